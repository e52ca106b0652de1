"""fnattn._functions: which user functions (``from_fn`` predicates and terms)
each Pallas backend compiles, and where impl="auto" sends those it cannot.

Each backend's set of primitives is lowered here in the flash kernels (forward
and backward, for cuda or tpu; ``.ci/lowering-jax-0.11`` repeats it under the
GPU machines' JAX, ``.ci/newest-jax`` under the newest), so a primitive in a set
is one the kernels were seen to compile; a function using anything else goes to the XLA lowering under
impl="auto" and is refused, naming the primitive, when a kernel is asked for.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fnattn
from fnattn import AttentionSpec, _functions, core, masks, position_bias, xla
from fnattn.flash import mosaic, mosaic_gpu, mosaic_gpu_bwd, triton
from lowering import gpu_target, tpu_target

F32 = jnp.float32
# Names that only some JAX versions have as primitives (jnp.log2 is log / log(2)
# before 0.11; pjit became jit).
VERSIONED = {"jit", "pjit", "log2", "one_minus_square"}


def _common(b, h, q, k, a):
    """Every primitive of ``_functions._COMMON``, on tiles and on the scalars
    ``b``, ``h`` and ``a`` (a ``select`` of scalars among them)."""
    d = (q - k).astype(F32)
    x = jnp.where(h % 2 == 0, a, -a) * (b + 1)
    x += jnp.where(((q > k) & (k >= 1)) | ((q == 3) ^ (k != 2)) | (q <= k - 7) | (q < 2),
                   1.0, 0.0)
    ints = (q << 1) + (k >> 2) + lax.shift_right_logical(q, 1) + (~q & 7) + (q - k) // 64
    x += a * ints.astype(F32) + jnp.maximum(q, k) - jnp.minimum(a, 1.0) + lax.clamp(0, q - k, 9)
    x += jnp.sign(d) * jnp.abs(a) - a * jnp.square(d) + a * d ** 3 - (a * a)
    x += jnp.exp(-a * jnp.abs(d)) + jnp.exp2(-a * jnp.abs(d)) + jnp.log(1.0 + a * jnp.abs(d))
    x += jnp.log2(1.0 + jnp.abs(d)) + jnp.tanh(a * d) + jax.nn.sigmoid(a * d) + jnp.sin(a * d)
    x += jnp.cos(a) + lax.rsqrt(1.0 + a * jnp.abs(d)) + a / (1.0 + jnp.abs(d))
    return x


def _triton_extra(b, h, q, k, a):
    d = jnp.abs(q - k).astype(F32)
    return (jnp.log1p(a * d) + jnp.sqrt(a * d) + (1.0 + d) ** a + jnp.floor(a * d)
            + jnp.ceil(a * d) + jnp.expm1(-a * d) + jnp.tan(a * d * 1e-3) + jnp.arctan(a * d)
            + jnp.cosh(a * d * 1e-3) + jax.nn.relu(a - d) + _common(b, h, q, k, a))


def _tpu_extra(b, h, q, k, a):
    d = jnp.abs(q - k).astype(F32)
    return (jnp.log1p(a * d) + jnp.sqrt(a * d) + (1.0 + d) ** a + jnp.floor(a * d)
            + jnp.ceil(a * d) + a * lax.erf(0.1 * d) + jnp.round(a * d) + jnp.tan(a * d * 1e-3)
            + jax.nn.relu(a - d) + _common(b, h, q, k, a))


def _learned_once(b, h, q, k, a):
    """The common set with its array's value used once (its tangent needs no
    add_any, which Mosaic GPU does not lower), under a tanh (whose tangent is
    one_minus_square under jax 0.11)."""
    return jnp.tanh(-(a * _common(b, h, q, k, 0.5)))


def _bool_not(b, h, q, k):
    return ~(k > q) & ~((q - k) % 3 == 1)


# (backend, probe, whether its kernels differentiate a term's arrays)
PROBES = {"triton": (_functions.TRITON, _triton_extra, True),
          "mosaic_tpu": (_functions.MOSAIC_TPU, _tpu_extra, True),
          "mosaic_gpu": (_functions.MOSAIC_GPU, _learned_once, True)}


@pytest.mark.parametrize("name", PROBES)
def test_probe_uses_every_primitive_of_the_backends_set(name):
    backend, fn, gradient = PROBES[name]
    used = _functions.primitives(position_bias.from_fn(fn, jnp.ones(4)),
                                 gradient and backend.gradient)
    assert used - VERSIONED <= backend.allowed
    assert backend.allowed - used <= VERSIONED | {"not (of booleans)"}
    assert _functions.refusals(position_bias.attach(None, position_bias.from_fn(
        fn, jnp.ones(4))), backend, gradient) == []
    if name == "mosaic_gpu":  # an array's value used twice: held fixed, not learned
        twice = position_bias.attach(None, position_bias.from_fn(_common, jnp.ones(4)))
        assert _functions.refusals(twice, backend) == []
        (why,) = _functions.refusals(twice, backend, True)
        assert "uses add_any" in why


def _lowered_grads(table, platform, term, mask=masks.causal(), *, wrt_arrays, block_sizes=None):
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)

    def loss(q, k, v, a):
        spec = AttentionSpec(mask=mask, position_bias=term(a), block_sizes=block_sizes)
        res = core.run(spec, q, k, v, fn="flash", table=table)
        return jnp.sum(res.out.astype(F32)) + jnp.sum(res.lse)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if wrt_arrays else (0, 1, 2)))
    with gpu_target() if platform == "cuda" else tpu_target():
        return grad.trace(q, kv, kv, jax.ShapeDtypeStruct((4,), F32)).lower(
            lowering_platforms=(platform,)).as_text()


def test_triton_kernels_lower_their_set():
    """Forward, dq (with the gradient of the term's array) and dk/dv, with a
    ``from_fn`` mask predicate using ``not`` of booleans beside the term."""
    pytest.importorskip("absl")
    table = (("default", xla.DENSE), ("cuda", triton.LOWERING))
    text = _lowered_grads(table, "cuda", lambda a: position_bias.from_fn(_triton_extra, a),
                          masks.from_fn(_bool_not), wrt_arrays=True)
    for name in ("fnattn_flash_fwd", "fnattn_flash_dq", "fnattn_flash_dkdv"):
        assert name in text


def test_mosaic_tpu_kernels_lower_their_set():
    table = (("default", xla.DENSE), ("tpu", mosaic.LOWERING))
    text = _lowered_grads(table, "tpu", lambda a: position_bias.from_fn(_tpu_extra, a),
                          masks.from_fn(_bool_not), wrt_arrays=True)
    assert set(re.findall(r'kernel_name = "(\w+)"', text)) == {
        "fnattn_flash_mosaic_fwd", "fnattn_flash_mosaic_dq", "fnattn_flash_mosaic_dkv"}


def _learned_erf(b, h, q, k, a):
    return lax.erf(a * (q - k).astype(F32) * 0.01)


def test_a_learned_erf_on_mosaic_tpu_follows_the_installed_jax():
    """The derivative of erf is jax's to write: jax 0.10 and 0.11 write it with
    exp (in the Mosaic TPU set), jax 0.12 with an exp of HIGHEST accuracy (which
    Mosaic TPU does not lower), bitcast_convert_type and polynomial. So a term
    learning an array through erf lowers in the Mosaic TPU kernels, or is
    refused naming what this jax's derivative uses, as the installed jax has it."""
    term = position_bias.from_fn(_learned_erf, jnp.ones(4))
    derivative = set()
    _functions._walk(jax.make_jaxpr(jax.grad(lax.erf))(1.0).jaxpr, derivative)
    missing = derivative - _functions.MOSAIC_TPU.allowed
    why = _functions.refusals(position_bias.attach(None, term), _functions.MOSAIC_TPU, True)
    table = (("default", xla.DENSE), ("tpu", mosaic.LOWERING))

    def lower():
        return _lowered_grads(table, "tpu", lambda a: position_bias.from_fn(_learned_erf, a),
                              wrt_arrays=True)
    if missing:
        (line,) = why
        assert all(p in line for p in missing), (line, missing)
        with pytest.raises(NotImplementedError, match=r"_learned_erf.* Mosaic TPU"):
            lower()
    else:
        assert why == []
        assert "fnattn_flash_mosaic_dq" in lower()
    # held fixed (no derivative), erf lowers under every jax
    assert _functions.refusals(position_bias.attach(None, term), _functions.MOSAIC_TPU) == []


def test_mosaic_gpu_kernels_lower_their_set():
    """The Mosaic GPU forward (and the Triton forward that recomputes its flagged
    rows) and backward: the common set with its array held fixed, and with
    the gradient of its array (the term's tangent tile, summed along the
    query rows)."""
    pytest.importorskip("absl")
    table = (("default", mosaic_gpu_bwd.LOWERING),)
    blocks = (mosaic_gpu.MosaicGpuBlockSizes(block_k=64), mosaic_gpu_bwd.MosaicGpuBwdBlockSizes())
    for fn, learned in ((_common, False), (_learned_once, True)):
        text = _lowered_grads(table, "cuda", lambda a: position_bias.from_fn(fn, a),
                              wrt_arrays=learned, block_sizes=blocks)
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
        assert "fnattn_flash_dq" not in text  # (no Triton backward)


def test_serving_kernels_lower_the_common_set():
    """The decode and paged kernels (Triton and Mosaic TPU) evaluate a term's
    function on their own tiles (rows of query heads)."""
    pytest.importorskip("absl")
    B, S, Hq, Hkv, D = 2, 256, 4, 2, 64
    q = jax.ShapeDtypeStruct((B, 1, Hq, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, Hkv, D), jnp.bfloat16)
    L = jax.ShapeDtypeStruct((B,), jnp.int32)
    spec = AttentionSpec(mask=masks.causal(), impl="pallas",
                         position_bias=position_bias.from_fn(_common, jnp.linspace(0, 1, Hq)))
    f = jax.jit(lambda q, k, v, L: fnattn.decode(spec, q, k, v, kv_lengths=L).out)
    with gpu_target():
        text = f.trace(q, kv, kv, L).lower(lowering_platforms=("cuda",)).as_text()
    assert "fnattn_decode" in text
    with tpu_target():
        text = f.trace(q, kv, kv, L).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


# ----------------------------------------------------------------------------------
# Routing and refusals
# ----------------------------------------------------------------------------------


def _erf(b, h, q, k, a):
    return -a * lax.erf(jnp.abs(q - k).astype(F32) / 64)


def _expm1(b, h, q, k, a):
    return a * jnp.expm1(-jnp.abs(q - k).astype(F32) / 64)


def _log1p(b, h, q, k, a):
    return -a * jnp.log1p(jnp.abs(q - k).astype(F32))


def _flash_text(spec, platform):
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    f = jax.jit(jax.grad(lambda q: jnp.sum(fnattn.flash(spec, q, q, q).out.astype(F32))))
    with gpu_target() if platform == "cuda" else tpu_target():
        return f.trace(q).lower(lowering_platforms=(platform,)).as_text()


def test_auto_lowers_what_a_kernel_cannot_compile_with_xla():
    """impl="auto": erf (no Triton lowering) runs on XLA for cuda and on the
    Mosaic TPU kernels for tpu; expm1 (no Mosaic TPU lowering) the reverse."""
    pytest.importorskip("absl")
    a = jnp.linspace(0.1, 1.0, 4)
    for fn, cuda_kernel, tpu_kernel in ((_erf, False, True), (_expm1, True, False)):
        spec = AttentionSpec(mask=masks.causal(), position_bias=position_bias.from_fn(fn, a))
        assert ("fnattn_flash_fwd" in _flash_text(spec, "cuda")) == cuda_kernel
        assert ("tpu_custom_call" in _flash_text(spec, "tpu")) == tpu_kernel


def test_kernels_asked_for_by_name_refuse_to_lower_naming_the_primitive():
    pytest.importorskip("absl")
    a = jnp.linspace(0.1, 1.0, 4)
    spec = AttentionSpec(mask=masks.causal(), impl="pallas",
                         position_bias=position_bias.from_fn(_erf, a))
    with pytest.raises(NotImplementedError, match=r"flash: the position term "
                       r"from_fn\(_erf, \.\.\.\) uses erf, which the Pallas Triton kernels do "
                       r"not compile .* impl='xla' computes it"):
        _flash_text(spec, "cuda")
    mask = masks.from_fn(lambda b, h, q, k: jnp.expm1(q - k) < 3)
    with pytest.raises(NotImplementedError, match=r"the mask predicate from_fn\(<lambda>\) "
                       r"uses expm1, which the Pallas Mosaic TPU kernels"):
        _flash_text(AttentionSpec(mask=mask, impl="pallas"), "tpu")
    # (the interpreter on a CPU computes anything)
    q = jnp.ones((1, 16, 4, 8))
    out = jax.jit(fnattn.flash)(spec, q, q, q).out
    ref = fnattn.reference(spec.replace(impl="xla"), q, q, q).out
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_serving_variants_lower_and_refuse_alike():
    """decode and paged attention: auto takes XLA for a term Triton cannot
    compile, and the kernel asked for by name refuses it."""
    pytest.importorskip("absl")
    B, S, Hq, Hkv, D = 2, 64, 4, 2, 32
    q = jax.ShapeDtypeStruct((B, 1, Hq, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, Hkv, D), jnp.bfloat16)
    L = jax.ShapeDtypeStruct((B,), jnp.int32)
    term = position_bias.from_fn(_erf, jnp.linspace(0.1, 1.0, Hq))

    def text(impl, platform):
        spec = AttentionSpec(impl=impl, position_bias=term)
        f = jax.jit(lambda q, k, v, L: fnattn.decode(spec, q, k, v, kv_lengths=L).out)
        with gpu_target() if platform == "cuda" else tpu_target():
            return f.trace(q, kv, kv, L).lower(lowering_platforms=(platform,)).as_text()

    assert "fnattn_decode" not in text("auto", "cuda")
    assert "tpu_custom_call" in text("auto", "tpu")
    with pytest.raises(NotImplementedError, match="decode: the position term .* uses erf"):
        text("pallas", "cuda")


def test_mosaic_gpu_takes_the_functions_it_compiles():
    """The Mosaic GPU kernels take a ``from_fn`` term or predicate of the common
    set, and refuse (impl="auto" then runs the Triton kernels) one using what
    Mosaic GPU does not lower, naming it."""
    from fnattn._checks import Dims
    from fnattn._dispatch import Config
    cfg = Config(Dims(1, 256, 256, 4, 2, 128, 128), 0.1, None, 0.0, None)
    a = jnp.linspace(0.1, 1.0, 4)
    ok = position_bias.attach(masks.causal(), position_bias.from_fn(_common, a))
    for kernel in (mosaic_gpu, mosaic_gpu_bwd):
        assert kernel.supports(cfg, jnp.bfloat16, ok, None, None) == []
        for bad, prim in ((position_bias.attach(None, position_bias.from_fn(_log1p, a)),
                           "log1p"),
                          (masks.from_fn(_bool_not), "not (of booleans)"),
                          (position_bias.attach(None, position_bias.from_fn(
                              lambda b, h, q, k, a: jax.nn.relu(a * (q - k)), a)),
                           "custom_jvp_call")):
            why = kernel.supports(cfg, jnp.bfloat16, bad, None, None)
            assert len(why) == 1 and f"uses {prim}, which the Pallas Mosaic GPU" in why[0], why


def test_functions_that_do_not_trace_on_tiles_are_trusted_nowhere():
    def reads_a_python_bool(b, h, q, k):
        return q > k if bool(h == 0) else q < k  # a tracer has no truth value
    mask = masks.from_fn(reads_a_python_bool)
    for backend in (_functions.TRITON, _functions.MOSAIC_TPU, _functions.MOSAIC_GPU):
        (why,) = _functions.refusals(mask, backend)
        assert "<untraceable>" in why


def test_scalars_reach_the_function_as_tiles():
    got = []

    def fn(b, h, q, k, a):
        got.append(tuple(jnp.shape(x) for x in (b, h, q, k, a)))
        return a * q

    term = position_bias.from_fn(fn, jnp.ones(2))
    pos = masks.Positions(b=jnp.int32(0), h=jnp.int32(1), q=jnp.zeros((4, 1), jnp.int32),
                          q_pos=jnp.zeros((4, 1), jnp.int32), k=jnp.zeros((1, 8), jnp.int32))
    out = jax.jit(lambda a: term.value(pos, [a]))(jnp.float32(2.0))
    assert got == [((4, 8), (4, 8), (4, 1), (1, 8), (4, 8))]
    assert out.shape == (4, 8)
