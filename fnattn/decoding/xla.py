"""The XLA lowering of :func:`fnattn.decode` (every platform).

For each split of the cache (split-K), when the rows of a GQA group
(``Tq * Hq / Hkv``) are few the logits are a fused multiply-reduce over the
cache in its own layout (no transposed copy of K or V, which is what a batched
matrix product would need), otherwise batched matrix products. The partial
results of the splits are combined by the merge of :mod:`fnattn.merging`, where
the sinks join the denominator once. Plain ``jnp``: differentiable.
"""

import jax
import jax.numpy as jnp

from fnattn import masks
from fnattn.merging import merge_stacked

__all__ = ["forward", "reference_forward"]

F32 = jnp.float32
I32 = jnp.int32

# Rows of one GQA group (Tq * G) up to which the logits are a fused multiply-reduce
# instead of a matrix product (measured on a 2-core x86 CPU, f32, D=128: 2x faster
# than the product at 4 rows, on par at 16).
FUSED_MAX_ROWS = 8


def forward(cfg, q, k, v, starts, lengths, sinks):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv) q.dtype, lse (B, Hq, Tq)."""
    out, lse = _attend(cfg, q, k, v, starts, lengths, sinks, num_splits=cfg.num_splits)
    return out.astype(q.dtype), lse


def reference_forward(cfg, q, k, v, starts, lengths, sinks):
    """The same with one split and every product a plain einsum (impl="reference")."""
    out, lse = _attend(cfg, q, k, v, starts, lengths, sinks, num_splits=1, fused=False)
    return out.astype(q.dtype), lse


def _attend(cfg, q, k, v, starts, lengths, sinks, *, num_splits, fused=None):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv) f32, lse (B, Hq, Tq)."""
    B, Tq, Hq, D = q.shape
    _, S, Hkv, Dv = v.shape
    G, ns = Hq // Hkv, num_splits
    C = S // ns
    R = Tq * G                                   # rows of one kv head
    # q as (B, Hkv, R) rows, row r = t * G + g; scaled before the products.
    qr = (q.astype(F32) * cfg.scale).reshape(B, Tq, Hkv, G, D).transpose(0, 2, 1, 3, 4)
    qr = qr.reshape(B, Hkv, R, D)
    kr = k.reshape(B, ns, C, Hkv, D)             # free reshapes: no copy of the cache
    vr = v.reshape(B, ns, C, Hkv, Dv)
    fused = R <= FUSED_MAX_ROWS if fused is None else fused
    if fused:
        # s[b, n, c, h, r]: one pass over the cache in its own layout.
        # (products in float32: the conversion fuses into the same pass)
        s = jnp.sum(qr[:, None, None] * kr[:, :, :, :, None, :].astype(F32), axis=-1)
    else:
        s = jnp.einsum("bhrd,bnchd->bnchr", qr.astype(k.dtype), kr,
                       preferred_element_type=F32)
    if cfg.softcap is not None:
        s = cfg.softcap * jnp.tanh(s / cfg.softcap)
    # Positions: key slot n*C + c is at logical position slot - start; row r is
    # query t = r // G of head h * G + r % G.
    slot = (jnp.arange(ns, dtype=I32)[:, None] * C + jnp.arange(C, dtype=I32)[None])
    kpos = slot[None, :, :, None, None] - starts[:, None, None, None, None]
    ok = (kpos >= 0) & (kpos < lengths[:, None, None, None, None])
    mask = cfg.mask
    if mask is not None:
        r = jnp.arange(R, dtype=I32)
        t = (r // G)[None, None, None, None, :]
        h = (jnp.arange(Hkv, dtype=I32)[:, None] * G + r[None] % G)[None, None, None]
        b = jnp.arange(B, dtype=I32)[:, None, None, None, None]
        q_pos = lengths[:, None, None, None, None] - Tq + t
        pos = masks.Positions(b=b, h=h, q=t, q_pos=q_pos, k=kpos)
        ok = ok & mask.predicate(pos, [])
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=2)                       # (B, ns, Hkv, R)
    m_safe = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(s - m_safe[:, :, None])
    l = jnp.sum(p, axis=2)
    if fused:
        o = jnp.sum(p[..., None] * vr[:, :, :, :, None, :].astype(F32), axis=2)
    else:
        o = jnp.einsum("bnchr,bnchd->bnhrd", p.astype(v.dtype), vr, preferred_element_type=F32)
    seen = l > 0
    part_lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    part_out = o / jnp.where(seen, l, 1.0)[..., None]
    sink = None
    if sinks is not None:
        sinks = sinks.astype(F32).reshape(Hkv, G)
        sink = jnp.broadcast_to(jnp.tile(sinks, (1, Tq))[None], (B, Hkv, R))
    # (ns, B, Hkv, R, ...) parts -> merged (B, Hkv, R, Dv), (B, Hkv, R)
    out, lse = merge_stacked(jnp.moveaxis(part_out, 1, 0), jnp.moveaxis(part_lse, 1, 0), sink)
    out = out.reshape(B, Hkv, Tq, G, Dv).transpose(0, 2, 1, 3, 4).reshape(B, Tq, Hq, Dv)
    lse = lse.reshape(B, Hkv, Tq, G).transpose(0, 1, 3, 2).reshape(B, Hq, Tq)
    return out, lse
