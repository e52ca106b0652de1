"""The XLA lowering of flash attention against float64 NumPy and the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, XlaBlockSizes, masks
from fnattn.flash import blocks, xla
from cases import CASES, make, tolerance, vjp
from lowering import cheap_compiles
from np_attention import np_attention, np_attention_grads, reduce_to

# Blocks that do not divide the test sizes (7, 11): ragged last tiles everywhere.
SMALL = XlaBlockSizes(block_q=4, block_k=8, block_q_bwd=8, block_k_bwd=4)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _check_forward(res, case, q, k, v, kw):
    out, lse, _ = np_attention(f64(q), f64(k), f64(v), **kw)
    tol = tolerance(case.dtype) * 10
    assert res.out.dtype == q.dtype and res.lse.dtype == jnp.float32
    np.testing.assert_allclose(f64(res.out), out, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(res.lse), lse, atol=tol, rtol=tol)


# (float32 forwards are checked by the gradient test, from the same compiled call)
@pytest.mark.parametrize("case", [c for c in CASES if c.dtype != "float32"],
                         ids=lambda c: c.name)
def test_forward_matches_numpy(case):
    spec, q, k, v, kw = make(case, impl="xla")
    res = jax.jit(fnattn.flash)(spec.replace(block_sizes=SMALL), q, k, v)
    _check_forward(res, case, q, k, v, kw)


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "float32"], ids=lambda c: c.name)
def test_forward_and_gradients_match_numpy(case):
    spec, q, k, v, kw = make(case, impl="xla")
    spec = spec.replace(block_sizes=SMALL)
    rs = np.random.default_rng(1)
    d_out = jnp.asarray(rs.standard_normal((case.B, case.Tq, case.Hq, case.Dv)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((case.B, case.Hq, case.Tq)), jnp.float32)

    def loss(q, k, v, bias, sinks):
        res = fnattn.flash(spec.replace(bias=bias, sinks=sinks), q, k, v)
        lse = jnp.where(jnp.isfinite(res.lse), res.lse, 0.0)
        return jnp.sum(res.out * d_out) + jnp.sum(lse * d_lse), res

    g, res = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        q, k, v, spec.bias, spec.sinks)
    _check_forward(res, case, q, k, v, kw)
    ref = np_attention_grads(f64(q), f64(k), f64(v), np.asarray(d_out), np.asarray(d_lse), **kw)
    for name, x in zip(("dq", "dk", "dv"), g[:3]):
        assert np.isfinite(np.asarray(x)).all(), name
        np.testing.assert_allclose(np.asarray(x), ref[name], atol=1e-4, rtol=1e-4, err_msg=name)
    if spec.bias is not None:
        np.testing.assert_allclose(np.asarray(g[3]), reduce_to(ref["dbias"], spec.bias.shape),
                                   atol=1e-4, rtol=1e-4)
    if spec.sinks is not None:
        np.testing.assert_allclose(np.asarray(g[4]), ref["dsinks"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bq,bk", [(1, 1), (3, 5), (16, 16), (7, 11)])
def test_block_sizes_do_not_change_the_result(bq, bk):
    spec, q, k, v, _ = make(CASES[20], impl="xla")  # "everything"
    ref = jax.jit(fnattn.reference)(spec, q, k, v)
    res = jax.jit(fnattn.flash)(spec.replace(block_sizes=XlaBlockSizes(bq, bk)), q, k, v)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=2e-6)
    np.testing.assert_allclose(np.asarray(res.lse), np.asarray(ref.lse), atol=2e-6)


def test_layout_bhtd():
    spec, q, k, v, kw = make(CASES[20], impl="xla", layout="bhtd")
    res = jax.jit(fnattn.flash)(spec.replace(block_sizes=SMALL), q, k, v)
    ref = jax.jit(fnattn.reference)(spec, q, k, v)
    assert res.out.shape == (2, 6, 11, 3)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=2e-6)


def _visited(mask, P):
    fi, fn, pi, pn = xla._split_schedule(xla._classes(mask, P)[0])
    return int(fn.sum()), int(pn.sum())


def test_causal_visits_about_half_the_tiles_and_windows_fewer():
    P = xla._plan(_cfg(4096, 4096))
    full = _visited(None, P)
    causal = _visited(masks.causal(), P)
    window = _visited(masks.sliding_window(left=128), P)
    assert full == (P.nq * P.nk, 0)
    # causal: the lower triangle of FULL tiles, the tiles crossing the diagonal
    # PARTIAL (bq / bk of them per q-block when bq is a multiple of bk)
    per_row = max(1, P.bq // P.bk)
    assert causal[1] == P.nq * per_row and sum(causal) <= full[0] // 2 + causal[1]
    # a window of 128 keys: only the kv-blocks overlapping [q - 128, q] of each q-block
    assert sum(window) <= P.nq * (-(-(P.bq + 128) // P.bk) + 1)
    assert sum(window) < sum(causal) // 2


def test_full_tiles_skip_the_mask():
    c = masks.block_classes(masks.causal(), 1, 1, 64, 64, 16, 16)
    s = blocks.schedule(c)
    kinds = np.asarray(s.kind[0, 0])
    # row 3 visits kv-blocks 0, 1, 2 as FULL and 3 as PARTIAL
    np.testing.assert_array_equal(np.asarray(s.index[0, 0, 3]), [0, 1, 2, 3])
    np.testing.assert_array_equal(kinds[3], [2, 2, 2, 1])
    np.testing.assert_array_equal(np.asarray(s.count[0, 0]), [1, 2, 3, 4])


@pytest.mark.parametrize("counted", [True, False])
@pytest.mark.parametrize("transpose", [False, True])
def test_schedule_in_xla_equals_a_plain_walk(transpose, counted, monkeypatch):
    """blocks.schedule (XLA: counting for small tables, a scatter past
    blocks.COUNTED_COMPARISONS; no sort) and schedule_static (NumPy) against
    walking each row: the non-empty tiles in order, their classes, the last
    repeated past the count (0 for a row that visits nothing)."""
    if not counted:
        monkeypatch.setattr(blocks, "COUNTED_COMPARISONS", 0)
    cls = np.random.default_rng(1).choice(
        np.array([masks.EMPTY, masks.PARTIAL, masks.FULL], np.int8), (2, 3, 6, 9),
        p=[0.5, 0.25, 0.25])
    cls[1, 2, :, 4] = masks.EMPTY
    cls[0, 1, 3] = masks.EMPTY
    rows = cls.swapaxes(-1, -2) if transpose else cls
    n = rows.shape[-1]
    index = np.zeros(rows.shape, np.int32)
    kind = np.full(rows.shape, masks.EMPTY, np.int8)
    for idx in np.ndindex(rows.shape[:-1]):
        seen = np.flatnonzero(rows[idx] != masks.EMPTY)
        index[idx] = list(seen) + [seen[-1] if len(seen) else 0] * (n - len(seen))
        kind[idx][:len(seen)] = rows[idx][seen]
    traced = jax.jit(lambda c: blocks.schedule(c, transpose=transpose))(cls)
    for s in (traced, blocks.schedule_static(cls, transpose=transpose)):
        np.testing.assert_array_equal(np.asarray(s.index), index)
        np.testing.assert_array_equal(np.asarray(s.kind), kind)
        np.testing.assert_array_equal(np.asarray(s.count), (rows != masks.EMPTY).sum(-1))


def test_ranked_order_is_a_stable_sort_by_rank():
    rank = np.random.default_rng(2).integers(0, 4, (3, 2, 17))
    want = np.argsort(rank, axis=-1, kind="stable")
    for ranks in (1, 2, 3, 4):
        traced = jax.jit(lambda r: blocks.ranked_order(jnp, r, ranks))(rank)
        got = [blocks.ranked_order(np, rank, ranks), np.asarray(traced)]
        for idx in np.ndindex(rank.shape[:-1]):
            listed = (rank[idx] < ranks).sum()
            for g in got:
                np.testing.assert_array_equal(g[idx][:listed], want[idx][:listed])


def test_classes_too_large_to_embed_are_built_in_xla(monkeypatch):
    """Past blocks.EMBEDDED_TILES an array-free mask's tile classes are computed
    in XLA at every call, not embedded as a constant: the same results, forward
    and gradients."""
    import re
    rs = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rs.standard_normal((2, T, 2, 8)), jnp.float32)
               for T in (37, 45, 45))
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(11),
                         block_sizes=XlaBlockSizes(8, 8))

    def both(q, k, v):
        return fnattn.flash(spec, q, k, v), jax.grad(
            lambda q, k, v: jnp.sum(jnp.sin(fnattn.flash(spec, q, k, v).out)),
            argnums=(0, 1, 2))(q, k, v)

    # (the FULL and PARTIAL lists of the 5 q-blocks over 6 kv-blocks, as constants)
    lists = re.compile(r"stablehlo\.constant dense<[^>]*> : tensor<5x6xi32>")
    text = jax.jit(both).lower(q, k, v).as_text()
    embedded = jax.jit(both)(q, k, v)
    monkeypatch.setattr(blocks, "EMBEDDED_TILES", 0)
    jax.clear_caches()
    text_built = jax.jit(both).lower(q, k, v).as_text()
    built = jax.jit(both)(q, k, v)
    assert lists.search(text) and not lists.search(text_built)
    for a, b in zip(jax.tree_util.tree_leaves(embedded), jax.tree_util.tree_leaves(built)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _cfg(tq, tk, hq=8, hkv=8, d=64):
    from fnattn import _checks, _dispatch
    dims = _checks.Dims(1, tq, tk, hq, hkv, d, d)
    return _dispatch.Config(dims=dims, scale=d ** -0.5, softcap=None, dropout_rate=0.0,
                            mask_treedef=None)


@pytest.mark.parametrize("causal", [False, True])
def test_memory_is_linear_in_sequence_length(causal):
    H, D = 4, 32
    spec = AttentionSpec(mask=masks.causal() if causal else None,
                         block_sizes=XlaBlockSizes(256, 256))
    fwd = jax.jit(lambda q, k, v: fnattn.flash(spec, q, k, v).out)
    bwd = jax.jit(jax.grad(lambda q, k, v: fnattn.flash(spec, q, k, v).out.sum(), argnums=(0, 1, 2)))
    for f in (fwd, bwd):
        temp = {}
        for T in (2048, 4096):
            q = jax.ShapeDtypeStruct((1, T, H, D), jnp.float32)
            temp[T] = f.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
        # doubling T at most doubles the buffers (plus the fixed tiles) ...
        assert temp[4096] < 2.2 * temp[2048], temp
        # ... and stays far below one dense (T, T) logit array of all heads
        assert temp[4096] < 4096 * 4096 * H * 4 / 8, temp


def test_vmap_grad_checkpoint_scan_compose():
    rs = np.random.default_rng(0)
    x = jnp.asarray(rs.standard_normal((2, 13, 3, 5)), jnp.float32)
    ws = jnp.asarray(rs.standard_normal((3, 5, 5)) * 0.3, jnp.float32)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.zeros(3), block_sizes=SMALL)

    def run(f):
        def layer(h, w):
            y = jnp.einsum("bthd,de->bthe", h, w)
            return h + f(spec, y, y, y).out, None
        return lambda ws: jnp.sum(jax.lax.scan(jax.checkpoint(layer), x, ws)[0] ** 2)

    g = jax.jit(jax.grad(run(fnattn.flash)))(ws)
    gr = jax.jit(jax.grad(run(fnattn.reference)))(ws)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=1e-4, atol=1e-4)
    vg = jax.jit(jax.vmap(jax.grad(lambda x: fnattn.flash(spec, x, x, x).out.sum())))(x[:, None])
    vgr = jax.jit(jax.vmap(jax.grad(lambda x: fnattn.reference(spec, x, x, x).out.sum())))(
        x[:, None])
    np.testing.assert_allclose(np.asarray(vg), np.asarray(vgr), rtol=1e-4, atol=1e-4)


def test_block_size_validation():
    with pytest.raises(ValueError, match="XlaBlockSizes: block_k must be a positive int; got 0"):
        XlaBlockSizes(block_q=8, block_k=0)
    d = XlaBlockSizes.default(_cfg(8192, 8192).dims, jnp.float32)
    assert d.block_q * d.block_k * 8 * 4 <= 2**23
    assert d.block_q_bwd * d.block_k_bwd * 8 * 4 <= 2**23


def test_q_offset_aligns_queries_like_the_dense_lowering():
    # Queries at key positions 3..7 of 11 (as a chunk of a longer prefill would be).
    from fnattn import _checks, _dispatch
    from fnattn import xla as dense
    rs = np.random.default_rng(3)
    q = jnp.asarray(rs.standard_normal((2, 5, 6, 3)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((2, 11, 2, 3)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((2, 11, 2, 7)), jnp.float32)
    mask = masks.causal() & masks.sliding_window(left=4)
    leaves, treedef = jax.tree_util.tree_flatten(mask)
    cfg = _dispatch.Config(dims=_checks.Dims(2, 5, 11, 6, 2, 3, 7), scale=0.5, softcap=None,
                           dropout_rate=0.0, mask_treedef=treedef, q_offset=3,
                           block_sizes=XlaBlockSizes(2, 3))

    def run(table):
        def f(q, k, v):
            out, lse = _dispatch.attend(table, cfg, q, k, v, None, None, tuple(leaves), None)
            return jnp.sum(out * out) + jnp.sum(lse), (out, lse)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, (out, lse)), g = run((("default", xla.LOWERING),))
    (_, (out_d, lse_d)), g_d = run((("default", dense.DENSE),))
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_d), atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_d), atol=2e-6)
    for a, b in zip(g, g_d):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    # the offset matters: with the default alignment (6) the first row sees 7 keys, not 4
    assert not np.allclose(np.asarray(lse), np.asarray(
        jax.jit(fnattn.flash)(AttentionSpec(mask=mask, scale=0.5), q, k, v).lse))


def _grads(f, spec, q, k, v, d_out):
    def loss(q, k, v, bias, sinks):
        r = f(spec.replace(bias=bias, sinks=sinks), q, k, v)
        lse = jnp.where(jnp.isfinite(r.lse), r.lse, 0.0)
        return jnp.sum(r.out.astype(jnp.float32) * d_out) + jnp.sum(jnp.sin(lse))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, spec.bias, spec.sinks)


# per_row: segment ids that differ along the batch give every batch row its own
# schedule, and a bias shared by the rows then accumulates its gradient across them.
@pytest.mark.parametrize("bias_shape,per_row", [((2, 1, 7, 11), True), ((1, 6, 1, 11), True),
                                                ((7, 1), True), ((2, 6, 7, 11), False)], ids=str)
def test_bias_gradient_in_every_broadcast_shape(bias_shape, per_row):
    rs = np.random.default_rng(5)
    q = jnp.asarray(rs.standard_normal((2, 7, 6, 3)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((2, 11, 2, 3)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((2, 11, 2, 5)), jnp.float32)
    bias = jnp.asarray(rs.standard_normal(bias_shape), jnp.float32)
    mask = masks.segments(jnp.array([[0] * 3 + [1] * 4, [0] * 7]),
                          jnp.array([[0] * 5 + [1] * 6, [0] * 4 + [1] * 7])) if per_row else None
    spec = AttentionSpec(mask=mask, bias=bias, block_sizes=SMALL)
    d_out = jnp.asarray(rs.standard_normal((2, 7, 6, 5)), jnp.float32)
    g = _grads(fnattn.flash, spec, q, k, v, d_out)
    r = _grads(fnattn.reference, spec, q, k, v, d_out)
    assert g[3].shape == bias_shape
    for a, b in zip(g[:4], r[:4]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


def test_fully_masked_rows_give_zeros_and_no_nan():
    rs = np.random.default_rng(6)
    q = jnp.asarray(rs.standard_normal((2, 7, 6, 3)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((2, 11, 2, 3)), jnp.float32)
    # row 0 sees nothing past q_length 5, row 1 nothing at all; bias of -inf too
    mask = masks.lengths(jnp.array([5, 0]), jnp.array([11, 3]))
    bias = jnp.zeros((1, 1, 7, 11)).at[..., 2, :].set(-jnp.inf)
    for sinks in (None, jnp.asarray(rs.standard_normal(6), jnp.float32)):
        spec = AttentionSpec(mask=mask, bias=bias, sinks=sinks, block_sizes=SMALL)
        res = jax.jit(fnattn.flash)(spec, q, k, k)
        ref = jax.jit(fnattn.reference)(spec, q, k, k)
        dead = np.zeros((2, 7), bool)
        dead[0, 5:] = dead[1] = dead[:, 2] = True
        np.testing.assert_array_equal(np.asarray(res.out)[dead], 0.0)
        want = -np.inf if sinks is None else np.broadcast_to(np.asarray(sinks), (2, 7, 6))[dead]
        np.testing.assert_array_equal(np.asarray(res.lse).transpose(0, 2, 1)[dead], want)
        np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=2e-6)
        g = _grads(fnattn.flash, spec, q, k, k, jnp.ones((2, 7, 6, 3)))
        for x in g:
            if x is not None:
                assert np.isfinite(np.asarray(x)).all()


def test_dropout_is_bit_identical_to_the_reference_mask():
    rs = np.random.default_rng(7)
    q = jnp.asarray(rs.standard_normal((2, 13, 6, 5)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((2, 11, 3, 5)), jnp.float32)
    spec = AttentionSpec(mask=masks.causal(), dropout_rate=0.4, dropout_key=jax.random.key(3),
                         block_sizes=SMALL)
    res = jax.jit(fnattn.flash)(spec, q, k, k)
    ref = jax.jit(fnattn.reference)(spec, q, k, k)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=2e-6)
    # another key drops other weights: the outputs differ
    other = jax.jit(fnattn.flash)(spec.replace(dropout_key=jax.random.key(4)), q, k, k)
    assert np.abs(np.asarray(other.out) - np.asarray(res.out)).max() > 1e-2
    d_out = jnp.asarray(rs.standard_normal((2, 13, 6, 5)), jnp.float32)
    for a, b in zip(_grads(fnattn.flash, spec, q, k, k, d_out)[:3],
                    _grads(fnattn.reference, spec, q, k, k, d_out)[:3]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_gradients_follow_the_reference(dtype):
    case = next(c for c in CASES if c.name == "everything")
    spec, q, k, v, _ = make(case, impl="xla")
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    spec = spec.replace(block_sizes=SMALL)
    d_out = jnp.asarray(np.random.default_rng(8).standard_normal((2, 11, 6, 3)), jnp.float32)
    g = _grads(fnattn.flash, spec, q, k, v, d_out)
    r = _grads(fnattn.reference, spec, q, k, v, d_out)
    for a, b in zip(g, r):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=6e-2, rtol=6e-2)


# --- issue 9: extreme logits, infinite sinks, non-finite masked keys, x64 -------------


def _inputs(seed, B=2, Tq=13, Tk=11, Hq=4, Hkv=2, D=3, dtype=jnp.float32):
    rs = np.random.default_rng(seed)
    q, k, v, d_out = (jnp.asarray(rs.standard_normal(s), dtype) for s in
                      ((B, Tq, Hq, D), (B, Tk, Hkv, D), (B, Tk, Hkv, D), (B, Tq, Hq, D)))
    return rs, q, k, v, d_out, jnp.asarray(rs.standard_normal((B, Hq, Tq)), dtype)


def _assert_same(a, b, names, atol=2e-5):
    for name, x, y in zip(names, a, b):
        if x is None:
            assert y is None, name
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert not np.isnan(x).any(), name
        np.testing.assert_allclose(x, y, atol=atol, rtol=atol, err_msg=name)


NAMES = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")


@pytest.fixture
def _cheap():
    # compiling, not running, is most of these tests' time
    with cheap_compiles():
        yield


def test_huge_logits_on_whole_rows_match_the_reference(_cheap):
    # Whole rows of -1e30, finfo.min and -1e9 bias (the additive padding mask: all of a
    # row's float32 logits are equal, a uniform softmax) and one logit of +1e10; the
    # backward must not give "Tk times too large" gradients (lse's rounding error).
    rs, q, k, v, d_out, d_lse = _inputs(0)
    bias = np.asarray(rs.standard_normal((2, 4, 13, 11)), np.float32)
    bias[:, :, 1] = -1e30
    bias[0, :, 4] = np.finfo(np.float32).min
    bias[1, 1:3, 6] = -1e9
    bias[:, 0, 9] = -1e8
    bias[1, 2, 11, 5] = 1e10
    spec = AttentionSpec(mask=masks.causal(), bias=jnp.asarray(bias), block_sizes=SMALL)
    (out, lse), g = vjp(fnattn.flash, spec, q, k, v, d_out, d_lse)
    (out_r, lse_r), g_r = vjp(fnattn.reference, spec, q, k, v, d_out, d_lse)
    _assert_same((out, lse) + g[:4], (out_r, lse_r) + g_r[:4], NAMES, atol=1e-5)
    # with sinks the huge rows give all their mass to the sink
    sinks = jnp.asarray(rs.standard_normal(4), jnp.float32)
    (out, lse), g = vjp(fnattn.flash, spec.replace(sinks=sinks), q, k, v, d_out, d_lse)
    (out_r, lse_r), g_r = vjp(fnattn.reference, spec.replace(sinks=sinks), q, k, v, d_out,
                               d_lse)
    _assert_same((out, lse) + g, (out_r, lse_r) + g_r, NAMES, atol=1e-5)


def test_infinite_sinks_with_fully_masked_rows(_cheap):
    # +inf takes all the mass (out 0, lse +inf, d(sink) = sum of d_lse over its rows);
    # -inf is no sink (a fully masked row: out 0, lse -inf); no NaN anywhere.
    rs, q, k, v, d_out, d_lse = _inputs(1)
    mask = masks.lengths(jnp.array([13, 5]), jnp.array([7, 0]))
    bias = jnp.asarray(rs.standard_normal((4, 13, 11)), jnp.float32)
    sinks = jnp.array([jnp.inf, -jnp.inf, 0.5, -jnp.inf], jnp.float32)
    spec = AttentionSpec(mask=mask, bias=bias, sinks=sinks, block_sizes=SMALL)
    (out, lse), g = vjp(fnattn.flash, spec, q, k, v, d_out, d_lse)
    (out_r, lse_r), g_r = vjp(fnattn.reference, spec, q, k, v, d_out, d_lse)
    _assert_same((out, lse) + g, (out_r, lse_r) + g_r, NAMES)
    assert np.isposinf(np.asarray(lse)[:, 0]).all()
    assert np.isneginf(np.asarray(lse)[1, 1]).all()
    np.testing.assert_allclose(np.asarray(g[4])[0], np.asarray(d_lse)[:, 0].sum(), rtol=1e-6)


def test_non_finite_masked_keys_contribute_nothing(_cheap):
    # NaN / inf in K or V of keys past kv_lengths (batch 0) and of keys no query's
    # segment holds (batch 1), in tiles that are PARTIAL, FULL and EMPTY for
    # different q-blocks (causal, 4 x 8 / 8 x 4 tiles).
    rs, q, k, v, d_out, d_lse = _inputs(2)
    seg_q = jnp.array([[0] * 13, [0] * 6 + [1] * 7])
    seg_k = jnp.array([[0] * 11, [0] * 4 + [2] * 2 + [1] * 5])
    mask = masks.lengths(kv_lengths=jnp.array([6, 11])) & masks.segments(seg_q, seg_k) \
        & masks.causal()
    k = k.at[0, 6, 0, 1].set(jnp.nan).at[0, 9:, 1].set(jnp.inf).at[1, 4, 0].set(-jnp.inf)
    v = v.at[0, 7, 1, 2].set(jnp.nan).at[0, 10, 0].set(-jnp.inf).at[1, 5, 1, 0].set(jnp.nan)
    bias = jnp.asarray(rs.standard_normal((2, 1, 13, 11)), jnp.float32)
    spec = AttentionSpec(mask=mask, bias=bias, sinks=jnp.zeros(4), block_sizes=SMALL)
    (out, lse), g = vjp(fnattn.flash, spec, q, k, v, d_out, d_lse)
    (out_r, lse_r), g_r = vjp(fnattn.reference, spec, q, k, v, d_out, d_lse)
    _assert_same((out, lse) + g, (out_r, lse_r) + g_r, NAMES)
    # a key that some rows see: those rows are NaN (out and lse), the others are not
    # touched. Batch 1's key 2 (kv head 0) is seen by rows 4 and 5 of query heads 0, 1
    # (segment 0 is rows 0..5; causal with Tq - Tk = 2 hides it from rows 0..3).
    v = v.at[1, 2, 0, 1].set(jnp.nan)
    res = jax.jit(fnattn.flash)(spec, q, k, v)
    ref = jax.jit(fnattn.reference)(spec, q, k, v)
    bad = np.zeros((2, 4, 13), bool)
    bad[1, :2, 4:6] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(ref.lse)), bad)
    np.testing.assert_array_equal(~np.isfinite(np.asarray(res.out)).all(-1),
                                  bad.transpose(0, 2, 1))
    np.testing.assert_array_equal(np.isnan(np.asarray(res.lse)), bad)
    np.testing.assert_allclose(np.asarray(res.lse)[~bad], np.asarray(ref.lse)[~bad], atol=2e-6)


def test_x64_float32_unchanged_and_float64_in_float64(_cheap):
    rs, q, k, v, d_out, d_lse = _inputs(3, dtype=jnp.float32)
    mask = masks.segments(jnp.array([[0] * 6 + [1] * 7, [0] * 13]),
                          jnp.array([[0] * 5 + [1] * 6, [0] * 11])) & masks.causal()
    bias = rs.standard_normal((2, 4, 13, 11))
    sinks = rs.standard_normal(4)
    spec = AttentionSpec(mask=mask, bias=jnp.asarray(bias, jnp.float32),
                         sinks=jnp.asarray(sinks, jnp.float32), softcap=3.0, block_sizes=SMALL)
    base = vjp(fnattn.flash, spec, q, k, v, d_out, d_lse)
    with jax.enable_x64(True):
        x32 = vjp(fnattn.flash, spec, q, k, v, d_out, d_lse)
        f64 = lambda x: jnp.asarray(np.asarray(x), jnp.float64)  # noqa: E731
        spec64 = spec.replace(bias=jnp.asarray(bias), sinks=jnp.asarray(sinks))
        args64 = tuple(f64(x) for x in (q, k, v, d_out, d_lse))
        (out, lse), g = vjp(fnattn.flash, spec64, *args64)
        (out_r, lse_r), g_r = vjp(fnattn.reference, spec64, *args64)
    assert x32[0][0].dtype == x32[0][1].dtype == jnp.float32
    for a, b in zip(jax.tree_util.tree_leaves(x32), jax.tree_util.tree_leaves(base)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)
    assert out.dtype == lse.dtype == jnp.float64
    assert all(x.dtype == jnp.float64 for x in g)
    _assert_same((out, lse) + g, (out_r, lse_r) + g_r, NAMES, atol=1e-12)
