"""fnattn.decoding.decode_with_update: the write equals writing by hand then
fnattn.decode; steps in a loop equal dense causal attention over the whole
sequence; GQA, per-sequence lengths and starts, both layouts; NaN cache slots
contribute nothing; sequences that do not fit get NaN and write nothing (or a
ValueError / checkify error); gradients equal those of the dense reference.
Everything under jax.jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from np_attention import np_causal_tail

import fnattn
from fnattn import AttentionSpec, masks
from fnattn.decoding import decode_with_update

# Distinct sizes: 3 sequences, 16 slots, 6 query heads over 2 kv heads (GQA), head
# dims 8 (k) and 4 (v).
B, S, HQ, HKV, D, DV = 3, 16, 6, 2, 8, 4
SPEC = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.5, -1.0, 0.0, 2.0, 0.3, -0.2]))
ATOL = 2e-5


def dense_causal(q, k, v):
    """Causal attention of the last Tq of Tk tokens in float64 NumPy (independent of
    fnattn) with SPEC's sinks: (out (B, Tq, Hq, Dv), lse (B, Hq, Tq))."""
    return np_causal_tail(q, k, v, sinks=np.asarray(SPEC.sinks))



def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def poisoned_cache(rng, dv, layout):
    """A cache full of NaN: only what a test writes is a number."""
    shape = (B, S, HKV, dv) if layout == "bthd" else (B, HKV, S, dv)
    return np.full(shape, np.nan, np.float32)


def to_layout(x, layout):
    """(B, T, H, D) -> the layout's axes."""
    return x if layout == "bthd" else np.swapaxes(x, 1, 2)


@jax.jit
def by_hand(spec, q, k_new, v_new, k_cache, v_cache, kv_lengths, kv_starts):
    """The documented meaning: write token i of sequence b at slot
    kv_starts[b] + kv_lengths[b] - Tq + i, then fnattn.decode."""
    bthd = spec.layout == "bthd"
    Tq = q.shape[1] if bthd else q.shape[2]
    kc, vc = k_cache, v_cache
    for b in range(B):
        first = kv_starts[b] + kv_lengths[b] - Tq
        if bthd:
            kc = jax.lax.dynamic_update_slice(kc, k_new[b:b + 1], (b, first, 0, 0))
            vc = jax.lax.dynamic_update_slice(vc, v_new[b:b + 1], (b, first, 0, 0))
        else:
            kc = jax.lax.dynamic_update_slice(kc, k_new[b:b + 1], (b, 0, first, 0))
            vc = jax.lax.dynamic_update_slice(vc, v_new[b:b + 1], (b, 0, first, 0))
    res = fnattn.decode(spec, q, kc, vc, kv_lengths=kv_lengths, kv_starts=kv_starts)
    return res, kc, vc


update = jax.jit(decode_with_update, static_argnames=("checked", "value_dim"))


@pytest.mark.parametrize("layout,tq", [("bthd", 1), ("bthd", 3), ("bhtd", 2)])
def test_equals_writing_by_hand_then_decode(layout, tq):
    rng = np.random.default_rng(0)
    spec = SPEC.replace(layout=layout)
    lengths = np.array([tq + 5, S - 4, tq], np.int32)  # different per sequence
    starts = np.array([3, 4, 0], np.int32)             # sequence 1 ends at the last slot
    kc, vc = poisoned_cache(rng, D, layout), poisoned_cache(rng, DV, layout)
    for b in range(B):  # the cached keys (not the new ones) are numbers
        n = lengths[b] - tq
        sl = slice(starts[b], starts[b] + n)
        if layout == "bthd":
            kc[b, sl], vc[b, sl] = normal(rng, n, HKV, D), normal(rng, n, HKV, DV)
        else:
            kc[b, :, sl], vc[b, :, sl] = normal(rng, HKV, n, D), normal(rng, HKV, n, DV)
    q = to_layout(normal(rng, B, tq, HQ, D), layout)
    kn = to_layout(normal(rng, B, tq, HKV, D), layout)
    vn = to_layout(normal(rng, B, tq, HKV, DV), layout)
    args = [jnp.asarray(x) for x in (q, kn, vn, kc, vc)]
    got, gk, gv = update(spec, *args, kv_lengths=jnp.asarray(lengths),
                         kv_starts=jnp.asarray(starts))
    want, wk, wv = by_hand(spec, *args, jnp.asarray(lengths), jnp.asarray(starts))
    np.testing.assert_array_equal(gk, wk)  # bit for bit, NaN where nothing was written
    np.testing.assert_array_equal(gv, wv)
    np.testing.assert_allclose(got.out, want.out, atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(got.lse, want.lse, atol=ATOL, rtol=ATOL)
    assert np.isfinite(np.asarray(got.out)).all() and np.isfinite(np.asarray(got.lse)).all()
    # The writes landed where the lengths say, and nowhere else: every other slot is
    # still NaN.
    written = np.zeros((B, S), bool)
    for b in range(B):
        written[b, starts[b]:starts[b] + lengths[b]] = True
    gk_bthd = np.asarray(gk) if layout == "bthd" else np.swapaxes(np.asarray(gk), 1, 2)
    assert np.isnan(gk_bthd[~written]).all() and not np.isnan(gk_bthd[written]).any()
    new_k = np.asarray(kn) if layout == "bthd" else np.swapaxes(kn, 1, 2)
    for b in range(B):
        end = starts[b] + lengths[b]
        np.testing.assert_array_equal(gk_bthd[b, end - tq:end], new_k[b])


def test_steps_in_a_loop_equal_dense_causal_attention():
    """Each sequence has an earlier context of its own length; a 3-token prefill, then
    five one-token steps in a lax.scan, all from a cache poisoned with NaN. Every
    step's rows equal dense causal attention (float64 NumPy) over the sequence's
    tokens so far."""
    rng = np.random.default_rng(1)
    prefix = np.array([0, 5, 2], np.int32)
    starts = np.array([2, 0, 6], np.int32)
    steps, prefill = 5, 3
    total = prefix + prefill + steps
    assert (starts + total <= S).all()
    k_all = normal(rng, B, S, HKV, D)  # the sequences' k/v in order (first `total` used)
    v_all = normal(rng, B, S, HKV, DV)
    q_all = normal(rng, B, S, HQ, D)
    kc, vc = poisoned_cache(rng, D, "bthd"), poisoned_cache(rng, DV, "bthd")
    for b in range(B):
        kc[b, starts[b]:starts[b] + prefix[b]] = k_all[b, :prefix[b]]
        vc[b, starts[b]:starts[b] + prefix[b]] = v_all[b, :prefix[b]]

    def take(x, first, n):  # rows first[b] .. first[b] + n - 1 of each sequence
        return jax.vmap(lambda xb, f: jax.lax.dynamic_slice_in_dim(xb, f, n))(x, first)

    @jax.jit
    def run(kc, vc, q_all, k_all, v_all):
        lengths = jnp.asarray(prefix + prefill)
        res, kc, vc = decode_with_update(
            SPEC, take(q_all, jnp.asarray(prefix), prefill),
            take(k_all, jnp.asarray(prefix), prefill), take(v_all, jnp.asarray(prefix), prefill),
            kc, vc, kv_lengths=lengths, kv_starts=jnp.asarray(starts))

        def step(carry, _):
            kc, vc, lengths = carry
            lengths = lengths + 1
            pos = lengths - 1
            r, kc, vc = decode_with_update(SPEC, take(q_all, pos, 1), take(k_all, pos, 1),
                                           take(v_all, pos, 1), kc, vc, kv_lengths=lengths,
                                           kv_starts=jnp.asarray(starts))
            return (kc, vc, lengths), (r.out[:, 0], r.lse[:, :, 0])

        (kc, vc, lengths), (outs, lses) = jax.lax.scan(step, (kc, vc, lengths), length=steps)
        return res, outs, lses, kc, lengths

    res, outs, lses, kc, lengths = run(*(jnp.asarray(x) for x in (kc, vc, q_all, k_all,
                                                                    v_all)))
    assert np.asarray(lengths).tolist() == total.tolist()
    for b in range(B):
        n = int(total[b])
        want_out, want_lse = dense_causal(q_all[b:b + 1, :n], k_all[b:b + 1, :n],
                                          v_all[b:b + 1, :n])  # every row of the sequence
        p = int(prefix[b])
        np.testing.assert_allclose(res.out[b], want_out[0, p:p + prefill], atol=ATOL, rtol=ATOL)
        np.testing.assert_allclose(res.lse[b], want_lse[0, :, p:p + prefill], atol=ATOL,
                                   rtol=ATOL)
        np.testing.assert_allclose(outs[:, b], want_out[0, p + prefill:n], atol=ATOL, rtol=ATOL)
        np.testing.assert_allclose(lses[:, b], want_lse[0, :, p + prefill:n].T, atol=ATOL,
                                   rtol=ATOL)
        # The cache holds the whole sequence, in order, at its slots.
        np.testing.assert_array_equal(kc[b, starts[b]:starts[b] + n], k_all[b, :n])


def test_gradients_equal_those_of_dense_attention():
    """d/d(q, k_new, v_new) of a weighted sum of the outputs, with a NaN-poisoned cache,
    against fnattn.reference on each sequence's dense tokens."""
    rng = np.random.default_rng(2)
    tq = 2
    lengths = np.array([7, 2, 12], np.int32)
    starts = np.array([1, 9, 4], np.int32)
    kc, vc = poisoned_cache(rng, D, "bthd"), poisoned_cache(rng, DV, "bthd")
    old_k = [normal(rng, n - tq, HKV, D) for n in lengths]
    old_v = [normal(rng, n - tq, HKV, DV) for n in lengths]
    for b in range(B):
        kc[b, starts[b]:starts[b] + lengths[b] - tq] = old_k[b]
        vc[b, starts[b]:starts[b] + lengths[b] - tq] = old_v[b]
    q, kn, vn = normal(rng, B, tq, HQ, D), normal(rng, B, tq, HKV, D), normal(rng, B, tq, HKV, DV)
    w = jnp.asarray(normal(rng, B, tq, HQ, DV))
    kc, vc = jnp.asarray(kc), jnp.asarray(vc)

    @jax.jit
    def loss(q, kn, vn, kc):
        res, _, _ = decode_with_update(SPEC, q, kn, vn, kc, vc, kv_lengths=jnp.asarray(lengths),
                                       kv_starts=jnp.asarray(starts))
        return jnp.sum(res.out * w) + 0.1 * jnp.sum(res.lse)

    @jax.jit
    def dense_loss(q, kn, vn, old_k):
        total = 0.0
        for b in range(B):
            k = jnp.concatenate([old_k[b], kn[b]])[None]
            v = jnp.concatenate([old_v[b], vn[b]])[None]
            res = fnattn.reference(SPEC, q[b:b + 1], k, v)
            total += jnp.sum(res.out[0] * w[b]) + 0.1 * jnp.sum(res.lse)
        return total

    args = [jnp.asarray(x) for x in (q, kn, vn)]
    np.testing.assert_allclose(loss(*args, kc), dense_loss(*args, old_k), rtol=1e-5)
    got = jax.grad(loss, argnums=(0, 1, 2, 3))(*args, kc)
    want = jax.grad(dense_loss, argnums=(0, 1, 2, 3))(*args, old_k)
    for g, r in zip(got[:3], want[:3]):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)
    # Through the old cache: its valid slots get the dense gradient, the others
    # (NaN, or overwritten by the new tokens) exactly zero.
    g = np.asarray(got[3])
    for b in range(B):
        n = lengths[b] - tq
        np.testing.assert_allclose(g[b, starts[b]:starts[b] + n], want[3][b], atol=1e-4,
                                   rtol=1e-4)
        others = np.ones(S, bool)
        others[starts[b]:starts[b] + n] = False
        assert (g[b, others] == 0).all()


def test_sequences_that_do_not_fit_get_nan_and_write_nothing():
    """Traced lengths (under jit): a sequence past the end of the cache, one shorter
    than Tq and a negative start are NaN and leave their rows of the cache as they
    were; the valid sequence is unaffected; a length of 0 writes nothing and gives
    zeros."""
    rng = np.random.default_rng(3)
    tq = 2
    kc, vc = normal(rng, B + 2, S, HKV, D), normal(rng, B + 2, S, HKV, DV)
    q, kn, vn = (normal(rng, B + 2, tq, HQ, D), normal(rng, B + 2, tq, HKV, D),
                 normal(rng, B + 2, tq, HKV, DV))
    lengths = jnp.array([6, S - 2, 1, 0, 4], jnp.int32)
    starts = jnp.array([0, 3, 0, 5, -1], jnp.int32)   # seq 1: 3 + 14 > 16; seq 2: 1 < Tq
    res, gk, gv = update(SPEC, *(jnp.asarray(x) for x in (q, kn, vn, kc, vc)),
                         kv_lengths=lengths, kv_starts=starts)
    out, lse = np.asarray(res.out), np.asarray(res.lse)
    assert np.isnan(out[[1, 2, 4]]).all() and np.isnan(lse[[1, 2, 4]]).all()
    # (no key: the sink takes all the mass, so lse is the sink's logit)
    assert (out[3] == 0).all()
    np.testing.assert_array_equal(lse[3], np.repeat(np.asarray(SPEC.sinks)[:, None], tq, 1))
    np.testing.assert_array_equal(np.asarray(gk)[1:], kc[1:])  # untouched, bit for bit
    np.testing.assert_array_equal(np.asarray(gv)[1:], vc[1:])
    want_out, _ = dense_causal(q[:1], np.concatenate([kc[0, :4], kn[0]])[None],
                               np.concatenate([vc[0, :4], vn[0]])[None])
    np.testing.assert_allclose(out[0], want_out[0], atol=ATOL, rtol=ATOL)
    np.testing.assert_array_equal(np.asarray(gk)[0, 4:6], kn[0])

    # checked=True reports the first such sequence through checkify.
    f = jax.jit(checkify.checkify(functools.partial(decode_with_update, checked=True)))
    err, _ = f(SPEC, *(jnp.asarray(x) for x in (q, kn, vn, kc, vc)), kv_lengths=lengths,
               kv_starts=starts)
    assert "kv_starts[4] = -1 is outside the cache [0, S=16]" in err.get()
    err, _ = f(SPEC, *(jnp.asarray(x) for x in (q, kn, vn, kc, vc)),
               kv_lengths=jnp.array([6, S - 2, 2, 0, 4]), kv_starts=jnp.array([0, 3, 0, 5, 0]))
    assert "kv_starts[1] + kv_lengths[1] = 3 + 14 is past the cache's S=16 slots" in err.get()
    err, _ = f(SPEC, *(jnp.asarray(x) for x in (q, kn, vn, kc, vc)),
               kv_lengths=jnp.array([6, 5, 2, 0, 4]), kv_starts=jnp.array([0, 3, 0, 5, 0]))
    assert err.get() is None


def test_low_precision_cache_stores_the_new_tokens_cast():
    rng = np.random.default_rng(4)
    kc = jnp.zeros((B, S, HKV, D), jnp.bfloat16)
    vc = jnp.zeros((B, S, HKV, DV), jnp.bfloat16)
    q = jnp.asarray(normal(rng, B, 1, HQ, D), jnp.bfloat16)
    kn, vn = normal(rng, B, 1, HKV, D), normal(rng, B, 1, HKV, DV)  # float32
    res, gk, gv = update(SPEC, q, jnp.asarray(kn), jnp.asarray(vn), kc, vc,
                         kv_lengths=jnp.array([1, 2, 3]))
    assert gk.dtype == gv.dtype == res.out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(gk[2, 2], np.float32),
                                  np.asarray(jnp.asarray(kn[2, 0], jnp.bfloat16), np.float32))


# ----------------------------------------------------------------------------------
# Messages
# ----------------------------------------------------------------------------------


def _args(tq=1, s=S):
    return (jnp.zeros((B, tq, HQ, D)), jnp.zeros((B, tq, HKV, D)), jnp.zeros((B, tq, HKV, DV)),
            jnp.zeros((B, s, HKV, D)), jnp.zeros((B, s, HKV, DV)))


def test_static_capacity_overflow_is_refused():
    q, kn, vn, kc, vc = _args(tq=5, s=4)
    with pytest.raises(ValueError) as info:
        update(SPEC, q, kn, vn, kc, vc, kv_lengths=jnp.array([5, 5, 5]))
    assert str(info.value) == (
        "decode_with_update: the Tq=5 new tokens of a sequence (q (3, 5, 6, 8)) cannot fit "
        "in a cache of S=4 slots (k_cache (3, 4, 2, 8)); use a cache of at least 5 slots.")
    # Lengths that are not traced are checked at once.
    with pytest.raises(ValueError) as info:
        decode_with_update(SPEC, *_args(tq=2), kv_lengths=jnp.array([4, 15, 2]),
                           kv_starts=jnp.array([0, 3, 0]))
    assert str(info.value) == (
        "decode_with_update: sequence 1 does not fit: its slots would be kv_starts[1] = 3 "
        "to kv_starts[1] + kv_lengths[1] = 18, holding its Tq=2 new tokens, in a cache of "
        "S=16 slots (0 <= kv_starts, kv_lengths = 0 or >= Tq, kv_starts + kv_lengths <= S). "
        "kv_lengths counts the new tokens; stop the sequence or give it a longer cache.")
    with pytest.raises(ValueError, match="sequence 2 does not fit"):
        decode_with_update(SPEC, *_args(tq=2), kv_lengths=jnp.array([4, 0, 1]))


def test_shape_and_type_messages():
    q, kn, vn, kc, vc = _args(tq=3)
    L = jnp.array([3, 3, 3])
    with pytest.raises(ValueError) as info:
        update(SPEC, q, kn[:, :1], vn, kc, vc, kv_lengths=L)
    assert str(info.value) == (
        "decode_with_update: k_new must have shape (B, Tq, Hkv, D)=(3, 3, 2, 8) for layout "
        "'bthd', from q (3, 3, 6, 8) and the cache (3, 16, 2, 8); got (3, 1, 2, 8)")
    with pytest.raises(ValueError) as info:  # v_new left in "bthd"
        update(SPEC.replace(layout="bhtd"), q.swapaxes(1, 2), kn.swapaxes(1, 2),
               vn, kc.swapaxes(1, 2), vc.swapaxes(1, 2), kv_lengths=L)
    assert str(info.value) == (
        "decode_with_update: v_new must have shape (B, Hkv, Tq, Dv)=(3, 2, 3, 4) for layout "
        "'bhtd', from q (3, 6, 3, 8) and the cache (3, 2, 16, 4); got (3, 3, 2, 4)")
    # decode's own checks, named for this function.
    with pytest.raises(ValueError) as info:
        update(SPEC, q, kn, vn, kc[:2], vc[:2], kv_lengths=L)
    assert str(info.value) == ("decode_with_update: batch mismatch: k must have batch B=3 "
                               "like q (3, 3, 6, 8); got k (2, 16, 2, 8)")
    with pytest.raises(ValueError) as info:
        update(SPEC, q, kn, vn, kc, vc, kv_lengths=L[:2])
    assert str(info.value) == ("decode_with_update: kv_lengths must have shape (B,)=(3,), "
                               "one per sequence of q (3, 3, 6, 8); got (2,)")
    with pytest.raises(TypeError) as info:
        update(SPEC, q, kn, vn.astype(jnp.int32), kc, vc, kv_lengths=L)
    assert str(info.value) == ("decode_with_update: v_new must be a floating-point array "
                               "(float32, bfloat16 or float16); got int32 with shape "
                               "(3, 3, 2, 4)")
    with pytest.raises(NotImplementedError, match="^decode_with_update: spec.bias"):
        update(SPEC.replace(bias=jnp.zeros((1,))), q, kn, vn, kc, vc, kv_lengths=L)


@pytest.mark.parametrize("layout,tq,formats", [
    ("bthd", 1, ("int8", "int4")), ("bhtd", 2, ("float8_e4m3fn", "float8_e5m2")),
    ("bthd", 3, ("int4-tensor", "float8_e4m3fn-tensor"))])
def test_quantized_cache_writes_quantize_codes_then_decodes(layout, tq, formats):
    """Quantized caches: the written codes and scales are fnattn.quant.quantize's of the
    new tokens, bit for bit; the result is decode on the written cache, which is the
    float64 reference on its dequantized values (tests/test_decoding.py)."""
    from fnattn import quant
    from fnattn.quant import QuantFormat
    fmts = [QuantFormat(*f.split("-")) for f in formats]
    rng = np.random.default_rng(1)
    spec = SPEC.replace(layout=layout)
    lengths = np.array([tq + 5, S - 4, tq], np.int32)
    starts = np.array([3, 4, 0], np.int32)
    kc = to_layout(normal(rng, B, S, HKV, D), layout)
    vc = to_layout(normal(rng, B, S, HKV, D), layout)

    def q8(x, f):
        return quant.quantize(jnp.asarray(x), f, scale=None if f.per_token else 3.0 / f.max_code)
    kq, vq = q8(kc, fmts[0]), q8(vc, fmts[1])
    q = jnp.asarray(to_layout(normal(rng, B, tq, HQ, D), layout))
    kn = jnp.asarray(to_layout(normal(rng, B, tq, HKV, D), layout))
    vn = jnp.asarray(to_layout(normal(rng, B, tq, HKV, D), layout))
    got, gk, gv = update(spec, q, kn, vn, kq, vq, kv_lengths=jnp.asarray(lengths),
                         kv_starts=jnp.asarray(starts))
    axis = 1 if layout == "bthd" else 2
    for cache, new, old in ((gk, kn, kq), (gv, vn, vq)):
        want = q8(new, cache.format)
        for b in range(B):
            end = starts[b] + lengths[b]
            idx = (b, slice(end - tq, end)) if axis == 1 else (b, slice(None),
                                                              slice(end - tq, end))
            np.testing.assert_array_equal(np.asarray(cache.data[idx]).view(np.uint8),
                                          np.asarray(want.data[b]).view(np.uint8))
            if cache.format.per_token:
                np.testing.assert_array_equal(cache.scale[idx], want.scale[b])
            # the other slots are untouched
            keep = np.ones(S, bool)
            keep[end - tq:end] = False
            sel = (b, keep) if axis == 1 else (b, slice(None), keep)
            np.testing.assert_array_equal(np.asarray(cache.data[sel]).view(np.uint8),
                                          np.asarray(old.data[sel]).view(np.uint8))
    want = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=lengths,
                                                 kv_starts=starts))(q, gk, gv)
    np.testing.assert_array_equal(got.out, want.out)
    # and decode on the quantized cache is the float reference on its dequantized values
    ref = jax.jit(lambda q, k, v: fnattn.decode(spec.replace(impl="reference"), q, k, v,
                                                kv_lengths=lengths, kv_starts=starts))(
        q, quant.dequantize(gk), quant.dequantize(gv))
    np.testing.assert_allclose(got.out, ref.out, atol=ATOL, rtol=ATOL)


def test_latent_cache_update_writes_the_latent_then_decodes():
    """A latent cache (value_dim): k_new holds latent and rope channels, no values. On a
    float cache the result equals decode_with_update with separate values k[..., :Dc];
    on an int8 cache the written codes are quantize's and the result is decode's on the
    written cache with its values sliced from the dequantized keys."""
    from fnattn import quant
    rng = np.random.default_rng(2)
    Dc, Dr, tq = 6, 2, 2
    kc = jnp.asarray(normal(rng, B, S, 1, Dc + Dr))
    q = jnp.asarray(normal(rng, B, tq, HQ, Dc + Dr))
    kn = jnp.asarray(normal(rng, B, tq, 1, Dc + Dr))
    lengths, starts = jnp.array([tq + 5, S - 4, tq]), jnp.array([3, 4, 0])
    got, gk, gv = update(SPEC, q, kn, None, kc, None, kv_lengths=lengths, kv_starts=starts,
                         value_dim=Dc)
    assert gv is None
    want, wk, _ = update(SPEC, q, kn, kn[..., :Dc], kc, kc[..., :Dc], kv_lengths=lengths,
                         kv_starts=starts)
    np.testing.assert_allclose(got.out, want.out, atol=ATOL, rtol=ATOL)
    np.testing.assert_array_equal(gk, wk)
    got, gk, gv = update(SPEC, q, kn, None, quant.quantize(kc, "int8"), None,
                         kv_lengths=lengths, kv_starts=starts, value_dim=Dc)
    first = int(starts[0] + lengths[0]) - tq                     # sequence 0's new slots
    np.testing.assert_array_equal(gk.data[0, first:first + tq], quant.quantize(kn, "int8").data[0])
    kd = quant.dequantize(gk)
    want = jax.jit(lambda q, k, v: fnattn.decode(SPEC, q, k, v, kv_lengths=lengths,
                                                 kv_starts=starts))(q, kd, kd[..., :Dc])
    np.testing.assert_allclose(got.out, want.out, atol=ATOL, rtol=ATOL)
