"""``fnattn.flash``: O(T)-memory attention with block-sparse skipping.

Lowerings, chosen per platform when the program is lowered
(:func:`fnattn._dispatch.select`; each branch is traced only for its platform):

========  ===========================================  ============================
platform  impl="auto"                                  impl="pallas"
========  ===========================================  ============================
cuda      cuDNN's fused attention for the specs it     Pallas Triton kernels
          computes exactly (fnattn/flash/cudnn.py,
          whose docstring has the routing table);
          on Hopper the Pallas Mosaic GPU forward
          and backward (fnattn/flash/mosaic_gpu.py,
          mosaic_gpu_bwd.py) for the specs they
          take (:func:`cuda_kernel`); the Pallas
          Triton kernels (fnattn/flash/triton) for
          the rest
tpu       Pallas Mosaic kernels (fnattn/flash/mosaic)  the same
other     blockwise XLA loops (fnattn/flash/xla.py)    Triton kernels, interpreted
========  ===========================================  ============================

float64 inputs (with ``jax_enable_x64``) are computed in float64 by the XLA
lowering on every platform under impl="auto"; the Pallas kernels compute in
float32, so impl="pallas" refuses float64.
"""

import dataclasses
import functools

import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, core
from fnattn.flash import blocks, cudnn, mosaic, mosaic_gpu, mosaic_gpu_bwd, triton, xla
from fnattn.reference import reference
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["cuda_kernel", "flash", "lowering_table"]


def lowering_table(impl: str, dtype=None):
    """The (platform, lowering) pairs for ``impl`` (and the inputs' ``dtype``).

    Every lowering's tangent pass (forward-mode differentiation) is the blockwise
    XLA one (:func:`fnattn.flash.xla.tangent`), on every platform.
    """
    return tuple((plat, _with_tangent(low)) for plat, low in _table(impl, dtype))


@functools.lru_cache(maxsize=None)
def _with_tangent(low):
    return low if low.jvp is not None else dataclasses.replace(low, jvp=xla.tangent)


def _table(impl: str, dtype):
    if dtype is not None and jnp.dtype(dtype) == jnp.float64:
        if impl == "pallas":
            raise NotImplementedError(
                "flash: float64 inputs are not supported by impl='pallas' (the Triton and "
                "Mosaic kernels compute in float32); impl='auto' or 'xla' compute float64 in "
                "float64 on every platform, or cast q, k and v to float32.")
        if impl in ("auto", "xla"):
            return (("default", xla.LOWERING),)
    if impl == "auto":
        return (("default", xla.LOWERING), ("cuda", _cuda_auto()),
                ("tpu", _auto(mosaic.LOWERING, mosaic.needs_xla)))
    if impl == "xla":
        return (("default", xla.LOWERING),)
    if impl == "pallas":
        # Elsewhere the Triton kernels run in Pallas interpret mode (slow; for
        # testing the kernels on a CPU).
        return (("default", triton.INTERPRET_LOWERING), ("cuda", triton.LOWERING),
                ("tpu", mosaic.LOWERING))
    if impl == "cudnn":
        raise NotImplementedError(
            "flash: impl='cudnn' is not a flash lowering; use "
            "fnattn.attention(AttentionSpec(impl='cudnn'), ...).")
    raise ValueError(f"flash: no lowering for impl={impl!r}")


@functools.lru_cache(maxsize=None)
def _cuda_auto():
    return _with_tangent(cudnn.pick(cuda_kernel, triton.needs_xla))


def cuda_kernel(cfg, q, bias, sinks, mask):
    """The Pallas lowering impl="auto" runs on cuda where cuDNN does not.

    * ``TritonBlockSizes`` in the spec: the Triton kernels;
    * on a Hopper GPU, for the specs the Mosaic GPU forward takes
      (:func:`fnattn.flash.mosaic_gpu.route`): that forward, with the Mosaic GPU
      backward (:mod:`fnattn.flash.mosaic_gpu_bwd`) where
      :func:`fnattn.flash.mosaic_gpu_bwd.route` says so (D <= 128 without
      dropout or a position term, or ``MosaicGpuBwdBlockSizes`` in the spec),
      else with the Triton backward;
    * else the Triton kernels.

    On a machine without a Hopper GPU (this one, when the doctests run) every
    spec gets the Triton kernels:

    >>> from fnattn import masks
    >>> from fnattn._checks import Dims
    >>> from fnattn._dispatch import Config
    >>> cfg = Config(Dims(1, 256, 256, 4, 4, 128, 128), 128 ** -0.5, None, 0.0, None)
    >>> q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    >>> cuda_kernel(cfg, q, None, None, masks.causal()).name
    'flash-triton'
    """
    if blocks.pick(cfg.block_sizes, triton.TritonBlockSizes, None) is not None or \
            not mosaic_gpu.route(cfg, q.dtype, mask, bias, sinks):
        return triton.LOWERING
    if mosaic_gpu_bwd.route(cfg, q.dtype, mask, bias, sinks):
        return mosaic_gpu_bwd.LOWERING
    return mosaic_gpu.LOWERING


@functools.lru_cache(maxsize=None)
def _auto(kernel, needs_xla):
    """impl="auto" on a GPU or TPU: the ``kernel`` lowering, or the XLA one where
    ``needs_xla(cfg)`` says the kernel cannot take the call (symbolic sizes for
    ``jax.export``, a ``from_fn`` function its backend does not compile)."""
    def pick(cfg):
        return xla.LOWERING if needs_xla(cfg) else kernel
    return dataclasses.replace(kernel, fwd=lambda cfg, *a: pick(cfg).fwd(cfg, *a),
                               bwd=lambda cfg, *a: pick(cfg).bwd(cfg, *a))


@_checks.entry_point("fnattn.flash")
@jaxtyped(typechecker=beartype)
def flash(spec: AttentionSpec, q: Shaped[Array, "_ _ _ _"], k: Shaped[Array, "_ _ _ _"],
          v: Shaped[Array, "_ _ _ _"]) -> AttentionOutput:
    """Flash attention: the whole spec in O(T) memory, skipping empty mask tiles.

    Same arguments, shapes and results as :func:`fnattn.attention`. ``spec.impl``
    selects the lowering: "auto" (per platform, see the module docstring), "xla"
    (the blockwise XLA loops everywhere), "pallas" or "reference".
    Block sizes come from ``spec.block_sizes`` (e.g. ``XlaBlockSizes``) or the
    lowering's defaults.

    >>> import jax, jax.numpy as jnp
    >>> import fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> q = jax.random.normal(jax.random.key(0), (1, 100, 4, 16))
    >>> k = v = jax.random.normal(jax.random.key(1), (1, 100, 2, 16))
    >>> spec = AttentionSpec(mask=masks.causal(), block_sizes=fnattn.XlaBlockSizes(32, 32))
    >>> res = jax.jit(fnattn.flash)(spec, q, k, v)
    >>> ref = fnattn.reference(spec, q, k, v)
    >>> bool(jnp.allclose(res.out, ref.out, atol=1e-5))
    True
    """
    if spec.impl == "reference":
        return reference(spec, q, k, v)
    return core.run(spec, q, k, v, fn="flash", table=lowering_table(spec.impl, q.dtype))
