"""The Pallas Triton lowering of paged attention (NVIDIA GPUs).

One kernel, grid ``(work items, kv heads, splits)``. A program owns one work
item (``block_q`` query tokens of one sequence; a whole sequence's Tq tokens in
``paged_attention``), one kv head and one split of the item's keys, and holds
**all query heads of the GQA group** as rows of one tile: row ``m`` is token
``m // Gp``, head ``m % Gp`` (Gp = the group size rounded up to a power of
two). Every key block is therefore read from HBM once per (item, kv head),
whatever the group size, which is what makes decode bandwidth-bound rather
than latency-bound. Tiles have at least 16 rows (the smallest tensor-core
tile); a one-token decode of a group of 8 pads to 16 rows.

Keys are visited in blocks of ``block_k`` positions, independent of the page
size: each key's pool row is ``page_table[seq, pos // page_size] * page_size +
pos % page_size``, loaded as a gather (Triton has no scalar prefetch, so the
page table is an ordinary input read in the kernel). Page entries are
pre-sanitised (-1 = invalid): invalid pages are read as page 0's rows under a
load mask, i.e. not at all, and their keys are masked. Head dims that are not
powers of two are padded inside the loads (masked columns), so the pools are
never copied.

**Split-K.** With few items (decode at small batch, long contexts) the keys of
an item are cut into ``num_splits`` contiguous ranges, one program each; the
programs write float32 partial outputs and their ``lse``, merged afterwards
(``fnattn.merge``), and the sinks join in the merge. With one split the kernel
applies the sinks and writes the final output in q's dtype.

**Block-sparse range.** Each item visits only the key blocks
``[k_lo, k_hi)`` that the mask's ``tile_bounds`` says may be visible (computed
in the wrapper), so a sliding window over a long context reads the window only.

**Cache update inside the kernel** (``ragged_paged_attention_with_update``):
the pools are aliased to outputs (``input_output_aliases``). Keys at positions
of the *new* tokens are read from the new ``k``/``v`` inputs, not from the
pool, and the split-0 program of each (item, kv head) writes its tokens' rows
into their slots. No program ever reads a slot that another program writes, so
there is no ordering hazard and no second pass.

**Quantized pools** (:mod:`fnattn.quant`): the kernel loads a block's codes
(and, per token, the scales of the same slots: the scale pool is laid out like
the pool without its head dim) and dequantizes them as
:func:`fnattn.quant.dequantize` does (codes and scales in float32, then q's
dtype) before the products; a per-tensor scale is a one-element operand. The
packed 4-bit format's bytes are unpacked into interleaved columns (channel j,
then j + D/2), and q and the output are laid out in that order by the
wrapper, so one product takes the whole head. The update form quantizes with
XLA (:func:`fnattn.quant.write`) before the kernel, which then reads the pool.
**Latent pools** (``value_dim``, no ``v_pages``): the values are the loaded key
tile itself; the output keeps its first ``value_dim`` channels.

**Symbolic sizes** (``jax.export`` shape polymorphism: tokens, sequence slots,
pages) are refused (``NotImplementedError``): the Triton backend has no dynamic
grid. ``impl="auto"`` runs such calls with the XLA lowering on GPUs
(:func:`auto_forward`).
"""

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnattn import _checks, _functions, quant
from fnattn import _online as online
from fnattn import _varying
from fnattn._serving import (MIN_BLOCKS_PER_SPLIT, NUM_SMS, TARGET_PROGRAMS,  # noqa: F401
                             auto_splits)
from fnattn.paged import common, xla
from fnattn.paged.common import F32, I32, Cfg, Meta

__all__ = ["auto_forward", "forward", "forward_interpret", "launch_plan", "symbolic"]

LOG2E, LN2 = online.LOG2E, online.LN2
MIN_ROWS = 16            # tl.dot needs at least 16 rows
@dataclasses.dataclass(frozen=True)
class _K(common.KernelFacts):
    """Static facts of one launch."""

    G: int
    Gp: int
    bq: int          # tokens per item (power of two)
    M: int           # rows per tile (>= 16)
    bk: int          # keys per step
    D: int
    Dp: int
    Dv: int
    Dvp: int
    ps: int
    P: int
    T: int
    splits: int
    scale: float
    softcap: Optional[float]
    mask_treedef: Any
    sinks: bool
    update: bool
    term_treedef: Any = None   # a position term, or None
    n_terms: int = 0           # its arrays, one value per head
    kq: Any = None             # k_pages' QuantFormat (fnattn.quant), or None: float
    vq: Any = None             # v_pages' QuantFormat, or None
    latent: bool = False       # no v_pages: the values are the loaded keys (value_dim)
    Dk_codes: int = 0          # a quantized pool's stored head dim (halved for 4-bit)
    Dk_load: int = 0           # ... padded to a power of two: the columns loaded
    Dv_codes: int = 0
    Dv_load: int = 0


def launch_plan(cfg: Cfg):
    """(block_q, block_k, num_splits, CompilerParams) for a call."""
    bs = cfg.block_sizes
    G = cfg.group
    Gp = common.pow2(G)
    if cfg.uniform_q is not None:
        bq = common.pow2(cfg.uniform_q)
    else:
        # About 64 rows per tile: decode tokens waste at most a tile of rows,
        # prefill tokens share each key block among many rows.
        bq = common.pow2(bs.block_q) if bs.block_q else max(1, 64 // Gp)
        bq = min(bq, common.pow2(cfg.total_tokens))
    wide = max(cfg.head_dim, cfg.v_head_dim) > 128
    bk = common.pow2(bs.block_k) if bs.block_k else (32 if wide else 64)
    bk = max(16, min(bk, common.pow2(cfg.capacity)))
    n_items = common.num_work_items(cfg, bq)
    n_blocks = common.cdiv(cfg.capacity, bk)
    if bs.num_splits:
        splits = bs.num_splits
    else:
        splits = auto_splits(n_items * cfg.num_kv_heads, n_blocks)
    params = plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    return bq, bk, splits, params


def _kernel(work_ref, pt_ref, q_ref, k_ref, *refs, K: _K):
    it = iter(refs)
    ks_ref = next(it) if K.kq is not None else None
    v_ref = None if K.latent else next(it)
    vs_ref = next(it) if K.vq is not None else None
    sinks_ref = next(it) if K.sinks else None
    terms_ref = next(it) if K.n_terms else None
    nk_ref = next(it) if K.update else None
    nv_ref = next(it) if K.update and not K.latent else None
    o_ref, lse_ref = next(it), next(it)
    ko_ref = next(it) if K.update else None
    vo_ref = next(it) if K.update and not K.latent else None
    w, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f = {name: work_ref[w, i] for name, i in common.FIELDS.items()}
    seq, tok, rows, kv_len = f["seq"], f["tok"], f["rows"], f["kv_len"]

    m_i = lax.broadcasted_iota(I32, (K.M,), 0)
    t_i, g_i = lax.div(m_i, I32(K.Gp)), lax.rem(m_i, I32(K.Gp))
    row_ok = t_i < rows
    dcols = lax.broadcasted_iota(I32, (K.Dp,), 0)[None, :]
    vcols = lax.broadcasted_iota(I32, (K.Dvp,), 0)[None, :]
    dmask = None if K.D == K.Dp else dcols < K.D
    vmask = None if K.Dv == K.Dvp else vcols < K.Dv

    def both(a, b):
        return a if b is None else a & b

    q = q_ref[h, pl.ds(tok * K.Gp, K.M), :]
    mask, term = K.mask(), K.term()
    if mask is not None or term is not None:
        qpos_rows = (f["q_pos"] + t_i)[:, None]
        raw_rows = (f["row0"] + t_i)[:, None]
        head_rows = (h * K.G + g_i)[:, None]
    if term is not None:  # the term's per-head arrays at each row
        term_rows = [plgpu.load(terms_ref.at[n, h, g_i])[:, None] for n in range(K.n_terms)]

    def bias_of(kpos):
        if term is None:
            return None
        pos = common.positions(seq, head_rows, raw_rows, qpos_rows, kpos[None, :])
        return jnp.broadcast_to(term.value(pos, term_rows), (K.M, K.bk)).astype(F32)

    def load_kv(ref, new_ref, cols, cmask, slot, ok, kpos):
        if not K.update:
            return plgpu.load(ref.at[h, slot[:, None], cols], mask=both(ok[:, None], cmask),
                              other=0.0)
        is_new = kpos >= f["new_start"]
        old = plgpu.load(ref.at[h, slot[:, None], cols],
                         mask=both((ok & ~is_new)[:, None], cmask), other=0.0)
        trow = jnp.clip(f["seq_tok"] + kpos - f["new_start"], 0, K.T - 1)
        new = plgpu.load(new_ref.at[trow[:, None], h, cols],
                         mask=both((ok & is_new)[:, None], cmask), other=0.0)
        return jnp.where(is_new[:, None], new, old)

    def load_codes(ref, s_ref, fmt, n, width, slot, ok):
        """A quantized tile, dequantized after the load as fnattn.quant.dequantize
        does (codes and scales in float32, then q's dtype). Keys that are not
        loaded (ok False) read codes and scales 0. Packed 4-bit codes are
        unpacked into interleaved columns (channel j, then j + D/2: see
        _to_tile), so that one product takes the whole head."""
        cols = lax.broadcasted_iota(I32, (width,), 0)[None, :]
        cmask = None if n == width else cols < n
        codes = plgpu.load(ref.at[h, slot[:, None], cols], mask=both(ok[:, None], cmask),
                           other=jnp.zeros((), ref.dtype))
        if fmt.per_byte == 1:
            vals = codes.astype(F32)
        else:
            b = codes.astype(I32)                         # 0..255
            lo = lax.shift_right_arithmetic(lax.shift_left(b, I32(28)), I32(28))
            hi = lax.shift_right_arithmetic(lax.shift_left(b, I32(24)), I32(28))
            vals = jnp.stack([lo.astype(F32), hi.astype(F32)], axis=-1)
            vals = vals.reshape(K.bk, 2 * width)
        if fmt.per_token:
            sc = plgpu.load(s_ref.at[h, slot], mask=ok, other=0.0)[:, None]
        else:
            sc = s_ref[0]
        return (vals * sc).astype(q.dtype)

    def load_k(slot, ok, kpos):
        if K.kq is not None:
            return load_codes(k_ref, ks_ref, K.kq, K.Dk_codes, K.Dk_load, slot, ok)
        return load_kv(k_ref, nk_ref, dcols, dmask, slot, ok, kpos)

    def load_v(slot, ok, kpos):
        if K.vq is not None:
            return load_codes(v_ref, vs_ref, K.vq, K.Dv_codes, K.Dv_load, slot, ok)
        return load_kv(v_ref, nv_ref, vcols, vmask, slot, ok, kpos)

    def body(j, carry, full=False):
        """One block of keys; ``full``: inside [0, kv_len) and seen whole by every
        row of the item, so neither the mask nor the sanitising of hidden keys
        runs (keys of missing pages are still never loaded)."""
        kpos = j * K.bk + lax.broadcasted_iota(I32, (K.bk,), 0)
        lpage = jnp.minimum(lax.div(kpos, I32(K.ps)), K.P - 1)
        page = plgpu.load(pt_ref.at[seq, lpage])
        ok = (kpos < kv_len) & (page >= 0)
        slot = jnp.maximum(page, 0) * K.ps + lax.rem(kpos, I32(K.ps))
        k = load_k(slot, ok, kpos)
        if K.latent:   # the values are the keys' first Dv channels: the same tile
            get_v = lambda: k  # noqa: E731
        else:
            get_v = lambda: load_v(slot, ok, kpos)  # noqa: E731
        bad = None
        if mask is not None and not full:
            # Slots past the length and invalid pages are never loaded; keys of the
            # sequence that the mask hides from some rows may still hold NaN.
            if K.latent:
                k, _, bad = online.finite_keys(k, k, triton=True)
                get_v = lambda: k  # noqa: E731
            else:
                k, v, bad = online.finite_keys(k, get_v(), triton=True)
                get_v = lambda: v  # noqa: E731
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        if bad is not None:
            s = jnp.where(bad[None, :], jnp.nan, s)
        allowed = ok[None, :]
        if mask is not None and not full:
            pos = common.positions(seq, head_rows, raw_rows, qpos_rows, kpos[None, :])
            allowed = allowed & mask.predicate(pos, [])
        return online.step_exp2(carry, s, allowed, get_v, scale=K.scale, softcap=K.softcap,
                                bias=bias_of(kpos), natural=K.natural)

    lo, hi = common.split_range(f["k_lo"], f["k_hi"], sp, K.splits)
    # this split's share of the blocks every row sees whole
    fa = jnp.minimum(jnp.maximum(f["f_lo"], lo), hi)
    fb = jnp.minimum(jnp.maximum(f["f_hi"], fa), hi)
    acc = jnp.zeros((K.M, K.Dvp), F32)
    m = jnp.full((K.M,), -jnp.inf, F32)
    l = jnp.zeros((K.M,), F32)
    carry = lax.fori_loop(lo, fa, body, (acc, m, l))
    carry = lax.fori_loop(fa, fb, functools.partial(body, full=True), carry)
    acc, m, l = lax.fori_loop(fb, hi, body, carry)

    if K.sinks:
        sink = plgpu.load(sinks_ref.at[h, g_i])
        acc, m, l = (online.join_sink(acc, m, l, sink, exp=jnp.exp) if K.natural else
                     online.join_sink(acc, m, l, sink * LOG2E, exp=jnp.exp2))
    out, lse = online.finish_exp2(acc, m, l, natural=K.natural)
    rows_ds = pl.ds(tok * K.Gp, K.M)
    cols_ds = pl.ds(I32(0), K.Dvp)   # (not `:`, whose start is int64 under x64)
    if K.splits == 1:
        plgpu.store(o_ref.at[h, rows_ds, cols_ds], out.astype(o_ref.dtype),
                    mask=row_ok[:, None])
        plgpu.store(lse_ref.at[h, rows_ds], lse, mask=row_ok)
    else:
        plgpu.store(o_ref.at[sp, h, rows_ds, cols_ds], out, mask=row_ok[:, None])
        plgpu.store(lse_ref.at[sp, h, rows_ds], lse, mask=row_ok)

    if K.update:
        @pl.when(sp == 0)
        def _write():
            # One token per step: a vector scatter would give masked-off lanes
            # slots that may equal a live lane's, which interpreters (that
            # write back the old value under the mask) would race with.
            def write(t, carry):
                pos = f["q_pos"] + t
                ok = (pos >= 0) & (pos < K.P * K.ps)
                pos = jnp.maximum(pos, 0)
                page = pt_ref[seq, jnp.minimum(lax.div(pos, I32(K.ps)), K.P - 1)]
                ok = ok & (page >= 0)
                slot = jnp.maximum(page, 0) * K.ps + lax.rem(pos, I32(K.ps))
                pairs = ((nk_ref, ko_ref, K.D, dcols[0]),)
                if not K.latent:
                    pairs += ((nv_ref, vo_ref, K.Dv, vcols[0]),)
                for new_ref, out_ref, n, cols in pairs:
                    wmask = ok & (cols < n)
                    x = plgpu.load(new_ref.at[tok + t, h, cols], mask=wmask, other=0.0)
                    plgpu.store(out_ref.at[h, slot, cols], x, mask=wmask)
                return carry

            lax.fori_loop(0, rows, write, jnp.int32(0))


def _widths(fmt, n: int):
    """(tile columns, stored columns, stored columns loaded) of a head dim of ``n``
    channels: float pools load ``pow2(n)`` columns; a quantized pool loads its
    codes, which for the packed 4-bit format are n / 2 bytes a row, unpacked into
    twice the (padded) loaded width."""
    if fmt is None or fmt.per_byte == 1:
        width = common.pow2(max(n, 16))
        return width, n, width
    half = common.pow2(max(n // 2, 8))
    return 2 * half, n // 2, half


def _to_tile(x, n: int, fmt, width: int):
    """x (..., n) in the column order of a tile of ``width`` columns: zero padded;
    for a packed 4-bit pool interleaved (column 2j = channel j, 2j + 1 = channel
    j + n/2), the order in which the kernel unpacks the two nibbles of byte j."""
    lead = x.shape[:-1]
    if fmt is None or fmt.per_byte == 1:
        return jnp.pad(x, [(0, 0)] * len(lead) + [(0, width - n)])
    half = x.reshape(*lead, 2, n // 2)
    half = jnp.pad(half, [(0, 0)] * (len(lead) + 1) + [(0, width // 2 - n // 2)])
    return jnp.swapaxes(half, -1, -2).reshape(*lead, width)


def _from_tile(x, full: int, keep: int, fmt, width: int):
    """The first ``keep`` channels of a tile laid out by :func:`_to_tile` for a head
    dim of ``full`` (``keep < full``: a latent pool's values)."""
    lead = x.shape[:-1]
    if fmt is None or fmt.per_byte == 1:
        return x[..., :keep]
    planes = jnp.swapaxes(x.reshape(*lead, width // 2, 2), -1, -2)[..., :full // 2]
    return planes.reshape(*lead, full)[..., :keep]


def _forward(cfg: Cfg, q, k_pages, v_pages, sinks, meta: Meta, new_k=None, new_v=None, *,
             interpret=False):
    T, Hq, D = q.shape
    Hkv, N, ps, _ = k_pages.shape
    G, Dv = cfg.group, cfg.v_head_dim
    _checks.refuse_symbolic(
        "paged attention: the Pallas Triton kernel", "its grid (work items, Hkv, splits) and "
        "its operand blocks", "impl='auto' (the XLA lowering for such calls) and "
        "impl='xla'", **dict(zip(_SIZES, _sizes(cfg))))
    if not interpret:
        _functions.refuse("paged attention",
                          _functions.refusals((cfg.mask(), cfg.term()), _functions.TRITON))
    latent = v_pages is None
    kq = k_pages.format if quant.is_quantized(k_pages) else None
    vq = v_pages.format if quant.is_quantized(v_pages) else None
    update = cfg.update
    if update and (kq is not None or vq is not None):
        # Quantized pools are written by XLA first (fnattn.quant.write: the codes and
        # scales of fnattn.quant.quantize, bit for bit), then read like any others.
        k_pages, v_pages = xla.write_tokens(cfg, meta, k_pages, v_pages, new_k, new_v)
        update = False
    bq, bk, splits, params = launch_plan(cfg)
    Gp = common.pow2(G)
    M = max(MIN_ROWS, bq * Gp)
    Dp, Dk_codes, Dk_load = _widths(kq, D)
    if latent:   # the output tile is the key tile: its first Dv channels are kept
        Dvp, Dv_codes, Dv_load, Dv_tile = Dp, Dk_codes, Dk_load, D
    else:
        (Dvp, Dv_codes, Dv_load), Dv_tile = _widths(vq, Dv), Dv
    work = common.work_list(cfg, meta, bq, bk)
    W = work.seq.shape[0]
    K = _K(G=G, Gp=Gp, bq=bq, M=M, bk=bk, D=D, Dp=Dp, Dv=Dv_tile, Dvp=Dvp, ps=ps,
           P=cfg.pages_per_seq, T=T, splits=splits, scale=cfg.scale, softcap=cfg.softcap,
           mask_treedef=cfg.mask_treedef, sinks=sinks is not None and splits == 1,
           update=update, term_treedef=cfg.term_treedef,
           n_terms=0 if meta.terms is None else meta.terms.shape[0], kq=kq, vq=vq,
           latent=latent, Dk_codes=Dk_codes, Dk_load=Dk_load, Dv_codes=Dv_codes,
           Dv_load=Dv_load)

    # q as (Hkv, tokens * Gp, Dp): a tile of M consecutive rows is bq tokens x Gp heads.
    # Padded so that the tile of the last item never runs past the end.
    t_pad = T + common.cdiv(M, Gp)
    qh = q.reshape(T, Hkv, G, D)
    qh = jnp.pad(qh, ((0, t_pad - T), (0, 0), (0, Gp - G), (0, 0)))
    qh = _to_tile(qh, D, kq, Dp)
    qh = qh.transpose(1, 0, 2, 3).reshape(Hkv, t_pad * Gp, Dp)
    rows = t_pad * Gp

    def pool_args(pool, fmt):
        n = pool.shape[-1]
        if fmt is None:
            return [pool.reshape(Hkv, N * ps, n)]
        codes = pool.data.reshape(Hkv, N * ps, pool.data.shape[-1])
        scale = (pool.scale.reshape(Hkv, N * ps) if fmt.per_token else
                 jnp.reshape(pool.scale, (1,)).astype(F32))
        return [codes, scale]

    args = [work.stacked(), meta.page_table, qh, *pool_args(k_pages, kq)]
    k_at = 3
    if not latent:
        v_at = len(args)
        args += pool_args(v_pages, vq)
    if K.sinks:
        args.append(jnp.pad(sinks.astype(F32).reshape(Hkv, G), ((0, 0), (0, Gp - G))))
    if K.n_terms:   # (n, Hq) -> (n, Hkv, Gp)
        args.append(jnp.pad(meta.terms.reshape(-1, Hkv, G), ((0, 0), (0, 0), (0, Gp - G))))
    out_dtype = q.dtype if splits == 1 else F32
    lead = () if splits == 1 else (splits,)
    out_shape = [jax.ShapeDtypeStruct(lead + (Hkv, rows, Dvp), out_dtype),
                 jax.ShapeDtypeStruct(lead + (Hkv, rows), F32)]
    aliases = {}
    if update:
        args.append(new_k)
        out_shape.append(jax.ShapeDtypeStruct(args[k_at].shape, k_pages.dtype))
        aliases[k_at] = 2
        if not latent:
            args.append(new_v)
            out_shape.append(jax.ShapeDtypeStruct(args[v_at].shape, v_pages.dtype))
            aliases[v_at] = 3
    res = _varying.pallas_call(
        functools.partial(_kernel, K=K),
        grid=(W, Hkv, splits),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=params, interpret=interpret, name="fnattn_paged_triton",
    )(*args)
    out, lse = res[0], res[1]
    if splits > 1:
        sink = None
        if sinks is not None:
            sink = jnp.pad(sinks.astype(F32).reshape(Hkv, G), ((0, 0), (0, Gp - G)))
            sink = jnp.tile(sink, (1, t_pad))
        out, lse = common.merge_splits(out, lse, sink)
    out = out.reshape(Hkv, t_pad, Gp, Dvp)[:, :T, :G]
    out = _from_tile(out, Dv_tile, Dv, kq if latent else vq, Dvp).transpose(1, 0, 2, 3)
    lse = lse.reshape(Hkv, t_pad, Gp)[:, :T, :G].transpose(0, 2, 1).reshape(Hq, T)
    # Rows of no live sequence were never written.
    _, _, valid = common.token_owner(cfg, meta)
    out = jnp.where(valid[:, None, None], out.reshape(T, Hq, Dv), 0).astype(q.dtype)
    lse = jnp.where(valid[None, :], lse, -jnp.inf)
    if update:
        k_out = res[2].reshape(k_pages.shape)
        return out, lse, k_out, None if latent else res[3].reshape(v_pages.shape)
    if cfg.update:
        return out, lse, k_pages, v_pages
    return out, lse


forward = functools.partial(_forward, interpret=False)
forward_interpret = functools.partial(_forward, interpret=True)

_SIZES = ("total_tokens", "max_seqs", "num_pages", "pages_per_seq")


def _sizes(cfg: Cfg):
    return tuple(getattr(cfg, name) for name in _SIZES)


def symbolic(cfg: Cfg) -> list:
    """The sizes of a call that are symbolic (``jax.export``), which the kernel
    cannot take (see :func:`fnattn._checks.refuse_symbolic`)."""
    return _checks.symbolic_sizes(**dict(zip(_SIZES, _sizes(cfg))))


def auto_forward(cfg: Cfg, *args):
    """impl="auto" on NVIDIA GPUs: the Triton kernel, or the XLA lowering for
    symbolic sizes (``jax.export``), which no Triton grid can take, and for a
    ``from_fn`` mask or term Triton does not compile."""
    slow = symbolic(cfg) or _functions.refusals((cfg.mask(), cfg.term()), _functions.TRITON)
    return (xla.forward if slow else forward)(cfg, *args)
