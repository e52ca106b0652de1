"""The Pallas Mosaic lowering of :func:`fnattn.decode` (TPU).

One kernel, grid ``(B, Hkv / hb, splits, key blocks)``, the last axis
sequential. The caches are viewed, for free, as ``(B, S, Hkv * D)``: the keys
of ``hb`` consecutive kv heads in slots ``[j * block_k, (j + 1) * block_k)``
are then the block ``(j, h // hb)`` of shape ``(block_k, hb * D)``, a legal TPU
block when ``hb * D`` is a multiple of 128 or the whole last axis.
:func:`heads_per_program` picks the smallest such ``hb``: one head for D = 128
or 256, two for D = 64, all of them for head dims like 80 or 96. Pallas's
pipeline copies block ``i + 1`` while the kernel computes on block ``i``; the
block index comes from a scalar-prefetched table of each sequence's key-block
range ``[lo, hi)`` (slot-aligned; from the sequence's slots and the mask's
``tile_bounds``, see :func:`fnattn.decoding.common.block_ranges`). Steps past
the end of a split's range repeat its last block index, which the pipeline does
not copy again, and skip the computation: only the blocks a sequence may see
are read, each once per (sequence, group of hb kv heads).

With ``hb > 1`` no lane slicing is needed: head ``hh``'s queries are placed in
its own columns of a ``(rows, hb * D)`` tile (zeros elsewhere, built by the
wrapper), so one product with the block gives that head's logits; its
``p @ v`` covers the block's ``hb * Dv`` columns, and the wrapper keeps the
head's own. That costs ``hb`` times the MXU work of one head, which decode (a
stream over the cache) has to spare.

A program holds the ``Tq`` tokens x the GQA group's heads (padded to a power of
two ``Gp``, so that a row's token and head are a shift and a mask) as the rows
of one tile per kv head. The running max and sum live in lane-replicated
``(rows, 128)`` VMEM scratch, the output accumulator in float32; ``lse`` leaves
the kernel lane-replicated as ``(rows, 128)``. Slots outside the sequence's
range (and past S in a ragged last block) are masked, and their values zeroed
before the product: they may hold anything, NaN included.

**Split-K** (only when ``DecodeBlockSizes(num_splits=...)`` asks: a TPU has one
or two cores per chip, which the (B, Hkv / hb) grid axes already fill): float32
partial results merged afterwards by :func:`fnattn.merging.merge_stacked`, the
sinks joined there once; with one split the kernel applies the sinks itself.

**Quantized and latent caches** (:mod:`fnattn.quant`; ``value_dim``). The
kernel reads the codes' blocks (a ``(bk, hb * D)`` block of an 8-bit cache, a
``(bk, hb * D / 2)`` one of the 4-bit format) and dequantizes them in VMEM to
q's dtype: times the per-tensor scales (two float32 scalars in SMEM), or times
per-token scales, whose ``(bk, Hkv)`` block (the whole last axis: always a
legal block) comes with each code block and gives each head's column. The
4-bit bytes become two *planes* of ``D / 2`` columns (their low and high
nibbles, i.e. each head's first and second half of channels): q is split the
same way in the wrapper, the logits are the sum of the two planes' products
and the output has one accumulator per plane, put side by side by the
wrapper. A latent cache has no V operand: the values are the key block (all
its columns accumulated, the first ``value_dim`` kept). On a TPU an 8-bit
block wants ``block_k`` a multiple of 32 (the default, 512, is).

**Dtypes.** float32 and bfloat16 run as they are; float16 caches are converted
to float32 first (TPUs have no float16 arithmetic; the conversion copies the
cache, so ``impl="auto"`` reads float16 with the XLA lowering instead); float64
is refused (:func:`unsupported`): ``impl="auto"`` runs it with the XLA
lowering, ``impl="pallas"`` raises ``NotImplementedError``. So are symbolic
sizes (``jax.export``): the scalar-prefetched metadata must have a static shape.
"""

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fnattn import _checks, _dequant, _functions
from fnattn import _online as online
from fnattn import _varying, cost, masks, quant
from fnattn.decoding import common, xla
from fnattn.decoding.common import F32, I32
from fnattn.merging import merge_stacked

__all__ = ["KERNEL_NAME", "auto_forward", "forward", "forward_interpret", "heads_per_program",
           "unsupported"]

KERNEL_NAME = "fnattn_decode_mosaic"
LANES = 128
SUBLANES = 8
NT = (((1,), (1,)), ((), ()))  # a @ b.T
DEFAULT_BLOCK_K = 512          # 128 KiB of bf16 keys at D=128 per buffer
NUM_META = 4                   # start, length, lo, hi per sequence


@dataclasses.dataclass(frozen=True)
class _K(common.KernelFacts):
    Tq: int
    G: int
    Gp: int
    M: int
    hb: int          # kv heads per program
    bk: int
    nb: int          # grid steps per split
    splits: int
    scale: float
    softcap: Optional[float]
    mask_treedef: Any
    sinks: bool
    term_treedef: Any = None   # a position term, or None
    n_terms: int = 0           # its arrays: (n, B, Hq) flat in SMEM
    B: int = 0
    Hq: int = 0
    k_fmt: Any = None          # a quantized cache's QuantFormat (None: float)
    v_fmt: Any = None
    latent: bool = False       # no v: the values are the key tiles (first Dv columns kept)
    dtype: Any = None          # the products' dtype (the dequantized tiles')

    @property
    def k_planes(self) -> int:
        """Column planes of a key tile: 2 for the 4-bit format (its low and
        high nibbles, the first and second half of each head's channels)."""
        return 1 if self.k_fmt is None else self.k_fmt.per_byte

    @property
    def v_planes(self) -> int:
        if self.latent:
            return self.k_planes
        return 1 if self.v_fmt is None else self.v_fmt.per_byte

    @property
    def tensor_scales(self) -> bool:
        return self.k_fmt is not None or self.v_fmt is not None


def heads_per_program(num_kv_heads: int, head_dim: int, v_head_dim: int) -> int:
    """The fewest kv heads whose columns of the (B, S, Hkv * D) caches make a legal
    TPU block: a multiple of 128 lanes, or all of them.

    >>> heads_per_program(8, 128, 128), heads_per_program(8, 64, 64), heads_per_program(4, 80, 80)
    (1, 2, 4)
    """
    for hb in range(1, num_kv_heads):
        if num_kv_heads % hb == 0 and (hb * head_dim) % LANES == 0 \
                and (hb * v_head_dim) % LANES == 0:
            return hb
    return num_kv_heads


def _block_range(meta_ref, b, sp, K: _K):
    lo, hi = meta_ref[b * NUM_META + 2], meta_ref[b * NUM_META + 3]
    return common.split_range(lo, hi, sp, K.splits)


def _kv_index(b, hg, sp, i, meta_ref, *, K: _K):
    first, end = _block_range(meta_ref, b, sp, K)
    # Past the range: the last block again (not copied twice); an empty split
    # points at a block of its own range's start (never computed on).
    return b, jnp.maximum(jnp.minimum(first + i, end - 1), 0), hg


def _tile(ref, fmt, scale_ref, ts_ref, which, hg, K: _K):
    """A block of a cache as its column planes (one; two for the 4-bit format),
    dequantized right after the load: codes times the per-tensor scale or, per
    token, the column of head ``hg * hb + hh``'s scales (from the block's
    (bk, Hkv) scale tile) in head hh's columns."""
    x = ref[...]
    if fmt is None:
        return [x]
    if fmt.per_byte == 2:
        byte = x.astype(I32)
        planes = [_dequant.codes_f32(fmt, byte, False), _dequant.codes_f32(fmt, byte, True)]
    else:
        planes = [x.astype(F32)]
    if fmt.per_token:
        tile = scale_ref[...]                                   # (bk, Hkv) float32
        lane = lax.broadcasted_iota(I32, tile.shape, 1)
        width = planes[0].shape[1] // K.hb
        col_head = lax.broadcasted_iota(I32, planes[0].shape, 1) // width
        scale = jnp.zeros(planes[0].shape, F32)
        for hh in range(K.hb):
            col = jnp.sum(jnp.where(lane == hg * K.hb + hh, tile, 0.0), axis=1, keepdims=True)
            scale = col if K.hb == 1 else jnp.where(col_head == hh, col, scale)
    else:
        scale = ts_ref[which]
    return [(p * scale).astype(K.dtype) for p in planes]


def _kernel(meta_ref, q_ref, k_ref, *refs, K: _K):
    it = iter(refs)
    v_ref = None if K.latent else next(it)
    ts_ref = next(it) if K.tensor_scales else None
    ks_ref = next(it) if K.k_fmt is not None and K.k_fmt.per_token else None
    vs_ref = next(it) if K.v_fmt is not None and K.v_fmt.per_token else None
    sinks_ref = next(it) if K.sinks else None
    terms_ref = next(it) if K.n_terms else None
    o_ref, lse_ref, m_scr, l_scr, acc_scr = refs[-5:]
    b, hg, sp, i = (pl.program_id(a) for a in range(4))
    start, length = meta_ref[b * NUM_META], meta_ref[b * NUM_META + 1]
    first, end = _block_range(meta_ref, b, sp, K)
    j = first + i
    shift = K.Gp.bit_length() - 1
    mask, term = K.mask(), K.term()

    @pl.when(i == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, F32)
        l_scr[...] = jnp.zeros(l_scr.shape, F32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, F32)

    @pl.when(j < end)
    def _step():
        ks = _tile(k_ref, K.k_fmt, ks_ref, ts_ref, 0, hg, K)
        vs = ks if K.latent else _tile(v_ref, K.v_fmt, vs_ref, ts_ref, 1, hg, K)
        vpos = j * K.bk + lax.broadcasted_iota(I32, vs[0].shape, 0) - start
        live = (vpos >= 0) & (vpos < length)
        vs = [jnp.where(live, v, jnp.zeros_like(v)) for v in vs]
        # Non-finite keys: zeroed, and their logits NaN before the masking (the rule
        # of fnattn._online.finite_keys). Needed where a NaN could reach a row
        # that may not see its key: keys the mask hides from some rows (K or V), and
        # with hb > 1 the other heads' columns of K, which every head's product reads.
        fk = fv = None
        if mask is not None or K.hb > 1:
            fk = [jnp.isfinite(k.astype(F32)) for k in ks]  # (TPUs test finiteness in f32)
            ks = [jnp.where(f, k, jnp.zeros_like(k)) for f, k in zip(fk, ks)]
        if mask is not None:
            fv = [jnp.isfinite(v.astype(F32)) for v in vs]
            vs = [jnp.where(f, v, jnp.zeros_like(v)) for f, v in zip(fv, vs)]
        shape = (K.M, K.bk)
        kpos = j * K.bk + lax.broadcasted_iota(I32, shape, 1) - start
        in_range = (kpos >= 0) & (kpos < length)
        r_i = lax.broadcasted_iota(I32, shape, 0)
        t_i = lax.shift_right_logical(r_i, jnp.int32(shift))
        g_i = r_i & (K.Gp - 1)
        for hh in range(K.hb):
            # q_ref[hh] is zero outside head hh's columns: its product with the
            # block of hb heads is head hh's logits.
            s = sum(lax.dot_general(q_ref[hh, c], ks[c], NT, preferred_element_type=F32)
                    for c in range(K.k_planes)) * K.scale
            h = hg * K.hb + hh
            pos = masks.Positions(b=b, h=h * K.G + g_i, q=t_i, q_pos=length - K.Tq + t_i,
                                  k=kpos)
            if term is not None:   # added before the cap: its arrays, one value per row
                cols = [online.group_sink_column(terms_ref, (n * K.B + b) * (K.Hq // K.G) + h,
                                                 K.G, K.Gp, K.M) for n in range(K.n_terms)]
                s = s + jnp.broadcast_to(term.value(pos, cols), s.shape)
            if K.softcap is not None:
                s = K.softcap * jnp.tanh(s / K.softcap)
            if fk is not None:
                s = jnp.where(_nonfinite(fk, fv, hh, K), jnp.nan, s)
            ok = in_range
            if mask is not None:
                ok = ok & mask.predicate(pos, [])
            s = jnp.where(ok, s, -jnp.inf)
            # (the columns of the other heads of the block are computed and dropped)
            m_new, l_new, alpha, p = _softmax_step(m_scr[hh][:, :1], l_scr[hh][:, :1], s)
            for c, v in enumerate(vs):
                acc_scr[hh, c] = acc_scr[hh, c] * alpha + lax.dot_general(
                    p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=F32)
            m_scr[hh] = jnp.broadcast_to(m_new, (K.M, LANES))
            l_scr[hh] = jnp.broadcast_to(l_new, (K.M, LANES))

    @pl.when(i == K.nb - 1)
    def _finish():
        for hh in range(K.hb):
            m, l = m_scr[hh][:, :1], l_scr[hh][:, :1]
            acc = [acc_scr[hh, c] for c in range(K.v_planes)]
            if K.sinks:
                sink = online.group_sink_column(sinks_ref, hg * K.hb + hh, K.G, K.Gp, K.M)
                a, m, l = online.sink_rescale(m, l, sink)
                acc = [x * a for x in acc]
            seen = l > 0
            safe = jnp.where(seen, l, 1.0)
            for c in range(K.v_planes):
                o_ref[hh, c] = (acc[c] / safe).astype(o_ref.dtype)
            lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
            lse_ref[hh] = jnp.broadcast_to(lse, (K.M, LANES))


def _softmax_step(m, l, s):
    """The online softmax's row state after a tile of logits ``s`` (invisible
    keys at -inf), in base e: ``(m, l, alpha, p)``, the accumulators to be
    scaled by ``alpha`` and to gain ``p @ v`` (one value plane or two); as
    :func:`fnattn._online.step_exp`."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_use)
    alpha = jnp.exp(m - m_use)
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha, p


def _nonfinite(fk, fv, hh: int, K: _K):
    """(M, bk) true in the columns of keys whose K (or, given ``fv``, V) holds a
    non-finite value in head ``hh``'s columns of the block: a product of head hh's
    column indicator with the non-finite indicators, which lands the per-key answer
    along lanes without a transpose (0/1 counts are exact in bfloat16 operands with a
    float32 result)."""
    ind = jnp.bfloat16

    def count(finite):
        width = finite.shape[1] // K.hb
        cols = lax.broadcasted_iota(I32, (K.M, finite.shape[1]), 1)
        mine = ((cols >= hh * width) & (cols < (hh + 1) * width)).astype(ind)
        return lax.dot_general(mine, (~finite).astype(ind), NT, preferred_element_type=F32)

    n = sum(count(f) for f in fk)      # (fk, fv: one indicator per column plane)
    if fv is not None:
        n = n + sum(count(f) for f in fv)
    return n > 0


def unsupported(cfg, q, k, v) -> Optional[str]:
    """What the Mosaic kernel lacks to run this call (None when it can).

    ``impl="auto"`` then uses the XLA lowering on TPU; ``impl="pallas"`` raises.
    """
    del v
    if k.dtype == jnp.float64:
        return "a float32, bfloat16 or float16 cache (got float64: TPUs have no float64)"
    names = _checks.symbolic_sizes(B=q.shape[0], Tq=q.shape[1], S=k.shape[1])
    if names:
        return (f"static sizes (got symbolic {', '.join(names)} under jax.export: its grid and "
                "its scalar-prefetched metadata are sized by them)")
    why = [] if cfg is None else _functions.refusals((cfg.mask, cfg.term), _functions.MOSAIC_TPU)
    if why:
        return f"functions it compiles: {'; '.join(why)}"
    return None


def _forward(cfg, q, k, v, starts, lengths, sinks, terms=None, *, interpret=False,
             block_k=None):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv), lse (B, Hq, Tq).

    ``block_k`` (a multiple of 8, 16 for bfloat16) overrides the key block size
    (tests: several blocks on short caches)."""
    why = unsupported(cfg, q, k, v)
    if why is not None:
        raise NotImplementedError(
            f"decode: the Mosaic (TPU) kernel needs {why}. impl='auto' runs such a cache "
            "with the XLA lowering on TPU; impl='xla' does everywhere.")
    B, Tq, Hq, D = q.shape
    latent = v is None
    _, S, Hkv, _ = k.shape
    Dv = cfg.value_dim if latent else v.shape[-1]
    fmt = lambda x: x.format if quant.is_quantized(x) else None  # noqa: E731
    k_fmt, v_fmt = fmt(k), None if latent else fmt(v)
    kp = 1 if k_fmt is None else k_fmt.per_byte       # column planes of a tile
    vp = kp if latent else (1 if v_fmt is None else v_fmt.per_byte)
    # A latent cache's values are its key tiles (the first Dv columns are kept).
    Dk = D // kp
    Dvk = Dk if latent else Dv // vp                   # stored columns of a plane
    G = Hq // Hkv
    Gp = common.pow2(G)
    hb = heads_per_program(Hkv, Dk, Dvk)
    ng = Hkv // hb
    M = max(SUBLANES, common.cdiv(Tq * Gp, SUBLANES) * SUBLANES)
    bk = block_k or DEFAULT_BLOCK_K
    bk = min(S, bk)     # a block as long as the cache is always legal
    n_blocks = common.cdiv(S, bk)
    splits = cfg.num_splits or 1
    splits = min(splits, n_blocks)
    nb = common.cdiv(n_blocks, splits)
    K = _K(Tq=Tq, G=G, Gp=Gp, M=M, hb=hb, bk=bk, nb=nb, splits=splits, scale=cfg.scale,
           softcap=cfg.softcap, mask_treedef=cfg.mask_treedef,
           sinks=sinks is not None and splits == 1, term_treedef=cfg.term_treedef,
           n_terms=0 if terms is None else terms.shape[0], B=B, Hq=Hq)
    # TPUs have no float16 arithmetic: such caches run in float32 (a copy).
    cd = _dequant.compute_dtype(q, k)
    cd = F32 if cd == jnp.float16 else cd
    K = dataclasses.replace(K, k_fmt=k_fmt, v_fmt=v_fmt, latent=latent, dtype=cd)

    lo, hi, _, _ = common.block_ranges(cfg.mask, Tq, lengths, starts, bk, n_blocks)
    meta = jnp.stack([starts, lengths, lo, hi], axis=1).astype(I32).reshape(-1)
    # q of kv head h = hg * hb + hh as rows of (B, ng, hb, planes, M, hb * Dk), in
    # head hh's columns of the block of hb heads (zeros elsewhere); plane c holds
    # the channels [c * Dk, (c + 1) * Dk) (the 4-bit format's second nibbles).
    qg = common.group_rows(q.astype(cd), Hkv, M, Gp).reshape(B, ng, hb, M, kp, 1, Dk)
    qx = qg * jnp.eye(hb, dtype=cd)[:, None, None, :, None]
    qx = jnp.moveaxis(qx, 4, 3).reshape(B, ng, hb, kp, M, hb * Dk)
    kv_index = functools.partial(_kv_index, K=K)

    def q_index(b, hg, sp, i, *_):
        return b, hg, 0, 0, 0, 0

    def stored(x, width):
        """A cache as (B, S, Hkv * width) (a free reshape): its codes if quantized."""
        x = x.data if quant.is_quantized(x) else x.astype(cd)
        return x.reshape(B, S, Hkv * width)

    def scale_index(b, hg, sp, i, meta_ref):
        return _kv_index(b, hg, sp, i, meta_ref, K=K)[:2] + (0,)

    in_specs = [pl.BlockSpec((None, None, hb, kp, M, hb * Dk), q_index),
                pl.BlockSpec((None, bk, hb * Dk), kv_index)]
    args = [qx, stored(k, Dk)]
    if not latent:
        in_specs.append(pl.BlockSpec((None, bk, hb * Dvk), kv_index))
        args.append(stored(v, Dvk))
    if K.tensor_scales:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(_dequant.tensor_scales(k, v))
    for f, x in ((k_fmt, k), (v_fmt, v)):
        if f is not None and f.per_token:  # the (bk, Hkv) scales beside each block
            in_specs.append(pl.BlockSpec((None, bk, Hkv), scale_index))
            args.append(x.scale.astype(F32))
    if K.sinks:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(sinks.astype(F32))
    if K.n_terms:   # (n, B, Hq), flat: one scalar per (array, row, head)
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(terms.astype(F32).reshape(-1))
    lead = () if splits == 1 else (splits,)
    blk = (None,) * len(lead) + (None, None, hb)

    def out_map(b, hg, sp, i, *_):
        return ((sp,) if splits > 1 else ()) + (b, hg, 0, 0, 0)

    def o_map(b, hg, sp, i, *_):
        return out_map(b, hg, sp, i) + (0,)

    cache_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                      for x in jax.tree_util.tree_leaves(args[1:]))

    out, lse = _varying.pallas_call(
        functools.partial(_kernel, K=K),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, ng, splits, nb), in_specs=in_specs,
            out_specs=[pl.BlockSpec(blk + (vp, M, hb * Dvk), o_map),
                       pl.BlockSpec(blk + (M, LANES), out_map)],
            scratch_shapes=[pltpu.VMEM((hb, M, LANES), F32), pltpu.VMEM((hb, M, LANES), F32),
                            pltpu.VMEM((hb, vp, M, hb * Dvk), F32)]),
        out_shape=[jax.ShapeDtypeStruct(lead + (B, ng, hb, vp, M, hb * Dvk),
                                        cd if splits == 1 else F32),
                   jax.ShapeDtypeStruct(lead + (B, ng, hb, M, LANES), F32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name=KERNEL_NAME,
        cost_estimate=cost.serving(
            B * Tq, Hkv * G, S, D, Dv, softcap=cfg.softcap is not None,
            cache_bytes=cache_bytes,
            io_bytes=B * Tq * Hkv * G * (D + Dv) * jnp.dtype(cd).itemsize),
    )(meta, *args)
    # Head hh's output is its own columns of the block's, its planes side by side
    # (a latent cache: the first Dv of them).
    out = out.reshape(out.shape[:-1] + (hb, Dvk))
    out = jnp.stack([out[..., hh, :, :, hh, :] for hh in range(hb)], axis=-4)
    out = jnp.moveaxis(out, -3, -2)                          # (..., hb, M, planes, Dvk)
    lead_shape = lead + (B, Hkv)
    out = out.reshape(lead_shape + (M, vp * Dvk))[..., :Dv]
    lse = lse[..., 0].reshape(lead_shape + (M,))
    if splits > 1:
        sink = None if sinks is None else common.row_sinks(sinks, Hkv, Tq, M, Gp)
        out, lse = merge_stacked(out, lse, sink)
    out, lse = common.ungroup_rows(out, lse, Tq, G, Gp)
    return out.astype(q.dtype), lse


forward = functools.partial(_forward, interpret=False)
forward_interpret = functools.partial(_forward, interpret=True)


def auto_forward(cfg, q, k, v, starts, lengths, sinks, terms=None):
    """impl="auto" on TPU: the Mosaic kernel, or the XLA lowering for a call it cannot
    run (see :func:`unsupported`), decided from the static shapes and dtypes."""
    # (a float16 cache would be copied to float32 first: XLA reads it as it is)
    slow = k.dtype == jnp.float16
    fwd = xla.forward if slow or unsupported(cfg, q, k, v) else forward
    return fwd(cfg, q, k, v, starts, lengths, sinks, terms)
