"""The dropout keep mask: a pure, reproducible function of positions."""

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from fnattn import AttentionSpec, dropout


def test_keep_rate_and_determinism():
    seed = dropout.seed_from_key(jax.random.key(3))
    b, h, q, k = np.ix_(np.arange(2), np.arange(3), np.arange(64), np.arange(64))
    keep = jax.jit(lambda s: dropout.keep_mask(s, b, h, q, k, 0.25))(seed)
    assert abs(float(keep.mean()) - 0.75) < 0.02
    np.testing.assert_array_equal(keep, dropout.keep_mask(seed, b, h, q, k, 0.25))
    other = dropout.keep_mask(dropout.seed_from_key(jax.random.key(4)), b, h, q, k, 0.25)
    assert (np.asarray(other) != np.asarray(keep)).mean() > 0.2
    # each index matters
    for shifted in [(b + 1, h, q, k), (b, h + 1, q, k), (b, h, q + 1, k), (b, h, q, k + 1)]:
        assert (np.asarray(dropout.keep_mask(seed, *shifted, 0.25)) != np.asarray(keep)).any()


def test_rate_zero_keeps_everything_and_raw_keys_work():
    seed = dropout.seed_from_key(jnp.array([1, 2], jnp.uint32))
    assert bool(dropout.keep_mask(seed, 0, 0, jnp.arange(100), 0, 0.0).all())
    assert dropout.threshold(0.5) == 2**31


def test_weights_match_the_mask():
    q = jax.random.normal(jax.random.key(0), (2, 5, 3, 7))
    spec = AttentionSpec(dropout_rate=0.5, dropout_key=jax.random.key(1))
    res, w = jax.jit(lambda s, q: fnattn.reference(s, q, q, q, return_weights=True))(spec, q)
    _, w0 = jax.jit(lambda s, q: fnattn.reference(s, q, q, q, return_weights=True))(
        spec.replace(dropout_rate=0.0, dropout_key=None), q)
    b, h, qi, ki = np.ix_(range(2), range(3), range(5), range(5))
    keep = np.asarray(dropout.keep_mask(dropout.seed_from_key(spec.dropout_key), b, h, qi, ki, 0.5))
    np.testing.assert_allclose(np.asarray(w), np.where(keep, np.asarray(w0) * 2, 0), rtol=1e-6)
    out = np.einsum("bhqk,bkhd->bqhd", np.asarray(w), np.asarray(q))
    np.testing.assert_allclose(np.asarray(res.out), out, rtol=1e-5, atol=1e-5)
