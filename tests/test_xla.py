"""The dense XLA lowering (``impl="xla"``) against float64 NumPy and the reference.

It runs behind the dispatch's custom_jvp, so gradients here exercise the
lowering's own backward (``xla._backward``), including the ``lse`` cotangent.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, _dispatch, core, masks, xla
from cases import CASES, EXTRA_CASES, assert_float64_equals, check_case, make, vjp
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
            lse = jnp.where(jnp.isfinite(r.lse), r.lse, 0)
            return jnp.sum(r.out * w_out) + jnp.sum(lse * w_lse)
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2)])
def test_low_precision_forward_runs_on_this_cpu_in_both_layouts(dtype, layout, Hq, Hkv):
    # XLA's CPU runtime refused some of the dense forward's bfloat16 products
    # ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"),
    # e.g. "bhtd" inputs with B, Hkv > 1: the products now take float32
    # operands on the CPU (exact for bfloat16 and float16 values).
    rs = np.random.default_rng(7)
    B, T, D = 2, 24, 16
    shape = {"bthd": lambda H: (B, T, H, D), "bhtd": lambda H: (B, H, T, D)}[layout]
    q, k, v = (jnp.asarray(rs.standard_normal(shape(H)), dtype) for H in (Hq, Hkv, Hkv))
    spec = AttentionSpec(mask=masks.causal(), layout=layout, impl="xla", return_lse=True)
    got = jax.jit(fnattn.attention)(spec, q, k, v)
    want = jax.jit(fnattn.reference)(spec.replace(impl="reference"),
                                      *(x.astype(jnp.float32) for x in (q, k, v)))
    assert got.out.dtype == jnp.dtype(dtype)
    # (the weights are rounded to the input dtype before they meet V)
    np.testing.assert_allclose(f64(got.out), f64(want.out), atol=2e-2)
    np.testing.assert_allclose(f64(got.lse), f64(want.lse), atol=1e-4, rtol=1e-4)


def _dot_operand_types(text):
    """The operand element types of every ``stablehlo.dot_general`` in ``text``."""
    return {tuple(re.findall(r"x(bf16|f16|f32)>", line.split(":")[-1].split("->")[0]))
            for line in text.splitlines() if "stablehlo.dot_general" in line}


def test_dense_forward_multiplies_narrow_operands_except_on_the_cpu():
    q = jnp.ones((2, 2, 8, 16), jnp.bfloat16)
    spec = AttentionSpec(layout="bhtd", impl="xla")
    traced = jax.jit(lambda q: fnattn.attention(spec, q, q, q).out).trace(q)
    types = {plat: _dot_operand_types(traced.lower(lowering_platforms=(plat,)).as_text())
             for plat in ("cpu", "cuda", "tpu")}
    assert types == {"cpu": {("f32", "f32")}, "cuda": {("bf16", "bf16")},
                     "tpu": {("bf16", "bf16")}}, types


def test_dense_forward_never_holds_the_logits_keys_first():
    # The products run in the logits' (B, Hkv, G, Tq, Tk) order: with q as
    # "bqhgd" XLA's CPU computed them as (Hkv, Tk, G * Tq) and transposed the
    # weights back for P @ V, 4x the time at 2048 tokens (the (Tq, Tk) arrays
    # of a compiled program here have distinct sizes, so the order shows).
    B, Tq, Tk, Hq, Hkv, D = 1, 512, 768, 4, 2, 64
    q = jnp.ones((B, Tq, Hq, D))
    k = v = jnp.ones((B, Tk, Hkv, D))
    for mask in (None, masks.causal()):
        spec = AttentionSpec(mask=mask, impl="xla")
        text = jax.jit(lambda q, k, v: fnattn.attention(spec, q, k, v).out).lower(
            q, k, v).compile().as_text()
        shapes = set(re.findall(r"\[([0-9,]+)\]", text))
        assert any(s.endswith(f"{Tq},{Tk}") for s in shapes), sorted(shapes)
        keys_first = {s for s in shapes if re.search(rf"(^|,){Tk},({Tq}|{2 * Tq})$", s)}
        assert not keys_first, keys_first


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


def test_float16_gradients_do_not_overflow_with_large_cotangents():
    # dO.V beyond float16's 65504 (loss scaling): the backward accumulates in float32
    # and only the gradients are rounded to float16.
    rs = np.random.default_rng(5)
    q, k = (jnp.asarray(rs.standard_normal(s), jnp.float32) for s in ((2, 7, 6, 5), (2, 11, 2, 5)))
    v = jnp.asarray(rs.standard_normal((2, 11, 2, 3)) * 2, jnp.float32)
    d_out = jnp.asarray(rs.standard_normal((2, 7, 6, 3)) * 8e3, jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((2, 6, 7)) * 8e3, jnp.float32)
    bias = jnp.asarray(rs.standard_normal((6, 7, 11)), jnp.float32)
    spec = AttentionSpec(mask=masks.causal(), bias=bias, sinks=jnp.zeros(6), impl="xla")
    h = jnp.float16
    _, g = vjp(fnattn.attention, spec.replace(bias=bias.astype(h)),
                *(x.astype(h) for x in (q, k, v, d_out)), d_lse)
    _, r = vjp(fnattn.reference, spec,
                *(x.astype(h).astype(jnp.float32) for x in (q, k, v, d_out)), d_lse)
    for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsinks"), g, r):
        a = f64(a)
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a / np.abs(b).max(), f64(b) / np.abs(b).max(), atol=2e-3,
                                   err_msg=name)


def test_float64_inputs_compute_in_float64_under_x64():
    rs = np.random.default_rng(6)
    q, k, v, d_out = (rs.standard_normal(s) for s in ((2, 7, 6, 5), (2, 11, 2, 5), (2, 11, 2, 3),
                                                       (2, 7, 6, 3)))
    d_lse = rs.standard_normal((2, 6, 7))
    bias, sinks = rs.standard_normal((6, 7, 11)), rs.standard_normal(6)
    mask = masks.lengths(kv_lengths=jnp.array([5, 11])) & masks.causal()
    allowed = np.tril(np.ones((7, 11), bool), 4)[None, None] & (np.arange(11) < np.array(
        [5, 11])[:, None, None, None])
    want = np_attention_grads(q, k, v, d_out, d_lse, bias=bias[None], sinks=sinks, mask=allowed,
                              softcap=2.0)
    with jax.enable_x64(True):
        spec = AttentionSpec(mask=mask, bias=jnp.asarray(bias), sinks=jnp.asarray(sinks),
                             softcap=2.0, impl="xla")
        (out, lse), g = vjp(fnattn.attention, spec, *(jnp.asarray(x) for x in
                                                       (q, k, v, d_out, d_lse)))
        # float32 inputs: float32 arithmetic, as without x64
        spec32 = spec.replace(bias=jnp.asarray(bias, jnp.float32),
                              sinks=jnp.asarray(sinks, jnp.float32))
        args32 = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, d_out, d_lse))
        x32 = vjp(fnattn.attention, spec32, *args32)
    base = vjp(fnattn.attention, spec32, *args32)
    assert_float64_equals(out, lse, g, want)
    for a, b in zip(jax.tree_util.tree_leaves(x32), jax.tree_util.tree_leaves(base)):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)


def test_dense_attention_refuses_late_normalisation_with_the_weights():
    from fnattn.reference import dense_attention
    x = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match="return_weights needs the normalised weights"):
        dense_attention(x, x, x, bias=None, sinks=None, mask=None, seed=None, scale=1.0,
                        softcap=None, dropout_rate=0.0, upcast=True, return_weights=True,
                        late_normalize=True)
