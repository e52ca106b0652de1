"""fnattn.attention (impl="xla" and "reference") against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks
from cases import CASES, make, to_bthd, tolerance
from np_attention import np_attention, np_attention_grads, reduce_to

IMPLS = ["xla", "reference"]


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_matches_numpy(case, impl):
    spec, q, k, v, kw = make(case, impl=impl)
    res = jax.jit(fnattn.attention)(spec, q, k, v)
    out, lse, _ = np_attention(f64(q), f64(k), f64(v), **kw)
    assert res.out.dtype == q.dtype and res.lse.dtype == jnp.float32
    assert res.out.shape == (case.B, case.Tq, case.Hq, case.Dv)
    assert res.lse.shape == (case.B, case.Hq, case.Tq)
    tol = tolerance(case.dtype)
    np.testing.assert_allclose(f64(res.out), out, atol=tol * 10, rtol=tol * 10)
    np.testing.assert_allclose(np.asarray(res.lse), lse, atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "float32"],
                         ids=lambda c: c.name)
def test_gradients_match_numpy(case, impl):
    spec, q, k, v, kw = make(case, impl=impl)
    rs = np.random.default_rng(1)
    d_out = jnp.asarray(rs.standard_normal((case.B, case.Tq, case.Hq, case.Dv)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((case.B, case.Hq, case.Tq)), jnp.float32)

    def loss(q, k, v, bias, sinks):
        res = fnattn.attention(spec.replace(bias=bias, sinks=sinks), q, k, v)
        lse = jnp.where(jnp.isfinite(res.lse), res.lse, 0.0)
        return jnp.sum(res.out * d_out) + jnp.sum(lse * d_lse)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, spec.bias, spec.sinks)
    ref = np_attention_grads(f64(q), f64(k), f64(v), np.asarray(d_out), np.asarray(d_lse), **kw)
    for name, g in zip(("dq", "dk", "dv"), grads[:3]):
        assert not np.isnan(np.asarray(g)).any(), name
        np.testing.assert_allclose(np.asarray(g), ref[name], atol=1e-4, rtol=1e-4, err_msg=name)
    if spec.bias is not None:
        np.testing.assert_allclose(np.asarray(grads[3]), reduce_to(ref["dbias"], spec.bias.shape),
                                   atol=1e-4, rtol=1e-4)
    if spec.sinks is not None:
        np.testing.assert_allclose(np.asarray(grads[4]), ref["dsinks"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_layout_bhtd_equals_bthd(impl):
    case = CASES[-3]  # "everything"
    spec, q, k, v, _ = make(case, impl=impl)
    spec_t, qt, kt, vt, _ = make(case, impl=impl, layout="bhtd")
    a = jax.jit(fnattn.attention)(spec, q, k, v)
    b = jax.jit(fnattn.attention)(spec_t, qt, kt, vt)
    assert b.out.shape == (case.B, case.Hq, case.Tq, case.Dv)
    np.testing.assert_allclose(np.asarray(to_bthd(b.out, "bhtd")), np.asarray(a.out), atol=1e-6)
    np.testing.assert_allclose(np.asarray(b.lse), np.asarray(a.lse), atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_are_zero_without_nan(impl):
    B, T, H, D = 2, 5, 3, 7
    q = jnp.ones((B, T, H, D))
    kv_lengths = jnp.array([0, 3])
    spec = AttentionSpec(mask=masks.lengths(kv_lengths=kv_lengths), impl=impl)
    res = jax.jit(fnattn.attention)(spec, q, q, q)
    assert np.all(np.asarray(res.out[0]) == 0)
    assert np.all(np.isneginf(np.asarray(res.lse[0])))
    assert np.all(np.isfinite(np.asarray(res.lse[1])))
    g = jax.jit(jax.grad(lambda x: fnattn.attention(spec, x, x, x).out.sum()))(q)
    assert np.isfinite(np.asarray(g)).all()
    # with a sink, the row is still zero and lse equals the sink
    spec2 = spec.replace(sinks=jnp.array([0.5, -1.0, 2.0]))
    res2 = jax.jit(fnattn.attention)(spec2, q, q, q)
    assert np.all(np.asarray(res2.out[0]) == 0)
    np.testing.assert_allclose(np.asarray(res2.lse[0]), np.broadcast_to([[0.5], [-1.0], [2.0]],
                                                                        (H, T)), rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_return_lse_false(impl):
    q = jnp.ones((1, 3, 2, 5))
    res = jax.jit(fnattn.attention)(AttentionSpec(return_lse=False, impl=impl), q, q, q)
    assert res.lse is None and res.out.shape == q.shape


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_batch_equals_batched_call(impl):
    case = CASES[-3]
    spec, q, k, v, _ = make(case, impl=impl)
    batched = jax.jit(fnattn.attention)(spec.replace(dropout_rate=0.0, dropout_key=None), q, k, v)
    # Split the batch into a vmapped axis of size B with per-example specs.
    seg = spec.mask.b  # the segments part of causal & segments
    per_spec = spec.replace(
        dropout_rate=0.0, dropout_key=None,
        mask=masks.causal() & masks.segments(seg.q_segment_ids[:, None], seg.kv_segment_ids[:, None]))
    axes = jax.tree_util.tree_map(lambda _: None, per_spec)
    axes = axes.replace(mask=masks.causal() & masks.segments(0, 0))
    f = jax.jit(jax.vmap(fnattn.attention, in_axes=(axes, 0, 0, 0)))
    res = f(per_spec, q[:, None], k[:, None], v[:, None])
    np.testing.assert_allclose(np.asarray(res.out[:, 0]), np.asarray(batched.out), atol=1e-6)
    np.testing.assert_allclose(np.asarray(res.lse[:, 0]), np.asarray(batched.lse), atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_checkpoint_and_scan_over_layers(impl):
    B, T, H, D, L = 2, 7, 3, 5, 3
    rs = np.random.default_rng(0)
    x = jnp.asarray(rs.standard_normal((B, T, H, D)), jnp.float32)
    ws = jnp.asarray(rs.standard_normal((L, D, D)) * 0.3, jnp.float32)
    spec = AttentionSpec(mask=masks.causal(), impl=impl)

    def layer(h, w):
        y = jnp.einsum("bthd,de->bthe", h, w)
        return h + fnattn.attention(spec, y, y, y).out, None

    def loss(ws, remat):
        f = jax.checkpoint(layer) if remat else layer
        return jnp.sum(jax.lax.scan(f, x, ws)[0] ** 2)

    g1 = jax.jit(jax.grad(lambda w: loss(w, True)))(ws)
    g2 = jax.jit(jax.grad(lambda w: loss(w, False)))(ws)
    ref_spec = spec.replace(impl="reference")

    def ref_loss(ws):
        def layer_ref(h, w):
            y = jnp.einsum("bthd,de->bthe", h, w)
            return h + fnattn.reference(ref_spec, y, y, y).out, None
        return jnp.sum(jax.lax.scan(layer_ref, x, ws)[0] ** 2)

    g3 = jax.jit(jax.grad(ref_loss))(ws)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g3), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(g2), np.asarray(g3), rtol=1e-4, atol=1e-4)


def test_bias_gradient_broadcast_shapes():
    rs = np.random.default_rng(3)
    q = jnp.asarray(rs.standard_normal((2, 5, 3, 7)), jnp.float32)
    for shape in [(5, 5), (1, 3, 1, 5), (2, 1, 5, 5), (2, 3, 5, 5)]:
        bias = jnp.asarray(rs.standard_normal(shape), jnp.float32)

        def loss(b, impl):
            return fnattn.attention(AttentionSpec(bias=b, impl=impl), q, q, q).out.sum()

        g = jax.jit(jax.grad(lambda b: loss(b, "xla")))(bias)
        gr = jax.jit(jax.grad(lambda b: loss(b, "reference")))(bias)
        assert g.shape == shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=1e-5)
