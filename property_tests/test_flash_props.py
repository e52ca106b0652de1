"""Fuzzed problems: ``fnattn.flash`` (the blockwise XLA lowering) against float64 NumPy.

Block sizes are drawn too, small and not dividing the sequence lengths, so that
every problem has several tiles per axis, ragged last tiles, and (through the
mask) EMPTY, PARTIAL and FULL tiles in the same call.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import fnattn
from fnattn import XlaBlockSizes
from np_attention import np_attention, np_attention_grads, reduce_to
from strategies import problems

block_sizes = st.builds(XlaBlockSizes, block_q=st.integers(1, 8), block_k=st.integers(1, 8),
                        block_q_bwd=st.one_of(st.none(), st.integers(1, 8)),
                        block_k_bwd=st.one_of(st.none(), st.integers(1, 8)))


def bthd(x, layout):
    x = jnp.asarray(x, jnp.float32)
    return np.asarray(x if layout == "bthd" else jnp.swapaxes(x, 1, 2), np.float64)


@settings(max_examples=8)
@given(problems(dtypes=("float32", "bfloat16", "float16"), impl="xla"), block_sizes)
def test_forward_matches_float64_numpy(p, bs):
    spec = p.spec.replace(block_sizes=bs)
    res = jax.jit(fnattn.flash)(spec, p.q, p.k, p.v)
    lay = spec.layout
    out, lse, _ = np_attention(bthd(p.q, lay), bthd(p.k, lay), bthd(p.v, lay), **p.np_kwargs)
    assert res.out.dtype == p.q.dtype and res.lse.dtype == jnp.float32
    tol = 1e-4 if p.q.dtype == jnp.float32 else 6e-2
    np.testing.assert_allclose(bthd(res.out, lay), out, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(res.lse), lse, atol=tol, rtol=tol)


@settings(max_examples=6)
@given(problems(impl="xla"), block_sizes, st.integers(0, 1000))
def test_gradients_match_float64_numpy(p, bs, seed):
    spec = p.spec.replace(block_sizes=bs)
    lay = spec.layout
    rs = np.random.default_rng(seed)
    B, Tq, Tk, Hq, Hkv, D, Dv = p.dims
    d_out = jnp.asarray(rs.standard_normal((B, Tq, Hq, Dv)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((B, Hq, Tq)), jnp.float32)
    d_out_l = d_out if lay == "bthd" else jnp.swapaxes(d_out, 1, 2)

    def loss(q, k, v, bias, sinks):
        r = fnattn.flash(spec.replace(bias=bias, sinks=sinks), q, k, v)
        lse = jnp.where(jnp.isfinite(r.lse), r.lse, 0.0)
        return jnp.sum(r.out * d_out_l) + jnp.sum(lse * d_lse)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(p.q, p.k, p.v, spec.bias, spec.sinks)
    ref = np_attention_grads(bthd(p.q, lay), bthd(p.k, lay), bthd(p.v, lay), np.asarray(d_out),
                             np.asarray(d_lse), **p.np_kwargs)
    for name, x in zip(("dq", "dk", "dv"), g[:3]):
        assert np.isfinite(np.asarray(x)).all(), name
        np.testing.assert_allclose(bthd(x, lay), ref[name], atol=2e-4, rtol=2e-4, err_msg=name)
    if spec.bias is not None:
        np.testing.assert_allclose(np.asarray(g[3]), reduce_to(ref["dbias"], spec.bias.shape),
                                   atol=2e-4, rtol=2e-4, err_msg="dbias")
    if spec.sinks is not None:
        np.testing.assert_allclose(np.asarray(g[4]), ref["dsinks"], atol=2e-4, rtol=2e-4,
                                   err_msg="dsinks")


@settings(max_examples=5)
@given(problems(impl="xla", layouts=("bthd",)), block_sizes, block_sizes)
def test_block_sizes_do_not_change_the_result(p, bs1, bs2):
    f = jax.jit(fnattn.flash)
    a = f(p.spec.replace(block_sizes=bs1), p.q, p.k, p.v)
    b = f(p.spec.replace(block_sizes=bs2), p.q, p.k, p.v)
    r = jax.jit(fnattn.reference)(p.spec, p.q, p.k, p.v)
    for x in (a, b):
        np.testing.assert_allclose(np.asarray(x.out), np.asarray(r.out), atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(x.lse), np.asarray(r.lse), atol=2e-5, rtol=2e-5)
