"""Context parallelism on 8 CPU devices: ``fnattn.context.attention`` against
``fnattn.attention`` on the whole sequence.

Each case runs ring or all-gather with one layout and a different set of
features, so that together they cover every mask kind and composition, sinks,
soft-cap, a bias with its gradient, position terms (ALiBi, a from_fn), dropout
(bit for bit the unsharded mask), GQA and MQA, both tensor layouts, the batch
sharded on a second axis, and the Pallas kernels (interpreted) as the per-step
computation. out, lse and every gradient must equal the single-device result.
Then: the collectives the ring issues (N-1 K/V transfers per pass), the work
balance of the layouts, the Triton and Mosaic per-step kernels lowering inside
the ring for GPU and TPU, and an export for cpu, cuda and tpu run on the CPUs.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fnattn
from fnattn import AttentionSpec, masks, position_bias
from lowering import abstract_mesh, cheap_compiles, target

F32 = jnp.float32


@dataclasses.dataclass
class Case:
    strategy: str
    layout: str
    mask: Callable  # (arrays) -> mask, arrays in the layout's order
    seq: int = 8  # devices along the sequence (the rest split the batch)
    Hq: int = 4
    Hkv: int = 2
    tensor_layout: str = "bthd"
    sinks: bool = False
    softcap: Any = None
    bias: Any = None  # None, "full" (B, Hq, T, T) or "keys" (B, 1, 1, T)
    dropout: float = 0.0
    impl: str = "auto"
    T: int = 64
    alibi: bool = False  # a position term: ALiBi plus a from_fn of (q, k)


def _problem(c: Case, rs):
    B, D = 2, 8
    if c.tensor_layout == "bthd":
        shape = lambda H: (B, c.T, H, D)  # noqa: E731
    else:
        shape = lambda H: (B, H, c.T, D)  # noqa: E731
    arrays = dict(
        q=rs.standard_normal(shape(c.Hq)), k=rs.standard_normal(shape(c.Hkv)),
        v=rs.standard_normal(shape(c.Hkv)), w=rs.standard_normal(shape(c.Hq)),
        ids=np.sort(rs.integers(0, 3, (B, c.T)), axis=1).astype(np.int32),
        dense=rs.random((B, 1, c.T, c.T)) < 0.7,
        sinks=rs.standard_normal((c.Hq,)),
        qlen=np.array([c.T - 4, c.T // 2 + 3], np.int32),
        kvlen=np.array([c.T, c.T // 2 - 5], np.int32),
        prefix=np.array([5, c.T // 2 + 7], np.int32),
        slopes=2 * position_bias.alibi_slopes(c.Hq).astype(np.float64),
    )
    if c.bias == "full":
        arrays["bias"] = rs.standard_normal((B, c.Hq, c.T, c.T))
    elif c.bias == "keys":
        arrays["bias"] = rs.standard_normal((B, 1, 1, c.T))
    return {n: jnp.asarray(a, F32) if a.dtype == np.float64 else jnp.asarray(a)
            for n, a in arrays.items()}


def _spec(c: Case, a):
    return AttentionSpec(
        mask=c.mask(a), sinks=a["sinks"] if c.sinks else None, softcap=c.softcap,
        bias=a.get("bias"), dropout_rate=c.dropout,
        dropout_key=jax.random.key(7) if c.dropout else None, layout=c.tensor_layout,
        impl=c.impl, block_sizes=(fnattn.XlaBlockSizes(8, 8),
                                  fnattn.TritonBlockSizes(16, 16, 16, 16)),
        position_bias=_term(a["slopes"]) if c.alibi else None)


def _term(slopes):
    return position_bias.alibi(slopes) + position_bias.from_fn(
        lambda b, h, q, k: jnp.where((q + 2 * k) % 7 == 0, 0.5, 0.0))


def _loss_and_grads(attend, spec, q, k, v, w, slopes=None):
    """(out, lse, grads of q, k, v, bias, sinks and, if given, ALiBi's slopes)."""
    def loss(q, k, v, bias, sinks, slopes):
        s = spec.replace(bias=bias, sinks=sinks)
        if slopes is not None:
            s = s.replace(position_bias=_term(slopes))
        res = attend(s, q, k, v)
        return jnp.sum(res.out * w) + jnp.sum(jnp.where(jnp.isfinite(res.lse), res.lse, 0)), res
    (_, res), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)(
        q, k, v, spec.bias, spec.sinks, slopes)
    return res.out, res.lse, g


def run_case(c: Case):
    rs = np.random.default_rng(hash((c.strategy, c.layout, c.seq)) % 2**32)
    a = _problem(c, rs)
    N = c.seq
    data = min(2, 8 // N)  # the batch (2) is split too where devices allow
    devices = np.array(jax.devices()[:data * N]).reshape(data, N)
    mesh = Mesh(devices, ("data", "seq"))
    t_axis = 1 if c.tensor_layout == "bthd" else 2
    spec = _spec(c, a)
    slopes = a["slopes"] if c.alibi else None
    whole = jax.jit(lambda q, k, v, w, s: _loss_and_grads(fnattn.attention, spec, q, k, v, w, s))
    out_w, lse_w, g_w = whole(a["q"], a["k"], a["v"], a["w"], slopes)

    # Reorder every sequence axis into the layout's order.
    re = lambda x, axis: fnattn.context.reorder(x, N, c.layout, axis=axis)  # noqa: E731
    r = dict(a)
    for n in "qkvw":
        r[n] = re(a[n], t_axis)
    r["ids"] = re(a["ids"], 1)
    r["dense"] = re(re(a["dense"], 2), 3)
    if "bias" in a:
        r["bias"] = re(re(a["bias"], 2), 3) if c.bias == "full" else re(a["bias"], 3)

    seq = P("data", None, "seq") if c.tensor_layout == "bhtd" else P("data", "seq")
    specs = dict(q=seq, k=seq, v=seq, w=seq, ids=P("data", "seq"),
                 dense=P("data", None, "seq", None), sinks=P(), qlen=P("data"),
                 kvlen=P("data"), prefix=P("data"), slopes=P(),
                 bias=P("data", None, "seq", None) if c.bias == "full" else P("data"))
    names = [n for n in ("q", "k", "v", "w", "ids", "dense", "sinks", "qlen", "kvlen", "prefix",
                         "slopes", "bias") if n in r]

    def local(*xs):
        x = dict(zip(names, xs))
        s = _spec(c, x)
        if c.dropout:  # the batch rows of this device
            s = s.replace(dropout_offsets=fnattn.dropout.shard_offsets(
                x["q"], layout=c.tensor_layout, batch_axis="data"))
        attend = lambda sp, q, k, v: fnattn.context.attention(  # noqa: E731
            sp, q, k, v, axis_name="seq", strategy=c.strategy, layout=c.layout)
        out, lse, g = _loss_and_grads(attend, s, x["q"], x["k"], x["v"], x["w"],
                                      x["slopes"] if c.alibi else None)
        if c.impl == "pallas":
            # Without the varying-axes check (the Pallas interpreter cannot run
            # under it) JAX leaves each device its share of a replicated input's
            # gradient, as for any shard_map.
            g = (*g[:4], *(None if x is None else jax.lax.psum(x, ("data", "seq"))
                           for x in g[4:]))
        return out, lse, g

    bias_spec = specs["bias"] if "bias" in r else None
    sink_spec = P() if c.sinks else None
    slope_spec = P() if c.alibi else None
    out_specs = (seq, P("data", None, "seq"),
                 (seq, seq, seq, bias_spec, sink_spec, slope_spec))
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[n] for n in names),
                              out_specs=out_specs, check_vma=c.impl != "pallas"))
    out, lse, g = f(*(r[n] for n in names))

    back = lambda x, axis: fnattn.context.restore(x, N, c.layout, axis=axis)  # noqa: E731
    name = f"{c.strategy}/{c.layout}/{c.impl}"
    tol = dict(atol=3e-5, rtol=3e-5)
    np.testing.assert_allclose(back(out, t_axis), out_w, err_msg=f"{name} out", **tol)
    np.testing.assert_allclose(back(lse, 2), lse_w, err_msg=f"{name} lse", **tol)
    gtol = dict(atol=2e-4, rtol=2e-4)
    for n, x, y in zip("qkv", g[:3], g_w[:3]):
        np.testing.assert_allclose(back(x, t_axis), y, err_msg=f"{name} d{n}", **gtol)
    if c.bias == "full":
        np.testing.assert_allclose(back(back(g[3], 2), 3), g_w[3], err_msg=f"{name} dbias",
                                   **gtol)
    elif c.bias == "keys":
        np.testing.assert_allclose(back(g[3], 3), g_w[3], err_msg=f"{name} dbias", **gtol)
    if c.sinks:
        np.testing.assert_allclose(g[4], g_w[4], err_msg=f"{name} dsinks", **gtol)
    if c.alibi:  # learnable slopes: summed over the sequence and batch splits
        assert float(jnp.abs(g_w[5]).min()) > 1e-3
        np.testing.assert_allclose(g[5], g_w[5], err_msg=f"{name} dslopes", **gtol)


CAUSAL_DOCS = lambda a: masks.causal() & masks.segments(a["ids"])  # noqa: E731

CASES = [
    Case("ring", "contiguous", CAUSAL_DOCS, sinks=True, softcap=20.0, impl="xla", alibi=True),
    Case("ring", "zigzag", lambda a: masks.sliding_window(20) | masks.prefix_lm(
        a["prefix"]), Hkv=1, tensor_layout="bhtd", bias="full"),
    Case("ring", "striped", lambda a: masks.chunked(16) & masks.causal() & masks.lengths(
        q_lengths=a["qlen"], kv_lengths=a["kvlen"]), dropout=0.3,
        sinks=True, seq=4),
    # (the array holds every key column, the segment ids this device's tokens)
    Case("ring", "zigzag", lambda a: masks.from_array(a["dense"]) & (
        masks.causal() | masks.segments(a["ids"])), dropout=0.25, bias="keys", seq=4),
    Case("all_gather", "contiguous", lambda a: masks.causal() & masks.from_array(a["dense"]),
         dropout=0.3, Hkv=1),
    Case("all_gather", "zigzag", lambda a: masks.causal() & masks.from_fn(
        lambda b, h, q, k: (q - k) % 5 != 1), sinks=True, bias="full", seq=4),
    Case("all_gather", "striped", lambda a: masks.segments(a["ids"]) & masks.sliding_window(
        24, 4), softcap=10.0, tensor_layout="bhtd", alibi=True),
    Case("ring", "striped", lambda a: ~masks.causal() | masks.sliding_window(0),
         sinks=True, bias="keys", seq=2),
]


def check_strategies_layouts_and_masks():
    for c in CASES:
        run_case(c)
    print(f"context: {len(CASES)} ring/all-gather cases equal one device (out, lse, grads)")


def check_pallas_per_step_kernels():
    """The Pallas kernels (interpreted on a CPU) as the per-step computation."""
    with cheap_compiles():
        run_case(Case("ring", "zigzag", CAUSAL_DOCS, seq=2, T=32, sinks=True, impl="pallas",
                      dropout=0.2))
        run_case(Case("all_gather", "striped", CAUSAL_DOCS, seq=2, T=32, impl="pallas"))
    print("context: Pallas per-step kernels (interpreted) equal one device")


def _count(jaxpr, prim):
    """How many arrays ``prim`` moves when a jaxpr runs: a scan's body counts
    its length times, a cond its largest branch."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == prim:
            n += len(eqn.invars)
        if eqn.primitive.name == "cond":
            n += max(_count(b.jaxpr, prim) for b in eqn.params["branches"])
            continue
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for sub in _subjaxprs(eqn.params):
            n += times * _count(sub, prim)
    return n


def _subjaxprs(params):
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def check_ring_transfers():
    """N-1 K/V transfers in the forward, N-1 K/V and N dK/dV in the backward;
    a document mask's key segment ids travel with K/V."""
    N = 8
    mesh = Mesh(np.array(jax.devices()[:N]), ("seq",))
    B, T, H, D = 1, 64, 2, 8
    q = k = v = jnp.ones((B, T, H, D), F32)
    ids = jnp.zeros((B, T), jnp.int32)

    def fwd(q, k, v, ids):
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids))
        return fnattn.context.attention(spec, q, k, v, axis_name="seq").out

    def grad(q, k, v, ids):
        return jax.grad(lambda q, k, v: fwd(q, k, v, ids).sum(), argnums=(0, 1, 2))(q, k, v)

    sm = lambda f, out: jax.shard_map(f, mesh=mesh, in_specs=(  # noqa: E731
        P(None, "seq"),) * 4, out_specs=out)
    jf = jax.make_jaxpr(sm(fwd, P(None, "seq")))(q, k, v, ids).jaxpr
    jg = jax.make_jaxpr(sm(grad, (P(None, "seq"),) * 3))(q, k, v, ids).jaxpr
    # operands sent per pass: k, v, kv segment ids
    fwd_sent = _count(jf, "ppermute")
    assert fwd_sent == 3 * (N - 1), fwd_sent
    # gradient: the forward again, then k, v, ids (N-1 times) and dk, dv (N times)
    grad_sent = _count(jg, "ppermute")
    assert grad_sent == 3 * (N - 1) + 3 * (N - 1) + 2 * N, grad_sent
    hlo = jax.jit(sm(fwd, P(None, "seq"))).lower(q, k, v, ids).compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" not in hlo
    print(f"context: ring on {N} devices sends {fwd_sent} arrays forward "
          f"(k, v, key segment ids x {N - 1} steps) and {grad_sent} in forward+backward; "
          "no all-gather or all-reduce")


def check_work_balance():
    N, T = 8, 8192
    rows = {}
    for layout in fnattn.context.LAYOUTS:
        w = fnattn.context.work(masks.causal(), T, N, layout, block=128)
        rows[layout] = w.max() / w.min()
    assert rows["zigzag"] <= 1.1 and rows["striped"] <= 1.1, rows
    assert rows["contiguous"] >= 1.5 * N, rows  # about 2N - 1
    print("context: causal work max/min over 8 devices at T=8192, 128x128 tiles: "
          + ", ".join(f"{k} {v:.2f}" for k, v in rows.items()))


def check_kernels_lower_in_ring():
    """The Triton and Mosaic per-step kernels lower inside the ring (forward and
    backward) for GPU and TPU."""
    bf16 = jnp.bfloat16
    N, B, T, Hq, Hkv, D = 2, 1, 512, 4, 2, 128

    def grads(q, k, v, ids, sinks):
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), sinks=sinks)

        def loss(q, k, v, sinks):
            return fnattn.context.attention(spec.replace(sinks=sinks), q, k, v,
                                            axis_name="seq", layout="zigzag").out.astype(
                                                F32).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

    seq = P(None, "seq")
    inputs = [((B, T, Hq, D), bf16, seq), ((B, T, Hkv, D), bf16, seq),
              ((B, T, Hkv, D), bf16, seq), ((B, T), jnp.int32, seq), ((Hq,), F32, P())]
    for platform in ("cuda", "tpu"):
        amesh = abstract_mesh(platform, (N,), ("seq",))
        mesh = amesh or Mesh(np.array(jax.devices()[:N]), ("seq",))
        args = [jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, sp))
                for s, dt, sp in inputs]
        f = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=tuple(sp for *_, sp in inputs),
                                  out_specs=(seq, seq, seq, P())))
        with target(platform, amesh):
            text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        kernel = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
        assert text.count(kernel) >= 3, (platform, text.count(kernel))
        assert "collective_permute" in text, platform
    print("context: the ring's Triton and Mosaic kernels lower for GPU and TPU")




def check_ring_forward_mode_and_second_order():
    """jvp and grad of grad of ring attention (zigzag, causal, sinks) on 8 devices
    equal those of fnattn.attention on the whole sequence."""
    B, T, H, D, N = 1, 32, 2, 8, 8
    rs = np.random.default_rng(3)
    q, k, v, tq, tk, tv = (jnp.asarray(rs.standard_normal((B, T, H, D)), F32) for _ in range(6))
    sinks = jnp.asarray(rs.standard_normal((H,)), F32)
    spec = AttentionSpec(mask=masks.causal(), sinks=sinks,
                         block_sizes=fnattn.XlaBlockSizes(8, 8))
    mesh = Mesh(np.array(jax.devices()[:N]), ("seq",))
    re = lambda x: fnattn.context.reorder(x, N, "zigzag")  # noqa: E731
    back = lambda x: fnattn.context.restore(x, N, "zigzag")  # noqa: E731

    def derivatives(f):
        t = jax.jvp(f, (q, k, v), (tq, tk, tv))[1]
        gg = jax.grad(lambda q: jnp.sum(jax.grad(lambda q: jnp.sum(jnp.sin(f(q, k, v))))(q)
                                        ** 2))(q)
        return t, gg

    def ring(q, k, v):
        body = lambda q, k, v: fnattn.context.attention(  # noqa: E731
            spec, q, k, v, axis_name="seq", strategy="ring", layout="zigzag").out
        return back(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                                  out_specs=P(None, "seq"))(re(q), re(k), re(v)))

    got = jax.jit(lambda: derivatives(ring))()
    want = jax.jit(lambda: derivatives(lambda q, k, v: fnattn.attention(spec, q, k, v).out))()
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-4, rtol=2e-4)
    print("ring jvp and grad of grad on 8 devices: max |diff| "
          f"{max(float(jnp.abs(g - w).max()) for g, w in zip(got, want)):.1e}")


def check_ring_exports_for_several_platforms():
    """Ring and all-gather attention inside shard_map on 2 devices, forward and
    gradient, exported for cpu, cuda and tpu in one artifact (serialized and
    read back), run on the CPU devices: the results of the program not
    exported. (Each pair's skip condition sits inside the platform choice: with
    the choice inside a lax.cond, XLA kept the Triton and Mosaic kernels in the
    CPU program, which refused them: "No FFI handler registered".) Exported
    over a mesh of abstract H100s where JAX has them (the Triton lowering asks
    for the GPU since JAX 0.11), called on the CPUs. (Two devices: the export
    lowers every ring step's kernels for three platforms, and the ring of the
    other checks runs on 8; with 4 this check alone took 230 s of a loaded
    2-core machine.)"""
    from jax import export
    N = 2
    mesh = Mesh(np.array(jax.devices()[:N]), ("seq",))
    amesh = abstract_mesh("cuda", (N,), ("seq",))
    seq = P(None, "seq")
    rs = np.random.default_rng(4)
    q, k, v = (jax.device_put(jnp.asarray(rs.standard_normal((1, 32, 2, 8)), F32),
                              NamedSharding(mesh, seq)) for _ in range(3))
    shape = jax.ShapeDtypeStruct(q.shape, F32, sharding=NamedSharding(amesh or mesh, seq))
    spec = AttentionSpec(mask=masks.causal() | masks.sliding_window(2, 2),
                         block_sizes=fnattn.XlaBlockSizes(8, 8))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for strategy in ("ring", "all_gather"):
        body = lambda q, k, v: fnattn.context.attention(  # noqa: E731
            spec, q, k, v, axis_name="seq", strategy=strategy, layout="zigzag").out

        def programs(m):
            fwd = jax.jit(jax.shard_map(body, mesh=m, in_specs=(seq,) * 3, out_specs=seq))
            grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fwd(q, k, v))), (0, 1, 2)))
            return {"forward": fwd, "gradient": grad}

        here = programs(mesh)
        for name, f in programs(amesh or mesh).items():
            with target("cuda", amesh):
                exp = export.export(f, platforms=("cpu", "cuda", "tpu"),
                                    disabled_checks=[triton])(shape, shape, shape)
            exp = export.deserialize(exp.serialize())
            got, want = jax.jit(exp.call)(q, k, v), here[name](q, k, v)
            for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=1e-6,
                                           err_msg=f"{strategy} {name}")
    print("context: ring and all-gather, forward and gradient, exported for cpu, cuda and "
          "tpu, run on 2 CPU devices")


CHECKS = [check_ring_forward_mode_and_second_order, check_work_balance, check_ring_transfers,
          check_strategies_layouts_and_masks, check_pallas_per_step_kernels,
          check_kernels_lower_in_ring, check_ring_exports_for_several_platforms]
