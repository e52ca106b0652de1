"""The Pallas Mosaic lowering of paged attention (TPU).

Two kernels:

* ``_attn_kernel``, grid ``(work items, kv heads, splits)``. The work list and
  the page table are **scalar-prefetched** into SMEM
  (``PrefetchScalarGridSpec``); the item's query tile (``block_q`` tokens x the
  GQA group's heads as rows, gathered by the wrapper) arrives through an
  ordinary BlockSpec. The pools stay in HBM (``memory_space=pl.ANY``): the
  kernel loops over its item's key blocks ``[k_lo, k_hi)`` (from the mask's
  ``tile_bounds``), each block ``pages_per_block`` pages long, copying the
  pages of block ``b + 1`` into one half of a double buffer while it computes
  on block ``b`` in the other. One DMA per (kv head, page): the heads-major
  pool makes every page a contiguous ``page_size x D`` tile. Invalid page
  entries (-1) are copied from page 0 and their keys masked.
* ``_write_kernel`` (the cache-writing form), grid ``(work items,)``: one
  HBM-to-HBM DMA per (new token, kv head) into its slot of the pools, which are
  aliased to the outputs (``input_output_aliases``): in place when donated.
  Invalid slots are skipped. The attention kernel then reads the updated pools.

**Quantized pools** (:mod:`fnattn.quant`): each page's codes are copied whole
into their own ``(page_size, D)`` tile of the buffer (aligned for every
storage dtype), converted to the compute dtype after the copy, and the scales
are applied to the logits (keys) and to the probabilities (values), where
they lie along the lanes: a per-tensor scale from SMEM, or per token the
page's ``(1, page_size)`` row of the scale pool, copied beside the codes and
placed along the block's lanes by exact one-hot products. The packed 4-bit
format is two nibble planes (channels j and j + D/2), each its own product.
The update form writes quantized pools with XLA (:func:`fnattn.quant.write`)
first. **Latent pools** (``value_dim``): the values are the key tile.

Statistics (running max and sum) are (rows, 1) columns; ``lse`` leaves the
kernel lane-replicated as (rows, 128), a legal TPU block. The page size must be
a multiple of 8 (a page is copied to a sublane-aligned offset of the buffer).

float16 runs in float32 (TPUs have no float16 arithmetic). Symbolic sizes
(``jax.export``) are refused (:func:`unsupported`): the scalar-prefetched work
list and page table must have static shapes; ``impl="auto"`` runs such calls
with the XLA lowering on TPU.
"""

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fnattn import _checks, _functions
from fnattn import _online as online
from fnattn import _varying, cost, quant
from fnattn.paged import common, xla
from fnattn.paged.common import F32, I32, Cfg, Meta

__all__ = ["forward", "forward_interpret", "unsupported", "write_tokens"]

LANES = 128
NT = (((1,), (1,)), ((), ()))  # a @ b.T
NF = len(common.FIELDS)
MIN_ROWS = 16
DEFAULT_BLOCK_Q = 8
DEFAULT_KEYS_PER_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class _K(common.KernelFacts):
    G: int
    Gp: int
    M: int
    ppb: int         # pages per key block
    ps: int
    P: int
    splits: int
    scale: float
    softcap: Optional[float]
    mask_treedef: Any
    sinks: bool
    term_treedef: Any = None   # a position term, or None
    n_terms: int = 0           # its arrays: (n, Hq) flat in SMEM
    Hkv: int = 0
    kq: Any = None             # k_pages' QuantFormat (fnattn.quant), or None: float
    vq: Any = None             # v_pages' QuantFormat, or None
    latent: bool = False       # no v_pages: the values are the key tile (value_dim)

    @property
    def C(self) -> int:
        return self.ppb * self.ps


def _attn_kernel(work_ref, pt_ref, *refs, K: _K):
    it = iter(refs)
    q_ref, k_hbm = next(it), next(it)
    ks_ref = next(it) if K.kq is not None else None
    v_hbm = None if K.latent else next(it)
    vs_ref = next(it) if K.vq is not None else None
    sinks_ref = next(it) if K.sinks else None
    terms_ref = next(it) if K.n_terms else None
    o_ref, lse_ref, kbuf = next(it), next(it), next(it)
    ksbuf = next(it) if K.kq is not None and K.kq.per_token else None
    vbuf = None if K.latent else next(it)
    vsbuf = next(it) if K.vq is not None and K.vq.per_token else None
    sem = next(it)
    w, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f = {name: work_ref[w * NF + i] for name, i in common.FIELDS.items()}
    seq, kv_len = f["seq"], f["kv_len"]
    lo, hi = common.split_range(f["k_lo"], f["k_hi"], sp, K.splits)

    def page_of(b, i):
        lp = jnp.minimum(b * K.ppb + i, K.P - 1)
        return pt_ref[seq * K.P + lp]

    def copies(b, slot):
        out = []
        pools = [(k_hbm, kbuf, K.kq, 0)]
        if not K.latent:
            pools.append((v_hbm, vbuf, K.vq, 1))
        for i in range(K.ppb):
            page = jnp.maximum(page_of(b, i), 0)
            rows = pl.ds(i * K.ps, K.ps)
            for hbm, buf, fmt, n in pools:
                # a quantized pool's pages land whole in their own (ps, D) tile of
                # the buffer, aligned for every storage dtype
                dst = buf.at[slot, rows] if fmt is None else buf.at[slot, i]
                out.append(pltpu.make_async_copy(hbm.at[h, page], dst, sem.at[I32(n), slot]))
            for s_hbm, sbuf, n in ((ks_ref, ksbuf, 2), (vs_ref, vsbuf, 3)):
                if sbuf is not None:   # the page's per-token scales, one (1, ps) row
                    out.append(pltpu.make_async_copy(s_hbm.at[h, pl.ds(page, 1)],
                                                     sbuf.at[slot, i], sem.at[I32(n), slot]))
        return out

    def start(b, slot):
        for c in copies(b, slot):
            c.start()

    def key_valid(b, shape, axis=0):
        """Which entries of a tile of block b (keys along ``axis``) hold a key of the
        sequence."""
        r = lax.broadcasted_iota(I32, shape, axis)
        ok = b * K.C + r < kv_len
        for i in range(K.ppb):
            ok = ok & ((lax.div(r, I32(K.ps)) != i) | (page_of(b, i) >= 0))
        return ok

    @pl.when(lo < hi)
    def _():
        start(lo, I32(0))   # (int32 indices: Python ints are int64 under x64)

    two = K.kq is not None and K.kq.per_byte == 2
    q_planes = [q_ref[0], q_ref[1]] if two else [q_ref[...]]
    shape = (K.M, K.C)
    r_i = lax.broadcasted_iota(I32, shape, 0)
    t_i, g_i = lax.div(r_i, I32(K.Gp)), lax.rem(r_i, I32(K.Gp))
    c_i = lax.broadcasted_iota(I32, shape, 1)
    mask, term = K.mask(), K.term()
    if term is not None:  # the term's per-head arrays, one value per row
        cols = [online.group_sink_column(terms_ref, n * K.Hkv + h, K.G, K.Gp, K.M)
                for n in range(K.n_terms)]

    def tiles(buf, fmt, slot):
        """The block's values as planes of (C, width) tiles in the compute dtype:
        a float pool's tile; a quantized pool's codes (before their scales), the
        packed 4-bit format's two nibble planes (channels j and j + D/2)."""
        if fmt is None:
            return [buf[slot]]
        codes = buf[slot]                                   # (ppb, ps, stored D)
        n = codes.shape[-1]
        if fmt.per_byte == 1:
            return [codes.astype(F32).reshape(K.C, n).astype(q_planes[0].dtype)]
        b = codes.astype(I32)                               # 0..255
        lo_ = lax.shift_right_arithmetic(lax.shift_left(b, I32(28)), I32(28))
        hi_ = lax.shift_right_arithmetic(lax.shift_left(b, I32(24)), I32(28))
        return [x.astype(F32).reshape(K.C, n).astype(q_planes[0].dtype) for x in (lo_, hi_)]

    def scale_row(s_ref, sbuf, fmt, b, slot):
        """``(scale, bad)``: the block's scales as a (1, C) row (per token; a
        scalar per tensor) and the keys of the sequence whose scale is not finite
        ((1, C) bool, or None). Scales of keys that are not the sequence's, and
        non-finite ones, are 0 in the row: the pages' rows are placed along the
        lanes by exact one-hot products, in which one NaN would reach every key."""
        if fmt is None:
            return None, None
        if not fmt.per_token:
            return s_ref[0], None
        lane = lax.broadcasted_iota(I32, (1, K.ps), 1)
        row = bad = None
        for i in range(K.ppb):
            srow = sbuf[slot, i]                                      # (1, ps)
            mine = (b * K.C + i * K.ps + lane < kv_len) & (page_of(b, i) >= 0)
            fin = jnp.isfinite(srow)
            clean = jnp.where(mine & fin, srow, 0.0)
            flag = jnp.where(mine & ~fin, 1.0, 0.0).astype(F32)
            if K.ppb == 1:
                return clean, flag > 0
            sel = (lax.broadcasted_iota(I32, (K.ps, K.C), 1)
                   == lax.broadcasted_iota(I32, (K.ps, K.C), 0) + i * K.ps).astype(F32)
            put = lambda x: lax.dot_general(  # noqa: E731
                jnp.broadcast_to(x, (8, K.ps)), sel, (((1,), (0,)), ((), ())),
                precision=lax.Precision.HIGHEST, preferred_element_type=F32)[0:1]
            row = put(clean) if row is None else row + put(clean)
            bad = put(flag) if bad is None else bad + put(flag)
        return row, bad > 0

    def body(b, carry):
        slot = lax.rem(b - lo, I32(2))

        @pl.when(b + 1 < hi)
        def _():
            start(b + 1, 1 - slot)

        for c in copies(b, slot):
            c.wait()
        ks, kbad = scale_row(ks_ref, ksbuf, K.kq, b, slot)
        vs, vbad = (ks, kbad) if K.latent else scale_row(vs_ref, vsbuf, K.vq, b, slot)
        k = tiles(kbuf, K.kq, slot)
        v = k if K.latent else tiles(vbuf, K.vq, slot)
        # Slots past the length and pages the sequence does not own (copied from
        # page 0 or another sequence's page) may hold anything, NaN included: their
        # values are zeroed, so that p = 0 gives 0 (0 * NaN would be NaN).
        v = [jnp.where(key_valid(b, x.shape), x, jnp.zeros_like(x)) for x in v]
        bad = None
        if mask is not None:
            # Keys of the sequence that the mask hides from some rows: the rule of
            # fnattn._online.finite_keys, with the non-finite keys counted per
            # row by a product (a per-key vector would need a lane transpose).
            k, v, bad = _nonfinite_tiles(k, v, K.M)
        s = sum(lax.dot_general(qp, kp, NT, preferred_element_type=F32)
                for qp, kp in zip(q_planes, k)) * K.scale
        if ks is not None:
            s = s * ks
        for flags in (kbad, vbad):
            if flags is not None:
                bad = flags if bad is None else bad | flags
        kpos = b * K.C + c_i
        pos = common.positions(seq, h * K.G + g_i, f["row0"] + t_i, f["q_pos"] + t_i, kpos)
        if term is not None:   # added before the cap
            s = s + jnp.broadcast_to(term.value(pos, cols), s.shape)
        if K.softcap is not None:
            s = K.softcap * jnp.tanh(s / K.softcap)
        if bad is not None:
            s = jnp.where(bad, jnp.nan, s)
        ok = kpos < kv_len
        for i in range(K.ppb):  # keys of invalid pages are masked
            ok = ok & ((lax.div(c_i, I32(K.ps)) != i) | (page_of(b, i) >= 0))
        if mask is not None:
            ok = ok & mask.predicate(pos, [])
        s = jnp.where(ok, s, -jnp.inf)
        if vs is None and len(v) == 1:
            m, l, acc = online.step_exp((carry[0], carry[1], carry[2][0]), s, v[0])
            return m, l, (acc,)
        return _step_planes(carry, s, v, vs)

    m = jnp.full((K.M, 1), -jnp.inf, F32)
    l = jnp.zeros((K.M, 1), F32)
    v_two = (K.kq if K.latent else K.vq) is not None and \
        (K.kq if K.latent else K.vq).per_byte == 2
    width = o_ref.shape[-1]
    acc = tuple(jnp.zeros((K.M, width), F32) for _ in range(2 if v_two else 1))
    m, l, acc = lax.fori_loop(lo, hi, body, (m, l, acc))
    if K.sinks:
        sink = online.group_sink_column(sinks_ref, h, K.G, K.Gp, K.M)
        joined = [online.join_sink(a, m, l, sink) for a in acc]  # (m, l: the same each)
        acc, m, l = tuple(j[0] for j in joined), joined[0][1], joined[0][2]
    ok = l > 0
    safe = jnp.where(ok, l, 1.0)
    if len(acc) == 1:
        o_ref[...] = (acc[0] / safe).astype(o_ref.dtype)
    else:
        for n, a in enumerate(acc):
            o_ref[n] = (a / safe).astype(o_ref.dtype)
    lse = jnp.where(ok, m + jnp.log(safe), -jnp.inf)
    lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _step_planes(carry, s, v, v_scale):
    """:func:`fnattn._online.step_exp` for values in planes (the 4-bit format's two
    nibble planes) and with their scales (a (1, C) row of per-token scales or a
    per-tensor scalar) applied to the probabilities before the product."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_use)
    alpha = jnp.exp(m - m_use)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    pw = p if v_scale is None else p * v_scale
    acc = tuple(a * alpha + lax.dot_general(pw.astype(x.dtype), x, (((1,), (0,)), ((), ())),
                                            preferred_element_type=F32)
                for a, x in zip(acc, v))
    return m_new, l, acc


def _nonfinite_tiles(k, v, rows: int):
    """:func:`_nonfinite_logits` for keys and values in planes (lists of tiles)."""
    ind = jnp.bfloat16
    bad = jnp.zeros((rows, k[0].shape[0]), F32)
    out = []
    for tiles in (k, v):
        clean = []
        for x in tiles:
            fx = jnp.isfinite(x.astype(F32))
            bad = bad + lax.dot_general(jnp.ones((rows, x.shape[1]), ind), (~fx).astype(ind),
                                        NT, preferred_element_type=F32)
            clean.append(jnp.where(fx, x, jnp.zeros_like(x)))
        out.append(clean)
    return out[0], out[1], bad > 0


def _nonfinite_logits(k, v, rows: int):
    """``(k, v, bad)`` for a tile of keys (C, D) and values (C, Dv): non-finite
    entries zeroed, and ``bad`` (rows, C) true in the columns of keys whose K or V
    held one (the same for every row: a product of ones with the indicators, which
    lands the per-key answer along lanes without a transpose; 0/1 counts are exact
    in bfloat16 operands with a float32 result)."""
    # (TPUs test finiteness in float32 only)
    fk, fv = jnp.isfinite(k.astype(F32)), jnp.isfinite(v.astype(F32))
    ind = jnp.bfloat16
    bad = lax.dot_general(jnp.ones((rows, k.shape[1]), ind), (~fk).astype(ind), NT,
                          preferred_element_type=F32)
    bad = bad + lax.dot_general(jnp.ones((rows, v.shape[1]), ind), (~fv).astype(ind), NT,
                                preferred_element_type=F32)
    return jnp.where(fk, k, jnp.zeros_like(k)), jnp.where(fv, v, jnp.zeros_like(v)), bad > 0


def _write_kernel(work_ref, pt_ref, *refs, ps: int, P: int, Hkv: int, latent: bool):
    # (the pool inputs are aliased to the outputs)
    if latent:   # a latent pool: the keys (latent and rope channels) only
        (nk_hbm, _, ko_hbm, sem), nv_hbm, vo_hbm = refs, None, None
    else:
        nk_hbm, nv_hbm, _, _, ko_hbm, vo_hbm, sem = refs
    w = pl.program_id(0)
    f = {name: work_ref[w * NF + i] for name, i in common.FIELDS.items()}

    def write(t, carry):
        pos = f["q_pos"] + t
        posc = jnp.maximum(pos, 0)
        page = pt_ref[f["seq"] * P + jnp.minimum(lax.div(posc, I32(ps)), P - 1)]
        ok = (pos >= 0) & (pos < P * ps) & (page >= 0)

        @pl.when(ok)
        def _():
            off = lax.rem(posc, I32(ps))
            cs = []
            for h in map(I32, range(Hkv)):  # (int32 indices: Python ints are int64 in x64)
                cs.append(pltpu.make_async_copy(nk_hbm.at[f["tok"] + t, h],
                                                ko_hbm.at[h, page, off], sem.at[I32(0)]))
                if not latent:
                    cs.append(pltpu.make_async_copy(nv_hbm.at[f["tok"] + t, h],
                                                    vo_hbm.at[h, page, off], sem.at[I32(1)]))
            for c in cs:
                c.start()
            for c in cs:
                c.wait()
        return carry

    lax.fori_loop(0, f["rows"], write, jnp.int32(0))


def _compute_dtype(dtype):
    return F32 if dtype == jnp.float16 else dtype


def _cost(cfg: Cfg, T, Hkv, G, D, Dv, cd, k_pages, v_pages=None):
    """Upper bounds (the lengths are data): every token sees a whole sequence's
    pages, and the kernel reads at most every page of the pool once per kv head
    (a quantized pool: its codes and scales; a latent pool: the keys once)."""
    size = jnp.dtype(cd).itemsize
    keys = cfg.pages_per_seq * cfg.page_size
    pool_keys = math.prod(k_pages.shape) // (Hkv * D)

    def pool_bytes(x, dim):
        if x is None:
            return 0
        if quant.is_quantized(x):
            return x.nbytes
        return pool_keys * Hkv * dim * size

    cache = pool_bytes(k_pages, D) + pool_bytes(v_pages, Dv)
    return cost.serving(T, Hkv * G, keys, D, Dv, softcap=cfg.softcap is not None,
                        cache_bytes=cache, io_bytes=T * Hkv * G * (D + Dv) * size)


def write_tokens(cfg: Cfg, meta: Meta, k_pages, v_pages, new_k, new_v, *, interpret=False):
    """The pools with the new tokens written at their slots (in place when donated);
    a latent pool (``v_pages`` None) has its keys written only."""
    # One item per sequence: the kernel loops over its tokens.
    bq = cfg.total_tokens if cfg.uniform_q is None else cfg.uniform_q
    work = common.work_list(cfg, meta, bq, cfg.capacity)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    latent = v_pages is None
    kernel = functools.partial(_write_kernel, ps=cfg.page_size, P=cfg.pages_per_seq,
                               Hkv=cfg.num_kv_heads, latent=latent)
    news, pools = ((new_k,), (k_pages,)) if latent else ((new_k, new_v), (k_pages, v_pages))
    n = len(pools)
    out = _varying.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(work.seq.shape[0],),
            in_specs=[any_spec] * (2 * n), out_specs=[any_spec] * n,
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools],
        # Inputs counted after the two scalar-prefetch operands.
        input_output_aliases={2 + n + i: i for i in range(n)},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret, name="fnattn_paged_mosaic_write",
    )(work.stacked().reshape(-1), meta.page_table.reshape(-1), *news, *pools)
    return (out[0], None) if latent else tuple(out)


def unsupported(cfg: Cfg) -> Optional[str]:
    """Why the Mosaic kernel cannot run ``cfg`` (None when it can).

    ``impl="auto"`` then uses the XLA lowering on TPU; ``impl="pallas"`` raises.
    """
    if cfg.page_size % 8:
        return (f"a page size that is a multiple of 8 (got {cfg.page_size}: pages are "
                "copied to 8-row-aligned VMEM slots)")
    names = _checks.symbolic_sizes(total_tokens=cfg.total_tokens, max_seqs=cfg.max_seqs,
                                   num_pages=cfg.num_pages, pages_per_seq=cfg.pages_per_seq)
    if names:
        return (f"static sizes (got symbolic {', '.join(names)} under jax.export: its grid, "
                "its scalar-prefetched work list and page table are sized by them)")
    why = _functions.refusals((cfg.mask(), cfg.term()), _functions.MOSAIC_TPU)
    if why:
        return f"functions it compiles: {'; '.join(why)}"
    return None


def _forward(cfg: Cfg, q, k_pages, v_pages, sinks, meta: Meta, new_k=None, new_v=None, *,
             interpret=False):
    why = unsupported(cfg)
    if why is not None:
        raise NotImplementedError(
            f"paged attention: the Mosaic (TPU) kernel needs {why}. impl='auto' runs such "
            "a cache with the XLA lowering on TPU; impl='xla' does everywhere.")
    latent = v_pages is None
    kq = k_pages.format if quant.is_quantized(k_pages) else None
    vq = v_pages.format if quant.is_quantized(v_pages) else None
    if cfg.update:
        if kq is None and vq is None:
            k_pages, v_pages = write_tokens(cfg, meta, k_pages, v_pages, new_k, new_v,
                                            interpret=interpret)
        else:
            # Quantized pools are written by XLA first: fnattn.quant.write, the codes
            # and scales of fnattn.quant.quantize bit for bit (a DMA moves bytes, it
            # does not quantize).
            k_pages, v_pages = xla.write_tokens(cfg, meta, k_pages, v_pages, new_k, new_v)
    T, Hq, D = q.shape
    Hkv, G, Dv, ps = cfg.num_kv_heads, cfg.group, cfg.v_head_dim, cfg.page_size
    bs = cfg.block_sizes
    Gp = common.pow2(G)
    if cfg.uniform_q is not None:
        bq = cfg.uniform_q
    else:
        bq = min(bs.block_q or DEFAULT_BLOCK_Q, T)
    bq_p = max(common.pow2(bq), common.cdiv(MIN_ROWS, Gp))
    M = bq_p * Gp
    ppb = max(1, (bs.block_k or DEFAULT_KEYS_PER_BLOCK) // ps)
    ppb = min(ppb, cfg.pages_per_seq)
    splits = bs.num_splits or 1  # a TPU has one or two cores: splitting rarely pays
    K = _K(G=G, Gp=Gp, M=M, ppb=ppb, ps=ps, P=cfg.pages_per_seq, splits=splits,
           scale=cfg.scale, softcap=cfg.softcap, mask_treedef=cfg.mask_treedef,
           sinks=sinks is not None and splits == 1, term_treedef=cfg.term_treedef,
           n_terms=0 if meta.terms is None else meta.terms.shape[0], Hkv=Hkv, kq=kq, vq=vq,
           latent=latent)
    work = common.work_list(cfg, meta, bq, K.C)
    W = work.seq.shape[0]
    cd = _compute_dtype(q.dtype)

    # Query tiles per (item, kv head): rows = bq_p tokens x Gp heads.
    idx = jnp.clip(work.tok[:, None] + jnp.arange(bq_p, dtype=I32), 0, T - 1)
    qw = q.astype(cd)[idx].reshape(W, bq_p, Hkv, G, D)
    qw = jnp.pad(qw, ((0, 0), (0, 0), (0, 0), (0, Gp - G), (0, 0)))
    qw = qw.transpose(0, 2, 1, 3, 4).reshape(W, Hkv, M, D)
    k_two = kq is not None and kq.per_byte == 2
    if k_two:   # two planes: the channels of the low and of the high nibbles
        qw = qw.reshape(W, Hkv, M, 2, D // 2).transpose(0, 1, 3, 2, 4)
        q_spec = pl.BlockSpec((None, None, 2, M, D // 2), lambda w, h, s, *_: (w, h, 0, 0, 0))
    else:
        q_spec = pl.BlockSpec((None, None, M, D), lambda w, h, s, *_: (w, h, 0, 0))
    # the output tile: the values' planes (a latent pool's: the keys')
    o_fmt, o_dim = (kq, D) if latent else (vq, Dv)
    o_planes = 2 if o_fmt is not None and o_fmt.per_byte == 2 else 1
    o_width = o_dim // o_planes

    lead = () if splits == 1 else (splits,)
    out_dtype = cd if splits == 1 else F32
    planes = (o_planes,) if o_planes == 2 else ()

    def item_map(w, h, s, *_):
        return ((s,) if splits > 1 else ()) + (w, h) + (0,) * (2 + len(planes))

    def lse_map(w, h, s, *_):
        return ((s,) if splits > 1 else ()) + (w, h, 0, 0)

    blk = (None,) * (1 + (splits > 1))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    in_specs, args, scratch = [q_spec], [qw], []

    def pool(x, fmt, dim):
        if fmt is None:
            in_specs.append(any_spec)
            args.append(x.astype(cd))
            scratch.append(pltpu.VMEM((2, K.C, dim), cd))
            return []
        in_specs.append(any_spec)
        args.append(x.data)
        scratch.append(pltpu.VMEM((2, ppb, ps, x.data.shape[-1]), x.data.dtype))
        if fmt.per_token:
            in_specs.append(any_spec)
            args.append(x.scale)
            return [pltpu.VMEM((2, ppb, 1, ps), F32)]
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(jnp.reshape(x.scale, (1,)).astype(F32))
        return []

    scale_k = pool(k_pages, kq, D)
    scale_v = [] if latent else pool(v_pages, vq, Dv)
    # scratch order of the kernel: kbuf, [ksbuf], [vbuf], [vsbuf], sem
    scratch = [scratch[0], *scale_k, *scratch[1:], *scale_v, pltpu.SemaphoreType.DMA((4, 2))]
    if K.sinks:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(sinks.astype(F32))
    if K.n_terms:   # (n, Hq), flat: one scalar per (array, head)
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(meta.terms.astype(F32).reshape(-1))
    out, lse = _varying.pallas_call(
        functools.partial(_attn_kernel, K=K),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(W, Hkv, splits), in_specs=in_specs,
            out_specs=[pl.BlockSpec(blk + (None,) + planes + (M, o_width), item_map),
                       pl.BlockSpec(blk + (None, M, LANES), lse_map)],
            scratch_shapes=scratch),
        out_shape=[jax.ShapeDtypeStruct(lead + (W, Hkv) + planes + (M, o_width), out_dtype),
                   jax.ShapeDtypeStruct(lead + (W, Hkv, M, LANES), F32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret, name="fnattn_paged_mosaic",
        cost_estimate=_cost(cfg, T, Hkv, G, D, Dv, cd, k_pages, v_pages),
    )(work.stacked().reshape(-1), meta.page_table.reshape(-1), *args)
    if planes:   # (..., 2, M, D/2) -> (..., M, D): the planes are channel halves
        out = jnp.moveaxis(out, -3, -2).reshape(out.shape[:-3] + (M, o_dim))
    out = out[..., :Dv]   # (a latent pool: the keys' first Dv channels)
    lse = lse[..., 0]
    if splits > 1:
        sink = None
        if sinks is not None:
            sink = jnp.pad(sinks.astype(F32).reshape(Hkv, G), ((0, 0), (0, Gp - G)))
            sink = jnp.tile(sink, (1, bq_p))[None]  # (1, Hkv, M)
        out, lse = common.merge_splits(out, lse, sink)
    # Items' rows back to packed tokens.
    out = out.reshape(W, Hkv, bq_p, Gp, Dv)[:, :, :, :G].transpose(0, 2, 1, 3, 4)
    out = out.reshape(W * bq_p, Hq, Dv)
    lse = lse.reshape(W, Hkv, bq_p, Gp)[:, :, :, :G].transpose(0, 2, 1, 3).reshape(W * bq_p, Hq)
    index, valid = _token_index(cfg, meta, bq, bq_p)
    out = jnp.where(valid[:, None, None], out[index], 0).astype(q.dtype)
    lse = jnp.where(valid[:, None], lse[index], -jnp.inf).T
    if cfg.update:
        return out, lse, k_pages, v_pages
    return out, lse


def _token_index(cfg: Cfg, meta: Meta, bq: int, bq_p: int):
    """Each packed token's row among the items' (W * bq_p) rows, and validity."""
    seq, row, valid = common.token_owner(cfg, meta)
    if cfg.uniform_q is not None:
        item, r = seq, row
    else:
        nb = common.cdiv(meta.q_len, bq)
        item = (jnp.cumsum(nb) - nb)[seq] + row // bq
        r = row % bq
    return jnp.where(valid, item * bq_p + r, 0), valid


forward = functools.partial(_forward, interpret=False)
forward_interpret = functools.partial(_forward, interpret=True)
