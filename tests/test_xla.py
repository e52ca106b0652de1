"""The dense XLA lowering (``impl="xla"``) against float64 NumPy and the reference.

It runs behind the dispatch's custom_vjp, so gradients here exercise the
lowering's own backward (``xla._backward``), including the ``lse`` cotangent.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, _dispatch, core, masks, xla
from cases import CASES, EXTRA_CASES, check_case, make
from np_attention import np_attention_grads, reduce_to

ALL = CASES + EXTRA_CASES


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _ids(c):
    return c.name


def test_xla_is_the_only_lowering_of_impl_xla():
    assert core.lowering_table("xla") == (("default", xla.DENSE),)
    assert isinstance(xla.DENSE, _dispatch.Lowering)


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_matches_numpy_forward_and_gradients(case):
    # forward for every case; gradients (q, k, v, bias, sinks; through out and lse)
    # for the float32 ones, in the same compiled function
    check_case(fnattn.attention, case, impl="xla")


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_equals_reference_forward_and_every_gradient(layout):
    case = [c for c in CASES if c.name == "everything"][0]
    spec, q, k, v, _ = make(case, impl="xla", layout=layout)
    ref_spec = spec.replace(impl="reference")
    rs = np.random.default_rng(2)
    w_out = jnp.asarray(rs.standard_normal(q.shape[:-1] + (case.Dv,)), jnp.float32)
    w_lse = jnp.asarray(rs.standard_normal((case.B, case.Hq, case.Tq)), jnp.float32)

    def loss(spec):
        def f(q, k, v, bias, sinks):
            r = fnattn.attention(spec.replace(bias=bias, sinks=sinks), q, k, v)
            return jnp.sum(r.out * w_out) + jnp.sum(jnp.where(jnp.isfinite(r.lse), r.lse, 0) * w_lse)
        return f

    args = (q, k, v, spec.bias, spec.sinks)
    a = jax.jit(jax.value_and_grad(loss(spec), argnums=(0, 1, 2, 3, 4)))(*args)
    b = jax.jit(jax.value_and_grad(loss(ref_spec), argnums=(0, 1, 2, 3, 4)))(*args)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 6e-2), ("float16", 1e-2)])
def test_low_precision_gradients_stay_close_to_float32(dtype, tol):
    # the lowering multiplies in the input dtype with float32 accumulation
    rs = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rs.standard_normal(s), jnp.float32)
               for s in ((2, 7, 6, 5), (2, 11, 2, 5), (2, 11, 2, 3)))
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.zeros(6), impl="xla")

    def grads(q, k, v):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(
            fnattn.attention(spec, q, k, v).out.astype(jnp.float32) ** 2),
            argnums=(0, 1, 2)))(q, k, v)

    low = grads(*(x.astype(dtype) for x in (q, k, v)))
    high = grads(q, k, v)
    for lo, hi in zip(low, high):
        assert lo.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(f64(lo), f64(hi), atol=tol, rtol=tol)


def test_bias_gradient_keeps_the_broadcast_shape():
    rs = np.random.default_rng(4)
    q = jnp.asarray(rs.standard_normal((2, 5, 3, 7)), jnp.float32)
    for shape in [(5, 5), (1, 3, 1, 5), (2, 1, 5, 5), (3, 5, 5), (2, 3, 5, 5)]:
        bias = jnp.asarray(rs.standard_normal(shape), jnp.float32)
        g = jax.jit(jax.grad(lambda b: fnattn.attention(
            AttentionSpec(bias=b, impl="xla"), q, q, q).out.sum()))(bias)
        ref = np_attention_grads(f64(q), f64(q), f64(q), np.ones((2, 5, 3, 7)),
                                 bias=np.broadcast_to(np.asarray(bias), (2, 3, 5, 5)))
        assert g.shape == shape
        np.testing.assert_allclose(np.asarray(g), reduce_to(ref["dbias"], shape), atol=1e-5)


def test_dropout_uses_the_same_keep_mask_as_the_reference():
    case = [c for c in ALL if c.name == "dropout_array_sinks_bias"][0]
    spec, q, k, v, _ = make(case, impl="xla")
    a = jax.jit(fnattn.attention)(spec, q, k, v)
    b = jax.jit(fnattn.reference)(spec, q, k, v)
    np.testing.assert_allclose(np.asarray(a.out), np.asarray(b.out), atol=1e-6)
    # a different key gives a different result
    c = jax.jit(fnattn.attention)(spec.replace(dropout_key=jax.random.key(99)), q, k, v)
    assert not np.allclose(np.asarray(a.out), np.asarray(c.out))
