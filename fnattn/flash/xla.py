"""The XLA lowering of flash attention: blockwise online softmax in ``lax`` loops.

Memory is O(T) in the forward *and* the backward: no (Tq, Tk) array is ever
formed (only a full-size ``bias``, which is itself O(T^2), gets a full-size
gradient).

**Block-sparse schedule.** ``masks.block_classes`` classifies every
(q-block, kv-block) tile as EMPTY, PARTIAL or FULL inside ``jit``;
``blocks.schedule`` compresses that into, per q-block, the FULL kv-blocks and,
separately, the PARTIAL ones. Each q-block then runs two ``lax.fori_loop``s
whose trip counts are those counts: the FULL tiles with no mask code at all,
then the PARTIAL tiles, where the mask is evaluated through the mask protocol
on the tile (with the ragged-length bound). Empty tiles cost nothing, so causal
attention does about half the work of full attention and a sliding window a
fraction of it. When the mask varies along the batch (segment ids, lengths)
each batch row gets its own schedule; heads share one (a tile is visited if
any head sees it, and is FULL only if FULL for every head).

**Forward.** For each q-block, all query heads are processed together: the
heads of a GQA group are stacked along the rows of one batched matrix product
with their kv head, so K and V are never repeated. K is laid out once as
transposed blocks ``(n_k, B, Hkv, D, block_k)`` and V as blocks, so every
product in the loop is a plain (rows x D) @ (D x cols) with no per-tile copy
or transpose. Logits and softmax statistics are float32 (float64 for float64
inputs); the forward also returns ``lse``'s rounding error ``lse_lo``
(``_online.lse_parts``).

**Backward.** One pass over kv-blocks (FlashAttention-2 style, recomputing the
probabilities from ``lse``): for each kv-block it visits the q-blocks that see
it (the transposed schedule, FULL then PARTIAL), accumulates dk and dv for the
block, and adds each tile's dq contribution into a dq buffer, so nothing is
recomputed twice and the backward costs about 2.5 forward passes. Tiles are
transposed, ``(k, q)``, and q, dO, K are also kept transposed, so all five
products are plain matrix products. The cotangent of ``lse`` is honoured
(``dS += P * d_lse``) and dbias / dsinks come out of the same pass. Probabilities
are recomputed as ``exp((s - lse) - lse_lo)``, exact even for rows whose logits
are all huge (a bias of -1e30 or ``finfo.min``, where ``lse`` cannot hold
``log(l)``).

**Masked keys contribute nothing, whatever their K/V hold.** On PARTIAL tiles
(forward and backward) keys with a non-finite K or V entry are zeroed and their
logits set to NaN before the mask: rows that may not see them are untouched,
rows that see them are NaN. FULL tiles need no such pass (every key is seen by
every row there) and EMPTY tiles are never read.
"""

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fnattn import _checks
from fnattn import _online as online
from fnattn import dropout, masks, position_bias
from fnattn._dispatch import Lowering
from fnattn._varying import varying_like
from fnattn.flash import blocks

__all__ = ["XlaBlockSizes", "LOWERING"]

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class XlaBlockSizes:
    """Tile sizes of the XLA flash lowering.

    Large tiles keep the matrix products efficient on CPUs; one tile of logits
    of all heads takes ``4 * B * Hq * block_q * block_k`` bytes. The backward
    pass has its own sizes (``block_q_bwd``, ``block_k_bwd``; None means the
    forward's), since it keeps several tiles live instead of one.

    >>> XlaBlockSizes(block_q=128, block_k=512)
    XlaBlockSizes(block_q=128, block_k=512, block_q_bwd=None, block_k_bwd=None)
    """

    block_q: int = 256
    block_k: int = 256
    block_q_bwd: Optional[int] = None
    block_k_bwd: Optional[int] = None

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            v = getattr(self, name)
            if v is None and name.endswith("_bwd"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"XlaBlockSizes: {name} must be a positive int; got {v!r}")

    @classmethod
    def default(cls, dims, dtype=None) -> "XlaBlockSizes":
        """Defaults for the problem ``dims`` (a :class:`fnattn._checks.Dims`).

        block_k is 256 and block_q keeps one float32 logit tile of all heads
        near 4 MiB (512 x 256 for 8 heads at batch 1); the backward, which keeps
        several tiles live, uses half the rows and twice the keys (256 x 512).
        Measured on a 2-core x86 CPU (B=1, H=8, D=64, float32, T=2k..8k): 1.6-1.9x
        faster than 256 x 256 tiles, forward and backward, causal or not;
        larger tiles are no faster.
        """
        del dtype  # logits are float32 whatever the input dtype
        # (a symbolic batch, under jax.export, sizes the tiles as a batch of 1)
        rows = max(_checks.static_or(dims.batch, 1) * dims.num_q_heads, 1)
        bk = 256
        bq = _pow2_floor(max(64, min(512, 2**20 // (rows * bk))))
        return cls(block_q=bq, block_k=bk, block_q_bwd=max(64, bq // 2), block_k_bwd=2 * bk)


def _pow2_floor(n):
    return 1 << (int(n).bit_length() - 1)


def _round_up(x, m):
    return -(-x // m) * m


def _pad_axis(x, axis, size, value=0):
    pad = size - x.shape[axis]
    if _checks.is_static(pad) and pad <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


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
    offset: int  # aligned query position = raw row + offset
    acc: Any = F32  # logits and accumulators: promote(float32, input dtype)


def _plan(cfg, backward=False, dtype=None) -> _Plan:
    d = cfg.dims
    bs = blocks.pick(cfg.block_sizes, XlaBlockSizes, XlaBlockSizes.default(d, None))
    bq, bk = bs.block_q, bs.block_k
    if backward:
        bq = bs.block_q_bwd or bq
        bk = bs.block_k_bwd or bk
    # Short sequences: one block, rounded up to a multiple of 8 rows.
    # (a symbolic length, under jax.export, keeps the block sizes)
    if _checks.is_static(d.q_len):
        bq = min(bq, _round_up(d.q_len, 8))
    if _checks.is_static(d.kv_len):
        bk = min(bk, _round_up(d.kv_len, 8))
    return _Plan(d.batch, d.q_len, d.kv_len, d.num_q_heads, d.num_kv_heads, d.group,
                 d.head_dim, d.v_head_dim, bq, bk, -(-d.q_len // bq), -(-d.kv_len // bk),
                 cfg.scale, cfg.softcap, cfg.dropout_rate,
                 d.kv_len - d.q_len if cfg.q_offset is None else cfg.q_offset,
                 F32 if dtype is None else jnp.promote_types(F32, dtype))


# ----------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------


def _classes(mask, P: _Plan):
    """Tile classes (B|1, nq, nk), shared by the heads (conservative union)."""
    st = masks.block_classes_static(mask, P.B, P.Hq, P.Tq, P.Tk, P.bq, P.bk, q_offset=P.offset)
    if st is not None and blocks.embeds(*st.shape):
        nonempty = np.any(st != masks.EMPTY, axis=1)
        full = np.all(st == masks.FULL, axis=1)
        return (nonempty | full).astype(np.int8) + full.astype(np.int8)
    cls = masks.block_classes(mask, P.B, P.Hq, P.Tq, P.Tk, P.bq, P.bk, q_offset=P.offset)
    nonempty = jnp.any(cls != masks.EMPTY, axis=1)
    full = jnp.all(cls == masks.FULL, axis=1)
    return (nonempty | full).astype(jnp.int8) + full.astype(jnp.int8)


def _split_schedule(classes, transpose=False):
    """The lists of the FULL tiles and of the PARTIAL tiles, per row-block, as
    the ``xs`` of the loop over row-blocks (:func:`_row_lists` reads one
    row-block's): static classes give NumPy ``(full index, full count, partial
    index, partial count)``; traced ones ``(index, count)``, of shapes
    (rows, 2, n) and (rows, 2), FULL first."""
    if isinstance(classes, np.ndarray):
        full = blocks.schedule_static(np.where(classes == masks.FULL, classes, masks.EMPTY)
                                      .astype(np.int8), transpose=transpose)
        part = blocks.schedule_static(np.where(classes == masks.PARTIAL, classes, masks.EMPTY)
                                      .astype(np.int8), transpose=transpose)
        return full.index, full.count, part.index, part.count
    # Both lists from one schedule, of each row-block's two tables (FULL tiles,
    # PARTIAL tiles) stacked as a table of two rows: one set of kernels to
    # compile instead of two, and lists that the loop over row-blocks slices
    # without a copy.
    c = classes.T if transpose else classes
    both = jnp.stack([jnp.where(c == kind, c, masks.EMPTY).astype(jnp.int8)
                      for kind in (masks.FULL, masks.PARTIAL)], axis=1)
    s = blocks.schedule(both)
    return s.index, s.count


def _row_lists(xs):
    """One row-block's ``(full index, full count, partial index, partial count)``
    from its slice of :func:`_split_schedule`'s lists."""
    if len(xs) == 4:
        return xs
    index, count = xs
    return index[0], count[0], index[1], count[1]


def _skips(lists):
    """Whether the FULL and the PARTIAL loops never run (static lists only)."""
    if len(lists) == 4:
        return _never(lists[1]), _never(lists[3])
    return False, False


def _never(n):
    """Whether a static count is zero everywhere (the loop need not be traced)."""
    return isinstance(n, np.ndarray) and not n.any()


def _batch_rows(P: _Plan, classes):
    """Whether each batch row runs with its own schedule (mask varies along B)."""
    return P.B != 1 and classes.shape[0] != 1


# ----------------------------------------------------------------------------------
# Tiles of the mask, bias and dropout
# ----------------------------------------------------------------------------------


def _pad4(x, P: _Plan):
    """A 4-D (b, h, q|1, k|1) array padded along q and k to whole blocks."""
    if x.shape[2] != 1:  # (!= 1, not > 1: also for a symbolic length)
        x = _pad_axis(x, 2, P.nq * P.bq)
    if x.shape[3] != 1:
        x = _pad_axis(x, 3, P.nk * P.bk)
    return x


def _tile(x, i, j, P: _Plan):
    """Slices a padded 4-D (b, h, q|1, k|1) array to the tile (i, j)."""
    start = [0, 0, 0, 0]
    size = list(x.shape)
    if x.shape[2] != 1:
        start[2], size[2] = i * P.bq, P.bq
    if x.shape[3] != 1:
        start[3], size[3] = j * P.bk, P.bk
    # int32 throughout (Python ints would be int64 under jax_enable_x64)
    return lax.dynamic_slice(x, [jnp.asarray(s, jnp.int32) for s in start], size)


def _to5(x, P: _Plan, transposed):
    """(b, Hq|1, q|1, k|1) -> (b, Hkv|1, G|1, q, k), or (b, Hkv|1, k, G|1, q) if transposed.

    Query head h is kv head h // G and group member h % G.
    """
    x = x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], P.Hkv, P.G, *x.shape[2:])
    return x.transpose(0, 1, 4, 2, 3) if transposed else x


def _positions(bidx, i, j, P: _Plan, transposed):
    """Index arrays of tile (i, j), broadcastable in the 5-D tile layout."""
    if transposed:
        shape = lambda b, h, g, q, k: (b, h, k, g, q)  # noqa: E731
    else:
        shape = lambda *a: a  # noqa: E731
    b = bidx.reshape(shape(bidx.shape[0], 1, 1, 1, 1))
    h = (jnp.arange(P.Hkv, dtype=jnp.int32)[:, None] * P.G
         + jnp.arange(P.G, dtype=jnp.int32)[None, :]).reshape(shape(1, P.Hkv, P.G, 1, 1))
    q = (i * P.bq + jnp.arange(P.bq, dtype=jnp.int32)).reshape(shape(1, 1, 1, P.bq, 1))
    k = (j * P.bk + jnp.arange(P.bk, dtype=jnp.int32)).reshape(shape(1, 1, 1, 1, P.bk))
    return masks.Positions(b=b, h=h, q=q, q_pos=q + P.offset, k=k)


def _allowed(mask, ops, bidx, i, j, P: _Plan, transposed):
    """Boolean mask of a PARTIAL tile in the 5-D layout, including k < Tk and
    q < Tq: a padding row sees no key, so that a key the mask shows it (a
    ``from_fn`` predicate knows no bound) cannot give it a NaN logit, whose P
    the backward would add into that key's dK and dV (0 * NaN)."""
    pos = _positions(bidx, i, j, P, transposed)
    ok = (pos.k < P.Tk) & (pos.q < P.Tq)
    if mask is not None:
        tiles = tuple(_to5(_tile(op, i, j, P), P, transposed) for op in ops)
        ok = mask.predicate(pos, tiles) & ok
    return ok


def _term(mask, ops, bidx, i, j, P: _Plan, transposed):
    """The position term of tile (i, j) in the 3-D tile layout, or None."""
    if not position_bias.present(mask):
        return None
    pos = _positions(bidx, i, j, P, transposed)
    tiles = tuple(_to5(_tile(op, i, j, P), P, transposed) for op in ops)
    B = bidx.shape[0]
    return _flat(position_bias.term(mask, pos, tiles), B, P, transposed).astype(P.acc)


def _keep(seed, bidx, i, j, P: _Plan, transposed):
    pos = _positions(bidx, i, j, P, transposed)
    return dropout.keep_mask(seed, pos.b, pos.h, pos.q, pos.k, P.rate)


# ----------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------


# Tiles are 3-D, (B*Hkv, G*bq, bk) in the forward and (B*Hkv, bk, G*bq) in the
# backward: the query heads of a GQA group are stacked along the rows of their
# kv head's product. (5-D tiles would make XLA:CPU copy every logit tile once
# more, to reshape it for the row reductions.)


def _q_blocks(x, P: _Plan, transposed=False):
    """bthd (B, Tq, Hq, E) -> (nq, B*Hkv, G*bq, E), or (nq, B*Hkv, E, G*bq)."""
    B, E = x.shape[0], x.shape[-1]
    x = _pad_axis(x, 1, P.nq * P.bq).reshape(B, P.nq, P.bq, P.Hkv, P.G, E)
    x = x.transpose((1, 0, 3, 5, 4, 2) if transposed else (1, 0, 3, 4, 2, 5))
    return x.reshape((P.nq, B * P.Hkv) + ((E, P.G * P.bq) if transposed else (P.G * P.bq, E)))


def _k_blocks(x, P: _Plan, transposed=False):
    """bthd (B, Tk, Hkv, E) -> (nk, B*Hkv, bk, E), or (nk, B*Hkv, E, bk)."""
    B, E = x.shape[0], x.shape[-1]
    x = _pad_axis(x, 1, P.nk * P.bk).reshape(B, P.nk, P.bk, P.Hkv, E)
    x = x.transpose((1, 0, 3, 4, 2) if transposed else (1, 0, 3, 2, 4))
    return x.reshape((P.nk, B * P.Hkv) + x.shape[3:])


def _rows_blocks(x, P: _Plan, value=0.0):
    """(B, Hq, Tq) -> (nq, B*Hkv, G*bq)."""
    B = x.shape[0]
    x = _pad_axis(x, 2, P.nq * P.bq, value).reshape(B, P.Hkv, P.G, P.nq, P.bq)
    return x.transpose(3, 0, 1, 2, 4).reshape(P.nq, B * P.Hkv, P.G * P.bq)


def _flat(x5, B, P: _Plan, transposed):
    """A broadcastable 5-D tile array -> the 3-D tile layout."""
    if transposed:
        x5 = jnp.broadcast_to(x5, (B, P.Hkv, P.bk, P.G, P.bq))
        return x5.reshape(B * P.Hkv, P.bk, P.G * P.bq)
    x5 = jnp.broadcast_to(x5, (B, P.Hkv, P.G, P.bq, P.bk))
    return x5.reshape(B * P.Hkv, P.G * P.bq, P.bk)


def _bias4(bias):
    return None if bias is None else jnp.reshape(bias, (1,) * (4 - bias.ndim) + bias.shape)


def _scaled(qb, P: _Plan):
    # Scaling f32 (f64) queries once saves a pass over every logit tile; lower
    # precisions keep the scale in f32 on the logits instead.
    return qb * jnp.asarray(P.scale, qb.dtype) if qb.dtype == P.acc else qb


def _by_batch(P: _Plan, per_row: bool, fn, batched, shared, carry=None):
    """Runs ``fn(P', bidx, batched, shared, carry)`` on all rows, or row by row.

    ``batched`` holds arrays whose leading axis is the batch (or None, or arrays
    with a size-1 batch axis, which are shared by every row).
    """
    bidx = jnp.arange(P.B, dtype=jnp.int32)
    if not per_row:
        return fn(P, bidx, batched, shared, carry)
    P1 = dataclasses.replace(P, B=1)
    leaves, treedef = jax.tree_util.tree_flatten(batched)
    sliced = [x.shape[0] > 1 for x in leaves]

    def one(c, xs):
        b, row = xs
        it = iter(row)
        parts = [next(it)[None] if s else x for s, x in zip(sliced, leaves)]
        out, c = fn(P1, b[None], jax.tree_util.tree_unflatten(treedef, parts), shared, c)
        return c, out

    carry, outs = lax.scan(one, carry, (bidx, [x for s, x in zip(sliced, leaves) if s]))
    return jax.tree_util.tree_map(lambda x: x.reshape((P.B,) + x.shape[2:]), outs), carry


# ----------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------


def _forward(cfg, q, k, v, bias, sinks, mask, seed):
    P = _plan(cfg, dtype=q.dtype)
    classes = _classes(mask, P)
    per_row = _batch_rows(P, classes)
    batched = dict(q=q, k=k, v=v, bias=_bias4(bias), classes=classes,
                   ops=tuple(mask.operands()) if mask is not None else ())
    (out, lse, lse_lo), _ = _by_batch(P, per_row, _forward_rows, batched, (mask, sinks, seed))
    return out.astype(q.dtype), lse, lse_lo


def _forward_rows(P: _Plan, bidx, a, shared, carry):
    mask, sinks, seed = shared
    B = a["q"].shape[0]
    qb = _scaled(_q_blocks(a["q"], P), P)                # (nq, B*Hkv, G*bq, D)
    kb = _k_blocks(a["k"], P, transposed=True)            # (nk, B*Hkv, D, bk)
    vb = _k_blocks(a["v"], P)                              # (nk, B*Hkv, bk, Dv)
    bias4 = None if a["bias"] is None else _pad4(a["bias"], P)
    ops = tuple(_pad4(op, P) for op in a["ops"])
    lists = _split_schedule(a["classes"][0])
    skip_full, skip_part = _skips(lists)
    rows = (B * P.Hkv, P.G * P.bq)
    lowp = qb.dtype != P.acc
    A = P.acc

    def tile_step(i, qi, partial):
        def step(t, carry, index):
            m, l, acc = carry
            j = index[t]
            kj, vj = kb[j], vb[j]
            if partial:
                # Keys hidden from a row contribute nothing, whatever their bits:
                # zeroed, and NaN logits for the rows that do see them.
                kj, vj, bad = online.finite_keys(kj, vj, k_axis=1, v_axis=2)
                bad = bad[:, None, :]
            s = jnp.einsum("hqd,hdk->hqk", qi, kj, preferred_element_type=A)
            if lowp:
                s = s * P.scale
            if bias4 is not None:
                s = s + _flat(_to5(_tile(bias4, i, j, P), P, False), B, P, False).astype(A)
            term = _term(mask, ops, bidx, i, j, P, False)
            if term is not None:
                s = s + term
            if P.softcap is not None:
                s = P.softcap * jnp.tanh(s / P.softcap)
            if partial:
                ok = _flat(_allowed(mask, ops, bidx, i, j, P, False), B, P, False)
                s = jnp.where(ok, jnp.where(bad, jnp.nan, s), -jnp.inf)
            m_new = online.running_max(m, s)  # (no derivative: the tangent pass)
            # A row with nothing visible yet keeps m = -inf; 0 avoids inf - inf.
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_use[..., None])
            alpha = jnp.exp(m - m_use)
            l = l * alpha + p.sum(-1)
            if P.rate > 0:
                keep = _flat(_keep(seed, bidx, i, j, P, False), B, P, False)
                p = jnp.where(keep, p * (1.0 / (1.0 - P.rate)), 0.0)
            pv = jnp.einsum("hqk,hkd->hqd", p.astype(vb.dtype), vj,
                            preferred_element_type=A)
            return m_new, l, acc * alpha[..., None] + pv
        return step

    def q_block(xs):
        qi, i, *sched = xs
        fidx, fn, pidx, pn = _row_lists(sched)
        carry = varying_like((jnp.full(rows, -jnp.inf, A), jnp.zeros(rows, A),
                              jnp.zeros(rows + (P.Dv,), A)), a, shared, bidx)
        full_step = tile_step(i, qi, False)
        part_step = tile_step(i, qi, True)
        if not skip_full:
            carry = lax.fori_loop(0, fn, lambda t, c: full_step(t, c, fidx), carry)
        if not skip_part:
            carry = lax.fori_loop(0, pn, lambda t, c: part_step(t, c, pidx), carry)
        m, l, acc = carry
        if sinks is not None:
            sk = jnp.broadcast_to(sinks.astype(A).reshape(1, P.Hkv, P.G, 1),
                                  (B, P.Hkv, P.G, P.bq)).reshape(rows)
            acc, m, l = online.join_sink(acc, m, l, sk)
        safe = jnp.where(l > 0, l, 1.0)
        out = acc / safe[..., None]
        # (a row that saw a non-finite key has a NaN state: NaN lse, not -inf)
        lse, lse_lo = online.lse_parts(m, l)
        return out.astype(qb.dtype), lse, lse_lo

    outs, lses, los = lax.map(q_block, (qb, jnp.arange(P.nq, dtype=jnp.int32), *lists))
    # (nq, B*Hkv, G*bq, Dv) -> (B, Tq, Hq, Dv)
    out = outs.reshape(P.nq, B, P.Hkv, P.G, P.bq, P.Dv).transpose(1, 0, 4, 2, 3, 5)
    out = out.reshape(B, P.nq * P.bq, P.Hq, P.Dv)[:, :P.Tq]

    def rows_out(x):  # (nq, B*Hkv, G*bq) -> (B, Hq, Tq)
        x = x.reshape(P.nq, B, P.Hq, P.bq).transpose(1, 2, 0, 3)
        return x.reshape(B, P.Hq, P.nq * P.bq)[..., :P.Tq]
    return (out, rows_out(lses), rows_out(los)), carry


# ----------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------


def _backward(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse):
    P = _plan(cfg, backward=True, dtype=q.dtype)
    A = P.acc
    classes = _classes(mask, P)
    per_row = _batch_rows(P, classes)
    delta = online.delta_rows(out, d_out, d_lse, A)          # (B, Hq, Tq)
    # Rows with lse = -inf have no probability mass: p = exp(s - inf) = 0, and
    # so do rows of a +inf sink; a NaN row (it saw a non-finite key) stays NaN.
    lse_safe = jnp.where(lse == -jnp.inf, jnp.inf, lse).astype(A)
    lse_lo = lse_lo.astype(A)
    bias4 = _bias4(bias)
    shared_bias = bias4 is not None and per_row and bias4.shape[0] == 1
    batched = dict(q=q, k=k, v=v, do=d_out, lse=lse_safe, lse_lo=lse_lo, delta=delta,
                   classes=classes,
                   bias=None if shared_bias else bias4,
                   ops=tuple(mask.operands()) if mask is not None else ())
    dbias0 = jnp.zeros(_pad4(bias4, P).shape, A) if shared_bias else None
    # the gradients of the term's operands (cfg.term_grad), whole, over all rows
    term_ops = _term_grad_operands(cfg, mask)
    ops_all = batched["ops"]
    dterm0 = tuple(jnp.zeros(_pad4(ops_all[n], P).shape, A) for n in term_ops)
    dbias0, dterm0 = varying_like((dbias0, dterm0), batched, mask, seed)
    (dq, dk, dv, dbias), (dbias_shared, dterm) = _by_batch(
        P, per_row, _backward_rows, batched,
        (mask, seed, bias4 if shared_bias else None, term_ops), (dbias0, dterm0))
    if shared_bias:
        dbias = dbias_shared
    if dbias is not None:
        dbias = dbias[:, :, :P.Tq if dbias.shape[2] > 1 else 1, :P.Tk if dbias.shape[3] > 1 else 1]
        dbias = dbias.reshape(bias.shape).astype(bias.dtype)
    dsinks = None
    if sinks is not None:
        dsinks = online.sink_grad(sinks, lse, lse_lo, delta).astype(sinks.dtype)
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, dsinks)
    if not cfg.term_grad:
        return grads
    d_ops = {n: g[tuple(slice(0, s) for s in ops_all[n].shape)]
             for n, g in zip(term_ops, dterm)}
    return grads + position_bias.leaf_cotangents(mask, cfg.term_grad, d_ops)


def _term_grad_operands(cfg, mask) -> tuple:
    """The indices in ``mask.operands()`` whose gradient the backward computes:
    the position term's, when ``cfg.term_grad`` asks for its arrays'."""
    return tuple(position_bias.term_operands(mask)) if cfg.term_grad else ()


def _backward_rows(P: _Plan, bidx, a, shared, carry):
    mask, seed, bias_shared, term_ops = shared
    dbias_shared, dterm_all = carry
    B = a["q"].shape[0]
    qb = _scaled(_q_blocks(a["q"], P), P)                      # (nq, B*Hkv, G*bq, D)
    qtb = _scaled(_q_blocks(a["q"], P, transposed=True), P)    # (nq, B*Hkv, D, G*bq)
    dob = _q_blocks(a["do"], P)                                 # (nq, B*Hkv, G*bq, Dv)
    dotb = _q_blocks(a["do"], P, transposed=True)               # (nq, B*Hkv, Dv, G*bq)
    kb = _k_blocks(a["k"], P)                                   # (nk, B*Hkv, bk, D)
    ktb = _k_blocks(a["k"], P, transposed=True)                 # (nk, B*Hkv, D, bk)
    vb = _k_blocks(a["v"], P)                                   # (nk, B*Hkv, bk, Dv)
    lseb = _rows_blocks(a["lse"], P, jnp.inf)[:, :, None]       # (nq, B*Hkv, 1, G*bq)
    lolb = _rows_blocks(a["lse_lo"], P)[:, :, None]
    deltab = _rows_blocks(a["delta"], P)[:, :, None]
    bias = bias_shared if bias_shared is not None else a["bias"]
    bias4 = None if bias is None else _pad4(bias, P)
    ops = tuple(_pad4(op, P) for op in a["ops"])
    lists = _split_schedule(a["classes"][0], transpose=True)
    skip_full, skip_part = _skips(lists)
    lowp = qb.dtype != P.acc
    dtype = qb.dtype
    A = P.acc

    def tile_step(j, kj, ktj, vj, partial, bad):
        # Tiles are (B*Hkv, bk, G*bq): every product below is a plain matmul.
        def step(t, carry, index):
            dqt, dbias, dterm, dkj, dvj = carry
            i = index[t]
            s = jnp.einsum("hkd,hdq->hkq", kj, qtb[i], preferred_element_type=A)
            if lowp:
                s = s * P.scale
            if bias4 is not None:
                s = s + _flat(_to5(_tile(bias4, i, j, P), P, True), B, P, True).astype(A)
            term = _term(mask, ops, bidx, i, j, P, True)
            if term is not None:
                s = s + term
            th = None
            if P.softcap is not None:
                th = jnp.tanh(s / P.softcap)
                s = P.softcap * th
            if partial:
                ok = _flat(_allowed(mask, ops, bidx, i, j, P, True), B, P, True)
                s = jnp.where(ok, jnp.where(bad, jnp.nan, s), -jnp.inf)
            # lse's rounding error restores the row sum that |lse| >> log(l) lost.
            p = jnp.exp((s - lseb[i]) - lolb[i])
            dp = jnp.einsum("hkd,hdq->hkq", vj, dotb[i], preferred_element_type=A)
            if P.rate > 0:
                keep = _flat(_keep(seed, bidx, i, j, P, True), B, P, True)
                inv = 1.0 / (1.0 - P.rate)
                pd = jnp.where(keep, p * inv, 0.0)
                dp = jnp.where(keep, dp * inv, 0.0)
            else:
                pd = p
            dvj = dvj + jnp.einsum("hkq,hqd->hkd", pd.astype(dtype), dob[i],
                                   preferred_element_type=A)
            ds = p * (dp - deltab[i])
            if th is not None:
                ds = ds * (1.0 - th * th)
            if dbias is not None:
                dbias = _add_dbias(dbias, ds, i, j, P)
            if term_ops:
                dterm = _add_dterm(dterm, ds, mask, ops, term_ops, bidx, i, j, P)
            dsc = ds.astype(dtype)
            dkj = dkj + jnp.einsum("hkq,hqd->hkd", dsc, qb[i], preferred_element_type=A)
            dqi = jnp.einsum("hdk,hkq->hdq", ktj, dsc, preferred_element_type=A)
            dqt = lax.dynamic_update_index_in_dim(dqt, dqt[i] + dqi, i, 0)
            return dqt, dbias, dterm, dkj, dvj
        return step

    def kv_block(carry, xs):
        dqt, dbias, dterm = carry
        kj, ktj, vj, j, *sched = xs
        fidx, fn, pidx, pn = _row_lists(sched)
        full_step = tile_step(j, kj, ktj, vj, False, None)
        # PARTIAL tiles: keys with a non-finite K or V are zeroed (so that dp = dO.v
        # and dq = dS.k stay finite where dS is 0) and NaN for the rows that see them.
        kjs, vjs, bad = online.finite_keys(kj, vj)
        ktjs = jnp.where(jnp.isfinite(ktj), ktj, jnp.zeros((), ktj.dtype))
        part_step = tile_step(j, kjs, ktjs, vjs, True, bad[:, :, None])
        inner = (dqt, dbias, dterm) + varying_like(
            (jnp.zeros((B * P.Hkv, P.bk, P.D), A), jnp.zeros((B * P.Hkv, P.bk, P.Dv), A)),
            a, shared, bidx)
        if not skip_full:
            inner = lax.fori_loop(0, fn, lambda t, c: full_step(t, c, fidx), inner)
        if not skip_part:
            inner = lax.fori_loop(0, pn, lambda t, c: part_step(t, c, pidx), inner)
        dqt, dbias, dterm, dkj, dvj = inner
        return (dqt, dbias, dterm), (dkj, dvj)

    dbias0 = dbias_shared
    if dbias0 is None and bias4 is not None:
        dbias0 = jnp.zeros(bias4.shape, A)
    # this call's rows of the term gradients (the rows of operands per batch row)
    dterm0 = tuple(jnp.zeros(ops[n].shape, A) for n in term_ops)
    dqt0 = jnp.zeros((P.nq, B * P.Hkv, P.D, P.G * P.bq), A)
    dqt0, dbias0, dterm0 = varying_like((dqt0, dbias0, dterm0), a, shared, bidx)
    (dqt, dbias, dterm), (dk, dv) = lax.scan(
        kv_block, (dqt0, dbias0, dterm0),
        (kb, ktb, vb, jnp.arange(P.nk, dtype=jnp.int32), *lists))
    # dq: (nq, B*Hkv, D, G*bq) -> (B, Tq, Hq, D)
    dq = dqt.reshape(P.nq, B, P.Hkv, P.D, P.G, P.bq).transpose(1, 0, 5, 2, 4, 3)
    dq = dq.reshape(B, P.nq * P.bq, P.Hq, P.D)[:, :P.Tq] * P.scale
    # dk, dv: (nk, B*Hkv, bk, E) -> (B, Tk, Hkv, E); f32 queries were pre-scaled.
    dk = dk.reshape(P.nk, B, P.Hkv, P.bk, P.D).transpose(1, 0, 3, 2, 4)
    dk = dk.reshape(B, P.nk * P.bk, P.Hkv, P.D)[:, :P.Tk]
    if lowp:
        dk = dk * P.scale
    dv = dv.reshape(P.nk, B, P.Hkv, P.bk, P.Dv).transpose(1, 0, 3, 2, 4)
    dv = dv.reshape(B, P.nk * P.bk, P.Hkv, P.Dv)[:, :P.Tk]
    dterm_all = tuple(_add_rows(acc, g, bidx) for acc, g in zip(dterm_all, dterm))
    if bias_shared is not None:
        return (dq, dk, dv, None), (dbias, dterm_all)
    return (dq, dk, dv, dbias), (dbias_shared, dterm_all)


def _add_rows(acc, g, bidx):
    """Adds ``g``, the gradient of one call's rows of an operand (all of them,
    or the row ``bidx[0]`` of one varying along the batch), into ``acc``."""
    if g.shape[0] == acc.shape[0]:
        return acc + g
    return lax.dynamic_update_index_in_dim(acc, acc[bidx[0]] + g[0], bidx[0], 0)


def _add_dterm(dterm, ds, mask, ops, term_ops, bidx, i, j, P: _Plan):
    """Adds a transposed tile's d(logits) into the gradients of the term's
    operands: the transpose of :func:`_term` (a slice of each operand, then the
    term's elementwise function) applied to ``ds``."""
    def value(*xs):
        ops_ = list(ops)
        for n, x in zip(term_ops, xs):
            ops_[n] = x
        return _term(mask, ops_, bidx, i, j, P, True)

    _, back = jax.vjp(value, *[ops[n] for n in term_ops])
    return tuple(d + g for d, g in zip(dterm, back(ds.astype(P.acc))))


def _add_dbias(dbias, ds, i, j, P: _Plan):
    """Adds a transposed tile's d(logits) to the bias gradient, reduced to its shape."""
    Bb, Hb, Tqb, Tkb = dbias.shape
    B = ds.shape[0] // P.Hkv
    g = ds.reshape(B, P.Hkv, P.bk, P.G, P.bq).transpose(0, 1, 3, 4, 2)
    g = g.reshape(B, P.Hq, P.bq, P.bk)
    axes = tuple(a for a, n in enumerate((Bb, Hb, Tqb, Tkb)) if n == 1 and g.shape[a] > 1)
    if axes:
        g = g.sum(axes, keepdims=True)
    start = tuple(jnp.asarray(s, jnp.int32)
                  for s in (0, 0, i * P.bq if Tqb > 1 else 0, j * P.bk if Tkb > 1 else 0))
    cur = lax.dynamic_slice(dbias, start, g.shape)
    return lax.dynamic_update_slice(dbias, cur + g, start)


# ----------------------------------------------------------------------------------
# Tangent (forward-mode differentiation)
# ----------------------------------------------------------------------------------


def tangent(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, tq, tk, tv, tbias,
            tsinks, *tterms):
    """(d_out, d_lse) for the tangents of (q, k, v, bias, sinks) and of the
    position term's arrays in ``cfg.term_grad`` (``tterms``): ``jax.jvp`` of
    the blockwise forward, one pass over the same tiles (empty ones skipped)
    carrying each tile's tangent beside its values, in O(T) memory. It is plain
    XLA, so every flash lowering uses it as its tangent pass, on every platform.
    """
    del out, lse, lse_lo
    which = cfg.term_grad
    leaves = jax.tree_util.tree_leaves(mask)

    def f(q, k, v, bias, sinks, *terms):
        m = position_bias.with_leaves(mask, which, terms)
        out, lse, _ = _forward(cfg, q, k, v, bias, sinks, m, seed)
        return out, lse

    _, (d_out, d_lse) = jax.jvp(f, (q, k, v, bias, sinks, *[leaves[i] for i in which]),
                                (tq, tk, tv, tbias, tsinks, *tterms))
    return d_out, d_lse


LOWERING = Lowering("flash-xla", _forward, _backward, tangent)
