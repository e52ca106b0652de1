"""Dropout on attention weights as a pure function of positions.

The keep/drop decision for the weight of query ``q`` on key ``k`` in batch ``b``
and query head ``h`` is a counter-based hash of ``(seed, b, h, q, k)``; there is
no random state to thread and no mask to store. Every lowering (reference, XLA,
Pallas kernels) computes exactly the same bits from the same indices, so a kernel
can regenerate the mask in its backward pass and tests can compare lowerings bit
for bit.

The hash is the 32-bit finaliser of MurmurHash3 applied after mixing each index
in with a different odd constant; it only uses uint32 multiply, xor and shift,
which every backend supports.

>>> import jax, jax.numpy as jnp
>>> seed = seed_from_key(jax.random.key(0))
>>> keep = keep_mask(seed, 0, 0, jnp.arange(4)[:, None], jnp.arange(4)[None, :], 0.5)
>>> keep.shape, keep.dtype
((4, 4), dtype('bool'))
"""

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["seed_from_key", "keep_mask", "threshold"]

_C = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)


def _u32(x):
    return jnp.asarray(x).astype(jnp.uint32)


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return h


def seed_from_key(key) -> jax.Array:
    """Two uint32 words from a JAX PRNG key (typed or raw), shape (2,)."""
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    key = jnp.asarray(key).astype(jnp.uint32).reshape(-1)
    if key.shape[0] < 2:
        key = jnp.concatenate([key, jnp.zeros((2 - key.shape[0],), jnp.uint32)])
    return key[:2]


def threshold(rate: float) -> int:
    """The uint32 threshold: a weight is kept when its hash is >= this value."""
    return int(min(np.floor(rate * 2.0**32), 2.0**32 - 1))


def random_bits(seed, b, h, q, k):
    """uint32 hash of (seed, b, h, q, k); arguments broadcast elementwise."""
    s0, s1 = _u32(seed[0]), _u32(seed[1])
    x = _fmix32(s0 ^ (_u32(b) * jnp.uint32(_C[0])))
    x = _fmix32(x ^ (_u32(h) * jnp.uint32(_C[1])) ^ s1)
    x = _fmix32(x ^ (_u32(q) * jnp.uint32(_C[2])))
    x = _fmix32(x ^ (_u32(k) * jnp.uint32(_C[3])))
    return x


def keep_mask(seed, b, h, q, k, rate: float) -> jax.Array:
    """Boolean keep mask (True keeps the weight) at the broadcast of the indices."""
    return random_bits(seed, b, h, q, k) >= jnp.uint32(threshold(rate))
