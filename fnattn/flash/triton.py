"""The Pallas Triton lowering of flash attention (NVIDIA GPUs).

Three kernels, each a plain function below:

* ``_fwd_kernel``   grid (q-blocks, B*Hq): online softmax over the scheduled kv-blocks.
* ``_dq_kernel``    grid (q-blocks, B*Hq): recomputes P from ``lse``; dq (and dbias).
* ``_dkdv_kernel``  grid (kv-blocks, B*Hq): loops over the q-blocks that see the
  kv-block (the transposed schedule); dk and dv per query head, summed over the
  GQA group afterwards.

Every array is passed whole along the sequence axes (only batch and head are
selected by the BlockSpec) and tiles are sliced with ``pl.ds`` inside the
kernels; the wrapper pads sequence lengths to whole blocks and head dims to
powers of two, so no load is out of bounds. The block-sparse schedule (which
kv-blocks to visit, and which of them need the mask) is an ordinary int32 input:
Triton has no scalar prefetch. Masks are evaluated through the mask protocol on
tiles of their operands, only on PARTIAL tiles; dropout regenerates the keep
mask from the seed with :func:`fnattn.dropout.keep_mask`.
"""

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnattn import dropout, masks
from fnattn._dispatch import Lowering
from fnattn.flash import blocks

__all__ = ["TritonBlockSizes", "LOWERING", "INTERPRET_LOWERING"]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _pow2(n):
    return 1 << max(0, int(n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class TritonBlockSizes:
    """Tile sizes and launch parameters of the Triton flash kernels.

    All block sizes must be powers of two (a Triton rule).

    >>> TritonBlockSizes(block_q=64, block_k=32).block_q_bwd
    64
    """

    block_q: int = 128
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0 or v & (v - 1):
                raise ValueError(f"TritonBlockSizes: {name} must be a positive power of two; "
                                 f"got {v!r}")
        for name in ("num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"TritonBlockSizes: {name} must be a positive int; got {v!r}")

    @classmethod
    def default(cls, dims, dtype) -> "TritonBlockSizes":
        d = _pow2(max(dims.head_dim, dims.v_head_dim))
        # Measured on an H100 (benchmarks/results/flash_gpu_*.md).
        if d <= 64:
            return cls(128, 64, 64, 64, 4, 3, 4, 2)
        if d <= 128:
            return cls(128, 128, 64, 64, 8, 3, 4, 2)
        return cls(64, 64, 32, 32, 8, 2, 4, 1)


@dataclasses.dataclass(frozen=True)
class _K:
    """Static facts shared by the kernels."""

    B: int
    Hq: int
    G: int
    Tq: int
    Tk: int
    bq: int
    bk: int
    scale: float
    softcap: Optional[float]
    rate: float
    has_bias: bool
    has_sinks: bool
    mask_treedef: object
    op_shapes: tuple  # per operand: (b varies, h varies, q varies, k varies)
    bias_shape: tuple


def _ds_tile(ref, varies_q, varies_k, i, j, bq, bk):
    qi = pl.ds(pl.multiple_of(i * bq, bq), bq) if varies_q else slice(None)
    kj = pl.ds(pl.multiple_of(j * bk, bk), bk) if varies_k else slice(None)
    return ref[qi, kj]


def _logits(q, k, bias_t, K: _K):
    """Logits of a tile in base 2 (``s * log2(e)``, f32), and tanh(s/c) when capped.

    Without bias and soft-cap the log2(e) factor folds into the scale, saving a
    pass over the tile.
    """
    if bias_t is None and K.softcap is None:
        return jnp.dot(q, k.T, preferred_element_type=jnp.float32) * (K.scale * LOG2E), None
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * K.scale
    if bias_t is not None:
        s = s + bias_t.astype(jnp.float32)
    th = None
    if K.softcap is not None:
        th = jnp.tanh(s / K.softcap)
        s = K.softcap * th
    return s * LOG2E, th


def _allowed(op_refs, b, h, i, j, K: _K):
    qi = i * K.bq + lax.broadcasted_iota(jnp.int32, (K.bq, 1), 0)
    kj = j * K.bk + lax.broadcasted_iota(jnp.int32, (1, K.bk), 1)
    ok = kj < K.Tk
    if K.mask_treedef is not None:
        tiles = tuple(_ds_tile(r, s[2], s[3], i, j, K.bq, K.bk)
                      for r, s in zip(op_refs, K.op_shapes))
        # Predicates read only the tiles; the leaves are placeholders (not None,
        # which would read as an absent optional array).
        mask = jax.tree_util.tree_unflatten(K.mask_treedef, [0] * K.mask_treedef.num_leaves)
        pos = masks.Positions(b=b, h=h, q=qi, q_pos=qi + (K.Tk - K.Tq), k=kj)
        ok = mask.predicate(pos, tiles).astype(jnp.bool_) & ok
    return ok


def _keep(seed_ref, b, h, i, j, K: _K):
    qi = i * K.bq + lax.broadcasted_iota(jnp.int32, (K.bq, 1), 0)
    kj = j * K.bk + lax.broadcasted_iota(jnp.int32, (1, K.bk), 1)
    seed = (seed_ref[0], seed_ref[1])
    return dropout.keep_mask(seed, b, h, qi, kj, K.rate)


def _masked(s, kind, op_refs, b, h, i, j, K: _K):
    def partial_tile(s):
        return jnp.where(_allowed(op_refs, b, h, i, j, K), s, -jnp.inf)
    return lax.cond(kind == masks.FULL, lambda s: s, partial_tile, s)


def _split_refs(refs, K: _K, n_in_fixed):
    it = iter(refs)
    fixed = [next(it) for _ in range(n_in_fixed)]
    bias_ref = next(it) if K.has_bias else None
    sinks_ref = next(it) if K.has_sinks else None
    seed_ref = next(it) if K.rate > 0 else None
    op_refs = [next(it) for _ in K.op_shapes]
    return fixed, bias_ref, sinks_ref, seed_ref, op_refs, list(it)


def _fwd_kernel(*refs, K: _K):
    (q_ref, k_ref, v_ref, idx_ref, kind_ref, cnt_ref), bias_ref, sinks_ref, seed_ref, op_refs, \
        (o_ref, lse_ref) = _split_refs(refs, K, 6)
    i, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // K.Hq, bh % K.Hq
    q = q_ref[pl.ds(pl.multiple_of(i * K.bq, K.bq), K.bq), :]

    def body(t, carry):
        acc, m, l = carry
        j = idx_ref[t]
        kslice = pl.ds(pl.multiple_of(j * K.bk, K.bk), K.bk)
        k = k_ref[kslice, :]
        bias_t = None
        if bias_ref is not None:
            bias_t = _ds_tile(bias_ref, K.bias_shape[2] > 1, K.bias_shape[3] > 1, i, j, K.bq, K.bk)
        s, _ = _logits(q, k, bias_t, K)
        s = _masked(s, kind_ref[t], op_refs, b, h, i, j, K)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - m_use[:, None])
        alpha = jnp.exp2(m - m_use)
        l = l * alpha + p.sum(axis=1)
        if seed_ref is not None:
            p = jnp.where(_keep(seed_ref, b, h, i, j, K), p * (1.0 / (1.0 - K.rate)), 0.0)
        v = v_ref[kslice, :]
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
        return acc, m_new, l

    acc = jnp.zeros((K.bq, v_ref.shape[-1]), jnp.float32)
    m = jnp.full((K.bq,), -jnp.inf, jnp.float32)
    l = jnp.zeros((K.bq,), jnp.float32)
    acc, m, l = lax.fori_loop(0, cnt_ref[0], body, (acc, m, l))
    if sinks_ref is not None:
        sink = sinks_ref[0] * LOG2E
        m_fin = jnp.maximum(m, sink)
        a = jnp.exp2(m - m_fin)
        l = l * a + jnp.exp2(sink - m_fin)
        acc = acc * a[:, None]
        m = m_fin
    safe = jnp.where(l > 0, l, 1.0)
    rows = pl.ds(pl.multiple_of(i * K.bq, K.bq), K.bq)
    o_ref[rows, :] = (acc / safe[:, None]).astype(o_ref.dtype)
    lse_ref[rows] = jnp.where(l > 0, (m + jnp.log2(safe)) * LN2, -jnp.inf)


def _recompute(q, k, do, v, lse2, delta, kind, bias_t, op_refs, seed_ref, b, h, i, j, K: _K):
    """p (undropped), the dropped p, and dS of one tile."""
    s, th = _logits(q, k, bias_t, K)
    s = _masked(s, kind, op_refs, b, h, i, j, K)
    p = jnp.exp2(s - lse2[:, None])
    dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
    pd = p
    if seed_ref is not None:
        keep = _keep(seed_ref, b, h, i, j, K)
        inv = 1.0 / (1.0 - K.rate)
        pd = jnp.where(keep, p * inv, 0.0)
        dp = jnp.where(keep, dp * inv, 0.0)
    ds = p * (dp - delta[:, None])
    if th is not None:
        ds = ds * (1.0 - th * th)
    return pd, ds


def _dq_kernel(*refs, K: _K):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, idx_ref, kind_ref, cnt_ref), bias_ref, \
        _, seed_ref, op_refs, outs = _split_refs(refs, K, 9)
    dq_ref = outs[0]
    dbias_ref = outs[1] if len(outs) > 1 else None
    i, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // K.Hq, bh % K.Hq
    rows = pl.ds(pl.multiple_of(i * K.bq, K.bq), K.bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    lse2, delta = lse_ref[rows] * LOG2E, delta_ref[rows]
    if dbias_ref is not None:
        zeros = jnp.zeros((K.bq, K.bk), dbias_ref.dtype)

        def clear(j, c):
            dbias_ref[rows, pl.ds(pl.multiple_of(j * K.bk, K.bk), K.bk)] = zeros
            return c
        lax.fori_loop(0, dbias_ref.shape[1] // K.bk, clear, 0)

    def body(t, dq):
        j = idx_ref[t]
        kslice = pl.ds(pl.multiple_of(j * K.bk, K.bk), K.bk)
        k, v = k_ref[kslice, :], v_ref[kslice, :]
        bias_t = None
        if bias_ref is not None:
            bias_t = _ds_tile(bias_ref, K.bias_shape[2] > 1, K.bias_shape[3] > 1, i, j, K.bq, K.bk)
        _, ds = _recompute(q, k, do, v, lse2, delta, kind_ref[t], bias_t, op_refs, seed_ref,
                           b, h, i, j, K)
        if dbias_ref is not None:
            dbias_ref[rows, kslice] = ds.astype(dbias_ref.dtype)
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(0, cnt_ref[0], body, jnp.zeros((K.bq, q_ref.shape[-1]), jnp.float32))
    dq_ref[rows, :] = (dq * K.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, K: _K):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, idx_ref, kind_ref, cnt_ref), bias_ref, \
        _, seed_ref, op_refs, (dk_ref, dv_ref) = _split_refs(refs, K, 9)
    j, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // K.Hq, bh % K.Hq
    kslice = pl.ds(pl.multiple_of(j * K.bk, K.bk), K.bk)
    k, v = k_ref[kslice, :], v_ref[kslice, :]

    def body(t, carry):
        dk, dv = carry
        i = idx_ref[t]
        rows = pl.ds(pl.multiple_of(i * K.bq, K.bq), K.bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        bias_t = None
        if bias_ref is not None:
            bias_t = _ds_tile(bias_ref, K.bias_shape[2] > 1, K.bias_shape[3] > 1, i, j, K.bq, K.bk)
        pd, ds = _recompute(q, k, do, v, lse_ref[rows] * LOG2E, delta_ref[rows], kind_ref[t],
                            bias_t, op_refs, seed_ref, b, h, i, j, K)
        dv = dv + jnp.dot(pd.astype(do.dtype).T, do, preferred_element_type=jnp.float32)
        dk = dk + jnp.dot(ds.astype(q.dtype).T, q, preferred_element_type=jnp.float32)
        return dk, dv

    dk, dv = lax.fori_loop(0, cnt_ref[0], body,
                           (jnp.zeros((K.bk, k_ref.shape[-1]), jnp.float32),
                            jnp.zeros((K.bk, v_ref.shape[-1]), jnp.float32)))
    dk_ref[kslice, :] = (dk * K.scale).astype(dk_ref.dtype)
    dv_ref[kslice, :] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------


def _pad(x, axis, size):
    if x.shape[axis] == size:
        return x
    w = [(0, 0)] * x.ndim
    w[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, w)


@dataclasses.dataclass(frozen=True)
class _Setup:
    K: _K
    Tqp: int
    Tkp: int
    Dp: int
    Dvp: int
    nq: int
    nk: int
    bs: TritonBlockSizes


def _setup(cfg, mask, bias, sinks, dtype, backward):
    d = cfg.dims
    bs = blocks.pick(cfg.block_sizes, TritonBlockSizes, TritonBlockSizes.default(d, dtype))
    bq, bk = (bs.block_q_bwd, bs.block_k_bwd) if backward else (bs.block_q, bs.block_k)
    bq, bk = min(bq, max(16, _pow2(d.q_len))), min(bk, max(16, _pow2(d.kv_len)))
    nq, nk = -(-d.q_len // bq), -(-d.kv_len // bk)
    ops = () if mask is None else mask.operands()
    leaves, treedef = jax.tree_util.tree_flatten(mask)
    K = _K(B=d.batch, Hq=d.num_q_heads, G=d.group, Tq=d.q_len, Tk=d.kv_len, bq=bq, bk=bk,
           scale=cfg.scale, softcap=cfg.softcap, rate=cfg.dropout_rate,
           has_bias=bias is not None, has_sinks=sinks is not None,
           mask_treedef=None if mask is None else treedef,
           op_shapes=tuple(tuple(n > 1 for n in op.shape) for op in ops),
           bias_shape=() if bias is None else
           tuple((1,) * (4 - bias.ndim) + tuple(bias.shape)))
    return _Setup(K, nq * bq, nk * bk, _pow2(max(d.head_dim, 16)), _pow2(max(d.v_head_dim, 16)),
                  nq, nk, bs)


def _bh_spec(shape4, S: _Setup, kind):
    """BlockSpec selecting (b, h) of a 4-D (B|1, H|1, Tq|1, Tk|1) array, whole along T."""
    K = S.K
    vb, vh = shape4[0] > 1, shape4[1] > 1
    block = (None, None, shape4[2], shape4[3])

    def index(a, bh):
        return (bh // K.Hq if vb else 0, bh % K.Hq if vh else 0, 0, 0)
    return pl.BlockSpec(block, index)


def _extra_inputs(S: _Setup, mask, bias, sinks, seed):
    """Inputs and BlockSpecs for bias, sinks, seed and mask operands (in kernel order)."""
    K = S.K
    arrays, specs = [], []
    if bias is not None:
        b4 = jnp.reshape(bias, K.bias_shape).astype(jnp.float32)
        b4 = _pad(b4, 2, S.Tqp) if b4.shape[2] > 1 else b4
        b4 = _pad(b4, 3, S.Tkp) if b4.shape[3] > 1 else b4
        arrays.append(b4)
        specs.append(_bh_spec(b4.shape, S, "bias"))
    if sinks is not None:
        arrays.append(sinks.astype(jnp.float32).reshape(K.Hq, 1))
        specs.append(pl.BlockSpec((None, 1), lambda a, bh: (bh % K.Hq, 0)))
    if K.rate > 0:
        arrays.append(seed.astype(jnp.uint32))
        specs.append(pl.BlockSpec((2,), lambda a, bh: (0,)))
    if mask is not None:
        for op in mask.operands():
            if op.dtype == jnp.bool_:
                op = op.astype(jnp.int8)
            op = _pad(op, 2, S.Tqp) if op.shape[2] > 1 else op
            op = _pad(op, 3, S.Tkp) if op.shape[3] > 1 else op
            arrays.append(op)
            specs.append(_bh_spec(op.shape, S, "op"))
    return arrays, specs


def _sched_inputs(mask, S: _Setup, transpose):
    K = S.K
    cls = masks.block_classes(mask, K.B, K.Hq, K.Tq, K.Tk, K.bq, K.bk)
    nonempty = jnp.any(cls != masks.EMPTY, axis=(0, 1))
    full = jnp.all(cls == masks.FULL, axis=(0, 1))
    union = (nonempty | full).astype(jnp.int8) + full.astype(jnp.int8)
    sched = blocks.schedule(union, transpose=transpose)
    n = sched.index.shape[-1]
    width = _pow2(n)
    idx = _pad(sched.index, 1, width)
    kind = _pad(sched.kind.astype(jnp.int32), 1, width)
    cnt = sched.count.reshape(-1, 1)
    specs = [pl.BlockSpec((None, width), lambda a, bh: (a, 0)),
             pl.BlockSpec((None, width), lambda a, bh: (a, 0)),
             pl.BlockSpec((None, 1), lambda a, bh: (a, 0))]
    return [idx, kind, cnt], specs


def _seq_spec(T, D, K: _K, kv=False):
    """BlockSpec of a (B, T, H, D) array: whole along T for one batch row and head."""
    if kv:
        return pl.BlockSpec((None, T, None, D), lambda a, bh: (bh // K.Hq, 0, (bh % K.Hq) // K.G, 0))
    return pl.BlockSpec((None, T, None, D), lambda a, bh: (bh // K.Hq, 0, bh % K.Hq, 0))


def _rows_spec(T, K: _K):
    return pl.BlockSpec((None, None, T), lambda a, bh: (bh // K.Hq, bh % K.Hq, 0))


def _pad_qkv(q, k, v, S: _Setup):
    q = _pad(_pad(q, 1, S.Tqp), 3, S.Dp)
    k = _pad(_pad(k, 1, S.Tkp), 3, S.Dp)
    v = _pad(_pad(v, 1, S.Tkp), 3, S.Dvp)
    return q, k, v


def _params(S: _Setup, backward):
    bs = S.bs
    return plgpu.CompilerParams(
        num_warps=bs.num_warps_bwd if backward else bs.num_warps,
        num_stages=bs.num_stages_bwd if backward else bs.num_stages)


def _forward(cfg, q, k, v, bias, sinks, mask, seed, *, interpret):
    S = _setup(cfg, mask, bias, sinks, q.dtype, backward=False)
    K = S.K
    d = cfg.dims
    qp, kp, vp = _pad_qkv(q, k, v, S)
    sched, sched_specs = _sched_inputs(mask, S, transpose=False)
    extra, extra_specs = _extra_inputs(S, mask, bias, sinks, seed)
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, K=K),
        grid=(S.nq, K.B * K.Hq),
        in_specs=[_seq_spec(S.Tqp, S.Dp, K), _seq_spec(S.Tkp, S.Dp, K, kv=True),
                  _seq_spec(S.Tkp, S.Dvp, K, kv=True)] + sched_specs + extra_specs,
        out_specs=[_seq_spec(S.Tqp, S.Dvp, K), _rows_spec(S.Tqp, K)],
        out_shape=[jax.ShapeDtypeStruct((K.B, S.Tqp, K.Hq, S.Dvp), q.dtype),
                   jax.ShapeDtypeStruct((K.B, K.Hq, S.Tqp), jnp.float32)],
        compiler_params=_params(S, False),
        interpret=interpret,
        name="fnattn_flash_fwd",
    )(qp, kp, vp, *sched, *extra)
    return out[:, :d.q_len, :, :d.v_head_dim], lse[:, :, :d.q_len]


def _backward(cfg, q, k, v, bias, sinks, mask, seed, out, lse, d_out, d_lse, *, interpret):
    S = _setup(cfg, mask, bias, sinks, q.dtype, backward=True)
    K = S.K
    d = cfg.dims
    f32 = jnp.float32
    delta = jnp.einsum("bthd,bthd->bht", out.astype(f32), d_out.astype(f32)) - d_lse.astype(f32)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)
    qp, kp, vp = _pad_qkv(q, k, v, S)
    dop = _pad(_pad(d_out, 1, S.Tqp), 3, S.Dvp)
    lse_p = _pad(lse_safe, 2, S.Tqp)
    delta_p = _pad(delta, 2, S.Tqp)
    extra, extra_specs = _extra_inputs(S, mask, bias, sinks, seed)
    common = [qp, kp, vp, dop, lse_p, delta_p]
    common_specs = [_seq_spec(S.Tqp, S.Dp, K), _seq_spec(S.Tkp, S.Dp, K, kv=True),
                    _seq_spec(S.Tkp, S.Dvp, K, kv=True), _seq_spec(S.Tqp, S.Dvp, K),
                    _rows_spec(S.Tqp, K), _rows_spec(S.Tqp, K)]

    sched, sched_specs = _sched_inputs(mask, S, transpose=False)
    out_specs = [_seq_spec(S.Tqp, S.Dp, K)]
    out_shape = [jax.ShapeDtypeStruct((K.B, S.Tqp, K.Hq, S.Dp), q.dtype)]
    if bias is not None:
        out_specs.append(pl.BlockSpec((None, None, S.Tqp, S.Tkp), lambda a, bh: (
            bh // K.Hq, bh % K.Hq, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((K.B, K.Hq, S.Tqp, S.Tkp), f32))
    res = pl.pallas_call(
        functools.partial(_dq_kernel, K=K), grid=(S.nq, K.B * K.Hq),
        in_specs=common_specs + sched_specs + extra_specs, out_specs=out_specs,
        out_shape=out_shape, compiler_params=_params(S, True), interpret=interpret,
        name="fnattn_flash_dq",
    )(*common, *sched, *extra)
    dq = res[0][:, :d.q_len, :, :d.head_dim]
    dbias = None
    if bias is not None:
        full = res[1][:, :, :d.q_len, :d.kv_len]
        shape4 = K.bias_shape
        axes = tuple(a for a in range(4) if shape4[a] == 1 and full.shape[a] != 1)
        dbias = full.sum(axes, keepdims=True).reshape(bias.shape).astype(bias.dtype)

    sched_t, sched_t_specs = _sched_inputs(mask, S, transpose=True)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, K=K), grid=(S.nk, K.B * K.Hq),
        in_specs=common_specs + sched_t_specs + extra_specs,
        out_specs=[_seq_spec(S.Tkp, S.Dp, K), _seq_spec(S.Tkp, S.Dvp, K)],
        out_shape=[jax.ShapeDtypeStruct((K.B, S.Tkp, K.Hq, S.Dp), f32),
                   jax.ShapeDtypeStruct((K.B, S.Tkp, K.Hq, S.Dvp), f32)],
        compiler_params=_params(S, True), interpret=interpret, name="fnattn_flash_dkdv",
    )(*common, *sched_t, *extra)
    Hkv = d.num_kv_heads

    def group_sum(x, D):
        x = x[:, :d.kv_len, :, :D].reshape(K.B, d.kv_len, Hkv, K.G, D)
        return x.sum(3)

    dk = group_sum(dk, d.head_dim).astype(k.dtype)
    dv = group_sum(dv, d.v_head_dim).astype(v.dtype)
    dsinks = None
    if sinks is not None:
        p_sink = jnp.exp(sinks.astype(f32)[None, :, None] - lse_safe)
        dsinks = -(p_sink * delta).sum((0, 2)).astype(sinks.dtype)
    return dq.astype(q.dtype), dk, dv, dbias, dsinks


LOWERING = Lowering("flash-triton", functools.partial(_forward, interpret=False),
                    functools.partial(_backward, interpret=False))
INTERPRET_LOWERING = Lowering("flash-triton-interpret", functools.partial(_forward, interpret=True),
                              functools.partial(_backward, interpret=True))
