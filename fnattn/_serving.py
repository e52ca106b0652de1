"""What the serving variants share: :mod:`fnattn.decoding` (contiguous caches)
and :mod:`fnattn.paged` (paged pools) both import this module, and
:mod:`fnattn.paged` may import :mod:`fnattn.decoding` (its Mosaic GPU lowering
runs the decode kernel with a paged producer), never the other way round.

- :class:`KernelFacts`: what a kernel's static facts rebuild (mask, term, units).
- :func:`cdiv`, :func:`pow2`, :func:`span`, :func:`first_run`: the index
  arithmetic of the schedules.
- :func:`auto_splits`: the split-K count of the Triton decode kernels.
- :func:`refuse_float64`: the refusal every serving entry point gives float64.

Loading and dequantizing quantized caches is :mod:`fnattn.quant`'s
(:func:`fnattn.quant.decode_codes`, :func:`fnattn.quant.load`), which every
lowering imports.

>>> from fnattn import _serving
>>> _serving.cdiv(10, 4), _serving.pow2(20), _serving.auto_splits(8, 512)
(3, 32, 33)
"""

import jax
import jax.numpy as jnp

from fnattn import masks

__all__ = ["KernelFacts", "MIN_BLOCKS_PER_SPLIT", "NUM_SMS", "TARGET_PROGRAMS", "auto_splits",
           "cdiv", "first_run", "pow2", "refuse_float64",
           "refuse_traced_sizes", "size_operands", "span", "traced_sizes"]

I32 = jnp.int32


class KernelFacts:
    """What the serving kernels' static facts (frozen dataclasses with
    ``mask_treedef``, ``term_treedef`` and ``softcap`` fields) rebuild from
    them: the mask, the position term, and the units of the row state."""

    __slots__ = ()

    def mask(self):
        """The mask (its arrays placeholders), or None."""
        return masks.from_treedef(self.mask_treedef)

    def term(self):
        """The position term (its arrays placeholders: their values come as
        the kernel's term operands), or None."""
        return masks.from_treedef(self.term_treedef)

    @property
    def natural(self) -> bool:
        """The row state ``m`` is kept in natural units (a term without
        soft-cap: logits may be huge, and ``(s - m) * log2(e)`` stays exact
        where ``s * log2(e) - m`` would not, :func:`fnattn._online.step_exp2`);
        else in base 2."""
        return self.term_treedef is not None and self.softcap is None


def cdiv(a, b):
    return -(-a // b)


def pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def span(flags):
    """[a, b) per row of ``flags`` (rows, n) bool, each (rows,) int32: from the first
    True entry to one past the last; ``a = b = 0`` in a row with none.

    >>> a, b = span(jnp.array([[0, 1, 0, 1, 0], [0, 0, 0, 0, 0]], bool))
    >>> a.tolist(), b.tolist()
    ([1, 0], [4, 0])
    """
    n = flags.shape[1]
    anyf = flags.any(axis=1)
    a = jnp.argmax(flags, axis=1).astype(I32)
    b = (n - jnp.argmax(flags[:, ::-1], axis=1)).astype(I32)
    return jnp.where(anyf, a, 0), jnp.where(anyf, b, 0)


def first_run(flags):
    """[a, b) per row of ``flags`` (rows, n) bool, each (rows,) int32: the first run
    of consecutive True entries; ``a = b = 0`` in a row with none."""
    n = flags.shape[1]
    j = jnp.arange(n, dtype=I32)[None, :]
    anyf = flags.any(axis=1)
    a = jnp.argmax(flags, axis=1).astype(I32)
    # the run ends at the first entry from a on that is False
    rest = flags | (j < a[:, None])
    b = jnp.where(rest.all(axis=1), n, jnp.argmin(rest, axis=1)).astype(I32)
    return jnp.where(anyf, a, 0), jnp.where(anyf, b, 0)


NUM_SMS = 132            # H100 SXM
# About two programs per multiprocessor, all resident at once. Measured on an
# H100 (benchmarks/results/gpu_h100_2026-11-27_s23, bf16, Hkv = 8, D = 128):
# B = 16, S = 4k reads 77 % (contiguous cache) and 72 % (paged) of peak HBM with
# 2 splits (256 programs) against 69 % and 65 % with 5 (640: more than fit at
# once, so a second partial wave); B = 4, S = 16k 78 % and 71 % with 8 (256
# programs) against 73 % and 70 % with 17.
TARGET_PROGRAMS = 2 * NUM_SMS
MIN_BLOCKS_PER_SPLIT = 8  # below this a split's fixed costs (q load, merge) dominate


def auto_splits(programs: int, n_blocks: int) -> int:
    """Split-K count of a Triton decode kernel (:mod:`fnattn.paged.triton` and
    :func:`fnattn.decoding.triton.launch_plan`) with ``programs`` programs per
    split over ``n_blocks`` key blocks: at most ``TARGET_PROGRAMS`` programs in
    all (past that, splits only add merge work), at least
    ``MIN_BLOCKS_PER_SPLIT`` blocks per split, at least one split.

    >>> auto_splits(128, 64), auto_splits(8, 512), auto_splits(512, 512), auto_splits(8, 16)
    (2, 33, 1, 2)
    """
    return max(1, min(TARGET_PROGRAMS // programs, n_blocks // MIN_BLOCKS_PER_SPLIT))


def refuse_float64(fn, **arrays):
    """A ``TypeError`` at trace time for float64 q/k/v: every serving lowering (the
    kernels, and the XLA ones that share their float32 statistics) computes in
    float32, and silently rounding float64 inputs would be a wrong number."""
    wide = [name for name, x in arrays.items() if getattr(x, "dtype", None) == jnp.float64]
    if wide:
        names = ", ".join(arrays)
        raise TypeError(f"{fn}: float64 inputs are not supported ({', '.join(wide)} "
                        f"{'is' if len(wide) == 1 else 'are'} float64): the serving variants "
                        f"compute in float32; cast {names} to float32 (x.astype(jnp.float32)).")


def _size_masks(mask):
    """The sub-masks of ``mask`` (through ``&``, ``|``, ``~``) that hold arrays, or
    None where one of them is not a window or chunk size."""
    if isinstance(mask, (masks.And, masks.Or)):
        a, b = _size_masks(mask.a), _size_masks(mask.b)
        return None if a is None or b is None else a + b
    if isinstance(mask, masks.Not):
        return _size_masks(mask.a)
    if isinstance(mask, (masks.SlidingWindowArray, masks.ChunkedArray)):
        return [mask]
    return None if jax.tree_util.tree_leaves(mask) else []


def traced_sizes(mask) -> bool:
    """Whether ``mask`` holds arrays that are all window or chunk sizes
    (:func:`fnattn.masks.sliding_window` / :func:`fnattn.masks.chunked` given an
    int array, e.g. one per layer inside ``lax.scan``): what the serving
    variants' XLA lowerings take as data.

    >>> import jax.numpy as jnp
    >>> traced_sizes(masks.causal() & masks.sliding_window(left=jnp.int32(4)))
    True
    >>> traced_sizes(masks.causal() & masks.sliding_window(left=4))
    False
    >>> traced_sizes(masks.segments(jnp.zeros((1, 3), jnp.int32)))
    False
    """
    found = None if mask is None else _size_masks(mask)
    return bool(found)


def size_operands(mask, rank: int, *, per_row: bool = True):
    """The operands of a mask with traced sizes (:func:`traced_sizes`), each
    (B|1, 1, ..., 1) of ``rank`` axes: its batch (``per_row``) or nothing
    varying, for positions whose batch index is the leading axis."""
    ops = []
    for o in mask.operands():
        n = o.shape[0] if per_row else 1
        ops.append(o.reshape((n,) + (1,) * (rank - 1)))
    return ops


def refuse_traced_sizes(fn: str, lowering: str, xla_name: str):
    """The ``NotImplementedError`` a Pallas lowering gives a mask with traced
    window or chunk sizes (its schedules are built from static sizes)."""
    raise NotImplementedError(
        f"{fn}: window or chunk sizes given as arrays (masks.sliding_window / masks.chunked "
        f"with a traced size) are not supported by the {lowering}; the XLA lowering "
        f"({xla_name}) takes them: use impl='auto' (which runs it for such masks on every "
        "platform) or impl='xla'.")
