"""The Pallas Mosaic GPU forward (fnattn/flash/mosaic_gpu.py).

Three groups:

* the Mosaic GPU interpreter on CPU: the kernel (TMA ring, barriers, block
  schedule, masks, online softmax, output path) against ``fnattn.reference``.
  The interpreter takes no transposed or register ``wgmma`` operand, so there
  the two products are computed from the same shared-memory tiles with ``jnp``
  (each warpgroup program compiled once: tests/mosaic_gpu_interpreter.py);
* lowering for "cuda" on CPU: the real ``wgmma`` kernel over head dims and masks;
* the real kernel on an NVIDIA GPU (skipped without one).
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
from fnattn.flash import xla
from fnattn._checks import Dims
from fnattn._dispatch import Config, Lowering
from fnattn.flash import mosaic_gpu
from fnattn.flash.mosaic_gpu import LOWERING, MosaicGpuBlockSizes
from lowering import gpu_target, mosaic_gpu_smem
from mosaic_gpu_interpreter import REDO_KERNELS, compile_once, reset_after_failure, triton_kernels

ON_GPU = jax.devices()[0].platform == "gpu"
SMALL = MosaicGpuBlockSizes(block_q=64, block_k=64, max_concurrent_steps=2)


def _interpreted():
    return Lowering("flash-mosaic-gpu-interpret",
                    functools.partial(mosaic_gpu.forward,
                                      interpret=mosaic_gpu.interpret_params()),
                    LOWERING.bwd)


def qkv(*, B=1, Tq=128, Tk=128, Hq=2, Hkv=2, D=64, Dv=None, dtype=jnp.float16, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, Tq, Hq, D), jnp.float32).astype(dtype),
            jax.random.normal(kk, (B, Tk, Hkv, D), jnp.float32).astype(dtype),
            jax.random.normal(kv, (B, Tk, Hkv, Dv or D), jnp.float32).astype(dtype))


def run(spec, q, k, v, table):
    return jax.jit(lambda q, k, v: core.run(spec, q, k, v, fn="flash", table=table))(q, k, v)


@pytest.fixture(scope="module", autouse=True)
def _fast_interpreter():
    with compile_once():
        yield


def interpret(spec, q, k, v):
    try:
        return run(spec, q, k, v, (("default", _interpreted()),))
    except Exception:
        reset_after_failure()
        raise


def check(spec, q, k, v, *, tol=2e-2):
    return compare(interpret(spec, q, k, v), spec, q, k, v, tol=tol)


def compare(res, spec, q, k, v, *, tol=2e-2):
    """``res`` (out, lse) against the float32 reference; NaN where the reference has NaN."""
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    ref = jax.jit(lambda *a: fnattn.reference(spec, *a))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    assert res.out.dtype == q.dtype and res.lse.dtype == jnp.float32
    assert res.out.shape == ref.out.shape and res.lse.shape == ref.lse.shape
    np.testing.assert_allclose(f32(res.out), f32(ref.out), atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isfinite(res.lse), np.isfinite(ref.lse))
    np.testing.assert_allclose(f32(res.lse), f32(ref.lse), atol=tol, rtol=tol)
    return res


# ----------------------------------------------------------------------------------
# Interpreted on CPU
# ----------------------------------------------------------------------------------

INTERPRET_CASES = {
    "none": (None, {}),
    "causal": (masks.causal(), dict(Tq=256, Tk=256)),
    "window": (masks.sliding_window(40), dict(Tq=256, Tk=256)),
    "causal_and_window": (masks.causal() & masks.sliding_window(70, None),
                          dict(Tq=256, Tk=256)),
    "gqa": (masks.causal(), dict(Hq=4, Hkv=2)),
    "ragged": (masks.causal(), dict(Tq=100, Tk=150)),
    "ragged_no_mask": (None, dict(Tq=70, Tk=90)),
}


@pytest.mark.parametrize("name", INTERPRET_CASES)
def test_interpreted_matches_reference(name):
    mask, sizes = INTERPRET_CASES[name]
    q, k, v = qkv(**sizes)
    check(AttentionSpec(mask=mask, return_lse=True, block_sizes=SMALL), q, k, v)


def test_interpreted_softcap_and_scale():
    q, k, v = qkv(Tq=128, Tk=192)
    spec = AttentionSpec(mask=masks.causal(), softcap=2.0, scale=0.3, return_lse=True,
                         block_sizes=SMALL)
    check(spec, q, k, v)


def test_interpreted_default_blocks_bfloat16():
    q, k, v = qkv(Tq=128, Tk=256, dtype=jnp.bfloat16)
    check(AttentionSpec(mask=masks.causal(), return_lse=True), q, k, v, tol=3e-2)


POSITION_TERM_CASES = {
    "alibi_causal": (masks.causal(), None, False),
    "alibi_softcap_sinks": (None, 5.0, True),
    "alibi_documents": ("documents", None, False),
}


@pytest.mark.parametrize("name", POSITION_TERM_CASES)
def test_interpreted_position_terms_match_reference(name):
    """ALiBi (and a sum of two) added to every tile's logits, FULL ones
    included; its slopes read per (batch, head) as float scalars."""
    mask, cap, sinks = POSITION_TERM_CASES[name]
    q, k, v = qkv(Tq=192, Tk=256, Hq=4, Hkv=2)
    if mask == "documents":
        ids = jnp.asarray(documents(100, 156))[None]
        mask = masks.causal() & masks.segments(ids[:, 64:], ids)
    slopes = jnp.asarray(position_bias.alibi_slopes(4)) * 4
    for term in (position_bias.alibi(slopes),
                 position_bias.alibi(slopes) + position_bias.alibi(slopes[::-1])):
        spec = AttentionSpec(mask=mask, softcap=cap, position_bias=term, return_lse=True,
                             sinks=jnp.linspace(-1.0, 1.0, 4) if sinks else None,
                             block_sizes=SMALL)
        res = check(spec, q, k, v)
        plain = jax.jit(lambda *a: fnattn.reference(spec.replace(position_bias=None), *a))(
            *(x.astype(jnp.float32) for x in (q, k, v)))
        assert float(jnp.abs(res.out.astype(jnp.float32) - plain.out).max()) > 0.1


def _decay(b, h, q, k, r):
    """A from_fn term Mosaic GPU compiles: a logarithmic decay with a per-(row,
    head) rate, and offsets by head and batch row (a select of scalars)."""
    return (-r * jnp.log(1.0 + jnp.abs(q - k).astype(jnp.float32))
            + jnp.where(h % 2 == 0, 0.5, -0.5) * (b + 1))


def test_interpreted_from_fn_terms_match_reference():
    """A ``from_fn`` term whose primitives Mosaic GPU lowers, with per-(batch
    row, head) arrays read as scalars, beside packed documents in two batch
    rows, GQA 2:1."""
    q, k, v = qkv(B=2, Tq=128, Tk=192, Hq=4, Hkv=2)
    ids = jnp.asarray(np.stack([documents(100, 92), documents(40, 152)]))
    mask = masks.causal() & masks.segments(ids[:, 64:], ids)
    rates = jnp.array([[0.5, 1.0, 2.0, 0.25], [3.0, 0.1, 1.5, 0.75]])
    spec = AttentionSpec(mask=mask, return_lse=True, block_sizes=SMALL,
                         position_bias=position_bias.from_fn(_decay, rates))
    res = check(spec, q, k, v)
    plain = jax.jit(lambda *a: fnattn.reference(spec.replace(position_bias=None), *a))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    assert float(jnp.abs(res.out.astype(jnp.float32) - plain.out).max()) > 0.1


PADDED_DIMS_CASES = {
    # D = 96 computed at 128 (a power of two: the flagged rows' recomputation,
    # no pass over K and V), packed documents with poisoned keys past them.
    "d96_documents_redo": (96, 96, "documents"),
    # D = 48, Dv = 80 at 128 with GQA 2:1, a window and sinks.
    "d48_dv80_window_sinks": (48, 80, "window"),
    # D = 64, Dv = 32: q and k as they are, V padded; ragged, no mask.
    "d64_dv32_ragged": (64, 32, None),
}


@pytest.mark.parametrize("name", PADDED_DIMS_CASES)
def test_interpreted_head_dims_padded_to_a_multiple_of_64(name):
    """Head dims that are not multiples of 64, and a value head dim unlike the
    query's: the kernel computes at kernel_dim (zero columns) and the output
    has Dv columns, against the reference."""
    D, Dv, mask = PADDED_DIMS_CASES[name]
    sizes = dict(Tq=100, Tk=150) if mask is None else dict(Tq=128, Tk=192)
    q, k, v = qkv(Hq=4, Hkv=2, D=D, Dv=Dv, **sizes)
    sinks = None
    if mask == "documents":
        ids = jnp.asarray(documents(100, 92))[None]
        mask = masks.causal() & masks.segments(ids[:, 64:], ids)
        # Poisoned keys 150..159: rows before position 150 (rows 0..85) hide them.
        k, v = k.at[:, 150:160].set(jnp.nan), v.at[:, 150:160].set(jnp.inf)
    elif mask == "window":
        mask, sinks = masks.causal() & masks.sliding_window(50), jnp.linspace(-1.0, 1.0, 4)
    assert mosaic_gpu.kernel_dim(Dims(1, 1, 1, 1, 1, D, Dv)) == (64 if D == 64 else 128)
    spec = AttentionSpec(mask=mask, sinks=sinks, return_lse=True, block_sizes=SMALL)
    res = interpret(spec, q, k, v)
    assert res.out.shape == q.shape[:3] + (Dv,)
    if name == "d96_documents_redo":
        out = np.asarray(res.out, np.float32)
        assert np.isfinite(out[:, :86]).all() and np.isnan(out[:, 86:]).all()
    compare(res, spec, q, k, v)


def test_interpreted_huge_terms_keep_rows_exact():
    """Without soft-cap a term keeps the row state in natural units: rows whose
    every logit is about -4e30 (slopes of 1e30, no key within distance 4) still
    weigh their nearest keys exactly, as the reference does."""
    q, k, v = qkv(Tq=128, Tk=128, Hq=2, Hkv=2)
    spec = AttentionSpec(mask=~masks.sliding_window(3, 3), return_lse=True, block_sizes=SMALL,
                         position_bias=position_bias.alibi(jnp.array([1e30, 1.0])))
    res = check(spec, q, k, v)
    assert np.all(np.isfinite(np.asarray(res.out, np.float32)))


@pytest.mark.parametrize("cap", [None, 5.0])
def test_interpreted_terms_with_infinite_sinks(cap):
    """ALiBi with sinks of -inf (no effect), +inf (every weight 0: out 0, lse
    +inf) and ordinary ones, in natural units (no cap) and in base 2 (cap),
    rows that see no key among them (Tq > Tk, bottom-right causal)."""
    q, k, v = qkv(Tq=192, Tk=128, Hq=4, Hkv=2)
    spec = AttentionSpec(mask=masks.causal(), softcap=cap, return_lse=True, block_sizes=SMALL,
                         sinks=jnp.array([-jnp.inf, jnp.inf, 0.3, -2.0]),
                         position_bias=position_bias.alibi(jnp.array([0.5, 0.25, 2.0, 1e4])))
    res = check(spec, q, k, v)
    out, lse = np.asarray(res.out, np.float32), np.asarray(res.lse)
    assert (out[:, :, 1] == 0).all() and (lse[:, 1] == np.inf).all()
    assert (out[:, :64, 0] == 0).all() and (lse[:, 0, :64] == -np.inf).all()
    assert np.isfinite(out).all() and np.isfinite(lse[:, 2:]).all()


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    # Tq > Tk with bottom-right alignment: the first 64 rows see no key.
    q, k, v = qkv(Tq=128, Tk=64)
    res = check(AttentionSpec(mask=masks.causal(), return_lse=True, block_sizes=SMALL),
                q, k, v)
    assert np.all(np.asarray(res.out[:, :64], np.float32) == 0)
    assert np.all(np.asarray(res.lse[:, :, :64]) == -np.inf)
    assert np.all(np.isfinite(np.asarray(res.lse[:, :, 64:])))


@pytest.mark.parametrize("hidden_keys", ["pass", "redo"])
def test_interpreted_sinks_join_the_denominator(hidden_keys):
    """One sink per query head: finite, -inf (no sink) and +inf (takes all the
    mass: out 0, lse +inf), with GQA 2:1 and causal rows that see no key (out 0,
    lse = the sink); with hidden_keys="redo" too (an infinite sink or an empty
    row is not a non-finite key)."""
    q, k, v = qkv(Tq=128, Tk=64, Hq=4, Hkv=2)
    sinks = jnp.array([0.5, -jnp.inf, jnp.inf, 3.0])
    spec = AttentionSpec(mask=masks.causal(), sinks=sinks, return_lse=True,
                         block_sizes=dataclasses.replace(SMALL, hidden_keys=hidden_keys))
    res = check(spec, q, k, v)
    out, lse = np.asarray(res.out, np.float32), np.asarray(res.lse)
    assert np.all(out[:, :64] == 0) and np.all(out[:, :, 2] == 0)
    np.testing.assert_array_equal(lse[0, :, :64], np.broadcast_to(np.asarray(sinks)[:, None],
                                                                  (4, 64)))
    assert np.all(lse[0, 2] == np.inf) and np.isfinite(lse[0, [0, 3], 64:]).all()


def test_interpreted_dropout_matches_the_reference_bit_for_bit_masks():
    """Dropout (rate 0.3) under a causal mask with GQA 2:1 on ragged 128 x 192: the
    kernel draws the reference's keep mask (fnattn.dropout, from the global row,
    key, batch and head indices), so outputs agree to rounding; lse keeps every
    weight; a different key changes the output."""
    q, k, v = qkv(Tq=128, Tk=192, Hq=4, Hkv=2, seed=5)
    spec = AttentionSpec(mask=masks.causal(), dropout_rate=0.3,
                         dropout_key=jax.random.key(7), return_lse=True, block_sizes=SMALL)
    res = check(spec, q, k, v)
    plain = check(spec.replace(dropout_rate=0.0, dropout_key=None), q, k, v)
    np.testing.assert_allclose(np.asarray(res.lse), np.asarray(plain.lse), rtol=1e-6)
    other = interpret(spec.replace(dropout_key=jax.random.key(8)), q, k, v)
    assert not np.allclose(np.asarray(other.out, np.float32), np.asarray(res.out, np.float32))


def test_poisoned_keys_reach_only_the_rows_that_see_them():
    """NaN and inf in K and V of keys a causal mask hides from early rows (on the
    diagonal tile, which the kernel visits): those rows are unchanged; the rows
    that see a poisoned key are NaN, as with every lowering."""
    q, k, v = qkv(Tq=128, Tk=128)
    spec = AttentionSpec(mask=masks.causal(), return_lse=True, block_sizes=SMALL)
    clean = interpret(spec, q, k, v)
    k2 = k.at[0, 100, 0, 3].set(jnp.nan)
    v2 = v.at[0, 90, 1, 5].set(jnp.inf).at[0, 100, 0, 7].set(jnp.nan)
    res = interpret(spec, q, k2, v2)
    out, ref = np.asarray(res.out, np.float32), np.asarray(clean.out, np.float32)
    np.testing.assert_array_equal(out[0, :90], ref[0, :90])       # see neither
    np.testing.assert_array_equal(out[0, 90:100, 0], ref[0, 90:100, 0])  # head 0: key 100 only
    assert np.isnan(out[0, 100:, 0]).all() and np.isnan(out[0, 90:, 1]).all()


REDO = dataclasses.replace(SMALL, hidden_keys="redo")


def test_redo_gives_the_bits_of_the_pass_on_finite_inputs():
    """hidden_keys="redo" on finite K and V flags no row: the kernel's own
    results, bit for bit those of the pass (soft-capped causal, GQA 2:1, ragged)."""
    q, k, v = qkv(Tq=100, Tk=150, Hq=2, Hkv=1)
    spec = AttentionSpec(mask=masks.causal(), softcap=2.0, return_lse=True, block_sizes=SMALL)
    a, b = interpret(spec, q, k, v), interpret(spec.replace(block_sizes=REDO), q, k, v)
    np.testing.assert_array_equal(np.asarray(a.out, np.float32), np.asarray(b.out, np.float32))
    np.testing.assert_array_equal(np.asarray(a.lse), np.asarray(b.lse))


def test_redo_recomputes_the_flagged_programs_only():
    """hidden_keys="redo" with poisoned keys. Head 0: key 10's K holds -inf where
    every query is positive, so its logit is -inf for every row (on a FULL tile,
    with no mask code, for rows 128..); the rows that see it are NaN all the same.
    Head 1: key 150's V is NaN. Head 1's first program (rows 0..127) loads
    neither: the kernel's bits. Everything else matches the pass and the
    reference, NaN for NaN."""
    q, k, v = qkv(Tq=192, Tk=192)
    q = q.at[0, :, 0, 3].set(jnp.abs(q[0, :, 0, 3]) + 0.5)
    spec = AttentionSpec(mask=masks.causal(), return_lse=True, block_sizes=REDO)
    clean = interpret(spec, q, k, v)
    k2, v2 = k.at[0, 10, 0, 3].set(-jnp.inf), v.at[0, 150, 1, 5].set(jnp.nan)
    res = compare(interpret(spec, q, k2, v2), spec, q, k2, v2)
    passed = interpret(spec.replace(block_sizes=SMALL), q, k2, v2)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    out, ref = f32(res.out), f32(clean.out)
    assert np.isnan(out[0, 10:, 0]).all() and np.isnan(out[0, 150:, 1]).all()
    assert np.isfinite(out[0, :10, 0]).all() and np.isfinite(out[0, :150, 1]).all()
    np.testing.assert_array_equal(out[0, :128, 1], ref[0, :128, 1])
    np.testing.assert_array_equal(np.asarray(res.lse)[0, 1, :128],
                                  np.asarray(clean.lse)[0, 1, :128])
    np.testing.assert_allclose(out, f32(passed.out), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.asarray(res.lse), np.asarray(passed.lse), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------
# Interpreted on CPU: masks holding arrays
# ----------------------------------------------------------------------------------


def documents(*lengths):
    """Segment ids of consecutive documents of the given lengths, numbered from 0."""
    return np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)


def array_mask_case(name):
    """``(spec, q, k, v)`` of one interpreted case with a mask holding arrays."""
    if name == "segments_lengths_poisoned":
        # Batch 0: one document of queries; kv-tile 0 FULL (no mask code), 1
        # PARTIAL, 2 EMPTY (another document). Batch 1: rows of document 9 see no
        # key; keys past kv_lengths are hidden. Poison: NaN/inf on keys of other
        # documents (batch 0 keys 110, 120; batch 1 key 170, past its length),
        # and on a key of document 1 that its own rows see (batch 1 key 45).
        q_ids = np.stack([documents(128), np.r_[documents(30, 50), [9] * 10, [2] * 38]])
        kv_ids = np.stack([documents(104, 88), documents(40, 60, 92)])
        mask = (masks.segments(jnp.asarray(q_ids), jnp.asarray(kv_ids))
                & masks.lengths(kv_lengths=jnp.array([192, 150])))
        q, k, v = qkv(B=2, Tq=128, Tk=192, Hq=1, Hkv=1, seed=3)
        k = k.at[0, 110, 0, 4].set(jnp.inf).at[1, 45, 0, 1].set(jnp.nan)
        v = v.at[0, 120, 0, 2].set(jnp.nan).at[1, 170, 0, 0].set(-jnp.inf)
        return AttentionSpec(mask=mask, return_lse=True, block_sizes=SMALL), q, k, v
    if name == "causal_segments_gqa_ragged":
        # Tq=100, Tk=150 (neither a multiple of the tiles), queries aligned to the
        # last 100 keys, GQA 2:1, documents crossing tile edges.
        kv_ids = documents(40, 70, 40)
        mask = masks.causal() & masks.segments(jnp.asarray(kv_ids[None, 50:]),
                                               jnp.asarray(kv_ids[None]))
        q, k, v = qkv(Tq=100, Tk=150, Hq=2, Hkv=1, seed=4)
        return AttentionSpec(mask=mask, return_lse=True, block_sizes=SMALL), q, k, v
    raise ValueError(name)


ARRAY_MASK_CASES = ("segments_lengths_poisoned", "causal_segments_gqa_ragged")


@pytest.fixture(scope="module")
def interpreted_array_masks():
    """``{case: AttentionOutput}`` of :data:`ARRAY_MASK_CASES` from the interpreter."""
    return {name: interpret(*array_mask_case(name)) for name in ARRAY_MASK_CASES}


def test_redo_with_array_masks_sinks_and_dropout_matches_the_pass(interpreted_array_masks):
    """hidden_keys="redo" where the Triton forward recomputes flagged programs with
    what else the spec holds: segment ids and lengths with poisoned keys inside
    and outside the documents; sinks, dropout and GQA 2:1 on a ragged causal
    spec with a NaN K on a hidden key. Out and lse match the pass's, NaN for NaN
    (dropout draws the same bits in both kernels)."""
    spec, q, k, v = array_mask_case("segments_lengths_poisoned")
    q2, k2, v2 = qkv(Tq=90, Tk=90, Hq=2, Hkv=1, seed=6)
    k2 = k2.at[0, 80, 0, 0].set(jnp.nan)
    drop = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.5, -1.0]), dropout_rate=0.2,
                         dropout_key=jax.random.key(3), return_lse=True, block_sizes=SMALL)
    for spec, q, k, v, a in ((spec, q, k, v, interpreted_array_masks["segments_lengths_poisoned"]),
                             (drop, q2, k2, v2, None)):
        a = interpret(spec, q, k, v) if a is None else a
        b = interpret(spec.replace(block_sizes=REDO), q, k, v)
        assert np.isnan(np.asarray(b.out, np.float32)).any()
        np.testing.assert_allclose(np.asarray(b.out, np.float32), np.asarray(a.out, np.float32),
                                   atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(np.asarray(b.lse), np.asarray(a.lse), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("persistent", [False, True])
def test_redo_under_vmap_over_segment_ids_and_poisoned_caches(persistent):
    """``vmap`` over documents and K/V with hidden_keys="redo", a poisoned key in
    each instance: the Triton forward (batched, in place) recomputes the
    flagged programs; every instance matches the reference, NaN for NaN, and
    rows of the other document stay finite. Persistent programs too."""
    q, k, v = qkv(Tq=128, Tk=128, Hq=2, Hkv=2, seed=6)
    ids = jnp.asarray(np.stack([documents(32, 96), documents(64, 64)])[:, None])
    kb = jnp.stack([k.at[0, 40, 0, 2].set(jnp.inf), k.at[0, 20, 1, 0].set(jnp.nan)])
    vb = jnp.stack([v, v])

    def spec(ids):
        return AttentionSpec(mask=masks.causal() & masks.segments(ids), return_lse=True,
                             block_sizes=dataclasses.replace(REDO, persistent=persistent))

    try:
        res = jax.jit(jax.vmap(lambda i, k, v: core.run(
            spec(i), q, k, v, fn="flash", table=(("default", _interpreted()),))))(ids, kb, vb)
    except Exception:
        reset_after_failure()
        raise
    for n in range(2):
        one = jax.tree.map(lambda x: x[n], res)
        compare(one, spec(ids[n]), q, kb[n], vb[n])
    out = np.asarray(res.out, np.float32)
    assert np.isnan(out[0, 0, 40:, 0]).all() and np.isfinite(out[0, 0, :40]).all()
    assert np.isnan(out[1, 0, 20:64, 1]).all() and np.isfinite(out[1, 0, 64:]).all()


@pytest.mark.parametrize("name", ARRAY_MASK_CASES)
def test_interpreted_array_masks_match_reference(name, interpreted_array_masks):
    spec, q, k, v = array_mask_case(name)
    compare(interpreted_array_masks[name], spec, q, k, v)


def test_interpreted_segments_no_key_and_poisoned_keys(interpreted_array_masks):
    """Rows whose document has no visible key give out 0 and lse -inf; NaN and
    inf on keys in other documents (or past the key length) reach no row; a
    poisoned key poisons exactly the rows of its own document."""
    res = interpreted_array_masks["segments_lengths_poisoned"]
    out, lse = np.asarray(res.out, np.float32), np.asarray(res.lse)
    assert np.all(out[1, 80:90] == 0) and np.all(lse[1, :, 80:90] == -np.inf)
    assert np.isfinite(out[0]).all() and np.isfinite(lse[0]).all()
    assert np.isnan(out[1, 30:80]).all()
    rest = np.r_[0:30, 90:128]
    assert np.isfinite(out[1, rest]).all() and np.isfinite(lse[1, :, rest]).all()


def test_persistent_programs_give_the_bits_of_one_program_per_item():
    """persistent=True: the interpreter's 3 programs walk the 8 items (2 batch
    rows x 2 heads x 2 q-tiles) 3, 3 and 2 each, in the grid's order
    (walk="tiles", not the heaviest-first order of the other persistent tests:
    [1, 0, 3, 2] against [3, 2, 1, 0] here), their K/V ring running on from one
    item to the next. Causal documents (one whose rows see no key), GQA 2:1,
    sinks, ragged 250 x 256 and a NaN K on a key hidden from the other
    documents (flagged rows recomputed): the bits of one program per item, and
    the reference's values, NaN for NaN."""
    assert mosaic_gpu.INTERPRETED_PROGRAMS == 3
    q, k, v = qkv(B=2, Tq=250, Tk=256, Hq=2, Hkv=1, seed=8)
    kv_ids = np.stack([documents(100, 156), documents(30, 130, 96)])
    q_ids = kv_ids[:, 6:].copy()
    q_ids[1, 200:220] = 7  # no key of document 7
    k = k.at[1, 40, 0, 5].set(jnp.nan)  # document 1 of batch row 1
    spec = AttentionSpec(mask=masks.causal() & masks.segments(jnp.asarray(q_ids),
                                                              jnp.asarray(kv_ids)),
                         sinks=jnp.array([0.5, -1.0]), return_lse=True,
                         block_sizes=SMALL)
    one = interpret(spec, q, k, v)
    persistent = spec.replace(block_sizes=dataclasses.replace(SMALL, persistent=True,
                                                              walk="tiles"))
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: core.run(
        persistent, q, k, v, fn="flash", table=(("default", _interpreted()),)).out)(q, k, v))
    assert "grid=(3,), grid_names=('sm',)" in jaxpr
    assert mosaic_gpu.q_buffers(SMALL, 64, q.dtype, (("rows", 1, True, False),), 3) == 2
    walked = compare(interpret(persistent, q, k, v), spec, q, k, v)
    out = np.asarray(walked.out, np.float32)
    np.testing.assert_array_equal(out, np.asarray(one.out, np.float32))
    np.testing.assert_array_equal(np.asarray(walked.lse), np.asarray(one.lse))
    assert np.isnan(out[1, 34:154]).all() and np.isfinite(out[1, 154:]).all()
    assert np.isfinite(out[0]).all() and np.all(out[1, 200:220] == 0)


# ----------------------------------------------------------------------------------
# What the kernel refuses
# ----------------------------------------------------------------------------------


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
    ("d288", dict(cfg=cfg_of(D=288)), "head dim D=288"),
    ("dv320", dict(cfg=cfg_of(D=64, Dv=320)), "head dim D=64, Dv=320"),
])
def test_supports_refuses_with_reasons(what, args, words):
    a = dict(cfg=cfg_of(), dtype=jnp.bfloat16, mask=None, bias=None, sinks=None)
    a.update(args)
    why = mosaic_gpu.supports(a["cfg"], a["dtype"], a["mask"], a["bias"], a["sinks"])
    assert len(why) == 1 and words in why[0], why
    with pytest.raises(NotImplementedError, match="fnattn/flash/triton.py"):
        mosaic_gpu.forward(a["cfg"], jnp.zeros((1, 128, 4, a["cfg"].dims.head_dim), a["dtype"]),
                           None, None, a["bias"], a["sinks"], a["mask"], None)


def test_supports_array_free_masks():
    for mask in (None, masks.causal(), masks.sliding_window(5, 7), masks.chunked(32),
                 masks.causal() | ~masks.sliding_window(3)):
        assert mosaic_gpu.supports(cfg_of(), jnp.float16, mask, None, None) == []


def test_supports_masks_holding_per_row_or_per_key_arrays():
    ids = jnp.zeros((1, 128), jnp.int32)
    for mask in (masks.segments(ids), masks.causal() & masks.segments(ids.astype(jnp.int8)),
                 masks.lengths(jnp.array([100]), jnp.array([90])),
                 masks.prefix_lm(jnp.array([7])) | masks.sliding_window(3),
                 masks.at_positions(masks.causal(), jnp.arange(128) + 9, jnp.arange(128))):
        assert mosaic_gpu.supports(cfg_of(), jnp.bfloat16, mask, None, None) == [], mask


@pytest.mark.parametrize("D, bq, bk, steps, persistent, mask", [
    (128, 64, 128, 2, False, "causal"), (64, 128, 64, 3, False, "documents"),
    (128, 64, 128, 2, True, "documents"), (256, 64, 64, 2, False, "lengths")])
def test_smem_estimate_is_what_the_lowering_counts(D, bq, bk, steps, persistent, mask):
    """``smem_bytes`` equals the count of Mosaic GPU's lowering (what the
    kernel's own check and fnattn.tune's candidates rely on)."""
    pytest.importorskip("absl")
    T = 1024
    ids = jnp.asarray(np.repeat(np.arange(4), T // 4)[None], jnp.int32)
    mask = {"causal": masks.causal(), "documents": masks.causal() & masks.segments(ids),
            "lengths": masks.lengths(kv_lengths=jnp.array([1000]))}[mask]
    bs = MosaicGpuBlockSizes(block_q=bq, block_k=bk, max_concurrent_steps=steps,
                             persistent=persistent)
    q = jax.ShapeDtypeStruct((1, T, 4, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, T, 2, D), jnp.bfloat16)
    spec = AttentionSpec(mask=mask, block_sizes=bs)
    counted = mosaic_gpu_smem(lambda: lowered_text(spec, q, k, (("default", LOWERING),)))
    rows, cols = mosaic_gpu.array_counts(mask)
    assert counted == bs.smem_bytes(D, row_arrays=rows, key_arrays=cols,
                                    q_buffers=2 if persistent else 1)


def test_tiles_past_shared_memory_are_refused_with_their_count():
    T, D = 1024, 128
    ids = jnp.asarray(np.repeat(np.arange(4), T // 4)[None], jnp.int32)
    bs = MosaicGpuBlockSizes(block_q=64, block_k=128, max_concurrent_steps=3)
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), block_sizes=bs)
    q = jax.ShapeDtypeStruct((1, T, 4, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, T, 2, D), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"max_concurrent_steps=3\) needs 236704 bytes .* 1 "
                                         "per-row and 1 per-key"):
        lowered_text(spec, q, k, (("default", LOWERING),))


def test_block_sizes_fit_shared_memory():
    for D in (64, 128, 256):
        assert MosaicGpuBlockSizes.default(D).smem_bytes(
            D, row_arrays=2, key_arrays=2) <= mosaic_gpu.SMEM_BYTES
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        MosaicGpuBlockSizes(max_concurrent_steps=1)


@pytest.mark.parametrize("transpose, heads_per_row", [(False, 1), (True, 1), (True, 3)])
def test_visit_list_matches_a_plain_walk(transpose, heads_per_row):
    """The visiting table (NumPy at trace time, or XLA) against walking
    each row: FULL tiles in order, then PARTIAL ones, then the last repeated
    (0 for a row that visits nothing); merged heads FULL only if FULL for all."""
    from fnattn.flash import triton
    cls = np.random.default_rng(0).choice(
        np.array([masks.EMPTY, masks.PARTIAL, masks.FULL], np.int8), (2, 6, 5, 7),
        p=[0.4, 0.3, 0.3])
    cls[0, 0, 1] = masks.EMPTY  # a row with nothing to visit
    rows = triton.row_classes(np, cls, transpose, heads_per_row)
    expected = np.zeros(rows.shape[:-1] + (2 + rows.shape[-1],), np.int32)
    for idx in np.ndindex(rows.shape[:-1]):
        r = rows[idx]
        full, part = np.flatnonzero(r == masks.FULL), np.flatnonzero(r == masks.PARTIAL)
        walk = list(full) + list(part)
        walk += [walk[-1] if walk else 0] * (len(r) - len(walk))
        expected[idx] = [len(full), len(full) + len(part)] + walk
    if heads_per_row > 1:
        merged = cls.swapaxes(-1, -2).reshape(2, 2, 3, 7, 5)
        assert (rows == masks.FULL).sum() == (merged == masks.FULL).all(2).sum()
    np.testing.assert_array_equal(mosaic_gpu.visit_list(np, rows), expected)
    traced = jax.jit(lambda c: mosaic_gpu.visit_list(
        jnp, triton.row_classes(jnp, c, transpose, heads_per_row)))(cls)
    np.testing.assert_array_equal(np.asarray(traced), expected)


# ----------------------------------------------------------------------------------
# Lowering for "cuda" on CPU
# ----------------------------------------------------------------------------------


def lowered_text(spec, q, k, table):
    """The program of a forward call (K = V) lowered for cuda, as text."""
    f = jax.jit(lambda q, k, v: core.run(spec, q, k, v, fn="flash", table=table).out)
    with gpu_target():
        return f.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()


def lowered_has_mosaic_gpu_call(spec, q, k, table):
    return re.search(r"custom_call @mosaic_gpu", lowered_text(spec, q, k, table)) is not None


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("mask", [None, "causal", "window", "chunked"])
def test_lowers_for_cuda(D, mask):
    """Every head dim and array-free mask (a negated one among them: ``~``);
    soft-cap at D = 256, sinks at D = 128, dropout at D = 64."""
    pytest.importorskip("absl")
    mask = {None: None, "causal": masks.causal(),
            "window": masks.causal() & masks.sliding_window(100),
            "chunked": masks.chunked(64) & ~masks.sliding_window(3, 3)}[mask]
    q = jax.ShapeDtypeStruct((2, 1000, 8, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1000, 2, D), jnp.bfloat16)
    spec = AttentionSpec(mask=mask, softcap=30.0 if D == 256 else None,
                         sinks=jnp.linspace(-1.0, 1.0, 8) if D == 128 else None,
                         dropout_rate=0.1 if D == 64 else 0.0,
                         dropout_key=jax.random.key(0) if D == 64 else None)
    assert lowered_has_mosaic_gpu_call(spec, q, k, (("default", LOWERING),))


@pytest.mark.parametrize("mask", ["causal", "documents"])
def test_lowers_for_cuda_with_position_terms(mask):
    """ALiBi (with sinks, a soft-cap, or documents' segment ids beside it)."""
    pytest.importorskip("absl")
    B, T = 2, 1000
    ids = jnp.asarray(np.stack([documents(300, 700), documents(250, 250, 500)]))
    q = jax.ShapeDtypeStruct((B, T, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, 2, 128), jnp.bfloat16)
    mask = masks.causal() if mask == "causal" else masks.causal() & masks.segments(ids)
    term = position_bias.alibi(jnp.asarray(position_bias.alibi_slopes(8)))
    for cap, sinks in ((None, jnp.zeros(8)), (30.0, None)):
        spec = AttentionSpec(mask=mask, softcap=cap, sinks=sinks, position_bias=term,
                             block_sizes=MosaicGpuBlockSizes(block_k=64, max_concurrent_steps=2))
        assert lowered_has_mosaic_gpu_call(spec, q, k, (("default", LOWERING),))


ARRAY_MASKS = {
    "segments": lambda ids, B, T: masks.segments(ids),
    "causal_segments": lambda ids, B, T: masks.causal() & masks.segments(ids.astype(jnp.int16)),
    "lengths_prefix_lm": lambda ids, B, T: (masks.prefix_lm(jnp.full((B,), 100))
                                            & masks.lengths(jnp.full((B,), 900),
                                                            jnp.full((B,), 800))),
    "at_positions": lambda ids, B, T: masks.at_positions(
        masks.causal() & masks.segments(ids), jnp.arange(T) + 500, jnp.arange(T)),
}


@pytest.mark.parametrize("name", ARRAY_MASKS)
def test_lowers_for_cuda_with_array_masks(name):
    """Segment ids, lengths, prefix lengths and positions: the schedule from XLA,
    the per-row arrays by TMA once, the per-key arrays by TMA with K."""
    pytest.importorskip("absl")
    B, T = 2, 1000
    ids = jnp.asarray(np.stack([documents(300, 700), documents(250, 250, 500)]))
    q = jax.ShapeDtypeStruct((B, T, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, 2, 128), jnp.bfloat16)
    spec = AttentionSpec(mask=ARRAY_MASKS[name](ids, B, T),
                         block_sizes=MosaicGpuBlockSizes(block_k=64, max_concurrent_steps=3))
    assert lowered_has_mosaic_gpu_call(spec, q, k, (("default", LOWERING),))


@pytest.mark.parametrize("D", [64, 192, 256])
def test_redo_lowers_for_cuda_without_the_pass(D):
    """hidden_keys="redo" (causal documents, soft-cap, sinks, GQA 4:1): the Mosaic
    GPU kernel and the Triton kernel that recomputes flagged rows, and none of
    the pass's ``is_finite`` over K and V in XLA; "pass" has those and no
    Triton kernel; "auto" (the default) is "redo" at 64 and 256 and "pass" at
    192, where "redo" is refused."""
    pytest.importorskip("absl")
    B, T = 2, 1000
    ids = jnp.asarray(np.stack([documents(300, 700), documents(250, 250, 500)]))
    q = jax.ShapeDtypeStruct((B, T, 8, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, 2, D), jnp.bfloat16)
    kv_finite = re.compile(rf"is_finite.*tensor<{B}x{T}x2x{D}xbf16>")
    pass_, redo = ([], 2), (REDO_KERNELS, 0)
    cases = {"pass": pass_, "auto": pass_ if D == 192 else redo}
    if D != 192:
        cases["redo"] = redo
    for hidden_keys, (triton_calls, passes) in cases.items():
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), softcap=30.0,
                             sinks=jnp.zeros(8), block_sizes=dataclasses.replace(
                                 MosaicGpuBlockSizes.default(D), hidden_keys=hidden_keys))
        text = lowered_text(spec, q, k, (("default", LOWERING),))
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
        assert triton_kernels(text) == triton_calls
        assert len(kv_finite.findall(text)) == passes


@pytest.mark.parametrize("B, H, tiles, sched_b, sched_h, programs", [
    (2, 16, 64, 1, 1, 132), (2, 16, 64, 2, 1, 132), (2, 4, 9, 2, 1, 7), (3, 2, 5, 3, 2, 4),
    (1, 1, 3, 1, 1, 8)])
@pytest.mark.parametrize("weights", ["documents", "causal"])
@pytest.mark.parametrize("walk_name", mosaic_gpu.WALKS)
def test_persistent_walk_takes_every_item_once_and_balances_the_programs(
        B, H, tiles, sched_b, sched_h, programs, weights, walk_name):
    """The persistent programs' share of the items (mosaic_gpu.Walk, the same
    code the kernel runs with lax.div / lax.rem): every (batch, head, q-tile)
    exactly once, NumPy and XLA alike. Ranked by kv-tiles visited (walk_order's
    "heaviest") and taken in snake order, no program's load exceeds another's
    by more than the heaviest item's, and the heaviest load is no more than
    with the grid's order taken round robin (random loads of 0 to 8 kv-tiles
    over 2 x 16 x 64 items on 132 programs: 66 kv-tiles against 85). In the
    grid's order ("tiles"), the ranks are the grid's, unbalanced."""
    seen = (np.random.default_rng(0).integers(0, 9, (sched_b, sched_h, tiles))
            if weights == "documents"
            else np.broadcast_to(np.arange(1, tiles + 1), (sched_b, sched_h, tiles)))
    table = np.zeros((sched_b, sched_h, tiles, 2), np.int32)
    table[..., 1] = seen
    order = mosaic_gpu.walk_order(np, table, walk_name)
    np.testing.assert_array_equal(
        jax.jit(lambda t: mosaic_gpu.walk_order(jnp, t, walk_name))(table), order)
    walk = mosaic_gpu.Walk(B, H, tiles, sched_b, sched_h, programs)
    div, rem = (lambda a, b: a // b), (lambda a, b: a % b)  # noqa: E731
    taken = [[walk.item(i, sm, lambda j: int(order[j]), div, rem)
              for i in range(walk.count(sm, rem))] for sm in range(programs)]
    assert sorted(sum(taken, [])) == [(b, h, t) for b in range(B) for h in range(H)
                                     for t in range(tiles)]
    if walk_name == "tiles":
        # the grid's order (neighbouring q-tiles side by side, the last first);
        # the loads are not balanced
        rows = range(sched_b * sched_h * tiles)
        assert order.tolist() == sorted(rows, key=lambda r: (r // tiles, -(r % tiles)))
        return

    def weight(b, h, t):
        return seen[b if sched_b > 1 else 0, h if sched_h > 1 else 0, t]

    loads = [sum(weight(*item) for item in mine) for mine in taken]
    grid_order = [(b, h, tiles - 1 - t) for t in range(tiles) for b in range(B) for h in range(H)]
    round_robin = [sum(weight(*item) for item in grid_order[sm::programs])
                   for sm in range(programs)]
    assert max(loads) - min(loads) <= seen.max()
    assert max(loads) <= max(round_robin)


def test_persistent_programs_with_one_q_buffer(monkeypatch):
    """Where shared memory holds one Q tile per consumer only (D = 256), each
    item loads its own after the one before it has left the buffer: causal,
    4 items on 3 programs, against the reference."""
    asked = []
    monkeypatch.setattr(mosaic_gpu, "q_buffers", lambda *a: asked.append(a[-1]) or 1)
    q, k, v = qkv(Tq=256, Tk=256, Hq=2, Hkv=2, seed=9)
    spec = AttentionSpec(mask=masks.causal(), return_lse=True,
                         block_sizes=dataclasses.replace(SMALL, persistent=True))
    check(spec, q, k, v)
    assert asked == [3]  # (the programs it was asked for)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_persistent_lowers_for_cuda(D):
    """persistent=True, one program per multiprocessor (132 when no GPU tells):
    causal documents with dropout at D = 64, sinks at 128, soft-cap at 256; and
    without a mask at 128."""
    pytest.importorskip("absl")
    B, T = 2, 1000
    ids = jnp.asarray(np.stack([documents(300, 700), documents(250, 250, 500)]))
    q = jax.ShapeDtypeStruct((B, T, 8, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, 2, D), jnp.bfloat16)
    bs = dataclasses.replace(MosaicGpuBlockSizes.default(D), persistent=True)
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), block_sizes=bs,
                         softcap=30.0 if D == 256 else None,
                         sinks=jnp.linspace(-1.0, 1.0, 8) if D == 128 else None,
                         dropout_rate=0.1 if D == 64 else 0.0,
                         dropout_key=jax.random.key(0) if D == 64 else None)
    table = (("default", LOWERING),)
    assert lowered_has_mosaic_gpu_call(spec, q, k, table)
    if D == 128:
        assert lowered_has_mosaic_gpu_call(spec.replace(mask=None), q, k, table)
    assert mosaic_gpu._programs(False) == mosaic_gpu.NUM_SMS == 132
    with pytest.raises(ValueError, match="persistent must be True or False"):
        MosaicGpuBlockSizes(persistent=1)
    with pytest.raises(ValueError, match=r"walk must be one of .*; got .grid."):
        MosaicGpuBlockSizes(walk="grid")


def test_redo_needs_a_power_of_two_head_dim():
    """hidden_keys="redo" at D = 192 is refused with the reason (the Triton forward
    that recomputes flagged rows takes powers of two); without a mask it runs, and
    so does the default ("auto": the pass there)."""
    cfg = Config(Dims(1, 256, 256, 4, 2, 192, 192), 0.1, None, 0.0, None,
                 block_sizes=dataclasses.replace(MosaicGpuBlockSizes.default(192),
                                                 hidden_keys="redo"))
    why = mosaic_gpu.supports(cfg, jnp.bfloat16, masks.causal(), None, None)
    assert len(why) == 1 and "hidden_keys='redo'" in why[0] and "D=192" in why[0]
    assert mosaic_gpu.supports(cfg, jnp.bfloat16, None, None, None) == []
    auto = dataclasses.replace(cfg, block_sizes=MosaicGpuBlockSizes.default(192))
    assert mosaic_gpu.supports(auto, jnp.bfloat16, masks.causal(), None, None) == []
    with pytest.raises(ValueError, match="hidden_keys must be 'auto', 'pass' or 'redo'"):
        MosaicGpuBlockSizes(hidden_keys="skip")


# ----------------------------------------------------------------------------------
# On an NVIDIA GPU
# ----------------------------------------------------------------------------------

GPU_MASKS = {"none": None, "causal": masks.causal(), "window": masks.sliding_window(256)}


def gpu_against_xla(spec, q, k, v):
    """On the GPU: the kernel's out, lse and gradients (the Triton backward from its
    residuals) of a loss that weights the head dim, against the float32 XLA
    lowering's. Returns the kernel's result."""
    D = v.shape[-1]

    def loss(table):
        def f(q, k, v):
            res = core.run(spec, q, k, v, fn="flash", table=table)
            return jnp.sum(res.out.astype(jnp.float32) * jnp.cos(jnp.arange(D))), res
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    (_, res), grads = loss((("default", LOWERING),))(q, k, v)
    (_, ref), ref_grads = loss((("default", xla.LOWERING),))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    np.testing.assert_allclose(f32(res.out), f32(ref.out), atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.isfinite(res.lse), np.isfinite(ref.lse))
    np.testing.assert_allclose(f32(res.lse), f32(ref.lse), atol=2e-2, rtol=2e-2)
    for g, gr in zip(grads, ref_grads):
        scale = float(np.abs(f32(gr)).max())
        np.testing.assert_allclose(f32(g) / scale, f32(gr) / scale, atol=3e-2)
    return res


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("D, Dv", [(128, 128), (256, 256), (192, 128)])
def test_gpu_mosaic_gpu_ragged_softcap_gqa_and_gradients(D, Dv):
    """Ragged lengths (1000 x 1500), soft-cap, sinks, GQA 4:1, D up to 256 (and
    a latent attention's 192 with Dv = 128, V padded to 192), and the gradients
    (the Triton backward from this kernel's residuals) against the XLA
    lowering."""
    q, k, v = qkv(B=2, Tq=1000, Tk=1500, Hq=8, Hkv=2, D=D, Dv=Dv, dtype=jnp.bfloat16, seed=1)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(700), softcap=20.0,
                         sinks=jnp.linspace(-2.0, 2.0, 8), return_lse=True)
    gpu_against_xla(spec, q, k, v)


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("T", [1024, 4096])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", GPU_MASKS)
def test_gpu_mosaic_gpu_forward_matches_reference(T, D, name):
    q, k, v = qkv(B=2, Tq=T, Tk=T, Hq=8, Hkv=2, D=D, dtype=jnp.bfloat16)
    spec = AttentionSpec(mask=GPU_MASKS[name], return_lse=True)
    res = run(spec, q, k, v, (("default", LOWERING),))
    ref = run(spec, *(x.astype(jnp.float32) for x in (q, k, v)), (("default", xla.LOWERING),))
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    np.testing.assert_allclose(f32(res.out), f32(ref.out), atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.isfinite(res.lse), np.isfinite(ref.lse))
    np.testing.assert_allclose(f32(res.lse), f32(ref.lse), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
def test_gpu_mosaic_gpu_dropout_matches_xla():
    """Dropout (rate 0.2) with a causal mask, ragged 1000 x 1500, GQA 4:1: the real
    kernel draws the XLA lowering's keep mask; out, lse and the gradients agree."""
    q, k, v = qkv(B=2, Tq=1000, Tk=1500, Hq=8, Hkv=2, D=128, dtype=jnp.bfloat16, seed=3)
    spec = AttentionSpec(mask=masks.causal(), dropout_rate=0.2, dropout_key=jax.random.key(4),
                         return_lse=True, block_sizes=MosaicGpuBlockSizes.default(128))
    gpu_against_xla(spec, q, k, v)


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_redo_matches_the_pass(D):
    """hidden_keys="redo" on the GPU (causal documents, soft-cap, sinks, GQA 4:1,
    ragged 1000 x 1500): finite inputs give the bits of the pass; poisoned keys
    (a -inf K on keys every later row sees, a NaN V, an inf K on a key of
    another document) give the pass's NaN rows and its values elsewhere."""
    q, k, v = qkv(B=2, Tq=1000, Tk=1500, Hq=8, Hkv=2, D=D, dtype=jnp.bfloat16, seed=5)
    ids = jnp.asarray(np.stack([documents(700, 800), documents(300, 1200)]))
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids[:, 500:], ids), softcap=20.0,
                         sinks=jnp.linspace(-2.0, 2.0, 8), return_lse=True,
                         block_sizes=MosaicGpuBlockSizes.default(D))
    redo = spec.replace(block_sizes=dataclasses.replace(spec.block_sizes, hidden_keys="redo"))
    table = (("default", LOWERING),)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    a, b = run(spec, q, k, v, table), run(redo, q, k, v, table)
    np.testing.assert_array_equal(f32(a.out), f32(b.out))
    np.testing.assert_array_equal(f32(a.lse), f32(b.lse))
    q = q.at[0, :, 0, 3].set(jnp.abs(q[0, :, 0, 3]) + 0.5)
    k = k.at[0, 800, 0, 3].set(-jnp.inf).at[1, 290, 1, 7].set(jnp.inf)
    v = v.at[0, 1200, 1, 5].set(jnp.nan)
    a, b = run(spec, q, k, v, table), run(redo, q, k, v, table)
    assert np.isnan(f32(b.out)).any() and np.isfinite(f32(b.out)[1]).all()
    np.testing.assert_allclose(f32(b.out), f32(a.out), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(f32(b.lse), f32(a.lse), atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("mask, walk", [("none", "heaviest"), ("causal_documents", "heaviest"),
                                        ("causal_documents", "tiles")])
def test_gpu_persistent_gives_the_bits_of_one_program_per_item(mask, walk):
    """persistent=True on the GPU (a program per multiprocessor): the bits of one
    program per item, out and lse, with GQA 4:1 on ragged 1000 x 1500; causal
    documents with a poisoned key (flagged rows recomputed), the items taken
    heaviest first or in the grid's order."""
    q, k, v = qkv(B=2, Tq=1000, Tk=1500, Hq=8, Hkv=2, D=128, dtype=jnp.bfloat16, seed=9)
    ids = jnp.asarray(np.stack([documents(700, 800), documents(300, 1200)]))
    causal_docs = masks.causal() & masks.segments(ids[:, 500:], ids)
    spec = AttentionSpec(mask=None if mask == "none" else causal_docs, return_lse=True,
                         block_sizes=MosaicGpuBlockSizes.default(128))
    if mask != "none":
        k = k.at[1, 900, 1, 3].set(jnp.nan)  # seen by rows 400.. of heads 4..7
    walked = spec.replace(block_sizes=dataclasses.replace(spec.block_sizes, persistent=True,
                                                          walk=walk))
    table = (("default", LOWERING),)
    a, b = run(spec, q, k, v, table), run(walked, q, k, v, table)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(f32(b.out), f32(a.out))
    np.testing.assert_array_equal(f32(b.lse), f32(a.lse))
    if mask != "none":
        out = f32(b.out)
        assert np.isnan(out[1, 400:, 4:]).all() and np.isfinite(out[1, :400]).all()
        assert np.isfinite(out[0]).all()


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_mosaic_gpu_segments_match_xla(causal):
    """Packed documents (segment ids per batch row, ragged 1000 x 1500 with the
    queries aligned to the last keys, a query document with no keys), GQA 4:1:
    the real kernel and the gradients of its residuals against the XLA lowering."""
    B, Tq, Tk, D = 2, 1000, 1500, 128
    q, k, v = qkv(B=B, Tq=Tq, Tk=Tk, Hq=8, Hkv=2, D=D, dtype=jnp.bfloat16, seed=2)
    kv_ids = np.stack([documents(300, 200, 1000), documents(700, 100, 400, 300)])
    q_ids = kv_ids[:, Tk - Tq:].copy()
    q_ids[1, 600:650] = 99  # no key of document 99
    seg = masks.segments(jnp.asarray(q_ids), jnp.asarray(kv_ids))
    spec = AttentionSpec(mask=masks.causal() & seg if causal else seg, return_lse=True,
                         block_sizes=MosaicGpuBlockSizes.default(D))
    res = gpu_against_xla(spec, q, k, v)
    assert np.all(np.asarray(res.out[1, 600:650], np.float32) == 0)


# ----------------------------------------------------------------------------------
# impl="auto" on cuda: which kernel runs
# ----------------------------------------------------------------------------------


@pytest.fixture
def hopper(monkeypatch):
    """Tracing as in a process with a Hopper GPU (this CPU has none)."""
    monkeypatch.setattr(mosaic_gpu, "available", lambda: None)


def test_available_needs_a_hopper_gpu():
    assert mosaic_gpu.available() is not None   # (no GPU in this process)
    cfg = cfg_of()
    assert not mosaic_gpu.route(cfg, jnp.bfloat16, masks.causal(), None, None)


def test_cuda_kernel_choice(hopper):
    """Which kernels impl="auto" runs on a Hopper GPU (stood in for) where cuDNN
    does not: "fa3" is the Mosaic GPU forward and backward, "mgpu" the Mosaic
    GPU forward with the Triton backward (tests/flash/test_mosaic_gpu_bwd.py
    checks the backward's side of the choice)."""
    from fnattn.flash.api import cuda_kernel
    names = {"flash-mosaic-gpu-fa3": "fa3", "flash-mosaic-gpu": "mgpu",
             "flash-triton": "triton"}

    def kernel(cfg, q, bias, sinks, mask):
        return names[cuda_kernel(cfg, q, bias, sinks, mask).name]

    cfg = cfg_of()
    q16, q32 = jnp.zeros((1, 128, 4, 64), jnp.bfloat16), jnp.zeros((1, 128, 4, 64))
    assert kernel(cfg, q16, None, None, masks.causal()) == "fa3"
    assert kernel(cfg, q16, None, None, masks.chunked(32)) == "fa3"
    assert kernel(cfg, q32, None, None, masks.causal()) == "triton"
    assert kernel(cfg, q16, jnp.zeros((128, 128)), None, None) == "triton"
    # Sinks cost a per-row epilogue only: the same path as without them.
    assert kernel(cfg, q16, None, jnp.zeros((4,)), masks.causal()) == "fa3"
    # Masks holding arrays (timed on an H100 ahead of the Triton kernels) too.
    seg = masks.segments(jnp.zeros((1, 128), jnp.int32))
    assert kernel(cfg, q16, None, None, seg) == "fa3"
    assert kernel(cfg, q16, None, None, masks.causal() & seg) == "fa3"
    assert kernel(cfg, q32, None, None, seg) == "triton"
    # Wide heads: the backward's column split is untimed, so the Triton backward.
    wide, q256 = cfg_of(D=256), jnp.zeros((1, 128, 4, 256), jnp.bfloat16)
    assert kernel(wide, q256, None, None, masks.causal() & seg) == "mgpu"
    # Head dims computed at a multiple of 64 (kernel_dim): D = 96 at 128 (the
    # backward's row split); D = 192 with Dv = 128 at 192 (its column split).
    d96, q96 = cfg_of(D=96), jnp.zeros((1, 128, 4, 96), jnp.bfloat16)
    assert kernel(d96, q96, None, None, masks.causal() & seg) == "fa3"
    mla, q192 = cfg_of(D=192, Dv=128), jnp.zeros((1, 128, 4, 192), jnp.bfloat16)
    assert kernel(mla, q192, None, None, seg) == "mgpu"
    assert kernel(cfg_of(D=320), jnp.zeros((1, 128, 4, 320), jnp.bfloat16), None, None,
                  seg) == "triton"
    # ... but where the padding makes more work than the Triton kernels' (D = 32
    # at 64 here, at 32 there) only when asked for by name.
    d32, q32b = cfg_of(D=32), jnp.zeros((1, 128, 4, 32), jnp.bfloat16)
    assert kernel(d32, q32b, None, None, seg) == "triton"
    assert kernel(cfg_of(D=64, Dv=32), q16, None, None, seg) == "triton"
    assert kernel(dataclasses.replace(d32, block_sizes=MosaicGpuBlockSizes()), q32b, None, None,
                  seg) == "fa3"
    given = dataclasses.replace(cfg, block_sizes=fnattn.TritonBlockSizes())
    assert kernel(given, q16, None, None, masks.causal()) == "triton"
    assert kernel(given, q16, None, None, seg) == "triton"
    given = dataclasses.replace(cfg, block_sizes=MosaicGpuBlockSizes(block_k=64))
    assert kernel(given, q16, None, None, masks.causal()) == "fa3"
    # Dropout: the Mosaic GPU forward only when asked for by name (awaiting an H100
    # timing), and then the Triton backward unless that is asked for as well.
    drop = dataclasses.replace(cfg, dropout_rate=0.1)
    assert kernel(drop, q16, None, None, masks.causal()) == "triton"
    assert kernel(dataclasses.replace(drop, block_sizes=given.block_sizes), q16, None,
                  None, masks.causal()) == "mgpu"
    both = dataclasses.replace(cfg, block_sizes=(MosaicGpuBlockSizes(),
                                                 fnattn.TritonBlockSizes()))
    assert kernel(both, q16, None, None, seg) == "triton"


def _lowered(spec, q, k, v):
    """(Mosaic GPU custom calls, Triton kernels) in the gradient program impl="auto"
    lowers for cuda."""
    def loss(q, k, v):
        return jnp.sum(fnattn.attention(spec, q, k, v).out.astype(jnp.float32))
    with gpu_target():
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
            lowering_platforms=("cuda",)).as_text()
    # (the Mosaic GPU custom call; the test file's own name is in the locations)
    mgpu = len(re.findall(r"custom_call @mosaic_gpu", text))
    return mgpu, triton_kernels(text)


_TRITON_BWD = ["fnattn_flash_dkdv", "fnattn_flash_dq"]
_TRITON_ALL = ["fnattn_flash_dkdv", "fnattn_flash_dq", "fnattn_flash_fwd"]


@pytest.mark.parametrize("D, Dv, expected", [
    (80, 128, (2, REDO_KERNELS)),                 # at 128: redo, the row split
    (192, 128, (1, sorted(_TRITON_BWD))),         # at 192: the pass; the Triton backward
])
def test_auto_gradient_with_padded_head_dims_lowers_for_cuda(monkeypatch, D, Dv, expected):
    """Head dims that are not multiples of 64, and Dv unlike D (a multi-head
    latent attention's 192 and 128), run on the Mosaic GPU kernels on Hopper
    at kernel_dim, with their gradients in their own shapes."""
    pytest.importorskip("absl")
    monkeypatch.setattr(mosaic_gpu, "available", lambda: None)
    q = jax.ShapeDtypeStruct((2, 300, 4, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 300, 2, D), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 300, 2, Dv), jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal(), softcap=30.0)
    assert _lowered(spec, q, k, v) == expected


@pytest.mark.parametrize("on_hopper, D", [(False, 128), (True, 128), (True, 256)])
def test_auto_runs_the_mosaic_gpu_kernels_on_hopper(monkeypatch, on_hopper, D):
    """A soft-capped causal spec (which cuDNN cannot run): on Hopper the Mosaic GPU
    forward and backward at D=128, the Mosaic GPU forward and the Triton dq and
    dk/dv kernels at D=256 (with the Triton forward that recomputes flagged rows
    at both); elsewhere the three Triton kernels. A spec with a bias stays on
    Triton either way."""
    pytest.importorskip("absl")
    if on_hopper:
        monkeypatch.setattr(mosaic_gpu, "available", lambda: None)
    q = jax.ShapeDtypeStruct((2, 256, 4, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 256, 2, D), jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal(), softcap=30.0)
    expected = {(False, 128): (0, _TRITON_ALL), (True, 128): (2, REDO_KERNELS),
                (True, 256): (1, sorted(_TRITON_BWD + REDO_KERNELS))}[on_hopper, D]
    assert _lowered(spec, q, k, k) == expected
    mgpu, kernels = _lowered(spec.replace(bias=jnp.zeros((256, 256))), q, k, k)
    assert not mgpu and "fnattn_flash_fwd" in kernels


@pytest.mark.parametrize("triton_sizes", [False, True])
def test_segment_ids_run_on_the_mosaic_gpu_kernels(hopper, triton_sizes):
    """On Hopper, impl="auto" runs a packed-documents spec on the Mosaic GPU
    forward (with the Triton forward that recomputes flagged rows) and backward;
    TritonBlockSizes in the spec ask for the Triton kernels."""
    pytest.importorskip("absl")
    q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    ids = jnp.asarray(np.stack([documents(100, 156), documents(256)]))
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), softcap=30.0,
                         block_sizes=fnattn.TritonBlockSizes() if triton_sizes else None)
    assert _lowered(spec, q, k, k) == ((0, _TRITON_ALL) if triton_sizes else (2, REDO_KERNELS))
