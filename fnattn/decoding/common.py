"""What the Pallas lowerings of :func:`fnattn.decode` share: which key blocks
of each sequence they visit.

A key block is ``block_k`` consecutive cache slots. Each sequence visits only
the blocks that hold one of its slots ``[start, start + length)`` and, by the
mask's ``tile_bounds`` (the block-sparsity protocol of :mod:`fnattn.masks`),
may hold a key visible to one of its ``Tq`` queries: a sliding window over a
long context reads the window only.
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from fnattn import masks
from fnattn._serving import KernelFacts, cdiv, first_run, pow2, span  # noqa: F401  (shared)

F32 = jnp.float32
I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Split-K and tiling of :func:`fnattn.decode` (``AttentionSpec(block_sizes=...)``).

    Attributes:
      num_splits: contiguous key ranges computed independently and merged; must
        divide the cache length S. None: each lowering chooses (see the module
        docstring).
      block_k, num_warps, num_stages: the Triton kernel's keys per step (a power
        of two >= 16 after rounding up), warps per program and software-pipeline
        depth. None: chosen from the problem
        (:func:`fnattn.decoding.triton.launch_plan`). ``block_k`` also sets
        the slots per step of the XLA lowering's looped form (which it then
        takes: :func:`fnattn.decoding.xla.forward`); the Mosaic lowering
        tiles by its own rules.

    >>> DecodeBlockSizes(num_splits=4).num_splits
    4
    >>> DecodeBlockSizes(num_splits=0)
    Traceback (most recent call last):
    ...
    ValueError: DecodeBlockSizes: num_splits must be a positive int or None; got 0
    """

    num_splits: Optional[int] = None
    block_k: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None

    def __post_init__(self):
        for name in ("num_splits", "block_k", "num_warps", "num_stages"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n <= 0):
                raise ValueError(f"DecodeBlockSizes: {name} must be a positive int or None; "
                                 f"got {n!r}")
        w = self.num_warps
        if w is not None and (w & (w - 1) or w > 32):
            raise ValueError(f"DecodeBlockSizes: num_warps must be a power of two <= 32; "
                             f"got {w}")


@dataclasses.dataclass(frozen=True)
class Cfg:
    """Static configuration of one decode call (hashable; part of the trace)."""

    scale: float
    softcap: Optional[float]
    mask_treedef: Any          # None: no mask. Masks here hold no arrays.
    num_splits: Optional[int]  # from DecodeBlockSizes; None: each lowering chooses
    block_sizes: Any = None
    term_treedef: Any = None   # a position term (fnattn.position_bias), or None
    value_dim: Optional[int] = None  # a latent cache: v is None, the values are k[..., :value_dim]

    @property
    def mask(self):
        return masks.from_treedef(self.mask_treedef)

    @property
    def term(self):
        """The position term (its arrays placeholders: their values come as the
        ``terms`` argument, :func:`fnattn.position_bias.per_head_arrays`), or None."""
        return masks.from_treedef(self.term_treedef)


class BlockRanges(NamedTuple):
    """Per sequence, each (B,) int32: ``[lo, hi)`` the key blocks that may matter,
    and ``[full_lo, full_hi)`` a run of them that every query row sees whole."""

    lo: jax.Array
    hi: jax.Array
    full_lo: jax.Array
    full_hi: jax.Array


def block_ranges(mask, Tq: int, lengths, offsets, block_k: int, num_blocks: int) -> BlockRanges:
    """The key blocks a sequence visits, and the ones it visits with no mask code.

    Block ``j`` holds the logical key positions ``j * block_k - offsets[b]`` to
    ``j * block_k + block_k - 1 - offsets[b]`` (``offsets`` is 0 for blocks
    aligned to each sequence's first key, ``starts`` for blocks aligned to cache
    slots).

    * ``[lo, hi)``: the blocks holding a position in ``[0, lengths[b])`` that
      ``mask.tile_bounds`` says may be visible (``lo = hi = 0`` when none is).
    * ``[full_lo, full_hi)``: the first run of blocks lying wholly inside
      ``[0, lengths[b])`` that the mask shows to every query row (``tile_bounds``'
      ``all_true``): a kernel visits them with no mask and no bounds code. Empty
      (``full_lo = full_hi``) when there is none; always inside ``[lo, hi)``.

    One ``tile_bounds`` evaluation over every (sequence, block) pair gives both.

    >>> import jax.numpy as jnp
    >>> from fnattn import masks
    >>> L = jnp.array([130, 64, 10])
    >>> r = block_ranges(masks.causal(), 1, L, jnp.zeros_like(L), 32, 8)
    >>> r.lo.tolist(), r.hi.tolist(), r.full_lo.tolist(), r.full_hi.tolist()
    ([0, 0, 0], [5, 2, 1], [0, 0, 0], [4, 2, 0])
    >>> # the last query (position 129) sees keys 89..129: blocks 2 to 4, block 3 whole
    >>> r = block_ranges(masks.sliding_window(40), 1, L[:1], jnp.zeros((1,), jnp.int32), 32, 8)
    >>> r.lo.tolist(), r.hi.tolist(), r.full_lo.tolist(), r.full_hi.tolist()
    ([2], [5], [3], [4])
    """
    B = lengths.shape[0]
    live = lengths > 0
    first = lax.div(offsets, jnp.int32(block_k))
    end = jnp.where(live, cdiv(offsets + lengths, block_k), first)  # offsets + lengths >= 0
    j = jnp.arange(num_blocks, dtype=I32)[None, :]
    col = lambda x: x[:, None]  # noqa: E731
    k_lo = j * block_k - col(offsets)  # logical position of each block's first slot
    may = (j >= col(first)) & (j < col(end))
    whole = (k_lo >= 0) & (k_lo + block_k <= col(lengths))
    if mask is not None:
        t = masks.TileBounds(b=col(jnp.arange(B, dtype=I32)), h=jnp.zeros((1, 1), I32),
                             q_lo=jnp.zeros((1, 1), I32), q_hi=jnp.full((1, 1), Tq - 1, I32),
                             pos_lo=col(lengths - Tq), pos_hi=col(lengths - 1), k_lo=k_lo,
                             k_hi=k_lo + block_k - 1)
        visible, every = mask.tile_bounds(t, [])
        may = may & jnp.broadcast_to(visible, may.shape)
        whole = whole & jnp.broadcast_to(every, whole.shape)
    return BlockRanges(*span(may), *first_run(whole))


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
