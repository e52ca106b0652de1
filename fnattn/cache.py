"""Functional paged KV caches for the paged attention functions.

Frozen pytrees of arrays with pure helpers: every helper returns a new cache
(under ``jax.jit`` with the cache donated, the updates happen in place).

``PagedKVCache`` holds one layer: the two pools in the heads-major layout of
:mod:`fnattn.paged`, the page table, the length of every sequence slot and a
stack of free pages::

    k_pages     (Hkv, num_pages, page_size, D)
    v_pages     (Hkv, num_pages, page_size, Dv)
    page_table  (max_seqs, max_pages_per_seq) int32, -1 where no page is allocated
    lengths     (max_seqs,) int32
    free_pages  (num_pages,) int32: free_pages[:num_free] are free
    num_free    () int32

``LayeredPagedKVCache`` holds every layer of a model: the same page table,
lengths and free stack, shared by all layers (a sequence's tokens are at the
same page and offset in every layer, so they are allocated once), and one pair
of pools per layer, stacked on a leading layer axis::

    k_pages     (num_layers, Hkv, num_pages, page_size, D)
    v_pages     (num_layers, Hkv, num_pages, page_size, Dv)

so that ``jax.lax.scan`` over the layers takes ``(k_pages, v_pages)`` as its
``xs`` and gives each layer the pools of :mod:`fnattn.paged`.

Sequences are identified by their slot ``0 .. max_seqs - 1``. A serving loop
makes room for the new tokens of some slots (pages are taken from the free
stack as needed), writes their k/v, runs attention with ``page_table``/``lengths``,
and ``release``\\ s a slot when its sequence finishes (its pages go back to the
stack; the slot can be reused at once). There are two ways to write:

* ``allocate`` then :func:`fnattn.ragged_paged_attention_with_update`, which
  writes the tokens and attends in one call;
* ``allocate_slots``, which also returns the :class:`TokenSlots` (where each
  token goes), then :func:`write_tokens` per layer (or ``append`` for a
  :class:`PagedKVCache`, which does both) and any paged attention function.

Running out of room never corrupts anything: tokens past a slot's capacity
(``max_pages_per_seq * page_size``) or that need a page when none is free are
not stored (``lengths`` stops at the capacity; a missing page stays -1 in the
table, so attention masks those keys). ``num_free`` tells how much room is left.
(On the ``allocate`` + ``ragged_paged_attention_with_update`` route the kernel
places the new tokens from the lengths, which stop at the capacity: tokens that
overflow a slot land over that slot's last tokens. Keep sequences within
``capacity``.)

>>> import jax, jax.numpy as jnp
>>> from fnattn import PagedKVCache
>>> cache = PagedKVCache.create(num_pages=6, page_size=4, num_kv_heads=1, head_dim=2,
...                             max_seqs=3, max_pages_per_seq=2)
>>> k = v = jnp.ones((7, 1, 2))
>>> cache = jax.jit(PagedKVCache.append)(cache, jnp.array([0, 0, 0, 0, 0, 2, 2]), k, v)
>>> cache.lengths.tolist(), cache.page_table.tolist(), int(cache.num_free)
([5, 0, 2], [[5, 4], [-1, -1], [3, -1]], 3)
>>> cache = jax.jit(PagedKVCache.release)(cache, 0)
>>> cache.lengths.tolist(), int(cache.num_free)
([0, 0, 2], 5)
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from fnattn import quant

__all__ = ["LayeredKVCache", "LayeredPagedKVCache", "PagedKVCache", "TokenSlots", "write_tokens"]

I32 = jnp.int32


# ----------------------------------------------------------------------------------
# Where the new tokens go
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenSlots:
    """Where each new token of a step goes in the pools, from ``allocate_slots``.

    The same for every layer of a :class:`LayeredPagedKVCache`: compute it once
    per step and pass it to :func:`write_tokens` (or
    :meth:`LayeredPagedKVCache.write`) in each layer. A type of its own so that
    the slot ids (``seq_ids``, also a (T,) int array) cannot be passed by mistake.

    Attributes:
      index: (T,) int32, ``page * page_size + offset`` of token t in the pool
        seen as ``num_pages * page_size`` slots per kv head;
        ``num_pages * page_size`` for a token that is not stored (padding, past
        the capacity, no page left). Any value outside
        ``[0, num_pages * page_size)`` writes nothing.
      positions: (T,) int32, the position of token t in its sequence (0 for a
        sequence's first token): the slot's length before the step plus the
        number of earlier tokens of the same slot in the step, whether or not
        the token fits in the cache; -1 for a token with no slot. The positions
        RoPE or a learned position embedding needs. ``None`` when the slots were
        built by hand without them.

    >>> import jax.numpy as jnp
    >>> TokenSlots(jnp.array([5, 6, 64])).index.tolist()
    [5, 6, 64]
    """

    index: Any
    positions: Any = None


jax.tree_util.register_dataclass(TokenSlots, data_fields=["index", "positions"],
                                 meta_fields=[])


def _shape(x):
    # np.shape: jnp.shape of a list is deprecated (and will raise) in JAX.
    return tuple(x.shape) if quant.is_quantized(x) else tuple(np.shape(x))


def _check_tokens(fn, T, Hkv, D, Dv, k, v):
    for name, x, want in (("k", k, (T, Hkv, D)), ("v", v, (T, Hkv, Dv))):
        if _shape(x) != want:
            raise ValueError(f"{fn}: {name} must have shape (T, Hkv, "
                             f"{'D' if name == 'k' else 'Dv'})={want}; got {_shape(x)}")


def _check_slots(fn, slots):
    if not isinstance(slots, TokenSlots):
        raise TypeError(f"{fn}: slots must be the TokenSlots that allocate_slots returns "
                        f"(cache, slots = cache.allocate_slots(seq_ids)); got "
                        f"{type(slots).__name__}. The slot ids (seq_ids) say which sequence a "
                        "token is in, not where it goes.")
    index = slots.index
    if not hasattr(index, "dtype") or not jnp.issubdtype(index.dtype, jnp.integer) \
            or index.ndim != 1:
        raise TypeError(f"{fn}: slots.index must be a 1-D integer array (one entry per new "
                        f"token); got {getattr(index, 'dtype', type(index).__name__)} "
                        f"{_shape(index)}")
    return index.shape[0]


def _check_pool(fn, name, x, ndim, axes):
    if not hasattr(x, "shape") or len(x.shape) != ndim:
        raise ValueError(f"{fn}: {name} must have {ndim} axes {axes}; got shape {_shape(x)}")


def _put(pool, index, new):
    """pool (Hkv, N, ps, D) with new (T, Hkv, D) at the flat slots ``index`` (T,);
    indices outside [0, N * ps) are dropped. A quantized pool gets
    :func:`fnattn.quant.quantize`'s codes and per-token scales."""
    Hkv, N, ps, D = pool.shape
    index = jnp.where((index >= 0) & (index < N * ps), index, N * ps)
    if quant.is_quantized(pool):
        flat = quant.write(pool.reshape_leading(Hkv, N * ps), (slice(None), index),
                           jnp.swapaxes(new, 0, 1))
        return flat.reshape_leading(Hkv, N, ps)
    flat = pool.reshape(Hkv, N * ps, D)
    flat = flat.at[:, index].set(jnp.swapaxes(new, 0, 1).astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


def write_tokens(k_pages, v_pages, slots: TokenSlots, k, v):
    """Writes one layer's new k/v into its pools at ``slots`` (from ``allocate_slots``).

    Pure: returns the new pools (donate them under ``jax.jit`` for an in-place
    write). Tokens whose slot is outside the pool (not stored) are dropped.

    Args:
      k_pages: (Hkv, num_pages, page_size, D), one layer's pool (a slice of a
        :class:`LayeredPagedKVCache`'s ``k_pages``, e.g. in ``lax.scan``).
      v_pages: (Hkv, num_pages, page_size, Dv).
      slots: the :class:`TokenSlots` of the step's T tokens.
      k: (T, Hkv, D), cast to the pool's dtype.
      v: (T, Hkv, Dv).

    Returns:
      ``(k_pages, v_pages)``.

    >>> import jax.numpy as jnp
    >>> from fnattn.cache import TokenSlots, write_tokens
    >>> kp = vp = jnp.zeros((1, 3, 2, 1))                  # 3 pages of 2 slots
    >>> kp, vp = write_tokens(kp, vp, TokenSlots(jnp.array([5, 0, 6])),
    ...                       jnp.array([[[1.]], [[2.]], [[3.]]]), jnp.ones((3, 1, 1)))
    >>> kp[0, :, :, 0].tolist()                            # slot 6 is past the pool: dropped
    [[2.0, 0.0], [0.0, 0.0], [0.0, 1.0]]
    """
    fn = "write_tokens"
    T = _check_slots(fn, slots)
    _check_pool(fn, "k_pages", k_pages, 4, "(Hkv, num_pages, page_size, D)")
    _check_pool(fn, "v_pages", v_pages, 4, "(Hkv, num_pages, page_size, Dv)")
    if v_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError(f"{fn}: v_pages must have shape (Hkv, num_pages, page_size, Dv)="
                         f"{(*k_pages.shape[:3], 'Dv')} matching k_pages {_shape(k_pages)}; "
                         f"got {_shape(v_pages)}")
    Hkv, D, Dv = k_pages.shape[0], k_pages.shape[3], v_pages.shape[3]
    _check_tokens(fn, T, Hkv, D, Dv, k, v)
    return (_put(k_pages, slots.index, jnp.asarray(k)),
            _put(v_pages, slots.index, jnp.asarray(v)))


# ----------------------------------------------------------------------------------
# The bookkeeping both caches share (page table, lengths, free stack)
# ----------------------------------------------------------------------------------


def _check_sizes(owner, **sizes):
    for name, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"{owner}.create: {name} must be a positive int; got {n!r}")


def _empty_book(num_pages, max_seqs, max_pages_per_seq):
    return dict(page_table=jnp.full((max_seqs, max_pages_per_seq), -1, I32),
                lengths=jnp.zeros((max_seqs,), I32),
                # Popped from the end: page 0 is handed out last.
                free_pages=jnp.arange(num_pages, dtype=I32),
                num_free=jnp.int32(num_pages))


def _check_seq_ids(cache, fn, seq_ids):
    if not hasattr(seq_ids, "dtype") or not jnp.issubdtype(seq_ids.dtype, jnp.integer) \
            or seq_ids.ndim != 1:
        raise TypeError(f"{type(cache).__name__}.{fn}: seq_ids must be a 1-D integer array "
                        f"(one slot per new token, -1 for none); got "
                        f"{getattr(seq_ids, 'dtype', type(seq_ids).__name__)} "
                        f"{_shape(seq_ids)}")


def _allocate(cache, seq_ids):
    S, P, ps = cache.max_seqs, cache.max_pages_per_seq, cache.page_size
    seq = jnp.where((seq_ids >= 0) & (seq_ids < S), seq_ids, S).astype(I32)
    counts = jnp.zeros((S + 1,), I32).at[seq].add(1)[:S]
    old = cache.lengths
    new = jnp.minimum(old + counts, cache.capacity)
    old_pages, new_pages = -(-old // ps), -(-new // ps)
    # Logical page j of slot s is new when old_pages[s] <= j < new_pages[s]; the
    # k-th new page overall (slots in order) is the k-th from the top of the stack.
    need = new_pages - old_pages
    before = jnp.cumsum(need) - need
    j = jnp.arange(P, dtype=I32)[None, :]
    fresh = (j >= old_pages[:, None]) & (j < new_pages[:, None])
    k = before[:, None] + j - old_pages[:, None]
    idx = cache.num_free - 1 - k
    got = fresh & (idx >= 0)
    page = cache.free_pages[jnp.clip(idx, 0, cache.num_pages - 1)]
    table = jnp.where(got, page, jnp.where(fresh, -1, cache.page_table))
    num_free = jnp.maximum(cache.num_free - need.sum(), 0)
    return cache.replace(page_table=table.astype(I32), lengths=new,
                         num_free=num_free.astype(I32))


def _token_positions(cache, seq_ids):
    """(slot, slot is valid, position) of each new token, from the lengths before
    the tokens are added."""
    S = cache.max_seqs
    T = seq_ids.shape[0]
    ok_seq = (seq_ids >= 0) & (seq_ids < S)
    seq = jnp.where(ok_seq, seq_ids, S).astype(I32)
    # Rank of each token among the earlier tokens of its slot (stable sort).
    order = jnp.argsort(seq, stable=True)
    sorted_seq = seq[order]
    first = jnp.searchsorted(sorted_seq, sorted_seq, side="left")
    rank = jnp.zeros((T,), I32).at[order].set(jnp.arange(T, dtype=I32) - first)
    seq_c = jnp.minimum(seq, S - 1)
    return seq_c, ok_seq, cache.lengths[seq_c] + rank


def _allocate_slots(cache, seq_ids):
    # Positions come from the lengths *before* the allocation: past the capacity
    # the lengths stop growing and could not say where the tokens were meant to go.
    seq, ok_seq, pos = _token_positions(cache, seq_ids)
    new = _allocate(cache, seq_ids)
    ps = cache.page_size
    page = new.page_table[seq, jnp.clip(pos // ps, 0, cache.max_pages_per_seq - 1)]
    ok = ok_seq & (pos < cache.capacity) & (page >= 0)
    index = jnp.where(ok, page * ps + pos % ps, cache.num_pages * ps).astype(I32)
    return new, TokenSlots(index, jnp.where(ok_seq, pos, -1).astype(I32))


def _release(cache, seq_id):
    S, N = cache.max_seqs, cache.num_pages
    seq_id = jnp.asarray(seq_id, I32)
    ok = (seq_id >= 0) & (seq_id < S)
    s = jnp.clip(seq_id, 0, S - 1)
    row = cache.page_table[s]
    mine = ok & (row >= 0) & (row < N)
    r = jnp.cumsum(mine) - 1
    dest = jnp.where(mine, cache.num_free + r, N)  # N: dropped
    free = cache.free_pages.at[dest].set(row, mode="drop")
    num_free = jnp.minimum(cache.num_free + mine.sum(), N)
    table = cache.page_table.at[s].set(jnp.where(ok, -1, row))
    lengths = cache.lengths.at[s].set(jnp.where(ok, 0, cache.lengths[s]))
    return cache.replace(page_table=table, lengths=lengths, free_pages=free,
                         num_free=num_free.astype(I32))


def _ragged_metadata(cache, seq_ids, checked, return_positions):
    S = cache.max_seqs
    if checked:
        seq_ids = jnp.asarray(seq_ids)
        checkify.check(~(seq_ids >= S).any(), "ragged_metadata: seq_ids holds slot {x}; "
                       f"slots are 0 .. max_seqs - 1 = {S - 1} (and -1 for padding)",
                       x=jnp.max(seq_ids))
        key = jnp.where(seq_ids >= 0, seq_ids, S)
        down = key[1:] < key[:-1]
        at = jnp.argmax(down) + 1
        checkify.check(~down.any(), "ragged_metadata: seq_ids must be sorted by slot with "
                       "-1 padding at the end; seq_ids[{i}] = {a} follows {b}",
                       i=at, a=seq_ids[at], b=seq_ids[at - 1])
    seq = jnp.where((seq_ids >= 0) & (seq_ids < S), seq_ids, S).astype(I32)
    counts = jnp.zeros((S + 1,), I32).at[seq].add(1)[:S]
    loc = jnp.concatenate([jnp.zeros((1,), I32), jnp.cumsum(counts).astype(I32)])
    meta = dict(page_table=cache.page_table, context_lengths=cache.lengths,
                query_start_loc=loc, num_seqs=jnp.int32(S))
    if not return_positions:
        return meta
    # The lengths already count the step's tokens: row t of slot s (rows
    # loc[s] .. loc[s + 1] - 1) is at lengths[s] - (loc[s + 1] - t), the layout
    # the ragged attention functions assume.
    seq_c = jnp.minimum(seq, S - 1)
    t = jnp.arange(seq.shape[0], dtype=I32)
    pos = cache.lengths[seq_c] - loc[seq_c + 1] + t
    return meta, jnp.where(seq < S, pos, -1).astype(I32)


def _check_accepted(cache, num_drafts, accepted, checked, parents=None):
    """Shapes at trace time; concrete values at trace time; traced ones with
    ``checked`` (checkify). With ``parents`` (max_seqs, max_drafts) the path must
    follow them: each accepted node's parent is the node before it, the first
    one's parent the root (-1)."""
    fn = f"{type(cache).__name__}.accept_drafts"
    S = cache.max_seqs
    for name, x, nd, what in (("num_drafts", num_drafts, 1, "(max_seqs,)"),
                              ("accepted", accepted, 2, "(max_seqs, max_accepted)")):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{fn}: {name} must be an integer array {what}; got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.ndim != nd or x.shape[0] != S:
            raise ValueError(f"{fn}: {name} must have shape {what} with max_seqs={S}; got "
                             f"{_shape(x)}")
    msg = (f"{fn}: accepted[{{s}}] must be a root-to-node path of slot {{s}}'s draft tokens: "
           "increasing indices into its num_drafts[{s}] = {n} new tokens, then -1 padding; "
           "entry {i} is {x}")
    if not isinstance(accepted, jax.core.Tracer) and not isinstance(num_drafts,
                                                                    jax.core.Tracer):
        a, n = np.asarray(accepted), np.asarray(num_drafts)
        for s in range(S):
            bad = _bad_path(a[s], int(n[s]))
            if bad is not None:
                raise ValueError(msg.format(s=s, n=int(n[s]), i=bad, x=int(a[s, bad])))
    elif checked:
        a, n = accepted.astype(I32), num_drafts.astype(I32)
        pad = a < 0
        after = jnp.cumsum(pad, axis=1) > 0
        prev = jnp.concatenate([jnp.full((S, 1), -1, I32), a[:, :-1]], axis=1)
        bad = (after & ~pad) | (~after & ((a >= n[:, None]) | (a <= prev)))
        flat = jnp.argmax(bad.reshape(-1))
        s, i = flat // a.shape[1], flat % a.shape[1]
        checkify.check(~bad.any(), msg.replace("{{s}}", "{s}"), s=s, n=n[s], i=i, x=a[s, i])
    if parents is not None:
        _check_follows_parents(fn, S, accepted, parents, checked)


def _check_follows_parents(fn, S, accepted, parents, checked):
    if not hasattr(parents, "dtype") or not jnp.issubdtype(parents.dtype, jnp.integer):
        raise TypeError(f"{fn}: parents must be an integer array (max_seqs, max_drafts); got "
                        f"{getattr(parents, 'dtype', type(parents).__name__)}")
    if parents.ndim != 2 or parents.shape[0] != S:
        raise ValueError(f"{fn}: parents must have shape (max_seqs, max_drafts) with "
                         f"max_seqs={S}; got {_shape(parents)}")
    msg = (f"{fn}: accepted[{{s}}] must follow parents[{{s}}]: entry {{i}} is node {{x}}, "
           "whose parent is {p}, but the node before it is {q} (-1: the root)")
    if not isinstance(accepted, jax.core.Tracer) and not isinstance(parents, jax.core.Tracer):
        a, par = np.asarray(accepted), np.asarray(parents)
        for s in range(S):
            prev = -1
            for i, x in enumerate(int(v) for v in a[s]):
                if x < 0:
                    break
                p = int(par[s, x]) if x < par.shape[1] else None
                if p != prev:
                    raise ValueError(msg.format(s=s, i=i, x=x, p=p, q=prev))
                prev = x
    elif checked:
        a, par = accepted.astype(I32), parents.astype(I32)
        prev = jnp.concatenate([jnp.full((S, 1), -1, I32), a[:, :-1]], axis=1)
        live = a >= 0
        p = jnp.take_along_axis(par, jnp.clip(a, 0, par.shape[1] - 1), axis=1)
        p = jnp.where(a < par.shape[1], p, -2)
        bad = live & (p != prev)
        flat = jnp.argmax(bad.reshape(-1))
        s, i = flat // a.shape[1], flat % a.shape[1]
        checkify.check(~bad.any(), msg.replace("{{s}}", "{s}").replace("{{i}}", "{i}")
                       .replace("{{x}}", "{x}"),
                       s=s, i=i, x=a[s, i], p=p[s, i], q=prev[s, i])


def _bad_path(row, n):
    """The first entry of ``row`` that breaks "increasing in [0, n), then -1s", or None."""
    prev, ended = -1, False
    for i, x in enumerate(int(v) for v in row):
        if x < 0:
            ended = True
        elif ended or x >= n or x <= prev:
            return i
        else:
            prev = x
    return None


def _accept_book(cache, num_drafts, accepted):
    """The bookkeeping of ``accept_drafts``: (cache with shortened lengths and the
    emptied pages freed, flat source slots, flat destination slots), the slots
    (max_seqs * max_accepted,) with ``num_pages * page_size`` for none."""
    S, P, ps, N = cache.max_seqs, cache.max_pages_per_seq, cache.page_size, cache.num_pages
    lengths = cache.lengths
    n = jnp.clip(num_drafts.astype(I32), 0, lengths)
    ctx = lengths - n
    acc = accepted.astype(I32)
    A = acc.shape[1]
    ok = (acc >= 0) & (acc < n[:, None])
    prefix = jnp.cumprod(ok.astype(I32), axis=1).astype(bool)
    k = jnp.minimum(prefix.sum(axis=1), n).astype(I32)
    take = prefix & (jnp.arange(A, dtype=I32)[None, :] < k[:, None])

    def flat(pos, valid):
        page = cache.page_table[jnp.arange(S)[:, None], jnp.clip(pos // ps, 0, P - 1)]
        good = valid & (pos >= 0) & (pos < cache.capacity) & (page >= 0) & (page < N)
        return jnp.where(good, page * ps + pos % ps, N * ps).reshape(-1)

    src = flat(ctx[:, None] + acc, take)
    dst = flat(ctx[:, None] + jnp.arange(A, dtype=I32)[None, :], take)
    new_len = jnp.where(n > 0, ctx + k, lengths)
    keep = -(-new_len // ps)
    table = cache.page_table
    j = jnp.arange(P, dtype=I32)[None, :]
    drop = (n > 0)[:, None] & (j >= keep[:, None]) & (table >= 0) & (table < N)
    r = jnp.cumsum(drop.reshape(-1)) - 1
    dest = jnp.where(drop.reshape(-1), cache.num_free + r, N)      # N: dropped
    free = cache.free_pages.at[dest].set(table.reshape(-1), mode="drop")
    num_free = jnp.minimum(cache.num_free + drop.sum(), N).astype(I32)
    book = cache.replace(page_table=jnp.where(drop, -1, table).astype(I32),
                         lengths=new_len.astype(I32), free_pages=free, num_free=num_free)
    return book, src, dst


def _move(pool, src, dst):
    """pool (Hkv, N, ps, D) (float or quantized) with the slots ``dst`` set to the
    bits of the slots ``src`` (flat slot indices; ``dst`` outside the pool: none)."""
    Hkv, N, ps = pool.shape[:3]
    src = jnp.clip(src, 0, N * ps - 1)

    def one(x, lead):   # x (Hkv, N, ps, ...) -> moved
        f = x.reshape(Hkv, N * ps, *x.shape[3:])
        f = f.at[:, dst].set(f[:, src], mode="drop", unique_indices=True)
        return f.reshape(x.shape)

    if quant.is_quantized(pool):
        scale = one(pool.scale, 3) if pool.format.per_token else pool.scale
        return quant.QuantizedArray(one(pool.data, 3), scale, pool.format)
    return one(pool, 3)


_BOOK_FIELDS = ["page_table", "lengths", "free_pages", "num_free"]


def _formats(owner, quant_format):
    """(k format, v format) from ``quant_format`` (None, one format or a pair)."""
    if quant_format is None:
        return None, None
    if isinstance(quant_format, (tuple, list)):
        if len(quant_format) != 2:
            raise ValueError(f"{owner}.create: quant_format must be a QuantFormat, a format "
                             f"name or a (k, v) pair of them; got {quant_format!r}")
        k, v = quant_format
    else:
        k = v = quant_format
    as_fmt = lambda f: None if f is None else (  # noqa: E731
        quant.QuantFormat(f) if isinstance(f, str) else f)
    return as_fmt(k), as_fmt(v)


def _pool(shape, dtype, fmt, scale):
    """A zero pool: float, or quantized (:func:`fnattn.quant.empty`)."""
    if fmt is None:
        return jnp.zeros(shape, dtype)
    return quant.empty(shape, fmt, scale=scale)


def _layered_pool(shape, dtype, fmt, scale, owner="LayeredPagedKVCache"):
    """:func:`_pool` of a layered cache (``owner`` names it in errors): a
    per-tensor format has one scale per layer, (num_layers,), each checked like
    a per-tensor scale."""
    if fmt is None or fmt.per_token:
        return _pool(shape, dtype, fmt, scale)
    L = shape[0]
    if scale is None:
        raise ValueError(f"{owner}.create: {fmt} needs its scales (k_scale, "
                         f"v_scale: a number or one per layer, shape ({L},))")
    scale = jnp.asarray(scale, jnp.float32)
    if scale.shape not in ((), (L,)):
        raise ValueError(f"{owner}.create: a per-tensor scale must be a number "
                         f"or one per layer, shape ({L},); got shape {scale.shape}")
    scales = jnp.broadcast_to(scale, (L,))
    for i in range(L):
        quant.check(f"{owner}.create", f"scale of layer {i}",
                    quant.QuantizedArray(jnp.zeros((1,), fmt.storage_dtype), scales[i], fmt))
    one = quant.empty(shape[1:], fmt, scale=1.0)
    return quant.QuantizedArray(jnp.zeros(shape[:-1] + one.data.shape[-1:], one.data.dtype),
                                scales, fmt)


# ----------------------------------------------------------------------------------
# One layer
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Paged:
    """Fields and sizes shared by :class:`PagedKVCache` and
    :class:`LayeredPagedKVCache`; the pools' page axes start at ``_POOL_AXIS``
    (after the kv-head axis, and the layer axis of a layered cache)."""

    _POOL_AXIS = 1

    k_pages: Any
    v_pages: Any
    page_table: Any
    lengths: Any
    free_pages: Any
    num_free: Any

    # -- sizes --------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.k_pages.shape[self._POOL_AXIS + 1]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[self._POOL_AXIS]

    @property
    def max_seqs(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    @property
    def capacity(self) -> int:
        """Tokens one slot can hold."""
        return self.max_pages_per_seq * self.page_size

    def replace(self, **changes):
        """A copy with ``changes`` (field name = new value)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class PagedKVCache(_Paged):
    """A paged KV cache of one layer (see the module docstring for the fields)."""

    # -- construction -------------------------------------------------------------
    @classmethod
    def create(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               max_seqs: int, max_pages_per_seq: int, dtype=jnp.float32,
               v_head_dim: int | None = None, quant_format=None, k_scale=None,
               v_scale=None) -> "PagedKVCache":
        """An empty cache: every page free, every slot of length 0.

        ``quant_format`` (a :class:`fnattn.quant.QuantFormat`, a format name, or a
        (k, v) pair of them) makes quantized pools (:class:`fnattn.quant.QuantizedArray`,
        whose scale pools are indexed like the pages); ``k_scale``/``v_scale`` are
        the scales of per-tensor formats. ``dtype`` is then unused (the pools'
        values come out in q's dtype).

        >>> c = PagedKVCache.create(8, 16, 2, 64, max_seqs=4, max_pages_per_seq=3)
        >>> c.k_pages.shape, c.page_table.shape, c.capacity
        ((2, 8, 16, 64), (4, 3), 48)
        >>> c = PagedKVCache.create(8, 16, 2, 64, max_seqs=4, max_pages_per_seq=3,
        ...                         quant_format="int8")
        >>> c.k_pages.data.dtype, c.k_pages.scale.shape
        (dtype('int8'), (2, 8, 16))
        """
        dv = head_dim if v_head_dim is None else v_head_dim
        _check_sizes("PagedKVCache", num_pages=num_pages, page_size=page_size,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, max_seqs=max_seqs,
                     max_pages_per_seq=max_pages_per_seq, v_head_dim=dv)
        kf, vf = _formats("PagedKVCache", quant_format)
        return cls(k_pages=_pool((num_kv_heads, num_pages, page_size, head_dim), dtype, kf,
                                 k_scale),
                   v_pages=_pool((num_kv_heads, num_pages, page_size, dv), dtype, vf, v_scale),
                   **_empty_book(num_pages, max_seqs, max_pages_per_seq))

    # -- helpers ------------------------------------------------------------------
    def allocate(self, seq_ids) -> "PagedKVCache":
        """Makes room for one new token per entry of ``seq_ids`` without writing k/v.

        ``seq_ids`` (T,) int: the slot of each new token (-1 or out of range: no
        token). Lengths grow by each slot's count and pages are taken from the
        free stack as needed. Use it before
        :func:`fnattn.ragged_paged_attention_with_update`, which writes the
        tokens itself; :meth:`append` allocates and writes.

        >>> c = PagedKVCache.create(4, 2, 1, 8, max_seqs=2, max_pages_per_seq=2)
        >>> c = c.allocate(jnp.array([1, 1, 1]))
        >>> c.lengths.tolist(), c.page_table.tolist()
        ([0, 3], [[-1, -1], [3, 2]])
        """
        _check_seq_ids(self, "allocate", seq_ids)
        return _allocate(self, seq_ids)

    def allocate_slots(self, seq_ids) -> tuple["PagedKVCache", TokenSlots]:
        """:meth:`allocate`, and where each token goes: ``(cache, slots)`` for
        :func:`write_tokens`. ``append`` is ``allocate_slots`` + ``write_tokens``.

        >>> c = PagedKVCache.create(4, 2, 1, 8, max_seqs=2, max_pages_per_seq=2)
        >>> c, slots = c.allocate_slots(jnp.array([1, 1, 1, -1]))
        >>> slots.index.tolist()                    # page 3 (slots 6, 7), page 2 (4); none
        [6, 7, 4, 8]
        >>> c, slots = c.allocate_slots(jnp.array([0, 1]))
        >>> slots.positions.tolist()                # each token's position in its sequence
        [0, 3]
        """
        _check_seq_ids(self, "allocate_slots", seq_ids)
        return _allocate_slots(self, seq_ids)

    def append(self, seq_ids, k, v) -> "PagedKVCache":
        """Appends one token's k/v per entry of ``seq_ids`` to its slot, in order.

        Args:
          seq_ids: (T,) int, the slot of each token (-1: no token).
          k: (T, Hkv, D).
          v: (T, Hkv, Dv).

        >>> c = PagedKVCache.create(4, 2, 1, 1, max_seqs=2, max_pages_per_seq=2)
        >>> c = c.append(jnp.array([0, 1, 0]), jnp.array([[[1.]], [[2.]], [[3.]]]),
        ...              jnp.zeros((3, 1, 1)))
        >>> c.lengths.tolist(), c.k_pages[0, :, :, 0].tolist()
        ([2, 1], [[0.0, 0.0], [0.0, 0.0], [2.0, 0.0], [1.0, 3.0]])
        """
        _check_seq_ids(self, "append", seq_ids)
        Hkv, D, Dv = self.k_pages.shape[0], self.k_pages.shape[3], self.v_pages.shape[3]
        _check_tokens("PagedKVCache.append", seq_ids.shape[0], Hkv, D, Dv, k, v)
        cache, slots = _allocate_slots(self, seq_ids)
        return cache.replace(k_pages=_put(self.k_pages, slots.index, jnp.asarray(k)),
                             v_pages=_put(self.v_pages, slots.index, jnp.asarray(v)))

    def release(self, seq_id) -> "PagedKVCache":
        """Frees slot ``seq_id`` (a traced int is fine): its pages return to the stack,
        its length becomes 0. An out-of-range id changes nothing."""
        return _release(self, seq_id)

    def accept_drafts(self, num_drafts, accepted, *, parents=None,
                      checked: bool = False) -> "PagedKVCache":
        """Commits the accepted draft tokens of a speculative step and rolls the rest back.

        After a verification step the last ``num_drafts[s]`` tokens of slot
        ``s`` are its draft tokens (new tokens ``0 .. n - 1``, at positions
        ``lengths[s] - n ..``). ``accepted[s]`` lists the ones accepted, a
        root-to-node path of the draft tree (increasing indices into the new
        tokens; -1 padding after it): the k accepted tokens' k/v are copied,
        bit for bit, to positions ``lengths[s] - n .. lengths[s] - n + k - 1``
        (right after the context, in path order), the length becomes
        ``lengths[s] - n + k``, and the pages that then hold none of the slot's
        tokens return to the free stack. Slots with ``num_drafts[s] = 0`` are
        unchanged.

        Args:
          num_drafts: (max_seqs,) int, draft tokens of each slot in the step.
          accepted: (max_seqs, max_accepted) int, each slot's accepted path.
          parents: optional (max_seqs, max_drafts) int, the draft tree's parent
            indices (-1: the root), as given to the verification step; with it
            the path must follow the tree (each accepted node's parent is the
            node before it, the first one's the root).
          checked: report a traced ``accepted`` that is not an increasing path
            in ``[0, num_drafts)`` (or does not follow ``parents``) with
            ``checkify`` (concrete values are checked at trace time, always).

        >>> c = PagedKVCache.create(4, 2, 1, 1, max_seqs=1, max_pages_per_seq=4)
        >>> k = jnp.arange(7.).reshape(7, 1, 1)            # 2 context tokens, then 5 drafts
        >>> c = c.append(jnp.zeros(7, jnp.int32), k, k)
        >>> c = c.accept_drafts(jnp.array([5]), jnp.array([[0, 2, 4, -1]]))   # path 0 -> 2 -> 4
        >>> c.lengths.tolist(), int(c.num_free), c.k_pages[0, c.page_table[0, :3], :, 0].tolist()
        ([5], 1, [[0.0, 1.0], [2.0, 4.0], [6.0, 5.0]])
        """
        _check_accepted(self, num_drafts, accepted, checked, parents)
        book, src, dst = _accept_book(self, num_drafts, accepted)
        return book.replace(k_pages=_move(self.k_pages, src, dst),
                            v_pages=_move(self.v_pages, src, dst))

    def ragged_metadata(self, seq_ids, *, checked: bool = False,
                        return_positions: bool = False):
        """``page_table``, ``context_lengths``, ``query_start_loc`` and ``num_seqs`` for
        :func:`fnattn.ragged_paged_attention` over tokens packed by slot.

        ``seq_ids`` (T,) must be sorted (the tokens of slot 0, then slot 1, ...;
        -1 padding at the end); every slot is a sequence, those with no token
        have no queries. Call it on the cache *after* :meth:`append` (or
        :meth:`allocate`), so that the lengths include the new tokens. With
        ``checked=True`` ids out of order, or past ``max_seqs``, are reported as
        ``jax.experimental.checkify`` errors (wrap the call in
        ``checkify.checkify``); otherwise the metadata would silently describe
        a different packing than the queries have.

        With ``return_positions=True`` it returns ``(metadata, positions)``:
        ``positions`` (T,) int32 is each token's position in its sequence
        (``context_lengths[s] - n .. context_lengths[s] - 1`` for the ``n``
        tokens of slot ``s``, as the ragged attention functions place them;
        -1 for padding), for RoPE or a position embedding. They equal the
        ``positions`` of the :class:`TokenSlots` that ``allocate_slots`` returns
        for the same ``seq_ids`` while the slots stay within ``capacity``.

        >>> c = PagedKVCache.create(4, 2, 1, 1, max_seqs=3, max_pages_per_seq=2)
        >>> c.ragged_metadata(jnp.array([0, 2, 2, -1]))["query_start_loc"].tolist()
        [0, 1, 1, 3]
        >>> c = c.allocate(jnp.array([2, 2, 2]))          # a 3-token prompt in slot 2
        >>> ids = jnp.array([0, 2, -1])                   # then one token of slots 0, 2
        >>> meta, pos = c.allocate(ids).ragged_metadata(ids, return_positions=True)
        >>> pos.tolist()
        [0, 3, -1]
        >>> from jax.experimental import checkify
        >>> err, _ = checkify.checkify(lambda i: c.ragged_metadata(i, checked=True))(
        ...     jnp.array([2, 0, -1]))
        >>> print(err.get())  # doctest: +ELLIPSIS
        ragged_metadata: seq_ids must be sorted by slot with -1 padding at the end; seq_ids[1] = 0 follows 2...
        """
        return _ragged_metadata(self, seq_ids, checked, return_positions)


jax.tree_util.register_dataclass(PagedKVCache, data_fields=["k_pages", "v_pages", *_BOOK_FIELDS],
                                 meta_fields=[])


# ----------------------------------------------------------------------------------
# Every layer, one page table
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayeredPagedKVCache(_Paged):
    """A paged KV cache of a whole model: one page table, one set of lengths and one
    free stack for all layers, one pair of pools per layer (stacked on axis 0).

    Every step allocates once (:meth:`allocate` or :meth:`allocate_slots`); each
    layer then writes its own k/v at the same places. With ``lax.scan`` over the
    layers, ``(cache.k_pages, cache.v_pages)`` are the ``xs`` and each layer gets
    pools in the layout of :mod:`fnattn.paged`; :meth:`ragged_metadata` (or
    ``page_table`` and ``lengths``) is the same for every layer:

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> from fnattn.cache import LayeredPagedKVCache
    >>> cache = LayeredPagedKVCache.create(num_layers=3, num_pages=8, page_size=4,
    ...                                    num_kv_heads=1, head_dim=8, max_seqs=2,
    ...                                    max_pages_per_seq=4)
    >>> seq_ids = jnp.array([0, 0, 0, 1, -1])               # 3 tokens of slot 0, 1 of slot 1
    >>> x = jax.random.normal(jax.random.key(0), (5, 1, 8))
    >>> @jax.jit
    ... def step(cache, x):
    ...     cache = cache.allocate(seq_ids)                   # once, for every layer
    ...     meta = cache.ragged_metadata(seq_ids)
    ...     def layer(x, pools):
    ...         res, kp, vp = fnattn.ragged_paged_attention_with_update(
    ...             AttentionSpec(mask=masks.causal()), x, x, x, *pools, **meta)
    ...         return res.out, (kp, vp)
    ...     x, pools = jax.lax.scan(layer, x, (cache.k_pages, cache.v_pages))
    ...     return cache.replace(k_pages=pools[0], v_pages=pools[1]), x
    >>> cache, x = step(cache, x)
    >>> cache.lengths.tolist(), cache.page_table.tolist(), cache.k_pages.shape
    ([3, 1], [[7, -1, -1, -1], [6, -1, -1, -1]], (3, 1, 8, 4, 8))
    """

    _POOL_AXIS = 2

    @property
    def num_layers(self) -> int:
        return self.k_pages.shape[0]

    # -- construction -------------------------------------------------------------
    @classmethod
    def create(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
               head_dim: int, max_seqs: int, max_pages_per_seq: int, dtype=jnp.float32,
               v_head_dim: int | None = None, quant_format=None, k_scale=None,
               v_scale=None) -> "LayeredPagedKVCache":
        """An empty cache: every page free, every slot of length 0.

        ``quant_format``, ``k_scale``, ``v_scale``: quantized pools, as in
        :meth:`PagedKVCache.create`; a per-tensor format's scale is one per
        layer, shape (num_layers,) (``k_scale`` a number or such an array), so
        that ``lax.scan`` over the layers gives each layer its scalar scale.

        >>> c = LayeredPagedKVCache.create(2, 8, 16, 2, 64, max_seqs=4, max_pages_per_seq=3)
        >>> c.k_pages.shape, c.page_table.shape, c.capacity
        ((2, 2, 8, 16, 64), (4, 3), 48)
        """
        dv = head_dim if v_head_dim is None else v_head_dim
        _check_sizes("LayeredPagedKVCache", num_layers=num_layers, num_pages=num_pages,
                     page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq, v_head_dim=dv)
        pool = (num_layers, num_kv_heads, num_pages, page_size)
        kf, vf = _formats("LayeredPagedKVCache", quant_format)
        return cls(k_pages=_layered_pool((*pool, head_dim), dtype, kf, k_scale),
                   v_pages=_layered_pool((*pool, dv), dtype, vf, v_scale),
                   **_empty_book(num_pages, max_seqs, max_pages_per_seq))

    # -- helpers ------------------------------------------------------------------
    def allocate(self, seq_ids) -> "LayeredPagedKVCache":
        """Makes room in every layer for one new token per entry of ``seq_ids``,
        without writing k/v (then :func:`fnattn.ragged_paged_attention_with_update`
        in each layer writes them); as :meth:`PagedKVCache.allocate`.

        >>> c = LayeredPagedKVCache.create(3, 4, 2, 1, 8, max_seqs=2, max_pages_per_seq=2)
        >>> c = c.allocate(jnp.array([1, 1, 1]))
        >>> c.lengths.tolist(), c.page_table.tolist()
        ([0, 3], [[-1, -1], [3, 2]])
        """
        _check_seq_ids(self, "allocate", seq_ids)
        return _allocate(self, seq_ids)

    def allocate_slots(self, seq_ids) -> tuple["LayeredPagedKVCache", TokenSlots]:
        """:meth:`allocate`, and where each token goes: ``(cache, slots)``, the
        slots for :meth:`write` or :func:`write_tokens` in every layer.

        >>> c = LayeredPagedKVCache.create(3, 4, 2, 1, 8, max_seqs=2, max_pages_per_seq=2)
        >>> c, slots = c.allocate_slots(jnp.array([1, 1, 1, -1]))
        >>> slots.index.tolist(), slots.positions.tolist()
        ([6, 7, 4, 8], [0, 1, 2, -1])
        """
        _check_seq_ids(self, "allocate_slots", seq_ids)
        return _allocate_slots(self, seq_ids)

    def write(self, layer: int | jax.Array, slots: TokenSlots, k, v) -> "LayeredPagedKVCache":
        """Writes layer ``layer``'s new k/v at ``slots`` (from :meth:`allocate_slots`).

        Args:
          layer: the layer, an int in ``[0, num_layers)`` or a traced integer
            scalar (e.g. a ``fori_loop`` index; out of range: nothing is written).
          slots: the step's :class:`TokenSlots`.
          k: (T, Hkv, D), cast to the pools' dtype.
          v: (T, Hkv, Dv).

        >>> c = LayeredPagedKVCache.create(2, 4, 2, 1, 1, max_seqs=2, max_pages_per_seq=2)
        >>> c, slots = c.allocate_slots(jnp.array([0, 0, 0]))
        >>> c = c.write(1, slots, jnp.array([[[1.]], [[2.]], [[3.]]]), jnp.zeros((3, 1, 1)))
        >>> c.k_pages[:, 0, :, :, 0].tolist()          # layer 0 untouched; pages 3, 2 of layer 1
        [[[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]],
         [[0.0, 0.0], [0.0, 0.0], [3.0, 0.0], [1.0, 2.0]]]
        """
        fn = "LayeredPagedKVCache.write"
        T = _check_slots(fn, slots)
        L, Hkv = self.num_layers, self.k_pages.shape[1]
        _check_tokens(fn, T, Hkv, self.k_pages.shape[4], self.v_pages.shape[4], k, v)
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            if not 0 <= layer < L:
                raise ValueError(f"{fn}: layer must be in [0, num_layers)=[0, {L}); got "
                                 f"{int(layer)}")
        elif not (hasattr(layer, "dtype") and jnp.issubdtype(layer.dtype, jnp.integer)
                  and _shape(layer) == ()):
            raise TypeError(f"{fn}: layer must be an int or an integer scalar array; got "
                            f"{getattr(layer, 'dtype', type(layer).__name__)} "
                            f"{_shape(layer)}")
        layer = jnp.asarray(layer, I32)
        N, ps = self.num_pages, self.page_size
        ok = (slots.index >= 0) & (slots.index < N * ps) & (layer >= 0) & (layer < L)
        index = jnp.where(ok, slots.index, N * ps)
        at = jnp.clip(layer, 0, L - 1)

        def put(pools, new):
            if quant.is_quantized(pools):   # quantize's codes (and per-token scales)
                fmt = pools.format
                qa = quant.quantize(jnp.asarray(new), fmt,
                                    scale=None if fmt.per_token else pools.scale[at])
                flat = pools.reshape_leading(L, Hkv, N * ps) if fmt.per_token else \
                    quant.QuantizedArray(pools.data.reshape(L, Hkv, N * ps, -1), pools.scale,
                                         fmt)
                data = flat.data.at[at, :, index].set(qa.data, mode="drop")
                scale = (flat.scale.at[at, :, index].set(qa.scale, mode="drop")
                         if fmt.per_token else flat.scale)
                return quant.QuantizedArray(data.reshape(pools.data.shape),
                                            scale.reshape(jnp.shape(pools.scale)), fmt)
            flat = pools.reshape(L, Hkv, N * ps, pools.shape[-1])
            # The advanced indices (at, index) are apart: the (T,) axis comes first.
            flat = flat.at[at, :, index].set(jnp.asarray(new).astype(pools.dtype),
                                             mode="drop")
            return flat.reshape(pools.shape)

        return self.replace(k_pages=put(self.k_pages, k), v_pages=put(self.v_pages, v))

    def append(self, seq_ids, k, v) -> "LayeredPagedKVCache":
        """Appends the k/v of every layer at once (e.g. from a dense prefill):
        :meth:`allocate_slots`, then each layer's tokens at the same slots.

        Args:
          seq_ids: (T,) int, the slot of each token (-1: no token).
          k: (num_layers, T, Hkv, D).
          v: (num_layers, T, Hkv, Dv).

        >>> c = LayeredPagedKVCache.create(2, 4, 2, 1, 1, max_seqs=2, max_pages_per_seq=2)
        >>> k = jnp.arange(6.).reshape(2, 3, 1, 1)             # layer 0: 0, 1, 2; layer 1: 3, 4, 5
        >>> c = c.append(jnp.array([1, 1, 1]), k, k)
        >>> c.lengths.tolist(), c.k_pages[:, 0, 2:, :, 0].tolist()
        ([0, 3], [[[2.0, 0.0], [0.0, 1.0]], [[5.0, 0.0], [3.0, 4.0]]])
        """
        fn = "LayeredPagedKVCache.append"
        _check_seq_ids(self, "append", seq_ids)
        L, T, Hkv = self.num_layers, seq_ids.shape[0], self.k_pages.shape[1]
        D, Dv = self.k_pages.shape[4], self.v_pages.shape[4]
        for name, x, want in (("k", k, (L, T, Hkv, D)), ("v", v, (L, T, Hkv, Dv))):
            if _shape(x) != want:
                raise ValueError(f"{fn}: {name} must have shape (num_layers, T, Hkv, "
                                 f"{'D' if name == 'k' else 'Dv'})={want}; got {_shape(x)}")
        cache, slots = _allocate_slots(self, seq_ids)
        put = jax.vmap(_put, in_axes=(0, None, 0))
        return cache.replace(k_pages=put(self.k_pages, slots.index, jnp.asarray(k)),
                             v_pages=put(self.v_pages, slots.index, jnp.asarray(v)))

    def release(self, seq_id) -> "LayeredPagedKVCache":
        """Frees slot ``seq_id`` in every layer (a traced int is fine): its pages return
        to the stack, its length becomes 0. An out-of-range id changes nothing.
        The pools are not touched (attention never reads a free page).

        >>> c = LayeredPagedKVCache.create(2, 4, 2, 1, 8, max_seqs=2, max_pages_per_seq=2)
        >>> c = c.allocate(jnp.array([0, 0, 0, 1])).release(0)
        >>> c.lengths.tolist(), c.page_table.tolist(), int(c.num_free)
        ([0, 1], [[-1, -1], [1, -1]], 3)
        """
        return _release(self, seq_id)

    def accept_drafts(self, num_drafts, accepted, *, parents=None,
                      checked: bool = False) -> "LayeredPagedKVCache":
        """Commits the accepted draft tokens of a speculative step in every layer and
        rolls the rest back: as :meth:`PagedKVCache.accept_drafts`, with the
        accepted tokens' k/v copied bit for bit in each layer.

        >>> c = LayeredPagedKVCache.create(2, 4, 2, 1, 1, max_seqs=1, max_pages_per_seq=4)
        >>> k = jnp.arange(10.).reshape(2, 5, 1, 1)        # 1 context token, then 4 drafts
        >>> c = c.append(jnp.zeros(5, jnp.int32), k, k)
        >>> c = c.accept_drafts(jnp.array([4]), jnp.array([[1, 3]]))         # path 1 -> 3
        >>> c.lengths.tolist(), c.k_pages[:, 0, :, :, 0][:, c.page_table[0, :2]].tolist()
        ([3], [[[0.0, 2.0], [4.0, 3.0]], [[5.0, 7.0], [9.0, 8.0]]])
        """
        _check_accepted(self, num_drafts, accepted, checked, parents)
        book, src, dst = _accept_book(self, num_drafts, accepted)
        move = jax.vmap(_move, in_axes=(0, None, None))
        return book.replace(k_pages=move(self.k_pages, src, dst),
                            v_pages=move(self.v_pages, src, dst))

    def ragged_metadata(self, seq_ids, *, checked: bool = False,
                        return_positions: bool = False):
        """``page_table``, ``context_lengths``, ``query_start_loc`` and ``num_seqs`` for
        the ragged paged attention functions, the same in every layer; as
        :meth:`PagedKVCache.ragged_metadata` (``return_positions=True`` adds each
        token's position in its sequence).

        >>> c = LayeredPagedKVCache.create(2, 4, 2, 1, 1, max_seqs=3, max_pages_per_seq=2)
        >>> c.ragged_metadata(jnp.array([0, 2, 2, -1]))["query_start_loc"].tolist()
        [0, 1, 1, 3]
        >>> ids = jnp.array([0, 2, 2, -1])
        >>> c.allocate(ids).ragged_metadata(ids, return_positions=True)[1].tolist()
        [0, 0, 1, -1]
        """
        return _ragged_metadata(self, seq_ids, checked, return_positions)


jax.tree_util.register_dataclass(LayeredPagedKVCache,
                                 data_fields=["k_pages", "v_pages", *_BOOK_FIELDS],
                                 meta_fields=[])


# ----------------------------------------------------------------------------------
# Every layer, contiguous rows
# ----------------------------------------------------------------------------------


def _contiguous_pool(shape, dtype, fmt, scale):
    """A zero (num_layers, B, S, Hkv, D) pool: float, or quantized with one
    per-tensor scale per layer (num_layers,), as :func:`_layered_pool`."""
    return _layered_pool(shape, dtype, fmt, scale, owner="LayeredKVCache")


def _is_concrete(*xs):
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


@dataclasses.dataclass(frozen=True)
class LayeredKVCache:
    """A contiguous KV cache of a whole model: ``max_seqs`` rows of ``capacity``
    slots per layer, one ``lengths`` vector for every layer, the layers' pools
    stacked on axis 0 for ``jax.lax.scan``::

        k_cache  (num_layers, max_seqs, capacity, Hkv, D)    (or a QuantizedArray)
        v_cache  (num_layers, max_seqs, capacity, Hkv, Dv)   (None: a latent cache)
        lengths  (max_seqs,) int32, the tokens of each row (the same in every layer)

    Each layer's pools are those of :func:`fnattn.decode` in the "bthd" layout:
    sequence ``b`` owns slots ``[0, lengths[b])`` of row ``b``. A step first
    :meth:`allocate`\\ s its new tokens once (``q_lengths[b]`` of them in row ``b``:
    the lengths then include them, as :func:`fnattn.decode_with_update` expects)
    and reads their :meth:`positions` (for RoPE); then every layer calls
    :meth:`decode_with_update` (or :meth:`write`), which writes only that layer's new
    tokens into the stacked pools and attends over the layer's row. Keep the cache
    in the ``lax.scan`` *carry* and pass the layer index in ``xs``: the writes then
    touch ``B * Tq`` slots per layer in place, with no copy of the cache per step
    (``xs``/``ys`` pools would restack them; each layer's read is a slice of the
    stacked pools, which XLA may copy, one layer at a time). Ragged prompts (right-padded to one
    ``Tq``) prefill in one call; the next call decodes them together:

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, LayeredKVCache, masks
    >>> spec = AttentionSpec(mask=masks.causal())
    >>> cache = LayeredKVCache.create(num_layers=3, max_seqs=2, capacity=8,
    ...                               num_kv_heads=1, head_dim=4)
    >>> @jax.jit
    ... def step(cache, x, q_lengths):                 # x (B, Tq, 1, 4), right-padded
    ...     cache = cache.allocate(q_lengths)            # once, for every layer
    ...     positions = cache.positions(q_lengths, x.shape[1])
    ...     def layer(carry, l):
    ...         x, cache = carry
    ...         res, cache = cache.decode_with_update(l, spec, x, x, x, q_lengths=q_lengths)
    ...         return (res.out, cache), None
    ...     (x, cache), _ = jax.lax.scan(layer, (x, cache), jnp.arange(cache.num_layers))
    ...     return cache, x, positions
    >>> x = jnp.ones((2, 3, 1, 4))
    >>> cache, out, pos = step(cache, x, jnp.array([3, 1]))    # prompts of 3 and 1 tokens
    >>> cache.lengths.tolist(), pos.tolist()
    ([3, 1], [[0, 1, 2], [0, -1, -1]])
    >>> cache, out, pos = step(cache, x[:, :1], jnp.array([1, 1]))   # one token each
    >>> cache.lengths.tolist(), pos.tolist(), cache.k_cache.shape
    ([4, 2], [[3], [1]], (3, 2, 8, 1, 4))

    A row whose tokens do not fit (``lengths > capacity``) gets NaN and writes
    nothing, in this step and every later one until :meth:`release`; with
    concrete values :meth:`allocate` raises ``ValueError``, and ``checked=True``
    reports traced ones through ``checkify``.
    """

    k_cache: Any
    v_cache: Any
    lengths: Any
    value_dim: int | None = None

    # -- sizes --------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.k_cache.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.k_cache.shape[1]

    @property
    def capacity(self) -> int:
        """Tokens one row can hold."""
        return self.k_cache.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[3]

    def replace(self, **changes) -> "LayeredKVCache":
        """A copy with ``changes`` (field name = new value)."""
        return dataclasses.replace(self, **changes)

    # -- construction -------------------------------------------------------------
    @classmethod
    def create(cls, num_layers: int, max_seqs: int, capacity: int, num_kv_heads: int,
               head_dim: int, dtype=jnp.float32, v_head_dim: int | None = None,
               value_dim: int | None = None, quant_format=None, k_scale=None,
               v_scale=None) -> "LayeredKVCache":
        """An empty cache: every row of length 0.

        ``v_head_dim``: the values' head dim (default ``head_dim``).
        ``value_dim``: a latent cache (multi-head latent attention) with no
        ``v_cache``: ``k_cache`` holds ``head_dim`` latent and rope channels, the
        values are its first ``value_dim``. ``quant_format``, ``k_scale``,
        ``v_scale``: quantized pools, as in :meth:`LayeredPagedKVCache.create` (a
        per-tensor scale is one per layer, shape (num_layers,)).

        >>> c = LayeredKVCache.create(2, 4, 16, 2, 8)
        >>> c.k_cache.shape, c.v_cache.shape, c.lengths.tolist()
        ((2, 4, 16, 2, 8), (2, 4, 16, 2, 8), [0, 0, 0, 0])
        >>> c = LayeredKVCache.create(2, 4, 16, 1, 10, value_dim=8, quant_format="int8")
        >>> c.k_cache.data.shape, c.k_cache.scale.shape, c.v_cache
        ((2, 4, 16, 1, 10), (2, 4, 16, 1), None)
        """
        dv = head_dim if v_head_dim is None else v_head_dim
        _check_sizes("LayeredKVCache", num_layers=num_layers, max_seqs=max_seqs,
                     capacity=capacity, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     v_head_dim=dv)
        if value_dim is not None:
            if v_head_dim is not None:
                raise ValueError("LayeredKVCache.create: a latent cache (value_dim) has no "
                                 "values of its own; leave v_head_dim out")
            if not isinstance(value_dim, int) or isinstance(value_dim, bool) \
                    or not 0 < value_dim <= head_dim:
                raise ValueError(f"LayeredKVCache.create: value_dim must be an int in "
                                 f"(0, head_dim={head_dim}]; got {value_dim!r}")
        kf, vf = _formats("LayeredKVCache", quant_format)
        shape = (num_layers, max_seqs, capacity, num_kv_heads)
        v = None if value_dim is not None else _contiguous_pool((*shape, dv), dtype, vf,
                                                                v_scale)
        return cls(k_cache=_contiguous_pool((*shape, head_dim), dtype, kf, k_scale),
                   v_cache=v, lengths=jnp.zeros((max_seqs,), I32), value_dim=value_dim)

    # -- bookkeeping --------------------------------------------------------------
    def _check_q_lengths(self, fn, q_lengths):
        from fnattn.decoding import update
        update.check_q_lengths_arg(f"LayeredKVCache.{fn}", q_lengths, self.max_seqs)

    def allocate(self, q_lengths, *, checked: bool = False) -> "LayeredKVCache":
        """Counts ``q_lengths[b]`` new tokens in row ``b`` (every layer): ``lengths``
        grows by them. Call it once per step, before the layers write.

        A row pushed past ``capacity`` keeps its true length (so that its results
        are NaN rather than wrong); concrete values past it, or negative counts,
        raise ``ValueError``; ``checked=True`` reports traced ones through
        ``checkify`` (wrap the call in ``checkify.checkify``).

        >>> c = LayeredKVCache.create(2, 3, 4, 1, 2).allocate(jnp.array([2, 0, 4]))
        >>> c.lengths.tolist()
        [2, 0, 4]
        >>> c.allocate(jnp.array([0, 1, 1]))
        Traceback (most recent call last):
        ...
        ValueError: LayeredKVCache.allocate: row 2 would hold 4 + 1 = 5 tokens, past the capacity...
        """
        fn = "LayeredKVCache.allocate"
        self._check_q_lengths("allocate", q_lengths)
        n = jnp.asarray(q_lengths).astype(I32)
        if _is_concrete(self.lengths, n):
            old, add = np.asarray(self.lengths, np.int64), np.asarray(n, np.int64)
            if (add < 0).any():
                b = int(np.argmax(add < 0))
                raise ValueError(f"{fn}: q_lengths[{b}] = {add[b]} is negative")
            over = old + add > self.capacity
            if over.any():
                b = int(np.argmax(over))
                raise ValueError(f"{fn}: row {b} would hold {old[b]} + {add[b]} = "
                                 f"{old[b] + add[b]} tokens, past the capacity of "
                                 f"{self.capacity} slots; release it (or stop it) first")
        if checked:
            neg = n < 0
            b = jnp.argmax(neg)
            checkify.check(~neg.any(), f"{fn}: q_lengths[{{b}}] = {{x}} is negative", b=b,
                           x=n[b])
            new = self.lengths + n
            over = new > self.capacity
            b = jnp.argmax(over)
            checkify.check(~over.any(), f"{fn}: row {{b}} would hold {{x}} tokens, past the "
                           f"capacity of {self.capacity} slots", b=b, x=new[b])
        return self.replace(lengths=(self.lengths + n).astype(I32))

    def positions(self, q_lengths, num_tokens: int):
        """(max_seqs, num_tokens) int32: the position in its sequence of each new
        token of the step (after :meth:`allocate`): ``lengths[b] - q_lengths[b] + i``
        for ``i < q_lengths[b]``, -1 for padding rows. The positions RoPE or a
        position embedding needs.

        >>> c = LayeredKVCache.create(1, 2, 8, 1, 2).allocate(jnp.array([2, 3]))
        >>> c.allocate(jnp.array([1, 2])).positions(jnp.array([1, 2]), 2).tolist()
        [[2, -1], [3, 4]]
        """
        self._check_q_lengths("positions", q_lengths)
        n = jnp.asarray(q_lengths).astype(I32)[:, None]
        i = jnp.arange(num_tokens, dtype=I32)[None, :]
        return jnp.where(i < n, self.lengths[:, None] - n + i, -1).astype(I32)

    def release(self, seq_id) -> "LayeredKVCache":
        """Empties row ``seq_id`` (a traced int is fine; out of range: nothing changes)
        in every layer: its length becomes 0. The pools are not touched (attention
        never reads past a row's length).

        >>> c = LayeredKVCache.create(1, 2, 8, 1, 2).allocate(jnp.array([2, 3]))
        >>> c.release(0).lengths.tolist()
        [0, 3]
        """
        s = jnp.asarray(seq_id, I32)
        ok = (s >= 0) & (s < self.max_seqs)
        mine = (jnp.arange(self.max_seqs, dtype=I32) == s) & ok
        return self.replace(lengths=jnp.where(mine, 0, self.lengths).astype(I32))

    # -- one layer ----------------------------------------------------------------
    def _layer_index(self, fn, layer):
        L = self.num_layers
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            if not 0 <= layer < L:
                raise ValueError(f"{fn}: layer must be in [0, num_layers)=[0, {L}); got "
                                 f"{int(layer)}")
        elif not (hasattr(layer, "dtype") and jnp.issubdtype(layer.dtype, jnp.integer)
                  and _shape(layer) == ()):
            raise TypeError(f"{fn}: layer must be an int or an integer scalar array; got "
                            f"{getattr(layer, 'dtype', type(layer).__name__)} "
                            f"{_shape(layer)}")
        layer = jnp.asarray(layer, I32)
        return jnp.clip(layer, 0, L - 1), (layer >= 0) & (layer < L)

    def layer(self, layer: int | jax.Array):
        """``(k_cache, v_cache)`` of one layer, (max_seqs, capacity, Hkv, D|Dv), as
        :func:`fnattn.decode` takes them (``v_cache`` None for a latent cache). A
        traced ``layer`` is clipped to ``[0, num_layers)``.

        >>> LayeredKVCache.create(3, 2, 8, 1, 4).layer(1)[0].shape
        (2, 8, 1, 4)
        """
        at, _ = self._layer_index("LayeredKVCache.layer", layer)
        return self._pools(at)

    def _pools(self, at):
        def one(pool):
            if pool is None:
                return None
            if quant.is_quantized(pool):
                data, scale = (jax.lax.dynamic_index_in_dim(x, at, 0, keepdims=False)
                               for x in (pool.data, pool.scale))
                return quant.QuantizedArray(data, scale, pool.format)
            return jax.lax.dynamic_index_in_dim(pool, at, 0, keepdims=False)
        return one(self.k_cache), one(self.v_cache)

    def _put(self, at, slot, k_new, v_new):
        """The new tokens (B, Tq, Hkv, D|Dv) of layer ``at`` at ``slot`` (B, Tq) of
        each row (``capacity``: dropped), in the stacked pools."""
        rows = jnp.arange(self.max_seqs, dtype=I32)[:, None]
        index = (at, rows, slot)

        def put(pool, new):
            new = jnp.asarray(new)
            if not quant.is_quantized(pool):
                return pool.at[index].set(new.astype(pool.dtype), mode="drop")
            fmt = pool.format
            qa = quant.quantize(new, fmt, scale=None if fmt.per_token else pool.scale[at])
            data = pool.data.at[index].set(qa.data, mode="drop")
            scale = pool.scale
            if fmt.per_token:
                scale = scale.at[index].set(quant.pool_scale_like(qa.scale, pool), mode="drop")
            return quant.QuantizedArray(data, scale, fmt)

        v = None if self.v_cache is None else put(self.v_cache, v_new)
        return self.replace(k_cache=put(self.k_cache, k_new), v_cache=v)

    def _prepare(self, fn, layer, spec, q, k_new, v_new, q_lengths, checked):
        from fnattn.decoding import api, update
        if spec.layout != "bthd":
            raise ValueError(f"{fn}: the cache's rows are in the 'bthd' layout (max_seqs, "
                             f"capacity, Hkv, D); give q, k_new and v_new as (B, Tq, H, D) "
                             f"with AttentionSpec(layout='bthd'); got layout {spec.layout!r}")
        if self.value_dim is None and v_new is None:
            raise ValueError(f"{fn}: v_new is None but the cache has values (v_cache); only a "
                             "latent cache (value_dim) takes v_new=None")
        at, layer_ok = self._layer_index(fn, layer)
        kl, vl = self._pools(at)
        try:
            B, Tq, S, *_ = update._check(spec, q, k_new, v_new, kl, vl, self.lengths, None,
                                         self.value_dim)
        except (TypeError, ValueError, NotImplementedError) as e:
            msg = str(e)
            if msg.startswith("decode_with_update: "):
                raise type(e)(f"{fn}: {msg[len('decode_with_update: '):]}") from None
            raise
        if q_lengths is not None:
            update.check_q_lengths_arg(fn, q_lengths, B)
            update.refuse_row_masks(fn, spec)
            update._refuse_static_ragged(self.lengths, None, q_lengths, S, Tq, fn=fn)
        elif _is_concrete(self.lengths):
            bad = np.asarray(self.lengths) > S
            if bad.any():
                b = int(np.argmax(bad))
                raise ValueError(f"{fn}: row {b} holds {int(self.lengths[b])} tokens, past the "
                                 f"capacity of {S} slots")
        if checked:
            quant.check_pool_scales(k_cache=kl, v_cache=vl)
            if q_lengths is None:
                api.check_inputs(S, Tq, self.lengths)
            else:
                update.check_q_lengths(S, Tq, self.lengths, q_lengths, fn=fn)
        zeros = jnp.zeros((B,), I32)
        fits, n, slot = update.plan(self.lengths.astype(I32), zeros, q_lengths, S, Tq)
        fits = fits & layer_ok
        slot = jnp.where(layer_ok, slot, S)
        return at, fits, n, slot, zeros

    def write(self, layer: int | jax.Array, k_new, v_new, *, q_lengths=None,
              checked: bool = False) -> "LayeredKVCache":
        """Writes layer ``layer``'s new k/v, (max_seqs, Tq, Hkv, D|Dv), after
        :meth:`allocate`: token ``i < q_lengths[b]`` of row ``b`` at slot
        ``lengths[b] - q_lengths[b] + i`` (``q_lengths`` None: ``Tq`` tokens in every
        row of nonzero length). Only those slots change; padding rows and rows
        that do not fit write nothing. ``layer``: an int or a traced integer
        scalar (out of range: nothing is written). ``v_new``: None for a latent
        cache.

        >>> c = LayeredKVCache.create(2, 2, 4, 1, 1).allocate(jnp.array([2, 1]))
        >>> k = jnp.array([[1., 2.], [3., 4.]])[:, :, None, None]
        >>> c = c.write(1, k, k, q_lengths=jnp.array([2, 1]))
        >>> c.k_cache[:, :, :, 0, 0].tolist()          # layer 0 untouched; row 1: one token
        [[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], [[1.0, 2.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]]]
        """
        from fnattn import AttentionSpec
        q_like = jax.ShapeDtypeStruct((*_shape(k_new)[:2], self.num_kv_heads,
                                       _shape(k_new)[-1]), jnp.float32)
        at, _, _, slot, _ = self._prepare("LayeredKVCache.write", layer, AttentionSpec(),
                                          q_like, k_new, v_new, q_lengths, checked)
        return self._put(at, slot, k_new, v_new)

    def decode_with_update(self, layer: int | jax.Array, spec, q, k_new, v_new, *,
                           q_lengths=None, checked: bool = False):
        """:func:`fnattn.decode_with_update` on one layer of the cache: writes the
        layer's new tokens (as :meth:`write`, after :meth:`allocate`), then decodes
        q (max_seqs, Tq, Hq, D) over the layer's rows with ``kv_lengths=lengths``.

        Returns ``(AttentionOutput, cache)``; the result is the function's: rows
        that do not fit are NaN, padding rows (with ``q_lengths``) 0 with lse
        -inf. ``layer``: an int or a traced integer scalar (out of range: NaN,
        nothing written). ``spec.layout`` must be "bthd"; ``v_new`` None for a
        latent cache.

        >>> from fnattn import AttentionSpec, masks
        >>> c = LayeredKVCache.create(2, 2, 8, 1, 4).allocate(jnp.array([1, 1]))
        >>> x = jnp.ones((2, 1, 2, 4))                   # 2 query heads over 1 kv head
        >>> res, c = c.decode_with_update(0, AttentionSpec(mask=masks.causal()), x,
        ...                               x[:, :, :1], x[:, :, :1])
        >>> res.out.shape, c.k_cache[0, :, 0, 0, 0].tolist(), c.k_cache[1, :, 0, 0, 0].tolist()
        ((2, 1, 2, 4), [1.0, 1.0], [0.0, 0.0])
        """
        from fnattn.decoding import update
        at, fits, n, slot, zeros = self._prepare("LayeredKVCache.decode_with_update", layer,
                                                 spec, q, k_new, v_new, q_lengths, checked)
        cache = self._put(at, slot, k_new, v_new)
        kl, vl = cache._pools(at)
        res = update.attend_written(spec, q, kl, vl, cache.lengths.astype(I32), zeros,
                                    q_lengths, n, fits, self.value_dim)
        return res, cache

    # -- sharding -----------------------------------------------------------------
    def partition_specs(self, batch=None, kv_heads=None) -> "LayeredKVCache":
        """A :class:`LayeredKVCache` of ``PartitionSpec``\\ s splitting the rows along
        the mesh axis ``batch`` and the kv heads along ``kv_heads`` (None:
        replicated); the layer and slot axes are never split. For ``shard_map``'s
        specs or ``NamedSharding``\\ s (``jax.tree.map``); quantized pools get
        :func:`fnattn.quant.partition_specs`.

        >>> s = LayeredKVCache.create(2, 4, 8, 2, 4).partition_specs(batch="data")
        >>> tuple(s.k_cache), tuple(s.lengths)
        ((None, 'data', None, None, None), ('data',))
        """
        from jax.sharding import PartitionSpec as P
        spec = P(None, batch, None, kv_heads, None)

        def one(pool):
            if pool is None:
                return None
            return quant.partition_specs(spec, pool.format) if quant.is_quantized(pool) \
                else spec
        k = one(self.k_cache)
        if quant.is_quantized(self.k_cache) and not self.k_cache.format.per_token:
            k = k.replace(scale=P(None))
        v = one(self.v_cache)
        if quant.is_quantized(self.v_cache) and not self.v_cache.format.per_token:
            v = v.replace(scale=P(None))
        return self.replace(k_cache=k, v_cache=v, lengths=P(batch))


jax.tree_util.register_dataclass(LayeredKVCache, data_fields=["k_cache", "v_cache", "lengths"],
                                 meta_fields=["value_dim"])
