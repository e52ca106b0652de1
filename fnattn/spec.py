"""`AttentionSpec`, the frozen pytree that configures every fnattn variant.

Array fields (``mask``'s arrays, ``bias``, ``sinks``, ``dropout_key``) are pytree
leaves: they may be traced, vmapped and (``bias``, ``sinks``) differentiated, and
changing their values does not retrace. Every other field is static
configuration: changing it retraces.

How the logits of one query row are formed (all in float32)::

    s_k   = scale * (q . k_k)                    # scale defaults to 1/sqrt(D)
    s_k   = s_k + bias[b, h, q, k]               # if bias is given
    s_k   = s_k + position_bias(b, h, q_pos, k)  # if given (ALiBi, ...)
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
import math
import numbers
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp

from fnattn.flash import blocks
from fnattn.masks import Mask
from fnattn.position_bias import PositionBias

__all__ = ["AttentionSpec", "AttentionOutput", "LAYOUTS", "IMPLS"]

LAYOUTS = ("bthd", "bhtd")
IMPLS = ("auto", "xla", "pallas", "cudnn", "reference")

_TRACE_TIME = (": pass a Python float known at trace time (float(x) for a concrete array; "
               "through jax.jit, a static argument: jax.jit(f, static_argnames=...)).")
_STATIC_HINTS = {
    "scale": ": to learn a scale, multiply q by it before the call.",
    "softcap": _TRACE_TIME,
    "dropout_rate": _TRACE_TIME,
}


def _is_block_sizes(x) -> bool:
    # Every lowering's block sizes are a frozen dataclass named *BlockSizes (checked
    # by name: importing the lowerings here would be circular).
    return (dataclasses.is_dataclass(x) and not isinstance(x, type)
            and type(x).__name__.endswith("BlockSizes"))


def _mask_message(mask) -> str:
    """What to do with something that is not a mask, given as ``mask=``."""
    message = (f"AttentionSpec: mask must be an fnattn.masks mask or None; got "
               f"{type(mask).__name__}.")
    if getattr(mask, "__module__", None) == "fnattn.masks" and callable(mask):
        return f"{message} Call it: masks.{mask.__name__}(...)."
    dtype = getattr(mask, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        return (f"{message} A {dtype} array is either an additive mask (0 to attend, "
                "-inf or a large negative number to mask), which is a bias: "
                "AttentionSpec(bias=mask); or 1s and 0s: mask=masks.from_array(mask > 0).")
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer):
        return f"{message} Wrap an integer array as masks.from_array(mask != 0) (True attends)."
    return f"{message} Wrap a boolean array with masks.from_array."


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
      dropout_offsets: optional integer array (4,): the global index of this
        call's first (batch row, query head, query, key), so that a call on a
        shard draws the rows of the whole problem's dropout mask (see
        :func:`fnattn.dropout.shard_offsets`); None means zeros (inside
        ``jax.shard_map`` the shards then draw independent masks, see
        :mod:`fnattn.dropout`).
      return_lse: whether the output carries ``lse`` (B, Hq, Tq) float32.
      layout: "bthd" (q is (B, Tq, Hq, D)) or "bhtd" (q is (B, Hq, Tq, D)).
      impl: "auto", "xla", "pallas", "cudnn" or "reference".
      block_sizes: block sizes for the blockwise lowerings, or None for defaults.
      position_bias: an additive logit term computed inside the kernels from
        positions (:mod:`fnattn.position_bias`: ALiBi, or any elementwise
        function of batch, head, query position and key), added with ``bias``.
        Its arrays are leaves; the flash lowerings take them as constants.

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
    dropout_offsets: Any = None
    return_lse: bool = True
    layout: Literal["bthd", "bhtd"] = "bthd"
    impl: Literal["auto", "xla", "pallas", "cudnn", "reference"] = "auto"
    block_sizes: Any = None
    position_bias: Optional[PositionBias] = None

    def __post_init__(self):
        # Only static fields are checked here: unflattening passes placeholders
        # for the array fields.
        if self.layout not in LAYOUTS:
            raise ValueError(f"AttentionSpec: layout must be one of {LAYOUTS}; got {self.layout!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"AttentionSpec: impl must be one of {IMPLS}; got {self.impl!r}")
        for name in ("scale", "softcap", "dropout_rate"):
            value = getattr(self, name)
            if value is None and name != "dropout_rate":
                continue
            # Static fields are part of the jit cache key: accept any real number
            # (NumPy scalars included) and store it as a Python float, so that equal
            # values give one cache entry.
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"AttentionSpec: {name} is static configuration and must be a Python "
                    f"float{'' if name == 'dropout_rate' else ' or None'}; got "
                    f"{type(value).__name__} {value!r}. A traced or array value cannot be "
                    "static" + _STATIC_HINTS[name])
            object.__setattr__(self, name, float(value))
        for name in ("scale", "softcap"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(
                    f"AttentionSpec: {name} must be a positive finite float or None; got {value!r}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(
                f"AttentionSpec: dropout_rate must be in [0, 1); got {self.dropout_rate!r}")
        if self.mask is not None and not isinstance(self.mask, Mask):
            raise TypeError(_mask_message(self.mask))
        if self.position_bias is not None and not isinstance(self.position_bias, PositionBias):
            raise TypeError(
                "AttentionSpec: position_bias must be an fnattn.position_bias term "
                "(position_bias.alibi(slopes), position_bias.from_fn(fn, *arrays)) or None; got "
                f"{type(self.position_bias).__name__}. An array of logits is a bias: "
                "AttentionSpec(bias=...).")
        if not isinstance(self.return_lse, bool):
            raise TypeError(f"AttentionSpec: return_lse must be a bool; got {self.return_lse!r}")
        if not all(_is_block_sizes(b) for b in blocks.entries(self.block_sizes)):
            raise TypeError(
                "AttentionSpec: block_sizes must be None, a block-size object "
                "(fnattn.XlaBlockSizes, TritonBlockSizes, MosaicBlockSizes, DecodeBlockSizes, "
                "PagedBlockSizes) or a tuple of them, one per lowering; got "
                f"{type(self.block_sizes).__name__} {self.block_sizes!r}")
        try:
            hash(self.block_sizes)
        except TypeError:
            raise TypeError(
                "AttentionSpec: block_sizes is static configuration and must be hashable "
                "(a frozen dataclass such as fnattn.XlaBlockSizes, or None); got "
                f"{type(self.block_sizes).__name__} {self.block_sizes!r}") from None

    def replace(self, **changes) -> "AttentionSpec":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    AttentionSpec,
    data_fields=["mask", "bias", "sinks", "dropout_key", "dropout_offsets", "position_bias"],
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
# A function that returns an AttentionOutput can be serialized by jax.export
# (its result tree is part of the artifact); the node has no static data.
jax.export.register_pytree_node_serialization(
    AttentionOutput, serialized_name="fnattn.AttentionOutput",
    serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda data: ())
