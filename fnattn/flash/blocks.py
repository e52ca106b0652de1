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


def _schedule(xp, classes, transpose):
    c = xp.swapaxes(classes, -1, -2) if transpose else classes
    n = c.shape[-1]
    cols = xp.arange(n, dtype=xp.int32)
    nonempty = c != EMPTY
    key = xp.where(nonempty, cols, n + cols)
    order = xp.argsort(key, axis=-1).astype(xp.int32)
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
