"""The Pallas Mosaic GPU lowering of :func:`fnattn.decode` (Hopper, sm90a).

JAX 0.11 deprecates the Pallas Triton backend that :mod:`fnattn.decoding.triton`
is written for; this kernel is decode on Mosaic GPU, the backend that replaces
it. Ask for it with ``AttentionSpec(block_sizes=MosaicGpuDecodeBlockSizes())``
(beside a ``DecodeBlockSizes`` for the split count, if wanted): on a Hopper GPU
``fnattn.decode`` then runs here, elsewhere as before. Without it
``impl="auto"`` keeps the Triton kernel, which was timed at 76.5 % of an H100's
HBM bandwidth; this one has not been timed on a GPU yet.

One kernel, grid ``(Hkv, splits, B)``. A program owns one kv head of one
sequence and one split of its key blocks, and runs two warpgroups:

* the *consumer* holds the ``Tq * G`` query rows of the kv head's GQA group
  (row ``r`` is token ``r // G`` of query head ``h * G + r % G``) as one 64-row
  tile, padded with zero rows, the smallest tile of ``wgmma``: every key is
  read from HBM once per (sequence, kv head) whatever the group. Per block of
  ``block_k`` keys it computes ``S = Q K^T`` and ``P V`` with ``plgpu.wgmma``
  into float32 accumulators, the online softmax between them in base 2
  (``log2(e)`` folded into the scale);
* the *producer* streams K and V blocks with TMA straight from the
  ``(B, S, Hkv, D)`` caches (a strided box, no copy of the cache) into a ring
  of ``max_concurrent_steps`` shared-memory slots, each with a *loaded* and a
  *consumed* barrier.

:mod:`fnattn.paged.mosaic_gpu` runs the same kernel on a paged cache (its
producer copies a block's pages, one TMA copy per page, instead of one box),
a program per work item of a ragged batch: :func:`launch` takes any table of
programs (:func:`program_meta`), :func:`attend` the contiguous cache's.

Key blocks are aligned to cache slots (block ``j`` holds slots ``j * block_k ..``),
so a block never reaches past the cache: ``block_k`` divides ``S``. Each
program visits only the blocks that hold its sequence's slots and that the
mask's ``tile_bounds`` says may be visible
(:func:`fnattn.decoding.common.block_ranges`), and runs the run of them that
every row sees whole without mask code; on the others (the sequence's first
and last block, blocks a window or chunk cuts) hidden logits become -inf.

**Keys that are not the sequence's** (slots before its start or past its
length in a boundary block, keys a mask hides) may hold anything: their logits
are replaced, so a non-finite K changes nothing, but ``0 * V`` is NaN where V
is not finite. The kernel reads V as it is and the wrapper checks its float32
partial outputs: when any is not finite, the whole call is computed again by
the XLA lowering (:func:`fnattn.decoding.xla.forward`, which makes such keys
inert), under ``lax.cond`` so that the pass costs nothing otherwise. A row
that sees a non-finite key is NaN in both, as in every lowering.

**Position terms.** A term's arrays (ALiBi's slopes; one value per sequence
and query head) reach the program as a float32 value per row, copied into
shared memory with the queries; per block the term is evaluated at each
row's head and position and added to the scaled logits before the cap.
Without a cap the row state is then kept in natural units
(:attr:`_Plan.natural`), as in the flash forward.

**Split-K.** The programs write partial outputs (float32; in the caches'
dtype past D = 128, where a float32 tile would leave a ring of one step,
:func:`plan`) with their base-2 row state ``(m, l)``;
:func:`fnattn.merging.merge_stacked` combines them, the
sinks joining the denominator once. :func:`auto_splits` fills the GPU with one
program per multiprocessor when ``DecodeBlockSizes(num_splits=...)`` does not
say.

Supported: float16 / bfloat16 caches, head dims ``D`` and ``Dv`` that are
multiples of 64 up to 256, ``Tq * G <= 64`` rows per kv head, any scale,
soft-cap, sinks, an array-free mask, a position term (ALiBi, ``from_fn``;
see below), and a cache length ``S`` that is a multiple of 64; ``from_fn``
masks and terms whose functions Mosaic GPU lowers
(:data:`fnattn._functions.MOSAIC_GPU`). :func:`supports` lists what else a
call asks for; asked for by name, such a call raises ``NotImplementedError``.
Quantized caches (:mod:`fnattn.quant`) and latent caches (``value_dim``) are
not read here (the producer copies tiles straight into ``wgmma`` operands,
with no step to dequantize them): :func:`gpu_forward` runs them with the
Triton kernel, which reads both.
"""

import dataclasses
import functools
import types
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fnattn import _checks, _dequant, _functions, masks, quant
from fnattn import _online as online
from fnattn.decoding import common, xla
from fnattn.decoding.common import F32, I32
from fnattn.flash import blocks
from fnattn.flash import mosaic_gpu as flash_mgpu
from fnattn.merging import merge_stacked

__all__ = ["MosaicGpuDecodeBlockSizes", "auto_splits", "forward",
           "attend", "finish", "gpu_forward", "kernel_refusals", "launch", "plan",
           "program_meta", "smem_bytes", "stored_refusals", "supports", "term_rows", "Tiles",
           "tiles_for"]

LOG2E = online.LOG2E
ROWS = 64                    # the query tile: one wgmma slab
MAX_STAGES = 4
_CONSUMER_REGISTERS, _PRODUCER_REGISTERS = 232, 40
_ELSEWHERE = ("the Pallas Triton kernel (fnattn/decoding/triton.py, the default on NVIDIA "
              "GPUs) supports it")


@dataclasses.dataclass(frozen=True)
class MosaicGpuDecodeBlockSizes:
    """Asks :func:`fnattn.decode` to run the Mosaic GPU kernel on Hopper GPUs.

    Attributes:
      block_k: keys per step, 64 or 128 (None: see :func:`plan`); must divide
        the cache length.
      max_concurrent_steps: depth of the ring of K and V blocks in shared
        memory (None: as deep as fits, at most 4).

    The split count is ``DecodeBlockSizes(num_splits=...)``'s, given beside
    this in a tuple, else :func:`auto_splits`'.

    >>> MosaicGpuDecodeBlockSizes(block_k=64).block_k
    64
    >>> MosaicGpuDecodeBlockSizes(block_k=32)
    Traceback (most recent call last):
    ...
    ValueError: MosaicGpuDecodeBlockSizes: block_k must be 64, 128 or None; got 32
    """

    block_k: Optional[int] = None
    max_concurrent_steps: Optional[int] = None

    def __post_init__(self):
        if self.block_k not in (None, 64, 128) or isinstance(self.block_k, bool):
            raise ValueError(f"MosaicGpuDecodeBlockSizes: block_k must be 64, 128 or None; "
                             f"got {self.block_k!r}")
        n = self.max_concurrent_steps
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError("MosaicGpuDecodeBlockSizes: max_concurrent_steps must be a "
                             f"positive int or None; got {n!r}")


def smem_bytes(D: int, Dv: int, block_k: int, stages: int, itemsize: int = 2,
               out_itemsize: int = 4, terms: int = 0) -> int:
    """Shared memory of one program as Mosaic GPU counts it: the query tile,
    the ring of K and V blocks, the output tile (float32, or the caches' dtype:
    ``out_itemsize``) and row state, a position term's ``terms`` arrays (a
    float32 value per row each), the barriers
    (:func:`fnattn.flash.mosaic_gpu.smem_layout_bytes`), and what the lowering
    keeps besides (reduction scratch; tests check the sum against the
    lowering's count).

    >>> smem_bytes(128, 128, 64, 4)
    184456
    """
    buffers = [ROWS * D * itemsize, stages * block_k * D * itemsize,
               stages * block_k * Dv * itemsize, ROWS * Dv * out_itemsize, ROWS * 4, ROWS * 4]
    if terms:
        buffers.append(terms * ROWS * 4)
    return flash_mgpu.smem_layout_bytes(buffers, 1 + 4 * stages) + _RESERVED


# What the program holds in shared memory besides its buffers and barriers
# (jax 0.10.2 and 0.11.2), as in the flash forward.
_RESERVED = 2048


class Tiles(NamedTuple):
    """A call's tiling: keys per step, the ring's depth, and whether the
    partial outputs leave in float32 (else in the caches' dtype)."""

    block_k: int
    stages: int
    out_f32: bool


def plan(D: int, Dv: int, S: int, given: Optional[MosaicGpuDecodeBlockSizes] = None,
         itemsize: int = 2, page_size: int = 0, terms: int = 0) -> Tiles:
    """The block (the given one, else the largest of 128 and 64 dividing ``S``,
    the keys a sequence can hold, and, with pages of ``page_size`` keys,
    dividing a page or a multiple of one, whose ring holds two steps), the
    deepest ring that fits (at most
    :data:`MAX_STAGES`, or the given depth), and float32 partial outputs
    where they leave room for a ring of two, else outputs in the caches'
    dtype (at D or Dv past 128: a float32 output tile would leave one step).
    ``terms``: the arrays of a position term (:func:`smem_bytes`). Raises
    ``ValueError`` for given sizes that do not fit.

    >>> plan(128, 128, 4096), plan(128, 128, 4160)
    (Tiles(block_k=128, stages=2, out_f32=True), Tiles(block_k=64, stages=4, out_f32=True))
    >>> plan(256, 256, 4096)
    Tiles(block_k=64, stages=2, out_f32=False)
    """
    given = given or MosaicGpuDecodeBlockSizes()
    budget = flash_mgpu.SMEM_BYTES

    def deepest(bk, out):
        n = MAX_STAGES
        while n > 1 and smem_bytes(D, Dv, bk, n, itemsize, out, terms) > budget:
            n -= 1
        return n

    def whole(b):
        return S % b == 0 and (not page_size or page_size % b == 0 or b % page_size == 0)

    sizes = (given.block_k,) if given.block_k else tuple(filter(whole, (128, 64))) or (64,)
    least = 1 if given.max_concurrent_steps else 2

    def fits(bk, out):
        n = given.max_concurrent_steps or deepest(bk, out)
        return n >= least and smem_bytes(D, Dv, bk, n, itemsize, out, terms) <= budget

    bk, out = next(((bk, out) for out in (4, itemsize) for bk in sizes if fits(bk, out)),
                   (sizes[-1], itemsize))
    stages = given.max_concurrent_steps or deepest(bk, out)
    need = smem_bytes(D, Dv, bk, stages, itemsize, out, terms)
    if need > budget:
        raise ValueError(
            f"decode: MosaicGpuDecodeBlockSizes(block_k={bk}, max_concurrent_steps={stages}) "
            f"needs {need} bytes of shared memory at D={D}, Dv={Dv}, more than the {budget} "
            "of a Hopper block; use block_k=64 or a shallower ring")
    if not whole(bk):
        raise ValueError(f"decode: MosaicGpuDecodeBlockSizes(block_k={bk}) must divide the "
                         f"cache length S={S}" + (f" and divide or be a multiple of the page "
                                                  f"size {page_size}" if page_size else ""))
    return Tiles(bk, stages, out == 4)


def auto_splits(pairs: int, n_blocks: int, sms: int) -> int:
    """Split-K count for ``pairs`` (sequence, kv head) programs per split over
    ``n_blocks`` key blocks on ``sms`` multiprocessors: a program's ring takes
    most of a multiprocessor's shared memory, so one wave of at most ``sms``
    programs, with at least two blocks per split.

    >>> auto_splits(128, 64, 132), auto_splits(8, 512, 132), auto_splits(8, 6, 132)
    (1, 16, 3)
    """
    return max(1, min(sms // max(pairs, 1), n_blocks // 2))


def supports(cfg, q, k, v) -> list:
    """Why a call cannot run on this kernel (empty: it can), from static facts.
    ``q`` (B, Tq, Hq, D), ``k`` / ``v`` (B, S, Hkv, D | Dv) arrays or shapes."""
    B, Tq, Hq, D = q.shape
    why = stored_refusals(k, v)
    if v is None:   # (a latent cache: the checks of its key tiles)
        v = k
    _, S, Hkv, Dv = v.shape
    why += kernel_refusals("caches", k.dtype, D, Dv, Tq * (Hq // Hkv),
                          f"Tq={Tq} x group {Hq // Hkv}", cfg.mask, cfg.term_treedef)
    if not isinstance(S, int) or S % 64:
        why.append(f"a cache of S={S} slots (multiples of 64 run here)")
    if _checks.symbolic_sizes(B=B, Tq=Tq, S=S):
        why.append("symbolic sizes (jax.export)")
    return why


def stored_refusals(k, v, what: str = "cache",
                    triton: str = "fnattn/decoding/triton.py") -> list:
    """What this kernel does not read of how a cache is stored: quantized
    caches (:mod:`fnattn.quant`; its producer copies tiles straight into the
    operands of ``wgmma``, with no step to dequantize them) and latent caches
    (``value_dim``, no ``v``). :func:`gpu_forward` runs such calls with the
    Triton kernel, which reads both (``what``: "cache" or "pool"; ``triton``:
    that kernel's file, for the message)."""
    why = []
    for name, x in (("k", k), ("v", v)):
        if quant.is_quantized(x):
            why.append(f"a quantized {name} {what} ({_dequant.describe(x)}; the Pallas Triton "
                       f"kernel, {triton}, reads it)")
    if v is None:
        why.append(f"a latent {what} (value_dim, no v; the Pallas Triton kernel, {triton}, "
                   "reads it)")
    return why


def kernel_refusals(cache: str, dtype, D: int, Dv: int, rows: int, rows_are: str, mask,
                    term_treedef) -> list:
    """What the kernel refuses whatever the cache's layout, for
    :func:`supports` and :func:`fnattn.paged.mosaic_gpu.supports`: the dtype of
    the ``cache`` (its name in the message), the head dims, ``rows`` query rows
    a program (``rows_are``: how they come about), and ``from_fn`` functions of
    ``mask`` or of the position term (``term_treedef``, or None) that Mosaic
    GPU does not lower."""
    why = []
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        why.append(f"{jnp.dtype(dtype).name} {cache} (float16 and bfloat16 run here)")
    for name, n in (("D", D), ("Dv", Dv)):
        if n % 64 or n > 256:
            why.append(f"head dim {name}={n} (multiples of 64 up to 256 run here)")
    if rows > ROWS:
        why.append(f"{rows} query rows per kv head ({rows_are}; at most {ROWS} run here)")
    term = masks.from_treedef(term_treedef)
    return why + _functions.refusals((mask, term), _functions.MOSAIC_GPU)


def _asked(cfg) -> Optional[MosaicGpuDecodeBlockSizes]:
    return blocks.pick(cfg.block_sizes, MosaicGpuDecodeBlockSizes, None)


def gpu_forward(fallback, cfg, q, k, v, starts, lengths, sinks, terms=None):
    """The cuda entry of :func:`fnattn.decoding.api.lowering_table`: this kernel
    when the spec asks for it (``MosaicGpuDecodeBlockSizes``) and the process
    has a Hopper GPU (:func:`fnattn.flash.mosaic_gpu.available`), else
    ``fallback`` (the Triton kernel's entry), which also reads the quantized
    and latent caches this kernel does not (:func:`stored_refusals`). Asked
    for another call it does not support, it raises ``NotImplementedError``
    with the reasons."""
    if (_asked(cfg) is None or flash_mgpu.available() is not None
            or stored_refusals(k, v)):
        return fallback(cfg, q, k, v, starts, lengths, sinks, terms)
    return forward(cfg, q, k, v, starts, lengths, sinks, terms)


@dataclasses.dataclass(frozen=True)
class _Plan(common.KernelFacts):
    """Everything the kernel needs at trace time (hashable)."""

    Tq: int
    G: int
    D: int
    Dv: int
    bk: int
    stages: int
    out_f32: bool
    splits: int
    scale: float
    softcap: Optional[float]
    mask_treedef: Any
    interpreted: bool
    page_size: int = 0       # a paged cache's (0: the contiguous cache)
    pages_per_seq: int = 0
    term_treedef: Any = None  # a position term, or None
    n_terms: int = 0          # its arrays: a float32 value per row each
    terms_shared: bool = False  # one set of values for every program's sequence (paged)

    @property
    def copies(self) -> int:
        """TMA copies per block of K (and of V)."""
        return self.bk // self.page_size if 0 < self.page_size < self.bk else 1


# Interpreter-aware helpers shared with the flash forward (they read only P.interpreted).
_plgpu, _iota, _in_layout, _load = (flash_mgpu._plgpu, flash_mgpu._iota, flash_mgpu._in_layout,
                                    flash_mgpu._load)


def _kernel(meta_ref, q_ref, k_ref, v_ref, *refs, P: _Plan, dtype):
    plgpu = _plgpu()
    ring = P.stages
    pt_ref = refs[0] if P.page_size else None
    terms_ref = refs[int(bool(P.page_size))] if P.n_terms else None
    o_ref, m_ref, l_ref = refs[-3:]

    def body(S):
        wg = lax.axis_index("wg")
        # (int32 under jax_enable_x64 too, where the interpreter's indices are int64)
        h, sp, b = (lax.axis_index(n).astype(I32) for n in ("heads", "splits", "batch"))
        # (b: the program's sequence, or work item of a ragged batch)
        start, length = meta_ref[b, 0], meta_ref[b, 1]
        # the first row's position and raw index among its sequence's queries,
        # and the sequence (its page-table row and the mask's batch index)
        q_pos0, seq, row0 = meta_ref[b, 6], meta_ref[b, 7], meta_ref[b, 8]
        lo, hi = common.split_range(meta_ref[b, 2], meta_ref[b, 3], sp, P.splits)
        # [fa, fb): this split's blocks inside the sequence that every row sees whole
        fa = jnp.minimum(jnp.maximum(meta_ref[b, 4], lo), hi)
        fb = jnp.minimum(jnp.maximum(meta_ref[b, 5], fa), hi)

        def slot_of(j):
            return lax.rem(j - lo, jnp.int32(ring))

        @pl.when(wg == 0)
        def _consume():
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
            plgpu.copy_gmem_to_smem(q_ref.at[b, h], S.q_smem, S.q_ready)
            if P.n_terms:  # (the term's values at the rows, with the queries)
                plgpu.copy_gmem_to_smem(terms_ref.at[0 if P.terms_shared else b, h],
                                        S.t_smem, S.q_ready)
            rows_layout = plgpu.Layout.WGMMA.reduce(1)
            m = _in_layout(jnp.full((ROWS,), -jnp.inf, F32), rows_layout, P)
            l = _in_layout(jnp.full((ROWS,), 0.0, F32), rows_layout, P)
            acc = _in_layout(jnp.full((ROWS, P.Dv), 0.0, F32), plgpu.Layout.WGMMA, P)
            plgpu.barrier_wait(S.q_ready)
            term_values = [_load(S.t_smem.at[i], rows_layout, P) for i in range(P.n_terms)]

            def positions(j):
                """The mask's and the term's positions of block ``j``'s (row,
                key) pairs (WGMMA layout)."""
                kpos = j * P.bk + _iota((ROWS, P.bk), 1, P) - start
                r = _iota((ROWS, P.bk), 0, P)
                t = lax.div(r, jnp.int32(P.G))
                return masks.Positions(b=seq, h=h * P.G + lax.rem(r, jnp.int32(P.G)),
                                       q=row0 + t, q_pos=q_pos0 + t, k=kpos)

            def term_of(pos):
                """The position term at ``pos`` (a block's, float32, WGMMA layout)."""
                ops = [lax.broadcast_in_dim(x, (ROWS, P.bk), [0]) for x in term_values]
                value = P.term().value(pos, ops)
                return jnp.broadcast_to(jnp.asarray(value, F32), (ROWS, P.bk))

            def visible(pos):
                """Which (row, key) pairs at ``pos`` (a block's) are the
                sequence's and visible under the mask (WGMMA layout)."""
                ok = (pos.k >= 0) & (pos.k < length)
                if P.mask_treedef is not None:
                    ok = ok & P.mask().predicate(pos, [])
                return ok

            def step(j, carry, partial: bool):
                acc, m, l = carry
                slot = slot_of(j)
                plgpu.barrier_wait(S.k_ready.at[slot])
                if P.interpreted:
                    # The interpreter's wgmma takes no transposed ref.
                    s = lax.dot_general(S.q_smem[...], S.k_smem.at[slot][...],
                                        (((1,), (1,)), ((), ())), preferred_element_type=F32)
                else:
                    def scores(s_ref):
                        plgpu.wgmma(s_ref, S.q_smem,
                                    flash_mgpu._compat_transpose(S.k_smem.at[slot]))
                        return s_ref[...]
                    s = pl.run_scoped(scores, plgpu.ACC((ROWS, P.bk), F32))
                plgpu.barrier_arrive(S.k_free.at[slot])
                scale = P.scale
                pos = positions(j) if partial or P.term_treedef is not None else None
                if P.term_treedef is not None:  # scale * s + term, then the cap
                    s, scale = s * scale + term_of(pos), 1.0
                if P.softcap is None:
                    c = scale * LOG2E
                else:  # softcap * tanh(scale * s / softcap), its factor folded into c
                    s = jnp.tanh(s * (scale / P.softcap))
                    c = P.softcap * LOG2E
                if partial:  # hidden logits: -inf, whatever the key's bits (or term) gave
                    s = jnp.where(visible(pos), s, -jnp.inf)
                if P.natural:  # m in natural units: exp2((s - m) * log2(e))
                    m_new = jnp.maximum(m, s.max(axis=1))
                else:
                    m_new = jnp.maximum(m, s.max(axis=1) * c)
                # A row that has seen no key keeps m = -inf; shifting it by 0
                # keeps its weights at exp2(-inf) = 0 instead of NaN. (A term
                # may be -inf on keys that every row sees.)
                guard = partial or P.term_treedef is not None
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard else m_new
                m_tile = lax.broadcast_in_dim(m_use, s.shape, [0])
                if P.natural:
                    alpha = jnp.exp2((m - m_use) * LOG2E)
                    p = jnp.exp2((s - m_tile) * LOG2E)
                else:
                    alpha = jnp.exp2(m - m_use)
                    p = jnp.exp2(s * c - m_tile)
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p = p.astype(dtype)
                plgpu.barrier_wait(S.v_ready.at[slot])
                if P.interpreted:
                    acc = acc + jnp.dot(p, S.v_smem.at[slot][...], preferred_element_type=F32)
                else:
                    def accumulate(acc_ref):
                        plgpu.wgmma(acc_ref, p, S.v_smem.at[slot])
                    acc = pl.run_state(accumulate)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(S.v_free.at[slot])
                return acc, m_new, l

            carry = lax.fori_loop(lo, fa, functools.partial(step, partial=True), (acc, m, l))
            carry = lax.fori_loop(fa, fb, functools.partial(step, partial=False), carry)
            acc, m, l = lax.fori_loop(fb, hi, functools.partial(step, partial=True), carry)

            inv = 1.0 / jnp.where(l > 0, l, 1.0)
            S.o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(
                S.o_smem.dtype)
            S.m_smem[...] = m
            S.l_smem[...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(S.o_smem, o_ref.at[sp, b, h])
            plgpu.copy_smem_to_gmem(S.m_smem, m_ref.at[sp, b, h])
            plgpu.copy_smem_to_gmem(S.l_smem, l_ref.at[sp, b, h])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 1)
        def _produce():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
            ps = P.page_size

            def page_ids(j):
                """The pool pages of block ``j`` of a paged cache (an invalid
                entry, -1, reads page 0: the wrapper recomputes a call whose
                sequences see such a page)."""
                first, count = ((lax.div(j * P.bk, jnp.int32(ps)), 1) if ps >= P.bk
                                else (j * (P.bk // ps), P.bk // ps))
                last = jnp.int32(P.pages_per_seq - 1)
                return tuple(jnp.maximum(pt_ref[seq, jnp.minimum(first + i, last)], 0)
                             for i in range(count))

            def copies(j, pages):
                """``(source index, destination rows or None)`` of block ``j``'s
                copies into a slot: one box of the contiguous cache, or one per
                page (its part of one page where pages hold more than a block)."""
                if not ps:
                    return [((b, pl.ds(j * P.bk, P.bk), h), None)]
                if ps >= P.bk:
                    return [((h, pages[0], pl.ds(lax.rem(j * P.bk, jnp.int32(ps)), P.bk)), None)]
                return [((h, page), pl.ds(i * ps, ps)) for i, page in enumerate(pages)]

            def issue(j, pages):
                # A paged block's page indices came a step ahead; the next
                # block's are read now, to arrive while this one's copies go.
                nxt = page_ids(j + 1) if ps else ()
                slot = slot_of(j)
                lap = j - lo >= ring  # the slot held an earlier block: wait for its hand-back
                for src, smem, ready, free in ((k_ref, S.k_smem, S.k_ready, S.k_free),
                                               (v_ref, S.v_smem, S.v_ready, S.v_free)):
                    pl.when(lap)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                    for at, rows in copies(j, pages):
                        dst = smem.at[slot] if rows is None else smem.at[slot, rows]
                        plgpu.copy_gmem_to_smem(src.at[at], dst, ready.at[slot])
                return nxt

            lax.fori_loop(lo, hi, issue, page_ids(lo) if ps else ())

            def drain(j, _):
                # The ring's last hand-backs, so that every barrier phase is
                # observed before the barriers go.
                plgpu.barrier_wait(S.k_free.at[slot_of(j)])
                plgpu.barrier_wait(S.v_free.at[slot_of(j)])

            lax.fori_loop(jnp.maximum(hi - ring, lo), hi, drain, None)

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = dict(
        q_smem=plgpu.SMEM((ROWS, P.D), dtype, transforms=swizzled),
        k_smem=plgpu.SMEM((ring, P.bk, P.D), dtype, transforms=swizzled),
        v_smem=plgpu.SMEM((ring, P.bk, P.Dv), dtype, transforms=swizzled),
        o_smem=(plgpu.SMEM((ROWS, P.Dv), F32) if P.out_f32
                else plgpu.SMEM((ROWS, P.Dv), dtype, transforms=swizzled)),
        m_smem=plgpu.SMEM((ROWS,), F32),
        l_smem=plgpu.SMEM((ROWS,), F32),
        **(dict(t_smem=plgpu.SMEM((P.n_terms, ROWS), F32)) if P.n_terms else {}),
        # (the queries, and the term's values in a second copy)
        q_ready=plgpu.Barrier(num_arrivals=1 + bool(P.n_terms), num_barriers=1),
        # (a paged block arrives in one copy per page, each an arrival)
        k_ready=plgpu.Barrier(num_arrivals=P.copies, num_barriers=ring),
        v_ready=plgpu.Barrier(num_arrivals=P.copies, num_barriers=ring),
        k_free=plgpu.Barrier(num_barriers=ring),
        v_free=plgpu.Barrier(num_barriers=ring),
    )
    names = tuple(scratch)
    pl.run_scoped(lambda *r: body(types.SimpleNamespace(**dict(zip(names, r)))),
                  *scratch.values(), collective_axes="wg")


def forward(cfg, q, k, v, starts, lengths, sinks, terms=None, *, interpret=False):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv), lse (B, Hq, Tq).

    ``interpret``: False to compile for the GPU, or the Mosaic GPU
    interpreter's parameters (:func:`fnattn.flash.mosaic_gpu.interpret_params`)
    to run the same kernel on CPU."""
    why = supports(cfg, q, k, v)
    if why:
        raise NotImplementedError(
            f"decode: the Mosaic GPU kernel does not support {'; '.join(why)}; {_ELSEWHERE}.")
    out, lse, finite = attend(cfg, q, k, v, starts, lengths, sinks, terms, interpret=interpret)

    def again():
        # A key that is not the sequence's held a non-finite V (or a row saw a
        # non-finite key): the XLA lowering makes hidden keys inert.
        return xla.forward(cfg, q, k, v, starts, lengths, sinks, terms)

    return lax.cond(finite, lambda: (out, lse), again)


def attend(cfg, q, k, v, starts, lengths, sinks, terms=None, *, interpret=False):
    """``(out, lse, finite)`` of the kernel on a contiguous cache: out (B, Tq,
    Hq, Dv) in q's dtype, lse (B, Hq, Tq), and whether every partial output is
    finite (else a key the rows do not see may have held a non-finite V: the
    caller computes the call again). ``terms``: the position term's arrays
    (n, B, Hq), or None."""
    B, Tq, Hq, D = q.shape
    _, S, Hkv, Dv = v.shape
    tiles = tiles_for(cfg, D, Dv, S, k.dtype, terms=0 if terms is None else terms.shape[0])
    # Blocks aligned to cache slots (offsets = starts): block j holds slots j*bk ..
    r = common.block_ranges(cfg.mask, Tq, lengths, starts, tiles.block_k, S // tiles.block_k)
    meta = program_meta(starts, lengths, r, lengths - Tq, jnp.arange(B, dtype=I32),
                        jnp.zeros((B,), I32))
    out, lse = launch(cfg, tiles, meta, common.group_rows(q.astype(k.dtype), Hkv, ROWS), k, v,
                      Tq=Tq, G=Hq // Hkv, capacity=S,
                      terms=None if terms is None else term_rows(terms, Hkv, Tq),
                      interpret=interpret)
    return finish(out, lse, sinks, Tq, q.dtype)


def term_rows(terms, Hkv: int, Tq: int):
    """A position term's arrays (n, W, Hq) as :func:`launch` takes them: (W,
    Hkv, n, ROWS) float32, each program's values in the order of its rows
    (:func:`fnattn.decoding.common.group_rows`; W = 1: every program alike).

    >>> slopes = jnp.arange(4.0).reshape(1, 1, 4)   # n = 1, W = 1, Hq = 4
    >>> r = term_rows(slopes, Hkv=2, Tq=2)          # rows t * G + g of each kv head
    >>> r.shape, r[0, 1, 0, :5].tolist()
    ((1, 2, 1, 64), [2.0, 3.0, 2.0, 3.0, 0.0])
    """
    rows = jax.vmap(jax.vmap(lambda x: common.row_sinks(x, Hkv, Tq, ROWS)))(terms)
    return rows.transpose(1, 2, 0, 3)


def tiles_for(cfg, D: int, Dv: int, capacity: int, dtype, page_size: int = 0,
              terms: int = 0) -> Tiles:
    """:func:`plan` for a call: the spec's ``MosaicGpuDecodeBlockSizes``
    (``cfg.block_sizes``), its dtype, ``capacity`` keys per sequence, the
    arrays of its position term."""
    return plan(D, Dv, capacity, _asked(cfg), jnp.dtype(dtype).itemsize, page_size=page_size,
                terms=terms)


def program_meta(starts, lengths, ranges, q_pos0, seq, row0):
    """The kernel's int32 table, a row per program's sequence (or work item):
    ``[start, length, lo, hi, full_lo, full_hi, q_pos0, seq, row0]``, each
    column (W,): the first slot and the length of its keys; the key blocks it
    visits and the run of them it sees whole (``ranges``,
    :class:`fnattn.decoding.common.BlockRanges` or four such columns); its
    first row's position and raw index among its sequence's queries; the
    sequence (the mask's batch index and the page-table row)."""
    return jnp.stack([starts, lengths, *ranges, q_pos0, seq, row0], axis=1).astype(I32)


def launch(cfg, tiles: Tiles, meta, qg, k, v, *, Tq: int, G: int, capacity: int,
           page_table=None, terms=None, interpret=False):
    """Runs the kernel: ``(out, lse)`` per split, float32 (splits, W, Hkv, Tq *
    G, Dv) and (splits, W, Hkv, Tq * G), normalised outputs and natural-log
    lse (-inf where a split saw no key).

    ``meta``: :func:`program_meta`'s (W, 9) table. ``qg`` (W, Hkv, ROWS, D):
    each program's query rows (:func:`fnattn.decoding.common.group_rows`).
    Contiguous caches: k/v (W, S, Hkv, D|Dv). Paged ones (``page_table``
    (sequences, pages_per_seq) int32, invalid entries -1): k/v pools (Hkv,
    pages, page_size, D|Dv). ``capacity``: the keys a sequence can hold.
    ``terms``: the values of ``cfg``'s position term at each program's rows,
    float32 (W, Hkv, n, ROWS), or (1, Hkv, n, ROWS) for every program alike;
    None without a term."""
    plgpu = _plgpu()
    W, Hkv, _, D = qg.shape
    Dv = v.shape[-1]
    paged = page_table is not None
    bk = tiles.block_k
    splits = cfg.num_splits or auto_splits(W * Hkv, capacity // bk,
                                           flash_mgpu._programs(bool(interpret)))
    P = _Plan(Tq=Tq, G=G, D=D, Dv=Dv, bk=bk, stages=tiles.stages, out_f32=tiles.out_f32,
              splits=splits, scale=float(cfg.scale),
              softcap=None if cfg.softcap is None else float(cfg.softcap),
              mask_treedef=cfg.mask_treedef, interpreted=bool(interpret),
              page_size=k.shape[2] if paged else 0,
              pages_per_seq=page_table.shape[1] if paged else 0,
              term_treedef=cfg.term_treedef,
              n_terms=0 if terms is None else terms.shape[2],
              terms_shared=terms is not None and terms.shape[0] == 1)
    rows = jax.ShapeDtypeStruct((splits, W, Hkv, ROWS), F32)
    call = plgpu.kernel(
        functools.partial(_kernel, P=P, dtype=k.dtype),
        out_type=(jax.ShapeDtypeStruct((splits, W, Hkv, ROWS, Dv),
                                       F32 if tiles.out_f32 else k.dtype), rows, rows),
        grid=(Hkv, splits, W),
        grid_names=("heads", "splits", "batch"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
    )
    extra = ((page_table.astype(I32),) if paged else ()) + (() if terms is None else (terms,))
    out, m, l = call(meta, qg, k, v, *extra)
    R = Tq * G
    out, m, l = out[..., :R, :], m[..., :R], l[..., :R]
    return out.astype(F32), online.lse_exp2(m, l, natural=P.natural)


def finish(out, lse, sinks, Tq: int, dtype):
    """:func:`launch`'s splits merged, the sinks joining the denominator once,
    and its rows back in query order: ``(out (W, Tq, Hq, Dv) in dtype, lse
    (W, Hq, Tq), finite)`` (``finite``: every partial output was)."""
    _, _, Hkv, R, _ = out.shape
    sink = None if sinks is None else common.row_sinks(sinks, Hkv, Tq, R)
    merged, merged_lse = merge_stacked(out, lse, sink)
    res_out, res_lse = common.ungroup_rows(merged, merged_lse, Tq, R // Tq)
    return res_out.astype(dtype), res_lse, jnp.all(jnp.isfinite(out))
