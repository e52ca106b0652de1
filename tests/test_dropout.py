"""The dropout keep mask: a pure, reproducible function of (seed, b, h, q, k).

Kernels must reproduce it bit for bit, so its bits are pinned here by a NumPy
re-implementation of the documented hash.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, dropout, masks

M32 = np.uint64(0xFFFFFFFF)


def _np_fmix32(h):
    h = h.astype(np.uint64)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & M32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & M32
    h ^= h >> np.uint64(16)
    return h


def np_random_bits(seed, b, h, q, k):
    """MurmurHash3's finaliser after adding each index, times its own odd constant
    (for q and k: seed words 4 and 5, the constant times a stride), and one seed word."""
    s0, s1, s2, s3, cq, ck = (np.uint64(int(x)) for x in np.asarray(seed))

    def mul(x, c):
        return (np.asarray(x, np.uint64) * np.uint64(c)) & M32

    x = _np_fmix32((s0 + mul(b, 0x9E3779B1)) & M32)
    x = _np_fmix32((x + s1 + mul(h, 0x85EBCA77)) & M32)
    x = _np_fmix32((x + s2 + mul(q, cq)) & M32)
    x = _np_fmix32((x + s3 + mul(k, ck)) & M32)
    return x.astype(np.uint32)


def _grid(B=2, H=3, Tq=5, Tk=7):
    return np.ix_(np.arange(B), np.arange(H), np.arange(Tq), np.arange(Tk))


def test_bits_match_the_documented_hash():
    seed = dropout.seed_from_key(jax.random.key(3))
    b, h, q, k = _grid()
    bits = jax.jit(lambda s: dropout.random_bits(s, b, h, q, k))(seed)
    assert bits.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(bits), np_random_bits(seed, b, h, q, k))
    keep = jax.jit(lambda s: dropout.keep_mask(s, b, h, q, k, 0.3))(seed)
    np.testing.assert_array_equal(np.asarray(keep),
                                  np_random_bits(seed, b, h, q, k) >= dropout.threshold(0.3))


def test_large_indices_wrap_like_uint32():
    seed = jnp.array([0xDEADBEEF, 0x12345678, 0x0BADF00D, 0x7, 0xC2B2AE3D, 0x27D4EB2F],
                     jnp.uint32)
    idx = np.array([0, 1, 2**20 + 3, 2**31 - 1])
    bits = jax.jit(lambda s: dropout.random_bits(s, idx, idx[::-1], idx, idx[::-1]))(seed)
    np.testing.assert_array_equal(np.asarray(bits),
                                  np_random_bits(seed, idx, idx[::-1], idx, idx[::-1]))


def test_keep_rate_and_determinism():
    seed = dropout.seed_from_key(jax.random.key(3))
    b, h, q, k = _grid(2, 3, 64, 64)
    keep = jax.jit(lambda s: dropout.keep_mask(s, b, h, q, k, 0.25))(seed)
    assert abs(float(keep.mean()) - 0.75) < 0.02
    np.testing.assert_array_equal(keep, dropout.keep_mask(seed, b, h, q, k, 0.25))
    other = dropout.keep_mask(dropout.seed_from_key(jax.random.key(4)), b, h, q, k, 0.25)
    assert (np.asarray(other) != np.asarray(keep)).mean() > 0.2
    # each index matters
    for shifted in [(b + 1, h, q, k), (b, h + 1, q, k), (b, h, q + 1, k), (b, h, q, k + 1)]:
        assert (np.asarray(dropout.keep_mask(seed, *shifted, 0.25)) != np.asarray(keep)).any()


def test_thresholds():
    assert dropout.threshold(0.0) == 0
    assert dropout.threshold(0.5) == 2**31
    assert dropout.threshold(0.999999999999) == 2**32 - 1
    seed = dropout.seed_from_key(jnp.array([1, 2], jnp.uint32))
    assert bool(dropout.keep_mask(seed, 0, 0, jnp.arange(100), 0, 0.0).all())


@pytest.mark.parametrize("key", [jax.random.key(5), jax.random.PRNGKey(5)])
def test_seed_from_typed_and_raw_keys(key):
    seed = jax.jit(dropout.seed_from_key)(key)
    assert seed.shape == (dropout.SEED_WORDS,) and seed.dtype == jnp.uint32
    data = key if key.dtype == jnp.uint32 else jax.random.key_data(key)
    np.testing.assert_array_equal(seed, np.concatenate([np.asarray(data).reshape(-1)[:2],
                                                        [0, 0, 0xC2B2AE3D, 0x27D4EB2F]]))


@pytest.mark.parametrize("key, message", [
    (jnp.array([0.5, 1.5]), "float32 with shape \\(2,\\).*A float array is not a key"),
    (jnp.array([7], jnp.uint32), "uint32 with shape \\(1,\\)"),
    (jax.random.split(jax.random.key(0), 3), "one PRNG key; got a batch of keys of shape \\(3,\\)"),
    (jnp.zeros((3, 2), jnp.uint32), "A batch of raw keys is not one key"),
])
def test_bad_keys_are_refused(key, message):
    q = jnp.ones((1, 3, 2, 4))
    spec = AttentionSpec(dropout_rate=0.5, dropout_key=key)
    with pytest.raises((TypeError, ValueError), match="dropout_key must be " + ".*" + message):
        jax.jit(fnattn.attention)(spec, q, q, q)


def test_weights_match_the_mask():
    q = jax.random.normal(jax.random.key(0), (2, 5, 3, 7))
    spec = AttentionSpec(dropout_rate=0.5, dropout_key=jax.random.key(1))
    res, w = jax.jit(lambda s, q: fnattn.reference(s, q, q, q, return_weights=True))(spec, q)
    _, w0 = jax.jit(lambda s, q: fnattn.reference(s, q, q, q, return_weights=True))(
        spec.replace(dropout_rate=0.0, dropout_key=None), q)
    b, h, qi, ki = _grid(2, 3, 5, 5)
    keep = np_random_bits(dropout.seed_from_key(spec.dropout_key), b, h, qi, ki) >= 2**31
    np.testing.assert_allclose(np.asarray(w), np.where(keep, np.asarray(w0) * 2, 0), rtol=1e-6)
    out = np.einsum("bhqk,bkhd->bqhd", np.asarray(w), np.asarray(q))
    np.testing.assert_allclose(np.asarray(res.out), out, rtol=1e-5, atol=1e-5)


def test_lse_is_the_pre_dropout_value():
    q = jax.random.normal(jax.random.key(0), (2, 5, 3, 7))
    spec = AttentionSpec(mask=masks.causal(), dropout_rate=0.4, dropout_key=jax.random.key(1))
    for impl in ("xla", "reference"):
        a = jax.jit(fnattn.attention)(spec.replace(impl=impl), q, q, q)
        b = jax.jit(fnattn.attention)(spec.replace(impl=impl, dropout_rate=0.0), q, q, q)
        np.testing.assert_allclose(np.asarray(a.lse), np.asarray(b.lse), rtol=1e-6)
        assert not np.allclose(np.asarray(a.out), np.asarray(b.out))


def test_batch_index_is_the_one_seen_by_the_call():
    # Under vmap the batch index inside the call is 0 for every example: pass one
    # key per example (vmap the key) to draw independent masks.
    q = jax.random.normal(jax.random.key(0), (3, 1, 5, 2, 7))
    spec = AttentionSpec(dropout_rate=0.5, dropout_key=jax.random.key(1), impl="xla")
    f = jax.jit(jax.vmap(lambda s, q: fnattn.attention(s, q, q, q).out,
                         in_axes=(spec.replace(dropout_key=None), 0)))
    same = f(spec, q)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(same[i]),
                                    np.asarray(fnattn.reference(spec, q[i], q[i], q[i]).out),
                                    atol=1e-6)
    keys = jax.random.split(jax.random.key(1), 3)
    per = jax.jit(jax.vmap(lambda s, q: fnattn.attention(s, q, q, q).out,
                           in_axes=(spec.replace(dropout_key=0), 0)))(
        spec.replace(dropout_key=keys), q)
    for i in range(3):
        one = fnattn.reference(spec.replace(dropout_key=keys[i]), q[i], q[i], q[i]).out
        np.testing.assert_allclose(np.asarray(per[i]), np.asarray(one), atol=1e-6)


def test_offsets_give_the_rows_of_the_whole_problem():
    # A call on a slice (batch rows 1:3, query heads 2:4, queries 3:7) with
    # dropout_offsets = its first global index draws exactly the whole problem's
    # mask there, in every lowering; without offsets it draws another one.
    rs = np.random.default_rng(0)
    q = jnp.asarray(rs.standard_normal((3, 7, 4, 8)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((3, 9, 2, 8)), jnp.float32)
    spec = AttentionSpec(dropout_rate=0.5, dropout_key=jax.random.key(2),
                         block_sizes=fnattn.XlaBlockSizes(8, 8))
    qs, ks = q[1:3, 3:7, 2:4], k[1:3, :, 1:2]
    offsets = jnp.array([1, 2, 3, 0], jnp.int32)
    for impl in ("reference", "xla", "auto"):
        s = spec.replace(impl=impl)
        whole = jax.jit(fnattn.attention)(s, q, k, k).out[1:3, 3:7, 2:4]
        part = jax.jit(fnattn.attention)(s.replace(dropout_offsets=offsets), qs, ks, ks).out
        np.testing.assert_allclose(np.asarray(part), np.asarray(whole), atol=1e-6, err_msg=impl)
        other = jax.jit(fnattn.attention)(s, qs, ks, ks).out
        assert not np.allclose(np.asarray(other), np.asarray(whole), atol=1e-3), impl


def test_vmap_with_batched_offsets_equals_the_batched_call():
    q = jax.random.normal(jax.random.key(0), (3, 5, 2, 7))
    spec = AttentionSpec(dropout_rate=0.5, dropout_key=jax.random.key(1), impl="auto")
    whole = jax.jit(fnattn.attention)(spec, q, q, q).out
    offsets = jnp.zeros((3, 4), jnp.int32).at[:, 0].set(jnp.arange(3))
    f = jax.jit(jax.vmap(lambda s, q: fnattn.attention(s, q[None], q[None], q[None]).out[0],
                         in_axes=(spec.replace(dropout_key=None, dropout_offsets=0), 0)))
    per = f(spec.replace(dropout_offsets=offsets), q)
    np.testing.assert_allclose(np.asarray(per), np.asarray(whole), atol=1e-6)


@pytest.mark.parametrize("offsets, message", [
    (jnp.zeros((3,), jnp.int32), "shape \\(3,\\)"),
    (jnp.zeros((4,), jnp.float32), "float32"),
])
def test_bad_offsets_are_refused(offsets, message):
    q = jnp.ones((1, 3, 2, 4))
    spec = AttentionSpec(dropout_rate=0.5, dropout_key=jax.random.key(0),
                         dropout_offsets=offsets)
    with pytest.raises(ValueError, match="dropout_offsets must be an integer array of shape "
                                         "\\(4,\\).*" + message):
        jax.jit(fnattn.attention)(spec, q, q, q)


def test_offsets_and_strides_hash_global_positions():
    # Local row i and key j of a call with offsets (b0, h0, q0, k0) and strides
    # (sq, sk) draw the bits of global (b0 + b, h0 + h, q0 + sq * i, k0 + sk * j):
    # what a device holding every 4th token (the striped layout) needs.
    key = jax.random.key(5)
    b, h, q, k = _grid(B=2, H=2, Tq=6, Tk=5)
    offsets, strides = jnp.array([1, 2, 3, 7]), jnp.array([4, 3])
    local = jax.jit(lambda o, s: dropout.random_bits(dropout.seed_from_key(key, o, s),
                                                     b, h, q, k))(offsets, strides)
    whole = np_random_bits(dropout.seed_from_key(key), b + 1, h + 2, 3 + 4 * q, 7 + 3 * k)
    np.testing.assert_array_equal(np.asarray(local), whole)


# ----------------------------------------------------------------------------------
# inside shard_map without offsets: one independent mask per shard
# ----------------------------------------------------------------------------------


def _np_shard_key(key_words, i):
    """dropout.shard_key in uint64 arithmetic reduced mod 2**32, from its documented
    hash."""
    w0, w1 = (np.uint64(int(x)) for x in key_words)
    i = np.uint64(i)
    inner = _np_fmix32(np.asarray((i * np.uint64(0x165667B1) + np.uint64(0x9E3779B1)) & M32))
    a = _np_fmix32(np.asarray((w0 + inner) & M32))
    b = _np_fmix32(np.asarray((w1 + a + ((i * np.uint64(0x85EBCA77)) & M32)) & M32))
    return np.array([a, b], np.uint32)


def test_shard_key_is_the_documented_hash_and_differs_per_shard():
    key = jax.random.key(3)
    words = np.asarray(jax.random.key_data(key)).reshape(-1)[:2]
    got = jax.jit(jax.vmap(dropout.shard_key, in_axes=(None, 0)))(key, jnp.arange(8))
    np.testing.assert_array_equal(got, np.stack([_np_shard_key(words, i) for i in range(8)]))
    assert len({tuple(g) for g in np.asarray(got).tolist()} | {tuple(words.tolist())}) == 9


def _on_one_device_mesh(spec, q, offsets=None, key_fn=None, check_vma=True):
    """fnattn.attention inside a 1-device shard_map over which q varies."""
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(jax.devices()[:1], ("data",))

    def local(q):
        s = spec if key_fn is None else spec.replace(dropout_key=key_fn(spec.dropout_key))
        return fnattn.attention(s.replace(dropout_offsets=offsets), q, q, q).out

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                 check_vma=check_vma))(q)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_shard_map_without_offsets_folds_the_shard_index(impl):
    q = jax.random.normal(jax.random.key(1), (2, 9, 2, 4))
    spec = AttentionSpec(mask=masks.causal(), dropout_rate=0.5,
                         dropout_key=jax.random.key(0), impl=impl)
    attend = jax.jit(fnattn.attention)
    whole = attend(spec, q, q, q).out
    folded = attend(spec.replace(dropout_key=dropout.shard_key(spec.dropout_key, 0)),
                    q, q, q).out
    assert not np.allclose(whole, folded, atol=1e-3)
    np.testing.assert_allclose(_on_one_device_mesh(spec, q), folded, atol=1e-6)
    # Offsets (even zeros) say where the shard is: nothing folded.
    np.testing.assert_allclose(_on_one_device_mesh(spec, q, offsets=jnp.zeros(4, jnp.int32)),
                               whole, atol=1e-6)
    # A key that varies over the axis already is taken as it is.
    fold = lambda key: jax.random.fold_in(key, jax.lax.axis_index("data"))  # noqa: E731
    np.testing.assert_allclose(
        _on_one_device_mesh(spec, q, key_fn=fold),
        attend(spec.replace(dropout_key=jax.random.fold_in(spec.dropout_key, 0)), q, q, q).out,
        atol=1e-6)
    # check_vma=False: JAX does not say how q varies, so nothing is folded (documented).
    np.testing.assert_allclose(_on_one_device_mesh(spec, q, check_vma=False), whole, atol=1e-6)
