"""Distributed decode on 8 CPU devices: ``fnattn.context.decode`` with the KV
cache's slots split along a mesh axis, and ``fnattn.merging.merge_across``.

Every result (out, lse, and the gradients with respect to q, both caches and
the sinks) must equal single-device :func:`fnattn.decode` on the whole cache.
Lengths end on a device boundary, at 0 and at the full cache; the Tq new tokens
straddle a boundary; cache slots outside the sequences hold NaN.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import fnattn
from fnattn import AttentionSpec, masks, position_bias
from fnattn.context.decode import decode as context_decode
from fnattn.merging import merge_across

F32 = jnp.float32


def _close(name, x, y, tol):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    np.testing.assert_array_equal(np.isneginf(x), np.isneginf(y), err_msg=name)
    np.testing.assert_allclose(np.where(np.isfinite(y), x, 0), np.where(np.isfinite(y), y, 0),
                               atol=tol, rtol=tol, err_msg=name)


def _problem(seed, B, Tq, S, Hq, Hkv, D, lengths, starts=None, dtype=F32):
    """q, caches (NaN outside every sequence's slots), sinks, lengths, starts, w."""
    rs = np.random.default_rng(seed)
    q = rs.standard_normal((B, Tq, Hq, D))
    k, v = rs.standard_normal((2, B, S, Hkv, D))
    lengths = np.asarray(lengths, np.int32)
    starts = np.zeros(B, np.int32) if starts is None else np.asarray(starts, np.int32)
    slot = np.arange(S)[None]
    outside = (slot < starts[:, None]) | (slot >= (starts + lengths)[:, None])
    k[outside], v[outside] = np.nan, np.nan
    sinks = rs.standard_normal(Hq)
    w = rs.standard_normal((B, Tq, Hq, D))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(sinks, F32), jnp.asarray(lengths), jnp.asarray(starts),
            jnp.asarray(w, F32))


def _compare(name, mesh, spec, args, *, batch_axis=None, tol=2e-5):
    """context.decode inside shard_map (slots along "seq") against fnattn.decode."""
    q, k, v, sinks, lengths, starts, w = args
    layout = spec.layout
    if layout == "bhtd":
        q, k, v, w = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, w))

    def run(decode, **kw):
        def f(q, k, v, sinks, lengths, starts, w):
            def loss(q, k, v, sinks):
                res = decode(spec.replace(sinks=sinks), q, k, v, kv_lengths=lengths,
                             kv_starts=starts, **kw)
                return jnp.sum(res.out.astype(F32) * w), res
            (_, res), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
                q, k, v, sinks)
            return res.out, res.lse, g
        return f

    rows = P(batch_axis)
    cache = P(batch_axis, "seq") if layout == "bthd" else P(batch_axis, None, "seq")
    sharded = jax.shard_map(run(context_decode, axis_name="seq"), mesh=mesh,
                            in_specs=(rows, cache, cache, P(), rows, rows, rows),
                            out_specs=(rows, rows, (rows, cache, cache, P())))
    got = jax.jit(sharded)(q, k, v, sinks, lengths, starts, w)
    want = jax.jit(run(fnattn.decode))(q, k, v, sinks, lengths, starts, w)
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    for what, x, y in zip(("out", "lse", "dq", "dk_cache", "dv_cache", "dsinks"), got, want):
        if what in ("dk_cache", "dv_cache"):   # NaN slots: no gradient, as in fnattn.decode
            assert np.isfinite(np.asarray(x, np.float32)).all(), (name, what)
        _close(f"{name} {what}", x, y, tol)


def check_decode_seq8():
    """A 1-D mesh of 8 along the cache slots (5 per device): causal with sinks,
    a sliding window with starts and a soft-cap; GQA; Tq = 3 new tokens."""
    t0 = time.perf_counter()
    mesh = Mesh(np.array(jax.devices()[:8]), ("seq",))
    # lengths: full (40), on a device boundary (15), empty (0), new tokens
    # straddling the boundary at 10 (11, 12), shorter than Tq (2).
    args = _problem(0, 6, 3, 40, 4, 2, 8, [40, 15, 0, 11, 12, 2])
    _compare("causal+sinks", mesh, AttentionSpec(mask=masks.causal()), args)
    # a window whose far edge and whose newest tokens cross device boundaries
    args = _problem(1, 6, 3, 40, 4, 2, 8, [33, 12, 0, 9, 20, 30], starts=[7, 3, 40, 1, 20, 0])
    spec = AttentionSpec(mask=masks.sliding_window(left=4) | masks.sliding_window(2, 1),
                         softcap=3.0)
    _compare("window+starts", mesh, spec, args)
    print(f"decode_seq8: 2 specs, forward+gradients equal fnattn.decode "
          f"({time.perf_counter() - t0:.1f}s)")


def _kerple(b, h, q, k, r1, r2):
    return -r1 * jnp.log1p(r2 * jnp.abs(q - k))


def check_decode_position_terms():
    """Position terms evaluated at their global positions on every device: ALiBi
    under causal with sinks, then a per-(row, head) KERPLE term plus ALiBi under
    a sliding window with starts (the far edge and the newest tokens on other
    devices), Tq = 3; forward and gradients (q, caches, sinks) equal
    fnattn.decode's on the whole cache, and differ from those without the term."""
    t0 = time.perf_counter()
    mesh = Mesh(np.array(jax.devices()[:8]), ("seq",))
    slopes = jnp.asarray(position_bias.alibi_slopes(4))
    args = _problem(4, 6, 3, 40, 4, 2, 8, [40, 15, 0, 11, 12, 2])
    _compare("alibi+causal+sinks", mesh, AttentionSpec(
        mask=masks.causal(), position_bias=position_bias.alibi(slopes * 4)), args)
    args = _problem(5, 6, 3, 40, 4, 2, 8, [33, 12, 0, 9, 20, 30], starts=[7, 3, 40, 1, 20, 0])
    r2 = jnp.asarray(np.random.default_rng(6).uniform(0.1, 2.0, (6, 4)), F32)
    term = position_bias.from_fn(_kerple, jnp.array([1.0, 2.0, 0.5, 3.0]), r2)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(4), softcap=3.0,
                         position_bias=term + position_bias.alibi(slopes))
    _compare("kerple+alibi+window+starts", mesh, spec, args)
    q, k, v, _, lengths, starts, _ = args
    with_term, without = (jax.jit(lambda s: fnattn.decode(s, q, k, v, kv_lengths=lengths,
                                                          kv_starts=starts).out)(s)
                          for s in (spec, spec.replace(position_bias=None)))
    assert float(jnp.nanmax(jnp.abs(with_term - without))) > 0.1
    print(f"decode_position_terms: 2 specs, forward+gradients equal fnattn.decode "
          f"({time.perf_counter() - t0:.1f}s)")


def check_decode_data2_seq4():
    """A 2x4 (data, seq) mesh, the batch split along "data": a bf16 cache with
    one new token (MQA), causal with sinks; then the "bhtd" layout with two new
    tokens and a causal sliding window."""
    t0 = time.perf_counter()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "seq"))
    args = _problem(2, 4, 1, 32, 4, 1, 16, [32, 8, 0, 19], dtype=jnp.bfloat16)
    _compare("bf16", mesh, AttentionSpec(mask=masks.causal()), args, batch_axis="data",
             tol=3e-2)
    args = _problem(3, 4, 2, 32, 4, 2, 8, [32, 8, 0, 9])
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(5), layout="bhtd")
    _compare("bhtd window", mesh, spec, args, batch_axis="data")
    print(f"decode_data2_seq4: forward+gradients equal fnattn.decode "
          f"({time.perf_counter() - t0:.1f}s)")


def check_band_masks():
    """Every kind of band mask (empty middle, one-sided, unbounded right, & and |)
    with random lengths and starts, 2 slots per device and Tq = 4 new tokens
    spread over up to 3 devices: forward equals fnattn.decode."""
    t0 = time.perf_counter()
    mesh = Mesh(np.array(jax.devices()[:8]), ("seq",))
    rs = np.random.default_rng(5)
    B, Tq, S, H, D = 8, 4, 16, 2, 4
    q = jnp.asarray(rs.standard_normal((B, Tq, 2 * H, D)), F32)
    k, v = jnp.asarray(rs.standard_normal((2, B, S, H, D)), F32)
    starts = jnp.asarray(rs.integers(0, S, B), jnp.int32)
    lengths = jnp.asarray(rs.integers(0, S + 1, B), jnp.int32)
    specs = [AttentionSpec(mask=m, softcap=2.0) for m in (
        None, masks.full(), masks.sliding_window(0), masks.sliding_window(1, 2),
        masks.sliding_window(None, 1), masks.sliding_window(2, None),
        masks.causal() & masks.sliding_window(6), masks.causal() | masks.sliding_window(1, 1))]

    def run(decode, **kw):
        def f(q, k, v, lengths, starts):
            return [decode(spec, q, k, v, kv_lengths=lengths, kv_starts=starts, **kw)
                    for spec in specs]
        return f

    cache = P(None, "seq")
    sharded = jax.shard_map(run(context_decode, axis_name="seq"), mesh=mesh,
                            in_specs=(P(), cache, cache, P(), P()), out_specs=P())
    got = jax.jit(sharded)(q, k, v, lengths, starts)
    want = jax.jit(run(fnattn.decode))(q, k, v, lengths, starts)
    for spec, x, y in zip(specs, got, want):
        _close(f"{spec.mask!r} out", x.out, y.out, 2e-5)
        _close(f"{spec.mask!r} lse", x.lse, y.lse, 2e-5)
    print(f"decode_band_masks: {len(specs)} masks equal fnattn.decode "
          f"({time.perf_counter() - t0:.1f}s)")


def check_merge_across():
    """merge_across over 8 devices (a tuple of axis names) equals merge of the 8
    parts, gradients included; devices whose part is empty (lse -inf, out NaN)
    contribute nothing. The compiled forward holds two all-reduces (max and sum) and no other
    collective."""
    t0 = time.perf_counter()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    rs = np.random.default_rng(4)
    n, B, T, H, Dv = 8, 2, 3, 4, 5
    outs = rs.standard_normal((n, B, T, H, Dv)).astype(np.float32)
    lses = rs.standard_normal((n, B, H, T)).astype(np.float32) * 3
    lses[2:5, :, 1] = -np.inf                 # head 1: only parts 0, 1, 5, 6, 7
    outs[2:5, :, :, 1] = np.nan
    lses[:, 1, :, 0] = -np.inf                # row (1, :, 0): no part
    outs[:, 1, 0] = np.nan
    sinks = jnp.asarray([0.5, -np.inf, 1.0, -2.0], F32)
    d_out = jnp.asarray(rs.standard_normal((B, T, H, Dv)), F32)
    d_lse = jnp.asarray(rs.standard_normal((B, H, T)), F32)
    outs, lses = jnp.asarray(outs), jnp.asarray(lses)

    def loss(res):
        lse = jnp.where(jnp.isfinite(res.lse), res.lse, 0)
        return jnp.sum(res.out * d_out) + jnp.sum(lse * d_lse)

    def across(outs, lses, sinks):
        return merge_across(outs[0], lses[0], ("a", "b"), sinks=sinks)

    parts = P(("a", "b"))
    sharded = jax.shard_map(across, mesh=mesh, in_specs=(parts, parts, P()), out_specs=P())
    hlo = jax.jit(sharded).lower(outs, lses, sinks).compile().as_text()
    counts = {c: hlo.count(f" {c}(") for c in ("all-reduce", "all-gather", "collective-permute",
                                               "all-to-all")}
    # one all-reduce (max) of the lse, one (sum) of the outputs and denominators
    assert counts == {"all-reduce": 2, "all-gather": 0, "collective-permute": 0,
                      "all-to-all": 0}, counts

    def whole(outs, lses, sinks):
        return fnattn.merge([(outs[i], lses[i]) for i in range(n)], sinks=sinks)

    for f, name in ((sharded, "across"), (whole, "merge")):
        res = jax.jit(f)(outs, lses, sinks)
        grads = jax.jit(jax.grad(lambda *a: loss(f(*a)), argnums=(0, 1, 2)))(outs, lses, sinks)
        if name == "across":
            got = (res, grads)
        else:
            want = (res, grads)
    (res, g), (ref, g_ref) = got, want
    _close("merge_across out", res.out, ref.out, 1e-6)
    _close("merge_across lse", res.lse, ref.lse, 1e-6)
    for what, x, y in zip(("d_outs", "d_lses", "d_sinks"), g, g_ref):
        assert np.isfinite(np.asarray(x)).all(), what
        _close(f"merge_across {what}", x, y, 1e-5)
    print(f"merge_across: 8 parts, collectives {counts}, forward+gradients equal merge "
          f"({time.perf_counter() - t0:.1f}s)")


def check_refused_masks():
    """Masks that are not one band per query are refused at trace time, naming
    the mask and the supported ones."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("seq",))
    q = jax.ShapeDtypeStruct((1, 2, 2, 8), F32)
    k = jax.ShapeDtypeStruct((1, 16, 2, 8), F32)
    n = jax.ShapeDtypeStruct((1,), jnp.int32)
    for mask, shown in ((masks.chunked(4) & masks.causal(), "chunked(4)"),
                        (masks.from_fn(lambda b, h, q, k: k <= q), "from_fn"),
                        (~masks.causal(), "~causal()")):
        spec = AttentionSpec(mask=mask)
        f = jax.shard_map(lambda q, k, v, n: context_decode(spec, q, k, v, kv_lengths=n,
                                                            axis_name="seq"),
                          mesh=mesh, in_specs=(P(), P(None, "seq"), P(None, "seq"), P()),
                          out_specs=P())
        try:
            jax.eval_shape(f, q, k, k, n)
        except NotImplementedError as e:
            msg = str(e)
            assert shown in msg and "masks.causal()" in msg and "sliding_window" in msg, msg
        else:
            raise AssertionError(f"context.decode accepted {mask!r}")


def check_decode_quantized():
    """Quantized caches (int8 per-token K, float8 per-tensor V) split along the slots,
    scale pools with them: context.decode equals fnattn.decode on the whole cache,
    with Tq = 3 new tokens straddling devices and a window's far edge."""
    from fnattn import quant
    from fnattn.quant import QuantFormat
    t0 = time.perf_counter()
    mesh = Mesh(np.array(jax.devices()[:8]), ("seq",))
    rs = np.random.default_rng(7)
    B, Tq, S, H, D = 4, 3, 32, 2, 8
    q = jnp.asarray(rs.standard_normal((B, Tq, 2 * H, D)), F32)
    k, v = jnp.asarray(rs.standard_normal((2, B, S, H, D)), F32)
    kq = quant.quantize(k, QuantFormat("int8"))
    vq = quant.quantize(v, QuantFormat("float8_e4m3fn", "tensor"), scale=jnp.float32(0.01))
    lengths = jnp.array([32, 10, 5, 0], jnp.int32)
    starts = jnp.array([0, 13, 20, 3], jnp.int32)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(4),
                         sinks=jnp.array([0.5, -1.0, 0.0, 1.0]))

    def run(decode, **kw):
        return lambda q, k, v, n, a: decode(spec, q, k, v, kv_lengths=n, kv_starts=a, **kw)

    cache = quant.QuantizedArray(P(None, "seq"), P(None, "seq"), kq.format)
    vspec = quant.QuantizedArray(P(None, "seq"), P(), vq.format)
    sharded = jax.shard_map(run(context_decode, axis_name="seq"), mesh=mesh,
                            in_specs=(P(), cache, vspec, P(), P()), out_specs=P())
    got = jax.jit(sharded)(q, kq, vq, lengths, starts)
    want = jax.jit(run(fnattn.decode))(q, kq, vq, lengths, starts)
    _close("quantized out", got.out, want.out, 2e-5)
    _close("quantized lse", got.lse, want.lse, 2e-5)
    print(f"decode_quantized: int8/float8 caches split along the slots equal fnattn.decode "
          f"({time.perf_counter() - t0:.1f}s)")


CHECKS = [check_decode_seq8, check_decode_position_terms, check_decode_data2_seq4,
          check_band_masks, check_merge_across, check_refused_masks, check_decode_quantized]
