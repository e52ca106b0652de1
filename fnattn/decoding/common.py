"""What the Pallas lowerings of :func:`fnattn.decode` share: which key blocks
of each sequence they visit.

A key block is ``block_k`` consecutive cache slots. Each sequence visits only
the blocks that hold one of its slots ``[start, start + length)`` and, by the
mask's ``tile_bounds`` (the block-sparsity protocol of :mod:`fnattn.masks`),
may hold a key visible to one of its ``Tq`` queries: a sliding window over a
long context reads the window only.
"""

from typing import Optional

import jax.numpy as jnp
from jax import lax

from fnattn import masks
from fnattn.paged.common import cdiv, first_run, pow2  # noqa: F401  (shared helpers)

F32 = jnp.float32
I32 = jnp.int32


def key_block_range(mask, Tq: int, lengths, offsets, block_k: int, num_blocks: int):
    """[lo, hi) per sequence, each (B,) int32: the blocks that may matter.

    Block ``j`` holds the logical key positions ``j * block_k - offsets[b]`` to
    ``j * block_k + block_k - 1 - offsets[b]`` (``offsets`` is 0 for blocks
    aligned to each sequence's first key, ``starts`` for blocks aligned to cache
    slots); a block matters when one of them is in ``[0, lengths[b])`` and
    ``mask.tile_bounds`` says it may be visible. Sequences with no such block get
    ``lo = hi = 0``.
    """
    live = lengths > 0
    first = lax.div(offsets, jnp.int32(block_k))
    end = jnp.where(live, cdiv(offsets + lengths, block_k), first)  # offsets + lengths >= 0
    if mask is None:
        return jnp.where(live, first, 0), jnp.where(live, end, 0)
    j = jnp.arange(num_blocks, dtype=I32)[None, :]
    col = lambda x: x[:, None]
    k_lo = j * block_k - col(offsets)
    t = masks.TileBounds(b=col(jnp.arange(lengths.shape[0], dtype=I32)),
                         h=jnp.zeros((1, 1), I32), q_lo=jnp.zeros((1, 1), I32),
                         q_hi=jnp.full((1, 1), Tq - 1, I32), pos_lo=col(lengths - Tq),
                         pos_hi=col(lengths - 1), k_lo=k_lo, k_hi=k_lo + block_k - 1)
    may, _ = mask.tile_bounds(t, [])
    may = jnp.broadcast_to(may, (lengths.shape[0], num_blocks))
    may = may & (j >= col(first)) & (j < col(end))
    anyv = may.any(axis=1)
    lo = jnp.argmax(may, axis=1).astype(I32)
    hi = (num_blocks - jnp.argmax(may[:, ::-1], axis=1)).astype(I32)
    return jnp.where(anyv, lo, 0), jnp.where(anyv, hi, 0)


def full_block_range(mask, Tq: int, lengths, block_k: int, num_blocks: int):
    """[a, b) per sequence, each (B,) int32: a run of blocks (aligned to each
    sequence's first key) that lie wholly inside ``[0, lengths[b])`` and that the
    mask shows to every query row (``tile_bounds``' ``all_true``): a kernel visits
    them with no mask and no bounds code. The first such run; ``a = b`` when there
    is none. Every block of ``[a, b)`` is also in :func:`key_block_range`'s range.

    >>> import jax.numpy as jnp
    >>> from fnattn import masks
    >>> a, b = full_block_range(masks.causal(), 1, jnp.array([130, 64, 10]), 32, 8)
    >>> a.tolist(), b.tolist()
    ([0, 0, 0], [4, 2, 0])
    >>> # the last query (position 129) sees keys 89..129: only block 3 (96..127)
    >>> a, b = full_block_range(masks.sliding_window(40), 1, jnp.array([130]), 32, 8)
    >>> a.tolist(), b.tolist()
    ([3], [4])
    """
    j = jnp.arange(num_blocks, dtype=I32)[None, :]
    col = lambda x: x[:, None]  # noqa: E731
    full = (j + 1) * block_k <= col(lengths)
    if mask is not None:
        k_lo = j * block_k
        t = masks.TileBounds(b=col(jnp.arange(lengths.shape[0], dtype=I32)),
                             h=jnp.zeros((1, 1), I32), q_lo=jnp.zeros((1, 1), I32),
                             q_hi=jnp.full((1, 1), Tq - 1, I32), pos_lo=col(lengths - Tq),
                             pos_hi=col(lengths - 1), k_lo=k_lo, k_hi=k_lo + block_k - 1)
        _, every = mask.tile_bounds(t, [])
        full = full & jnp.broadcast_to(every, full.shape)
    return first_run(full)


def split_range(lo, hi, split, num_splits: int):
    """The blocks of split ``split`` out of ``num_splits`` of [lo, hi)."""
    # lax.div (truncating; operands >= 0): jnp's floor division lowers through
    # `sign`, which the Mosaic lowering cannot handle without a TPU to ask.
    per = lax.div(hi - lo + (num_splits - 1), jnp.int32(num_splits))
    first = jnp.minimum(lo + split * per, hi)
    return first, jnp.minimum(first + per, hi)


def group_rows(x, Hkv: int, rows: int, Gp: Optional[int] = None):
    """(B, Tq, Hq, D) -> (B, Hkv, rows, D): row ``r = t * Gp + g`` is token t of query
    head ``h * G + g`` (``Gp >= G``, default G); other rows are zero."""
    B, Tq, Hq, D = x.shape
    G = Hq // Hkv
    Gp = G if Gp is None else Gp
    x = x.reshape(B, Tq, Hkv, G, D).transpose(0, 2, 1, 3, 4)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, Gp - G), (0, 0))).reshape(B, Hkv, Tq * Gp, D)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - Tq * Gp), (0, 0)))


def ungroup_rows(out, lse, Tq: int, G: int, Gp: Optional[int] = None):
    """(B, Hkv, >= Tq*Gp, Dv), (B, Hkv, >= Tq*Gp) -> (B, Tq, Hq, Dv), (B, Hq, Tq)."""
    B, Hkv, _, Dv = out.shape
    Gp = G if Gp is None else Gp
    R = Tq * Gp
    out = out[:, :, :R].reshape(B, Hkv, Tq, Gp, Dv)[:, :, :, :G].transpose(0, 2, 1, 3, 4)
    lse = lse[:, :, :R].reshape(B, Hkv, Tq, Gp)[:, :, :, :G].transpose(0, 1, 3, 2)
    return out.reshape(B, Tq, Hkv * G, Dv), lse.reshape(B, Hkv * G, Tq)


def row_sinks(sinks, Hkv: int, Tq: int, rows: int, Gp: Optional[int] = None):
    """sinks (Hq,) -> (Hkv, rows) float32 in the row order of :func:`group_rows`."""
    s = sinks.astype(F32).reshape(Hkv, -1)
    Gp = s.shape[1] if Gp is None else Gp
    s = jnp.tile(jnp.pad(s, ((0, 0), (0, Gp - s.shape[1]))), (1, Tq))
    return jnp.pad(s, ((0, 0), (0, rows - s.shape[1])))
