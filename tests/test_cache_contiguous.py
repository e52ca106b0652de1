"""fnattn.cache.LayeredKVCache: a contiguous cache of a whole model (pools stacked
on a layer axis, one lengths vector). A 3-layer toy model served from it under one
lax.scan (ragged prompts prefilled in one call, then decoded together, some rows
pausing or starting) equals the unrolled model on one cache per layer through
fnattn.decode_with_update, and the float64 NumPy model without a cache; NaN in
unused slots and padding rows never reaches a valid output; the scan carries the
pools (jaxpr, and compiled temporaries that do not grow with depth); quantized and
latent pools; bad inputs. Everything under jax.jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from np_attention import np_attention

import fnattn
from fnattn import AttentionSpec, LayeredKVCache, masks, quant
from fnattn.quant import QuantFormat

# Distinct sizes: 3 layers, 3 rows of 12 slots, 4 query heads over 2 kv heads, head
# dims 4 (k) and 3 (v), model width 6.
L, B, CAP, HQ, HKV, D, DV, DM = 3, 3, 12, 4, 2, 4, 3, 6
SPEC = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.5, -1.0, 0.0, 2.0]))
RNG = np.random.default_rng(0)
W = {"q": RNG.standard_normal((L, DM, HQ * D)) * 0.5,
     "k": RNG.standard_normal((L, DM, HKV * D)) * 0.5,
     "v": RNG.standard_normal((L, DM, HKV * DV)) * 0.5,
     "o": RNG.standard_normal((L, HQ * DV, DM)) * 0.5}
POS = RNG.standard_normal((CAP, DM))         # a learned position embedding
W32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), W)
POS32 = jnp.asarray(POS, jnp.float32)
# Prompts of 4, 1 and 3 tokens, then one-token steps in which rows pause (0) or go on.
SCHEDULE = [np.array([4, 1, 3]), np.array([1, 1, 0]), np.array([1, 1, 1]),
            np.array([0, 1, 1])]


def empty(**kw):
    return LayeredKVCache.create(L, B, CAP, HKV, D, v_head_dim=DV, **kw)


def poisoned(cache):
    """Every slot NaN: only what a step writes is a number."""
    return cache.replace(k_cache=jnp.full_like(cache.k_cache, jnp.nan),
                         v_cache=jnp.full_like(cache.v_cache, jnp.nan))


def project(w, x, pos):
    """One layer's q, k, v of x (B, T, DM) at positions pos (B, T) (-1: padding)."""
    b, t, _ = x.shape
    h = x + POS32[jnp.clip(pos, 0)]
    return ((h @ w["q"]).reshape(b, t, HQ, D), (h @ w["k"]).reshape(b, t, HKV, D),
            (h @ w["v"]).reshape(b, t, HKV, DV))


def finish(w, x, out):
    return x + jnp.tanh(out.reshape(*x.shape[:2], HQ * DV) @ w["o"])


@functools.partial(jax.jit, donate_argnums=0)
def scanned_step(cache, x, q_lengths):
    cache = cache.allocate(q_lengths)
    pos = cache.positions(q_lengths, x.shape[1])

    def layer(carry, xs):
        x, cache = carry
        i, w = xs
        q, k, v = project(w, x, pos)
        res, cache = cache.decode_with_update(i, SPEC, q, k, v, q_lengths=q_lengths)
        return (finish(w, x, res.out), cache), None

    (x, cache), _ = jax.lax.scan(layer, (x, cache), (jnp.arange(L), W32))
    return cache, x, pos


@jax.jit
def unrolled_step(k_caches, v_caches, lengths, x, q_lengths):
    """The same model, a Python loop over layers, one pair of caches per layer."""
    lengths = lengths + q_lengths
    i = jnp.arange(x.shape[1])[None, :]
    pos = jnp.where(i < q_lengths[:, None], lengths[:, None] - q_lengths[:, None] + i, -1)
    k_caches, v_caches = list(k_caches), list(v_caches)
    for layer in range(L):
        w = jax.tree.map(lambda a, i=layer: a[i], W32)
        q, k, v = project(w, x, pos)
        res, k_caches[layer], v_caches[layer] = fnattn.decode_with_update(
            SPEC, q, k, v, k_caches[layer], v_caches[layer], kv_lengths=lengths,
            q_lengths=q_lengths)
        x = finish(w, x, res.out)
    return k_caches, v_caches, lengths, x


def np_model(tokens):
    """The float64 model without a cache over one sequence's tokens (n, DM)."""
    x = np.asarray(tokens, np.float64)
    n = x.shape[0]
    keep = np.arange(n)[None, :] <= np.arange(n)[:, None]
    for layer in range(L):
        h = x + POS[:n]
        q = (h @ W["q"][layer]).reshape(1, n, HQ, D)
        k = (h @ W["k"][layer]).reshape(1, n, HKV, D)
        v = (h @ W["v"][layer]).reshape(1, n, HKV, DV)
        out, _, _ = np_attention(q, k, v, mask=keep, sinks=np.asarray(SPEC.sinks))
        x = x + np.tanh(out.reshape(n, HQ * DV) @ W["o"][layer])
    return x


def step_inputs(rng, counts, tokens):
    """x (B, Tq, DM) of the step, right-padded with NaN; appends to `tokens`."""
    tq = int(np.max(counts))
    x = np.full((B, tq, DM), np.nan, np.float32)
    for b in range(B):
        new = rng.standard_normal((int(counts[b]), DM)).astype(np.float32)
        x[b, :counts[b]] = new
        tokens[b] += list(new)
    return jnp.asarray(x)


def test_scanned_model_equals_unrolled_and_float64_model():
    rng = np.random.default_rng(1)
    cache = poisoned(empty())
    k_caches = [cache.k_cache[i] for i in range(L)]
    v_caches = [cache.v_cache[i] for i in range(L)]
    lengths = jnp.zeros((B,), jnp.int32)
    tokens = [[] for _ in range(B)]
    for counts in SCHEDULE:
        x = step_inputs(rng, counts, tokens)
        ql = jnp.asarray(counts, jnp.int32)
        cache, got, pos = scanned_step(cache, x, ql)
        k_caches, v_caches, lengths, want = unrolled_step(k_caches, v_caches, lengths, x, ql)
        np.testing.assert_array_equal(cache.lengths, lengths)
        got, want, pos = np.asarray(got), np.asarray(want), np.asarray(pos)
        for b in range(B):
            n, total = int(counts[b]), len(tokens[b])
            np.testing.assert_array_equal(pos[b], [total - n + i if i < n else -1
                                                   for i in range(x.shape[1])])
            if not n:
                continue
            assert np.isfinite(got[b, :n]).all()
            np.testing.assert_allclose(got[b, :n], want[b, :n], atol=1e-5, rtol=1e-5)
            dense = np_model(np.stack(tokens[b]))
            np.testing.assert_allclose(got[b, :n], dense[total - n:], atol=1e-4, rtol=1e-4)
        # The same pools; each row written at slots [0, length) only (NaN after).
        np.testing.assert_allclose(cache.k_cache, np.stack(k_caches), atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(cache.v_cache, np.stack(v_caches), atol=1e-6, rtol=1e-6)
        k = np.asarray(cache.k_cache)
        for b in range(B):
            assert not np.isnan(k[:, b, :lengths[b]]).any()
            assert np.isnan(k[:, b, lengths[b]:]).all()


def test_each_prompt_alone_gives_the_same_rows():
    """The ragged prefill equals prefilling each prompt alone in a one-row cache."""
    rng = np.random.default_rng(2)
    tokens = [[] for _ in range(B)]
    x = step_inputs(rng, SCHEDULE[0], tokens)
    cache, got, _ = scanned_step(poisoned(empty()), x, jnp.asarray(SCHEDULE[0], jnp.int32))
    for b in range(B):
        n = int(SCHEDULE[0][b])
        one = LayeredKVCache.create(L, 1, CAP, HKV, D, v_head_dim=DV)
        alone, out, _ = scanned_step(one, x[b:b + 1, :n], jnp.array([n], jnp.int32))
        np.testing.assert_allclose(got[b, :n], out[0], atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(cache.k_cache[:, b, :n], alone.k_cache[:, 0, :n],
                                   atol=1e-6, rtol=1e-6)


def _scan_eqns(jaxpr):
    """The scans of a jaxpr, inside the jit calls too."""
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            yield e
        for sub in e.params.values():
            inner = getattr(sub, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield from _scan_eqns(inner)


def _scan_eqn(jaxpr):
    eqns = list(_scan_eqns(jaxpr))
    assert len(eqns) == 1
    return eqns[0]


def test_the_scan_carries_the_pools_and_writes_only_the_new_tokens():
    """In the jaxpr the stacked pools are scan carries (not xs or ys), and the body
    updates them with scatters of the (B, Tq) new tokens only; compiled, the
    temporaries do not grow with the number of layers (no copy of the cache per
    step), unlike the pools' full size."""
    x, ql = jnp.ones((B, 2, DM)), jnp.array([2, 1, 0], jnp.int32)
    cache = empty()
    eqn = _scan_eqn(jax.make_jaxpr(scanned_step)(cache, x, ql).jaxpr)
    pool, vpool = tuple(cache.k_cache.shape), tuple(cache.v_cache.shape)
    body = eqn.params["jaxpr"].jaxpr
    # A carry keeps its whole shape in the body; xs come in and ys go out a layer at
    # a time, (B, CAP, Hkv, D).
    ins = [tuple(v.aval.shape) for v in body.invars]
    outs = [tuple(v.aval.shape) for v in body.outvars]
    assert ins.count(pool) == outs.count(pool) == 1
    assert ins.count(vpool) == outs.count(vpool) == 1
    assert pool[1:] not in ins + outs and vpool[1:] not in ins + outs
    writes = [e for e in body.eqns
              if e.primitive.name in ("scatter", "dynamic_update_slice")
              and tuple(e.invars[0].aval.shape) in (pool, vpool)]
    assert len(writes) == 2
    assert all(e.primitive.name == "scatter" for e in writes)
    assert {tuple(e.invars[2].aval.shape) for e in writes} == {(B, 2, HKV, D), (B, 2, HKV, DV)}
    assert not [e for e in body.eqns if e.primitive.name == "concatenate"
                and tuple(e.outvars[0].aval.shape) == pool]

    def temp_bytes(num_layers):
        c = LayeredKVCache.create(num_layers, B, 64, HKV, D, v_head_dim=DV)
        spec = SPEC

        def step(c, q):
            c = c.allocate(jnp.ones((B,), jnp.int32))

            def layer(carry, i):
                q, c = carry
                res, c = c.decode_with_update(i, spec, q, q[:, :, :HKV], q[:, :, :HKV, :DV])
                return (jnp.pad(res.out, ((0, 0), (0, 0), (0, 0), (0, D - DV))), c), None
            (q, c), _ = jax.lax.scan(layer, (q, c), jnp.arange(num_layers))
            return c, q
        compiled = jax.jit(step, donate_argnums=0).lower(c, jnp.ones((B, 1, HQ, D))).compile()
        stats = compiled.memory_analysis()
        return stats.temp_size_in_bytes, c.k_cache.nbytes + c.v_cache.nbytes

    small, _ = temp_bytes(2)
    deep, pools = temp_bytes(16)
    assert deep == small and deep < pools / 2, (small, deep, pools)


@pytest.mark.parametrize("formats", [("int4", "int8"), ("float8_e4m3fn-tensor", "int8-tensor")])
def test_quantized_pools_equal_one_quantized_cache_per_layer(formats):
    """Quantized pools (per-token, or per-tensor with one scale per layer) through the
    scan: the stored codes and scales equal those of fnattn.decode_with_update on one
    quantized cache per layer, bit for bit, and so do the results."""
    rng = np.random.default_rng(3)
    kf, vf = (QuantFormat(*f.split("-")) for f in formats)
    scales = {f: (jnp.array([0.02, 0.03, 0.05]) if not f.per_token else None) for f in (kf, vf)}
    cache = empty(quant_format=(kf, vf), k_scale=scales[kf], v_scale=scales[vf])
    singles = [[quant.empty((B, CAP, HKV, d), f, scale=None if f.per_token else scales[f][i])
                for i in range(L)] for f, d in ((kf, D), (vf, DV))]
    counts = jnp.array([3, 1, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((L, B, 3, HQ, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((L, B, 3, HKV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, B, 3, HKV, DV)), jnp.float32)

    @jax.jit
    def scanned(cache):
        cache = cache.allocate(counts)

        def layer(cache, xs):
            i, q, k, v = xs
            res, cache = cache.decode_with_update(i, SPEC, q, k, v, q_lengths=counts)
            return cache, res.out
        return jax.lax.scan(layer, cache, (jnp.arange(L), q, k, v))

    @jax.jit
    def unrolled(ks, vs):
        outs = []
        for i in range(L):
            res, ks[i], vs[i] = fnattn.decode_with_update(SPEC, q[i], k[i], v[i], ks[i], vs[i],
                                                          kv_lengths=counts, q_lengths=counts)
            outs.append(res.out)
        return ks, vs, jnp.stack(outs)

    cache, got = scanned(cache)
    ks, vs, want = unrolled(*singles)
    np.testing.assert_array_equal(got, want)
    for pool, per_layer in ((cache.k_cache, ks), (cache.v_cache, vs)):
        np.testing.assert_array_equal(np.asarray(pool.data).view(np.uint8),
                                      np.stack([np.asarray(c.data).view(np.uint8)
                                                for c in per_layer]))
        np.testing.assert_array_equal(pool.scale, np.stack([c.scale for c in per_layer]))
    assert (np.asarray(got[:, 1, 1:]) == 0).all() and (np.asarray(got[:, 2]) == 0).all()


@pytest.mark.parametrize("quant_format", [None, "int8"])
def test_latent_pools(quant_format):
    """A latent cache (value_dim, no v_cache): every layer equals
    fnattn.decode_with_update on one latent cache per layer."""
    rng = np.random.default_rng(4)
    Dc, Dr = 6, 2
    cache = LayeredKVCache.create(L, B, CAP, 1, Dc + Dr, value_dim=Dc, quant_format=quant_format)
    assert cache.v_cache is None
    counts = jnp.array([2, 3, 1], jnp.int32)
    q = jnp.asarray(rng.standard_normal((L, B, 3, HQ, Dc + Dr)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((L, B, 3, 1, Dc + Dr)), jnp.float32)

    @jax.jit
    def scanned(cache):
        cache = cache.allocate(counts)

        def layer(cache, xs):
            i, q, k = xs
            res, cache = cache.decode_with_update(i, SPEC, q, k, None, q_lengths=counts)
            return cache, res.out
        return jax.lax.scan(layer, cache, (jnp.arange(L), q, k))

    cache, got = scanned(cache)
    for i in range(L):
        one = cache.k_cache[i] if quant_format is None else None
        one = jnp.zeros((B, CAP, 1, Dc + Dr)) if quant_format is None else \
            quant.empty((B, CAP, 1, Dc + Dr), quant_format)
        res, kc, _ = jax.jit(functools.partial(fnattn.decode_with_update, value_dim=Dc))(
            SPEC, q[i], k[i], None, one, None, kv_lengths=counts, q_lengths=counts)
        np.testing.assert_array_equal(got[i], res.out)
        stored = cache.k_cache.data[i] if quant_format else cache.k_cache[i]
        np.testing.assert_array_equal(stored, kc.data if quant_format else kc)


def test_release_positions_and_write():
    c = empty().allocate(jnp.array([3, 2, 0]))
    pos = c.positions(jnp.array([3, 2, 0]), 3)
    np.testing.assert_array_equal(pos, [[0, 1, 2], [0, 1, -1], [-1, -1, -1]])
    k = jnp.arange(1., 4.)[None, :, None, None] * jnp.ones((B, 3, HKV, D))
    c = jax.jit(lambda c, k: c.write(jnp.int32(2), k, k[..., :DV],
                                     q_lengths=jnp.array([3, 2, 0])))(c, k)
    kk = np.asarray(c.k_cache)
    assert (kk[:2] == 0).all()                                  # layers 0, 1 untouched
    np.testing.assert_array_equal(kk[2, :, :4, 0, 0], [[1, 2, 3, 0], [1, 2, 0, 0], [0] * 4])
    c = jax.jit(LayeredKVCache.release)(c, 1)
    np.testing.assert_array_equal(c.lengths, [3, 0, 0])
    c = jax.jit(LayeredKVCache.release)(c, 7)                   # out of range: nothing
    np.testing.assert_array_equal(c.lengths, [3, 0, 0])
    assert c.layer(2)[0].shape == (B, CAP, HKV, D) and c.layer(2)[1].shape == (B, CAP, HKV, DV)


def test_overflow_is_refused_or_nan_and_writes_nothing():
    """Concrete: allocate past the capacity raises; traced (under jit) the row keeps its
    true length, gets NaN and writes nothing while the others go on; checked=True
    reports it through checkify."""
    c = empty().allocate(jnp.array([CAP - 1, 2, 0]))
    with pytest.raises(ValueError, match="^LayeredKVCache.allocate: row 0 would hold 11 \\+ 2 "
                                         "= 13 tokens, past the capacity of 12 slots"):
        c.allocate(jnp.array([2, 1, 1]))
    with pytest.raises(ValueError, match="^LayeredKVCache.allocate: q_lengths\\[2\\] = -1 is "
                                         "negative"):
        c.allocate(jnp.array([0, 1, -1]))
    x = jnp.ones((B, 2, DM))
    pools = jnp.ones_like(c.k_cache), jnp.ones_like(c.v_cache)
    c = c.replace(k_cache=pools[0], v_cache=pools[1])
    nxt, out, _ = scanned_step(jax.tree.map(jnp.copy, c), x, jnp.array([2, 1, 2], jnp.int32))
    assert nxt.lengths.tolist() == [CAP + 1, 3, 2]
    out = np.asarray(out)
    assert np.isnan(out[0]).all() and np.isfinite(out[1, :1]).all() and np.isfinite(out[2]).all()
    assert (np.asarray(nxt.k_cache[:, 0]) == 1).all()           # row 0 untouched
    f = jax.jit(checkify.checkify(lambda c, n: c.allocate(n, checked=True)))
    err, _ = f(c, jnp.array([2, 1, 2]))
    assert "row 0 would hold 13 tokens, past the capacity of 12 slots" in err.get()
    err, _ = f(c, jnp.array([1, 1, -2]))
    assert "q_lengths[2] = -2 is negative" in err.get()
    err, _ = f(c, jnp.array([1, 1, 2]))
    assert err.get() is None
    g = jax.jit(checkify.checkify(lambda c, q, k, n: c.decode_with_update(
        0, SPEC, q, k, k[..., :DV], q_lengths=n, checked=True)))
    q, k = jnp.ones((B, 2, HQ, D)), jnp.ones((B, 2, HKV, D))
    err, _ = g(c.allocate(jnp.array([1, 0, 0])), q, k, jnp.array([1, 3, 0]))
    assert "q_lengths[1] = 3 is outside [0, Tq=2]" in err.get()


def test_bad_arguments():
    c = empty().allocate(jnp.array([1, 1, 1]))
    q, k, v = jnp.ones((B, 1, HQ, D)), jnp.ones((B, 1, HKV, D)), jnp.ones((B, 1, HKV, DV))
    fn = "LayeredKVCache.decode_with_update"
    with pytest.raises(ValueError, match=f"^{fn}: layer must be in \\[0, num_layers\\)=\\[0, 3\\); "
                                         "got 3"):
        c.decode_with_update(3, SPEC, q, k, v)
    with pytest.raises(TypeError, match=f"^{fn}: layer must be an int or an integer scalar"):
        c.decode_with_update(jnp.float32(1), SPEC, q, k, v)
    with pytest.raises(ValueError, match=f"^{fn}: the cache's rows are in the 'bthd' layout"):
        c.decode_with_update(0, SPEC.replace(layout="bhtd"), q, k, v)
    with pytest.raises(ValueError, match=f"^{fn}: k_new must have shape \\(B, Tq, Hkv, D\\)"):
        c.decode_with_update(0, SPEC, q, k[:, :, :1], v)
    with pytest.raises(ValueError, match=f"^{fn}: v_new is None but the cache has values"):
        c.decode_with_update(0, SPEC, q, k, None)
    with pytest.raises(ValueError, match=f"^{fn}: q_lengths must have shape \\(B,\\)=\\(3,\\)"):
        c.decode_with_update(0, SPEC, q, k, v, q_lengths=jnp.array([1, 1]))
    with pytest.raises(ValueError, match=f"^{fn}: q_lengths\\[0\\] = 2 must be in \\[0, Tq=1\\]"):
        c.decode_with_update(0, SPEC, q, k, v, q_lengths=jnp.array([2, 1, 1]))
    with pytest.raises(TypeError, match="^LayeredKVCache.allocate: q_lengths must be an integer"):
        c.allocate(jnp.ones(3))
    with pytest.raises(ValueError, match="^LayeredKVCache.create: value_dim must be an int"):
        LayeredKVCache.create(L, B, CAP, 1, 4, value_dim=5)
    with pytest.raises(ValueError, match="^LayeredKVCache.create: QuantFormat.*needs its scales"):
        LayeredKVCache.create(L, B, CAP, 1, 4, quant_format=QuantFormat("int8", "tensor"))
    # a traced layer out of range: NaN, nothing written
    res, c2 = jax.jit(lambda c, i: c.decode_with_update(i, SPEC, q, k, v))(c, jnp.int32(5))
    assert np.isnan(np.asarray(res.out)).all() and (np.asarray(c2.k_cache) == 0).all()


def test_partition_specs_shard_the_rows():
    """partition_specs splits the rows (and kv heads) and nothing else; a cache placed
    with them on a mesh serves the same step."""
    c = empty()
    s = c.partition_specs(batch="data", kv_heads="model")
    assert tuple(s.k_cache) == (None, "data", None, "model", None)
    assert tuple(s.lengths) == ("data",)
    q = empty(quant_format=QuantFormat("int8", "tensor"), k_scale=0.1, v_scale=0.1)
    sq = q.partition_specs(batch="data")
    assert tuple(sq.k_cache.data) == (None, "data", None, None, None)
    assert tuple(sq.k_cache.scale) == (None,)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    placed = jax.tree.map(lambda x, p: jax.device_put(x, jax.sharding.NamedSharding(mesh, p)),
                          c, s)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((B, 2, DM)), jnp.float32)
    ql = jnp.array([2, 1, 2], jnp.int32)
    _, got, _ = scanned_step(placed, x, ql)
    _, want, _ = scanned_step(empty(), x, ql)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_scanned_ragged_step_lowers_to_the_decode_kernels(platform):
    """The scanned layered step with q_lengths lowers for cuda (Triton) and tpu (Mosaic):
    per-sequence counts reach the Pallas decode kernels as per-row lengths."""
    from lowering import target

    from fnattn.decoding import mosaic, triton
    nl, b, cap, hq, hkv, d = 2, 2, 512, 8, 2, 128
    cache = LayeredKVCache.create(nl, b, cap, hkv, d, dtype=jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal())

    def step(cache, q, q_lengths):
        cache = cache.allocate(q_lengths)

        def layer(carry, i):
            q, cache = carry
            res, cache = cache.decode_with_update(i, spec, q, q[:, :, :hkv], q[:, :, :hkv],
                                                  q_lengths=q_lengths)
            return (res.out, cache), None
        (q, cache), _ = jax.lax.scan(layer, (q, cache), jnp.arange(nl))
        return cache, q

    q = jnp.zeros((b, 4, hq, d), jnp.bfloat16)
    with target(platform):
        text = jax.jit(step).trace(cache, q, jnp.array([4, 1], jnp.int32)).lower(
            lowering_platforms=(platform,)).as_text()
    assert (triton.KERNEL_NAME if platform == "cuda" else mosaic.KERNEL_NAME) in text
