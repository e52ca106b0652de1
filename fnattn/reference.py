"""The plain-``jnp`` ground truth for every feature of :class:`AttentionSpec`.

Every lowering of every variant is tested against :func:`reference`. It builds
the whole (Tq, Tk) logit matrix, so it is meant for testing and small problems.
"""

from typing import Optional

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, dropout, masks
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["reference", "dense_attention"]


def dense_attention(q, k, v, *, bias, sinks, mask, seed, scale: float,
                    softcap: Optional[float], dropout_rate: float,
                    upcast: bool, q_offset: Optional[int] = None,
                    return_weights: bool = False):
    """Dense attention on "bthd" inputs; returns (out f32, lse f32[, weights]).

    ``upcast=True`` casts q, k, v to float32 before the products (the reference);
    ``False`` multiplies in the input dtype with float32 accumulation.
    GQA is handled by grouping query heads, without repeating k or v.
    """
    B, Tq, Hq, D = q.shape
    _, Tk, Hkv, _ = k.shape
    G = Hq // Hkv
    if upcast:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    qg = q.reshape(B, Tq, Hkv, G, D)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    s = s.reshape(B, Hq, Tq, Tk) * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    allowed = masks.materialize(mask, B, Hq, Tq, Tk, q_offset=q_offset)
    s = jnp.where(allowed, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if sinks is not None:
        sink = sinks.astype(jnp.float32)[None, :, None]
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(s - m[..., None])
    denom = jnp.sum(e, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    safe = jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom > 0, m + jnp.log(safe), -jnp.inf)
    p = e / safe[..., None]
    if dropout_rate > 0:
        b = jnp.arange(B)[:, None, None, None]
        h = jnp.arange(Hq)[None, :, None, None]
        qi = jnp.arange(Tq)[None, None, :, None]
        ki = jnp.arange(Tk)[None, None, None, :]
        keep = dropout.keep_mask(seed, b, h, qi, ki, dropout_rate)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    pv = p.astype(jnp.float32 if upcast else v.dtype).reshape(B, Hkv, G, Tq, Tk)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", pv, v, preferred_element_type=jnp.float32)
    out = out.reshape(B, Tq, Hq, v.shape[-1])
    if return_weights:
        return out, lse, p
    return out, lse


def prepare(spec: AttentionSpec, q, k, v, fn: str):
    """Validates and returns (dims, q, k, v in "bthd", scale, seed)."""
    dims = _checks.check_qkv(q, k, v, spec.layout, fn=fn)
    _checks.check_spec_arrays(spec, dims, fn=fn)
    q, k, v = (_checks.to_bthd(x, spec.layout) for x in (q, k, v))
    seed = (dropout.seed_from_key(spec.dropout_key, spec.dropout_offsets)
            if spec.dropout_rate > 0 else None)
    return dims, q, k, v, _checks.resolve_scale(spec, dims.head_dim), seed


# q, k, v are annotated "...": rank and shape errors come from _checks.check_qkv,
# which names the axes expected for the layout.
@jaxtyped(typechecker=beartype)
def reference(spec: AttentionSpec, q: Shaped[Array, "..."], k: Shaped[Array, "..."],
              v: Shaped[Array, "..."], *, return_weights: bool = False):
    """Reference attention: every spec feature, computed densely in float32.

    Args:
      spec: the :class:`AttentionSpec`.
      q: (B, Tq, Hq, D) ("bthd") or (B, Hq, Tq, D) ("bhtd").
      k: (B, Tk, Hkv, D) or (B, Hkv, Tk, D).
      v: (B, Tk, Hkv, Dv) or (B, Hkv, Tk, Dv).
      return_weights: also return the attention weights (B, Hq, Tq, Tk), float32,
        after dropout.

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
    res = dense_attention(qb, kb, vb, bias=spec.bias, sinks=spec.sinks, mask=spec.mask,
                          seed=seed, scale=scale, softcap=spec.softcap,
                          dropout_rate=spec.dropout_rate, upcast=True,
                          return_weights=return_weights)
    out = _checks.from_bthd(res[0].astype(q.dtype), spec.layout)
    result = AttentionOutput(out, res[1] if spec.return_lse else None)
    if return_weights:
        return result, res[2]
    return result
