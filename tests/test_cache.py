"""fnattn.PagedKVCache: creation, allocation from the free stack, appends of interleaved
slots, running out of room, release and reuse, against a plain-Python model of the
documented behaviour, and paged attention on a cache built this way against
fnattn.reference on the dense tokens. Every update runs under jax.jit, most with the
cache donated."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import fnattn
from fnattn import AttentionSpec, PagedKVCache, masks

# Distinct sizes so that a swapped axis fails: 7 pages of 3 slots, 2 kv heads, k head
# dim 5, v head dim 4, 4 slots of at most 3 pages (capacity 9). 4 * 3 > 7: the pages
# can run out.
N, PS, HKV, D, DV, S, P = 7, 3, 2, 5, 4, 4, 3
CAP = P * PS
T = 6  # tokens per append in the jitted helpers (one compilation)


def empty(dtype=jnp.float32):
    return PagedKVCache.create(num_pages=N, page_size=PS, num_kv_heads=HKV, head_dim=D,
                               max_seqs=S, max_pages_per_seq=P, dtype=dtype, v_head_dim=DV)


# The cache is donated: the update happens in place and the old cache is deleted.
append = jax.jit(PagedKVCache.append, donate_argnums=0)
release = jax.jit(PagedKVCache.release, donate_argnums=0)
allocate = jax.jit(PagedKVCache.allocate, donate_argnums=0)


def tokens(rng, n):
    k = rng.standard_normal((n, HKV, D)).astype(np.float32)
    v = rng.standard_normal((n, HKV, DV)).astype(np.float32)
    return k, v


def snapshot(cache):
    return jax.tree_util.tree_map(np.asarray, cache)


class Model:
    """The documented behaviour in plain Python: a stack of free pages popped from the
    end (slots served in order, a slot's pages in logical order), lengths that stop at
    the capacity, -1 for a page that could not be had, releases pushed in logical order."""

    def __init__(self):
        self.table = np.full((S, P), -1, np.int32)
        self.lengths = np.zeros(S, np.int32)
        self.stack = list(range(N))
        self.k = np.zeros((HKV, N, PS, D), np.float32)
        self.v = np.zeros((HKV, N, PS, DV), np.float32)
        self.reached_capacity = self.ran_out = False  # what the walk went through

    def append(self, seq_ids, k=None, v=None):
        counts = np.zeros(S, int)
        for s in seq_ids:
            if 0 <= s < S:
                counts[s] += 1
        old = self.lengths.copy()
        for s in range(S):
            new = min(old[s] + counts[s], CAP)
            self.reached_capacity |= old[s] + counts[s] > CAP
            for j in range(-(-old[s] // PS), -(-new // PS)):
                self.ran_out |= not self.stack
                self.table[s, j] = self.stack.pop() if self.stack else -1
            self.lengths[s] = new
        if k is None:
            return
        pos = old.copy()
        for t, s in enumerate(seq_ids):
            if not 0 <= s < S:
                continue
            p, pos[s] = pos[s], pos[s] + 1
            if p < CAP and self.table[s, p // PS] >= 0:
                self.k[:, self.table[s, p // PS], p % PS] = k[t]
                self.v[:, self.table[s, p // PS], p % PS] = v[t]

    def release(self, s):
        if 0 <= s < S:
            self.stack.extend(int(x) for x in self.table[s] if x >= 0)
            self.table[s] = -1
            self.lengths[s] = 0

    def check(self, cache):
        c = snapshot(cache)
        np.testing.assert_array_equal(c.page_table, self.table)
        np.testing.assert_array_equal(c.lengths, self.lengths)
        assert int(c.num_free) == len(self.stack)
        np.testing.assert_array_equal(c.free_pages[:int(c.num_free)], self.stack)
        # The whole pools, not just the live slots: nothing was written anywhere else.
        np.testing.assert_array_equal(c.k_pages, self.k)
        np.testing.assert_array_equal(c.v_pages, self.v)
        # Every page is either free or held by exactly one logical page of one slot.
        held = c.page_table[c.page_table >= 0]
        assert sorted(held.tolist() + c.free_pages[:int(c.num_free)].tolist()) == list(range(N))


def readback(cache, s):
    """Slot s's stored tokens gathered through the page table: (k (L, Hkv, D), v)."""
    pos = np.arange(int(cache.lengths[s]))
    pages = np.asarray(cache.page_table)[s, pos // PS]
    assert (pages >= 0).all()
    k = np.asarray(cache.k_pages)[:, pages, pos % PS]
    v = np.asarray(cache.v_pages)[:, pages, pos % PS]
    return k.swapaxes(0, 1), v.swapaxes(0, 1)


# ----------------------------------------------------------------------------------
# create, sizes, pytree
# ----------------------------------------------------------------------------------


def test_create_is_empty_with_every_page_free():
    c = PagedKVCache.create(num_pages=N, page_size=PS, num_kv_heads=HKV, head_dim=D,
                            max_seqs=S, max_pages_per_seq=P, dtype=jnp.bfloat16, v_head_dim=DV)
    assert c.k_pages.shape == (HKV, N, PS, D) and c.k_pages.dtype == jnp.bfloat16
    assert c.v_pages.shape == (HKV, N, PS, DV) and c.v_pages.dtype == jnp.bfloat16
    assert c.page_table.shape == (S, P) and c.page_table.dtype == jnp.int32
    assert c.lengths.shape == (S,) and c.lengths.dtype == jnp.int32
    assert c.free_pages.shape == (N,) and c.free_pages.dtype == jnp.int32
    assert c.num_free.shape == () and c.num_free.dtype == jnp.int32
    assert (c.page_size, c.num_pages, c.max_seqs, c.max_pages_per_seq, c.capacity) == \
        (PS, N, S, P, CAP)
    assert (np.asarray(c.page_table) == -1).all() and (np.asarray(c.lengths) == 0).all()
    assert int(c.num_free) == N and sorted(np.asarray(c.free_pages).tolist()) == list(range(N))
    assert not np.asarray(c.k_pages, np.float32).any()
    # Without v_head_dim, v has k's head dim; the default dtype is float32.
    c = PagedKVCache.create(N, PS, HKV, D, max_seqs=S, max_pages_per_seq=P)
    assert c.v_pages.shape == (HKV, N, PS, D) and c.v_pages.dtype == jnp.float32


def test_the_cache_is_a_pytree_of_its_six_arrays():
    c = empty()
    leaves, treedef = jax.tree_util.tree_flatten(c)
    assert len(leaves) == 6
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, PagedKVCache) and again.capacity == CAP
    # replace() gives a new cache and leaves the old one alone.
    r = c.replace(lengths=jnp.ones((S,), jnp.int32))
    assert r.lengths.tolist() == [1] * S and c.lengths.tolist() == [0] * S
    # Sizes are read from shapes, so they are static inside jit.
    assert jax.jit(lambda c: jnp.zeros((c.capacity, c.num_pages)))(c).shape == (CAP, N)


@pytest.mark.parametrize("name,value", [("num_pages", 0), ("page_size", -2),
                                        ("head_dim", 2.0), ("max_seqs", True),
                                        ("v_head_dim", 0)])
def test_create_refuses_sizes_that_are_not_positive_ints(name, value):
    args = dict(num_pages=N, page_size=PS, num_kv_heads=HKV, head_dim=D, max_seqs=S,
                max_pages_per_seq=P)
    args[name] = value
    with pytest.raises(ValueError) as info:
        PagedKVCache.create(**args)
    assert str(info.value) == (f"PagedKVCache.create: {name} must be a positive int; "
                               f"got {value!r}")


def test_messages_of_append():
    c = empty()
    ids = jnp.zeros((3,), jnp.int32)
    k, v = jnp.zeros((3, HKV, D)), jnp.zeros((3, HKV, DV))
    with pytest.raises(TypeError) as info:
        c.append(jnp.zeros((3,)), k, v)
    assert str(info.value) == ("PagedKVCache.append: seq_ids must be a 1-D integer array (one "
                               "slot per new token, -1 for none); got float32 (3,)")
    with pytest.raises(TypeError) as info:
        c.allocate(jnp.zeros((1, 3), jnp.int32))
    assert str(info.value) == ("PagedKVCache.allocate: seq_ids must be a 1-D integer array (one "
                               "slot per new token, -1 for none); got int32 (1, 3)")
    with pytest.raises(TypeError) as info:
        c.allocate([0, 1])
    assert str(info.value).endswith("-1 for none); got list (2,)")
    with pytest.raises(ValueError) as info:
        c.append(ids, jnp.zeros((3, HKV, DV)), v)
    assert str(info.value) == ("PagedKVCache.append: k must have shape (T, Hkv, D)=(3, 2, 5); "
                               "got (3, 2, 4)")
    with pytest.raises(ValueError) as info:
        jax.jit(PagedKVCache.append)(c, ids, k, jnp.zeros((2, HKV, DV)))
    assert str(info.value) == ("PagedKVCache.append: v must have shape (T, Hkv, Dv)=(3, 2, 4); "
                               "got (2, 2, 4)")


# ----------------------------------------------------------------------------------
# append / allocate / release
# ----------------------------------------------------------------------------------


def test_append_interleaved_slots_in_one_call():
    rng = np.random.default_rng(0)
    ids = np.array([2, 0, 2, 2, 0, 3, 2, 2])  # slot 2: 5 tokens, slot 0: 2, slot 3: 1
    k, v = tokens(rng, len(ids))
    c = empty()
    out = append(c, jnp.asarray(ids), jnp.asarray(k), jnp.asarray(v))
    assert c.k_pages.is_deleted()  # donated: updated in place
    # Pages come off the top of the stack [0..6], slots in order: slot 0 takes 6,
    # slot 2 takes 5 and 4, slot 3 takes 3.
    assert out.page_table.tolist() == [[6, -1, -1], [-1, -1, -1], [5, 4, -1], [3, -1, -1]]
    assert out.lengths.tolist() == [2, 0, 5, 1]
    assert int(out.num_free) == 3
    assert sorted(np.asarray(out.free_pages)[:3].tolist()) == [0, 1, 2]
    for s in (0, 2, 3):
        got_k, got_v = readback(out, s)
        np.testing.assert_array_equal(got_k, k[ids == s])  # in order of arrival
        np.testing.assert_array_equal(got_v, v[ids == s])
    # A second call continues each slot where it stopped, filling the partly used
    # page before taking a new one.
    ids2 = np.array([0, 0, 2, -1, 1, 0])
    k2, v2 = tokens(rng, len(ids2))
    out = append(out, jnp.asarray(ids2), jnp.asarray(k2), jnp.asarray(v2))
    assert out.lengths.tolist() == [5, 1, 6, 1]
    assert out.page_table.tolist() == [[6, 2, -1], [1, -1, -1], [5, 4, -1], [3, -1, -1]]
    for s in range(S):
        want = np.concatenate([k[ids == s], k2[ids2 == s]])
        np.testing.assert_array_equal(readback(out, s)[0], want)


def test_low_precision_cache_stores_the_tokens_cast_to_its_dtype():
    rng = np.random.default_rng(6)
    k, v = tokens(rng, 4)
    c = jax.jit(PagedKVCache.append)(empty(jnp.bfloat16), jnp.array([1, 3, 1, 1]),
                                     jnp.asarray(k), jnp.asarray(v))
    assert c.k_pages.dtype == jnp.bfloat16 and c.v_pages.dtype == jnp.bfloat16
    got_k, got_v = readback(c, 1)
    np.testing.assert_array_equal(got_k, jnp.asarray(k[[0, 2, 3]], jnp.bfloat16))
    np.testing.assert_array_equal(got_v, jnp.asarray(v[[0, 2, 3]], jnp.bfloat16))
    # Plain nested lists are accepted for k and v.
    c = c.append(jnp.array([0]), k[:1].tolist(), v[:1].tolist())
    np.testing.assert_array_equal(readback(c, 0)[0], jnp.asarray(k[:1], jnp.bfloat16))


def test_allocate_makes_room_without_writing():
    c = allocate(empty(), jnp.array([1, 1, 1, 1, -1, 3, 9, -4]))
    assert c.lengths.tolist() == [0, 4, 0, 1]
    assert c.page_table.tolist() == [[-1, -1, -1], [6, 5, -1], [-1, -1, -1], [4, -1, -1]]
    assert int(c.num_free) == 4
    assert not np.asarray(c.k_pages).any() and not np.asarray(c.v_pages).any()


def test_past_capacity_and_out_of_pages_never_corrupts_other_slots():
    rng = np.random.default_rng(1)
    c = empty()
    k, v = tokens(rng, T)
    ids = np.array([1, 1, 1, 1, 2, 3])  # slot 1: 4 tokens (2 pages), 2 and 3: one each
    c = append(c, jnp.asarray(ids), jnp.asarray(k), jnp.asarray(v))
    assert int(c.num_free) == 3
    before = snapshot(c)
    # Slot 0 asks for 6 + 6 tokens = 4 pages > capacity (3 pages) and > the 3 free pages.
    k0, v0 = tokens(rng, 2 * T)
    for half in (slice(0, T), slice(T, 2 * T)):
        c = append(c, jnp.zeros((T,), jnp.int32), jnp.asarray(k0[half]), jnp.asarray(v0[half]))
    after = snapshot(c)
    assert after.lengths.tolist() == [CAP, 4, 1, 1]  # stops at the capacity
    assert after.page_table[0].tolist() == [2, 1, 0] and int(after.num_free) == 0
    np.testing.assert_array_equal(readback(c, 0)[0], k0[:CAP])  # the rest is dropped
    np.testing.assert_array_equal(readback(c, 0)[1], v0[:CAP])
    # Other slots: same pages, same lengths, their pages bit-identical.
    for s in (1, 2, 3):
        np.testing.assert_array_equal(after.page_table[s], before.page_table[s])
        pages = before.page_table[s][before.page_table[s] >= 0]
        np.testing.assert_array_equal(after.k_pages[:, pages], before.k_pages[:, pages])
        np.testing.assert_array_equal(after.v_pages[:, pages], before.v_pages[:, pages])

    # No page left: slot 2 grows past its page, its new page is missing (-1), the
    # tokens that needed it are not stored, and nothing else changes.
    before = after
    k2, v2 = tokens(rng, T)
    c = append(c, jnp.array([2, 2, 2, 3, -1, -1]), jnp.asarray(k2), jnp.asarray(v2))
    after = snapshot(c)
    assert after.lengths.tolist() == [CAP, 4, 4, 2]
    assert after.page_table[2].tolist() == [before.page_table[2, 0], -1, -1]
    page2, page3 = before.page_table[2, 0], before.page_table[3, 0]
    np.testing.assert_array_equal(after.k_pages[:, page2, 1:3], k2[:2].swapaxes(0, 1))
    np.testing.assert_array_equal(after.k_pages[:, page3, 1], k2[3])
    np.testing.assert_array_equal(after.v_pages[:, page2, 1:3], v2[:2].swapaxes(0, 1))
    written = np.zeros((N, PS), bool)
    written[page2, 1:3] = written[page3, 1] = True
    np.testing.assert_array_equal(after.k_pages[:, ~written], before.k_pages[:, ~written])
    np.testing.assert_array_equal(after.v_pages[:, ~written], before.v_pages[:, ~written])


def test_release_returns_the_pages_and_the_slot_is_reused():
    rng = np.random.default_rng(2)
    k, v = tokens(rng, T)
    c = append(empty(), jnp.array([0, 0, 0, 0, 1, 2]), jnp.asarray(k), jnp.asarray(v))
    assert c.page_table.tolist() == [[6, 5, -1], [4, -1, -1], [3, -1, -1], [-1, -1, -1]]
    before = snapshot(c)
    c = release(c, jnp.int32(0))  # a traced slot id
    assert c.lengths.tolist() == [0, 1, 1, 0] and int(c.num_free) == 5
    assert c.page_table.tolist()[0] == [-1, -1, -1]
    assert np.asarray(c.free_pages)[:5].tolist() == [0, 1, 2, 6, 5]
    # Releasing does not touch the pools, the other slots, or anything twice.
    np.testing.assert_array_equal(np.asarray(c.k_pages), before.k_pages)
    for bad in (0, -1, S, 100):
        same = snapshot(c)
        c = release(c, jnp.int32(bad))
        for a, b in zip(jax.tree_util.tree_leaves(snapshot(c)), jax.tree_util.tree_leaves(same)):
            np.testing.assert_array_equal(a, b)
    # The slot starts again from position 0 on the pages it gave back (last freed
    # first), and reads back only its new tokens.
    k2, v2 = tokens(rng, T)
    c = append(c, jnp.array([0, 0, 0, 0, -1, -1]), jnp.asarray(k2), jnp.asarray(v2))
    assert c.lengths.tolist() == [4, 1, 1, 0]
    assert c.page_table.tolist()[0] == [5, 6, -1]
    np.testing.assert_array_equal(readback(c, 0)[0], k2[:4])
    np.testing.assert_array_equal(readback(c, 1)[0], k[4:5])


def test_random_appends_and_releases_match_the_model():
    """Appends of interleaved slots (with -1, negative and out-of-range ids), releases
    of any id, capacity overflows and page exhaustion, against the Python model: the
    whole pools, the table, the lengths and the free stack after every step."""
    rng = np.random.default_rng(3)
    model, c = Model(), empty()
    model.check(c)
    choices = np.array([-1, -3, 0, 1, 2, 3, S, 0, 1, 2, 3])
    for step in range(30):
        if rng.random() < 0.3:
            s = int(rng.integers(-1, S + 1))
            c = release(c, jnp.int32(s))
            model.release(s)
        else:
            ids = rng.choice(choices, T).astype(np.int32)
            k, v = tokens(rng, T)
            c = append(c, jnp.asarray(ids), jnp.asarray(k), jnp.asarray(v))
            model.append(ids, k, v)
        model.check(c)
    # The walk went through both kinds of trouble.
    assert model.reached_capacity and model.ran_out


# ----------------------------------------------------------------------------------
# attention on the cache
# ----------------------------------------------------------------------------------


def test_ragged_metadata():
    c = append(empty(), jnp.array([0, 0, 2, 2, 2, 3]), jnp.zeros((T, HKV, D)),
               jnp.zeros((T, HKV, DV)))
    m = c.ragged_metadata(jnp.array([0, 0, 2, 2, 2, 3, -1, -1]))
    assert m["query_start_loc"].tolist() == [0, 2, 2, 5, 6]
    assert int(m["num_seqs"]) == S and m["num_seqs"].dtype == jnp.int32
    assert m["context_lengths"] is c.lengths and m["page_table"] is c.page_table


def test_ragged_metadata_checked_reports_bad_packing():
    c = empty()
    f = jax.jit(checkify.checkify(lambda ids: c.ragged_metadata(ids, checked=True)))
    err, m = f(jnp.array([0, 0, 2, 3, -1, -1]))
    assert err.get() is None and m["query_start_loc"].tolist() == [0, 2, 2, 3, 4]
    err, _ = f(jnp.array([0, 2, 0, 3, -1, -1]))
    assert "seq_ids[2] = 0 follows 2" in err.get()
    err, _ = f(jnp.array([0, 0, -1, 3, -1, -1]))  # padding before a token
    assert "seq_ids[3] = 3 follows -1" in err.get()
    err, _ = f(jnp.array([0, S, -1, -1, -1, -1]))
    assert f"seq_ids holds slot {S}; slots are 0 .. max_seqs - 1 = {S - 1}" in err.get()


SPEC = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.5, -1.0, 0.0, 2.0]))
HQ, STEP_T = 4, 8  # query heads; tokens per serving step (padded with -1)


@functools.partial(jax.jit, donate_argnums=0)
def serve(cache, seq_ids, q, k, v):
    """One serving step: store the new tokens, then attend over the cache."""
    cache = cache.append(seq_ids, k, v)
    res = fnattn.ragged_paged_attention(SPEC, q, cache.k_pages, cache.v_pages,
                                        **cache.ragged_metadata(seq_ids))
    return cache, res


_reference = jax.jit(fnattn.reference)


def test_ragged_paged_attention_on_the_cache_equals_reference_on_dense_tokens():
    """Prefill of several slots, decode, chunked prefill, a release and a new sequence in
    the freed slot, one jitted step each; every live row against fnattn.reference on
    the sequence's dense tokens, padding rows exactly 0 with lse = -inf."""
    rng = np.random.default_rng(4)
    cache = PagedKVCache.create(num_pages=12, page_size=PS, num_kv_heads=HKV, head_dim=D,
                                max_seqs=S, max_pages_per_seq=P, v_head_dim=DV)
    dense_k = {s: np.zeros((0, HKV, D), np.float32) for s in range(S)}
    dense_v = {s: np.zeros((0, HKV, DV), np.float32) for s in range(S)}
    steps = [[0, 0, 0, 0, 0, 2, 2, 2],  # prefill (sorted by slot, as ragged_metadata wants)
             [0, 1, 1, 1, 2, -1, -1, -1],  # decode of 0 and 2, prefill of 1
             [0, 2, 2, 2, 2, 3, -1, -1],  # chunked prefill of 2 (to 8 tokens), 3 starts
             "release 0",
             [0, 0, 1, 3, -1, -1, -1, -1]]  # a new sequence in slot 0
    for ids in steps:
        if ids == "release 0":
            cache = release(cache, jnp.int32(0))
            dense_k[0], dense_v[0] = dense_k[0][:0], dense_v[0][:0]
            continue
        ids = np.asarray(ids, np.int32)
        q = rng.standard_normal((STEP_T, HQ, D)).astype(np.float32)
        k, v = tokens(rng, STEP_T)
        cache, res = serve(cache, jnp.asarray(ids), jnp.asarray(q), jnp.asarray(k),
                           jnp.asarray(v))
        out, lse = np.asarray(res.out), np.asarray(res.lse)
        for s in range(S):
            rows = ids == s
            dense_k[s] = np.concatenate([dense_k[s], k[rows]])
            dense_v[s] = np.concatenate([dense_v[s], v[rows]])
            if not rows.any():
                continue
            want = _reference(SPEC, jnp.asarray(q[rows])[None], jnp.asarray(dense_k[s])[None],
                              jnp.asarray(dense_v[s])[None])
            np.testing.assert_allclose(out[rows], want.out[0], atol=2e-5, rtol=2e-5)
            np.testing.assert_allclose(lse[:, rows], want.lse[0], atol=2e-5, rtol=2e-5)
        pad = ids < 0
        assert (out[pad] == 0).all() and (lse[:, pad] == -np.inf).all()
        assert cache.lengths.tolist() == [len(dense_k[s]) for s in range(S)]


def test_allocate_then_update_equals_append_then_attend():
    """allocate + ragged_paged_attention_with_update (which writes the tokens) gives the
    same cache and the same result as append + ragged_paged_attention."""
    rng = np.random.default_rng(5)
    prefix_ids = np.array([0, 0, 1, 1, 1, 3])
    k0, v0 = tokens(rng, T)
    base = append(empty(), jnp.asarray(prefix_ids), jnp.asarray(k0), jnp.asarray(v0))
    ids = jnp.array([0, 1, 1, 1, 1, 3, 3, -1])
    q = jnp.asarray(rng.standard_normal((8, HQ, D)), jnp.float32)
    k, v = (jnp.asarray(x) for x in tokens(rng, 8))

    @jax.jit
    def write_then_attend(cache):
        cache = cache.append(ids, k, v)
        res = fnattn.ragged_paged_attention(SPEC, q, cache.k_pages, cache.v_pages,
                                            **cache.ragged_metadata(ids))
        return cache, res

    @jax.jit
    def allocate_then_update(cache):
        cache = cache.allocate(ids)
        res, kp, vp = fnattn.ragged_paged_attention_with_update(
            SPEC, q, k, v, cache.k_pages, cache.v_pages, **cache.ragged_metadata(ids))
        return cache.replace(k_pages=kp, v_pages=vp), res

    c1, r1 = write_then_attend(base)
    c2, r2 = allocate_then_update(base)
    for a, b in zip(jax.tree_util.tree_leaves(c1), jax.tree_util.tree_leaves(c2)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(r1.out, r2.out, atol=1e-6)
    np.testing.assert_allclose(r1.lse, r2.lse, atol=1e-6)


# ----------------------------------------------------------------------------------
# Quantized pools (fnattn.quant)
# ----------------------------------------------------------------------------------

QFORMATS = ["int8", ("float8_e4m3fn", "float8_e5m2"), "int4",
            (("int8", "tensor"), ("float8_e4m3fn", "tensor"))]


def _qformat(f):
    from fnattn.quant import QuantFormat
    if isinstance(f, tuple) and isinstance(f[0], (tuple, str)) and len(f) == 2 \
            and not (isinstance(f[0], str) and f[1] in ("token", "tensor")):
        return tuple(_qformat(x) for x in f)
    return QuantFormat(*f) if isinstance(f, tuple) else QuantFormat(f)


@pytest.mark.parametrize("fmt", QFORMATS, ids=str)
def test_quantized_cache_serving_steps_equal_reference_on_dequantized_tokens(fmt):
    """As above on quantized pools: append (quantize on write), release and reuse of a
    slot, attention; every live row against fnattn.reference on the sequence's tokens
    as quantized (each token's codes depend on its own values only); allocate +
    ragged_paged_attention_with_update writes the same codes and scales as append."""
    from fnattn import quant
    fmts = _qformat(fmt)
    kf, vf = fmts if isinstance(fmts, tuple) else (fmts, fmts)
    scale = lambda f: None if f.per_token else 3.0 / f.max_code  # noqa: E731
    Dq = 6
    cache = PagedKVCache.create(num_pages=12, page_size=PS, num_kv_heads=HKV, head_dim=Dq,
                                max_seqs=S, max_pages_per_seq=P, v_head_dim=Dq,
                                quant_format=(kf, vf), k_scale=scale(kf), v_scale=scale(vf))
    assert quant.is_quantized(cache.k_pages) and cache.k_pages.format == kf
    rq = lambda x, f: np.asarray(quant.dequantize(quant.quantize(  # noqa: E731
        jnp.asarray(x), f, scale=scale(f))))
    rng = np.random.default_rng(6)
    dense_k = {s: np.zeros((0, HKV, Dq), np.float32) for s in range(S)}
    dense_v = {s: np.zeros((0, HKV, Dq), np.float32) for s in range(S)}
    steps = [[0, 0, 0, 0, 0, 2, 2, 2], [0, 1, 1, 1, 2, -1, -1, -1], "release 0",
             [0, 0, 1, 3, -1, -1, -1, -1]]

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, ids, q, k, v):
        cache = cache.append(ids, k, v)
        res = fnattn.ragged_paged_attention(SPEC, q, cache.k_pages, cache.v_pages,
                                            **cache.ragged_metadata(ids))
        return cache, res

    @jax.jit
    def step_update(cache, ids, q, k, v):
        cache = cache.allocate(ids)
        res, kp, vp = fnattn.ragged_paged_attention_with_update(
            SPEC, q, k, v, cache.k_pages, cache.v_pages, **cache.ragged_metadata(ids))
        return cache.replace(k_pages=kp, v_pages=vp), res

    for ids in steps:
        if ids == "release 0":
            cache = release(cache, jnp.int32(0))
            dense_k[0], dense_v[0] = dense_k[0][:0], dense_v[0][:0]
            continue
        ids = np.asarray(ids, np.int32)
        q = rng.standard_normal((STEP_T, HQ, Dq)).astype(np.float32)
        k = rng.standard_normal((STEP_T, HKV, Dq)).astype(np.float32)
        v = rng.standard_normal((STEP_T, HKV, Dq)).astype(np.float32)
        args = (jnp.asarray(ids), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        c2, r2 = step_update(cache, *args)
        cache, res = step(cache, *args)
        for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(c2)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1
                                          else a, np.asarray(b).view(np.uint8)
                                          if b.dtype.itemsize == 1 else b)
        np.testing.assert_allclose(res.out, r2.out, atol=1e-6)
        out, lse = np.asarray(res.out), np.asarray(res.lse)
        for s in range(S):
            rows = ids == s
            dense_k[s] = np.concatenate([dense_k[s], rq(k[rows], kf)])
            dense_v[s] = np.concatenate([dense_v[s], rq(v[rows], vf)])
            if not rows.any():
                continue
            want = _reference(SPEC, jnp.asarray(q[rows])[None], jnp.asarray(dense_k[s])[None],
                              jnp.asarray(dense_v[s])[None])
            np.testing.assert_allclose(out[rows], want.out[0], atol=2e-5, rtol=2e-5)
            np.testing.assert_allclose(lse[:, rows], want.lse[0], atol=2e-5, rtol=2e-5)
        assert cache.lengths.tolist() == [len(dense_k[s]) for s in range(S)]


def test_quantized_cache_create_messages():
    with pytest.raises(ValueError, match="needs its scale"):
        PagedKVCache.create(4, 2, 1, 8, max_seqs=2, max_pages_per_seq=2,
                            quant_format=fnattn.quant.QuantFormat("int8", "tensor"))
    with pytest.raises(ValueError, match="head dim, which must be even"):
        PagedKVCache.create(4, 2, 1, 7, max_seqs=2, max_pages_per_seq=2, quant_format="int4")
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        PagedKVCache.create(4, 2, 1, 8, max_seqs=2, max_pages_per_seq=2, k_scale=0.0,
                            v_scale=1.0,
                            quant_format=fnattn.quant.QuantFormat("int8", "tensor"))
