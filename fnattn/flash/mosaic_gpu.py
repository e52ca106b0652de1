"""The Pallas Mosaic GPU lowering of the flash-attention forward (Hopper, sm90a).

One kernel, warp-specialised: every program (CTA) owns ``2 * block_q`` query
rows of one (batch, query head) and runs three warpgroups.

* Warpgroups 0 and 1 (*consumers*) each hold ``block_q`` of those rows. Per
  kv-tile they compute ``S = Q K^T`` with ``plgpu.wgmma`` into a float32
  accumulator, run the online softmax in base 2 (``log2(e)`` folded into the
  scale) and add ``P V`` into a float32 output accumulator, again with
  ``wgmma``. A shared barrier staggers the two so that one's softmax overlaps
  the other's matrix multiplies.
* Warpgroup 2 (*producer*) streams the K and V tiles with TMA
  (``plgpu.copy_gmem_to_smem``) into a ring of ``max_concurrent_steps`` shared
  memory slots; per slot a *loaded* barrier (TMA done) and a *consumed*
  barrier (both consumers done with it) hand it back and forth.

With ``MosaicGpuBlockSizes(persistent=True)`` a program per multiprocessor
walks its share of those work items (:func:`launch_grid`; heaviest first,
dealt out so that the programs' loads stay even, or with ``walk="tiles"`` in
the grid's order: :class:`Walk`), the ring's
slots counted on from one item to the next, so the producer streams the next
item's K and V while the consumers finish the current one, and each consumer
loads the next item's Q into a second buffer where shared memory allows
(:func:`q_buffers`).

Which kv-tiles a program visits comes from the mask's block classes at the
granularity of the whole ``2 * block_q`` tile, compressed into one list by a
single sort (:func:`visit_list`): one int32 row per (batch|1, head|1, q-tile),
``[n_full, n_visited, kv-tiles...]``, FULL tiles first. For a mask without
arrays the classes are static (:func:`fnattn.masks.block_classes_static`) and
the table is a NumPy constant built at trace time; for a mask holding arrays
(segment ids, lengths, prefix lengths, positions) it is computed in XLA from
them (:func:`fnattn.masks.block_classes`, then :func:`visit_list`), so a new
packing of documents does not recompile. Producer and consumers read the
same row, so they iterate the same list, and read it ahead: a persistent
program's next item's indices and counts while it runs the current one, and
the next tile's index while a step runs, so that no step waits on a load from
global memory for its own. FULL tiles run without mask code; the
others evaluate the mask's predicate elementwise on the tile (and the bound of
ragged sequences: keys past ``Tk`` are not visible). EMPTY tiles are never
loaded.

The mask's arrays reach the predicate in the ``wgmma`` register layout, sorted
by what they vary along (canonical shape ``(B|1, H|1, Tq|1, Tk|1)``, int32):

* per query row (query segment ids, query positions): each consumer copies its
  ``block_q`` values by TMA into shared memory once, reads them in the layout
  of a row of the accumulator (``Layout.WGMMA.reduce(1)``) and broadcasts them
  along the keys;
* per key (kv segment ids, key positions): the producer copies the tile's
  ``block_k`` values by TMA with K, into a ring beside K's, for PARTIAL tiles
  only; consumers read them in the layout of a column
  (``Layout.WGMMA.reduce(0)``) while ``Q K^T`` runs, before they hand K's slot
  back;
* per (batch, head) (lengths, prefix lengths): read as scalars once.

Arrays that vary along both queries and keys (``from_array``) are refused.

Keys a row may not see contribute nothing to it whatever their bits: hidden
logits are set to -inf on PARTIAL tiles, and at head dims that are powers of
two the kernel reads K and V as they are and flags the rows that met a
non-finite logit or output, whose blocks the Triton forward then recomputes
with hidden keys made inert (:func:`fnattn.flash.triton.redo_forward`). At
other head dims (or with ``MosaicGpuBlockSizes(hidden_keys="pass")``) the
wrapper makes non-finite keys inert before the kernel instead
(:func:`_hidden_keys_inert`: one elementwise pass over K and V, with a
reduction over V only).

Dropout draws :func:`fnattn.dropout.keep_mask` on every visited tile from the
rows' and keys' global indices (the same bits as every other lowering): the
denominator keeps every weight, ``P V`` only the kept ones, scaled by
``1 / (1 - rate)``; the backward draws the same mask again.

Attention sinks (one logit per query head, float32) join each row's state after
its last tile (:func:`fnattn._online.sink_rescale`): they add to the denominator
and to ``lse``, never to the output's numerator.

The kernel writes the output and the base-2 row state ``(m, l)``; the wrapper
turns the latter into ``lse`` and ``lse_lo`` (:func:`fnattn._online.lse_parts`),
so a row that sees no key gets ``out = 0`` and ``lse = -inf``. The residuals
are those of the Triton lowering, whose backward kernels :data:`LOWERING`
reuses.

Supported: float16 / bfloat16, head dims ``D`` and ``Dv`` up to 256 (the
kernel computes at :func:`kernel_dim`, their maximum rounded up to a multiple
of 64: the wrapper zero-pads q, k and v to it and drops the output's extra
columns; D = 96 runs at 128, D = 192 with Dv = 128 at 192), any
scale, soft-cap, attention sinks, dropout, GQA, no mask, an array-free mask
(causal, sliding windows, chunks and their ``&``, ``|``, ``~``) or a mask
holding per-row, per-key or per-sequence integer arrays (segments, lengths,
prefix-LM, ``at_positions``, combined with the others), and an ALiBi position
term (:func:`fnattn.position_bias.alibi`, or a sum of them): its slopes are
read once per item as float scalars and the term is added to every tile's
logits, FULL ones included, before the soft-cap; without a soft-cap the row
state is then kept in natural units (:attr:`_Plan.natural`), so that rows
whose every logit is huge stay exact. A ``from_fn`` term (or mask
predicate) runs here when its function uses only operations Mosaic GPU lowers
(:data:`fnattn._functions.MOSAIC_GPU`: no ``log1p``, ``sqrt``, ``pow``,
``floor``, ``jax.nn.relu``, ...; checked when the spec is traced), its
arrays read like ALiBi's slopes. :func:`supports`
lists what else a spec asks for; :func:`forward` refuses it with
``NotImplementedError``.

impl="auto" on a Hopper GPU (:func:`route`) runs this kernel for the specs it
takes, except those with dropout or a position term: those paths have not
been timed on an H100 yet (:func:`_explicit_only`), so they run here only when
the spec's block sizes include :class:`MosaicGpuBlockSizes`, and on the
Triton kernels otherwise. The Mosaic GPU backward computes the term too, its
arrays held fixed or learned (when asked for by name too:
``MosaicGpuBwdBlockSizes``).

>>> import jax.numpy as jnp
>>> from fnattn import masks
>>> from fnattn._checks import Dims
>>> from fnattn._dispatch import Config
>>> cfg = Config(Dims(1, 256, 256, 4, 2, 128, 128), 128 ** -0.5, None, 0.0, None)
>>> supports(cfg, jnp.bfloat16, masks.causal(), None, None)
[]
>>> ids = jnp.zeros((1, 256), jnp.int32)
>>> supports(cfg, jnp.bfloat16, masks.causal() & masks.segments(ids), None, None)
[]
>>> supports(cfg, jnp.float32, None, jnp.zeros((256, 256)), None)  # doctest: +ELLIPSIS
['a bias ...', 'float32 inputs ...']
"""

import dataclasses
import functools
import inspect
import types
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from fnattn import _checks, _functions, dropout, masks, position_bias
from fnattn import _online as online
from fnattn._dispatch import Lowering
from fnattn.flash import blocks, triton
from fnattn._serving import NUM_SMS

__all__ = ["MosaicGpuBlockSizes", "LOWERING", "available", "forward", "route", "supports",
           "interpret_params"]

LOG2E, LN2 = online.LOG2E, online.LN2
F32 = jnp.float32
# The Triton kernels take what this one refuses.
_ELSEWHERE = "the Pallas Triton kernels (fnattn/flash/triton.py, impl='pallas') support it"
# Consumers hold the accumulators (more registers); the producer only issues copies.
_CONSUMER_REGISTERS, _PRODUCER_REGISTERS = 232, 40
# Hopper's shared memory per block, less what the runtime keeps.
SMEM_BYTES = 227 * 1024


def _plgpu():
    # Imported on use: Mosaic GPU needs absl, which plain CPU installs may lack.
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return plgpu


# ----------------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MosaicGpuBlockSizes:
    """Tiles of the Mosaic GPU forward.

    Attributes:
      block_q: query rows of each consumer warpgroup (a program holds twice
        this); 64 or 128 (``wgmma`` works on 64-row slabs).
      block_k: kv rows per step; 64 or 128.
      max_concurrent_steps: depth of the K/V ring in shared memory, 2 to 4.
      hidden_keys: how a masked call keeps non-finite K/V bits of keys a row
        may not see out of its result. ``"redo"``: the kernel reads K and V as
        they are and flags the rows where it met a non-finite logit or output;
        the Triton forward recomputes the blocks of those rows, and nothing else
        (:func:`fnattn.flash.triton.redo_forward`). ``"pass"``: an elementwise
        XLA pass over K and V before the kernel (:func:`_hidden_keys_inert`).
        Same results; ``"redo"`` moves no K/V bytes when the inputs are finite
        (on an H100 a document-masked forward at T = 8k takes 0.33 ms against
        0.38), but needs a head dim the Triton forward takes (a power of two).
        ``"auto"`` (the default): ``"redo"`` at power-of-two head dims,
        ``"pass"`` at the others.
      persistent: one program per multiprocessor (132 on an H100) walks its
        share of the work items (a q-tile of one batch row and head), ranked by
        the kv-tiles they visit and dealt out in snake order (:class:`Walk`),
        instead of one program per item. The producer then loads the next
        item's K and V while the consumers finish the current one, the
        consumers load its Q tiles into a second buffer where shared memory
        allows (:func:`q_buffers`), and no program waits for its last stores:
        meant for short items (packed documents). Same results. Off by
        default: on an H100 it was slower on packed documents at T = 8k (0.356
        ms against 0.312); on an H200, later, 5 % faster there (0.292 against
        0.306) but 11 % slower without a mask (2.03 against 1.82 ms).
      walk: the order in which persistent programs take the items
        (:func:`walk_order`). ``"heaviest"`` (the default): most kv-tiles
        visited first, which balances the programs' loads. ``"tiles"``: the
        grid's order, each batch row's q-tiles from the last to the first, the
        heads side by side, so that the programs running at once hold
        neighbouring q-tiles (of packed documents: the same document) and read
        the same K/V tiles. Not faster on an H200 (packed documents at T = 8k:
        0.315 ms against 0.292 heaviest first).

    >>> MosaicGpuBlockSizes.default(128).smem_bytes(128)
    168024
    >>> MosaicGpuBlockSizes(block_q=96)
    Traceback (most recent call last):
    ...
    ValueError: MosaicGpuBlockSizes: block_q must be 64 or 128; got 96
    """

    block_q: int = 64
    block_k: int = 128
    max_concurrent_steps: int = 2
    hidden_keys: str = "auto"
    persistent: bool = False
    walk: str = "heaviest"

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            if getattr(self, name) not in (64, 128):
                raise ValueError(
                    f"MosaicGpuBlockSizes: {name} must be 64 or 128; got {getattr(self, name)!r}")
        if self.max_concurrent_steps not in (2, 3, 4):
            raise ValueError("MosaicGpuBlockSizes: max_concurrent_steps must be 2, 3 or 4; "
                             f"got {self.max_concurrent_steps!r}")
        if self.hidden_keys not in ("auto", "pass", "redo"):
            raise ValueError("MosaicGpuBlockSizes: hidden_keys must be 'auto', 'pass' or "
                             f"'redo'; got {self.hidden_keys!r}")
        if not isinstance(self.persistent, bool):
            raise ValueError("MosaicGpuBlockSizes: persistent must be True or False; "
                             f"got {self.persistent!r}")
        if self.walk not in WALKS:
            raise ValueError(f"MosaicGpuBlockSizes: walk must be one of {WALKS}; "
                             f"got {self.walk!r}")

    def redoes(self, head_dim: int) -> bool:
        """Whether a masked forward at this head dim leaves the pass out
        (``hidden_keys`` "redo", or "auto" at a power of two).

        >>> MosaicGpuBlockSizes().redoes(128), MosaicGpuBlockSizes().redoes(192)
        (True, False)
        >>> MosaicGpuBlockSizes(hidden_keys="pass").redoes(128)
        False
        """
        if self.hidden_keys == "auto":
            return triton._is_pow2(head_dim)
        return self.hidden_keys == "redo"

    @classmethod
    def default(cls, head_dim: int) -> "MosaicGpuBlockSizes":
        """Tiles for an H100 by head dim: the deepest ring that fits shared memory.

        A consumer keeps a (block_q, D) and a (block_q, block_k) float32 tile
        in registers (64 + 64 per thread at D = 128), so block_q stays 64.
        """
        if head_dim <= 64:
            return cls(block_q=64, block_k=128, max_concurrent_steps=3)
        if head_dim <= 128:
            return cls(block_q=64, block_k=128, max_concurrent_steps=2)
        return cls(block_q=64, block_k=64, max_concurrent_steps=2)

    def smem_bytes(self, head_dim: int, itemsize: int = 2, *, row_arrays: int = 0,
                   key_arrays: int = 0, q_buffers: int = 1) -> int:
        """Shared memory a program allocates: Q/O tiles, the K/V ring, row state,
        and the int32 tiles of a mask's per-row and per-key arrays (segment ids,
        positions: ``row_arrays`` and ``key_arrays`` of them), as Mosaic GPU
        counts it (:func:`smem_layout_bytes`). ``q_buffers=2``: the Q tiles and
        per-row arrays twice (a persistent program loading the next item's
        while it runs the current one).

        >>> MosaicGpuBlockSizes().smem_bytes(128, row_arrays=1, key_arrays=1)
        170104
        >>> MosaicGpuBlockSizes().smem_bytes(128, row_arrays=1, key_arrays=1, q_buffers=2)
        202904
        """
        ring, bq, bk = self.max_concurrent_steps, self.block_q, self.block_k
        buffers = [2 * q_buffers * bq * head_dim * itemsize,     # Q (and O) tiles
                   ring * bk * head_dim * itemsize,              # K ring
                   ring * bk * head_dim * itemsize,              # V ring
                   2 * bq * 4, 2 * bq * 4]                       # m and l of each consumer
        barriers = 2 * q_buffers + 4 * ring + 1
        if row_arrays:
            buffers.append(2 * q_buffers * row_arrays * bq * 4)
            barriers += 2 * q_buffers
        if key_arrays:
            buffers.append(ring * key_arrays * bk * 4)
            barriers += ring
        return smem_layout_bytes(buffers, barriers) + _FWD_RESERVED


# What the forward's program holds in shared memory besides its buffers and
# barriers, fitted (with :func:`smem_layout_bytes`) to what Mosaic GPU counts
# when lowering the kernel (jax 0.10.2 and 0.11.2; tests/flash/test_mosaic_gpu.py
# checks the estimate against the lowering).
_FWD_RESERVED = 2048


def smem_layout_bytes(buffers, barriers: int) -> int:
    """Shared memory of ``buffers`` (their sizes in bytes) and ``barriers`` as
    Mosaic GPU lays them out: each buffer from a 1024-byte boundary, 8 bytes
    per barrier.

    >>> smem_layout_bytes([512, 4096], 3)
    5144
    """
    return sum(-(-n // 1024) * 1024 for n in buffers) + 8 * barriers


# ----------------------------------------------------------------------------------
# What the kernel takes
# ----------------------------------------------------------------------------------


def supports(cfg, dtype, mask, bias, sinks) -> list:
    """Why the spec cannot run on this kernel (empty: it can), from static facts.

    ``mask`` is the mask object (or None); ``bias`` and ``sinks`` are arrays or None.
    """
    why = maskless_refusals(cfg, dtype, bias, sinks) + term_refusals(mask)
    if mask is not None and mask.num_operands:
        why += operand_refusals(mask)
    Dp = kernel_dim(cfg.dims)
    if (mask is not None and Dp is not None and Dp <= 256
            and _blocks_for(cfg).hidden_keys == "redo" and not triton._is_pow2(Dp)):
        d = cfg.dims
        at = (f"D={Dp}" if d.head_dim == d.v_head_dim == Dp
              else f"{Dp} (D={d.head_dim}, Dv={d.v_head_dim} padded)")
        why.append(f"hidden_keys='redo' at head dim {at} (the Triton forward that "
                   "recomputes flagged rows takes powers of two; hidden_keys='pass' runs here)")
    return why


def term_refusals(mask, term_grad: tuple = ()) -> list:
    """The user's functions and a position term (:mod:`fnattn.position_bias`)
    riding with the mask: the Mosaic GPU kernels compile a ``from_fn``
    predicate or term whose primitives Mosaic GPU lowers
    (:data:`fnattn._functions.MOSAIC_GPU`: no ``log1p``, ``sqrt``, ``pow``,
    ``floor``, ``jax.nn.relu``, ...), and a term's arrays of one value per
    batch row and head (ALiBi's, a ``from_fn``'s). ``term_grad`` (the
    backward's ``Config.term_grad``): the Mosaic GPU backward differentiates
    the term in its learned arrays too, which then must compile as well.

    >>> import jax.numpy as jnp
    >>> from fnattn import masks, position_bias
    >>> decay = position_bias.from_fn(lambda b, h, q, k, a: -a * jnp.log(1.0 + abs(q - k)),
    ...                               jnp.ones(4))
    >>> term_refusals(position_bias.attach(masks.causal(), decay))
    []
    >>> term_refusals(masks.from_fn(lambda b, h, q, k: jnp.floor(q / 64) == k // 64))
    ... # doctest: +ELLIPSIS
    ['the mask predicate from_fn(<lambda>) uses floor, which the Pallas Mosaic GPU ...']
    """
    why = _functions.refusals(mask, _functions.MOSAIC_GPU, bool(term_grad))
    if not position_bias.present(mask):
        return why
    ops = jax.eval_shape(lambda m: m.operands(), mask)
    if any(ops[n].shape[2] > 1 or ops[n].shape[3] > 1 for n in position_bias.term_operands(mask)):
        why.append(f"a position bias with arrays along the queries or keys ({mask!r}; the "
                   "kernel reads one value per batch row and head)")
    return why


def maskless_refusals(cfg, dtype, bias, sinks) -> list:
    """What the Mosaic GPU kernels (this forward and :mod:`fnattn.flash.mosaic_gpu_bwd`)
    refuse apart from the mask: a bias, dtypes other than float16/bfloat16,
    head dims past 256 (:func:`kernel_dim`), symbolic sizes.

    >>> from fnattn._checks import Dims
    >>> from fnattn._dispatch import Config
    >>> cfg = Config(Dims(1, 256, 256, 4, 2, 288, 288), 0.1, None, 0.2, None)
    >>> for why in maskless_refusals(cfg, jnp.float32, jnp.zeros((1, 4, 256, 256)), None):
    ...     print(why)
    a bias (the kernel adds nothing to the logits)
    float32 inputs (the kernel takes float16 or bfloat16)
    head dim D=288 (the kernel computes at a multiple of 64 up to 256)
    """
    d = cfg.dims
    why = []
    if bias is not None:
        why.append("a bias (the kernel adds nothing to the logits)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        why.append(f"{jnp.dtype(dtype).name} inputs (the kernel takes float16 or bfloat16)")
    Dp = kernel_dim(d)
    if Dp is None:
        why.append(f"symbolic head dims D={d.head_dim}, Dv={d.v_head_dim}")
    elif Dp > 256:
        dims = f"D={d.head_dim}" + ("" if d.v_head_dim == d.head_dim else f", Dv={d.v_head_dim}")
        why.append(f"head dim {dims} (the kernel computes at a multiple of 64 up to 256)")
    symbolic = _checks.symbolic_sizes(B=d.batch, Tq=d.q_len, Tk=d.kv_len)
    if symbolic:
        why.append(f"symbolic sizes {symbolic}")
    return why


def kernel_dim(dims) -> Optional[int]:
    """The head dim the Mosaic GPU kernels compute at (None if symbolic): the
    larger of ``D`` and ``Dv`` rounded up to a multiple of 64, the width of a
    128-byte swizzled row of 16-bit values. The wrappers zero-pad q, k and v
    (and the backward's ``out`` and ``d_out``) to it and drop the extra
    columns of the results: a zero column adds nothing to ``q . k``, and zero
    columns of V give output columns that are dropped. The Triton kernels pad
    D and Dv apart, each to the next power of two (16 at least): where that
    is less work (D = 32, or Dv = 32 with D = 64), impl="auto" keeps the spec
    there (:func:`_explicit_only`).

    >>> from fnattn._checks import Dims
    >>> [kernel_dim(Dims(1, 8, 8, 1, 1, D, Dv)) for D, Dv in [(128, 128), (96, 96),
    ...                                                        (80, 80), (192, 128)]]
    [128, 128, 128, 192]
    """
    if not (isinstance(dims.head_dim, int) and isinstance(dims.v_head_dim, int)):
        return None
    return -(-max(dims.head_dim, dims.v_head_dim) // 64) * 64


def at_kernel_dim(cfg):
    """``cfg`` with ``D`` and ``Dv`` both :func:`kernel_dim`'s (``cfg`` itself
    where they already are): what the kernels are traced with."""
    d, Dp = cfg.dims, kernel_dim(cfg.dims)
    if d.head_dim == d.v_head_dim == Dp:
        return cfg
    return dataclasses.replace(cfg, dims=d._replace(head_dim=Dp, v_head_dim=Dp))


def pad_dim(x, D: int):
    """A "bthd" array zero-padded along its last axis to ``D``."""
    return triton._pad(x, 3, D)


def operand_refusals(mask) -> list:
    """What the Mosaic GPU kernels cannot read among the mask's arrays (shapes and
    dtypes only): arrays along both queries and keys, and non-integers or integers
    wider than 32 bits."""
    why = []
    term = set(position_bias.term_operands(mask))  # (floats: the "fscalar" stack)
    for n, op in enumerate(jax.eval_shape(lambda m: m.operands(), mask)):
        if n in term:
            continue
        if op.shape[2] > 1 and op.shape[3] > 1:
            why.append(f"a mask array that varies along both queries and keys ({mask!r}; "
                       "the kernel reads per-row, per-key and per-sequence arrays)")
        elif not (op.dtype == jnp.bool_ or (jnp.issubdtype(op.dtype, jnp.integer)
                                            and jnp.dtype(op.dtype).itemsize <= 4)):
            why.append(f"a mask array of dtype {jnp.dtype(op.dtype).name} ({mask!r}: the "
                       "kernel reads integers of at most 32 bits)")
    return list(dict.fromkeys(why))


@functools.lru_cache(maxsize=None)
def available() -> Optional[str]:
    """None when this process can compile the kernel (a Hopper GPU, compute
    capability 9.x, and Mosaic GPU importable), else why not. Asked when a
    program is traced for cuda, like cuDNN's presence."""
    try:
        _plgpu()
    except ImportError as e:
        return f"Mosaic GPU cannot be imported ({e})"
    try:
        gpus = jax.devices("gpu")
    except (RuntimeError, ValueError):  # (no GPU backend in this process)
        return "no GPU in this process"
    caps = {str(getattr(d, "compute_capability", "")) for d in gpus}
    if not caps or not all(c.startswith("9.") for c in caps):
        return f"the kernel needs a Hopper GPU (compute capability 9.x); found {sorted(caps)}"
    return None


def _explicit_only(cfg) -> bool:
    """Whether this kernel takes the spec only when asked for by name
    (``MosaicGpuBlockSizes`` in the spec's block sizes).

    True for dropout, whose keep mask is a hash of every (row, key) pair on
    every tile: not timed on an H100 yet, so until a measurement shows it
    ahead of the Triton kernel impl="auto" keeps dropout on the Triton kernels.
    Masks holding arrays (segment ids, lengths, prefix lengths, positions) are
    not: with packed documents (T = 8192, D = 128) this forward took 0.42 ms
    against the Triton forward's 0.55 ms
    (benchmarks/results/gpu_h100_2026-11-26_s20).

    True for a position term (ALiBi) too: computed here since this kernel
    learned it, not timed on an H100 yet; impl="auto" runs it on the Triton
    kernels until a measurement shows this forward ahead.

    True where the head dims padded to :func:`kernel_dim` make more work
    (``2 * kernel_dim``) than the Triton kernels' padding of D and Dv to
    powers of two: D = 32 is computed at 64 here and at 32 there. Where the
    work is the same (D = 96 at 128 in both; D = 192 with Dv = 128, 384 in
    both) this kernel runs, as at D = 128, where it was timed ahead.

    >>> from fnattn._checks import Dims
    >>> from fnattn._dispatch import Config
    >>> [_explicit_only(Config(Dims(1, 8, 8, 1, 1, D, Dv), 0.1, None, 0.0, None))
    ...  for D, Dv in [(128, 128), (96, 96), (192, 128), (32, 32), (64, 32)]]
    [False, False, False, True, True]
    """
    wider = 2 * kernel_dim(cfg.dims) > sum(triton.head_dims_padded(cfg.dims))
    return (cfg.dropout_rate > 0 or wider
            or position_bias.present(masks.from_treedef(cfg.mask_treedef)))


def route(cfg, dtype, mask, bias, sinks) -> bool:
    """Whether impl="auto" on cuda runs this call's forward here (when cuDNN does
    not): every feature supported, a Hopper GPU present, and for dropout
    (:func:`_explicit_only`) ``MosaicGpuBlockSizes`` in the spec."""
    if supports(cfg, dtype, mask, bias, sinks) or available() is not None:
        return False
    asked = blocks.pick(cfg.block_sizes, MosaicGpuBlockSizes, None) is not None
    return asked or not _explicit_only(cfg)


def _refuse(cfg, dtype, mask, bias, sinks):
    why = supports(cfg, dtype, mask, bias, sinks)
    if why:
        raise NotImplementedError(
            f"flash: the Mosaic GPU kernel does not support {'; '.join(why)}; {_ELSEWHERE}.")


# ----------------------------------------------------------------------------------
# Static facts of one call
# ----------------------------------------------------------------------------------


# How the kernel reads each mask array, from its canonical (B|1, H|1, Tq|1, Tk|1)
# shape: one value per (batch, head); one per query row; one per key.
_KINDS = ("scalar", "fscalar", "rows", "cols")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything the kernel needs at trace time (hashable)."""

    G: int                # query heads per kv head
    Tk: int               # unpadded kv length (keys past it are not visible)
    offset: int           # aligned query position = row + offset
    bq: int               # rows per consumer warpgroup
    bk: int
    stages: int
    n_kv: int             # kv-tiles per row of the schedule (padded Tk // bk)
    D: int
    scale: float
    softcap: Optional[float]
    mask_treedef: object  # None without a mask
    ragged_k: bool
    sched_b: bool         # the schedule varies along batch / heads
    sched_h: bool
    interpreted: bool     # run by the Mosaic GPU interpreter
    sinks: bool = False   # one sink logit per query head, joined to each row's state
    rate: float = 0.0     # dropout rate (0: none)
    operands: tuple = ()  # per mask array, in the mask's order: (kind, index in its stack)
    stacks: tuple = ()    # per kind present, in _KINDS order: (kind, count, along b, along h)
    flag: bool = False    # m = NaN on rows that met a non-finite logit or output
    programs: int = 0     # persistent programs walking the work items (0: one per item)
    q_buffers: int = 1    # 2: an item's Q loads while the one before it runs
    term: bool = False    # the mask carries a position term, added to every tile's logits

    @property
    def natural(self) -> bool:
        """The row state ``m`` is kept in natural units (a term without soft-cap:
        logits may be huge, and ``(s - m) * log2(e)`` stays exact where the
        fused ``s * log2(e) - m`` would not); else in base 2."""
        return self.term and self.softcap is None

    @property
    def rows(self) -> int:
        return 2 * self.bq

    def stack(self, kind):
        """``(count, along_b, along_h)`` of the arrays of ``kind``, or None."""
        return stack_of(self.stacks, kind)


def array_counts(mask) -> tuple:
    """``(per-row, per-key)``: how many of the mask's arrays the Mosaic GPU
    kernels keep in shared memory per query row and per key (shapes only).

    >>> ids = jnp.zeros((2, 100), jnp.int32)
    >>> array_counts(masks.segments(ids) & masks.lengths(jnp.ones(2, int)))
    (1, 1)
    """
    if mask is None or not mask.num_operands:
        return 0, 0
    ops = jax.eval_shape(lambda m: m.operands(), mask)
    return (sum(op.shape[2] > 1 for op in ops),
            sum(op.shape[3] > 1 and op.shape[2] == 1 for op in ops))


def stack_of(stacks, kind):
    """``(count, along_b, along_h)`` of the stacked mask arrays of ``kind`` in
    ``stacks`` (:func:`id_arrays`), or None when there are none."""
    return next((s[1:] for s in stacks if s[0] == kind), None)


# Mosaic GPU's profiler, for developers: ``(entries, directory)`` makes the
# compiled forward kernel record when each warpgroup enters and leaves the
# kernel's named regions (:func:`_region`: waits, the two products, the softmax,
# the epilogue), ``entries`` 32-bit words per warpgroup (events past them are
# dropped), and write a Chrome trace to ``directory`` after every call
# (``benchmarks/kernel_profile.py``). Read when a kernel is traced; None:
# off.
PROFILE = None


def _profiler_params():
    if PROFILE is None:
        return {}
    entries, where = PROFILE
    return dict(profile_space=entries, profile_dir=where, profile_bounds_check=True)


def _region(name):
    """A named region of the kernel: a timed span of each warpgroup's trace when
    :data:`PROFILE` is set, nothing otherwise."""
    return jax.named_scope(name)


def _compat_transpose(ref):
    """``ref`` seen with its two axes swapped, on either JAX's spelling."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return _plgpu().transpose_ref(ref, (1, 0))


def _kernel(q_ref, k_ref, v_ref, sched_ref, *refs, P: _Plan, dtype):
    plgpu = _plgpu()
    ring = P.stages
    q_tiles = pl.cdiv(q_ref.shape[1], P.rows)
    ids_ref = {s[0]: r for s, r in zip(P.stacks, refs)}
    refs = refs[len(P.stacks):]
    sinks_ref, refs = (refs[0], refs[1:]) if P.sinks else (None, refs)
    seed_ref, refs = (refs[0], refs[1:]) if P.rate > 0 else (None, refs)
    order_ref, refs = (refs[0], refs[1:]) if P.programs else (None, refs)
    o_ref, m_ref, l_ref = refs
    n_rows = (P.stack("rows") or (0,))[0]
    n_cols = (P.stack("cols") or (0,))[0]

    def body(S):
        wg = lax.axis_index("wg")
        # This program's work items: one from the grid; or, with ``P.programs``,
        # its share of every (batch, head, q-tile), in walk_order's order
        # (:class:`Walk`), on a persistent program per multiprocessor.
        if P.programs:
            sm = lax.axis_index("sm")
            walk = Walk(q_ref.shape[0], q_ref.shape[2], q_tiles, sched_ref.shape[0],
                        sched_ref.shape[1], P.programs)
            count = walk.count(sm, _rem)

        def item_at(i):
            """``(b, h, tile)`` of this program's ``i``-th item."""
            if not P.programs:
                # Heaviest q-tiles (the last, under causal-like masks) start first.
                tile = q_tiles - 1 - lax.axis_index("tiles")
                return lax.axis_index("batch"), lax.axis_index("heads"), tile
            return walk.item(i, sm, lambda j: order_ref[j], _div, _rem)

        def row_of(b, h, tile):
            """The index of an item's row in the visiting table."""
            return (b if P.sched_b else 0, h if P.sched_h else 0, tile)

        def info(i):
            """``(b, h, tile, n_full, n_seen, first)`` of this program's ``i``-th
            item: its row's counts and the first kv-tile it visits."""
            b, h, tile = item_at(i)
            row = row_of(b, h, tile)
            return (b, h, tile) + tuple(sched_ref[row + (c,)] for c in range(3))

        def each_item(item):
            """Runs ``item(i, cur, nxt, step) -> step`` on this program's work
            items in order and returns the last ``step``: the count of kv-tiles
            the program has walked so far, whose remainder by the ring's depth
            names the slot of the next tile (producer and consumers count alike).
            ``cur``: the item's :func:`info`; ``nxt``: the next item's (the
            last item's own for the last), read from memory one item ahead so
            that no item waits on the loads of its own indices."""
            if not P.programs:
                cur = info(0)
                return item(jnp.int32(0), cur, cur, jnp.int32(0))

            def one(i, carry):
                step, cur = carry[0], carry[1:]
                nxt = info(jnp.minimum(i + 1, count - 1))
                return (item(i, cur, nxt, step),) + nxt

            return lax.fori_loop(jnp.int32(0), count, one, (jnp.int32(0),) + info(0))[0]

        def kv_tile_of(b, h, tile):
            """The kv-tile visited at step ``t`` of an item (past its last, the last)."""
            row = row_of(b, h, tile)
            return lambda t: sched_ref[row + (2 + jnp.minimum(t, P.n_kv - 1),)]

        def slot_of(step):
            return lax.rem(step, jnp.int32(ring))

        def ids_at(kind, b, h):
            """The (batch|0, head|0) of (b, h) in the stacked arrays of ``kind``."""
            _, along_b, along_h = P.stack(kind)
            return (b if along_b else 0, h if along_h else 0)

        def take_turn():
            # The two consumers alternate at this barrier: one runs its softmax
            # while the other's matrix multiplies occupy the tensor cores.
            plgpu.barrier_arrive(S.turn)
            plgpu.barrier_wait(S.turn)

        def load_rows(item, buf):
            """Starts the copies of the Q tile of ``item`` (``(b, h, tile)``) and
            the mask's arrays along its rows into this consumer's buffer ``buf``."""
            b, h, tile = item
            q0 = tile * P.rows + wg * P.bq
            at = buf * 2 + wg
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, P.bq), h], S.q_smem.at[at],
                                    S.q_ready.at[at])
            if n_rows:
                plgpu.copy_gmem_to_smem(
                    ids_ref["rows"].at[ids_at("rows", b, h) + (slice(None), pl.ds(q0, P.bq))],
                    S.rows_smem.at[at], S.rows_ready.at[at])

        def consume_item(rows_layout, seed, i, cur, nxt, start):
            b, h, tile, n_full, n_seen, _ = cur
            kv_tile = kv_tile_of(b, h, tile)
            # The first PARTIAL tile's index, read now: the FULL tiles run
            # while it arrives (each PARTIAL step reads the next one's).
            first_partial = kv_tile(n_full)
            q0 = tile * P.rows + wg * P.bq
            if P.q_buffers == 1:
                load_rows((b, h, tile), 0)
                at = wg
            else:
                # Item i + 1's rows load into the other buffer while this item
                # runs (the item before this one, whose rows it held, has read
                # them and its output has left it).
                buf = _rem(i, 2)
                pl.when(i == 0)(lambda: load_rows((b, h, tile), buf))
                pl.when(i + 1 < count)(lambda: load_rows(nxt[:3], 1 - buf))
                at = buf * 2 + wg
            mine = S.q_smem.at[at]
            with _region("wait_q"):
                plgpu.barrier_wait(S.q_ready.at[at])

            m = _in_layout(jnp.full((P.bq,), -jnp.inf, F32), rows_layout, P)
            l = _in_layout(jnp.full((P.bq,), 0.0, F32), rows_layout, P)
            acc = _in_layout(jnp.full((P.bq, P.D), 0.0, F32), plgpu.Layout.WGMMA, P)
            row_ids, scalars = [], {}
            if n_rows:
                plgpu.barrier_wait(S.rows_ready.at[at])
                row_ids = [_load(S.rows_smem.at[at, c], rows_layout, P) for c in range(n_rows)]
            for kind in ("scalar", "fscalar"):  # (integers; a position term's floats)
                if P.stack(kind) is not None:
                    where = ids_at(kind, b, h)
                    scalars[kind] = [ids_ref[kind][where + (c,)]
                                     for c in range(P.stack(kind)[0])]

            with _region("wait_k"):
                @pl.when(n_seen > 0)
                def _():
                    plgpu.barrier_wait(S.k_ready.at[slot_of(start)])

                # Each item staggers the consumers anew: 1 falls in behind 0
                # here, and 0 waits for 1's last softmax at the end (below), so
                # 0's epilogue runs beside 1's last P V. Carried on across a
                # persistent program's items instead, the stagger would hold
                # 1's last P V until 0 had written its output and issued the
                # next item's first product (tensor cores idle meanwhile).
                pl.when(wg == 1)(take_turn)

            def step(t, carry, partial: bool):
                if partial:
                    # This tile's index came a step ahead; the next one's is
                    # read now, to arrive while this one runs.
                    acc, m, l, j = carry
                    j_next = kv_tile(t + 1)
                else:
                    acc, m, l = carry
                    j = kv_tile(t) if seed is not None or P.term else None
                slot = slot_of(start + t)
                reads_ids = partial and n_cols > 0

                def kv_ids():
                    # The arrays along the keys of this tile, streamed with K.
                    plgpu.barrier_wait(S.cols_ready.at[slot])
                    return [_load(S.cols_smem.at[slot, c], plgpu.Layout.WGMMA.reduce(0), P)
                            for c in range(n_cols)]

                def scores(s_ref):
                    plgpu.wgmma(s_ref, mine, _compat_transpose(S.k_smem.at[slot]))
                    # A PARTIAL tile's key arrays reach registers while the
                    # multiply runs and before the turn's wait, which absorbs
                    # their loads: past the turn the logits come next.
                    ids = kv_ids() if reads_ids else []
                    take_turn()
                    return s_ref[...], ids

                kind = "partial" if partial else "full"
                if P.interpreted:
                    # The interpreter's ``wgmma`` takes no transposed ref: the
                    # same product from the tiles in shared memory.
                    s = lax.dot_general(mine[...], S.k_smem.at[slot][...],
                                        (((1,), (1,)), ((), ())), preferred_element_type=F32)
                    ids = kv_ids() if reads_ids else []
                    take_turn()
                else:
                    with _region(kind + "_qk"):
                        s, ids = pl.run_scoped(scores, plgpu.ACC((P.bq, P.bk), F32))

                # (K and the tile's key arrays are read: the slot may be refilled)
                plgpu.barrier_arrive(S.k_free.at[slot])

                def softmax(s, ids, acc, m, l):
                    if P.flag:
                        # A non-finite logit becomes NaN (inf + inf * 0), before
                        # the soft-cap could make it finite; finite ones keep
                        # their bits. The NaN reaches the row's l through its
                        # weight, hidden or not (below), and flags the row in the
                        # epilogue. Elementwise and independent, unlike a row
                        # sum: no chain of adds, no shuffles.
                        s = s + s * 0.0
                    if P.term:  # scale * s + term, then the cap
                        s = s * P.scale + _term(q0, j, b, h, scalars, P)
                        if P.softcap is None:
                            c = 1.0  # natural units (P.natural): exp2((s - m) * log2(e))
                        else:
                            s = jnp.tanh(s * (1.0 / P.softcap))
                            c = P.softcap * LOG2E
                    elif P.softcap is None:
                        c = P.scale * LOG2E
                    else:  # softcap * tanh(scale * s / softcap), its factor folded into c
                        s = jnp.tanh(s * (P.scale / P.softcap))
                        c = P.softcap * LOG2E
                    if partial:
                        ops = _tile_operands(scalars, row_ids, ids, P)
                        visible = _visible(q0, j, b, h, ops, P)
                        if visible is not None:  # (a flagged hidden logit stays NaN)
                            s = jnp.where(visible, s,
                                          s * 0.0 - jnp.inf if P.flag else -jnp.inf)
                    m_new = jnp.maximum(m, s.max(axis=1) * c)
                    # A row that has seen no key keeps m = -inf; shifting it by
                    # 0 keeps its p at exp2(-inf) = 0 instead of NaN. FULL tiles
                    # come first and see every key, so they need no such guard.
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if partial else m_new
                    if P.natural:
                        alpha = jnp.exp2((m - m_use) * LOG2E)
                        p = jnp.exp2((s - lax.broadcast_in_dim(m_use, s.shape, [0])) * LOG2E)
                    else:
                        alpha = jnp.exp2(m - m_use)
                        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
                    l = l * alpha + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    if seed is not None:  # the denominator keeps every weight; P V the kept
                        p = jnp.where(_keep(seed, q0, j, b, h, P), p * (1 / (1 - P.rate)), 0.0)
                    p = p.astype(dtype)
                    return acc, m_new, l, p

                with _region(kind + "_softmax"):
                    acc, m_new, l, p = softmax(s, ids, acc, m, l)
                with _region("wait_v"):
                    plgpu.barrier_arrive(S.turn)
                    plgpu.barrier_wait(S.v_ready.at[slot])
                    plgpu.barrier_wait(S.turn)

                # (computed out here: ``run_state`` below must close over no
                # constant scalar, which its Mosaic GPU lowering cannot return)
                more, next_slot = t + 1 < n_seen, slot_of(start + t + 1)

                def accumulate(acc_ref):
                    plgpu.wgmma(acc_ref, p, S.v_smem.at[slot])

                    # Wait for the next K while this multiply runs.
                    @pl.when(more)
                    def _():
                        plgpu.barrier_wait(S.k_ready.at[next_slot])

                if P.interpreted:
                    # The interpreter's ``wgmma`` takes no operand in registers:
                    # the same product from the tile in shared memory.
                    acc = acc + jnp.dot(p, S.v_smem.at[slot][...], preferred_element_type=F32)

                    @pl.when(more)
                    def _():
                        plgpu.barrier_wait(S.k_ready.at[next_slot])
                else:
                    with _region(kind + "_pv"):
                        acc = pl.run_state(accumulate)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(S.v_free.at[slot])
                return (acc, m_new, l, j_next) if partial else (acc, m_new, l)

            carry = lax.fori_loop(jnp.int32(0), n_full, functools.partial(step, partial=False),
                                  (acc, m, l))
            acc, m, l, _ = lax.fori_loop(n_full, n_seen, functools.partial(step, partial=True),
                                         carry + (first_partial,))
            with _region("wait_turn"):
                pl.when(wg == 0)(take_turn)

            def epilogue(acc, m, l):
                if P.flag:  # 0, or NaN on a row that met a non-finite logit, V or output
                    flagged = (l + (acc * 0.0).sum(axis=1)) * 0.0
                inv = 1.0 / jnp.where(l > 0, l, 1.0)
                if P.sinks:  # the head's sink joins the denominator only
                    if P.natural:
                        a, m, l = online.sink_rescale(m, l, sinks_ref[h],
                                                      exp=lambda x: jnp.exp2(x * LOG2E))
                    else:
                        a, m, l = online.sink_rescale(m, l, sinks_ref[h] * LOG2E,
                                                      exp=jnp.exp2)
                    inv = a / jnp.where(l > 0, l, 1.0)
                mine[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
                S.m_smem.at[wg][...] = (m + flagged) if P.flag else m
                S.l_smem.at[wg][...] = l
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(mine, o_ref.at[b, pl.ds(q0, P.bq), h])
                plgpu.copy_smem_to_gmem(S.m_smem.at[wg], m_ref.at[b, h, pl.ds(q0, P.bq)])
                plgpu.copy_smem_to_gmem(S.l_smem.at[wg], l_ref.at[b, h, pl.ds(q0, P.bq)])
                # The next item may load its Q into this buffer once the copies
                # have read it; their writes to memory need not be waited for.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            with _region("epilogue"):
                epilogue(acc, m, l)
            return start + n_seen

        @pl.when(wg < 2)
        def _consume():
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
            rows_layout = plgpu.Layout.WGMMA.reduce(1)
            seed = None if seed_ref is None else dropout.seed_words(seed_ref)
            with _region("consumer"):
                each_item(functools.partial(consume_item, rows_layout, seed))
            # (Each item has waited for its stores to read shared memory, which
            # is all a program must wait for before it ends: the writes land
            # before the kernel is done, and the next program on this
            # multiprocessor need not wait for them.)

        def produce_item(i, cur, nxt, start):
            b, h, tile, n_full, n_seen, first = cur
            kv_tile = kv_tile_of(b, h, tile)
            kv_head = lax.div(h, jnp.int32(P.G))

            def issue(t, j):
                # ``j``: this tile's index, read a step ahead (the next one's
                # is read now). The ring's slot of this tile is free once both
                # consumers have handed back the tile it held (none before the
                # first lap).
                j_next = kv_tile(t + 1)
                step = start + t
                slot = slot_of(step)
                rows = (b, pl.ds(j * P.bk, P.bk), kv_head)
                with _region("wait_free"):
                    pl.when(step >= ring)(lambda: plgpu.barrier_wait(S.k_free.at[slot]))
                plgpu.copy_gmem_to_smem(k_ref.at[rows], S.k_smem.at[slot], S.k_ready.at[slot])
                if n_cols:  # the key arrays ride with K, for PARTIAL tiles only
                    @pl.when(t >= n_full)
                    def _():
                        keys = ids_at("cols", b, h) + (slice(None), pl.ds(j * P.bk, P.bk))
                        plgpu.copy_gmem_to_smem(ids_ref["cols"].at[keys], S.cols_smem.at[slot],
                                                S.cols_ready.at[slot])
                pl.when(step >= ring)(lambda: plgpu.barrier_wait(S.v_free.at[slot]))
                plgpu.copy_gmem_to_smem(v_ref.at[rows], S.v_smem.at[slot], S.v_ready.at[slot])
                return j_next

            lax.fori_loop(jnp.int32(0), n_seen, issue, first)
            return start + n_seen

        @pl.when(wg == 2)
        def _produce():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
            with _region("producer"):
                walked = each_item(produce_item)

            def drain(step, _):
                # Sees the ring's last hand-backs too, so every barrier phase is
                # observed before the barriers go (the interpreter checks it).
                plgpu.barrier_wait(S.k_free.at[slot_of(step)])
                plgpu.barrier_wait(S.v_free.at[slot_of(step)])

            lax.fori_loop(jnp.maximum(walked - ring, 0), walked, drain, None)

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = dict(
        q_smem=plgpu.SMEM((2 * P.q_buffers, P.bq, P.D), dtype, transforms=swizzled),
        k_smem=plgpu.SMEM((ring, P.bk, P.D), dtype, transforms=swizzled),
        v_smem=plgpu.SMEM((ring, P.bk, P.D), dtype, transforms=swizzled),
        m_smem=plgpu.SMEM((2, P.bq), F32),
        l_smem=plgpu.SMEM((2, P.bq), F32),
        q_ready=plgpu.Barrier(num_barriers=2 * P.q_buffers),
        k_ready=plgpu.Barrier(num_barriers=ring),
        v_ready=plgpu.Barrier(num_barriers=ring),
        k_free=plgpu.Barrier(num_arrivals=2, num_barriers=ring),
        v_free=plgpu.Barrier(num_arrivals=2, num_barriers=ring),
        turn=plgpu.Barrier(num_arrivals=2),
    )
    if n_rows:
        scratch.update(rows_smem=plgpu.SMEM((2 * P.q_buffers, n_rows, P.bq), jnp.int32),
                       rows_ready=plgpu.Barrier(num_barriers=2 * P.q_buffers))
    if n_cols:
        scratch.update(cols_smem=plgpu.SMEM((ring, n_cols, P.bk), jnp.int32),
                       cols_ready=plgpu.Barrier(num_barriers=ring))
    names = tuple(scratch)
    pl.run_scoped(lambda *r: body(types.SimpleNamespace(**dict(zip(names, r)))),
                  *scratch.values(), collective_axes="wg")


def _in_layout(x, layout, P: _Plan):
    """``x`` placed in the register layout of ``wgmma`` results (a no-op for
    the interpreter, which has no layouts)."""
    return x if P.interpreted else _plgpu().layout_cast(x, layout)


def _load(ref, layout, P: _Plan):
    """A 1-D shared-memory ref read into registers in ``layout``."""
    if P.interpreted:
        return ref[...]
    if _load_takes_an_index():  # jax 0.10: required; deprecated from 0.11
        return _plgpu().load(ref, (), layout=layout)
    return _plgpu().load(ref, layout=layout)


@functools.cache
def _load_takes_an_index() -> bool:
    param = inspect.signature(_plgpu().load).parameters.get("idx")
    return param is not None and param.default is inspect.Parameter.empty


def _iota(shape, axis, P: _Plan):
    if P.interpreted:
        return lax.broadcasted_iota(jnp.int32, shape, axis)
    plgpu = _plgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def _tile_operands(scalars, row_ids, kv_ids, P: _Plan):
    """The mask's arrays on one (bq, bk) tile, in the mask's order: the per-row
    and per-key vectors broadcast to the tile (in registers, no data moves),
    the per-(batch, head) values as scalars (``scalars``: by kind, "scalar"
    for integers, "fscalar" for a position term's floats)."""
    shape = (P.bq, P.bk)
    pick = {"scalar": lambda i: scalars["scalar"][i],
            "fscalar": lambda i: scalars["fscalar"][i],
            "rows": lambda i: lax.broadcast_in_dim(row_ids[i], shape, [0]),
            "cols": lambda i: lax.broadcast_in_dim(kv_ids[i], shape, [1])}
    return [pick[kind](i) for kind, i in P.operands]


def _term(q0, j, b, h, scalars, P: _Plan):
    """The position term on kv-tile ``j`` of the consumer's rows ``q0 ..`` (WGMMA
    layout): its arrays are per (batch, head), so every tile, FULL ones
    included, reads them from the scalars (the mask's other arrays are not
    read: the term sees only its own)."""
    qi, kj = _tile_indices(q0, j, P)
    ops = [scalars[kind][i] if kind in ("scalar", "fscalar") else None
           for kind, i in P.operands]
    pos = masks.Positions(b=b, h=h, q=qi, q_pos=qi + P.offset, k=kj)
    term = position_bias.term(masks.from_treedef(P.mask_treedef), pos, ops)
    return jnp.broadcast_to(term, (P.bq, P.bk))


def _tile_indices(q0, j, P: _Plan):
    """``(rows, keys)``: the indices of the consumer's rows ``q0 ..`` and of kv-tile
    ``j``'s keys on the (block_q, block_k) tile (WGMMA layout)."""
    return q0 + _iota((P.bq, P.bk), 0, P), j * P.bk + _iota((P.bq, P.bk), 1, P)


def _keep(seed, q0, j, b, h, P: _Plan):
    """Dropout's keep mask on kv-tile ``j`` of the consumer's rows ``q0 ..`` (WGMMA
    layout): :func:`fnattn.dropout.keep_mask` at the rows' and keys' indices."""
    return dropout.keep_mask(seed, b, h, *_tile_indices(q0, j, P), P.rate)


def _visible(q0, j, b, h, ops, P: _Plan):
    """Which keys of kv-tile ``j`` the consumer's rows ``q0 ..`` may see (WGMMA
    layout), or None for all of them (a tile PARTIAL only for padded rows).
    ``ops``: the mask's arrays on the tile (:func:`_tile_operands`)."""
    qi, kj = _tile_indices(q0, j, P)
    return visible_pairs(qi, kj, b, h, ops, P.mask_treedef, P.offset,
                         P.Tk if P.ragged_k else None)


def visible_pairs(qi, kj, b, h, ops, mask_treedef, offset, kv_len, q_len=None):
    """Which (query ``qi``, key ``kj``) pairs of a tile are visible: the mask's
    predicate (``ops``: its arrays on the tile; ``offset``: aligned query
    position minus row) and, unless ``kv_len`` (``q_len``) is None, ``kj <
    kv_len`` (``qi < q_len``). None when none applies (every pair visible).
    The Mosaic GPU kernels' PARTIAL tiles, forward and backward
    (:mod:`fnattn.flash.mosaic_gpu_bwd`).

    >>> qi, kj = jnp.arange(3)[:, None], jnp.arange(4)[None, :]
    >>> tree = jax.tree_util.tree_structure(masks.causal())
    >>> visible_pairs(qi, kj, 0, 0, [], tree, 0, 3).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    >>> visible_pairs(qi, kj, 0, 0, [], None, 0, None) is None
    True
    """
    ok = None
    if mask_treedef is not None:
        pos = masks.Positions(b=b, h=h, q=qi, q_pos=qi + offset, k=kj)
        ok = masks.from_treedef(mask_treedef).predicate(pos, ops)
    for idx, n in ((kj, kv_len), (qi, q_len)):
        if n is not None:
            inside = idx < n
            ok = inside if ok is None else ok & inside
    return ok


# ----------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------


def _schedule(cfg, mask, rows, bk):
    """The kernel's visiting table, int32 (B|1, H|1, q-tiles, 2 + kv-tiles):
    ``[n_full, n_visited, FULL tiles..., PARTIAL tiles..., repeats of the
    last]``. A read-only NumPy constant when the mask's tile classes are static
    (no arrays) and the table is not too large to embed (:func:`_static_table_of`);
    otherwise computed in XLA (from the mask's arrays:
    :func:`fnattn.masks.block_classes`), as the Triton kernels' table is.
    ``rows`` and ``bk``: the tiles of ``cfg``'s block sizes."""
    table = _static_table_of(cfg, mask)
    if table is not None:
        return table
    return dynamic_schedule(mask, cfg.dims, cfg.q_offset, rows, bk)


def dynamic_schedule(mask, dims, q_offset, block_rows, block_cols, *, transpose=False,
                     heads_per_row=1):
    """:func:`static_schedule`'s table for a mask holding arrays, computed in XLA
    from them (:func:`fnattn.masks.block_classes`): a jnp int32 array of the same
    layout, so that a new packing of documents does not recompile.

    >>> from fnattn._checks import Dims
    >>> ids = jnp.array([[0] * 64 + [1] * 192])
    >>> t = dynamic_schedule(masks.segments(ids), Dims(1, 256, 256, 1, 1, 64, 64), None,
    ...                      64, 128, transpose=True)
    >>> t[0, 0].tolist()  # kv tile 0 (both documents): every q tile PARTIAL; 1: 3 FULL
    [[0, 4, 0, 1, 2, 3], [3, 3, 1, 2, 3, 3]]
    """
    cls = masks.block_classes(mask, dims.batch, dims.num_q_heads, dims.q_len, dims.kv_len,
                              block_rows, block_cols, q_offset=q_offset)
    return visit_list(jnp, triton.row_classes(jnp, cls, transpose, heads_per_row))


@functools.lru_cache(maxsize=256)
def static_schedule(treedef, batch, num_heads, q_len, kv_len, block_rows, block_cols, q_offset,
                    *, transpose=False, heads_per_row=1):
    """The visiting table of the array-free mask ``treedef`` (None: no mask) as a
    read-only NumPy int32 array (B|1, H|1, row-tiles, 2 + col-tiles), or None
    when the mask's tile classes are not static. Per row ``[n_full, n_visited,
    FULL tiles..., PARTIAL tiles..., repeats of the last]``: one list, that a
    producer and its consumers walk alike.

    Rows are q tiles of ``block_rows`` and columns kv tiles of ``block_cols``
    (the forward's walk); with ``transpose``, rows are kv tiles of
    ``block_cols`` and columns the q tiles of ``block_rows`` that see them (the
    backward's dK/dV walk, :mod:`fnattn.flash.mosaic_gpu_bwd`). ``heads_per_row``
    > 1 merges the rows of that many consecutive heads (a tile FULL if FULL for
    all of them, visited if any sees it): :func:`visit_list` of
    :func:`fnattn.masks.block_classes_static`.

    >>> t = static_schedule(jax.tree_util.tree_structure(masks.causal()), 1, 1, 256, 256,
    ...                     64, 128, None, transpose=True)
    >>> t[0, 0].tolist()  # kv tile 0: 4 q tiles (2 FULL); kv tile 1: 2 q tiles
    [[2, 4, 2, 3, 0, 1], [0, 2, 2, 3, 3, 3]]
    """
    cls = masks.block_classes_static(masks.from_treedef(treedef), batch, num_heads, q_len,
                                     kv_len, block_rows, block_cols, q_offset=q_offset)
    if cls is None:
        return None
    table = visit_list(np, triton.row_classes(np, cls, transpose, heads_per_row))
    table.flags.writeable = False
    return table


def _static_table_of(cfg, mask):
    """The visiting table of ``cfg`` at its block sizes when it is static and
    embedded (:func:`fnattn.flash.blocks.embeds`), else None."""
    if mask is not None and mask.num_operands:
        return None
    d, bs = cfg.dims, _blocks_for(cfg)
    if not blocks.embeds(-(-d.q_len // (2 * bs.block_q)), -(-d.kv_len // bs.block_k)):
        return None
    treedef = None if mask is None else jax.tree_util.tree_structure(mask)
    return static_schedule(treedef, d.batch, d.num_q_heads, d.q_len, d.kv_len,
                           2 * bs.block_q, bs.block_k, cfg.q_offset)


def visit_list(xp, cls):
    """The visiting table of tile classes (…, rows, cols), as
    :func:`fnattn.flash.triton.row_classes` gives them: per row ``[n_full,
    n_visited, FULL tiles..., PARTIAL tiles..., repeats of the last]``, each
    kind in increasing order (:func:`fnattn.flash.blocks.ranked_order`: FULL
    tiles rank first, then PARTIAL), int32.

    >>> visit_list(np, np.array([[masks.PARTIAL, masks.FULL, masks.EMPTY, masks.FULL],
    ...                          [masks.EMPTY] * 4])).tolist()
    [[2, 3, 1, 3, 0, 0], [0, 0, 0, 0, 0, 0]]
    """
    n = cls.shape[-1]
    cols = xp.arange(n, dtype=np.int32)
    rank = xp.where(cls == masks.FULL, 0, xp.where(cls == masks.PARTIAL, 1, 2))
    order = blocks.ranked_order(xp, rank, 2)
    n_full = (cls == masks.FULL).sum(-1, keepdims=True).astype(np.int32)
    n_seen = (cls != masks.EMPTY).sum(-1, keepdims=True).astype(np.int32)
    last = xp.take_along_axis(order, xp.maximum(n_seen - 1, 0), axis=-1)
    order = xp.where(cols < n_seen, order, xp.where(n_seen > 0, last, 0))
    return xp.concatenate([n_full, n_seen, order], axis=-1).astype(np.int32)


def id_arrays(mask, Tqp, Tkp):
    """The mask's arrays as the Mosaic GPU kernels read them: int32 (float32
    for a position term's, kind "fscalar"), one stack
    per kind (:data:`_KINDS`), each (B|1, H|1, n) for scalars or (B|1, H|1, n,
    T) padded to ``Tqp`` rows or ``Tkp`` keys. Returns ``(operands, stacks,
    arrays)``, the first two for the kernels' plans.

    >>> ids = jnp.zeros((2, 100), jnp.int32)
    >>> ops, stacks, arrays = id_arrays(masks.segments(ids) & masks.lengths(jnp.ones(2, int)),
    ...                                 128, 256)
    >>> ops  # the segment ids' query and key sides, then the lengths
    (('rows', 0), ('cols', 0), ('scalar', 0))
    >>> for (kind, n, along_b, along_h), x in zip(stacks, arrays):
    ...     print(kind, n, along_b, along_h, x.shape)
    scalar 1 True False (2, 1, 1)
    rows 1 True False (2, 1, 1, 128)
    cols 1 True False (2, 1, 1, 256)
    """
    if mask is None or not mask.num_operands:
        return (), (), []
    groups = {kind: [] for kind in _KINDS}
    operands = []
    for op in mask.operands():
        along_q, along_k = op.shape[2] > 1, op.shape[3] > 1  # (never both: refused)
        kind = "rows" if along_q else "cols" if along_k else "scalar"
        if jnp.issubdtype(op.dtype, jnp.floating):  # a position term's (per batch, head)
            kind = "fscalar"
        operands.append((kind, len(groups[kind])))
        x = op[:, :, :, 0] if along_q else op[:, :, 0, :]
        groups[kind].append(x.astype(F32 if kind == "fscalar" else jnp.int32))
    stacks, arrays = [], []
    for kind in _KINDS:
        xs = groups[kind]
        if not xs:
            continue
        lead = (max(x.shape[0] for x in xs), max(x.shape[1] for x in xs))
        x = jnp.stack([jnp.broadcast_to(x, lead + x.shape[2:]) for x in xs], axis=2)
        if kind in ("scalar", "fscalar"):
            x = x[..., 0]
        else:
            x = triton._pad(x, 3, Tqp if kind == "rows" else Tkp)
        stacks.append((kind, len(xs), lead[0] > 1, lead[1] > 1))
        arrays.append(x)
    return tuple(operands), tuple(stacks), arrays


def _hidden_keys_inert(k, v):
    """K and V such that a key a row may not see contributes nothing to it, whatever
    its bits. On PARTIAL tiles the kernel sets hidden logits to -inf (so a
    non-finite K is dropped there), but ``P @ V`` multiplies the zero weights by V
    itself and 0 * NaN is NaN. So non-finite V entries become 0, and every key
    whose K or V holds a non-finite value gets a NaN logit from every row: its
    non-finite K entries become NaN (``q . k`` is then NaN, 0 * NaN included),
    and so does the whole K of a key whose V held one. Every row that sees such
    a key gets NaN, as in every lowering; rows that do not see it drop the
    logit. Only V is reduced over (a flag per key); K is rewritten elementwise.
    Only for masked specs (without a mask every visited key is seen by every
    row, and padding is zeros)."""
    fv = jnp.isfinite(v)
    bad_v = online.any_false(fv, -1, keepdims=True) > 0
    k = jnp.where(jnp.isfinite(k) & ~bad_v, k, jnp.asarray(jnp.nan, k.dtype))
    return k, jnp.where(fv, v, jnp.zeros_like(v))


def _blocks_for(cfg):
    return blocks.pick(cfg.block_sizes, MosaicGpuBlockSizes,
                       MosaicGpuBlockSizes.default(kernel_dim(cfg.dims)))


def forward(cfg, q, k, v, bias, sinks, mask, seed, *, interpret=False):
    """``(out, lse, lse_lo)`` of the flash forward on the Mosaic GPU kernel.

    The signature and results of every flash lowering's ``fwd``: "bthd" inputs,
    ``out`` (B, Tq, Hq, Dv) in q's dtype, ``lse`` and ``lse_lo`` (B, Hq, Tq)
    float32, lse in natural-log units. Head dims are padded to
    :func:`kernel_dim`. ``interpret``: False to compile for the GPU, or the
    parameters of the Mosaic GPU interpreter (:func:`interpret_params`) to run
    the same kernel on CPU.
    """
    _refuse(cfg, q.dtype, mask, bias, sinks)
    kcfg = at_kernel_dim(cfg)
    if kcfg is cfg:
        return _forward(cfg, q, k, v, sinks, mask, seed, interpret)
    Dp = kcfg.dims.head_dim
    out, lse, lse_lo = _forward(kcfg, pad_dim(q, Dp), pad_dim(k, Dp), pad_dim(v, Dp), sinks,
                                mask, seed, interpret)
    return out[..., :cfg.dims.v_head_dim], lse, lse_lo


def _forward(cfg, q, k, v, sinks, mask, seed, interpret):
    """:func:`forward` at the kernel's head dim (``D == Dv ==`` :func:`kernel_dim`)."""
    plgpu = _plgpu()
    d = cfg.dims
    bs = _blocks_for(cfg)
    rows, bk = 2 * bs.block_q, bs.block_k
    Tqp, Tkp = -(-d.q_len // rows) * rows, -(-d.kv_len // bk) * bk
    redo = mask is not None and bs.redoes(d.head_dim)
    table = _schedule(cfg, mask, rows, bk)
    operands, stacks, ids = id_arrays(mask, Tqp, Tkp)
    n_kv = Tkp // bk
    P = _Plan(G=d.group, Tk=d.kv_len,
              offset=d.kv_len - d.q_len if cfg.q_offset is None else cfg.q_offset,
              bq=bs.block_q, bk=bk, stages=min(bs.max_concurrent_steps, max(n_kv, 1)),
              n_kv=n_kv, D=d.head_dim, scale=float(cfg.scale),
              softcap=None if cfg.softcap is None else float(cfg.softcap),
              mask_treedef=None if mask is None else jax.tree_util.tree_structure(mask),
              ragged_k=d.kv_len % bk != 0,
              sched_b=table.shape[0] > 1, sched_h=table.shape[1] > 1,
              interpreted=bool(interpret), sinks=sinks is not None,
              rate=float(cfg.dropout_rate), operands=operands, stacks=stacks, flag=redo,
              term=position_bias.present(mask))
    n_rows, n_cols = ((stack_of(stacks, kind) or (0,))[0] for kind in ("rows", "cols"))
    need = bs.smem_bytes(d.head_dim, jnp.dtype(q.dtype).itemsize, row_arrays=n_rows,
                         key_arrays=n_cols)
    if need > SMEM_BYTES and P.stages == bs.max_concurrent_steps:
        raise ValueError(
            f"flash: MosaicGpuBlockSizes(block_q={bs.block_q}, block_k={bs.block_k}, "
            f"max_concurrent_steps={bs.max_concurrent_steps}) needs {need} bytes of shared "
            f"memory at head dim {d.head_dim} (with {n_rows} per-row and {n_cols} per-key "
            f"mask arrays), more than the {SMEM_BYTES} of a Hopper block; use smaller tiles "
            "or a shallower ring")
    sms = _programs(bool(interpret)) if bs.persistent else 0
    grid, grid_names, programs = launch_grid(d.batch, d.num_q_heads, Tqp // rows, bs.persistent,
                                             sms)
    P = dataclasses.replace(P, programs=programs,
                            q_buffers=q_buffers(bs, d.head_dim, q.dtype, stacks, programs))
    rows_out = jax.ShapeDtypeStruct((d.batch, d.num_q_heads, Tqp), F32)
    call = plgpu.kernel(
        functools.partial(_kernel, P=P, dtype=q.dtype),
        out_type=(jax.ShapeDtypeStruct((d.batch, Tqp, d.num_q_heads, d.head_dim), q.dtype),
                  rows_out, rows_out),
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, **_profiler_params()),
        interpret=interpret or None,
    )
    extra = [] if sinks is None else [sinks.astype(F32)]
    if cfg.dropout_rate > 0:
        extra.append(seed)
    if programs:
        extra.append(walk_order(np if isinstance(table, np.ndarray) else jnp, table, bs.walk))
    kk, vv = _hidden_keys_inert(k, v) if mask is not None and not redo else (k, v)
    out, m, l = call(triton._pad(q, 1, Tqp), triton._pad(kk, 1, Tkp), triton._pad(vv, 1, Tkp),
                     jnp.asarray(table), *ids, *extra)
    if redo:
        # Rows flagged by the kernel (m = NaN: a non-finite logit, hidden or not,
        # or a non-finite output) are recomputed, by blocks of its rows, by the
        # Triton forward, which makes hidden keys inert on the tiles it loads.
        # An unflagged row met only finite K and V on every tile it visited (a
        # non-finite K makes every logit of its key non-finite, a non-finite V
        # the outputs: 0 * inf and p * inf are), so the pass would have changed
        # nothing it sees: its results are the same bits.
        out, m, l = triton.redo_forward(cfg, q, k, v, sinks, mask, seed, table, m, out, m, l,
                                        bq=rows, bk=bk, interpret=bool(interpret))
    lse, lse_lo = triton.row_results(P.natural, m[:, :, :d.q_len], l[:, :, :d.q_len])
    return out[:, :d.q_len], lse, lse_lo


def _div(a, b: int):
    return lax.div(a, jnp.int32(b))


def _rem(a, b: int):
    return lax.rem(a, jnp.int32(b))


@dataclasses.dataclass(frozen=True)
class Walk:
    """How the programs of a persistent forward share its work items: every
    (batch row, head, q-tile), ``batch * heads * tiles`` of them, grouped by
    their row of the visiting table, shape ``(sched_b, sched_h, tiles)``
    (``sched_b`` 1 or ``batch``, ``sched_h`` 1 or ``heads``): the rows ranked
    (:func:`walk_order`: heaviest first, or in the grid's order), each row's
    items side by side. The programs take the ranked items in waves of
    ``programs``, in snake order (forward on even waves, backward on odd ones),
    so that the heaviest items spread evenly and no program ends far behind
    the others. ``div`` and ``rem``: integer division and remainder on
    non-negative values (``lax.div`` and ``lax.rem`` in the kernel).

    >>> walk = Walk(1, 2, 3, 1, 1, programs=4)  # 6 items; the rows ranked [2, 1, 0]
    >>> div, rem = int.__floordiv__, int.__mod__
    >>> [[walk.item(i, sm, [2, 1, 0].__getitem__, div, rem)
    ...   for i in range(walk.count(sm, rem))] for sm in range(4)]
    [[(0, 0, 2)], [(0, 1, 2)], [(0, 0, 1), (0, 1, 0)], [(0, 1, 1), (0, 0, 0)]]
    """

    batch: int
    heads: int
    tiles: int
    sched_b: int
    sched_h: int
    programs: int

    @property
    def items(self) -> int:
        return self.batch * self.heads * self.tiles

    def _slot(self, wave, sm, rem):
        """Where program ``sm`` takes its item of a wave: snake order."""
        return sm + rem(wave, 2) * (self.programs - 1 - 2 * sm)

    def count(self, sm, rem):
        """How many items program ``sm`` walks."""
        full, left = divmod(self.items, self.programs)
        return full + (self._slot(full, sm, rem) < left) * 1

    def item(self, i, sm, order, div, rem):
        """``(b, h, tile)`` of program ``sm``'s ``i``-th item; ``order(j)``: the
        table row ranked ``j`` (:func:`walk_order`)."""
        w = i * self.programs + self._slot(i, sm, rem)
        per_row = (self.batch // self.sched_b) * (self.heads // self.sched_h)
        row, e = order(div(w, per_row)), rem(w, per_row)
        tile, rest = rem(row, self.tiles), div(row, self.tiles)
        # A row spans the batch (or heads) its table does not vary along: one
        # of each pair below is 0.
        eh, eb = rem(e, self.heads // self.sched_h), div(e, self.heads // self.sched_h)
        return div(rest, self.sched_h) + eb, rem(rest, self.sched_h) + eh, tile


WALKS = ("heaviest", "tiles")


def walk_order(xp, table, walk="heaviest"):
    """The order in which persistent programs take the rows of a visiting table
    (``(B|1, H|1, tiles, 2 + n)``, flattened; :class:`Walk`). ``"heaviest"``:
    ranked by how many kv-tiles they visit, most first, later q-tiles first
    among equals: NumPy at trace time for a static table, else XLA.
    ``"tiles"``: the table's order with each (batch row, head)'s q-tiles from
    the last to the first, which depends on the table's shape alone (NumPy).

    >>> table = np.array([[[[0, 1], [0, 3], [0, 3], [0, 0]]]])
    >>> walk_order(np, table).tolist(), walk_order(np, table, "tiles").tolist()
    ([2, 1, 0, 3], [3, 2, 1, 0])
    """
    if walk == "tiles":
        rows, tiles = table.shape[0] * table.shape[1], table.shape[2]
        return (np.arange(rows, dtype=np.int32)[:, None] * tiles
                + np.arange(tiles - 1, -1, -1, dtype=np.int32)).reshape(-1)
    seen = table[..., 1].reshape(-1).astype(np.int32)
    return xp.lexsort((-xp.arange(seen.shape[0], dtype=np.int32), -seen)).astype(np.int32)


# Programs of a persistent forward in the Mosaic GPU interpreter: few, so that
# each walks several items and their counts differ.
INTERPRETED_PROGRAMS = 3


def launch_grid(batch, heads, q_tiles, persistent, sms):
    """``(grid, grid_names, programs)`` of the forward: a program per (head,
    q-tile, batch row), or with ``persistent`` ``programs`` of them (one per
    multiprocessor, at most one per item) walking the items in turn.

    >>> launch_grid(2, 16, 64, False, 132)
    ((16, 64, 2), ('heads', 'tiles', 'batch'), 0)
    >>> launch_grid(2, 16, 64, True, 132)
    ((132,), ('sm',), 132)
    >>> launch_grid(1, 2, 8, True, 132)[0]  # fewer items than multiprocessors
    (16,)
    """
    if not persistent:
        return (heads, q_tiles, batch), ("heads", "tiles", "batch"), 0
    programs = min(batch * heads * q_tiles, sms)
    return (programs,), ("sm",), programs


def q_buffers(bs, head_dim, dtype, stacks, programs) -> int:
    """2 when a persistent forward (``programs`` > 0) has the shared memory to
    load the next item's Q tiles (and per-row mask arrays) while it runs the
    current one, else 1.

    >>> bs = MosaicGpuBlockSizes.default(128)
    >>> [q_buffers(bs, 128, jnp.bfloat16, (), n) for n in (0, 132)]
    [1, 2]
    >>> q_buffers(MosaicGpuBlockSizes.default(256), 256, jnp.bfloat16, (), 132)
    1
    """
    if not programs:
        return 1
    rows, cols = ((stack_of(stacks, kind) or (0,))[0] for kind in ("rows", "cols"))
    need = bs.smem_bytes(head_dim, jnp.dtype(dtype).itemsize, row_arrays=rows, key_arrays=cols,
                         q_buffers=2)
    return 2 if need <= SMEM_BYTES else 1


@functools.lru_cache(maxsize=None)
def _programs(interpreted: bool) -> int:
    """How many persistent programs to launch: one per multiprocessor of the
    GPU this process traces for (:data:`fnattn._serving.NUM_SMS`, an H100
    SXM's, when it cannot tell), or
    :data:`INTERPRETED_PROGRAMS` in the interpreter."""
    if interpreted:
        return INTERPRETED_PROGRAMS
    try:
        return int(jax.devices("gpu")[0].core_count)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return NUM_SMS


def interpret_params():
    """Parameters that run the kernel in the Mosaic GPU interpreter (on CPU)."""
    from fnattn import _jax_private
    return _jax_private.get("mosaic_gpu_interpret_params")()


# The residuals are the Triton forward's: its dq and dk/dv kernels are the backward.
LOWERING = Lowering("flash-mosaic-gpu", functools.partial(forward, interpret=False),
                    triton.LOWERING.bwd)
