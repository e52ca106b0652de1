"""The Pallas Mosaic GPU lowering of :func:`fnattn.paged_attention` (Hopper, sm90a).

The kernel of :mod:`fnattn.decoding.mosaic_gpu` with a paged producer: a key
block of ``block_k`` positions of one sequence and kv head lies in
``block_k / page_size`` pages of the ``(Hkv, pages, page_size, D)`` pools (or
in part of one page, for pages of more keys than a block), each a contiguous
tile, so the producer warpgroup issues one TMA copy per page into the ring's
slot, all of them arriving on the slot's barrier. Hopper's TMA has no gather:
a page table row is read by the producer as scalars, a block's pages one step
ahead of its copies. The consumer, the split-K merge and the sinks are the
contiguous kernel's.

Ask for it with ``AttentionSpec(block_sizes=MosaicGpuDecodeBlockSizes())`` (beside
a ``PagedBlockSizes`` for the split count, if wanted): on a Hopper GPU
``paged_attention`` then runs here; without it ``impl="auto"`` keeps the Triton
kernel, timed at 70.8 % of an H100's HBM bandwidth, while this one has not been
timed on a GPU yet.

**Pages that are not the sequence's.** Entries of the page table that are
invalid (-1 after :func:`fnattn.paged.common.sanitize`) are read as page 0;
the last block of a sequence reads whatever pages its row names past its
length. The logits of keys past the length are replaced by -inf, so their K
changes nothing, but ``0 * V`` is NaN where V is not finite. So, as in the
contiguous kernel, the call is computed again by the XLA lowering
(:func:`fnattn.paged.xla.forward`) when a partial output is not finite, or
when a live sequence's row holds an invalid entry among the pages its length
covers; otherwise that pass costs nothing (``lax.cond``).

Supported: ``paged_attention`` (every sequence the same ``Tq`` query tokens;
not the ragged batches of ``ragged_paged_attention`` nor the in-kernel cache
update), float16 / bfloat16 pools, head dims that are multiples of 64 up to
256, ``Tq * G <= 64``, pages of 8, 16, 32 keys or a multiple of 64, a capacity
(``pages_per_seq * page_size``) that is a multiple of 64, array-free masks,
soft-cap, sinks. :func:`supports` lists what else a call asks for; asked for
by name, such a call raises ``NotImplementedError``.
"""

import jax.numpy as jnp
from jax import lax

from fnattn import _checks, _functions
from fnattn.decoding import mosaic_gpu as kernel
from fnattn.flash import mosaic_gpu as flash_mgpu
from fnattn.paged import common, xla
from fnattn.paged.common import I32, Cfg, Meta

__all__ = ["forward", "gpu_forward", "supports"]

_ELSEWHERE = ("the Pallas Triton kernel (fnattn/paged/triton.py, the default on NVIDIA GPUs) "
              "supports it")


def supports(cfg: Cfg, dtype) -> list:
    """Why a call cannot run on this kernel (empty: it can), from static facts."""
    why = []
    if cfg.update:
        why.append("writing the new tokens into the pools "
                   "(ragged_paged_attention_with_update)")
    if cfg.uniform_q is None:
        why.append("ragged batches (ragged_paged_attention)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        why.append(f"{jnp.dtype(dtype).name} pools (float16 and bfloat16 run here)")
    for name, n in (("D", cfg.head_dim), ("Dv", cfg.v_head_dim)):
        if n % 64 or n > 256:
            why.append(f"head dim {name}={n} (multiples of 64 up to 256 run here)")
    rows = (cfg.uniform_q or 1) * cfg.group
    if rows > kernel.ROWS:
        why.append(f"{rows} query rows per kv head (Tq={cfg.uniform_q} x group {cfg.group}; "
                   f"at most {kernel.ROWS} run here)")
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
    if cfg.term_treedef is not None:
        why.append("a position term (ALiBi, from_fn)")
    why += _functions.refusals(cfg.mask(), _functions.MOSAIC_GPU)
    return why


def gpu_forward(fallback, cfg: Cfg, *args):
    """The cuda entry of :func:`fnattn.paged.api.lowering_table`: this kernel when
    the spec asks for it (``MosaicGpuDecodeBlockSizes``) and the process has a
    Hopper GPU, else ``fallback`` (the Triton kernel's entry)."""
    if cfg.mosaic_gpu is None or flash_mgpu.available() is not None:
        return fallback(cfg, *args)
    return forward(cfg, *args)


def forward(cfg: Cfg, q, k_pages, v_pages, sinks, meta: Meta, new_k=None, new_v=None, *,
            interpret=False):
    """q (T, Hq, D) packed, ``cfg.uniform_q`` tokens per sequence slot; pools
    (Hkv, pages, page_size, D|Dv) -> out (T, Hq, Dv), lse (Hq, T).

    ``interpret``: False to compile for the GPU, or the Mosaic GPU
    interpreter's parameters to run the same kernel on CPU."""
    why = supports(cfg, k_pages.dtype)
    if why:
        raise NotImplementedError(f"paged attention: the Mosaic GPU kernel does not support "
                                  f"{'; '.join(why)}; {_ELSEWHERE}.")
    from fnattn.decoding.api import Cfg as DecodeCfg
    T, Hq, D = q.shape
    S, Tq, ps = cfg.max_seqs, cfg.uniform_q, cfg.page_size
    dcfg = DecodeCfg(scale=cfg.scale, softcap=cfg.softcap, mask_treedef=cfg.mask_treedef,
                     num_splits=cfg.block_sizes.num_splits, block_sizes=cfg.mosaic_gpu)
    zeros = jnp.zeros((S,), I32)
    out, lse, finite = kernel.attend(dcfg, q.reshape(S, Tq, Hq, D), k_pages, v_pages, zeros,
                                     meta.kv_len, sinks, cfg.capacity,
                                     page_table=meta.page_table, interpret=interpret)
    out = out.reshape(T, Hq, -1)
    lse = lse.transpose(1, 0, 2).reshape(Hq, T)
    # Slots of no live sequence give zeros and -inf, sinks or not.
    _, _, valid = common.token_owner(cfg, meta)
    out = jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
    lse = jnp.where(valid[None, :], lse, -jnp.inf)
    # A live sequence whose row names an invalid page among those its keys fill.
    page = jnp.arange(cfg.pages_per_seq, dtype=I32)[None, :]
    covered = (page < common.cdiv(meta.kv_len, ps)[:, None]) & (meta.q_len > 0)[:, None]
    pages_ok = ~jnp.any(covered & (meta.page_table < 0))

    def again():
        return xla.forward(cfg, q, k_pages, v_pages, sinks, meta)

    return lax.cond(finite & pages_ok, lambda: (out, lse), again)
