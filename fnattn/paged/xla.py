"""The XLA lowering of paged attention (every platform; the default off GPU/TPU).

**Work items.** Query tokens are grouped into work items of ``block_q`` tokens
of one sequence (one item per sequence in ``paged_attention``); the query heads
of each GQA group are stacked along the rows of one matrix, so every product is
a batched ``(rows x D) @ (D x keys)`` with batch axes (kv head, item) and K and
V are never repeated. The pools are laid out heads-major, (Hkv, pages,
page_size, D), so gathering a sequence's pages gives (Hkv, item, keys, D)
directly, with no transpose before the products.

**Split-K over key chunks.** Keys are visited in chunks of ``block_k`` (a
multiple of the page size): a ``lax.fori_loop`` gathers one chunk of pages per
step and folds it into an online softmax, so the gathered keys are used while
they are still in cache and no (tokens x whole context) array is formed. A
chunk that no item can see (past every sequence's length, or outside every
item's window, from the mask's ``tile_bounds``) is skipped at run time by a
``lax.cond``. Short contexts (one chunk) take a single pass with no loop.

**Trees** (speculative verification, :mod:`fnattn.paged.tree`): each row's
keys among its sequence's new tokens are its ancestors, tested only in chunks
that hold new tokens; positions are depth-based, and the chunks a positional
mask leaves empty at those positions are skipped as above.

**Cache update.** With new tokens, they are first scattered into their slots
(``mode="drop"``: invalid slots are dropped), then attention reads the pool.

**Quantized pools** (:mod:`fnattn.quant`): each chunk's codes are gathered
and converted to q's dtype (exactly) for the products, and its scales
multiply the logits (K) and the probabilities (V) instead of the codes, so no
dequantized array, not even of one chunk, is formed (the sanitising pass,
which inspects values, dequantizes one chunk); the update quantizes the new tokens with
:func:`fnattn.quant.quantize` and scatters codes and scales alike.

The function is differentiable (``jax.vjp`` of it is the backward of every
lowering's attention-only forms).
"""

import functools

import jax.numpy as jnp
from jax import lax

from fnattn import _checks, quant
from fnattn._varying import varying_like
from fnattn.merging import shifted_exp
from fnattn import _online as online
from fnattn.paged import common
from fnattn.paged import tree as treemod
from fnattn.paged.common import F32, I32, Cfg, Meta

__all__ = ["forward", "write_tokens", "attend"]

DEFAULT_BLOCK_Q = 8
# Default chunk: about this many bytes of gathered keys per step (all items and kv
# heads), so that a chunk is still in cache when its products read it. Measured on
# a 2-core x86 CPU (f32, D=64, Hkv=2): 4-6x faster than gathering the whole
# context at once for long contexts, never slower for short ones.
CHUNK_BYTES = 2 ** 21
MIN_CHUNK, MAX_CHUNK = 128, 4096


def write_tokens(cfg: Cfg, meta: Meta, k_pages, v_pages, new_k, new_v):
    """The pools with each live token's k/v written at its slot; invalid slots dropped."""
    Hkv, N, ps = cfg.num_kv_heads, cfg.num_pages, cfg.page_size
    seq, row, valid = common.token_owner(cfg, meta)
    pos = meta.kv_len[seq] - meta.q_len[seq] + row
    page_idx = jnp.clip(pos // ps, 0, cfg.pages_per_seq - 1)
    page = meta.page_table[seq, page_idx]
    ok = valid & (pos >= 0) & (pos < cfg.capacity) & (page >= 0)
    slot = jnp.where(ok, page * ps + pos % ps, N * ps)  # N * ps: out of range, dropped

    def put(pool, new):
        if pool is None:               # a latent pool has no values of its own
            return None
        if quant.is_quantized(pool):  # quantize's codes and per-token scales, at the slots
            flat = quant.write(pool.reshape_leading(Hkv, N * ps), (slice(None), slot),
                               jnp.swapaxes(new, 0, 1))
            return flat.reshape_leading(Hkv, N, ps)
        flat = pool.reshape(Hkv, N * ps, pool.shape[-1])
        flat = flat.at[:, slot].set(jnp.swapaxes(new, 0, 1).astype(pool.dtype), mode="drop",
                                    unique_indices=False)
        return flat.reshape(pool.shape)

    return put(k_pages, new_k), put(v_pages, new_v)


def _load(pool, pages, dtype, dequantize: bool, lead):
    """``(values, scale)`` of the slots of ``pages`` (W, ppc) of a pool, the
    values as ``lead + (head dim,)``: a float pool's and None; a quantized
    pool's codes as ``dtype`` and its scales (per token: ``lead``; per tensor:
    the scalar), or with ``dequantize`` codes times scales and None."""
    index = (slice(None), pages)
    if not quant.is_quantized(pool):
        return pool[index].astype(dtype).reshape(*lead, pool.shape[-1]), None
    part = pool[index]
    if dequantize:
        return quant.dequantize(part, dtype).reshape(*lead, pool.shape[-1]), None
    codes = quant.code_halves(pool.format, part.data, dtype)   # (4-bit: two halves)
    codes = (tuple(c.reshape(*lead, c.shape[-1]) for c in codes) if isinstance(codes, tuple)
             else codes.reshape(*lead, pool.shape[-1]))
    scale = jnp.asarray(part.scale, F32)
    return codes, (scale.reshape(lead) if pool.format.per_token else scale)


def _scaled(x, scale, factor=1.0):
    """``x`` (Hkv, W, M, C) times a per-token (Hkv, W, C) or per-tensor scale
    (None: none) and a static ``factor``."""
    if scale is None:
        return x * factor if factor != 1.0 else x
    scale = scale * factor if factor != 1.0 else scale
    return x * (scale[:, :, None, :] if scale.ndim else scale)


def _token_gather_index(cfg: Cfg, meta: Meta, block_q: int):
    """For every packed token: its (item * block_q + row) in the items' rows, and validity."""
    seq, row, valid = common.token_owner(cfg, meta)
    if cfg.uniform_q is not None:
        return seq * block_q + row, valid
    nb = common.cdiv(meta.q_len, block_q)
    first = jnp.cumsum(nb) - nb
    item = first[seq] + row // block_q
    return jnp.where(valid, item * block_q + row % block_q, 0), valid


def attend(cfg: Cfg, q, k_pages, v_pages, sinks, meta: Meta, *, sanitize=None):
    """Attention of packed q (T, Hq, D) over the pools; (out (T, Hq, Dv) q.dtype, lse (Hq, T)).

    ``sanitize=None`` sanitises keys (``_online.finite_keys``) only when the pools
    hold a non-finite value where this call looked (``_online.clean_unless_garbage``);
    ``True`` always does, which is what the backward differentiates (through a
    ``cond`` the untaken branch gets zero cotangents, and 0 * NaN is NaN).
    """
    f = functools.partial(_attend, cfg, q, k_pages, v_pages, sinks, meta)
    return online.clean_unless_garbage(f) if sanitize is None else f(sanitize)[:2]


def _attend(cfg: Cfg, q, k_pages, v_pages, sinks, meta: Meta, sanitize: bool):
    bs = cfg.block_sizes
    T, Hq, D = q.shape
    Hkv, G, Dv, ps = cfg.num_kv_heads, cfg.group, cfg.v_head_dim, cfg.page_size
    bq = cfg.uniform_q if cfg.uniform_q is not None else (bs.block_q or DEFAULT_BLOCK_Q)
    if _checks.is_static(T):  # (a symbolic T, under jax.export, keeps block_q)
        bq = min(bq, T)
    n_items = common.num_work_items(cfg, bq)
    if bs.block_k:
        chunk = bs.block_k
    elif not _checks.is_static(n_items):
        chunk = MIN_CHUNK  # symbolic sizes (jax.export): the chunk for many items
    else:
        # (a quantized pool's chunk is converted to q's dtype for the products)
        itemsize = max(jnp.dtype(k_pages.dtype).itemsize, jnp.dtype(q.dtype).itemsize)
        per_key = n_items * Hkv * D * itemsize
        chunk = min(max(common.pow2(max(CHUNK_BYTES // per_key, 1)), MIN_CHUNK), MAX_CHUNK)
    ppc = max(1, chunk // ps)                                   # pages per chunk
    if _checks.is_static(cfg.pages_per_seq):
        ppc = min(ppc, cfg.pages_per_seq)
    C = ppc * ps
    n_chunks = common.cdiv(cfg.pages_per_seq, ppc)
    work = common.work_list(cfg, meta, bq, C)
    W, M = work.seq.shape[0], bq * G
    # a tree over the new tokens (fnattn.paged.tree): depth-based positions, and
    # the chunks skipped from the mask's tile bounds at those positions
    tree = treemod.build(cfg, meta) if cfg.tree else None
    if tree is not None and cfg.mask() is not None:
        work = work._replace(**dict(zip(("k_lo", "k_hi", "f_lo", "f_hi"),
                                        treemod.block_ranges(cfg, work, tree, bq, C, meta))))

    if cfg.uniform_q is not None:
        qw = q.reshape(W, bq, Hq, D)
    else:
        idx = jnp.clip(work.tok[:, None] + jnp.arange(bq, dtype=I32), 0, T - 1)
        qw = q[idx]
    # (Hkv, W, M, D), row m = t * G + g.
    qw = qw.reshape(W, bq, Hkv, G, D).transpose(2, 0, 1, 3, 4).reshape(Hkv, W, M, D)
    t_of = jnp.arange(M, dtype=I32) // G
    g_of = jnp.arange(M, dtype=I32) % G
    raw_q = (work.row0[:, None] + t_of)[None, :, :, None]          # (1, W, M, 1)
    q_pos = (work.q_pos[:, None] + t_of)[None, :, :, None]
    if tree is not None:
        q_pos = treemod.query_positions(tree, work, bq, G)
    seq4 = work.seq[None, :, None, None]
    head4 = (jnp.arange(Hkv, dtype=I32)[:, None] * G + g_of)[:, None, :, None]  # (Hkv, 1, M, 1)
    mask, mask_ops = common.mask_and_operands(cfg, meta)   # (traced sizes: their values)
    # a position term's per-head arrays at each row: (Hkv, 1, M, 1)
    term_rows = None if cfg.term() is None else (
        lambda x: x.reshape(Hkv, G)[:, g_of][:, None, :, None])

    pt = meta.page_table[work.seq]                                   # (W, P)
    pad = n_chunks * ppc - cfg.pages_per_seq
    if not _checks.is_static(pad) or pad:
        pt = jnp.pad(pt, ((0, 0), (0, pad)), constant_values=-1)

    def scores(j):
        pages = lax.dynamic_slice_in_dim(pt, j * ppc, ppc, axis=1)  # (W, ppc)
        safe = jnp.maximum(pages, 0)
        # A quantized pool: this chunk's codes, as q's dtype, and its scales,
        # applied to the logits and the probabilities (q . (c * s) = (q . c) * s):
        # no element of the pool is multiplied (dequantized when sanitising).
        kc, ks = _load(k_pages, safe, qw.dtype, sanitize, (Hkv, W, C))
        # A latent pool: the values are the keys' first Dv channels. The product
        # takes the keys whole and the output keeps its first Dv channels: a
        # slice of the keys here would be a copy of them.
        vc, vs = ((kc, ks) if v_pages is None else
                  _load(v_pages, safe, qw.dtype, sanitize, (Hkv, W, C)))
        # Slots past a sequence's length and pages it does not own may hold anything
        # (NaN from a released request, never-written memory): see _online.finite_keys.
        if sanitize:
            kc, vc, bad = online.finite_keys(kc, vc)
        s = _scaled(quant.einsum_codes("hwmd,hwkd->hwmk", qw, kc), ks, cfg.scale)
        finite = sanitize or jnp.all(jnp.isfinite(s))    # before the cap hides an inf
        kpos = j * C + jnp.arange(C, dtype=I32)
        kpos4, tree_ok = kpos[None, None, None, :], None
        if tree is not None:   # the new tokens' keys at depth-based positions
            kpos4, tree_ok = treemod.chunk_visibility(tree, work, kpos, bq, G)
        if term_rows is not None:  # a position term, added before the cap
            pos = common.positions(seq4, head4, raw_q, q_pos, kpos4)
            s = s + common.term_value(cfg, meta, pos, term_rows)
        if cfg.softcap is not None:
            s = cfg.softcap * jnp.tanh(s / cfg.softcap)
        if sanitize:
            s = jnp.where(bad[:, :, None, :], jnp.nan, s)
        ok = (kpos[None, :] < work.kv_len[:, None]) & jnp.repeat(pages >= 0, ps, axis=1)
        ok = ok[None, :, None, :]
        if tree_ok is not None:
            ok = ok & tree_ok
        if mask is not None:
            pos = common.positions(seq4, head4, raw_q, q_pos, kpos4)
            ok = ok & mask.predicate(pos, mask_ops)
        return jnp.where(ok, s, -jnp.inf), (vc, vs), finite

    def fold(j, carry):
        m, l, acc, finite = carry
        s, (vc, vs), finite_j = scores(j)
        # The running max is only a shift: no gradient flows through it (the result
        # does not depend on it), which keeps the backward exact and NaN-free.
        m_new = lax.stop_gradient(jnp.maximum(m, s.max(-1)))
        # Rows that have seen no visible key keep m = -inf: shift by 0 so exp is 0, not NaN.
        m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_use[..., None])
        alpha = jnp.exp(m - m_use)
        l = l * alpha + p.sum(-1)
        pv = _scaled(p, vs).astype((vc[0] if isinstance(vc, tuple) else vc).dtype)
        acc = acc * alpha[..., None] + quant.einsum_codes("hwmk,hwkd->hwmd", pv, vc)
        return m_new, l, acc, finite & finite_j

    m = jnp.full((Hkv, W, M), -jnp.inf, F32)
    l = jnp.zeros((Hkv, W, M), F32)
    acc = jnp.zeros((Hkv, W, M, D if v_pages is None else Dv), F32)
    m, l, acc, finite = varying_like((m, l, acc, jnp.bool_(True)), q, k_pages, v_pages, sinks,
                                     meta)
    if _checks.is_static(n_chunks) and n_chunks == 1:
        m, l, acc, finite = fold(0, (m, l, acc, finite))
    else:
        lo, hi = work.k_lo, work.k_hi
        live = work.rows > 0

        def step(j, carry):
            needed = jnp.any(live & (lo <= j) & (j < hi))
            return lax.cond(needed, functools.partial(fold, j), lambda c: c, carry)

        m, l, acc, finite = lax.fori_loop(0, n_chunks, step, (m, l, acc, finite))

    if sinks is not None:
        # Infinite sinks as in fnattn._online.join_sink: -inf is no sink, +inf takes all
        # the mass (out 0, lse +inf, d(sink) = d(lse): shifted_exp's derivative is 1).
        sink = sinks.astype(F32).reshape(Hkv, G)[:, g_of][:, None, :]   # (Hkv, 1, M)
        m_fin = lax.stop_gradient(jnp.maximum(m, sink))
        m_use = jnp.where(m_fin == -jnp.inf, 0.0, m_fin)
        a = shifted_exp(m, m_use)
        l = l * a + shifted_exp(sink, m_use)
        acc = acc * a[..., None]
        m = m_fin
    empty = l == 0                        # (a row that saw a NaN key stays NaN)
    safe = jnp.where(empty, 1.0, l)
    out = acc[..., :Dv] / safe[..., None]     # (a latent pool: its first Dv channels)
    lse = jnp.where(empty, -jnp.inf, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(safe))

    # Items' rows back to packed tokens; tokens of no sequence get 0 and -inf.
    out = out.reshape(Hkv, W, bq, G, Dv).transpose(1, 2, 0, 3, 4).reshape(W * bq, Hq, Dv)
    lse = lse.reshape(Hkv, W, bq, G).transpose(1, 2, 0, 3).reshape(W * bq, Hq)
    index, valid = _token_gather_index(cfg, meta, bq)
    out = jnp.where(valid[:, None, None], out[index], 0.0).astype(q.dtype)
    lse = jnp.where(valid[:, None], lse[index], -jnp.inf).T
    return out, lse, finite & jnp.all(jnp.isfinite(acc))


def forward(cfg: Cfg, q, k_pages, v_pages, sinks, meta: Meta, new_k=None, new_v=None):
    """(out, lse) or, with new tokens, (out, lse, k_pages, v_pages)."""
    if cfg.update:
        k_pages, v_pages = write_tokens(cfg, meta, k_pages, v_pages, new_k, new_v)
        out, lse = attend(cfg, q, k_pages, v_pages, sinks, meta)
        return out, lse, k_pages, v_pages
    return attend(cfg, q, k_pages, v_pages, sinks, meta)
