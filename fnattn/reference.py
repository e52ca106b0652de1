"""The plain-``jnp`` ground truth for every feature of :class:`AttentionSpec`.

Every lowering of every variant is tested against :func:`reference`. It builds
the whole (Tq, Tk) logit matrix, so it is meant for testing and small problems.
"""

from typing import Optional

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, dropout, masks, position_bias
from fnattn._online import finite_keys
from fnattn._platforms import mixed_einsum
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["reference", "dense_attention"]


def dense_attention(q, k, v, *, bias, sinks, mask, seed, scale: float,
                    softcap: Optional[float], dropout_rate: float,
                    upcast: bool, q_offset: Optional[int] = None,
                    return_weights: bool = False, late_normalize: bool = False):
    """Dense attention on "bthd" inputs; returns (out, lse[, weights]) in the
    accumulation dtype ``promote(float32, dtype)`` (float32, or float64 for
    float64 inputs).

    ``upcast=True`` casts q, k, v to the accumulation dtype before the products
    (the reference); ``False`` multiplies the inputs as they are, accumulating
    in the accumulation dtype (:func:`fnattn._platforms.mixed_einsum`). GQA is
    handled by grouping query heads, without repeating k or v.

    ``late_normalize`` (the XLA lowering's form; ``return_weights`` refuses it)
    multiplies V by the unnormalised weights ``exp(s - m)`` and divides the
    (Tq, Dv) result by the row sums, as the blockwise lowerings do, instead of
    dividing the (Tq, Tk) weights: the same value up to rounding, one pass
    over the (Tq, Tk) arrays fewer, and its ``jax.vjp`` (the lowering's
    backward) 1.3-1.8x faster on a CPU at 2048 tokens.

    Masked keys contribute exactly nothing, whatever their K/V bits hold: a key
    whose K or V holds a non-finite value is zeroed and its logit made NaN for
    the rows that may see it (those rows are NaN, honestly), then the mask sets
    it to -inf for the rest. Infinite sinks: -inf is no sink; +inf takes all the
    mass (out 0, lse +inf, d(sink) = d(lse), no gradient to anything else).
    """
    if late_normalize and return_weights:
        raise ValueError("dense_attention: return_weights needs the normalised weights; "
                         "late_normalize divides the output instead (pass one of them)")
    B, Tq, Hq, D = q.shape
    _, Tk, Hkv, _ = k.shape
    G = Hq // Hkv
    acc = jnp.promote_types(jnp.float32, q.dtype)
    if upcast:
        q, k, v = (x.astype(acc) for x in (q, k, v))
    # Non-finite keys: zeroed and flagged per (b, key, kv head) (_online.finite_keys).
    k, v, bad = finite_keys(k, v)
    # The products in the (B, Hkv, G, Tq, .) order of the logits, q transposed
    # to it first: the (Tq, Tk) results then need no transpose (on a CPU, XLA
    # transposed them for "bqhgd,bkhd->bhgqk": 4x the time at 2048 tokens).
    qg = q.reshape(B, Tq, Hkv, G, D).transpose(0, 2, 3, 1, 4)
    s = mixed_einsum("bhgqd,bkhd->bhgqk", qg, k, acc)
    s = s.reshape(B, Hq, Tq, Tk) * scale
    if bias is not None:
        s = s + bias.astype(acc)
    if position_bias.present(mask):
        s = s + _position_term(mask, B, Hq, Tq, Tk, q_offset).astype(acc)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    # (B, Tk, Hkv) -> (B, Hq, 1, Tk): query head h reads kv head h // G.
    bad = jnp.repeat(jnp.swapaxes(bad, 1, 2), G, axis=1)[:, :, None, :]
    s = jnp.where(bad, jnp.nan, s)
    allowed = masks.materialize(mask, B, Hq, Tq, Tk, q_offset=q_offset)
    s = jnp.where(allowed, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    inf_sink = None
    if sinks is not None:
        sink = sinks.astype(acc)[None, :, None]
        # A sink of +inf is handled apart (below); the rest of the row is computed
        # with a finite stand-in, so that its gradients are finite (and masked out).
        inf_sink = sink == jnp.inf
        sink = jnp.where(inf_sink, jnp.zeros((), acc), sink)
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(s - m[..., None])
    denom = jnp.sum(e, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    # denom == 0, not <= 0: a NaN row (one that sees a non-finite key) stays NaN.
    dead = denom == 0
    safe = jnp.where(dead, 1.0, denom)
    lse = jnp.where(dead, -jnp.inf, m + jnp.log(safe))
    # (late_normalize: the rows' factor 1 / safe is applied to the output instead, below)
    p = e if late_normalize else e / safe[..., None]
    inf_row = None
    if inf_sink is not None:
        # p_sink = 1: no weight on any key, lse = sink (+inf; d(sink) = d(lse)).
        # A row that sees a non-finite key stays NaN.
        inf_row = inf_sink & ~jnp.isnan(lse)
        lse = jnp.where(inf_row, sinks.astype(acc)[None, :, None], lse)
        if not late_normalize:
            p = jnp.where(inf_row[..., None], jnp.zeros((), acc), p)
    if dropout_rate > 0:
        b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
        h = jnp.arange(Hq, dtype=jnp.int32)[None, :, None, None]
        qi = jnp.arange(Tq, dtype=jnp.int32)[None, None, :, None]
        ki = jnp.arange(Tk, dtype=jnp.int32)[None, None, None, :]
        keep = dropout.keep_mask(seed, b, h, qi, ki, dropout_rate)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    pv = p.astype(acc if upcast else v.dtype).reshape(B, Hkv, G, Tq, Tk)
    out = mixed_einsum("bhgqk,bkhd->bhgqd", pv, v, acc)
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, Tq, Hq, v.shape[-1])
    if late_normalize:
        rows = jnp.swapaxes(safe, 1, 2)[..., None]  # (B, Tq, Hq, 1)
        out = out / rows
        if inf_row is not None:
            out = jnp.where(jnp.swapaxes(inf_row, 1, 2)[..., None], jnp.zeros((), acc), out)
    if return_weights:
        return out, lse, p
    return out, lse


def _position_term(mask, B, Hq, Tq, Tk, q_offset):
    """The position term of ``mask`` (a :func:`fnattn.position_bias.attach`) on
    the whole (B, Hq, Tq, Tk) logit matrix."""
    pos = masks.dense_positions(B, Hq, Tq, Tk, q_offset=q_offset)
    return position_bias.term(mask, pos, mask.operands())


def prepare(spec: AttentionSpec, q, k, v, fn: str):
    """Validates and returns (dims, q, k, v in "bthd", scale, seed)."""
    dims = _checks.check_qkv(q, k, v, spec.layout, fn=fn)
    _checks.check_spec_arrays(spec, dims, fn=fn, position_bias=True)
    q, k, v = (_checks.to_bthd(x, spec.layout) for x in (q, k, v))
    seed = None
    if spec.dropout_rate > 0:
        # Inside shard_map without offsets: one independent mask per shard.
        key = dropout.key_for_shard(spec.dropout_key, spec.dropout_offsets, q)
        seed = dropout.seed_from_key(key, spec.dropout_offsets)
    return dims, q, k, v, _checks.resolve_scale(spec, dims.head_dim), seed


# q, k, v are annotated "...": rank and shape errors come from _checks.check_qkv,
# which names the axes expected for the layout.
@_checks.entry_point("fnattn.reference")
@jaxtyped(typechecker=beartype)
def reference(spec: AttentionSpec, q: Shaped[Array, "..."], k: Shaped[Array, "..."],
              v: Shaped[Array, "..."], *, return_weights: bool = False):
    """Reference attention: every spec feature, computed densely in float32
    (float64 for float64 inputs, with ``jax_enable_x64``).

    Keys a query row may not see contribute nothing to it, whatever their K/V
    hold (NaN, inf); a row that sees a key with a non-finite K or V is NaN. A
    sink of -inf is no sink; +inf takes all the mass (out 0, lse +inf).

    Args:
      spec: the :class:`AttentionSpec`.
      q: (B, Tq, Hq, D) ("bthd") or (B, Hq, Tq, D) ("bhtd").
      k: (B, Tk, Hkv, D) or (B, Hkv, Tk, D).
      v: (B, Tk, Hkv, Dv) or (B, Hkv, Tk, Dv).
      return_weights: also return the attention weights (B, Hq, Tq, Tk), float32
        (float64 for float64 inputs), after dropout.

    Returns:
      :class:`AttentionOutput`, or ``(AttentionOutput, weights)``.

    >>> import jax, jax.numpy as jnp
    >>> from fnattn import AttentionSpec, masks, reference
    >>> q = k = v = jnp.ones((1, 3, 2, 4))
    >>> res = jax.jit(reference)(AttentionSpec(mask=masks.causal()), q, k, v)
    >>> res.out.shape, res.lse.shape
    ((1, 3, 2, 4), (1, 2, 3))
    """
    dims, qb, kb, vb, scale, seed = prepare(spec, q, k, v, "reference")
    mask = position_bias.attach(spec.mask, spec.position_bias, constant=False)
    res = dense_attention(qb, kb, vb, bias=spec.bias, sinks=spec.sinks, mask=mask,
                          seed=seed, scale=scale, softcap=spec.softcap,
                          dropout_rate=spec.dropout_rate, upcast=True,
                          return_weights=return_weights)
    out = _checks.from_bthd(res[0].astype(q.dtype), spec.layout)
    result = AttentionOutput(out, res[1] if spec.return_lse else None)
    if return_weights:
        return result, res[2]
    return result
