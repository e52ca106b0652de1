"""Speculative tree verification (``draft_parents``) in the paged attention functions,
against a float64 NumPy attention with an explicit ancestor mask (tests/np_attention.py)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import fnattn  # noqa: E402
from fnattn import AttentionSpec, PagedBlockSizes, masks, position_bias, quant  # noqa: E402
from fnattn.quant import QuantFormat  # noqa: E402
from fnattn.paged import api, common  # noqa: E402
from fnattn.paged import tree as treemod  # noqa: E402
from np_attention import np_attention  # noqa: E402
from problems import assert_close, make, meta, poisoned, quantized  # noqa: E402

SMALL = PagedBlockSizes(block_q=2, block_k=4)


def np_ancestors(parents):
    """(n, n) bool, [i, j]: j is i or an ancestor of i; and the depths (n,)."""
    n = len(parents)
    anc = np.eye(n, dtype=bool)
    depth = np.zeros(n, int)
    for i in range(n):
        j = parents[i]
        while j >= 0:
            anc[i, j] = True
            depth[i] += 1
            j = parents[j]
    return anc, depth


def random_parents(rng, n):
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]


def np_tree_mask(spec, s, Hq, L, parents):
    """(1, Hq, n, L) bool: the sequence's context and each token's ancestors, and the
    spec's positional mask at depth-based positions."""
    n = len(parents)
    C = L - n
    anc, depth = np_ancestors(parents)
    allowed = np.ones((n, L), bool)
    allowed[:, C:] = anc
    q_pos = C + depth
    k_pos = np.arange(L)
    k_pos[C:] = C + depth
    if spec.mask is not None:
        pos = masks.Positions(b=np.full((1, 1, 1, 1), s), h=np.arange(Hq)[None, :, None, None],
                              q=np.arange(n)[None, None, :, None],
                              q_pos=q_pos[None, None, :, None], k=k_pos[None, None, None, :])
        allowed = allowed & np.asarray(spec.mask.predicate(pos, []))
    return np.broadcast_to(allowed, (1, Hq, n, L))


def np_alibi(slopes, L, parents):
    """(1, Hq, n, L): ALiBi at the depth-based positions."""
    n = len(parents)
    C = L - n
    depth = np_ancestors(parents)[1]
    k_pos = np.arange(L)
    k_pos[C:] = C + depth
    dist = np.abs((C + depth)[:, None] - k_pos[None, :])
    return -np.asarray(slopes, np.float64)[None, :, None, None] * dist[None, None]


def np_expected(spec, p, trees, slopes=None):
    T, Hq, _ = p.q.shape
    Dv = p.v_pages.shape[-1]
    out = np.zeros((T, Hq, Dv))
    lse = np.full((Hq, T), -np.inf)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    sinks = None if spec.sinks is None else f64(spec.sinks)
    start = 0
    for s, (L, n) in enumerate(p.seqs):
        bias = None if slopes is None else np_alibi(slopes, L, trees[s])
        o, l, _ = np_attention(f64(p.q[start:start + n])[None], f64(p.k_tok[s])[None],
                               f64(p.v_tok[s])[None], scale=spec.scale, softcap=spec.softcap,
                               sinks=sinks, mask=np_tree_mask(spec, s, Hq, L, trees[s]),
                               bias=bias)
        out[start:start + n] = o[0]
        lse[:, start:start + n] = l[0]
        start += n
    return out, lse


def packed(p, trees):
    T = p.q.shape[0]
    flat = sum(trees, [])
    return jnp.asarray(flat + [0] * (T - len(flat)), jnp.int32)


def run_ragged(spec, p, parents, **kw):
    return jax.jit(lambda spec, q, kp, vp, m, par: fnattn.ragged_paged_attention(
        spec, q, kp, vp, **m, draft_parents=par, **kw))(spec, p.q, p.k_pages, p.v_pages,
                                                         meta(p), parents)


SPECS = {
    "none": AttentionSpec(return_lse=True),
    "causal+softcap": AttentionSpec(mask=masks.causal(), softcap=5.0, return_lse=True),
    "window+sinks": AttentionSpec(mask=masks.causal() & masks.sliding_window(left=3),
                                  sinks=jnp.array([0.5, -1.0, 2.0, 0.0]), return_lse=True),
    "chunked": AttentionSpec(mask=masks.causal() & masks.chunked(4), return_lse=True),
}


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("name", list(SPECS))
def test_random_trees_match_the_float64_ancestor_mask(name, impl):
    rng = np.random.default_rng(3)
    seqs = [(13, 7), (6, 1), (9, 5)]
    p = make(seqs, Hq=4, Hkv=2, D=8, page_size=4, pad_tokens=2, max_seqs=4, seed=5)
    trees = [random_parents(rng, n) for _, n in seqs]
    spec = SPECS[name].replace(impl=impl, block_sizes=SMALL)
    res = run_ragged(spec, p, packed(p, trees))
    assert_close(res.out, res.lse, *np_expected(spec, p, trees), 2e-5)
    assert np.all(np.asarray(res.out[-2:]) == 0)            # padding rows


def test_trees_with_alibi_and_a_window():
    rng = np.random.default_rng(8)
    seqs = [(15, 6), (8, 4)]
    p = make(seqs, Hq=4, Hkv=2, D=8, page_size=4, seed=8)
    trees = [random_parents(rng, n) for _, n in seqs]
    slopes = position_bias.alibi_slopes(4)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(left=4), return_lse=True,
                         position_bias=position_bias.alibi(slopes), block_sizes=SMALL)
    res = run_ragged(spec, p, packed(p, trees))
    assert_close(res.out, res.lse, *np_expected(spec, p, trees, slopes), 2e-5)


def test_trees_over_quantized_pools_equal_trees_over_their_values():
    rng = np.random.default_rng(9)
    seqs = [(11, 5), (7, 3)]
    p = quantized(make(seqs, Hq=4, Hkv=2, D=8, page_size=4, seed=9), QuantFormat("int8"))
    par = packed(p, [random_parents(rng, n) for _, n in seqs])
    spec = AttentionSpec(mask=masks.causal(), return_lse=True, block_sizes=SMALL)
    f = jax.jit(lambda q, kp, vp, m, par: fnattn.ragged_paged_attention(
        spec, q, kp, vp, **m, draft_parents=par))
    got = f(p.q, p.k_pages, p.v_pages, meta(p), par)
    want = f(p.q, quant.dequantize(p.k_pages), quant.dequantize(p.v_pages), meta(p), par)
    np.testing.assert_allclose(got.out, want.out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got.lse, want.lse, atol=1e-5, rtol=1e-5)


def test_rows_a_mask_leaves_empty_are_zeros():
    rng = np.random.default_rng(10)
    seqs = [(9, 5)]
    p = make(seqs, Hq=2, Hkv=1, D=8, page_size=4, seed=10)
    trees = [random_parents(rng, 5)]
    spec = AttentionSpec(mask=masks.from_fn(lambda b, h, q, k: q % 2 == 0), return_lse=True,
                         block_sizes=SMALL)
    res = run_ragged(spec, p, packed(p, trees))
    assert_close(res.out, res.lse, *np_expected(spec, p, trees), 2e-5)
    assert np.all(np.asarray(res.out[1::2]) == 0) and np.all(np.isneginf(res.lse[:, 1::2]))


def test_a_chain_is_causal_prefill():
    seqs = [(11, 6), (5, 3)]
    p = make(seqs, Hq=4, Hkv=1, D=8, page_size=4, seed=1)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(left=4), block_sizes=SMALL)
    chain = [[-1] + list(range(n - 1)) for _, n in seqs]
    got = run_ragged(spec, p, packed(p, chain))
    f = jax.jit(lambda q, kp, vp, m: fnattn.ragged_paged_attention(spec, q, kp, vp, **m))
    want = f(p.q, p.k_pages, p.v_pages, meta(p))
    np.testing.assert_allclose(got.out, want.out, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(got.lse, want.lse, atol=1e-6, rtol=1e-6)


def test_paged_attention_trees_gqa():
    rng = np.random.default_rng(7)
    B, Tq = 2, 6
    p = make([(14, Tq), (9, Tq)], Hq=6, Hkv=2, D=8, page_size=4, seed=2)
    trees = [random_parents(rng, Tq) for _ in range(B)]
    spec = AttentionSpec(mask=masks.sliding_window(left=5), return_lse=True, block_sizes=SMALL)
    res = jax.jit(lambda q, kp, vp, t, l, par: fnattn.paged_attention(
        spec, q, kp, vp, page_table=t, kv_lengths=l, draft_parents=par))(
        p.q.reshape(B, Tq, 6, 8), p.k_pages, p.v_pages, p.page_table, p.context_lengths,
        jnp.asarray(trees, jnp.int32))
    out, lse = np_expected(spec, p, trees)
    assert_close(res.out.reshape(B * Tq, 6, 8), res.lse.transpose(1, 0, 2).reshape(6, -1),
                 out, lse, 2e-5)


def test_update_form_writes_and_attends():
    rng = np.random.default_rng(11)
    seqs = [(10, 5), (7, 4)]
    p = make(seqs, Hq=4, Hkv=2, D=8, page_size=4, seed=4)
    trees = [random_parents(rng, n) for _, n in seqs]
    spec = AttentionSpec(mask=masks.causal(), return_lse=True, block_sizes=SMALL)
    res, kp, vp = jax.jit(lambda q, k, v, kp, vp, m, par: (
        fnattn.ragged_paged_attention_with_update(spec, q, k, v, kp, vp, **m,
                                                  draft_parents=par)))(
        p.q, p.k_new, p.v_new, p.k_old, p.v_old, meta(p), packed(p, trees))
    assert_close(res.out, res.lse, *np_expected(spec, p, trees), 2e-5)
    np.testing.assert_array_equal(kp, p.k_pages)
    np.testing.assert_array_equal(vp, p.v_pages)


def test_nan_in_non_ancestor_drafts_never_reaches_the_output():
    seqs = [(12, 6)]
    tree = [-1, 0, 0, 1, 2, 2]                          # two branches: 1-3 and 2-4, 2-5
    p = make(seqs, Hq=2, Hkv=1, D=8, page_size=4, seed=9)
    C = 12 - 6
    poison = [C + 2, C + 4]                             # branch 2 (tokens 2 and 4)
    bad = poisoned(p, hidden=lambda L, n, pos: pos in poison)
    spec = AttentionSpec(mask=masks.causal(), return_lse=True, block_sizes=SMALL)
    res = run_ragged(spec, bad, jnp.asarray(tree, jnp.int32))
    want_out, want_lse = np_expected(spec, p, [tree])
    clean = [0, 1, 3]                                   # rows whose ancestors hold no NaN
    out = np.asarray(res.out)
    np.testing.assert_allclose(out[clean], want_out[clean], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(res.lse)[:, clean], want_lse[:, clean], atol=2e-5)


def test_draft_positions_are_context_plus_depth():
    rng = np.random.default_rng(0)
    trees = [random_parents(rng, 9), random_parents(rng, 4)]
    lengths = [20, 7]
    flat = jnp.asarray(sum(trees, []) + [5], jnp.int32)
    pos = jax.jit(lambda par: fnattn.draft_positions(
        par, context_lengths=jnp.array(lengths), query_start_loc=jnp.array([0, 9, 13]),
        num_seqs=jnp.int32(2)))(flat)
    want = [L - len(t) + np_ancestors(t)[1] for L, t in zip(lengths, trees)]
    assert pos.tolist() == list(np.concatenate(want)) + [-1]
    for t in trees:
        np.testing.assert_array_equal(fnattn.draft_ancestor_mask(jnp.asarray(t)),
                                      np_ancestors(t)[0])


def test_windowed_chunks_outside_every_drafts_window_are_skipped():
    """The key blocks [k_lo, k_hi) of every item hold every key a row of it sees
    (NumPy) and leave out blocks of the context that the window hides."""
    rng = np.random.default_rng(2)
    seqs = [(40, 8), (30, 6)]
    trees = [random_parents(rng, n) for _, n in seqs]
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(left=5))
    p = make(seqs, Hq=2, Hkv=1, D=8, page_size=4, seed=3)
    cfg = api._make_cfg(spec, num_q_heads=2, num_kv_heads=1, head_dim=8, v_head_dim=8,
                        num_pages=p.k_pages.shape[1], page_size=4,
                        pages_per_seq=p.page_table.shape[1], max_seqs=2, total_tokens=14,
                        uniform_q=None, update=False, tree=True)
    m = common.sanitize(cfg, p.page_table, p.context_lengths, p.query_start_loc, p.num_seqs)
    m = m._replace(parents=packed(p, trees))

    @jax.jit
    def ranges(m):
        work = common.work_list(cfg, m, 2, 4)
        return work, treemod.block_ranges(cfg, work, treemod.build(cfg, m), 2, 4)

    work, (k_lo, k_hi, _, _) = ranges(m)
    skipped = 0
    for w in range(work.seq.shape[0]):
        rows = int(work.rows[w])
        if not rows:
            continue
        s, r0 = int(work.seq[w]), int(work.row0[w])
        L = seqs[s][0]
        seen = np_tree_mask(spec, s, 1, L, trees[s])[0, 0, r0:r0 + rows].any(axis=0)
        blocks = np.unique(np.flatnonzero(seen) // 4)
        assert int(k_lo[w]) <= blocks.min() and blocks.max() < int(k_hi[w])
        skipped += int(k_lo[w])
    assert skipped > 0


@pytest.mark.parametrize("update", [False, True])
def test_traced_window_sizes_with_a_tree_equal_the_static_sizes(update):
    """A tree with window and chunk sizes given as arrays (one per layer inside a
    ``lax.scan``, masks.NO_WINDOW for a global layer) equals the static-int form
    and the float64 ancestor mask, in the update form too."""
    rng = np.random.default_rng(11)
    seqs = [(17, 6), (9, 1), (12, 4)]
    p = make(seqs, Hq=4, Hkv=2, D=8, page_size=4, pad_tokens=1, max_seqs=4, seed=12)
    trees = [random_parents(rng, n) for _, n in seqs]
    par = packed(p, trees)
    lefts = [3, masks.NO_WINDOW, 6]
    statics = [masks.causal() & masks.sliding_window(left=3), masks.causal(),
               masks.causal() & masks.sliding_window(left=6)]
    base = AttentionSpec(return_lse=True, block_sizes=SMALL)
    pools = (p.k_old, p.v_old) if update else (p.k_pages, p.v_pages)

    def one(left, kp, vp):
        spec = base.replace(mask=masks.causal() & masks.sliding_window(left=left))
        if update:
            res, _, _ = fnattn.ragged_paged_attention_with_update(
                spec, p.q, p.k_new, p.v_new, kp, vp, **meta(p), draft_parents=par)
            return res
        return fnattn.ragged_paged_attention(spec, p.q, kp, vp, **meta(p), draft_parents=par)

    @jax.jit
    def scanned(lefts):
        return jax.lax.scan(lambda c, left: (c, one(left, *pools)), 0, lefts)[1]

    got = scanned(jnp.asarray(lefts, jnp.int32))
    for i, mask in enumerate(statics):
        spec = base.replace(mask=mask)
        if update:
            want = jax.jit(lambda kp, vp: fnattn.ragged_paged_attention_with_update(
                spec, p.q, p.k_new, p.v_new, kp, vp, **meta(p), draft_parents=par)[0])(*pools)
        else:
            want = run_ragged(spec, p, par)
        np.testing.assert_allclose(got.out[i], want.out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.lse[i], want.lse, rtol=1e-5, atol=1e-6)
        assert_close(got.out[i], got.lse[i], *np_expected(spec, p, trees), 2e-5)


def test_traced_window_sizes_skip_the_same_blocks_under_a_tree():
    """The block ranges of a tree with a traced window equal those of the static
    window (the tiles the window leaves empty are still skipped)."""
    rng = np.random.default_rng(5)
    seqs = [(40, 8), (30, 6)]
    trees = [random_parents(rng, n) for _, n in seqs]
    p = make(seqs, Hq=2, Hkv=1, D=8, page_size=4, seed=4)

    def ranges_for(spec, sizes):
        cfg = api._make_cfg(spec, num_q_heads=2, num_kv_heads=1, head_dim=8, v_head_dim=8,
                            num_pages=p.k_pages.shape[1], page_size=4,
                            pages_per_seq=p.page_table.shape[1], max_seqs=2,
                            total_tokens=14, uniform_q=None, update=False, tree=True)
        m = common.sanitize(cfg, p.page_table, p.context_lengths, p.query_start_loc,
                            p.num_seqs)
        m = m._replace(parents=packed(p, trees))
        if sizes is not None:
            m = m._replace(sizes=sizes)
        work = common.work_list(cfg, m, 2, 4)
        return treemod.block_ranges(cfg, work, treemod.build(cfg, m), 2, 4, m)

    static = jax.jit(lambda: ranges_for(
        AttentionSpec(mask=masks.causal() & masks.sliding_window(left=5)), None))()

    @jax.jit
    def traced(left):
        spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(left=left))
        return ranges_for(spec, tuple(jnp.asarray(x, jnp.int32)
                                      for x in jax.tree_util.tree_leaves(spec.mask)))

    got = traced(jnp.int32(5))
    for a, b in zip(got, static):
        np.testing.assert_array_equal(a, b)
    assert int(jnp.sum(got[0])) > 0          # context blocks left of every window skipped


BAD = [([-1, 1, 0, -1, 0], "draft_parents\\[1\\] = 1 is not a parent of token 1 \\(new token 1 of "
        "sequence 0"),
       ([-1, 0, -2, -1, 0], "draft_parents\\[2\\] = -2"),
       ([-1, 0, 0, -1, 1], "draft_parents\\[4\\] = 1 is not a parent of token 4 \\(new token 1 "
        "of sequence 1, whose new tokens are packed rows 3 to 4\\)")]


@pytest.mark.parametrize("parents,message", BAD)
def test_bad_trees_are_refused_at_trace_time(parents, message):
    p = make([(6, 3), (4, 2)], Hq=2, Hkv=1, D=8, page_size=4, seed=1)
    spec = AttentionSpec(mask=masks.causal())
    # parent >= own index (a later token, or another sequence's), out of range
    with pytest.raises(ValueError, match=message):
        fnattn.ragged_paged_attention(spec, p.q, p.k_pages, p.v_pages, **meta(p),
                                      draft_parents=np.array(parents))
    with pytest.raises(ValueError, match=message):   # a constant inside jit
        jax.jit(lambda q: fnattn.ragged_paged_attention(
            spec, q, p.k_pages, p.v_pages, **meta(p), draft_parents=np.array(parents)))(p.q)
    # traced: checked mode reports it; unchecked, the result stays finite
    f = jax.jit(checkify.checkify(lambda q, par: fnattn.ragged_paged_attention(
        spec, q, p.k_pages, p.v_pages, **meta(p), draft_parents=par, checked=True).out))
    err, out = f(p.q, jnp.asarray(parents, jnp.int32))
    assert err.get() is not None and "is not a parent of token" in err.get()
    assert np.isfinite(np.asarray(out)).all()
    err, _ = f(p.q, jnp.asarray([-1, 0, 1, -1, 0], jnp.int32))
    assert err.get() is None


def test_bad_tree_shapes_and_paged_values():
    p = make([(6, 3)], Hq=2, Hkv=1, D=8, page_size=4, seed=1)
    spec = AttentionSpec()
    with pytest.raises(ValueError, match=r"draft_parents must have shape \(total_tokens,\)"):
        fnattn.ragged_paged_attention(spec, p.q, p.k_pages, p.v_pages, **meta(p),
                                      draft_parents=jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="draft_parents must be an integer array"):
        fnattn.ragged_paged_attention(spec, p.q, p.k_pages, p.v_pages, **meta(p),
                                      draft_parents=jnp.zeros((3,)))
    q = p.q.reshape(1, 3, 2, 8)
    kw = dict(page_table=p.page_table, kv_lengths=p.context_lengths)
    with pytest.raises(ValueError, match=r"draft_parents\[0, 2\] = 2 is not a parent of new "
                       "token 2 of sequence 0"):
        fnattn.paged_attention(spec, q, p.k_pages, p.v_pages, **kw,
                               draft_parents=np.array([[-1, 0, 2]]))
    with pytest.raises(ValueError, match=r"draft_parents must have shape \(B, Tq\)"):
        fnattn.paged_attention(spec, q, p.k_pages, p.v_pages, **kw,
                               draft_parents=np.array([-1, 0, 1]))
    f = jax.jit(checkify.checkify(lambda par: fnattn.paged_attention(
        spec, q, p.k_pages, p.v_pages, **kw, draft_parents=par, checked=True).out))
    err, _ = f(jnp.array([[-1, 0, 2]], jnp.int32))
    assert "draft_parents[2] = 2 is not a parent of token 2 (new token 2 of sequence 0)" \
        in err.get()
    assert f(jnp.array([[-1, 0, 1]], jnp.int32))[0].get() is None


def test_pallas_refuses_trees_and_names_the_xla_lowering():
    p = make([(6, 3)], Hq=2, Hkv=1, D=8, page_size=8, seed=1)
    with pytest.raises(NotImplementedError, match="speculative tree verification "
                       "\\(draft_parents\\).*impl='xla'"):
        fnattn.ragged_paged_attention(AttentionSpec(impl="pallas"), p.q, p.k_pages, p.v_pages,
                                      **meta(p), draft_parents=jnp.array([-1, 0, 0]))
    from fnattn.paged import triton
    with pytest.raises(NotImplementedError, match="speculative tree verification"):
        api.ragged_paged_attention_with(
            (("default", triton.forward_interpret),), AttentionSpec(), p.q, p.k_pages,
            p.v_pages, **meta(p), draft_parents=jnp.array([-1, 0, 0]))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_trees_lower_for_gpu_and_tpu_with_the_xla_lowering(platform):
    """impl='auto' routes trees to the XLA lowering on every platform."""
    from lowering import target
    p = make([(9, 4), (5, 1)], Hq=4, Hkv=1, D=128, page_size=8, seed=13)
    spec = AttentionSpec(mask=masks.causal())
    par = jnp.array([-1, 0, 0, 1, -1], jnp.int32)
    f = lambda q, kp, vp, par: fnattn.ragged_paged_attention(  # noqa: E731
        spec, q, kp, vp, **meta(p), draft_parents=par).out
    g = lambda q, k, v, kp, vp, par: fnattn.ragged_paged_attention_with_update(  # noqa: E731
        spec, q, k, v, kp, vp, **meta(p), draft_parents=par)[0].out
    for fn, args in ((f, (p.q, p.k_pages, p.v_pages, par)),
                     (g, (p.q, p.k_new, p.v_new, p.k_pages, p.v_pages, par))):
        with target(platform):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert "tpu_custom_call" not in text and "triton" not in text.lower()
        assert "stablehlo.dot_general" in text


def test_tree_gradients_match_the_reference_lowering():
    rng = np.random.default_rng(5)
    seqs = [(9, 5), (6, 3)]
    p = make(seqs, Hq=2, Hkv=1, D=8, page_size=4, seed=6)
    trees = [random_parents(rng, n) for _, n in seqs]
    par = packed(p, trees)

    def loss(impl, q, kp, vp):
        spec = AttentionSpec(mask=masks.causal(), impl=impl, block_sizes=SMALL)
        r = fnattn.ragged_paged_attention(spec, q, kp, vp, **meta(p), draft_parents=par)
        return jnp.sum(r.out * jnp.cos(r.out))

    used = jnp.asarray(p.used_pages)[None, :, None, None]
    kp = jnp.where(used, p.k_pages, 0.0)
    vp = jnp.where(used, p.v_pages, 0.0)
    got = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2)))(p.q, kp, vp)
    # the dense problem through fnattn.reference with the explicit ancestor mask
    dense = []
    for s, (L, n) in enumerate(seqs):
        allowed = np_tree_mask(AttentionSpec(), s, 2, L, trees[s])[0, 0]
        dense.append(allowed)

    def dense_loss(q, ks, vs):
        total, start = 0.0, 0
        for s, (L, n) in enumerate(seqs):
            spec = AttentionSpec(mask=masks.from_array(jnp.asarray(dense[s])[None, None]))
            r = fnattn.reference(spec, q[None, start:start + n], ks[s][None], vs[s][None])
            total = total + jnp.sum(r.out * jnp.cos(r.out))
            start += n
        return total

    dq, dks, dvs = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(p.q, p.k_tok, p.v_tok)
    np.testing.assert_allclose(got[0], dq, atol=2e-5, rtol=2e-5)
    table = np.asarray(p.page_table)
    for s, (L, _) in enumerate(seqs):
        for pos in range(L):
            np.testing.assert_allclose(got[1][:, table[s, pos // 4], pos % 4], dks[s][pos],
                                       atol=2e-5, rtol=2e-5)
            np.testing.assert_allclose(got[2][:, table[s, pos // 4], pos % 4], dvs[s][pos],
                                       atol=2e-5, rtol=2e-5)


def test_sharding_rules_split_the_parents_like_the_tokens():
    from jax.sharding import PartitionSpec as P
    mesh = {"data": 2, "model": 2}
    r = fnattn.sharding.rules(mode="ragged_paged", batch="data", heads="model", mesh=mesh,
                              shapes=dict(draft_parents=(16,), num_seqs=(2,)))
    assert r.draft_parents == P("data") and r.query_start_loc == P("data")
    r = fnattn.sharding.rules(mode="paged", batch="data", mesh=mesh,
                              shapes=dict(draft_parents=(4, 3)))
    assert r.draft_parents == P("data", None)
    with pytest.raises(ValueError, match="draft_parents"):
        fnattn.sharding.rules(mode="ragged_paged", batch="data", mesh=mesh,
                              shapes=dict(draft_parents=(15,)))
