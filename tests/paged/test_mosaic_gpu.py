"""The Pallas Mosaic GPU lowering of paged_attention (fnattn/paged/mosaic_gpu.py).

* the kernel in JAX's Mosaic GPU interpreter on CPU against the dense
  problems in float64 NumPy (tests/paged/problems.py: pools full of huge
  garbage, junk page-table entries past each sequence): pages smaller than a
  block (several copies per block), equal to it and larger, masks, one and
  two query tokens, ragged batches, the form that writes the new tokens,
  splits, sinks, soft-cap, empty sequences; with the XLA pass replaced by
  NaN, so that these results are the kernel's own;
* NaN in every unowned slot, and invalid page-table entries: the XLA
  lowering's result;
* lowering for "cuda" on CPU (a Hopper GPU stood in for): one Mosaic GPU
  kernel and no Triton one; which kernel each call picks; refusals.
"""

import dataclasses
import os
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import fnattn  # noqa: E402
from fnattn import AttentionSpec, MosaicGpuDecodeBlockSizes, PagedBlockSizes, masks  # noqa: E402
from fnattn.flash import mosaic_gpu as flash_mgpu  # noqa: E402
from fnattn.paged import api, xla  # noqa: E402
from fnattn.paged import mosaic_gpu as pm  # noqa: E402
from lowering import gpu_target  # noqa: E402
from mosaic_gpu_interpreter import compile_once, reset_after_failure  # noqa: E402
from problems import (assert_close, check_ragged, check_update, expected, make,  # noqa: E402
                      poisoned, ragged, update)

pytest.importorskip("absl")   # (Mosaic GPU imports it)

Hq, Hkv, D = 4, 2, 64


@pytest.fixture(scope="module", autouse=True)
def _fast_interpreter():
    with compile_once():
        yield


def _interpreted(*args):
    try:
        return pm.forward(*args, interpret=flash_mgpu.interpret_params())
    except Exception:
        reset_after_failure()
        raise


INTERPRET = (("default", _interpreted),)


@pytest.fixture
def no_xla_pass(monkeypatch):
    """The XLA pass that recomputes a poisoned call replaced by NaN: a result
    that matches came from the kernel."""
    def nan_forward(*args):
        out, lse = xla.forward(*args)
        return jnp.full_like(out, jnp.nan), jnp.full_like(lse, jnp.nan)
    monkeypatch.setattr(pm, "xla", types.SimpleNamespace(forward=nan_forward,
                                                         write_tokens=xla.write_tokens))


def problem(lengths, Tq, *, page_size, pages_per_seq, Dv=D, seed=0):
    return make([(L, Tq) for L in lengths], Hq=Hq, Hkv=Hkv, D=D, Dv=Dv, page_size=page_size,
                pages_per_seq=pages_per_seq, dtype=jnp.bfloat16, seed=seed)


def decode(table, spec, p, Tq):
    q = p.q.reshape(-1, Tq, Hq, D)
    f = jax.jit(lambda spec, q, kp, vp, pt, L: api.paged_attention_with(
        table, spec, q, kp, vp, page_table=pt, kv_lengths=L))
    return f(spec, q, p.k_pages, p.v_pages, p.page_table, p.context_lengths)


def check(spec, p, Tq, tol=2e-2):
    """The interpreted kernel against float64 NumPy, in the packed layout."""
    res = decode(INTERPRET, spec, p, Tq)
    T = p.q.shape[0]
    assert res.out.dtype == p.q.dtype and res.out.shape == (T // Tq, Tq, Hq, D)
    want_out, want_lse = expected(spec, p)
    assert_close(res.out.reshape(T, Hq, -1), res.lse.transpose(1, 0, 2).reshape(Hq, T),
                 want_out, want_lse, tol)


@pytest.mark.parametrize("page_size,pages_per_seq,mask,splits", [
    (16, 8, masks.causal(), None),                                   # 8 pages per block of 128
    (8, 16, masks.causal() & masks.sliding_window(20), 2),           # 16 per block
    (64, 3, masks.chunked(48) & masks.causal(), 3),                  # one page, one block
    (128, 2, None, 1),                                               # half a page per block
])
def test_interpreted_pages_and_masks(no_xla_pass, page_size, pages_per_seq, mask, splits):
    p = problem([100, 37, 0, pages_per_seq * page_size], 1, page_size=page_size,
                pages_per_seq=pages_per_seq, seed=page_size)
    spec = AttentionSpec(mask=mask, block_sizes=PagedBlockSizes(num_splits=splits))
    check(spec, p, 1)


@pytest.mark.parametrize("Tq", [1, 2])
def test_interpreted_sinks_softcap_and_query_tokens(no_xla_pass, Tq):
    p = problem([90, 5, 128], Tq, page_size=16, pages_per_seq=8, seed=3)
    spec = AttentionSpec(mask=masks.causal(), softcap=5.0, sinks=jnp.linspace(-1.0, 2.0, Hq),
                         block_sizes=PagedBlockSizes(num_splits=2))
    check(spec, p, Tq)


def test_interpreted_block_sizes_asked_for(no_xla_pass):
    """MosaicGpuDecodeBlockSizes' block and ring reach the kernel (block_k=64:
    four pages of 16 per block)."""
    p = problem([70, 128], 1, page_size=16, pages_per_seq=8, seed=4)
    spec = AttentionSpec(mask=masks.causal(), block_sizes=(
        MosaicGpuDecodeBlockSizes(block_k=64, max_concurrent_steps=2),
        PagedBlockSizes(num_splits=2)))
    check(spec, p, 1)


@pytest.mark.parametrize("block_q,splits", [(None, 1), (3, 2)])
def test_interpreted_ragged_batches(no_xla_pass, block_q, splits):
    """ragged_paged_attention: prefill, chunked prefill, decode and idle
    sequences, padding tokens and padding sequences, on pages of 16; items of
    the default 32 tokens (64 rows / group 2) or of 3."""
    p = make([(70, 20), (128, 1), (5, 5), (0, 0), (100, 37)], Hq=Hq, Hkv=Hkv, D=D,
             page_size=16, pages_per_seq=8, max_seqs=7, pad_tokens=3, dtype=jnp.bfloat16,
             seed=7)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(50), softcap=5.0,
                         sinks=jnp.linspace(-1.0, 1.0, Hq),
                         block_sizes=PagedBlockSizes(block_q=block_q, num_splits=splits))
    check_ragged(INTERPRET, spec, p, tol=2e-2)


def test_interpreted_update_writes_then_attends(no_xla_pass):
    """ragged_paged_attention_with_update: the pools come back with every new
    token written (those of the Triton kernel's and the XLA lowering's), and
    the result is that of attention over the written pools."""
    p = make([(70, 20), (128, 1), (5, 5), (100, 37)], Hq=Hq, Hkv=Hkv, D=D, page_size=16,
             pages_per_seq=8, max_seqs=5, pad_tokens=2, dtype=jnp.bfloat16, seed=8)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.linspace(-1.0, 1.0, Hq),
                         block_sizes=PagedBlockSizes(num_splits=2))
    check_update(INTERPRET, spec, p, tol=2e-2)


def _term(offset=0.0):
    """ALiBi plus a from_fn term of the sequence, the head, the key and a
    per-head array, offset by ``offset`` on every logit."""
    from fnattn import position_bias
    r = jnp.linspace(-0.5, 1.0, Hq)
    return position_bias.alibi(jnp.asarray(position_bias.alibi_slopes(Hq)) * 0.5) \
        + position_bias.from_fn(
            lambda b, h, q, k, r: jnp.where(k % 3 == h % 2, r, 0.0) * (b + 1) + offset, r)


def _assert_as_xla(got, want, offset=0.0, tol=2e-2):
    np.testing.assert_allclose(np.asarray(got.out, np.float32),
                               np.asarray(want.out, np.float32), atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isneginf(got.lse), np.isneginf(want.lse))
    np.testing.assert_allclose(np.asarray(got.lse) - offset, np.asarray(want.lse) - offset,
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("softcap,offset,forms", [(None, 0.0, 3), (5.0, 0.0, 2), (None, 1e4, 1)])
def test_interpreted_position_terms(no_xla_pass, softcap, offset, forms):
    """A position term at each row's sequence, head and position: the XLA
    lowering's result (tests/test_position_bias.py checks that against the
    reference) in paged_attention (two query tokens, pages of 16), then (the
    first ``forms``) a ragged batch of prefill and decode items, and the form
    that writes the cache."""
    XLA = (("default", xla.forward),)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(60), softcap=softcap,
                         sinks=jnp.linspace(-1.0, 1.0, Hq), position_bias=_term(offset),
                         block_sizes=PagedBlockSizes(num_splits=2))
    p = problem([90, 5, 0, 128], 2, page_size=16, pages_per_seq=8, seed=10)
    _assert_as_xla(decode(INTERPRET, spec, p, 2), decode(XLA, spec, p, 2), offset)
    if forms == 1:
        return
    p = make([(70, 20), (128, 1), (5, 5), (100, 37)], Hq=Hq, Hkv=Hkv, D=D, page_size=16,
             pages_per_seq=8, max_seqs=5, pad_tokens=2, dtype=jnp.bfloat16, seed=11)
    _assert_as_xla(ragged(INTERPRET, spec, p), ragged(XLA, spec, p), offset)
    if forms == 2:
        return
    (got, kp, vp), (want, _, _) = update(INTERPRET, spec, p), update(XLA, spec, p)
    _assert_as_xla(got, want, offset)
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(p.k_pages))
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(p.v_pages))


def test_poisoned_slots_and_invalid_pages_give_the_xla_result():
    """NaN in every pool slot no live token holds (the last block reads some),
    then an invalid entry among a sequence's pages: the XLA lowering's result,
    bit for bit."""
    p = poisoned(problem([100, 37, 128], 1, page_size=16, pages_per_seq=8, seed=5))
    spec = AttentionSpec(mask=masks.causal())
    for pp in (p, dataclasses.replace(p, page_table=p.page_table.at[1, 1].set(-5))):
        got = decode(INTERPRET, spec, pp, 1)
        want = decode((("default", xla.forward),), spec, pp, 1)
        np.testing.assert_array_equal(np.asarray(got.out), np.asarray(want.out))
        np.testing.assert_array_equal(got.lse, want.lse)
    assert np.isfinite(np.asarray(got.out, np.float32)[0]).all()


# ----------------------------------------------------------------------------------
# Refusals and lowering for "cuda" on CPU
# ----------------------------------------------------------------------------------


def cfg_of(**kw):
    base = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, v_head_dim=128, num_pages=64,
                page_size=16, pages_per_seq=8, max_seqs=4, total_tokens=4, scale=0.1,
                softcap=None, mask_treedef=None, has_sinks=False, uniform_q=1, update=False,
                block_sizes=PagedBlockSizes())
    from fnattn.paged.common import Cfg
    return Cfg(**{**base, **kw})


@pytest.mark.parametrize("kw,words", [
    (dict(head_dim=80), "head dim D=80"),
    (dict(uniform_q=9, total_tokens=36, num_q_heads=16), "72 query rows per kv head"),
    (dict(uniform_q=None, block_sizes=PagedBlockSizes(block_q=40)), "block_q=40"),
    (dict(page_size=24, pages_per_seq=8), "pages of 24 keys"),
    (dict(page_size=16, pages_per_seq=5), "a capacity of 80 keys"),
])
def test_supports_refuses_with_reasons(kw, words):
    assert pm.supports(cfg_of(), jnp.bfloat16) == []
    assert pm.supports(cfg_of(uniform_q=None), jnp.bfloat16) == []   # (ragged batches)
    why = pm.supports(cfg_of(**kw), jnp.bfloat16)
    assert len(why) == 1 and words in why[0], why
    assert "float32 pools" in pm.supports(cfg_of(), jnp.float32)[0]


def lowered(spec, *, B=4, Tq=1, ps=16, P=8, N=64, form="decode"):
    q = jax.ShapeDtypeStruct((B, Tq, 8, 128), jnp.bfloat16)
    kp = jax.ShapeDtypeStruct((2, N, ps, 128), jnp.bfloat16)
    pt, L = jax.ShapeDtypeStruct((B, P), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)
    ragged = dict(page_table=pt, context_lengths=L, num_seqs=jnp.int32(B),
                  query_start_loc=jnp.arange(B + 1, dtype=jnp.int32) * Tq)
    if form == "ragged":
        f = jax.jit(lambda q, kp, vp, pt, L: fnattn.ragged_paged_attention(
            spec, q.reshape(B * Tq, 8, 128), kp, vp, **{**ragged, "page_table": pt,
                                                        "context_lengths": L}).out)
    elif form == "update":
        f = jax.jit(lambda q, kp, vp, pt, L: fnattn.ragged_paged_attention_with_update(
            spec, q.reshape(B * Tq, 8, 128), q.reshape(B * Tq, 8, 128)[:, :2],
            q.reshape(B * Tq, 8, 128)[:, :2], kp, vp,
            **{**ragged, "page_table": pt, "context_lengths": L})[0].out)
    else:
        f = jax.jit(lambda q, kp, vp, pt, L: fnattn.paged_attention(
            spec, q, kp, vp, page_table=pt, kv_lengths=L).out)
    with gpu_target():
        return f.trace(q, kp, kp, pt, L).lower(lowering_platforms=("cuda",)).as_text()


def kernels(text):
    return len(re.findall(r"custom_call @mosaic_gpu", text)), "fnattn_paged_triton" in text


@pytest.mark.parametrize("ps,P,bs", [(16, 8, MosaicGpuDecodeBlockSizes()),
                                     (8, 32, MosaicGpuDecodeBlockSizes(block_k=64)),
                                     (256, 2, MosaicGpuDecodeBlockSizes(block_k=128))])
def test_lowers_for_cuda(monkeypatch, ps, P, bs):
    """Pages of 16 (8 copies per block of 128), 8 (8 per block of 64) and 256
    (half a page per block), with a window, soft-cap, sinks and two splits;
    paged_attention and a ragged batch."""
    monkeypatch.setattr(flash_mgpu, "available", lambda: None)
    for impl in ("auto", "pallas"):
        spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(100), softcap=30.0,
                             sinks=jnp.zeros(8), impl=impl,
                             block_sizes=(bs, PagedBlockSizes(num_splits=2)))
        assert kernels(lowered(spec, ps=ps, P=P, N=4 * P)) == (1, False)
        assert kernels(lowered(spec, Tq=3, ps=ps, P=P, N=4 * P, form="ragged")) == (1, False)


def test_lowers_for_cuda_with_a_position_term(monkeypatch):
    """ALiBi and a from_fn term with a per-head array, in paged_attention, a
    ragged batch and the form that writes the cache: one Mosaic GPU kernel."""
    from fnattn import position_bias
    monkeypatch.setattr(flash_mgpu, "available", lambda: None)
    term = position_bias.alibi(jnp.asarray(position_bias.alibi_slopes(8))) \
        + position_bias.from_fn(lambda b, h, q, k, r: jnp.where(k % 3 == h % 2, r, 0.0),
                                jnp.linspace(-0.5, 1.0, 8))
    for softcap in (None, 30.0):
        spec = AttentionSpec(mask=masks.causal(), softcap=softcap, position_bias=term,
                             block_sizes=(MosaicGpuDecodeBlockSizes(),
                                          PagedBlockSizes(num_splits=2)))
        assert kernels(lowered(spec)) == (1, False)
        assert kernels(lowered(spec, Tq=3, form="ragged")) == (1, False)
        assert kernels(lowered(spec, Tq=2, form="update")) == (1, False)
    assert pm.supports(cfg_of(term_treedef=jax.tree_util.tree_structure(term)),
                       jnp.bfloat16) == []


def test_lowering_picks_the_kernel(monkeypatch):
    asked = AttentionSpec(mask=masks.causal(), block_sizes=MosaicGpuDecodeBlockSizes())
    assert kernels(lowered(asked)) == (0, True)                   # (no Hopper here)
    monkeypatch.setattr(flash_mgpu, "available", lambda: None)
    assert kernels(lowered(AttentionSpec(mask=masks.causal()))) == (0, True)
    assert kernels(lowered(asked)) == (1, False)
    assert kernels(lowered(asked, Tq=5, form="ragged")) == (1, False)
    assert kernels(lowered(asked, Tq=2, form="update")) == (1, False)
    with pytest.raises(NotImplementedError, match=r"pages of 24 keys.*Pallas Triton kernel"):
        lowered(asked, ps=24, P=8)


def test_lowers_for_cuda_under_x64(monkeypatch):
    with jax.enable_x64(True):
        test_lowers_for_cuda(monkeypatch, 16, 8, MosaicGpuDecodeBlockSizes())


# ----------------------------------------------------------------------------------
# On an NVIDIA GPU
# ----------------------------------------------------------------------------------

ON_GPU = jax.devices()[0].platform == "gpu"


@pytest.mark.skipif(not ON_GPU or flash_mgpu.available() is not None,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("page_size", [16, 128])
def test_gpu_mosaic_gpu_paged_matches_xla(page_size):
    """The compiled kernel against the XLA lowering: long ragged contexts over
    shuffled pages, a window, soft-cap, sinks, GQA."""
    from benchmark_scripts import benchmark_module
    bench = benchmark_module("paged_problems")
    prob = bench.decode_problem(batch=5, context=4096, num_q_heads=32, num_kv_heads=8,
                                head_dim=128, page_size=page_size, dtype=jnp.bfloat16)
    q, kp, vp, pt, L = prob.args
    L = jnp.array([4096, 3000, 17, 1, 0], jnp.int32)
    for mask, splits in ((masks.causal(), None), (masks.causal() & masks.sliding_window(300), 3)):
        spec = AttentionSpec(mask=mask, sinks=jnp.linspace(-1.0, 1.0, 32), softcap=30.0,
                             block_sizes=(MosaicGpuDecodeBlockSizes(),
                                          PagedBlockSizes(num_splits=splits)))
        f = jax.jit(lambda spec, q, kp, vp: fnattn.paged_attention(
            spec, q, kp, vp, page_table=pt, kv_lengths=L))
        got, want = f(spec, q, kp, vp), f(spec.replace(impl="xla"), q, kp, vp)
        np.testing.assert_allclose(np.asarray(got.out, np.float32),
                                   np.asarray(want.out, np.float32), atol=3e-2, rtol=3e-2)
        np.testing.assert_allclose(got.lse, want.lse, atol=3e-2, rtol=3e-2)



@pytest.mark.skipif(not ON_GPU or flash_mgpu.available() is not None,
                    reason="needs a Hopper GPU")
def test_gpu_mosaic_gpu_ragged_matches_xla():
    """A ragged batch on the compiled kernel against the XLA lowering: a long
    prefill chunk, decodes, a short prefill and an idle sequence, with NaN in
    every unowned pool slot (the XLA pass then), a window and sinks."""
    p = make([(3000, 200), (4096, 1), (17, 17), (0, 0), (1000, 1)], Hq=32, Hkv=8, D=128,
             page_size=16, pages_per_seq=256, max_seqs=6, pad_tokens=5, dtype=jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(700),
                         sinks=jnp.linspace(-1.0, 1.0, 32),
                         block_sizes=(MosaicGpuDecodeBlockSizes(), PagedBlockSizes()))
    for pp in (p, poisoned(p)):
        got = check_ragged(None, spec, pp, tol=3e-2, use_reference=True)
        want = check_ragged(None, spec.replace(impl="xla"), pp, tol=3e-2, use_reference=True)
        np.testing.assert_allclose(np.asarray(got.out, np.float32),
                                   np.asarray(want.out, np.float32), atol=3e-2, rtol=3e-2)
