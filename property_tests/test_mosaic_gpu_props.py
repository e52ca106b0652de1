"""Fuzzed problems on the Mosaic GPU kernels (fnattn/flash/mosaic_gpu.py forward,
fnattn/flash/mosaic_gpu_bwd.py backward), run by JAX's Mosaic GPU interpreter on CPU.

Random masks of every kind those kernels read (causal, windows, chunks, segment ids,
lengths, prefix-LM, ``from_fn`` and their ``&``, ``|``, ``~``), GQA ratios, query and
key lengths that are not multiples of the 64-row tiles, head dims the kernels
pad to 64 (a value head dim unlike the query's among them), float16 and bfloat16,
soft-cap, sinks (-inf, +inf or ordinary), dropout, an ALiBi or ``from_fn``
term (its arrays fixed), one program per q-tile or
persistent programs, and NaN / inf in the K and V of keys no row may see. Out, lse
and every gradient must be those of the float32 reference on the same (rounded)
inputs, with no NaN; rows that see nothing give 0 and lse -inf.

The decode kernels (fnattn/decoding/mosaic_gpu.py and its paged producer,
fnattn/paged/mosaic_gpu.py): ragged lengths and starts, 1 to 3 query tokens,
GQA, positional masks that cut key blocks, splits, soft-cap, sinks of every
kind, ALiBi (decode), shuffled pages of 8 to 64 keys, ragged batches, and large, NaN or inf
values in every slot no sequence owns, against the float64 dense problems.
"""

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import fnattn
from fnattn import AttentionSpec, core, masks, position_bias
from fnattn.flash.mosaic_gpu import MosaicGpuBlockSizes
from mosaic_gpu_interpreter import compile_once, flash_table, reset_after_failure
from strategies import (MASK_KINDS, examples, extreme_sinks, gqa_heads, mask_trees,
                        poison_hidden_keys, ragged_lengths)
from test_reliability import _assert_same, _run

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "paged"))
import problems as paged  # noqa: E402  (tests/paged/problems.py)

F32 = jnp.float32
# The smallest tiles: 128 query rows a forward program, 64 a backward step, 128
# keys a backward program.
SMALL = MosaicGpuBlockSizes(block_q=64, block_k=64, max_concurrent_steps=2)
# Every kind but dense arrays along queries and keys, which the kernels refuse.
KINDS = tuple(kind for kind in MASK_KINDS if kind != "array")


@functools.cache
def _table():
    return flash_table("flash-mosaic-gpu-fuzz-interpret")


def _kernels(spec, q, k, v):
    return core.run(spec, q, k, v, fn="flash", table=_table())


def _decay(b, h, q, k, r):
    return -r * jnp.log(1.0 + jnp.abs(q - k).astype(F32)) + jnp.where(h == 0, 0.5, 0.0)


@st.composite
def problems(draw, head_dims=((64, 64), (40, 64), (64, 24))):
    """``(spec, q, k, v, d_out, d_lse)`` of a drawn problem whose head dims
    ``(D, Dv)`` are one of ``head_dims``: by default pairs the kernels compute at
    64 (zero columns pad 40 and 24 there), since the interpreter slows down
    with wider heads, whose own paths (dQ in two halves at 128, the column
    split above) have tests of their own in tests/flash/."""
    hq, hkv = draw(gqa_heads(max_kv=2, max_group=2))
    B = draw(st.integers(1, 2))
    Tq, Tk = draw(st.integers(1, 200)), draw(st.integers(1, 200))
    dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float16]))
    rs = np.random.default_rng(draw(st.integers(0, 2**16)))

    def normal(*shape, dtype=dtype):  # values the kernel's dtype holds exactly
        return jnp.asarray(rs.standard_normal(shape), F32).astype(dtype)

    D, Dv = draw(st.sampled_from(head_dims))
    q, k, v = normal(B, Tq, hq, D), normal(B, Tk, hkv, D), normal(B, Tk, hkv, Dv)
    mask = draw(st.one_of(st.none(), mask_trees(B, Tq, Tk, H=hq, kinds=KINDS)))
    if mask is not None:
        k, v = poison_hidden_keys(k, v, masks.materialize(mask, B, hq, Tq, Tk))
    rate = draw(st.sampled_from([0.0, 0.0, 0.3]))
    term = None  # a position term, its arrays held fixed
    kind = draw(st.sampled_from([None, None, "alibi", "from_fn"]))
    if kind == "alibi":
        term = position_bias.alibi(jnp.asarray(rs.uniform(-0.5, 2.0, hq), F32))
    elif kind == "from_fn":  # per (batch row, head) rates, in operations Mosaic GPU compiles
        term = position_bias.from_fn(_decay, jnp.asarray(rs.uniform(0.0, 2.0, (B, hq)), F32))
    spec = AttentionSpec(mask=mask, softcap=draw(st.sampled_from([None, 20.0])),
                         position_bias=term,
                         sinks=draw(extreme_sinks(hq)) if draw(st.booleans()) else None,
                         dropout_rate=rate, dropout_key=jax.random.key(rs.integers(99)) if rate
                         else None, return_lse=True,
                         block_sizes=dataclasses.replace(SMALL, persistent=draw(st.booleans())))
    do = normal(B, Tq, hq, Dv).astype(F32)
    dl = jnp.asarray(rs.standard_normal((B, hq, Tq)), F32)
    return spec, q, k, v, do, dl


@examples(4)
@given(problems())
def test_mosaic_gpu_kernels_match_the_reference(problem):
    spec, q, k, v, do, dl = problem
    want = _run(fnattn.reference, spec, *(x.astype(F32) for x in (q, k, v)), do, dl)
    try:
        with compile_once():
            got = _run(_kernels, spec, q, k, v, do, dl)
    except Exception:
        reset_after_failure()
        raise
    names = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")
    for name, a, b in zip(names, (*got[:2], *got[2]), (*want[:2], *want[2])):
        assert (a is None) == (b is None), name
        if a is not None:  # (no bias: its gradient is None)
            _assert_same(name, a, b, 3e-2)


# ----------------------------------------------------------------------------------
# decode and paged decode (fnattn/decoding/mosaic_gpu.py, fnattn/paged/mosaic_gpu.py)
# ----------------------------------------------------------------------------------

DECODE_S = 128   # cache slots: two key blocks of 64


@st.composite
def decode_problems(draw):
    """``(spec, q, k, v, lengths, starts, slopes)``: ragged lengths (0 and the
    whole cache likely) and starts, 1 to 3 query tokens, GQA, a positional mask
    whose window or chunk may cut a block, splits, soft-cap, sinks of every
    kind, ALiBi (its slopes, or None), and large, NaN or inf values in every
    slot outside a sequence's range."""
    hq, hkv = draw(gqa_heads(max_kv=2, max_group=4))
    B, Tq = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float16]))
    rs = np.random.default_rng(draw(st.integers(0, 2**16)))
    lengths = np.asarray(draw(ragged_lengths(B, DECODE_S)))
    starts = np.array([rs.integers(0, DECODE_S - L + 1) for L in lengths], np.int32)
    garbage = {"large": 3e4, "nan": np.nan, "inf": np.inf}[
        draw(st.sampled_from(["large", "nan", "inf"]))]
    slot = np.arange(DECODE_S)[None, :, None, None]
    live = (slot >= starts[:, None, None, None]) & (slot < (starts + lengths)[:, None, None, None])
    k = np.where(live, rs.standard_normal((B, DECODE_S, hkv, 64)), garbage)
    v = np.where(live, rs.standard_normal((B, DECODE_S, hkv, 64)), garbage)
    q = rs.standard_normal((B, Tq, hq, 64))
    mask = draw(st.sampled_from([
        None, masks.causal(), masks.causal() & masks.sliding_window(int(rs.integers(0, 80))),
        masks.chunked(int(rs.integers(1, 70))) & masks.causal()]))
    slopes = (np.asarray(rs.uniform(0.05, 1.0, hq), np.float32) if draw(st.booleans())
              else None)
    spec = AttentionSpec(mask=mask, softcap=draw(st.sampled_from([None, 5.0])),
                         sinks=draw(extreme_sinks(hq)) if draw(st.booleans()) else None,
                         position_bias=None if slopes is None
                         else position_bias.alibi(jnp.asarray(slopes)),
                         block_sizes=fnattn.DecodeBlockSizes(
                             # (decode takes split counts that divide S)
                             num_splits=draw(st.sampled_from([None, 1, 2, 4]))))
    cast = lambda x: jnp.asarray(x, F32).astype(dtype)  # noqa: E731
    return (spec, cast(q), cast(k), cast(v), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(starts), slopes)


def _interpreted_decode(spec, q, k, v, lengths, starts):
    from fnattn.decoding import api
    from fnattn.decoding import mosaic_gpu as dm
    from fnattn.flash import mosaic_gpu as flash_mgpu
    term = spec.position_bias
    cfg = api.Cfg(scale=q.shape[-1] ** -0.5, softcap=spec.softcap,
                  mask_treedef=None if spec.mask is None
                  else jax.tree_util.tree_structure(spec.mask),
                  num_splits=spec.block_sizes.num_splits, block_sizes=spec.block_sizes,
                  term_treedef=None if term is None else jax.tree_util.tree_structure(term))
    terms = None if term is None else position_bias.per_head_arrays(term, q.shape[0], q.shape[2])
    f = jax.jit(functools.partial(dm.forward, cfg, interpret=flash_mgpu.interpret_params()))
    try:
        with compile_once():
            return f(q, k, v, starts, lengths, spec.sinks, terms)
    except Exception:
        reset_after_failure()
        raise


@examples(4)
@given(decode_problems())
def test_mosaic_gpu_decode_matches_the_reference(problem):
    """The decode kernel (or, where a slot it reads holds NaN or inf, the XLA
    pass it falls back to) against the float64 dense problem of every sequence
    on the same rounded inputs; no NaN, 0 and -inf where nothing is seen."""
    from test_decoding import expected
    spec, q, k, v, lengths, starts, slopes = problem
    out, lse = _interpreted_decode(spec, q, k, v, lengths, starts)
    want_out, want_lse = expected(spec, q, k, v, np.asarray(lengths), np.asarray(starts),
                                  alibi_slopes=slopes)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(want_lse))
    np.testing.assert_allclose(out, want_out, atol=3e-2, rtol=3e-2)
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], atol=3e-2, rtol=3e-2)


@examples(4)
@given(st.integers(0, 2**16), st.sampled_from([8, 16, 64]),
       st.sampled_from([1, 2, "ragged", "update"]),
       st.sampled_from([None, masks.causal(), masks.causal() & masks.sliding_window(40)]),
       st.sampled_from([None, 2]), st.booleans())
def test_mosaic_gpu_paged_matches_the_reference(seed, page_size, queries, mask, splits,
                                                poison):
    """paged_attention (1 or 2 query tokens a sequence), ragged batches
    (prefill, chunked prefill, decode and idle sequences, padding tokens) and
    the form that writes the new tokens first, on the Mosaic GPU kernel:
    shuffled pages of 8 to 64 keys, junk page-table entries past each
    sequence, huge garbage (or NaN) in the pool slots no live token holds."""
    from fnattn.flash import mosaic_gpu as flash_mgpu
    from fnattn.paged import api
    from fnattn.paged import mosaic_gpu as pm
    rs = np.random.default_rng(seed)
    lengths = [int(x) for x in rs.integers(0, 129, 3)]
    ragged = queries in ("ragged", "update")
    if ragged:
        seqs = [(L, int(rs.integers(0, min(L, 40) + 1))) for L in lengths]
    else:
        seqs = [(L, queries) for L in lengths]
    p = paged.make(seqs, Hq=4, Hkv=2, D=64, page_size=page_size,
                   pages_per_seq=128 // page_size, dtype=jnp.bfloat16, seed=seed,
                   max_seqs=4 if ragged else None, pad_tokens=2 if ragged else 0)
    if poison:
        p = paged.poisoned(p, old=queries == "update")
    spec = AttentionSpec(mask=mask, block_sizes=fnattn.PagedBlockSizes(num_splits=splits))
    table = (("default", functools.partial(pm.forward,
                                            interpret=flash_mgpu.interpret_params())),)
    try:
        with compile_once():
            if queries == "update":
                res, kp, vp = paged.update(table, spec, p)
                out, lse = res.out, res.lse
                # (as float32: NumPy matches NaN with NaN there, not in bfloat16)
                for got, want in ((kp, p.k_pages), (vp, p.v_pages)):
                    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                                  np.asarray(want, np.float32))
            elif queries == "ragged":
                res = paged.ragged(table, spec, p)
                out, lse = res.out, res.lse
            else:
                res = jax.jit(lambda q, kp, vp: api.paged_attention_with(
                    table, spec, q, kp, vp, page_table=p.page_table,
                    kv_lengths=p.context_lengths))(p.q.reshape(3, queries, 4, 64), p.k_pages,
                                                   p.v_pages)
                T = 3 * queries
                out = res.out.reshape(T, 4, 64)
                lse = res.lse.transpose(1, 0, 2).reshape(4, T)
    except Exception:
        reset_after_failure()
        raise
    paged.assert_close(out, lse, *paged.expected(spec, p), 3e-2)
