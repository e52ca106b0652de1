"""fnattn.position_bias: ALiBi and position terms computed inside the kernels.

Every lowering that takes a term is checked against the reference (forward and
gradients), and the reference against the same term written out as a bias
array; the variants and lowerings that do not compute a term refuse it.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, core, masks, position_bias, xla
from fnattn._checks import Dims
from fnattn._dispatch import Config
from fnattn.flash import cudnn, mosaic, mosaic_gpu, mosaic_gpu_bwd, triton
from lowering import cheap_compiles, gpu_target, tpu_target

TRITON = (("default", triton.INTERPRET_LOWERING),)
MOSAIC = (("default", mosaic.INTERPRET_LOWERING),)


def _qkv(B, Tq, Tk, Hq, Hkv, D, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, Tk, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, Tk, Hkv, D), dtype)
    d_out = jax.random.normal(ks[3], (B, Tq, Hq, D), jnp.float32)
    return q, k, v, d_out


def _bloom_slopes(n):
    """ALiBi's slopes as the BLOOM code computes them (an independent check)."""
    closest = 2 ** int(np.floor(np.log2(n)))
    base = 2.0 ** (-(2.0 ** -(np.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != n:
        extra = 2.0 ** (-(2.0 ** -(np.log2(2 * closest) - 3)))
        slopes += [extra ** p for p in range(1, 2 * (n - closest) + 1, 2)]
    return np.asarray(slopes, np.float32)


@pytest.mark.parametrize("n", [1, 2, 4, 6, 8, 12, 16, 40])
def test_alibi_slopes_are_the_papers(n):
    np.testing.assert_allclose(position_bias.alibi_slopes(n), _bloom_slopes(n), rtol=1e-6)


def _explicit(term, B, Hq, Tq, Tk):
    """The term written out as a (B, Hq, Tq, Tk) bias, with NumPy."""
    b, h, q, k = np.meshgrid(np.arange(B), np.arange(Hq), np.arange(Tq), np.arange(Tk),
                             indexing="ij")
    pos = masks.Positions(b=jnp.asarray(b), h=jnp.asarray(h), q=jnp.asarray(q),
                          q_pos=jnp.asarray(q + Tk - Tq), k=jnp.asarray(k))
    return jnp.broadcast_to(term.value(pos, term.operands()), (B, Hq, Tq, Tk))


@pytest.mark.parametrize("Tq,Tk", [(12, 12), (5, 12)])
def test_reference_adds_the_term_as_a_bias_before_the_cap(Tq, Tk):
    B, Hq, Hkv, D = 2, 4, 2, 8
    q, k, v, _ = _qkv(B, Tq, Tk, Hq, Hkv, D)
    slopes = jnp.asarray(position_bias.alibi_slopes(Hq)) * 8
    term = position_bias.alibi(slopes) + position_bias.from_fn(
        lambda b, h, q, k: jnp.where((k + b) % 3 == 0, 0.7, 0.0) * (h + 1))
    # ALiBi by hand: -slope * |aligned q - k|
    qpos = np.arange(Tq)[:, None] + (Tk - Tq)
    alibi = -np.asarray(slopes)[:, None, None] * np.abs(qpos - np.arange(Tk)[None, :])
    np.testing.assert_allclose(_explicit(position_bias.alibi(slopes), B, Hq, Tq, Tk),
                               np.broadcast_to(alibi, (B, Hq, Tq, Tk)), rtol=1e-6)
    for mask in (None, masks.causal()):
        spec = AttentionSpec(mask=mask, softcap=4.0, bias=jnp.full((Tk,), 0.25))
        got = jax.jit(fnattn.reference)(spec.replace(position_bias=term), q, k, v)
        want = jax.jit(fnattn.reference)(
            spec.replace(bias=spec.bias + _explicit(term, B, Hq, Tq, Tk)), q, k, v)
        np.testing.assert_allclose(got.out, want.out, atol=1e-6)
        np.testing.assert_allclose(got.lse, want.lse, atol=1e-6)


def _call(table, spec, q, k, v, impl=None):
    """(out, lse) of one lowering table, through the API (``impl``), or the reference."""
    if impl is not None:
        res = fnattn.attention(spec.replace(impl=impl), q, k, v)
    elif table is None:
        res = fnattn.reference(spec, q, k, v)
    else:
        res = core.run(spec, q, k, v, fn="flash", table=table)
    return res.out, res.lse


def _pulled(f, args, d_out):
    """(out, lse, *cotangents of args) of ``f(*args) -> (out, lse)``."""
    (out, lse), pull = jax.vjp(f, *args)
    d_lse = jnp.where(jnp.isfinite(lse), jnp.cos(lse), 0.0)
    return (out, lse) + pull((d_out.astype(out.dtype), d_lse))


def _grads(table, spec, q, k, v, d_out, impl=None):
    """(out, lse, dq, dk, dv) of one lowering table (``impl``: or through the API)."""
    return _pulled(lambda q, k, v: _call(table, spec, q, k, v, impl), (q, k, v), d_out)


def _check(got, want, tol):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol, err_msg=name)


SLOPES4 = jnp.asarray(position_bias.alibi_slopes(4)) * 4


def _segments(B, T):
    ids = np.repeat(np.arange(3), [T // 2, T // 3, T - T // 2 - T // 3])
    return masks.segments(jnp.asarray(np.tile(ids, (B, 1))))


# (name, mask, softcap, Tq, Tk): ragged lengths, GQA, Tq != Tk, both caps.
CASES = [
    ("none", None, None, 70, 70),
    ("causal-cap", masks.causal(), 5.0, 70, 70),
    ("segments", "segments", None, 70, 70),
    ("window-chunk", masks.causal() & masks.sliding_window(24), None, 40, 70),
]


def _spec(mask, softcap, B, T, term=None):
    if mask == "segments":
        mask = masks.causal() & _segments(B, T)
    term = position_bias.alibi(SLOPES4) if term is None else term
    return AttentionSpec(mask=mask, softcap=softcap, position_bias=term)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_xla_matches_reference(case):
    _, mask, softcap, Tq, Tk = case
    q, k, v, d_out = _qkv(2, Tq, Tk, 4, 2, 16)
    spec = _spec(mask, softcap, 2, Tk).replace(block_sizes=fnattn.XlaBlockSizes(32, 32))
    want = jax.jit(lambda *a: _grads(None, spec, *a))(q, k, v, d_out)
    got = jax.jit(lambda *a: _grads(None, spec, *a, impl="auto"))(q, k, v, d_out)
    _check(got, want, 2e-5)
    # the term changes the answer (it is not dropped on the way)
    plain = jax.jit(lambda *a: _grads(None, spec.replace(position_bias=None), *a))(q, k, v, d_out)
    assert float(jnp.abs(plain[0] - want[0]).max()) > 1e-2


def test_dense_xla_matches_reference():
    q, k, v, d_out = _qkv(2, 30, 30, 4, 2, 16)
    spec = _spec(masks.causal(), 3.0, 2, 30)
    want = jax.jit(lambda *a: _grads(None, spec, *a))(q, k, v, d_out)
    got = jax.jit(lambda *a: _grads(None, spec, *a, impl="xla"))(q, k, v, d_out)
    _check(got, want, 2e-5)


@pytest.mark.parametrize("case", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_triton_interpret_matches_reference(case):
    _, mask, softcap, Tq, Tk = case
    q, k, v, d_out = _qkv(1, Tq, Tk, 4, 2, 16)
    extra = position_bias.from_fn(lambda b, h, q, k: jnp.where(k % 7 == 0, 0.5, 0.0) * (h + 1))
    spec = _spec(mask, softcap, 1, Tk, position_bias.alibi(SLOPES4) + extra).replace(
        block_sizes=fnattn.TritonBlockSizes(32, 32))
    with cheap_compiles():
        got = jax.jit(lambda *a: _grads(TRITON, spec, *a))(q, k, v, d_out)
    want = jax.jit(lambda *a: _grads(None, spec, *a))(q, k, v, d_out)
    _check(got, want, 2e-5)


def test_mosaic_interpret_matches_reference():
    q, k, v, d_out = _qkv(1, 200, 200, 4, 2, 128)
    spec = _spec(masks.causal(), None, 1, 200).replace(
        block_sizes=fnattn.MosaicBlockSizes(128, 128))
    with cheap_compiles():
        got = jax.jit(lambda *a: _grads(MOSAIC, spec, *a))(q, k, v, d_out)
    want = jax.jit(lambda *a: _grads(None, spec, *a))(q, k, v, d_out)
    _check(got, want, 5e-5)


def test_bfloat16_flash_is_as_close_as_without_the_term():
    q, k, v, d_out = _qkv(1, 256, 256, 4, 2, 32, jnp.bfloat16)
    spec = _spec(masks.causal(), None, 1, 256)
    want = jax.jit(lambda *a: _grads(None, spec, *a))(q, k, v, d_out)
    got = jax.jit(lambda *a: _grads(None, spec, *a, impl="auto"))(q, k, v, d_out)
    _check(got[:2], want[:2], 2e-2)


def test_jvp_vmap_and_second_order():
    q, k, v, _ = _qkv(2, 40, 40, 4, 2, 8)
    spec = _spec(masks.causal(), None, 2, 40)

    def f(impl):
        return lambda q: fnattn.attention(spec.replace(impl=impl), q, k, v).out

    ref = lambda q: fnattn.reference(spec, q, k, v).out  # noqa: E731
    t = jnp.sin(q)
    _, got = jax.jit(lambda q, t: jax.jvp(f("auto"), (q,), (t,)))(q, t)
    _, want = jax.jit(lambda q, t: jax.jvp(ref, (q,), (t,)))(q, t)
    np.testing.assert_allclose(got, want, atol=2e-5)
    hvp = lambda g: jax.jit(jax.grad(lambda q: jnp.vdot(jax.grad(  # noqa: E731
        lambda q: jnp.sum(g(q) ** 2))(q), t)))(q)
    np.testing.assert_allclose(hvp(f("auto")), hvp(ref), atol=1e-4, rtol=1e-4)
    batched = jax.jit(jax.vmap(lambda q: fnattn.attention(spec, q[None], k[:1], v[:1]).out[0]))
    np.testing.assert_allclose(batched(q), fnattn.reference(spec, q, k[:1].repeat(2, 0),
                                                            v[:1].repeat(2, 0)).out, atol=2e-5)


def test_masked_poisoned_keys_contribute_nothing():
    B, T = 1, 70
    q, k, v, _ = _qkv(B, T, T, 4, 2, 16)
    lengths = jnp.array([50])
    k = k.at[:, 50:].set(jnp.nan)
    v = v.at[:, 50:].set(jnp.inf)
    spec = AttentionSpec(mask=masks.causal() & masks.lengths(kv_lengths=lengths),
                         position_bias=position_bias.alibi(SLOPES4))
    want = fnattn.reference(spec, q[:, :50], k[:, :50], v[:, :50]).out
    for impl in ("auto", "xla"):
        out = jax.jit(fnattn.attention)(spec.replace(impl=impl), q, k, v).out
        np.testing.assert_allclose(out[:, :50], want, atol=2e-5)
        assert bool(jnp.isfinite(out).all())


# ----------------------------------------------------------------------------------
# Gradients into the term's arrays (learnable ALiBi slopes)
# ----------------------------------------------------------------------------------


def _slope_grads(table, spec, q, k, v, slopes, d_out, impl=None):
    """(out, lse, dq, dk, dv, dslopes) of one lowering table, or the reference."""
    def f(q, k, v, slopes):
        s = spec.replace(position_bias=position_bias.alibi(slopes))
        return _call(table, s, q, k, v, impl)
    return _pulled(f, (q, k, v, slopes), d_out)


def _check_slopes(got, want, tol):
    *rest, dslopes = got
    _check(rest, want[:-1], tol)
    # dslopes sums Tq * Tk terms of distance-weighted dS: a relative tolerance
    np.testing.assert_allclose(dslopes, want[-1], rtol=tol * 10,
                               atol=tol * 10 * float(jnp.abs(want[-1]).max()), err_msg="dslopes")


# (name, table, impl, mask, softcap, dropout, Tq, Tk, D)
SLOPE_CASES = [
    ("flash-xla-segments", None, "auto", "segments", None, 0.0, 70, 70, 16),
    ("flash-xla-cap-dropout", None, "auto", masks.causal(), 5.0, 0.25, 40, 70, 16),
    ("dense-xla-cap", None, "xla", masks.causal(), 3.0, 0.0, 30, 30, 16),
    ("triton-segments-cap", TRITON, None, "segments", 5.0, 0.0, 70, 70, 16),
    ("triton-window", TRITON, None, masks.causal() & masks.sliding_window(24), None, 0.0,
     40, 70, 16),
    ("mosaic-causal", MOSAIC, None, masks.causal(), None, 0.0, 200, 200, 128),
]


@pytest.mark.parametrize("case", SLOPE_CASES, ids=[c[0] for c in SLOPE_CASES])
def test_slope_gradients_match_the_reference(case):
    """Every lowering that computes the term also differentiates its slopes
    (the XLA backward, the Triton and Mosaic TPU dq kernels), with dq, dk and
    dv unchanged; masks, soft-cap, dropout, GQA, ragged and Tq != Tk."""
    _, table, impl, mask, softcap, rate, Tq, Tk, D = case
    B = 1 if table is not None else 2
    q, k, v, d_out = _qkv(B, Tq, Tk, 4, 2, D)
    spec = _spec(mask, softcap, B, Tk)
    if rate:
        spec = spec.replace(dropout_rate=rate, dropout_key=jax.random.key(3))
    if impl == "auto":
        spec = spec.replace(block_sizes=fnattn.XlaBlockSizes(32, 32))
    elif table is TRITON:
        spec = spec.replace(block_sizes=fnattn.TritonBlockSizes(32, 32))
    elif table is MOSAIC:
        spec = spec.replace(block_sizes=fnattn.MosaicBlockSizes(128, 128))
    with cheap_compiles():
        got = jax.jit(lambda *a: _slope_grads(table, spec, *a, impl=impl))(
            q, k, v, SLOPES4, d_out)
    want = jax.jit(lambda *a: _slope_grads(None, spec, *a))(q, k, v, SLOPES4, d_out)
    assert float(jnp.abs(want[-1]).min()) > 1e-3  # a gradient that is there to get wrong
    _check_slopes(got, want, 5e-5 if table is MOSAIC else 2e-5)


def test_reference_slope_gradient_is_that_of_the_bias_they_make():
    q, k, v, _ = _qkv(1, 20, 20, 4, 2, 8)

    def loss(slopes):
        spec = AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(slopes))
        return jnp.sum(fnattn.reference(spec, q, k, v).out ** 2)

    dist = jnp.abs(jnp.arange(20)[:, None] - jnp.arange(20)[None, :]).astype(jnp.float32)

    def via_bias(s):
        spec = AttentionSpec(mask=masks.causal(), bias=-s[:, None, None] * dist)
        return jnp.sum(fnattn.reference(spec, q, k, v).out ** 2)

    np.testing.assert_allclose(jax.jit(jax.grad(loss))(SLOPES4),
                               jax.jit(jax.grad(via_bias))(SLOPES4), rtol=1e-5, atol=1e-6)


def test_slope_gradients_forward_mode_second_order_and_vmap():
    q, k, v, _ = _qkv(2, 40, 40, 4, 2, 8)
    base = AttentionSpec(mask=masks.causal(), softcap=4.0,
                         block_sizes=fnattn.XlaBlockSizes(16, 16))

    def out(fn, slopes, q=q):
        return fn(base.replace(position_bias=position_bias.alibi(slopes)), q, k, v).out

    t = jnp.linspace(-1.0, 1.0, 4)
    jvp = lambda fn: jax.jit(lambda s: jax.jvp(  # noqa: E731
        lambda s: out(fn, s), (s,), (t,))[1])(SLOPES4)
    np.testing.assert_allclose(jvp(fnattn.flash), jvp(fnattn.reference), atol=2e-5)

    def loss(fn, s, q=q):
        return jnp.sum(out(fn, s, q) ** 2)

    hess = lambda fn: jax.jit(jax.hessian(lambda s: loss(fn, s)))(SLOPES4)  # noqa: E731
    want = hess(fnattn.reference)
    np.testing.assert_allclose(hess(fnattn.flash), want, rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(want).max()))
    mixed = lambda fn: jax.jit(jax.grad(lambda q: jnp.sum(  # noqa: E731
        jax.grad(lambda s: loss(fn, s, q))(SLOPES4) ** 2)))(q)
    want = mixed(fnattn.reference)
    np.testing.assert_allclose(mixed(fnattn.flash), want, rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(want).max()))
    # one set of slopes per instance under vmap
    many = jnp.stack([SLOPES4, SLOPES4 * 0.5, SLOPES4 * 2.0])
    per = lambda fn: jax.jit(jax.vmap(jax.grad(lambda s: loss(fn, s))))(many)  # noqa: E731
    want = per(fnattn.reference)
    np.testing.assert_allclose(per(fnattn.flash), want, rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(want).max()))


def test_fixed_slopes_run_the_backward_without_their_gradient():
    """Only a differentiated term asks the kernels for its gradient."""
    q, k, v, _ = _qkv(1, 20, 20, 4, 2, 8)
    spec = AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(SLOPES4))

    def loss(q, slopes):
        s = spec.replace(position_bias=position_bias.alibi(slopes))
        return jnp.sum(fnattn.attention(s, q, k, v).out)

    fixed = str(jax.make_jaxpr(jax.grad(loss))(q, SLOPES4))
    learned = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, SLOPES4))
    assert "term_grad=()" in fixed and "term_grad=(" not in fixed.replace("term_grad=()", "")
    assert re.search(r"term_grad=\(\d", learned)


def _kerple(b, h, q, k, r1, r2):
    """KERPLE's logarithmic term, with learnable per-head r1, r2."""
    return -r1 * jnp.log1p(r2 * jnp.abs(q - k))


R1 = jnp.array([1.0, 0.5, 2.0, 0.25])
R2 = jnp.array([[0.5, 1.0, 0.1, 2.0], [0.3, 0.6, 0.9, 1.2]])  # per batch row and head


def _fn_grads(table, spec, q, k, v, r1, r2, d_out, impl=None):
    """(out, lse, dq, dk, dv, dr1, dr2) with a from_fn term holding arrays."""
    def f(q, k, v, r1, r2):
        s = spec.replace(position_bias=position_bias.from_fn(_kerple, r1, r2))
        return _call(table, s, q, k, v, impl)
    return _pulled(f, (q, k, v, r1, r2), d_out)


FN_CASES = [
    ("flash-xla", None, "auto", fnattn.XlaBlockSizes(32, 32), 1e-5),
    ("dense-xla", None, "xla", None, 1e-5),
    ("triton", TRITON, None, fnattn.TritonBlockSizes(32, 32), 2e-5),
    ("mosaic", MOSAIC, None, fnattn.MosaicBlockSizes(128, 128), 5e-5),
]


@pytest.mark.parametrize("case", FN_CASES, ids=[c[0] for c in FN_CASES])
def test_from_fn_with_learnable_arrays_matches_the_reference(case):
    """``from_fn(fn, *arrays)``: per-head and per-(row, head) parameters reach
    every lowering's tiles, and their gradients come back from every backward."""
    _, table, impl, bs, tol = case
    D = 128 if table is MOSAIC else 16
    q, k, v, d_out = _qkv(2, 70, 70, 4, 2, D)
    spec = AttentionSpec(mask=masks.causal() & _segments(2, 70), softcap=5.0, block_sizes=bs)
    with cheap_compiles():
        got = jax.jit(lambda *a: _fn_grads(table, spec, *a, impl=impl))(q, k, v, R1, R2, d_out)
    want = jax.jit(lambda *a: _fn_grads(None, spec, *a))(q, k, v, R1, R2, d_out)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dr1", "dr2"), got, want):
        a, b = np.asarray(a), np.asarray(b)
        scale = float(np.abs(b).max()) if name.startswith("dr") else 1.0
        np.testing.assert_allclose(a, b, rtol=10 * tol, atol=10 * tol * scale, err_msg=name)
    assert float(np.abs(np.asarray(want[-1])).min()) > 1e-3
    # the arrays matter: another r1 changes the answer
    other = jax.jit(lambda *a: _fn_grads(None, spec, *a))(q, k, v, R1 * 2, R2, d_out)
    assert float(jnp.abs(other[0] - want[0]).max()) > 1e-2


def test_from_fn_arrays_in_decode_and_paged():
    """The serving variants take per-head arrays of a ``from_fn`` term too."""
    B, S, H, Hk, D = 2, 40, 4, 2, 16
    q, k, v, _ = _qkv(B, 1, S, H, Hk, D)
    lengths = jnp.array([40, 23])
    spec = AttentionSpec(position_bias=position_bias.from_fn(_kerple, R1, R2))
    # each sequence over its own keys, with its own row of the (B, Hq) array
    want = [fnattn.reference(AttentionSpec(position_bias=position_bias.from_fn(
        _kerple, R1, R2[b])), q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
        for b, n in enumerate(lengths.tolist())]
    for impl in ("xla", "pallas"):
        with cheap_compiles():
            got = jax.jit(lambda q, k, v: fnattn.decode(  # noqa: B023
                spec.replace(impl=impl), q, k, v, kv_lengths=lengths))(q, k, v)
        for b, w in enumerate(want):
            np.testing.assert_allclose(got.out[b:b + 1], w.out, atol=2e-5, err_msg=impl)
            np.testing.assert_allclose(got.lse[b:b + 1], w.lse, atol=2e-5, err_msg=impl)
    # the paged variant, per head (its arrays are one value per head)
    ps, n_pages = 8, 5
    pool_k = k[:1, :40].reshape(n_pages, ps, Hk, D).transpose(2, 0, 1, 3)
    pool_v = v[:1, :40].reshape(n_pages, ps, Hk, D).transpose(2, 0, 1, 3)
    table = jnp.arange(n_pages, dtype=jnp.int32)[None]
    one = AttentionSpec(position_bias=position_bias.from_fn(_kerple, R1, R2[0]))
    want = fnattn.reference(one, q[:1], k[:1, :40], v[:1, :40])
    got = jax.jit(lambda q, kp, vp: fnattn.paged_attention(
        one, q, kp, vp, page_table=table, kv_lengths=jnp.array([40])))(q[:1], pool_k, pool_v)
    np.testing.assert_allclose(got.out, want.out, atol=2e-5)


def test_from_fn_arrays_are_checked_and_split_with_the_heads():
    q, k, v, _ = _qkv(2, 8, 8, 4, 2, 8)
    with pytest.raises(ValueError, match=r"from_fn\(_kerple\): array 1 must have shape "
                                         r"\(Hq,\)=\(4,\) or \(B, Hq\)=\(2, 4\).*got \(3,\)"):
        fnattn.flash(AttentionSpec(position_bias=position_bias.from_fn(
            _kerple, R1, jnp.ones(3))), q, k, v)
    with pytest.raises(TypeError, match="array 0 must be a float array"):
        fnattn.flash(AttentionSpec(position_bias=position_bias.from_fn(
            _kerple, jnp.ones(4, jnp.int32), R1)), q, k, v)
    with pytest.raises(TypeError, match=r"array 0 must be an array of shape \(Hq,\)"):
        position_bias.from_fn(_kerple, 1.0)
    spec = AttentionSpec(position_bias=position_bias.from_fn(_kerple, R1, R2))
    r = fnattn.sharding.rules(spec, batch="data", heads="model")
    assert r.spec.position_bias.arrays == (jax.sharding.PartitionSpec("model"),
                                           jax.sharding.PartitionSpec("data", "model"))


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_slope_gradients_on_one_device(strategy):
    """Ring and all-gather attention differentiate the slopes too (reverse and
    forward mode); 2 to 8 devices: tests/multi_device/context_checks.py."""
    q, k, v, _ = _qkv(2, 32, 32, 4, 2, 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    seq = jax.sharding.PartitionSpec(None, "x")

    def loss(fn, slopes, q):
        spec = AttentionSpec(mask=masks.causal(), softcap=5.0,
                             position_bias=position_bias.alibi(slopes))
        return jnp.sum(fn(spec, q) ** 2)

    def ring(spec, q):
        return jax.shard_map(
            lambda q, k, v: fnattn.context.attention(spec, q, k, v, axis_name="x",
                                                     strategy=strategy).out,
            mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)(q, k, v)

    def ref(spec, q):
        return fnattn.reference(spec, q, k, v).out

    grads = lambda fn: jax.jit(jax.grad(  # noqa: E731
        lambda s, q: loss(fn, s, q), argnums=(0, 1)))(SLOPES4, q)
    (gs, gq), (ws, wq) = grads(ring), grads(ref)
    np.testing.assert_allclose(gq, wq, atol=2e-5)
    np.testing.assert_allclose(gs, ws, rtol=1e-4, atol=1e-4 * float(jnp.abs(ws).max()))
    t = jnp.linspace(-1.0, 1.0, 4)
    jvp = lambda fn: jax.jit(lambda s: jax.jvp(  # noqa: E731
        lambda s: loss(fn, s, q), (s,), (t,))[1])(SLOPES4)
    np.testing.assert_allclose(jvp(ring), jvp(ref), rtol=1e-4)


def test_slope_gradients_refused_where_not_computed():
    q, k, v, _ = _qkv(1, 16, 16, 4, 2, 8)

    def decode(slopes):
        spec = AttentionSpec(position_bias=position_bias.alibi(slopes))
        return jnp.sum(fnattn.decode(spec, q[:, :1], k, v, kv_lengths=jnp.array([16])).out)

    with pytest.raises(NotImplementedError, match="slopes.*constants.*fnattn.attention"):
        jax.jit(jax.grad(decode))(SLOPES4)


# ----------------------------------------------------------------------------------
# Checks and refusals
# ----------------------------------------------------------------------------------


def test_bad_terms_are_refused_with_the_argument_named():
    q, k, v, _ = _qkv(1, 8, 8, 4, 2, 8)
    with pytest.raises(TypeError, match="position_bias must be an fnattn.position_bias"):
        AttentionSpec(position_bias=jnp.zeros((4,)))
    with pytest.raises(ValueError, match=r"flash: alibi: slopes must have shape \(Hq,\)=\(4,\)"
                                         r".*got \(2,\)"):
        fnattn.flash(AttentionSpec(position_bias=position_bias.alibi(jnp.ones(2))), q, k, v)
    with pytest.raises(TypeError, match="must return floats"):
        fnattn.flash(AttentionSpec(position_bias=position_bias.from_fn(
            lambda b, h, q, k: q > k)), q, k, v)
    with pytest.raises(TypeError, match="cannot add"):
        position_bias.alibi(jnp.ones(4)) + masks.causal()
    with pytest.raises(TypeError, match="must be callable"):
        position_bias.from_fn(3)


def test_other_variants_refuse_a_term():
    spec = AttentionSpec(position_bias=position_bias.alibi(SLOPES4))
    q, k, v, _ = _qkv(2, 1, 16, 4, 2, 8)
    calls = {
        "attention with impl='cudnn'": lambda: fnattn.attention(
            spec.replace(impl="cudnn"), q, k, v),
    }
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=f"{re.escape(name)}.*position_bias.*"
                                                      "fnattn.attention and fnattn.flash"):
            call()


def test_kernels_that_do_not_compute_a_term_are_not_routed_to():
    """cuDNN computes no term; the Mosaic GPU forward and backward compute ALiBi
    (its arrays per head), only when asked for by name until timed on a GPU,
    the backward with the slopes held fixed or learned, and refuse ``from_fn``
    terms whose functions Mosaic GPU does not lower (and learned arrays whose
    tangent it does not: a value used twice)."""
    dims = Dims(1, 256, 256, 4, 2, 128, 128)
    mask = position_bias.attach(masks.causal(), position_bias.alibi(SLOPES4), constant=False)
    cfg = Config(dims, 0.1, None, 0.0, jax.tree_util.tree_structure(mask))
    assert "position bias" in cudnn.reasons(cfg, jnp.bfloat16, mask, None, None)
    assert cudnn.reasons(cfg, jnp.bfloat16, masks.causal(), None, None) == []
    assert mosaic_gpu_bwd.supports(cfg, jnp.bfloat16, mask, None, None) == []
    assert not mosaic_gpu_bwd.route(cfg, jnp.bfloat16, mask, None, None)
    learned = dataclasses.replace(cfg, term_grad=position_bias.term_leaves(mask))
    assert mosaic_gpu_bwd.supports(learned, jnp.bfloat16, mask, None, None) == []
    twice = position_bias.attach(None, position_bias.from_fn(
        lambda b, h, q, k, r: r * r * (k - q), SLOPES4), constant=False)
    why = mosaic_gpu_bwd.supports(dataclasses.replace(
        cfg, term_grad=position_bias.term_leaves(twice)), jnp.bfloat16, twice, None, None)
    assert len(why) == 1 and "uses add_any" in why[0], why
    assert mosaic_gpu.supports(cfg, jnp.bfloat16, mask, None, None) == []
    assert mosaic_gpu._explicit_only(cfg)
    plain = Config(dims, 0.1, None, 0.0, jax.tree_util.tree_structure(masks.causal()))
    assert not mosaic_gpu._explicit_only(plain)
    # from_fn terms: those whose primitives Mosaic GPU lowers (tests/test_functions.py)
    plain = position_bias.from_fn(lambda b, h, q, k: 0.0 * k)
    kerple = position_bias.alibi(SLOPES4) + position_bias.from_fn(_kerple, SLOPES4, SLOPES4)
    for kernel in (mosaic_gpu, mosaic_gpu_bwd):
        assert kernel.supports(cfg, jnp.bfloat16, position_bias.attach(None, plain), None,
                               None) == []
        why = kernel.supports(cfg, jnp.bfloat16, position_bias.attach(None, kerple), None, None)
        assert len(why) == 1 and "uses log1p, which the Pallas Mosaic GPU kernels" in why[0]


def test_kernels_lower_for_cuda_and_tpu():
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(SLOPES4))

    slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
    kerple = lambda s: position_bias.from_fn(_kerple, s, s)  # noqa: E731

    def loss(table, argnums, term):
        def f(q, k, v, slopes):
            s = spec.replace(position_bias=term(slopes))
            res = core.run(s, q, k, v, fn="flash", table=table)
            return jnp.sum(res.out.astype(jnp.float32)) + jnp.sum(res.lse)
        return jax.jit(jax.grad(f, argnums=argnums))

    # and with the gradient of the term's arrays (ALiBi's, KERPLE's)
    for argnums, term in (((0, 1, 2), position_bias.alibi), ((0, 1, 2, 3), position_bias.alibi),
                          ((0, 1, 2, 3), kerple)):
        cuda = (("default", xla.DENSE), ("cuda", triton.LOWERING))
        with gpu_target():
            text = loss(cuda, argnums, term).trace(q, kv, kv, slopes).lower(
                lowering_platforms=("cuda",)).as_text()
        for name in ("fnattn_flash_fwd", "fnattn_flash_dq", "fnattn_flash_dkdv"):
            assert name in text
        tpu = (("default", xla.DENSE), ("tpu", mosaic.LOWERING))
        with tpu_target():
            text = loss(tpu, argnums, term).trace(q, kv, kv, slopes).lower(
                lowering_platforms=("tpu",)).as_text()
        assert set(re.findall(r'kernel_name = "(\w+)"', text)) == {
            "fnattn_flash_mosaic_fwd", "fnattn_flash_mosaic_dq", "fnattn_flash_mosaic_dkv"}


def test_ring_attention_on_one_device_takes_the_term():
    """Context parallelism evaluates the term at the ring steps' global positions
    (tests/multi_device/context_checks.py checks 2 to 8 devices)."""
    q, k, v, _ = _qkv(2, 32, 32, 4, 2, 8)
    spec = AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(SLOPES4))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    seq = jax.sharding.PartitionSpec(None, "x")
    out = jax.jit(jax.shard_map(
        lambda q, k, v: fnattn.context.attention(spec, q, k, v, axis_name="x").out,
        mesh=mesh, in_specs=(seq,) * 3, out_specs=seq))(q, k, v)
    np.testing.assert_allclose(out, fnattn.reference(spec, q, k, v).out, atol=2e-5)


def test_sharding_rules_split_the_slopes_with_the_heads():
    from jax.sharding import PartitionSpec as P
    spec = AttentionSpec(position_bias=position_bias.alibi(SLOPES4))
    r = fnattn.sharding.rules(spec, heads="model")
    assert r.spec.position_bias.slopes == P("model")


def test_sharding_rules_refuse_to_split_an_index_a_function_reads():
    reads_h = position_bias.from_fn(lambda b, h, q, k: jnp.where(h == 1, -0.5, 0.0) * q)
    spec = AttentionSpec(position_bias=reads_h)
    with pytest.raises(ValueError, match="heads='model' would split .* position term "
                                         r"from_fn\(<lambda>\) may read the head index"):
        fnattn.sharding.rules(spec, heads="model")
    fnattn.sharding.rules(spec, batch="data")  # the batch may split: it is not read
    reads_b = AttentionSpec(mask=masks.from_fn(lambda b, h, q, k: (k <= q) | (b == 0)))
    with pytest.raises(ValueError, match="batch='data' would split .* mask .* batch row"):
        fnattn.sharding.rules(reads_b, batch="data")
    fnattn.sharding.rules(reads_b, heads="model")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_auto_runs_the_term_on_the_triton_kernels(D):
    B, T, Hq, Hkv = 2, 1000, 8, 2
    q, k, v, d_out = _qkv(B, T, T, Hq, Hkv, D, jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(
        jnp.asarray(position_bias.alibi_slopes(Hq))))
    f = jax.jit(lambda *a: _grads(None, spec, *a, impl="auto"))
    text = f.lower(q, k, v, d_out).as_text()
    assert "fnattn_flash_fwd" in text and "fnattn_flash_dkdv" in text
    assert not re.search(r"custom_call @(__cudnn|mosaic_gpu)", text)
    got = f(q, k, v, d_out)
    want = jax.jit(lambda *a: _grads(None, spec, *a, impl="xla"))(q, k, v, d_out)
    _check(got, want, 3e-2)


@pytest.mark.skipif(jax.default_backend() != "gpu" or mosaic_gpu.available() is not None,
                    reason="needs a Hopper GPU (the Mosaic GPU kernels)")
def test_gpu_mosaic_gpu_forward_computes_alibi_when_asked():
    """With MosaicGpuBlockSizes in the spec (ALiBi is explicit-only until timed):
    the Mosaic GPU forward with the term, the Triton backward, learned slopes."""
    B, T, Hq, Hkv, D = 2, 1000, 8, 2, 128
    q, k, v, d_out = _qkv(B, T, T, Hq, Hkv, D, jnp.bfloat16)
    slopes = jnp.asarray(position_bias.alibi_slopes(Hq))
    spec = AttentionSpec(mask=masks.causal(), block_sizes=mosaic_gpu.MosaicGpuBlockSizes())
    f = jax.jit(lambda *a: _slope_grads(None, spec, *a, impl="auto"))
    text = f.lower(q, k, v, slopes, d_out).as_text()
    assert re.search(r"custom_call @mosaic_gpu", text) and "fnattn_flash_dkdv" in text
    got = f(q, k, v, slopes, d_out)
    want = jax.jit(lambda *a: _slope_grads(None, spec, *a, impl="xla"))(q, k, v, slopes, d_out)
    _check(got[:-1], want[:-1], 3e-2)
    np.testing.assert_allclose(got[-1], want[-1], rtol=3e-2,
                               atol=3e-2 * float(jnp.abs(want[-1]).max()))


@pytest.mark.skipif(jax.default_backend() != "gpu" or mosaic_gpu.available() is not None,
                    reason="needs a Hopper GPU (the Mosaic GPU kernels)")
@pytest.mark.parametrize("cap", [None, 30.0])
def test_gpu_mosaic_gpu_backward_computes_alibi_when_asked(cap):
    """With MosaicGpuBlockSizes and MosaicGpuBwdBlockSizes in the spec and the
    slopes held fixed: both Mosaic GPU kernels compute the term (no Triton
    dk/dv kernel), against the XLA lowering, with and without a soft-cap."""
    B, T, Hq, Hkv, D = 2, 1000, 8, 2, 128
    q, k, v, d_out = _qkv(B, T, T, Hq, Hkv, D, jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal(), softcap=cap, position_bias=position_bias.alibi(
        jnp.asarray(position_bias.alibi_slopes(Hq))),
        block_sizes=(mosaic_gpu.MosaicGpuBlockSizes(), mosaic_gpu_bwd.MosaicGpuBwdBlockSizes()))
    f = jax.jit(lambda *a: _grads(None, spec, *a, impl="auto"))
    text = f.lower(q, k, v, d_out).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
    assert "fnattn_flash_dkdv" not in text
    got = f(q, k, v, d_out)
    want = jax.jit(lambda *a: _grads(None, spec, *a, impl="xla"))(q, k, v, d_out)
    _check(got, want, 3e-2)


def _decay(b, h, q, k, r):
    return -r * jnp.log(1.0 + jnp.abs(q - k).astype(jnp.float32))


def _learned_terms(cap, D):
    """``(grads, args)``: ``grads(impl, *args)`` gives (out, lse, dq, dk, dv,
    dslopes, drates) of learned ALiBi slopes plus a learned ``from_fn`` decay
    under a negated window, both Mosaic GPU kernels asked for (bf16, B = 2,
    T = 1000, GQA 8:2)."""
    B, T, Hq, Hkv = 2, 1000, 8, 2
    q, k, v, d_out = _qkv(B, T, T, Hq, Hkv, D, jnp.bfloat16)
    slopes = jnp.asarray(position_bias.alibi_slopes(Hq))
    rates = jnp.linspace(0.1, 0.8, B * Hq).reshape(B, Hq)
    sizes = (mosaic_gpu.MosaicGpuBlockSizes.default(D),
             mosaic_gpu_bwd.MosaicGpuBwdBlockSizes.default(D))

    def grads(impl, q, k, v, slopes, rates):
        def f(q, k, v, slopes, rates):
            term = position_bias.alibi(slopes) + position_bias.from_fn(_decay, rates)
            spec = AttentionSpec(mask=masks.causal() & ~masks.sliding_window(4), softcap=cap,
                                 position_bias=term, block_sizes=sizes, return_lse=True)
            return _call(None, spec, q, k, v, impl)
        return _pulled(f, (q, k, v, slopes, rates), d_out)
    return grads, (q, k, v, slopes, rates)


def _assert_both_mosaic_gpu_kernels(text):
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
    assert "fnattn_flash_dkdv" not in text


LEARNED_ON_MOSAIC_GPU = [(None, 128), (30.0, 256)]


@pytest.mark.parametrize("cap, D", LEARNED_ON_MOSAIC_GPU)
def test_learned_terms_lower_to_both_mosaic_gpu_kernels(cap, D, monkeypatch):
    """On Hopper (stood in for), impl="auto" with both Mosaic GPU block sizes
    in the spec runs learned term arrays on both Mosaic GPU kernels, the row
    split in natural units and the column split under a soft-cap: what
    ``test_gpu_mosaic_gpu_backward_sums_learned_term_gradients`` runs."""
    pytest.importorskip("absl")
    monkeypatch.setattr(mosaic_gpu, "available", lambda: None)
    grads, args = _learned_terms(cap, D)
    with gpu_target():
        _assert_both_mosaic_gpu_kernels(jax.jit(functools.partial(grads, "auto")).trace(
            *args).lower(lowering_platforms=("cuda",)).as_text())


@pytest.mark.skipif(jax.default_backend() != "gpu" or mosaic_gpu.available() is not None,
                    reason="needs a Hopper GPU (the Mosaic GPU kernels)")
@pytest.mark.parametrize("cap, D", LEARNED_ON_MOSAIC_GPU)
def test_gpu_mosaic_gpu_backward_sums_learned_term_gradients(cap, D):
    """The same on the GPU: the backward sums the arrays' gradients per key,
    against the XLA lowering."""
    grads, args = _learned_terms(cap, D)
    f = jax.jit(functools.partial(grads, "auto"))
    _assert_both_mosaic_gpu_kernels(f.lower(*args).as_text())
    got = f(*args)
    want = jax.jit(functools.partial(grads, "xla"))(*args)
    _check(got[:5], want[:5], 3e-2)
    for name, a, b in zip(("dslopes", "drates"), got[5:], want[5:]):
        np.testing.assert_allclose(a, b, rtol=0.1, atol=0.1 * float(jnp.abs(b).max()),
                                   err_msg=name)


def test_decoding_with_alibi_through_attention_over_a_padded_cache():
    """What the docs say to do while decode does not take a term: attention of
    the new token over the padded cache with the lengths as a mask gives each
    sequence's output over its own keys (ALiBi's distances from the padded end
    differ by one constant per row, which the softmax drops)."""
    B, S, Hq, Hkv, D = 2, 48, 4, 2, 8
    lengths = jnp.array([48, 21])
    alibi = position_bias.alibi(SLOPES4)
    for Tq in (1, 3):   # one new token; three, with a causal mask at their true positions
        q, k, v, _ = _qkv(B, Tq, S, Hq, Hkv, D)
        k = k.at[1, 21:].set(jnp.nan)
        mask = masks.lengths(kv_lengths=lengths)
        if Tq > 1:
            q_positions = lengths[:, None] - Tq + jnp.arange(Tq)[None]
            mask = mask & masks.at_positions(masks.causal(), q_positions, jnp.arange(S))
        spec = AttentionSpec(mask=mask, position_bias=alibi)
        out = jax.jit(fnattn.attention)(spec, q, k, v).out
        for b in range(B):
            L = int(lengths[b])
            want = fnattn.reference(AttentionSpec(mask=masks.causal(), position_bias=alibi),
                                    q[b:b + 1], k[b:b + 1, :L], v[b:b + 1, :L]).out
            np.testing.assert_allclose(out[b:b + 1], want, atol=2e-5)


# ----------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------

DECODE_TERM = position_bias.alibi(SLOPES4 * 0.75) + position_bias.from_fn(
    lambda b, h, q, k: jnp.where(k % 3 == 0, 0.4, 0.0) * (b + 1))


def _decode_reference(spec, q, k, v, lengths, starts):
    """Each sequence's rows: the reference over its own keys (the term's from_fn
    reads the batch row: each sequence gets its own index back)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        lo, n = int(starts[b]), int(lengths[b])
        term = position_bias.alibi(SLOPES4 * 0.75) + position_bias.from_fn(
            lambda bb, h, q, k, b=b: jnp.where(k % 3 == 0, 0.4, 0.0) * (b + 1))
        res = fnattn.reference(spec.replace(impl="reference", position_bias=term),
                               q[b:b + 1], k[b:b + 1, lo:lo + n], v[b:b + 1, lo:lo + n])
        outs.append(res.out)
        lses.append(res.lse)
    return jnp.concatenate(outs), jnp.concatenate(lses)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("Tq", [1, 3])
def test_decode_matches_reference(impl, Tq):
    """XLA (split in two; what impl="auto" runs on a CPU) and the Triton kernel
    (interpreted, several blocks), with masks, soft-cap, sinks and kv_starts."""
    B, S, Hq, Hkv, D = 3, 40, 4, 2, 8
    q, k, v, _ = _qkv(B, Tq, S, Hq, Hkv, D, seed=Tq)
    lengths, starts = jnp.array([40, 17, 5]), jnp.array([0, 10, 3])
    sizes = fnattn.DecodeBlockSizes(num_splits=2, block_k=16)
    for mask, softcap, sinks in ((None, None, None), (masks.causal(), 4.0, None),
                                 (masks.causal() & masks.sliding_window(6), None,
                                  jnp.array([0.5, -1.0, 0.0, 2.0]))):
        spec = AttentionSpec(mask=mask, softcap=softcap, sinks=sinks, impl=impl,
                             position_bias=DECODE_TERM, block_sizes=sizes)
        with cheap_compiles():
            res = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=lengths,
                                                        kv_starts=starts))(q, k, v)
        out, lse = _decode_reference(spec, q, k, v, lengths, starts)
        np.testing.assert_allclose(res.out, out, atol=2e-5, err_msg=f"{impl} {mask}")
        np.testing.assert_allclose(res.lse, lse, atol=2e-5, err_msg=f"{impl} {mask}")


def test_decode_gradients_and_update():
    B, S, Hq, Hkv, D = 2, 24, 4, 2, 8
    q, k, v, _ = _qkv(B, 2, S, Hq, Hkv, D)
    lengths, starts = jnp.array([24, 9]), jnp.array([0, 4])
    spec = AttentionSpec(mask=masks.causal(), position_bias=DECODE_TERM)

    def loss(q, k, v):
        return jnp.sum(fnattn.decode(spec, q, k, v, kv_lengths=lengths,
                                     kv_starts=starts).out ** 2)

    def ref_loss(q, k, v):
        return jnp.sum(_decode_reference(spec, q, k, v, lengths, starts)[0] ** 2)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="slopes"):
        jax.grad(lambda s: jnp.sum(fnattn.decode(
            spec.replace(position_bias=position_bias.alibi(s)), q, k, v,
            kv_lengths=lengths).out))(SLOPES4)
    # decode_with_update writes the new tokens, then decodes as decode does
    new = k[:, :2], v[:, :2]
    res, k2, v2 = fnattn.decode_with_update(spec, q, *new, k, v, kv_lengths=lengths,
                                            kv_starts=starts)
    want = fnattn.decode(spec, q, k2, v2, kv_lengths=lengths, kv_starts=starts)
    np.testing.assert_allclose(res.out, want.out, atol=1e-6)


def _sharded_decode(spec, q, k, v, lengths, starts):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    P = jax.sharding.PartitionSpec
    return jax.jit(jax.shard_map(
        lambda q, k, v, n, s: fnattn.context.decode(spec, q, k, v, axis_name="x",
                                                    kv_lengths=n, kv_starts=s),
        mesh=mesh, in_specs=(P(), P(None, "x"), P(None, "x"), P(), P()),
        out_specs=P()))(q, k, v, lengths, starts)


def test_context_decode_evaluates_the_term_at_global_positions():
    """context.decode takes per-(row, head) terms: its local decode sees them at
    the global positions (offsets as float32 values of a from_fn term) and its
    dense edge part through masks.at_positions. On one device here (8 devices:
    tests/multi_device/decode_checks.py), Tq = 3 with a window, starts and
    sinks, against fnattn.decode; the slopes stay constants (serving)."""
    B, S, Hq, Hkv, D = 2, 24, 4, 2, 8
    q, k, v, _ = _qkv(B, 3, S, Hq, Hkv, D)
    lengths, starts = jnp.array([20, 9]), jnp.array([4, 0])
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(5), sinks=jnp.ones(4),
                         position_bias=DECODE_TERM + position_bias.alibi(SLOPES4),
                         return_lse=True)
    got = _sharded_decode(spec, q, k, v, lengths, starts)
    want = fnattn.decode(spec, q, k, v, kv_lengths=lengths, kv_starts=starts)
    np.testing.assert_allclose(got.out, want.out, atol=1e-5)
    np.testing.assert_allclose(got.lse, want.lse, atol=1e-5)
    with pytest.raises(NotImplementedError, match="serving variants"):
        jax.grad(lambda s: jnp.sum(_sharded_decode(spec.replace(
            position_bias=position_bias.alibi(s)), q, k, v, lengths, starts).out))(SLOPES4)
    per_key = AttentionSpec(position_bias=position_bias.from_fn(
        lambda b, h, q, k, w: w * k, jnp.ones((B, 24))))
    with pytest.raises(ValueError, match="context.decode: position_bias.from_fn"):
        _sharded_decode(per_key, q, k, v, lengths, starts)


def test_decode_refusals_and_routing():
    q, k, v, _ = _qkv(2, 1, 16, 4, 2, 8)
    per_key = position_bias.from_fn(lambda b, h, q, k: 0.0 * k) + position_bias.alibi(SLOPES4)
    table_like = AttentionSpec(position_bias=per_key)
    fnattn.decode(table_like, q, k, v, kv_lengths=jnp.array([16, 3]))  # per head: taken
    from fnattn.decoding import api as decode_api
    cfg = decode_api.Cfg(scale=1.0, softcap=None, mask_treedef=None, num_splits=None,
                         term_treedef=jax.tree_util.tree_structure(per_key))
    # a term that reads the head index keeps jit from splitting the heads
    reads_h = position_bias.from_fn(lambda b, h, q, k: jnp.where(h == 0, 1.0, 0.0))
    assert decode_api._splittable(dataclasses.replace(
        cfg, term_treedef=jax.tree_util.tree_structure(reads_h))) == "b"
    assert decode_api._splittable(cfg) == "bh"


@pytest.mark.parametrize("D, Tq", [(8, 1), (128, 3)])
def test_decode_mosaic_interpret_matches_reference(D, Tq, monkeypatch):
    """The Mosaic (TPU) decode kernel, interpreted: several kv heads a program
    (D = 8) or one (D = 128), split in two, with sinks."""
    from fnattn.decoding import api as decode_api
    from fnattn.decoding import mosaic as decode_mosaic
    B, S, Hq, Hkv = 3, 48, 4, 2
    q, k, v, _ = _qkv(B, Tq, S, Hq, Hkv, D, seed=D)
    lengths, starts = jnp.array([48, 17, 5]), jnp.array([0, 10, 3])
    table = (("default", functools.partial(decode_mosaic._forward, interpret=True,
                                           block_k=16)),)
    monkeypatch.setattr(decode_api, "lowering_table", lambda impl: table)
    spec = AttentionSpec(mask=masks.causal(), softcap=4.0, position_bias=DECODE_TERM,
                         sinks=jnp.array([0.5, -1.0, 0.0, 2.0]),
                         block_sizes=fnattn.DecodeBlockSizes(num_splits=2))
    with cheap_compiles():
        res = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=lengths,
                                                    kv_starts=starts))(q, k, v)
    out, lse = _decode_reference(spec.replace(block_sizes=None), q, k, v, lengths, starts)
    np.testing.assert_allclose(res.out, out, atol=2e-5)
    np.testing.assert_allclose(res.lse, lse, atol=2e-5)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_decode_kernel_lowers(platform):
    """The Mosaic kernel with the term lowers for TPU, the Triton one for cuda:
    ALiBi, and the term context.decode gives a device's local decode (a
    KERPLE term plus ALiBi at shifted positions)."""
    from fnattn.context.decode import _at_global_positions
    from fnattn.decoding import api as decode_api
    from fnattn.decoding import mosaic as decode_mosaic
    from fnattn.decoding import triton as decode_triton
    kernel, target = {"tpu": (decode_mosaic, tpu_target),
                      "cuda": (decode_triton, gpu_target)}[platform]
    q = jax.ShapeDtypeStruct((4, 1, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 4096, 2, 128), jnp.bfloat16)
    alibi = position_bias.alibi(jnp.asarray(position_bias.alibi_slopes(8)))
    kerple = position_bias.from_fn(_kerple, jnp.ones(8), jnp.full((4, 8), 0.5))
    shifted = _at_global_positions(kerple + alibi, 4, 8, q_shift=jnp.arange(4) * 100,
                                   k_shift=jnp.arange(4) * 50)
    table = (("default", decode_api.xla.forward), (platform, kernel.forward))
    for term in (alibi, shifted):
        spec = AttentionSpec(mask=masks.causal(), position_bias=term)

        def f(q, k, v):
            return decode_api._attend(table, *_decode_args(spec, q, k, v))

        with target():
            text = jax.jit(f).trace(q, kv, kv).lower(lowering_platforms=(platform,)).as_text()
        assert kernel.KERNEL_NAME in text


def _decode_args(spec, q, k, v):
    """decode's (cfg, q, k, v, starts, lengths, sinks, terms, sizes), as it builds
    them (a static mask: no traced sizes)."""
    from fnattn.decoding import api as decode_api
    B, _, Hq, _ = q.shape
    term = spec.position_bias
    cfg = decode_api.Cfg(scale=q.shape[-1] ** -0.5, softcap=None,
                         mask_treedef=jax.tree_util.tree_structure(spec.mask), num_splits=None,
                         term_treedef=jax.tree_util.tree_structure(term))
    lengths = jnp.full((B,), k.shape[1], jnp.int32)
    return (cfg, q, k, v, jnp.zeros((B,), jnp.int32), lengths, None,
            position_bias.per_head_arrays(term, B, Hq), ())


# ----------------------------------------------------------------------------------
# paged and ragged paged attention
# ----------------------------------------------------------------------------------


def _paged_problem(B=3, Tq=2, Hq=4, Hkv=2, D=8, ps=4, P=6, seed=0):
    rs = np.random.default_rng(seed)
    kp, vp = (jnp.asarray(rs.standard_normal((Hkv, B * P, ps, D)), jnp.float32)
              for _ in range(2))
    table = jnp.asarray(rs.permutation(B * P).reshape(B, P), jnp.int32)
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    return q, kp, vp, table, jnp.array([24, 9, 3])


def _paged_reference(spec, q, kp, vp, table, lengths):
    outs, lses = [], []
    Hkv, _, ps, D = kp.shape
    for b in range(q.shape[0]):
        pages, n = table[b], int(lengths[b])
        k, v = (x[:, pages].reshape(Hkv, -1, D).transpose(1, 0, 2)[None, :n] for x in (kp, vp))
        term = position_bias.alibi(SLOPES4 * 0.75) + position_bias.from_fn(
            lambda bb, h, q, k, b=b: jnp.where(k % 3 == 0, 0.4, 0.0) * (b + 1))
        res = fnattn.reference(spec.replace(impl="reference", block_sizes=None,
                                            position_bias=term), q[b:b + 1], k, v)
        outs.append(res.out)
        lses.append(res.lse)
    return jnp.concatenate(outs), jnp.concatenate(lses)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_paged_and_ragged_match_reference(impl):
    """paged_attention, ragged_paged_attention (the same tokens packed) and the
    form that writes the cache, with ALiBi and a from_fn of the sequence index."""
    q, kp, vp, table, lengths = _paged_problem()
    B, Tq, Hq, D = q.shape
    for mask, softcap in ((masks.causal(), None), (masks.causal() & masks.sliding_window(5), 3.0)):
        spec = AttentionSpec(mask=mask, softcap=softcap, position_bias=DECODE_TERM, impl=impl,
                             block_sizes=fnattn.PagedBlockSizes(block_k=16))
        with cheap_compiles():
            res = jax.jit(lambda q, kp, vp: fnattn.paged_attention(
                spec, q, kp, vp, page_table=table, kv_lengths=lengths))(q, kp, vp)
        out, lse = _paged_reference(spec, q, kp, vp, table, lengths)
        np.testing.assert_allclose(res.out, out, atol=2e-5, err_msg=f"{impl} {mask}")
        np.testing.assert_allclose(res.lse, lse, atol=2e-5, err_msg=f"{impl} {mask}")
        packed = dict(page_table=table, context_lengths=lengths,
                      query_start_loc=jnp.arange(0, B * Tq + 1, Tq, dtype=jnp.int32),
                      num_seqs=jnp.array([B], jnp.int32))
        with cheap_compiles():
            ragged = jax.jit(lambda q, kp, vp: fnattn.ragged_paged_attention(
                spec, q, kp, vp, **packed))(q.reshape(B * Tq, Hq, D), kp, vp)
        np.testing.assert_allclose(ragged.out.reshape(B, Tq, Hq, D), out, atol=2e-5)
    # the form that writes the new tokens first: the same answer
    if impl != "pallas":
        return
    Hkv, _, ps, _ = kp.shape
    slot = [(table[b, (int(lengths[b]) - Tq + t) // ps], (int(lengths[b]) - Tq + t) % ps)
            for b in range(B) for t in range(Tq)]
    new_k = jnp.stack([kp[:, p, o] for p, o in slot], axis=0)      # (B*Tq, Hkv, D)
    new_v = jnp.stack([vp[:, p, o] for p, o in slot], axis=0)
    res, _, _ = jax.jit(lambda q: fnattn.ragged_paged_attention_with_update(
        spec, q, new_k, new_v, kp, vp, **packed))(q.reshape(B * Tq, Hq, D))
    np.testing.assert_allclose(res.out.reshape(B, Tq, Hq, D), out, atol=2e-5)


def test_paged_gradients_kernel_refusal_and_lowering():
    q, kp, vp, table, lengths = _paged_problem()
    spec = AttentionSpec(mask=masks.causal(), position_bias=DECODE_TERM)

    def loss(q):
        return jnp.sum(fnattn.paged_attention(spec, q, kp, vp, page_table=table,
                                              kv_lengths=lengths).out ** 2)

    want = jax.grad(lambda q: jnp.sum(_paged_reference(spec, q, kp, vp, table, lengths)[0]
                                      ** 2))(q)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(q), want, atol=1e-4, rtol=1e-4)
    from fnattn.paged import api as paged_api
    from fnattn.paged import mosaic as paged_mosaic
    from fnattn.paged import triton as paged_triton
    # the Triton kernel with the term lowers for cuda, the Mosaic one for TPU
    qs = jax.ShapeDtypeStruct((16, 1, 8, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2, 256, 16, 128), jnp.bfloat16)
    alibi = AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(
        jnp.asarray(position_bias.alibi_slopes(8))))
    table16 = jnp.arange(256, dtype=jnp.int32).reshape(16, 16)
    lens16 = jnp.full((16,), 200, jnp.int32)

    for platform, forward, target, name in (
            ("cuda", paged_triton.forward, gpu_target, "fnattn_paged_triton"),
            ("tpu", paged_mosaic.forward, tpu_target, "fnattn_paged_mosaic")):
        def f(q, kp, vp):
            return paged_api.paged_attention_with(
                (("default", paged_api.xla.forward), (platform, forward)), alibi, q, kp, vp,
                page_table=table16, kv_lengths=lens16).out  # noqa: B023

        with target():
            text = jax.jit(f).trace(qs, pool, pool).lower(
                lowering_platforms=(platform,)).as_text()
        assert name in text


def test_paged_mosaic_interpret_matches_reference():
    from fnattn.paged import api as paged_api
    from fnattn.paged import mosaic as paged_mosaic
    q, kp, vp, table, lengths = _paged_problem(D=128, ps=8, P=4)
    lengths = jnp.array([30, 9, 3])
    table_ = (("default", functools.partial(paged_mosaic._forward, interpret=True)),)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(5), softcap=3.0,
                         sinks=jnp.array([0.5, -1.0, 0.0, 2.0]), position_bias=DECODE_TERM,
                         block_sizes=fnattn.PagedBlockSizes(block_k=16))
    with cheap_compiles():
        res = jax.jit(lambda q, kp, vp: paged_api.paged_attention_with(
            table_, spec, q, kp, vp, page_table=table, kv_lengths=lengths))(q, kp, vp)
    out, lse = _paged_reference(spec, q, kp, vp, table, lengths)
    np.testing.assert_allclose(res.out, out, atol=2e-5)
    np.testing.assert_allclose(res.lse, lse, atol=2e-5)


def test_serving_kernels_keep_huge_terms_exact(monkeypatch):
    """A term without a cap keeps the serving kernels' row state in natural
    units: rows whose every visible logit is huge (slopes of 1e30 and 1e8, no
    key within distance 4) weigh their nearest keys as the XLA lowering does,
    where the base-2 state of the Triton kernels gave NaN (the largest logit's
    ``s * log2(e) - m``, fused, is the rounding error of m). Decode (Triton and
    Mosaic TPU, interpreted, one split and two, with sinks) and paged decode
    (both kernels)."""
    from fnattn.decoding import api as decode_api
    from fnattn.decoding import mosaic as decode_mosaic
    from fnattn.paged import api as paged_api
    from fnattn.paged import mosaic as paged_mosaic
    term = position_bias.alibi(jnp.array([1e30, 1.0, 1e8, 0.5]))
    sinks = jnp.array([0.5, -1.0, 0.0, 2.0])

    def close(got, want):
        np.testing.assert_allclose(got.out, want.out, atol=2e-5)
        np.testing.assert_allclose(got.lse, want.lse, rtol=1e-6)

    B, S, Hq, Hkv, D = 3, 48, 4, 2, 8
    q, k, v, _ = _qkv(B, 1, S, Hq, Hkv, D, seed=3)
    lengths, starts = jnp.array([48, 17, 5]), jnp.array([0, 10, 3])
    decode = jax.jit(lambda spec, q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=lengths,
                                                         kv_starts=starts))
    for splits, s in ((1, None), (2, sinks)):
        spec = AttentionSpec(mask=~masks.sliding_window(3, 3), position_bias=term, sinks=s,
                             block_sizes=fnattn.DecodeBlockSizes(num_splits=splits, block_k=16))
        want = decode(spec.replace(impl="xla"), q, k, v)
        assert np.isfinite(want.out).all()
        with cheap_compiles():
            close(decode(spec.replace(impl="pallas"), q, k, v), want)     # Triton
        mosaic = (("default", functools.partial(decode_mosaic._forward, interpret=True,
                                                block_k=16)),)
        with monkeypatch.context() as mp, cheap_compiles():
            mp.setattr(decode_api, "lowering_table", lambda impl: mosaic)  # noqa: B023
            close(decode(spec, q, k, v), want)

    spec = AttentionSpec(mask=~masks.sliding_window(3, 3), position_bias=term, sinks=sinks,
                         block_sizes=fnattn.PagedBlockSizes(block_k=16, num_splits=2))
    mosaic = (("default", functools.partial(paged_mosaic._forward, interpret=True)),)
    for table_, problem in ((None, _paged_problem()),                     # Triton
                            (mosaic, _paged_problem(D=128, ps=8, P=4))):
        q, kp, vp, table, lengths = problem
        def paged(table_, spec, q, kp, vp):
            return jax.jit(lambda q, kp, vp: paged_api.paged_attention_with(
                table_, spec, q, kp, vp, page_table=table,  # noqa: B023
                kv_lengths=lengths))(q, kp, vp)  # noqa: B023
        want = paged(None, spec.replace(impl="xla"), q, kp, vp)
        assert np.isfinite(want.out).all()
        with cheap_compiles():
            close(paged(table_, spec.replace(impl="pallas"), q, kp, vp), want)
