"""The selected serving forms over latent (MLA) and quantized caches, and the paged
update form, under jax.jit, against float64 NumPy and the dense serving variants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks, quant, selection
from fnattn.selection import (selected_decode, selected_decode_with_update,
                              selected_paged_attention, selected_ragged_paged_attention,
                              selected_ragged_paged_attention_with_update)
from cases import np_mask
from np_attention import np_attention, np_attention_grads

HQ, HKV, D, DC, K = 4, 2, 8, 6, 5       # latent: values are the first DC of D channels


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def random_indices(key, shape, hi):
    """Indices with repeats, -1 padding and entries past the length."""
    return jax.random.randint(key, shape, -2, hi + 2)


def selected_np(idx, Hq, L):
    """(1, Hq, Tq, L) bool of one sequence's index sets ``idx`` (Tq, [Hkv,] K)."""
    idx = np.asarray(idx)
    if idx.ndim == 2:
        idx = idx[:, None, :]
    Tq, Hkv, _ = idx.shape
    sel = np.zeros((1, Hq, Tq, L), bool)
    for t in range(Tq):
        for h in range(Hq):
            for j in idx[t, h // (Hq // Hkv)]:
                if 0 <= j < L:
                    sel[0, h, t, j] = True
    return sel


@pytest.fixture(params=["one block", "blocks of 2"])
def blocks(request, monkeypatch):
    jax.clear_caches()
    if request.param == "blocks of 2":
        per_token = HKV * K * D * 4 + 3 * HQ * K * 4
        monkeypatch.setattr(selection, "BLOCK_BYTES", 2 * per_token + 1)
        monkeypatch.setattr(selection, "ONE_BLOCK_BYTES", 0)
    yield request.param
    jax.clear_caches()


def latent_problem(seed, B=3, S=16, Tq=3):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, Tq, HQ, D))
    kc = jax.random.normal(ks[1], (B, S, HKV, D))
    return q, kc, ks[2]


# ----------------------------------------------------------------------------------
# latent caches
# ----------------------------------------------------------------------------------


def test_latent_decode_forward_and_gradients_match_numpy(blocks):
    B, S, Tq = 3, 16, 3
    q, kc, key = latent_problem(0, B, S, Tq)
    lengths, starts = np.array([9, 16, 2]), np.array([4, 0, 1])
    slot = np.arange(S)
    inside = (slot[None] >= starts[:, None]) & (slot[None] < (starts + lengths)[:, None])
    kc = jnp.where(inside[:, :, None, None], kc, jnp.nan)        # NaN outside each sequence
    ks = jax.random.split(key, 3)
    idx = random_indices(ks[0], (B, Tq, HKV, K), 16)
    sinks = jnp.linspace(-0.5, 0.5, HQ)
    spec = AttentionSpec(mask=masks.causal(), softcap=6.0, sinks=sinks)
    d_out = jax.random.normal(ks[1], (B, Tq, HQ, DC))
    d_lse = jax.random.normal(ks[2], (B, HQ, Tq))

    def f(q, kc, sinks):
        r = selected_decode(spec.replace(sinks=sinks), q, kc, None, idx, kv_lengths=lengths,
                            kv_starts=starts, value_dim=DC)
        return r.out, r.lse

    @jax.jit
    def run(q, kc, sinks):
        res, pullback = jax.vjp(f, q, kc, sinks)
        return res, pullback((d_out, d_lse))

    (out, lse), (dq, dk, dsinks) = run(q, kc, sinks)
    dk = np.asarray(dk)
    assert (dk[~inside] == 0).all()
    dsinks_want = 0.0
    for b in range(B):
        a, L = starts[b], lengths[b]
        allowed = selected_np(idx[b], HQ, L) & np_mask(masks.causal(), 0, HQ, Tq, L)
        kb = f64(kc[b:b + 1, a:a + L])
        want = np_attention_grads(f64(q[b:b + 1]), kb, kb[..., :DC], f64(d_out[b:b + 1]),
                                  f64(d_lse[b:b + 1]), softcap=6.0, mask=allowed,
                                  sinks=f64(sinks))
        np.testing.assert_allclose(out[b], want["out"][0], atol=2e-5)
        np.testing.assert_allclose(lse[b], want["lse"][0], atol=2e-5)
        np.testing.assert_allclose(dq[b], want["dq"][0], atol=5e-5)
        dk_want = want["dk"][0].copy()
        dk_want[..., :DC] += want["dv"][0]          # the values are the keys' first channels
        np.testing.assert_allclose(dk[b, a:a + L], dk_want, atol=5e-5)
        dsinks_want = dsinks_want + want["dsinks"]
    np.testing.assert_allclose(dsinks, dsinks_want, atol=5e-5)


def test_latent_forward_mode_and_paged_latent_pool():
    """jax.jvp through a latent pool equals jax.jvp of dense attention with v = k[..., :Dc]."""
    N, ps = 6, 4
    kp = jax.random.normal(jax.random.key(1), (HKV, N, ps, D))
    table = np.array([[4, 1, 5, 0]])
    q = jax.random.normal(jax.random.key(2), (1, 2, HQ, D))
    idx = random_indices(jax.random.key(3), (1, 2, K), 14)
    spec = AttentionSpec(mask=masks.causal())
    L = 14

    def seq(p):      # (1, L, Hkv, D): the sequence's keys in position order
        return jnp.concatenate([p[:, i] for i in table[0]], axis=1)[:, :L].transpose(1, 0, 2)[None]

    def f(kp):
        return selected_paged_attention(spec, q, kp, None, idx, page_table=table,
                                        kv_lengths=np.array([L]), value_dim=DC).out

    tk = jax.random.normal(jax.random.key(4), kp.shape)
    out, t_out = jax.jit(lambda kp, tk: jax.jvp(f, (kp,), (tk,)))(kp, tk)
    keep = jnp.asarray(selected_np(idx[0], HQ, L)) & np_mask(masks.causal(), 0, HQ, 2, L)
    dense = AttentionSpec(mask=masks.from_array(keep), impl="reference")
    g = lambda ks: fnattn.reference(dense, q, ks, ks[..., :DC]).out  # noqa: E731
    want, t_want = jax.jit(lambda a, b: jax.jvp(g, (a,), (b,)))(seq(kp), seq(tk))
    np.testing.assert_allclose(out, want, atol=2e-5)
    np.testing.assert_allclose(t_out, t_want, atol=2e-5)


def test_latent_bad_input_is_refused():
    q, kc, _ = latent_problem(5)
    idx = jnp.zeros(q.shape[:2] + (K,), jnp.int32)
    L = jnp.array([4, 4, 4])
    with pytest.raises(ValueError, match="v_cache=None"):
        selected_decode(AttentionSpec(), q, kc, kc[..., :DC], idx, kv_lengths=L, value_dim=DC)
    with pytest.raises(ValueError, match="value_dim must be an int in"):
        selected_decode(AttentionSpec(), q, kc, None, idx, kv_lengths=L, value_dim=D + 1)
    with pytest.raises(ValueError, match="v_cache is None"):
        selected_decode(AttentionSpec(), q, kc, None, idx, kv_lengths=L)
    with pytest.raises(ValueError, match="pass v_new=None"):
        selected_decode_with_update(AttentionSpec(), q, q[:, :, :HKV], q[:, :, :HKV, :DC], kc,
                                    None, idx, kv_lengths=L, value_dim=DC)


# ----------------------------------------------------------------------------------
# quantized caches
# ----------------------------------------------------------------------------------

FORMATS = [quant.QuantFormat("int8"), quant.QuantFormat("int4"),
           quant.QuantFormat("float8_e4m3fn"), quant.QuantFormat("float8_e5m2", "tensor")]


def quantized(x, fmt):
    return quant.quantize(x, fmt, scale=None if fmt.per_token else 0.05)


def poison(qa, where):
    """``qa`` with NaN codes (float formats) and NaN per-token scales at ``where``
    (a bool mask over the leading axes): slots no selection may read."""
    data, scale = qa.data, qa.scale
    if qa.format.is_float:
        data = jnp.where(where[..., None], jnp.asarray(jnp.nan, data.dtype), data)
    if qa.format.per_token:
        scale = jnp.where(where, jnp.nan, scale)
    return quant.QuantizedArray(data, scale, qa.format)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}-{f.granularity}")
def test_quantized_decode_equals_the_dequantized_cache(fmt):
    B, S, Tq = 2, 16, 2
    ks = jax.random.split(jax.random.key(6), 5)
    q = jax.random.normal(ks[0], (B, Tq, HQ, D))
    kq = quantized(jax.random.normal(ks[1], (B, S, HKV, D)), fmt)
    vq = quantized(jax.random.normal(ks[2], (B, S, HKV, D)), fmt)
    lengths = np.array([11, 5])
    outside = np.arange(S)[None, :, None] >= lengths[:, None, None]
    outside = jnp.asarray(np.broadcast_to(outside, (B, S, HKV)))
    kd, vd = quant.dequantize(kq), quant.dequantize(vq)        # before the poison
    kq, vq = poison(kq, outside), poison(vq, outside)
    idx = random_indices(ks[3], (B, Tq, K), 11)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.linspace(-1.0, 1.0, HQ))
    for value_dim, v_q, v_d in ((None, vq, vd), (DC, None, None)):
        f = jax.jit(selected_decode, static_argnames="value_dim")
        got = f(spec, q, kq, v_q, idx, kv_lengths=lengths, value_dim=value_dim)
        want = f(spec, q, kd, v_d, idx, kv_lengths=lengths, value_dim=value_dim)
        assert np.isfinite(np.asarray(got.out)).all()
        np.testing.assert_allclose(got.out, want.out, atol=1e-5)
        np.testing.assert_allclose(got.lse, want.lse, atol=1e-5)
    # against float64 NumPy for one sequence (separate values)
    got = jax.jit(selected_decode)(spec, q, kq, vq, idx, kv_lengths=lengths)
    L = 11
    allowed = selected_np(idx[0], HQ, L) & np_mask(masks.causal(), 0, HQ, Tq, L)
    out, lse, _ = np_attention(f64(q[:1]), f64(kd[:1, :L]), f64(vd[:1, :L]), mask=allowed,
                               sinks=f64(spec.sinks))
    np.testing.assert_allclose(got.out[0], out[0], atol=2e-5)
    # reverse mode: q (as over the dequantized cache), the scales, the sinks
    loss = lambda q, kq, vq: jnp.sum(jnp.sin(selected_decode(  # noqa: E731
        spec, q, kq, vq, idx, kv_lengths=lengths).out))
    dq, dkq, dvq = jax.jit(jax.grad(loss, argnums=(0, 1, 2), allow_int=True))(q, kq, vq)
    dq_want = jax.jit(jax.grad(loss))(q, kd, vd)
    np.testing.assert_allclose(dq, dq_want, atol=5e-5)
    # integer codes get float0 zeros; float8 codes a gradient (zero where unselected)
    assert dkq.data.dtype == (kq.data.dtype if fmt.is_float else jax.dtypes.float0)
    assert np.isfinite(np.asarray(dkq.scale)).all() and np.isfinite(np.asarray(dvq.scale)).all()
    if fmt.per_token:      # slots outside the sequences get no gradient
        assert (np.asarray(dkq.scale)[np.asarray(outside)] == 0).all()
    if fmt.is_float:
        assert (np.asarray(dkq.data, np.float32)[np.asarray(outside)] == 0).all()


def test_quantized_gradients_of_the_scales_match_the_float_cache():
    """d/d scale[slot] = sum_d dK[slot, d] * code[slot, d]: the float cache's key
    gradient contracted with the codes (per-token int8)."""
    B, S, Tq = 1, 12, 2
    ks = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(ks[0], (B, Tq, HQ, D))
    kq = quant.quantize(jax.random.normal(ks[1], (B, S, HKV, D)), "int8")
    vq = quant.quantize(jax.random.normal(ks[2], (B, S, HKV, D)), "int8")
    idx = random_indices(ks[3], (B, Tq, HKV, K), S)
    spec = AttentionSpec(softcap=5.0)
    lengths = np.array([S])
    loss = lambda q, k, v: jnp.sum(selected_decode(  # noqa: E731
        spec, q, k, v, idx, kv_lengths=lengths).out ** 2)
    dkq, dvq = jax.jit(jax.grad(loss, argnums=(1, 2), allow_int=True))(q, kq, vq)
    dk, dv = jax.jit(jax.grad(loss, argnums=(1, 2)))(q, quant.dequantize(kq),
                                                     quant.dequantize(vq))
    codes = lambda x: np.asarray(x.data, np.float32)  # noqa: E731
    np.testing.assert_allclose(dkq.scale, np.sum(np.asarray(dk) * codes(kq), -1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dvq.scale, np.sum(np.asarray(dv) * codes(vq), -1), rtol=1e-5, atol=1e-4)


def _largest_float_array(fn, *args):
    """The largest float intermediate (elements) in the jaxpr of ``fn(*args)``."""
    biggest = 0

    def visit(jaxpr):
        nonlocal biggest
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                aval = var.aval
                if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating):
                    biggest = max(biggest, int(np.prod(aval.shape)))
            for p in eqn.params.values():
                for x in (p if isinstance(p, (tuple, list)) else (p,)):
                    if hasattr(x, "eqns"):
                        visit(x)
                    elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                        visit(x.jaxpr)
    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return biggest


def test_quantized_pools_dequantize_only_the_selected_keys():
    """A quantized latent pool: paged and ragged equal the dequantized pool, and no
    float array as large as the pool is formed (the gather comes first)."""
    N, ps = 64, 8
    ks = jax.random.split(jax.random.key(8), 4)
    pool = quant.quantize(jax.random.normal(ks[0], (HKV, N, ps, D)), "int4")
    table = np.array([[7, 3, 60, 12], [1, 2, 5, 9]])
    lengths = np.array([30, 19])
    q = jax.random.normal(ks[1], (2, 1, HQ, D))
    idx = random_indices(ks[2], (2, 1, K), 30)
    spec = AttentionSpec()

    def f(pool):
        return selected_paged_attention(spec, q, pool, None, idx, page_table=table,
                                        kv_lengths=lengths, value_dim=DC).out

    got = jax.jit(f)(pool)
    want = jax.jit(f)(quant.dequantize(pool))
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert _largest_float_array(f, pool) < HKV * N * ps * D // 4
    # the ragged form over the same pool, one row per sequence
    r = jax.jit(selected_ragged_paged_attention, static_argnames="value_dim")(
        spec, q[:, 0], pool, None, idx[:, 0], page_table=table, context_lengths=lengths,
        query_start_loc=np.array([0, 1, 2]), num_seqs=2, value_dim=DC)
    np.testing.assert_allclose(r.out, got[:, 0], atol=1e-5)


def test_quantized_cache_is_refused_when_malformed():
    q, kc, _ = latent_problem(9)
    idx = jnp.zeros(q.shape[:2] + (K,), jnp.int32)
    kq = quant.quantize(kc, "int8")
    bad = quant.QuantizedArray(kq.data.astype(jnp.int32), kq.scale, kq.format)
    with pytest.raises(TypeError, match="k_cache.data must be stored as int8"):
        selected_decode(AttentionSpec(), q, bad, None, idx, kv_lengths=jnp.array([3, 3, 3]),
                        value_dim=DC)


# ----------------------------------------------------------------------------------
# the update forms
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["float", "int8", "int4-latent"])
def test_decode_with_update_writes_as_decode_with_update(kind):
    B, S, Tq = 2, 10, 2
    ks = jax.random.split(jax.random.key(10), 6)
    q = jax.random.normal(ks[0], (B, Tq, HQ, D))
    k_new = jax.random.normal(ks[1], (B, Tq, HKV, D))
    v_new = jax.random.normal(ks[2], (B, Tq, HKV, D))
    kc = jax.random.normal(ks[3], (B, S, HKV, D))
    vc = jax.random.normal(ks[4], (B, S, HKV, D))
    value_dim = None
    if kind == "int8":
        kc, vc = quant.quantize(kc, "int8"), quant.quantize(vc, "int8")
    elif kind == "int4-latent":
        kc, vc, v_new, value_dim = quant.quantize(kc, "int4"), None, None, DC
    lengths = jnp.array([6, 10])
    idx = random_indices(ks[5], (B, Tq, K), 10)
    spec = AttentionSpec(mask=masks.causal())
    step = jax.jit(selected_decode_with_update, static_argnames="value_dim")
    res, kc2, vc2 = step(spec, q, k_new, v_new, kc, vc, idx, kv_lengths=lengths,
                         value_dim=value_dim)
    _, kw, vw = jax.jit(fnattn.decode_with_update, static_argnames="value_dim")(
        spec, q, k_new, v_new, kc, vc, kv_lengths=lengths, value_dim=value_dim)
    for got, want in ((kc2, kw), (vc2, vw)):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))    # bit for bit
    ref = jax.jit(selected_decode, static_argnames="value_dim")(
        spec, q, kc2, vc2, idx, kv_lengths=lengths, value_dim=value_dim)
    np.testing.assert_array_equal(res.out, ref.out)


def _ragged_case(seed):
    N, ps = 12, 4
    table = np.array([[3, 8, 1, -1], [0, 11, 6, 2], [5, 5, 5, 5]])
    ctx = np.array([9, 15, 4])
    loc = np.array([0, 3, 4, 4])          # seq 2 is not live (num_seqs = 2)
    T = 6                                  # rows 4, 5: no sequence
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (T, HQ, D))
    k = jax.random.normal(ks[1], (T, HKV, D))
    v = jax.random.normal(ks[2], (T, HKV, D))
    kp = jax.random.normal(ks[3], (HKV, N, ps, D))
    vp = jax.random.normal(ks[4], (HKV, N, ps, D))
    idx = random_indices(ks[5], (T, HKV, K), 15)
    meta = dict(page_table=table, context_lengths=ctx, query_start_loc=loc, num_seqs=np.int32(2))
    return q, k, v, kp, vp, idx, meta


@pytest.mark.parametrize("kind", ["float", "int8", "float8_e4m3fn", "int4-latent", "latent"])
def test_ragged_update_writes_as_the_dense_update_then_attends(kind):
    q, k, v, kp, vp, idx, meta = _ragged_case(11)
    value_dim = None
    if kind in ("int8", "float8_e4m3fn"):
        kp, vp = quant.quantize(kp, kind), quant.quantize(vp, kind)
    elif kind == "int4-latent":
        kp, vp, v, value_dim = quant.quantize(kp, "int4"), None, None, DC
    elif kind == "latent":
        vp, v, value_dim = None, None, DC
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.linspace(-1.0, 0.0, HQ))
    step = jax.jit(selected_ragged_paged_attention_with_update, static_argnames="value_dim")
    res, kp2, vp2 = step(spec, q, k, v, kp, vp, idx, value_dim=value_dim, **meta)
    dense, kw, vw = jax.jit(fnattn.ragged_paged_attention_with_update,
                            static_argnames="value_dim")(spec, q, k, v, kp, vp,
                                                         value_dim=value_dim, **meta)
    for got, want in ((kp2, kw), (vp2, vw)):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))    # bit for bit
    after = jax.jit(selected_ragged_paged_attention, static_argnames="value_dim")(
        spec, q, kp2, vp2, idx, value_dim=value_dim, **meta)
    np.testing.assert_array_equal(res.out, after.out)
    np.testing.assert_array_equal(res.lse, after.lse)
    assert (np.asarray(res.out[4:]) == 0).all()
    # selecting every position is the dense update's attention
    every = jnp.tile(jnp.arange(16, dtype=jnp.int32), (q.shape[0], 1))
    full, _, _ = step(spec, q, k, v, kp, vp, every, value_dim=value_dim, **meta)
    np.testing.assert_allclose(full.out[:4], dense.out[:4], atol=2e-5)
    np.testing.assert_allclose(full.lse[:, :4], dense.lse[:, :4], atol=2e-5)


def test_ragged_update_matches_numpy_after_the_write():
    q, k, v, kp, vp, idx, meta = _ragged_case(12)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(7), softcap=4.0)
    res, kp2, vp2 = jax.jit(selected_ragged_paged_attention_with_update)(
        spec, q, k, v, kp, vp, idx, **meta)
    table, ctx, loc = meta["page_table"], meta["context_lengths"], meta["query_start_loc"]
    ps = kp.shape[2]
    for s in range(2):
        n, L = loc[s + 1] - loc[s], int(ctx[s])
        rows = slice(loc[s], loc[s + 1])
        pages = [p for p in table[s][: -(-L // ps)]]
        seq = lambda p: jnp.concatenate([p[:, i] for i in pages], 1)[:, :L].transpose(1, 0, 2)  # noqa: E731
        ks, vs = seq(kp2), seq(vp2)
        # the new tokens are at the sequence's last n positions
        np.testing.assert_array_equal(ks[L - n:], k[rows])
        np.testing.assert_array_equal(vs[L - n:], v[rows])
        allowed = selected_np(idx[rows], HQ, L) & np_mask(spec.mask, 0, HQ, n, L)
        out, lse, _ = np_attention(f64(q[None, rows]), f64(ks[None]), f64(vs[None]),
                                   mask=allowed, softcap=4.0)
        np.testing.assert_allclose(res.out[rows], out[0], atol=2e-5)
        np.testing.assert_allclose(res.lse[:, rows], lse[0], atol=2e-5)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8"])
def test_a_masked_selected_key_with_nan_codes_reaches_no_row_that_cannot_see_it(fmt):
    """Causal decode of 2 tokens: the newest position holds NaN codes (float8) or a
    NaN scale (int8); the older query selects it but may not see it."""
    S, Tq = 8, 2
    ks = jax.random.split(jax.random.key(13), 3)
    q = jax.random.normal(ks[0], (1, Tq, HQ, D))
    kq = quant.quantize(jax.random.normal(ks[1], (1, S, HKV, D)), fmt)
    vq = quant.quantize(jax.random.normal(ks[2], (1, S, HKV, D)), fmt)
    newest = jnp.zeros((1, S, HKV), bool).at[:, 5].set(True)       # position 5 of length 6
    if fmt == "int8":
        kq = kq.replace(scale=jnp.where(newest, jnp.nan, kq.scale))
        vq = vq.replace(scale=jnp.where(newest, jnp.nan, vq.scale))
    else:
        kq, vq = poison(kq, newest), poison(vq, newest)
    idx = jnp.array([[[0, 3, 5], [1, 4, 5]]])
    out = np.asarray(jax.jit(selected_decode)(AttentionSpec(mask=masks.causal()), q, kq, vq, idx,
                                              kv_lengths=np.array([6])).out)
    assert np.isfinite(out[0, 0]).all()          # position 4: key 5 is in its future
    assert np.isnan(out[0, 1]).all()             # position 5 sees it
