"""Block sizes and the block-sparse schedule shared by the flash lowerings.

The schedule turns the tile classes of :func:`fnattn.masks.block_classes` into,
for every q-block, the list of kv-blocks to visit (non-empty ones first, in
increasing order) with their class, and the count of them. A kernel loops over
``count`` entries only, so empty tiles cost nothing, and evaluates the mask only
on PARTIAL tiles. The transposed schedule (for every kv-block, the q-blocks that
see it) drives the dk/dv backward pass.

>>> import jax.numpy as jnp
>>> from fnattn import masks
>>> c = masks.block_classes(masks.causal(), 1, 1, 12, 12, 4, 4)
>>> s = schedule(c)
>>> s.count[0, 0].tolist(), s.index[0, 0, 2].tolist(), s.kind[0, 0, 2].tolist()
([1, 2, 3], [0, 1, 2], [2, 2, 1])
"""

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from fnattn.masks import EMPTY


class Schedule(NamedTuple):
    """Per row-block lists of column blocks to visit.

    Attributes:
      index: int32 (B|1, H|1, n_rows, n_cols): column-block indices, non-empty first;
        entries past ``count`` repeat the last visited index (or 0).
      kind: int8, same shape: the class (PARTIAL or FULL) of each listed tile,
        EMPTY past ``count``.
      count: int32 (B|1, H|1, n_rows): how many entries to visit.
    """

    index: Any
    kind: Any
    count: Any


# The most tiles (row-blocks x column-blocks) of a schedule embedded in a
# program as a constant: the lowerings compute the tables of an array-free mask
# (causal, windows, no mask) with NumPy at trace time up to this, and in XLA at
# every call past it, as for a mask holding arrays (T = 64k at tiles of 128 is
# 512 x 512). A table holds a slot per tile: embedded at T = 256k and tiles of 128
# (2048 x 2048), the Triton kernels' would put 64 MB of constants into the
# forward's program and 320 MB into the gradient's (as StableHLO text); built
# in XLA, it costs milliseconds a call (``benchmarks/results/schedule_cpu.md``).
EMBEDDED_TILES = 1 << 18


def embeds(*counts) -> bool:
    """Whether a static schedule of ``prod(counts)`` tiles (its row-blocks,
    column-blocks, and batch rows and heads where it varies along them) is
    embedded as a constant (:data:`EMBEDDED_TILES`).
    False for a symbolic count (``jax.export``), whose tables are traced anyway.

    >>> embeds(512, 512), embeds(512, 513), embeds(2, 64, 64)
    (True, False, True)
    """
    if not all(isinstance(c, (int, np.integer)) for c in counts):
        return False
    return int(np.prod(counts, dtype=np.int64)) <= EMBEDDED_TILES


def schedule(classes, *, transpose: bool = False) -> Schedule:
    """Compresses tile classes (…, nq, nk) into a visiting schedule.

    With ``transpose=True`` the rows are kv-blocks and the columns q-blocks.
    """
    return _schedule(jnp, classes, transpose)


def schedule_static(classes, *, transpose: bool = False) -> Schedule:
    """:func:`schedule` of concrete classes, computed with NumPy at trace time.

    For the classes of :func:`fnattn.masks.block_classes_static`: no JAX
    operation runs (an eager one compiles a small program each), and the
    result holds read-only NumPy arrays with the values :func:`schedule` gives.

    >>> from fnattn import masks
    >>> s = schedule_static(masks.block_classes_static(masks.causal(), 1, 1, 12, 12, 4, 4))
    >>> s.count[0, 0].tolist(), s.index[0, 0, 2].tolist(), s.kind[0, 0, 2].tolist()
    ([1, 2, 3], [0, 1, 2], [2, 2, 1])
    """
    s = _schedule(np, np.asarray(classes), transpose)
    for x in s:
        x.flags.writeable = False
    return s


def ranked_order(xp, rank, ranks: int):
    """Each row's columns (the last axis) ordered by ``rank``, lowest first and
    in column order within a rank: ``argsort(rank * n + column)``, for the
    columns of rank below ``ranks``; the entries past them are unspecified
    (callers overwrite them). Returns int32 of ``rank``'s shape.

    ``xp`` is ``np`` (static tables, a stable sort) or ``jnp`` (tables computed
    in XLA from a mask's arrays): there each column goes to its place, counted
    by cumulative sums, in one scatter. No sort runs, which matters for long
    sequences: at 1024 x 1024 tiles (T = 128k at tiles of 128) the XLA flash
    lowering's lists took 70 ms with a sort on a 2-core CPU, 8 ms this way
    (``benchmarks/results/schedule_cpu.md``).

    >>> rank = np.array([[1, 2, 0, 1, 0]])
    >>> ranked_order(np, rank, 2)[0, :4].tolist(), ranked_order(jnp, rank, 2)[0, :4].tolist()
    ([2, 4, 0, 3], [2, 4, 0, 3])
    """
    n = rank.shape[-1]
    cols = xp.arange(n, dtype=np.int32)
    if xp is np:
        return np.argsort(rank * n + cols, axis=-1, kind="stable").astype(np.int32)
    # A column of rank >= ranks goes past the row, to a place of its own (the
    # scatter drops it; every index stays unique, as the scatter is told).
    place = jnp.broadcast_to(n + cols, rank.shape)
    before = jnp.zeros(rank.shape[:-1] + (1,), jnp.int32)
    for r in range(ranks):
        this = rank == r
        place = jnp.where(this, before + jnp.cumsum(this, -1, dtype=jnp.int32) - 1, place)
        before = before + this.sum(-1, keepdims=True, dtype=jnp.int32)
    rows = place.reshape(-1, n)
    which = jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None]
    order = jnp.zeros(rows.shape, jnp.int32).at[which, rows].set(
        jnp.broadcast_to(cols, rows.shape), mode="drop", unique_indices=True)
    return order.reshape(rank.shape)


# The most comparisons (tables x rows x columns x columns) of a schedule
# computed in XLA by counting (:func:`_counted`) instead of by
# :func:`ranked_order`: both give the same lists; counting is a few fused
# reductions, where the cumulative sums, scatter and gathers of the other take
# a dozen kernels, each compiled on its own (XLA:CPU: about 0.25 s of CPU time
# of a traced-window layer's first call; ``benchmarks/results/traced_window_cpu.md``).
# The comparisons grow as columns squared: long tables keep ranked_order.
COUNTED_COMPARISONS = 1 << 20


def _counts_small(shape) -> bool:
    if not all(isinstance(c, (int, np.integer)) for c in shape):
        return False  # (a symbolic size under jax.export)
    return int(np.prod(shape, dtype=np.int64)) * int(shape[-1]) <= COUNTED_COMPARISONS


def _counted(c):
    """``(index, count)`` of :func:`schedule` of the tables ``c`` (…, n) by
    counting: with ``cs[j]`` the number of non-empty columns up to ``j``, the
    ``t``-th listed column is the number of columns with ``cs <= t`` (past the
    count, the last listed one: ``t`` clipped to ``count - 1``; 0 when none)."""
    n = c.shape[-1]
    nonempty = c != EMPTY
    count = nonempty.sum(-1, dtype=jnp.int32)
    cols = jnp.arange(n, dtype=jnp.int32)
    upto = cols[None, :] <= cols[:, None]                      # (j, j')
    cs = jnp.sum(nonempty[..., None, :] & upto, -1, dtype=jnp.int32)
    t = jnp.minimum(cols, count[..., None] - 1)
    index = jnp.sum(cs[..., None, :] <= t[..., :, None], -1, dtype=jnp.int32)
    return index, count


def _schedule(xp, classes, transpose):
    c = xp.swapaxes(classes, -1, -2) if transpose else classes
    n = c.shape[-1]
    if xp is jnp and _counts_small(c.shape):
        index, count = _counted(c)
        listed = jnp.arange(n, dtype=jnp.int32) < count[..., None]
        kind = jnp.where(listed, jnp.take_along_axis(c, index, axis=-1), EMPTY)
        return Schedule(index, kind.astype(jnp.int8), count)
    cols = xp.arange(n, dtype=xp.int32)
    nonempty = c != EMPTY
    order = ranked_order(xp, xp.where(nonempty, 0, 1), 1)
    count = nonempty.sum(-1).astype(xp.int32)
    kind = xp.take_along_axis(c, order, axis=-1)
    last = xp.take_along_axis(order, xp.maximum(count - 1, 0)[..., None], axis=-1)
    listed = cols < count[..., None]
    index = xp.where(listed, order, xp.where(count[..., None] > 0, last, 0))
    kind = xp.where(listed, kind, EMPTY).astype(xp.int8)
    return Schedule(index, kind, count)


def entries(block_sizes) -> tuple:
    """A spec's ``block_sizes`` field (None, one block-size object, or a tuple of
    objects of different lowerings' types) as a tuple of objects."""
    if block_sizes is None:
        return ()
    return block_sizes if isinstance(block_sizes, tuple) else (block_sizes,)


def pick(block_sizes, cls, default):
    """The block sizes of type ``cls`` from a spec's ``block_sizes`` field.

    ``block_sizes`` may be None, one block-size object, or a tuple of objects of
    different lowerings' types; when none has type ``cls``, ``default`` is used.
    """
    for b in entries(block_sizes):
        if isinstance(b, cls):
            return b
    return default
