"""The Pallas Triton lowering of flash attention (NVIDIA GPUs).

Three kernels, in this file's order:

* ``_fwd_kernel``  grid (q-blocks, B*Hq): online softmax over the kv-blocks a
  q-block sees, in base 2 (``exp2`` with ``log2(e)`` folded into the scale).
* ``_dq_kernel``   grid (q-blocks, B*Hq): recomputes P from ``lse``; dq, and
  dbias when a bias is given (accumulated straight into the bias's own
  broadcast shape, with atomic adds where several programs share an element).
* ``_dkdv_kernel`` grid (kv-blocks, B*Hkv*S): for one kv-block, loops over the
  q-blocks that see it *and* over the query heads of its GQA group, so K and V
  are never repeated. It works on transposed tiles (``S^T = K Q^T``) so that no
  (block, block) tile is transposed in registers.

Then the wrappers ``_forward`` and ``_backward``, ``redo_forward`` (the forward
kernel recomputing only the blocks another kernel flagged, in place: the Mosaic
GPU forward's ``hidden_keys="redo"``), the two :class:`Lowering` objects and
:class:`TritonBlockSizes`.

How the kernels see the data. Arrays are passed whole along the sequence axes
(the BlockSpecs select only batch and head) and tiles are sliced with ``pl.ds``
inside the kernels. The wrapper pads sequence lengths to whole blocks and head
dims to powers of two (a Triton rule), so no load is out of bounds.

Block-sparse skipping. ``masks.block_classes`` and ``blocks.schedule`` run in
the wrapper, inside ``jit`` (with NumPy at trace time when the mask holds no
arrays: the table is then a constant); each (batch, head, row-block) gets one int32 row
``[n_full, n_partial, full kv-blocks..., partial kv-blocks...]`` that the kernel
reads as an ordinary input (Triton has no scalar prefetch). A kernel runs two
loops: the FULL tiles with no mask code at all, then the PARTIAL tiles, where
the mask predicate (through the mask protocol, on tiles of the mask's operands)
and the ragged-length bound are applied. Empty tiles cost nothing. Without a
mask there is no schedule: the loop runs over every kv-block with ``j = t``.

Everything else is specialised at trace time: without bias, soft-cap, dropout
or sinks the kernels contain no code for them.

Extreme inputs. With a bias and no soft-cap (``_K.large``) a logit may be
anything finite (-1e30 or ``finfo.min`` on whole rows, 1e10): the running max
stays in natural units and P is ``exp2((s - m) * log2(e))``; the forward also
returns ``lse_lo`` (``_online.lse_parts``) and the backward recomputes
``P = exp2(((s - lse) - lse_lo) * log2(e))``, exact when every logit of a row
is huge. Otherwise (logits from ``q.k`` or within the soft-cap) the fused
``s * c - m`` stays. The forward kernel writes its row state ``(m, l)``; the
wrapper makes lse of it in XLA (:func:`row_results`), and without a cap the
backward recomputes ``P = exp2(s * c - hi) * exp2(-lo)`` from the base-2 lse
in two parts that give back the forward's ``m + log2(l)`` to the last bit,
whatever the logits' size (:func:`fnattn._online.lse_parts_exp2`; one float32
base-2 lse is off by up to a unit in the last place of ``m``, a factor of 2
on the weights at logits of about 1e7). ``exp2`` of the base-2 state's
rounding overflows from logits of about 1e9: NaN beyond
(docs/spec_and_masks.md, "Extreme inputs"; ``benchmarks/extreme_logits.py``).
On PARTIAL tiles with a mask, non-finite K/V entries are zeroed and their
keys' logits set to NaN before the mask (``online.finite_keys``), so a key a
row may not see contributes nothing to it whatever its bits hold.

>>> import jax, jax.numpy as jnp
>>> from fnattn import AttentionSpec, core, masks, reference
>>> from fnattn.flash.triton import INTERPRET_LOWERING
>>> q = jax.random.normal(jax.random.key(0), (1, 20, 2, 16))
>>> spec = AttentionSpec(mask=masks.causal())
>>> run = lambda q: core.run(spec, q, q, q, fn="flash",
...                          table=(("default", INTERPRET_LOWERING),))
>>> res = jax.jit(run)(q)
>>> bool(jnp.allclose(res.out, reference(spec, q, q, q).out, atol=1e-5))
True
"""

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnattn import _checks, _functions
from fnattn import _online as online
from fnattn import _varying, dropout, masks, position_bias
from fnattn._dispatch import Lowering
from fnattn.flash import blocks

__all__ = ["TritonBlockSizes", "LOWERING", "INTERPRET_LOWERING"]

LOG2E, LN2 = online.LOG2E, online.LN2
F32 = jnp.float32

# The dk/dv pass handles a whole GQA group per program when that still leaves
# this many programs to fill the GPU (an H100 has 132 SMs); otherwise it splits
# the group over programs and sums per-head float32 results afterwards.
MIN_DKDV_PROGRAMS = 264


def _pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _is_pow2(n) -> bool:
    return isinstance(n, int) and n > 0 and not n & (n - 1)


# ----------------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TritonBlockSizes:
    """Tile sizes and launch parameters of the three Triton flash kernels.

    Block sizes must be powers of two (a Triton rule) and at least 16 (the
    smallest tensor-core tile). They are clamped to the (padded) sequence length,
    so small problems need no special block sizes.

    Attributes:
      block_q, block_k: forward tile: q rows held by a program, kv rows per step.
      block_q_dq, block_k_dq: dq pass: q rows held, kv rows per step.
      block_q_dkdv, block_k_dkdv: dk/dv pass: q rows per step, kv rows held.
      num_warps, num_stages: forward launch (``num_stages`` is the depth of
        Triton's software pipeline over the kv loop).
      num_warps_dq, num_stages_dq, num_warps_dkdv, num_stages_dkdv: the same for
        the two backward kernels.

    >>> TritonBlockSizes(block_q=64, block_k=32).block_k_dkdv
    128
    >>> TritonBlockSizes(block_q=48)
    Traceback (most recent call last):
    ...
    ValueError: TritonBlockSizes: block_q must be a power of two >= 16; got 48
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dq: int = 128
    block_k_dq: int = 64
    block_q_dkdv: int = 64
    block_k_dkdv: int = 128
    num_warps: int = 4
    num_stages: int = 3
    num_warps_dq: int = 8
    num_stages_dq: int = 2
    num_warps_dkdv: int = 8
    num_stages_dkdv: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.startswith("block"):
                if not (_is_pow2(v) and v >= 16):
                    raise ValueError(
                        f"TritonBlockSizes: {f.name} must be a power of two >= 16; got {v!r}")
            elif f.name.startswith("num_warps"):
                if not (_is_pow2(v) and v <= 32):
                    raise ValueError(
                        f"TritonBlockSizes: {f.name} must be a power of two <= 32; got {v!r}")
            elif not (isinstance(v, int) and v >= 1):
                raise ValueError(f"TritonBlockSizes: {f.name} must be an int >= 1; got {v!r}")

    @classmethod
    def default(cls, dims, dtype) -> "TritonBlockSizes":
        """Block sizes for an H100 by head dim (the larger of D and Dv) and dtype.

        Register use grows with the head dim (the accumulators are
        block x head-dim float32) and with the element size, so larger head dims
        and float32 get smaller tiles.

        >>> from fnattn._checks import Dims
        >>> TritonBlockSizes.default(Dims(1, 8192, 8192, 16, 16, 128, 128), "bfloat16")
        ... # doctest: +ELLIPSIS
        TritonBlockSizes(block_q=128, block_k=128, ...)
        """
        d = _pow2(max(dims.head_dim, dims.v_head_dim, 16))
        wide = jnp.dtype(dtype).itemsize >= 4
        if wide:
            d *= 2  # float32 operands take twice the registers and shared memory
        if d <= 64:
            return cls(block_q=128, block_k=64, block_q_dq=128, block_k_dq=64,
                       block_q_dkdv=64, block_k_dkdv=128, num_warps=4, num_stages=3,
                       num_warps_dq=8, num_stages_dq=3, num_warps_dkdv=8, num_stages_dkdv=3)
        if d <= 128:
            return cls(block_q=128, block_k=128, block_q_dq=128, block_k_dq=64,
                       block_q_dkdv=64, block_k_dkdv=128, num_warps=8, num_stages=3,
                       num_warps_dq=8, num_stages_dq=2, num_warps_dkdv=8, num_stages_dkdv=2)
        if d <= 256:
            return cls(block_q=64, block_k=64, block_q_dq=64, block_k_dq=64,
                       block_q_dkdv=64, block_k_dkdv=64, num_warps=8, num_stages=2,
                       num_warps_dq=8, num_stages_dq=2, num_warps_dkdv=8, num_stages_dkdv=1)
        return cls(block_q=32, block_k=32, block_q_dq=32, block_k_dq=32,
                   block_q_dkdv=32, block_k_dkdv=32, num_warps=8, num_stages=1,
                   num_warps_dq=8, num_stages_dq=1, num_warps_dkdv=8, num_stages_dkdv=1)


# ----------------------------------------------------------------------------------
# Static facts shared by the kernels
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _K:
    """Everything a kernel needs to know at trace time (hashable)."""

    Hq: int
    G: int            # query heads per kv head
    Gp: int           # query heads per dk/dv program (divides G)
    Tq: int
    Tk: int
    offset: int       # aligned query position = q + offset
    bq: int
    bk: int
    nk: int           # kv-blocks (or q-blocks in the dk/dv pass) per row, for the schedule
    scale: float
    softcap: Optional[float]
    rate: float
    bias_varies: Optional[tuple]  # (b, h, q, k) flags, None without bias
    has_sinks: bool
    mask_treedef: object          # None without a mask
    op_varies: tuple              # per mask operand: (b, h, q, k) flags
    ragged_k: bool                # Tk is not a multiple of bk
    ragged_q: bool = False        # Tq is not a multiple of bq
    one_list: bool = False        # the schedule is [n_full, n_visited, tiles...] (Mosaic GPU's)
    term_grad: tuple = ()         # mask operands (a position term's) whose gradient dq sums

    @property
    def has_mask(self) -> bool:
        return self.mask_treedef is not None

    @property
    def large(self) -> bool:
        """Logits may be huge (a bias without soft-cap: -1e30 or ``finfo.min`` rows,
        the additive padding mask): the running max is kept in natural units
        and the softmax computes ``exp2((s - m) * log2(e))``, never ``s * log2(e)``
        alone (``finfo.min * log2(e)`` overflows, and the rounding of a product
        of 1e10 is larger than the softmax's whole range). Without a bias, or
        with a soft-cap (logits within +-softcap), the fused ``s * c - m`` stays."""
        return (self.bias_varies is not None or self.has_term) and self.softcap is None

    @property
    def split(self) -> bool:
        """Base 2 without a soft-cap: logits from ``q.k`` may be huge, and the
        backward recomputes ``P = exp2(s * c - hi) * exp2(-lo)`` from the
        base-2 lse in two parts (:func:`fnattn._online.backward_rows`), which
        is the forward's own weight at any size (one float32 base-2 lse is off
        by up to a unit in the last place of the row maximum)."""
        return not self.large and self.softcap is None

    @property
    def has_lse_lo(self) -> bool:
        """The backward kernels read a third row statistic, ``lse_lo``: the
        natural lse's low part (``large``) or exp2 of minus the base-2 lse's
        (``split``); that is, whenever there is no soft-cap."""
        return self.large or self.split

    @property
    def has_term(self) -> bool:
        """Whether the mask carries a position term (:mod:`fnattn.position_bias`)."""
        return self.has_mask and position_bias.present(masks.from_treedef(self.mask_treedef))


def _q_rows(i, K: _K):
    return pl.ds(pl.multiple_of(i * K.bq, K.bq), K.bq)


def _k_rows(j, K: _K):
    return pl.ds(pl.multiple_of(j * K.bk, K.bk), K.bk)


def _tile(ref, varies, head, i, j, K: _K, transposed: bool):
    """The (bq|1, bk|1) tile (i, j) of a per-(b, h) 2-D ref, or (bk|1, bq|1) if transposed.

    ``varies`` are the operand's (b, h, q, k) flags; ``head`` indexes a leading
    head axis that the dk/dv pass keeps in the block (or is None).
    """
    qs = _q_rows(i, K) if varies[2] else slice(None)
    ks = _k_rows(j, K) if varies[3] else slice(None)
    idx = (ks, qs) if transposed else (qs, ks)
    if head is not None and varies[1]:
        idx = (head,) + idx
    return ref[idx]


def _scores(a, b, bias_t, K: _K):
    """Logits of a tile ``a @ b.T`` as ``(s, c, th)`` with ``exp(logit) = exp2(s * c)``.

    Keeping the factor ``c`` apart lets the caller fold it into the
    ``s * c - m`` of the softmax (one fused multiply-add per element). ``th`` is
    ``tanh`` of the capped logit (for the soft-cap derivative) or None.
    """
    s = lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    if bias_t is None and K.softcap is None:
        return s, K.scale * LOG2E, None
    s = s * K.scale
    if bias_t is not None:
        s = s + bias_t.astype(F32)
    if K.softcap is None:
        return s, LOG2E, None
    th = jnp.tanh(s * (1.0 / K.softcap))
    return th, K.softcap * LOG2E, th


def _bias_tile(R, K: _K, head, b, h, i, j, transposed: bool):
    """The additive logits of tile (i, j): the bias tile plus the position
    term (float32), or None without either. ``head`` indexes the refs' head
    axis (the dk/dv pass), ``h`` is the query head."""
    bias_t = None if R.bias is None else _tile(R.bias, K.bias_varies, head, i, j, K, transposed)
    if not K.has_term:
        return bias_t
    pos = _positions(b, h, i, j, K, transposed)
    tiles = [_tile(r, v, head, i, j, K, transposed) for r, v in zip(R.ops, K.op_varies)]
    term = position_bias.term(masks.from_treedef(K.mask_treedef), pos, tiles)
    return term if bias_t is None else bias_t.astype(F32) + term


def _positions(b, h, i, j, K: _K, transposed: bool):
    """Broadcastable (raw q, aligned q, k) index arrays of tile (i, j)."""
    if transposed:
        qi = i * K.bq + lax.broadcasted_iota(jnp.int32, (1, K.bq), 1)
        kj = j * K.bk + lax.broadcasted_iota(jnp.int32, (K.bk, 1), 0)
    else:
        qi = i * K.bq + lax.broadcasted_iota(jnp.int32, (K.bq, 1), 0)
        kj = j * K.bk + lax.broadcasted_iota(jnp.int32, (1, K.bk), 1)
    return masks.Positions(b=b, h=h, q=qi, q_pos=qi + K.offset, k=kj)


def _allowed(op_refs, head, pos, i, j, K: _K, transposed: bool):
    """The mask of a PARTIAL tile: the mask predicate and the ragged-length
    bounds. With a mask, padding rows see no key: a key a ``from_fn`` predicate
    shows them would give them a NaN logit where its K or V is not finite
    (:func:`_masked`), and the backward would add 0 * NaN into its dK and dV."""
    ok = None
    if K.has_mask:
        tiles = [_tile(r, v, head, i, j, K, transposed) for r, v in zip(op_refs, K.op_varies)]
        # The predicate reads only the tiles (the mask's arrays are placeholders).
        ok = masks.from_treedef(K.mask_treedef).predicate(pos, tiles).astype(jnp.bool_)
    if K.ragged_k:
        inb = pos.k < K.Tk
        ok = inb if ok is None else ok & inb
    if K.has_mask and K.ragged_q:
        ok = ok & (pos.q < K.Tq)
    return ok


def _masked(s, allowed, bad, transposed: bool):
    """The logits of a PARTIAL tile: NaN at keys with non-finite K/V (``bad``,
    or None), then -inf where not ``allowed``."""
    if bad is not None:
        s = jnp.where(bad[:, None] if transposed else bad[None, :], jnp.nan, s)
    return jnp.where(allowed, s, -jnp.inf)


def _keep(seed_ref, pos, K: _K):
    return dropout.keep_mask(dropout.seed_words(seed_ref), pos.b, pos.h, pos.q, pos.k, K.rate)


class _Refs:
    """Names the kernel's refs; the optional ones are None when absent.

    ``outs``: the outputs' names in order, each a name or a ``(name, present)``
    pair, None when not present (no ref taken for it).
    """

    def __init__(self, refs, K: _K, names, outs, *, sched: bool, aliased: int = 0):
        it = iter(refs)
        for n in names:
            setattr(self, n, next(it))
        self.sched = next(it) if sched else None
        self.bias = next(it) if K.bias_varies is not None else None
        self.sinks = next(it) if K.has_sinks else None
        self.seed = next(it) if K.rate > 0 else None
        self.ops = [next(it) for _ in K.op_varies]
        for _ in range(aliased):  # inputs aliased to outputs: used through the outputs
            next(it)
        for n in outs:
            name, present = (n, True) if isinstance(n, str) else n
            setattr(self, name, next(it, None) if present else None)


def _loops(R: _Refs, K: _K, n_static: int, body, carry, repeat: int = 1,
           between=None):
    """Runs ``body(j, g, carry, partial)`` over the scheduled blocks.

    With a schedule: the FULL blocks, then the PARTIAL ones. Without: blocks
    ``0 .. n_static-1`` with no mask, then (for a ragged last kv-block) one
    partial step. ``repeat`` > 1 visits every block once per head ``g`` of a
    GQA group (the dk/dv pass). ``between()``, if given, is traced between the
    two loops (values the partial steps share, live only during them).
    """
    def step(index_of, partial):
        def f(t, c):
            # t >= 0: plain truncating division (jnp's floor-division rules are
            # more code, and their lowering trips over Triton's integer types).
            slot, g = (t, 0) if repeat == 1 else (lax.div(t, repeat), lax.rem(t, repeat))
            return body(index_of(slot), g, c, partial)
        return f

    i32 = jnp.int32  # loop bounds pinned to int32 (Python ints are int64 under x64)
    if R.sched is None:
        carry = lax.fori_loop(i32(0), i32(n_static * repeat), step(lambda s: s, False), carry)
        if K.ragged_k and n_static < K.nk:
            if between is not None:
                between()
            carry = lax.fori_loop(i32(0), i32(repeat), step(lambda s: n_static + s, True), carry)
        return carry
    n_full, n_part = R.sched[0], R.sched[1]
    # The PARTIAL blocks follow the FULL ones (one list), or start at 2 + nk.
    first_partial = 2 + n_full if K.one_list else 2 + K.nk
    if K.one_list:
        n_part = n_part - n_full
    carry = lax.fori_loop(i32(0), n_full * repeat, step(lambda s: R.sched[2 + s], False), carry)
    if between is not None:
        between()
    return lax.fori_loop(i32(0), n_part * repeat,
                         step(lambda s: R.sched[first_partial + s], True), carry)


# ----------------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------------


def _heavy_first(n_q_blocks):
    """The q-block of this program, last blocks first.

    Under causal-like masks the last q-blocks see the most kv-blocks; starting
    them first keeps a long block from running alone at the end of the grid.
    """
    return n_q_blocks - 1 - pl.program_id(0)


def _fwd_kernel(*refs, K: _K, sched: bool, redo: bool = False):
    """One q-block of one head. ``redo``: the outputs alias earlier results (of
    :func:`redo_forward`), and the block is computed only when its rows of the
    ``flags`` input hold a NaN, with non-finite keys flagged on every tile."""
    names = ("q", "k", "v", "flags") if redo else ("q", "k", "v")
    R = _Refs(refs, K, names, ("o", "m", "l"), sched=sched, aliased=3 if redo else 0)
    i, bh = _heavy_first(R.q.shape[0] // K.bq), pl.program_id(1)
    b, h = bh // K.Hq, bh % K.Hq
    rows = _q_rows(i, K)
    if redo:
        flags = R.flags[rows]
        pl.when(online.any_false(flags == flags) > 0)(  # (a NaN among the block's rows)
            functools.partial(_fwd_block, R, K, i, b, h, rows, every_tile=True))
    else:
        _fwd_block(R, K, i, b, h, rows)


def _fwd_block(R: _Refs, K: _K, i, b, h, rows, *, every_tile=False):
    """``every_tile``: keys with non-finite K/V give NaN logits on FULL tiles too
    (``online.finite_keys``), not only where the mask hides keys; otherwise a
    FULL tile leaves them to the arithmetic, where a -inf logit drops its key."""
    q = R.q[rows, :]
    guard = K.has_mask or K.ragged_k or K.bias_varies is not None

    def body(j, _, carry, partial):
        acc, m, l = carry
        ks = _k_rows(j, K)
        k, v, bad = R.k[ks, :], None, None
        if (partial or every_tile) and K.has_mask:  # keys a row may not see: their
            k, v, bad = online.finite_keys(k, R.v[ks, :], triton=True)  # K/V bits never matter
        bias_t = _bias_tile(R, K, None, b, h, i, j, False)
        s, c, _ = _scores(q, k, bias_t, K)
        pos = _positions(b, h, i, j, K, False) if partial or R.seed is not None else None
        if partial:
            s = _masked(s, _allowed(R.ops, None, pos, i, j, K, False), bad, False)
        elif bad is not None:
            s = jnp.where(bad[None, :], jnp.nan, s)
        # A row with no visible key so far keeps m = -inf; shifting by 0 instead
        # of -inf keeps exp2 at exp2(-inf) = 0 rather than NaN.
        if K.large:  # m in natural units; (s - m) is exact where it matters
            m_new = jnp.maximum(m, s.max(axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp2((s - m_use[:, None]) * c)
            alpha = jnp.exp2((m - m_use) * c)
        else:  # m in base-2 units, one fused multiply-add per logit
            m_new = jnp.maximum(m, s.max(axis=1) * c)
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard else m_new
            p = jnp.exp2(s * c - m_use[:, None])
            alpha = jnp.exp2(m - m_use)
        l = l * alpha + p.sum(axis=1)
        if R.seed is not None:
            p = jnp.where(_keep(R.seed, pos, K), p * (1.0 / (1.0 - K.rate)), 0.0)
        if v is None:
            v = R.v[ks, :]
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32)
        return acc, m_new, l

    acc = jnp.zeros((K.bq, R.v.shape[-1]), F32)
    m = jnp.full((K.bq,), -jnp.inf, F32)
    l = jnp.zeros((K.bq,), F32)
    acc, m, l = _loops(R, K, K.Tk // K.bk, body, (acc, m, l))
    if R.sinks is not None:
        sink = R.sinks[0].astype(F32)
        if K.large:
            acc, m, l = online.join_sink(acc, m, l, sink, exp=jnp.exp)
        else:
            acc, m, l = online.join_sink(acc, m, l, sink * LOG2E, exp=jnp.exp2)
    out = acc * (1.0 / jnp.where(l > 0, l, 1.0))[:, None]
    # The row state itself: the wrapper makes lse of it (row_results), in XLA,
    # where the base-2 lse's two parts come out the same bits as the backward's.
    R.m[rows], R.l[rows] = m, l
    R.o[rows, :] = out.astype(R.o.dtype)


# ----------------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------------


def _ds(p, dp, delta, th, keep, K: _K):
    """(dropped p, dS) of a tile; dS is the gradient of the pre-cap scaled logit."""
    pd = p
    if keep is not None:
        inv = 1.0 / (1.0 - K.rate)
        pd = jnp.where(keep, p * inv, 0.0)
        dp = jnp.where(keep, dp * inv, 0.0)
    ds = p * (dp - delta)
    if th is not None:
        ds = ds * (1.0 - th * th)
    return pd, ds


def _row_names(K: _K):
    """The per-row inputs of the backward kernels: (B, H, Tq) float32 each.

    ``lse`` is the forward's lse in the base the kernel recomputes P in: base 2
    (``lse * log2(e)``, P = ``exp2(s * c - lse)``, under a soft-cap), base 2 in
    two parts for ``K.split`` (``lse`` the high part, ``lse_lo`` ``exp2`` of
    minus the low part: P = ``exp2(s * c - lse) * lse_lo``) or, for
    ``K.large``, natural with ``lse_lo`` beside it
    (P = ``exp2(((s - lse) - lse_lo) * log2(e))``, exact for rows whose logits
    are all huge). +inf where the forward's lse is not finite (and on padding
    rows), so that P = 0 there.
    """
    return ("q", "k", "v", "do", "lse", "delta") + (("lse_lo",) if K.has_lse_lo else ())


def _probs(s, c, lse, lse_lo, K: _K):
    """P of a tile from its logits and the per-row lse (broadcast already)."""
    if K.large:
        return jnp.exp2(((s - lse) - lse_lo) * c)
    if K.split:  # (lse_lo holds exp2(-lo): the forward's own exp2(s * c - m), scaled)
        return jnp.exp2(s * c - lse) * lse_lo
    return jnp.exp2(s * c - lse)


def _dq_kernel(*refs, K: _K, sched: bool):
    outs = ("dq", ("dbias", K.bias_varies is not None))
    outs += tuple(f"dterm{n}" for n in range(len(K.term_grad)))
    R = _Refs(refs, K, _row_names(K), outs, sched=sched, aliased=K.bias_varies is not None)
    dterm_refs = [getattr(R, f"dterm{n}") for n in range(len(K.term_grad))]
    i, bh = _heavy_first(R.q.shape[0] // K.bq), pl.program_id(1)
    b, h = bh // K.Hq, bh % K.Hq
    rows = _q_rows(i, K)
    q, do = R.q[rows, :], R.do[rows, :]
    lse, delta = R.lse[rows][:, None], R.delta[rows]
    lse_lo = R.lse_lo[rows][:, None] if K.has_lse_lo else None

    def body(j, _, carry, partial):
        dq, dterm = carry
        ks = _k_rows(j, K)
        k, v, bad = R.k[ks, :], None, None
        if partial and K.has_mask:  # masked keys with NaN/inf K/V give exactly 0
            k, v, bad = online.finite_keys(k, R.v[ks, :], triton=True)
        bias_t = _bias_tile(R, K, None, b, h, i, j, False)
        s, c, th = _scores(q, k, bias_t, K)
        pos = _positions(b, h, i, j, K, False) if partial or R.seed is not None else None
        if partial:
            s = _masked(s, _allowed(R.ops, None, pos, i, j, K, False), bad, False)
        p = _probs(s, c, lse, lse_lo, K)
        if v is None:
            v = R.v[ks, :]
        dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        keep = None if R.seed is None else _keep(R.seed, pos, K)
        _, ds = _ds(p, dp, delta[:, None], th, keep, K)
        if R.dbias is not None:
            _add_dbias(R.dbias, ds, rows, ks, K)
        if K.term_grad:
            dterm = tuple(a + g for a, g in zip(dterm, _term_grads(R, K, ds, b, h, i, j)))
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=F32), dterm

    dterm0 = tuple(jnp.zeros((1, 1), F32) for _ in K.term_grad)
    dq, dterm = _loops(R, K, K.Tk // K.bk, body, (jnp.zeros((K.bq, R.q.shape[-1]), F32), dterm0))
    R.dq[rows, :] = (dq * K.scale).astype(R.dq.dtype)
    for ref, g in zip(dterm_refs, dterm):
        ref[...] = g[0]


def _term_grads(R, K: _K, ds, b, h, i, j):
    """The gradients of the term's operands ``K.term_grad`` (each one value per
    batch row and head, a (1, 1) tile) from tile (i, j)'s dS: the transpose of
    the term's elementwise function, a sum over the tile."""
    pos = _positions(b, h, i, j, K, False)
    tiles = [_tile(r, v, None, i, j, K, False) for r, v in zip(R.ops, K.op_varies)]
    mask = masks.from_treedef(K.mask_treedef)

    def value(*xs):
        t = list(tiles)
        for n, x in zip(K.term_grad, xs):
            t[n] = x.astype(F32)
        return position_bias.term(mask, pos, t)

    _, back = jax.vjp(value, *[tiles[n].astype(F32) for n in K.term_grad])
    return back(ds)


def _add_dbias(dbias_ref, ds, rows, ks, K: _K):
    """Adds a dS tile into dbias, which has the bias's broadcast shape (zeros at start).

    The tile is first summed over the axes along which the bias is broadcast.
    Only when the bias varies along every axis does each element belong to one
    program and one step: then a plain store; otherwise an atomic add.
    """
    _, _, vq, vk = K.bias_varies
    if not vq:
        ds = ds.sum(axis=0, keepdims=True)
    if not vk:
        ds = ds.sum(axis=1, keepdims=True)
    # A broadcast axis is sliced from an int32 0: the atomic add's interpret rule
    # wants every start of one dtype (a bare ``slice`` starts at an int64 0 under x64).
    whole = pl.ds(jnp.int32(0), 1)
    idx = (rows if vq else whole, ks if vk else whole)
    if all(K.bias_varies):
        dbias_ref[idx] = ds
    else:
        plgpu.atomic_add(dbias_ref, idx, ds)


def _dkdv_kernel(*refs, K: _K, sched: bool):
    # Blocks hold Gp query heads: q, do (Tq, Gp, D); lse, delta, lse_lo (Gp, Tq).
    R = _Refs(refs, K, _row_names(K), ("dk", "dv"), sched=sched)
    j, bp = pl.program_id(0), pl.program_id(1)
    nprog = K.Hq // K.Gp
    b, p_head = bp // nprog, bp % nprog
    ks = _k_rows(j, K)
    k_full, v_full = R.k[ks, :], R.v[ks, :]
    # The PARTIAL steps use the tile with non-finite entries zeroed (masked keys
    # contribute exactly nothing), loaded and cleaned between the two loops.
    clean = {}

    def between():
        if K.has_mask:
            clean["kvb"] = online.finite_keys(R.k[ks, :], R.v[ks, :], triton=True)

    def body(i, g, carry, partial):
        dk, dv = carry
        k, v, bad = clean["kvb"] if partial and K.has_mask else (k_full, v_full, None)
        rows = _q_rows(i, K)
        q, do = R.q[rows, g, :], R.do[rows, g, :]
        lse, delta = R.lse[g, rows][None, :], R.delta[g, rows]
        lse_lo = R.lse_lo[g, rows][None, :] if K.has_lse_lo else None
        bias_t = _bias_tile(R, K, g, b, p_head * K.Gp + g, i, j, True)
        st, c, th = _scores(k, q, bias_t, K)                      # (bk, bq) = S^T
        pos = None
        if partial or R.seed is not None:
            pos = _positions(b, p_head * K.Gp + g, i, j, K, True)
        if partial:
            st = _masked(st, _allowed(R.ops, g, pos, i, j, K, True), bad, True)
        pt = _probs(st, c, lse, lse_lo, K)
        dpt = lax.dot_general(v, do, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        keep = None if R.seed is None else _keep(R.seed, pos, K)
        pdt, dst = _ds(pt, dpt, delta[None, :], th, keep, K)
        dv = dv + jnp.dot(pdt.astype(do.dtype), do, preferred_element_type=F32)
        dk = dk + jnp.dot(dst.astype(q.dtype), q, preferred_element_type=F32)
        return dk, dv

    carry = (jnp.zeros((K.bk, R.k.shape[-1]), F32), jnp.zeros((K.bk, R.v.shape[-1]), F32))
    # Without a mask every q-block is visited and needs no bound: padded query
    # rows have lse = +inf, so their P is 0.
    dk, dv = _loops(R, K, K.nk, body, carry, repeat=K.Gp, between=between)
    R.dk[ks, :] = (dk * K.scale).astype(R.dk.dtype)
    R.dv[ks, :] = dv.astype(R.dv.dtype)


# ----------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------


def _pad(x, axis, size, value=0):
    if x.shape[axis] == size:
        return x
    w = [(0, 0)] * x.ndim
    w[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, w, constant_values=value)


def _pad_seq(x, sizes):
    """Pads axes 2 and 3 of a (B|1, H|1, Tq|1, Tk|1) array to ``sizes`` where not 1."""
    for axis, n in zip((2, 3), sizes):
        if x.shape[axis] > 1:
            x = _pad(x, axis, n)
    return x


def _varies(shape4):
    return tuple(n > 1 for n in shape4)


# Shared memory a kernel may plan for with (block_q, block_k) tiles of a bias or
# an array mask in its pipeline, by `_smem_estimate` (which counts only the
# staged operands: Triton adds its own layout-conversion buffers on top, and the
# H100 gives a block at most 227 KB).
SMEM_BUDGET = 160 * 1024


def _tile_bytes(bias, mask) -> int:
    """Bytes per (query, key) pair of the inputs the kernels read as (q, k) tiles: a
    bias or mask operand that varies along both sequence axes (0 without one)."""
    arrays = ([] if bias is None else [bias]) + ([] if mask is None else list(mask.operands()))
    n = 0
    for a in arrays:
        shape = (1,) * (4 - a.ndim) + tuple(a.shape)
        if shape[2] > 1 and shape[3] > 1:
            n += 1 if a.dtype == jnp.bool_ else jnp.dtype(a.dtype).itemsize
    return n


def _smem_estimate(which, bq, bk, stages, Dp, Dvp, itemsize, tile_bytes) -> int:
    """Shared memory of one program's staged operands: ``stages`` copies of what
    each step of the loop loads, plus the tiles held for the whole loop and the
    (block_q, block_k) operand of the second matrix product."""
    if which == "dkdv":  # the loop walks q-blocks: q and dO stream, K and V stay
        step, held = bq * (Dp + Dvp) * itemsize, bk * (Dp + Dvp) * itemsize
    else:                # the loop walks kv-blocks: K and V stream
        step = bk * (Dp + Dvp) * itemsize
        held = bq * (Dp if which == "fwd" else Dp + Dvp) * itemsize
    step += bq * bk * tile_bytes
    return stages * step + held + (1 if which == "fwd" else 2) * bq * bk * itemsize


def _fit_smem(which, bq, bk, stages, Dp, Dvp, itemsize, tile_bytes):
    """Smaller tiles (fewer stages first, then the longer block side halved, down
    to 32) until ``_smem_estimate`` fits ``SMEM_BUDGET``; only when (q, k)-shaped
    tiles are streamed (tuned defaults are kept for the rest)."""
    if not tile_bytes:
        return bq, bk, stages
    def over():
        return _smem_estimate(which, bq, bk, stages, Dp, Dvp, itemsize,
                              tile_bytes) > SMEM_BUDGET
    while over():
        if stages > 2:
            stages -= 1
        elif max(bq, bk) > 32:
            if bq >= bk:
                bq //= 2
            else:
                bk //= 2
        elif stages > 1:
            stages -= 1
        else:
            break
    return bq, bk, stages


def _blocks_for(cfg, dtype, which, tile_bytes=0):
    """(block_q, block_k, CompilerParams) of one kernel: the spec's block sizes or
    the defaults, clamped to the sequences, and shrunk to fit shared memory when a
    bias or array mask is streamed as (block_q, block_k) tiles (``tile_bytes``
    per pair, :func:`_tile_bytes`).

    >>> from fnattn._checks import Dims
    >>> from fnattn._dispatch import Config
    >>> cfg = Config(Dims(1, 4096, 4096, 8, 8, 128, 128), 0.1, None, 0.0, None)
    >>> _blocks_for(cfg, jnp.bfloat16, "fwd")[:2], _blocks_for(cfg, jnp.bfloat16, "fwd", 4)[:2]
    ((128, 128), (64, 64))
    """
    d = cfg.dims
    given = blocks.pick(cfg.block_sizes, TritonBlockSizes, None)
    bs = given or TritonBlockSizes.default(d, dtype)
    bq, bk, warps, stages = {
        "fwd": (bs.block_q, bs.block_k, bs.num_warps, bs.num_stages),
        "dq": (bs.block_q_dq, bs.block_k_dq, bs.num_warps_dq, bs.num_stages_dq),
        "dkdv": (bs.block_q_dkdv, bs.block_k_dkdv, bs.num_warps_dkdv, bs.num_stages_dkdv),
    }[which]
    # Tiles never larger than the padded sequence: small problems need no tuning.
    bq, bk = min(bq, max(16, _pow2(d.q_len))), min(bk, max(16, _pow2(d.kv_len)))
    if given is None:  # (block sizes the user chose are kept as they are)
        bq, bk, stages = _fit_smem(which, bq, bk, stages, *head_dims_padded(d),
                                   jnp.dtype(dtype).itemsize, tile_bytes)
    return bq, bk, plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _make_k(cfg, mask, bias, sinks, bq, bk, *, dkdv=False, Gp=1, term_grad=()):
    d = cfg.dims
    nq, nk = -(-d.q_len // bq), -(-d.kv_len // bk)
    ops = () if mask is None else mask.operands()
    treedef = None if mask is None else jax.tree_util.tree_structure(mask)
    return _K(Hq=d.num_q_heads, G=d.group, Gp=Gp, Tq=d.q_len, Tk=d.kv_len,
              offset=d.kv_len - d.q_len if cfg.q_offset is None else cfg.q_offset,
              bq=bq, bk=bk, nk=nq if dkdv else nk, scale=cfg.scale, softcap=cfg.softcap,
              rate=cfg.dropout_rate,
              bias_varies=None if bias is None else _varies(_bias4(bias).shape),
              has_sinks=sinks is not None, mask_treedef=treedef,
              op_varies=tuple(_varies(op.shape) for op in ops),
              ragged_k=d.kv_len % bk != 0, ragged_q=d.q_len % bq != 0, term_grad=term_grad)


def _bias4(bias):
    return jnp.reshape(bias, (1,) * (4 - bias.ndim) + tuple(bias.shape))


def _schedule(mask, cfg, K: _K, *, transpose=False, heads_per_row=1):
    """One int32 row [n_full, n_partial, full blocks (nk), partial blocks (nk)]
    per (b|1, h|1, row-block); None without a mask.

    With ``heads_per_row`` > 1 the rows of consecutive query heads are merged
    (a tile is FULL only if FULL for every head, visited if any head sees it).
    A mask holding no arrays has static classes: the table is then computed
    with NumPy at trace time (cached per configuration) and reaches the kernel
    as a constant, so tracing this branch compiles nothing, unless it has more
    tiles than :data:`fnattn.flash.blocks.EMBEDDED_TILES`; otherwise it is
    built in XLA at every call.
    """
    if mask is None:
        return None
    d = cfg.dims
    if mask.num_operands == 0 and blocks.embeds(-(-d.q_len // K.bq), -(-d.kv_len // K.bk)):
        table = _static_table(jax.tree_util.tree_structure(mask), d.batch, d.num_q_heads,
                              d.q_len, d.kv_len, K.bq, K.bk, cfg.q_offset, transpose,
                              heads_per_row)
        if table is not None:
            return table
    cls = masks.block_classes(mask, d.batch, d.num_q_heads, d.q_len, d.kv_len, K.bq, K.bk,
                              q_offset=cfg.q_offset)
    return _table(jnp, blocks.schedule, cls, transpose, heads_per_row)


@functools.lru_cache(maxsize=256)
def _static_table(treedef, batch, num_heads, q_len, kv_len, bq, bk, q_offset, transpose,
                  heads_per_row):
    """:func:`_schedule`'s table of the array-free mask ``treedef`` in NumPy, or
    None when its classes are not static (a symbolic size)."""
    cls = masks.block_classes_static(masks.from_treedef(treedef), batch, num_heads, q_len,
                                     kv_len, bq, bk, q_offset=q_offset)
    if cls is None:
        return None
    table = _table(np, blocks.schedule_static, cls, transpose, heads_per_row)
    table.flags.writeable = False
    return table


def row_classes(xp, cls, transpose, heads_per_row):
    """Tile classes (B|1, H|1, rows, cols) as a kernel walks them: rows are q-blocks,
    or kv-blocks with ``transpose``; with ``heads_per_row`` > 1 the rows of that
    many consecutive heads merged (FULL only if FULL for every head, visited if
    any head sees the tile).

    >>> cls = np.array([[[[masks.FULL, masks.EMPTY]], [[masks.PARTIAL, masks.EMPTY]]]])
    >>> row_classes(np, cls, True, 2)[0, 0].tolist()  # kv-block 0: seen, not FULL for both
    [[1], [0]]
    """
    if transpose:
        cls = xp.swapaxes(cls, -1, -2)
    if heads_per_row > 1 and cls.shape[1] > 1:
        c = cls.reshape(cls.shape[0], -1, heads_per_row, *cls.shape[2:])
        full = xp.all(c == masks.FULL, axis=2)
        seen = xp.any(c != masks.EMPTY, axis=2)
        cls = full.astype(xp.int8) + seen.astype(xp.int8)
    return cls


def _table(xp, schedule, cls, transpose, heads_per_row):
    cls = row_classes(xp, cls, transpose, heads_per_row)
    full = schedule(xp.where(cls == masks.FULL, cls, masks.EMPTY).astype(xp.int8))
    part = schedule(xp.where(cls == masks.PARTIAL, cls, masks.EMPTY).astype(xp.int8))
    return xp.concatenate([full.count[..., None], part.count[..., None],
                           full.index, part.index], axis=-1).astype(xp.int32)


def _sched_spec(table, n_heads_total, *, heavy_first):
    """BlockSpec of a schedule table, for grid (row-block, b * n_heads + head).

    ``heavy_first``: the kernel visits row-blocks last first (`_heavy_first`).
    """
    vb, vh = table.shape[0] > 1, table.shape[1] > 1
    n_rows = table.shape[2]

    def index(r, bh):
        row = n_rows - 1 - r if heavy_first else r
        return (bh // n_heads_total if vb else 0, bh % n_heads_total if vh else 0, row, 0)
    return pl.BlockSpec((None, None, None, table.shape[-1]), index)


def _bh_spec(shape4, n_heads, heads_per_prog):
    """BlockSpec of a (B|1, H|1, X, Y) array, whole along X and Y.

    The grid's second axis is ``b * n_heads + head``; with ``heads_per_prog``
    (the dk/dv pass) the block keeps that many consecutive heads.
    """
    vb, vh = shape4[0] > 1, shape4[1] > 1
    hblock = heads_per_prog if (vh and heads_per_prog) else None

    def index(r, bh):
        return (bh // n_heads if vb else 0, bh % n_heads if vh else 0, 0, 0)
    return pl.BlockSpec((None, hblock, shape4[2], shape4[3]), index)


def _extras(K: _K, mask, bias, sinks, seed, pads, *, transpose=False, n_heads,
            heads_per_prog=None):
    """Inputs and BlockSpecs for bias, sinks, seed and the mask operands (kernel order)."""
    arrays, specs = [], []

    def add4(x):
        x = _pad_seq(x, pads)
        if transpose:
            x = jnp.swapaxes(x, 2, 3)
        arrays.append(x)
        specs.append(_bh_spec(x.shape, n_heads, heads_per_prog))

    if bias is not None:
        add4(_bias4(bias))
    if sinks is not None:
        arrays.append(sinks.reshape(K.Hq, 1))
        specs.append(pl.BlockSpec((None, 1), lambda r, bh: (bh % K.Hq, 0)))
    if K.rate > 0:
        arrays.append(seed.astype(jnp.uint32))
        specs.append(pl.BlockSpec((dropout.SEED_WORDS,), lambda r, bh: (0,)))
    if mask is not None:
        for op in mask.operands():
            add4(op.astype(jnp.int8) if op.dtype == jnp.bool_ else op)
    return arrays, specs


def _seq_spec(T, D, n_heads, head_of, heads_per_prog=None):
    """BlockSpec of a (B, T, H, D) array: whole along T and D for one program's head,
    or its ``heads_per_prog`` consecutive heads (kept as an axis of the block)."""
    hblock = heads_per_prog
    return pl.BlockSpec((None, T, hblock, D),
                        lambda r, bh: (bh // n_heads, 0, head_of(bh % n_heads), 0))


def _rows_spec(T, n_heads, heads_per_prog=None):
    hblock = heads_per_prog
    return pl.BlockSpec((None, hblock, T), lambda r, bh: (bh // n_heads, bh % n_heads, 0))


def head_dims_padded(dims) -> tuple:
    """``(Dp, Dvp)``: the head dims these kernels compute at, D and Dv each
    padded to a power of two (16 at least: ``tl.arange`` and the smallest
    tensor-core tile).

    >>> from fnattn._checks import Dims
    >>> head_dims_padded(Dims(1, 8, 8, 1, 1, 96, 8))
    (128, 16)
    """
    return _pow2(max(dims.head_dim, 16)), _pow2(max(dims.v_head_dim, 16))


def _dims_padded(cfg, bq, bk):
    d = cfg.dims
    Tqp, Tkp = -(-d.q_len // bq) * bq, -(-d.kv_len // bk) * bk
    return (Tqp, Tkp) + head_dims_padded(d)


def _pad_bthd(x, T, D):
    return _pad(_pad(x, 1, T), 3, D)


def _sizes(cfg, interpret):
    # The sizes the kernels need static: all on a GPU (the Triton backend has no
    # dynamic grid), the sequence lengths when interpreted (whole-row blocks).
    d = cfg.dims
    sizes = dict(Tq=d.q_len, Tk=d.kv_len)
    return sizes if interpret else dict(B=d.batch, **sizes)


def symbolic(cfg, *, interpret=False) -> list:
    """The sizes of ``cfg`` that are symbolic (``jax.export``) and that the kernels
    cannot take."""
    return _checks.symbolic_sizes(**_sizes(cfg, interpret))


def needs_xla(cfg) -> bool:
    """Whether impl="auto" gives the call to the XLA lowering instead of the
    compiled kernels: symbolic sizes (:func:`symbolic`) or a ``from_fn``
    function Triton does not compile (:func:`fnattn._functions.refusals`)."""
    return bool(symbolic(cfg)) or bool(_functions.config_refusals(cfg, _functions.TRITON))


def _refuse(cfg, interpret):
    """What the kernels cannot take of a call asked of them by name: symbolic
    sizes, and (compiled, not interpreted) functions Triton does not compile."""
    _checks.refuse_symbolic("flash: the Pallas Triton kernels", "their grids and blocks",
                            "impl='auto' (the XLA lowering for such calls) and impl='xla'",
                            **_sizes(cfg, interpret))
    if not interpret:
        _functions.refuse("flash", _functions.config_refusals(cfg, _functions.TRITON))


def _forward(cfg, q, k, v, bias, sinks, mask, seed, *, interpret):
    d = cfg.dims
    _refuse(cfg, interpret)
    bq, bk, params = _blocks_for(cfg, q.dtype, "fwd", _tile_bytes(bias, mask))
    Tqp, Tkp, Dp, Dvp = _dims_padded(cfg, bq, bk)
    K = _make_k(cfg, mask, bias, sinks, bq, bk)
    Hq, G = d.num_q_heads, d.group
    table = _schedule(mask, cfg, K)
    extra, extra_specs = _extras(K, mask, bias, sinks, seed, (Tqp, Tkp), n_heads=Hq)
    sched, sched_specs = ([], []) if table is None else ([table], [_sched_spec(table, Hq, heavy_first=True)])
    out, m, l = _varying.pallas_call(
        functools.partial(_fwd_kernel, K=K, sched=table is not None),
        grid=(Tqp // bq, d.batch * Hq),
        in_specs=[_seq_spec(Tqp, Dp, Hq, lambda h: h), _seq_spec(Tkp, Dp, Hq, lambda h: h // G),
                  _seq_spec(Tkp, Dvp, Hq, lambda h: h // G)] + sched_specs + extra_specs,
        out_specs=[_seq_spec(Tqp, Dvp, Hq, lambda h: h), _rows_spec(Tqp, Hq),
                   _rows_spec(Tqp, Hq)],
        out_shape=[jax.ShapeDtypeStruct((d.batch, Tqp, Hq, Dvp), q.dtype),
                   jax.ShapeDtypeStruct((d.batch, Hq, Tqp), F32),
                   jax.ShapeDtypeStruct((d.batch, Hq, Tqp), F32)],
        compiler_params=params, interpret=interpret, name="fnattn_flash_fwd",
    )(_pad_bthd(q, Tqp, Dp), _pad_bthd(k, Tkp, Dp), _pad_bthd(v, Tkp, Dvp), *sched, *extra)
    lse, lse_lo = row_results(K.large, m[:, :, :d.q_len], l[:, :, :d.q_len])
    return out[:, :d.q_len, :, :d.v_head_dim], lse, lse_lo


def row_results(natural: bool, m, l):
    """``(lse, lse_lo)`` of the forward kernel's row state ``(m, l)``: natural
    (``natural``, ``_K.large``: :func:`fnattn._online.lse_parts`) or base 2
    (:func:`fnattn._online.lse_parts_exp2`, whose low part gives the backward
    the base-2 lse in two exact parts). In XLA, outside the kernels."""
    return online.lse_parts(m, l) if natural else online.lse_parts_exp2(m, l)


def redo_forward(cfg, q, k, v, sinks, mask, seed, table, flags, out, m, l, *, bq, bk,
                 interpret):
    """``(out, m, l)`` (the output and the row state, :func:`row_results`
    makes lse of it) as given, except the (bq)-row blocks whose ``flags``
    hold a NaN, which the forward kernel computes again from ``q, k, v``.

    For a kernel that ran on K and V as they are and flagged the rows where it
    met a non-finite value (:mod:`fnattn.flash.mosaic_gpu`): this kernel makes
    the keys a row may not see inert on the tiles it loads, so the blocks it
    recomputes follow the rule every lowering follows. The given results are
    updated in place (aliased): a block that is not recomputed costs the read
    of its flags. ``out`` is (B, Tp, Hq, D), ``D`` a power of two, ``flags``,
    ``m`` and ``l`` are (B, Hq, Tp), float32, ``Tp`` a multiple of
    ``bq``; ``table`` is the Mosaic GPU kernels' one-list table at (bq, bk) tiles
    (:func:`fnattn.flash.mosaic_gpu.static_schedule`; None without a mask). No
    bias (the caller takes none)."""
    d = cfg.dims
    _refuse(cfg, interpret)
    Tp, Hq, G = out.shape[1], d.num_q_heads, d.group
    Tkp, Dp = -(-d.kv_len // bk) * bk, out.shape[-1]
    if Tp % bq or Tp < d.q_len or Dp != head_dims_padded(d)[0] or d.head_dim != d.v_head_dim:
        raise ValueError(f"redo_forward: out {out.shape} is not whole ({bq}-row) blocks of "
                         f"the queries ({d.q_len}) at a power-of-two head dim ({d.head_dim})")
    K = dataclasses.replace(_make_k(cfg, mask, None, sinks, bq, bk), one_list=True)
    extra, extra_specs = _extras(K, mask, None, sinks, seed, (Tp, Tkp), n_heads=Hq)
    sched, sched_specs = (([], []) if table is None
                          else ([table], [_sched_spec(table, Hq, heavy_first=True)]))
    rows_spec, out_spec = _rows_spec(Tp, Hq), _seq_spec(Tp, Dp, Hq, lambda h: h)
    stages = 2 if _smem_estimate("fwd", bq, bk, 2, Dp, Dp, q.dtype.itemsize, 0) <= SMEM_BUDGET \
        else 1
    first = 4 + len(sched) + len(extra)  # the aliased inputs follow the others
    return _varying.pallas_call(
        functools.partial(_fwd_kernel, K=K, sched=table is not None, redo=True),
        grid=(Tp // bq, d.batch * Hq),
        in_specs=[out_spec, _seq_spec(Tkp, Dp, Hq, lambda h: h // G),
                  _seq_spec(Tkp, Dp, Hq, lambda h: h // G), rows_spec]
        + sched_specs + extra_specs + [out_spec, rows_spec, rows_spec],
        out_specs=[out_spec, rows_spec, rows_spec],
        out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype),
                   jax.ShapeDtypeStruct(m.shape, F32), jax.ShapeDtypeStruct(m.shape, F32)],
        input_output_aliases={first: 0, first + 1: 1, first + 2: 2},
        compiler_params=plgpu.CompilerParams(num_warps=8 if bq >= 128 else 4,
                                             num_stages=stages),
        interpret=interpret, name="fnattn_flash_fwd_redo",
    )(_pad_bthd(q, Tp, Dp), _pad_bthd(k, Tkp, Dp), _pad_bthd(v, Tkp, Dp), flags, *sched,
      *extra, out, m, l)


def _heads_per_dkdv_program(d, n_kv_blocks):
    """The largest divisor Gp of the GQA group that leaves enough programs."""
    for Gp in sorted((g for g in range(1, d.group + 1) if d.group % g == 0), reverse=True):
        batch = _checks.static_or(d.batch, 1)  # (symbolic under jax.export: assume 1)
        if batch * d.num_kv_heads * (d.group // Gp) * n_kv_blocks >= MIN_DKDV_PROGRAMS:
            return Gp
    return 1


def _backward(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse, *, interpret):
    d = cfg.dims
    _refuse(cfg, interpret)
    B, Hq, Hkv, G = d.batch, d.num_q_heads, d.num_kv_heads, d.group
    # delta folds in the lse cotangent: dS = P * (dP - (rowsum(dO * O) - d_lse)).
    delta = online.delta_rows(out, d_out, d_lse)
    # The per-row statistics the kernels recompute P from (`_row_names`): +inf
    # where lse is not finite (rows that saw nothing, an infinite sink) and on
    # padding rows, so that P = 0 there.
    natural = (bias is not None or position_bias.present(mask)) and cfg.softcap is None
    rows = online.backward_rows(lse, lse_lo, delta, natural=natural,  # (K.large, K.split)
                                split=not natural and cfg.softcap is None)

    def pad_rows(T):
        return [_pad(x, 2, T, jnp.inf if n == 0 else 0.0) for n, x in enumerate(rows)]

    # dq and dbias.
    tile_bytes = _tile_bytes(bias, mask)
    bq, bk, params = _blocks_for(cfg, q.dtype, "dq", tile_bytes)
    Tqp, Tkp, Dp, Dvp = _dims_padded(cfg, bq, bk)
    term_ops = position_bias.kernel_grad_operands(cfg.term_grad, mask, "Pallas Triton")
    K = _make_k(cfg, mask, bias, None, bq, bk, term_grad=term_ops)
    table = _schedule(mask, cfg, K)
    extra, extra_specs = _extras(K, mask, bias, None, seed, (Tqp, Tkp), n_heads=Hq)
    sched, sched_specs = ([], []) if table is None else ([table], [_sched_spec(table, Hq, heavy_first=True)])
    out_specs = [_seq_spec(Tqp, Dp, Hq, lambda h: h)]
    out_shape = [jax.ShapeDtypeStruct((B, Tqp, Hq, Dp), q.dtype)]
    # the term's gradients: one partial sum per program, (q-blocks, B*Hq, 1)
    term_specs = [pl.BlockSpec((None, None, 1), lambda r, bh: (r, bh, 0))] * len(term_ops)
    term_shapes = [jax.ShapeDtypeStruct((Tqp // bq, B * Hq, 1), F32)] * len(term_ops)
    aliases = {}
    if bias is not None:
        # dbias in the bias's broadcast shape, float32, starting from zeros.
        b4 = _pad_seq(_bias4(bias), (Tqp, Tkp)).shape
        aliases = {4 + len(rows) + len(sched) + len(extra): 1}
        # (typed to vary like the inputs inside shard_map: the output aliases it)
        zeros = _varying.varying_like(jnp.zeros(b4, F32), q, k, v, bias, d_out)
        extra, extra_specs = extra + [zeros], extra_specs + [_bh_spec(b4, Hq, None)]
        out_specs.append(_bh_spec(b4, Hq, None))
        out_shape.append(jax.ShapeDtypeStruct(b4, F32))
    out_specs, out_shape = out_specs + term_specs, out_shape + term_shapes
    res = _varying.pallas_call(
        functools.partial(_dq_kernel, K=K, sched=table is not None),
        grid=(Tqp // bq, B * Hq),
        in_specs=[_seq_spec(Tqp, Dp, Hq, lambda h: h), _seq_spec(Tkp, Dp, Hq, lambda h: h // G),
                  _seq_spec(Tkp, Dvp, Hq, lambda h: h // G), _seq_spec(Tqp, Dvp, Hq, lambda h: h)]
        + [_rows_spec(Tqp, Hq)] * len(rows) + sched_specs + extra_specs,
        out_specs=out_specs, out_shape=out_shape, compiler_params=params,
        input_output_aliases=aliases, interpret=interpret, name="fnattn_flash_dq",
    )(_pad_bthd(q, Tqp, Dp), _pad_bthd(k, Tkp, Dp), _pad_bthd(v, Tkp, Dvp),
      _pad_bthd(d_out, Tqp, Dvp), *pad_rows(Tqp), *sched, *extra)
    dq = res[0][:, :d.q_len, :, :d.head_dim]
    dbias = None
    if bias is not None:
        dbias = res[1][:, :, :min(res[1].shape[2], d.q_len), :min(res[1].shape[3], d.kv_len)]
        dbias = dbias.reshape(bias.shape).astype(bias.dtype)
    # the term's gradients per (batch row, head): the sum of the programs' partials
    term_sums = [g.sum(0).reshape(B, Hq) for g in res[len(res) - len(term_ops):]]

    # dk, dv: programs over (kv-block, batch x group of Gp query heads).
    bq, bk, params = _blocks_for(cfg, q.dtype, "dkdv", tile_bytes)
    Tqp, Tkp, Dp, Dvp = _dims_padded(cfg, bq, bk)
    Gp = _heads_per_dkdv_program(d, Tkp // bk)
    P = Hq // Gp  # programs per batch row
    K = _make_k(cfg, mask, bias, None, bq, bk, dkdv=True, Gp=Gp)
    table = _schedule(mask, cfg, K, transpose=True, heads_per_row=Gp)
    extra, extra_specs = _extras(K, mask, bias, None, seed, (Tqp, Tkp), transpose=True,
                                 n_heads=P, heads_per_prog=Gp)
    sched, sched_specs = ([], []) if table is None else ([table], [_sched_spec(table, P, heavy_first=False)])
    direct = Gp == G  # one program per kv head: write dk, dv directly
    out_dtype = (k.dtype, v.dtype) if direct else (F32, F32)
    dk, dv = _varying.pallas_call(
        functools.partial(_dkdv_kernel, K=K, sched=table is not None),
        grid=(Tkp // bk, B * P),
        in_specs=[_seq_spec(Tqp, Dp, P, lambda p: p, Gp),
                  _seq_spec(Tkp, Dp, P, lambda p: p // (P // Hkv)),
                  _seq_spec(Tkp, Dvp, P, lambda p: p // (P // Hkv)),
                  _seq_spec(Tqp, Dvp, P, lambda p: p, Gp)]
        + [_rows_spec(Tqp, P, Gp)] * len(rows) + sched_specs + extra_specs,
        out_specs=[_seq_spec(Tkp, Dp, P, lambda p: p), _seq_spec(Tkp, Dvp, P, lambda p: p)],
        out_shape=[jax.ShapeDtypeStruct((B, Tkp, P, Dp), out_dtype[0]),
                   jax.ShapeDtypeStruct((B, Tkp, P, Dvp), out_dtype[1])],
        compiler_params=params, interpret=interpret, name="fnattn_flash_dkdv",
    )(_pad_bthd(q, Tqp, Dp), _pad_bthd(k, Tkp, Dp), _pad_bthd(v, Tkp, Dvp),
      _pad_bthd(d_out, Tqp, Dvp), *pad_rows(Tqp), *sched, *extra)

    def finish(x, D, dtype):
        x = x[:, :d.kv_len, :, :D]
        if not direct:
            x = x.reshape(B, d.kv_len, Hkv, P // Hkv, D).sum(3)
        return x.astype(dtype)

    dsinks = None
    if sinks is not None:
        dsinks = online.sink_grad(sinks, lse, lse_lo, delta).astype(sinks.dtype)
    return (dq.astype(q.dtype), finish(dk, d.head_dim, k.dtype),
            finish(dv, d.v_head_dim, v.dtype), dbias, dsinks,
            *position_bias.kernel_leaf_grads(mask, cfg.term_grad, term_ops, term_sums))


LOWERING = Lowering("flash-triton", functools.partial(_forward, interpret=False),
                    functools.partial(_backward, interpret=False))
INTERPRET_LOWERING = Lowering("flash-triton-interpret",
                              functools.partial(_forward, interpret=True),
                              functools.partial(_backward, interpret=True))
