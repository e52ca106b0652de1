"""Plain ``jax.jit`` with batch- and head-sharded inputs keeps the sharding
(``fnattn._partition``): no collective in the compiled forward or gradient, the
output sharded like the input, values equal to the unsharded call.

Each check jits a function of sharded arrays on a 2x2 ("data", "model") mesh,
counts the collectives in the compiled HLO and prints them, and compares the
results with the same function on unsharded arrays (one device). Where an
axis cannot be split (the sequence, one kv head, a predicate that reads the
head index) the check asks only for the right answer; where a gradient is a
sum over a split axis (sinks or a bias broadcast along the batch) it asks for
that all-reduce and nothing else.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fnattn
from fnattn import AttentionSpec, masks, position_bias

F32 = jnp.float32
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
               "reduce-scatter")
HEADS = ("data", None, "model")      # (B, T, H, D) split on batch and heads
ROWS = ("data", "model", None)       # lse (B, Hq, Tq)


def _mesh(explicit=False):
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    if explicit:
        return Mesh(devices, ("data", "model"),
                    axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    return Mesh(devices, ("data", "model"))


def collectives(compiled) -> dict:
    """The collective ops in the HLO of a compiled function, by kind."""
    text = compiled.as_text()
    found = {c: len(re.findall(rf"\s{c}(-start)?\(", text)) for c in COLLECTIVES}
    return {c: n for c, n in found.items() if n}


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _close(name, x, y, tol=2e-5):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol, err_msg=name)


def _check(name, f, args, *, out_specs=None, allowed=(), tol=1e-4):
    """Compiles ``jax.jit(f)`` on the sharded ``args`` and prints its collectives;
    asserts that only kinds in ``allowed`` occur (None: any), that the outputs
    have ``out_specs`` and the values of ``f`` on one device."""
    compiled = jax.jit(f).lower(*args).compile()
    found = collectives(compiled)
    print(f"{name}: collectives {found or 0}", flush=True)
    if allowed is not None:
        assert set(found) <= set(allowed), (name, found)
    got = compiled(*args)
    one = jax.device_put([np.asarray(a) for a in args], jax.devices()[0])
    want = jax.jit(f)(*one)
    for i, (x, y) in enumerate(zip(jax.tree_util.tree_leaves(got),
                                   jax.tree_util.tree_leaves(want))):
        _close(f"{name} output {i}", x, y, tol)
    if out_specs is not None:
        for i, (x, spec) in enumerate(zip(jax.tree_util.tree_leaves(got), out_specs)):
            assert x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, P(*spec)),
                                               x.ndim), (name, i, x.sharding, spec)
    return found


def _qkv(mesh, B=4, T=32, Hq=4, Hkv=2, D=8, spec=HEADS, kv_spec=None, seed=0):
    rs = np.random.default_rng(seed)
    q = rs.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rs.standard_normal((B, T, Hkv, D)).astype(np.float32)
    v = rs.standard_normal((B, T, Hkv, D)).astype(np.float32)
    kv_spec = spec if kv_spec is None else kv_spec
    return _put(mesh, q, *spec), _put(mesh, k, *kv_spec), _put(mesh, v, *kv_spec)


def _out_and_grads(attend, argnums=(0, 1, 2)):
    """``f(*args) -> (out, lse, grads)`` of the loss ``sum(out ** 2)``."""
    def f(*args):
        def loss(*diff):
            full = list(args)
            for i, x in zip(argnums, diff):
                full[i] = x
            res = attend(*full)
            return jnp.sum(res.out.astype(F32) ** 2), res
        (_, res), g = jax.value_and_grad(loss, argnums=tuple(range(len(argnums))),
                                         has_aux=True)(*(args[i] for i in argnums))
        return res.out, jnp.where(jnp.isfinite(res.lse), res.lse, 0), g
    return f


def check_flash_gqa_segments_sinks():
    """GQA (4 query heads on 2 kv heads), causal & document mask with segment ids
    sharded with the batch, sinks with the heads, soft-cap: forward and the
    gradients of q, k and v compile with no collective. The gradient of the
    sinks, replicated along "data", is summed over it: all-reduce only."""
    mesh = _mesh()
    q, k, v = _qkv(mesh)
    B, T, Hq, _ = q.shape
    rs = np.random.default_rng(1)
    ids = _put(mesh, np.sort(rs.integers(0, 3, (B, T)), axis=1).astype(np.int32), "data")
    sinks = _put(mesh, rs.standard_normal((Hq,)).astype(np.float32), "model")

    def attend(q, k, v, ids, sinks):
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), sinks=sinks,
                             softcap=20.0)
        return fnattn.attention(spec, q, k, v)

    args = (q, k, v, ids, sinks)
    _check("flash gqa+segments+sinks fwd+grad(q, k, v)", _out_and_grads(attend), args,
           out_specs=[HEADS, ROWS] + [HEADS] * 3)
    _check("flash gqa+segments+sinks grad(sinks)", _out_and_grads(attend, (0, 4)), args,
           out_specs=[HEADS, ROWS, HEADS, ("model",)], allowed=("all-reduce",))


def check_flash_bias_dropout_layouts():
    """A full (B, Hq, Tq, Tk) bias sharded on batch and heads (forward and its
    gradient) with dropout (equal to one device: each shard folds its first batch
    row and head into the seed), with the XLA flash lowering and with
    impl="pallas" (the Triton kernels, interpreted) in layout "bhtd": no
    collective. A bias broadcast along the batch: its gradient is all-reduced."""
    mesh = _mesh()
    q, k, v = _qkv(mesh, T=16)
    B, T, Hq, _ = q.shape
    rs = np.random.default_rng(2)
    bias = rs.standard_normal((B, Hq, T, T)).astype(np.float32)
    key = jax.random.key(3)

    def attend(impl, layout, rate=0.3):
        def f(q, k, v, bias):
            if layout == "bhtd":
                q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
            spec = AttentionSpec(mask=masks.causal(), bias=bias, dropout_rate=rate,
                                 dropout_key=key, impl=impl, layout=layout)
            res = fnattn.flash(spec, q, k, v)
            out = res.out if layout == "bthd" else jnp.swapaxes(res.out, 1, 2)
            return fnattn.AttentionOutput(out, res.lse)
        return f

    full = _put(mesh, bias, "data", "model")
    for impl, layout in (("auto", "bthd"), ("pallas", "bhtd")):
        _check(f"flash[{impl}, {layout}] bias+dropout fwd+grad", _out_and_grads(
            attend(impl, layout), (0, 1, 2, 3)), (q, k, v, full),
            out_specs=[HEADS, ROWS] + [HEADS] * 3 + [("data", "model")])
    shared = _put(mesh, bias[:1], None, "model")
    _check("flash bias broadcast on batch, grad(bias)", _out_and_grads(
        attend("auto", "bthd", 0.0), (0, 3)), (q, k, v, shared),
        out_specs=[HEADS, ROWS, HEADS, (None, "model")], allowed=("all-reduce",))


def check_flash_fallbacks():
    """Axes that cannot be split are gathered, never answered wrong: one kv head
    (MQA) with the query heads sharded, the sequence sharded, a ``from_fn``
    predicate that reads the head index. A predicate of positions only splits."""
    mesh = _mesh()

    def attend(spec):
        return lambda q, k, v: fnattn.attention(spec, q, k, v).out

    causal = AttentionSpec(mask=masks.causal())
    _check("flash MQA, heads sharded", attend(causal), _qkv(mesh, Hkv=1, kv_spec=("data",)),
           allowed=None)
    _check("flash sequence sharded", attend(causal), _qkv(mesh, spec=("data", "model")),
           allowed=None)
    qkv = _qkv(mesh)
    reads_h = AttentionSpec(mask=masks.from_fn(lambda b, h, q, k: (k <= q) | (h == 1)))
    _check("flash from_fn reading the head", attend(reads_h), qkv, allowed=None)
    positions = AttentionSpec(mask=masks.from_fn(lambda b, h, q, k: k <= q + 2))
    _check("flash from_fn of positions", attend(positions), qkv, out_specs=[HEADS])


def check_flash_position_bias():
    """ALiBi with its slopes sharded like the heads: the heads split, forward and
    the gradients of q, k and v with no collective. A position term that reads
    the head index (a ``from_fn``) is gathered, and right."""
    mesh = _mesh()
    q, k, v = _qkv(mesh)
    Hq = q.shape[2]
    slopes = _put(mesh, position_bias.alibi_slopes(Hq) * 4, "model")

    def attend(q, k, v, slopes):
        spec = AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(slopes))
        return fnattn.attention(spec, q, k, v)

    _check("flash alibi fwd+grad(q, k, v)", _out_and_grads(attend), (q, k, v, slopes),
           out_specs=[HEADS, ROWS] + [HEADS] * 3)
    # learnable slopes: their gradient is split with the heads and summed over
    # the batch's split (the one collective)
    _check("flash alibi grad(q, k, v, slopes)", _out_and_grads(attend, (0, 1, 2, 3)),
           (q, k, v, slopes), out_specs=[HEADS, ROWS] + [HEADS] * 3 + [("model",)],
           allowed=("all-reduce",))
    # a from_fn term with learnable per-head arrays (KERPLE), split alike
    r1 = _put(mesh, np.linspace(0.5, 2.0, Hq).astype(np.float32), "model")
    r2 = _put(mesh, np.linspace(0.1, 1.0, Hq).astype(np.float32), "model")

    def kerple(q, k, v, r1, r2):
        term = position_bias.from_fn(
            lambda b, h, q, k, r1, r2: -r1 * jnp.log1p(r2 * jnp.abs(q - k)), r1, r2)
        return fnattn.attention(AttentionSpec(mask=masks.causal(), position_bias=term), q, k, v)

    _check("flash from_fn arrays grad(q, k, v, r1, r2)", _out_and_grads(kerple, (0, 1, 2, 3, 4)),
           (q, k, v, r1, r2), out_specs=[HEADS, ROWS] + [HEADS] * 3 + [("model",)] * 2,
           allowed=("all-reduce",))
    reads_h = AttentionSpec(position_bias=position_bias.from_fn(
        lambda b, h, q, k: jnp.where(h == 1, -0.5, 0.0) * jnp.abs(q - k)))
    _check("flash position term reading the head",
           lambda q, k, v: fnattn.attention(reads_h, q, k, v).out, (q, k, v), allowed=None)


def check_flash_transforms():
    """checkpoint, scan and forward mode compose with the split call; vmap runs
    unsplit (gathered)."""
    mesh = _mesh()
    q, k, v = _qkv(mesh)
    spec = AttentionSpec(mask=masks.causal())

    def ckpt(q, k, v):
        def loss(q, k, v):
            return jnp.sum(fnattn.attention(spec, q, k, v).out ** 2)
        return jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(q, k, v)

    _check("flash checkpoint grad", ckpt, (q, k, v), out_specs=[HEADS] * 3)

    def scanned(q, k, v):
        def step(c, _):
            return c + fnattn.attention(spec, q + c, k, v).out, None
        return jax.lax.scan(step, jnp.zeros_like(q), None, length=2)[0]

    _check("flash scan", scanned, (q, k, v), out_specs=[HEADS])
    stacked = tuple(_put(mesh, np.stack([np.asarray(x)] * 2), None, *HEADS) for x in (q, k, v))
    _check("flash vmap", jax.vmap(lambda q, k, v: fnattn.attention(spec, q, k, v).out),
           stacked, allowed=None)

    def forward_mode(q, k, v):  # the tangent pass is split like the forward
        f = lambda q, k, v: fnattn.attention(spec, q, k, v).out  # noqa: E731
        return jax.jvp(f, (q, k, v), (jnp.cos(q), jnp.sin(k), v))

    _check("flash jvp", forward_mode, (q, k, v), out_specs=[HEADS] * 2)


def check_decode():
    """decode on a cache sharded on batch and kv heads, lengths with the batch,
    sinks with the heads, ALiBi's slopes (a constant) cut with the batch and the
    heads: forward and gradients of q and the caches, no collective; the gradient
    of the sinks is summed over the batch split (all-reduce)."""
    mesh = _mesh()
    rs = np.random.default_rng(4)
    B, S, Hq, Hkv, D = 4, 40, 4, 2, 8
    q = _put(mesh, rs.standard_normal((B, 1, Hq, D)).astype(np.float32), *HEADS)
    kc = _put(mesh, rs.standard_normal((B, S, Hkv, D)).astype(np.float32), *HEADS)
    vc = _put(mesh, rs.standard_normal((B, S, Hkv, D)).astype(np.float32), *HEADS)
    lengths = _put(mesh, np.array([40, 7, 0, 23], np.int32), "data")
    sinks = _put(mesh, rs.standard_normal((Hq,)).astype(np.float32), "model")

    def attend(q, kc, vc, lengths, sinks):
        alibi = position_bias.alibi(jnp.asarray(position_bias.alibi_slopes(Hq)))
        return fnattn.decode(AttentionSpec(mask=masks.causal(), sinks=sinks,
                                           position_bias=alibi), q, kc, vc, kv_lengths=lengths)

    args = (q, kc, vc, lengths, sinks)
    _check("decode fwd+grad(q, k_cache, v_cache)", _out_and_grads(attend), args,
           out_specs=[HEADS, ROWS] + [HEADS] * 3)
    _check("decode grad(sinks)", _out_and_grads(attend, (0, 4)), args,
           out_specs=[HEADS, ROWS, HEADS, ("model",)], allowed=("all-reduce",))


def check_paged():
    """ragged paged attention (forward and gradients of q and the pools, and the
    form that writes the cache) and paged_attention, with heads-major pools
    sharded on the kv heads: no collective; the pools come back sharded as they
    went in. (The pools are shared by all sequences: tokens are not split.) With
    ALiBi, whose slopes are cut with the heads."""
    from paged import problems  # tests/ is on sys.path
    mesh = _mesh()
    p = problems.make([(9, 9), (13, 1), (6, 2)], Hq=4, Hkv=2, page_size=4, pad_tokens=3)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.5, -1.0, 0.0, 2.0], F32),
                         position_bias=position_bias.alibi(jnp.array([0.5, 0.25, 0.1, 0.05])))
    heads, pool = (None, "model", None), ("model", None, None, None)
    q = _put(mesh, p.q, *heads)
    kp, vp = (_put(mesh, x, *pool) for x in (p.k_pages, p.v_pages))
    sinks = _put(mesh, spec.sinks, "model")
    meta = (p.page_table, p.context_lengths, p.query_start_loc, p.num_seqs)

    def ragged(q, kp, vp, sinks, table, ctx, qsl, n):
        return fnattn.ragged_paged_attention(spec.replace(sinks=sinks), q, kp, vp,
                                             page_table=table, context_lengths=ctx,
                                             query_start_loc=qsl, num_seqs=n)

    _check("ragged paged fwd+grad(q, k_pages, v_pages, sinks)",
           _out_and_grads(ragged, (0, 1, 2, 3)), (q, kp, vp, sinks, *meta),
           out_specs=[heads, ("model", None), heads, pool, pool, ("model",)])

    def update(q, knew, vnew, kp, vp, sinks, table, ctx, qsl, n):
        res, kp, vp = fnattn.ragged_paged_attention_with_update(
            spec.replace(sinks=sinks), q, knew, vnew, kp, vp, page_table=table,
            context_lengths=ctx, query_start_loc=qsl, num_seqs=n)
        return res.out, kp, vp

    knew, vnew = (_put(mesh, x, *heads) for x in (p.k_new, p.v_new))
    kold, vold = (_put(mesh, x, *pool) for x in (p.k_old, p.v_old))
    _check("ragged paged with update", update, (q, knew, vnew, kold, vold, sinks, *meta),
           out_specs=[heads, pool, pool])

    def decode(q, kp, vp, sinks, table, lengths):
        return fnattn.paged_attention(spec.replace(sinks=sinks), q, kp, vp, page_table=table,
                                      kv_lengths=lengths).out

    cache_q = _put(mesh, np.asarray(p.q)[:3, None], None, None, "model")
    _check("paged_attention forward", decode,
           (cache_q, kp, vp, sinks, p.page_table[:3], jnp.array([9, 13, 6], jnp.int32)),
           out_specs=[(None, None, "model")])


def check_explicit_mesh():
    """Arrays whose types carry the sharding (explicit mesh axes): split by
    ``shard_map`` at trace time, with the same result and no collective."""
    mesh = _mesh(explicit=True)
    q, k, v = _qkv(mesh)
    spec = AttentionSpec(mask=masks.causal())
    _check("flash fwd+grad, explicit mesh axes", _out_and_grads(
        lambda q, k, v: fnattn.attention(spec, q, k, v)), (q, k, v),
        out_specs=[HEADS, ROWS] + [HEADS] * 3)


def check_explicit_context_mesh():
    """Under ``jax.set_mesh`` of a mesh with Explicit axes (``jax.make_mesh``'s
    default), arrays that no mesh axis splits (q, k, v made without a sharding):
    each device computes the whole call, as without the mesh, with no
    collective. (Under jax 0.11 the partitioner once failed here: "No registered
    implementation for untyped custom call to Sharding".)"""
    mesh = _mesh(explicit=True)
    rs = np.random.default_rng(5)
    q = jnp.asarray(rs.standard_normal((4, 32, 4, 8)), F32)
    k, v = (jnp.asarray(rs.standard_normal((4, 32, 2, 8)), F32) for _ in range(2))
    lengths = jnp.array([32, 7, 0, 23], jnp.int32)
    spec = AttentionSpec(mask=masks.causal())

    def f(q, k, v):
        dec = fnattn.decode(spec, q[:, :1], k, v, kv_lengths=lengths).out
        return dec, _out_and_grads(lambda q, k, v: fnattn.attention(spec, q, k, v))(q, k, v)

    want = jax.jit(f)(q, k, v)
    with jax.set_mesh(mesh):
        compiled = jax.jit(f).lower(q, k, v).compile()
        found = collectives(compiled)
        got = compiled(q, k, v)
    print(f"flash fwd+grad and decode, explicit context mesh, unsplit arrays: "
          f"collectives {found or 0}", flush=True)
    assert not found, found
    for i, (x, y) in enumerate(zip(jax.tree_util.tree_leaves(got),
                                   jax.tree_util.tree_leaves(want))):
        _close(f"explicit context mesh output {i}", x, y, 1e-4)


def check_gspmd_propagation():
    """The same split with the older GSPMD sharding propagation."""
    prev = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh = _mesh()
        spec = AttentionSpec(mask=masks.causal())
        _check("flash fwd+grad, GSPMD propagation", _out_and_grads(
            lambda q, k, v: fnattn.attention(spec, q, k, v)), _qkv(mesh),
            out_specs=[HEADS, ROWS] + [HEADS] * 3)
    finally:
        jax.config.update("jax_use_shardy_partitioner", prev)


CHECKS = [check_flash_gqa_segments_sinks, check_flash_bias_dropout_layouts,
          check_flash_fallbacks, check_flash_position_bias, check_flash_transforms,
          check_decode, check_paged,
          check_explicit_mesh, check_explicit_context_mesh, check_gspmd_propagation]
