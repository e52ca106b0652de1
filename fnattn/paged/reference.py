"""A plain ``jnp`` paged attention: gather each token's whole context, then softmax.

The simplest correct implementation, kept beside the lowerings as their
reference (``impl="reference"``) and as the baseline the XLA lowering is
measured against: every packed token gathers all ``pages_per_seq`` pages of its
sequence and forms a (tokens, Hq, capacity) logit array. It shares only the
sanitised metadata (:func:`fnattn.paged.common.sanitize`) with the lowerings.
"""

import jax.numpy as jnp

from fnattn.merging import shifted_exp
from fnattn import _online as online
from fnattn import quant
from fnattn.paged import common
from fnattn.paged import tree as treemod
from fnattn.paged.common import F32, I32, Cfg, Meta

__all__ = ["attend"]


def attend(cfg: Cfg, q, k_pages, v_pages, sinks, meta: Meta):
    """(out (T, Hq, Dv) in q.dtype, lse (Hq, T) f32) for packed q (T, Hq, D)."""
    T, Hq, D = q.shape
    Hkv, G, ps = cfg.num_kv_heads, cfg.group, cfg.page_size
    seq, row, valid = common.token_owner(cfg, meta)
    L = meta.kv_len[seq]
    pages = meta.page_table[seq]                                        # (T, P)
    idx = (slice(None), jnp.maximum(pages, 0))     # (a quantized pool: dequantized)
    k = quant.load(k_pages, idx, F32).reshape(Hkv, T, cfg.capacity, D)
    v = (k[..., :cfg.v_head_dim] if v_pages is None else   # (a latent pool)
         quant.load(v_pages, idx, F32).reshape(Hkv, T, cfg.capacity, -1))
    k, v, bad = online.finite_keys(k, v)     # (Hkv, T, capacity) bad keys
    qg = q.reshape(T, Hkv, G, D).astype(F32)
    s = jnp.einsum("thgd,htkd->thgk", qg, k.astype(F32)) * cfg.scale
    kpos = jnp.arange(cfg.capacity, dtype=I32)
    heads = jnp.arange(Hq, dtype=I32).reshape(1, Hkv, G, 1)
    col = lambda x: x[:, None, None, None]  # noqa: E731
    q_pos, k_pos, tree_ok = L - meta.q_len[seq] + row, kpos[None, :], None
    if cfg.tree:   # depth-based positions; new keys visible to their descendants only
        tree = treemod.build(cfg, meta)
        start = L - meta.q_len[seq]
        q_pos = start + tree.depth
        k_pos, new, kt = treemod.key_positions(tree, kpos[None, :], start[:, None],
                                               meta.q_start[seq][:, None], L[:, None])
        t = jnp.arange(T, dtype=I32)[:, None]
        tree_ok = ~new | treemod.is_ancestor(tree, t, kt)
    pos = common.positions(col(seq), heads, col(row), col(q_pos), k_pos[:, None, None, :])
    term = common.term_value(cfg, meta, pos, lambda x: x.reshape(1, Hkv, G, 1))
    if term is not None:   # a position term, added before the cap
        s = s + term
    if cfg.softcap is not None:
        s = cfg.softcap * jnp.tanh(s / cfg.softcap)
    s = jnp.where(jnp.transpose(bad, (1, 0, 2))[:, :, None, :], jnp.nan, s)
    ok = (kpos[None, :] < L[:, None]) & jnp.repeat(pages >= 0, ps, axis=1) & valid[:, None]
    if tree_ok is not None:
        ok = ok & tree_ok
    ok = ok[:, None, None, :]
    mask, ops = common.mask_and_operands(cfg, meta)
    if mask is not None:
        ok = ok & mask.predicate(pos, ops)
    s = jnp.where(ok, s, -jnp.inf)
    m = s.max(-1)
    if sinks is not None:   # infinite sinks: as fnattn._online.join_sink
        sink = sinks.astype(F32).reshape(1, Hkv, G)
        m = jnp.maximum(m, sink)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    e = shifted_exp(s, m[..., None])
    denom = e.sum(-1)
    if sinks is not None:
        denom = denom + shifted_exp(sink, m)
    empty = denom == 0
    safe = jnp.where(empty, 1.0, denom)
    out = jnp.einsum("thgk,htkd->thgd", e / safe[..., None], v.astype(F32))
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(safe))
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    lse = jnp.where(valid[:, None, None], lse, -jnp.inf)
    return out.reshape(T, Hq, -1).astype(q.dtype), lse.reshape(T, Hq).T
