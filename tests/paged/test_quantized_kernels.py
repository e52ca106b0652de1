"""Quantized and latent pools in the Pallas paged kernels: Triton
(fnattn/paged/triton.py) and Mosaic TPU (fnattn/paged/mosaic.py).

* interpret mode on CPU, under jax.jit: ragged mixed prefill/decode batches,
  ``paged_attention`` decode and the update form, over every format of
  fnattn.quant with per-tensor and per-token scales (K and V in different
  ones), and latent pools (values = the keys' first Dc channels), float and
  quantized. Outputs equal the XLA lowering's and the float64 reference on the
  dequantized pools; the update form writes the codes and scales of
  ``fnattn.quant.write`` bit for bit; non-finite codes and scales in slots no
  sequence owns never reach an output;
* lowering for cuda (Triton) and tpu (Mosaic) on CPU over every format and
  scale kind, with ``impl="auto"`` choosing the kernels there.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import fnattn  # noqa: E402
from fnattn import AttentionSpec, PagedBlockSizes, masks, quant  # noqa: E402
from fnattn.paged import api, mosaic, triton, xla  # noqa: E402
from fnattn.quant import QuantFormat  # noqa: E402
from lowering import cheap_compiles, target  # noqa: E402
from problems import (assert_close, assert_pools_equal, check_ragged, check_update,  # noqa: E402
                      expected, make, meta, poisoned, quantized, ragged)


@pytest.fixture(autouse=True, scope="module")
def _cheap_compiles():
    with cheap_compiles():
        yield


XLA = (("default", xla.forward),)
KERNELS = {"triton": (("default", triton.forward_interpret),),
           "mosaic": (("default", mosaic.forward_interpret),)}
# (L, n) per sequence: prefill chunks, decodes, a one-token sequence, one with no
# new token. Pages of 8 keys (the Mosaic kernel's smallest); 3 for Triton.
MIXED = [(11, 3), (21, 1), (8, 8), (1, 1), (9, 0)]
PAGE = {"triton": 3, "mosaic": 8}
# Every format with both scale kinds, across K and V.
FORMATS = [(QuantFormat("int8"), QuantFormat("int4", "tensor")),
           (QuantFormat("int4"), QuantFormat("float8_e4m3fn")),
           (QuantFormat("float8_e5m2", "tensor"), QuantFormat("int8", "tensor")),
           (QuantFormat("float8_e4m3fn", "tensor"), QuantFormat("float8_e5m2"))]
IDS = [f"{k.name}-{k.granularity}/{v.name}-{v.granularity}" for k, v in FORMATS]


def _problem(kernel, formats, *, D=8, Dv=6, seed=1, pad_tokens=2):
    return quantized(make(MIXED, Hq=4, Hkv=2, D=D, Dv=Dv, page_size=PAGE[kernel], max_seqs=6,
                          pad_tokens=pad_tokens, seed=seed), *formats)


def _spec(kernel):
    # Triton: three splits merged with the sinks; Mosaic: two pages per key block
    bs = (PagedBlockSizes(block_q=2, block_k=16, num_splits=3) if kernel == "triton"
          else PagedBlockSizes(block_q=4, block_k=16))
    return AttentionSpec(mask=masks.causal() & masks.sliding_window(7), softcap=5.0,
                         sinks=jnp.array([0.5, -1.0, 0.0, 2.0]), block_sizes=bs)


@pytest.mark.parametrize("formats", FORMATS, ids=IDS)
@pytest.mark.parametrize("kernel", ["triton", "mosaic"])
def test_ragged_equals_xla_and_the_reference_on_the_dequantized_pools(kernel, formats):
    p = _problem(kernel, formats)
    spec = _spec(kernel)
    res = check_ragged(KERNELS[kernel], spec, p)          # float64 on the dequantized pools
    want = ragged(XLA, spec, p)
    np.testing.assert_allclose(res.out, want.out, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(res.lse, want.lse, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("formats", FORMATS[:2], ids=IDS[:2])
@pytest.mark.parametrize("kernel", ["triton", "mosaic"])
def test_update_form_writes_the_codes_and_scales_of_quant_write(kernel, formats):
    """The pools written by the update form equal fnattn.quant.write's, bit for bit
    (codes and per-token scales; per-tensor scales kept), and the attention sees
    the new tokens."""
    p = _problem(kernel, formats, seed=3, pad_tokens=3)
    spec = _spec(kernel)
    res = check_update(KERNELS[kernel], spec, p)        # pools == quantize of every token
    # and == fnattn.quant.write of the new tokens at their slots of the old pools
    cfg_pools = jax.jit(lambda kp, vp, k, v, m: api.ragged_paged_attention_with_update_with(
        XLA, spec, p.q, k, v, kp, vp, **m))(p.k_old, p.v_old, p.k_new, p.v_new, meta(p))
    assert_pools_equal(cfg_pools[1], p.k_pages)
    assert_pools_equal(cfg_pools[2], p.v_pages)
    np.testing.assert_allclose(res.out, cfg_pools[0].out, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("kernel", ["triton", "mosaic"])
def test_paged_attention_decode(kernel):
    """paged_attention (Tq = 2) over int4 keys with per-token scales and int8 values
    whose per-tensor scale is a Python float."""
    B, Tq, Hq, D = 3, 2, 4, 8
    p = quantized(make([(11, Tq), (20, Tq), (Tq, Tq)], Hq=Hq, Hkv=2, D=D,
                       page_size=PAGE[kernel], seed=2),
                  QuantFormat("int4"), QuantFormat("int8", "tensor"))
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.ones(Hq))
    vp = p.v_pages.replace(scale=float(p.v_pages.scale))  # a Python float, closed over
    f = jax.jit(lambda q, kp, pt, lens: api.paged_attention_with(
        KERNELS[kernel], spec, q, kp, vp, page_table=pt, kv_lengths=lens))
    res = f(p.q.reshape(B, Tq, Hq, D), p.k_pages, p.page_table, p.context_lengths)
    assert_close(res.out.reshape(B * Tq, Hq, D), res.lse.transpose(1, 0, 2).reshape(Hq, B * Tq),
                 *expected(spec, p), 2e-5)


def _spoiled(p, base, hidden=None):
    """The problem's quantized pools with NaN/inf codes and NaN scales in every slot
    no live sequence owns, and in the keys ``hidden(L, n, pos)`` names."""
    bad = poisoned(base, hidden=hidden)
    keep = ~np.isnan(np.asarray(bad.k_pages))[..., 0]                   # (Hkv, N, ps)

    def spoil(pool):
        scale = pool.scale
        if pool.format.per_token:
            scale = jnp.where(keep, scale, jnp.nan)
        data = pool.data
        if pool.format.is_float:
            junk = jnp.inf if pool.format.name == "float8_e5m2" else jnp.nan
        else:
            junk = 0x88 if data.dtype == jnp.uint8 else -128    # codes outside -7..7, -127..127
        data = jnp.where(keep[..., None], data, jnp.array(junk, data.dtype))
        return pool.replace(data=data, scale=scale)

    return p.__class__(**{**p.__dict__, "k_pages": spoil(p.k_pages),
                          "v_pages": spoil(p.v_pages)})


@pytest.mark.parametrize("kernel", ["triton", "mosaic"])
def test_nonfinite_codes_and_scales_in_unowned_or_hidden_slots_change_nothing(kernel):
    """NaN/inf codes and NaN scales in every slot no sequence owns and in the keys a
    window hides from all of its queries: the dense answer (with x64 on, too)."""
    base = make(MIXED, Hq=4, Hkv=2, D=8, page_size=PAGE[kernel], max_seqs=6, pad_tokens=2,
                seed=7)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(4),
                         sinks=jnp.array([0.5, 1.0, -1.0, 0.0]),
                         block_sizes=PagedBlockSizes(block_k=16))
    hidden = lambda L, n, pos: pos < L - n - 4  # noqa: E731
    for formats, x64 in ((FORMATS[1], False), (FORMATS[3], True)):
        p = quantized(base, *formats)
        want = expected(spec, p)
        with jax.enable_x64(x64):
            res = check_ragged(KERNELS[kernel], spec, _spoiled(p, base, hidden))
        assert_close(res.out, res.lse, *want, 2e-5)


LATENT = [("triton", None), ("triton", QuantFormat("int4")), ("mosaic", QuantFormat("int4")),
          ("mosaic", None), ("mosaic", QuantFormat("float8_e4m3fn", "tensor"))]


@pytest.mark.parametrize("kernel,fmt", LATENT,
                         ids=[f"{k}-{'float' if f is None else f.name + '-' + f.granularity}"
                              for k, f in LATENT])
def test_latent_pools_ragged_and_update(kernel, fmt):
    """A latent pool (value_dim=Dc, v_pages None, one kv head): the kernels equal the
    same problem with a separate value pool holding the keys' first Dc channels, and
    the update form writes the keys (latent and rope channels) only."""
    Dc, Dr = 6, 4
    p = make(MIXED, Hq=4, Hkv=1, D=Dc + Dr, Dv=Dc, page_size=PAGE[kernel], max_seqs=6,
             pad_tokens=2, seed=11)
    if fmt is not None:
        p = quantized(p, fmt)
    kd = quant.dequantize(p.k_pages)
    sep = p.__class__(**{**p.__dict__, "v_pages": kd[..., :Dc],
                         "v_tok": [x[..., :Dc] for x in p.k_tok]})
    spec = _spec(kernel)
    table = KERNELS[kernel]
    res = jax.jit(lambda q, kp, m: api.ragged_paged_attention_with(
        table, spec, q, kp, None, value_dim=Dc, **m))(p.q, p.k_pages, meta(p))
    assert res.out.shape == (p.q.shape[0], 4, Dc)
    assert_close(res.out, res.lse, *expected(spec, sep), 2e-5)
    res, kp, vp = jax.jit(lambda q, k, kp, m: api.ragged_paged_attention_with_update_with(
        table, spec, q, k, None, kp, None, value_dim=Dc, **m))(p.q, p.k_new, p.k_old, meta(p))
    assert vp is None
    assert_close(res.out, res.lse, *expected(spec, sep), 2e-5)
    assert_pools_equal(kp, p.k_pages)


def test_impl_pallas_runs_the_kernels_on_quantized_and_latent_pools(monkeypatch):
    """impl='pallas' off GPU/TPU runs the Triton kernels interpreted: the same
    numbers as the XLA lowering, through the public functions."""
    calls = []
    run = triton.forward_interpret
    monkeypatch.setattr(triton, "forward_interpret",
                        lambda cfg, *a: calls.append(cfg.value_dim) or run(cfg, *a))
    p = _problem("triton", FORMATS[0])
    spec = AttentionSpec(mask=masks.causal(), impl="pallas")
    got = jax.jit(lambda q, kp, vp, m: fnattn.ragged_paged_attention(spec, q, kp, vp, **m))(
        p.q, p.k_pages, p.v_pages, meta(p))
    want = ragged(XLA, spec, p)
    np.testing.assert_allclose(got.out, want.out, atol=2e-6, rtol=2e-6)
    jax.jit(lambda q, kp: fnattn.ragged_paged_attention(
        spec, q, kp, None, value_dim=4, **meta(p)).out).trace(p.q, p.k_pages)
    assert set(calls) == {None, 4}      # (traced once per form of the custom_vjp)


LOWER_FORMATS = [QuantFormat(name, g) for name in quant.FORMATS for g in ("token", "tensor")]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_every_format_lowers_to_the_kernel_under_impl_auto(platform):
    """On a GPU (Triton) and a TPU (Mosaic), impl='auto' runs quantized pools of every
    format and scale kind, and latent pools, in the Pallas kernel."""
    N, ps, S, P, T, Hq, Hkv, D = 16, 16, 3, 4, 7, 8, 2, 128
    m = dict(page_table=jnp.zeros((S, P), jnp.int32), context_lengths=jnp.zeros(S, jnp.int32),
             query_start_loc=jnp.zeros(S + 1, jnp.int32), num_seqs=jnp.int32(S))
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(9), sinks=jnp.zeros(Hq),
                         block_sizes=PagedBlockSizes(block_k=32))
    q = jnp.zeros((T, Hq, D), jnp.bfloat16)
    name = "fnattn_paged_triton" if platform == "cuda" else "tpu_custom_call"
    for i, fmt in enumerate(LOWER_FORMATS):
        kp = quant.empty((Hkv, N, ps, D), fmt, scale=None if fmt.per_token else 0.5)
        if i % 2:   # a latent pool and the update form
            f = lambda q, kp: fnattn.ragged_paged_attention_with_update(  # noqa: E731
                spec, q, q[:, :Hkv], None, kp, None, value_dim=96, **m)[0].out
        else:
            f = lambda q, kp: fnattn.ragged_paged_attention(spec, q, kp, kp, **m).out  # noqa: E731
        with target(platform):
            text = jax.jit(f).trace(q, kp).lower(lowering_platforms=(platform,)).as_text()
        assert name in text, (platform, fmt)


def test_a_spec_asking_for_mosaic_gpu_runs_quantized_pools_with_triton(monkeypatch):
    """MosaicGpuDecodeBlockSizes on a Hopper GPU: that kernel reads float pools only,
    so quantized pools run with the Triton kernel there (as the contiguous decode's)."""
    from fnattn.decoding.mosaic_gpu import MosaicGpuDecodeBlockSizes
    from fnattn.flash import mosaic_gpu as flash_mgpu
    monkeypatch.setattr(flash_mgpu, "available", lambda: None)
    p = _problem("triton", FORMATS[0])
    spec = AttentionSpec(mask=masks.causal(), block_sizes=MosaicGpuDecodeBlockSizes())
    with target("cuda"):
        text = jax.jit(lambda q, kp, vp: fnattn.ragged_paged_attention(
            spec, q, kp, vp, **meta(p)).out).trace(p.q, p.k_pages, p.v_pages).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower() and "mosaic_gpu" not in text.lower()


def test_mosaic_cost_counts_the_codes_and_scales_it_reads():
    """The Mosaic kernel's cost estimate counts a quantized pool's codes and scales,
    and a latent pool once (no value pool)."""
    import json
    import re
    N, ps, S, P, T, Hq, Hkv, D = 16, 16, 3, 4, 7, 8, 2, 128
    m = dict(page_table=jnp.zeros((S, P), jnp.int32), context_lengths=jnp.zeros(S, jnp.int32),
             query_start_loc=jnp.zeros(S + 1, jnp.int32), num_seqs=jnp.int32(S))
    q = jnp.zeros((T, Hq, D), jnp.bfloat16)
    slots = Hkv * N * ps
    cases = [(quant.empty((Hkv, N, ps, D), "int8"), None, 2 * slots * (D + 4)),
             (quant.empty((Hkv, N, ps, D), "int4"), 96, slots * (D // 2 + 4)),
             (jnp.zeros((Hkv, N, ps, D), jnp.bfloat16), 96, slots * D * 2)]
    for kp, value_dim, pool_bytes in cases:
        f = jax.jit(lambda q, kp: fnattn.ragged_paged_attention(  # noqa: B023
            AttentionSpec(impl="pallas"), q, kp, kp if value_dim is None else None,
            value_dim=value_dim, **m).out)
        with target("tpu"):
            txt = f.trace(q, kp).lower(lowering_platforms=("tpu",)).as_text()
        found = re.findall(r'cost_estimate\\22: (\{.*?\})', txt.replace("\\0A", ""))
        [est] = [json.loads(x.replace("\\22", '"')) for x in found]
        io = 2 * T * Hq * (D + (D if value_dim is None else value_dim))   # q in, out
        assert est["bytes_accessed"] == pool_bytes + io, (kp.dtype, value_dim)
