"""The Pallas Triton lowering of :func:`fnattn.decode` (NVIDIA GPUs).

One kernel, grid ``(B, Hkv, splits)``. A program owns one sequence, one kv head
and one split of the sequence's key blocks, and holds the ``Tq * G`` query rows
of the kv head's GQA group as the rows of one tile (row ``r`` is token
``r // G`` of query head ``h * G + r % G``), padded to a power of two of at
least 16 rows (the smallest tensor-core tile). Every key is therefore read from
HBM once per (sequence, kv head), whatever the group size: decode stays bound
by memory bandwidth.

Keys are read **straight from the (B, S, Hkv, D) cache** in blocks of
``block_k`` slots starting at the sequence's first slot: each block is a
strided gather of rows ``k[b, start + j*block_k : ..., h, :]`` (no transposed
copy of the cache, no repeat over the group). Loads are masked: slots past the
sequence's length are never read (they may hold anything, NaN included), and
head dims that are not powers of two are padded inside the loads (masked
columns), so the cache is never copied.

Each program visits only its share of the blocks ``[lo, hi)`` that hold the
sequence's keys and that the mask's ``tile_bounds`` says may be visible
(computed in the wrapper, :func:`fnattn.decoding.common.block_ranges`): a
sliding window over a long context reads the window only. Scale and soft-cap
are applied to the float32 logits; the online softmax runs in base 2 with
``log2(e)`` folded into the scale.

**Split-K.** With few (sequence, kv head) pairs the blocks of a sequence are
cut into ``splits`` contiguous ranges, one program each (:func:`launch_plan`
picks about two per multiprocessor of an H100); the programs write float32
partial outputs with their ``lse``, merged afterwards by
:func:`fnattn.merging.merge_stacked`, where the sinks join the denominator
once. With one split the kernel applies the sinks and writes the output in q's
dtype.

**Quantized and latent caches** (:mod:`fnattn.quant`; ``value_dim``). A
quantized cache's tile of codes is dequantized right after its load, to q's
dtype (:mod:`fnattn._dequant`, the numbers the XLA lowering multiplies):
times the per-tensor scale (a float32 operand), or times a column of
per-token scales loaded beside the codes under the same row mask (slots not
loaded get 0, so a NaN scale of a slot the sequence does not own is never
read). float8 codes are loaded unfilled and zeroed after the conversion
(Triton casts no constant to float8). An ``int4`` tile is one load whose
column ``c`` reads byte ``c`` or ``c - D/2`` (each byte named twice: the same
bytes from HBM) and takes its low or high nibble. A latent cache has no V
operand: the values are the key tile just loaded, the kernel accumulates all
its columns and the wrapper keeps the first ``value_dim``.

**Symbolic sizes** (``jax.export`` shape polymorphism) are refused
(``NotImplementedError``): the Triton backend has no dynamic grid, and the
grid is sized by the batch. ``impl="auto"`` runs such calls with the XLA
lowering on GPUs (:func:`auto_forward`).
"""

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnattn import _checks, _dequant, _functions, _serving
from fnattn import _online as online
from fnattn import _varying, masks, quant
from fnattn.decoding import common, xla
from fnattn.decoding.common import F32, I32
from fnattn.flash.blocks import pick
from fnattn.merging import merge_stacked

__all__ = ["KERNEL_NAME", "Plan", "auto_forward", "forward", "forward_interpret", "launch_plan",
           "symbolic"]

KERNEL_NAME = "fnattn_decode_triton"
LOG2E, LN2 = online.LOG2E, online.LN2
MIN_ROWS = 16            # tl.dot needs at least 16 rows
MIN_COLS = 16            # ... and 16 along the contraction


class Plan(NamedTuple):
    """Launch parameters of one call."""

    block_k: int
    num_splits: int
    num_warps: int
    num_stages: int


def launch_plan(batch: int, num_kv_heads: int, cache_len: int, head_dim: int,
                v_head_dim: int, *, rows: int = MIN_ROWS, num_splits: Optional[int] = None,
                block_k: Optional[int] = None, num_warps: Optional[int] = None,
                num_stages: Optional[int] = None) -> Plan:
    """Block size, split count and Triton launch parameters for a decode call.

    ``num_splits`` (from ``DecodeBlockSizes``) is used as given; otherwise
    :func:`fnattn._serving.auto_splits` of ``batch * num_kv_heads`` programs
    per split: about two per multiprocessor of an H100. ``block_k``
    (rounded up to a power of two >= 16) overrides the key block size. ``rows``
    is the height of the query tile (``Tq * G`` padded).

    >>> launch_plan(1, 8, 32768, 128, 128)
    Plan(block_k=64, num_splits=33, num_warps=4, num_stages=2)
    >>> launch_plan(64, 8, 32768, 128, 128).num_splits
    1
    >>> launch_plan(1, 8, 1000, 80, 80, num_splits=5)
    Plan(block_k=64, num_splits=5, num_warps=4, num_stages=2)
    """
    if block_k is None:
        # 64 keys x 128 dims of K and V in flight per stage; half as many past 128.
        block_k = 32 if max(head_dim, v_head_dim) > 128 else 64
        block_k = min(block_k, common.pow2(cache_len))
    bk = max(MIN_COLS, common.pow2(block_k))
    if num_splits is None:
        num_splits = _serving.auto_splits(batch * num_kv_heads, common.cdiv(cache_len, bk))
    # Decode is a stream over the cache: two stages of prefetch hide the latency
    # of the next block's loads. 4 warps hold a float32 accumulator of up to
    # 64 x 128; taller tiles (speculative decoding with large groups) take 8.
    if num_warps is None:
        num_warps = 4 if rows * max(head_dim, v_head_dim) <= 64 * 128 else 8
    return Plan(block_k=bk, num_splits=num_splits, num_warps=num_warps,
                num_stages=2 if num_stages is None else num_stages)


@dataclasses.dataclass(frozen=True)
class _K(common.KernelFacts):
    """Static facts of one launch."""

    Tq: int
    G: int
    R: int           # live rows: Tq * G
    M: int           # rows per tile: a power of two >= max(R, 16)
    bk: int
    D: int
    Dp: int
    Dv: int
    Dvp: int
    splits: int
    scale: float
    softcap: Optional[float]
    mask_treedef: Any
    sinks: bool
    term_treedef: Any = None   # a position term, or None
    n_terms: int = 0           # its arrays, one value per row
    k_fmt: Any = None          # a quantized cache's QuantFormat (None: float)
    v_fmt: Any = None
    latent: bool = False       # no v: the values are the keys' first Dv channels

    @property
    def tensor_scales(self) -> bool:
        return self.k_fmt is not None or self.v_fmt is not None


def _kernel(meta_ref, q_ref, k_ref, *refs, K: _K):
    it = iter(refs)
    v_ref = None if K.latent else next(it)
    ts_ref = next(it) if K.tensor_scales else None
    ks_ref = next(it) if K.k_fmt is not None and K.k_fmt.per_token else None
    vs_ref = next(it) if K.v_fmt is not None and K.v_fmt.per_token else None
    sinks_ref = next(it) if K.sinks else None
    terms_ref = next(it) if K.n_terms else None
    o_ref, lse_ref = next(it), next(it)
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length = meta_ref[b, 0], meta_ref[b, 1]
    lo, hi = common.split_range(meta_ref[b, 2], meta_ref[b, 3], sp, K.splits)
    # [fa, fb): this split's blocks inside the sequence that every row sees whole
    fa = jnp.minimum(jnp.maximum(meta_ref[b, 4], lo), hi)
    fb = jnp.minimum(jnp.maximum(meta_ref[b, 5], fa), hi)

    r_i = lax.broadcasted_iota(I32, (K.M,), 0)
    t_i, g_i = lax.div(r_i, jnp.int32(K.G)), lax.rem(r_i, jnp.int32(K.G))
    dcols = lax.broadcasted_iota(I32, (K.Dp,), 0)[None, :]
    vcols = lax.broadcasted_iota(I32, (K.Dvp,), 0)[None, :]
    dmask = None if K.D == K.Dp else dcols < K.D
    vmask = None if K.Dv == K.Dvp else vcols < K.Dv

    def both(a, c):
        return c if a is None else (a if c is None else a & c)

    q = q_ref[b, h]
    mask, term = K.mask(), K.term()
    if mask is not None or term is not None:
        raw_rows = t_i[:, None]
        qpos_rows = (length - K.Tq + t_i)[:, None]
        head_rows = (h * K.G + g_i)[:, None]
    if term is not None:  # the term's arrays, one value per row
        term_rows = [terms_ref[n, b, h][:, None] for n in range(K.n_terms)]

    def bias_of(kpos):
        if term is None:
            return None
        pos = masks.Positions(b=b, h=head_rows, q=raw_rows, q_pos=qpos_rows, k=kpos[None, :])
        return jnp.broadcast_to(term.value(pos, term_rows), (K.M, K.bk))

    def body(j, carry, full=False):
        """One block of keys; ``full``: inside the sequence and seen whole by every
        row (no bounds, no mask, no sanitising: the keys are all used)."""
        kpos = j * K.bk + lax.broadcasted_iota(I32, (K.bk,), 0)
        ok = None if full else kpos < length
        slot = (start + kpos)[:, None]
        krows = None if full else ok[:, None]

        def load(ref, cols, cmask, fmt, n, scale_ref, which):
            """A (bk, cols) tile of a cache, dequantized right after the load."""
            m = both(krows, cmask)
            if fmt is None:
                return plgpu.load(ref.at[b, slot, h, cols], **(
                    {} if m is None else dict(mask=m, other=0.0)))
            high = None
            if fmt.per_byte == 2:
                # channel c sits in byte c (low nibble) or c - n/2 (high): one
                # load whose lanes name each byte twice (the same HBM bytes)
                high = cols >= n // 2
                cols = jnp.where(high, cols - n // 2, cols)
            if fmt.is_float:
                # (Triton casts no constant to float8: masked lanes are zeroed
                # after the conversion instead of filled by the load)
                codes = plgpu.load(ref.at[b, slot, h, cols],
                                   **({} if m is None else dict(mask=m))).astype(F32)
                if m is not None:
                    codes = jnp.where(m, codes, 0.0)
            else:
                codes = plgpu.load(ref.at[b, slot, h, cols], **(
                    {} if m is None else dict(mask=m, other=0)))
            if fmt.per_token:  # the tile's scales; slots not loaded: 0, never NaN
                sc = plgpu.load(scale_ref.at[b, slot[:, 0], h], **(
                    {} if krows is None else dict(mask=ok, other=0.0)))[:, None]
            else:
                sc = ts_ref[which]
            return _dequant.values(fmt, codes, sc, q.dtype, high)
        k = load(k_ref, dcols, dmask, K.k_fmt, K.D, ks_ref, 0)
        if K.latent:   # the values are the tile just loaded (its first Dv columns)
            load_v = lambda: k  # noqa: E731
        else:
            load_v = lambda: load(v_ref, vcols, vmask, K.v_fmt, K.Dv, vs_ref, 1)  # noqa: E731
        if full:
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32)
            return online.step_exp2(carry, s, None, load_v, scale=K.scale, softcap=K.softcap,
                                    bias=bias_of(kpos), natural=K.natural)
        bad = None
        if mask is not None:
            # Slots outside the range are never loaded; keys of the sequence that the
            # mask hides from some rows may still hold NaN (see _online.finite_keys).
            k, v, bad = online.finite_keys(k, load_v(), triton=True)
            load_v = lambda: v  # noqa: E731
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        if bad is not None:
            s = jnp.where(bad[None, :], jnp.nan, s)
        allowed = ok[None, :]
        if mask is not None:
            pos = masks.Positions(b=b, h=head_rows, q=raw_rows, q_pos=qpos_rows,
                                  k=kpos[None, :])
            allowed = allowed & mask.predicate(pos, [])
        return online.step_exp2(carry, s, allowed, load_v, scale=K.scale, softcap=K.softcap,
                                bias=bias_of(kpos), natural=K.natural)

    acc = jnp.zeros((K.M, K.Dvp), F32)
    m = jnp.full((K.M,), -jnp.inf, F32)
    l = jnp.zeros((K.M,), F32)
    carry = lax.fori_loop(lo, fa, body, (acc, m, l))
    carry = lax.fori_loop(fa, fb, functools.partial(body, full=True), carry)
    acc, m, l = lax.fori_loop(fb, hi, body, carry)

    if K.sinks and K.natural:
        acc, m, l = online.join_sink(acc, m, l, sinks_ref[h], exp=jnp.exp)
    elif K.sinks:
        acc, m, l = online.join_sink(acc, m, l, sinks_ref[h] * LOG2E, exp=jnp.exp2)
    out, lse = online.finish_exp2(acc, m, l, natural=K.natural)
    # Padded buffers: whole tiles are stored, no masked (or duplicate) addresses.
    if K.splits == 1:
        o_ref[b, h] = out.astype(o_ref.dtype)
        lse_ref[b, h] = lse
    else:
        o_ref[sp, b, h] = out
        lse_ref[sp, b, h] = lse


def _forward(cfg, q, k, v, starts, lengths, sinks, terms=None, *, interpret=False,
             block_k=None):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv), lse (B, Hq, Tq).

    ``block_k`` overrides :func:`launch_plan`'s key block size (tests)."""
    B, Tq, Hq, D = q.shape
    latent = v is None
    _, S, Hkv, _ = k.shape
    Dv = cfg.value_dim if latent else v.shape[-1]
    _checks.refuse_symbolic(
        "decode: the Pallas Triton kernel", "its grid (B, Hkv, splits) and its operand "
        "blocks", "impl='auto' (the XLA lowering for such calls) and impl='xla'",
        B=B, S=S, Tq=Tq)
    if not interpret:
        _functions.refuse("decode", _functions.refusals((cfg.mask, cfg.term), _functions.TRITON))
    G = Hq // Hkv
    R = Tq * G
    M = max(MIN_ROWS, common.pow2(R))
    given = pick(cfg.block_sizes, common.DecodeBlockSizes, common.DecodeBlockSizes())
    plan = launch_plan(B, Hkv, S, D, Dv, rows=M, num_splits=cfg.num_splits,
                       block_k=given.block_k if block_k is None else block_k,
                       num_warps=given.num_warps, num_stages=given.num_stages)
    bk, splits = plan.block_k, plan.num_splits
    Dp, Dvp = common.pow2(max(D, MIN_COLS)), common.pow2(max(Dv, MIN_COLS))
    # A latent cache's values are its key tiles: the output has the keys'
    # columns, the first Dv of which are kept.
    Dv_k, Dvp = (D, Dp) if latent else (Dv, Dvp)
    fmt = lambda x: x.format if quant.is_quantized(x) else None  # noqa: E731
    K = _K(Tq=Tq, G=G, R=R, M=M, bk=bk, D=D, Dp=Dp, Dv=Dv_k, Dvp=Dvp, splits=splits,
           scale=cfg.scale, softcap=cfg.softcap, mask_treedef=cfg.mask_treedef,
           sinks=sinks is not None and splits == 1, term_treedef=cfg.term_treedef,
           n_terms=0 if terms is None else terms.shape[0], k_fmt=fmt(k),
           v_fmt=None if latent else fmt(v), latent=latent)

    r = common.block_ranges(cfg.mask, Tq, lengths, jnp.zeros_like(lengths), bk,
                            common.cdiv(S, bk))
    meta = jnp.stack([starts, lengths, *r], axis=1).astype(I32)
    # The query tile of each (sequence, kv head): small, so padded here (rows and
    # head dim); the caches are only ever read in place.
    qg = common.group_rows(q.astype(_dequant.compute_dtype(q, k)), Hkv, M)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, Dp - D)))
    data = lambda x: x.data if quant.is_quantized(x) else x  # noqa: E731
    args = [meta, qg, data(k)] + ([] if latent else [data(v)])
    if K.tensor_scales:
        args.append(_dequant.tensor_scales(k, v))
    for f, x in ((K.k_fmt, k), (K.v_fmt, v)):
        if f is not None and f.per_token:
            args.append(x.scale.astype(F32))
    if K.sinks:
        args.append(common.row_sinks(sinks, Hkv, Tq, M))
    if K.n_terms:   # (n, B, Hq) -> (n, B, Hkv, M), in the rows' order
        args.append(jax.vmap(jax.vmap(lambda x: common.row_sinks(x, Hkv, Tq, M)))(terms))
    lead = () if splits == 1 else (splits,)
    out_shape = [jax.ShapeDtypeStruct(lead + (B, Hkv, M, Dvp), q.dtype if splits == 1 else F32),
                 jax.ShapeDtypeStruct(lead + (B, Hkv, M), F32)]
    out, lse = _varying.pallas_call(
        functools.partial(_kernel, K=K),
        grid=(B, Hkv, splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=interpret, name=KERNEL_NAME,
    )(*args)
    out, lse = out[..., :R, :Dv], lse[..., :R]   # (a latent cache: its first Dv columns)
    if splits > 1:
        sink = None if sinks is None else common.row_sinks(sinks, Hkv, Tq, R)
        out, lse = merge_stacked(out, lse, sink)
    out, lse = common.ungroup_rows(out, lse, Tq, G)
    return out.astype(q.dtype), lse


forward = functools.partial(_forward, interpret=False)
forward_interpret = functools.partial(_forward, interpret=True)


def symbolic(q, k) -> list:
    """The sizes of a call that are symbolic (``jax.export``), which the kernel
    cannot take (see :func:`fnattn._checks.refuse_symbolic`)."""
    return _checks.symbolic_sizes(B=q.shape[0], Tq=q.shape[1], S=k.shape[1])


def auto_forward(cfg, q, k, v, starts, lengths, sinks, terms=None):
    """impl="auto" on NVIDIA GPUs: the Triton kernel, or the XLA lowering for
    symbolic sizes (``jax.export``), which no Triton grid can take, and for a
    ``from_fn`` mask or term Triton does not compile."""
    slow = symbolic(q, k) or _functions.refusals((cfg.mask, cfg.term), _functions.TRITON)
    fwd = xla.forward if slow else forward
    return fwd(cfg, q, k, v, starts, lengths, sinks, terms)
