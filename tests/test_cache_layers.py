"""fnattn.cache.LayeredPagedKVCache: one allocation and one page table for every
layer, per-layer pools stacked on axis 0. Against one PagedKVCache per layer built
separately (the whole pools, tables, lengths and free stacks, after every step of a
walk with interleaved slots, padding, capacity overflows, page exhaustion and
releases), and attention per layer under lax.scan against those caches and against
a float64 NumPy attention on the dense tokens. Everything under jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_attention import np_causal_tail

import fnattn
from fnattn import AttentionSpec, PagedKVCache, masks
from fnattn.cache import LayeredPagedKVCache, TokenSlots, write_tokens

# Distinct sizes so that a swapped axis fails: 3 layers, 7 pages of 3 slots, 2 kv
# heads, head dims 5 (k) and 4 (v), 4 slots of at most 3 pages (capacity 9; 4 * 3 > 7,
# so the pages can run out).
L, N, PS, HKV, D, DV, S, P = 3, 7, 3, 2, 5, 4, 4, 3
CAP = P * PS
T = 6   # tokens per step
HQ = 4
SPEC = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.5, -1.0, 0.0, 2.0]))


def empty(num_pages=N):
    return LayeredPagedKVCache.create(num_layers=L, num_pages=num_pages, page_size=PS,
                                      num_kv_heads=HKV, head_dim=D, max_seqs=S,
                                      max_pages_per_seq=P, v_head_dim=DV)


def single(num_pages=N):
    return PagedKVCache.create(num_pages=num_pages, page_size=PS, num_kv_heads=HKV, head_dim=D,
                               max_seqs=S, max_pages_per_seq=P, v_head_dim=DV)


def normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


BOOK = ("page_table", "lengths", "free_pages", "num_free")


def assert_same_as_layers(layered, caches):
    """The layered cache is the per-layer caches: same bookkeeping, same pools."""
    for c in caches:
        for name in BOOK:
            np.testing.assert_array_equal(getattr(layered, name), getattr(c, name), err_msg=name)
    np.testing.assert_array_equal(layered.k_pages, np.stack([c.k_pages for c in caches]))
    np.testing.assert_array_equal(layered.v_pages, np.stack([c.v_pages for c in caches]))


# ----------------------------------------------------------------------------------
# create, pytree
# ----------------------------------------------------------------------------------


def test_create_sizes_and_pytree():
    c = empty()
    assert c.k_pages.shape == (L, HKV, N, PS, D) and c.v_pages.shape == (L, HKV, N, PS, DV)
    assert (c.num_layers, c.num_pages, c.page_size, c.max_seqs, c.max_pages_per_seq,
            c.capacity) == (L, N, PS, S, P, CAP)
    s = single()
    for name in BOOK:  # the bookkeeping of an empty single-layer cache
        np.testing.assert_array_equal(getattr(c, name), getattr(s, name))
        assert getattr(c, name).dtype == jnp.int32
    c16 = LayeredPagedKVCache.create(2, N, PS, HKV, D, max_seqs=S, max_pages_per_seq=P,
                                     dtype=jnp.bfloat16)
    assert c16.k_pages.dtype == c16.v_pages.dtype == jnp.bfloat16
    assert c16.v_pages.shape == (2, HKV, N, PS, D)

    leaves, treedef = jax.tree_util.tree_flatten(c)
    assert len(leaves) == 6
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, LayeredPagedKVCache) and again.capacity == CAP
    r = c.replace(lengths=jnp.ones((S,), jnp.int32))
    assert r.lengths.tolist() == [1] * S and c.lengths.tolist() == [0] * S
    # Sizes come from shapes: static under jit; the cache is a scan carry.
    assert jax.jit(lambda c: jnp.zeros((c.num_layers, c.capacity)))(c).shape == (L, CAP)
    out, _ = jax.jit(lambda c: jax.lax.scan(
        lambda c, i: (c.allocate(jnp.array([i % S])), None), c, jnp.arange(5)))(c)
    assert out.lengths.tolist() == [2, 1, 1, 1]


@pytest.mark.parametrize("name,value", [("num_layers", 0), ("num_pages", -1),
                                        ("head_dim", 2.0), ("v_head_dim", 0)])
def test_create_refuses_sizes_that_are_not_positive_ints(name, value):
    args = dict(num_layers=L, num_pages=N, page_size=PS, num_kv_heads=HKV, head_dim=D,
                max_seqs=S, max_pages_per_seq=P)
    args[name] = value
    with pytest.raises(ValueError) as info:
        LayeredPagedKVCache.create(**args)
    assert str(info.value) == (f"LayeredPagedKVCache.create: {name} must be a positive int; "
                               f"got {value!r}")


# ----------------------------------------------------------------------------------
# Allocation once, writes per layer, against one PagedKVCache per layer
# ----------------------------------------------------------------------------------


@jax.jit
def layered_step(cache, seq_ids, k, v):
    """Allocate once; write each layer inside lax.scan over the stacked pools."""
    cache, slots = cache.allocate_slots(seq_ids)

    def layer(_, xs):
        kp, vp, k, v = xs
        return None, write_tokens(kp, vp, slots, k, v)

    _, (kp, vp) = jax.lax.scan(layer, None, (cache.k_pages, cache.v_pages, k, v))
    return cache.replace(k_pages=kp, v_pages=vp)


@jax.jit
def per_layer_step(caches, seq_ids, k, v):
    return [c.append(seq_ids, k[i], v[i]) for i, c in enumerate(caches)]


release_layered = jax.jit(LayeredPagedKVCache.release)
release_single = jax.jit(PagedKVCache.release)


def test_random_walk_equals_one_cache_per_layer():
    """Interleaved slots with -1, negative and out-of-range ids, capacity overflows,
    pages running out, releases of any id: the layered cache (one allocation per step,
    writes under lax.scan) stays equal to L PagedKVCaches, each appended to separately."""
    rng = np.random.default_rng(0)
    layered, caches = empty(), [single() for _ in range(L)]
    choices = np.array([-1, -3, 0, 1, 2, 3, S, 0, 1, 2, 3])
    full = ran_out = False
    for _ in range(25):
        if rng.random() < 0.3:
            s = jnp.int32(rng.integers(-1, S + 1))
            layered = release_layered(layered, s)
            caches = [release_single(c, s) for c in caches]
        else:
            ids = jnp.asarray(rng.choice(choices, T).astype(np.int32))
            k, v = normal(rng, L, T, HKV, D), normal(rng, L, T, HKV, DV)
            layered = layered_step(layered, ids, k, v)
            caches = per_layer_step(caches, ids, k, v)
        assert_same_as_layers(layered, caches)
        full |= bool((np.asarray(layered.lengths) == CAP).any())
        # a page a slot needs that could not be had stays -1
        needed = np.arange(P)[None, :] < -(-np.asarray(layered.lengths)[:, None] // PS)
        ran_out |= bool((needed & (np.asarray(layered.page_table) == -1)).any())
    assert full and ran_out  # the walk went through both kinds of trouble


def test_append_write_and_write_tokens_agree():
    """append (every layer at once), write(layer) with a static and with a traced
    layer, and write_tokens on each layer's slice write the same thing."""
    rng = np.random.default_rng(1)
    ids = jnp.array([2, 0, 2, -1, 2, 0])
    k, v = normal(rng, L, T, HKV, D), normal(rng, L, T, HKV, DV)
    a = jax.jit(LayeredPagedKVCache.append)(empty(), ids, k, v)

    @jax.jit
    def static_layers(cache):
        cache, slots = cache.allocate_slots(ids)
        for i in range(L):
            cache = cache.write(i, slots, k[i], v[i])
        return cache

    @jax.jit
    def traced_layers(cache):
        cache, slots = cache.allocate_slots(ids)
        return jax.lax.fori_loop(0, L, lambda i, c: c.write(i, slots, k[i], v[i]), cache)

    b, c = static_layers(empty()), traced_layers(empty())
    for x, y in ((a, b), (a, c)):
        for p, q in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)):
            np.testing.assert_array_equal(p, q)
    assert a.lengths.tolist() == [2, 0, 3, 0] and np.asarray(a.k_pages).any()

    # A traced layer out of range writes nothing; a static one is refused.
    cache, slots = empty().allocate_slots(ids)
    write0 = jax.jit(lambda c, i: c.write(i, slots, k[0], v[0]))
    for bad in (-1, L, 100):
        out = write0(cache, jnp.int32(bad))
        assert not np.asarray(out.k_pages).any() and not np.asarray(out.v_pages).any()
    with pytest.raises(ValueError) as info:
        cache.write(L, slots, k[0], v[0])
    assert str(info.value) == ("LayeredPagedKVCache.write: layer must be in [0, num_layers)="
                               f"[0, {L}); got {L}")


# ----------------------------------------------------------------------------------
# Attention per layer under lax.scan
# ----------------------------------------------------------------------------------


@jax.jit
def serve_layered(cache, seq_ids, q, k, v):
    """One step of a model whose layers run in lax.scan: allocate once, then per layer
    write the layer's tokens and attend over its pools with the shared metadata."""
    cache, slots = cache.allocate_slots(seq_ids)
    meta = cache.ragged_metadata(seq_ids)

    def layer(_, xs):
        kp, vp, q, k, v = xs
        kp, vp = write_tokens(kp, vp, slots, k, v)
        res = fnattn.ragged_paged_attention(SPEC, q, kp, vp, **meta)
        return None, (kp, vp, res.out, res.lse)

    _, (kp, vp, out, lse) = jax.lax.scan(layer, None, (cache.k_pages, cache.v_pages, q, k, v))
    return cache.replace(k_pages=kp, v_pages=vp), out, lse


@jax.jit
def serve_layered_with_update(cache, seq_ids, q, k, v):
    """The same with ragged_paged_attention_with_update writing the tokens."""
    cache = cache.allocate(seq_ids)
    meta = cache.ragged_metadata(seq_ids)

    def layer(_, xs):
        kp, vp, q, k, v = xs
        res, kp, vp = fnattn.ragged_paged_attention_with_update(SPEC, q, k, v, kp, vp, **meta)
        return None, (kp, vp, res.out, res.lse)

    _, (kp, vp, out, lse) = jax.lax.scan(layer, None, (cache.k_pages, cache.v_pages, q, k, v))
    return cache.replace(k_pages=kp, v_pages=vp), out, lse


@jax.jit
def serve_per_layer(caches, seq_ids, q, k, v):
    outs, lses, new = [], [], []
    for i, c in enumerate(caches):
        c = c.append(seq_ids, k[i], v[i])
        res = fnattn.ragged_paged_attention(SPEC, q[i], c.k_pages, c.v_pages,
                                            **c.ragged_metadata(seq_ids))
        new.append(c)
        outs.append(res.out)
        lses.append(res.lse)
    return new, jnp.stack(outs), jnp.stack(lses)


def dense_causal(q, k, v):
    """Causal attention of the last Tq of Tk tokens in float64 NumPy (independent of
    fnattn) with SPEC's sinks: (out (B, Tq, Hq, Dv), lse (B, Hq, Tq))."""
    return np_causal_tail(q, k, v, sinks=np.asarray(SPEC.sinks))


def test_attention_per_layer_equals_separate_caches_and_dense_reference():
    """Prefill of several slots, decode with a prefill, a release and a new sequence in
    the freed slot (on the freed pages), one jitted step each: per layer, the scan's
    result equals the per-layer caches' and dense causal attention on the tokens; the
    with_update form gives the same caches and results."""
    rng = np.random.default_rng(2)
    layered = LayeredPagedKVCache.create(L, 12, PS, HKV, D, max_seqs=S, max_pages_per_seq=P,
                                         v_head_dim=DV)
    updated = layered
    caches = [PagedKVCache.create(12, PS, HKV, D, max_seqs=S, max_pages_per_seq=P,
                                  v_head_dim=DV) for _ in range(L)]
    dense_k = {s: np.zeros((L, 0, HKV, D), np.float32) for s in range(S)}
    dense_v = {s: np.zeros((L, 0, HKV, DV), np.float32) for s in range(S)}
    steps = [[0, 0, 0, 0, 0, 2, 2, 2],
             [0, 1, 1, 1, 2, -1, -1, -1],
             "release 0",
             [0, 0, 0, 1, 2, 3, 3, -1]]
    for ids in steps:
        if ids == "release 0":
            freed = np.asarray(layered.page_table)[0]
            layered = release_layered(layered, jnp.int32(0))
            updated = release_layered(updated, jnp.int32(0))
            caches = [release_single(c, jnp.int32(0)) for c in caches]
            dense_k[0], dense_v[0] = dense_k[0][:, :0], dense_v[0][:, :0]
            continue
        ids = np.asarray(ids, np.int32)
        q = normal(rng, L, len(ids), HQ, D)
        k, v = normal(rng, L, len(ids), HKV, D), normal(rng, L, len(ids), HKV, DV)
        layered, out, lse = serve_layered(layered, jnp.asarray(ids), q, k, v)
        updated, out_u, lse_u = serve_layered_with_update(updated, jnp.asarray(ids), q, k, v)
        caches, out_s, lse_s = serve_per_layer(caches, jnp.asarray(ids), q, k, v)
        assert_same_as_layers(layered, caches)
        for x, y in zip(jax.tree_util.tree_leaves(layered), jax.tree_util.tree_leaves(updated)):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_allclose(out, out_s, atol=1e-6)
        np.testing.assert_allclose(lse, lse_s, atol=1e-6)
        np.testing.assert_allclose(out, out_u, atol=2e-5)
        np.testing.assert_allclose(lse, lse_u, atol=2e-5)
        out, lse = np.asarray(out), np.asarray(lse)
        for s in range(S):
            rows = ids == s
            dense_k[s] = np.concatenate([dense_k[s], np.asarray(k)[:, rows]], axis=1)
            dense_v[s] = np.concatenate([dense_v[s], np.asarray(v)[:, rows]], axis=1)
            if not rows.any():
                continue
            want_out, want_lse = dense_causal(np.asarray(q)[:, rows], dense_k[s], dense_v[s])
            np.testing.assert_allclose(out[:, rows], want_out, atol=2e-5, rtol=2e-5)
            np.testing.assert_allclose(lse[:, :, rows], want_lse, atol=2e-5, rtol=2e-5)
        pad = ids < 0
        assert (out[:, pad] == 0).all()
        assert layered.lengths.tolist() == [dense_k[s].shape[1] for s in range(S)]
    # The new sequence in slot 0 took the pages slot 0 had given back.
    assert set(np.asarray(layered.page_table)[0, :1].tolist()) <= set(freed[freed >= 0].tolist())


def test_paged_attention_per_layer_in_a_fori_loop():
    """Decode (one token per slot) with write(i, ...) on a traced layer index and
    fnattn.paged_attention on the layer's pools: equals the per-layer caches."""
    rng = np.random.default_rng(3)
    ids0 = jnp.array([0, 0, 1, 1, 1, 3])
    k0, v0 = normal(rng, L, T, HKV, D), normal(rng, L, T, HKV, DV)
    layered = jax.jit(LayeredPagedKVCache.append)(empty(), ids0, k0, v0)
    caches = per_layer_step([single() for _ in range(L)], ids0, k0, v0)
    ids = jnp.arange(S, dtype=jnp.int32)   # one new token per slot
    q, k, v = normal(rng, L, S, 1, HQ, D), normal(rng, L, S, HKV, D), normal(rng, L, S, HKV, DV)

    @jax.jit
    def decode_step(cache):
        cache, slots = cache.allocate_slots(ids)

        def layer(i, carry):
            cache, outs = carry
            cache = cache.write(i, slots, k[i], v[i])
            res = fnattn.paged_attention(SPEC, q[i], cache.k_pages[i], cache.v_pages[i],
                                         page_table=cache.page_table, kv_lengths=cache.lengths)
            return cache, outs.at[i].set(res.out)

        return jax.lax.fori_loop(0, L, layer, (cache, jnp.zeros((L, S, 1, HQ, DV))))

    layered, out = decode_step(layered)
    caches = per_layer_step(caches, ids, k, v)
    assert_same_as_layers(layered, caches)
    paged = jax.jit(fnattn.paged_attention)
    for i, c in enumerate(caches):
        want = paged(SPEC, q[i], c.k_pages, c.v_pages, page_table=c.page_table,
                     kv_lengths=c.lengths)
        np.testing.assert_allclose(out[i], want.out, atol=1e-6)
    assert layered.lengths.tolist() == [3, 4, 1, 2]


# ----------------------------------------------------------------------------------
# Messages
# ----------------------------------------------------------------------------------


def test_messages():
    c = empty()
    ids = jnp.zeros((3,), jnp.int32)
    with pytest.raises(TypeError) as info:
        c.allocate_slots(jnp.zeros((3,)))
    assert str(info.value) == ("LayeredPagedKVCache.allocate_slots: seq_ids must be a 1-D "
                               "integer array (one slot per new token, -1 for none); got "
                               "float32 (3,)")
    with pytest.raises(TypeError) as info:
        c.allocate([0, 1])
    assert str(info.value).startswith("LayeredPagedKVCache.allocate: seq_ids must be")
    c, slots = c.allocate_slots(ids)
    kp, vp = c.k_pages[0], c.v_pages[0]
    k, v = jnp.zeros((3, HKV, D)), jnp.zeros((3, HKV, DV))
    # The slot ids where the slots belong: refused, with the fix.
    with pytest.raises(TypeError) as info:
        write_tokens(kp, vp, ids, k, v)
    assert str(info.value) == (
        "write_tokens: slots must be the TokenSlots that allocate_slots returns (cache, slots "
        "= cache.allocate_slots(seq_ids)); got ArrayImpl. The slot ids (seq_ids) say which "
        "sequence a token is in, not where it goes.")
    with pytest.raises(TypeError, match="^LayeredPagedKVCache.write: slots must be the "):
        c.write(0, ids, k, v)
    with pytest.raises(TypeError) as info:
        write_tokens(kp, vp, TokenSlots(jnp.zeros((3,))), k, v)
    assert str(info.value) == ("write_tokens: slots.index must be a 1-D integer array (one "
                               "entry per new token); got float32 (3,)")
    with pytest.raises(ValueError) as info:
        write_tokens(c.k_pages, c.v_pages, slots, k, v)  # the stacked pools, not one layer's
    assert str(info.value) == ("write_tokens: k_pages must have 4 axes (Hkv, num_pages, "
                               f"page_size, D); got shape {(L, HKV, N, PS, D)}")
    with pytest.raises(ValueError) as info:
        write_tokens(kp, vp[:, :2], slots, k, v)
    assert str(info.value) == ("write_tokens: v_pages must have shape (Hkv, num_pages, "
                               f"page_size, Dv)=({HKV}, {N}, {PS}, 'Dv') matching k_pages "
                               f"{(HKV, N, PS, D)}; got {(HKV, 2, PS, DV)}")
    with pytest.raises(ValueError) as info:
        write_tokens(kp, vp, slots, k[:2], v)
    assert str(info.value) == ("write_tokens: k must have shape (T, Hkv, D)=(3, 2, 5); got "
                               "(2, 2, 5)")
    with pytest.raises(ValueError) as info:
        c.write(0, slots, k, jnp.zeros((3, HKV, D)))
    assert str(info.value) == ("LayeredPagedKVCache.write: v must have shape (T, Hkv, Dv)="
                               "(3, 2, 4); got (3, 2, 5)")
    with pytest.raises(TypeError) as info:
        c.write(jnp.float32(0), slots, k, v)
    assert str(info.value) == ("LayeredPagedKVCache.write: layer must be an int or an "
                               "integer scalar array; got float32 ()")
    with pytest.raises(ValueError) as info:
        c.append(ids, k, v)   # one layer's k/v where every layer's are needed
    assert str(info.value) == ("LayeredPagedKVCache.append: k must have shape (num_layers, "
                               f"T, Hkv, D)=({L}, 3, 2, 5); got (3, 2, 5)")


@pytest.mark.parametrize("fmt", ["int8", "int4-tensor"])
def test_quantized_layers_scan_write_and_append_equal_per_layer_caches(fmt):
    """A layered quantized cache (per-token scale pools, or one per-tensor scale per
    layer) written by append and by write in each layer holds what a single-layer
    cache of each layer holds, and lax.scan over the layers attends on it."""
    from fnattn import quant
    from fnattn.quant import QuantFormat
    f = QuantFormat(*fmt.split("-"))
    Dq = 6
    scales = None if f.per_token else jnp.array([0.5, 0.25, 1.0])
    lc = LayeredPagedKVCache.create(num_layers=L, num_pages=N, page_size=PS, num_kv_heads=HKV,
                                    head_dim=Dq, max_seqs=S, max_pages_per_seq=P,
                                    quant_format=f, k_scale=scales, v_scale=scales)
    assert lc.k_pages.scale.shape == ((L, HKV, N, PS) if f.per_token else (L,))
    rng = np.random.default_rng(3)
    ids = jnp.array([0, 0, 2, 2, 2, -1])
    k, v = normal(rng, L, T, HKV, Dq), normal(rng, L, T, HKV, Dq)
    by_append = jax.jit(LayeredPagedKVCache.append)(lc, ids, k, v)

    @jax.jit
    def by_write(lc):
        lc, slots = lc.allocate_slots(ids)
        for layer in range(L):
            lc = lc.write(jnp.int32(layer), slots, k[layer], v[layer])
        return lc

    w = by_write(lc)
    for a, b in zip(jax.tree_util.tree_leaves(by_append), jax.tree_util.tree_leaves(w)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1
                                      else a, np.asarray(b).view(np.uint8)
                                      if b.dtype.itemsize == 1 else b)
    for layer in range(L):   # each layer: a single-layer cache with that layer's scale
        s = None if f.per_token else float(scales[layer])
        one = PagedKVCache.create(num_pages=N, page_size=PS, num_kv_heads=HKV, head_dim=Dq,
                                  max_seqs=S, max_pages_per_seq=P, quant_format=f,
                                  k_scale=s, v_scale=s).append(ids, k[layer], v[layer])
        got = jax.tree_util.tree_map(lambda x: x[layer], by_append.k_pages)
        np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8),
                                      np.asarray(one.k_pages.data).view(np.uint8))
        np.testing.assert_array_equal(got.scale, one.k_pages.scale)
    q = normal(rng, L, T, HQ, Dq)

    @jax.jit
    def attend(lc, q):
        meta = lc.ragged_metadata(ids)

        def layer(_, xs):
            kp, vp, q = xs
            return None, fnattn.ragged_paged_attention(SPEC, q, kp, vp, **meta).out
        return jax.lax.scan(layer, None, (lc.k_pages, lc.v_pages, q))[1]

    out = attend(by_append, q)
    for layer in range(L):   # slot 2's 3 tokens, against the reference on their values
        kd = quant.dequantize(jax.tree_util.tree_map(lambda x: x[layer], by_append.k_pages))
        vd = quant.dequantize(jax.tree_util.tree_map(lambda x: x[layer], by_append.v_pages))
        sl = by_append.page_table[2]
        kt = jnp.concatenate([kd[:, int(p)] for p in sl if p >= 0], axis=1)[:, :3]
        vt = jnp.concatenate([vd[:, int(p)] for p in sl if p >= 0], axis=1)[:, :3]
        ref = fnattn.reference(SPEC, q[layer, 2:5][None], jnp.swapaxes(kt, 0, 1)[None],
                               jnp.swapaxes(vt, 0, 1)[None])
        np.testing.assert_allclose(out[layer, 2:5], ref.out[0], atol=2e-5, rtol=2e-5)
