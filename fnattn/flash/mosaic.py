"""The Pallas Mosaic lowering of flash attention (TPU).

Three kernels, each a plain function below, in the style of splash attention:

* ``_fwd_kernel``  grid (B, Hq, q-blocks, kv-steps): online softmax with the
  running max ``m`` and sum ``l`` kept lane-replicated in (block_q, 128) VMEM
  scratch and the output accumulated in a (block_q, Dv) f32 scratch; initialised
  at the first kv-step and normalised at the last, where it writes ``lse`` and
  ``lse_lo``, the rounding error of ``lse`` (:func:`fnattn._online.lse_parts`).
* ``_dq_kernel``   grid (B, Hq, q-blocks, kv-steps): recomputes P as
  ``exp((s - lse) - lse_lo)``, exact even when a row's logits are all near
  -1e30; dq, and dbias when the bias varies along the queries.
* ``_dkv_kernel``  grid (B, Hkv, kv-blocks, G * q-steps): works on transposed
  tiles (keys on sublanes, queries on lanes) so that every product is a plain
  or an RHS-transposed matmul; the G query heads of a GQA group run one after
  the other in the "arbitrary" grid axis and accumulate into one dk/dv, so K and
  V are never repeated and dk/dv need no group sum.

Block sparsity comes from scalar prefetch: the wrapper computes
:func:`fnattn.masks.block_classes` and :func:`fnattn.flash.blocks.schedule`
inside ``jit`` and hands the kernels, through ``PrefetchScalarGridSpec``, one
int32 word per (row-block, step) packing the column block to visit and its
class, plus the number of steps to take. The index maps read the schedule, so a
step past the count points at the block visited last: the pipeline issues no
DMA for it, and ``pl.when`` skips its compute. The mask is evaluated only on
PARTIAL tiles, where non-finite K/V entries are also zeroed and a key holding
one sets its logits to NaN before the mask: a key a row may not see adds
nothing to it whatever its bits, a visible one makes the row NaN. When the mask
holds no arrays, the classes and the schedule are computed at trace time with
NumPy (:func:`fnattn.masks.block_classes_static`, cached per configuration, so
tracing this branch on a machine that never runs it costs no compilation) and
the grid is only as wide as the longest row of the schedule (a sliding window
visits a few kv-blocks per q-block, not all of them). A schedule larger
than one call's share of SMEM (:data:`SCHEDULE_WORDS`; e.g. four 128k-token
documents-masked sequences) is cut along its row-blocks into several calls, each
writing its own rows, so neither batch size nor sequence length is limited.

Layout. q, k, v stay in "bthd" order, viewed as (B, T, H * D) with D padded to a
multiple of 128 so that a (block, D) tile of one head is a legal TPU block; no
transpose is needed when D is already a multiple of 128. Sequence lengths are
padded to whole blocks (padded keys are masked, padded query rows dropped).
Per-row statistics (``lse``, ``lse_lo``, ``delta``) travel as (8, T) rows, queries on
lanes. Mask operands and the bias become kernel inputs whose BlockSpec slices
them to the tile along their non-1 axes: an operand varying along both axes is a
(block, block) tile, one varying along the tile's rows only is stored
lane-replicated as (T, 128), one varying along the columns only as (8, T), and
one varying along neither (per batch row or head, e.g. lengths) is read from SMEM.

float16 inputs run in float32 (TPUs have no float16 arithmetic).
"""

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fnattn import _checks, _functions, _online, _varying, cost, dropout, masks, position_bias
from fnattn._dispatch import Lowering
from fnattn.flash import blocks

__all__ = ["MosaicBlockSizes", "LOWERING", "INTERPRET_LOWERING"]

LANES = 128
SUBLANES = 8
NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b
F32 = jnp.float32
# The prefetched schedule lives in scalar memory (SMEM, 1 MiB on recent TPUs).
# A pallas_call takes at most this many int32 words of it, half of SMEM, leaving
# room for the other scalar inputs; a longer schedule is cut along its
# row-blocks into several calls (see ``_schedule``), so sequence length and
# batch size have no limit.
SCHEDULE_WORDS = 2**17


def _round_up(x, m):
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
    """Tile sizes of the Mosaic (TPU) flash kernels.

    ``block_q``/``block_k`` tile the forward, ``block_q_dq``/``block_k_dq`` the dq
    kernel and ``block_q_dkv``/``block_k_dkv`` the dk/dv kernel. Every size must
    be a positive multiple of 128: tiles of logits put keys (or, in the dk/dv
    kernel, queries) on the 128 lanes of a vector register, and TPU blocks must
    have their last dimension divisible by 128. Sequences shorter than a block
    use one block of the sequence length rounded up to 128.

    >>> MosaicBlockSizes(block_q=256, block_k=512).block_k_dkv
    512
    >>> MosaicBlockSizes(block_q=100)
    Traceback (most recent call last):
    ...
    ValueError: MosaicBlockSizes: block_q must be a positive multiple of 128; got 100
    """

    block_q: int = 512
    block_k: int = 512
    block_q_dq: int = 512
    block_k_dq: int = 512
    block_q_dkv: int = 512
    block_k_dkv: int = 512

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0 or v % LANES:
                raise ValueError(f"MosaicBlockSizes: {f.name} must be a positive multiple of "
                                 f"{LANES}; got {v!r}")

    @classmethod
    def default(cls, dims, dtype) -> "MosaicBlockSizes":
        """512-blocks for 16-bit inputs with head dims up to 128; half the rows for
        float32 or wider heads, whose tiles take twice the VMEM."""
        d = max(dims.head_dim, dims.v_head_dim)
        wide = d > 128 or jnp.dtype(dtype).itemsize > 2
        if wide:
            return cls(block_q=256, block_k=512, block_q_dq=256, block_k_dq=256,
                       block_q_dkv=256, block_k_dkv=256)
        return cls()


# ----------------------------------------------------------------------------------
# Static description of one kernel launch
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Operand:
    """Where one mask operand (or the bias) lives, in a kernel's tile orientation.

    ``form`` is "tile" (varies along rows and columns), "row" (rows only,
    stored lane-replicated), "col" (columns only, stored on 8 sublanes) or
    "scalar" (neither; read from SMEM). ``vb``/``vh``: varies along batch/head.
    """

    form: str
    vb: bool
    vh: bool
    is_bool: bool
    h_size: int


@dataclasses.dataclass(frozen=True)
class _K:
    """Static facts shared by a kernel and its index maps."""

    B: int
    Hq: int
    G: int
    Tq: int
    Tk: int
    off: int            # aligned query position = row + off
    br: int             # block along the kernel's rows (q, or k in the dk/dv kernel)
    bc: int             # block along the kernel's columns
    r0: int             # the call's first row block (the grid's row i is block r0 + i)
    n_rows: int         # row blocks of this call
    W: int              # steps per row (grid width of the schedule)
    sb: bool            # schedule varies along batch
    sh: bool            # schedule varies along head
    transposed: bool    # rows are keys (the dk/dv kernel)
    scale: float
    softcap: Optional[float]
    rate: float
    has_sinks: bool
    bias: Optional[_Operand]
    dbias: Optional[str]   # the dbias form this kernel produces, if any
    ops: tuple
    mask_treedef: object
    term_grad: tuple = ()  # mask operands (a position term's) whose gradient dq sums

    def sched_row(self, b, h, r):
        bb = b if self.sb else 0
        hh = h if self.sh else 0
        return (bb * (self.Hq if self.sh else 1) + hh) * self.n_rows + r


def _operand(x4, transposed) -> _Operand:
    vq, vk = x4.shape[2] > 1, x4.shape[3] > 1
    vr, vc = (vk, vq) if transposed else (vq, vk)
    form = {(True, True): "tile", (True, False): "row", (False, True): "col",
            (False, False): "scalar"}[(vr, vc)]
    return _Operand(form, x4.shape[0] > 1, x4.shape[1] > 1, x4.dtype == jnp.bool_, x4.shape[1])


def _bias4(bias):
    return jnp.reshape(bias, (1,) * (4 - bias.ndim) + tuple(bias.shape))


# ----------------------------------------------------------------------------------
# Kernel helpers
# ----------------------------------------------------------------------------------


def _lanes(x, n):
    """(rows, 128) lane-replicated -> (rows, n), n a multiple of 128."""
    return x if n == LANES else jnp.concatenate([x] * (n // LANES), axis=1)


def _load(ref, op: _Operand, K: _K, b, h):
    """An operand's tile as an array broadcastable to (br, bc), or a scalar."""
    if op.form == "scalar":
        bb = b if op.vb else 0
        hh = h if op.vh else 0
        x = ref[bb * op.h_size + hh]
    else:
        x = ref[...]
        if op.form == "row":
            x = _lanes(x, K.bc)
        elif op.form == "col":
            x = jnp.broadcast_to(x[0:1, :], (K.br, K.bc))
    if op.is_bool:
        x = x.astype(jnp.int32) != 0
    return x


def _positions(K: _K, r_blk, c_blk):
    shape = (K.br, K.bc)
    rows = r_blk * K.br + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = c_blk * K.bc + lax.broadcasted_iota(jnp.int32, shape, 1)
    return (cols, rows) if K.transposed else (rows, cols)  # (q, k)


def _allowed(K: _K, op_refs, b, h, r_blk, c_blk):
    """The mask of a masked tile, with k < Tk and q < Tq: a padding row sees no
    key (a key a ``from_fn`` mask shows it would give it a NaN logit where the
    key's K or V is not finite, and the backward would add 0 * NaN into that
    key's dK and dV)."""
    q, k = _positions(K, r_blk, c_blk)
    ok = (k < K.Tk) & (q < K.Tq)
    if K.mask_treedef is not None:
        tiles = [_load(r, op, K, b, h) for r, op in zip(op_refs, K.ops)]
        # Predicates read only the tiles (the mask's arrays are placeholders).
        pos = masks.Positions(b=b, h=h, q=q, q_pos=q + K.off, k=k)
        ok = ok & jnp.broadcast_to(
            masks.from_treedef(K.mask_treedef).predicate(pos, tiles), ok.shape)
    return ok


def _keep(K: _K, seed_ref, b, h, r_blk, c_blk):
    q, k = _positions(K, r_blk, c_blk)
    return dropout.keep_mask(dropout.seed_words(seed_ref), b, h, q, k, K.rate)


def _logits(K: _K, a, bmat, dims, bias_ref, op_refs, b, h, r_blk, c_blk):
    """Scaled, biased, capped logits of tile (r_blk, c_blk) in f32, and
    tanh(s / cap) if capped. The bias includes the mask's position term
    (:mod:`fnattn.position_bias`), if it carries one."""
    s = lax.dot_general(a, bmat, dims, preferred_element_type=F32) * K.scale
    if K.bias is not None:
        s = s + _load(bias_ref, K.bias, K, b, h).astype(F32)
    if K.mask_treedef is not None:
        mask = masks.from_treedef(K.mask_treedef)
        if position_bias.present(mask):
            q, k = _positions(K, r_blk, c_blk)
            pos = masks.Positions(b=b, h=h, q=q, q_pos=q + K.off, k=k)
            tiles = [_load(r, op, K, b, h) for r, op in zip(op_refs, K.ops)]
            s = s + jnp.broadcast_to(position_bias.term(mask, pos, tiles), s.shape)
    th = None
    if K.softcap is not None:
        th = jnp.tanh(s / K.softcap)
        s = K.softcap * th
    return s, th


def _split(refs, K: _K, n_fixed, n_out, n_scratch):
    it = iter(refs)
    fixed = [next(it) for _ in range(n_fixed)]
    bias_ref = next(it) if K.bias is not None else None
    sinks_ref = next(it) if K.has_sinks else None
    seed_ref = next(it) if K.rate > 0 else None
    op_refs = [next(it) for _ in K.ops]
    rest = list(it)
    assert len(rest) == n_out + n_scratch, (len(rest), n_out, n_scratch)
    return fixed, bias_ref, sinks_ref, seed_ref, op_refs, rest[:n_out], rest[n_out:]


def _when_visited(count, t, kind, step):
    """Runs ``step(masked)`` on scheduled steps: without the mask on FULL tiles."""
    run = t < count
    pl.when(run & (kind == masks.FULL))(lambda: step(False))
    pl.when(run & (kind != masks.FULL))(lambda: step(True))


def _row_out(x):
    """(rows, 128) lane-replicated column -> (8, rows): rows on lanes."""
    return jnp.transpose(x)[:SUBLANES, :]


def _i32(x):
    """A static int as an int32 scalar: ``lax.div``/``lax.rem`` take no weak
    types, and a Python int is int64 under ``jax_enable_x64``."""
    return np.int32(x)


def _finite_kv(k, v, shape, *, keys_on_lanes):
    """K and V tiles with non-finite entries zeroed (``where``, never a product),
    and ``bad``, broadcast to the logits tile ``shape``: where a key's K or V
    holds a non-finite value. On PARTIAL tiles only: a masked key must add
    nothing whatever its bits, a visible one poisons its row honestly (the
    caller sets its logits to NaN before the mask is applied).

    ``keys_on_lanes``: keys are the columns of the logits (the forward and dq
    kernels); the count of non-finite entries per key is then a small matmul,
    which puts it on lanes without a transpose. Otherwise keys are rows (the
    dk/dv kernel) and it is a lane reduction.
    """
    # In float32: Mosaic checks finiteness of float32 vectors only.
    k32, v32 = k.astype(F32), v.astype(F32)
    fk, fv = jnp.isfinite(k32), jnp.isfinite(v32)
    nk, nv = (~fk).astype(F32), (~fv).astype(F32)
    k = jnp.where(fk, k32, 0.0).astype(k.dtype)
    v = jnp.where(fv, v32, 0.0).astype(v.dtype)
    if keys_on_lanes:
        ones_k = jnp.ones((SUBLANES, k.shape[1]), F32)
        ones_v = jnp.ones((SUBLANES, v.shape[1]), F32)
        cnt = (lax.dot_general(ones_k, nk, NT, preferred_element_type=F32)
               + lax.dot_general(ones_v, nv, NT, preferred_element_type=F32))[0:1, :]
    else:
        cnt = jnp.max(nk, axis=1, keepdims=True) + jnp.max(nv, axis=1, keepdims=True)
    return k, v, jnp.broadcast_to(cnt, shape) > 0.0


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


def _fwd_kernel(code_ref, cnt_ref, *refs, K: _K):
    (q_ref, k_ref, v_ref), bias_ref, sinks_ref, seed_ref, op_refs, (o_ref, lse_ref, lo_ref), \
        (m_sc, l_sc, acc_sc) = _split(refs, K, 3, 3, 3)
    b, h, i, t = (pl.program_id(a) for a in range(4))
    row = K.sched_row(b, h, i)
    i = i + K.r0
    code = code_ref[row * K.W + t]
    j, kind = code >> 2, code & 3

    @pl.when(t == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    def step(masked):
        k, v = k_ref[...], v_ref[...]
        if masked:
            k, v, bad = _finite_kv(k, v, (K.br, K.bc), keys_on_lanes=True)
        s, _ = _logits(K, q_ref[...], k, NT, bias_ref, op_refs, b, h, i, j)
        if masked:
            s = jnp.where(bad, jnp.nan, s)
            s = jnp.where(_allowed(K, op_refs, b, h, i, j), s, -jnp.inf)
        m_prev = m_sc[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row that has seen no visible key keeps m = -inf; subtract 0 instead
        # so that exp gives 0, not NaN.
        m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp(s - _lanes(m_use, K.bc))
        alpha = jnp.exp(m_prev - m_use)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_next
        if K.rate > 0:
            keep = _keep(K, seed_ref, b, h, i, j)
            p = jnp.where(keep, p * (1.0 / (1.0 - K.rate)), 0.0)
        pv = lax.dot_general(p.astype(v.dtype), v, NN, preferred_element_type=F32)
        acc_sc[...] = acc_sc[...] * _lanes(alpha, acc_sc.shape[1]) + pv

    _when_visited(cnt_ref[row], t, kind, step)

    @pl.when(t == K.W - 1)
    def _finish():
        m, l, acc = m_sc[...], l_sc[...], acc_sc[...]
        if sinks_ref is not None:
            # _online.join_sink on lane-replicated statistics (vector ops only:
            # the scalar unit has no exp). A sink of -inf is no sink; +inf
            # takes all the mass (m = +inf, l = 1, acc = 0).
            sink = jnp.full(m.shape, sinks_ref[h], F32)
            m_fin = jnp.maximum(m, sink)
            m_use = jnp.where(m_fin == -jnp.inf, 0.0, m_fin)
            a = jnp.exp(m - m_use)
            l = l * a + jnp.where(sink == m_use, 1.0, jnp.exp(sink - m_use))
            acc = acc * _lanes(a, acc.shape[1])
            m = m_fin
        lse, lo = _online.lse_parts(m, l)
        # A row that saw a non-finite value has l = NaN: its lse is NaN, not -inf.
        lse = jnp.where(jnp.isnan(l), jnp.nan, lse)
        safe = jnp.where(l > 0, l, 1.0)
        o_ref[...] = (acc / _lanes(safe, acc.shape[1])).astype(o_ref.dtype)
        lse_ref[...] = _row_out(lse)
        lo_ref[...] = _row_out(lo)


def _dq_kernel(code_ref, cnt_ref, *refs, K: _K):
    n_term = len(K.term_grad)
    n_out = 1 + (K.dbias is not None) + n_term
    n_scratch = 1 + (K.dbias == "row") + n_term
    (q_ref, k_ref, v_ref, do_ref, lse_ref, lo_ref, delta_ref), bias_ref, _, seed_ref, op_refs, \
        outs, scratch = _split(refs, K, 7, n_out, n_scratch)
    dq_ref, dq_sc = outs[0], scratch[0]
    # the term's gradients: row sums of dS * d(term)/d(operand), lane-replicated
    term_outs, term_sc = outs[n_out - n_term:], scratch[n_scratch - n_term:]
    b, h, i, t = (pl.program_id(a) for a in range(4))
    row = K.sched_row(b, h, i)
    i = i + K.r0
    code = code_ref[row * K.W + t]
    j, kind = code >> 2, code & 3

    @pl.when(t == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)
        if K.dbias == "row":
            scratch[1][...] = jnp.zeros(scratch[1].shape, F32)
        for sc in term_sc:
            sc[...] = jnp.zeros(sc.shape, F32)

    def step(masked):
        k, v = k_ref[...], v_ref[...]
        if masked:
            k, v, bad = _finite_kv(k, v, (K.br, K.bc), keys_on_lanes=True)
        s, th = _logits(K, q_ref[...], k, NT, bias_ref, op_refs, b, h, i, j)
        if masked:
            s = jnp.where(bad, jnp.nan, s)
            s = jnp.where(_allowed(K, op_refs, b, h, i, j), s, -jnp.inf)
        lse = jnp.expand_dims(lse_ref[0], -1)
        lo = jnp.expand_dims(lo_ref[0], -1)
        delta = jnp.expand_dims(delta_ref[0], -1)
        p = jnp.exp((s - lse) - lo)
        dp = lax.dot_general(do_ref[...], v, NT, preferred_element_type=F32)
        if K.rate > 0:
            keep = _keep(K, seed_ref, b, h, i, j)
            dp = jnp.where(keep, dp * (1.0 / (1.0 - K.rate)), 0.0)
        ds = p * (dp - delta)
        if th is not None:
            ds = ds * (1.0 - th * th)
        dq_sc[...] += lax.dot_general(ds.astype(k.dtype), k, NN, preferred_element_type=F32)
        if K.dbias == "tile":
            outs[1][...] = ds
        elif K.dbias == "row":
            scratch[1][...] += jnp.sum(ds, axis=1, keepdims=True)
        for sc, g in zip(term_sc, _term_grads(K, op_refs, ds, b, h, i, j)):
            sc[...] += jnp.sum(g, axis=1, keepdims=True)

    _when_visited(cnt_ref[row], t, kind, step)

    @pl.when(t == K.W - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * K.scale).astype(dq_ref.dtype)
        if K.dbias == "row":
            outs[1][...] = _row_out(scratch[1][...])
        for ref, sc in zip(term_outs, term_sc):
            ref[...] = _row_out(sc[...])


def _term_grads(K: _K, op_refs, ds, b, h, r_blk, c_blk):
    """dS times the derivative of the position term with respect to each of the
    operands ``K.term_grad`` (one value per batch row and head, read from SMEM),
    elementwise over the tile: the operand is broadcast to the tile first, so
    the transpose of the term's function is elementwise too."""
    if not K.term_grad:
        return ()
    q, k = _positions(K, r_blk, c_blk)
    pos = masks.Positions(b=b, h=h, q=q, q_pos=q + K.off, k=k)
    tiles = [_load(r, op, K, b, h) for r, op in zip(op_refs, K.ops)]
    mask = masks.from_treedef(K.mask_treedef)
    shape = (K.br, K.bc)

    def value(*xs):
        t = list(tiles)
        for n, x in zip(K.term_grad, xs):
            t[n] = x
        return jnp.broadcast_to(position_bias.term(mask, pos, t), shape)

    wide = [jnp.full(shape, tiles[n], F32) for n in K.term_grad]
    _, back = jax.vjp(value, *wide)
    return back(ds)


def _dkv_kernel(code_ref, cnt_ref, *refs, K: _K):
    n_out = 2 + (K.dbias is not None)
    n_scratch = 2 + (K.dbias is not None)
    (q_ref, k_ref, v_ref, do_ref, lse_ref, lo_ref, delta_ref), bias_ref, _, seed_ref, op_refs, \
        outs, scratch = _split(refs, K, 7, n_out, n_scratch)
    dk_ref, dv_ref = outs[:2]
    dk_sc, dv_sc = scratch[:2]
    b, hk, j, s_ = (pl.program_id(a) for a in range(4))
    # lax.div/rem: jnp's floor division lowers through sign, which needs a TPU.
    g, t = lax.div(s_, _i32(K.W)), lax.rem(s_, _i32(K.W))
    h = hk * K.G + g
    row = K.sched_row(b, h, j)
    j = j + K.r0
    code = code_ref[row * K.W + t]
    i, kind = code >> 2, code & 3

    @pl.when(s_ == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    if K.dbias is not None:
        @pl.when(t == 0)
        def _init_head():
            scratch[2][...] = jnp.zeros(scratch[2].shape, F32)

    def step(masked):
        q, do = q_ref[...], do_ref[...]
        k, v = k_ref[...], v_ref[...]
        if masked:
            k, v, bad = _finite_kv(k, v, (K.br, K.bc), keys_on_lanes=False)
        st, th = _logits(K, k, q, NT, bias_ref, op_refs, b, h, j, i)
        if masked:
            st = jnp.where(bad, jnp.nan, st)
            st = jnp.where(_allowed(K, op_refs, b, h, j, i), st, -jnp.inf)
        pt = jnp.exp((st - lse_ref[0:1, :]) - lo_ref[0:1, :])
        dpt = lax.dot_general(v, do, NT, preferred_element_type=F32)
        pdt = pt
        if K.rate > 0:
            keep = _keep(K, seed_ref, b, h, j, i)
            inv = 1.0 / (1.0 - K.rate)
            pdt = jnp.where(keep, pt * inv, 0.0)
            dpt = jnp.where(keep, dpt * inv, 0.0)
        dst = pt * (dpt - delta_ref[0:1, :])
        if th is not None:
            dst = dst * (1.0 - th * th)
        dv_sc[...] += lax.dot_general(pdt.astype(do.dtype), do, NN, preferred_element_type=F32)
        dk_sc[...] += lax.dot_general(dst.astype(q.dtype), q, NN, preferred_element_type=F32)
        if K.dbias is not None:
            scratch[2][...] += jnp.sum(dst, axis=1, keepdims=True)

    _when_visited(cnt_ref[row], t, kind, step)

    if K.dbias is not None:
        @pl.when(t == K.W - 1)
        def _finish_head():
            outs[2][...] = _row_out(scratch[2][...])

    @pl.when(s_ == K.G * K.W - 1)
    def _finish():
        dk_ref[...] = (dk_sc[...] * K.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------


def _pad_to(x, axis, size):
    if x.shape[axis] == size:
        return x
    w = [(0, 0)] * x.ndim
    w[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, w)


def _compute_dtype(dtype):
    # TPUs have no float16 arithmetic; run float16 problems in float32.
    return F32 if dtype == jnp.float16 else dtype


class _Chunk(NamedTuple):
    """One pallas_call's share of the schedule: row-blocks ``r0 .. r0 + n - 1``."""

    r0: int
    n: int
    code: jax.Array   # int32 (Bv * Hv * n * W,): index << 2 | kind per (row, step)
    count: jax.Array  # int32 (Bv * Hv * n,): steps per row (both NumPy when static)


def _union(classes, xp=jnp):
    """One class per tile for every batch row and head: EMPTY where all are empty,
    FULL where all are full, PARTIAL otherwise (the mask is then evaluated)."""
    empty = xp.all(classes == masks.EMPTY, axis=(0, 1), keepdims=True)
    full = xp.all(classes == masks.FULL, axis=(0, 1), keepdims=True)
    return xp.where(empty, masks.EMPTY, xp.where(full, masks.FULL, masks.PARTIAL)).astype(
        classes.dtype)


def _schedule(cfg, mask, bq, bk, *, transpose):
    """Tile classes, and the packed schedule cut into chunks that fit SMEM.

    Returns ``(classes, chunks, width, sb, sh)``: ``chunks`` are :class:`_Chunk`
    (one pallas_call each, see :data:`SCHEDULE_WORDS`), ``width`` is the grid's
    step count and ``sb``/``sh`` say whether the schedule varies along
    batch/head. When even one row-block of the schedule would not fit (very many
    per-example or per-head variants of a very long mask), the variants are
    merged into one schedule by :func:`_union`: fewer tiles are skipped, none
    wrongly.

    The classes of a mask holding no arrays are known at trace time: they and
    the schedule are then computed with NumPy (:func:`_static_schedule`, cached
    per configuration; no JAX operation, so nothing to compile) and the grid is
    only as wide as the longest row of the schedule. Past
    :data:`fnattn.flash.blocks.EMBEDDED_TILES` tiles the width still comes from
    the static classes (:func:`_static_width`) but the codes are built in XLA,
    not embedded. Otherwise they are traced.
    """
    d = cfg.dims
    known = None   # (merged, width) of an array-free mask whose schedule is built in XLA
    if mask is None or mask.num_operands == 0:
        key = (None if mask is None else jax.tree_util.tree_structure(mask), d.batch,
               d.num_q_heads, d.q_len, d.kv_len, bq, bk, cfg.q_offset, transpose)
        if blocks.embeds(-(-d.q_len // bq), -(-d.kv_len // bk)):
            static = _static_schedule(*key)
            if static is not None:
                return static
        else:
            known = _static_width(*key)
    classes = masks.block_classes(mask, d.batch, d.num_q_heads, d.q_len, d.kv_len, bq, bk,
                                  q_offset=cfg.q_offset)
    if known is not None:   # as narrow as the static schedule, its codes from XLA
        merged, width = known
    else:                   # every column of a row
        width = classes.shape[-2 if transpose else -1]
        merged = not _one_row_fits(classes, width)
    if merged:
        classes = _union(classes)
    return _pack(classes, blocks.schedule(classes, transpose=transpose), width, bq, bk, jnp)


@functools.lru_cache(maxsize=256)
def _static_schedule(treedef, batch, num_heads, q_len, kv_len, bq, bk, q_offset, transpose):
    """:func:`_schedule` of the array-free mask ``treedef`` (None: no mask) in
    NumPy, or None when its classes are not static (a symbolic size)."""
    mask = masks.from_treedef(treedef)
    classes = masks.block_classes_static(mask, batch, num_heads, q_len, kv_len, bq, bk,
                                         q_offset=q_offset)
    if classes is None:
        return None
    sched = blocks.schedule_static(classes, transpose=transpose)
    width = max(1, int(sched.count.max()))
    if not _one_row_fits(classes, width):
        classes = _union(classes, np)
        sched = blocks.schedule_static(classes, transpose=transpose)
        width = max(1, int(sched.count.max()))
    return _pack(classes, sched, width, bq, bk, np)


@functools.lru_cache(maxsize=256)
def _static_width(treedef, batch, num_heads, q_len, kv_len, bq, bk, q_offset, transpose):
    """``(merged, width)`` of :func:`_static_schedule` without its tables: whether
    the variants are merged (:func:`_union`) and the longest row, from the
    static classes' counts alone; None when the classes are not static."""
    classes = masks.block_classes_static(masks.from_treedef(treedef), batch, num_heads, q_len,
                                         kv_len, bq, bk, q_offset=q_offset)
    if classes is None:
        return None

    def longest(c):
        return max(1, int((c != masks.EMPTY).sum(-2 if transpose else -1).max()))

    width = longest(classes)
    if _one_row_fits(classes, width):
        return False, width
    return True, longest(_union(classes, np))


def _one_row_fits(classes, width):
    return classes.shape[0] * classes.shape[1] * (width + 1) <= SCHEDULE_WORDS


def _pack(classes, sched, width, bq, bk, xp):
    """The schedule's first ``width`` steps packed as ``index << 2 | kind``, cut
    into chunks of row-blocks that fit SMEM; the result of :func:`_schedule`."""
    if not _one_row_fits(classes, width):
        raise NotImplementedError(
            f"flash-mosaic: one row of the block-sparse schedule needs {width + 1} int32 "
            f"words of SMEM, more than the {SCHEDULE_WORDS} a kernel call may take "
            f"({width} steps with blocks ({bq}, {bk})). Use larger MosaicBlockSizes, or "
            "impl='xla' (the flash-xla lowering has no such limit).")
    code = sched.index[..., :width] * 4 + sched.kind[..., :width].astype(xp.int32)
    code = code.astype(xp.int32)
    count = sched.count.astype(xp.int32)
    n_rows = code.shape[2]
    per_row = classes.shape[0] * classes.shape[1] * (width + 1)
    step = max(1, SCHEDULE_WORDS // per_row)
    chunks = [_Chunk(r0, min(step, n_rows - r0), code[:, :, r0:r0 + step].reshape(-1),
                     count[:, :, r0:r0 + step].reshape(-1))
              for r0 in range(0, n_rows, step)]
    return classes, chunks, width, classes.shape[0] > 1, classes.shape[1] > 1


def _operand_array(x4, op: _Operand, transposed, R, C):
    """The array handed to the kernel for one operand (or the bias)."""
    if op.form == "scalar":
        x = x4.reshape(-1)
        return x.astype(jnp.int32) if not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(F32)
    x = jnp.swapaxes(x4, 2, 3) if transposed else x4
    if op.is_bool:
        x = x.astype(jnp.int8 if op.form == "tile" else jnp.int32)
    elif jnp.issubdtype(x.dtype, jnp.integer):
        x = x.astype(jnp.int32)
    elif x.dtype not in (F32, jnp.bfloat16) or op.form != "tile":
        x = x.astype(F32)
    if op.form == "tile":
        return _pad_to(_pad_to(x, 2, R), 3, C)
    if op.form == "row":
        x = _pad_to(x, 2, R)
        return jnp.broadcast_to(x, x.shape[:3] + (LANES,))
    x = _pad_to(x, 3, C)
    return jnp.broadcast_to(x, x.shape[:2] + (SUBLANES, C))


def _operand_spec(op: _Operand, K: _K, coords):
    """BlockSpec of an operand: ``coords(*grid, *prefetch) -> (b, h, row blk, col blk)``."""
    if op.form == "scalar":
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    block = {"tile": (K.br, K.bc), "row": (K.br, LANES), "col": (SUBLANES, K.bc)}[op.form]

    def index(*args):
        b, h, r, c = coords(*args)
        return (b if op.vb else 0, h if op.vh else 0,
                r if op.form in ("tile", "row") else 0, c if op.form in ("tile", "col") else 0)
    return pl.BlockSpec((None, None) + block, index)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Padded sizes of one forward or backward call."""

    bq: int
    bk: int
    Tqp: int
    Tkp: int
    Dp: int
    Dvp: int


def _block(b, T):
    return min(b, _round_up(T, LANES))


def _plan(cfg, bq, bk, bq2=None, bk2=None) -> _Plan:
    d = cfg.dims
    bq, bk = _block(bq, d.q_len), _block(bk, d.kv_len)
    mq, mk = bq, bk
    if bq2 is not None:
        bq2, bk2 = _block(bq2, d.q_len), _block(bk2, d.kv_len)
        mq, mk = math.lcm(bq, bq2), math.lcm(bk, bk2)
    return _Plan(bq, bk, _round_up(d.q_len, mq), _round_up(d.kv_len, mk),
                 _round_up(d.head_dim, LANES), _round_up(d.v_head_dim, LANES))


def _flat(x, T, D, dtype):
    """(B, T', H, D') -> (B, T, H * D) zero-padded, in the compute dtype."""
    x = _pad_to(_pad_to(x.astype(dtype), 1, T), 3, D)
    return x.reshape(x.shape[0], T, x.shape[2] * D)


def _kernel_facts(cfg, mask, bias, sinks, *, br, bc, chunk, W, sb, sh, transposed, dbias,
                  term_grad=()):
    d = cfg.dims
    ops = () if mask is None else tuple(_operand(o, transposed) for o in mask.operands())
    treedef = None if mask is None else jax.tree_util.tree_structure(mask)
    off = d.kv_len - d.q_len if cfg.q_offset is None else cfg.q_offset
    return _K(B=d.batch, Hq=d.num_q_heads, G=d.group, Tq=d.q_len, Tk=d.kv_len, off=off,
              br=br, bc=bc, r0=chunk.r0, n_rows=chunk.n, W=W, sb=sb, sh=sh,
              transposed=transposed, scale=cfg.scale, softcap=cfg.softcap,
              rate=cfg.dropout_rate, has_sinks=sinks is not None,
              bias=None if bias is None else _operand(_bias4(bias), transposed),
              dbias=dbias, ops=ops, mask_treedef=treedef, term_grad=term_grad)


def _extras(K: _K, mask, bias, sinks, seed, R, C, *, with_sinks):
    """Kernel inputs after the fixed ones (bias, sinks, seed, mask operands), and
    ``specs(coords)``, their BlockSpecs for one call's tile coordinates.

    The arrays are the same for every call of a kernel (the calls of a chunked
    schedule differ only in their coordinates), so they are built once.
    """
    arrays, ops = [], []  # ops: the operand's form, or None for an SMEM array
    if bias is not None:
        arrays.append(_operand_array(_bias4(bias), K.bias, K.transposed, R, C))
        ops.append(K.bias)
    if with_sinks and sinks is not None:
        arrays.append(sinks.astype(F32))
        ops.append(None)
    if K.rate > 0:
        arrays.append(lax.bitcast_convert_type(seed.astype(jnp.uint32), jnp.int32))
        ops.append(None)
    if mask is not None:
        for x4, op in zip(mask.operands(), K.ops):
            arrays.append(_operand_array(jnp.asarray(x4), op, K.transposed, R, C))
            ops.append(op)

    def specs(coords):
        return [pl.BlockSpec(memory_space=pltpu.SMEM) if op is None
                else _operand_spec(op, K, coords) for op in ops]

    return arrays, specs


def _vmem_limit():
    """A scoped-VMEM limit above the default where the chip has room for it.

    512-blocks with a bias, a dense mask and dropout keep several (512, 512) f32
    temporaries live; chips with 64 MiB or more of VMEM get 3/4 of it. Elsewhere
    (and when not tracing for a TPU, where there is no TPU to ask) the compiler's
    default stands.
    """
    try:
        capacity = pltpu.get_tpu_info().vmem_capacity_bytes
    except Exception:  # not a TPU, or a JAX without this query
        return None
    return capacity * 3 // 4 if capacity >= 64 * 2**20 else None


def _params(interpret):
    return dict(
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=None if interpret else _vmem_limit()),
        interpret=interpret)


def symbolic(cfg) -> list:
    """The sizes of ``cfg`` that are symbolic (``jax.export``) and that the kernels
    cannot take: the sequence lengths, which size the block-sparse schedule
    (a symbolic batch is a dynamic grid axis, which Mosaic takes)."""
    return _checks.symbolic_sizes(Tq=cfg.dims.q_len, Tk=cfg.dims.kv_len)


def needs_xla(cfg) -> bool:
    """Whether impl="auto" gives the call to the XLA lowering instead of these
    kernels: symbolic sizes (:func:`symbolic`) or a ``from_fn`` function Mosaic
    TPU does not compile (:func:`fnattn._functions.refusals`)."""
    return bool(symbolic(cfg)) or bool(_functions.config_refusals(cfg, _functions.MOSAIC_TPU))


def _refuse(cfg, interpret):
    _checks.refuse_symbolic(
        "flash: the Pallas Mosaic kernels", "their block-sparse schedule", "impl='auto' (the "
        "XLA lowering for such calls) and impl='xla'", Tq=cfg.dims.q_len, Tk=cfg.dims.kv_len)
    if not interpret:
        _functions.refuse("flash", _functions.config_refusals(cfg, _functions.MOSAIC_TPU))


def _forward(cfg, q, k, v, bias, sinks, mask, seed, *, interpret):
    d = cfg.dims
    _refuse(cfg, interpret)
    bs = blocks.pick(cfg.block_sizes, MosaicBlockSizes, MosaicBlockSizes.default(d, q.dtype))
    P = _plan(cfg, bs.block_q, bs.block_k)
    _, chunks, W, sb, sh = _schedule(cfg, mask, P.bq, P.bk, transpose=False)
    cd = _compute_dtype(q.dtype)
    qf, kf, vf = _flat(q, P.Tqp, P.Dp, cd), _flat(k, P.Tkp, P.Dp, cd), _flat(v, P.Tkp, P.Dvp, cd)
    outs, lses, los, extras = [], [], [], None
    for chunk in chunks:
        K = _kernel_facts(cfg, mask, bias, sinks, br=P.bq, bc=P.bk, chunk=chunk, W=W, sb=sb,
                          sh=sh, transposed=False, dbias=None)
        if extras is None:
            extras = _extras(K, mask, bias, sinks, seed, P.Tqp, P.Tkp, with_sinks=True)
        out, lse, lo = _forward_call(K, P, cd, chunk, qf, kf, vf, extras, interpret=interpret)
        outs.append(out)
        lses.append(lse)
        los.append(lo)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=3) if len(lses) > 1 else lses[0]
    lo = jnp.concatenate(los, axis=3) if len(los) > 1 else los[0]
    out = out.reshape(d.batch, -1, d.num_q_heads, P.Dvp)[:, :d.q_len, :, :d.v_head_dim]
    return out.astype(q.dtype), lse[:, :, 0, :d.q_len], lo[:, :, 0, :d.q_len]


def _cost(K: _K, chunk: _Chunk, d: int, dv: int, itemsize: int, *, kernel: str):
    """The ``pl.CostEstimate`` of one call (see :mod:`fnattn.cost`): the tiles its
    schedule visits (a static schedule's exact count; a traced one's grid size,
    an upper bound), the column operands read once per tile and the row operands
    (read, and written back) once per row block. None under a symbolic batch
    (``jax.export``): the count is not a number then."""
    if not _checks.is_static(K.B):
        return None
    if isinstance(chunk.count, np.ndarray):
        n = int(chunk.count.sum()) * (1 if K.sb else K.B) * (1 if K.sh else K.Hq)
    else:
        n = K.B * K.Hq * K.n_rows * K.W
    rows = K.B * K.Hq * K.n_rows * K.br
    per_row = (d + dv) * itemsize * (1 if kernel == "forward" else 2) + 8 * LANES
    moved = n * K.bc * (d + dv) * itemsize + rows * per_row
    return cost.tiles(n, K.br, K.bc, d, dv, kernel=kernel, softcap=K.softcap is not None,
                      bytes_accessed=moved)


def _q_row_maps(K: _K):
    """Index-map pieces of the kernels whose grid is (B, Hq, q-blocks, steps):
    the kv-block of a step, the (b, h, q-block, kv-block) coordinates of its
    tile (for the mask operands and the bias), and the block of K and V."""
    W, G, r0 = K.W, K.G, K.r0

    def col(b, h, i, t, code_ref, cnt_ref):
        return code_ref[K.sched_row(b, h, i) * W + t] >> 2

    def coords(b, h, i, t, code_ref, cnt_ref):
        return b, h, i + r0, col(b, h, i, t, code_ref, cnt_ref)

    def kv_index(b, h, i, t, *refs):
        # lax.div: jnp's floor division lowers through sign, which needs a TPU.
        return b, col(b, h, i, t, *refs), lax.div(h, _i32(G))

    return col, coords, kv_index


def _forward_call(K: _K, P: _Plan, cd, chunk: _Chunk, qf, kf, vf, extras, *, interpret):
    """One pallas_call of the forward over the q-blocks of ``chunk``."""
    B, Hq, r0 = K.B, K.Hq, K.r0
    col, coords, kv_index = _q_row_maps(K)

    extra, extra_specs = extras[0], extras[1](coords)
    in_specs = [
        pl.BlockSpec((None, P.bq, P.Dp), lambda b, h, i, t, *_: (b, i + r0, h)),
        pl.BlockSpec((None, P.bk, P.Dp), kv_index),
        pl.BlockSpec((None, P.bk, P.Dvp), kv_index),
    ] + extra_specs
    row_spec = pl.BlockSpec((None, None, SUBLANES, P.bq), lambda b, h, i, t, *_: (b, h, 0, i))
    out_specs = [pl.BlockSpec((None, P.bq, P.Dvp), lambda b, h, i, t, *_: (b, i, h)),
                 row_spec, row_spec]
    rows = chunk.n * P.bq
    return _varying.pallas_call(
        functools.partial(_fwd_kernel, K=K),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, Hq, chunk.n, K.W),
            in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((P.bq, LANES), F32), pltpu.VMEM((P.bq, LANES), F32),
                            pltpu.VMEM((P.bq, P.Dvp), F32)]),
        out_shape=[jax.ShapeDtypeStruct((B, rows, Hq * P.Dvp), cd),
                   jax.ShapeDtypeStruct((B, Hq, SUBLANES, rows), F32),
                   jax.ShapeDtypeStruct((B, Hq, SUBLANES, rows), F32)],
        name="fnattn_flash_mosaic_fwd",
        cost_estimate=_cost(K, chunk, P.Dp, P.Dvp, jnp.dtype(cd).itemsize, kernel="forward"),
        **_params(interpret),
    )(chunk.code, chunk.count, qf, kf, vf, *extra)


def _dbias_forms(bias):
    """Which kernel produces dbias: the dq kernel for a bias that varies along the
    queries (or along neither axis), the dk/dv kernel for one that varies only
    along the keys."""
    if bias is None:
        return None, None
    b4 = _bias4(bias)
    vq, vk = b4.shape[2] > 1, b4.shape[3] > 1
    if vq and vk:
        return "tile", None
    if vk:
        return None, "row"
    return "row", None


def _backward(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse, *, interpret):
    d = cfg.dims
    _refuse(cfg, interpret)
    B, Hq, Hkv = d.batch, d.num_q_heads, d.num_kv_heads
    bs = blocks.pick(cfg.block_sizes, MosaicBlockSizes, MosaicBlockSizes.default(d, q.dtype))
    P = _plan(cfg, bs.block_q_dq, bs.block_k_dq, bs.block_q_dkv, bs.block_k_dkv)
    Pt = _plan(cfg, bs.block_q_dkv, bs.block_k_dkv)
    cd = _compute_dtype(q.dtype)

    delta = _online.delta_rows(out, d_out, d_lse)
    # Rows without any visible key (lse = -inf), rows an infinite sink took
    # (+inf) and padded rows get lse = +inf and lse_lo = 0, so that
    # exp((s - lse) - lse_lo) = 0 there: no NaN, no contribution. A NaN row
    # (it saw a non-finite K or V) stays NaN.
    lse_safe = jnp.where(jnp.isinf(lse), jnp.inf, lse)
    lo_safe = jnp.where(jnp.isfinite(lse), lse_lo.astype(F32), 0.0)

    def rows8(x, fill):
        x = jnp.pad(x, ((0, 0), (0, 0), (0, P.Tqp - d.q_len)), constant_values=fill)
        return jnp.broadcast_to(x[:, :, None, :], (B, Hq, SUBLANES, P.Tqp))

    lse8, lo8, delta8 = rows8(lse_safe, jnp.inf), rows8(lo_safe, 0.0), rows8(delta, 0.0)
    qf, dof = _flat(q, P.Tqp, P.Dp, cd), _flat(d_out, P.Tqp, P.Dvp, cd)
    kf, vf = _flat(k, P.Tkp, P.Dp, cd), _flat(v, P.Tkp, P.Dvp, cd)
    dbias_dq, dbias_dkv = _dbias_forms(bias)

    # dq (and dbias along the queries, and the term's gradients)
    term_ops = position_bias.kernel_grad_operands(cfg.term_grad, mask, "Pallas Mosaic TPU")
    classes, chunks, W, sb, sh = _schedule(cfg, mask, P.bq, P.bk, transpose=False)
    res, extras = [], None
    for chunk in chunks:
        K = _kernel_facts(cfg, mask, bias, None, br=P.bq, bc=P.bk, chunk=chunk, W=W, sb=sb,
                          sh=sh, transposed=False, dbias=dbias_dq, term_grad=term_ops)
        if extras is None:
            extras = _extras(K, mask, bias, None, seed, P.Tqp, P.Tkp, with_sinks=False)
        res.append(_dq_call(K, P, cd, chunk, classes.shape[3], qf, kf, vf, dof, lse8, lo8,
                            delta8, extras, interpret=interpret))
    # the row axes of dq, dbias and the term's gradients
    axes = (1,) + ((2 if dbias_dq == "tile" else 3,) if dbias_dq else ()) + (3,) * len(term_ops)
    res = [jnp.concatenate(parts, axis=ax) if len(parts) > 1 else parts[0]
           for parts, ax in zip(zip(*res), axes)]
    # the term's gradients per (batch row, head): the sum of the rows' sums
    term_sums = [g[:, :, 0, :d.q_len].sum(-1) for g in res[len(res) - len(term_ops):]]
    dq = res[0].reshape(B, -1, Hq, P.Dp)[:, :d.q_len, :, :d.head_dim].astype(q.dtype)
    dbias_full = None
    if dbias_dq == "tile":
        nq, nk = classes.shape[2], classes.shape[3]
        x = res[1].reshape(B, Hq, nq, P.bq, nk, P.bk)
        # Tiles the schedule never visits were never written: they hold garbage.
        seen = (classes != masks.EMPTY)[:, :, :, None, :, None]
        x = jnp.where(seen, x, 0.0).reshape(B, Hq, nq * P.bq, nk * P.bk)
        dbias_full = x[:, :, :d.q_len, :d.kv_len]
    elif dbias_dq == "row":
        dbias_full = res[1][:, :, 0, :d.q_len, None]

    # dk, dv (and dbias along the keys only), on transposed tiles
    _, chunks_t, Wt, sbt, sht = _schedule(cfg, mask, Pt.bq, Pt.bk, transpose=True)
    res_t, extras = [], None
    for chunk in chunks_t:
        Kt = _kernel_facts(cfg, mask, bias, None, br=Pt.bk, bc=Pt.bq, chunk=chunk, W=Wt,
                           sb=sbt, sh=sht, transposed=True, dbias=dbias_dkv)
        if extras is None:
            extras = _extras(Kt, mask, bias, None, seed, P.Tkp, P.Tqp, with_sinks=False)
        res_t.append(_dkv_call(Kt, P, Pt, cd, chunk, qf, kf, vf, dof, lse8, lo8, delta8,
                               extras, Hkv=Hkv, interpret=interpret))
    axes = (1, 1, 3)  # the row axis of dk, dv and a row dbias
    res_t = [jnp.concatenate(parts, axis=ax) if len(parts) > 1 else parts[0]
             for parts, ax in zip(zip(*res_t), axes)]
    dk = res_t[0].reshape(B, -1, Hkv, P.Dp)[:, :d.kv_len, :, :d.head_dim].astype(k.dtype)
    dv = res_t[1].reshape(B, -1, Hkv, P.Dvp)[:, :d.kv_len, :, :d.v_head_dim].astype(v.dtype)
    if dbias_dkv is not None:
        dbias_full = res_t[2][:, :, 0, None, :d.kv_len]

    dbias = None
    if bias is not None:
        shape4 = _bias4(bias).shape
        axes = tuple(a for a in range(4) if shape4[a] == 1 and dbias_full.shape[a] != 1)
        dbias = dbias_full.sum(axes, keepdims=True).reshape(bias.shape).astype(bias.dtype)
    dsinks = None
    if sinks is not None:
        dsinks = _online.sink_grad(sinks, lse, lse_lo, delta).astype(sinks.dtype)
    return (dq, dk, dv, dbias, dsinks,
            *position_bias.kernel_leaf_grads(mask, cfg.term_grad, term_ops, term_sums))


def _dq_call(K: _K, P: _Plan, cd, chunk: _Chunk, nk, qf, kf, vf, dof, lse8, lo8, delta8, extras,
             *, interpret):
    """One pallas_call of the dq kernel over the q-blocks of ``chunk``."""
    B, Hq, W, r0 = K.B, K.Hq, K.W, K.r0
    bq, bk = P.bq, P.bk
    col, coords, kv_index = _q_row_maps(K)

    extra, extra_specs = extras[0], extras[1](coords)
    row_spec = pl.BlockSpec((None, None, SUBLANES, bq), lambda b, h, i, t, *_: (b, h, 0, i + r0))
    in_specs = [
        pl.BlockSpec((None, bq, P.Dp), lambda b, h, i, t, *_: (b, i + r0, h)),
        pl.BlockSpec((None, bk, P.Dp), kv_index),
        pl.BlockSpec((None, bk, P.Dvp), kv_index),
        pl.BlockSpec((None, bq, P.Dvp), lambda b, h, i, t, *_: (b, i + r0, h)),
        row_spec, row_spec, row_spec,
    ] + extra_specs
    rows = chunk.n * bq
    out_specs = [pl.BlockSpec((None, bq, P.Dp), lambda b, h, i, t, *_: (b, i, h))]
    out_shape = [jax.ShapeDtypeStruct((B, rows, Hq * P.Dp), cd)]
    scratch = [pltpu.VMEM((bq, P.Dp), F32)]
    if K.dbias == "tile":
        out_specs.append(pl.BlockSpec((None, None, bq, bk), lambda b, h, i, t, *r: (
            b, h, i, col(b, h, i, t, *r))))
        out_shape.append(jax.ShapeDtypeStruct((B, Hq, rows, nk * bk), F32))
    elif K.dbias == "row":
        out_specs.append(pl.BlockSpec((None, None, SUBLANES, bq),
                                      lambda b, h, i, t, *_: (b, h, 0, i)))
        out_shape.append(jax.ShapeDtypeStruct((B, Hq, SUBLANES, rows), F32))
        scratch.append(pltpu.VMEM((bq, LANES), F32))
    for _ in K.term_grad:
        out_specs.append(pl.BlockSpec((None, None, SUBLANES, bq),
                                      lambda b, h, i, t, *_: (b, h, 0, i)))
        out_shape.append(jax.ShapeDtypeStruct((B, Hq, SUBLANES, rows), F32))
        scratch.append(pltpu.VMEM((bq, LANES), F32))
    return _varying.pallas_call(
        functools.partial(_dq_kernel, K=K),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, Hq, chunk.n, W), in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape, name="fnattn_flash_mosaic_dq",
        cost_estimate=_cost(K, chunk, P.Dp, P.Dvp, jnp.dtype(cd).itemsize, kernel="backward_dq"),
        **_params(interpret),
    )(chunk.code, chunk.count, qf, kf, vf, dof, lse8, lo8, delta8, *extra)


def _dkv_call(K: _K, P: _Plan, Pt: _Plan, cd, chunk: _Chunk, qf, kf, vf, dof, lse8, lo8,
              delta8, extras, *, Hkv, interpret):
    """One pallas_call of the dk/dv kernel over the kv-blocks of ``chunk``."""
    B, G, W, r0 = K.B, K.G, K.W, K.r0
    bqt, bkt = Pt.bq, Pt.bk

    def head(hk, s):
        return hk * G + lax.div(s, _i32(W))

    def qcol(b, hk, j, s, code_ref, cnt_ref):
        return code_ref[K.sched_row(b, head(hk, s), j) * W + lax.rem(s, _i32(W))] >> 2

    def coords(b, hk, j, s, code_ref, cnt_ref):
        return b, head(hk, s), j + r0, qcol(b, hk, j, s, code_ref, cnt_ref)

    extra, extra_specs = extras[0], extras[1](coords)
    row_spec = pl.BlockSpec((None, None, SUBLANES, bqt), lambda b, hk, j, s, *r: (
        b, head(hk, s), 0, qcol(b, hk, j, s, *r)))

    def q_side(width):
        return pl.BlockSpec((None, bqt, width), lambda b, hk, j, s, *r: (
            b, qcol(b, hk, j, s, *r), head(hk, s)))

    def kv_side(width, offset):
        return pl.BlockSpec((None, bkt, width), lambda b, hk, j, s, *_: (b, j + offset, hk))

    in_specs = [q_side(P.Dp), kv_side(P.Dp, r0), kv_side(P.Dvp, r0), q_side(P.Dvp),
                row_spec, row_spec, row_spec] + extra_specs
    rows = chunk.n * bkt
    out_specs = [kv_side(P.Dp, 0), kv_side(P.Dvp, 0)]
    out_shape = [jax.ShapeDtypeStruct((B, rows, Hkv * P.Dp), cd),
                 jax.ShapeDtypeStruct((B, rows, Hkv * P.Dvp), cd)]
    scratch = [pltpu.VMEM((bkt, P.Dp), F32), pltpu.VMEM((bkt, P.Dvp), F32)]
    if K.dbias is not None:
        out_specs.append(pl.BlockSpec((None, None, SUBLANES, bkt), lambda b, hk, j, s, *_: (
            b, head(hk, s), 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, K.Hq, SUBLANES, rows), F32))
        scratch.append(pltpu.VMEM((bkt, LANES), F32))
    return _varying.pallas_call(
        functools.partial(_dkv_kernel, K=K),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, Hkv, chunk.n, G * W), in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape, name="fnattn_flash_mosaic_dkv",
        cost_estimate=_cost(K, chunk, P.Dp, P.Dvp, jnp.dtype(cd).itemsize,
                            kernel="backward_dkv"),
        **_params(interpret),
    )(chunk.code, chunk.count, qf, kf, vf, dof, lse8, lo8, delta8, *extra)


LOWERING = Lowering("flash-mosaic", functools.partial(_forward, interpret=False),
                    functools.partial(_backward, interpret=False))
INTERPRET_LOWERING = Lowering("flash-mosaic-interpret",
                              functools.partial(_forward, interpret=True),
                              functools.partial(_backward, interpret=True))
