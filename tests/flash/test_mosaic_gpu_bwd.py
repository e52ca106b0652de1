"""The Pallas Mosaic GPU backward (fnattn/flash/mosaic_gpu_bwd.py).

Three groups:

* the Mosaic GPU interpreter on CPU: gradients through ``core.run`` with the
  interpreted Mosaic GPU forward and this backward, against the float32
  gradients of ``fnattn.reference``. The interpreter takes no transposed or
  register ``wgmma`` operand and no TMA reduction, so there the products are
  ``jnp`` dots of the same shared-memory tiles and dQ is read, added and
  written back;
* lowering for "cuda" on CPU: the real ``wgmma`` kernel over head dims, masks,
  GQA and ``vmap``;
* the real kernels on an NVIDIA GPU (skipped without one).

The interpreted tests compile each warpgroup program once
(tests/mosaic_gpu_interpreter.py).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, core, masks, position_bias
from fnattn._checks import Dims
from fnattn._dispatch import Config, Lowering
from fnattn.flash import mosaic_gpu, mosaic_gpu_bwd, triton, xla
from fnattn.flash.mosaic_gpu import MosaicGpuBlockSizes
from fnattn.flash.mosaic_gpu_bwd import MosaicGpuBwdBlockSizes
from lowering import gpu_target, mosaic_gpu_smem
from mosaic_gpu_interpreter import (REDO_KERNELS, compile_once, flash_table, reset_after_failure,
                                   triton_kernels)
from test_reliability import _two_keys_per_row

ON_GPU = jax.devices()[0].platform == "gpu"
SMALL = MosaicGpuBlockSizes(block_q=64, block_k=64, max_concurrent_steps=2)


def f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def qkv(*, B=1, Tq=128, Tk=128, Hq=1, Hkv=1, D=64, Dv=None, dtype=jnp.float16, seed=0):
    kq, kk, kv, ko, kl = jax.random.split(jax.random.key(seed), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    q = normal(kq, (B, Tq, Hq, D)).astype(dtype)
    k = normal(kk, (B, Tk, Hkv, D)).astype(dtype)
    v = normal(kv, (B, Tk, Hkv, Dv or D)).astype(dtype)
    d_out = normal(ko, (B, Tq, Hq, Dv or D)).astype(dtype)
    d_lse = normal(kl, (B, Hq, Tq))
    return q, k, v, d_out, d_lse


# ----------------------------------------------------------------------------------
# Interpreted on CPU
# ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted():
    """The lowering table of the interpreted Mosaic GPU forward and backward."""
    with compile_once():
        yield flash_table("flash-mosaic-gpu-bwd-interpret")


def _with_sinks(run, spec, sinks):
    """``run(spec, q, k, v)`` as a function of ``(q, k, v)``, or of ``(q, k, v,
    sinks)`` when ``sinks`` is given (differentiated: the spec's travel apart)."""
    if sinks is None:
        return lambda q, k, v: run(spec, q, k, v)
    return lambda q, k, v, s: run(spec.replace(sinks=s), q, k, v)


@functools.partial(jax.jit, static_argnums=6)
def _vjp(spec, q, k, v, d_out, d_lse, table, sinks):
    def run(spec, q, k, v):
        res = core.run(spec, q, k, v, fn="flash", table=table)
        return res.out, res.lse

    args = (q, k, v) if sinks is None else (q, k, v, sinks)
    (out, lse), vjp = jax.vjp(_with_sinks(run, spec, sinks), *args)
    return out, lse, vjp((d_out, d_lse))


def outputs_and_grads(spec, q, k, v, d_out, d_lse, table, sinks=None):
    """``(out, lse, (dq, dk, dv))`` through ``core.run`` with ``table``: the VJP for
    the cotangents of ``out`` and ``lse``, under ``jit``; with ``sinks`` (the
    spec's, given apart) also their gradient, last."""
    try:
        return jax.block_until_ready(_vjp(spec, q, k, v, d_out, d_lse, table, sinks))
    except Exception:
        reset_after_failure()
        raise


@jax.jit
def reference(spec, q, k, v, d_out, d_lse, sinks=None):
    """The float32 reference's ``(out, lse, (dq, dk, dv[, dsinks]))``."""
    def run(spec, q, k, v):
        res = fnattn.reference(spec, q, k, v)
        return res.out, res.lse

    args = tuple(x.astype(jnp.float32) for x in (q, k, v))
    args += () if sinks is None else (sinks,)
    (out, lse), vjp = jax.vjp(_with_sinks(run, spec, sinks), *args)
    return out, lse, vjp((d_out.astype(jnp.float32), d_lse))


def assert_grads_close(grads, ref_grads, *, tol=2e-2, names=("dq", "dk", "dv", "dsinks")):
    for name, g, r in zip(names, grads, ref_grads):
        assert g.shape == r.shape, name
        g, r = f32(g), f32(r)
        assert np.isfinite(g).all(), name
        scale = max(float(np.abs(r).max()), 1e-6)
        np.testing.assert_allclose(g / scale, r / scale, atol=tol, err_msg=name)


# name: (mask, spec settings, sizes, the whole GQA group in one program)
INTERPRET_CASES = {
    # Causal, bottom-right aligned with Tq > Tk: the first 64 rows see no key
    # (lse = -inf, zero gradients); GQA 2:1 accumulated over the group in-kernel.
    "causal_gqa_rows_that_see_nothing": (
        masks.causal(), {}, dict(Tq=128, Tk=64, Hq=2, Hkv=1, D=64), True),
    # The same with a sink per head: rows that see no key have lse = the sink
    # and still zero dq; d(sinks) against the reference's.
    "causal_gqa_sinks": (
        masks.causal(), dict(sinks=(0.5, -1.0)), dict(Tq=128, Tk=64, Hq=2, Hkv=1, D=64), True),
    # A sliding window, soft-cap and scale, ragged Tq != Tk (PARTIAL tiles from
    # the mask and from the ragged bound), the GQA group split over programs
    # (float32 partials), head dim 128 (two dQ column chunks), bfloat16.
    "window_softcap_ragged_gqa_split": (
        masks.sliding_window(40, 20), dict(softcap=2.0, scale=0.3),
        dict(Tq=100, Tk=150, Hq=2, Hkv=1, D=128, dtype=jnp.bfloat16), False),
    # Dropout (the forward's keep mask drawn again in the transposed tile), causal
    # on ragged 128 x 192, GQA 2:1 over the group in one program.
    "causal_dropout_gqa": (
        masks.causal(), dict(dropout_rate=0.25, dropout_key=jax.random.key(3)),
        dict(Tq=128, Tk=192, Hq=2, Hkv=1, D=64), True),
    # No mask, head dim 256: the column split (both consumers on the same keys).
    "no_mask_head_dim_256": (None, {}, dict(Tq=64, Tk=128, D=256), False),
    # D = 96, Dv = 48: computed at 128 with zero columns (kernel_dim), causal
    # GQA 2:1 with sinks; the gradients keep their own head dims.
    "d96_dv48_causal_gqa_sinks": (
        masks.causal(), dict(sinks=(0.5, -1.0)), dict(Tq=128, Tk=192, Hq=2, Hkv=1, D=96, Dv=48),
        True),
    # D = 160 at 192: the column split (128 + 64) on padded heads, a window.
    "window_d160": (masks.sliding_window(60), {}, dict(Tq=64, Tk=128, D=160), False),
    # ALiBi (slopes held fixed) on every tile, FULL ones included: in natural
    # units (no cap; lse_lo a third row statistic) with sinks and GQA 2:1 ...
    "alibi_causal_gqa_sinks": (
        masks.causal(), dict(sinks=(0.5, -1.0), position_bias=position_bias.alibi(
            jnp.array([0.5, 0.125]))), dict(Tq=128, Tk=192, Hq=2, Hkv=1, D=64), True),
    # ... a sum of two under a soft-cap with dropout, no mask, the group split ...
    "alibi_sum_softcap_dropout_no_mask": (
        None, dict(softcap=4.0, dropout_rate=0.25, dropout_key=jax.random.key(5),
                   position_bias=(position_bias.alibi(jnp.array([0.25, 1.0]))
                                  + position_bias.alibi(jnp.array([0.0, -0.5])))),
        dict(Tq=100, Tk=150, Hq=2, Hkv=1, D=64), False),
    # ... and on the column split (D = 256), a window, ragged.
    "alibi_window_d256": (
        masks.sliding_window(50, 10), dict(position_bias=position_bias.alibi(jnp.array([2.0]))),
        dict(Tq=64, Tk=100, D=256), False),
    # A from_fn term Mosaic GPU compiles (its array per (batch row, head), a
    # select of the head and batch indices), two batch rows.
    "from_fn_term_causal": (
        masks.causal(), dict(position_bias=position_bias.from_fn(
            lambda b, h, q, k, r: (-r * jnp.log(1.0 + jnp.abs(q - k).astype(jnp.float32))
                                   + jnp.where(h == 0, 0.5, -0.5) * (b + 1)),
            jnp.array([[0.5, 2.0], [0.25, 1.0]]))), dict(B=2, Tq=128, Tk=128, Hq=2, Hkv=1),
        False),
}


@pytest.mark.parametrize("name", INTERPRET_CASES)
def test_interpreted_gradients_match_reference(name, interpreted, monkeypatch):
    mask, settings, sizes, whole_group = INTERPRET_CASES[name]
    if whole_group:  # (the small problem would otherwise split the group)
        monkeypatch.setattr(triton, "MIN_DKDV_PROGRAMS", 0)
    q, k, v, d_out, d_lse = qkv(**sizes)
    settings = dict(settings)
    sinks = settings.pop("sinks", None)
    sinks = None if sinks is None else jnp.array(sinks, jnp.float32)
    spec = AttentionSpec(mask=mask, return_lse=True, block_sizes=SMALL, **settings)
    out, lse, grads = outputs_and_grads(spec, q, k, v, d_out, d_lse, interpreted, sinks)
    r_out, r_lse, r_grads = reference(spec, q, k, v, d_out, d_lse, sinks)
    np.testing.assert_allclose(f32(out), f32(r_out), atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.isfinite(f32(lse)), np.isfinite(f32(r_lse)))
    np.testing.assert_allclose(f32(lse), f32(r_lse), atol=2e-2, rtol=2e-2)
    dtypes = [q.dtype, k.dtype, v.dtype] + ([] if sinks is None else [jnp.float32])
    assert [g.dtype for g in grads] == dtypes
    assert_grads_close(grads, r_grads)
    if name.startswith("causal_gqa"):
        rows_lse = -np.inf if sinks is None else np.asarray(sinks)[None, :, None]
        np.testing.assert_array_equal(f32(lse)[:, :, :64],
                                      np.broadcast_to(rows_lse, (1, 2, 64)))
        assert (f32(grads[0])[:, :64] == 0).all()  # (d_lse reaches them: still 0)


def test_interpreted_tables_too_large_to_embed_are_built_in_xla(interpreted, monkeypatch):
    """Past blocks.EMBEDDED_TILES the forward's and the backward's visiting
    tables of an array-free mask come from XLA (dynamic_schedule), with the
    same results as the embedded ones."""
    from fnattn.flash import blocks
    monkeypatch.setattr(triton, "MIN_DKDV_PROGRAMS", 0)
    q, k, v, d_out, d_lse = qkv(Tq=128, Tk=192, Hq=2, Hkv=1)
    sinks = jnp.array([0.5, -1.0], jnp.float32)
    spec = AttentionSpec(mask=masks.causal(), return_lse=True, block_sizes=SMALL)
    embedded = outputs_and_grads(spec, q, k, v, d_out, d_lse, interpreted, sinks)
    built_with = []
    real = mosaic_gpu.dynamic_schedule

    def spy(*args, transpose=False, **kw):
        built_with.append(transpose)
        return real(*args, transpose=transpose, **kw)

    monkeypatch.setattr(mosaic_gpu, "dynamic_schedule", spy)
    monkeypatch.setattr(blocks, "EMBEDDED_TILES", 0)
    jax.clear_caches()
    built = outputs_and_grads(spec, q, k, v, d_out, d_lse, interpreted, sinks)
    assert sorted(set(built_with)) == [False, True]
    for a, b in zip(jax.tree_util.tree_leaves(embedded), jax.tree_util.tree_leaves(built)):
        np.testing.assert_array_equal(f32(a), f32(b))


def test_interpreted_huge_logits_from_qk_keep_the_forwards_weights(interpreted):
    """Logits of about 4e8 from q.k alone (no term, no cap): the backward
    recomputes P from the base-2 lse in two parts (``_Plan.split``, a third row
    statistic), which give back the forward's own weights, where one float32
    base-2 lse made dv wrong by orders of magnitude; out, lse and dv are the
    float32 reference's."""
    q, k, v, d_out, d_lse = qkv(Tq=128, Tk=128, Hq=2, Hkv=1, dtype=jnp.bfloat16)
    q = (q.astype(jnp.float32) * 1e8).astype(q.dtype)
    spec = AttentionSpec(return_lse=True, block_sizes=SMALL)
    out, lse, grads = outputs_and_grads(spec, q, k, v, d_out, d_lse, interpreted)
    r_out, r_lse, r_grads = reference(spec, q, k, v, d_out, d_lse)
    assert float(np.abs(f32(r_lse)).max()) > 1e8
    np.testing.assert_allclose(f32(out), f32(r_out), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(f32(lse), f32(r_lse), rtol=1e-6)
    assert_grads_close(grads[2:], r_grads[2:], names=("dv",))


def test_interpreted_huge_terms_keep_rows_exact(interpreted):
    """ALiBi slopes of 1e30 with no key within distance 4 of a row: every logit
    about -4e30, which the natural-unit recomputation (z - lse - lse_lo) still
    weighs exactly, as the reference does."""
    q, k, v, d_out, d_lse = qkv(Tq=128, Tk=128, Hq=2, Hkv=2)
    spec = AttentionSpec(mask=~masks.sliding_window(3, 3), return_lse=True, block_sizes=SMALL,
                         position_bias=position_bias.alibi(jnp.array([1e30, 1.0])))
    out, lse, grads = outputs_and_grads(spec, q, k, v, d_out, d_lse, interpreted)
    r_out, r_lse, r_grads = reference(spec, q, k, v, d_out, d_lse)
    np.testing.assert_allclose(f32(out), f32(r_out), atol=2e-2, rtol=2e-2)
    assert_grads_close(grads, r_grads)


def test_interpreted_learned_arrays_it_cannot_differentiate_are_refused(interpreted):
    """A ``from_fn`` term using its learned array's value twice (``r * r``):
    its tangent needs an ``add_any``, which Mosaic GPU does not lower, so the
    kernel refuses the gradient, naming the operation and the Triton backward
    (impl="auto" takes that one)."""
    q, k, v, _, _ = qkv(Tq=64, Tk=64, Hq=2, Hkv=2)

    def loss(rates):
        term = position_bias.from_fn(lambda b, h, q, k, r: r * r * (k - q), rates)
        spec = AttentionSpec(mask=masks.causal(), block_sizes=SMALL, position_bias=term)
        return core.run(spec, q, k, v, fn="flash", table=interpreted).out.astype(
            jnp.float32).sum()

    with pytest.raises(NotImplementedError, match=r"uses add_any, which the Pallas Mosaic GPU "
                                                  r"kernels do not compile.*Triton backward"):
        jax.jit(jax.grad(loss))(jnp.array([0.5, 0.25]))


def test_interpreted_poisoned_hidden_keys(interpreted):
    """NaN and inf in K and V of keys a window hides from some rows, on PARTIAL
    tiles: the rows that do not see them get the clean reference's dq, and the
    keys only such rows see get its dk and dv; the rows that see one are NaN."""
    q, k, v, d_out, d_lse = qkv(Tq=128, Tk=128)
    spec = AttentionSpec(mask=masks.sliding_window(16, 16), return_lse=True, block_sizes=SMALL)
    bad_k, bad_v = 100, 90
    k2 = k.at[0, bad_k, 0, 3].set(jnp.nan)
    v2 = v.at[0, bad_v, 0, 5].set(jnp.inf).at[0, bad_k, 0, 7].set(jnp.nan)
    out, _, (dq, dk, dv) = outputs_and_grads(spec, q, k2, v2, d_out, d_lse, interpreted)
    _, _, (r_dq, r_dk, r_dv) = reference(spec, q, k, v, d_out, d_lse)
    clean_rows = slice(0, bad_v - 16)      # rows 0..73 see neither key
    clean_keys = slice(0, bad_v - 32)      # keys 0..57: seen only by clean rows
    assert_grads_close((dq[:, clean_rows], dk[:, clean_keys], dv[:, clean_keys]),
                       (r_dq[:, clean_rows], r_dk[:, clean_keys], r_dv[:, clean_keys]))
    assert np.isnan(f32(out)[0, bad_v - 16:bad_k + 17]).all(axis=-1).all()
    assert np.isnan(f32(dq)[0, bad_v - 16:bad_k + 17]).any(axis=-1).all()


def test_interpreted_padding_rows_never_meet_the_keys_only_they_would_see(interpreted):
    """Tq = 70 in programs of 128 rows: the padding rows 70.. would see keys
    139..191 by the mask's predicate, keys no query row sees and which hold NaN
    and inf. Every gradient is the clean reference's, and those keys' dk and dv
    are 0 (a padding row's NaN logit would reach them as 0 * NaN)."""
    q, k, v, d_out, d_lse = qkv(Tq=70, Tk=192)
    spec = AttentionSpec(mask=masks.from_fn(_two_keys_per_row), return_lse=True,
                         block_sizes=SMALL)
    k2, v2 = k.at[:, 139:].set(jnp.nan), v.at[:, 139:].set(jnp.inf)
    out, _, grads = outputs_and_grads(spec, q, k2, v2, d_out, d_lse, interpreted)
    _, _, r_grads = reference(spec, q, k, v, d_out, d_lse)
    assert_grads_close(grads, r_grads)
    assert (f32(grads[1])[:, 139:] == 0).all() and (f32(grads[2])[:, 139:] == 0).all()


LEARNED_TERM_CASES = {
    # ALiBi's slopes and a from_fn term's per-(row, head) rates, learned, with a
    # soft-cap, GQA 2:1 split over programs (each program one head: the sums
    # of each go to their head), two batch rows, ragged keys ...
    "alibi_and_from_fn_gqa_split": (masks.causal(), 4.0, dict(B=2, Tq=100, Tk=150, Hq=2,
                                                             Hkv=1), False),
    # ... the whole group in one program (its heads' sums apart), in natural
    # units (no cap), packed documents ...
    "alibi_and_from_fn_documents": ("documents", None, dict(Tq=128, Tk=192, Hq=2, Hkv=1),
                                    True),
    # ... and the column split (D = 256), whose consumers share their keys.
    "alibi_and_from_fn_d256": (masks.sliding_window(40), None, dict(Tq=64, Tk=100, D=256),
                               False),
}


@pytest.mark.parametrize("name", LEARNED_TERM_CASES)
def test_interpreted_learned_term_arrays_match_reference(name, interpreted, monkeypatch):
    """The gradient of a term's learned arrays, summed by this kernel per key
    beside dK (the term's tangent tile times dS, along the query rows): ALiBi's
    slopes and a ``from_fn`` term's rates against the float32 reference, with
    dq, dk and dv."""
    mask, cap, sizes, whole_group = LEARNED_TERM_CASES[name]
    if whole_group:
        monkeypatch.setattr(triton, "MIN_DKDV_PROGRAMS", 0)
    q, k, v, d_out, _ = qkv(**sizes)
    B, Hq = q.shape[0], q.shape[2]
    if mask == "documents":
        ids = jnp.asarray(documents(100, 92))[None]
        mask = masks.causal() & masks.segments(ids[:, 64:], ids)
    slopes = jnp.linspace(0.5, 0.05, Hq)
    rates = jnp.linspace(0.2, 1.5, B * Hq).reshape(B, Hq)

    def decay(b, h, q, k, r):
        return -r * jnp.log(1.0 + jnp.abs(q - k).astype(jnp.float32))

    def grads(run, q, k, v):
        def loss(q, k, v, slopes, rates):
            term = position_bias.alibi(slopes) + position_bias.from_fn(decay, rates)
            spec = AttentionSpec(mask=mask, softcap=cap, position_bias=term, block_sizes=SMALL)
            return jnp.sum(run(spec, q, k, v).out.astype(jnp.float32) * d_out)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, slopes, rates)

    try:
        got = grads(lambda s, *a: core.run(s, *a, fn="flash", table=interpreted), q, k, v)
    except Exception:
        reset_after_failure()
        raise
    want = grads(fnattn.reference, *(x.astype(jnp.float32) for x in (q, k, v)))
    assert float(jnp.abs(want[3]).min()) > 1e-3 and float(jnp.abs(want[4]).min()) > 1e-3
    assert_grads_close(got, want, names=("dq", "dk", "dv", "dslopes", "drates"))


def _learned_slope_grads(run, spec, q, k, v, d_out, slopes):
    """``(dq, dk, dv, dslopes)`` of ``sum(out * d_out)`` with ALiBi's slopes
    learned, under ``jit``."""
    def loss(q, k, v, slopes):
        s = spec.replace(position_bias=position_bias.alibi(slopes))
        return jnp.sum(run(s, q, k, v).out.astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, slopes)


@pytest.mark.parametrize("case", ["infinite_sinks", "infinite_sinks_softcap",
                                  "poisoned_hidden_keys", "float16_large_cotangents"])
def test_interpreted_learned_slopes_under_extreme_inputs(case, interpreted, monkeypatch):
    """The per-key sums of a learned term's gradient meet what the other
    gradients meet: sinks of -inf (no effect) and +inf (a head whose every
    weight is 0: its slope's gradient exactly 0) with causal rows that see no
    key, in natural units and under a soft-cap; NaN and inf in K and V of keys
    past the keys' length (the gradient equal to the clean reference's, all
    finite); and float16 under loss scaling (|dO| ~ 1e3, dO.V^T past float16's
    range in many entries). GQA 2:1, the group in one program."""
    monkeypatch.setattr(triton, "MIN_DKDV_PROGRAMS", 0)
    Hq, mask, settings = 4, masks.causal(), {}
    q, k, v, d_out, _ = qkv(Tq=192, Tk=128, Hq=Hq, Hkv=2)
    slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
    k_run, v_run = k, v
    if case.startswith("infinite_sinks"):
        settings = dict(sinks=jnp.array([-jnp.inf, jnp.inf, 0.3, -2.0]),
                        softcap=5.0 if case.endswith("softcap") else None)
    elif case == "poisoned_hidden_keys":
        mask = mask & masks.lengths(kv_lengths=jnp.array([100]))
        k_run = k.at[0, 100:, 0, 3].set(jnp.nan).at[0, 110, 1, 0].set(jnp.inf)
        v_run = v.at[0, 105:, 1, 5].set(-jnp.inf).at[0, 120, 0, 2].set(jnp.nan)
    else:
        rs = np.random.default_rng(3)
        v = v_run = jnp.asarray(6 * rs.standard_normal(v.shape), jnp.float16)
        d_out = jnp.asarray(1e3 * rs.standard_normal(d_out.shape), jnp.float16)
        dov = np.einsum("bqhd,bkd->bqhk", f32(d_out)[:, :, :2], f32(v)[:, :, 0])
        assert (np.abs(dov) > np.finfo(np.float16).max).mean() > 0.1
    spec = AttentionSpec(mask=mask, block_sizes=SMALL, **settings)
    try:
        got = _learned_slope_grads(lambda s, *a: core.run(s, *a, fn="flash", table=interpreted),
                                   spec, q, k_run, v_run, d_out, slopes)
    except Exception:
        reset_after_failure()
        raise
    want = _learned_slope_grads(fnattn.reference, spec,
                                *(x.astype(jnp.float32) for x in (q, k, v)), d_out, slopes)
    names = ("dq", "dk", "dv", "dslopes")
    if case == "poisoned_hidden_keys":  # (the hidden keys' own dk and dv: 0 here)
        assert (f32(got[1])[:, 100:] == 0).all() and (f32(got[2])[:, 100:] == 0).all()
    assert_grads_close(got, want, names=names)
    if case.startswith("infinite_sinks"):
        assert float(got[3][1]) == 0.0 and float(got[3][0]) != 0.0
        assert (f32(got[0])[:, :, 1] == 0).all()
    if case == "float16_large_cotangents":
        assert max(float(np.abs(f32(g)).max()) for g in want[:3]) < 3e4


@pytest.mark.parametrize("alibi", [False, True])
def test_interpreted_float16_with_large_cotangents(interpreted, alibi):
    """float16 under loss scaling: |dO| ~ 1e3 and |V| ~ 6, so that dO.V^T
    overflows float16 in many entries (dP is accumulated in float32 by the
    kernel), while every gradient fits float16: all finite and equal to the
    float32 reference's, GQA 2:1 over the group in one program; and with ALiBi
    (P recomputed in natural units, lse_lo a third row statistic)."""
    rs = np.random.default_rng(3)
    q = jnp.asarray(rs.standard_normal((1, 128, 2, 64)), jnp.float16)
    k = jnp.asarray(rs.standard_normal((1, 128, 1, 64)), jnp.float16)
    v = jnp.asarray(6 * rs.standard_normal((1, 128, 1, 64)), jnp.float16)
    d_out = jnp.asarray(1e3 * rs.standard_normal((1, 128, 2, 64)), jnp.float16)
    d_lse = jnp.zeros((1, 2, 128), jnp.float32)
    dov = np.einsum("bqhd,bkd->bqhk", f32(d_out), f32(v)[:, :, 0])
    assert (np.abs(dov) > np.finfo(np.float16).max).mean() > 0.1
    spec = AttentionSpec(mask=masks.causal(), return_lse=True, block_sizes=SMALL,
                         position_bias=position_bias.alibi(jnp.array([0.5, 0.0625]))
                         if alibi else None)
    _, _, grads = outputs_and_grads(spec, q, k, v, d_out, d_lse, interpreted)
    _, _, r_grads = reference(spec, q, k, v, d_out, d_lse)
    assert max(float(np.abs(f32(g)).max()) for g in r_grads) < 3e4
    assert_grads_close(grads, r_grads)


def documents(*lengths):
    """Segment ids of consecutive documents of the given lengths, numbered from 0."""
    return np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)


def test_interpreted_segments_lengths_and_poisoned_hidden_keys(interpreted):
    """Segment ids and key lengths (the table from XLA, the query rows' ids
    streamed with Q on PARTIAL steps, the keys' ids loaded once): batch 0 has
    one query document and keys of two (FULL, PARTIAL and EMPTY tiles);
    batch 1's rows of document 9 see no key (zero dq) and keys past the length
    are hidden. NaN and inf on keys no row sees leave every gradient equal to
    the clean reference's (zero for those keys)."""
    q, k, v, d_out, d_lse = qkv(B=2, Tq=128, Tk=192, seed=3)
    q_ids = np.stack([documents(128), np.r_[documents(30, 50), [9] * 10, [2] * 38]])
    kv_ids = np.stack([documents(104, 88), documents(40, 60, 92)])
    mask = (masks.segments(jnp.asarray(q_ids), jnp.asarray(kv_ids))
            & masks.lengths(kv_lengths=jnp.array([192, 150])))
    spec = AttentionSpec(mask=mask, return_lse=True, block_sizes=SMALL)
    k2 = k.at[0, 110, 0, 4].set(jnp.inf).at[1, 170, 0, 1].set(jnp.nan)
    v2 = v.at[0, 120, 0, 2].set(jnp.nan).at[1, 160, 0, 0].set(-jnp.inf)
    out, lse, grads = outputs_and_grads(spec, q, k2, v2, d_out, d_lse, interpreted)
    r_out, r_lse, r_grads = reference(spec, q, k, v, d_out, d_lse)
    np.testing.assert_allclose(f32(out), f32(r_out), atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.isfinite(f32(lse)), np.isfinite(f32(r_lse)))
    assert_grads_close(grads, r_grads)
    assert (f32(grads[0])[1, 80:90] == 0).all()
    assert (f32(grads[1])[0, 104:] == 0).all() and (f32(grads[2])[1, 150:] == 0).all()


def test_interpreted_prefix_lm_lengths_at_positions(interpreted):
    """Per-sequence scalars (prefix lengths, query and key lengths) and per-row
    and per-key arrays (positions: the queries those of tokens 70..169 of 150
    keys' sequence) in one mask, with a soft-cap, ragged 100 x 150, GQA 2:1: the
    masks holding arrays that impl="auto" now sends here besides segment ids."""
    q, k, v, d_out, d_lse = qkv(B=2, Tq=100, Tk=150, Hq=2, Hkv=1, seed=6)
    inner = (masks.prefix_lm(jnp.array([10, 120]))
             & masks.lengths(jnp.array([170, 150]), jnp.array([120, 150])))
    mask = masks.at_positions(inner, jnp.arange(100) + 70, jnp.arange(150))
    spec = AttentionSpec(mask=mask, softcap=2.5, return_lse=True, block_sizes=SMALL)
    out, lse, grads = outputs_and_grads(spec, q, k, v, d_out, d_lse, interpreted)
    r_out, r_lse, r_grads = reference(spec, q, k, v, d_out, d_lse)
    np.testing.assert_allclose(f32(out), f32(r_out), atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.isfinite(f32(lse)), np.isfinite(f32(r_lse)))
    assert not np.isfinite(f32(r_lse)).all()  # (rows past batch 1's query length)
    assert_grads_close(grads, r_grads)


def test_interpreted_causal_segments_gqa_ragged(interpreted, monkeypatch):
    """Causal & segments with queries aligned to the last keys, ragged 100 x 150,
    GQA 2:1 over the group in one program, head dim 128, bfloat16."""
    monkeypatch.setattr(triton, "MIN_DKDV_PROGRAMS", 0)
    q, k, v, d_out, d_lse = qkv(Tq=100, Tk=150, Hq=2, Hkv=1, D=128, dtype=jnp.bfloat16,
                                seed=4)
    kv_ids = documents(40, 70, 40)
    mask = masks.causal() & masks.segments(jnp.asarray(kv_ids[None, 50:]),
                                           jnp.asarray(kv_ids[None]))
    spec = AttentionSpec(mask=mask, return_lse=True, block_sizes=SMALL)
    _, _, grads = outputs_and_grads(spec, q, k, v, d_out, d_lse, interpreted)
    _, _, r_grads = reference(spec, q, k, v, d_out, d_lse)
    assert_grads_close(grads, r_grads)


def test_interpreted_vmap_over_dropout_keys_and_segment_ids(interpreted):
    """``vmap`` over a spec whose dropout key and segment ids differ per instance:
    each instance's output and gradient are the reference's for its own key and
    documents (the forward batched by Pallas, the backward one launch per
    instance)."""
    q = qkv(Tq=128, Tk=128, Hq=2, Hkv=2, seed=6)[0]
    keys = jax.random.split(jax.random.key(1), 3)
    ids = jnp.asarray(np.stack([documents(64, 64), documents(32, 32, 32, 32),
                                documents(128)])[:, None])

    def value_and_grad(key, ids, reference):
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), dropout_rate=0.3,
                             dropout_key=key, return_lse=True, block_sizes=SMALL)

        def loss(q):
            if reference:
                x = q.astype(jnp.float32)
                res = fnattn.reference(spec, x, x, x)
            else:
                res = core.run(spec, q, q, q, fn="flash", table=interpreted)
            return jnp.sum(res.out.astype(jnp.float32) ** 2), res.out
        return jax.value_and_grad(loss, has_aux=True)(q)

    try:
        (_, out), grad = jax.jit(jax.vmap(lambda k, i: value_and_grad(k, i, False)))(keys, ids)
    except Exception:
        reset_after_failure()
        raise
    (_, r_out), r_grad = jax.jit(jax.vmap(lambda k, i: value_and_grad(k, i, True)))(keys, ids)
    np.testing.assert_allclose(f32(out), f32(r_out), atol=2e-2, rtol=2e-2)
    assert_grads_close((grad,), (r_grad,), names=("dq (k and v are q)",))
    assert not np.allclose(f32(out[0]), f32(out[2]))  # (each instance its own mask)


# ----------------------------------------------------------------------------------
# Tables, block sizes and what the kernel refuses
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "transposed"])
@pytest.mark.parametrize("mask", [None, masks.causal() & masks.sliding_window(100),
                                  masks.chunked(96) | masks.sliding_window(20, 20)],
                         ids=["none", "causal_window", "chunks_or_window"])
def test_schedule_table_lists_every_tile_that_sees_something(mask, transpose):
    """Per row tile, the column tiles to visit: every tile with a visible pair is
    listed, FULL ones first and only when every pair is visible (no padding)."""
    Tq, Tk, bq, bk = 300, 500, 64, 128
    treedef = None if mask is None else jax.tree_util.tree_structure(mask)
    table = mosaic_gpu.static_schedule(treedef, 1, 1, Tq, Tk, bq, bk, None,
                                      transpose=transpose)[0, 0]
    seen = np.asarray(masks.materialize(mask, 1, 1, Tq, Tk, validate=False))[0, 0]
    seen = np.broadcast_to(seen, (Tq, Tk))
    if transpose:
        seen, bq, bk = seen.T, bk, bq
    assert table.shape == (-(-seen.shape[0] // bq), 2 + -(-seen.shape[1] // bk))
    for r, (n_full, n_seen, *order) in enumerate(table):
        assert len(set(order[:n_seen])) == n_seen
        rows = seen[r * bq:(r + 1) * bq]
        for c in range(len(order)):
            tile = rows[:, c * bk:(c + 1) * bk]
            if tile.any():
                assert c in order[:n_seen], (r, c)
            if c in order[:n_full]:
                assert tile.all() and tile.shape == (bq, bk), (r, c)


def cfg_of(*, D=64, Dv=None, dropout=0.0, Tq=128, Tk=128):
    return Config(Dims(1, Tq, Tk, 4, 2, D, D if Dv is None else Dv), D ** -0.5, None,
                  dropout, None)


@pytest.mark.parametrize("what, args, words", [
    ("bias", dict(bias=jnp.zeros((128, 128))), "a bias"),
    ("from_array", dict(mask=masks.from_array(jnp.ones((128, 128), bool))),
     "a mask array that varies along both queries and keys"),
    ("float_lengths", dict(mask=masks.lengths(kv_lengths=jnp.zeros((1,), jnp.float32))),
     "a mask array of dtype float32"),
    ("float32", dict(dtype=jnp.float32), "float32 inputs"),
    ("d320", dict(cfg=cfg_of(D=320)), "head dim D=320"),
    ("dv288", dict(cfg=cfg_of(D=64, Dv=288)), "head dim D=64, Dv=288"),
])
def test_refuses_with_reasons_and_names_the_triton_backward(what, args, words):
    a = dict(cfg=cfg_of(), dtype=jnp.bfloat16, mask=None, bias=None, sinks=None)
    a.update(args)
    why = mosaic_gpu_bwd.supports(a["cfg"], a["dtype"], a["mask"], a["bias"], a["sinks"])
    assert len(why) == 1 and words in why[0], why
    d = a["cfg"].dims
    x = jnp.zeros((1, 128, 4, d.head_dim), a["dtype"])
    rows = jnp.zeros((1, 4, 128))
    with pytest.raises(NotImplementedError,
                       match=r"Mosaic GPU backward .*Triton backward \(fnattn/flash/triton.py"):
        mosaic_gpu_bwd.backward(a["cfg"], x, None, None, a["bias"], a["sinks"], a["mask"],
                                None, x, rows, rows, x, rows)


def test_supports_array_free_masks():
    for mask in (None, masks.causal(), masks.sliding_window(5, 7), masks.chunked(32),
                 masks.causal() | ~masks.sliding_window(3)):
        assert mosaic_gpu_bwd.supports(cfg_of(), jnp.float16, mask, None, None) == []


@pytest.mark.parametrize("D, ring, documents, alibi", [
    (128, 2, False, False), (64, 3, True, False), (192, 2, True, False), (128, 2, True, True),
    (128, 2, False, "learned"), (256, 2, True, "learned")])
def test_smem_estimate_is_what_the_lowering_counts(D, ring, documents, alibi):
    """``smem_bytes`` equals the count of Mosaic GPU's lowering, for the row
    split (D <= 128) and the column split, with and without mask arrays, and
    with ALiBi (no cap: a third row statistic, the base-2 lse's low part, or
    lse_lo in natural units with ALiBi; with learned slopes, each consumer's
    per-key sums of their gradient, for each head of the program)."""
    pytest.importorskip("absl")
    T = 1024
    ids = jnp.asarray(np.repeat(np.arange(4), T // 4)[None], jnp.int32)
    mask = masks.causal() & masks.segments(ids) if documents else masks.causal()
    bs = MosaicGpuBwdBlockSizes(max_concurrent_steps=ring)
    q = jax.ShapeDtypeStruct((1, T, 4, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, T, 2, D), jnp.bfloat16)
    # the Triton forward, so that the backward is the one Mosaic GPU kernel
    table = (("default", Lowering("triton-fwd-mosaic-bwd", triton.LOWERING.fwd,
                                  mosaic_gpu_bwd.LOWERING.bwd)),)
    spec = AttentionSpec(mask=mask, block_sizes=bs, position_bias=position_bias.alibi(
        jnp.asarray(position_bias.alibi_slopes(4))) if alibi else None)

    def lower():
        def loss(q, k, v, slopes):
            s = spec if alibi != "learned" else spec.replace(
                position_bias=position_bias.alibi(slopes))
            return jnp.sum(core.run(s, q, k, v, fn="flash", table=table).out.astype(
                jnp.float32))
        with gpu_target():
            jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if alibi == "learned" else (0, 1, 2))
                    ).trace(q, k, k, jax.ShapeDtypeStruct((4,), jnp.float32)).lower(
                lowering_platforms=("cuda",))

    rows, cols = mosaic_gpu.array_counts(mask)
    # (learned slopes: at D = 128, T = 1024 gives 8 kv tiles of 2 kv heads, too
    # few programs: the GQA group of 2 is split, one head a program; the column
    # split keeps the group whole)
    sums = 0 if alibi != "learned" else (1 if D <= 128 else 2)
    assert mosaic_gpu_smem(lower) == bs.smem_bytes(D, row_arrays=rows, key_arrays=cols,
                                                   row_stats=3, term_sums=sums)


def test_learned_term_sums_lower_while_a_ring_fits_else_go_to_the_triton_backward():
    """At D = 256 (the column split: the whole GQA group in one program) a
    learned term's per-key sums grow with the group: 12 heads still fit the
    smallest ring (the lowering counts what ``smem_bytes`` says), 16 do not, and
    then the kernel refuses the call, naming the Triton backward, rather than
    asking for a smaller ring that does not exist; ``route`` sends it there even
    with ``MosaicGpuBwdBlockSizes`` in the spec."""
    pytest.importorskip("absl")
    T, D = 256, 256
    bs = MosaicGpuBwdBlockSizes()

    def cfg_and_mask(Hq):
        mask = position_bias.attach(None, position_bias.alibi(jnp.ones(Hq)))
        cfg = Config(Dims(1, T, T, Hq, 1, D, D), D ** -0.5, None, 0.0, None, term_grad=(0,),
                     block_sizes=bs)
        return cfg, mask

    def lower(Hq):
        q = jax.ShapeDtypeStruct((1, T, Hq, D), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((1, T, 1, D), jnp.bfloat16)
        table = (("default", Lowering("triton-fwd-mosaic-bwd", triton.LOWERING.fwd,
                                      mosaic_gpu_bwd.LOWERING.bwd)),)

        def loss(q, k, v, slopes):
            spec = AttentionSpec(block_sizes=bs, position_bias=position_bias.alibi(slopes))
            return jnp.sum(core.run(spec, q, k, v, fn="flash", table=table).out.astype(
                jnp.float32))
        with gpu_target():
            jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(
                q, k, k, jax.ShapeDtypeStruct((Hq,), jnp.float32)).lower(
                lowering_platforms=("cuda",))

    cfg, mask = cfg_and_mask(12)
    assert mosaic_gpu_bwd.supports(cfg, jnp.bfloat16, mask, None, None) == []
    need = bs.smem_bytes(D, row_stats=3, term_sums=12)
    assert need <= mosaic_gpu.SMEM_BYTES
    assert mosaic_gpu_smem(lambda: lower(12)) == need
    cfg, mask = cfg_and_mask(16)
    why = mosaic_gpu_bwd.supports(cfg, jnp.bfloat16, mask, None, None)
    assert why == [f"the gradient of 1 learned position-term array for 16 query heads per "
                   f"program at head dim 256 ({bs.smem_bytes(D, row_stats=3, term_sums=16)} "
                   f"bytes of shared memory at the smallest ring, more than "
                   f"{mosaic_gpu.SMEM_BYTES} of a Hopper block)"]
    assert not mosaic_gpu_bwd.route(cfg, jnp.bfloat16, mask, None, None)
    with pytest.raises(NotImplementedError, match=r"16 query heads per program.*Triton "
                                                  r"backward \(fnattn/flash/triton.py"):
        lower(16)


def test_block_sizes_fit_shared_memory():
    for D in (64, 128, 192, 256):
        assert MosaicGpuBwdBlockSizes.default(D).smem_bytes(
            D, row_arrays=2, key_arrays=2) <= mosaic_gpu.SMEM_BYTES
    assert MosaicGpuBwdBlockSizes(max_concurrent_steps=3).smem_bytes(256) > mosaic_gpu.SMEM_BYTES
    cfg = dataclasses.replace(cfg_of(D=256),
                              block_sizes=MosaicGpuBwdBlockSizes(max_concurrent_steps=3))
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        mosaic_gpu_bwd._plan(cfg, None, False)


# ----------------------------------------------------------------------------------
# Lowering for "cuda" on CPU
# ----------------------------------------------------------------------------------


def _lowered_grad(spec, q, k, v, *, vmapped=False):
    def loss(q, k, v):
        res = core.run(spec, q, k, v, fn="flash", table=(("default", mosaic_gpu_bwd.LOWERING),))
        return jnp.sum(res.out.astype(jnp.float32)) + jnp.sum(res.lse)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    if vmapped:
        grad = jax.vmap(grad)
    with gpu_target():
        return jax.jit(grad).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("D, mask, Hq, softcap", [
    (64, "negated", 8, None),
    (128, "window", 2, None),
    (192, "chunks", 4, None),
    (256, "causal", 4, 30.0),
])
def test_gradient_lowers_for_cuda(D, mask, Hq, softcap):
    """The gradient lowers to two Mosaic GPU custom calls, the forward's and this
    backward's, and no Triton kernel but, at power-of-two head dims, the forward
    that recomputes the rows the Mosaic GPU forward flags. Ragged lengths 1000 x 1500 and
    2 kv heads: at D = 64 a GQA group of 4 split over programs (float32
    partials), at 128 no GQA and sinks, at 192 and 256 the column split (columns
    128 + 64 and 128 + 128) with a group of 2 in one program, soft-cap at 256,
    dropout at 64 and 192, a negated mask (``~``) at 64."""
    pytest.importorskip("absl")
    mask = {"causal": masks.causal(),
            "negated": masks.causal() & ~masks.sliding_window(8),
            "window": masks.causal() & masks.sliding_window(300),
            "chunks": masks.chunked(256) & masks.causal()}[mask]
    q = jax.ShapeDtypeStruct((2, 1000, Hq, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1500, 2, D), jnp.bfloat16)
    sinks = jnp.linspace(-1.0, 1.0, Hq) if D == 128 else None
    rate = 0.1 if D in (64, 192) else 0.0
    text = _lowered_grad(AttentionSpec(mask=mask, softcap=softcap, sinks=sinks,
                                       dropout_rate=rate,
                                       dropout_key=jax.random.key(0) if rate else None,
                                       return_lse=True), q, k, k)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
    assert triton_kernels(text) == ([] if D == 192 else REDO_KERNELS)
    # delta's reduction stays out of the fusion that stacks the row statistics
    assert re.search(rf"optimization_barrier %\S+ : tensor<2x{Hq}x1000xf32>", text)


@pytest.mark.parametrize("D, cap", [(128, None), (256, 30.0)])
def test_gradient_with_alibi_lowers_for_cuda(D, cap):
    """ALiBi with fixed slopes: two Mosaic GPU custom calls (the forward's and
    this backward's), in natural units without a cap (three row statistics)
    and in base 2 with one, on the row and the column split, beside segment
    ids and sinks."""
    pytest.importorskip("absl")
    ids = jnp.asarray(np.stack([documents(300, 700), documents(250, 250, 500)]))
    q = jax.ShapeDtypeStruct((2, 1000, 4, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1000, 2, D), jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), softcap=cap,
                         sinks=jnp.linspace(-1.0, 1.0, 4), return_lse=True,
                         position_bias=position_bias.alibi(
                             jnp.asarray(position_bias.alibi_slopes(4))))
    text = _lowered_grad(spec, q, k, k)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2


@pytest.mark.parametrize("D, name", [(64, "causal_segments"), (128, "lengths_prefix_lm"),
                                     (256, "at_positions")])
def test_gradient_lowers_for_cuda_with_array_masks(D, name):
    """Masks holding arrays, at the row split (64, 128; GQA 4:1 split over
    programs at 64) and the column split (256): still the two Mosaic GPU custom
    calls, of the Triton kernels only the forward that recomputes flagged rows,
    and no pass over K or V in XLA (the backward zeroes their non-finite
    entries on its tiles in shared memory: outside the kernels only the row
    statistics are tested for finiteness)."""
    pytest.importorskip("absl")
    B, T = 2, 1000
    ids = jnp.asarray(np.stack([documents(300, 700), documents(250, 250, 500)]))
    mask = {"causal_segments": masks.causal() & masks.segments(ids.astype(jnp.int16)),
            "lengths_prefix_lm": masks.prefix_lm(jnp.full((B,), 100))
            & masks.lengths(jnp.full((B,), 900), jnp.full((B,), 800)),
            "at_positions": masks.at_positions(masks.causal() & masks.segments(ids),
                                               jnp.arange(T) + 500, jnp.arange(T))}[name]
    q = jax.ShapeDtypeStruct((B, T, 8, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, 2, D), jnp.bfloat16)
    text = _lowered_grad(AttentionSpec(mask=mask, return_lse=True), q, k, k)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
    assert triton_kernels(text) == REDO_KERNELS
    assert not re.search(rf"is_finite %\S+ : \(tensor<{B}x{T}x2x{D}xbf16>", text)


def test_vmapped_gradient_lowers_for_cuda():
    pytest.importorskip("absl")
    q = jax.ShapeDtypeStruct((3, 1, 256, 2, 128), jnp.float16)
    text = _lowered_grad(AttentionSpec(mask=masks.causal(), return_lse=True), q, q, q,
                         vmapped=True)
    assert re.search(r"custom_call @mosaic_gpu", text)
    # Segment ids shared by the mapped elements: one launch per element.
    ids = jnp.asarray(documents(100, 156)[None])
    text = _lowered_grad(AttentionSpec(mask=masks.segments(ids), return_lse=True), q, q, q,
                         vmapped=True)
    assert re.search(r"custom_call @mosaic_gpu", text)


# ----------------------------------------------------------------------------------
# On an NVIDIA GPU
# ----------------------------------------------------------------------------------

GPU_CASES = {
    "causal_window_gqa4_ragged_d128": (masks.causal() & masks.sliding_window(700), None,
                                       dict(B=2, Tq=1000, Tk=1500, Hq=8, Hkv=2, D=128)),
    "causal_softcap_gqa4_ragged_d256": (masks.causal(), 20.0,
                                        dict(B=1, Tq=1500, Tk=1000, Hq=8, Hkv=2, D=256)),
    "none_sinks_d64": (None, None, dict(B=2, Tq=1024, Tk=1024, Hq=4, Hkv=4, D=64)),
    "causal_d128_long": (masks.causal(), None, dict(B=1, Tq=4096, Tk=4096, Hq=4, Hkv=4, D=128)),
    "causal_dropout_gqa4_d128": (masks.causal(), None,
                                 dict(B=2, Tq=1000, Tk=1000, Hq=8, Hkv=2, D=128)),
    # float16 under loss scaling: dO.V^T overflows float16 (dP in float32).
    "causal_float16_large_cotangents_gqa2_d64": (
        masks.causal(), None, dict(B=1, Tq=1024, Tk=1024, Hq=4, Hkv=2, D=64)),
    # Packed documents (segment ids), the queries those of the last 1000 keys.
    "causal_segments_gqa4_ragged_d128": (
        masks.causal() & masks.segments(
            jnp.asarray(np.stack([documents(300, 200, 500), documents(500, 100, 90, 310)])),
            jnp.asarray(np.stack([documents(800, 200, 500), documents(1000, 100, 90, 310)]))),
        None, dict(B=2, Tq=1000, Tk=1500, Hq=8, Hkv=2, D=128)),
    # A negated mask (its predicate a logical xor: jax 0.11's Mosaic GPU takes no
    # bitwise not of booleans), rows past the window's reach on PARTIAL tiles.
    "causal_not_window_gqa2_d64": (masks.causal() & ~masks.sliding_window(64), None,
                                   dict(B=1, Tq=1024, Tk=1024, Hq=4, Hkv=2, D=64)),
    # Head dims computed at 128 with zero columns (mosaic_gpu.kernel_dim).
    "causal_window_gqa4_ragged_d96_dv64": (masks.causal() & masks.sliding_window(700), None,
                                           dict(B=2, Tq=1000, Tk=1500, Hq=8, Hkv=2, D=96,
                                                Dv=64)),
}


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu_gradients_match_xla(name):
    mask, softcap, sizes = GPU_CASES[name]
    f16 = "float16" in name
    q, k, v, d_out, d_lse = qkv(dtype=jnp.float16 if f16 else jnp.bfloat16, seed=1, **sizes)
    if f16:
        v, d_out = 6 * v, 1e3 * d_out
    sinks = jnp.linspace(-1.0, 1.0, sizes["Hq"]) if "sinks" in name else None
    drop = dict(dropout_rate=0.2, dropout_key=jax.random.key(2)) if "dropout" in name else {}
    spec = AttentionSpec(mask=mask, softcap=softcap, sinks=sinks, return_lse=True, **drop)

    @functools.partial(jax.jit, static_argnums=0)
    def go(table, q, k, v, d_out, d_lse):
        def f(q, k, v):
            res = core.run(spec, q, k, v, fn="flash", table=table)
            return res.out, res.lse
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return out, lse, vjp((d_out, d_lse))

    _, _, grads = go((("default", mosaic_gpu_bwd.LOWERING),), q, k, v, d_out, d_lse)
    _, _, ref = go((("default", xla.LOWERING),),
                   *(x.astype(jnp.float32) for x in (q, k, v, d_out)), d_lse)
    assert_grads_close(grads, ref, tol=3e-2)


def _auto_masks(B, Tq, Tk):
    """The masks impl="auto" sends to the Mosaic GPU kernels on Hopper (with a
    soft-cap, so that cuDNN does not take them): each kind of mask array."""
    kv_ids = jnp.asarray(np.stack([documents(300, 200, Tk - 500), documents(Tk)]))
    q_ids = kv_ids[:, Tk - Tq:]
    return {
        "causal": masks.causal(),
        "causal_segments": masks.causal() & masks.segments(q_ids, kv_ids),
        "lengths_prefix_lm": (masks.prefix_lm(jnp.array([100, 700]))
                              & masks.lengths(jnp.array([Tq, Tq - 150]),
                                              jnp.array([Tk - 300, Tk]))),
        "at_positions": masks.at_positions(masks.causal(), jnp.arange(Tq) + 700,
                                           jnp.arange(Tk)),
    }


@pytest.mark.skipif(not ON_GPU or mosaic_gpu.available() is not None,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", ["causal", "causal_segments", "lengths_prefix_lm",
                                  "at_positions"])
def test_gpu_auto_runs_the_mosaic_gpu_kernels_and_matches_xla(name):
    """impl="auto" on a Hopper GPU, end to end: a soft-capped spec with each kind
    of mask array lowers to the two Mosaic GPU kernels (and, of the Triton kernels,
    only the forward that recomputes flagged rows), and its
    out, lse and gradients equal the XLA lowering's. Ragged 1000 x 1500, GQA 4:1."""
    B, Tq, Tk = 2, 1000, 1500
    q, k, v, d_out, d_lse = qkv(B=B, Tq=Tq, Tk=Tk, Hq=8, Hkv=2, D=128,
                                dtype=jnp.bfloat16, seed=5)
    spec = AttentionSpec(mask=_auto_masks(B, Tq, Tk)[name], softcap=25.0, return_lse=True)

    def vjp(spec, q, k, v, d_out, d_lse):
        def f(q, k, v):
            res = fnattn.attention(spec, q, k, v)
            return res.out, res.lse
        (out, lse), pull = jax.vjp(f, q, k, v)
        return out, lse, pull((d_out, d_lse))

    go = jax.jit(vjp)
    text = go.trace(spec, q, k, v, d_out, d_lse).lower().as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
    assert triton_kernels(text) == REDO_KERNELS
    out, lse, grads = go(spec, q, k, v, d_out, d_lse)
    r_out, r_lse, r_grads = go(spec.replace(impl="xla"),
                               *(x.astype(jnp.float32) for x in (q, k, v, d_out)), d_lse)
    np.testing.assert_allclose(f32(out), f32(r_out), atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.isfinite(f32(lse)), np.isfinite(f32(r_lse)))
    assert_grads_close(grads, r_grads, tol=3e-2)


# ----------------------------------------------------------------------------------
# impl="auto" on cuda: when this backward runs
# ----------------------------------------------------------------------------------


def test_cuda_kernel_choice_of_the_backward(monkeypatch):
    """On Hopper (stood in for), wherever the Mosaic GPU forward runs, this
    backward runs too for D <= 128 without dropout (segment ids and sinks
    included); for D=256 and dropout only with ``MosaicGpuBwdBlockSizes`` in
    the spec, and the Triton backward otherwise; ``TritonBlockSizes`` or a GPU
    other than Hopper give Triton throughout."""
    from fnattn.flash.api import cuda_kernel
    cfg = cfg_of()
    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    seg = masks.segments(jnp.zeros((1, 128), jnp.int32))
    bwd = dataclasses.replace(cfg, block_sizes=(SMALL, MosaicGpuBwdBlockSizes()))
    assert cuda_kernel(cfg, q, None, None, masks.causal()) is triton.LOWERING  # (no Hopper)
    assert cuda_kernel(bwd, q, None, None, masks.causal()) is triton.LOWERING
    monkeypatch.setattr(mosaic_gpu, "available", lambda: None)
    for c in (cfg, bwd):
        assert cuda_kernel(c, q, None, None, masks.causal()) is mosaic_gpu_bwd.LOWERING
        assert cuda_kernel(c, q, None, None, None) is mosaic_gpu_bwd.LOWERING
        assert cuda_kernel(c, q, None, jnp.zeros((4,)), None) is mosaic_gpu_bwd.LOWERING
        assert cuda_kernel(c, q, None, None, seg) is mosaic_gpu_bwd.LOWERING
        assert cuda_kernel(c, q.astype(jnp.float32), None, None, None) is triton.LOWERING
    wide, q256 = cfg_of(D=256), jnp.zeros((1, 128, 4, 256), jnp.bfloat16)
    assert cuda_kernel(wide, q256, None, None, seg) is mosaic_gpu.LOWERING
    wide = dataclasses.replace(wide, block_sizes=MosaicGpuBwdBlockSizes())
    assert cuda_kernel(wide, q256, None, None, seg) is mosaic_gpu_bwd.LOWERING
    drop = dataclasses.replace(cfg, dropout_rate=0.1, block_sizes=SMALL)
    assert cuda_kernel(drop, q, None, None, masks.causal()) is mosaic_gpu.LOWERING
    drop = dataclasses.replace(drop, block_sizes=bwd.block_sizes)
    assert cuda_kernel(drop, q, None, None, masks.causal()) is mosaic_gpu_bwd.LOWERING
    both = dataclasses.replace(cfg, block_sizes=(MosaicGpuBwdBlockSizes(),
                                                 fnattn.TritonBlockSizes()))
    assert cuda_kernel(both, q, None, None, None) is triton.LOWERING
    # ALiBi (untimed, so asked for by name): the Mosaic GPU backward with
    # MosaicGpuBwdBlockSizes too, its slopes held fixed or learned
    # (Config.term_grad: it sums their gradient); a from_fn term whose learned
    # array's tangent Mosaic GPU does not lower (add_any) takes the Triton one.
    alibi = position_bias.attach(masks.causal(), position_bias.alibi(jnp.ones(4)),
                                 constant=False)
    term = dataclasses.replace(cfg, mask_treedef=jax.tree_util.tree_structure(alibi))
    assert cuda_kernel(term, q, None, None, alibi) is triton.LOWERING
    term = dataclasses.replace(term, block_sizes=SMALL)
    assert cuda_kernel(term, q, None, None, alibi) is mosaic_gpu.LOWERING
    term = dataclasses.replace(term, block_sizes=(SMALL, MosaicGpuBwdBlockSizes()))
    assert cuda_kernel(term, q, None, None, alibi) is mosaic_gpu_bwd.LOWERING
    learned = dataclasses.replace(term, term_grad=position_bias.term_leaves(alibi))
    assert cuda_kernel(learned, q, None, None, alibi) is mosaic_gpu_bwd.LOWERING
    square = position_bias.attach(masks.causal(), position_bias.from_fn(
        lambda b, h, q, k, r: r * r * (k - q), jnp.ones(4)), constant=False)
    learned = dataclasses.replace(learned, mask_treedef=jax.tree_util.tree_structure(square),
                                  term_grad=position_bias.term_leaves(square))
    assert cuda_kernel(learned, q, None, None, square) is mosaic_gpu.LOWERING


def test_auto_gradient_with_dropout_lowers_to_the_triton_backward(monkeypatch):
    """The same choice seen in the program impl="auto" lowers for cuda on Hopper:
    a soft-capped causal spec (no cuDNN) with dropout and ``MosaicGpuBlockSizes``
    has the Mosaic GPU forward (with the Triton forward that recomputes flagged
    rows) and the Triton dq and dk/dv kernels. (Without
    dropout, the two Mosaic GPU kernels: tests/flash/test_mosaic_gpu.py,
    ``test_auto_runs_the_mosaic_gpu_kernels_on_hopper``, lowers that same spec.)"""
    pytest.importorskip("absl")
    monkeypatch.setattr(mosaic_gpu, "available", lambda: None)
    q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal(), softcap=30.0, dropout_rate=0.1,
                         dropout_key=jax.random.key(0), block_sizes=MosaicGpuBlockSizes())

    def loss(q, k, v):
        return jnp.sum(fnattn.attention(spec, q, k, v).out.astype(jnp.float32))
    with gpu_target():
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(
            lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    assert triton_kernels(text) == ["fnattn_flash_dkdv", "fnattn_flash_dq"] + REDO_KERNELS
