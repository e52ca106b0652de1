"""fnattn.selection (top-k token selection) against float64 NumPy, under jax.jit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks, selection
from fnattn.selection import (blockwise_top_k, selected_attention, selected_decode,
                              selected_decode_with_update,
                              selected_paged_attention, selected_ragged_paged_attention)
from cases import np_mask
from np_attention import np_attention, np_attention_grads

B, TQ, TK, HQ, HKV, D, DV, K = 2, 5, 13, 6, 2, 7, 3, 6


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def problem(seed=0, B=B, Tq=TQ, Tk=TK, Hq=HQ, Hkv=HKV, D=D, Dv=DV, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (B, Tq, Hq, D), dtype),
            jax.random.normal(ks[1], (B, Tk, Hkv, D), dtype),
            jax.random.normal(ks[2], (B, Tk, Hkv, Dv), dtype), ks[3])


def selected_np(idx, Hq, Tk):
    """The index sets as a dense bool (B, Hq, Tq, Tk): each in-range index once.
    ``idx`` (B, Tq, K) or (B, Tq, Hkv, K)."""
    idx = np.asarray(idx)
    if idx.ndim == 3:
        idx = idx[:, :, None, :]
    Bn, Tq, Hkv, _ = idx.shape
    sel = np.zeros((Bn, Hq, Tq, Tk), bool)
    for b in range(Bn):
        for t in range(Tq):
            for h in range(Hq):
                for j in idx[b, t, h // (Hq // Hkv) if Hkv > 1 else 0]:
                    if 0 <= j < Tk:
                        sel[b, h, t, j] = True
    return sel


def segment_ids(Tq, Tk):
    qs = np.array([[0] * 2 + [1] * (Tq - 2), [0] * Tq])
    ks = np.array([[0] * (Tk - Tq + 2) + [1] * (Tq - 2), [0] * Tk])
    return qs, ks


MASKS = {
    "none": lambda Tq, Tk: (None, None),
    "causal": lambda Tq, Tk: (masks.causal(), np_mask(masks.causal(), 0, HQ, Tq, Tk)),
    "window": lambda Tq, Tk: (masks.causal() & masks.sliding_window(4),
                              np_mask(masks.causal() & masks.sliding_window(4), 0, HQ, Tq, Tk)),
    "fn": lambda Tq, Tk: (masks.from_fn(lambda b, h, q, k: (k + h) % 3 != 0),
                          (np.arange(Tk)[None, None, None] + np.arange(HQ)[None, :, None, None])
                          % 3 != 0),
    "segments": lambda Tq, Tk: (
        masks.segments(jnp.asarray(segment_ids(Tq, Tk)[0]), jnp.asarray(segment_ids(Tq, Tk)[1])),
        (segment_ids(Tq, Tk)[0][:, None, :, None] == segment_ids(Tq, Tk)[1][:, None, None, :])),
}


def random_indices(key, shape, Tk):
    """Indices with repeats, -1 padding and entries past Tk."""
    return jax.random.randint(key, shape, -2, Tk + 2)


@pytest.fixture(params=["one block", "blocks of 2"])
def blocks(request, monkeypatch):
    # (fnattn's entry points keep their traces: the block size is read when tracing)
    jax.clear_caches()
    if request.param == "blocks of 2":
        # about two query tokens per block: the scan over blocks, with padding
        per_token = HKV * K * (D + DV) * 4 + 3 * HQ * K * 4
        monkeypatch.setattr(selection, "BLOCK_BYTES", 2 * per_token + 1)
        monkeypatch.setattr(selection, "ONE_BLOCK_BYTES", 0)
    yield request.param
    jax.clear_caches()


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("per_head", [False, True])
def test_forward_and_gradients_match_numpy(blocks, mask_name, per_head):
    q, k, v, key = problem()
    ks = jax.random.split(key, 4)
    shape = (B, TQ, HKV, K) if per_head else (B, TQ, K)
    idx = random_indices(ks[0], shape, TK)
    sinks = jax.random.normal(ks[1], (HQ,))
    mask, np_m = MASKS[mask_name](TQ, TK)
    spec = AttentionSpec(mask=mask, softcap=4.0 if mask_name != "none" else None, sinks=sinks)
    allowed = selected_np(idx, HQ, TK)
    if np_m is not None:
        allowed = allowed & np_m
    d_out = jax.random.normal(ks[2], (B, TQ, HQ, DV))
    d_lse = jax.random.normal(ks[3], (B, HQ, TQ))

    def f(q, k, v, sinks):
        r = selected_attention(spec.replace(sinks=sinks), q, k, v, idx)
        return r.out, r.lse

    @jax.jit
    def run(q, k, v, sinks):
        res, pullback = jax.vjp(f, q, k, v, sinks)
        return res, pullback((d_out, d_lse))

    (out, lse), (dq, dk, dv, dsinks) = run(q, k, v, sinks)
    assert ("scan" in str(jax.make_jaxpr(run)(q, k, v, sinks))) == (blocks == "blocks of 2")
    want = np_attention_grads(f64(q), f64(k), f64(v), f64(d_out), f64(d_lse), softcap=spec.softcap,
                              mask=allowed, sinks=f64(sinks))
    np.testing.assert_allclose(out, want["out"], atol=2e-5)
    np.testing.assert_allclose(lse, want["lse"], atol=2e-5)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv), ("dsinks", dsinks)):
        np.testing.assert_allclose(got, want[name], atol=5e-5, err_msg=name)


@pytest.mark.parametrize("mask_name", ["none", "causal", "segments"])
def test_forward_mode_matches_dense(blocks, mask_name):
    q, k, v, key = problem(1)
    ks = jax.random.split(key, 5)
    idx = random_indices(ks[0], (B, TQ, K), TK)
    sinks = jax.random.normal(ks[1], (HQ,))
    mask, _ = MASKS[mask_name](TQ, TK)
    spec = AttentionSpec(mask=mask, softcap=3.0, sinks=sinks)
    keep = masks.from_array(jnp.asarray(selected_np(idx, HQ, TK)))
    dense = spec.replace(mask=keep if mask is None else keep & mask, impl="reference")
    tans = tuple(jax.random.normal(kk, x.shape) for kk, x in zip(ks[2:], (q, k, v)))
    tsink = jnp.linspace(-1.0, 1.0, HQ)

    def g(fn, s):
        def h(q, k, v, sk):
            r = fn(s.replace(sinks=sk), q, k, v)
            return r.out, r.lse
        return h

    got = jax.jit(lambda *x: jax.jvp(g(lambda s, q, k, v: selected_attention(s, q, k, v, idx),
                                       spec), x, tans + (tsink,))[1])(q, k, v, sinks)
    want = jax.jit(lambda *x: jax.jvp(g(fnattn.reference, dense), x, tans + (tsink,))[1])(
        q, k, v, sinks)
    np.testing.assert_allclose(got[0], want[0], atol=3e-5)
    np.testing.assert_allclose(got[1], want[1], atol=3e-5)


def test_bhtd_layout_and_bfloat16():
    q, k, v, key = problem(2, dtype=jnp.bfloat16)
    idx = random_indices(key, (B, TQ, K), TK)
    spec = AttentionSpec(mask=masks.causal())
    got = jax.jit(selected_attention)(spec.replace(layout="bhtd"), q.transpose(0, 2, 1, 3),
                                      k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), idx)
    assert got.out.dtype == jnp.bfloat16
    allowed = selected_np(idx, HQ, TK) & np_mask(masks.causal(), 0, HQ, TQ, TK)
    out, lse, _ = np_attention(f64(q), f64(k), f64(v), mask=allowed)
    np.testing.assert_allclose(f64(got.out).transpose(0, 2, 1, 3), out, atol=3e-2)
    np.testing.assert_allclose(got.lse, lse, atol=3e-2)


def test_duplicates_count_once_unless_unique():
    q, k, v, _ = problem(3)
    base = jnp.tile(jnp.array([1, 4, 7, 9, -1, -1]), (B, TQ, 1))
    dup = jnp.tile(jnp.array([1, 4, 4, 7, 9, 9]), (B, TQ, 1))
    f = jax.jit(selected_attention, static_argnames="unique")
    a, b = f(AttentionSpec(), q, k, v, base), f(AttentionSpec(), q, k, v, dup)
    np.testing.assert_allclose(a.out, b.out, atol=1e-6)
    np.testing.assert_allclose(a.lse, b.lse, atol=1e-6)
    # unique=True: the caller's promise; a repeat then counts twice (weight x2 = logit + log 2)
    twice = f(AttentionSpec(), q, k, v, dup, unique=True)
    bias = np.zeros((1, 1, 1, TK))
    bias[..., [4, 9]] = np.log(2.0)
    out, lse, _ = np_attention(f64(q), f64(k), f64(v), bias=bias,
                               mask=selected_np(dup, HQ, TK))
    np.testing.assert_allclose(twice.out, out, atol=2e-5)
    np.testing.assert_allclose(twice.lse, lse, atol=2e-5)


def test_padding_rows_give_zeros_and_no_nan_anywhere():
    q, k, v, _ = problem(4)
    idx = jnp.full((B, TQ, K), -1).at[:, 1:3, :2].set(jnp.array([2, TK + 5]))
    # NaN in every key no row selects
    poison = jnp.zeros((TK,), bool).at[2].set(True)
    k = jnp.where(poison[None, :, None, None], k, jnp.nan)
    v = jnp.where(poison[None, :, None, None], v, jnp.inf)
    sinks = jnp.array([0.5, -jnp.inf, 1.0, 2.0, 0.0, -1.0])

    def loss(q, k, v, sinks, spec):
        r = selected_attention(spec.replace(sinks=sinks), q, k, v, idx)
        return jnp.sum(r.out ** 2) + jnp.sum(jnp.where(jnp.isfinite(r.lse), r.lse, 0.0)), r

    for spec in (AttentionSpec(), AttentionSpec(sinks=sinks, softcap=2.0)):
        s = None if spec.sinks is None else spec.sinks
        (_, r), grads = jax.jit(jax.value_and_grad(
            lambda q, k, v, s: loss(q, k, v, s, spec), argnums=(0, 1, 2), has_aux=True))(
                q, k, v, s)
        assert np.isfinite(np.asarray(r.out)).all()
        assert (np.asarray(r.out)[:, [0, 3, 4]] == 0).all()
        want_lse = -np.inf if s is None else np.broadcast_to(np.asarray(s)[None, :, None],
                                                             (B, HQ, 3))
        np.testing.assert_array_equal(np.asarray(r.lse)[:, :, [0, 3, 4]], want_lse)
        for g in grads:
            assert np.isfinite(np.asarray(g)).all()
        # rows 1 and 2 see key 2 alone (TK + 5 selects nothing)
        one = np_attention(f64(q[:, 1:3]), f64(k[:, 2:3]), f64(v[:, 2:3]), softcap=spec.softcap,
                           sinks=None if s is None else f64(s))
        np.testing.assert_allclose(r.out[:, 1:3], one[0], atol=2e-5)


def test_merge_with_a_dense_branch_is_dense_attention_over_the_union():
    """DSA/NSA mixtures: selected far keys merged with a sliding window of near ones."""
    q, k, v, key = problem(5, Tq=6, Tk=24)
    Tq, Tk, W = 6, 24, 3
    qpos = Tk - Tq + np.arange(Tq)
    rng = np.random.default_rng(0)
    # far keys only (outside the window), so the two sets are disjoint
    idx = np.stack([np.stack([rng.choice(np.arange(0, p - W), K, replace=False)
                              for p in qpos]) for _ in range(B)])
    sinks = jnp.linspace(-1, 1, HQ)
    far = jax.jit(selected_attention)(AttentionSpec(), q, k, v, jnp.asarray(idx))
    near = jax.jit(fnattn.attention)(AttentionSpec(mask=masks.causal()
                                                   & masks.sliding_window(W)), q, k, v)
    both = fnattn.merge([far, near], sinks=sinks)
    allowed = selected_np(idx, HQ, Tk) | np_mask(masks.causal() & masks.sliding_window(W), 0,
                                                 HQ, Tq, Tk)
    out, lse, _ = np_attention(f64(q), f64(k), f64(v), mask=allowed, sinks=f64(sinks))
    np.testing.assert_allclose(both.out, out, atol=2e-5)
    np.testing.assert_allclose(both.lse, lse, atol=2e-5)


def _largest_buffer(compiled):
    """The element count of the largest array in the compiled program's text."""
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
             for dims in re.findall(r"\b(?:f32|f16|bf16|s32|pred|u32|s8|u8)\[([\d,]*)\]",
                                    compiled.as_text())]
    return max(sizes)


def test_no_tq_by_tk_array_forward_or_backward():
    """The compiled forward and backward hold nothing of Tq * Tk elements."""
    Bm, Tq, Tk, Hq, Hkv, Dm, Km = 1, 256, 8192, 2, 1, 8, 16
    q, k, v, key = problem(6, B=Bm, Tq=Tq, Tk=Tk, Hq=Hq, Hkv=Hkv, D=Dm, Dv=Dm)
    idx = jax.random.randint(key, (Bm, Tq, Km), 0, Tk)
    spec = AttentionSpec(mask=masks.causal())

    def loss(q, k, v):
        return jnp.sum(selected_attention(spec, q, k, v, idx).out)

    for f in (lambda q, k, v: selected_attention(spec, q, k, v, idx).out,
              jax.grad(loss, argnums=(0, 1, 2))):
        compiled = jax.jit(f).lower(q, k, v).compile()
        biggest = _largest_buffer(compiled)
        # the cache's own size (Tk * D) and the indices (Tq * K) are the largest
        assert biggest <= max(Tk * Dm, Tq * Km * Hq), biggest
        assert biggest < Tq * Tk // 16
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < Tq * Tk * 4 // 8, temp


def test_decode_matches_numpy_per_sequence():
    Bd, S, Tq = 3, 20, 2
    q, k, v, key = problem(7, B=Bd, Tq=Tq, Tk=S)
    lengths, starts = np.array([12, 2, 0]), np.array([3, 17, 5])
    idx = random_indices(key, (Bd, Tq, HKV, K), 14)
    # slots outside each sequence hold NaN
    slot = np.arange(S)
    inside = (slot[None] >= starts[:, None]) & (slot[None] < (starts + lengths)[:, None])
    k = jnp.where(inside[:, :, None, None], k, jnp.nan)
    v = jnp.where(inside[:, :, None, None], v, jnp.nan)
    sinks = jnp.linspace(-1.0, 0.5, HQ)
    spec = AttentionSpec(mask=masks.causal(), sinks=sinks, softcap=5.0)
    res = jax.jit(selected_decode)(spec, q, k, v, idx, kv_lengths=lengths, kv_starts=starts)
    for b in range(Bd):
        a, L = starts[b], lengths[b]
        if L == 0:
            assert (np.asarray(res.out[b]) == 0).all()
            np.testing.assert_allclose(res.lse[b], np.broadcast_to(sinks[:, None], (HQ, Tq)))
            continue
        allowed = selected_np(idx[b:b + 1], HQ, L) & np_mask(masks.causal(), 0, HQ, Tq, L)
        out, lse, _ = np_attention(f64(q[b:b + 1]), f64(k[b:b + 1, a:a + L]),
                                   f64(v[b:b + 1, a:a + L]), mask=allowed, softcap=5.0,
                                   sinks=f64(sinks))
        np.testing.assert_allclose(res.out[b], out[0], atol=2e-5)
        np.testing.assert_allclose(res.lse[b], lse[0], atol=2e-5)
    g = jax.jit(jax.grad(lambda q: jnp.sum(selected_decode(
        spec, q, k, v, idx, kv_lengths=lengths, kv_starts=starts).out)))(q)
    assert np.isfinite(np.asarray(g)).all()


def _pools(seed, N=9, ps=4, Hkv=HKV, Dm=D, Dv=DV):
    ks = jax.random.split(jax.random.key(seed), 2)
    return (jax.random.normal(ks[0], (Hkv, N, ps, Dm)), jax.random.normal(ks[1], (Hkv, N, ps, Dv)))


def _sequence_keys(kp, table_row, L, ps):
    pages = [kp[:, p] for p in table_row[: -(-L // ps)]]
    return jnp.concatenate(pages, axis=1)[:, :L].transpose(1, 0, 2)[None]   # (1, L, Hkv, D)


def test_paged_matches_numpy_and_never_reads_unowned_pages():
    kp, vp = _pools(8)
    ps = 4
    table = np.array([[3, 0, 7, -1], [5, 12, 1, 2]])     # 12: past the pool, not owned
    lengths = np.array([11, 14])
    owned = {3, 0, 7, 5, 1, 2}
    # pages no sequence owns hold NaN
    bad = np.array([p not in owned for p in range(kp.shape[1])])
    kp = jnp.where(bad[None, :, None, None], jnp.nan, kp)
    vp = jnp.where(bad[None, :, None, None], jnp.nan, vp)
    Tq = 2
    q = jax.random.normal(jax.random.key(9), (2, Tq, HQ, D))
    idx = random_indices(jax.random.key(10), (2, Tq, K), 16)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(9))
    res = jax.jit(selected_paged_attention)(spec, q, kp, vp, idx, page_table=table,
                                            kv_lengths=lengths)
    assert np.isfinite(np.asarray(res.out)).all()
    for b in range(2):
        L = int(lengths[b])
        # sequence 1's positions 4..7 are on page 12 (not owned): not selected
        visible = np.ones(L, bool)
        if b == 1:
            visible[4:8] = False
        ks = jnp.nan_to_num(_sequence_keys(kp, table[b], L, ps))
        vs = jnp.nan_to_num(_sequence_keys(vp, table[b], L, ps))
        allowed = (selected_np(idx[b:b + 1], HQ, L) & visible
                   & np_mask(spec.mask, 0, HQ, Tq, L))
        out, lse, _ = np_attention(f64(q[b:b + 1]), f64(ks), f64(vs), mask=allowed)
        np.testing.assert_allclose(res.out[b], out[0], atol=2e-5)
        np.testing.assert_allclose(res.lse[b], lse[0], atol=2e-5)
    # gradients for the pools: scatter-added at the selected slots only
    dk = jax.jit(jax.grad(lambda kp: jnp.sum(selected_paged_attention(
        spec, q, kp, vp, idx, page_table=table, kv_lengths=lengths).out)))(kp)
    assert (np.asarray(dk)[:, bad] == 0).all()


def test_ragged_paged_matches_numpy():
    kp, vp = _pools(11)
    ps = 4
    table = np.array([[2, 4, 6, 8], [1, 3, 5, 7], [0, 0, 0, 0]])
    ctx = np.array([13, 6, 5])
    loc = np.array([0, 3, 4, 6])          # seq 2 is not live: its rows give 0
    T = 7                                  # row 6 belongs to no sequence
    q = jax.random.normal(jax.random.key(12), (T, HQ, D))
    idx = random_indices(jax.random.key(13), (T, HKV, K), 14)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.linspace(-1, 1, HQ))
    res = jax.jit(selected_ragged_paged_attention)(
        spec, q, kp, vp, idx, page_table=table, context_lengths=ctx, query_start_loc=loc,
        num_seqs=2)
    for s in range(2):
        n, L = loc[s + 1] - loc[s], int(ctx[s])
        rows = slice(loc[s], loc[s + 1])
        ks, vs = _sequence_keys(kp, table[s], L, ps), _sequence_keys(vp, table[s], L, ps)
        allowed = selected_np(idx[None, rows], HQ, L) & np_mask(masks.causal(), 0, HQ, n, L)
        out, lse, _ = np_attention(f64(q[None, rows]), f64(ks), f64(vs), mask=allowed,
                                   sinks=f64(spec.sinks))
        np.testing.assert_allclose(res.out[rows], out[0], atol=2e-5)
        np.testing.assert_allclose(res.lse[:, rows], lse[0], atol=2e-5)
    assert (np.asarray(res.out[4:]) == 0).all()
    np.testing.assert_allclose(res.lse[:, 4:], np.broadcast_to(np.asarray(spec.sinks)[:, None],
                                                               (HQ, 3)))


@pytest.mark.parametrize("block_k,k", [(32, 5), (8, 20), (64, 64)])
def test_blockwise_top_k_matches_lax_top_k(block_k, k):
    rows, n = 3, 100
    s = jax.random.normal(jax.random.key(14), (rows, n))
    s = s.at[2, 10:].set(-jnp.inf)        # row 2 has 10 selectable keys
    padded = jnp.pad(s, ((0, 0), (0, block_k)))

    def blk(start):
        return jax.lax.dynamic_slice_in_dim(padded, start, block_k, axis=1)

    vals, idx = jax.jit(lambda: blockwise_top_k(blk, n, k, block_k=block_k))()
    want_vals, want_idx = jax.lax.top_k(s, k)
    np.testing.assert_array_equal(vals, want_vals)
    want_idx = np.where(np.isfinite(np.asarray(want_vals)), want_idx, -1)
    np.testing.assert_array_equal(idx, want_idx)


def test_refusals_name_the_feature_and_the_lowering():
    q, k, v, key = problem()
    idx = jnp.zeros((B, TQ, K), jnp.int32)
    with pytest.raises(NotImplementedError, match="XLA lowering"):
        jax.jit(selected_attention)(AttentionSpec(impl="pallas"), q, k, v, idx)
    with pytest.raises(ValueError, match="spec.bias"):
        selected_attention(AttentionSpec(bias=jnp.zeros((1, 1, TQ, TK))), q, k, v, idx)
    with pytest.raises(ValueError, match=r"indices must have shape \(B, Tq, K\)=\(2, 5, 'K'\)"):
        selected_attention(AttentionSpec(), q, k, v, jnp.zeros((B, TQ + 1, K), jnp.int32))
    with pytest.raises(TypeError, match="indices must be an integer array"):
        selected_attention(AttentionSpec(), q, k, v, jnp.zeros((B, TQ, K)))
    with pytest.raises(ValueError, match="masks that hold arrays"):
        selected_decode(AttentionSpec(mask=masks.lengths(None, jnp.array([3, 4]))), q, k, v,
                        idx, kv_lengths=jnp.array([3, 4]))


def test_vmap_and_return_lse_false():
    """vmap over a leading axis equals the batched call; no lse when not asked."""
    q, k, v, key = problem(15)
    idx = random_indices(key, (B, TQ, K), TK)
    spec = AttentionSpec(mask=masks.causal(), return_lse=False)
    batched = jax.jit(selected_attention)(spec, q, k, v, idx)
    assert batched.lse is None
    mapped = jax.jit(jax.vmap(lambda q, k, v, i: selected_attention(
        spec, q[None], k[None], v[None], i[None]).out[0]))(q, k, v, idx)
    np.testing.assert_allclose(mapped, batched.out, atol=1e-6)
    g = jax.jit(jax.vmap(jax.grad(lambda q, k, v, i: jnp.sum(selected_attention(
        spec, q[None], k[None], v[None], i[None]).out))))(q, k, v, idx)
    g_all = jax.jit(jax.grad(lambda q: jnp.sum(selected_attention(spec, q, k, v, idx).out)))(q)
    np.testing.assert_allclose(g, g_all, atol=1e-5)


def test_paged_forward_mode_and_per_head_indices():
    kp, vp = _pools(16)
    table = np.array([[3, 0, 7, 1]])
    q = jax.random.normal(jax.random.key(17), (1, 1, HQ, D))
    idx = random_indices(jax.random.key(18), (1, 1, HKV, K), 16)
    spec = AttentionSpec(softcap=3.0)

    def f(kp):
        return selected_paged_attention(spec, q, kp, vp, idx, page_table=table,
                                        kv_lengths=np.array([15])).out

    tk = jax.random.normal(jax.random.key(19), kp.shape)
    got = jax.jit(lambda kp, tk: jax.jvp(f, (kp,), (tk,))[1])(kp, tk)
    # the same through dense attention over the sequence's keys
    ks, vs = _sequence_keys(kp, table[0], 15, 4), _sequence_keys(vp, table[0], 15, 4)
    tks = _sequence_keys(tk, table[0], 15, 4)
    keep = jnp.asarray(selected_np(idx, HQ, 15))
    dense = AttentionSpec(softcap=3.0, mask=masks.from_array(keep), impl="reference")
    want = jax.jit(lambda ks, tks: jax.jvp(lambda ks: fnattn.reference(dense, q, ks, vs).out,
                                           (ks,), (tks,))[1])(ks, tks)
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("mask", [None, masks.causal()])
def test_a_selected_non_finite_key_makes_only_its_rows_nan(mask):
    q, k, v, _ = problem(20)
    v = v.at[:, 3].set(jnp.nan)                     # key 3's value
    k = k.at[:, TK - 1].set(jnp.inf)                # the last key, future to rows < TQ - 1
    idx = jnp.tile(jnp.array([0, 1, 2, 3, 4, 5]), (B, TQ, 1))
    idx = idx.at[:, 0].set(jnp.array([0, 1, 2, TK - 1, -1, -1]))   # row 0: the inf key
    idx = idx.at[:, 1].set(jnp.array([0, 1, 2, 4, 5, -1]))         # row 1: only finite keys
    out = np.asarray(jax.jit(selected_attention)(AttentionSpec(mask=mask), q, k, v, idx).out)
    assert np.isnan(out[:, 2:]).all()               # rows that select key 3
    assert np.isfinite(out[:, 1]).all()
    # row 0 selects the inf key: NaN unless the mask hides it (causal: it is in its future)
    assert np.isnan(out[:, 0]).all() == (mask is None)
    assert np.isfinite(out[:, 0]).all() == (mask is not None)


def test_decode_with_update_writes_then_attends():
    Bd, S, Tq = 3, 12, 2
    q, k, v, key = problem(21, B=Bd, Tq=Tq, Tk=S)
    ks = jax.random.split(key, 3)
    k_new = jax.random.normal(ks[0], (Bd, Tq, HKV, D))
    v_new = jax.random.normal(ks[1], (Bd, Tq, HKV, DV))
    lengths, starts = jnp.array([7, 2, 11]), jnp.array([1, 0, 3])   # sequence 2 does not fit
    idx = random_indices(ks[2], (Bd, Tq, K), 9)
    spec = AttentionSpec(mask=masks.causal())
    res, kc, vc = jax.jit(selected_decode_with_update)(spec, q, k_new, v_new, k, v, idx,
                                                       kv_lengths=lengths, kv_starts=starts)
    want_k, want_v = k, v
    for b, (L, a) in enumerate(zip([7, 2], [1, 0])):
        want_k = want_k.at[b, a + L - Tq:a + L].set(k_new[b])
        want_v = want_v.at[b, a + L - Tq:a + L].set(v_new[b])
    np.testing.assert_array_equal(kc, want_k)
    np.testing.assert_array_equal(vc, want_v)
    ref = jax.jit(selected_decode)(spec, q, want_k, want_v, idx, kv_lengths=lengths,
                                   kv_starts=starts)
    np.testing.assert_allclose(res.out[:2], ref.out[:2], atol=1e-6)
    assert np.isnan(np.asarray(res.out[2])).all()
