"""Dropout on attention weights as a pure function of positions.

The keep/drop decision for the weight of query ``q`` on key ``k`` in batch ``b``
and query head ``h`` is a counter-based hash of ``(seed, b, h, q, k)``; there is
no random state to thread and no mask to store. Every lowering (reference, XLA,
Pallas kernels) computes exactly the same bits from the same indices, so a kernel
can regenerate the mask in its backward pass and tests can compare lowerings bit
for bit.

**Global indices.** The indices are those of the whole problem, not of the
arrays one call sees: ``AttentionSpec(dropout_offsets=...)`` gives the global
index of the call's first batch row, query head, query and key, and the mask is
then exactly the rows of the unsharded problem's mask. Inside ``jax.shard_map``
:func:`shard_offsets` computes them from the mesh axes that split the batch and
the heads. The offsets are folded into the seed (``seed_from_key``), so
kernels see no extra input. Under ``jax.vmap`` an unbatched key gives every
instance the same mask, as ``jax.random`` does; batch the key (or the offsets)
for one mask per instance.

**Shards without offsets draw independent masks.** Inside ``jax.shard_map``,
when ``dropout_offsets`` is None and q varies over mesh axes that the key does
not (one replicated key, data or head parallelism), the same local indices on
every shard would repeat one mask, biasing training. So the shard's index over
those axes (row-major in the mesh's axis order) is folded into the key: shard
``i`` draws the mask of ``shard_key(dropout_key, i)``, independent of the
others, though not the unsharded call's (for that, pass
``dropout_offsets=shard_offsets(...)``). With offsets given, nothing is folded:
they say where the shard is. A key that varies over an axis (``fold_in`` of
``lax.axis_index``) is taken as is over that axis. The varying axes are those
``shard_map``'s default ``check_vma=True`` tracks; under ``check_vma=False``
JAX does not say how q varies, nothing is folded, and the shards repeat one
mask unless offsets or per-shard keys are given. The sequence axis of
:func:`fnattn.context.attention` is not folded either: its global positions
are the indices already.

The hash is MurmurHash3's 32-bit finaliser applied after adding each index,
times its own odd constant, and one seed word; it only uses uint32 multiply,
add, xor and shift, which every backend supports. Since the indices enter by
addition, ``seed word + offset * constant`` is the same as adding the offset to
every index; and the query and key constants are seed words too, so that
``constant * stride`` makes local row ``i`` hash as global position
``offset + stride * i`` (the striped layout of context parallelism, where a
device holds every N-th token; see :mod:`fnattn.context`).

>>> import jax, jax.numpy as jnp
>>> seed = seed_from_key(jax.random.key(0))
>>> keep = keep_mask(seed, 0, 0, jnp.arange(4)[:, None], jnp.arange(4)[None, :], 0.5)
>>> keep.shape, keep.dtype
((4, 4), dtype('bool'))
"""

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fnattn import _varying

__all__ = ["seed_from_key", "keep_mask", "threshold", "shard_offsets", "shard_key", "SEED_WORDS"]

_C = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)
# Words 0-3 are added to the (b, h, q, k) terms, words 4-5 multiply q and k.
SEED_WORDS = 6


def _u32(x):
    return jnp.asarray(x).astype(jnp.uint32)


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return h


def _key_words(key) -> jax.Array:
    """Two uint32 words of one PRNG key, with the mistakes users make refused."""
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        if jnp.ndim(key) != 0:
            raise ValueError(
                f"dropout_key must be one PRNG key; got a batch of keys of shape "
                f"{tuple(jnp.shape(key))}. For one mask per key, jax.vmap over the keys "
                "(or over specs whose dropout_key is batched).")
        return jax.random.key_data(key).reshape(-1)[:2].astype(jnp.uint32)
    dtype = jnp.result_type(key)
    if dtype != jnp.uint32 or jnp.ndim(key) != 1 or jnp.shape(key)[0] not in (2, 4):
        raise TypeError(
            "dropout_key must be a JAX PRNG key (jax.random.key(0)) or a raw uint32 key "
            f"of shape (2,) (jax.random.PRNGKey(0)); got {dtype} with shape "
            f"{tuple(jnp.shape(key))}. "
            + ("A float array is not a key: its bits would be truncated."
               if jnp.issubdtype(dtype, jnp.floating) else
               "A batch of raw keys is not one key: jax.vmap over them instead."
               if jnp.ndim(key) > 1 else ""))
    return jnp.asarray(key)[:2]


def seed_from_key(key, offsets=None, strides=None) -> jax.Array:
    """The kernels' seed: ``SEED_WORDS`` uint32 words from a PRNG key (typed, or
    raw uint32 of shape (2,)), optional global ``offsets`` (4,) integers, the
    index of the first (batch row, query head, query, key) of this call, and
    optional ``strides`` (2,) integers: local query row ``i`` and key ``j`` are
    global positions ``offsets[2] + strides[0] * i`` and
    ``offsets[3] + strides[1] * j`` (default 1).

    >>> import jax
    >>> seed_from_key(jax.random.key(0)).shape
    (6,)
    """
    words = jnp.concatenate([_key_words(key), jnp.zeros((2,), jnp.uint32)])
    if offsets is not None:
        words = words + _u32(offsets) * jnp.asarray(_C[:4], jnp.uint32)
    mult = jnp.asarray(_C[2:4], jnp.uint32)
    if strides is not None:
        mult = mult * _u32(strides)
    return jnp.concatenate([words, mult])


def seed_words(seed) -> tuple:
    """The seed's words as a tuple of scalars, from an array or a kernel's ref."""
    return tuple(seed[i] for i in range(SEED_WORDS))


def threshold(rate: float) -> int:
    """The uint32 threshold: a weight is kept when its hash is >= this value."""
    return int(min(np.floor(rate * 2.0**32), 2.0**32 - 1))


def random_bits(seed, b, h, q, k):
    """uint32 hash of (seed, b, h, q, k); arguments broadcast elementwise."""
    s = [_u32(seed[i]) for i in range(SEED_WORDS)]
    x = _fmix32(s[0] + _u32(b) * jnp.uint32(_C[0]))
    x = _fmix32(x + s[1] + _u32(h) * jnp.uint32(_C[1]))
    x = _fmix32(x + s[2] + _u32(q) * s[4])
    x = _fmix32(x + s[3] + _u32(k) * s[5])
    return x


def keep_mask(seed, b, h, q, k, rate: float) -> jax.Array:
    """Boolean keep mask (True keeps the weight) at the broadcast of the indices."""
    return random_bits(seed, b, h, q, k) >= jnp.uint32(threshold(rate))


AxisName = Union[str, Sequence[str]]


def shard_offsets(q, *, layout: str = "bthd", batch_axis: Optional[AxisName] = None,
                  head_axis: Optional[AxisName] = None) -> jax.Array:
    """``dropout_offsets`` for a call inside ``jax.shard_map`` whose batch and/or
    query heads are split along the named mesh axes: the global index of this
    shard's first batch row and first query head (shards hold equal, contiguous
    slices, as ``PartitionSpec`` sharding makes them). With them the sharded
    dropout mask is bit for bit the unsharded one.

    Args:
      q: this shard's queries (only the shape is read).
      layout: "bthd" or "bhtd".
      batch_axis: the mesh axis that splits the batch: a name, a tuple of
        names (major first), or None where the batch is not split.
      head_axis: the same for the query heads.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> f = jax.jit(jax.shard_map(lambda q: shard_offsets(q, batch_axis="data"), mesh=mesh,
    ...                           in_specs=P("data"), out_specs=P("data")))
    >>> f(jnp.ones((2, 3, 4, 5))).tolist()
    [0, 0, 0, 0]
    """
    if layout not in ("bthd", "bhtd"):
        raise ValueError(f"shard_offsets: layout must be 'bthd' or 'bhtd'; got {layout!r}")
    B = q.shape[0]
    H = q.shape[2] if layout == "bthd" else q.shape[1]

    def first(axis, size):
        if axis is None:
            return jnp.int32(0)
        return lax.axis_index(axis).astype(jnp.int32) * size

    return jnp.stack([first(batch_axis, B), first(head_axis, H), jnp.int32(0), jnp.int32(0)])


def shard_key(key, index) -> jax.Array:
    """The raw uint32 (2,) key that shard ``index`` of a ``shard_map`` draws its
    dropout mask from when ``dropout_offsets`` is None and q varies over mesh
    axes the key does not (see the module docstring): ``key``'s two words
    hashed with the shard's index. Different for every index, and different
    from ``key`` itself.

    >>> import jax
    >>> a, b = (shard_key(jax.random.key(0), i) for i in (0, 1))
    >>> a.shape, a.dtype, bool((a != b).any())
    ((2,), dtype('uint32'), True)
    """
    w = _key_words(key)
    i = _u32(index)
    a = _fmix32(w[0] + _fmix32(i * jnp.uint32(_C[4]) + jnp.uint32(_C[0])))
    b = _fmix32(w[1] + a + i * jnp.uint32(_C[1]))
    return jnp.stack([a, b])


def key_for_shard(key, offsets, q, *, sequence_axes=()):
    """``key``, or :func:`shard_key` of it with this shard's index over the mesh
    axes that q varies over and neither the key nor ``sequence_axes`` (the axes
    whose positions the caller gives already) do; only when ``offsets`` is
    None. Outside ``shard_map`` (and under ``check_vma=False``): ``key``."""
    if offsets is not None:
        return key
    axes = _varying.varying_axes(q) - _varying.varying_axes(key) - frozenset(sequence_axes)
    if not axes:
        return key
    # Row-major over the axes in the mesh's order: the same index on every JAX.
    names = tuple(a for a in jax.sharding.get_abstract_mesh().axis_names if a in axes)
    names += tuple(sorted(axes - frozenset(names)))
    index = lax.axis_index(names[0] if len(names) == 1 else names)
    return shard_key(key, index)
