"""The Pallas Mosaic GPU lowering of paged attention (Hopper, sm90a):
:func:`fnattn.paged_attention` and :func:`fnattn.ragged_paged_attention`.

The kernel of :mod:`fnattn.decoding.mosaic_gpu` with a paged producer: a key
block of ``block_k`` positions of one sequence and kv head lies in
``block_k / page_size`` pages of the ``(Hkv, pages, page_size, D)`` pools (or
in part of one page, for pages of more keys than a block), each a contiguous
tile, so the producer warpgroup issues one TMA copy per page into the ring's
slot, all of them arriving on the slot's barrier. Hopper's TMA has no gather:
the producer reads the page table as scalars, a block's pages one step ahead
of its copies. The consumer, the split-K merge and the sinks are the
contiguous kernel's.

A program owns one *work item* (:func:`fnattn.paged.common.work_list`) and
one kv head: ``paged_attention``'s ``Tq`` tokens of one sequence, or in a
ragged batch up to :func:`tokens_per_item` consecutive tokens of one sequence
(a prefill of many tokens is several items, each reading the sequence's
visible keys), their GQA group's query heads together in the 64 rows of one
``wgmma`` tile. The wrapper gathers each item's query rows and scatters the
results back to the packed tokens.

Ask for it with ``AttentionSpec(block_sizes=MosaicGpuDecodeBlockSizes())`` (beside
a ``PagedBlockSizes`` for the split count and ``block_q``, if wanted): on a
Hopper GPU paged attention then runs here; without it ``impl="auto"`` keeps
the Triton kernel, timed at 70.8 % of an H100's HBM bandwidth in decode,
while this one has not been timed on a GPU yet.

**Pages that are not the sequence's.** Entries of the page table that are
invalid (-1 after :func:`fnattn.paged.common.sanitize`) are read as page 0;
the last block of a sequence reads whatever pages its row names past its
length. The logits of keys past the length are replaced by -inf, so their K
changes nothing, but ``0 * V`` is NaN where V is not finite. So, as in the
contiguous kernel, the call is computed again by the XLA lowering
(:func:`fnattn.paged.xla.forward`) when a partial output is not finite, or
when a live sequence's row holds an invalid entry among the pages its length
covers; otherwise that pass costs nothing (``lax.cond``).

**The form that writes the cache** (``ragged_paged_attention_with_update``)
scatters the new tokens' K and V into the pools with XLA first (in place when
the pools are donated, as the Triton kernel's aliased pools are), then runs
the kernel on them.

Supported: float16 / bfloat16 pools, head dims that are multiples of 64 up
to 256, up to 64 query rows per program (``Tq * G``, or ``block_q * G``),
pages of 8, 16, 32 keys or a multiple of 64, a capacity (``pages_per_seq *
page_size``) that is a multiple of 64, array-free masks, soft-cap, sinks,
position terms (their arrays one value per head).
:func:`supports` lists what else a call asks for; asked for by name, such a
call raises ``NotImplementedError``.
"""

import dataclasses

import jax.numpy as jnp
from jax import lax

from fnattn import _checks
from fnattn.decoding import common as dcommon
from fnattn.decoding import mosaic_gpu as kernel
from fnattn.flash import mosaic_gpu as flash_mgpu
from fnattn.paged import common, xla
from fnattn.paged.common import I32, Cfg, Meta

__all__ = ["forward", "gpu_forward", "supports", "tokens_per_item"]

_TRITON = "fnattn/paged/triton.py"
_ELSEWHERE = ("the Pallas Triton kernel (fnattn/paged/triton.py, the default on NVIDIA GPUs) "
              "supports it")


def supports(cfg: Cfg, dtype) -> list:
    """Why a call cannot run on this kernel (empty: it can), from static facts."""
    tokens = (f"Tq={cfg.uniform_q}" if cfg.uniform_q is not None
              else f"PagedBlockSizes(block_q={cfg.block_sizes.block_q})")
    why = kernel.kernel_refusals("pools", dtype, cfg.head_dim, cfg.v_head_dim,
                                 tokens_per_item(cfg) * cfg.group,
                                 f"{tokens} x group {cfg.group}", cfg.mask(), cfg.term_treedef)
    ps = cfg.page_size
    if not isinstance(ps, int) or not (ps in (8, 16, 32) or ps % 64 == 0):
        why.append(f"pages of {ps} keys (8, 16, 32 or a multiple of 64 run here)")
    sizes = ("total_tokens", "max_seqs", "num_pages", "pages_per_seq")
    symbolic = _checks.symbolic_sizes(**{n: getattr(cfg, n) for n in sizes})
    if symbolic:
        why.append("symbolic sizes (jax.export)")
    elif cfg.capacity % 64:
        why.append(f"a capacity of {cfg.capacity} keys per sequence (pages_per_seq x "
                   "page_size; multiples of 64 run here)")
    return why


def gpu_forward(fallback, cfg: Cfg, *args):
    """The cuda entry of :func:`fnattn.paged.api.lowering_table`: this kernel when
    the spec asks for it (``MosaicGpuDecodeBlockSizes``) and the process has a
    Hopper GPU, else ``fallback`` (the Triton kernel's entry), which is also
    where quantized and latent pools go (this kernel reads neither:
    :func:`fnattn.decoding.mosaic_gpu.stored_refusals`)."""
    _, k_pages, v_pages = args[:3]
    if (cfg.mosaic_gpu is None or flash_mgpu.available() is not None
            or kernel.stored_refusals(k_pages, v_pages, "pool", _TRITON)):
        return fallback(cfg, *args)
    return forward(cfg, *args)


def tokens_per_item(cfg: Cfg) -> int:
    """Query tokens per program: ``paged_attention``'s ``Tq``; in a ragged batch
    ``PagedBlockSizes.block_q``, else as many as fill the 64 rows of the tile
    with the GQA group (``64 // group``)."""
    if cfg.uniform_q is not None:
        return cfg.uniform_q
    return cfg.block_sizes.block_q or max(1, kernel.ROWS // cfg.group)


def forward(cfg: Cfg, q, k_pages, v_pages, sinks, meta: Meta, new_k=None, new_v=None, *,
            interpret=False):
    """q (T, Hq, D) packed; pools (Hkv, pages, page_size, D|Dv) -> out (T, Hq, Dv),
    lse (Hq, T): ``paged_attention`` (``cfg.uniform_q`` tokens per sequence slot)
    and ``ragged_paged_attention`` (the work items of
    :func:`fnattn.paged.common.work_list`, :func:`tokens_per_item` tokens each).

    ``interpret``: False to compile for the GPU, or the Mosaic GPU
    interpreter's parameters to run the same kernel on CPU."""
    why = kernel.stored_refusals(k_pages, v_pages, "pool", _TRITON) + supports(cfg, k_pages.dtype)
    if why:
        raise NotImplementedError(f"paged attention: the Mosaic GPU kernel does not support "
                                  f"{'; '.join(why)}; {_ELSEWHERE}.")
    if cfg.update:
        # The new tokens go into the pools first, by XLA: a scatter of their
        # rows, in place when the pools are donated (as the Triton kernel's
        # aliased pools are); the kernel then reads them with the rest.
        k_pages, v_pages = xla.write_tokens(cfg, meta, k_pages, v_pages, new_k, new_v)
        out, lse = forward(dataclasses.replace(cfg, update=False), q, k_pages, v_pages, sinks,
                           meta, interpret=interpret)
        return out, lse, k_pages, v_pages
    T, Hq, D = q.shape
    Hkv, _, ps, Dv = v_pages.shape
    dcfg = dcommon.Cfg(scale=cfg.scale, softcap=cfg.softcap, mask_treedef=cfg.mask_treedef,
                     num_splits=cfg.block_sizes.num_splits, block_sizes=cfg.mosaic_gpu,
                     term_treedef=cfg.term_treedef)
    n_terms = 0 if meta.terms is None else meta.terms.shape[0]
    tiles = kernel.tiles_for(dcfg, D, Dv, cfg.capacity, k_pages.dtype, page_size=ps,
                             terms=n_terms)
    bq = tokens_per_item(cfg)
    # A position term's arrays, one value per head: the same for every item.
    terms = None if not n_terms else kernel.term_rows(meta.terms[:, None], Hkv, bq)
    work = common.work_list(cfg, meta, bq, tiles.block_k)
    W = work.seq.shape[0]
    table = kernel.program_meta(jnp.zeros((W,), I32), work.kv_len,
                                (work.k_lo, work.k_hi, work.f_lo, work.f_hi), work.q_pos,
                                work.seq, work.row0)
    # Each item's query tokens (past its rows: any token, whose results are dropped).
    tok = work.tok[:, None] + jnp.arange(bq, dtype=I32)[None, :]
    qi = q[jnp.minimum(tok, T - 1)].astype(k_pages.dtype)
    out, lse = kernel.launch(dcfg, tiles, table, dcommon.group_rows(qi, Hkv, kernel.ROWS),
                             k_pages, v_pages, Tq=bq, G=cfg.group, capacity=cfg.capacity,
                             page_table=meta.page_table, terms=terms, interpret=interpret)
    out, lse, finite = kernel.finish(out, lse, sinks, bq, q.dtype)
    # Back to the packed tokens; tokens of no live sequence stay 0 and -inf.
    dest = jnp.where(jnp.arange(bq)[None, :] < work.rows[:, None], tok, T).reshape(-1)
    out = jnp.zeros((T + 1, Hq, Dv), q.dtype).at[dest].set(out.reshape(W * bq, Hq, Dv))[:T]
    lse = jnp.full((Hq, T + 1), -jnp.inf, lse.dtype).at[:, dest].set(
        lse.transpose(1, 0, 2).reshape(Hq, W * bq))[:, :T]
    # A live sequence whose row names an invalid page among those its keys fill.
    page = jnp.arange(cfg.pages_per_seq, dtype=I32)[None, :]
    covered = (page < common.cdiv(meta.kv_len, ps)[:, None]) & (meta.q_len > 0)[:, None]
    pages_ok = ~jnp.any(covered & (meta.page_table < 0))

    def again():
        return xla.forward(cfg, q, k_pages, v_pages, sinks, meta)

    return lax.cond(finite & pages_ok, lambda: (out, lse), again)
