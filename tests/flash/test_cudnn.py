"""impl="auto" on NVIDIA GPUs: which specs go to cuDNN and what the cuDNN lowering
keeps of fnattn's contract (fnattn/flash/cudnn.py).

Four groups:
* the routing table, decision by decision (static facts only);
* the programs lowered for "cuda" on this CPU (cuDNN's version check answered by
  a stand-in): cuDNN's forward and backward custom calls for routed specs, the
  Triton kernels for the rest and for a backward through ``lse``;
* the wrapper around cuDNN against ``fnattn.reference``, forward and gradients,
  with cuDNN stood in for by an XLA emulation that leaves NaN in every row and
  gradient cuDNN's documentation leaves unspecified (padding rows), so that a
  wrapper leaning on cuDNN for them fails here;
* on an NVIDIA GPU (skipped without one): the real cuDNN path against the
  Triton kernels and the reference.
"""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, _jax_private, core, masks
from fnattn._checks import Dims
from fnattn._dispatch import Config
from fnattn.flash import cudnn, triton
from fnattn.flash.api import lowering_table
from lowering import cheap_compiles, gpu_target

ON_GPU = jax.devices()[0].platform == "gpu"
F16 = jnp.float16


def cfg_for(B=2, Tq=64, Tk=64, Hq=4, Hkv=2, D=64, Dv=None, **kw):
    return Config(Dims(B, Tq, Tk, Hq, Hkv, D, D if Dv is None else Dv), 0.125,
                  kw.pop("softcap", None), kw.pop("dropout_rate", 0.0), None, **kw)


# ----------------------------------------------------------------------------------
# The routing table
# ----------------------------------------------------------------------------------

LENS = jnp.array([30, 64])

ROUTED = {
    "no mask": (cfg_for(), None),
    "causal": (cfg_for(), masks.causal()),
    "causal, GQA 8:1": (cfg_for(Hq=8, Hkv=1), masks.causal()),
    "left window": (cfg_for(), masks.sliding_window(16)),
    "causal & window right 3": (cfg_for(), masks.causal() & masks.sliding_window(16, 3)),
    "lengths": (cfg_for(), masks.lengths(LENS, LENS)),
    "causal & kv lengths": (cfg_for(), masks.causal() & masks.lengths(None, LENS)),
    "cross attention, lengths": (cfg_for(Tq=32, Tk=96), masks.lengths(None, LENS)),
    "causal, Tq != Tk, q_offset 0": (cfg_for(Tq=32, q_offset=0), masks.causal()),
    "head dim 128": (cfg_for(D=128), masks.causal()),
}

NOT_ROUTED = {
    "segment ids": (cfg_for(), masks.segments(jnp.zeros((2, 64), jnp.int32)), {}, "segments"),
    "causal, Tq < Tk": (cfg_for(Tq=32), masks.causal(), {}, "top left"),
    "window right, no causal": (cfg_for(), masks.sliding_window(8, 8), {}, "right of"),
    "two windows": (cfg_for(), masks.sliding_window(8) & masks.sliding_window(4), {},
                    "more than one"),
    "chunked": (cfg_for(), masks.chunked(16), {}, "chunked"),
    "per-head lengths": (cfg_for(), masks.lengths(None, jnp.ones((2, 4), jnp.int32)), {},
                         "one per batch row"),
    "bias": (cfg_for(), None, {"bias": jnp.zeros((1, 4, 64, 64))}, "bias"),
    "sinks": (cfg_for(), None, {"sinks": jnp.zeros((4,))}, "sinks"),
    "softcap": (cfg_for(softcap=30.0), None, {}, "softcap"),
    "dropout": (cfg_for(dropout_rate=0.1), None, {}, "dropout"),
    "Dv != D": (cfg_for(Dv=32), None, {}, "Dv=32"),
    "head dim 60": (cfg_for(D=60), None, {}, "head dim 60"),
    "head dim 256 (not Hopper)": (cfg_for(D=256), None, {}, "head dim 256"),
    "block sizes": (cfg_for(block_sizes=triton.TritonBlockSizes(*(64,) * 6)), None, {},
                    "TritonBlockSizes"),
    "float32": (cfg_for(), None, {"dtype": jnp.float32}, "float32"),
}


@pytest.mark.parametrize("name", ROUTED)
def test_routed_specs(name):
    cfg, mask = ROUTED[name]
    assert cudnn.reasons(cfg, jnp.bfloat16, mask, None, None) == []
    assert cudnn.reasons(cfg, F16, mask, None, None) == []


@pytest.mark.parametrize("name", NOT_ROUTED)
def test_specs_left_to_the_kernels(name):
    cfg, mask, kw, why = NOT_ROUTED[name]
    got = cudnn.reasons(cfg, kw.get("dtype", jnp.bfloat16), mask, kw.get("bias"),
                        kw.get("sinks"))
    assert len(got) == 1 and why in got[0], got


def test_no_cudnn_when_tracing_means_the_kernels():
    # This CPU install has no cuDNN: nothing routes, whatever the spec.
    assert cudnn.available() is not None
    assert not cudnn.route(cfg_for(), jnp.bfloat16, masks.causal(), None, None)


# ----------------------------------------------------------------------------------
# Lowered for cuda
# ----------------------------------------------------------------------------------

@pytest.fixture
def cudnn_present(monkeypatch):
    """cuDNN's version check answered as on a GPU machine with cuDNN 9.10."""
    fa = _jax_private.get("cudnn_fused_attention")
    monkeypatch.setattr(fa, "cuda_versions", types.SimpleNamespace(
        cudnn_get_version=lambda: 91000, cuda_runtime_get_version=lambda: 12090))


def lowered_calls(spec, q, k, v, *, through_lse=False):
    def loss(q, k, v):
        res = fnattn.attention(spec, q, k, v)
        total = jnp.sum(res.out.astype(jnp.float32))
        return total + (jnp.sum(jnp.where(jnp.isfinite(res.lse), res.lse, 0.0))
                        if through_lse else 0.0)
    with gpu_target():
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = set(re.findall(r"custom_call @([\w$]+)", text))
    kernels = set(re.findall(r"fnattn_flash_\w+", text))
    return {c for c in calls if "cudnn" in c}, kernels


def qkv(B=2, T=128, Hq=4, Hkv=2, D=64, dtype=jnp.bfloat16, Tk=None):
    rs = np.random.default_rng(0)
    q = jnp.asarray(rs.standard_normal((B, T, Hq, D)), dtype)
    k = jnp.asarray(rs.standard_normal((B, Tk or T, Hkv, D)), dtype)
    v = jnp.asarray(rs.standard_normal((B, Tk or T, Hkv, D)), dtype)
    return q, k, v


CUDNN_FWD, CUDNN_BWD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"


@pytest.mark.parametrize("mask", [None, masks.causal(),
                                  masks.causal() & masks.lengths(jnp.array([100, 128]),
                                                                 jnp.array([0, 90])),
                                  masks.sliding_window(32)],
                         ids=["none", "causal", "causal-lengths", "window"])
def test_routed_spec_lowers_to_cudnn_forward_and_backward(cudnn_present, mask):
    cudnn_calls, kernels = lowered_calls(AttentionSpec(mask=mask), *qkv())
    assert cudnn_calls == {CUDNN_FWD, CUDNN_BWD}
    assert not kernels


def test_backward_through_lse_runs_the_triton_kernels(cudnn_present):
    cudnn_calls, kernels = lowered_calls(AttentionSpec(mask=masks.causal()), *qkv(),
                                         through_lse=True)
    assert cudnn_calls == {CUDNN_FWD}
    assert kernels == {"fnattn_flash_dq", "fnattn_flash_dkdv"}


@pytest.mark.parametrize("what", ["segments", "float32", "bias"])
def test_other_specs_lower_to_the_triton_kernels(cudnn_present, what):
    q, k, v = qkv(dtype=jnp.float32 if what == "float32" else jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal())
    if what == "segments":
        spec = AttentionSpec(mask=masks.segments(jnp.zeros((2, 128), jnp.int32)))
    if what == "bias":
        spec = spec.replace(bias=jnp.zeros((1, 4, 128, 128)))
    cudnn_calls, kernels = lowered_calls(spec, q, k, v)
    assert not cudnn_calls
    assert kernels == {"fnattn_flash_fwd", "fnattn_flash_dq", "fnattn_flash_dkdv"}


def test_vmap_and_forward_mode_lower_with_cudnn(cudnn_present):
    q, k, v = (jnp.stack([x] * 3) for x in qkv())
    spec = AttentionSpec(mask=masks.causal())

    def loss(q, k, v):
        out = jax.vmap(lambda *a: fnattn.attention(spec, *a).out)(q, k, v)
        return jnp.sum(out.astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
    assert {CUDNN_FWD, CUDNN_BWD} <= set(re.findall(r"custom_call @([\w$]+)", text))
    # forward mode: cuDNN's forward, the blockwise XLA tangent pass
    text = jax.jit(lambda q, t: jax.jvp(lambda x: fnattn.attention(spec, x, k[0], v[0]).out,
                                        (q,), (t,))).trace(q[0], q[0]).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = set(re.findall(r"custom_call @([\w$]+)", text))
    assert CUDNN_FWD in calls and CUDNN_BWD not in calls


def test_without_cudnn_the_kernels_run():
    cudnn_calls, kernels = lowered_calls(AttentionSpec(mask=masks.causal()), *qkv())
    assert not cudnn_calls
    assert kernels == {"fnattn_flash_fwd", "fnattn_flash_dq", "fnattn_flash_dkdv"}


def test_backward_entry_point_is_the_known_one():
    # If a JAX release changes it, the Triton backward runs instead; this pins
    # the JAX in use to the fast path, naming what this release takes.
    assert cudnn.backward_available(), (
        f"jax {jax.__version__}: cuDNN's backward entry point takes {cudnn.bwd_signature()}, "
        "none of fnattn.flash.cudnn._BWD_SIGNATURES")


# ----------------------------------------------------------------------------------
# The wrapper, with cuDNN emulated
# ----------------------------------------------------------------------------------

def _visible(plan, B, Tq, Tk, kv_len):
    qi = jnp.arange(Tq)[:, None]
    kj = jnp.arange(Tk)[None, :]
    vis = jnp.ones((B, 1, Tq, Tk), bool)
    if plan.causal:
        vis &= kj <= qi
    if plan.left is not None:
        vis &= kj >= qi - plan.left
    if kv_len is not None:
        vis &= kj < kv_len[:, None, None, None]
    return vis


def _scores(q, k, scale):
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(B, Tq, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32))
    return s.reshape(B, Hq, Tq, -1) * scale


def _expand(x, Hq):  # (B, Tk, Hkv, D) -> (B, Hq, Tk, D)
    return jnp.repeat(jnp.swapaxes(x.astype(jnp.float32), 1, 2), Hq // x.shape[2], axis=1)


def emulated_forward(q, k, v, q_len, kv_len, *, scale, plan):
    """cuDNN's forward as its documentation states it; NaN where it is unspecified
    (rows past the query length, rows that see no key). Values multiply
    probabilities, as a kernel does: 0 * NaN is NaN."""
    B, Tq, Hq, _ = q.shape
    s = _scores(q, k, scale)
    vis = _visible(plan, B, Tq, k.shape[1], kv_len)
    stats = jax.nn.logsumexp(jnp.where(vis, s, -jnp.inf), axis=-1)
    p = jnp.where(vis, jnp.exp(s - stats[..., None]), 0.0)
    out = jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", p, _expand(v, Hq)), 1, 2)
    seen = jnp.any(vis, axis=-1)                                         # (B, 1, Tq)
    out = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], out, jnp.nan)
    stats = jnp.where(seen, stats, jnp.nan)
    if q_len is not None:
        live = jnp.arange(Tq)[None, :] < q_len[:, None]
        out = jnp.where(live[:, :, None, None], out, jnp.nan)
        stats = jnp.where(live[:, None, :], stats, jnp.nan)
    return out.astype(q.dtype), stats


def emulated_backward(q, k, v, q_len, kv_len, out, stats, d_out, *, scale, plan):
    """cuDNN's backward from its residuals, padding rows included in the
    arithmetic (what a wrapper must make harmless), NaN in their dq."""
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    s = _scores(q, k, scale)
    vis = _visible(plan, B, Tq, k.shape[1], kv_len)
    p = jnp.where(vis, jnp.exp(s - stats[..., None]), 0.0)
    do = jnp.swapaxes(d_out.astype(jnp.float32), 1, 2)                    # (B, Hq, Tq, D)
    dp = jnp.einsum("bhqd,bhkd->bhqk", do, _expand(v, Hq))
    delta = jnp.sum(do * jnp.swapaxes(out.astype(jnp.float32), 1, 2), axis=-1)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", ds, _expand(k, Hq)), 1, 2)
    qh = jnp.swapaxes(q.astype(jnp.float32), 1, 2)

    def per_kv(x):  # (B, Hq, Tk, D) -> (B, Tk, Hkv, D)
        return jnp.swapaxes(x.reshape(B, Hkv, Hq // Hkv, -1, D).sum(2), 1, 2)

    dk = per_kv(jnp.einsum("bhqk,bhqd->bhkd", ds, qh))
    dv = per_kv(jnp.einsum("bhqk,bhqd->bhkd", p, do))
    if q_len is not None:
        live = jnp.arange(Tq)[None, :] < q_len[:, None]
        dq = jnp.where(live[:, :, None, None], dq, jnp.nan)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(cudnn, "cudnn_forward", emulated_forward)
    monkeypatch.setattr(cudnn, "cudnn_backward", emulated_backward)
    monkeypatch.setattr(cudnn, "available", lambda: None)
    monkeypatch.setattr(cudnn, "FALLBACK", triton.INTERPRET_LOWERING)
    return (("default", cudnn.pick(triton.INTERPRET_LOWERING, triton.symbolic)),)


def fwd_and_grads(f, spec, q, k, v, through_lse):
    def loss(q, k, v):
        res = f(spec, q, k, v)
        w = jnp.cos(jnp.arange(res.out.size, dtype=jnp.float32)).reshape(res.out.shape)
        total = jnp.sum(res.out.astype(jnp.float32) * w)
        if through_lse:
            lse = jnp.where(jnp.isfinite(res.lse), res.lse, 0.0)
            total += jnp.sum(lse * jnp.sin(jnp.arange(lse.size, dtype=jnp.float32)).reshape(
                lse.shape))
        return total, res
    (_, res), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return res, grads


def check(table, spec, q, k, v, *, clean=None, through_lse=False, tol=5e-3):
    """The routed path on (q, k, v) against the reference on ``clean`` (the same
    arrays with finite values where the mask hides them)."""
    assert cudnn.route(cfg_of(spec, q, k), q.dtype, spec.mask, None, None)
    run = lambda *a: core.run(*a, fn="flash", table=table)  # noqa: E731
    res, grads = jax.jit(lambda *a: fwd_and_grads(run, *a, through_lse))(spec, q, k, v)
    ref, ref_grads = jax.jit(lambda *a: fwd_and_grads(fnattn.reference, *a, through_lse))(
        spec, *(clean or (q, k, v)))
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    assert res.out.dtype == q.dtype and res.lse.dtype == jnp.float32
    np.testing.assert_allclose(f32(res.out), f32(ref.out), atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isfinite(res.lse), np.isfinite(ref.lse))
    np.testing.assert_allclose(f32(res.lse), f32(ref.lse), atol=tol, rtol=tol)
    for name, g, gr in zip(("dq", "dk", "dv"), grads, ref_grads):
        g, gr = f32(g), f32(gr)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, gr, atol=tol * max(1.0, np.abs(gr).max()), rtol=tol,
                                   err_msg=name)
    return res


def cfg_of(spec, q, k):
    B, Tq, Hq, D = q.shape
    return Config(Dims(B, Tq, k.shape[1], Hq, k.shape[2], D, D), 1.0, spec.softcap,
                  spec.dropout_rate, None, spec.block_sizes)


SMALL = dict(B=2, T=24, Hq=4, Hkv=2, D=16, dtype=F16)


@pytest.mark.parametrize("mask", [None, masks.causal(), masks.sliding_window(5),
                                  masks.causal() & masks.sliding_window(4, 2)],
                         ids=["none", "causal", "window", "causal-window"])
def test_emulated_matches_reference(emulated, mask):
    check(emulated, AttentionSpec(mask=mask), *qkv(**SMALL))


def poison(x, live):
    """NaN where ``live`` (B, T) is False."""
    return jnp.where(live[:, :, None, None], x, jnp.asarray(jnp.nan, x.dtype))


@pytest.mark.parametrize("window", [None, 3])
def test_emulated_lengths_empty_rows_and_poisoned_padding(emulated, window):
    # Batch row 0: 17 queries, 0 keys (every row empty); row 1: 24 queries over
    # 9 keys (causal: rows past 9 + window see nothing).
    q_len, kv_len = jnp.array([17, 24]), jnp.array([0, 9])
    mask = masks.causal() & masks.lengths(q_len, kv_len)
    if window is not None:
        mask = mask & masks.sliding_window(window)
    q, k, v = qkv(**SMALL)
    live_q = jnp.arange(24)[None] < q_len[:, None]
    live_k = jnp.arange(24)[None] < kv_len[:, None]
    res = check(emulated, AttentionSpec(mask=mask),
                poison(q, live_q), poison(k, live_k), poison(v, live_k), clean=(q, k, v))
    assert np.all(np.asarray(res.out[0]) == 0) and np.all(np.isneginf(np.asarray(res.lse[0])))
    if window is not None:  # rows 12.. of batch row 1 see no key
        assert np.all(np.isneginf(np.asarray(res.lse[1, :, 12:])))
        assert np.isfinite(np.asarray(res.lse[1, :, :12])).all()


def test_emulated_cross_attention_with_lengths(emulated):
    q, k, v = qkv(**SMALL, Tk=40)
    check(emulated, AttentionSpec(mask=masks.lengths(jnp.array([24, 5]), jnp.array([40, 13]))),
          q, k, v)


def test_emulated_backward_through_lse_uses_the_kernels(emulated):
    with cheap_compiles():
        check(emulated, AttentionSpec(mask=masks.causal()), *qkv(**SMALL), through_lse=True)


def test_auto_table_on_cuda_is_the_router():
    (_, default), (_, cuda), (_, tpu) = lowering_table("auto", jnp.bfloat16)
    assert cuda.name == "flash-auto-cuda" and cuda.takes_absent_cotangents
    assert default.name != cuda.name != tpu.name


# ----------------------------------------------------------------------------------
# On an NVIDIA GPU
# ----------------------------------------------------------------------------------

GPU_MASKS = {
    "none": None,
    "causal": masks.causal(),
    "causal-window": masks.causal() & masks.sliding_window(256),
    "causal-lengths": masks.causal() & masks.lengths(jnp.array([1000, 2048]),
                                                     jnp.array([0, 1500])),
}


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", GPU_MASKS)
@pytest.mark.parametrize("through_lse", [False, True])
def test_gpu_cudnn_route_matches_kernels_and_reference(name, through_lse):
    q, k, v = qkv(B=2, T=2048, Hq=8, Hkv=2, D=128, dtype=jnp.bfloat16)
    spec = AttentionSpec(mask=GPU_MASKS[name])
    assert cudnn.route(cfg_of(spec, q, k), q.dtype, spec.mask, None, None)
    auto = lowering_table("auto", q.dtype)
    kernels = (("default", triton.LOWERING),)
    for table in (auto, kernels):
        check(table, spec, q, k, v, through_lse=through_lse, tol=3e-2)
    cudnn_calls, _ = lowered_calls(spec, q, k, v)
    assert cudnn_calls == {CUDNN_FWD, CUDNN_BWD}
