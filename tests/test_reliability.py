"""Hostile inputs through every lowering: no NaN and no silently wrong number.

Each problem below packs several of the cases that used to break into one call,
so that every lowering is compiled once per problem: whole rows of bias -1e30,
``finfo.min``, -1e9 and -1e8 (the usual additive padding mask), a single logit
of 1e10, rows of -inf bias, NaN and inf in the K/V of keys the mask hides
(cache slots past a length), fully masked rows, sinks of -inf and +inf, and
float16 with cotangents large enough that dO.V overflows float16. Every lowering
must give the reference's out, lse and every gradient (q, k, v, bias, sinks).

The reference itself is pinned against float64 NumPy in ``test_reference.py``;
here it is the yardstick, because at -1e9 the float32 logits of a row are all
equal and the float32 answer (a uniform softmax) is not the float64 one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, core, masks
from fnattn.flash import mosaic
from lowering import cheap_compiles

F32 = jnp.float32
FMIN = float(np.finfo(np.float32).min)


def _mosaic(spec, q, k, v):
    return core.run(spec, q, k, v, fn="flash",
                    table=(("default", mosaic.INTERPRET_LOWERING),))


LOWERINGS = {
    "xla": lambda spec, q, k, v: fnattn.attention(spec.replace(impl="xla"), q, k, v),
    "flash-xla": lambda spec, q, k, v: fnattn.attention(spec.replace(impl="auto"), q, k, v),
    "triton-interpret": lambda spec, q, k, v: fnattn.attention(spec.replace(impl="pallas"),
                                                               q, k, v),
    "mosaic-interpret": _mosaic,
    "cudnn": lambda spec, q, k, v: fnattn.attention(spec.replace(impl="cudnn"), q, k, v),
}


def _hostile_problem(dtype=F32, seed=0):
    """B=2, Tq=12, Tk=16, Hq=4, Hkv=2, D=8 with a bias whose rows are extreme.

    Batch 0: rows 0-1 bias -1e30, rows 2-3 finfo.min, row 4 one logit of 1e10,
    row 5 all -inf, row 6 -inf but for one key. Batch 1: rows 0-1 -1e9, rows
    2-3 -1e8; its keys 11-15 are past kv_lengths and hold NaN (K) and inf (V),
    and its rows 9-11 are past q_lengths (fully masked).
    """
    rs = np.random.default_rng(seed)
    B, Tq, Tk, Hq, Hkv, D = 2, 12, 16, 4, 2, 8
    q = rs.standard_normal((B, Tq, Hq, D))
    k = rs.standard_normal((B, Tk, Hkv, D))
    v = rs.standard_normal((B, Tk, Hkv, D))
    k[1, 11:] = np.nan
    v[1, 11:] = np.inf
    v[1, 13:, 1] = -np.inf
    bias = 0.3 * rs.standard_normal((B, Hq, Tq, Tk))
    bias[0, :, 0:2] = -1e30
    bias[0, :, 2:4] = FMIN
    bias[0, :, 4, 3] = 1e10
    bias[0, :, 5] = -np.inf
    bias[0, :, 6] = -np.inf
    bias[0, :, 6, 2] = 0.5
    bias[1, :, 0:2] = -1e9
    bias[1, :, 2:4] = -1e8
    mask = masks.lengths(jnp.array([Tq, 9]), jnp.array([Tk, 11]))
    do = rs.standard_normal((B, Tq, Hq, D))
    dl = rs.standard_normal((B, Hq, Tq))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), jnp.asarray(bias, F32), mask, cast(do),
            jnp.asarray(dl, F32))


SINKS = jnp.array([-np.inf, np.inf, 0.5, -1.0], F32)


def _run(fn, spec, q, k, v, do, dl):
    """out, lse and the gradients of sum(out*do) + sum(lse*dl), under jit."""
    def loss(q, k, v, bias, sinks):
        res = fn(spec.replace(bias=bias, sinks=sinks), q, k, v)
        return jnp.sum(res.out.astype(F32) * do.astype(F32)) + jnp.sum(res.lse * dl), res

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4) if spec.sinks is not None else (0, 1, 2, 3),
                    has_aux=True)
    g, res = jax.jit(grad)(q, k, v, spec.bias, spec.sinks)
    return res.out, res.lse, g


@functools.lru_cache(maxsize=None)
def _reference(with_sinks: bool, dtype_name: str):
    q, k, v, bias, mask, do, dl = _hostile_problem(jnp.dtype(dtype_name))
    spec = AttentionSpec(mask=mask, bias=bias, sinks=SINKS if with_sinks else None)
    return _run(fnattn.reference, spec, q, k, v, do, dl)


def _assert_same(name, got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not np.isnan(want).any(), f"the reference has NaN in {name}"
    assert not np.isnan(got).any(), f"NaN in {name} at {np.argwhere(np.isnan(got))[:5]}"
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=name)
    np.testing.assert_array_equal(np.sign(got[np.isinf(got)]), np.sign(want[np.isinf(want)]),
                                  err_msg=name)
    fin = np.isfinite(want)
    scale = max(np.abs(want[fin]).max(initial=0.0), 1.0)
    np.testing.assert_allclose(got[fin], want[fin], rtol=tol, atol=tol * scale, err_msg=name)


def _compare(got, want, tol):
    (out, lse, g), (out_r, lse_r, g_r) = got, want
    _assert_same("out", out, out_r, tol)
    _assert_same("lse", lse, lse_r, tol)
    for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsinks"), g, g_r):
        _assert_same(name, a, b, tol)


def test_the_reference_is_finite_and_right_on_the_easy_rows():
    # The yardstick itself: no NaN anywhere, dead rows are 0 / -inf, the +inf sink
    # takes its head (out 0, lse +inf), and the -inf sink is no sink.
    out, lse, g = _reference(True, "float32")
    assert all(not np.isnan(np.asarray(x)).any() for x in (out, lse, *g))
    lse = np.asarray(lse)
    assert (lse[:, 1] == np.inf).all()
    assert (lse[1, 0, 9:] == -np.inf).all() and (lse[0, 0, 5] == -np.inf)
    assert np.all(np.asarray(out)[1, 9:, 0] == 0) and np.all(np.asarray(out)[:, :, 1] == 0)
    # d(sink of +inf) is the sum of d_lse over its rows
    dl = np.asarray(_hostile_problem()[6])
    np.testing.assert_allclose(float(g[4][1]), dl[:, 1].sum(), rtol=1e-5)
    assert float(g[4][0]) == 0.0


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "inf-sinks"])
@pytest.mark.parametrize("lowering", list(LOWERINGS))
def test_hostile_rows_match_the_reference(lowering, with_sinks):
    if lowering == "cudnn" and with_sinks:
        pytest.skip("impl='cudnn' refuses sinks (tested in test_cudnn.py)")
    q, k, v, bias, mask, do, dl = _hostile_problem()
    spec = AttentionSpec(mask=mask, bias=bias, sinks=SINKS if with_sinks else None,
                         block_sizes=fnattn.XlaBlockSizes(4, 8))
    with cheap_compiles():
        got = _run(LOWERINGS[lowering], spec, q, k, v, do, dl)
    _compare(got, _reference(with_sinks, "float32"), 2e-4)


def _two_keys_per_row(b, h, q, k):
    # (module level: from_fn masks are static and compared by identity)
    return k <= 2 * q


@pytest.mark.parametrize("lowering", ["xla", "flash-xla", "triton-interpret",
                                      "mosaic-interpret"])
def test_padding_rows_never_meet_the_keys_only_they_would_see(lowering):
    # Tq = 5 in tiles of 4 (8 on the TPU kernel) rows: the padding rows 5.. of
    # the last tile would see keys 9..11, which no query row sees and which hold
    # NaN and inf. A padding row must see nothing: otherwise its NaN logit
    # reaches those keys' dk and dv (0 * NaN), and the dbias summed over rows.
    rs = np.random.default_rng(11)
    q = jnp.asarray(rs.standard_normal((2, 5, 2, 8)), F32)
    k = jnp.asarray(rs.standard_normal((2, 12, 1, 8)), F32)
    v = jnp.asarray(rs.standard_normal((2, 12, 1, 8)), F32)
    do = jnp.asarray(rs.standard_normal((2, 5, 2, 8)), F32)
    dl = jnp.asarray(rs.standard_normal((2, 2, 5)), F32)
    bias = jnp.asarray(rs.standard_normal((1, 1, 1, 12)), F32)  # (its gradient sums rows)
    k = k.at[:, 9:].set(jnp.nan)
    v = v.at[:, 9:].set(jnp.inf)
    spec = AttentionSpec(mask=masks.from_fn(_two_keys_per_row), bias=bias,
                         block_sizes=fnattn.XlaBlockSizes(4, 8))
    with cheap_compiles():
        got = _run(LOWERINGS[lowering], spec, q, k, v, do, dl)
    want = _run(fnattn.reference, spec, q, k, v, do, dl)
    _compare(got, want, 2e-4)
    assert (np.asarray(got[2][1])[:, 9:] == 0).all() and (np.asarray(got[2][2])[:, 9:] == 0).all()


# (cudnn: jax.nn's own XLA path cannot differentiate float16 on a CPU, "precision
# F16_F16_F32 is not supported by dot_general on CPU"; cuDNN accumulates in float32.)
@pytest.mark.parametrize("lowering", ["xla", "flash-xla", "triton-interpret",
                                      "mosaic-interpret"])
def test_float16_with_large_cotangents(lowering):
    # dO.V overflows float16 (|dO| ~ 2e3, |V| ~ 6, D = 8: up to 1.2e5): gradients must be
    # accumulated in float32 and come out finite, like the reference's.
    rs = np.random.default_rng(3)
    q = jnp.asarray(rs.standard_normal((1, 12, 2, 8)), jnp.float16)
    k = jnp.asarray(rs.standard_normal((1, 16, 1, 8)), jnp.float16)
    v = jnp.asarray(6 * rs.standard_normal((1, 16, 1, 8)), jnp.float16)
    do = jnp.asarray(2e3 * rs.standard_normal((1, 12, 2, 8)), jnp.float16)
    dl = jnp.zeros((1, 2, 12), F32)
    spec = AttentionSpec(mask=masks.causal())
    assert not np.isfinite(np.einsum("bqhd,bkd->bqhk", np.asarray(do), np.asarray(v)[:, :, 0],
                                     dtype=np.float16)).all()
    with cheap_compiles():
        got = _run(LOWERINGS[lowering], spec, q, k, v, do, dl)
    want = _run(fnattn.reference, spec, q, k, v, do, dl)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got[0], *got[2]), (want[0], *want[2])):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(a).all(), f"{lowering}: non-finite {name}"
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2 * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("impl", ["reference", "xla", "auto", "pallas", "cudnn"])
def test_x64_changes_nothing_for_float32(impl):
    # With jax_enable_x64 Python ints and aranges are int64: every lowering (and
    # with "auto"/"pallas" every platform's branch, all traced) must still trace
    # and give the float32 answer.
    q, k, v, bias, mask, do, dl = _hostile_problem()
    spec = AttentionSpec(mask=mask & masks.causal(), bias=bias, impl=impl,
                         block_sizes=fnattn.XlaBlockSizes(4, 8))
    if impl != "cudnn":
        spec = spec.replace(sinks=SINKS[2:].repeat(2), softcap=5.0)
    f = LOWERINGS.get({"auto": "flash-xla", "pallas": "triton-interpret"}.get(impl, impl),
                      lambda s, q, k, v: fnattn.reference(s, q, k, v))
    with cheap_compiles():
        want = _run(f, spec, q, k, v, do, dl)
        with jax.enable_x64(True):
            got = _run(f, spec, q, k, v, do, dl)
    assert got[0].dtype == q.dtype and got[1].dtype == F32
    _compare(got, want, 1e-5)


def test_float64_inputs_are_computed_in_float64():
    with jax.enable_x64(True):
        q, k, v, bias, mask, do, dl = _hostile_problem(jnp.float64)
        q = q.at[1, :, :, :].multiply(1 + 1e-12)  # a difference float32 cannot see
        bias = bias.astype(jnp.float64)
        spec = AttentionSpec(mask=mask, bias=bias, sinks=SINKS.astype(jnp.float64))
        want = _run(fnattn.reference, spec, q, k, v, do, dl)
        assert want[0].dtype == jnp.float64
        for impl in ("xla", "auto"):
            got = _run(LOWERINGS["flash-xla" if impl == "auto" else "xla"], spec, q, k, v, do, dl)
            assert got[0].dtype == jnp.float64, impl
            _compare(got, want, 1e-10)


@pytest.mark.parametrize("k_axis, v_axis", [(-1, -1), (1, 2)])
def test_finite_keys_both_forms_flag_the_same_keys(k_axis, v_axis):
    """``_online.finite_keys`` flags a key whose K or V holds NaN, +inf or -inf
    anywhere along its features, zeroing just those entries, the same in the
    boolean reduction XLA code uses and the float one of the Triton kernels
    (``triton=True``), under ``jit``: keys (2, 8), 16 features along
    ``k_axis`` of K and ``v_axis`` of V."""
    from fnattn import _online
    rs = np.random.default_rng(0)
    k = np.moveaxis(rs.standard_normal((2, 8, 16)).astype(np.float32), -1, k_axis)
    v = np.moveaxis(rs.standard_normal((2, 8, 16)).astype(np.float32), -1, v_axis)
    want = np.zeros((2, 8), bool)
    for (x, axis), key, feature, value in (((k, k_axis), (0, 1), 3, np.nan),
                                           ((v, v_axis), (1, 4), 15, np.inf),
                                           ((k, k_axis), (1, 6), 0, -np.inf),
                                           ((v, v_axis), (1, 6), 7, np.nan)):
        np.moveaxis(x, axis, -1)[key + (feature,)] = value
        want[key] = True
    for triton in (False, True):
        kc, vc, got = jax.jit(functools.partial(_online.finite_keys, k_axis=k_axis,
                                                v_axis=v_axis, triton=triton))(k, v)
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(kc), np.where(np.isfinite(k), k, 0))
        np.testing.assert_array_equal(np.asarray(vc), np.where(np.isfinite(v), v, 0))
