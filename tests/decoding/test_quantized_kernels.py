"""The Pallas decode kernels on quantized (fnattn.quant) and latent (value_dim) caches.

* interpret mode on CPU, under jax.jit, for the Triton (fnattn/decoding/triton.py)
  and Mosaic TPU (fnattn/decoding/mosaic.py) kernels: every format with either
  scale kind, MHA and GQA, against float64 NumPy on the dequantized cache and
  against the XLA lowering. Slots outside each sequence's range hold NaN codes
  (float8) and NaN per-token scales: a kernel that let one through would fail;
* latent caches (values = the keys' first Dc channels), float and quantized;
* gradients through impl="pallas" (kernel forward, XLA backward);
* the Mosaic GPU kernel hands quantized and latent caches to Triton, and says so
  when asked for them by name;
* lowering for cuda (Triton) and tpu (Mosaic) on CPU, impl="auto" and "pallas".
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowering import cheap_compiles, gpu_target, tpu_target
from test_decoding import NAN_SLOTS, expected, nan_problem

import fnattn
from fnattn import AttentionSpec, DecodeBlockSizes, masks, position_bias, quant
from fnattn.decoding import api, mosaic, mosaic_gpu, triton, xla
from fnattn.flash import mosaic_gpu as flash_mgpu
from fnattn.quant import QuantFormat


@pytest.fixture(autouse=True, scope="module")
def _cheap_compiles():
    with cheap_compiles():
        yield


KERNELS = {
    "triton": functools.partial(triton._forward, interpret=True, block_k=16),
    "mosaic": functools.partial(mosaic._forward, interpret=True, block_k=8),
}


@pytest.fixture(params=list(KERNELS))
def kernel(request, monkeypatch):
    """fnattn.decode(impl="pallas") routed to one interpreted kernel."""
    fwd = KERNELS[request.param]
    monkeypatch.setattr(api, "lowering_table", lambda impl: (("default", fwd),))
    return request.param


def fmt(name, granularity):
    return QuantFormat(name, granularity)


def quantized(x, f, live):
    """``x`` quantized; where not ``live`` (slots no sequence owns) the codes of
    float8 formats stay NaN and per-token scales become NaN."""
    qa = quant.quantize(x, f, scale=None if f.per_token else 2.5 / f.max_code)
    if f.per_token:
        qa = qa.replace(scale=jnp.where(live[..., 0], qa.scale, jnp.nan))
    return qa


def owned(L, a):
    slot = jnp.arange(NAN_SLOTS)[None, :, None, None]
    return (slot >= a[:, None, None, None]) & (slot < (a + L)[:, None, None, None])


# Every format with either scale kind, as K or V, with MHA and with GQA.
PAIRS = [(fmt("int8", "token"), fmt("float8_e5m2", "tensor")),
         (fmt("float8_e4m3fn", "token"), fmt("int4", "tensor")),
         (fmt("int4", "token"), fmt("int8", "tensor")),
         (fmt("float8_e5m2", "token"), fmt("float8_e4m3fn", "tensor"))]
PAIR_IDS = [f"{k.name}-{k.granularity}/{v.name}-{v.granularity}" for k, v in PAIRS]


@pytest.mark.parametrize("heads", [(3, 3), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("formats", PAIRS, ids=PAIR_IDS)
def test_formats_scales_and_heads(kernel, formats, heads):
    """Quantized K and V (one scale kind each), NaN in unowned slots and scales, a
    causal mask, two splits, a sink: the kernel equals float64 NumPy on the
    dequantized cache and the XLA lowering, to float32 rounding."""
    Hq, Hkv = heads
    q, k, v, L, a = nan_problem(Hq=Hq, Hkv=Hkv, D=8, Dv=8, seed=11,
                                lengths=(30, 9, 0), starts=(0, 17, 3))
    live = owned(L, a)
    kq, vq = quantized(k, formats[0], live), quantized(v, formats[1], live)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.linspace(-1.0, 1.0, Hq),
                         block_sizes=DecodeBlockSizes(num_splits=2))
    run = jax.jit(lambda spec, q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L,
                                                      kv_starts=a))
    got = run(spec.replace(impl="pallas"), q, kq, vq)
    want = run(spec.replace(impl="xla"), q, kq, vq)
    out, lse = expected(spec, q, kq, vq, np.asarray(L), np.asarray(a))
    assert np.isfinite(np.asarray(got.out)).all()
    np.testing.assert_allclose(np.asarray(got.out, np.float64), out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got.out, want.out, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(got.lse, want.lse, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(got.lse, lse, atol=2e-5, rtol=2e-5)


def test_window_softcap_alibi_bfloat16_queries(kernel):
    """A sliding window (keys the mask hides hold NaN codes in the sequence's own
    unowned neighbours), soft-cap, ALiBi, bfloat16 queries (tiles dequantized to
    bfloat16, as the XLA lowering does), three query tokens, one split."""
    q, k, v, L, a = nan_problem(Tq=3, Hq=8, Hkv=2, D=16, Dv=16, seed=12,
                                lengths=(33, 12, 3), starts=(2, 20, 37))
    live = owned(L, a)
    kq = quantized(k, fmt("float8_e4m3fn", "tensor"), live)
    vq = quantized(v, fmt("int8", "token"), live)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(5), softcap=4.0,
                         position_bias=position_bias.alibi(position_bias.alibi_slopes(8)))
    q = q.astype(jnp.bfloat16)
    run = jax.jit(lambda spec, q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L,
                                                      kv_starts=a))
    got, want = run(spec.replace(impl="pallas"), q, kq, vq), run(spec.replace(impl="xla"),
                                                                  q, kq, vq)
    assert got.out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got.out, np.float32), np.asarray(want.out, np.float32),
                               atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(got.lse, want.lse, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("f", [None, fmt("int8", "token"), fmt("int4", "tensor")],
                         ids=["float", "int8-token", "int4-tensor"])
def test_latent_caches(kernel, f):
    """One pool of Dc + Dr channels, one kv head, values its first Dc channels (the
    key tile the kernel loaded): float64 NumPy on (K, K[..., :Dc]) and the XLA
    lowering; NaN in unowned slots."""
    Dc, Dr, Hq = 8, 4, 8
    q, k, _, L, a = nan_problem(Tq=2, Hq=Hq, Hkv=1, D=Dc + Dr, Dv=1, seed=13,
                                lengths=(30, 9, 0), starts=(0, 17, 3))
    kc = jnp.where(owned(L, a), k, 0.0) if f is None else quantized(k, f, owned(L, a))
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.linspace(-1.0, 1.0, Hq), softcap=5.0,
                         block_sizes=DecodeBlockSizes(num_splits=2))
    run = jax.jit(lambda spec, q, k: fnattn.decode(spec, q, k, None, kv_lengths=L,
                                                   kv_starts=a, value_dim=Dc))
    got, want = run(spec.replace(impl="pallas"), q, kc), run(spec.replace(impl="xla"), q, kc)
    kd = quant.dequantize(kc)
    out, lse = expected(spec, q, kd, kd[..., :Dc], np.asarray(L), np.asarray(a))
    assert got.out.shape == (3, 2, Hq, Dc)
    np.testing.assert_allclose(np.asarray(got.out, np.float64), out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got.out, want.out, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(np.where(np.isfinite(lse), got.lse, 0),
                               np.where(np.isfinite(lse), lse, 0), atol=2e-5, rtol=2e-5)


def test_gradients_through_the_kernel_forward(monkeypatch):
    """impl="pallas" (interpreted Triton forward, the XLA backward of _attend_stored):
    the gradients of q and of the per-token scales equal impl="xla"'s."""
    monkeypatch.setattr(api, "lowering_table", lambda impl: (("default", KERNELS["triton"]),))
    q, k, v, L, a = nan_problem(Hq=6, Hkv=2, D=8, Dv=8, seed=14)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    kq, vq = quant.quantize(k, "int8"), quant.quantize(v, "int4")
    spec = AttentionSpec(mask=masks.causal())

    def loss(impl, q, ks, vs):
        r = fnattn.decode(spec.replace(impl=impl), q, kq.replace(scale=ks), vq.replace(scale=vs),
                          kv_lengths=L, kv_starts=a)
        return jnp.sum(jnp.sin(r.out)) + jnp.sum(jnp.where(jnp.isfinite(r.lse), r.lse, 0))

    g = {impl: jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2)))(
        q, kq.scale, vq.scale) for impl in ("pallas", "xla")}
    for x, y in zip(g["pallas"], g["xla"]):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


def test_mosaic_gpu_hands_quantized_and_latent_caches_to_triton(monkeypatch):
    """Asked for by name, the Mosaic GPU kernel (which copies tiles straight into
    wgmma operands) refuses quantized and latent caches, naming the Triton kernel;
    its cuda entry (gpu_forward) runs them there instead."""
    monkeypatch.setattr(flash_mgpu, "available", lambda: None)
    q = jnp.zeros((2, 1, 8, 128), jnp.bfloat16)
    k = jnp.zeros((2, 256, 2, 128), jnp.bfloat16)
    kq = quant.quantize(k, "int8")
    cfg = api.Cfg(scale=0.1, softcap=None, mask_treedef=None, num_splits=None,
                  block_sizes=mosaic_gpu.MosaicGpuDecodeBlockSizes())
    L = jnp.array([5, 9])
    with pytest.raises(NotImplementedError, match=r"a quantized k cache \(int8 \(per-token "
                       r"scales\); the Pallas Triton kernel, fnattn/decoding/triton.py"):
        mosaic_gpu.forward(cfg, q, kq, k, L * 0, L, None)
    with pytest.raises(NotImplementedError, match="a latent cache"):
        mosaic_gpu.forward(cfg, q, k, None, L * 0, L, None)
    seen = []

    def fallback(cfg, q, k, v, *rest):
        seen.append(v is None or quant.is_quantized(k))
        return "triton"
    assert mosaic_gpu.gpu_forward(fallback, cfg, q, kq, k, L * 0, L, None) == "triton"
    assert mosaic_gpu.gpu_forward(fallback, dataclasses.replace(cfg, value_dim=64), q, k, None,
                                  L * 0, L, None) == "triton"
    assert seen == [True, True]


# ----------------------------------------------------------------------------------
# Lowering on CPU
# ----------------------------------------------------------------------------------

LOWER = [  # k format, v format (None: a latent cache of 576 channels, Dc = 512), D, Hq, Hkv
    (fmt("int8", "token"), fmt("int8", "tensor"), 128, 32, 8),
    (fmt("float8_e4m3fn", "token"), fmt("float8_e5m2", "tensor"), 128, 16, 16),
    (fmt("float8_e5m2", "tensor"), fmt("float8_e4m3fn", "token"), 64, 8, 4),
    (fmt("int4", "token"), fmt("int4", "tensor"), 128, 16, 4),
    (fmt("int4", "tensor"), None, 576, 16, 1),
    (fmt("int8", "token"), None, 576, 16, 1),
]


def _lowered(platform, spec, kf, vf, D, Hq, Hkv, S=512):
    q = jnp.zeros((2, 1, Hq, D), jnp.bfloat16)
    k = jnp.ones((2, S, Hkv, D), jnp.float32)
    kq = quant.quantize(k, kf, scale=None if kf.per_token else 0.1)
    vq = None if vf is None else quant.quantize(k, vf, scale=None if vf.per_token else 0.2)
    L = jnp.array([300, 7])
    f = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L,
                                              value_dim=512 if v is None else None).out)
    with (gpu_target() if platform == "cuda" else tpu_target()):
        return f.trace(q, kq, vq).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("kf,vf,D,Hq,Hkv", LOWER)
def test_lowers_for_cuda_and_tpu(kf, vf, D, Hq, Hkv):
    """impl="auto" and impl="pallas" lower a quantized or latent cache to the Triton
    kernel for cuda and to the Mosaic kernel for tpu (no XLA lowering there)."""
    for impl in ("auto", "pallas"):
        spec = AttentionSpec(mask=masks.causal(), softcap=30.0, impl=impl,
                             sinks=jnp.zeros(Hq), block_sizes=DecodeBlockSizes(num_splits=2))
        assert triton.KERNEL_NAME in _lowered("cuda", spec, kf, vf, D, Hq, Hkv), impl
        text = _lowered("tpu", spec, kf, vf, D, Hq, Hkv)
        assert re.findall(r'kernel_name = "(\w+)"', text) == [mosaic.KERNEL_NAME], impl


def test_auto_elsewhere_is_xla():
    """On a CPU impl="auto" reads quantized caches with the XLA lowering (no kernel)."""
    table = api.quantized_table("auto")
    assert dict(table)["default"] is xla.forward
    assert {plat for plat, _ in table} == {"default", "cuda", "tpu"}
    assert api.quantized_table("xla") == api.lowering_table("xla")


def test_lowers_under_x64():
    with jax.enable_x64(True):
        test_lowers_for_cuda_and_tpu(*LOWER[3])


def test_asked_for_mosaic_gpu_on_hopper_lowers_to_triton(monkeypatch):
    """MosaicGpuDecodeBlockSizes on a Hopper GPU (where a float cache lowers to the
    Mosaic GPU kernel, tests/decoding/test_mosaic_gpu.py): a quantized or latent
    cache lowers to the Triton kernel, with no Mosaic GPU call."""
    monkeypatch.setattr(flash_mgpu, "available", lambda: None)
    spec = AttentionSpec(mask=masks.causal(),
                         block_sizes=mosaic_gpu.MosaicGpuDecodeBlockSizes())
    for kf, vf, D, Hq, Hkv in (LOWER[0], LOWER[5]):
        text = _lowered("cuda", spec, kf, vf, D, Hq, Hkv)
        assert triton.KERNEL_NAME in text and "custom_call @mosaic_gpu" not in text


def test_decode_with_update_through_the_kernel():
    """decode_with_update(impl="pallas") on a CPU: the interpreted Triton kernel (its
    default plan) reads the quantized latent cache the update wrote; the same as
    impl="xla", caches bit for bit."""
    Dc, Hq = 8, 4
    q, k, _, L, a = nan_problem(Tq=1, Hq=Hq, Hkv=1, D=Dc + 4, Dv=1, seed=15,
                                lengths=(30, 9, 1), starts=(0, 17, 3))
    kq = quantized(k, fmt("int8", "token"), owned(L, a))
    k_new = jax.random.normal(jax.random.key(16), (3, 1, 1, Dc + 4))
    run = jax.jit(lambda spec, q, kn, kc: fnattn.decode_with_update(
        spec, q, kn, None, kc, None, kv_lengths=L, kv_starts=a, value_dim=Dc))
    spec = AttentionSpec(mask=masks.causal())
    (got, gk, _), (want, wk, _) = (run(spec.replace(impl=impl), q, k_new, kq)
                                   for impl in ("pallas", "xla"))
    np.testing.assert_array_equal(gk.data, wk.data)
    np.testing.assert_allclose(got.out, want.out, atol=2e-6, rtol=2e-6)
