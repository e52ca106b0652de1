"""Rolling back a speculative step: ``accept_drafts`` of PagedKVCache and
LayeredPagedKVCache keeps the accepted path's k/v bit for bit, right after the context,
shortens the lengths and gives emptied pages back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import fnattn
from fnattn import AttentionSpec, LayeredPagedKVCache, PagedKVCache, masks

PS, HKV, D = 4, 2, 8


def _tokens(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::7] = -0.0                       # bits a float compare would not see
    return jnp.asarray(x)


def _bits(x):
    return np.asarray(x).view(np.uint32)


def _setup(cache_cls, layers=None, quant_format=None):
    """Two slots: slot 0 with a 6-token context and 7 drafts, slot 1 with a 3-token
    context and no drafts; slot 2 empty. Returns (cache after the step, k, v) with k/v
    every token's (context then drafts) per slot."""
    rng = np.random.default_rng(0)
    lead = () if layers is None else (layers,)
    kw = dict(num_pages=12, page_size=PS, num_kv_heads=HKV, head_dim=D, max_seqs=3,
              max_pages_per_seq=5, quant_format=quant_format)
    cache = (cache_cls.create(**kw) if layers is None else cache_cls.create(layers, **kw))
    ids = jnp.array([0] * 6 + [1] * 3)
    k, v = _tokens(rng, lead + (9, HKV, D)), _tokens(rng, lead + (9, HKV, D))
    cache = jax.jit(type(cache).append)(cache, ids, k, v)
    dk, dv = _tokens(rng, lead + (7, HKV, D)), _tokens(rng, lead + (7, HKV, D))
    cache = jax.jit(type(cache).append)(cache, jnp.zeros(7, jnp.int32), dk, dv)
    ax = len(lead)
    return cache, (jnp.concatenate([k.take(jnp.arange(6), axis=ax), dk], axis=ax),
                   jnp.concatenate([v.take(jnp.arange(6), axis=ax), dv], axis=ax),
                   k.take(jnp.arange(6, 9), axis=ax))


def _read(cache, slot, n, layer=None):
    """k of the first n positions of ``slot`` (n, Hkv, D), read through the table."""
    kp = cache.k_pages if layer is None else cache.k_pages[layer]
    table = np.asarray(cache.page_table[slot])
    return jnp.stack([kp[:, table[p // PS], p % PS] for p in range(n)])


ACCEPTED = jnp.array([[0, 2, 5, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]])


def test_accept_drafts_keeps_the_path_bit_exactly_and_frees_pages():
    cache, (k, v, k1) = _setup(PagedKVCache)
    before = (cache.page_table, int(cache.num_free))
    assert cache.lengths.tolist() == [13, 3, 0]
    got = jax.jit(PagedKVCache.accept_drafts)(cache, jnp.array([7, 0, 0]), ACCEPTED)
    assert got.lengths.tolist() == [9, 3, 0]
    want = jnp.concatenate([k[:6], k[6 + jnp.array([0, 2, 5])]])
    np.testing.assert_array_equal(_bits(_read(got, 0, 9)), _bits(want))
    np.testing.assert_array_equal(_bits(_read(got, 1, 3)), _bits(k1))       # untouched
    # 13 tokens took 4 pages, 9 take 3: one page back on the stack
    assert int(got.num_free) == before[1] + 1
    freed = int(before[0][0, 3])
    assert got.page_table[0].tolist() == before[0][0, :3].tolist() + [-1, -1]
    assert int(got.free_pages[before[1]]) == freed
    # the next allocation reuses it, and attention over the rolled-back slot equals
    # attention over a cache that received the accepted tokens directly
    direct = PagedKVCache.create(num_pages=12, page_size=PS, num_kv_heads=HKV, head_dim=D,
                                 max_seqs=3, max_pages_per_seq=5)
    idx = jnp.array([0, 2, 5])
    direct = direct.append(jnp.array([0] * 9), want, jnp.concatenate([v[:6], v[6 + idx]]))
    q = _tokens(np.random.default_rng(1), (1, 1, 4, D))
    spec = AttentionSpec(mask=masks.causal())
    f = jax.jit(lambda c: fnattn.paged_attention(spec, q, c.k_pages, c.v_pages,
                                                 page_table=c.page_table[:1],
                                                 kv_lengths=c.lengths[:1]).out)
    np.testing.assert_array_equal(f(got), f(direct))


def test_a_verification_step_end_to_end_under_jit():
    """allocate the drafts, verify the tree with the update form, accept a path."""
    rng = np.random.default_rng(4)
    cache = PagedKVCache.create(num_pages=8, page_size=PS, num_kv_heads=1, head_dim=D,
                                max_seqs=1, max_pages_per_seq=6)
    ctx = _tokens(rng, (10, 1, D))
    cache = cache.append(jnp.zeros(10, jnp.int32), ctx, ctx)
    parents = jnp.array([-1, 0, 0, 1, 2], jnp.int32)
    q, kd = _tokens(rng, (5, 2, D)), _tokens(rng, (5, 1, D))
    spec = AttentionSpec(mask=masks.causal())

    @jax.jit
    def step(cache, q, kd):
        ids = jnp.zeros(5, jnp.int32)
        cache = cache.allocate(ids)
        res, kp, vp = fnattn.ragged_paged_attention_with_update(
            spec, q, kd, kd, cache.k_pages, cache.v_pages, **cache.ragged_metadata(ids),
            draft_parents=parents)
        cache = cache.replace(k_pages=kp, v_pages=vp)
        return res.out, cache.accept_drafts(jnp.array([5]), jnp.array([[0, 2, 4]]))

    out, cache = step(cache, q, kd)
    assert cache.lengths.tolist() == [13] and int(cache.num_free) == 4
    np.testing.assert_array_equal(_bits(_read(cache, 0, 13)),
                                  _bits(jnp.concatenate([ctx, kd[jnp.array([0, 2, 4])]])))
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_layered_cache_rolls_back_every_layer(fmt):
    cache, _ = _setup(LayeredPagedKVCache, layers=3, quant_format=fmt)
    got = jax.jit(LayeredPagedKVCache.accept_drafts)(cache, jnp.array([7, 0, 0]), ACCEPTED)
    assert got.lengths.tolist() == [9, 3, 0] and int(got.num_free) == int(cache.num_free) + 1
    order = jnp.array(list(range(6)) + [6, 8, 11])
    table0, table1 = np.asarray(cache.page_table[0]), np.asarray(got.page_table[0])
    for layer in range(3):
        for name in ("k_pages", "v_pages"):
            old, new = getattr(cache, name), getattr(got, name)
            leaves = [(old, new)] if fmt is None else [(old.data, new.data),
                                                       (old.scale, new.scale)]
            for a, b in leaves:       # codes and per-token scales alike, bit for bit
                for pos in range(9):
                    src = int(order[pos])
                    x = a[layer, :, table0[src // PS], src % PS]
                    y = b[layer, :, table1[pos // PS], pos % PS]
                    np.testing.assert_array_equal(np.asarray(x).view(np.uint8),
                                                  np.asarray(y).view(np.uint8))


def test_bad_paths_are_refused():
    cache, _ = _setup(PagedKVCache)
    n = jnp.array([7, 0, 0])
    for bad, entry in (([[0, 0, 2, -1]], "entry 1 is 0"), ([[0, 7, -1, -1]], "entry 1 is 7"),
                       ([[0, -1, 3, -1]], "entry 2 is 3")):
        acc = np.array(bad + [[-1] * 4] * 2)
        with pytest.raises(ValueError, match="accepted\\[0\\] must be a root-to-node path.*"
                           + entry):
            cache.accept_drafts(n, acc)
        err, _ = jax.jit(checkify.checkify(lambda c, a: c.accept_drafts(n, a, checked=True)))(
            cache, jnp.asarray(acc))
        assert err.get() is not None and entry in err.get()
    err, _ = jax.jit(checkify.checkify(lambda c, a: c.accept_drafts(n, a, checked=True)))(
        cache, ACCEPTED)
    assert err.get() is None
    with pytest.raises(ValueError, match=r"accepted must have shape \(max_seqs, max_accepted\)"):
        cache.accept_drafts(n, jnp.array([0, 1]))


@pytest.mark.parametrize("cache_cls", [PagedKVCache, LayeredPagedKVCache])
def test_paths_that_leave_the_tree_are_refused(cache_cls):
    cache, _ = _setup(cache_cls, layers=2 if cache_cls is LayeredPagedKVCache else None)
    n = jnp.array([7, 0, 0])
    # slot 0's tree: 0 <- 1 <- 3, 0 <- 2 <- 4, root <- 5 <- 6
    par = np.array([[-1, 0, 0, 1, 2, -1, 5]] + [[-1] * 7] * 2)
    good = np.array([[0, 2, 4, -1]] + [[-1] * 4] * 2)
    f = jax.jit(checkify.checkify(
        lambda c, a, p: c.accept_drafts(n, a, parents=p, checked=True)))
    assert f(cache, jnp.asarray(good), jnp.asarray(par))[0].get() is None
    cache.accept_drafts(n, good, parents=par)
    for bad, entry in (([[0, 3, -1, -1]], "entry 1 is node 3, whose parent is 1"),
                       ([[2, 4, -1, -1]], "entry 0 is node 2, whose parent is 0"),
                       ([[0, 1, 6, -1]], "entry 2 is node 6, whose parent is 5")):
        acc = np.array(bad + [[-1] * 4] * 2)
        with pytest.raises(ValueError, match="must follow parents\\[0\\]: " + entry):
            cache.accept_drafts(n, acc, parents=par)
        err = f(cache, jnp.asarray(acc), jnp.asarray(par))[0]
        assert err.get() is not None and entry in err.get()
    with pytest.raises(ValueError, match=r"parents must have shape \(max_seqs, max_drafts\)"):
        cache.accept_drafts(n, good, parents=par[0])
