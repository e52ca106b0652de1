"""impl="cudnn": a delegate to jax.nn.dot_product_attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks

rs = np.random.default_rng(0)
Q = jnp.asarray(rs.standard_normal((2, 7, 6, 8)), jnp.float32)
K = jnp.asarray(rs.standard_normal((2, 7, 2, 8)), jnp.float32)


@pytest.mark.parametrize("mask", [
    None, masks.causal(), masks.causal() & masks.sliding_window(left=2),
    masks.lengths(jnp.array([7, 3]), jnp.array([5, 7])),
    masks.segments(jnp.array([[0, 0, 0, 1, 1, 1, 1], [0] * 7])),
])
def test_matches_reference_where_expressible(mask):
    spec = AttentionSpec(mask=mask, bias=jnp.asarray(rs.standard_normal((1, 6, 7, 7)), jnp.float32),
                         impl="cudnn")
    res = jax.jit(fnattn.attention)(spec, Q, K, K)
    ref = jax.jit(fnattn.reference)(spec, Q, K, K)
    valid = np.isfinite(np.asarray(ref.lse))
    # jax.nn leaves fully padded query rows unspecified; compare the valid ones
    np.testing.assert_allclose(np.asarray(res.out)[np.swapaxes(valid, 1, 2)],
                               np.asarray(ref.out)[np.swapaxes(valid, 1, 2)], atol=1e-5)
    np.testing.assert_allclose(np.asarray(res.lse)[valid], np.asarray(ref.lse)[valid], atol=1e-5)


def test_gradient_flows():
    spec = AttentionSpec(mask=masks.causal(), impl="cudnn")
    g = jax.jit(jax.grad(lambda q: fnattn.attention(spec, q, K, K).out.sum()))(Q)
    gr = jax.jit(jax.grad(lambda q: fnattn.reference(spec, q, K, K).out.sum()))(Q)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=1e-5)


@pytest.mark.parametrize("spec,v,feature", [
    (AttentionSpec(softcap=5.0, impl="cudnn"), K, "softcap"),
    (AttentionSpec(sinks=jnp.zeros(6), impl="cudnn"), K, "sinks"),
    (AttentionSpec(dropout_rate=0.1, dropout_key=jax.random.key(0), impl="cudnn"), K, "dropout"),
    (AttentionSpec(impl="cudnn"), K[..., :3], "Dv=3 different from D=8"),
])
def test_unsupported_features_are_named(spec, v, feature):
    with pytest.raises(NotImplementedError, match=feature) as info:
        jax.jit(fnattn.attention)(spec, Q, K, v)
    assert "impl='auto'" in str(info.value)
