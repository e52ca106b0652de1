"""The Pallas Mosaic (TPU) lowering of flash attention.

On CPU the kernels run in Pallas interpret mode (``INTERPRET_LOWERING``) and are
compared with :func:`fnattn.reference`, forward and gradients; and the real
``LOWERING`` is lowered for TPU, which checks the TPU block-shape rules and that
every primitive has a Mosaic lowering. TPU block rules put 128 on the lane axis,
so the sequences here are 128 to 300 long with 128-blocks and ragged ends.
"""

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import fnattn
from fnattn import AttentionSpec, XlaBlockSizes, core, masks, xla
from fnattn._checks import Dims
from fnattn._dispatch import Config, Lowering
from fnattn.flash import blocks, mosaic
from fnattn.flash.mosaic import MosaicBlockSizes
from lowering import tpu_target

INTERPRET = (("default", mosaic.INTERPRET_LOWERING),)
ON_TPU = (("default", xla.DENSE), ("tpu", mosaic.LOWERING))
B128 = MosaicBlockSizes(*(128,) * 6)
F32 = jnp.float32


def flash(spec, q, k, v, table=INTERPRET):
    return core.run(spec, q, k, v, fn="flash", table=table)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int = 2
    Tq: int = 200
    Tk: int = 300
    Hq: int = 4
    Hkv: int = 2
    D: int = 16
    Dv: int = 8
    mask: str = "none"
    bias: tuple | None = None   # bias shape, with "B", "H", "Q", "K" standing for the sizes
    softcap: float | None = None
    sinks: bool = False
    dropout: float = 0.0
    dtype: str = "float32"
    blocks: MosaicBlockSizes | None = B128


def _mask(kind, B, Tq, Tk, rs):
    seg_q = jnp.asarray(np.sort(rs.integers(0, 3, (B, Tq)), axis=1))
    seg_k = jnp.asarray(np.sort(rs.integers(0, 3, (B, Tk)), axis=1))
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.sliding_window(left=100)
    if kind == "causal_segments":
        return masks.causal() & masks.segments(seg_q, seg_k)
    if kind == "lengths":
        # batch row 1 has q_length 0: every one of its rows is fully masked
        return masks.lengths(jnp.array([Tq - 70, 0][:B]), jnp.array([Tk - 100, Tk - 7][:B]))
    if kind == "prefix_not_array":
        # per-head dense mask: the schedule varies along batch and head
        dense = jnp.asarray(rs.random((B, 2, Tq, Tk)) < 0.3)
        return masks.prefix_lm(jnp.array([50, 200][:B])) & ~masks.from_array(dense)
    if kind == "fn_algebra":
        fn = masks.from_fn(lambda b, h, q, k: (q + 2 * k + h + b) % 5 != 0)
        return ((masks.causal() & ~masks.sliding_window(left=1)) | masks.chunked(50)) & fn
    raise ValueError(kind)


def make(case: Case, seed=0):
    rs = np.random.default_rng(seed)
    dt = jnp.dtype(case.dtype)
    q = jnp.asarray(rs.standard_normal((case.B, case.Tq, case.Hq, case.D)), dt)
    k = jnp.asarray(rs.standard_normal((case.B, case.Tk, case.Hkv, case.D)), dt)
    v = jnp.asarray(rs.standard_normal((case.B, case.Tk, case.Hkv, case.Dv)), dt)
    bias = None
    if case.bias is not None:
        sizes = dict(B=case.B, H=case.Hq, Q=case.Tq, K=case.Tk)
        shape = tuple(sizes.get(a, a) for a in case.bias)
        bias = jnp.asarray(rs.standard_normal(shape), F32)
    sinks = jnp.asarray(rs.standard_normal((case.Hq,)) + 1.0, F32) if case.sinks else None
    spec = AttentionSpec(mask=_mask(case.mask, case.B, case.Tq, case.Tk, rs), bias=bias,
                         sinks=sinks, softcap=case.softcap, dropout_rate=case.dropout,
                         dropout_key=jax.random.key(seed) if case.dropout else None,
                         block_sizes=case.blocks)
    d_out = jnp.asarray(rs.standard_normal((case.B, case.Tq, case.Hq, case.Dv)), F32)
    d_lse = jnp.asarray(rs.standard_normal((case.B, case.Hq, case.Tq)), F32)
    return spec, q, k, v, d_out, d_lse


def outputs_and_grads(attn, spec, q, k, v, d_out, d_lse):
    """(out, lse) and the gradients w.r.t. q, k, v, bias, sinks of a loss that
    also goes through lse."""
    def loss(q, k, v, bias, sinks):
        res = attn(spec.replace(bias=bias, sinks=sinks), q, k, v)
        lse = jnp.where(jnp.isfinite(res.lse), res.lse, 0.0)
        return jnp.sum(res.out.astype(F32) * d_out) + jnp.sum(lse * d_lse), res

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    (_, res), grads = grad(q, k, v, spec.bias, spec.sinks)
    return res.out, res.lse, grads


CASES = [
    Case("causal_gqa_ragged", mask="causal"),
    Case("mqa_window_sinks", B=1, Tq=300, Tk=300, Hq=3, Hkv=1, D=8, Dv=8, mask="window",
         sinks=True),
    Case("segments_tile_bias_softcap", Tq=260, Tk=260, Hq=2, Hkv=2, D=32, Dv=16,
         mask="causal_segments", bias=(1, "H", "Q", "K"), softcap=5.0),
    Case("lengths_fully_masked_rows", Tq=130, Tk=250, Hq=2, Hkv=1, mask="lengths",
         bias=("B", 1, 1, "K")),
    Case("lengths_sinks_row_bias", Tq=130, Tk=250, Hq=2, Hkv=1, mask="lengths", sinks=True,
         bias=(1, "H", "Q", 1)),
    Case("prefix_not_array_scalar_bias", B=2, Tq=140, Tk=260, Hq=2, Hkv=2,
         mask="prefix_not_array", bias=("B", "H", 1, 1)),
    Case("fn_algebra_2d_bias", B=1, Tq=270, Tk=270, Hq=2, Hkv=1, mask="fn_algebra",
         bias=("Q", "K")),
    Case("dropout_softcap", B=2, Tq=140, Tk=140, Hq=2, Hkv=1, mask="causal", dropout=0.3,
         softcap=4.0),
    Case("everything_dv_blocks", Tq=300, Tk=270, Hq=4, Hkv=2, D=24, Dv=40,
         mask="causal_segments", bias=(1, "H", "Q", "K"), softcap=6.0, sinks=True, dropout=0.2,
         blocks=MosaicBlockSizes(128, 256, 256, 128, 128, 256)),
    Case("default_blocks", B=1, Tq=150, Tk=150, Hq=2, Hkv=1, mask="causal", blocks=None),
]

DTYPE_CASES = [
    Case("bf16", B=1, Tq=150, Tk=260, mask="causal", bias=(1, "H", "Q", "K"), sinks=True,
         dtype="bfloat16"),
    Case("f16", B=1, Tq=150, Tk=260, mask="causal", sinks=True, dtype="float16"),
]


def _close(name, x, ref, tol):
    x, ref = np.asarray(jnp.asarray(x, F32)), np.asarray(jnp.asarray(ref, F32))
    assert x.shape == ref.shape, (name, x.shape, ref.shape)
    assert not np.isnan(x).any(), f"{name} has NaN"
    scale = max(1.0, float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0)))
    np.testing.assert_allclose(x, ref, atol=tol * scale, rtol=tol, err_msg=name)


@pytest.mark.parametrize("case", CASES + DTYPE_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case):
    spec, q, k, v, d_out, d_lse = make(case)
    out, lse, grads = jax.jit(outputs_and_grads, static_argnums=0)(
        flash, spec, q, k, v, d_out, d_lse)
    # The reference in float32 on the same (rounded) inputs.
    up = lambda x: x.astype(F32)  # noqa: E731
    r_out, r_lse, r_grads = jax.jit(outputs_and_grads, static_argnums=0)(
        fnattn.reference, spec, up(q), up(k), up(v), d_out, d_lse)
    assert out.dtype == q.dtype and out.shape == (case.B, case.Tq, case.Hq, case.Dv)
    assert lse.dtype == F32 and lse.shape == (case.B, case.Hq, case.Tq)
    tol = {"float32": 2e-5, "bfloat16": 4e-2, "float16": 4e-3}[case.dtype]
    _close("out", out, r_out, tol)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(r_lse))
    _close("lse", jnp.where(jnp.isfinite(lse), lse, 0), jnp.where(jnp.isfinite(r_lse), r_lse, 0),
           tol)
    gtol = {"float32": 1e-4, "bfloat16": 6e-2, "float16": 1e-2}[case.dtype]
    for name, g, r in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, r_grads):
        if r is None:
            assert g is None, name
            continue
        assert g.dtype == r.dtype or name in ("dq", "dk", "dv"), name
        _close(name, g, r, gtol)


def test_tpu_interpreter_with_poisoned_memory():
    """The TPU interpreter raises on out-of-bounds reads and races, and here fills
    uninitialised memory with NaN: a tile the kernels never write (the dbias of
    an EMPTY tile) or a stale accumulator would show up as NaN."""
    ip = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True)
    table = (("default", Lowering("flash-mosaic-tpu-interpret",
                                  functools.partial(mosaic._forward, interpret=ip),
                                  functools.partial(mosaic._backward, interpret=ip))),)
    case = Case("poisoned", B=1, Tq=256, Tk=256, Hq=2, Hkv=1, D=8, Dv=8, mask="causal",
                bias=(1, "H", "Q", "K"), sinks=True, dropout=0.2)
    spec, q, k, v, d_out, d_lse = make(case)
    spec = spec.replace(mask=masks.causal() & masks.lengths(kv_lengths=jnp.array([230])))
    attn = lambda s, q, k, v: flash(s, q, k, v, table=table)  # noqa: E731
    out, lse, grads = jax.jit(outputs_and_grads, static_argnums=0)(
        attn, spec, q, k, v, d_out, d_lse)
    r_out, r_lse, r_grads = jax.jit(outputs_and_grads, static_argnums=0)(
        fnattn.reference, spec, q, k, v, d_out, d_lse)
    _close("out", out, r_out, 2e-5)
    _close("lse", lse, r_lse, 2e-5)
    for name, g, r in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, r_grads):
        _close(name, g, r, 1e-4)


def test_fully_masked_rows_give_zero_and_minus_inf():
    case = CASES[3]  # lengths: batch row 1 has no visible row at all
    spec, q, k, v, d_out, d_lse = make(case)
    out, lse, grads = jax.jit(outputs_and_grads, static_argnums=0)(
        flash, spec, q, k, v, d_out, d_lse)
    assert np.all(np.asarray(out[1]) == 0.0)
    assert np.all(np.asarray(lse[1]) == -np.inf)
    assert np.all(np.asarray(out[0, case.Tq - 70:]) == 0.0)
    for g in grads[:4]:
        assert np.isfinite(np.asarray(g)).all()


def test_dropout_keep_mask_is_bit_exact():
    # With v the identity over keys, out[b, q, h, :] is the row of dropped weights.
    B, T, H = 2, 128, 2
    rs = np.random.default_rng(3)
    q = jnp.asarray(rs.standard_normal((B, T, H, 8)), F32)
    k = jnp.asarray(rs.standard_normal((B, T, 1, 8)), F32)
    v = jnp.broadcast_to(jnp.eye(T, dtype=F32)[None, :, None, :], (B, T, 1, T))
    spec = AttentionSpec(mask=masks.causal(), dropout_rate=0.4, dropout_key=jax.random.key(7),
                         block_sizes=B128)
    out = jax.jit(flash)(spec, q, k, v).out
    _, weights = jax.jit(lambda s, q, k, v: fnattn.reference(s, q, k, v, return_weights=True))(
        spec, q, k, v)
    weights = np.asarray(jnp.swapaxes(weights, 1, 2))  # (B, Tq, H, Tk)
    np.testing.assert_array_equal(np.asarray(out) == 0, weights == 0)
    np.testing.assert_allclose(np.asarray(out), weights, atol=1e-6)
    dropped = (weights == 0) & np.tril(np.ones((T, T), bool))[None, :, None, :]
    assert 0.3 < dropped.sum() / (B * H * T * (T + 1) / 2) < 0.5


def test_vmap_of_grad():
    # vmap adds a grid axis to every kernel and batches the prefetched schedule.
    rs = np.random.default_rng(0)
    x = jnp.asarray(rs.standard_normal((3, 1, 130, 2, 8)), F32)
    ids = jnp.asarray(np.sort(rs.integers(0, 3, (3, 1, 130)), axis=-1))

    def loss(attn, x, ids):
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), block_sizes=B128,
                             sinks=jnp.array([0.5, -0.5]), dropout_rate=0.25,
                             dropout_key=jax.random.key(1))
        return jnp.sum(attn(spec, x, x, x).out * x)

    g = jax.jit(jax.vmap(jax.grad(lambda x, i: loss(flash, x, i))))(x, ids)
    r = jax.jit(jax.vmap(jax.grad(lambda x, i: loss(fnattn.reference, x, i))))(x, ids)
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=1e-5)


def _cfg(T, mask=None, B=1, H=1):
    dims = Dims(B, T, T, H, H, 64, 64)
    return Config(dims=dims, scale=0.125, softcap=None, dropout_rate=0.0,
                  mask_treedef=jax.tree_util.tree_structure(mask))


def test_array_free_masks_get_a_narrow_grid():
    window = masks.sliding_window(left=100)
    _, chunks, width, sb, sh = mosaic._schedule(_cfg(1024, window), window, 128, 128,
                                                transpose=False)
    assert width == 2 and not sb and not sh and len(chunks) == 1
    (chunk,) = chunks
    assert (chunk.r0, chunk.n) == (0, 8)
    np.testing.assert_array_equal(np.asarray(chunk.count), [1] + [2] * 7)
    # codes pack (kv-block << 2 | class); row 3 visits blocks 2 (PARTIAL) and 3 (PARTIAL)
    np.testing.assert_array_equal(np.asarray(chunk.code).reshape(8, 2)[3],
                                  [2 * 4 + 1, 3 * 4 + 1])
    causal = masks.causal()
    _, (chunk,), width, *_ = mosaic._schedule(_cfg(1024, causal), causal, 128, 128,
                                              transpose=True)
    assert width == 8
    np.testing.assert_array_equal(np.asarray(chunk.count), [8, 7, 6, 5, 4, 3, 2, 1])
    # kv-block 0 is seen by q-blocks 0 (PARTIAL), 1.. (FULL)
    np.testing.assert_array_equal(np.asarray(chunk.code).reshape(8, 8)[0, :3],
                                  [1, 1 * 4 + 2, 2 * 4 + 2])


def test_schedules_too_large_to_embed_are_built_in_xla(monkeypatch):
    """Past blocks.EMBEDDED_TILES an array-free mask's packed schedule is built
    in XLA, as narrow as the static one (its width from the static classes) and
    with the same codes; the kernels give the same bits, forward and backward."""
    cases = [(masks.sliding_window(left=100), False), (masks.causal(), True),
             (masks.causal() & masks.chunked(300), False)]
    static = [mosaic._schedule(_cfg(1024, m), m, 128, 128, transpose=t) for m, t in cases]
    spec, q, k, v, d_out, d_lse = make(CASES[0], seed=3)   # causal, GQA, ragged
    run = jax.jit(outputs_and_grads, static_argnums=0)
    embedded = run(lambda *a: flash(*a), spec, q, k, v, d_out, d_lse)
    monkeypatch.setattr(blocks, "EMBEDDED_TILES", 0)
    jax.clear_caches()
    for (m, t), (classes, chunks, width, sb, sh) in zip(cases, static):
        facts = {}

        def built(m=m, t=t, facts=facts):
            c, ch, facts["width"], facts["sb"], facts["sh"] = mosaic._schedule(
                _cfg(1024, m), m, 128, 128, transpose=t)
            facts["rows"] = [(x.r0, x.n) for x in ch]
            return c, [(x.code, x.count) for x in ch]

        got_classes, got = jax.jit(built)()
        assert (facts["width"], facts["sb"], facts["sh"]) == (width, sb, sh)
        assert facts["rows"] == [(x.r0, x.n) for x in chunks]
        np.testing.assert_array_equal(np.asarray(got_classes), classes)
        for (code, count), x in zip(got, chunks):
            np.testing.assert_array_equal(np.asarray(code), x.code)
            np.testing.assert_array_equal(np.asarray(count), x.count)
    widths = []
    real = mosaic._static_width
    monkeypatch.setattr(mosaic, "_static_width", lambda *a: widths.append(a) or real(*a))
    built = run(lambda *a: flash(*a), spec, q, k, v, d_out, d_lse)
    assert len(widths) == 3   # the forward's, dq's and dk/dv's schedules
    for a, b in zip(jax.tree_util.tree_leaves(embedded), jax.tree_util.tree_leaves(built)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_block_sizes_validation_and_defaults():
    with pytest.raises(ValueError, match="MosaicBlockSizes: block_k_dq must be a positive "
                                         "multiple of 128; got 64"):
        MosaicBlockSizes(block_k_dq=64)
    with pytest.raises(ValueError, match="block_q must be a positive multiple of 128; got 0"):
        MosaicBlockSizes(block_q=0)
    d = Dims(1, 4096, 4096, 8, 8, 128, 128)
    assert MosaicBlockSizes.default(d, jnp.bfloat16) == MosaicBlockSizes()
    wide = MosaicBlockSizes.default(d._replace(head_dim=256, v_head_dim=256), jnp.bfloat16)
    assert wide.block_q == 256 and wide.block_k_dkv == 256
    picked = blocks.pick((XlaBlockSizes(32, 32), B128), MosaicBlockSizes, None)
    assert picked is B128


# ----------------------------------------------------------------------------------
# Schedules larger than one kernel call's SMEM share: cut into several calls
# ----------------------------------------------------------------------------------


def _segment_ids(B, T, seed=0):
    rs = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rs.integers(0, 4, (B, T)), axis=1), jnp.int32)


def test_long_schedule_is_cut_into_row_chunks(monkeypatch):
    T, B = 1024, 3
    ids = _segment_ids(B, T)
    mask = masks.causal() & masks.segments(ids)
    cfg = _cfg(T, mask, B=B)
    whole = mosaic._schedule(cfg, mask, 128, 128, transpose=False)
    monkeypatch.setattr(mosaic, "SCHEDULE_WORDS", 3 * (8 + 1) * 3)  # three row-blocks a call
    classes, chunks, width, sb, sh = mosaic._schedule(cfg, mask, 128, 128, transpose=False)
    assert (width, sb, sh) == (8, True, False)
    assert [(c.r0, c.n) for c in chunks] == [(0, 3), (3, 3), (6, 2)]
    np.testing.assert_array_equal(classes, whole[0])
    # The chunks hold the rows of the whole schedule, each batch row's in order.
    (full,) = whole[1]
    code = np.concatenate([np.asarray(c.code).reshape(B, 1, c.n, width) for c in chunks], 2)
    count = np.concatenate([np.asarray(c.count).reshape(B, 1, c.n) for c in chunks], 2)
    np.testing.assert_array_equal(code.reshape(-1), full.code)
    np.testing.assert_array_equal(count.reshape(-1), full.count)


def test_schedule_variants_are_merged_when_one_row_does_not_fit(monkeypatch):
    T, B = 512, 4
    ids = _segment_ids(B, T)
    mask = masks.segments(ids)
    monkeypatch.setattr(mosaic, "SCHEDULE_WORDS", 2 * (4 + 1))  # less than B rows
    classes, chunks, width, sb, sh = mosaic._schedule(_cfg(T, mask, B=B), mask, 128, 128,
                                                      transpose=False)
    assert classes.shape == (1, 1, 4, 4) and not sb and not sh
    assert [(c.r0, c.n) for c in chunks] == [(0, 2), (2, 2)]
    per_example = np.asarray(masks.block_classes(mask, B, 1, T, T, 128, 128))
    merged = np.where((per_example == masks.EMPTY).all(0), masks.EMPTY,
                      np.where((per_example == masks.FULL).all(0), masks.FULL, masks.PARTIAL))
    np.testing.assert_array_equal(np.asarray(classes)[0], merged)
    monkeypatch.setattr(mosaic, "SCHEDULE_WORDS", 4)  # not even one merged row
    with pytest.raises(NotImplementedError, match=r"flash-mosaic: one row of the block-sparse "
                       r"schedule needs 5 int32 words of SMEM, more than the 4 .*impl='xla'"):
        mosaic._schedule(_cfg(T, mask, B=B), mask, 128, 128, transpose=False)


# (case, SCHEDULE_WORDS): small enough that every kernel runs as several calls,
# and, where one row of the per-example schedule does not fit, on merged schedules.
CHUNKED = [
    (CASES[8], 6),   # everything; dq/dk-dv blocks differ: chunks and merges
    (CASES[4], 6),   # per-example lengths, sinks, dbias from the dq kernel ("row")
    (CASES[3], 6),   # fully masked rows, dbias from the dk/dv kernel
    (CASES[0], 4),   # array-free causal: the static schedule, chunked
]


@pytest.mark.parametrize("case,words", CHUNKED, ids=lambda p: getattr(p, "name", str(p)))
def test_chunked_schedule_matches_reference(case, words, monkeypatch):
    monkeypatch.setattr(mosaic, "SCHEDULE_WORDS", words)
    spec, q, k, v, d_out, d_lse = make(case, seed=5)
    attn = lambda s, q, k, v: flash(s, q, k, v)  # noqa: E731  (a fresh trace)
    out, lse, grads = jax.jit(outputs_and_grads, static_argnums=0)(
        attn, spec, q, k, v, d_out, d_lse)
    r_out, r_lse, r_grads = jax.jit(outputs_and_grads, static_argnums=0)(
        fnattn.reference, spec, q, k, v, d_out, d_lse)
    _close("out", out, r_out, 2e-5)
    _close("lse", jnp.where(jnp.isfinite(lse), lse, 0), jnp.where(jnp.isfinite(r_lse), r_lse, 0),
           2e-5)
    for name, g, r in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, r_grads):
        if r is not None:
            _close(name, g, r, 1e-4)


def test_long_document_masked_batch_traces_on_every_platform():
    """B=4, T=128k with segment ids needs more SMEM than one call may take. Every
    branch of the dispatch is traced on every platform, so the Mosaic kernels
    must accept it (in several calls) for the flash API to work anywhere."""
    B, T = 4, 131072
    q = jax.ShapeDtypeStruct((B, T, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def run(q, ids, table=None):
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids))
        if table is None:
            return fnattn.flash(spec, q, q, q).out
        return flash(spec, q, q, q, table=table).out

    assert jax.eval_shape(jax.jit(run), q, ids).shape == (B, T, 2, 128)
    text = jax.jit(functools.partial(run, table=ON_TPU)).trace(q, ids).lower(
        lowering_platforms=("tpu",)).as_text()
    # 256 q-blocks of 512, 4 x 257 words a row: 127 rows a call
    assert len(re.findall(r"fnattn_flash_mosaic_fwd", text)) == 3


# ----------------------------------------------------------------------------------
# Lowering for TPU (Mosaic) on CPU: block-shape rules and primitive coverage
# ----------------------------------------------------------------------------------

LOWER_CASES = [
    # (dtype, D, Dv, Hq, Hkv, mask, bias shape, softcap, sinks, dropout, T)
    ("bfloat16", 128, 128, 8, 2, "causal", None, None, False, 0.0, 1024),
    ("bfloat16", 64, 64, 4, 4, "causal_segments", (1, "H", "Q", "K"), 30.0, True, 0.1, 1000),
    ("float32", 256, 256, 4, 1, "window", ("B", 1, 1, "K"), None, True, 0.0, 777),
    ("float16", 64, 128, 4, 2, "lengths", (1, "H", "Q", 1), None, False, 0.0, 640),
    ("bfloat16", 128, 64, 2, 1, "prefix_not_array", ("B", "H", 1, 1), None, False, 0.2, 384),
    ("float32", 128, 128, 2, 2, "fn_algebra", ("Q", "K"), 50.0, False, 0.0, 512),
    ("bfloat16", 80, 80, 2, 2, "none", None, None, False, 0.0, 200),
]


@pytest.mark.parametrize("params", LOWER_CASES, ids=lambda p: f"{p[0]}-D{p[1]}-{p[5]}")
def test_lowers_for_tpu(params):
    dtype, D, Dv, Hq, Hkv, mask, bias, softcap, sinks, rate, T = params
    case = Case("lower", B=2, Tq=T, Tk=T, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv, mask=mask, bias=bias,
                softcap=softcap, sinks=sinks, dropout=rate, dtype=dtype, blocks=None)
    spec, q, k, v, d_out, d_lse = make(case)
    attn = lambda s, q, k, v: flash(s, q, k, v, table=ON_TPU)  # noqa: E731
    fwd = jax.jit(lambda s, q, k, v: attn(s, q, k, v).out)
    both = jax.jit(outputs_and_grads, static_argnums=0)
    with tpu_target():
        text = fwd.trace(spec, q, k, v).lower(lowering_platforms=("tpu",)).as_text()
        assert re.findall(r'kernel_name = "(\w+)"', text) == ["fnattn_flash_mosaic_fwd"]
        text = both.trace(attn, spec, q, k, v, d_out, d_lse).lower(
            lowering_platforms=("tpu",)).as_text()
    names = set(re.findall(r'kernel_name = "(\w+)"', text))
    assert names == {"fnattn_flash_mosaic_fwd", "fnattn_flash_mosaic_dq",
                     "fnattn_flash_mosaic_dkv"}
    if isinstance(tpu_target(), contextlib.nullcontext):
        return
    # v5e has 128 MiB of VMEM: the kernels ask for 96 MiB of scoped VMEM
    assert len(re.findall(r"scoped_memory_configs.{0,60}size.{0,10}: 100663296", text)) == 3


# ----------------------------------------------------------------------------------
# Extreme inputs (issue 9): huge logits on whole rows, infinite sinks, non-finite
# K/V in masked keys, x64. One compiled call each, reused across the values.
# ----------------------------------------------------------------------------------

_grads = jax.jit(outputs_and_grads, static_argnums=0)


def _vjp(attn, spec, q, k, v, d_out, d_lse):
    """(out, lse) and the pullback of the cotangents (d_out, d_lse) as given (the
    cotangent of an infinite lse too) w.r.t. q, k, v, bias, sinks."""
    def f(q, k, v, bias, sinks):
        res = attn(spec.replace(bias=bias, sinks=sinks), q, k, v)
        return res.out, res.lse

    (out, lse), pull = jax.vjp(f, q, k, v, spec.bias, spec.sinks)
    return out, lse, pull((d_out.astype(out.dtype), d_lse))


_vjp_jit = jax.jit(_vjp, static_argnums=0)


def _check_all(got, want, tol=2e-5, gtol=1e-4):
    out, lse, grads = got
    r_out, r_lse, r_grads = want
    _close("out", out, r_out, tol)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(r_lse))
    _close("lse", jnp.where(jnp.isfinite(lse), lse, 0), jnp.where(jnp.isfinite(r_lse), r_lse, 0),
           tol)
    for name, g, r in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, r_grads):
        if r is not None:
            _close(name, g, r, gtol)


def test_extreme_bias_rows_match_reference():
    """A bias of -1e30, finfo.min or -1e9 on whole rows (the additive padding
    mask): the rows' lse absorbs log(l), which the backward restores from
    lse_lo; without it their gradients were up to Tk times too large. Rows in
    both q-blocks, on FULL and PARTIAL tiles (causal, ragged ends)."""
    case = Case("extreme_rows", B=1, Tq=130, Tk=250, Hq=2, Hkv=1, mask="causal",
                bias=(1, "H", "Q", "K"))
    spec, q, k, v, d_out, d_lse = make(case, seed=1)
    rows = np.zeros((1, 2, case.Tq, 1), bool)
    rows[:, 0, 2:5] = True
    rows[:, 1, 100:] = True
    for val in (-1e30, float(np.finfo(np.float32).min), -1e9):
        s = spec.replace(bias=jnp.where(rows, jnp.float32(val), spec.bias))
        got = _grads(flash, s, q, k, v, d_out, d_lse)
        want = _grads(fnattn.reference, s, q, k, v, d_out, d_lse)
        assert np.all(np.abs(np.asarray(got[1])[rows[..., 0]]) >= 1e8), val
        _check_all(got, want)


def test_infinite_sinks_with_fully_masked_rows():
    """A sink of -inf is no sink (a fully masked row gives out 0 and lse -inf);
    +inf takes all the mass: out 0, lse +inf, no gradient from its rows but
    d(sink) = the sum of their d_lse. Heads: sinks -inf, +inf, finite."""
    case = Case("inf_sinks", B=1, Tq=130, Tk=250, Hq=3, Hkv=1, mask="lengths",
                bias=(1, "H", "Q", "K"), sinks=True)
    spec, q, k, v, d_out, d_lse = make(case, seed=2)  # rows 60.. see no key
    dead = np.arange(case.Tq) >= 60
    d_lse = d_lse.at[:, 0, dead].set(0.0)  # lse -inf there
    sinks = jnp.array([-np.inf, np.inf, spec.sinks[2]], F32)
    out, lse, grads = _vjp_jit(flash, spec.replace(sinks=sinks), q, k, v, d_out, d_lse)
    # The reference without head 1's sink and cotangents: the other heads' answer.
    r_out, r_lse, r_grads = _vjp_jit(
        fnattn.reference, spec.replace(sinks=sinks.at[1].set(-np.inf)), q, k, v,
        d_out.at[:, :, 1].set(0.0), d_lse.at[:, 1].set(0.0))
    names = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")
    for name, x in zip(names, (out, lse, *grads)):
        assert not np.isnan(np.asarray(x)).any(), name
    assert np.all(np.asarray(out[:, :, 1]) == 0.0)
    assert np.all(np.asarray(lse[:, 1]) == np.inf)
    assert np.all(np.asarray(out[:, dead]) == 0.0)
    assert np.all(np.asarray(lse[:, 0, dead]) == -np.inf)
    heads = np.array([0, 2])
    _close("out", out[:, :, heads], r_out[:, :, heads], 2e-5)
    lse_h, r_lse_h = np.asarray(lse[:, heads]), np.asarray(r_lse[:, heads])
    np.testing.assert_array_equal(np.isfinite(lse_h), np.isfinite(r_lse_h))
    fin = np.isfinite(r_lse_h)
    _close("lse", np.where(fin, lse_h, 0), np.where(fin, r_lse_h, 0), 2e-5)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, r_grads):
        _close(name, g, r, 1e-4)
    dsinks = np.asarray(grads[4])
    assert dsinks[0] == 0.0
    np.testing.assert_allclose(dsinks[1], float(d_lse[:, 1].sum()), rtol=1e-5)
    np.testing.assert_allclose(dsinks[2], float(r_grads[4][2]), rtol=1e-4, atol=1e-5)
    # The reference defines infinite sinks the same way.
    ref = _vjp_jit(fnattn.reference, spec.replace(sinks=sinks), q, k, v, d_out, d_lse)
    _check_all((out, lse, grads), ref)


def test_masked_keys_with_non_finite_kv_contribute_nothing():
    """NaN and inf in the K/V of keys a row may not see (past kv_lengths, on
    PARTIAL and EMPTY tiles) change nothing, forward or backward; a row that
    does see a NaN value gets NaN."""
    case = Case("poison", B=2, Tq=250, Tk=250, Hq=2, Hkv=1, bias=("B", 1, 1, "K"))
    spec, q, k, v, d_out, d_lse = make(case, seed=3)
    spec = spec.replace(mask=masks.causal() & masks.lengths(kv_lengths=jnp.array([100, 200])))
    kp, vp = np.array(k), np.array(v)
    kp[0, 100:], vp[0, 110:] = np.nan, np.inf
    kp[1, 200:], vp[1, 220:240, :, 3] = -np.inf, np.nan
    got = _grads(flash, spec, q, jnp.asarray(kp), jnp.asarray(vp), d_out, d_lse)
    want = _grads(fnattn.reference, spec, q, k, v, d_out, d_lse)
    _check_all(got, want)
    _check_all(got, _grads(fnattn.reference, spec, q, jnp.asarray(kp), jnp.asarray(vp), d_out,
                           d_lse))
    # Key 150 of batch row 1 is visible to its rows 150.. only (causal).
    vp[1, 150, 0, 0] = np.nan
    out, lse, _ = _grads(flash, spec, q, jnp.asarray(kp), jnp.asarray(vp), d_out, d_lse)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[1, 150:]).all() and np.isnan(lse[1, :, 150:]).all()
    r_out, r_lse, _ = _grads(fnattn.reference, spec, q, jnp.asarray(kp), jnp.asarray(vp), d_out,
                             d_lse)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(np.asarray(r_out)))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(np.asarray(r_lse)))
    _close("out clean rows", out[1, :150], want[0][1, :150], 2e-5)
    _close("out batch 0", out[0], want[0][0], 2e-5)


def test_x64_traces_runs_and_lowers_for_tpu():
    """Under jax_enable_x64 Python ints and user arrays (here the lengths) are
    64-bit: the schedule, index maps and kernels pin int32. The public API
    traces, the interpret kernels give the reference's answer, and the kernels
    lower for TPU."""
    small = Case("x64", B=1, Tq=130, Tk=130, Hq=2, Hkv=1, D=8, Dv=8, mask="lengths",
                 bias=(1, "H", "Q", "K"), sinks=True, dropout=0.2)
    big = Case("x64_tpu", B=2, Tq=640, Tk=640, Hq=4, Hkv=2, D=64, Dv=64, mask="lengths",
               bias=(1, "H", "Q", "K"), sinks=True, dropout=0.1, dtype="bfloat16", blocks=None)
    want = _grads(fnattn.reference, *make(small))
    with jax.enable_x64(True):
        spec, q, k, v, d_out, d_lse = make(small)
        assert jnp.asarray(spec.mask.operands()[0]).dtype == jnp.int64  # x64 is on
        for impl in ("pallas",):  # "auto" also traces the flash XLA lowering
            s = spec.replace(impl=impl)
            shapes = jax.eval_shape(jax.jit(lambda q: jax.grad(
                lambda q: fnattn.attention(s, q, k, v).out.sum())(q)), q)
            assert shapes.shape == q.shape and shapes.dtype == q.dtype
        got = jax.jit(outputs_and_grads, static_argnums=0)(flash, spec, q, k, v, d_out, d_lse)
        assert got[0].dtype == F32 and got[1].dtype == F32
        spec, q, k, v, d_out, d_lse = make(big)
        attn = lambda s, q, k, v: flash(s, q, k, v, table=ON_TPU)  # noqa: E731
        with tpu_target():
            text = jax.jit(outputs_and_grads, static_argnums=0).trace(
                attn, spec, q, k, v, d_out, d_lse).lower(lowering_platforms=("tpu",)).as_text()
    assert set(re.findall(r'kernel_name = "(\w+)"', text)) == {
        "fnattn_flash_mosaic_fwd", "fnattn_flash_mosaic_dq", "fnattn_flash_mosaic_dkv"}
    _check_all(got, want)
