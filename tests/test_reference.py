"""fnattn.reference against an independent float64 NumPy attention (tests/np_attention.py).

The reference is the ground truth of every other test, so it is checked here
feature by feature, forward and backward (through ``out`` and ``lse``), with
distinct prime sizes so that a swapped axis fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks
from cases import CASES, EXTRA_CASES, assert_float64_equals, check_case, make, to_bthd
from np_attention import np_attention, np_attention_grads

ALL = CASES + EXTRA_CASES


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _ids(c):
    return c.name


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_matches_numpy_forward_and_gradients(case):
    # forward for every case; gradients (q, k, v, bias, sinks; through out and lse)
    # for the float32 ones, in the same compiled function
    check_case(fnattn.reference, case, impl="reference")


@pytest.mark.parametrize("case", [c for c in ALL if c.name in ("everything", "gqa3", "dv_larger")],
                         ids=_ids)
def test_layout_bhtd_is_bthd_transposed(case):
    spec, q, k, v, _ = make(case, impl="reference")
    spec_t, qt, kt, vt, _ = make(case, impl="reference", layout="bhtd")
    assert qt.shape == (case.B, case.Hq, case.Tq, case.D)
    a = jax.jit(fnattn.reference)(spec, q, k, v)
    b = jax.jit(fnattn.reference)(spec_t, qt, kt, vt)
    assert b.out.shape == (case.B, case.Hq, case.Tq, case.Dv)
    # the same arithmetic up to XLA's fusion choices
    np.testing.assert_allclose(np.asarray(to_bthd(b.out, "bhtd")), np.asarray(a.out), atol=1e-6)
    np.testing.assert_allclose(np.asarray(b.lse), np.asarray(a.lse), atol=1e-6)


def test_default_scale_is_inverse_sqrt_head_dim():
    rs = np.random.default_rng(2)
    q = jnp.asarray(rs.standard_normal((2, 5, 3, 7)), jnp.float32)
    f = jax.jit(fnattn.reference)
    a = f(AttentionSpec(), q, q, q)
    b = f(AttentionSpec(scale=7 ** -0.5), q, q, q)
    c = f(AttentionSpec(scale=1.0), q, q, q)
    np.testing.assert_array_equal(np.asarray(a.out), np.asarray(b.out))
    assert not np.allclose(np.asarray(a.out), np.asarray(c.out))


def test_gqa_uses_kv_head_of_the_group_without_repeating():
    # query head h reads kv head h // (Hq // Hkv): the same as repeating k and v
    rs = np.random.default_rng(3)
    q = jnp.asarray(rs.standard_normal((2, 5, 6, 3)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((2, 7, 2, 3)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((2, 7, 2, 11)), jnp.float32)
    spec = AttentionSpec(mask=masks.causal())
    a = jax.jit(fnattn.reference)(spec, q, k, v)
    b = jax.jit(fnattn.reference)(spec, q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2))
    np.testing.assert_allclose(np.asarray(a.out), np.asarray(b.out), atol=1e-6)
    # and not the interleaved assignment h % Hkv
    c = jax.jit(fnattn.reference)(spec, q, jnp.tile(k, (1, 1, 3, 1)), jnp.tile(v, (1, 1, 3, 1)))
    assert not np.allclose(np.asarray(a.out), np.asarray(c.out), atol=1e-3)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows_give_zeros_and_finite_gradients(with_sinks):
    B, Tq, Tk, Hq, Hkv, D = 2, 7, 5, 3, 1, 11
    rs = np.random.default_rng(4)
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    sinks = jnp.array([0.5, -1.0, 2.0]) if with_sinks else None
    # batch 0 sees no key at all; in batch 1 causal alignment (Tq > Tk) hides the
    # first Tq - Tk = 2 rows
    mask = masks.lengths(kv_lengths=jnp.array([0, Tk])) & masks.causal()
    spec = AttentionSpec(mask=mask, softcap=5.0, bias=jnp.zeros((Tq, Tk)), sinks=sinks)
    res = jax.jit(fnattn.reference)(spec, q, k, v)
    dead = np.zeros((B, Tq), bool)
    dead[0] = True
    dead[1, :2] = True
    np.testing.assert_array_equal(np.asarray(res.out)[dead], 0.0)
    lse = np.asarray(res.lse).transpose(0, 2, 1)  # (B, Tq, Hq)
    if with_sinks:
        np.testing.assert_allclose(lse[dead], np.broadcast_to(sinks, lse[dead].shape), rtol=1e-6)
    else:
        assert np.isneginf(lse[dead]).all()
    assert np.isfinite(lse[~dead]).all()

    def loss(q, k, v, bias, sinks):
        r = fnattn.reference(spec.replace(bias=bias, sinks=sinks), q, k, v)
        return jnp.sum(r.out ** 2) + jnp.sum(jnp.where(jnp.isfinite(r.lse), r.lse, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, spec.bias, sinks)
    for g in jax.tree_util.tree_leaves(grads):
        assert np.isfinite(np.asarray(g)).all()
    # a row that sees nothing gets no gradient into q
    np.testing.assert_array_equal(np.asarray(grads[0])[dead], 0.0)


def test_return_weights():
    case = [c for c in ALL if c.name == "dropout_array_sinks_bias"][0]
    spec, q, k, v, kw = make(case, impl="reference")
    res, w = jax.jit(lambda s, q, k, v: fnattn.reference(s, q, k, v, return_weights=True))(
        spec, q, k, v)
    _, _, internals = np_attention(f64(q), f64(k), f64(v), **kw)
    assert w.shape == (case.B, case.Hq, case.Tq, case.Tk) and w.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(w), internals["pd"], atol=1e-5)
    # the weights reproduce the output
    v_rep = np.repeat(f64(v), case.Hq // case.Hkv, axis=2)
    np.testing.assert_allclose(np.einsum("bhqk,bkhd->bqhd", np.asarray(w, np.float64), v_rep),
                               f64(res.out), atol=1e-5)
    # without dropout, each row sums to 1 minus the sink's share; masked weights are 0
    nodrop = spec.replace(dropout_rate=0.0, dropout_key=None)
    _, w0 = jax.jit(lambda s: fnattn.reference(s, q, k, v, return_weights=True))(nodrop)
    w0 = np.asarray(w0)
    assert (w0[~np.broadcast_to(kw["mask"], w0.shape)] == 0).all()
    _, _, it = np_attention(f64(q), f64(k), f64(v), **{**kw, "keep": None, "rate": 0.0})
    np.testing.assert_allclose(w0.sum(-1), 1.0 - it["psink"], atol=1e-5)


def test_sinks_enter_lse_once_and_parts_merge_without_them():
    # lse includes the sink; parts over disjoint key ranges are merged by adding the
    # sink once as a part with out = 0 and lse = sink (docs/spec_and_masks.md).
    rs = np.random.default_rng(5)
    B, Tq, Tk, Hq, Hkv, D = 2, 5, 13, 6, 3, 7
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    sinks = jnp.asarray(rs.standard_normal((Hq,)), jnp.float32)
    f = jax.jit(fnattn.reference)
    full = f(AttentionSpec(sinks=sinks), q, k, v)
    nosink = f(AttentionSpec(), q, k, v)
    np.testing.assert_allclose(np.asarray(full.lse),
                               np.logaddexp(np.asarray(nosink.lse), np.asarray(sinks)[:, None]),
                               rtol=1e-6)
    split = 6
    a = f(AttentionSpec(), q, k[:, :split], v[:, :split])
    b = f(AttentionSpec(), q, k[:, split:], v[:, split:])
    sink_lse = jnp.broadcast_to(sinks[None, :, None], a.lse.shape)
    lse = jnp.logaddexp(jnp.logaddexp(a.lse, b.lse), sink_lse)

    def w(part_lse):
        return jnp.swapaxes(jnp.exp(part_lse - lse), 1, 2)[..., None]

    out = w(a.lse) * a.out + w(b.lse) * b.out
    np.testing.assert_allclose(np.asarray(lse), np.asarray(full.lse), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full.out), rtol=1e-5, atol=1e-5)


def test_softcap_bounds_every_logit():
    q = jnp.full((1, 3, 2, 5), 100.0)
    k = jnp.ones((1, 11, 2, 5))
    res = jax.jit(fnattn.reference)(AttentionSpec(softcap=4.0), q, k, k)
    # every logit is capped just below 4: lse = 4 + log(11) up to tanh's rounding
    np.testing.assert_allclose(np.asarray(res.lse), 4.0 + np.log(11.0), rtol=1e-5)


def test_bias_broadcasts_in_both_layouts():
    rs = np.random.default_rng(6)
    q = jnp.asarray(rs.standard_normal((2, 5, 3, 7)), jnp.float32)
    bias = jnp.asarray(rs.standard_normal((3, 5, 5)), jnp.float32)  # (Hq, Tq, Tk)
    a = jax.jit(fnattn.reference)(AttentionSpec(bias=bias), q, q, q)
    qt = jnp.swapaxes(q, 1, 2)
    b = jax.jit(fnattn.reference)(AttentionSpec(bias=bias, layout="bhtd"), qt, qt, qt)
    out, _, _ = np_attention(f64(q), f64(q), f64(q), bias=np.asarray(bias)[None])
    np.testing.assert_allclose(f64(a.out), out, atol=1e-5)
    np.testing.assert_allclose(f64(jnp.swapaxes(b.out, 1, 2)), out, atol=1e-5)


def test_dtypes_compute_in_float32_and_return_q_dtype():
    rs = np.random.default_rng(7)
    q32 = jnp.asarray(rs.standard_normal((1, 7, 2, 5)), jnp.float32)
    ref = jax.jit(fnattn.reference)(AttentionSpec(mask=masks.causal()), q32, q32, q32)
    for dt, tol in ((jnp.bfloat16, 3e-2), (jnp.float16, 4e-3)):
        q = q32.astype(dt)
        res = jax.jit(fnattn.reference)(AttentionSpec(mask=masks.causal()), q, q, q)
        assert res.out.dtype == dt and res.lse.dtype == jnp.float32
        # the only rounding is of the inputs and the output: compare with the
        # float32 result of the rounded inputs
        exact = jax.jit(fnattn.reference)(AttentionSpec(mask=masks.causal()),
                                          *(q.astype(jnp.float32),) * 3)
        np.testing.assert_allclose(f64(res.out), f64(exact.out), atol=tol / 4, rtol=tol / 4)
        np.testing.assert_allclose(np.asarray(res.lse), np.asarray(exact.lse), rtol=1e-6)
        np.testing.assert_allclose(f64(res.out), f64(ref.out), atol=tol, rtol=tol)


def test_return_lse_false():
    q = jnp.ones((1, 3, 2, 5))
    res = jax.jit(fnattn.reference)(AttentionSpec(return_lse=False), q, q, q)
    assert res.lse is None and res.out.shape == q.shape


# --- issue 9: non-finite masked keys, infinite sinks, float64 -------------------------

# Sizes of the cases below: batch 1's keys 0..2 are segment 0, 3..5 segment 1, 6
# segment 2 (no query has it); batch 0 sees 4 keys (lengths).
_B, _TQ, _TK, _HQ, _HKV, _D = 2, 5, 7, 4, 2, 3
_SEG_MASK = (masks.lengths(kv_lengths=jnp.array([4, 7]))
             & masks.segments(jnp.array([[0] * 5, [0, 0, 1, 1, 1]]),
                              jnp.array([[0] * 7, [0, 0, 0, 1, 1, 1, 2]])))


def _seg_allowed():
    allowed = np.zeros((_B, 1, _TQ, _TK), bool)
    allowed[0, :, :, :4] = True
    for qi, sq in enumerate([0, 0, 1, 1, 1]):
        allowed[1, 0, qi] = np.array([0, 0, 0, 1, 1, 1, 2]) == sq
    return allowed


def _qkv(rs, dtype=np.float32):
    q = rs.standard_normal((_B, _TQ, _HQ, _D)).astype(dtype)
    k = rs.standard_normal((_B, _TK, _HKV, _D)).astype(dtype)
    v = rs.standard_normal((_B, _TK, _HKV, _D)).astype(dtype)
    return q, k, v


def _vjp(spec, q, k, v, d_out, d_lse, sinks=None):
    """(out, lse), (dq, dk, dv, dbias, dsinks) of fnattn.reference, one compiled call."""
    def f(q, k, v, bias, sinks):
        r = fnattn.reference(spec.replace(bias=bias, sinks=sinks), q, k, v)
        return r.out, r.lse

    def run(q, k, v, bias, sinks, d_out, d_lse):
        res, vjp = jax.vjp(f, q, k, v, bias, sinks)
        return res, vjp((d_out, d_lse))

    return jax.jit(run)(q, k, v, spec.bias, sinks, d_out, d_lse)


def test_non_finite_masked_keys_contribute_nothing_per_row():
    rs = np.random.default_rng(11)
    q, k, v = _qkv(rs)
    bias = rs.standard_normal((_B, _HQ, _TQ, _TK)).astype(np.float32)
    d_out = rs.standard_normal(q.shape).astype(np.float32)
    d_lse = rs.standard_normal((_B, _HQ, _TQ)).astype(np.float32)
    allowed = _seg_allowed()
    want = np_attention_grads(q, k, v, d_out, d_lse, bias=bias, mask=allowed)
    # Poison only keys that no row may see: past batch 0's length, segment 2 of batch 1.
    kp, vp = k.copy(), v.copy()
    kp[0, 4, 0, 1] = np.nan
    vp[0, 5, 1, 0] = np.inf
    kp[0, 6, :, :] = -np.inf
    kp[1, 6, 1, 2] = np.nan
    vp[1, 6, 0, :] = np.nan
    spec = AttentionSpec(mask=_SEG_MASK, bias=jnp.asarray(bias))
    (out, lse), (dq, dk, dv, dbias, _) = _vjp(spec, q, kp, vp, d_out, d_lse)
    np.testing.assert_allclose(np.asarray(out), want["out"], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want["lse"], atol=1e-5, rtol=1e-5)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        np.testing.assert_allclose(np.asarray(g), want[name], atol=1e-5, rtol=1e-5,
                                   err_msg=name)
    # A row that does see a non-finite key is NaN, honestly, and only that row:
    # batch 1's key 1 (segment 0, kv head 0) is seen by rows 0, 1 of query heads 0, 1.
    vp[1, 1, 0, 2] = np.nan
    (out, lse), (dq, *_) = _vjp(spec, q, kp, vp, d_out, d_lse)
    nan_rows = np.zeros((_B, _HQ, _TQ), bool)
    nan_rows[1, :2, :2] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), nan_rows)
    out_rows = np.isnan(np.asarray(out)).any(-1).transpose(0, 2, 1)
    np.testing.assert_array_equal(out_rows, nan_rows)
    clean = ~nan_rows
    np.testing.assert_allclose(np.asarray(lse)[clean], want["lse"][clean], atol=1e-5, rtol=1e-5)
    dq_clean = clean.transpose(0, 2, 1)
    np.testing.assert_allclose(np.asarray(dq)[dq_clean], want["dq"][dq_clean], atol=1e-5,
                               rtol=1e-5)


def test_infinite_sinks_forward_and_gradients():
    # Head 0: +inf (takes all the mass), heads 1 and 3: -inf (no sink), head 2: finite;
    # batch 0's rows see 4 keys, batch 1's rows 2..4 none (lengths).
    rs = np.random.default_rng(12)
    q, k, v = _qkv(rs)
    sinks = np.array([np.inf, -np.inf, 0.3, -np.inf], np.float32)
    mask = masks.lengths(q_lengths=jnp.array([5, 2]), kv_lengths=jnp.array([4, 7]))
    allowed = np.zeros((_B, 1, _TQ, _TK), bool)
    allowed[0, :, :, :4] = True
    allowed[1, :, :2, :] = True
    d_out = rs.standard_normal(q.shape).astype(np.float32)
    d_lse = rs.standard_normal((_B, _HQ, _TQ)).astype(np.float32)
    spec = AttentionSpec(mask=mask)
    (out, lse), (dq, dk, dv, _, dsinks) = _vjp(spec, q, k, v, d_out, d_lse,
                                               jnp.asarray(sinks))
    # The model: head 0 as if it had no sink and no cotangent, then out 0, lse +inf.
    inf_head = np.isposinf(sinks)
    keep = ~inf_head[None, None, :, None]
    want = np_attention_grads(q, k, v, d_out * keep, d_lse * keep[..., 0].transpose(0, 2, 1),
                              mask=allowed, sinks=np.where(inf_head, -np.inf, sinks))
    want["out"][:, :, inf_head] = 0.0
    want["lse"][:, inf_head] = np.inf
    want["dsinks"][inf_head] = d_lse[:, inf_head].sum((0, 2))
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv),
                    ("dsinks", dsinks)):
        x = np.asarray(x)
        assert not np.isnan(x).any(), name
        np.testing.assert_allclose(x, want[name], atol=1e-5, rtol=1e-5, err_msg=name)
    # fully masked rows without a sink: out 0, lse -inf
    assert np.isneginf(np.asarray(lse)[1, 1, 2:]).all()


def test_float64_inputs_compute_in_float64():
    rs = np.random.default_rng(13)
    q, k, v = _qkv(rs, np.float64)
    bias = rs.standard_normal((_HQ, _TQ, _TK))
    sinks = rs.standard_normal(_HQ)
    d_out = rs.standard_normal(q.shape)
    d_lse = rs.standard_normal((_B, _HQ, _TQ))
    want = np_attention_grads(q, k, v, d_out, d_lse, bias=bias[None], sinks=sinks,
                              mask=_seg_allowed(), softcap=2.0)
    with jax.enable_x64(True):
        spec = AttentionSpec(mask=_SEG_MASK, bias=jnp.asarray(bias), softcap=2.0)
        (out, lse), grads = _vjp(spec, *(jnp.asarray(x) for x in (q, k, v, d_out, d_lse)),
                                 sinks=jnp.asarray(sinks))
        assert_float64_equals(out, lse, grads, want)
        # float32 inputs under x64: float32 arithmetic, lse float32, as without x64
        q32, k32, v32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
        r = jax.jit(fnattn.reference)(AttentionSpec(mask=_SEG_MASK), q32, k32, v32)
        assert r.out.dtype == r.lse.dtype == jnp.float32
    r0 = jax.jit(fnattn.reference)(AttentionSpec(mask=_SEG_MASK), q32, k32, v32)
    np.testing.assert_array_equal(np.asarray(r.out), np.asarray(r0.out))
    np.testing.assert_array_equal(np.asarray(r.lse), np.asarray(r0.lse))
