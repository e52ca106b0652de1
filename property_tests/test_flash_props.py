"""Fuzzed problems: ``fnattn.flash`` (the blockwise XLA lowering) against float64 NumPy.

Block sizes are drawn too, small and not dividing the sequence lengths, so that
every problem has several tiles per axis, ragged last tiles, and (through the
mask) EMPTY, PARTIAL and FULL tiles in the same call.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import fnattn
from fnattn import XlaBlockSizes, position_bias
from np_attention import np_attention, np_attention_grads, reduce_to
from strategies import examples, problems
from test_attention_props import check_forward_mode

block_sizes = st.builds(XlaBlockSizes, block_q=st.integers(1, 8), block_k=st.integers(1, 8),
                        block_q_bwd=st.one_of(st.none(), st.integers(1, 8)),
                        block_k_bwd=st.one_of(st.none(), st.integers(1, 8)))


def bthd(x, layout):
    x = jnp.asarray(x, jnp.float32)
    return np.asarray(x if layout == "bthd" else jnp.swapaxes(x, 1, 2), np.float64)


@examples(8)
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


@examples(6)
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


@examples(6)
@given(problems(impl="xla"), block_sizes, st.integers(0, 1000))
def test_forward_mode_matches_float64_numpy(p, bs, seed):
    # The tangent pass of the blockwise lowering, on tiles of every kind.
    check_forward_mode(dataclasses.replace(p, spec=p.spec.replace(block_sizes=bs)),
                       fnattn.flash, seed)


@examples(4)
@given(problems(impl="xla"), block_sizes, st.integers(0, 1000))
def test_second_order_matches_the_reference(p, bs, seed):
    # Hessian-vector products (forward over reverse, and reverse over reverse)
    # of a loss of out and lse in q, k, v, bias and sinks, against the same
    # transformations of fnattn.reference (plain JAX autodiff in float32).
    spec = p.spec.replace(block_sizes=bs)
    rs = np.random.default_rng(seed)
    primals = (p.q, p.k, p.v, spec.bias, spec.sinks)
    w_out = jnp.asarray(rs.standard_normal(p.q.shape[:-1] + (p.v.shape[-1],)), jnp.float32)
    w_lse = jnp.asarray(rs.standard_normal((p.dims[0], p.dims[3], p.dims[1])), jnp.float32)
    direction = tuple(None if x is None else jnp.asarray(rs.standard_normal(x.shape), x.dtype)
                      for x in primals)

    def hvps(fn):
        def loss(*args):
            q, k, v, bias, sinks = args
            r = fn(spec.replace(bias=bias, sinks=sinks), q, k, v)
            lse = jnp.where(jnp.isfinite(r.lse), r.lse, 0.0)
            return jnp.sum(jnp.sin(r.out) * w_out) + jnp.sum(jnp.tanh(lse) * w_lse)

        grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
        fwd_rev = jax.jvp(lambda *a: grad(*a), primals, direction)[1]
        inner = lambda *a: sum(jnp.vdot(g, d) for g, d in zip(grad(*a), direction)  # noqa: E731
                               if d is not None)
        rev_rev = jax.grad(inner, argnums=(0, 1, 2, 3, 4))(*primals)
        return fwd_rev, rev_rev

    got, want = jax.jit(lambda: (hvps(fnattn.flash), hvps(fnattn.reference)))()
    for g_tree, w_tree in zip(got, want):
        for name, g, w in zip(("q", "k", "v", "bias", "sinks"), g_tree, w_tree):
            if g is None:
                continue
            assert np.isfinite(np.asarray(g)).all(), name
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-4, rtol=5e-4,
                                       err_msg=name)


@examples(5)
@given(problems(impl="xla", layouts=("bthd",)), block_sizes, block_sizes)
def test_block_sizes_do_not_change_the_result(p, bs1, bs2):
    f = jax.jit(fnattn.flash)
    a = f(p.spec.replace(block_sizes=bs1), p.q, p.k, p.v)
    b = f(p.spec.replace(block_sizes=bs2), p.q, p.k, p.v)
    r = jax.jit(fnattn.reference)(p.spec, p.q, p.k, p.v)
    for x in (a, b):
        np.testing.assert_allclose(np.asarray(x.out), np.asarray(r.out), atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(x.lse), np.asarray(r.lse), atol=2e-5, rtol=2e-5)


@st.composite
def position_terms(draw, B, Hq):
    """``(kind, arrays)``: ALiBi with drawn slopes, or KERPLE's logarithmic term
    with drawn positive parameters per head or per (row, head)."""
    rs = np.random.default_rng(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(["alibi", "kerple"]))
    if kind == "alibi":
        return kind, (rs.uniform(0.0, 1.0, Hq).astype(np.float32),)
    shape = draw(st.sampled_from([(Hq,), (B, Hq)]))
    return kind, (rs.uniform(0.2, 2.0, Hq).astype(np.float32),
                  rs.uniform(0.1, 1.5, shape).astype(np.float32))


def _kerple(b, h, q, k, r1, r2):
    return -r1 * jnp.log1p(r2 * jnp.abs(q - k))


def _term_parts(kind, arrays, B, Hq, Tq, Tk):
    """The term as a float64 (B, Hq, Tq, Tk) bias, and its derivative with
    respect to each array's entries, as arrays of the same shape (one per array)."""
    dist = np.abs(np.arange(Tq)[:, None] + (Tk - Tq) - np.arange(Tk)[None, :]).astype(np.float64)
    per = [np.broadcast_to(np.asarray(a, np.float64).reshape(
        (-1 if a.ndim == 2 else 1, Hq, 1, 1)), (B, Hq, 1, 1)) for a in arrays]
    if kind == "alibi":
        (s,) = per
        return -s * dist, [-dist + 0 * s]
    r1, r2 = per
    return -r1 * np.log1p(r2 * dist), [-np.log1p(r2 * dist), -r1 * dist / (1 + r2 * dist)]


@examples(5)
@given(problems(impl="xla", layouts=("bthd",), dropout=False), block_sizes, st.data())
def test_position_terms_and_their_gradients_match_float64_numpy(p, bs, data):
    """In-kernel position terms (ALiBi, KERPLE) against the same logits as a
    float64 bias: out, lse, dq, dk, dv, and the gradients of the term's arrays
    (summed dbias times the term's derivative)."""
    B, Tq, Tk, Hq, Hkv, D, Dv = p.dims
    kind, arrays = data.draw(position_terms(B, Hq))
    build = (position_bias.alibi if kind == "alibi"
             else lambda *a: position_bias.from_fn(_kerple, *a))
    rs = np.random.default_rng(Tq * 31 + Tk)
    d_out = jnp.asarray(rs.standard_normal((B, Tq, Hq, Dv)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((B, Hq, Tq)), jnp.float32)

    def f(q, k, v, *arrays):
        spec = p.spec.replace(block_sizes=bs, position_bias=build(*arrays))
        r = fnattn.flash(spec, q, k, v)
        lse = jnp.where(jnp.isfinite(r.lse), r.lse, 0.0)
        return jnp.sum(r.out * d_out) + jnp.sum(lse * d_lse), r

    n = len(arrays)
    (_, res), g = jax.jit(jax.value_and_grad(f, argnums=tuple(range(3 + n)), has_aux=True))(
        p.q, p.k, p.v, *(jnp.asarray(a) for a in arrays))
    term, dterm = _term_parts(kind, arrays, B, Hq, Tq, Tk)
    kw = dict(p.np_kwargs)
    kw["bias"] = term if kw.get("bias") is None else np.asarray(kw["bias"], np.float64) + term
    q, k, v = (np.asarray(x, np.float64) for x in (p.q, p.k, p.v))
    out, lse, _ = np_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(res.out), out, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(res.lse), lse, atol=1e-4, rtol=1e-4)
    ref = np_attention_grads(q, k, v, np.asarray(d_out), np.asarray(d_lse), **kw)
    for name, x in zip(("dq", "dk", "dv"), g[:3]):
        np.testing.assert_allclose(np.asarray(x), ref[name], atol=2e-4, rtol=2e-4, err_msg=name)
    dbias = ref["dbias"]  # (B, Hq, Tq, Tk), before any reduction to the bias's shape
    for i, (a, dt, x) in enumerate(zip(arrays, dterm, g[3:])):
        want = reduce_to((dbias * dt).sum((2, 3), keepdims=True),
                         (B, Hq, 1, 1) if a.ndim == 2 else (1, Hq, 1, 1)).reshape(a.shape)
        np.testing.assert_allclose(np.asarray(x), want, atol=1e-3, rtol=1e-3,
                                   err_msg=f"{kind} array {i}")
