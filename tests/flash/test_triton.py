"""The Pallas Triton lowering of flash attention (fnattn/flash/triton.py).

Three groups:

* interpret mode on CPU: the kernels against ``fnattn.reference``, forward and
  gradients (q, k, v, bias, sinks, and through lse), on every feature case with
  several blocks per axis (ragged last blocks, FULL, PARTIAL and EMPTY tiles);
* lowering to Triton IR for "cuda" on CPU: every kernel variant over head dims,
  dtypes and features (catches non-power-of-two blocks and unlowerable ops);
* the real kernels on an NVIDIA GPU (skipped without one).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, core, masks, xla
from fnattn._checks import Dims
from fnattn._dispatch import Config
from fnattn.flash import triton
from fnattn.flash.triton import INTERPRET_LOWERING, LOWERING, TritonBlockSizes
from lowering import gpu_target
from cases import CASES, Case, make

ON_GPU = jax.devices()[0].platform == "gpu"
INTERPRET = (("default", INTERPRET_LOWERING),)
CUDA = (("default", xla.DENSE), ("cuda", LOWERING))
SMALL = TritonBlockSizes(*(16,) * 6)


def scaled(case: Case) -> Case:
    """The case with 2-3 blocks of 16 along each sequence axis, both ragged."""
    return dataclasses.replace(case, Tq=case.Tq * 3 + 4, Tk=case.Tk * 3 + 7)


def run(table):
    return lambda spec, q, k, v: core.run(spec, q, k, v, fn="flash", table=table)


def fwd_and_grads(f, spec, q, k, v):
    """out, lse and the gradients of a loss that weighs out and (finite) lse."""
    def loss(q, k, v, bias, sinks):
        res = f(spec.replace(bias=bias, sinks=sinks), q, k, v)
        lse = jnp.where(jnp.isfinite(res.lse), res.lse, 0.0)
        w_out = jnp.cos(jnp.arange(res.out.size, dtype=jnp.float32)).reshape(res.out.shape)
        w_lse = jnp.sin(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape)
        return jnp.sum(res.out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse), res

    (_, res), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
        q, k, v, spec.bias, spec.sinks)
    return res, grads


def assert_matches_reference(spec, q, k, v, *, tol, table=INTERPRET):
    res, grads = jax.jit(lambda *a: fwd_and_grads(run(table), *a))(spec, q, k, v)
    ref, ref_grads = jax.jit(lambda *a: fwd_and_grads(fnattn.reference, *a))(spec, q, k, v)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    assert res.out.dtype == q.dtype and res.lse.dtype == jnp.float32
    assert res.out.shape == ref.out.shape and res.lse.shape == ref.lse.shape
    assert np.isfinite(f32(res.out)).all()
    np.testing.assert_allclose(f32(res.out), f32(ref.out), atol=tol, rtol=tol)
    # -inf exactly where the reference has it (fully masked rows), close elsewhere.
    np.testing.assert_array_equal(np.isfinite(res.lse), np.isfinite(ref.lse))
    np.testing.assert_allclose(f32(res.lse), f32(ref.lse), atol=tol, rtol=tol)
    for name, g, gr in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, ref_grads):
        if gr is None:
            assert g is None, name
            continue
        g, gr = f32(g), f32(gr)
        assert g.shape == gr.shape, name
        assert np.isfinite(g).all(), name
        scale = max(1.0, float(np.abs(gr).max()))
        np.testing.assert_allclose(g, gr, atol=tol * scale, rtol=tol, err_msg=name)
    return res


# ----------------------------------------------------------------------------------
# Interpret mode against the reference
# ----------------------------------------------------------------------------------

TOL = {"float32": 2e-5, "bfloat16": 4e-2, "float16": 5e-3}


# Every feature at least once, each compile in interpret mode being slow: the
# cases left out here are covered by "everything" (bias, soft-cap, segments,
# dropout, Dv != D), "algebra" (chunked, windows), "causal_square",
# "sinks_masked", the per-head tests below (dense masks) and the dbias tests.
INTERPRET_CASES = [c for c in CASES if c.name in (
    "plain", "mha", "mqa", "causal_square", "window", "lengths", "prefix", "fn", "algebra",
    "sinks_masked", "everything", "bf16", "f16")]


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case):
    case = scaled(case)
    spec, q, k, v, _ = make(case, impl="xla")
    res = assert_matches_reference(spec.replace(block_sizes=SMALL), q, k, v,
                                   tol=TOL[case.dtype])
    if case.name == "lengths":  # batch row 1 has q_length 0: fully masked rows
        assert (np.asarray(res.out[1]) == 0).all()
        assert np.isneginf(np.asarray(res.lse[1])).all()


@pytest.mark.parametrize("name", ["mqa", "everything"])
def test_dkdv_over_whole_gqa_groups(monkeypatch, name):
    # Small problems split GQA groups over dk/dv programs; force whole groups.
    monkeypatch.setattr(triton, "MIN_DKDV_PROGRAMS", 1)
    case = scaled(next(c for c in CASES if c.name == name))
    spec, q, k, v, _ = make(case, impl="xla")
    assert triton._heads_per_dkdv_program(Dims(2, 1, 1, case.Hq, case.Hkv, 1, 1), 1) == \
        case.Hq // case.Hkv
    assert_matches_reference(spec.replace(block_sizes=SMALL), q, k, v, tol=2e-5)


@pytest.mark.parametrize("whole_groups", [False, True])
def test_per_head_mask_and_bias(monkeypatch, whole_groups):
    # A mask operand and a bias that vary along the query heads, with dropout.
    if whole_groups:
        monkeypatch.setattr(triton, "MIN_DKDV_PROGRAMS", 1)
    rs = np.random.default_rng(3)
    B, Tq, Tk, Hq, Hkv, D = 2, 29, 37, 6, 2, 7
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    keep = jnp.asarray(rs.random((B, Hq, Tq, Tk)) < 0.7) | (jnp.arange(Tk) < 3)
    mask = masks.from_array(keep) & masks.causal()
    bias = jnp.asarray(rs.standard_normal((B, Hq, 1, Tk)), jnp.float32)
    spec = AttentionSpec(mask=mask, bias=bias, dropout_rate=0.25,
                         dropout_key=jax.random.key(5), block_sizes=SMALL)
    assert_matches_reference(spec, q, k, v, tol=2e-5)


@pytest.mark.parametrize("shape", [(2, 4, 21, 37), (37,), (2, 1, 21, 1), (4, 1, 1)],
                         ids=["full", "keys", "rows", "heads"])
def test_dbias_in_the_bias_shape(shape):
    # (B, H, Tq, Tk) is stored tile by tile; broadcast shapes are summed in-kernel
    # (atomic adds where programs share an element).
    rs = np.random.default_rng(4)
    q = jnp.asarray(rs.standard_normal((2, 21, 4, 8)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((2, 37, 2, 8)), jnp.float32)
    bias = jnp.asarray(rs.standard_normal(shape), jnp.float32)
    spec = AttentionSpec(mask=masks.causal(), bias=bias, block_sizes=SMALL)
    assert_matches_reference(spec, q, k, k, tol=2e-5)


def test_fully_masked_rows_with_sinks_give_zero_and_lse_sink():
    case = Case("masked", B=2, Tq=21, Tk=37, mask="lengths", bias=True, softcap=5.0,
                sinks=True)
    spec, q, k, v, _ = make(case, impl="xla")  # batch row 1 has q_length 0
    res = assert_matches_reference(spec.replace(block_sizes=SMALL), q, k, v, tol=2e-5)
    assert (np.asarray(res.out[1]) == 0).all()
    np.testing.assert_allclose(np.asarray(res.lse[1]),
                               np.broadcast_to(np.asarray(spec.sinks)[:, None],
                                               res.lse[1].shape), rtol=1e-6)


def test_dropout_keep_mask_is_bit_exact():
    # With rate 0.5 a single differing keep bit changes the output by O(1).
    case = Case("drop", Tq=29, Tk=37, dropout=0.5, mask="causal")
    spec, q, k, v, _ = make(case, impl="xla")
    res = jax.jit(run(INTERPRET))(spec.replace(block_sizes=SMALL), q, k, v)
    ref = jax.jit(fnattn.reference)(spec, q, k, v)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=2e-6)
    other = jax.jit(run(INTERPRET))(spec.replace(dropout_key=jax.random.key(1),
                                                 block_sizes=SMALL), q, k, v)
    assert np.abs(np.asarray(other.out) - np.asarray(ref.out)).max() > 0.1


def test_layout_bhtd_and_default_block_sizes():
    spec, q, k, v, _ = make(scaled(CASES[20]), impl="xla", layout="bhtd")  # "everything"
    res = jax.jit(run(INTERPRET))(spec, q, k, v)
    ref = jax.jit(fnattn.reference)(spec, q, k, v)
    assert res.out.shape == ref.out.shape == (2, 6, 37, 3)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=2e-5)


def test_vmap_of_grad():
    rs = np.random.default_rng(0)
    x = jnp.asarray(rs.standard_normal((3, 1, 19, 2, 8)), jnp.float32)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.zeros(2), block_sizes=SMALL)

    def g(f):
        return jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(f(spec, x, x, x).out ** 2))))

    np.testing.assert_allclose(np.asarray(g(run(INTERPRET))(x)),
                               np.asarray(g(fnattn.reference)(x)), rtol=2e-5, atol=2e-5)


def test_impl_pallas_runs_the_interpreted_kernels_off_gpu():
    spec, q, k, v, _ = make(scaled(CASES[5]), impl="pallas")  # causal
    res = jax.jit(fnattn.flash)(spec.replace(block_sizes=SMALL), q, k, v)
    ref = jax.jit(fnattn.reference)(spec, q, k, v)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=2e-5)


# ----------------------------------------------------------------------------------
# Extreme inputs: huge logits, infinite sinks, poisoned masked keys, x64
# ----------------------------------------------------------------------------------

F32_MIN = float(np.finfo(np.float32).min)


def _extreme_bias(Hq, Tq, Tk):
    """A (1, Hq, Tq, Tk) bias whose rows hold the logits that broke the kernels:
    whole rows of -1e30, finfo.min, -1e9 and -1e8 (uniform softmax in float32),
    a single logit of 1e10, a row of -inf, a row half -1e30 (a tile boundary
    inside), the rest small."""
    b = np.random.default_rng(7).standard_normal((1, Hq, Tq, Tk)).astype(np.float32)
    b[:, :, 1] = -1e30
    b[:, :, 3] = F32_MIN
    b[:, :, 5] = -1e9
    b[:, :, 7] = -1e8
    b[:, :, 9, 20] = 1e10
    b[:, :, 11] = -np.inf
    b[:, :, 13, 10:] = -1e30
    b[:, 1, 15] = F32_MIN  # one head only
    return jnp.asarray(b)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "causal-sinks"])
def test_extreme_bias_rows_match_reference(masked):
    # The large-logit path (bias, no soft-cap) keeps the running max in natural
    # units and the backward recomputes P from lse and lse_lo: forward and every
    # gradient equal the float32 reference's (uniform rows at -1e9 included).
    rs = np.random.default_rng(8)
    B, Tq, Tk, Hq, Hkv, D = 1, 21, 37, 2, 1, 8
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    spec = AttentionSpec(bias=_extreme_bias(Hq, Tq, Tk), block_sizes=SMALL)
    if masked:
        spec = spec.replace(mask=masks.causal(), sinks=jnp.array([0.5, -1.0]))
    res = assert_matches_reference(spec, q, k, v, tol=2e-5)
    lse = np.asarray(res.lse)
    np.testing.assert_allclose(lse[0, :, 9], 1e10, rtol=1e-6)
    if not masked:  # (with sinks, the sink's logit dominates these rows)
        assert (lse[0, :, 1] == -1e30).all() and (lse[0, 0, 3] == F32_MIN)


@pytest.mark.parametrize("mask", [None, "lengths", "causal"])
def test_huge_logits_from_qk_keep_the_forwards_weights(mask):
    # Without bias, term or cap the kernels keep the fused base-2 state, and the
    # backward recomputes P from the base-2 lse in two parts
    # (_online.lse_parts_exp2, backward_rows(split=True)) that give back the
    # forward's own m + log2(l): at logits of 4e6 from q.k alone, where one
    # float32 base-2 lse put dv 20 % off (benchmarks/extreme_logits.py), out,
    # lse and dv are the XLA lowering's, dq and dk to the size of rounding.
    # With a mask, only within 10 %: on the masked tiles of the interpreted
    # kernels XLA:CPU may fuse the forward's s * c - m into one multiply-add and
    # not the backward's (jax 0.10 with XLA's optimising flags,
    # FNATTN_TEST_XLA_OPT=1; jax 0.11 with either), or round a logit's dot
    # product an ulp away from the forward's, 0.4 in base 2 at these sizes;
    # one float32 base-2 lse put the causal case's dv 20 % off.
    from fnattn.flash import xla as flash_xla
    rs = np.random.default_rng(9)
    B, T, Hq, Hkv, D = 1, 128, 4, 2, 64
    q = jnp.asarray(rs.standard_normal((B, T, Hq, D)) * 1e6, jnp.float32)
    k, v = (jnp.asarray(rs.standard_normal((B, T, Hkv, D)), jnp.float32) for _ in "kv")
    spec = AttentionSpec(mask={None: None, "causal": masks.causal(),
                               "lengths": masks.lengths(kv_lengths=jnp.array([100]))}[mask])
    (want, g_want), (got, g_got) = (
        jax.jit(lambda *a, t=t: fwd_and_grads(run(t), *a))(spec, q, k, v)
        for t in ((("default", flash_xla.LOWERING),), INTERPRET))
    assert float(jnp.max(jnp.abs(want.lse))) > 1e6
    np.testing.assert_allclose(got.out, want.out, atol=1e-5)
    np.testing.assert_allclose(got.lse, want.lse, rtol=1e-6)
    np.testing.assert_allclose(g_got[2], g_want[2], atol=(1e-5 if mask is None else 0.1)
                               * float(jnp.max(jnp.abs(g_want[2]))))
    if mask is None:
        dp = float(jnp.max(jnp.abs(v))) * float(jnp.sum(jnp.abs(jnp.cos(jnp.arange(D)))))
        for n in (0, 1):  # dq, dk: to 1e-5 of the size of rounding in dS times k or q
            size = D ** -0.5 * float(jnp.max(jnp.abs(k if n == 0 else q))) * dp
            np.testing.assert_array_less(jnp.abs(g_got[n] - g_want[n]), 1e-5 * size)


def vjp_all(f, spec, q, k, v, d_out, d_lse):
    """(out, lse) of ``f`` and its VJP for the cotangents (d_out, d_lse), under jit;
    the VJP w.r.t. q, k, v, bias, sinks. d_lse reaches rows whose lse is infinite."""
    def go(q, k, v, bias, sinks):
        res = f(spec.replace(bias=bias, sinks=sinks), q, k, v)
        return res.out, res.lse
    return jax.jit(lambda *a: (lambda o, vjp: (o, vjp((d_out, d_lse))))(
        *jax.vjp(go, *a)))(q, k, v, spec.bias, spec.sinks)


def test_infinite_sinks():
    # Head 0 has a -inf sink ("no sink"), head 1 +inf (takes all the mass), head
    # 2 a finite one; batch row 1 has q_length 0 (fully masked rows).
    rs = np.random.default_rng(9)
    B, Tq, Tk, Hq, D = 2, 21, 37, 3, 8
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, 1, D)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, Tk, 1, D)), jnp.float32)
    d_out = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((B, Hq, Tq)), jnp.float32)
    spec = AttentionSpec(mask=masks.lengths(jnp.array([Tq, 0]), jnp.array([Tk, 30])),
                         sinks=jnp.array([-jnp.inf, jnp.inf, 0.25]), block_sizes=SMALL)
    (out, lse), grads = vjp_all(run(INTERPRET), spec, q, k, v, d_out, d_lse)
    out, lse = np.asarray(out), np.asarray(lse)
    for x in (out, *grads):
        assert x is None or not np.isnan(np.asarray(x)).any()
    # -inf: no sink; fully masked rows give 0 and lse -inf.
    assert (out[1, :, 0] == 0).all() and np.isneginf(lse[1, 0]).all()
    # +inf: out 0, lse +inf, nothing flows back to q, k, v; d(sink) = sum of d_lse.
    assert (out[:, :, 1] == 0).all() and np.isposinf(lse[:, 1]).all()
    dsinks = np.asarray(grads[4])
    np.testing.assert_allclose(dsinks[1], np.asarray(d_lse[:, 1]).sum(), rtol=1e-5)
    # And the reference.
    (ref_out, ref_lse), ref_grads = vjp_all(fnattn.reference, spec, q, k, v, d_out, d_lse)
    np.testing.assert_allclose(out, np.asarray(ref_out), atol=2e-5)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(np.asarray(ref_lse)))
    np.testing.assert_allclose(lse, np.asarray(ref_lse), rtol=2e-5)
    for name, g, gr in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=1e-4, err_msg=name)
    np.testing.assert_allclose(dsinks, np.asarray(ref_grads[4]), rtol=1e-4, atol=1e-4)


def _poison(x, where, values=(np.nan, np.inf, -np.inf)):
    """x with non-finite values written into the (b, t) slots ``where`` selects."""
    x = np.array(x)
    idx = np.argwhere(where)
    for n, (b, t) in enumerate(idx):
        x[b, t, :, n % x.shape[-1]] = values[n % len(values)]
    return jnp.asarray(x)


def test_poisoned_keys_past_kv_lengths_contribute_nothing():
    # Keys past kv_lengths (a cache slot another request left NaN/inf) sit on
    # PARTIAL tiles of all three kernels: out, lse and every gradient equal the
    # reference on clean values, and dk/dv are exactly 0 there.
    rs = np.random.default_rng(10)
    B, Tq, Tk, Hq, Hkv, D = 2, 21, 37, 4, 2, 8
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    kv_len = np.array([19, 30])
    dead = np.arange(Tk)[None, :] >= kv_len[:, None]
    spec = AttentionSpec(mask=masks.causal() & masks.lengths(kv_lengths=jnp.asarray(kv_len)),
                         bias=jnp.asarray(rs.standard_normal((Tk,)), jnp.float32),
                         sinks=jnp.array([0.1, -0.3, 0.2, 0.0]), block_sizes=SMALL)
    d_out = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((B, Hq, Tq)), jnp.float32)
    kp, vp = _poison(k, dead), _poison(v, dead, (np.inf, np.nan))
    (out, lse), grads = vjp_all(run(INTERPRET), spec, q, kp, vp, d_out, d_lse)
    (ref_out, ref_lse), ref_grads = vjp_all(fnattn.reference, spec, q, k, v, d_out, d_lse)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-5)
    for name, g, gr in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, ref_grads):
        g, gr = np.asarray(g), np.asarray(gr)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, gr, atol=1e-4, rtol=1e-4, err_msg=name)
    for g in grads[1:3]:
        assert (np.asarray(g)[dead] == 0).all()


def test_poisoned_future_key_reaches_only_the_rows_that_see_it():
    # Causal: a NaN key at position 9 is masked for rows 0-8 (on the diagonal's
    # PARTIAL tile), which equal the clean reference, dq included; rows 9- see
    # it and are NaN.
    rs = np.random.default_rng(11)
    B, T, H, D = 1, 21, 2, 8
    q, k, v = (jnp.asarray(rs.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))
    bad = np.zeros((B, T), bool)
    bad[0, 9] = True
    spec = AttentionSpec(mask=masks.causal(), block_sizes=SMALL)
    d_out = jnp.asarray(rs.standard_normal((B, T, H, D)), jnp.float32)
    d_lse = jnp.zeros((B, H, T), jnp.float32)
    (out, lse), grads = vjp_all(run(INTERPRET), spec, q, _poison(k, bad),
                                _poison(v, bad, (np.inf,)), d_out, d_lse)
    (ref_out, ref_lse), ref_grads = vjp_all(fnattn.reference, spec, q, k, v, d_out, d_lse)
    out, dq = np.asarray(out), np.asarray(grads[0])
    np.testing.assert_allclose(out[:, :9], np.asarray(ref_out)[:, :9], atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[..., :9], np.asarray(ref_lse)[..., :9],
                               atol=2e-5)
    np.testing.assert_allclose(dq[:, :9], np.asarray(ref_grads[0])[:, :9], atol=1e-4)
    assert np.isnan(out[:, 9:]).all(axis=(0, 2, 3)).all()


def test_x64_traces_and_interprets():
    # Under jax_enable_x64 Python ints and loop counters are int64: every index
    # the kernels build is pinned to int32. A broadcast bias takes the dbias
    # atomic-add path, whose interpret rule wants one index dtype.
    rs = np.random.default_rng(12)
    q = jnp.asarray(rs.standard_normal((1, 21, 2, 8)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((1, 37, 1, 8)), jnp.float32)
    spec = AttentionSpec(mask=masks.causal(), bias=jnp.asarray(rs.standard_normal((37,)),
                                                               jnp.float32),
                         sinks=jnp.array([0.3, -0.2]), block_sizes=SMALL)
    with jax.enable_x64(True):
        res = assert_matches_reference(spec, q, k, k, tol=2e-5)
    assert res.out.dtype == res.lse.dtype == jnp.float32


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_large_logit_and_poison_paths_lower_for_cuda(x64, dtype):
    # Bias without soft-cap (natural-unit max, lse_lo), sinks, a mask (PARTIAL
    # tiles with the K/V cleaning), a broadcast bias (atomic dbias).
    B, T, Hq, Hkv, D = 2, 300, 4, 2, 64
    q = jax.ShapeDtypeStruct((B, T, Hq, D), dtype)
    kv = jax.ShapeDtypeStruct((B, T, Hkv, D), dtype)
    bias = jax.ShapeDtypeStruct((1, Hq, 1, T), jnp.float32)
    sinks = jax.ShapeDtypeStruct((Hq,), jnp.float32)
    mask = masks.causal() & masks.lengths(kv_lengths=jnp.array([T, 200]))

    def loss(q, k, v, bias, sinks):
        res = run(CUDA)(AttentionSpec(mask=mask, bias=bias, sinks=sinks), q, k, v)
        return jnp.sum(res.out.astype(jnp.float32)) + jnp.sum(res.lse)

    with jax.enable_x64(x64), gpu_target():
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(
            q, kv, kv, bias, sinks).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("fnattn_flash_fwd", "fnattn_flash_dq", "fnattn_flash_dkdv"):
        assert name in text


# ----------------------------------------------------------------------------------
# Schedules, block sizes
# ----------------------------------------------------------------------------------


def _cfg(mask, tq, tk, hq=2, hkv=1, d=16):
    from fnattn import _dispatch
    dims = Dims(1, tq, tk, hq, hkv, d, d)
    return _dispatch.Config(dims=dims, scale=d ** -0.5, softcap=None, dropout_rate=0.0,
                            mask_treedef=jax.tree_util.tree_structure(mask))


def test_schedule_lists_full_tiles_first_then_partial():
    mask = masks.causal()
    cfg = _cfg(mask, 64, 64)
    K = triton._make_k(cfg, mask, None, None, 16, 16)
    table = np.asarray(jax.jit(lambda: triton._schedule(mask, cfg, K))())
    assert table.shape == (1, 1, 4, 2 + 2 * 4)
    row = table[0, 0, 3]  # q-block 3: kv-blocks 0-2 FULL, 3 PARTIAL (the diagonal)
    assert row[0] == 3 and row[1] == 1
    np.testing.assert_array_equal(row[2:5], [0, 1, 2])
    assert row[2 + 4] == 3
    # Transposed (dk/dv): kv-block 0 is seen fully by q-blocks 1-3, partially by 0.
    t = np.asarray(jax.jit(lambda: triton._schedule(mask, cfg, K, transpose=True))())
    assert t[0, 0, 0, 0] == 3 and t[0, 0, 0, 1] == 1
    np.testing.assert_array_equal(t[0, 0, 0, 2:5], [1, 2, 3])


def test_sliding_window_visits_few_tiles():
    mask = masks.sliding_window(left=16)
    cfg = _cfg(mask, 256, 256)
    K = triton._make_k(cfg, mask, None, None, 16, 16)
    table = np.asarray(jax.jit(lambda: triton._schedule(mask, cfg, K))())
    visited = table[..., 0] + table[..., 1]
    assert visited.max() <= 3 and visited.sum() <= 3 * 16


def test_no_mask_needs_no_schedule():
    jaxpr = jax.make_jaxpr(lambda q: run(INTERPRET)(AttentionSpec(), q, q, q).out)(
        jnp.ones((1, 64, 2, 16)))
    calls = [e for e in jaxpr.eqns if e.primitive.name == "custom_jvp_call"]
    assert calls
    text = str(jaxpr)
    assert "argsort" not in text and "sort" not in text


def test_block_size_validation():
    with pytest.raises(ValueError, match="TritonBlockSizes: block_k must be a power of two "
                                         ">= 16; got 48"):
        TritonBlockSizes(block_k=48)
    with pytest.raises(ValueError, match="TritonBlockSizes: num_warps must be a power of two "
                                         "<= 32; got 6"):
        TritonBlockSizes(num_warps=6)
    with pytest.raises(ValueError, match="num_stages_dq must be an int >= 1; got 0"):
        TritonBlockSizes(num_stages_dq=0)


@pytest.mark.parametrize("d,dtype", [(64, "bfloat16"), (80, "bfloat16"), (128, "bfloat16"),
                                     (128, "float32"), (256, "bfloat16"), (256, "float32")])
def test_default_block_sizes_fit_an_h100(d, dtype):
    bs = TritonBlockSizes.default(Dims(1, 8192, 8192, 8, 8, d, d), dtype)
    dp, item = triton._pow2(d), jnp.dtype(dtype).itemsize
    # Shared memory: the held tile plus num_stages copies of the streamed tiles
    # must stay under the H100's 227 KiB per block.
    fwd = (bs.block_q + bs.num_stages * 2 * bs.block_k) * dp * item
    dq = (2 * bs.block_q_dq + bs.num_stages_dq * 2 * bs.block_k_dq) * dp * item
    dkdv = (2 * bs.block_k_dkdv + bs.num_stages_dkdv * 2 * bs.block_q_dkdv) * dp * item
    assert max(fwd, dq, dkdv) <= 227 * 1024, (fwd, dq, dkdv)
    # Registers: float32 accumulators per thread well under 255.
    assert bs.block_q * dp // (32 * bs.num_warps) <= 128
    assert 2 * bs.block_k_dkdv * dp // (32 * bs.num_warps_dkdv) <= 128


@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("tile_bytes", [1, 4, 5])
def test_tiles_of_a_bias_or_array_mask_shrink_blocks_to_fit(d, tile_bytes):
    """A float32 bias (4 bytes per pair), a boolean mask (1) or both, streamed as
    (block_q, block_k) tiles: each kernel's staged operands fit SMEM_BUDGET (the
    tuned defaults did not: 352 KB requested on an H100 at D=128), and specs
    without such tiles keep the tuned defaults."""
    cfg = Config(Dims(1, 4096, 4096, 8, 8, d, d), 0.1, None, 0.0, None)
    dp = triton._pow2(d)
    for which in ("fwd", "dq", "dkdv"):
        bq, bk, params = triton._blocks_for(cfg, jnp.bfloat16, which, tile_bytes)
        assert triton._smem_estimate(which, bq, bk, params.num_stages, dp, dp, 2,
                                     tile_bytes) <= triton.SMEM_BUDGET, (which, bq, bk)
        assert min(bq, bk) >= 32
        plain = triton._blocks_for(cfg, jnp.bfloat16, which)
        default = TritonBlockSizes.default(cfg.dims, jnp.bfloat16)
        assert plain[:2] == {"fwd": (default.block_q, default.block_k),
                             "dq": (default.block_q_dq, default.block_k_dq),
                             "dkdv": (default.block_q_dkdv, default.block_k_dkdv)}[which]
    given = TritonBlockSizes(block_q=128, block_k=128)
    assert triton._blocks_for(dataclasses.replace(cfg, block_sizes=given), jnp.bfloat16,
                              "fwd", tile_bytes)[:2] == (128, 128)


def test_tile_bytes_counts_inputs_varying_along_both_sequences():
    T = 64
    full, row = jnp.zeros((2, 1, T, T)), jnp.zeros((2, 1, 1, T))
    assert triton._tile_bytes(None, None) == 0
    assert triton._tile_bytes(full, None) == 4 and triton._tile_bytes(row, None) == 0
    assert triton._tile_bytes(full.astype(jnp.bfloat16), masks.causal()) == 2
    arr = masks.from_array(jnp.ones((T, T), bool))
    assert triton._tile_bytes(full, arr) == 5
    seg = masks.segments(jnp.zeros((2, T), jnp.int32), jnp.zeros((2, T), jnp.int32))
    assert triton._tile_bytes(None, seg) == 0


def test_spec_block_sizes_are_used():
    spec, q, k, v, _ = make(scaled(CASES[5]), impl="xla")
    bs = TritonBlockSizes(block_q=32, block_k=16, block_q_dq=16, block_k_dq=32,
                          block_q_dkdv=32, block_k_dkdv=16)
    assert_matches_reference(spec.replace(block_sizes=(fnattn.XlaBlockSizes(8, 8), bs)),
                             q, k, v, tol=2e-5)


# ----------------------------------------------------------------------------------
# Lowering to Triton for "cuda" (runs on CPU)
# ----------------------------------------------------------------------------------

LOWER_CASES = [
    # (case name from CASES, D, Dv, dtype)
    ("plain", 64, 64, "bfloat16"),
    ("mqa", 80, 80, "bfloat16"),
    ("dv", 128, 96, "bfloat16"),
    ("causal", 128, 128, "float16"),
    ("causal_square", 256, 256, "bfloat16"),
    ("segments", 64, 64, "float32"),
    ("lengths", 96, 96, "bfloat16"),
    ("array", 128, 128, "bfloat16"),
    ("fn", 64, 64, "bfloat16"),
    ("algebra", 80, 80, "float16"),
    ("bias", 128, 128, "float32"),
    ("softcap", 256, 256, "float32"),
    ("sinks_masked", 64, 64, "bfloat16"),
    ("dropout", 128, 128, "bfloat16"),
    ("everything", 80, 48, "bfloat16"),
    ("everything", 128, 128, "float16"),
]


@pytest.mark.parametrize("name,D,Dv,dtype", LOWER_CASES,
                         ids=[f"{n}-{d}-{dv}-{t}" for n, d, dv, t in LOWER_CASES])
def test_lowers_for_cuda(name, D, Dv, dtype):
    base = next(c for c in CASES if c.name == name)
    case = dataclasses.replace(base, D=D, Dv=Dv if base.Dv != base.D else D, dtype=dtype,
                               Tq=base.Tq * 37, Tk=base.Tk * 37)
    spec, q, k, v, _ = make(case, impl="xla")
    f = run(CUDA)

    def loss(q, k, v, bias, sinks):
        res = f(spec.replace(bias=bias, sinks=sinks), q, k, v)
        return jnp.sum(res.out.astype(jnp.float32)) + jnp.sum(jnp.where(
            jnp.isfinite(res.lse), res.lse, 0.0))

    with gpu_target():
        fwd = jax.jit(f).trace(spec, q, k, v).lower(lowering_platforms=("cuda",)).as_text()
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(
            q, k, v, spec.bias, spec.sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert fwd.count("fnattn_flash_fwd") >= 1
    assert "fnattn_flash_dq" in bwd and "fnattn_flash_dkdv" in bwd


def test_lowers_for_cuda_with_whole_gqa_groups_and_long_sequences(monkeypatch):
    monkeypatch.setattr(triton, "MIN_DKDV_PROGRAMS", 1)
    B, T, Hq, Hkv, D = 1, 8192, 8, 2, 128
    q = jax.ShapeDtypeStruct((B, T, Hq, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, Hkv, D), jnp.bfloat16)
    for mask in (None, masks.causal()):
        spec = AttentionSpec(mask=mask)
        g = jax.jit(jax.grad(lambda q, k, v: run(CUDA)(spec, q, k, v).out.astype(
            jnp.float32).sum(), argnums=(0, 1, 2)))
        with gpu_target():
            text = g.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
        assert "fnattn_flash_dkdv" in text


def test_tables_too_large_to_embed_are_built_in_xla(monkeypatch):
    """Past blocks.EMBEDDED_TILES, an array-free mask's tables are computed in
    XLA at every call instead of embedded as constants: the same results in
    interpret mode (forward and gradients), and no table constant in the program
    lowered for cuda."""
    from fnattn.flash import blocks
    case = dataclasses.replace(next(c for c in CASES if c.name == "window"), Tq=52, Tk=71)
    spec, q, k, v, _ = make(case, impl="xla")
    spec = spec.replace(block_sizes=SMALL)
    f = jax.jit(lambda *a: fwd_and_grads(run(INTERPRET), *a))
    ql = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)

    def lowered():
        g = jax.jit(jax.grad(lambda q: run(CUDA)(AttentionSpec(mask=masks.causal()), q, q, q)
                             .out.astype(jnp.float32).sum()))
        with gpu_target():
            return g.trace(ql).lower(lowering_platforms=("cuda",)).as_text()

    embedded, text_embedded = f(spec, q, k, v), lowered()
    monkeypatch.setattr(blocks, "EMBEDDED_TILES", 0)
    jax.clear_caches()
    built, text_built = f(spec, q, k, v), lowered()
    for a, b in zip(jax.tree_util.tree_leaves(embedded), jax.tree_util.tree_leaves(built)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The tables ((B|1, H|1, row-blocks, 2 + 2 * column-blocks) int32 constants)
    # leave the program, replaced by the ops that build them.
    table = re.compile(r"stablehlo\.constant dense<[^>]*> : tensor<1x1x\d+x\d+xi32>")
    assert table.search(text_embedded) and not table.search(text_built)
    assert "fnattn_flash_dq" in text_built and "fnattn_flash_dkdv" in text_built


# ----------------------------------------------------------------------------------
# The real kernels on an NVIDIA GPU
# ----------------------------------------------------------------------------------

GPU_CASES = ["plain", "mqa", "dv", "causal", "causal_square", "window", "segments", "lengths",
             "prefix", "array", "fn", "bias", "softcap", "sinks_masked", "dropout",
             "everything", "bf16", "f16"]


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", GPU_CASES)
@pytest.mark.parametrize("D", [64, 80, 128])
def test_gpu_kernels_match_reference(name, D):
    base = next(c for c in CASES if c.name == name)
    dtype = "bfloat16" if base.dtype == "float32" else base.dtype
    case = dataclasses.replace(base, D=D, Dv=D if base.Dv == base.D else 48, dtype=dtype,
                               Tq=base.Tq * 37, Tk=base.Tk * 37)
    spec, q, k, v, _ = make(case, impl="xla")
    assert_matches_reference(spec, q, k, v, tol={"bfloat16": 3e-2, "float16": 5e-3}[dtype],
                             table=CUDA)


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_long_sequence_bf16(causal):
    rs = np.random.default_rng(0)
    B, T, H, D = 1, 4096, 4, 128
    q, k, v = (jnp.asarray(rs.standard_normal((B, T, H, D)), jnp.bfloat16) for _ in range(3))
    spec = AttentionSpec(mask=masks.causal() if causal else None)
    res = jax.jit(run(CUDA))(spec, q, k, v)
    ref = jax.jit(fnattn.reference)(spec, q, k, v)
    np.testing.assert_allclose(np.asarray(res.out, np.float32), np.asarray(ref.out, np.float32),
                               atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(res.lse), np.asarray(ref.lse), atol=1e-3, rtol=1e-3)
