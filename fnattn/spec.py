"""`AttentionSpec`, the frozen pytree that configures every fnattn variant.

Array fields (``mask``'s arrays, ``bias``, ``sinks``, ``dropout_key``) are pytree
leaves: they may be traced, vmapped and (``bias``, ``sinks``) differentiated, and
changing their values does not retrace. Every other field is static
configuration: changing it retraces.

How the logits of one query row are formed (all in float32)::

    s_k   = scale * (q . k_k)                    # scale defaults to 1/sqrt(D)
    s_k   = s_k + bias[b, h, q, k]               # if bias is given
    s_k   = softcap * tanh(s_k / softcap)        # if softcap is given
    s_k   = -inf where the mask disallows k
    lse   = log(exp(sinks[h]) + sum_k exp(s_k))  # the sink term only if sinks given
    p_k   = exp(s_k - lse)
    p_k   = p_k * keep[b, h, q, k] / (1 - rate)  # if dropout_rate > 0
    out   = sum_k p_k v_k

**Sinks and lse.** A sink is a logit with a zero value vector: it joins the
denominator and nothing else. ``lse`` *includes* the sink term, so
``out == sum_k exp(s_k - lse) v_k`` holds exactly. To merge partial results over
disjoint key ranges (split-K, ring attention), compute the parts *without* sinks
and add the sink once, as one more part with ``out = 0`` and ``lse = sinks[h]``
(``fnattn.merge`` does this when given ``sinks=``). Counting it in every part
would count it several times.

**Fully masked rows** (no visible key, no sink) give ``out = 0`` and
``lse = -inf``; with a sink they give ``out = 0`` and ``lse = sinks[h]``. No NaN
appears in the output or any gradient.

**Dropout** drops weights *after* ``lse`` is formed; ``lse`` is the
pre-dropout value. The keep mask is a pure function of
``(dropout_key, b, h, q, k)`` (see :mod:`fnattn.dropout`).
"""

import dataclasses
from typing import Any, Literal, Optional

import jax

from fnattn.masks import Mask

__all__ = ["AttentionSpec", "AttentionOutput", "LAYOUTS", "IMPLS"]

LAYOUTS = ("bthd", "bhtd")
IMPLS = ("auto", "xla", "pallas", "cudnn", "reference")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What attention to compute, independent of how.

    Args:
      mask: a :mod:`fnattn.masks` mask, or None for full attention.
      scale: multiplier of ``q . k``; None means ``1/sqrt(D)``.
      softcap: if set, logits are capped to ``softcap * tanh(s / softcap)``.
      bias: additive logit bias broadcastable to (B, Hq, Tq, Tk) in both layouts;
        differentiable.
      sinks: float array (Hq,), one learnable logit per query head that joins the
        softmax denominator; differentiable.
      dropout_rate: probability of dropping an attention weight, in [0, 1).
      dropout_key: a JAX PRNG key; required when ``dropout_rate > 0``.
      return_lse: whether the output carries ``lse`` (B, Hq, Tq) float32.
      layout: "bthd" (q is (B, Tq, Hq, D)) or "bhtd" (q is (B, Hq, Tq, D)).
      impl: "auto", "xla", "pallas", "cudnn" or "reference".
      block_sizes: block sizes for the blockwise lowerings, or None for defaults.

    >>> import jax.numpy as jnp
    >>> from fnattn import AttentionSpec, masks
    >>> spec = AttentionSpec(mask=masks.causal(), softcap=30.0)
    >>> spec.layout, spec.impl
    ('bthd', 'auto')
    """

    mask: Optional[Mask] = None
    scale: Optional[float] = None
    softcap: Optional[float] = None
    bias: Any = None
    sinks: Any = None
    dropout_rate: float = 0.0
    dropout_key: Any = None
    return_lse: bool = True
    layout: Literal["bthd", "bhtd"] = "bthd"
    impl: Literal["auto", "xla", "pallas", "cudnn", "reference"] = "auto"
    block_sizes: Any = None

    def __post_init__(self):
        # Only static fields are checked here: unflattening passes placeholders
        # for the array fields.
        if self.layout not in LAYOUTS:
            raise ValueError(f"AttentionSpec: layout must be one of {LAYOUTS}; got {self.layout!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"AttentionSpec: impl must be one of {IMPLS}; got {self.impl!r}")
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and self.scale > 0):
            raise ValueError(f"AttentionSpec: scale must be a positive float or None; got {self.scale!r}")
        if self.softcap is not None and not (
                isinstance(self.softcap, (int, float)) and self.softcap > 0):
            raise ValueError(
                f"AttentionSpec: softcap must be a positive float or None; got {self.softcap!r}")
        if not (isinstance(self.dropout_rate, (int, float)) and 0.0 <= self.dropout_rate < 1.0):
            raise ValueError(
                f"AttentionSpec: dropout_rate must be in [0, 1); got {self.dropout_rate!r}")
        if self.mask is not None and not isinstance(self.mask, Mask):
            raise TypeError(
                f"AttentionSpec: mask must be an fnattn.masks mask or None; got "
                f"{type(self.mask).__name__}. Wrap a boolean array with masks.from_array.")
        if not isinstance(self.return_lse, bool):
            raise TypeError(f"AttentionSpec: return_lse must be a bool; got {self.return_lse!r}")

    def replace(self, **changes) -> "AttentionSpec":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    AttentionSpec,
    data_fields=["mask", "bias", "sinks", "dropout_key"],
    meta_fields=["scale", "softcap", "dropout_rate", "return_lse", "layout", "impl",
                 "block_sizes"],
)


@dataclasses.dataclass(frozen=True)
class AttentionOutput:
    """The result of an attention variant.

    Attributes:
      out: (B, Tq, Hq, Dv) in "bthd" or (B, Hq, Tq, Dv) in "bhtd", q's dtype.
      lse: (B, Hq, Tq) float32 log-sum-exp of the logits (sink included), or None
        when the spec has ``return_lse=False``.
    """

    out: jax.Array
    lse: Optional[jax.Array] = None


jax.tree_util.register_dataclass(AttentionOutput, data_fields=["out", "lse"], meta_fields=[])
