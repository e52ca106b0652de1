"""``fnattn.tune``: block sizes measured on this machine.

Every blockwise lowering reads its tiles and launch parameters from the spec's
``block_sizes`` (:class:`fnattn.XlaBlockSizes`, :class:`fnattn.TritonBlockSizes`,
:class:`fnattn.MosaicGpuBlockSizes`, ...), whose defaults were measured on a
few machines. :func:`autotune` times candidates for one call on the device that
holds its arrays and returns the spec with the fastest. That spec is used like
any other (under ``jit``, ``grad``, ``vmap``, ``shard_map``). Block sizes
change speed, never results: every candidate computes the same function.

**The search** goes by stages, each varying a few parameters of the best
candidate so far (for flash on an NVIDIA GPU: the forward kernel's tile and
launch, choosing between the Triton and, on Hopper, the Mosaic GPU kernels;
then the dq kernel's; then the dk/dv kernel's; for decode and paged attention
the split count, the Triton kernel's launch and, on Hopper, the Mosaic GPU
decode kernel's block and ring, the faster kernel winning), so that a tuning
compiles tens of programs, not the product of every grid. The first candidate is the spec as
given, and the search's winner replaces it only after beating it again head to
head (``2 * reps`` calls each, alternating), so that one lucky timing does not
replace what you passed.
:func:`plan` shows what a tuning would vary without running anything.

**What is measured**: ``jax.jit`` of the call (``backward=False``) or of the
gradient of ``sum(out)`` with respect to the floating-point positional arrays
(``backward=True``: forward and backward together), compiled once per
candidate; after a warm-up call, the median time per call of ``reps`` batches
of calls issued back to back (about 10 ms of work each, so that a short
kernel's time is not its dispatch's). A candidate
that fails to lower, compile or run (a tile the kernel refuses, shared memory
exceeded) is recorded with its error and skipped.

**Caching.** Results are kept for the process, and in a JSON file when
``cache=`` names one (written atomically, merged with what the file holds).
The key is the device kind, the JAX and fnattn versions, the variant, the
direction (forward, or forward and backward), the spec's static configuration
(block sizes excepted) and the shape and dtype of every array. A later call
with the same key returns the stored block sizes without timing
(``Tuned.cached``); ``retune=True`` measures again. A mask holding a Python
function (:func:`fnattn.masks.from_fn`) is keyed by that function object, so
its results hold within one process only.

>>> import jax, jax.numpy as jnp, fnattn
>>> from fnattn import AttentionSpec, masks, tune
>>> q = k = v = jnp.ones((1, 128, 2, 16))
>>> spec = AttentionSpec(mask=masks.causal())
>>> tuned = tune.autotune(fnattn.flash, spec, q, k, v, reps=1)
>>> tuned.lowering   # on a CPU
'flash: blockwise XLA'
>>> jax.jit(fnattn.flash)(tuned.spec, q, k, v).out.shape
(1, 128, 2, 16)
"""

import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fnattn.flash import blocks

__all__ = ["Plan", "Stage", "Target", "Trial", "Tuned", "autotune", "plan"]

Candidate = tuple  # block-size objects of the tuned family; () is the spec as given


# ----------------------------------------------------------------------------------
# Where, what and how
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a tuning measures on.

    Attributes:
      platform: "cpu", "cuda", "rocm", "tpu" or another JAX platform name; the
        lowering that runs there decides which block sizes are tuned.
      device_kind: e.g. "NVIDIA H100 80GB HBM3"; part of the cache key.
      hopper: an NVIDIA GPU of compute capability 9.x, where flash's Mosaic GPU
        kernels are candidates beside the Triton ones.

    >>> Target.of(jnp.zeros(3)).platform
    'cpu'
    """

    platform: str
    device_kind: str = ""
    hopper: bool = False

    @classmethod
    def of(cls, x) -> "Target":
        """The device holding the array ``x`` (any one of its devices)."""
        dev = min(x.devices(), key=lambda d: d.id)
        platform = dev.platform
        if platform == "gpu":
            version = str(getattr(dev.client, "platform_version", "")).lower()
            platform = "rocm" if "rocm" in version or "hip" in version else "cuda"
        cap = str(getattr(dev, "compute_capability", ""))
        return cls(platform, str(dev.device_kind), platform == "cuda" and cap.startswith("9"))


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of the search: ``propose(best)`` gives the candidates to time
    beside ``best``, the best candidate of the stages before."""

    name: str
    propose: Callable[[Candidate], Sequence[Candidate]]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a tuning varies.

    Attributes:
      lowering: the lowering (or lowerings) the candidates configure, in words.
      family: the block-size types a candidate sets; the spec's entries of these
        types are replaced, its other entries (other platforms') kept.
      stages: the search, in order.
      given: the spec as given, spelled out as a candidate, where the defaults
        are known exactly (a proposal equal to it is not timed twice).
    """

    lowering: str
    family: tuple
    stages: tuple
    given: Optional[Candidate] = None

    def candidates(self, best: Candidate = ()) -> list:
        """Every stage's proposals from ``best``, in order (for inspection)."""
        return [c for s in self.stages for c in s.propose(best)]


@dataclasses.dataclass(frozen=True)
class Trial:
    """One measured candidate.

    Attributes:
      stage: the stage that proposed it ("given" for the spec as passed).
      block_sizes: the candidate's block-size objects (() for the spec as given).
      seconds: median seconds per call, or None when it failed.
      error: why it failed ("ExceptionType: first line"), or None.
    """

    stage: str
    block_sizes: tuple
    seconds: Optional[float]
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Tuned:
    """The result of :func:`autotune`.

    Attributes:
      spec: the spec with the fastest block sizes (its other fields unchanged).
      block_sizes: the winning entries of the tuned family (() when the spec as
        given was fastest).
      seconds: the winner's median seconds per call.
      baseline_seconds: the spec as given, measured in the same run.
      trials: every candidate timed, in order (empty when ``cached``).
      cached: the result came from the cache, nothing was timed.
      lowering: :attr:`Plan.lowering`.
      complete: False when ``max_seconds`` ran out before the search's end.
    """

    spec: Any
    block_sizes: tuple
    seconds: Optional[float]
    baseline_seconds: Optional[float]
    trials: tuple
    cached: bool
    lowering: str
    complete: bool = True

    @property
    def speedup(self) -> Optional[float]:
        """``baseline_seconds / seconds``."""
        if not self.seconds or self.baseline_seconds is None:
            return None
        return self.baseline_seconds / self.seconds

    def report(self) -> str:
        """A markdown table of the trials, fastest first, failures last."""
        lines = [f"lowering: {self.lowering}; " + (
            "from the cache" if self.cached else
            f"{len(self.trials)} trials, best {_ms(self.seconds)} ms against "
            f"{_ms(self.baseline_seconds)} as given"
            + ("" if self.complete else "; stopped early: max_seconds ran out")),
            "", "| stage | block sizes | ms | error |", "|---|---|---|---|"]
        ok = sorted((t for t in self.trials if t.seconds is not None), key=lambda t: t.seconds)
        for t in ok + [t for t in self.trials if t.seconds is None]:
            sizes = ", ".join(map(repr, t.block_sizes)) or "(as given)"
            lines.append(f"| {t.stage} | {sizes} | {_ms(t.seconds)} | {t.error or ''} |")
        return "\n".join(lines)


def _ms(s):
    return "—" if s is None else f"{1e3 * s:.3f}"


# ----------------------------------------------------------------------------------
# Plans per variant and platform
# ----------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _capped(values, length, floor):
    """``values`` not above the smallest power of two >= ``length`` (>= floor):
    larger tiles are clamped to the sequence by every lowering, so they repeat."""
    cap = max(floor, _pow2(length))
    return [x for x in values if x <= cap]


def _variants():
    import fnattn
    return {fnattn.flash: "flash", fnattn.attention: "attention", fnattn.decode: "decode",
            fnattn.decode_with_update: "decode_with_update",
            fnattn.paged_attention: "paged_attention",
            fnattn.ragged_paged_attention: "ragged_paged_attention",
            fnattn.ragged_paged_attention_with_update: "ragged_paged_attention_with_update"}


def _variant(fn) -> str:
    for f, name in _variants().items():
        if fn is f:
            return name
    raise TypeError(
        "autotune: fn must be one of fnattn's variants ("
        + ", ".join(f"fnattn.{n}" for n in _variants().values())
        + f"), whose block sizes this module knows; got {getattr(fn, '__name__', fn)!r}. "
        "For another function pass candidates=[...] and the variant it calls.")


def plan(fn, spec, *args, kwargs: Optional[Mapping] = None, target: Optional[Target] = None,
         backward: bool = False, candidates: Optional[Sequence] = None) -> Plan:
    """What :func:`autotune` would vary for ``fn(spec, *args, **kwargs)``.

    Args:
      fn: an fnattn variant (``fnattn.flash``, ``fnattn.attention``,
        ``fnattn.decode``, ``fnattn.paged_attention``, ...).
      spec: the call's :class:`fnattn.AttentionSpec`.
      *args: the call's positional arrays, as they will be passed.
      kwargs: the call's keyword arguments.
      target: the device (default: the one holding the first array argument).
      backward: whether the backward kernels' parameters are tuned too.
      candidates: block-size objects (or tuples of them) to time instead of
        the built-in search; one stage, "candidates".

    >>> import fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> q = jnp.zeros((1, 512, 8, 64), jnp.bfloat16)
    >>> p = plan(fnattn.flash, AttentionSpec(mask=masks.causal()), q, q, q,
    ...          target=Target("cuda", "NVIDIA H100 80GB HBM3", hopper=True))
    >>> p.lowering
    'flash: Pallas Triton or Mosaic GPU kernels'
    >>> [s.name for s in p.stages], len(p.stages[0].propose(()))
    (['forward'], 44)
    """
    variant = _variant(fn)
    kwargs = dict(kwargs or {})
    if target is None:
        target = Target.of(_first_array(args, kwargs))
    if candidates is not None:
        return _explicit(variant, spec, candidates)
    if variant in ("flash", "attention"):
        return _flash_plan(variant, spec, args, target, backward)
    if variant in ("decode", "decode_with_update"):
        return _decode_plan(variant, spec, args, target)
    return _paged_plan(variant, spec, args, target)


def _explicit(variant, spec, candidates) -> Plan:
    from fnattn.spec import _is_block_sizes
    cands = []
    for c in candidates:
        c = c if isinstance(c, tuple) else (c,)
        if not c or not all(_is_block_sizes(b) for b in c):
            raise TypeError(
                "autotune: every candidate must be a block-size object (fnattn.XlaBlockSizes, "
                "TritonBlockSizes, ...) or a non-empty tuple of them; got " + repr(c))
        cands.append(c)
    if not cands:
        raise ValueError("autotune: candidates is empty; pass None for the built-in search")
    family = tuple(dict.fromkeys(type(b) for c in cands for b in c))
    return Plan(f"{variant}: the given candidates", family,
                (Stage("candidates", lambda best: cands),))


def _first_array(args, kwargs):
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, jax.Array):
            return x
    raise TypeError("autotune: the call has no jax.Array argument to tell the device from; "
                    "pass target=Target(...)")


def _flash_plan(variant, spec, args, target, backward) -> Plan:
    from fnattn import _dispatch, position_bias
    from fnattn.flash import cudnn, mosaic, mosaic_gpu, mosaic_gpu_bwd, triton, xla
    from fnattn.reference import prepare

    if len(args) != 3:
        raise TypeError(f"autotune: {variant} takes (spec, q, k, v); got {len(args)} arrays "
                        "after the spec")
    if spec.impl in ("reference", "cudnn") or (variant == "attention" and spec.impl == "xla"):
        raise ValueError(
            f"autotune: fnattn.{variant} with impl={spec.impl!r} has no block sizes to tune; "
            "the blockwise lowerings run under impl='auto' (or 'pallas', or flash's 'xla')")
    q, k, v = args
    dims, qb, _, _, scale, _ = prepare(spec, q, k, v, variant)
    platform = target.platform
    f64 = jnp.dtype(q.dtype) == jnp.float64
    blockwise_xla = f64 or spec.impl == "xla" or platform not in ("cuda", "tpu")
    if blockwise_xla and spec.impl == "pallas" and not f64:
        raise ValueError(
            f"autotune: impl='pallas' on {platform!r} runs the Triton kernels in interpret "
            "mode (for testing kernels), whose speed means nothing; tune impl='auto'")

    if blockwise_xla:
        base = xla.XlaBlockSizes.default(dims)

        def fwd(best):
            b = blocks.pick(best, xla.XlaBlockSizes, base)
            return [(dataclasses.replace(b, block_q=bq, block_k=bk),)
                    for bq in _capped((64, 128, 256, 512), dims.q_len, 64)
                    for bk in _capped((128, 256, 512), dims.kv_len, 128)]

        def bwd(best):
            b = blocks.pick(best, xla.XlaBlockSizes, base)
            return [(dataclasses.replace(b, block_q_bwd=bq, block_k_bwd=bk),)
                    for bq in _capped((64, 128, 256), dims.q_len, 64)
                    for bk in _capped((256, 512, 1024), dims.kv_len, 256)]

        stages = (Stage("forward", fwd),) + ((Stage("backward", bwd),) if backward else ())
        given = (blocks.pick(spec.block_sizes, xla.XlaBlockSizes, base),)
        return Plan(f"{variant}: blockwise XLA", (xla.XlaBlockSizes,), stages, given)

    if platform == "tpu":
        base = mosaic.MosaicBlockSizes.default(dims, q.dtype)
        grid = (128, 256, 512, 1024)

        def tiles(fq, fk):
            def propose(best):
                b = blocks.pick(best, mosaic.MosaicBlockSizes, base)
                return [(dataclasses.replace(b, **{fq: bq, fk: bk}),)
                        for bq in _capped(grid, dims.q_len, 128)
                        for bk in _capped(grid, dims.kv_len, 128)]
            return propose

        stages = (Stage("forward", tiles("block_q", "block_k")),)
        if backward:
            stages += (Stage("dq", tiles("block_q_dq", "block_k_dq")),
                       Stage("dkv", tiles("block_q_dkv", "block_k_dkv")))
        return Plan(f"{variant}: Pallas Mosaic (TPU) kernels", (mosaic.MosaicBlockSizes,), stages,
                    (blocks.pick(spec.block_sizes, mosaic.MosaicBlockSizes, base),))

    # cuda
    mask = position_bias.attach(spec.mask, spec.position_bias, constant=False)
    treedef = jax.tree_util.tree_structure(mask)
    cfg = _dispatch.Config(dims=dims, scale=scale, softcap=spec.softcap,
                           dropout_rate=float(spec.dropout_rate), mask_treedef=treedef,
                           block_sizes=spec.block_sizes)
    if spec.impl == "auto" and cudnn.route(cfg, qb.dtype, mask, spec.bias, spec.sinks):
        raise ValueError(
            "autotune: on this GPU impl='auto' runs this spec on cuDNN (fnattn/flash/cudnn.py "
            "routes it), which has no block sizes; tune impl='pallas' to time fnattn's kernels")
    with_mosaic = (spec.impl == "auto" and target.hopper and not mosaic_gpu.supports(
        cfg, qb.dtype, mask, spec.bias, spec.sinks))
    D, item = mosaic_gpu.kernel_dim(dims), jnp.dtype(q.dtype).itemsize  # (its padded dim)
    n_rows, n_cols = mosaic_gpu.array_counts(mask) if with_mosaic else (0, 0)
    T = triton.TritonBlockSizes

    def tiles16(pairs):   # (Triton clamps tiles to the padded sequence, 16 at least)
        return [(a, b) for a, b in pairs
                if a <= max(16, _pow2(dims.q_len)) and b <= max(16, _pow2(dims.kv_len))]

    def fwd(best):
        out = [(T(block_q=bq, block_k=bk, num_warps=w, num_stages=s),)
               for bq, bk in tiles16(((128, 64), (128, 128), (64, 64), (64, 128), (128, 32)))
               for w in (4, 8) for s in (2, 3)]
        if with_mosaic:
            M = mosaic_gpu.MosaicGpuBlockSizes
            out += [(m,) for bq in (64, 128) for bk in (64, 128) for steps in (2, 3, 4)
                    for persistent in (False, True)
                    for m in [M(block_q=bq, block_k=bk, max_concurrent_steps=steps,
                                persistent=persistent)]
                    if m.smem_bytes(D, item, row_arrays=n_rows,
                                    key_arrays=n_cols) <= mosaic_gpu.SMEM_BYTES]
        return out

    def triton_bwd(kernel, pairs):
        def propose(best):
            b = blocks.pick(best, T, None)
            if b is None:   # the best forward is not Triton's: its backward is not either
                return []
            return [(dataclasses.replace(b, **{f"block_q_{kernel}": bq, f"block_k_{kernel}": bk,
                                               f"num_warps_{kernel}": w,
                                               f"num_stages_{kernel}": s}),)
                    for bq, bk in tiles16(pairs) for w in (4, 8) for s in (2, 3)]
        return propose

    def mosaic_bwd(best):
        m = blocks.pick(best, mosaic_gpu.MosaicGpuBlockSizes, None)
        if m is None:
            return []
        rings = (mosaic_gpu_bwd.MosaicGpuBwdBlockSizes(max_concurrent_steps=s) for s in (2, 3, 4))
        return [(m, b) for b in rings if b.smem_bytes(
            D, item, row_arrays=n_rows, key_arrays=n_cols) <= mosaic_gpu.SMEM_BYTES]

    stages = (Stage("forward", fwd),)
    if backward:
        stages += (Stage("dq", triton_bwd("dq", ((128, 64), (64, 64), (64, 128), (128, 128),
                                                (128, 32)))),
                   Stage("dkdv", triton_bwd("dkdv", ((64, 128), (64, 64), (128, 128),
                                                    (32, 128), (128, 64)))))
        if with_mosaic:
            stages += (Stage("mosaic backward", mosaic_bwd),)
    family = (T, mosaic_gpu.MosaicGpuBlockSizes, mosaic_gpu_bwd.MosaicGpuBwdBlockSizes)
    kernels = "Pallas Triton or Mosaic GPU kernels" if with_mosaic else "Pallas Triton kernels"
    return Plan(f"{variant}: {kernels}", family, stages)


def _decode_plan(variant, spec, args, target) -> Plan:
    from fnattn.decoding import DecodeBlockSizes

    # (spec, q, k_cache, ...) or, with the update, (spec, q, k_new, v_new, k_cache, ...)
    cache = 1 if variant == "decode" else 3
    if len(args) <= cache or not hasattr(args[cache], "shape") or len(args[cache].shape) != 4:
        raise TypeError(f"autotune: fnattn.{variant}'s k_cache must be its positional argument "
                        f"{cache + 1} after the spec, a 4-d array")
    S = args[cache].shape[1 if spec.layout == "bthd" else 2]

    def splits(best):
        b = blocks.pick(best, DecodeBlockSizes, DecodeBlockSizes())
        return [(dataclasses.replace(b, num_splits=n),) for n in (1, 2, 4, 8, 16, 32, 64)
                if S % n == 0 and S // n >= 16]

    def launch(best):
        b = blocks.pick(best, DecodeBlockSizes, DecodeBlockSizes())
        return [(dataclasses.replace(b, block_k=bk, num_warps=w, num_stages=s),)
                for bk in (32, 64, 128, 256) for w in (4, 8) for s in (2, 3)]

    stages = (Stage("splits", splits),)
    family, kernels = (DecodeBlockSizes,), "split-K decode"
    if target.platform == "cuda":
        stages += (Stage("launch", launch),)
        q = args[0]
        k, v = args[cache], args[cache + 1] if len(args) > cache + 1 else args[cache]
        if target.hopper and _decode_on_mosaic_gpu(spec, q, k, v):
            family += (_mosaic_gpu_decode_sizes(),)
            stages += (Stage("mosaic gpu", _mosaic_gpu_decode_stage(DecodeBlockSizes, q, k, v)),)
            kernels += " (Triton or Mosaic GPU kernel)"
    return Plan(f"{variant}: {kernels}", family, stages)


def _mosaic_gpu_decode_sizes():
    from fnattn.decoding.mosaic_gpu import MosaicGpuDecodeBlockSizes
    return MosaicGpuDecodeBlockSizes


def _decode_on_mosaic_gpu(spec, q, k, v) -> bool:
    """Whether the Mosaic GPU decode kernel takes ``fnattn.decode``'s call
    (:func:`fnattn.decoding.mosaic_gpu.supports`, from shapes)."""
    from fnattn.decoding import api
    from fnattn.decoding import mosaic_gpu as dm

    def bthd(x):
        shape = tuple(x.shape)
        if spec.layout == "bhtd":
            shape = (shape[0], shape[2], shape[1], shape[3])
        return jax.ShapeDtypeStruct(shape, x.dtype)

    tree = jax.tree_util.tree_structure
    cfg = api.Cfg(scale=1.0, softcap=spec.softcap, num_splits=None,
                  mask_treedef=None if spec.mask is None else tree(spec.mask),
                  term_treedef=None if spec.position_bias is None else tree(spec.position_bias))
    return not dm.supports(cfg, bthd(q), bthd(k), bthd(v))


def _mosaic_gpu_decode_stage(splits_type, q, k, v):
    """Proposes the Mosaic GPU decode kernel (:mod:`fnattn.decoding.mosaic_gpu`,
    and its paged producer) at every block and ring depth that fits shared
    memory, beside the best split count so far (``splits_type``:
    ``DecodeBlockSizes`` or ``PagedBlockSizes``)."""
    from fnattn.decoding import mosaic_gpu as dm
    M = dm.MosaicGpuDecodeBlockSizes
    D, Dv, item = q.shape[-1], v.shape[-1], jnp.dtype(k.dtype).itemsize

    def fits(m):
        try:
            dm.plan(D, Dv, 1024, m, item)
        except ValueError:
            return False
        return True

    def propose(best):
        b = blocks.pick(best, splits_type, splits_type())
        keep = splits_type(num_splits=b.num_splits)
        return [(keep, m) for bk in (64, 128) for steps in (2, 3, 4)
                for m in [M(block_k=bk, max_concurrent_steps=steps)] if fits(m)]
    return propose


def _paged_plan(variant, spec, args, target) -> Plan:
    from fnattn.paged import PagedBlockSizes

    def field(name, values):
        def propose(best):
            b = blocks.pick(best, PagedBlockSizes, PagedBlockSizes())
            return [(dataclasses.replace(b, **{name: x}),) for x in values]
        return propose

    stages = ()
    if variant != "paged_attention":
        stages += (Stage("block_q", field("block_q", (8, 16, 32, 64, 128))),)
    stages += (Stage("block_k", field("block_k", (16, 32, 64, 128, 256, 512))),
               Stage("splits", field("num_splits", (1, 2, 4, 8, 16))))
    if target.platform == "cuda":
        def launch(best):
            b = blocks.pick(best, PagedBlockSizes, PagedBlockSizes())
            return [(dataclasses.replace(b, num_warps=w, num_stages=s),)
                    for w in (2, 4, 8) for s in (1, 2, 3)]
        stages += (Stage("launch", launch),)
    family, kernels = (PagedBlockSizes,), "paged kernels"
    # (spec, q, k_pages, v_pages, ...) or, with the update, (spec, q, k, v, k_pages, ...)
    pools = 3 if variant.endswith("_with_update") else 1
    if target.hopper and len(args) > pools + 1 and all(
            hasattr(x, "shape") and len(x.shape) == 4 for x in args[pools:pools + 2]):
        kp, vp = args[pools], args[pools + 1]
        if (jnp.dtype(kp.dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
                and kp.shape[-1] % 64 == 0 and vp.shape[-1] % 64 == 0):
            # (the kernel's other limits, page size and rows, show as failed trials)
            family += (_mosaic_gpu_decode_sizes(),)
            stages += (Stage("mosaic gpu", _mosaic_gpu_decode_stage(
                PagedBlockSizes, args[0], kp, vp)),)
            kernels += " (Triton or Mosaic GPU)"
    return Plan(f"{variant}: {kernels}", family, stages)


# ----------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------


def _with(spec, family, cand):
    """``spec`` whose entries of ``family`` are ``cand`` (() keeps the spec's own)."""
    if cand == ():
        return spec
    others = tuple(b for b in blocks.entries(spec.block_sizes) if not isinstance(b, family))
    return spec.replace(block_sizes=others + tuple(cand))


def _is_array(x):
    return isinstance(x, (jax.Array, np.ndarray))


def _program(fn, args, kwargs, backward):
    """(jitted f(spec, arrays, kwarrays), arrays, kwarrays): non-array arguments
    are closed over (static), arrays passed."""
    pos = [i for i, a in enumerate(args) if _is_array(a)]
    kpos = [n for n, a in kwargs.items() if _is_array(a)]
    arrays = [args[i] for i in pos]
    kwarrays = {n: kwargs[n] for n in kpos}

    def call(spec, arrays, kwarrays):
        a = list(args)
        for i, x in zip(pos, arrays):
            a[i] = x
        kw = dict(kwargs, **kwarrays)
        return fn(spec, *a, **kw)

    if not backward:
        return jax.jit(call), arrays, kwarrays
    diff = [j for j, x in enumerate(arrays) if jnp.issubdtype(x.dtype, jnp.floating)]

    def loss(d, spec, arrays, kwarrays):
        arrays = list(arrays)
        for j, x in zip(diff, d):
            arrays[j] = x
        res = call(spec, arrays, kwarrays)
        out = res.out if hasattr(res, "out") else jax.tree_util.tree_leaves(res)[0]
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.grad(loss)
    return (jax.jit(lambda spec, arrays, kwarrays: grad([arrays[j] for j in diff], spec,
                                                         arrays, kwarrays)),
            arrays, kwarrays)


def _lower(program, spec, arrays, kwarrays):
    return program.lower(spec, arrays, kwarrays)


def _time(compiled, spec, arrays, kwarrays, reps):
    """Median seconds per call of a compiled program over ``reps`` batches.

    A batch issues its calls back to back and waits for the last one only (as a
    training or serving loop does), with as many calls as make about 10 ms of
    work (1 to 64): a short kernel is then timed, not the host's dispatch and
    wait around it.
    """
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(spec, arrays, kwarrays))
    n = max(1, min(64, int(0.01 / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            out = compiled(spec, arrays, kwarrays)   # (an earlier out is freed when done)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def _error(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (f"{type(e).__name__}: {text[0] if text else ''}")[:300]


# ----------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------

_MEMORY: dict = {}


def _key(variant, spec, args, kwargs, target, backward) -> tuple:
    import fnattn
    bare = spec.replace(block_sizes=None)
    leaves, treedef = jax.tree_util.tree_flatten((bare, list(args), dict(kwargs)))
    desc = {
        "variant": variant, "backward": bool(backward), "device_kind": target.device_kind,
        "platform": target.platform, "jax": jax.__version__, "fnattn": fnattn.__version__,
        "structure": str(treedef),
        "arrays": [f"{jnp.dtype(x.dtype).name}{list(x.shape)}" if hasattr(x, "shape")
                   else repr(x) for x in leaves],
    }
    text = json.dumps(desc, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32], desc


def _block_size_types() -> dict:
    import fnattn
    return {c.__name__: c for c in (
        fnattn.XlaBlockSizes, fnattn.TritonBlockSizes, fnattn.MosaicBlockSizes,
        fnattn.MosaicGpuBlockSizes, fnattn.MosaicGpuBwdBlockSizes, fnattn.DecodeBlockSizes,
        fnattn.PagedBlockSizes)}


def _encode(cand) -> list:
    return [{"type": type(b).__name__, "fields": dataclasses.asdict(b)} for b in cand]


def _decode(items) -> tuple:
    types = _block_size_types()
    return tuple(types[i["type"]](**i["fields"]) for i in items)


def _read(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"autotune: cannot read the cache file {path!r}: {e}") from None
    return data.get("entries", {}) if isinstance(data, dict) else {}


def _write(path, key, entry):
    entries = _read(path)
    entries[key] = entry
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".fnattn-tune-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"format": 1, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------
# autotune
# ----------------------------------------------------------------------------------


def autotune(fn, spec, *args, kwargs: Optional[Mapping] = None,
             candidates: Optional[Sequence] = None, backward: bool = False, reps: int = 5,
             cache: Optional[str | os.PathLike] = None, retune: bool = False,
             target: Optional[Target] = None, max_seconds: Optional[float] = None,
             compile_threads: Optional[int] = None) -> Tuned:
    """Times block sizes for ``fn(spec, *args, **kwargs)`` and returns the fastest.

    Args:
      fn: an fnattn variant: ``fnattn.flash``, ``fnattn.attention``,
        ``fnattn.decode``, ``fnattn.decode_with_update``,
        ``fnattn.paged_attention``, ``fnattn.ragged_paged_attention`` or
        ``fnattn.ragged_paged_attention_with_update``.
      spec: the :class:`fnattn.AttentionSpec` of the call.
      *args: the call's positional arrays (q, k, v, caches, ...), with the
        shapes and dtypes of the real calls: block sizes are tuned for them.
      kwargs: the call's keyword arguments (``kv_lengths=...``, ``page_table=...``).
      candidates: block-size objects, or tuples of them, to time instead of the
        built-in search of :func:`plan`.
      backward: time forward and backward together and tune the backward
        kernels' parameters too (for training); else the forward alone.
      reps: timed batches of calls per candidate (after one warm-up call); the
        median counts.
      cache: a JSON file to read results from and write them to.
      retune: measure even when the cache holds a result.
      target: the device (default: the one holding the first array argument);
        the measurement runs wherever the arrays are.
      max_seconds: a time budget: once spent, no further candidate is timed,
        and the best so far is confirmed against the spec as given and
        returned with ``complete=False`` (not cached). None: no limit.
      compile_threads: how many candidates of a stage compile at once (XLA
        compiles outside the GIL; lowering stays on the calling thread). None:
        the machine's cores, at most 8.

    Returns:
      :class:`Tuned`, whose ``spec`` is ``spec`` with the fastest block sizes
      (entries of other platforms' lowerings kept).

    Raises:
      ValueError: a spec with nothing to tune (impl="reference", cuDNN's
        routes), or bad arguments.
      RuntimeError: every candidate failed (the errors are in the message).

    >>> import fnattn
    >>> from fnattn import AttentionSpec
    >>> q = k = v = jnp.ones((1, 64, 2, 16))
    >>> tuned = autotune(fnattn.flash, AttentionSpec(), q, k, v, reps=1,
    ...                  candidates=[fnattn.XlaBlockSizes(32, 32), fnattn.XlaBlockSizes(64, 64)])
    >>> [t.stage for t in tuned.trials[:3]]   # then "confirm" if a candidate won
    ['given', 'candidates', 'candidates']
    """
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"autotune: reps must be a positive int; got {reps!r}")
    from fnattn.spec import AttentionSpec
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"autotune: spec must be an AttentionSpec; got {type(spec).__name__}")
    kwargs = dict(kwargs or {})
    if any(isinstance(x, jax.core.Tracer)
           for x in jax.tree_util.tree_leaves((spec, list(args), kwargs))):
        raise TypeError(
            "autotune: got traced arrays; it runs outside jax.jit, jax.grad and jax.vmap "
            "(it compiles and times real calls): call it once with concrete arrays of the "
            "real shapes and pass the returned spec into the transformed code")
    target = Target.of(_first_array(args, kwargs)) if target is None else target
    the_plan = plan(fn, spec, *args, kwargs=kwargs, target=target, backward=backward,
                    candidates=candidates)
    variant = _variant(fn)
    key, desc = _key(variant, spec, args, kwargs, target, backward)
    if candidates is not None:
        # the same call with other candidates is another question
        key = hashlib.sha256((key + repr(the_plan.stages[0].propose(()))).encode()).hexdigest()[:32]

    if not retune:
        entry = _MEMORY.get(key)
        if entry is None and cache is not None:
            entry = _read(cache).get(key)
        if entry is not None:
            cand = _decode(entry["block_sizes"])
            _MEMORY[key] = entry
            return Tuned(_with(spec, the_plan.family, cand), cand, entry.get("seconds"),
                         entry.get("baseline_seconds"), (), True, the_plan.lowering)

    program, arrays, kwarrays = _program(fn, args, kwargs, backward)
    threads = compile_threads or min(8, os.cpu_count() or 1)
    start = time.perf_counter()
    timed: dict = {}       # candidate -> its latest median (None: it failed)
    compiled: dict = {}    # candidate -> compiled program, or the exception it raised
    trials = []
    complete = True

    def out_of_time():
        return max_seconds is not None and time.perf_counter() - start > max_seconds

    def build(cands):
        """Lowers each candidate here, compiles them on ``threads`` threads."""
        lowered = {}
        for cand in cands:
            try:
                lowered[cand] = _lower(program, _with(spec, the_plan.family, cand), arrays,
                                       kwarrays)
            except Exception as e:  # noqa: BLE001 (a candidate the lowering refuses)
                compiled[cand] = e
        def compile_one(cand):
            try:
                return lowered[cand].compile()
            except Exception as e:  # noqa: BLE001
                return e
        if threads > 1 and len(lowered) > 1:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                compiled.update(zip(lowered, pool.map(compile_one, lowered)))
        else:
            compiled.update((c, compile_one(c)) for c in lowered)

    def run(stage, cand):
        try:
            if isinstance(compiled[cand], Exception):
                raise compiled[cand]
            c = _with(spec, the_plan.family, cand)
            if cand not in timed:   # (first run: the warm-up)
                jax.block_until_ready(compiled[cand](c, arrays, kwarrays))
            seconds, error = _time(compiled[cand], c, arrays, kwarrays, reps), None
        except Exception as e:  # noqa: BLE001 (a candidate the kernel refuses)
            seconds, error = None, _error(e)
        timed[cand] = seconds
        trials.append(Trial(stage, cand, seconds, error))

    own = tuple(b for b in blocks.entries(spec.block_sizes) if isinstance(b, the_plan.family))
    build([()])
    run("given", ())
    best, first = (), True
    for stage in the_plan.stages:
        # (proposals build on the best so far; while that is the spec as given, on
        # the spec's own entries of the family)
        proposed = [tuple(c) for c in stage.propose(best or own)]
        fresh = [c for c in dict.fromkeys(proposed)
                 if c not in timed and c != the_plan.given]
        if not fresh:
            continue
        if out_of_time():
            complete = False
            break
        build(fresh)
        if not first and timed.get(best) is not None:
            # the incumbent again, beside this stage's candidates: a machine whose
            # speed drifts between stages then compares like with like
            run(stage.name, best)
        first = False
        for cand in fresh:
            if out_of_time():
                complete = False
                break
            run(stage.name, cand)
        done = {c: s for c, s in timed.items() if s is not None}
        if done:
            best = min(done, key=done.get)   # ties: the earlier (dicts keep order)
        if not complete:
            break
    if best != () and timed.get(()) is not None:
        # the winner against the spec as given, their calls alternating: one lucky
        # timing does not replace what the user passed
        rounds = {best: [], (): []}
        for r in range(2 * reps):
            for cand in (best, ()) if r % 2 else ((), best):   # each first in turn
                rounds[cand].append(_time(compiled[cand], _with(spec, the_plan.family, cand),
                                          arrays, kwarrays, 1))
        for cand, times in rounds.items():
            timed[cand] = statistics.median(times)
            trials.append(Trial("confirm", cand, timed[cand]))
        if timed[best] >= timed[()]:
            best = ()
    if timed.get(best) is None:
        raise RuntimeError(
            f"autotune: every candidate failed for {the_plan.lowering}:\n"
            + "\n".join(f"  {t.block_sizes or '(as given)'}: {t.error}" for t in trials))

    if complete:   # (a partial search is not what a later call should get)
        entry = {"block_sizes": _encode(best), "seconds": timed[best],
                 "baseline_seconds": timed.get(()), "lowering": the_plan.lowering,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                     timespec="seconds"),
                 "description": desc}
        _MEMORY[key] = entry
        if cache is not None:
            _write(cache, key, entry)
    return Tuned(_with(spec, the_plan.family, best), best, timed[best], timed.get(()),
                 tuple(trials), False, the_plan.lowering, complete)
