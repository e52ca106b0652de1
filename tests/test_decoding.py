"""fnattn.decode against float64 NumPy on each sequence's dense problem, under jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import fnattn
from fnattn import AttentionSpec, DecodeBlockSizes, masks, quant
from fnattn.quant import QuantFormat
from fnattn.decoding import api, xla
from cases import np_mask
from np_attention import np_attention, np_attention_grads

S = 24  # cache slots per sequence (divisible by 1, 2, 3, 4, 6, 8)

MASKS = {
    "none": None,
    "causal": masks.causal(),
    "window": masks.causal() & masks.sliding_window(4),
    "chunked": masks.chunked(5) & masks.causal(),
    "two-sided": masks.sliding_window(3, 1),
    "fn": masks.from_fn(lambda b, h, q, k: (k + h + b) % 3 != 0) & masks.causal(),
}


def problem(B=3, Tq=1, Hq=6, Hkv=2, D=7, Dv=5, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, S, Hkv, Dv), dtype)
    return q, k, v


def expected(spec, q, k, v, lengths, starts, alibi_slopes=None):
    """(out (B, Tq, Hq, Dv), lse (B, Hq, Tq)) of every sequence's dense problem;
    with ``alibi_slopes`` (Hq,), its ALiBi term at each row's aligned position."""
    # (a quantized cache: the reference runs on its dequantized values)
    f64 = lambda x: np.asarray(quant.dequantize(x, jnp.float32), np.float64)  # noqa: E731
    q, k, v = f64(q), f64(k), f64(v)
    B, Tq, Hq, _ = q.shape
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    lse = np.full((B, Hq, Tq), -np.inf)
    sinks = None if spec.sinks is None else f64(spec.sinks)
    for b in range(B):
        a, L = int(starts[b]), int(lengths[b])
        if L == 0:
            if sinks is not None:
                lse[b] = sinks[:, None]
            continue
        bias = None
        if alibi_slopes is not None:
            dist = np.abs((L - Tq + np.arange(Tq))[:, None] - np.arange(L)[None, :])
            bias = -np.asarray(alibi_slopes, np.float64)[None, :, None, None] * dist
        o, l, _ = np_attention(q[b:b + 1], k[b:b + 1, a:a + L], v[b:b + 1, a:a + L],
                               scale=spec.scale, softcap=spec.softcap, sinks=sinks,
                               mask=np_mask(spec.mask, b, Hq, Tq, L), bias=bias)
        out[b], lse[b] = o[0], l[0]
    return out, lse


NAN_SLOTS = 40  # cache slots of the kernel tests (tests/decoding): ragged key blocks


def nan_problem(B=3, Tq=2, Hq=6, Hkv=2, D=7, Dv=5, dtype=jnp.float32, seed=0,
                lengths=(30, 9, 0), starts=(0, 17, 3)):
    """q, k, v, lengths, starts over a cache of ``NAN_SLOTS`` slots whose slots
    outside each sequence's range are NaN, so a kernel that read one would fail."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, NAN_SLOTS, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, NAN_SLOTS, Hkv, Dv), dtype)
    L, a = jnp.array(lengths, jnp.int32), jnp.array(starts, jnp.int32)
    slot = jnp.arange(NAN_SLOTS)[None, :, None, None]
    live = (slot >= a[:, None, None, None]) & (slot < (a + L)[:, None, None, None])
    return q, jnp.where(live, k, jnp.nan), jnp.where(live, v, jnp.nan), L, a


def check(spec, q, k, v, lengths, starts=None, tol=2e-5):
    run = jax.jit(lambda spec, q, k, v, L, s: fnattn.decode(spec, q, k, v, kv_lengths=L,
                                                            kv_starts=s))
    res = run(spec, q, k, v, lengths, starts)
    starts_np = np.zeros(len(lengths), int) if starts is None else np.asarray(starts)
    out, lse = expected(spec, q, k, v, np.asarray(lengths), starts_np)
    assert res.out.dtype == q.dtype and res.lse.dtype == jnp.float32
    assert res.out.shape == out.shape and res.lse.shape == lse.shape
    np.testing.assert_array_equal(np.isneginf(np.asarray(res.lse)), np.isneginf(lse))
    np.testing.assert_allclose(np.asarray(res.out, np.float64), out, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.where(np.isfinite(lse), res.lse, 0),
                               np.where(np.isfinite(lse), lse, 0), atol=tol, rtol=tol)
    return res


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("splits", [1, 4])
def test_masks_and_splits(mask, splits):
    q, k, v = problem(Tq=2)
    spec = AttentionSpec(mask=MASKS[mask], block_sizes=DecodeBlockSizes(num_splits=splits))
    check(spec, q, k, v, jnp.array([24, 9, 2]))


@pytest.mark.parametrize("heads,Tq", [((6, 2), 1), ((3, 3), 1), ((5, 1), 1), ((6, 2), 3),
                                      ((8, 1), 3)])
def test_gqa_shapes_fused_and_matmul_paths(heads, Tq):
    # Tq * Hq / Hkv rows per kv head: 2..7 take the XLA lowering's "mixed" form, 1 and
    # 8 or more its "dot" form (fnattn.decoding.xla.choose).
    Hq, Hkv = heads
    q, k, v = problem(Tq=Tq, Hq=Hq, Hkv=Hkv, seed=1)
    spec = AttentionSpec(mask=masks.causal(), block_sizes=DecodeBlockSizes(num_splits=3))
    check(spec, q, k, v, jnp.array([5, 24, 17]))


def test_starts_sinks_softcap_scale():
    q, k, v = problem(Tq=2, seed=2)
    spec = AttentionSpec(mask=masks.causal(), softcap=3.0, scale=0.4,
                         sinks=jnp.linspace(-1.0, 2.0, 6),
                         block_sizes=DecodeBlockSizes(num_splits=6))
    check(spec, q, k, v, jnp.array([10, 3, 0]), jnp.array([5, 21, 7]))


def test_empty_sequences_give_zeros_and_lengths_are_clipped():
    q, k, v = problem(seed=3)
    # sequence 0: no keys; 1: length past the cache end (clipped to S - start);
    # 2: start past the end (no keys)
    lengths, starts = jnp.array([0, 100, 4]), jnp.array([3, 20, 30])
    res = jax.jit(lambda q, k, v: fnattn.decode(AttentionSpec(), q, k, v, kv_lengths=lengths,
                                                kv_starts=starts))(q, k, v)
    assert np.all(np.asarray(res.out)[[0, 2]] == 0)
    assert np.all(np.isneginf(np.asarray(res.lse)[[0, 2]]))
    check(AttentionSpec(), q, k, v, jnp.array([0, 4, 0]), jnp.array([3, 20, 24]))


def test_bhtd_layout():
    q, k, v = problem(seed=4)
    spec = AttentionSpec(mask=masks.causal())
    lengths = jnp.array([7, 24, 1])
    ref = check(spec, q, k, v, lengths)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    res = jax.jit(lambda q, k, v: fnattn.decode(spec.replace(layout="bhtd"), q, k, v,
                                                kv_lengths=lengths))(t(q), t(k), t(v))
    np.testing.assert_allclose(t(res.out), ref.out, atol=1e-6)
    np.testing.assert_allclose(res.lse, ref.lse, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision(dtype):
    q, k, v = problem(Tq=3, seed=5, dtype=jnp.dtype(dtype))
    check(AttentionSpec(mask=masks.causal()), q, k, v, jnp.array([24, 12, 3]), tol=2e-2)


def test_gradients_match_numpy():
    q, k, v = problem(B=2, Tq=2, seed=6)
    lengths = jnp.array([24, 11])
    sinks = jnp.linspace(-0.5, 1.0, 6)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(6), softcap=4.0,
                         block_sizes=DecodeBlockSizes(num_splits=4))
    rs = np.random.default_rng(0)
    d_out = rs.standard_normal((2, 2, 6, 5))
    d_lse = rs.standard_normal((2, 6, 2))

    def loss(q, k, v, sinks):
        res = fnattn.decode(spec.replace(sinks=sinks), q, k, v, kv_lengths=lengths)
        return jnp.sum(res.out * d_out) + jnp.sum(res.lse * d_lse)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    for b in range(2):
        L = int(lengths[b])
        ref = np_attention_grads(f64(q[b:b + 1]), f64(k[b:b + 1, :L]), f64(v[b:b + 1, :L]),
                                 d_out[b:b + 1], d_lse[b:b + 1], softcap=4.0,
                                 sinks=f64(sinks), mask=np_mask(spec.mask, b, 6, 2, L))
        np.testing.assert_allclose(grads[0][b], ref["dq"][0], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(grads[1][b, :L], ref["dk"][0], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(grads[2][b, :L], ref["dv"][0], atol=1e-4, rtol=1e-4)
        np.testing.assert_array_equal(grads[1][b, L:], 0.0)   # slots never seen
    assert np.isfinite(np.asarray(grads[3])).all()


def test_vmap_over_a_leading_axis():
    q, k, v = problem(seed=7)
    lengths = jnp.array([[3, 24, 9], [1, 2, 3]])
    qs, ks, vs = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
    spec = AttentionSpec(mask=masks.causal())
    f = jax.jit(jax.vmap(lambda q, k, v, L: fnattn.decode(spec, q, k, v, kv_lengths=L)))
    res = f(qs, ks, vs, lengths)
    for i in range(2):
        one = fnattn.decode(spec, qs[i], ks[i], vs[i], kv_lengths=lengths[i])
        np.testing.assert_allclose(res.out[i], one.out, atol=1e-6)


def test_xla_lowering_picks_its_form_and_splits():
    cfg = api.Cfg(scale=1.0, softcap=None, mask_treedef=None, num_splits=None)
    assert xla.choose(cfg, 4, 32768) == ("mixed", 2)   # a few rows per kv head
    assert xla.choose(cfg, 1, 32768) == ("dot", 1)     # MHA
    assert xla.choose(cfg, 8, 32768) == ("dot", 1)     # many rows per kv head
    assert xla.choose(cfg, 4, 1001) == ("mixed", 1)    # no even split
    assert xla.choose(cfg, 4, 128) == ("mixed", 1)     # too short to split
    given = api.Cfg(scale=1.0, softcap=None, mask_treedef=None, num_splits=3)
    assert xla.choose(given, 4, 24) == ("mixed", 3) and xla.choose(given, 1, 24) == ("dot", 3)
    # On a CPU, float32 caches of several sequences and kv heads: the multiply-reduce
    many = dict(batch=4, kv_heads=2, cpu=True)
    assert xla.choose(cfg, 4, 8192, **many) == ("reduce", 2)
    assert xla.choose(cfg, 4, 8192, **{**many, "cpu": False}) == ("mixed", 2)
    assert xla.choose(cfg, 4, 8192, **{**many, "dtype": jnp.bfloat16}) == ("mixed", 2)
    # one kv head: the keys-last product, in one range
    assert xla.choose(cfg, 4, 8192, **{**many, "kv_heads": 1}) == ("dot", 1)
    assert xla.choose(cfg, 7, 8192, **{**many, "kv_heads": 1, "dtype": jnp.bfloat16}) == \
        ("dot", 1)
    assert xla.choose(cfg, 4, 8192, **{**many, "kv_heads": 1, "cpu": False}) == ("mixed", 2)
    assert xla.choose(cfg, 1, 8192, **{**many, "kv_heads": 1}) == ("dot", 1)
    assert xla.choose(cfg, 8, 8192, **{**many, "kv_heads": 1}) == ("dot", 1)
    assert xla.choose(cfg, 4, 8192, **{**many, "batch": 1}) == ("mixed", 2)
    one = {**many, "batch": 1, "kv_heads": 8}        # one sequence: with 2 rows only
    assert xla.choose(cfg, 2, 8192, **one) == ("reduce", 2)
    assert xla.choose(cfg, 3, 8192, **one) == ("mixed", 2)
    assert xla.choose(cfg, 4, 4096, **{**many, "batch": 2}) == ("mixed", 2)   # < 65536 keys
    assert xla.choose(cfg, 1, 8192, **many) == ("dot", 1)


@pytest.mark.parametrize("garbage", [3e4, np.nan])
def test_reduce_form_on_a_cpu_equals_dense_per_sequence(garbage):
    """impl="auto" on a CPU with float32 caches of several sequences and kv heads
    (B * S * Hkv >= 65536) takes the "reduce" form: each sequence's dense
    answer, with large values or NaN in the slots outside its range."""
    B, S_, Hq, Hkv = 2, 16384, 6, 2
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (B, 2, Hq, 4))
    k = jax.random.normal(ks[1], (B, S_, Hkv, 4))
    v = jax.random.normal(ks[2], (B, S_, Hkv, 3))
    L, a = jnp.array([16000, 301]), jnp.array([5, 9000])
    slot = jnp.arange(S_)[None, :, None, None]
    live = (slot >= a[:, None, None, None]) & (slot < (a + L)[:, None, None, None])
    k, v = jnp.where(live, k, garbage), jnp.where(live, v, garbage)
    cfg = api.Cfg(scale=0.5, softcap=None, mask_treedef=None, num_splits=None)
    assert xla.choose(cfg, 6, S_, batch=B, kv_heads=Hkv, cpu=True)[0] == "reduce"
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(5000),
                         sinks=jnp.linspace(-1.0, 1.0, Hq))
    check(spec, q, jnp.where(live, k, 0.0), jnp.where(live, v, 0.0), L, a, tol=1e-4)
    res = check(spec, q, k, v, L, a, tol=1e-4)
    assert np.isfinite(np.asarray(res.out)).all()


def test_bad_input_messages():
    q, k, v = problem()
    L = jnp.array([1, 2, 3])
    with pytest.raises(ValueError, match=r"decode: kv_lengths must have shape \(B,\)=\(3,\), "
                                         r"one per sequence of q \(3, 1, 6, 7\); got \(2,\)"):
        fnattn.decode(AttentionSpec(), q, k, v, kv_lengths=L[:2])
    with pytest.raises(TypeError, match=r"decode: kv_starts must be an integer array; "
                                        r"got float32"):
        fnattn.decode(AttentionSpec(), q, k, v, kv_lengths=L, kv_starts=jnp.zeros(3))
    with pytest.raises(ValueError, match=r"decode: head-dim mismatch"):
        fnattn.decode(AttentionSpec(), q, k[..., :3], v, kv_lengths=L)
    with pytest.raises(NotImplementedError, match=r"decode: masks that hold arrays"):
        fnattn.decode(AttentionSpec(mask=masks.lengths(kv_lengths=L)), q, k, v, kv_lengths=L)
    with pytest.raises(NotImplementedError, match=r"decode: spec.bias is not supported"):
        fnattn.decode(AttentionSpec(bias=jnp.zeros((1, 1, 1, S))), q, k, v, kv_lengths=L)
    with pytest.raises(ValueError, match=r"num_splits=5\) must divide the cache length S=24"):
        fnattn.decode(AttentionSpec(block_sizes=DecodeBlockSizes(5)), q, k, v, kv_lengths=L)
    with pytest.raises(ValueError, match=r"decode: sinks must have shape \(Hq,\)=\(6,\)"):
        fnattn.decode(AttentionSpec(sinks=jnp.zeros(2)), q, k, v, kv_lengths=L)


# ----------------------------------------------------------------------------------
# Poisoned slots, infinite sinks, checked mode, x64
# ----------------------------------------------------------------------------------

WINDOW = 3


def hide_before_window(k, v, lengths, starts, Tq):
    """k, v with NaN also in each sequence's own slots that the window of
    ``WINDOW`` keys (causal) hides from all of its Tq queries."""
    slot = jnp.arange(k.shape[1])[None, :, None, None]
    first_seen = (starts + lengths - Tq - WINDOW)[:, None, None, None]
    hidden = (slot >= starts[:, None, None, None]) & (slot < first_seen)
    return jnp.where(hidden, jnp.nan, k), jnp.where(hidden, jnp.nan, v)


def check_poisoned_window_under_x64(q, k, v, lengths, starts, sinks, route):
    """A kernel (``route()`` sends fnattn.decode to it) with NaN in every slot
    outside each range and in the own slots the window hides, under x64, gives
    the XLA lowering's answer, finite."""
    pk, pv = hide_before_window(k, v, lengths, starts, q.shape[1])
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(WINDOW), sinks=sinks)

    def f(impl):
        return jax.jit(lambda q, k, v: fnattn.decode(spec.replace(impl=impl), q, k, v,
                                                     kv_lengths=lengths, kv_starts=starts))
    want = f("xla")(q, k, v)
    route()
    with jax.enable_x64(True):
        res = f("auto")(q, pk, pv)
    np.testing.assert_allclose(res.out, want.out, atol=2e-6)
    np.testing.assert_allclose(res.lse, want.lse, atol=2e-6)
    assert np.isfinite(np.asarray(res.out)).all()


@pytest.mark.parametrize("impl,mask,splits", [("xla", "none", 4), ("xla", "window", 1),
                                              ("reference", "window", 1)])
def test_poisoned_slots_reach_neither_results_nor_gradients(impl, mask, splits):
    """NaN in every slot outside each sequence's range (and, with a window, in its
    own slots the window hides): the result is that of the clean cache, and so
    are the gradients, which are exactly 0 at the poisoned slots."""
    q, k, v, L, a = nan_problem()
    if mask == "window":
        k, v = hide_before_window(k, v, L, a, q.shape[1])
    poison = np.isnan(np.asarray(k)).any(-1)
    clean_k, clean_v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    spec = AttentionSpec(mask=MASKS["window" if mask == "window" else "causal"], impl=impl,
                         sinks=jnp.linspace(-1.0, 1.0, 6),
                         block_sizes=DecodeBlockSizes(num_splits=splits))
    if mask == "window":
        spec = spec.replace(mask=masks.causal() & masks.sliding_window(WINDOW))
    want = check(spec, q, clean_k, clean_v, L, a)          # against NumPy
    res = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L, kv_starts=a))(
        q, k, v)
    np.testing.assert_allclose(res.out, want.out, atol=1e-6)
    np.testing.assert_allclose(res.lse, want.lse, atol=1e-6)
    w = jnp.cos(jnp.arange(3 * 2 * 6 * 5, dtype=jnp.float32)).reshape(3, 2, 6, 5)

    def loss(q, k, v, sinks):
        r = fnattn.decode(spec.replace(sinks=sinks), q, k, v, kv_lengths=L, kv_starts=a)
        return jnp.sum(r.out * w) + jnp.sum(jnp.where(jnp.isfinite(r.lse), r.lse, 0.0))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    got, want = grad(q, k, v, spec.sinks), grad(q, clean_k, clean_v, spec.sinks)
    for g, g0 in zip(got, want):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, g0, atol=1e-6)
    for g in got[1:3]:
        np.testing.assert_array_equal(np.asarray(g)[poison], 0.0)


def test_a_visible_nan_key_gives_nan_rows_only():
    """Honest NaN: a row that sees a non-finite key is NaN; rows that do not are not."""
    q, k, v = problem(B=2, Tq=2)
    k = k.at[0, 5, 0, 1].set(jnp.inf)          # sequence 0, kv head 0, position 5
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(4), impl="xla")
    res = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=jnp.array([8, 24])))(
        q, k, v)
    out, lse = np.asarray(res.out), np.asarray(res.lse)
    # queries at positions 6 and 7 see 2..6 and 3..7; heads 0-2 read kv head 0
    assert np.isnan(out[0, :, :3]).all() and np.isnan(lse[0, :3]).all()
    assert np.isfinite(out[0, :, 3:]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("splits", [1, 4])
def test_infinite_sinks(splits):
    """Sinks of -inf are no sink; +inf takes all the mass (out 0, lse +inf, no gradient
    to q/k/v from those rows, d(sink) = the sum of d(lse) over its rows); a sequence
    of length 0 with a -inf sink gives 0 and -inf, no NaN anywhere."""
    q, k, v = problem(Tq=2, seed=8)
    L = jnp.array([24, 5, 0])
    sinks = jnp.array([0.5, jnp.inf, -jnp.inf, -jnp.inf, jnp.inf, 0.0])
    spec = AttentionSpec(mask=masks.causal(), impl="xla",
                         block_sizes=DecodeBlockSizes(num_splits=splits))
    rs = np.random.default_rng(1)
    d_out = jnp.asarray(rs.standard_normal((3, 2, 6, 5)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((3, 6, 2)), jnp.float32)

    @jax.jit
    def run(q, k, v, sinks):
        def f(q, k, v, s):
            r = fnattn.decode(spec.replace(sinks=s), q, k, v, kv_lengths=L)
            return r.out, r.lse
        res, vjp = jax.vjp(f, q, k, v, sinks)
        return res, vjp((d_out, d_lse))

    (out, lse), (dq, dk, dv, ds) = run(q, k, v, sinks)
    for x in (out, dq, dk, dv, ds):
        assert np.isfinite(np.asarray(x)).all()
    out, lse = np.asarray(out), np.asarray(lse)
    plus, minus = [1, 4], [2, 3]
    assert (out[:, :, plus] == 0).all() and (lse[:, plus] == np.inf).all()
    np.testing.assert_array_equal(np.asarray(dq)[:, :, plus], 0.0)
    np.testing.assert_allclose(ds[np.array(plus)], np.asarray(d_lse)[:, plus].sum((0, 2)),
                               rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ds)[minus], 0.0)
    # -inf heads: as without sinks (sequence 2, of length 0: zeros and -inf)
    none = check(AttentionSpec(mask=masks.causal()), q, k, v, L)
    np.testing.assert_allclose(out[:, :, minus], np.asarray(none.out)[:, :, minus], atol=1e-6)
    np.testing.assert_array_equal(lse[2, minus], -np.inf)
    # the finite heads are checked against NumPy
    finite = sinks.at[np.array(plus + minus)].set(0.0)
    want = check(spec.replace(sinks=finite), q, k, v, L)
    np.testing.assert_allclose(out[:, :, [0, 5]], np.asarray(want.out)[:, :, [0, 5]],
                               atol=1e-6)


CHECKED = jax.jit(checkify.checkify(
    lambda q, k, v, L, a: fnattn.decode(AttentionSpec(mask=masks.causal()), q, k, v,
                                        kv_lengths=L, kv_starts=a, checked=True)))


@pytest.mark.parametrize("lengths,starts,message", [
    ((24, 9, 0), (0, 15, 24), None),
    ((24, 2, 1), (0, 0, 0), None),
    ((25, 9, 0), (0, 0, 0), "kv_starts[0] + kv_lengths[0] = 0 + 25 is past the cache's S=24 "
                            "slots"),
    ((4, 10, 0), (0, 15, 0), "kv_starts[1] + kv_lengths[1] = 15 + 10 is past the cache's "
                             "S=24 slots"),
    ((4, 2 ** 31 - 1, 0), (0, 3, 0), "kv_starts[1] + kv_lengths[1] = 3 + 2147483647 is past "
                                     "the cache's S=24 slots"),
    ((4, -1, 0), (0, 0, 0), "kv_lengths[1] = -1 is negative"),
    ((4, 1, 0), (0, 0, -2), "kv_starts[2] = -2 is outside the cache [0, S=24]"),
    ((4, 1, 0), (0, 0, 25), "kv_starts[2] = 25 is outside the cache [0, S=24]"),
])
def test_checked_mode_reports_values_that_would_be_clipped(lengths, starts, message):
    q, k, v = problem()
    err, res = CHECKED(q, k, v, jnp.array(lengths), jnp.array(starts))
    got = err.get()
    assert (got if got is None else got.removesuffix(" (`check` failed)")) == message
    assert res.out.shape == (3, 1, 6, 5)


def test_checked_mode_reports_lengths_below_the_new_tokens():
    q, k, v = problem(Tq=3)
    err, _ = CHECKED(q, k, v, jnp.array([3, 2, 0]), jnp.array([0, 0, 0]))
    assert err.get().removesuffix(" (`check` failed)") == (
        "kv_lengths[1] = 2 is less than the Tq=3 new tokens (the length includes them; 0 marks "
        "an empty sequence)")


@pytest.mark.parametrize("impl", ["xla", "reference", "pallas"])
def test_x64_float32_inputs(impl):
    """With jax_enable_x64 (Python ints and aranges become int64) every lowering traces
    and gives the float32 answer; int64 lengths are accepted."""
    q, k, v = problem(Tq=2, seed=9)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(5), impl=impl,
                         sinks=jnp.linspace(-1.0, 1.0, 6),
                         block_sizes=DecodeBlockSizes(num_splits=2))
    L = np.array([24, 9, 0])
    want = check(spec, q, k, v, jnp.asarray(L))
    with jax.enable_x64(True):
        res = jax.jit(lambda q, k, v, L: fnattn.decode(spec, q, k, v, kv_lengths=L))(
            q, k, v, jnp.asarray(L, jnp.int64))
    assert res.out.dtype == jnp.float32 and res.lse.dtype == jnp.float32
    np.testing.assert_allclose(res.out, want.out, atol=1e-6)
    np.testing.assert_allclose(res.lse, want.lse, atol=1e-6)


def test_float64_is_refused():
    with jax.enable_x64(True):
        q = jnp.zeros((1, 1, 4, 8), jnp.float64)
        kv = jnp.zeros((1, 16, 2, 8), jnp.float64)
        for impl in ("auto", "xla", "pallas"):
            with pytest.raises(TypeError) as info:
                jax.jit(fnattn.decode)(AttentionSpec(impl=impl), q, kv, kv,
                                       kv_lengths=jnp.ones((1,), jnp.int32))
            assert str(info.value) == (
                "decode: float64 inputs are not supported (q, k_cache, v_cache are float64): "
                "the serving variants compute in float32; cast q, k_cache, v_cache to float32 "
                "(x.astype(jnp.float32)).")


# ----------------------------------------------------------------------------------
# Quantized caches (fnattn.quant): against float64 NumPy on the dequantized cache
# ----------------------------------------------------------------------------------

QUANT = [(QuantFormat("int8"), QuantFormat("int8")),
         (QuantFormat("float8_e4m3fn"), QuantFormat("float8_e5m2", "tensor")),
         (QuantFormat("int4"), QuantFormat("float8_e4m3fn")),
         (QuantFormat("float8_e5m2"), QuantFormat("int4", "tensor"))]
QIDS = [f"{k.name}-{k.granularity}/{v.name}-{v.granularity}" for k, v in QUANT]


def quantized(x, fmt):
    return quant.quantize(x, fmt, scale=None if fmt.per_token else 2.5 / fmt.max_code)


@pytest.mark.parametrize("formats", QUANT, ids=QIDS)
@pytest.mark.parametrize("mask,splits,heads,Tq", [("causal", 1, (6, 2), 2), ("window", 4, (6, 2), 1),
                                                  ("fn", 3, (8, 1), 3), ("none", 2, (3, 3), 1)])
def test_quantized_caches_masks_splits_and_forms(formats, mask, splits, heads, Tq):
    Hq, Hkv = heads
    q, k, v = problem(Tq=Tq, Hq=Hq, Hkv=Hkv, D=8, Dv=6, seed=7)
    kq, vq = quantized(k, formats[0]), quantized(v, formats[1])
    spec = AttentionSpec(mask=MASKS[mask], block_sizes=DecodeBlockSizes(num_splits=splits))
    check(spec, q, kq, vq, jnp.array([24, 9, 3]))


@pytest.mark.parametrize("formats", QUANT[:2], ids=QIDS[:2])
def test_quantized_starts_sinks_softcap_alibi_bhtd(formats):
    from fnattn import position_bias
    q, k, v = problem(Tq=2, D=8, Dv=8, seed=8)
    kq, vq = quantized(k, formats[0]), quantized(v, formats[1])
    spec = AttentionSpec(mask=masks.causal(), softcap=3.0, scale=0.4,
                         sinks=jnp.linspace(-1.0, 2.0, 6),
                         block_sizes=DecodeBlockSizes(num_splits=6))
    lengths, starts = jnp.array([10, 3, 0]), jnp.array([5, 21, 7])
    ref = check(spec, q, kq, vq, lengths, starts)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    res = jax.jit(lambda q, k, v: fnattn.decode(spec.replace(layout="bhtd"), q, k, v,
                                                kv_lengths=lengths, kv_starts=starts))(
        t(q), kq.swapaxes(1, 2), vq.swapaxes(1, 2))
    np.testing.assert_allclose(t(res.out), ref.out, atol=1e-6)
    slopes = position_bias.alibi_slopes(6)
    alibi = AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(slopes))
    res = jax.jit(lambda q, k, v: fnattn.decode(alibi, q, k, v, kv_lengths=lengths))(q, kq, vq)
    out, _ = expected(alibi, q, kq, vq, np.asarray(lengths), np.zeros(3, int),
                      alibi_slopes=slopes)
    np.testing.assert_allclose(res.out, out, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("formats", QUANT, ids=QIDS)
def test_quantized_nan_in_unowned_slots_and_scales_changes_nothing(formats):
    q, k, v, L, a = nan_problem(D=8, Dv=8)
    kq, vq = quantized(k, formats[0]), quantized(v, formats[1])
    clean = lambda x: jnp.where(jnp.isnan(x), 0.0, x)  # noqa: E731
    want = check(AttentionSpec(mask=masks.causal(), sinks=jnp.ones(6)), q,
                 quantized(clean(k), formats[0]), quantized(clean(v), formats[1]), L, a)
    slot = jnp.arange(NAN_SLOTS)[None, :, None]
    live = (slot >= a[:, None, None]) & (slot < (a + L)[:, None, None])

    def spoil(x):   # NaN scales where the slots are unowned, too
        return x.replace(scale=jnp.where(live, x.scale, jnp.nan)) if x.format.per_token else x
    for impl in ("xla", "reference"):
        res = jax.jit(lambda q, k, v: fnattn.decode(
            AttentionSpec(mask=masks.causal(), sinks=jnp.ones(6), impl=impl), q, k, v,
            kv_lengths=L, kv_starts=a))(q, spoil(kq), spoil(vq))
        np.testing.assert_allclose(res.out, want.out, atol=2e-6)
        assert np.isfinite(np.asarray(res.out)).all()


def test_quantized_bad_scales_are_reported():
    # (the Pallas kernels on quantized caches: tests/decoding/test_quantized_kernels.py)
    q, k, v = problem(D=8, Dv=8)
    kq = quantized(k, QuantFormat("int8"))
    L = jnp.array([3, 4, 5])
    with pytest.raises(ValueError, match=r"decode: k_cache.scale must have shape "
                                         r"data.shape\[:-1\]"):
        fnattn.decode(AttentionSpec(), q, kq.replace(scale=kq.scale[:, :3]), v, kv_lengths=L)
    vt = quantized(v, QuantFormat("int8", "tensor"))
    f = checkify.checkify(lambda s: fnattn.decode(AttentionSpec(), q, kq, vt.replace(scale=s),
                                                  kv_lengths=L, checked=True).out)
    err, _ = jax.jit(f)(jnp.float32(-1.0))
    with pytest.raises(checkify.JaxRuntimeError, match="v_cache.scale must be finite and > 0"):
        err.throw()
    with pytest.raises(ValueError, match="v_cache: scale must be finite and > 0"):
        fnattn.decode(AttentionSpec(), q, kq, vt.replace(scale=jnp.float32(jnp.nan)),
                      kv_lengths=L)


# ----------------------------------------------------------------------------------
# Latent caches (MLA): values are the keys' first value_dim channels
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [None, QuantFormat("int8"), QuantFormat("float8_e4m3fn")],
                         ids=["float", "int8", "fp8"])
@pytest.mark.parametrize("mask,splits,Tq", [("causal", 1, 1), ("window", 4, 2), ("fn", 3, 3)])
def test_latent_cache_equals_attention_with_values_sliced_from_the_keys(fmt, mask, splits, Tq):
    Dc, Dr, Hq = 6, 4, 8
    q, k, _ = problem(Tq=Tq, Hq=Hq, Hkv=1, D=Dc + Dr, Dv=1, seed=9)
    kc = k if fmt is None else quantized(k, fmt)
    spec = AttentionSpec(mask=MASKS[mask], sinks=jnp.linspace(-1, 1, Hq), softcap=5.0,
                         block_sizes=DecodeBlockSizes(num_splits=splits))
    lengths, starts = jnp.array([24, 9, 3]), jnp.array([0, 10, 20])
    res = jax.jit(lambda q, k: fnattn.decode(spec, q, k, None, kv_lengths=lengths,
                                             kv_starts=starts, value_dim=Dc))(q, kc)
    kd = quant.dequantize(kc)
    out, lse = expected(spec, q, kd, kd[..., :Dc], np.asarray(lengths), np.asarray(starts))
    assert res.out.shape == (3, Tq, Hq, Dc)
    np.testing.assert_allclose(res.out, out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.where(np.isfinite(lse), res.lse, 0),
                               np.where(np.isfinite(lse), lse, 0), atol=2e-5, rtol=2e-5)


def test_latent_cache_bad_input():
    q, k, v = problem(D=10, Dv=6, Hkv=1)
    L = jnp.array([3, 4, 5])
    with pytest.raises(ValueError, match="a latent cache \\(value_dim=6\\) has no separate "
                                         "v_cache"):
        fnattn.decode(AttentionSpec(), q, k, v, kv_lengths=L, value_dim=6)
    with pytest.raises(ValueError, match="value_dim must be an int in \\[1, D=10\\]"):
        fnattn.decode(AttentionSpec(), q, k, None, kv_lengths=L, value_dim=11)
    with pytest.raises(ValueError, match="v_cache is None: pass the values, or value_dim"):
        fnattn.decode(AttentionSpec(), q, k, None, kv_lengths=L)


@pytest.mark.parametrize("formats", [(None, None)] + QUANT[:3], ids=["float"] + QIDS[:3])
def test_looped_form_reads_chunks_of_slots(formats, monkeypatch):
    """Large caches (quantized: all) are read a chunk of slots at a time (a loop
    over chunks folded into an online softmax; DecodeBlockSizes.block_k sets the
    chunk): the same answers as the reference, with starts, windows, ALiBi, sinks,
    empty sequences and NaN in unowned slots and scales."""
    from fnattn import position_bias
    q, k, v, L, a = nan_problem(D=8, Dv=8, lengths=(30, 9, 0), starts=(0, 17, 3))
    kq, vq = (k, v) if formats[0] is None else (quantized(k, formats[0]),
                                                 quantized(v, formats[1]))
    assert xla._loop_chunk(api.Cfg(1.0, None, None, None), q, kq, vq) == (
        None if formats[0] is None else NAN_SLOTS)
    slopes = position_bias.alibi_slopes(6)
    chunked = DecodeBlockSizes(block_k=8)
    for spec in (AttentionSpec(mask=masks.causal() & masks.sliding_window(5),
                               sinks=jnp.linspace(-1, 1, 6), softcap=4.0, block_sizes=chunked),
                 AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(slopes),
                               block_sizes=chunked)):
        res = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L,
                                                    kv_starts=a))(q, kq, vq)
        out, lse = expected(spec, q, kq, vq, np.asarray(L), np.asarray(a),
                            alibi_slopes=slopes if spec.position_bias is not None else None)
        assert np.isfinite(np.asarray(res.out)).all()
        np.testing.assert_allclose(res.out, out, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.where(np.isfinite(lse), res.lse, 0),
                                   np.where(np.isfinite(lse), lse, 0), atol=2e-5, rtol=2e-5)
    # and the gradient with respect to q (through the loop) is the one-chunk gradient's
    grads = []
    for block_k in (8, NAN_SLOTS):
        spec = AttentionSpec(mask=masks.causal(), block_sizes=DecodeBlockSizes(block_k=block_k))
        f = lambda q: jnp.sum(fnattn.decode(spec, q, kq, vq,  # noqa: E731
                                            kv_lengths=L, kv_starts=a).out ** 2)
        grads.append(jax.jit(jax.grad(f))(q))
    assert np.isfinite(np.asarray(grads[0])).all()
    np.testing.assert_allclose(grads[0], grads[1], atol=1e-5, rtol=1e-5)
