"""The Pallas Mosaic GPU backward of flash attention (Hopper, sm90a).

One fused kernel computes dQ, dK and dV, in the manner of FlashAttention-3:
a program owns a tile of keys of one (batch, kv head) and walks the query
tiles that see it, for every query head of its GQA group; dK and dV stay in
registers for the whole walk, and dQ is added into a float32 buffer in global
memory with TMA reductions (``copy_smem_to_gmem(..., reduction_op="add")``),
each program adding its share. The five products per step all run on
``wgmma``: ``S^T = K Q^T``, ``dP^T = V dO^T``, ``dV += P^T dO``,
``dK += dS^T Q``, ``dQ += dS K`` (seven would be needed by a dQ kernel apart).

Every program runs three warpgroups:

* Warpgroup 2 (*producer*) loads K and V once, then streams the step's Q and
  dO tiles (64 rows) and row statistics (``lse`` in base 2 and ``delta``)
  into a ring of ``max_concurrent_steps`` shared memory slots with TMA; a
  *ready* barrier per slot (all of a slot's copies) and a *consumed* barrier
  (both consumers done with it) hand the slots back and forth.
* Warpgroups 0 and 1 (*consumers*) compute. Their split depends on the head
  dim, because a consumer must hold a dK and a dV accumulator of 64 key rows:

  - ``D <= 128`` (*row split*): a program owns 128 keys and each consumer 64
    of them, with dK and dV over the whole head dim (2 x D/2 float32 registers
    a thread). Each writes its rows of dS^T to shared memory (double-buffered),
    both meet at a barrier, and dQ (64 x D) is computed in 64-column chunks,
    ``dS (64 x 128) @ K[:, chunk]``, chunk ``j`` by consumer ``j % 2`` (at
    ``D = 64``, the single chunk alternates between them step by step).
  - ``D > 128`` (*column split*): a program owns 64 keys, both consumers
    compute the same S^T and dP^T (twice the work for those two products: no
    register budget fits 64 x D float32 dK and dV at D = 256), and each
    accumulates dK and dV for its group of columns (128 + 128 at D = 256,
    128 + 64 at D = 192); Q, dO, K and V tiles are stored as those two column
    groups. The consumer with fewer columns writes dS^T to shared memory and
    computes all of dQ's chunks; no barrier.

dQ's float32 sum is a zeroed buffer the kernel adds into (aliased in and out
through ``pl.run_state``); XLA scales and casts it afterwards. Shared memory
(:meth:`MosaicGpuBwdBlockSizes.smem_bytes`, default rings): 145.5 KiB at D = 64,
193 KiB at D = 128 (K and V 64, the Q / dO ring 64, dS^T 32, dQ staging 32),
169 KiB at D = 192 and 217 KiB at D = 256 (K and V 64, the ring 128, dS^T 8,
dQ staging 16).

Which query tiles a program visits comes from the mask's block schedule,
transposed (:func:`fnattn.flash.mosaic_gpu.static_schedule`: per kv tile, the q
tiles that see it, FULL first; heads of a GQA group merged, a tile FULL only if
FULL for all of them): a NumPy constant for array-free masks, computed in XLA
from the arrays for masks holding them (segment ids, lengths, prefix-LM,
positions; :func:`fnattn.flash.mosaic_gpu.dynamic_schedule`). FULL tiles run
without mask code; PARTIAL ones evaluate the mask's predicate and the
ragged-length bound elementwise; EMPTY ones are never loaded. The mask's
arrays reach the predicate on the transposed tile in registers: the arrays
along the keys (kv segment ids) are copied once per program with K and V and
read along the tile's rows; those along the query rows (query segment ids,
positions) ride with the step's Q and dO, for PARTIAL steps only, and are
read along its columns; per-sequence values (lengths) are read as scalars.
Programs visit kv tiles in order: under causal-like masks the first ones,
which see the most query tiles, start first.

Residuals are the forward's (those of every flash lowering): ``lse`` in
natural log with ``lse_lo``. The wrapper folds them into the base-2 lse, in
two parts without a soft-cap (``hi + lo``, the forward's own base-2 ``m +
log2(l)`` to the last bit whatever the logits' size: ``P = exp2(s * c - hi) *
exp2(-lo)``, :func:`fnattn._online.backward_rows`) or one under a cap (``lse2 =
(lse + lse_lo) * log2(e)``, ``P = exp2(s * c - lse2)``), +inf for rows whose
``lse`` is not finite (rows that saw nothing; rows that saw a non-finite key)
and for padding rows, so that P is 0 there; and ``delta = rowsum(dO * O) -
d_lse`` (the lse cotangent folded in: ``dS = P * (dP - delta)``). Soft-cap
multiplies dS by ``1 - tanh^2``.

A position term (ALiBi, a ``from_fn`` term whose function Mosaic GPU
compiles, :data:`fnattn._functions.MOSAIC_GPU`, or a sum of them)
is added to every tile's ``scale * s``, FULL ones included, before the cap,
as in the forward, its slopes read as float scalars per (batch row, head).
Without a cap ``P`` is recomputed in natural units, ``exp2(((z - lse) -
lse_lo) * log2(e))`` with ``z = scale * s + term`` (lse_lo a third row
statistic), so that rows whose every logit is huge keep their weights.
Learned arrays (ALiBi's slopes, a ``from_fn``'s parameters;
``Config.term_grad``) get their gradient here too, in forward mode: per
step, the term's tangent in each array's value (a tile, ``jax.jvp`` of the
term) times dS, summed along the step's query rows into one float32 per key
in registers, for each head of the program; each consumer writes its keys'
sums once at the end (TMA, through shared memory) and XLA sums them over the
keys. Mosaic GPU lowers no sum over a whole tile, nor ``add_any``: a
``from_fn`` term that uses an array's value twice (``r * r``) keeps its
learned arrays on the Triton backward (:func:`fnattn._functions.refusals`).

Keys a row may not see contribute nothing to it whatever their bits: for a
masked spec each program zeroes the non-finite entries of its K tile in
shared memory before it walks (as :func:`fnattn._online.finite_keys` does;
no pass over K in XLA), so that ``dS @ K`` never meets 0 * inf; PARTIAL tiles
set hidden logits to -inf and select 0 for hidden dS entries (padding rows
hidden too, when ``Tq`` is not a multiple of 64), so whatever V holds there
reaches nothing through ``dP``; and a row that did see a non-finite key
already has a NaN ``out`` and so a NaN ``delta``: its gradients are NaN, as
with every lowering.

GQA: when there are enough programs, one program accumulates dK and dV over
the whole group and writes them in the input dtype. When ``B * Hkv * kv
tiles`` is small, the group is split over programs (as the Triton backward
does, :data:`fnattn.flash.triton.MIN_DKDV_PROGRAMS`) and float32 partials are
summed in XLA (row split only).

Supported: float16 / bfloat16, head dims ``D`` and ``Dv`` up to 256 (computed
at :func:`fnattn.flash.mosaic_gpu.kernel_dim`, their maximum rounded up to a
multiple of 64, with zero columns), any scale, soft-cap, attention sinks
(``P`` comes from the forward's ``lse``, which holds the sink; their gradient
is a sum over the row statistics in XLA),
dropout (the forward's keep mask drawn again on the transposed tile: ``dV``
takes the kept weights, ``dP`` is masked and scaled alike), GQA,
ragged lengths, no mask, an array-free mask (causal, sliding windows, chunks and
their ``&``, ``|``, ``~``) or a mask holding per-row, per-key or per-sequence
integer arrays, and a position term with its arrays held fixed or learned: what the
Mosaic GPU forward takes. :func:`supports` lists what else a spec asks for;
:func:`backward` refuses it with ``NotImplementedError``.

Timed on an H100 at T = 8192, D = 128 (benchmarks/results/gpu_h100_2026-11-26_s20):
forward + backward 1.32x faster than the Mosaic GPU forward with the Triton
backward without a mask, 1.39x causal, 1.26x with packed documents, and 0.97x
cuDNN's where cuDNN runs. So impl="auto" runs it wherever the Mosaic GPU
forward runs and the head dim is at most 128, without dropout (:func:`route`,
:func:`fnattn.flash.api.cuda_kernel`). Wider heads (the column split) and
dropout await their own timing: there ``MosaicGpuBwdBlockSizes`` in the spec's
block sizes asks for it, and otherwise the Triton backward runs.

On CPU the same kernel runs in the Mosaic GPU interpreter (``interpret=``
:func:`fnattn.flash.mosaic_gpu.interpret_params`). The interpreter takes no
transposed or register ``wgmma`` operand and has no TMA reduction: there the
products are ``jnp`` dots of the same shared-memory tiles and each dQ chunk is
read, added and written back (programs run one after the other there).

>>> from fnattn._checks import Dims
>>> from fnattn._dispatch import Config
>>> cfg = Config(Dims(1, 8192, 8192, 16, 16, 128, 128), 128 ** -0.5, None, 0.0, None)
>>> supports(cfg, jnp.bfloat16, None, None, None)
[]
>>> MosaicGpuBwdBlockSizes.default(128).smem_bytes(128) <= SMEM_BYTES
True
"""

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fnattn import _checks, dropout, masks, position_bias
from fnattn import _online as online
from fnattn._dispatch import Lowering
from fnattn.flash import blocks, mosaic_gpu, triton
from fnattn.flash.mosaic_gpu import (SMEM_BYTES, _compat_transpose, _in_layout, _iota, _load,
                                     _plgpu)

__all__ = ["MosaicGpuBwdBlockSizes", "LOWERING", "backward", "route", "supports"]

LOG2E = online.LOG2E
F32 = jnp.float32
# The Triton kernels take what this one refuses.
_ELSEWHERE = ("the Pallas Triton backward (fnattn/flash/triton.py, impl='pallas') "
              "supports it")
# Consumers hold dK, dV and the tiles of S^T and dP^T; the producer only issues copies.
_CONSUMER_REGISTERS, _PRODUCER_REGISTERS = 232, 40
# Rows of a q tile and keys per consumer: the M of one warpgroup's wgmma.
TILE = 64
# The widest head dim whose dK and dV (64 rows each, float32) one consumer holds.
_ROW_SPLIT_MAX_D = 128


# ----------------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MosaicGpuBwdBlockSizes:
    """Pipeline depth of the Mosaic GPU backward.

    The tiles are fixed by the design (64 query rows a step, 64 keys a
    consumer); what may be tuned is how far the producer runs ahead.

    Attributes:
      max_concurrent_steps: depth of the Q / dO / row-statistics ring, 2 to 4.

    >>> tuple(MosaicGpuBwdBlockSizes.default(d).smem_bytes(d) for d in (64, 128, 192, 256))
    (149568, 197680, 173104, 222256)
    >>> MosaicGpuBwdBlockSizes(max_concurrent_steps=1)
    Traceback (most recent call last):
    ...
    ValueError: MosaicGpuBwdBlockSizes: max_concurrent_steps must be 2, 3 or 4; got 1
    """

    max_concurrent_steps: int = 2

    def __post_init__(self):
        if self.max_concurrent_steps not in (2, 3, 4):
            raise ValueError("MosaicGpuBwdBlockSizes: max_concurrent_steps must be 2, 3 or 4; "
                             f"got {self.max_concurrent_steps!r}")

    @classmethod
    def default(cls, head_dim: int) -> "MosaicGpuBwdBlockSizes":
        """The deepest ring that leaves the shared memory of an H100 comfortable."""
        return cls(max_concurrent_steps=3 if head_dim <= 64 else 2)

    def smem_bytes(self, head_dim: int, itemsize: int = 2, *, row_arrays: int = 0,
                   key_arrays: int = 0, row_stats: int = 2, term_sums: int = 0) -> int:
        """Shared memory a program allocates, as Mosaic GPU counts it
        (:func:`fnattn.flash.mosaic_gpu.smem_layout_bytes`): K and V, the Q /
        dO / statistics ring, dS^T, the float32 staging of dQ chunks, the int32
        tiles of a mask's per-row arrays (in the ring, ``row_arrays`` of them)
        and per-key arrays (the program's keys, ``key_arrays`` of them), and
        the barriers. ``row_stats``: lse and delta, and lse's low part for a
        position term in natural units (:attr:`_Plan.natural`). ``term_sums``:
        the per-key float32 sums of a learned term's gradient a consumer
        writes (the program's heads times the learned arrays).

        >>> MosaicGpuBwdBlockSizes().smem_bytes(128, row_arrays=1, key_arrays=1)
        199744
        """
        ring = self.max_concurrent_steps
        row_split = head_dim <= _ROW_SPLIT_MAX_D
        groups = 2 if row_split else 1
        if row_split:
            widths = [head_dim]
        else:
            w0 = TILE * -(-head_dim // (2 * TILE))
            widths = [w0, head_dim - w0]
        ds_bufs, ds_groups, stages = (2, groups, 2) if row_split else (1, 1, 1)
        buffers = ([ring * TILE * w * itemsize for w in widths] * 2      # Q, dO
                   + [groups * TILE * w * itemsize for w in widths] * 2  # K, V
                   + [ring * row_stats * TILE * 4,                       # lse and delta
                      ds_bufs * ds_groups * TILE * TILE * itemsize,      # dS^T
                      stages * TILE * TILE * 4])                         # dQ staging
        barriers = 2 * ring + 2
        if row_arrays:
            buffers.append(ring * row_arrays * TILE * 4)
            barriers += ring
        if key_arrays:
            buffers.append(groups * key_arrays * TILE * 4)
        if term_sums:
            # the sums, and the scratch Mosaic GPU's lowering allocates for
            # summing a tile along its rows (2 KiB, measured on 0.10 and 0.11)
            buffers += [2 * term_sums * TILE * 4, 2048]
        return mosaic_gpu.smem_layout_bytes(buffers, barriers)


# ----------------------------------------------------------------------------------
# What the kernel takes
# ----------------------------------------------------------------------------------


def supports(cfg, dtype, mask, bias, sinks) -> list:
    """Why the spec's backward cannot run on this kernel (empty: it can), from static
    facts. ``mask`` is the mask object (or None); ``bias`` and ``sinks`` are arrays
    or None.

    >>> from fnattn._checks import Dims
    >>> from fnattn._dispatch import Config
    >>> cfg = Config(Dims(1, 256, 256, 4, 2, 80, 80), 0.1, None, 0.0, None)
    >>> supports(cfg, jnp.float16, masks.causal(), None, None)  # (computed at D = 128)
    []
    >>> wide = Config(Dims(1, 256, 256, 4, 2, 320, 320), 0.1, None, 0.0, None)
    >>> supports(wide, jnp.float16, masks.causal(), None, None)
    ['head dim D=320 (the kernel computes at a multiple of 64 up to 256)']
    """
    d = cfg.dims
    why = (mosaic_gpu.maskless_refusals(cfg, dtype, bias, sinks)
           + mosaic_gpu.term_refusals(mask, cfg.term_grad))
    if mask is not None and not _checks.symbolic_sizes(B=d.batch, Tq=d.q_len, Tk=d.kv_len):
        if mask.num_operands:
            why += mosaic_gpu.operand_refusals(mask)
            if any(op.shape[1] > 1 and op.shape[3] > 1
                   for op in jax.eval_shape(lambda m: m.operands(), mask)):
                # (no fnattn mask holds such arrays: segment ids are per batch row)
                why.append(f"a mask array along the keys that varies along heads ({mask!r})")
        elif masks.block_classes_static(mask, d.batch, d.num_q_heads, d.q_len, d.kv_len,
                                        TILE, TILE, q_offset=cfg.q_offset) is None:
            why.append(f"a mask whose tile classes are not static ({mask!r})")
        if not why:
            why += _term_sums_refusals(cfg, mask)
    return why


def _term_sums_refusals(cfg, mask) -> list:
    """A learned term's per-key gradient sums (one float32 tile row per head of a
    program and learned array) that leave no ring in shared memory: the column
    split (D > 128) keeps the whole GQA group in one program, so a wide head
    with a large group can ask for more than a Hopper block holds even at the
    smallest ring.

    >>> from fnattn import position_bias
    >>> from fnattn._checks import Dims
    >>> from fnattn._dispatch import Config
    >>> alibi = position_bias.attach(None, position_bias.alibi(jnp.ones(16)))
    >>> cfg = Config(Dims(1, 1024, 1024, 16, 1, 256, 256), 0.1, None, 0.0, None,
    ...              term_grad=(0,))
    >>> print(*_term_sums_refusals(cfg, alibi))  # doctest: +NORMALIZE_WHITESPACE
    the gradient of 1 learned position-term array for 16 query heads per program at
    head dim 256 (233520 bytes of shared memory at the smallest ring, more than
    232448 of a Hopper block)
    """
    if not cfg.term_grad or not position_bias.present(mask):
        return []
    d = mosaic_gpu.at_kernel_dim(cfg).dims
    Gp = _heads_per_program(d)
    n_arrays = len(position_bias.term_operands(mask))
    rows, cols = mosaic_gpu.array_counts(mask)
    need = MosaicGpuBwdBlockSizes(max_concurrent_steps=2).smem_bytes(
        d.head_dim, row_arrays=rows, key_arrays=cols, row_stats=3 if cfg.softcap is None else 2,
        term_sums=Gp * n_arrays)
    if need <= SMEM_BYTES:
        return []
    return [f"the gradient of {n_arrays} learned position-term array"
            f"{'s' if n_arrays > 1 else ''} for {Gp} query heads per program at head dim "
            f"{d.head_dim} ({need} bytes of shared memory at the smallest ring, more than "
            f"{SMEM_BYTES} of a Hopper block)"]


def route(cfg, dtype, mask, bias, sinks) -> bool:
    """Whether impl="auto" on cuda runs this call's backward here, once the Mosaic
    GPU forward runs it (:func:`fnattn.flash.mosaic_gpu.route`): the kernel takes
    the spec, and either ``MosaicGpuBwdBlockSizes`` are in the spec or the spec
    takes the path timed on an H100: the row split (a head dim of at most 128;
    timed at 128) without dropout or a position term. The column split of
    wider heads, which recomputes S and dP per column half, dropout and a
    term (ALiBi) are untimed.

    >>> from fnattn._checks import Dims
    >>> from fnattn._dispatch import Config
    >>> cfg = Config(Dims(1, 256, 256, 4, 2, 128, 128), 0.1, None, 0.0, None)
    >>> route(cfg, jnp.bfloat16, masks.causal(), None, None)
    True
    >>> wide = Config(Dims(1, 256, 256, 4, 2, 256, 256), 0.1, None, 0.0, None)
    >>> route(wide, jnp.bfloat16, masks.causal(), None, None)
    False
    >>> route(dataclasses.replace(wide, block_sizes=MosaicGpuBwdBlockSizes()), jnp.bfloat16,
    ...       masks.causal(), None, None)
    True
    """
    if supports(cfg, dtype, mask, bias, sinks):
        return False
    if blocks.pick(cfg.block_sizes, MosaicGpuBwdBlockSizes, None) is not None:
        return True
    return (mosaic_gpu.kernel_dim(cfg.dims) <= _ROW_SPLIT_MAX_D and cfg.dropout_rate == 0
            and not position_bias.present(mask))


def _refuse(cfg, dtype, mask, bias, sinks):
    why = supports(cfg, dtype, mask, bias, sinks)
    if why:
        raise NotImplementedError(
            f"flash: the Mosaic GPU backward does not support {'; '.join(why)}; {_ELSEWHERE}.")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything the kernel needs at trace time (hashable)."""

    B: int
    Hq: int
    G: int                # query heads per kv head
    Gp: int               # query heads per program (divides G)
    Tq: int
    Tk: int               # unpadded kv length (keys past it are not visible)
    q_offset: Optional[int]
    offset: int           # aligned query position = row + offset
    D: int
    ring: int
    scale: float
    softcap: Optional[float]
    mask_treedef: object  # None without a mask
    interpreted: bool     # run by the Mosaic GPU interpreter
    operands: tuple = ()  # per mask array, in the mask's order: (kind, index in its stack)
    stacks: tuple = ()    # per kind present: (kind, count, along b, along h)
    rate: float = 0.0     # dropout rate (0: none)
    term: bool = False    # a position term (ALiBi), added to every tile's logits
    term_grad: tuple = () # the term's operands (indices in P.operands) whose gradient
                          # the kernel sums (learned arrays): one float32 per key

    @property
    def natural(self) -> bool:
        """P recomputed in natural units, ``exp2(((z - lse) - lse_lo) * log2 e)``
        with ``z = scale * s + term`` (a term without soft-cap, whose logits
        may all be huge: as the forward keeps its row state)."""
        return self.term and self.softcap is None

    @property
    def split(self) -> bool:
        """P recomputed in base 2 from the lse in two parts, ``exp2(s * c -
        hi) * exp2(-lo)`` (no term and no cap: logits from ``q.k`` may be huge, and
        ``hi + lo`` is the forward's base-2 ``m + log2(l)`` to the last bit,
        :func:`fnattn._online.backward_rows`)."""
        return not self.term and self.softcap is None

    @property
    def row_stats(self) -> int:
        """Row statistics per step: lse (base 2, in two parts, or natural with
        lse_lo) and delta."""
        return 3 if self.natural or self.split else 2

    def stack(self, kind):
        """``(count, along_b, along_h)`` of the mask arrays of ``kind``, or None."""
        return mosaic_gpu.stack_of(self.stacks, kind)

    @property
    def row_split(self) -> bool:
        return self.D <= _ROW_SPLIT_MAX_D

    @property
    def kv_rows(self) -> int:
        """Keys of one program."""
        return 2 * TILE if self.row_split else TILE

    @property
    def row_groups(self) -> int:
        return 2 if self.row_split else 1

    @property
    def col_groups(self) -> tuple:
        """(first column, width) of the column groups tiles are stored in."""
        if self.row_split:
            return ((0, self.D),)
        w0 = TILE * -(-self.D // (2 * TILE))
        return ((0, w0), (w0, self.D - w0))

    @property
    def dq_wg(self) -> int:
        """Column split: the consumer that computes dQ (the one with fewer columns)."""
        return 1

    @property
    def Hp(self) -> int:
        return self.Hq // self.Gp

    @property
    def direct(self) -> bool:
        """One program per kv head: dK and dV written in the input dtype."""
        return self.Gp == self.G

    @property
    def Tqp(self) -> int:
        return -(-self.Tq // TILE) * TILE

    @property
    def Tkp(self) -> int:
        return -(-self.Tk // self.kv_rows) * self.kv_rows

    @property
    def ragged_k(self) -> bool:
        return self.Tk % self.kv_rows != 0

    def table(self):
        """The visiting table of an array-free mask (a NumPy constant), or None
        when it is too large to embed (:func:`fnattn.flash.blocks.embeds`)."""
        if not blocks.embeds(self.Tkp // self.kv_rows, self.Tqp // TILE):
            return None
        return mosaic_gpu.static_schedule(self.mask_treedef, self.B, self.Hq, self.Tq, self.Tk,
                                          TILE, self.kv_rows, self.q_offset, transpose=True,
                                          heads_per_row=self.Gp)


# ----------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------


def _kernel(q_ref, k_ref, v_ref, do_ref, st_ref, sched_ref, *refs, P: _Plan, sched_b: bool,
            sched_h: bool, dtype):
    plgpu = _plgpu()
    ring, RG, CG = P.ring, P.row_groups, len(P.col_groups)
    full_cols = CG == 1
    ids_ref = {s[0]: r for s, r in zip(P.stacks, refs)}
    refs = refs[len(P.stacks):]
    seed_ref, refs = (refs[0], refs[1:]) if P.rate > 0 else (None, refs)
    dq_ref, dk_ref, dv_ref = refs[:3]
    dterm_ref = refs[3] if P.term_grad else None
    n_rows = (P.stack("rows") or (0,))[0]
    n_cols = (P.stack("cols") or (0,))[0]

    def body(q_smem, do_smem, k_smem, v_smem, st_smem, ds_smem, stage, ready, consumed,
             kv_ready, pair, dq_bar, rows_smem, rows_ready, cols_smem, dterm_smem):
        hp, tile, b = lax.axis_index("heads"), lax.axis_index("tiles"), lax.axis_index("batch")
        wg = lax.axis_index("wg")
        kv0 = tile * P.kv_rows
        kv_head = lax.div(hp * P.Gp, jnp.int32(P.G))
        row = (b if sched_b else 0, hp if sched_h else 0, tile)
        n_steps = sched_ref[row + (1,)] * P.Gp
        full_steps = sched_ref[row + (0,)] * P.Gp

        def at_step(t):
            """(q tile, query head) of step t: each scheduled tile for every head."""
            if P.Gp == 1:
                s, g = t, 0
            else:
                s, g = lax.div(t, jnp.int32(P.Gp)), lax.rem(t, jnp.int32(P.Gp))
            return sched_ref[row + (2 + s,)], hp * P.Gp + g

        def slot_of(t):
            return lax.rem(t, jnp.int32(ring))

        def cols(h):
            c0, w = P.col_groups[h]
            return () if full_cols else (pl.ds(c0, w),)

        def ids_at(kind, head):
            """The (batch|0, head|0) of ``head`` in the stacked mask arrays of ``kind``."""
            _, along_b, along_h = P.stack(kind)
            return (b if along_b else 0, head if along_h else 0)

        @pl.when(wg == 2)
        def _produce():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
            for r in range(RG):
                keys = (b, pl.ds(kv0 + r * TILE, TILE), kv_head)
                for h in range(CG):
                    plgpu.copy_gmem_to_smem(k_ref.at[keys + cols(h)], k_smem[h].at[r],
                                            kv_ready)
                    plgpu.copy_gmem_to_smem(v_ref.at[keys + cols(h)], v_smem[h].at[r],
                                            kv_ready)
                if n_cols:  # the mask's arrays along the program's keys: once
                    at = ids_at("cols", 0) + (slice(None), pl.ds(kv0 + r * TILE, TILE))
                    plgpu.copy_gmem_to_smem(ids_ref["cols"].at[at], cols_smem.at[r],
                                            kv_ready)

            def issue(t, slot, at):
                i, head = at
                rows = (b, pl.ds(i * TILE, TILE), head)
                for h in range(CG):
                    plgpu.copy_gmem_to_smem(q_ref.at[rows + cols(h)], q_smem[h].at[slot],
                                            ready.at[slot])
                    plgpu.copy_gmem_to_smem(do_ref.at[rows + cols(h)], do_smem[h].at[slot],
                                            ready.at[slot])
                plgpu.copy_gmem_to_smem(
                    st_ref.at[b, head, pl.ds(0, P.row_stats), pl.ds(i * TILE, TILE)],
                    st_smem.at[slot], ready.at[slot])
                if n_rows:  # the arrays along the step's rows, for PARTIAL steps only
                    @pl.when(t >= full_steps)
                    def _():
                        at = ids_at("rows", head) + (slice(None), pl.ds(i * TILE, TILE))
                        plgpu.copy_gmem_to_smem(ids_ref["rows"].at[at], rows_smem.at[slot],
                                                rows_ready.at[slot])

            # Fill the ring. The first steps' indices are read from memory
            # beside the row's counts, not after them (clamped to the row's
            # width; a step past the count is not issued).
            last = (sched_ref.shape[-1] - 3) * P.Gp + P.Gp - 1
            first = [at_step(jnp.int32(min(t, last))) for t in range(ring)]
            for t in range(ring):
                pl.when(t < n_steps)(lambda t=t: issue(jnp.int32(t), t, first[t]))

            def refill(t, _):
                slot = slot_of(t)
                at = at_step(t)  # (read from memory while the slot is in use)
                plgpu.barrier_wait(consumed.at[slot])
                issue(t, slot, at)

            lax.fori_loop(jnp.int32(ring), jnp.maximum(n_steps, ring), refill, None)

            def drain(t, _):
                # The ring's last hand-backs, so that every barrier phase is seen
                # before the barriers go (the interpreter checks it).
                plgpu.barrier_wait(consumed.at[slot_of(t)])

            lax.fori_loop(jnp.maximum(n_steps - ring, 0), n_steps, drain, None)

        for c in range(2):
            pl.when(wg == c)(functools.partial(
                _consume, c, P=P, dtype=dtype, b=b, hp=hp, kv0=kv0, n_steps=n_steps,
                full_steps=full_steps, at_step=at_step, slot_of=slot_of, ids_at=ids_at,
                refs=(q_smem, do_smem, k_smem, v_smem, st_smem, ds_smem, stage, ready,
                      consumed, kv_ready, pair, dq_bar, dq_ref, dk_ref, dv_ref),
                dterm=(dterm_ref, dterm_smem),
                id_refs=(ids_ref, rows_smem, rows_ready, cols_smem), seed_ref=seed_ref))

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    staged = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    widths = [w for _, w in P.col_groups]
    ds_bufs, ds_groups, n_stages = (2, RG, 2) if P.row_split else (1, 1, 1)
    pl.run_scoped(
        body,
        tuple(plgpu.SMEM((ring, TILE, w), dtype, transforms=swizzled) for w in widths),
        tuple(plgpu.SMEM((ring, TILE, w), dtype, transforms=swizzled) for w in widths),
        tuple(plgpu.SMEM((RG, TILE, w), dtype, transforms=swizzled) for w in widths),
        tuple(plgpu.SMEM((RG, TILE, w), dtype, transforms=swizzled) for w in widths),
        plgpu.SMEM((ring, P.row_stats, TILE), F32),
        plgpu.SMEM((ds_bufs, ds_groups, TILE, TILE), dtype, transforms=swizzled),
        plgpu.SMEM((n_stages, TILE, TILE), F32, transforms=staged),
        plgpu.Barrier(num_arrivals=2 * CG + 1, num_barriers=ring),
        plgpu.Barrier(num_arrivals=2, num_barriers=ring),
        plgpu.Barrier(num_arrivals=RG * (2 * CG + (1 if n_cols else 0))),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_barriers=2) if P.interpreted else None,
        plgpu.SMEM((ring, n_rows, TILE), jnp.int32) if n_rows else None,
        plgpu.Barrier(num_barriers=ring) if n_rows else None,
        plgpu.SMEM((RG, n_cols, TILE), jnp.int32) if n_cols else None,
        # the sums of a learned term's gradient, per key, of each consumer
        plgpu.SMEM((2, P.Gp * len(P.term_grad), TILE), F32) if P.term_grad else None,
        collective_axes="wg",
    )


def _consume(c, *, P: _Plan, dtype, b, hp, kv0, n_steps, full_steps, at_step, slot_of, ids_at,
             refs, id_refs, seed_ref, dterm):
    """Consumer warpgroup ``c`` (static): its dK and dV, and its share of dQ."""
    plgpu = _plgpu()
    (q_smem, do_smem, k_smem, v_smem, st_smem, ds_smem, stage, ready, consumed, kv_ready,
     pair, dq_bar, dq_ref, dk_ref, dv_ref) = refs
    ids_ref, rows_smem, rows_ready, cols_smem = id_refs
    seed = None if seed_ref is None else dropout.seed_words(seed_ref)
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    RG, CG = P.row_groups, len(P.col_groups)
    mine_r = c if P.row_split else 0      # the key rows of this consumer (row group)
    mine_h = 0 if P.row_split else c      # the dK / dV columns of this consumer (col group)
    c0, w = P.col_groups[mine_h]
    keys0 = kv0 + mine_r * TILE
    n_chunks = P.D // TILE
    plgpu.barrier_wait(kv_ready)
    if P.mask_treedef is not None:
        # Hidden keys contribute nothing whatever their bits: their dS is 0 on
        # PARTIAL tiles (a select, whatever dP = V dO^T holds there), and K
        # with its non-finite entries zeroed keeps dS @ K finite there (as
        # fnattn._online.finite_keys does, here on the program's tile in
        # shared memory: each consumer its own rows or columns, then both meet
        # before either reads the other's). V needs no such pass: it reaches
        # dQ, dK and dV only through dP, and only where dS is not set to 0.
        tile = k_smem[mine_h].at[mine_r]
        x = tile[...].astype(F32)
        tile[...] = jnp.where(x - x == 0.0, x, 0.0).astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(pair)
        plgpu.barrier_wait(pair)

    def dot(a, b_, contract_b=0):
        return lax.dot_general(a, b_, (((1,), (contract_b,)), ((), ())),
                               preferred_element_type=F32)

    def scores(slot):
        """S^T = K Q^T and dP^T = V dO^T of this consumer's keys, (64, 64) float32."""
        if P.interpreted:
            # The interpreter's ``wgmma`` takes no transposed ref: the same
            # products from the tiles in shared memory.
            st = sum(dot(k_smem[h].at[mine_r][...], q_smem[h].at[slot][...], 1)
                     for h in range(CG))
            dpt = sum(dot(v_smem[h].at[mine_r][...], do_smem[h].at[slot][...], 1)
                      for h in range(CG))
            return st, dpt

        def products(s_ref, dp_ref):
            for h in range(CG):
                plgpu.wgmma(s_ref, k_smem[h].at[mine_r], _compat_transpose(q_smem[h].at[slot]))
            for h in range(CG):
                plgpu.wgmma(dp_ref, v_smem[h].at[mine_r],
                            _compat_transpose(do_smem[h].at[slot]))
            return s_ref[...], dp_ref[...]

        return pl.run_scoped(products, plgpu.ACC((TILE, TILE), F32),
                             plgpu.ACC((TILE, TILE), F32))

    def row_stat(slot, which):
        """lse2 (0; natural lse with :attr:`_Plan.natural`), delta (1) or lse_lo
        (2: natural, or ``exp2(-lo)`` of lse2's low part with
        :attr:`_Plan.split`) of the step's 64 rows, broadcast over the keys."""
        ref = st_smem.at[slot, which]
        x = _load(ref, plgpu.Layout.WGMMA.reduce(0), P)
        return lax.broadcast_in_dim(x, (TILE, TILE), [1])

    def tile_operands(slot, head):
        """The mask's arrays on the step's transposed tile (keys x queries), in
        the mask's order: the query rows' arrays along its columns, the keys'
        along its rows (registers only), per-sequence values as scalars."""
        shape, ops = (TILE, TILE), []
        for kind, n in P.operands:
            if kind in ("scalar", "fscalar"):
                ops.append(ids_ref[kind][ids_at(kind, head) + (n,)])
            elif kind == "rows":
                x = _load(rows_smem.at[slot, n], plgpu.Layout.WGMMA.reduce(0), P)
                ops.append(lax.broadcast_in_dim(x, shape, [1]))
            else:
                x = _load(cols_smem.at[mine_r, n], plgpu.Layout.WGMMA.reduce(1), P)
                ops.append(lax.broadcast_in_dim(x, shape, [0]))
        return ops

    def term_operands(head):
        """The per-(batch, head) scalars a position term reads (None for the
        mask's other arrays, which it does not see), on every tile."""
        return [ids_ref[kind][ids_at(kind, head) + (n,)]
                if kind in ("scalar", "fscalar") else None for kind, n in P.operands]

    def probs_and_ds(st, dpt, slot, i, head, partial):
        visible = None
        if partial:
            visible = _visible_t(i, keys0, b, head, tile_operands(slot, head), P)
        z = None
        if P.term:  # scale * s + term, before the cap (as in the forward)
            z = st * P.scale + _term_t(i, keys0, b, head, term_operands(head), P)
        if P.softcap is None:
            x, c_ = (st, P.scale * LOG2E) if z is None else (z, LOG2E)
        else:  # logit = softcap * tanh(scale * s / softcap), its factor folded into c
            th = jnp.tanh(st * (P.scale / P.softcap) if z is None else z * (1 / P.softcap))
            x, c_ = th, P.softcap * LOG2E
        if visible is not None:
            x = jnp.where(visible, x, -jnp.inf)
        if P.natural:  # (z - lse) exact where every logit of the row is huge
            pt = jnp.exp2(((x - row_stat(slot, 0)) - row_stat(slot, 2)) * LOG2E)
        elif P.split:  # (hi + lo: the forward's base-2 m + log2(l); stat 2 is exp2(-lo))
            pt = jnp.exp2(x * c_ - row_stat(slot, 0)) * row_stat(slot, 2)
        else:
            pt = jnp.exp2(x * c_ - row_stat(slot, 0))
        pvt = pt  # the weights dV sees: the kept ones, scaled
        if seed is not None:  # the forward's keep mask, drawn again
            keep = _keep_t(seed, i, keys0, b, head, P)
            pvt = jnp.where(keep, pt * (1 / (1 - P.rate)), 0.0)
            dpt = jnp.where(keep, dpt * (1 / (1 - P.rate)), 0.0)
        dst = pt * (dpt - row_stat(slot, 1))
        if P.softcap is not None:
            dst = dst * (1.0 - th * th)
        if visible is not None:  # exactly 0 for hidden keys, whatever dP holds there
            dst = jnp.where(visible, dst, 0.0)
        return pvt.astype(dtype), dst.astype(dtype), dst

    def term_sums(dst, i, head):
        """Per key of this consumer, the step's sum over its query rows of dS
        times the term's derivative in each learned array's value (the tangent
        of the term in that value: a tile)."""
        ops = term_operands(head)
        sums = []
        for n in P.term_grad:
            def term_of(x, n=n):
                return _term_t(i, keys0, b, head, ops[:n] + [x] + ops[n + 1:], P)
            _, slope = jax.jvp(term_of, (ops[n],), (jnp.ones_like(ops[n]),))
            sums.append(jnp.sum(dst * slope, axis=1))
        return sums

    def accumulate(dk, dv, pt, dst, slot):
        """dV += P^T dO and dK += dS^T Q over this consumer's columns."""
        if P.interpreted:
            # The interpreter's ``wgmma`` takes no operand in registers.
            return (dk + dot(dst, q_smem[mine_h].at[slot][...]),
                    dv + dot(pt, do_smem[mine_h].at[slot][...]))

        def products(refs):
            dk_acc, dv_acc = refs
            plgpu.wgmma(dv_acc, pt, do_smem[mine_h].at[slot])
            plgpu.wgmma(dk_acc, dst, q_smem[mine_h].at[slot])

        return pl.run_state(products)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))

    def dq_chunk(j, buf, i, head):
        """dQ[:, 64j:64j+64] of the step: dS (64 x keys) @ K[:, chunk], added to gmem."""
        h = next(n for n, (g0, gw) in enumerate(P.col_groups) if g0 <= j * TILE < g0 + gw)
        off = j * TILE - P.col_groups[h][0]
        groups = range(RG) if P.row_split else (0,)
        if P.interpreted:
            # (dS^T transposed: contract the key axis of both tiles)
            acc = sum(lax.dot_general(ds_smem.at[buf, r][...],
                                      k_smem[h].at[r][:, pl.ds(off, TILE)],
                                      (((0,), (0,)), ((), ())), preferred_element_type=F32)
                      for r in groups)
        else:
            def product(acc_ref):
                for r in groups:
                    plgpu.wgmma(acc_ref, _compat_transpose(ds_smem.at[buf, r]),
                                k_smem[h].at[r].at[:, pl.ds(off, TILE)])
                return acc_ref[...]

            acc = pl.run_scoped(product, plgpu.ACC((TILE, TILE), F32))
        _add_to_gmem(acc, stage.at[c if P.row_split else 0],
                     dq_ref.at[b, pl.ds(i * TILE, TILE), head, pl.ds(j * TILE, TILE)],
                     None if dq_bar is None else dq_bar.at[c], P)

    def step(t, carry, partial: bool):
        dk, dv, sums = carry
        slot = slot_of(t)
        i, head = at_step(t)
        plgpu.barrier_wait(ready.at[slot])
        if partial and rows_ready is not None:
            plgpu.barrier_wait(rows_ready.at[slot])
        st, dpt = scores(slot)
        pt, dst, dst32 = probs_and_ds(st, dpt, slot, i, head, partial)
        if sums:  # a learned term's gradient: this step's sums go to its head's
            n, here = len(P.term_grad), head - hp * P.Gp
            new = term_sums(dst32, i, head)
            sums = tuple(acc + (x if P.Gp == 1 else x * (here == g).astype(F32))
                         for g in range(P.Gp) for acc, x in zip(sums[g * n:(g + 1) * n], new))
        dk, dv = accumulate(dk, dv, pt, dst, slot)
        plgpu.barrier_arrive(consumed.at[slot])
        if P.row_split:
            buf = lax.rem(t, jnp.int32(2))
            ds_smem.at[buf, mine_r][...] = dst
            plgpu.commit_smem()
            # Both consumers' rows of dS^T are in shared memory. (The buffer
            # written next step is the other one; this one is rewritten only
            # after the next meeting, when both are done reading it.)
            plgpu.barrier_arrive(pair)
            plgpu.barrier_wait(pair)
            for j in range(n_chunks):
                if n_chunks % 2:  # D = 64: the one chunk alternates between consumers
                    pl.when(lax.rem(t, jnp.int32(2)) == c)(
                        functools.partial(dq_chunk, j, buf, i, head))
                elif j % 2 == c:
                    dq_chunk(j, buf, i, head)
        elif c == P.dq_wg:
            ds_smem.at[0, 0][...] = dst
            plgpu.commit_smem()
            for j in range(n_chunks):
                dq_chunk(j, 0, i, head)
        return dk, dv, sums

    zeros = _in_layout(jnp.full((TILE, w), 0.0, F32), plgpu.Layout.WGMMA, P)
    # A learned term's sums, per (head of the program, learned array), one float32
    # per key: by each consumer for its keys (row split), or by the one that
    # computes dQ (the column split's consumers share their keys).
    n_sums = P.Gp * len(P.term_grad) if (P.row_split or c == P.dq_wg) else 0
    key_zeros = _in_layout(jnp.full((TILE,), 0.0, F32), plgpu.Layout.WGMMA.reduce(1), P)
    carry = lax.fori_loop(jnp.int32(0), full_steps, functools.partial(step, partial=False),
                          (zeros, zeros, (key_zeros,) * n_sums))
    dk, dv, sums = lax.fori_loop(full_steps, n_steps, functools.partial(step, partial=True),
                                 carry)
    # Every dQ product has read K and dS^T (the other consumer's included)
    # before K's and V's tiles become the output buffers.
    plgpu.barrier_arrive(pair)
    plgpu.barrier_wait(pair)
    dk = dk * P.scale
    out_rows = pl.ds(keys0, TILE)
    if sums:
        dterm_ref, dterm_smem = dterm
        n = len(P.term_grad)
        for r, x in enumerate(sums):
            dterm_smem.at[c, r][...] = x
        plgpu.commit_smem()
        for r in range(len(sums)):
            g, j = divmod(r, n)
            plgpu.copy_smem_to_gmem(dterm_smem.at[c, r],
                                    dterm_ref.at[b, j, hp * P.Gp + g, out_rows])
    if P.direct:
        for x, smem, out in ((dk, k_smem, dk_ref), (dv, v_smem, dv_ref)):
            buf = smem[mine_h].at[mine_r]
            buf[...] = x.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf, out.at[(b, out_rows, hp) + (
                () if CG == 1 else (pl.ds(c0, w),))])
    else:  # float32 partials, in 64-column chunks through the dQ staging tile
        for x, out in ((dk, dk_ref), (dv, dv_ref)):
            for j in range(w // TILE):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                stage.at[c][...] = x[:, j * TILE:(j + 1) * TILE]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(stage.at[c], out.at[b, out_rows, hp,
                                                            pl.ds(c0 + j * TILE, TILE)])
    # The stores and dQ's additions must have read shared memory before the
    # program ends; their writes land before the kernel is done, and the next
    # program on this multiprocessor need not wait for them.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _add_to_gmem(x, stage, dst, bar, P: _Plan):
    """``dst += x`` for a (64, 64) float32 tile, through the staging tile ``stage``."""
    plgpu = _plgpu()
    if P.interpreted:
        # No TMA reduction in the interpreter; it runs programs one at a time,
        # so read, add and write back is the same sum.
        plgpu.copy_gmem_to_smem(dst, stage, bar)
        plgpu.barrier_wait(bar)
        stage[...] = stage[...] + x
        plgpu.copy_smem_to_gmem(stage, dst)
        plgpu.wait_smem_to_gmem(0)
        return
    # The previous chunk's reduction has finished reading the staging tile.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dst, reduction_op="add")


def _tile_indices_t(i, keys0, P: _Plan):
    """``(rows, keys)``: the query-row and key indices on the transposed tile (keys
    ``keys0 ..`` along its rows, q tile ``i`` along its columns; WGMMA layout)."""
    return i * TILE + _iota((TILE, TILE), 1, P), keys0 + _iota((TILE, TILE), 0, P)


def _keep_t(seed, i, keys0, b, h, P: _Plan):
    """Dropout's keep mask on the transposed tile (keys ``keys0 ..``, q tile ``i``):
    :func:`fnattn.dropout.keep_mask` at the rows' and keys' indices, as the
    forward draws it."""
    return dropout.keep_mask(seed, b, h, *_tile_indices_t(i, keys0, P), P.rate)


def _term_t(i, keys0, b, h, ops, P: _Plan):
    """The position term on the transposed tile (keys ``keys0 ..``, q tile ``i``;
    WGMMA layout); ``ops``: the mask's arrays, the term's per-(batch, head)
    scalars among them."""
    qi, kj = _tile_indices_t(i, keys0, P)
    pos = masks.Positions(b=b, h=h, q=qi, q_pos=qi + P.offset, k=kj)
    term = position_bias.term(masks.from_treedef(P.mask_treedef), pos, ops)
    return jnp.broadcast_to(term, (TILE, TILE))


def _visible_t(i, keys0, b, h, ops, P: _Plan):
    """Which (key, query) pairs of the transposed tile (keys ``keys0 ..``, q tile
    ``i``) are visible (WGMMA layout), or None for all of them. ``ops``: the
    mask's arrays on the tile."""
    qi, kj = _tile_indices_t(i, keys0, P)
    # Padding rows see nothing: their dO is 0, and a non-finite V on a key that
    # only they would see must not make dP = inf * 0 reach dK.
    return mosaic_gpu.visible_pairs(qi, kj, b, h, ops, P.mask_treedef, P.offset,
                                    P.Tk if P.ragged_k else None,
                                    P.Tq if P.Tq % TILE else None)


# ----------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------


def _launch(P: _Plan, interpret, dtype, q, k, v, do, stats, table, extra):
    """``(dq float32 (B, Tqp, Hq, D), dk, dv (B, Tkp, Hp, D))`` of the padded inputs,
    the visiting table and ``extra``: the mask's arrays
    (:func:`fnattn.flash.mosaic_gpu.id_arrays`), then dropout's seed; with a
    learned term (``P.term_grad``) also its gradient's sums per key, float32
    (B, len(term_grad), Hq, Tkp).

    Under ``vmap`` the mapped axis joins the batch (one launch) when nothing but
    the inputs varies along it; otherwise (the schedule or the mask's arrays
    vary along the batch or the mapped axis, or dropout's mask, which depends
    on the batch index) the launches run one per mapped element.
    """

    @jax.custom_batching.custom_vmap
    def run(q, k, v, do, stats, table, extra):
        return _launch_now(P, interpret, dtype, q, k, v, do, stats, table, extra)

    @run.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = jax.tree.map(
            lambda x, bat: x if bat else jnp.broadcast_to(x, (axis_size,) + x.shape),
            args, tuple(in_batched))
        if table.shape[0] == 1 and not extra and not in_batched[5]:
            wide = dataclasses.replace(P, B=axis_size * P.B)
            outs = _launch(wide, interpret, dtype,
                           *(x.reshape((-1,) + x.shape[2:]) for x in args[:5]), table, extra)
            outs = tuple(o.reshape((axis_size, P.B) + o.shape[1:]) for o in outs)
        else:
            outs = lax.map(lambda a: _launch(P, interpret, dtype, *a), args)
        return outs, (True,) * len(outs)

    return run(q, k, v, do, stats, jnp.asarray(table), list(extra))


def _launch_now(P: _Plan, interpret, dtype, q, k, v, do, stats, table, extra):
    plgpu = _plgpu()
    call = functools.partial(
        pl.kernel,
        functools.partial(_kernel, P=P, sched_b=table.shape[0] > 1, sched_h=table.shape[1] > 1,
                          dtype=dtype),
        mesh=plgpu.Mesh(grid=(P.Hp, P.Tkp // P.kv_rows, P.B),
                        grid_names=("heads", "tiles", "batch"), num_threads=3,
                        thread_name="wg"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        name="fnattn_flash_mosaic_gpu_bwd")
    args = (q, k, v, do, stats, table, *extra)
    dq_type = jax.ShapeDtypeStruct((P.B, P.Tqp, P.Hq, P.D), F32)
    kv_type = jax.ShapeDtypeStruct((P.B, P.Tkp, P.Hp, P.D), dtype if P.direct else F32)
    types = (dq_type, kv_type, kv_type)
    if P.term_grad:
        types += (jax.ShapeDtypeStruct((P.B, len(P.term_grad), P.Hq, P.Tkp), F32),)
    if interpret:
        # The interpreter's outputs start at zero when asked to: dQ's sum then
        # starts there. (It takes no aliased buffer without a memory space.)
        params = mosaic_gpu.interpret_params() if interpret is True else interpret
        params = dataclasses.replace(params, uninitialized_memory="zero")
        return call(out_type=types, interpret=params)(*args)

    def stateful(refs):
        # dQ's float32 sum starts at zero: a buffer the kernel adds into, aliased
        # in and out (``run_state`` keeps the mutation inside this function).
        call(out_type=(), interpret=False)(*args, *refs)

    return pl.run_state(stateful)((jnp.zeros(dq_type.shape, F32),)
                                  + tuple(lax.empty(t.shape, t.dtype) for t in types[1:]))


def _blocks_for(cfg):
    return blocks.pick(cfg.block_sizes, MosaicGpuBwdBlockSizes,
                       MosaicGpuBwdBlockSizes.default(mosaic_gpu.kernel_dim(cfg.dims)))


def _heads_per_program(d) -> int:
    """Query heads of one program: the whole GQA group, split when that leaves
    too few programs for the GPU (the row split only, which has a float32
    staging tile per consumer for the partials)."""
    row_split = d.head_dim <= _ROW_SPLIT_MAX_D
    n_kv = -(-d.kv_len // (2 * TILE if row_split else TILE))
    return triton._heads_per_dkdv_program(d, n_kv) if row_split else d.group


def _plan(cfg, mask, interpret, operands=(), stacks=(), term_grad=()) -> _Plan:
    """The kernel's plan; ``operands`` and ``stacks``: those of the mask's arrays
    (:func:`fnattn.flash.mosaic_gpu.id_arrays`); ``term_grad``: the term's
    operands whose gradient it sums."""
    d = cfg.dims
    bs = _blocks_for(cfg)
    Gp = _heads_per_program(d)
    P = _Plan(B=d.batch, Hq=d.num_q_heads, G=d.group, Gp=Gp, Tq=d.q_len, Tk=d.kv_len,
                 q_offset=cfg.q_offset,
                 offset=d.kv_len - d.q_len if cfg.q_offset is None else cfg.q_offset,
                 D=d.head_dim, ring=bs.max_concurrent_steps, scale=float(cfg.scale),
                 softcap=None if cfg.softcap is None else float(cfg.softcap),
                 mask_treedef=None if mask is None else jax.tree_util.tree_structure(mask),
                 interpreted=bool(interpret), operands=tuple(operands), stacks=tuple(stacks),
                 rate=float(cfg.dropout_rate),
                 term=mask is not None and position_bias.present(mask),
                 term_grad=tuple(term_grad))
    count = lambda kind: (P.stack(kind) or (0,))[0]  # noqa: E731
    need = bs.smem_bytes(d.head_dim, row_arrays=count("rows"), key_arrays=count("cols"),
                         row_stats=P.row_stats, term_sums=P.Gp * len(P.term_grad))
    if need > SMEM_BYTES:
        raise ValueError(
            f"flash: MosaicGpuBwdBlockSizes(max_concurrent_steps={bs.max_concurrent_steps}) "
            f"needs {need} bytes of shared memory at head dim "
            f"{d.head_dim}, more than the {SMEM_BYTES} of a Hopper block; use a smaller "
            "max_concurrent_steps")
    return P


def backward(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse, *,
             interpret=False):
    """``(dq, dk, dv, dbias, dsinks)`` of the flash backward on the Mosaic GPU kernel.

    The signature and results of every flash lowering's ``bwd``: "bthd" inputs,
    the forward's ``out``, ``lse`` and ``lse_lo`` (B, Hq, Tq) float32, and the
    cotangents ``d_out`` and ``d_lse``. ``dbias`` is None (a bias is refused);
    ``dsinks`` comes from the row statistics in XLA (:func:`fnattn._online.sink_grad`),
    None without sinks. ``interpret``: False to compile for the GPU, or the
    parameters of the Mosaic GPU interpreter
    (:func:`fnattn.flash.mosaic_gpu.interpret_params`) to run the same kernel on CPU.
    Head dims are padded to :func:`fnattn.flash.mosaic_gpu.kernel_dim` (zero
    columns of ``out`` and ``d_out`` leave ``rowsum(dO * O)`` as it is).
    """
    _refuse(cfg, q.dtype, mask, bias, sinks)
    kcfg = mosaic_gpu.at_kernel_dim(cfg)
    if kcfg is cfg:
        return _backward(cfg, q, k, v, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse,
                         interpret)
    d, Dp, pad = cfg.dims, kcfg.dims.head_dim, mosaic_gpu.pad_dim
    dq, dk, dv, *rest = _backward(kcfg, pad(q, Dp), pad(k, Dp), pad(v, Dp), sinks, mask, seed,
                                  pad(out, Dp), lse, lse_lo, pad(d_out, Dp), d_lse, interpret)
    return (dq[..., :d.head_dim], dk[..., :d.head_dim], dv[..., :d.v_head_dim], *rest)


def _backward(cfg, q, k, v, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse, interpret):
    """:func:`backward` at the kernel's head dim (``D == Dv ==``
    :func:`fnattn.flash.mosaic_gpu.kernel_dim`)."""
    d = cfg.dims
    P = _plan(cfg, mask, interpret)
    ids = []
    # a learned term: the operands whose gradient the kernel sums beside dK
    term_ops = position_bias.kernel_grad_operands(cfg.term_grad, mask, "Pallas Mosaic GPU")
    if mask is not None and mask.num_operands:  # its arrays from XLA
        operands, stacks, ids = mosaic_gpu.id_arrays(mask, P.Tqp, P.Tkp)
        P = _plan(cfg, mask, interpret, operands, stacks, term_ops)
    table = P.table() if mask is None or not mask.num_operands else None
    if table is None:   # the table from XLA (a mask's arrays, or one too large to embed)
        table = mosaic_gpu.dynamic_schedule(mask, d, cfg.q_offset, TILE, P.kv_rows,
                                            transpose=True, heads_per_row=P.Gp)
    # delta folds in the lse cotangent: dS = P * (dP - (rowsum(dO * O) - d_lse)).
    # The barrier keeps its reduction out of the stack below: fused into it, XLA
    # took 295 us on an H100 (B=2, T=8k, H=16, D=128) for what it reduces in
    # 48 us as its own fusion (the Triton backward's; gpu_h100_2026-11-27_s23).
    delta = lax.optimization_barrier(online.delta_rows(out, d_out, d_lse))
    # P = exp2(s * c - lse2): +inf where lse is not finite (rows that saw
    # nothing, or a non-finite key) and on padding rows, so that P = 0 there.
    # In natural units (a position term without cap) lse itself, +inf alike,
    # and lse_lo beside it (P = exp2(((z - lse) - lse_lo) * log2 e)).
    rows = online.backward_rows(lse, lse_lo, delta, natural=P.natural, split=P.split)
    stats = jnp.stack([triton._pad(x, 2, P.Tqp, jnp.inf if n == 0 else 0.0)
                       for n, x in enumerate(rows)], axis=2)
    dq, dk, dv, *dterm = _launch(P, interpret, q.dtype, triton._pad(q, 1, P.Tqp),
                                 triton._pad(k, 1, P.Tkp), triton._pad(v, 1, P.Tkp),
                                 triton._pad(d_out.astype(q.dtype), 1, P.Tqp), stats, table,
                                 ids + ([seed] if P.rate > 0 else []))
    dq = (dq[:, :d.q_len] * P.scale).astype(q.dtype)

    def finish(x, dtype):
        x = x[:, :d.kv_len]
        if not P.direct:
            x = x.reshape(x.shape[:2] + (d.num_kv_heads, P.Hp // d.num_kv_heads, d.head_dim))
            x = x.sum(3)
        return x.astype(dtype)

    dsinks = None
    if sinks is not None:  # (the forward's lse holds the sink: dQ, dK, dV need nothing more)
        dsinks = online.sink_grad(sinks, lse, lse_lo, delta).astype(sinks.dtype)
    # (B, n, Hq, Tkp) per key -> per (batch row, head), without the padding keys
    sums = [] if not dterm else list(jnp.moveaxis(dterm[0][..., :d.kv_len].sum(-1), 1, 0))
    return (dq, finish(dk, k.dtype), finish(dv, v.dtype), None, dsinks,
            *position_bias.kernel_leaf_grads(mask, cfg.term_grad, term_ops, sums))


# The Mosaic GPU forward with this backward: what impl="auto" runs on Hopper where
# route() says so (fnattn.flash.api.cuda_kernel).
LOWERING = Lowering("flash-mosaic-gpu-fa3", mosaic_gpu.LOWERING.fwd,
                    functools.partial(backward, interpret=False))
