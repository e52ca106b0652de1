"""The Pallas Mosaic GPU forward (fnattn/flash/mosaic_gpu.py).

Three groups:

* the Mosaic GPU interpreter on CPU: the kernel (TMA ring, barriers, block
  schedule, masks, online softmax, output path) against ``fnattn.reference``.
  The interpreter takes no transposed or register ``wgmma`` operand, so there
  the two products are computed from the same shared-memory tiles with ``jnp``;
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
from fnattn import AttentionSpec, core, masks
from fnattn.flash import xla
from fnattn._checks import Dims
from fnattn._dispatch import Config, Lowering
from fnattn.flash import mosaic_gpu
from fnattn.flash.mosaic_gpu import LOWERING, MosaicGpuBlockSizes

ON_GPU = jax.devices()[0].platform == "gpu"
SMALL = MosaicGpuBlockSizes(block_q=64, block_k=64, max_concurrent_steps=2)


def _interpreted():
    return Lowering("flash-mosaic-gpu-interpret",
                    functools.partial(mosaic_gpu.forward,
                                      interpret=mosaic_gpu.interpret_params()),
                    LOWERING.bwd)


def qkv(*, B=1, Tq=128, Tk=128, Hq=2, Hkv=2, D=64, dtype=jnp.float16, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, Tq, Hq, D), jnp.float32).astype(dtype),
            jax.random.normal(kk, (B, Tk, Hkv, D), jnp.float32).astype(dtype),
            jax.random.normal(kv, (B, Tk, Hkv, D), jnp.float32).astype(dtype))


def run(spec, q, k, v, table):
    return jax.jit(lambda q, k, v: core.run(spec, q, k, v, fn="flash", table=table))(q, k, v)


def interpret(spec, q, k, v):
    try:
        return run(spec, q, k, v, (("default", _interpreted()),))
    except Exception:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        interpret_pallas_call.reset_gpu_interpret_mode_state()
        raise


def check(spec, q, k, v, *, tol=2e-2):
    res = interpret(spec, q, k, v)
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


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    # Tq > Tk with bottom-right alignment: the first 64 rows see no key.
    q, k, v = qkv(Tq=128, Tk=64)
    res = check(AttentionSpec(mask=masks.causal(), return_lse=True, block_sizes=SMALL),
                q, k, v)
    assert np.all(np.asarray(res.out[:, :64], np.float32) == 0)
    assert np.all(np.asarray(res.lse[:, :, :64]) == -np.inf)
    assert np.all(np.isfinite(np.asarray(res.lse[:, :, 64:])))


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


# ----------------------------------------------------------------------------------
# What the kernel refuses
# ----------------------------------------------------------------------------------


def cfg_of(*, D=64, Dv=None, dropout=0.0, Tq=128, Tk=128):
    return Config(Dims(1, Tq, Tk, 4, 2, D, D if Dv is None else Dv), D ** -0.5, None,
                  dropout, None)


@pytest.mark.parametrize("what, args, words", [
    ("bias", dict(bias=jnp.zeros((128, 128))), "a bias"),
    ("sinks", dict(sinks=jnp.zeros((4,))), "attention sinks"),
    ("segments", dict(mask=masks.segments(jnp.zeros((1, 128), jnp.int32))),
     "a mask holding arrays"),
    ("float32", dict(dtype=jnp.float32), "float32 inputs"),
    ("d80", dict(cfg=cfg_of(D=80)), "head dim D=80"),
    ("dv", dict(cfg=cfg_of(D=64, Dv=128)), "value head dim"),
    ("dropout", dict(cfg=cfg_of(dropout=0.1)), "dropout"),
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


def test_block_sizes_fit_shared_memory():
    for D in (64, 128, 256):
        assert MosaicGpuBlockSizes.default(D).smem_bytes(D) <= mosaic_gpu.SMEM_BYTES
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        MosaicGpuBlockSizes(max_concurrent_steps=1)


# ----------------------------------------------------------------------------------
# Lowering for "cuda" on CPU
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("mask", [None, "causal", "window", "chunked"])
def test_lowers_for_cuda(D, mask):
    pytest.importorskip("absl")
    mask = {None: None, "causal": masks.causal(),
            "window": masks.causal() & masks.sliding_window(100),
            "chunked": masks.chunked(64)}[mask]
    q = jax.ShapeDtypeStruct((2, 1000, 8, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1000, 2, D), jnp.bfloat16)
    spec = AttentionSpec(mask=mask, softcap=30.0 if D == 256 else None)
    f = jax.jit(lambda q, k, v: core.run(spec, q, k, v, fn="flash",
                                         table=(("default", LOWERING),)).out)
    text = f.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert re.search(r"custom_call @mosaic_gpu", text)


# ----------------------------------------------------------------------------------
# On an NVIDIA GPU
# ----------------------------------------------------------------------------------

GPU_MASKS = {"none": None, "causal": masks.causal(), "window": masks.sliding_window(256)}


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("D", [128, 256])
def test_gpu_mosaic_gpu_ragged_softcap_gqa_and_gradients(D):
    """Ragged lengths (1000 x 1500), soft-cap, GQA 4:1, D up to 256, and the gradients
    (the Triton backward from this kernel's residuals) against the XLA lowering."""
    q, k, v = qkv(B=2, Tq=1000, Tk=1500, Hq=8, Hkv=2, D=D, dtype=jnp.bfloat16, seed=1)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(700), softcap=20.0,
                         return_lse=True)

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
    np.testing.assert_allclose(f32(res.lse), f32(ref.lse), atol=2e-2, rtol=2e-2)
    for g, gr in zip(grads, ref_grads):
        scale = float(np.abs(f32(gr)).max())
        np.testing.assert_allclose(f32(g) / scale, f32(gr) / scale, atol=3e-2)


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
    from fnattn.flash import triton
    from fnattn.flash.api import cuda_kernel
    cfg = cfg_of()
    q16, q32 = jnp.zeros((1, 128, 4, 64), jnp.bfloat16), jnp.zeros((1, 128, 4, 64))
    assert cuda_kernel(cfg, q16, None, None, masks.causal()) is LOWERING
    assert cuda_kernel(cfg, q16, None, None, masks.chunked(32)) is LOWERING
    assert cuda_kernel(cfg, q32, None, None, masks.causal()) is triton.LOWERING
    assert cuda_kernel(cfg, q16, jnp.zeros((128, 128)), None, None) is triton.LOWERING
    seg = masks.segments(jnp.zeros((1, 128), jnp.int32))
    assert cuda_kernel(cfg, q16, None, None, seg) is triton.LOWERING
    given = dataclasses.replace(cfg, block_sizes=fnattn.TritonBlockSizes())
    assert cuda_kernel(given, q16, None, None, masks.causal()) is triton.LOWERING
    given = dataclasses.replace(cfg, block_sizes=MosaicGpuBlockSizes(block_k=64))
    assert cuda_kernel(given, q16, None, None, masks.causal()) is LOWERING


def _lowered(spec, q, k, v):
    def loss(q, k, v):
        return jnp.sum(fnattn.attention(spec, q, k, v).out.astype(jnp.float32))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
    # (the Mosaic GPU custom call; the test file's own name is in the locations)
    mgpu = re.search(r"custom_call @mosaic_gpu", text) is not None
    return mgpu, sorted(set(re.findall(r"fnattn_flash_\w+", text)))


@pytest.mark.parametrize("on_hopper", [False, True])
def test_auto_runs_the_mosaic_gpu_forward_on_hopper(monkeypatch, on_hopper):
    """A soft-capped causal spec (which cuDNN cannot run): on Hopper the Mosaic GPU
    forward and the Triton dq and dk/dv kernels; elsewhere the three Triton
    kernels. A spec with a bias stays on Triton either way."""
    pytest.importorskip("absl")
    if on_hopper:
        monkeypatch.setattr(mosaic_gpu, "available", lambda: None)
    q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal(), softcap=30.0)
    mgpu, kernels = _lowered(spec, q, k, k)
    assert mgpu == on_hopper
    assert kernels == (["fnattn_flash_dkdv", "fnattn_flash_dq"] if on_hopper else
                       ["fnattn_flash_dkdv", "fnattn_flash_dq", "fnattn_flash_fwd"])
    mgpu, kernels = _lowered(spec.replace(bias=jnp.zeros((256, 256))), q, k, k)
    assert not mgpu and "fnattn_flash_fwd" in kernels
