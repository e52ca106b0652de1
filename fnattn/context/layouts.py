"""How a sequence is cut into the shards of a mesh axis, and its global positions.

Context parallelism splits the sequence axis of q, k and v over the ``N``
devices of a mesh axis. ``jax.shard_map`` gives device ``r`` the ``r``-th
contiguous slice of whatever array it is handed, so a layout other than
"contiguous" is a *reordering* of the sequence before the split
(:func:`reorder`, outside ``shard_map``) and its inverse after
(:func:`restore`):

* ``"contiguous"``: device ``r`` holds tokens ``[r*L, (r+1)*L)``. Under a causal
  mask the last device has ``2N - 1`` times the work of the first.
* ``"zigzag"``: the sequence is cut into ``2N`` chunks and device ``r`` holds
  chunks ``r`` and ``2N - 1 - r``: a cheap chunk and an expensive one, so under
  a causal mask every device has the same work.
* ``"striped"``: device ``r`` holds tokens ``r, r + N, r + 2N, ...``: balanced
  too, and every device's tokens are spread over the whole sequence.

A device's tokens are described by :class:`Piece` s: runs of local rows whose
global positions are ``start + stride * i``. One piece for "contiguous" and
"striped", two for "zigzag". Context-parallel attention computes each pair of
(query piece, key piece) as one call of the flash lowering with those positions.

>>> import jax.numpy as jnp
>>> x = jnp.arange(8)[None]
>>> reorder(x, 2, "zigzag").tolist()
[[0, 1, 6, 7, 2, 3, 4, 5]]
>>> reorder(x, 2, "striped").tolist()
[[0, 2, 4, 6, 1, 3, 5, 7]]
>>> bool((restore(reorder(x, 2, "zigzag"), 2, "zigzag") == x).all())
True
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fnattn import masks

__all__ = ["LAYOUTS", "Piece", "pieces", "positions", "reorder", "restore", "work"]

LAYOUTS = ("contiguous", "zigzag", "striped")
I32 = jnp.int32


class Piece(NamedTuple):
    """Local rows ``[lo, lo + size)`` of a shard, at global positions
    ``start + stride * i`` (``start`` may be traced: it depends on the rank)."""

    lo: int
    size: int
    start: Any
    stride: int


def check_layout(layout: str, local_len: int, fn: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}; got {layout!r}")
    if layout == "zigzag" and local_len % 2:
        raise ValueError(f"{fn}: the zigzag layout holds two equal chunks per device, so the "
                         f"local sequence length must be even; got {local_len}")


def pieces(layout: str, local_len: int, rank, axis_size: int) -> tuple[Piece, ...]:
    """The pieces of device ``rank``'s shard of ``local_len`` tokens.

    >>> pieces("zigzag", 4, 1, 2)
    (Piece(lo=0, size=2, start=2, stride=1), Piece(lo=2, size=2, start=4, stride=1))
    """
    L, N = local_len, axis_size
    if layout == "contiguous":
        return (Piece(0, L, rank * L, 1),)
    if layout == "striped":
        return (Piece(0, L, rank, N),)
    if layout == "zigzag":
        C = L // 2
        return (Piece(0, C, rank * C, 1), Piece(C, C, (2 * N - 1 - rank) * C, 1))
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def positions(layout: str, local_len: int, rank, axis_size: int) -> jax.Array:
    """int32 (local_len,): the global positions of device ``rank``'s tokens.

    Inside ``jax.shard_map`` pass ``rank = jax.lax.axis_index(axis_name)``.

    >>> positions("striped", 3, 1, 4).tolist()
    [1, 5, 9]
    """
    out = [jnp.asarray(p.start, I32) + p.stride * jnp.arange(p.size, dtype=I32)
           for p in pieces(layout, local_len, rank, axis_size)]
    return out[0] if len(out) == 1 else jnp.concatenate(out)


def _order(seq_len: int, axis_size: int, layout: str) -> np.ndarray:
    """The global positions in shard order: ``reorder(x)[i] = x[order[i]]``."""
    N = axis_size
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    div = 2 * N if layout == "zigzag" else N
    if seq_len % div:
        raise ValueError(f"the {layout} layout over {N} devices needs a sequence length "
                         f"divisible by {div}; got {seq_len}")
    L = seq_len // N
    return np.concatenate([p.start + p.stride * np.arange(p.size)
                           for r in range(N) for p in pieces(layout, L, r, N)])


def reorder(x, axis_size: int, layout: str, *, axis: int = 1):
    """``x`` with its sequence ``axis`` reordered so that the ``axis_size``
    contiguous shards ``shard_map`` makes are the ``layout``'s shards.

    Apply it to q, k, v, the segment ids and the key columns of a bias or
    array mask before the ``shard_map`` (for "contiguous" it is the identity).
    """
    order = _order(x.shape[axis], axis_size, layout)
    return x if layout == "contiguous" else jnp.take(x, jnp.asarray(order), axis=axis)


def restore(x, axis_size: int, layout: str, *, axis: int = 1):
    """The inverse of :func:`reorder`: the global sequence order back."""
    order = _order(x.shape[axis], axis_size, layout)
    return x if layout == "contiguous" else jnp.take(x, jnp.asarray(np.argsort(order)),
                                                      axis=axis)


def work(mask, seq_len: int, axis_size: int, layout: str, *, block: int = 128,
         batch: int = 1, num_heads: int = 1) -> np.ndarray:
    """Tiles each device computes: int (axis_size,), the number of non-empty
    ``block`` x ``block`` tiles of ``mask`` between the device's queries and all
    keys, counted per (query piece, key piece) pair as context-parallel
    attention runs them. ``max / min`` is the load imbalance.

    >>> from fnattn import masks
    >>> work(masks.causal(), 1024, 4, "contiguous", block=64).tolist()
    [10, 26, 42, 58]
    >>> work(masks.causal(), 1024, 4, "zigzag", block=64).tolist()
    [34, 34, 34, 34]
    """
    N = axis_size
    L = seq_len // N
    _order(seq_len, N, layout)  # validates
    counts = []
    for r in range(N):
        total = 0
        for qp in pieces(layout, L, r, N):
            qpos = qp.start + qp.stride * jnp.arange(qp.size, dtype=I32)
            for src in range(N):
                for kp in pieces(layout, L, src, N):
                    kpos = kp.start + kp.stride * jnp.arange(kp.size, dtype=I32)
                    m = masks.at_positions(mask, qpos, kpos)
                    c = masks.block_classes(m, batch, num_heads, qp.size, kp.size,
                                            min(block, qp.size), min(block, kp.size))
                    total += int(jnp.sum(c != masks.EMPTY))
        counts.append(total)
    return np.asarray(counts)
