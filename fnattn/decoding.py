"""``fnattn.decode``: a few query tokens per sequence against a contiguous KV cache.

The cache holds ``S`` slots per sequence; sequence ``b`` owns the slots
``[kv_starts[b], kv_starts[b] + kv_lengths[b])``, the ``Tq`` new tokens
included (they must already be written, as in every serving loop). Positions
are logical: the key in slot ``kv_starts[b] + j`` is at position ``j`` and
query ``i`` at position ``kv_lengths[b] - Tq + i``, so the spec's positional
mask (``causal()``, ``sliding_window``, ``chunked``, their combinations,
``from_fn``) means exactly what it means in dense attention over the
sequence's tokens: the result equals :func:`fnattn.reference` on q and the
``kv_lengths[b]`` valid keys. Slots outside the valid range are never seen;
a sequence of length 0 gives zeros and ``lse = -inf``.

**Split-K.** The cache is cut into ``num_splits`` contiguous ranges whose
partial results (out, lse) are computed independently (in parallel) and
combined exactly by the merge of :mod:`fnattn.merging`. With few sequences and
long contexts this is what keeps every core (or every GPU multiprocessor)
busy. The default picks the number of splits from B, Hkv and S
(:func:`default_num_splits`); ``AttentionSpec(block_sizes=DecodeBlockSizes(...))``
overrides it.

**Lowering.** One XLA lowering, on every platform: decode reads every cached
key once and is bound by memory bandwidth, and XLA fuses the products,
softmax and split merge into a few passes over the cache. For each split,
when the rows of a GQA group (``Tq * Hq / Hkv``) are few the logits are a fused
multiply-reduce over the cache in its own layout (no transposed copy of K or
V, which is what a batched matrix product would need), otherwise batched
matrix products. Dedicated Pallas kernels serve the paged cache
(:func:`fnattn.paged_attention`), the layout that serving systems use on
accelerators.

It is differentiable (plain ``jnp``) with respect to q, the caches and the
sinks.
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, masks
from fnattn.merging import merge_stacked
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["decode", "DecodeBlockSizes", "default_num_splits"]

F32 = jnp.float32
I32 = jnp.int32

# Rows of one GQA group (Tq * G) up to which the logits are a fused multiply-reduce
# instead of a matrix product (measured on a 2-core x86 CPU, f32, D=128: 2x faster
# than the product at 4 rows, on par at 16).
FUSED_MAX_ROWS = 8
MIN_SPLIT_KEYS = 512
MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Split-K of :func:`fnattn.decode` (``AttentionSpec(block_sizes=...)``).

    Attributes:
      num_splits: contiguous key ranges computed independently and merged; must
        divide the cache length S. None: :func:`default_num_splits`.

    >>> DecodeBlockSizes(num_splits=4).num_splits
    4
    >>> DecodeBlockSizes(num_splits=0)
    Traceback (most recent call last):
    ...
    ValueError: DecodeBlockSizes: num_splits must be a positive int or None; got 0
    """

    num_splits: Optional[int] = None

    def __post_init__(self):
        n = self.num_splits
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n <= 0):
            raise ValueError(f"DecodeBlockSizes: num_splits must be a positive int or None; "
                             f"got {n!r}")


def default_num_splits(batch: int, num_kv_heads: int, cache_len: int) -> int:
    """Enough independent (sequence, kv head, split) items to fill the machine.

    Splits only when there are fewer than 16 (sequence, kv head) pairs, keeps at
    least ``MIN_SPLIT_KEYS`` keys per split, and uses a divisor of ``cache_len``.

    >>> default_num_splits(1, 2, 32768), default_num_splits(64, 8, 32768)
    (8, 1)
    """
    pairs = batch * num_kv_heads
    n = 1
    while pairs * n < 16 and n < MAX_SPLITS:
        n *= 2
    while n > 1 and (cache_len % n or cache_len // n < MIN_SPLIT_KEYS):
        n -= 1
    return n


def _pick_splits(spec, B, Hkv, S) -> int:
    items = spec.block_sizes if isinstance(spec.block_sizes, tuple) else (spec.block_sizes,)
    for b in items:
        if isinstance(b, DecodeBlockSizes) and b.num_splits is not None:
            if S % b.num_splits:
                raise ValueError(f"decode: DecodeBlockSizes(num_splits={b.num_splits}) must "
                                 f"divide the cache length S={S}")
            return b.num_splits
    return default_num_splits(B, Hkv, S)


def _check(spec, q, k_cache, v_cache, kv_lengths, kv_starts):
    fn = "decode"
    dims = _checks.check_qkv(q, k_cache, v_cache, spec.layout, fn=fn)
    B = dims.batch
    for name, x in (("kv_lengths", kv_lengths), ("kv_starts", kv_starts)):
        if x is None:
            continue
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{fn}: {name} must be an integer array; got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if tuple(jnp.shape(x)) != (B,):
            raise ValueError(f"{fn}: {name} must have shape (B,)=({B},), one per sequence "
                             f"of q {tuple(q.shape)}; got {tuple(jnp.shape(x))}")
    if spec.bias is not None:
        raise NotImplementedError(f"{fn}: spec.bias is not supported by decode; "
                                  "fnattn.attention and fnattn.flash take a bias.")
    if spec.dropout_rate > 0:
        raise NotImplementedError(f"{fn}: dropout is not supported by decode (an inference "
                                  "variant); fnattn.attention and fnattn.flash support it.")
    if spec.mask is not None and jax.tree_util.tree_leaves(spec.mask):
        raise NotImplementedError(
            f"{fn}: masks that hold arrays ({spec.mask!r}) are not supported by decode; use "
            "positional masks (causal, sliding_window, chunked, their combinations, "
            "from_fn). kv_lengths and kv_starts already say which keys exist.")
    if spec.sinks is not None:
        _checks.check_float(f"{fn}: sinks", spec.sinks)
        if tuple(spec.sinks.shape) != (dims.num_q_heads,):
            raise ValueError(f"{fn}: sinks must have shape (Hq,)=({dims.num_q_heads},), one "
                             f"logit per query head; got {tuple(spec.sinks.shape)}")
    return dims


@jaxtyped(typechecker=beartype)
def decode(spec: AttentionSpec, q: Shaped[Array, "..."], k_cache: Shaped[Array, "..."],
           v_cache: Shaped[Array, "..."], *, kv_lengths: Shaped[Array, "..."],
           kv_starts: Optional[Shaped[Array, "..."]] = None) -> AttentionOutput:
    """Attention of the newest ``Tq`` tokens of each sequence over its cached keys.

    Args:
      spec: the :class:`AttentionSpec` (mask, scale, softcap, sinks, layout,
        ``block_sizes=DecodeBlockSizes(...)``; no bias, no dropout, no masks
        that hold arrays).
      q: (B, Tq, Hq, D) in "bthd" or (B, Hq, Tq, D) in "bhtd" (Tq small: 1 for
        plain decoding, a few for speculative decoding).
      k_cache: (B, S, Hkv, D) or (B, Hkv, S, D); Hq a multiple of Hkv.
      v_cache: (B, S, Hkv, Dv) or (B, Hkv, S, Dv).
      kv_lengths: (B,) int, valid keys of each sequence (new tokens included).
        Values are clipped to the cache: ``0 <= start``, ``start + length <= S``.
      kv_starts: (B,) int, first valid slot of each sequence (default 0).

    Returns:
      :class:`AttentionOutput`: ``out`` like q with head dim Dv, ``lse``
      (B, Hq, Tq) float32.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> k = v = jax.random.normal(jax.random.key(0), (2, 64, 2, 16))   # cache of 64 slots
    >>> q = jax.random.normal(jax.random.key(1), (2, 1, 8, 16))        # one new token
    >>> spec = AttentionSpec(mask=masks.causal())
    >>> res = jax.jit(fnattn.decode)(spec, q, k, v, kv_lengths=jnp.array([40, 9]))
    >>> ref = fnattn.reference(spec, q[1:], k[1:, :9], v[1:, :9])      # sequence 1's 9 keys
    >>> bool(jnp.allclose(res.out[1:], ref.out, atol=1e-5)), res.lse.shape
    (True, (2, 8, 1))
    """
    dims = _check(spec, q, k_cache, v_cache, kv_lengths, kv_starts)
    B, Tq, S, Hq, Hkv, D, Dv = dims
    G = Hq // Hkv
    qb, kb, vb = (_checks.to_bthd(x, spec.layout) for x in (q, k_cache, v_cache))
    scale = _checks.resolve_scale(spec, D)
    ns = _pick_splits(spec, B, Hkv, S)
    starts = jnp.zeros((B,), I32) if kv_starts is None else kv_starts.astype(I32)
    starts = jnp.clip(starts, 0, S)
    lengths = jnp.clip(kv_lengths.astype(I32), 0, S - starts)
    out, lse = _decode_xla(spec, qb, kb, vb, starts, lengths, scale=scale, num_splits=ns)
    out = _checks.from_bthd(out.reshape(B, Tq, Hq, Dv).astype(q.dtype), spec.layout)
    return AttentionOutput(out, lse if spec.return_lse else None)


def _decode_xla(spec, q, k, v, starts, lengths, *, scale, num_splits):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv) f32, lse (B, Hq, Tq)."""
    B, Tq, Hq, D = q.shape
    _, S, Hkv, Dv = v.shape
    G, ns = Hq // Hkv, num_splits
    C = S // ns
    R = Tq * G                                   # rows of one kv head
    # q as (B, Hkv, R) rows, row r = t * G + g; scaled before the products.
    qr = (q.astype(F32) * scale).reshape(B, Tq, Hkv, G, D).transpose(0, 2, 1, 3, 4)
    qr = qr.reshape(B, Hkv, R, D)
    kr = k.reshape(B, ns, C, Hkv, D)             # free reshapes: no copy of the cache
    vr = v.reshape(B, ns, C, Hkv, Dv)
    fused = R <= FUSED_MAX_ROWS
    if fused:
        # s[b, n, c, h, r]: one pass over the cache in its own layout.
        # (products in float32: the conversion fuses into the same pass)
        s = jnp.sum(qr[:, None, None] * kr[:, :, :, :, None, :].astype(F32), axis=-1)
    else:
        s = jnp.einsum("bhrd,bnchd->bnchr", qr.astype(k.dtype), kr,
                       preferred_element_type=F32)
    if spec.softcap is not None:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    # Positions: key slot n*C + c is at logical position slot - start; row r is
    # query t = r // G of head h * G + r % G.
    slot = (jnp.arange(ns, dtype=I32)[:, None] * C + jnp.arange(C, dtype=I32)[None])
    kpos = slot[None, :, :, None, None] - starts[:, None, None, None, None]
    ok = (kpos >= 0) & (kpos < lengths[:, None, None, None, None])
    if spec.mask is not None:
        r = jnp.arange(R, dtype=I32)
        t = (r // G)[None, None, None, None, :]
        h = (jnp.arange(Hkv, dtype=I32)[:, None] * G + r[None] % G)[None, None, None]
        b = jnp.arange(B, dtype=I32)[:, None, None, None, None]
        q_pos = lengths[:, None, None, None, None] - Tq + t
        pos = masks.Positions(b=b, h=h, q=t, q_pos=q_pos, k=kpos)
        ok = ok & spec.mask.predicate(pos, [])
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
    if spec.sinks is not None:
        sinks = spec.sinks.astype(F32).reshape(Hkv, G)
        sink = jnp.broadcast_to(jnp.tile(sinks, (1, Tq))[None], (B, Hkv, R))
    # (ns, B, Hkv, R, ...) parts -> merged (B, Hkv, R, Dv), (B, Hkv, R)
    out, lse = merge_stacked(jnp.moveaxis(part_out, 1, 0), jnp.moveaxis(part_lse, 1, 0), sink)
    out = out.reshape(B, Hkv, Tq, G, Dv).transpose(0, 2, 1, 3, 4)
    lse = lse.reshape(B, Hkv, Tq, G).transpose(0, 1, 3, 2).reshape(B, Hq, Tq)
    return out, lse
