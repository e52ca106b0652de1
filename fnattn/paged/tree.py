"""Speculative tree verification: the tree over each request's new tokens.

A request with context ``C`` (tokens already in the cache before the step) and
``n`` new tokens gives each new token ``i`` a parent ``draft_parents[i]``: the
index of an earlier new token of the same request (``0 <= parent < i``), or
``-1`` for a root, which hangs off the context. New token ``i`` then sees

* every context key (positions ``0 .. C - 1``), and
* among the new tokens, exactly its ancestors and itself;

and its position is ``C + depth(i)`` (a root has depth 0): the position RoPE
gives it, and the one positional masks (windows, chunks) and position terms
compare, for queries and for the new tokens' keys alike (a ``from_fn``
predicate gets the raw row ``i`` and those key positions).
(A chain, ``parents = [-1, 0, 1, ...]``, is causal attention over the new
tokens; the key of new token ``i`` lies in slot ``C + i`` of the cache.)

Every value is safe whatever it holds: a parent outside ``[-1, i)`` is read as
``-1`` (checked mode reports it, see :func:`check`); nothing is ever read
outside the request.

**Ancestor tests.** Parents are turned into depths and the ``2^k``-th
ancestor of every token by pointer jumping (``ceil(log2 T)`` rounds over the
packed tokens, no sequential loop); whether key ``a`` is an ancestor of query
``r`` is then whether lifting ``r`` by ``depth(r) - depth(a)`` levels lands on
``a``: ``log2 T`` gathers per (query, key) pair, done only for key blocks that
hold new tokens.
"""

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify

from fnattn import masks
from fnattn.paged import common
from fnattn.paged.common import I32

__all__ = ["Tree", "build", "check", "draft_positions", "draft_ancestor_mask"]


class Tree(NamedTuple):
    """The sanitised tree of every packed token (T tokens).

    Attributes:
      depth: (T,) int32, 0 for roots, padding tokens and invalid parents.
      up: (levels, T) int32: ``up[k, t]`` is the ``2^k``-th ancestor of ``t``
        (a packed token index) or -1.
    """

    depth: Any
    up: Any


def levels(total_tokens) -> int:
    """Rounds of pointer jumping that reach any ancestor among ``total_tokens``."""
    if not isinstance(total_tokens, int):
        return 32   # symbolic sizes (jax.export): enough for any int32 count
    return max(1, (total_tokens - 1).bit_length())


def global_parents(cfg, meta):
    """(T,) int32: the packed index of each token's parent, -1 for roots, padding
    tokens and parents outside ``[-1, row)``."""
    _, row, valid = common.token_owner(cfg, meta)
    p = meta.parents.astype(I32)
    ok = valid & (p >= 0) & (p < row)
    t = jnp.arange(cfg.total_tokens, dtype=I32)
    return jnp.where(ok, t - row + p, -1)


def build(cfg, meta) -> Tree:
    """Depths and ancestor tables of the packed tokens (pointer jumping)."""
    jump = global_parents(cfg, meta)
    dist = (jump >= 0).astype(I32)
    ups = []
    for _ in range(levels(cfg.total_tokens)):
        ups.append(jump)
        has = jump >= 0
        at = jnp.maximum(jump, 0)
        dist = dist + jnp.where(has, dist[at], 0)
        jump = jnp.where(has, jump[at], -1)
    return Tree(dist, jnp.stack(ups))


def is_ancestor(tree: Tree, r, a):
    """Whether packed token ``a`` is ``r`` or an ancestor of it (broadcast int arrays
    of packed indices, in range)."""
    diff = tree.depth[r] - tree.depth[a]
    x = r
    for k in range(tree.up.shape[0]):
        step = ((diff >> k) & 1) == 1
        x = jnp.where(step & (x >= 0), tree.up[k][jnp.maximum(x, 0)], x)
    return (diff >= 0) & (x == a)


def key_positions(tree: Tree, kpos, new_start, seq_tok, kv_len):
    """The positions of keys in slots ``kpos`` (broadcast with ``new_start``,
    ``seq_tok``, ``kv_len``): the slot for context keys, ``new_start + depth``
    for new tokens; and (is new, packed index of the new token)."""
    new = (kpos >= new_start) & (kpos < kv_len)
    t = jnp.clip(seq_tok + kpos - new_start, 0, tree.depth.shape[0] - 1)
    return jnp.where(new, new_start + tree.depth[t], kpos), new, t


def block_ranges(cfg, work, tree: Tree, bq: int, block_k: int, meta=None):
    """``common.key_block_ranges`` for a tree: the mask's ``tile_bounds`` at the
    items' depth-based query positions and at key blocks whose positions reach
    down to ``new_start`` where they hold new tokens; blocks holding new tokens
    are never wholly visible (the tree hides some of their keys). ``meta``: its
    traced window or chunk sizes, if any, are the mask's (as for
    ``common.key_block_ranges``)."""
    n_blocks = common.cdiv(cfg.capacity, block_k)
    col = lambda x: x[:, None]  # noqa: E731
    rows = work.rows
    j = jnp.arange(n_blocks, dtype=I32)[None, :]
    may = j < col(common.cdiv(work.kv_len, block_k))
    whole = ((j + 1) * block_k <= col(work.kv_len)) & col(rows > 0)
    whole = whole & ((j + 1) * block_k <= col(work.new_start))
    t = jnp.arange(bq, dtype=I32)[None, :]
    live = t < col(rows)
    idx = jnp.clip(col(work.tok) + t, 0, tree.depth.shape[0] - 1)
    d = tree.depth[idx]
    big = jnp.iinfo(jnp.int32).max
    d_lo = jnp.where(live, d, big).min(axis=1)
    d_hi = jnp.where(live, d, 0).max(axis=1)
    d_lo = jnp.where(rows > 0, d_lo, 0)
    k_first = j * block_k
    holds_new = (k_first + block_k > col(work.new_start))
    k_lo = jnp.where(holds_new, jnp.minimum(k_first, col(work.new_start)), k_first)
    mask, stats = common.mask_and_operands(cfg, meta, stats=True)
    if mask is not None:
        tb = masks.TileBounds(b=col(work.seq), h=jnp.zeros((1, 1), I32), q_lo=col(work.row0),
                              q_hi=col(work.row0 + jnp.maximum(rows - 1, 0)),
                              pos_lo=col(work.new_start + d_lo),
                              pos_hi=col(work.new_start + d_hi),
                              k_lo=k_lo, k_hi=k_first + block_k - 1)
        visible, every = mask.tile_bounds(tb, stats)
        may = may & jnp.broadcast_to(visible, may.shape)
        whole = whole & jnp.broadcast_to(every, whole.shape)
    return common.span(may) + common.first_run(whole)


def chunk_visibility(tree: Tree, work, kpos, bq: int, group: int):
    """For one chunk of key slots ``kpos`` (C,): the keys' positions (1, W, 1, C)
    and which (row, key) pairs the tree lets through (1, W, bq * group, C);
    the ancestor tests run only when some item's chunk holds new tokens."""
    col = lambda x: x[:, None]  # noqa: E731
    kp = kpos[None, :]
    pos, new, kt = key_positions(tree, kp, col(work.new_start), col(work.seq_tok),
                                 col(work.kv_len))                      # (W, C)
    T = tree.depth.shape[0]
    W = work.seq.shape[0]
    qt = jnp.clip(col(work.tok) + jnp.arange(bq, dtype=I32)[None, :], 0, T - 1)  # (W, bq)

    def tested(_):
        anc = is_ancestor(tree, qt[:, :, None], kt[:, None, :])         # (W, bq, C)
        return ~new[:, None, :] | anc

    any_new = jnp.any(new & col(work.rows > 0))
    ok = lax.cond(any_new, tested, lambda _: jnp.ones((W, bq, kpos.shape[0]), bool), None)
    ok = jnp.repeat(ok, group, axis=1)
    return pos[None, :, None, :], ok[None]


def query_positions(tree: Tree, work, bq: int, group: int):
    """(1, W, bq * group, 1): each item row's position, ``new_start + depth``."""
    T = tree.depth.shape[0]
    qt = jnp.clip(work.tok[:, None] + jnp.arange(bq, dtype=I32)[None, :], 0, T - 1)
    pos = work.new_start[:, None] + tree.depth[qt]
    return jnp.repeat(pos, group, axis=1)[None, :, :, None]


def check(parents, *, query_start_loc, num_seqs, max_seqs, fn="draft_parents"):
    """checkify errors for parents outside ``[-1, row)`` of live tokens."""
    T = parents.shape[0]
    loc = lax.cummax(jnp.clip(query_start_loc.astype(I32), 0, T), axis=0)
    n = jnp.clip(jnp.reshape(num_seqs, (-1,))[0].astype(I32), 0, max_seqs)
    t = jnp.arange(T, dtype=I32)
    seq = jnp.sum(loc[1:][:, None] <= t[None, :], axis=0, dtype=I32)
    seq_c = jnp.minimum(seq, max_seqs - 1)
    row = t - loc[seq_c]
    live = (seq < n) & (row >= 0)
    p = parents.astype(I32)
    bad = live & ((p < -1) | (p >= row))
    i = jnp.argmax(bad)
    checkify.check(~bad.any(), f"{fn}[{{t}}] = {{p}} is not a parent of token {{t}} (new token "
                   "{r} of sequence {s}): a parent is -1 (a root, attached to the context) or "
                   "an earlier new token of the same sequence, 0 <= parent < {r}",
                   t=i, p=p[i], r=row[i], s=seq_c[i])


def draft_positions(draft_parents, *, context_lengths, query_start_loc=None, num_seqs=None,
                    page_table=None):
    """Each new token's position, ``context + depth`` in its tree, for RoPE or a
    learned position embedding.

    ``context_lengths`` counts every token of a sequence, the new ones included
    (as the paged attention functions take it), so the context before the step
    is ``context_lengths - n``.

    Args:
      draft_parents: (total_tokens,) int, each packed token's parent among its
        sequence's new tokens (-1: a root), with ``query_start_loc`` and
        ``num_seqs`` as for :func:`fnattn.ragged_paged_attention`; or (B, Tq)
        int as for :func:`fnattn.paged_attention`, with ``context_lengths``
        its ``kv_lengths`` (B,).
      context_lengths: (max_seqs,) or (B,) int.
      query_start_loc: (max_seqs + 1,) int (ragged form only).
      num_seqs: int scalar (ragged form only; default: every sequence).
      page_table: unused; taken so that the metadata of
        ``PagedKVCache.ragged_metadata`` can be passed whole (``**meta``).

    Returns:
      int32 positions shaped like ``draft_parents``; -1 for padding tokens.

    >>> import jax.numpy as jnp, fnattn
    >>> parents = jnp.array([-1, 0, 0, 1, -1, 0])      # seq 0: 4 new tokens, seq 1: 2
    >>> fnattn.draft_positions(parents, context_lengths=jnp.array([10, 5]),
    ...                        query_start_loc=jnp.array([0, 4, 6])).tolist()
    [6, 7, 7, 8, 3, 4]
    >>> fnattn.draft_positions(jnp.array([[-1, 0, 0]]), context_lengths=jnp.array([7])).tolist()
    [[4, 5, 5]]
    """
    fn = "draft_positions"
    del page_table
    parents = jnp.asarray(draft_parents)
    lengths = jnp.asarray(context_lengths)
    if not jnp.issubdtype(parents.dtype, jnp.integer):
        raise TypeError(f"{fn}: draft_parents must be an integer array; got {parents.dtype}")
    if parents.ndim == 2:
        if query_start_loc is not None or num_seqs is not None:
            raise ValueError(f"{fn}: draft_parents (B, Tq) is paged_attention's form: pass "
                             "context_lengths (B,) only (no query_start_loc, num_seqs)")
        B, Tq = parents.shape
        if lengths.shape != (B,):
            raise ValueError(f"{fn}: context_lengths must have shape (B,)=({B},) from "
                             f"draft_parents {parents.shape}; got {lengths.shape}")
        loc = jnp.arange(B + 1, dtype=I32) * Tq
        out = draft_positions(parents.reshape(-1), context_lengths=lengths,
                              query_start_loc=loc, num_seqs=jnp.int32(B))
        return out.reshape(B, Tq)
    if parents.ndim != 1 or query_start_loc is None:
        raise ValueError(f"{fn}: draft_parents must be (total_tokens,) with query_start_loc, "
                         f"or (B, Tq); got shape {parents.shape}"
                         + ("" if query_start_loc is not None else " without query_start_loc"))
    loc = jnp.asarray(query_start_loc)
    S = lengths.shape[0]
    if loc.shape != (S + 1,):
        raise ValueError(f"{fn}: query_start_loc must have shape (max_seqs + 1,)=({S + 1},) "
                         f"from context_lengths {lengths.shape}; got {loc.shape}")
    cfg = _Sizes(total_tokens=parents.shape[0], max_seqs=S)
    meta = _meta(cfg, lengths, loc, S if num_seqs is None else num_seqs, parents)
    tree = build(cfg, meta)
    seq, _, valid = common.token_owner(cfg, meta)
    start = meta.kv_len[seq] - meta.q_len[seq]
    return jnp.where(valid, start + tree.depth, -1).astype(I32)


class _Sizes(NamedTuple):
    total_tokens: int
    max_seqs: int
    uniform_q: Any = None


def _meta(cfg, lengths, loc, num_seqs, parents):
    T, S = cfg.total_tokens, cfg.max_seqs
    n = jnp.clip(jnp.reshape(jnp.asarray(num_seqs), (-1,))[0].astype(I32), 0, S)
    live = jnp.arange(S, dtype=I32) < n
    loc = lax.cummax(jnp.clip(loc.astype(I32), 0, T), axis=0)
    q_len = jnp.where(live, loc[1:] - loc[:-1], 0)
    kv_len = jnp.where(live, jnp.maximum(lengths.astype(I32), 0), 0)
    return common.Meta(None, kv_len, loc[:-1], q_len, parents=parents)


def draft_ancestor_mask(draft_parents):
    """(n, n) bool for one request's parents (n,): ``[i, j]`` is True where new
    token ``j`` is ``i`` or an ancestor of ``i`` (the attention pattern among the
    new tokens; an invalid parent is a root).

    >>> draft_ancestor_mask(jnp.array([-1, 0, 0, 1])).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    parents = jnp.asarray(draft_parents)
    n = parents.shape[0]
    cfg = _Sizes(total_tokens=n, max_seqs=1)
    meta = _meta(cfg, jnp.array([n]), jnp.array([0, n]), 1, parents)
    tree = build(cfg, meta)
    i = jnp.arange(n, dtype=I32)
    return is_ancestor(tree, i[:, None], i[None, :])

