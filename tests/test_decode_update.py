"""fnattn.decoding.decode_with_update: the write equals writing by hand then
fnattn.decode; steps in a loop equal dense causal attention over the whole
sequence; GQA, per-sequence lengths and starts, both layouts; NaN cache slots
contribute nothing; sequences that do not fit get NaN and write nothing (or a
ValueError / checkify error); gradients equal those of the dense reference.
q_lengths: ragged prompts prefilled in one call then decoded equal float64
references and each prompt alone (float, quantized, latent caches), padding rows give
zeros and no gradient, bad counts are refused. Everything under jax.jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from np_attention import np_attention, np_causal_tail

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


# ----------------------------------------------------------------------------------
# q_lengths: a number of new tokens per sequence (right-padded rows)
# ----------------------------------------------------------------------------------

PROMPTS = np.array([5, 1, 3, 0], np.int32)    # 4 sequences, one still empty
STARTS = np.array([0, 2, 1, 0], np.int32)
RB = len(PROMPTS)


def np_masked(q, k, v, keep):
    """float64 attention with SPEC's sinks, `keep` (Tq, Tk) the visible keys."""
    out, lse, _ = np_attention(q, k, v, mask=keep, sinks=np.asarray(SPEC.sinks))
    return out, lse


def visible(mask_kind, q_pos, n_keys):
    k = np.arange(n_keys)[None, :]
    qp = np.asarray(q_pos)[:, None]
    keep = k <= qp
    if mask_kind == "window":        # sliding_window(left=2)
        keep &= k >= qp - 2
    return keep


def ragged_rows(rng, tq, counts, layout, nan_padding=True):
    """q, k_new, v_new of RB sequences with counts[b] tokens each, the padding rows NaN."""
    q, kn, vn = (normal(rng, RB, tq, HQ, D), normal(rng, RB, tq, HKV, D),
                 normal(rng, RB, tq, HKV, DV))
    if nan_padding:
        for x in (q, kn, vn):
            for b in range(RB):
                x[b, counts[b]:] = np.nan
    return q, kn, vn


@pytest.mark.parametrize("layout,mask_kind,impl", [
    ("bthd", "causal", "auto"), ("bhtd", "window", "xla"), ("bthd", "causal", "pallas")])
def test_ragged_prefill_then_decode_equals_float64_references(layout, mask_kind, impl):
    """Prompts of 5, 1, 3 and 0 tokens right-padded to Tq=5 (padding rows NaN, cache
    poisoned with NaN) prefilled in one call; then three one-token steps in which
    sequences pause (q_lengths 0) or start. Every valid row equals float64 attention
    over the sequence's tokens so far, padding rows are 0 with lse -inf, writes land
    at the sequence's next slots only, and each prompt prefilled alone gives the same
    result and the same cache row."""
    rng = np.random.default_rng(10)
    mask = masks.causal() if mask_kind == "causal" else masks.sliding_window(2)
    spec = SPEC.replace(layout=layout, mask=mask, impl=impl)
    schedule = [PROMPTS, np.array([1, 1, 0, 1]), np.array([1, 0, 1, 1]),
                np.array([1, 1, 1, 0])]
    kc = jnp.asarray(poisoned_cache(rng, D, layout)[:1].repeat(RB, 0))
    vc = jnp.asarray(poisoned_cache(rng, DV, layout)[:1].repeat(RB, 0))
    seq_q, seq_k, seq_v = ([[] for _ in range(RB)] for _ in range(3))  # tokens so far
    lengths = np.zeros(RB, np.int32)
    for step, counts in enumerate(schedule):
        counts = np.asarray(counts, np.int32)
        tq = int(counts.max())
        q, kn, vn = ragged_rows(rng, tq, counts, layout)
        lengths = lengths + counts
        res, kc, vc = update(spec, *(jnp.asarray(to_layout(x, layout)) for x in (q, kn, vn)),
                             kc, vc, kv_lengths=jnp.asarray(lengths),
                             kv_starts=jnp.asarray(STARTS), q_lengths=jnp.asarray(counts))
        out = np.asarray(res.out) if layout == "bthd" else np.swapaxes(res.out, 1, 2)
        lse = np.asarray(res.lse)
        kb = np.asarray(kc) if layout == "bthd" else np.swapaxes(np.asarray(kc), 1, 2)
        for b in range(RB):
            n = int(counts[b])
            seq_q[b] += list(q[b, :n])
            seq_k[b] += list(kn[b, :n])
            seq_v[b] += list(vn[b, :n])
            assert (out[b, n:] == 0).all() and (lse[b, :, n:] == -np.inf).all()
            L = int(lengths[b])
            if L:   # the cache row holds the sequence in order; NaN after it
                np.testing.assert_array_equal(kb[b, STARTS[b]:STARTS[b] + L],
                                              np.stack(seq_k[b]))
            assert np.isnan(kb[b, STARTS[b] + L:]).all() and np.isnan(kb[b, :STARTS[b]]).all()
            if not n:
                continue
            pos = np.arange(L - n, L)
            want_out, want_lse = np_masked(q[b:b + 1, :n], np.stack(seq_k[b])[None],
                                           np.stack(seq_v[b])[None], visible(mask_kind, pos, L))
            np.testing.assert_allclose(out[b, :n], want_out[0], atol=ATOL, rtol=ATOL)
            np.testing.assert_allclose(lse[b, :, :n], want_lse[0], atol=ATOL, rtol=ATOL)
        if step == 0:    # each prompt alone (no q_lengths, its own Tq)
            for b in np.flatnonzero(PROMPTS):
                n = int(PROMPTS[b])
                alone, ka, _ = update(
                    spec, *(jnp.asarray(to_layout(x[b:b + 1, :n], layout)) for x in (q, kn, vn)),
                    kc[b:b + 1] * np.nan, vc[b:b + 1] * np.nan, kv_lengths=jnp.array([n]),
                    kv_starts=jnp.asarray(STARTS[b:b + 1]))
                a = np.asarray(alone.out) if layout == "bthd" else np.swapaxes(alone.out, 1, 2)
                np.testing.assert_allclose(out[b, :n], a[0], atol=1e-6, rtol=1e-6)
                np.testing.assert_array_equal(ka, kc[b:b + 1])


def test_ragged_gradients_equal_dense_and_skip_the_padding():
    """d/d(q, k_new, v_new) through a ragged prefill over an earlier context (cache and
    padding rows NaN) equal fnattn.reference's on each sequence's tokens; the padding
    rows get exactly zero."""
    rng = np.random.default_rng(11)
    tq, counts = 3, np.array([3, 1, 0, 2], np.int32)
    prefix = np.array([2, 0, 4, 5], np.int32)
    kc, vc = (poisoned_cache(rng, d, "bthd")[:1].repeat(RB, 0) for d in (D, DV))
    old_k = [normal(rng, p, HKV, D) for p in prefix]
    old_v = [normal(rng, p, HKV, DV) for p in prefix]
    for b in range(RB):
        kc[b, STARTS[b]:STARTS[b] + prefix[b]] = old_k[b]
        vc[b, STARTS[b]:STARTS[b] + prefix[b]] = old_v[b]
    q, kn, vn = ragged_rows(rng, tq, counts, "bthd")
    w = jnp.asarray(normal(rng, RB, tq, HQ, DV))
    lengths = jnp.asarray(prefix + counts)

    @jax.jit
    def loss(q, kn, vn):
        res, _, _ = decode_with_update(SPEC, q, kn, vn, jnp.asarray(kc), jnp.asarray(vc),
                                       kv_lengths=lengths, kv_starts=jnp.asarray(STARTS),
                                       q_lengths=jnp.asarray(counts))
        return jnp.sum(res.out * w) + 0.1 * jnp.sum(jnp.where(jnp.isinf(res.lse), 0, res.lse))

    @jax.jit
    def dense_loss(q, kn, vn):
        total = 0.0
        for b in np.flatnonzero(counts):
            n = int(counts[b])
            k = jnp.concatenate([old_k[b], kn[b, :n]])[None]
            v = jnp.concatenate([old_v[b], vn[b, :n]])[None]
            res = fnattn.reference(SPEC, q[b:b + 1, :n], k, v)
            total += jnp.sum(res.out[0] * w[b, :n]) + 0.1 * jnp.sum(res.lse)
        return total

    args = [jnp.asarray(x) for x in (q, kn, vn)]
    clean = [jnp.nan_to_num(x) for x in args]           # the reference never reads padding
    np.testing.assert_allclose(loss(*args), dense_loss(*clean), rtol=1e-5)
    got = jax.grad(loss, argnums=(0, 1, 2))(*args)
    want = jax.grad(dense_loss, argnums=(0, 1, 2))(*clean)
    for g, r in zip(got, want):
        g = np.asarray(g)
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)
        for b in range(RB):
            assert (g[b, counts[b]:] == 0).all()


@pytest.mark.parametrize("formats", [("int8", "int4"), ("float8_e4m3fn-tensor", "int8")])
def test_ragged_prefill_into_quantized_cache_equals_each_prompt_alone(formats):
    """Quantized caches through q_lengths: the codes (and per-token scales) written for
    each prompt are those of the prompt prefilled alone, bit for bit; the padding
    writes nothing; the results match."""
    from fnattn import quant
    from fnattn.quant import QuantFormat
    fmts = [QuantFormat(*f.split("-")) for f in formats]
    rng = np.random.default_rng(12)
    q8 = lambda x, f: quant.quantize(jnp.asarray(x), f,  # noqa: E731
                                     scale=None if f.per_token else 3.0 / f.max_code)
    kq = q8(normal(rng, RB, S, HKV, D), fmts[0])
    vq = q8(normal(rng, RB, S, HKV, DV), fmts[1])
    tq = int(PROMPTS.max())
    q, kn, vn = ragged_rows(rng, tq, PROMPTS, "bthd", nan_padding=False)
    res, gk, gv = update(SPEC, *(jnp.asarray(x) for x in (q, kn, vn)), kq, vq,
                         kv_lengths=jnp.asarray(PROMPTS), kv_starts=jnp.asarray(STARTS),
                         q_lengths=jnp.asarray(PROMPTS))
    for b in range(RB):
        n, s0 = int(PROMPTS[b]), int(STARTS[b])
        keep = np.ones(S, bool)
        keep[s0:s0 + n] = False
        for got, old in ((gk, kq), (gv, vq)):
            np.testing.assert_array_equal(np.asarray(got.data[b, keep]).view(np.uint8),
                                          np.asarray(old.data[b, keep]).view(np.uint8))
        if not n:
            assert (np.asarray(res.out[b]) == 0).all()
            continue
        alone, ka, va = update(SPEC, *(jnp.asarray(x[b:b + 1, :n]) for x in (q, kn, vn)),
                               kq[b:b + 1], vq[b:b + 1], kv_lengths=jnp.array([n]),
                               kv_starts=jnp.asarray(STARTS[b:b + 1]))
        for got, a in ((gk, ka), (gv, va)):
            np.testing.assert_array_equal(np.asarray(got.data[b]).view(np.uint8),
                                          np.asarray(a.data[0]).view(np.uint8))
            if got.format.per_token:
                np.testing.assert_array_equal(got.scale[b], a.scale[0])
        np.testing.assert_allclose(res.out[b, :n], alone.out[0], atol=1e-6, rtol=1e-6)


def test_ragged_prefill_into_latent_cache():
    """A latent cache (value_dim) through q_lengths equals the float cache with the
    values sliced from the keys, and writes the same latent rows."""
    rng = np.random.default_rng(13)
    Dc, Dr, tq = 6, 2, int(PROMPTS.max())
    kc = jnp.asarray(normal(rng, RB, S, 1, Dc + Dr))
    q = jnp.asarray(normal(rng, RB, tq, HQ, Dc + Dr))
    kn = jnp.asarray(normal(rng, RB, tq, 1, Dc + Dr))
    kw = dict(kv_lengths=jnp.asarray(PROMPTS + 2), kv_starts=jnp.asarray(STARTS),
              q_lengths=jnp.asarray(PROMPTS))
    got, gk, gv = update(SPEC, q, kn, None, kc, None, value_dim=Dc, **kw)
    want, wk, _ = update(SPEC, q, kn, kn[..., :Dc], kc, kc[..., :Dc], **kw)
    assert gv is None
    np.testing.assert_allclose(got.out, want.out, atol=ATOL, rtol=ATOL)
    np.testing.assert_array_equal(gk, wk)
    assert (np.asarray(got.out[3]) == 0).all() and (np.asarray(got.out[1, 1:]) == 0).all()


def test_ragged_counts_that_do_not_fit():
    """Concrete values: a ValueError naming the argument; traced ones (under jit): the
    sequence gets NaN and writes nothing, the others are unaffected; checked=True
    reports them through checkify."""
    tq = 3
    q, kn, vn = (jnp.ones((RB, tq, HQ, D)), jnp.ones((RB, tq, HKV, D)),
                 jnp.ones((RB, tq, HKV, DV)))
    kc, vc = jnp.zeros((RB, S, HKV, D)), jnp.zeros((RB, S, HKV, DV))
    ok = dict(kv_lengths=jnp.array([3, 1, 2, 0]), q_lengths=jnp.array([3, 1, 2, 0]))
    bad = {"q_lengths[1] = 4 must be in [0, Tq=3]": dict(q_lengths=jnp.array([3, 4, 2, 0]),
                                                        kv_lengths=jnp.array([3, 4, 2, 0])),
           "q_lengths[2] = -1 must be in [0, Tq=3]": dict(q_lengths=jnp.array([3, 1, -1, 0])),
           "q_lengths[0] = 3 new tokens exceed kv_lengths[0] = 2":
               dict(kv_lengths=jnp.array([2, 1, 2, 0])),
           "sequence 3 does not fit: its slots would be kv_starts[3] = 15 to kv_starts[3] + "
           "kv_lengths[3] = 17": dict(kv_lengths=jnp.array([3, 1, 2, 2]),
                                      kv_starts=jnp.array([0, 0, 0, 15]))}
    for msg, change in bad.items():
        with pytest.raises(ValueError) as info:
            decode_with_update(SPEC, q, kn, vn, kc, vc, **{**ok, **change})
        assert str(info.value).startswith("decode_with_update: " + msg), str(info.value)
    # traced: each bad sequence is NaN and leaves its row as it was
    traced = dict(kv_lengths=jnp.array([3, 1, 1, 2]), q_lengths=jnp.array([4, 1, 2, 1]),
                  kv_starts=jnp.array([0, 0, 0, 15]))
    res, gk, _ = update(SPEC, q, kn, vn, kc, vc, **traced)
    out = np.asarray(res.out)
    assert np.isnan(out[[0, 2, 3]]).all() and np.isnan(np.asarray(res.lse)[[0, 2, 3]]).all()
    assert (np.asarray(gk)[[0, 2, 3]] == 0).all()
    assert (np.asarray(gk)[1, 0] == 1).all() and (np.asarray(gk)[1, 1:] == 0).all()
    assert np.isfinite(out[1, :1]).all() and (out[1, 1:] == 0).all()
    f = jax.jit(checkify.checkify(functools.partial(decode_with_update, checked=True)))
    inside = {**traced, "kv_starts": jnp.array([0, 0, 0, 0])}
    for msg, change in (("q_lengths[0] = 4 is outside [0, Tq=3]", inside),
                        ("q_lengths[2] = 2 exceeds kv_lengths[2] = 1",
                         {**inside, "q_lengths": jnp.array([3, 1, 2, 1])}),
                        ("kv_starts[3] + kv_lengths[3] = 15 + 2 is past the cache's S=16",
                         {**traced, "q_lengths": jnp.array([3, 1, 1, 1]),
                          "kv_lengths": jnp.array([3, 1, 1, 2])})):
        err, _ = f(SPEC, q, kn, vn, kc, vc, **change)
        assert msg in err.get(), err.get()
    err, _ = f(SPEC, q, kn, vn, kc, vc, **ok)
    assert err.get() is None


def test_ragged_argument_messages():
    q, kn, vn, kc, vc = _args(tq=2)
    L = jnp.array([2, 2, 2])
    with pytest.raises(ValueError) as info:
        update(SPEC, q, kn, vn, kc, vc, kv_lengths=L, q_lengths=jnp.array([1, 2]))
    assert str(info.value) == ("decode_with_update: q_lengths must have shape (B,)=(3,), the "
                               "number of new tokens of each sequence; got (2,)")
    with pytest.raises(TypeError, match="^decode_with_update: q_lengths must be an integer"):
        update(SPEC, q, kn, vn, kc, vc, kv_lengths=L, q_lengths=jnp.ones(3))
    spec = SPEC.replace(mask=masks.causal() & masks.from_fn(lambda b, h, q, k: q >= 0))
    with pytest.raises(NotImplementedError, match="^decode_with_update: a masks.from_fn mask"):
        update(spec, q, kn, vn, kc, vc, kv_lengths=L, q_lengths=jnp.array([1, 2, 0]))
