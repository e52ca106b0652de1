"""What every paged lowering shares: the static configuration, block sizes,
sanitised run-time metadata and the work list.

**Run-time values are never trusted.** Page tables, lengths and query offsets
are data: a wrong value must not make a kernel read or write outside the pool.
:func:`sanitize` therefore turns them into values that are always safe, once,
before any lowering sees them:

* page-table entries outside ``[0, num_pages)`` become ``-1``; lowerings read
  page ``max(entry, 0)`` (always inside the pool), mask the keys of such pages
  and drop writes into them;
* context lengths are clipped to ``[0, pages_per_seq * page_size]``;
* ``num_seqs`` is clipped to ``[0, max_seqs]``; sequences at or past it are
  *padding*: no queries, no keys, no writes;
* ``query_start_loc`` is clipped to ``[0, total_tokens]`` and made
  non-decreasing (a running maximum), so every token belongs to at most one
  sequence; tokens that belong to none produce zeros and ``lse = -inf``.

:func:`fnattn.paged.check_inputs` reports the same conditions as errors.

**Work list.** Kernels launch one program per *work item*: ``block_q``
consecutive query tokens of one sequence (all query heads of one kv head
together). :func:`work_list` builds the list inside ``jit`` from the
sanitised metadata; its static length bounds the number of items any batch of
``total_tokens`` tokens can need, and unused items have no rows.
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from fnattn import _checks, masks
from fnattn._serving import KernelFacts, cdiv, first_run, pow2, span  # noqa: F401  (shared)
from fnattn.flash import blocks

F32 = jnp.float32
I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class PagedBlockSizes:
    """Tiling of the paged lowerings (``AttentionSpec(block_sizes=...)``).

    Attributes:
      block_q: query tokens of one sequence per program in ragged batches
        (``paged_attention`` always uses its Tq). None: the lowering's default.
      block_k: keys per step of the inner loop (XLA, Triton); the Mosaic kernel
        copies ``max(1, block_k // page_size)`` pages per step. None: default.
      num_splits: split-K factor: each work item's keys are cut into this many
        contiguous ranges, computed in parallel and merged with
        ``fnattn.merge``. None: chosen from the problem (more splits when there
        are few sequences and long contexts).
      num_warps, num_stages: Triton launch parameters.

    >>> PagedBlockSizes(block_k=128, num_splits=4).num_splits
    4
    >>> PagedBlockSizes(block_k=0)
    Traceback (most recent call last):
    ...
    ValueError: PagedBlockSizes: block_k must be a positive int or None; got 0
    """

    block_q: Optional[int] = None
    block_k: Optional[int] = None
    num_splits: Optional[int] = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "num_splits", "num_warps", "num_stages"):
            v = getattr(self, name)
            optional = name in ("block_q", "block_k", "num_splits")
            if v is None and optional:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"PagedBlockSizes: {name} must be a positive int"
                                 f"{' or None' if optional else ''}; got {v!r}")
        if self.num_warps & (self.num_warps - 1) or self.num_warps > 32:
            raise ValueError(f"PagedBlockSizes: num_warps must be a power of two <= 32; "
                             f"got {self.num_warps}")


def pick_block_sizes(block_sizes) -> PagedBlockSizes:
    """The spec's ``PagedBlockSizes``, or the defaults."""
    return blocks.pick(block_sizes, PagedBlockSizes, PagedBlockSizes())


@dataclasses.dataclass(frozen=True)
class Cfg(KernelFacts):
    """Static description of one paged call (hashable; part of the trace)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    num_pages: int
    page_size: int
    pages_per_seq: int
    max_seqs: int
    total_tokens: int
    scale: float
    softcap: Optional[float]
    mask_treedef: Any          # None without a mask
    has_sinks: bool
    uniform_q: Optional[int]   # paged_attention: every sequence has exactly this many queries
    update: bool               # new tokens' k/v are written into the pool first
    block_sizes: PagedBlockSizes
    term_treedef: Any = None   # a position term (its arrays: Meta.terms), or None
    mosaic_gpu: Any = None     # the spec's MosaicGpuDecodeBlockSizes (fnattn.paged.mosaic_gpu)
    value_dim: Optional[int] = None  # a latent pool: v_pages None, values k[..., :value_dim]
    tree: bool = False         # Meta.parents: a tree over each sequence's new tokens

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def capacity(self) -> int:
        return self.pages_per_seq * self.page_size


def term_value(cfg, meta, pos, rows):
    """The position term at ``pos``, its arrays' per-head values given by
    ``rows(x)`` for each (Hq,) array ``x`` of ``meta.terms`` (broadcastable with
    ``pos``), float32; None without a term."""
    term = cfg.term()
    if term is None:
        return None
    ops = [] if meta.terms is None else [rows(meta.terms[i]) for i in range(meta.terms.shape[0])]
    return jnp.asarray(term.value(pos, ops), jnp.float32)


class Meta(NamedTuple):
    """Sanitised per-sequence metadata (see the module docstring); all int32.

    Attributes:
      page_table: (S, P); invalid entries are -1.
      kv_len: (S,) keys of each sequence, in [0, capacity]; 0 for padding.
      q_start: (S,) first token row of each sequence in the packed q.
      q_len: (S,) new query tokens of each sequence; 0 for padding.
      parents: (T,) int32, each packed token's parent among its sequence's
        new tokens (-1: a root), for speculative tree verification
        (:mod:`fnattn.paged.tree`); or None. Only the XLA and reference
        lowerings read it.
      sizes: a tuple of int32 scalars, the leaves of a mask whose window or
        chunk sizes are arrays (:func:`fnattn._serving.traced_sizes`: one per
        call, e.g. per layer inside ``lax.scan``); or None. Only the XLA
        lowering reads it (:func:`mask_and_operands`).
      terms: (n, Hq) float32, the arrays of a position term
        (:mod:`fnattn.position_bias`), one value per query head; or None.
    """

    page_table: Any
    kv_len: Any
    q_start: Any
    q_len: Any
    parents: Any = None
    sizes: Any = None
    terms: Any = None


def mask_and_operands(cfg: Cfg, meta: Meta, *, stats: bool = False):
    """The mask (None without one) and its operands: none for a positional mask;
    for traced window or chunk sizes (``meta.sizes``) the mask rebuilt from them
    and each size as a scalar, as ``OperandStats`` (lo = hi) with ``stats``
    (what ``tile_bounds`` takes) or as the predicate's operand."""
    sizes = getattr(meta, "sizes", None)
    if not sizes:
        return cfg.mask(), []
    mask = jax.tree_util.tree_unflatten(cfg.mask_treedef, list(sizes))
    ops = [jnp.reshape(o, ()) for o in mask.operands()]
    return mask, [masks.OperandStats(o, o) for o in ops] if stats else ops


def sanitize(cfg: Cfg, page_table, context_lengths, query_start_loc, num_seqs) -> Meta:
    S, T = cfg.max_seqs, cfg.total_tokens
    pt = page_table.astype(I32)
    pt = jnp.where((pt >= 0) & (pt < cfg.num_pages), pt, -1)
    n = jnp.clip(jnp.reshape(num_seqs, (-1,))[0].astype(I32), 0, S)
    live = jnp.arange(S, dtype=I32) < n
    loc = lax.cummax(jnp.clip(query_start_loc.astype(I32), 0, T), axis=0)
    start, end = loc[:-1], loc[1:]
    q_len = jnp.where(live, end - start, 0)
    kv_len = jnp.where(live, jnp.clip(context_lengths.astype(I32), 0, cfg.capacity), 0)
    return Meta(pt, kv_len, start, q_len)


def token_owner(cfg: Cfg, meta: Meta):
    """(seq, row within the sequence, valid) of every packed token, each (T,) int32/bool."""
    t = jnp.arange(cfg.total_tokens, dtype=I32)
    if cfg.uniform_q is not None:
        seq = t // cfg.uniform_q
        row = t % cfg.uniform_q
        return seq, row, meta.q_len[seq] > 0
    # q_start is non-decreasing and each range ends before the next starts, so
    # the ends are sorted: the owner of t is the first sequence ending after t.
    ends = meta.q_start + meta.q_len
    seq = _count_le(ends, t)
    seq_c = jnp.minimum(seq, cfg.max_seqs - 1)
    row = t - meta.q_start[seq_c]
    valid = (seq < cfg.max_seqs) & (row >= 0) & (row < meta.q_len[seq_c])
    return seq_c, row, valid


class Work(NamedTuple):
    """One entry per work item (all (W,) int32): the kernels' scalar metadata."""

    seq: Any      # sequence slot (0 for unused items)
    tok: Any      # first packed token row
    rows: Any     # query tokens in the item (0: unused)
    row0: Any     # index of the first token among the sequence's new tokens
    q_pos: Any    # position of the first token = kv_len - q_len + row0
    kv_len: Any   # keys [0, kv_len) exist
    new_start: Any  # first position of the new tokens (kv_len - q_len)
    seq_tok: Any  # first packed token row of the sequence
    k_lo: Any     # key blocks [k_lo, k_hi) may hold a visible key
    k_hi: Any
    f_lo: Any     # key blocks [f_lo, f_hi) lie inside [0, kv_len) and every row of
    f_hi: Any     # the item sees all their keys (the mask need not be evaluated)

    def stacked(self):
        return jnp.stack(list(self), axis=1).astype(I32)


FIELDS = {name: i for i, name in enumerate(Work._fields)}


def num_work_items(cfg: Cfg, block_q: int) -> int:
    if cfg.uniform_q is not None:
        return cfg.max_seqs
    # Each live sequence needs ceil(q_len / block_q) items: at most one partial
    # item per sequence that has tokens.
    S, T = cfg.max_seqs, cfg.total_tokens
    if not (_checks.is_static(S) and _checks.is_static(T)):
        return cdiv(T, block_q) + S   # symbolic (jax.export): no min, and S bounds it
    return cdiv(T, block_q) + min(S, T)


def _count_le(sorted_values, x):
    """``searchsorted(sorted_values, x, side="right")`` as int32: for every entry of
    ``x`` the number of values <= it, by comparing all pairs (the values are few:
    one per sequence), which also holds for symbolic sizes under ``jax.export``."""
    return jnp.sum(sorted_values[:, None] <= x[None, :], axis=0, dtype=I32)


def work_list(cfg: Cfg, meta: Meta, block_q: int, block_k: int) -> Work:
    """The work items for ``block_q`` tokens per item and key blocks of ``block_k``."""
    W = num_work_items(cfg, block_q)
    if cfg.uniform_q is not None:
        seq = jnp.arange(W, dtype=I32)
        row0 = jnp.zeros((W,), I32)
        valid = meta.q_len > 0
    else:
        nb = cdiv(meta.q_len, block_q)
        cum = jnp.cumsum(nb).astype(I32)
        w = jnp.arange(W, dtype=I32)
        seq = _count_le(cum, w)
        valid = w < cum[-1]
        seq = jnp.where(valid, jnp.minimum(seq, cfg.max_seqs - 1), 0)
        row0 = jnp.where(valid, (w - (cum[seq] - nb[seq])) * block_q, 0)
    q_len, kv_len = meta.q_len[seq], meta.kv_len[seq]
    rows = jnp.where(valid, jnp.clip(q_len - row0, 0, block_q), 0)
    valid = rows > 0
    kv_len = jnp.where(valid, kv_len, 0)
    new_start = kv_len - q_len
    q_pos = new_start + row0
    seq_tok = meta.q_start[seq]
    tok = seq_tok + row0
    k_lo, k_hi, f_lo, f_hi = key_block_ranges(cfg, seq, row0, rows, q_pos, kv_len, block_k,
                                              meta=meta)
    return Work(seq, tok, rows, row0, q_pos, kv_len, new_start, seq_tok, k_lo, k_hi, f_lo,
                f_hi)


def key_block_ranges(cfg: Cfg, seq, row0, rows, q_pos, kv_len, block_k, meta=None):
    """``(k_lo, k_hi, f_lo, f_hi)``, each (items,) int32, from one evaluation of the
    mask's ``tile_bounds`` (the block-sparsity protocol of :mod:`fnattn.masks`)
    on every (item, key block) pair:

    * ``[k_lo, k_hi)``: the key blocks that may hold a key ``< kv_len`` visible
      to some row of the item;
    * ``[f_lo, f_hi)``: the first run of key blocks wholly inside ``[0, kv_len)``
      whose keys every row of the item sees (``all_true``): kernels skip the mask
      and the sanitising of hidden keys there. ``f_lo = f_hi`` when there is
      none (and for unused items); always inside ``[k_lo, k_hi)``.

    ``meta``: its traced window or chunk sizes (``Meta.sizes``), if any, are
    the mask's (the blocks a window leaves empty are skipped as for static ones).
    """
    n_blocks = cdiv(cfg.capacity, block_k)
    in_len = cdiv(kv_len, block_k)  # blocks holding a key < kv_len
    j = jnp.arange(n_blocks, dtype=I32)[None, :]
    col = lambda x: x[:, None]  # noqa: E731
    may = j < col(in_len)
    whole = ((j + 1) * block_k <= col(kv_len)) & col(rows > 0)
    mask, stats = mask_and_operands(cfg, meta, stats=True)
    if mask is not None:
        last = jnp.maximum(rows - 1, 0)
        t = masks.TileBounds(b=col(seq), h=jnp.zeros((1, 1), I32), q_lo=col(row0),
                             q_hi=col(row0 + last), pos_lo=col(q_pos), pos_hi=col(q_pos + last),
                             k_lo=j * block_k, k_hi=j * block_k + block_k - 1)
        visible, every = mask.tile_bounds(t, stats)
        may = may & jnp.broadcast_to(visible, may.shape)
        whole = whole & jnp.broadcast_to(every, whole.shape)
    return span(may) + first_run(whole)


def split_range(k_lo, k_hi, split, num_splits):
    """The key blocks of split ``split`` out of ``num_splits`` of [k_lo, k_hi)."""
    # lax.div (truncating; operands >= 0): jnp's floor division lowers through
    # `sign`, which the Mosaic lowering cannot handle without a TPU to ask.
    per = lax.div(k_hi - k_lo + (num_splits - 1), jnp.int32(num_splits))
    lo = jnp.minimum(k_lo + split * per, k_hi)
    return lo, jnp.minimum(lo + per, k_hi)


def positions(seq, head, raw_q, q_pos, k):
    return masks.Positions(b=seq, h=head, q=raw_q, q_pos=q_pos, k=k)


def merge_splits(out, lse, sink=None):
    """Merges split-K partial results: out (S, ..., Dv) and lse (S, ...) float32.

    ``sink`` (broadcastable to ``lse[0]``) joins the denominator once. Rows with
    no visible key in any split and no sink give 0 and -inf; infinite sinks and
    empty splits are handled as by :func:`fnattn.merging.merge_stacked` (which
    this is).
    """
    from fnattn.merging import merge_stacked
    return merge_stacked(out, lse, sink)
