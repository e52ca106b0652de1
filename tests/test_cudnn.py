"""impl="cudnn": a delegate to jax.nn.dot_product_attention.

On this machine jax.nn takes its XLA path (``platform_dependent`` picks cuDNN only
when lowering for CUDA); the results must match the reference wherever jax.nn
can express the spec, including fnattn's own guarantees that jax.nn lacks
(zero rows with ``lse = -inf`` where no key is visible, gradients through ``lse``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, cudnn, masks

rs = np.random.default_rng(0)
B, T, HQ, HKV, D = 2, 7, 6, 2, 8
Q = jnp.asarray(rs.standard_normal((B, T, HQ, D)), jnp.float32)
K = jnp.asarray(rs.standard_normal((B, T, HKV, D)), jnp.float32)
V = jnp.asarray(rs.standard_normal((B, T, HKV, D)), jnp.float32)
BIAS = jnp.asarray(rs.standard_normal((1, HQ, T, T)), jnp.float32)

MASKS = {
    "none": None,
    "causal": masks.causal(),
    "causal_window": masks.causal() & masks.sliding_window(left=2),
    "two_sided_window": masks.sliding_window(left=1, right=2),
    "lengths": masks.lengths(jnp.array([7, 3]), jnp.array([5, 0])),
    "segments": masks.segments(jnp.array([[0, 0, 0, 1, 1, 1, 1], [0] * 7])),
    "prefix": masks.prefix_lm(jnp.array([2, 5])),
    "causal_or_chunk": masks.causal() | masks.chunked(3),
    "two_lengths": (masks.lengths(kv_lengths=jnp.array([6, 2]))
                    & masks.lengths(kv_lengths=jnp.array([3, 7]))),
    "causal_lengths_two_sided_window": (masks.causal() & masks.sliding_window(left=2, right=1)
                                        & masks.lengths(q_lengths=jnp.array([7, 5]))),
}


def _loss(attn, spec, w_out, w_lse):
    def f(q, k, v, bias):
        r = attn(spec.replace(bias=bias), q, k, v)
        return jnp.sum(r.out * w_out) + jnp.sum(jnp.where(jnp.isfinite(r.lse), r.lse, 0) * w_lse)
    return f


@pytest.mark.parametrize("name", list(MASKS))
def test_forward_and_gradients_match_the_reference(name):
    spec = AttentionSpec(mask=MASKS[name], bias=BIAS, impl="cudnn")
    res = jax.jit(fnattn.attention)(spec, Q, K, V)
    ref = jax.jit(fnattn.reference)(spec, Q, K, V)
    np.testing.assert_array_equal(np.isneginf(np.asarray(res.lse)), np.isneginf(np.asarray(ref.lse)))
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(res.lse), np.asarray(ref.lse), atol=1e-5)
    w_out = jnp.asarray(rs.standard_normal(Q.shape), jnp.float32)
    w_lse = jnp.asarray(rs.standard_normal((B, HQ, T)), jnp.float32)
    g = jax.jit(jax.grad(_loss(fnattn.attention, spec, w_out, w_lse), argnums=(0, 1, 2, 3)))(
        Q, K, V, BIAS)
    gr = jax.jit(jax.grad(_loss(fnattn.reference, spec, w_out, w_lse), argnums=(0, 1, 2, 3)))(
        Q, K, V, BIAS)
    for n, a, b in zip(("dq", "dk", "dv", "dbias"), g, gr):
        assert np.isfinite(np.asarray(a)).all(), n
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, err_msg=n)


@pytest.mark.parametrize("shape", [(T, T), (1, 1), (HQ, T, T), (B, 1, 1, T)])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_a_bias_of_lower_rank_broadcasts(shape, mask):
    """A bias of rank 2 or 3, or with broadcast axes, as for every lowering (a 2-D
    bias once raised an axis error here, with and without a mask), with a -inf
    entry: forward and gradients match the reference."""
    bias = jnp.asarray(rs.standard_normal(shape), jnp.float32)
    bias = bias.at[(0,) * (len(shape) - 1) + (-1,)].set(-jnp.inf) if shape[-1] > 1 else bias
    spec = AttentionSpec(mask=MASKS[mask], bias=bias, impl="cudnn")
    res = jax.jit(fnattn.attention)(spec, Q, K, V)
    ref = jax.jit(fnattn.reference)(spec, Q, K, V)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(res.lse), np.asarray(ref.lse), atol=1e-5)
    w_out = jnp.asarray(rs.standard_normal(Q.shape), jnp.float32)
    g = jax.jit(jax.grad(_loss(fnattn.attention, spec, w_out, 0.0), argnums=(0, 1, 2)))(
        Q, K, V, bias)
    gr = jax.jit(jax.grad(_loss(fnattn.reference, spec, w_out, 0.0), argnums=(0, 1, 2)))(
        Q, K, V, bias)
    for n, a, b in zip(("dq", "dk", "dv"), g, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, err_msg=n)


def test_rows_that_see_no_key_are_zero_with_lse_minus_inf():
    spec = AttentionSpec(mask=masks.lengths(q_lengths=jnp.array([7, 4]),
                                            kv_lengths=jnp.array([0, 7])), impl="cudnn")
    res = jax.jit(fnattn.attention)(spec, Q, K, V)
    np.testing.assert_array_equal(np.asarray(res.out[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(res.out[1, 4:]), 0.0)
    assert np.isneginf(np.asarray(res.lse[0])).all() and np.isneginf(np.asarray(res.lse[1, :, 4:])).all()
    assert np.isfinite(np.asarray(res.lse[1, :, :4])).all()


def test_only_lse_gradient_and_only_out_gradient():
    spec = AttentionSpec(mask=masks.causal(), impl="cudnn")
    for pick in (lambda r: r.out.sum(), lambda r: r.lse.sum()):
        g = jax.jit(jax.grad(lambda q: pick(fnattn.attention(spec, q, K, V))))(Q)
        gr = jax.jit(jax.grad(lambda q: pick(fnattn.reference(spec, q, K, V))))(Q)
        np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=1e-5)


def test_second_order_through_lse_matches_the_reference():
    """A Hessian-vector product of a loss on out and lse: JAX differentiates the
    delegate's backward, lse's part included (``cudnn._lse_vjp``, whose row
    maximum is a constant shift), on jax.nn's XLA path here."""
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(left=3), bias=BIAS,
                         impl="cudnn")
    w_out = jnp.asarray(rs.standard_normal(Q.shape), jnp.float32)
    w_lse = jnp.asarray(rs.standard_normal((B, HQ, T)), jnp.float32)
    t = jnp.asarray(rs.standard_normal(Q.shape), jnp.float32)

    def hvp(attn):
        loss = _loss(attn, spec, w_out, w_lse)
        grad = jax.grad(lambda q, k: loss(q, k, V, BIAS), argnums=(0, 1))
        return jax.jit(lambda q, k: jax.jvp(grad, (q, k), (t, jnp.zeros_like(k)))[1])(Q, K)

    for n, a, b in zip(("q", "k"), hvp(fnattn.attention), hvp(fnattn.reference)):
        assert np.isfinite(np.asarray(a)).all(), n
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4,
                                   err_msg=n)


def test_causal_with_more_keys_than_queries_uses_bottom_right_alignment():
    # jax.nn's is_causal aligns top-left; fnattn passes such masks as dense arrays
    k = jnp.asarray(rs.standard_normal((B, 11, HKV, D)), jnp.float32)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(left=3), impl="cudnn")
    res = jax.jit(fnattn.attention)(spec, Q, k, k)
    ref = jax.jit(fnattn.reference)(spec, Q, k, k)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=1e-5)


def test_native_forms_are_used_where_jax_nn_has_them():
    dims = fnattn._checks.Dims(B, T, T, HQ, HKV, D, D)
    kw = cudnn._native_mask(masks.causal() & masks.sliding_window(left=2), dims)
    assert kw == {"is_causal": True, "local_window_size": (2, 0)}
    kw = cudnn._native_mask(masks.lengths(kv_lengths=jnp.array([3, 4])), dims)
    assert set(kw) == {"key_value_seq_lengths"}
    assert cudnn._native_mask(masks.segments(jnp.zeros((B, T), jnp.int32)), dims) is None
    # under causal a window's right side is irrelevant; without causal jax.nn has none
    kw = cudnn._native_mask(masks.causal() & masks.sliding_window(left=2, right=3), dims)
    assert kw == {"is_causal": True, "local_window_size": (2, 0)}
    assert cudnn._native_mask(masks.sliding_window(left=2, right=3), dims) is None
    # two masks of one kind cannot both be passed to jax.nn
    two = masks.lengths(kv_lengths=jnp.array([3, 4])) & masks.lengths(kv_lengths=jnp.array([5, 1]))
    assert cudnn._native_mask(two, dims) is None
    # alignment differs when Tq != Tk
    assert cudnn._native_mask(masks.causal(), dims._replace(kv_len=11)) is None


def test_bhtd_layout_and_bfloat16():
    spec = AttentionSpec(mask=masks.causal(), impl="cudnn", layout="bhtd")
    qt, kt, vt = (jnp.swapaxes(x, 1, 2).astype(jnp.bfloat16) for x in (Q, K, V))
    res = jax.jit(fnattn.attention)(spec, qt, kt, vt)
    ref = jax.jit(fnattn.reference)(spec, qt, kt, vt)
    assert res.out.dtype == jnp.bfloat16 and res.out.shape == (B, HQ, T, D)
    assert res.lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(res.out, np.float32), np.asarray(ref.out, np.float32),
                               atol=3e-2)
    np.testing.assert_allclose(np.asarray(res.lse), np.asarray(ref.lse), atol=5e-2)


@pytest.mark.parametrize("spec,v,feature", [
    (AttentionSpec(softcap=5.0, impl="cudnn"), V, "softcap"),
    (AttentionSpec(sinks=jnp.zeros(6), impl="cudnn"), V, "sinks"),
    (AttentionSpec(dropout_rate=0.1, dropout_key=jax.random.key(0), impl="cudnn"), V, "dropout"),
    (AttentionSpec(impl="cudnn"), V[..., :3], "a value head dim Dv=3 different from D=8"),
])
def test_unsupported_features_are_named(spec, v, feature):
    with pytest.raises(NotImplementedError) as info:
        jax.jit(fnattn.attention)(spec, Q, K, v)
    assert str(info.value) == (
        f"impl='cudnn' (jax.nn.dot_product_attention) cannot express: {feature}. "
        "Use impl='auto' (flash) or impl='xla', which support them.")


def test_every_unsupported_feature_is_listed_at_once():
    spec = AttentionSpec(softcap=5.0, sinks=jnp.zeros(6), impl="cudnn")
    with pytest.raises(NotImplementedError, match="cannot express: softcap, sinks."):
        jax.jit(fnattn.attention)(spec, Q, K, V)


def test_lowering_for_cuda_selects_cudnn_when_available():
    # Tracing jax.nn's cuDNN branch needs cuDNN; without it the delegate keeps the
    # XLA branch, and lowering for CUDA must still not fail on the host side.
    spec = AttentionSpec(mask=masks.causal(), impl="cudnn")
    traced = jax.jit(lambda q: fnattn.attention(spec, q, K, V).out).trace(Q)
    text = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "custom_call" not in text or "cudnn" not in text
