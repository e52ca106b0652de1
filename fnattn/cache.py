"""`PagedKVCache`: a small functional paged KV cache for the paged attention functions.

A frozen pytree of arrays with pure helpers: every helper returns a new cache
(under ``jax.jit`` with the cache donated, the updates happen in place). It
holds the two pools in the heads-major layout of :mod:`fnattn.paged`, the page
table, the length of every sequence slot and a stack of free pages::

    k_pages     (Hkv, num_pages, page_size, D)
    v_pages     (Hkv, num_pages, page_size, Dv)
    page_table  (max_seqs, max_pages_per_seq) int32, -1 where no page is allocated
    lengths     (max_seqs,) int32
    free_pages  (num_pages,) int32: free_pages[:num_free] are free
    num_free    () int32

Sequences are identified by their slot ``0 .. max_seqs - 1``. A serving loop
``append``\\ s the new tokens of some slots (pages are taken from the free stack
as needed), runs attention with ``page_table``/``lengths``, and ``release``\\ s a
slot when its sequence finishes (its pages go back to the stack; the slot can
be reused at once).

Running out of room never corrupts anything: tokens past a slot's capacity
(``max_pages_per_seq * page_size``) or that need a page when none is free are
not stored (``lengths`` stops at the capacity; a missing page stays -1 in the
table, so attention masks those keys). ``num_free`` tells how much room is left.

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

__all__ = ["PagedKVCache"]

I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A paged KV cache (see the module docstring for the fields)."""

    k_pages: Any
    v_pages: Any
    page_table: Any
    lengths: Any
    free_pages: Any
    num_free: Any

    # -- sizes --------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

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

    # -- construction -------------------------------------------------------------
    @classmethod
    def create(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               max_seqs: int, max_pages_per_seq: int, dtype=jnp.float32,
               v_head_dim: int | None = None) -> "PagedKVCache":
        """An empty cache: every page free, every slot of length 0.

        >>> c = PagedKVCache.create(8, 16, 2, 64, max_seqs=4, max_pages_per_seq=3)
        >>> c.k_pages.shape, c.page_table.shape, c.capacity
        ((2, 8, 16, 64), (4, 3), 48)
        """
        for name, n in (("num_pages", num_pages), ("page_size", page_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("max_seqs", max_seqs), ("max_pages_per_seq", max_pages_per_seq),
                        ("v_head_dim", head_dim if v_head_dim is None else v_head_dim)):
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise ValueError(f"PagedKVCache.create: {name} must be a positive int; "
                                 f"got {n!r}")
        dv = head_dim if v_head_dim is None else v_head_dim
        return cls(
            k_pages=jnp.zeros((num_kv_heads, num_pages, page_size, head_dim), dtype),
            v_pages=jnp.zeros((num_kv_heads, num_pages, page_size, dv), dtype),
            page_table=jnp.full((max_seqs, max_pages_per_seq), -1, I32),
            lengths=jnp.zeros((max_seqs,), I32),
            # Popped from the end: page 0 is handed out last.
            free_pages=jnp.arange(num_pages, dtype=I32),
            num_free=jnp.int32(num_pages))

    def replace(self, **changes) -> "PagedKVCache":
        return dataclasses.replace(self, **changes)

    # -- helpers ------------------------------------------------------------------
    def _check_seq_ids(self, fn, seq_ids):
        if not hasattr(seq_ids, "dtype") or not jnp.issubdtype(seq_ids.dtype, jnp.integer) \
                or seq_ids.ndim != 1:
            raise TypeError(f"PagedKVCache.{fn}: seq_ids must be a 1-D integer array (one "
                            f"slot per new token, -1 for none); got "
                            f"{getattr(seq_ids, 'dtype', type(seq_ids).__name__)} "
                            f"{tuple(np.shape(seq_ids))}")

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
        self._check_seq_ids("allocate", seq_ids)
        S, P, ps = self.max_seqs, self.max_pages_per_seq, self.page_size
        seq = jnp.where((seq_ids >= 0) & (seq_ids < S), seq_ids, S).astype(I32)
        counts = jnp.zeros((S + 1,), I32).at[seq].add(1)[:S]
        old = self.lengths
        new = jnp.minimum(old + counts, self.capacity)
        old_pages, new_pages = -(-old // ps), -(-new // ps)
        # Logical page j of slot s is new when old_pages[s] <= j < new_pages[s]; the
        # k-th new page overall (slots in order) is the k-th from the top of the stack.
        need = new_pages - old_pages
        before = jnp.cumsum(need) - need
        j = jnp.arange(P, dtype=I32)[None, :]
        fresh = (j >= old_pages[:, None]) & (j < new_pages[:, None])
        k = before[:, None] + j - old_pages[:, None]
        idx = self.num_free - 1 - k
        got = fresh & (idx >= 0)
        page = self.free_pages[jnp.clip(idx, 0, self.num_pages - 1)]
        table = jnp.where(got, page, jnp.where(fresh, -1, self.page_table))
        num_free = jnp.maximum(self.num_free - need.sum(), 0)
        return self.replace(page_table=table.astype(I32), lengths=new,
                            num_free=num_free.astype(I32))

    def _token_positions(self, seq_ids):
        """(slot, slot is valid, position) of each new token, from the lengths before
        the tokens are added."""
        S = self.max_seqs
        T = seq_ids.shape[0]
        ok_seq = (seq_ids >= 0) & (seq_ids < S)
        seq = jnp.where(ok_seq, seq_ids, S).astype(I32)
        # Rank of each token among the earlier tokens of its slot (stable sort).
        order = jnp.argsort(seq, stable=True)
        sorted_seq = seq[order]
        first = jnp.searchsorted(sorted_seq, sorted_seq, side="left")
        rank = jnp.zeros((T,), I32).at[order].set(jnp.arange(T, dtype=I32) - first)
        seq_c = jnp.minimum(seq, S - 1)
        return seq_c, ok_seq, self.lengths[seq_c] + rank

    def append(self, seq_ids, k, v) -> "PagedKVCache":
        """Appends one token's k/v per entry of ``seq_ids`` to its slot, in order.

        Args:
          seq_ids: (T,) int, the slot of each token (-1: no token).
          k: (T, Hkv, D); v: (T, Hkv, Dv).

        >>> c = PagedKVCache.create(4, 2, 1, 1, max_seqs=2, max_pages_per_seq=2)
        >>> c = c.append(jnp.array([0, 1, 0]), jnp.array([[[1.]], [[2.]], [[3.]]]),
        ...              jnp.zeros((3, 1, 1)))
        >>> c.lengths.tolist(), c.k_pages[0, :, :, 0].tolist()
        ([2, 1], [[0.0, 0.0], [0.0, 0.0], [2.0, 0.0], [1.0, 3.0]])
        """
        self._check_seq_ids("append", seq_ids)
        T = seq_ids.shape[0]
        Hkv, D, Dv = self.k_pages.shape[0], self.k_pages.shape[3], self.v_pages.shape[3]
        # np.shape: jnp.shape of a list is deprecated (and will raise) in JAX.
        for name, x, want in (("k", k, (T, Hkv, D)), ("v", v, (T, Hkv, Dv))):
            if tuple(np.shape(x)) != want:
                raise ValueError(f"PagedKVCache.append: {name} must have shape (T, Hkv, "
                                 f"{'D' if name == 'k' else 'Dv'})={want}; got "
                                 f"{tuple(np.shape(x))}")
        k, v = jnp.asarray(k), jnp.asarray(v)
        seq, ok_seq, pos = self._token_positions(seq_ids)
        cache = self.allocate(seq_ids)
        ps, N = self.page_size, self.num_pages
        page_idx = jnp.clip(pos // ps, 0, self.max_pages_per_seq - 1)
        page = cache.page_table[seq, page_idx]
        ok = ok_seq & (pos < self.capacity) & (page >= 0)
        slot = jnp.where(ok, page * ps + pos % ps, N * ps)

        def put(pool, new):
            flat = pool.reshape(Hkv, N * ps, pool.shape[-1])
            flat = flat.at[:, slot].set(jnp.swapaxes(new, 0, 1).astype(pool.dtype),
                                        mode="drop")
            return flat.reshape(pool.shape)

        return cache.replace(k_pages=put(self.k_pages, k), v_pages=put(self.v_pages, v))

    def release(self, seq_id) -> "PagedKVCache":
        """Frees slot ``seq_id`` (a traced int is fine): its pages return to the stack,
        its length becomes 0. An out-of-range id changes nothing."""
        S, N = self.max_seqs, self.num_pages
        seq_id = jnp.asarray(seq_id, I32)
        ok = (seq_id >= 0) & (seq_id < S)
        s = jnp.clip(seq_id, 0, S - 1)
        row = self.page_table[s]
        mine = ok & (row >= 0) & (row < N)
        r = jnp.cumsum(mine) - 1
        dest = jnp.where(mine, self.num_free + r, N)  # N: dropped
        free = self.free_pages.at[dest].set(row, mode="drop")
        num_free = jnp.minimum(self.num_free + mine.sum(), N)
        table = self.page_table.at[s].set(jnp.where(ok, -1, row))
        lengths = self.lengths.at[s].set(jnp.where(ok, 0, self.lengths[s]))
        return self.replace(page_table=table, lengths=lengths, free_pages=free,
                            num_free=num_free.astype(I32))

    def ragged_metadata(self, seq_ids, *, checked: bool = False):
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

        >>> c = PagedKVCache.create(4, 2, 1, 1, max_seqs=3, max_pages_per_seq=2)
        >>> c.ragged_metadata(jnp.array([0, 2, 2, -1]))["query_start_loc"].tolist()
        [0, 1, 1, 3]
        >>> from jax.experimental import checkify
        >>> err, _ = checkify.checkify(lambda i: c.ragged_metadata(i, checked=True))(
        ...     jnp.array([2, 0, -1]))
        >>> print(err.get())  # doctest: +ELLIPSIS
        ragged_metadata: seq_ids must be sorted by slot with -1 padding at the end; seq_ids[1] = 0 follows 2...
        """
        S = self.max_seqs
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
        return dict(page_table=self.page_table, context_lengths=self.lengths,
                    query_start_loc=loc, num_seqs=jnp.int32(S))


jax.tree_util.register_dataclass(
    PagedKVCache,
    data_fields=["k_pages", "v_pages", "page_table", "lengths", "free_pages", "num_free"],
    meta_fields=[])
