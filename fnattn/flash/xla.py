"""The XLA lowering of flash attention: blockwise online softmax in ``lax`` loops.

Memory is O(T) in the forward *and* the backward: no (Tq, Tk) array is ever
formed. The forward visits, for each q-block, only the kv-blocks that the mask
leaves non-empty (the schedule of :mod:`fnattn.flash.blocks`), so causal
attention costs about half of full attention, and it evaluates the mask only on
PARTIAL tiles. The backward is one pass over kv-blocks (FlashAttention-2 style,
recomputing the probabilities from ``lse``) that accumulates dk and dv for the
kv-block and adds each tile's contribution to dq, so it costs about 2.5 forward
passes.

All query heads of a GQA group are processed with their kv head in one batched
matrix product, so K and V are never repeated.
"""

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from fnattn import dropout, masks
from fnattn._dispatch import Lowering
from fnattn.flash import blocks

__all__ = ["XlaBlockSizes", "LOWERING"]


@dataclasses.dataclass(frozen=True)
class XlaBlockSizes:
    """Tile sizes of the XLA flash lowering.

    Large tiles make the matrix products efficient on CPUs; the tile's f32
    logits take ``4 * Hq * block_q * block_k`` bytes.

    The backward pass has its own tile sizes (``block_q_bwd``, ``block_k_bwd``;
    None means the forward's), since it keeps four tiles live instead of one.

    >>> XlaBlockSizes(block_q=256, block_k=512)
    XlaBlockSizes(block_q=256, block_k=512, block_q_bwd=None, block_k_bwd=None)
    """

    block_q: int = 256
    block_k: int = 512
    block_q_bwd: Optional[int] = None
    block_k_bwd: Optional[int] = None

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            v = getattr(self, name)
            if v is None and name.endswith("_bwd"):
                continue
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"XlaBlockSizes: {name} must be a positive int; got {v!r}")

    @classmethod
    def default(cls, dims, dtype) -> "XlaBlockSizes":
        del dtype
        # Keep one f32 logit tile of all heads around 8 MiB.
        budget = 2**21 // max(dims.num_q_heads, 1)
        bk = 512 if dims.head_dim <= 128 else 256
        bq = max(64, min(256, budget // bk))
        return cls(block_q=bq, block_k=bk)


def _round_up(x, m):
    return -(-x // m) * m


def _pad_axis(x, axis, size):
    pad = size - x.shape[axis]
    if pad <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


@dataclasses.dataclass(frozen=True)
class _Plan:
    B: int
    Tq: int
    Tk: int
    Hq: int
    Hkv: int
    G: int
    D: int
    Dv: int
    bq: int
    bk: int
    nq: int
    nk: int
    scale: float
    softcap: Optional[float]
    rate: float


def _plan(cfg, backward=False) -> _Plan:
    d = cfg.dims
    bs = blocks.pick(cfg.block_sizes, XlaBlockSizes, XlaBlockSizes.default(d, None))
    bq, bk = bs.block_q, bs.block_k
    if backward:
        bq = bs.block_q_bwd or bq
        bk = bs.block_k_bwd or bk
    bq = min(bq, _round_up(d.q_len, 8))
    bk = min(bk, _round_up(d.kv_len, 8))
    return _Plan(d.batch, d.q_len, d.kv_len, d.num_q_heads, d.num_kv_heads, d.group,
                 d.head_dim, d.v_head_dim, bq, bk, -(-d.q_len // bq), -(-d.kv_len // bk),
                 cfg.scale, cfg.softcap, cfg.dropout_rate)


def _union_classes(cls):
    """One class per tile, shared by every batch row and head (conservative)."""
    nonempty = jnp.any(cls != masks.EMPTY, axis=(0, 1))
    full = jnp.all(cls == masks.FULL, axis=(0, 1))
    return (nonempty | full).astype(jnp.int8) + full.astype(jnp.int8)


def _prepare_operands(mask, P: _Plan):
    """The mask's 4-D operands, padded along q and k to whole blocks."""
    if mask is None:
        return ()
    ops = []
    for op in mask.operands():
        if op.shape[2] > 1:
            op = _pad_axis(op, 2, P.nq * P.bq)
        if op.shape[3] > 1:
            op = _pad_axis(op, 3, P.nk * P.bk)
        ops.append(op)
    return tuple(ops)


def _tile(x, i, j, P: _Plan):
    """Slices a padded 4-D (b, h, q|1, k|1) array to the tile (i, j)."""
    start = [0, 0, 0, 0]
    size = list(x.shape)
    if x.shape[2] > 1:
        start[2], size[2] = i * P.bq, P.bq
    if x.shape[3] > 1:
        start[3], size[3] = j * P.bk, P.bk
    return lax.dynamic_slice(x, start, size)


def _to5(x, P: _Plan, transposed=False):
    """(b, Hq|1, q|1, k|1) -> (b, Hkv|1, G|1, q, k), or (b, Hkv|1, k, G|1, q) if transposed.

    Query head h is kv head h // G and group member h % G.
    """
    x = x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], P.Hkv, P.G, *x.shape[2:])
    return x.transpose(0, 1, 4, 2, 3) if transposed else x


def _positions(i, j, P: _Plan, transposed=False):
    """Index arrays of tile (i, j), broadcastable in the 5-D tile layout."""
    shape = (lambda *a: a) if not transposed else (lambda b, h, g, q, k: (b, h, k, g, q))
    b = jnp.arange(P.B, dtype=jnp.int32).reshape(shape(P.B, 1, 1, 1, 1))
    h = (jnp.arange(P.Hkv, dtype=jnp.int32)[:, None] * P.G
         + jnp.arange(P.G, dtype=jnp.int32)[None, :]).reshape(shape(1, P.Hkv, P.G, 1, 1))
    q = (i * P.bq + jnp.arange(P.bq, dtype=jnp.int32)).reshape(shape(1, 1, 1, P.bq, 1))
    k = (j * P.bk + jnp.arange(P.bk, dtype=jnp.int32)).reshape(shape(1, 1, 1, 1, P.bk))
    return masks.Positions(b=b, h=h, q=q, q_pos=q + (P.Tk - P.Tq), k=k)


def _allowed(mask, ops, i, j, P: _Plan, transposed=False):
    """Boolean mask of a PARTIAL tile in the 5-D layout, including k < Tk."""
    pos = _positions(i, j, P, transposed)
    ok = pos.k < P.Tk
    if mask is not None:
        tiles = tuple(_to5(_tile(op, i, j, P), P, transposed) for op in ops)
        ok = mask.predicate(pos, tiles) & ok
    return ok


def _keep(seed, i, j, P: _Plan, transposed=False):
    pos = _positions(i, j, P, transposed)
    return dropout.keep_mask(seed, pos.b, pos.h, pos.q, pos.k, P.rate)


def _logits(qi, kj, bias_t, P: _Plan):
    """f32 logits of a tile before masking; also returns tanh(s/c) for the backward."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kj, preferred_element_type=jnp.float32)
    if qi.dtype != jnp.float32:  # f32 queries arrive pre-scaled (see _scaled_queries)
        s = s * P.scale
    if bias_t is not None:
        s = s + _to5(bias_t, P).astype(jnp.float32)
    if P.softcap is not None:
        th = jnp.tanh(s / P.softcap)
        return P.softcap * th, th
    return s, None


def _scaled_queries(qg, P: _Plan):
    # Scaling f32 queries once saves a pass over every logit tile; lower
    # precisions keep the scale in f32 on the logits instead.
    return qg * P.scale if qg.dtype == jnp.float32 else qg


def _layout(q, k, v, P: _Plan):
    """bthd -> padded (B, Hkv, G, Tq', D), (B, Hkv, Tk', D), (B, Hkv, Tk', Dv)."""
    qg = q.reshape(P.B, P.Tq, P.Hkv, P.G, P.D).transpose(0, 2, 3, 1, 4)
    qg = _pad_axis(qg, 3, P.nq * P.bq)
    kt = _pad_axis(k.transpose(0, 2, 1, 3), 2, P.nk * P.bk)
    vt = _pad_axis(v.transpose(0, 2, 1, 3), 2, P.nk * P.bk)
    return qg, kt, vt


def _bias4(bias, P: _Plan):
    if bias is None:
        return None
    b = jnp.reshape(bias, (1,) * (4 - bias.ndim) + bias.shape)
    if b.shape[2] > 1:
        b = _pad_axis(b, 2, P.nq * P.bq)
    if b.shape[3] > 1:
        b = _pad_axis(b, 3, P.nk * P.bk)
    return b


def _schedule(mask, P: _Plan, transpose=False):
    cls = masks.block_classes(mask, P.B, P.Hq, P.Tq, P.Tk, P.bq, P.bk)
    return blocks.schedule(_union_classes(cls), transpose=transpose)


def _forward(cfg, q, k, v, bias, sinks, mask, seed):
    P = _plan(cfg)
    qg, kt, vt = _layout(q, k, v, P)
    qg = _scaled_queries(qg, P)
    ops = _prepare_operands(mask, P)
    bias4 = _bias4(bias, P)
    sched = _schedule(mask, P)
    row_shape = (P.B, P.Hkv, P.G, P.bq)

    def q_block(i):
        qi = lax.dynamic_slice_in_dim(qg, i * P.bq, P.bq, axis=3)

        def step(t, carry):
            m, l, acc = carry
            j = sched.index[i, t]
            kj = lax.dynamic_slice_in_dim(kt, j * P.bk, P.bk, axis=2)
            vj = lax.dynamic_slice_in_dim(vt, j * P.bk, P.bk, axis=2)
            s, _ = _logits(qi, kj, None if bias4 is None else _tile(bias4, i, j, P), P)
            s = lax.cond(sched.kind[i, t] == masks.FULL, lambda s: s,
                         lambda s: jnp.where(_allowed(mask, ops, i, j, P), s, -jnp.inf), s)
            m_new = jnp.maximum(m, s.max(-1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_use[..., None])
            alpha = jnp.exp(m - m_use)
            l = l * alpha + p.sum(-1)
            if P.rate > 0:
                p = jnp.where(_keep(seed, i, j, P), p * (1.0 / (1.0 - P.rate)), 0.0)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(vj.dtype), vj,
                            preferred_element_type=jnp.float32)
            return m_new, l, acc * alpha[..., None] + pv

        init = (jnp.full(row_shape, -jnp.inf, jnp.float32), jnp.zeros(row_shape, jnp.float32),
                jnp.zeros(row_shape + (P.Dv,), jnp.float32))
        m, l, acc = lax.fori_loop(0, sched.count[i], step, init)
        if sinks is not None:
            sk = sinks.astype(jnp.float32).reshape(1, P.Hkv, P.G, 1)
            m_fin = jnp.maximum(m, sk)
            a = jnp.exp(m - m_fin)
            l = l * a + jnp.exp(sk - m_fin)
            acc = acc * a[..., None]
            m = m_fin
        safe = jnp.where(l > 0, l, 1.0)
        out = acc / safe[..., None]
        lse = jnp.where(l > 0, m + jnp.log(safe), -jnp.inf)
        return out.astype(q.dtype), lse

    outs, lses = lax.map(q_block, jnp.arange(P.nq))
    # (nq, B, Hkv, G, bq, Dv) -> (B, Tq, Hq, Dv)
    out = outs.transpose(1, 0, 4, 2, 3, 5).reshape(P.B, P.nq * P.bq, P.Hq, P.Dv)[:, :P.Tq]
    lse = lses.transpose(1, 2, 3, 0, 4).reshape(P.B, P.Hq, P.nq * P.bq)[..., :P.Tq]
    return out, lse


def _backward(cfg, q, k, v, bias, sinks, mask, seed, out, lse, d_out, d_lse):
    P = _plan(cfg, backward=True)
    qg, kt, vt = _layout(q, k, v, P)
    qg = _scaled_queries(qg, P)
    dog, _, _ = _layout(d_out, k[..., :1], k[..., :1], dataclasses.replace(P, D=P.Dv))
    ops = _prepare_operands(mask, P)
    bias4 = _bias4(bias, P)
    sched = _schedule(mask, P, transpose=True)
    f32 = jnp.float32
    delta = jnp.einsum("bthd,bthd->bht", out.astype(f32), d_out.astype(f32))
    delta = delta - d_lse.astype(f32)                        # (B, Hq, Tq)
    # rows with lse = -inf have no probability mass: p = exp(s - inf) = 0
    lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)

    def rows5(x):  # (B, Hq, Tq) -> padded (B, Hkv, G, Tq')
        return _pad_axis(x.reshape(P.B, P.Hkv, P.G, P.Tq), 3, P.nq * P.bq)

    lse5, delta5 = rows5(lse_safe), rows5(delta)
    Tqp, Tkp = P.nq * P.bq, P.nk * P.bk
    dbias_shape = None if bias4 is None else bias4.shape

    def kv_block(j, carry):
        dq, dk, dv, dbias = carry
        kj = lax.dynamic_slice_in_dim(kt, j * P.bk, P.bk, axis=2)
        vj = lax.dynamic_slice_in_dim(vt, j * P.bk, P.bk, axis=2)

        # Tiles are laid out transposed, (b, h, k, g, q), so that the products
        # for dk and dv contract the trailing axes without transposing.
        def step(t, inner):
            dq, dkj, dvj, dbias = inner
            i = sched.index[j, t]
            qi = lax.dynamic_slice_in_dim(qg, i * P.bq, P.bq, axis=3)
            doi = lax.dynamic_slice_in_dim(dog, i * P.bq, P.bq, axis=3)
            lse_i = lax.dynamic_slice_in_dim(lse5, i * P.bq, P.bq, axis=3)[:, :, None]
            delta_i = lax.dynamic_slice_in_dim(delta5, i * P.bq, P.bq, axis=3)[:, :, None]
            s = jnp.einsum("bhkd,bhgqd->bhkgq", kj, qi, preferred_element_type=f32)
            if qi.dtype != f32:
                s = s * P.scale
            if bias4 is not None:
                s = s + _to5(_tile(bias4, i, j, P), P, True).astype(f32)
            th = None
            if P.softcap is not None:
                th = jnp.tanh(s / P.softcap)
                s = P.softcap * th
            s = lax.cond(sched.kind[j, t] == masks.FULL, lambda s: s,
                         lambda s: jnp.where(_allowed(mask, ops, i, j, P, True), s, -jnp.inf), s)
            p = jnp.exp(s - lse_i)
            dp = jnp.einsum("bhkd,bhgqd->bhkgq", vj, doi, preferred_element_type=f32)
            if P.rate > 0:
                keep = _keep(seed, i, j, P, True)
                inv = 1.0 / (1.0 - P.rate)
                pd = jnp.where(keep, p * inv, 0.0)
                dp = jnp.where(keep, dp * inv, 0.0)
            else:
                pd = p
            dvj = dvj + jnp.einsum("bhkgq,bhgqd->bhkd", pd.astype(doi.dtype), doi,
                                   preferred_element_type=f32)
            ds = p * (dp - delta_i)
            if th is not None:
                ds = ds * (1.0 - th * th)
            if dbias is not None:
                dbias = _add_dbias(dbias, ds, i, j, P)
            dsq = ds.astype(qi.dtype)
            dkj = dkj + jnp.einsum("bhkgq,bhgqd->bhkd", dsq, qi, preferred_element_type=f32)
            dqi = jnp.einsum("bhkgq,bhkd->bhgqd", dsq, kj, preferred_element_type=f32)
            cur = lax.dynamic_slice_in_dim(dq, i * P.bq, P.bq, axis=3)
            dq = lax.dynamic_update_slice_in_dim(dq, cur + dqi, i * P.bq, axis=3)
            return dq, dkj, dvj, dbias

        init = (dq, jnp.zeros((P.B, P.Hkv, P.bk, P.D), f32),
                jnp.zeros((P.B, P.Hkv, P.bk, P.Dv), f32), dbias)
        dq, dkj, dvj, dbias = lax.fori_loop(0, sched.count[j], step, init)
        dk = lax.dynamic_update_slice_in_dim(dk, dkj, j * P.bk, axis=2)
        dv = lax.dynamic_update_slice_in_dim(dv, dvj, j * P.bk, axis=2)
        return dq, dk, dv, dbias

    init = (jnp.zeros((P.B, P.Hkv, P.G, Tqp, P.D), f32), jnp.zeros((P.B, P.Hkv, Tkp, P.D), f32),
            jnp.zeros((P.B, P.Hkv, Tkp, P.Dv), f32),
            None if dbias_shape is None else jnp.zeros(dbias_shape, f32))
    dq, dk, dv, dbias = lax.fori_loop(0, P.nk, kv_block, init)
    dq = (dq[:, :, :, :P.Tq] * P.scale).transpose(0, 3, 1, 2, 4).reshape(q.shape)
    dk = dk[:, :, :P.Tk] * (P.scale if qg.dtype != f32 else 1.0)
    dk = dk.transpose(0, 2, 1, 3)
    dv = dv[:, :, :P.Tk].transpose(0, 2, 1, 3)
    if dbias is not None:
        dbias = dbias[:, :, :P.Tq if dbias.shape[2] > 1 else 1, :P.Tk if dbias.shape[3] > 1 else 1]
        dbias = dbias.reshape(bias.shape).astype(bias.dtype)
    dsinks = None
    if sinks is not None:
        p_sink = jnp.exp(sinks.astype(f32)[None, :, None] - lse_safe)
        dsinks = -(p_sink * delta).sum((0, 2)).astype(sinks.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, dsinks


def _add_dbias(dbias, ds, i, j, P: _Plan):
    """Adds a transposed tile's d(logits) to the bias gradient, reduced to its shape."""
    Bb, Hb, Tqb, Tkb = dbias.shape
    g = ds.transpose(0, 1, 3, 4, 2).reshape(P.B, P.Hq, P.bq, P.bk)
    if Bb == 1:
        g = g.sum(0, keepdims=True)
    if Hb == 1:
        g = g.sum(1, keepdims=True)
    if Tqb == 1:
        g = g.sum(2, keepdims=True)
    if Tkb == 1:
        g = g.sum(3, keepdims=True)
    start = (0, 0, i * P.bq if Tqb > 1 else 0, j * P.bk if Tkb > 1 else 0)
    cur = lax.dynamic_slice(dbias, start, g.shape)
    return lax.dynamic_update_slice(dbias, cur + g, start)


LOWERING = Lowering("flash-xla", _forward, _backward)
