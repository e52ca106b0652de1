"""Each layer's attention from a Hugging Face ``transformers`` config.

:func:`layers` reads a ``PretrainedConfig`` (``AutoConfig.from_pretrained``,
or any family's config class; no model weights, no torch) and returns one
:class:`LayerAttention` per decoder layer: its :class:`~fnattn.AttentionSpec`
(mask, scale, soft-cap, sinks) and its head counts and head dims, as the
family's modeling code computes its attention. Install with
``pip install 'fnattn[transformers]'``; ``import fnattn`` does not import it.

What is read, and how it maps:

* ``layer_types`` (``"full_attention"``, ``"sliding_attention"``,
  ``"chunked_attention"``), the per-layer pattern of Gemma 2/3, gpt-oss,
  Qwen2/Qwen3 (from ``use_sliding_window`` and ``max_window_layers``: the layers
  at or past ``max_window_layers`` slide), Cohere2 and Llama 4 (chunked where
  ``no_rope_layers`` says RoPE). A config without ``layer_types`` (Mistral,
  Phi-3, Llama, GPT-2) slides in every layer when ``sliding_window`` is set,
  as their modeling code does.
* ``sliding_window=W`` in transformers' meaning: a query sees ``W`` keys, itself
  included (``kv_idx > q_idx - W``), which is fnattn's
  ``masks.sliding_window(left=W - 1)``; every layer is causal.
* ``attention_chunk_size=C`` (Llama 4's chunked layers): ``masks.chunked(C)``
  and causal.
* The scale: ``query_pre_attn_scalar ** -0.5`` where the config has one (the
  Gemma families), else ``head_dim ** -0.5``; GPT-2's ``scale_attn_weights``
  and ``scale_attn_by_inverse_layer_idx`` (a scale of ``1 / (layer + 1)`` more).
* ``attn_logit_softcapping`` (Gemma 2): ``softcap``.
* Sinks (gpt-oss): one learned logit per head and layer, a weight of the
  model, not of the config: pass them as ``sinks`` (num_layers, Hq).
* ``num_attention_heads``, ``num_key_value_heads`` (default: as many as the
  query heads), ``head_dim`` (default ``hidden_size // num_attention_heads``).

Not read (the model applies them to q and k, or they are not attention's):
RoPE and its scaling, q/k norms, attention biases of the projections,
``attention_dropout`` (for training, ``spec.replace(dropout_rate=...,
dropout_key=...)``), Llama 4's ``attn_temperature_tuning``
(:meth:`LayerAttention.query_scales` gives its per-position factor of q).

:func:`stacked_spec` stacks the layers' specs into one whose leaves (window and
chunk sizes, sinks) have a leading layer axis, to scan a model's layers with
``jax.lax.scan`` whatever their pattern.

>>> from transformers import Gemma2Config
>>> from fnattn.adapters.transformers import layers
>>> config = Gemma2Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
...                       head_dim=16, hidden_size=64, sliding_window=512,
...                       query_pre_attn_scalar=16)
>>> [(l.layer_type, l.window) for l in layers(config)]
[('sliding_attention', 512), ('full_attention', None),
 ('sliding_attention', 512), ('full_attention', None)]
>>> layers(config)[0].spec.mask, layers(config)[0].spec.softcap, layers(config)[0].spec.scale
((causal() & sliding_window(left=511, right=0)), 50.0, 0.25)
"""

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

try:
    from transformers import PretrainedConfig
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError("fnattn.adapters.transformers needs transformers: install it with "
                      "pip install 'fnattn[transformers]'") from e

from fnattn import masks
from fnattn.spec import AttentionSpec

__all__ = ["LayerAttention", "layers", "stacked_spec"]

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
# Families whose attention has one learned sink logit per head (a weight).
_SINK_FAMILIES = ("gpt_oss",)


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """One decoder layer's attention, from :func:`layers`.

    Attributes:
      layer_type: ``"full_attention"``, ``"sliding_attention"`` or
        ``"chunked_attention"``.
      spec: the :class:`~fnattn.AttentionSpec` of the layer (causal, with its
        window or chunk, scale, soft-cap and sinks).
      num_heads: query heads ``Hq``.
      num_kv_heads: key/value heads ``Hkv``.
      head_dim: ``D`` of q, k and v.
      window: transformers' ``sliding_window`` of a sliding layer (keys seen,
        the current one included), None otherwise.
      chunk_size: the chunk of a chunked layer, None otherwise.
      temperature: Llama 4's ``(floor_scale, attn_scale)`` where the layer
        scales its queries by position (``attn_temperature_tuning`` in a layer
        without RoPE), None otherwise; see :meth:`query_scales`.
    """

    layer_type: str
    spec: AttentionSpec
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: Optional[int] = None
    chunk_size: Optional[int] = None
    temperature: Optional[tuple] = None

    def query_scales(self, positions):
        """The factor Llama 4 multiplies this layer's queries by at ``positions``
        (int array): ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``;
        ones for a layer without temperature tuning.

        >>> import jax.numpy as jnp
        >>> from transformers import Llama4TextConfig
        >>> c = Llama4TextConfig(num_hidden_layers=4, floor_scale=2, attn_scale=0.5)
        >>> tuple(round(float(x), 3) for x in layers(c)[3].query_scales(jnp.arange(4)))
        (1.0, 1.347, 1.347, 1.549)
        """
        pos = jnp.asarray(positions)
        if self.temperature is None:
            return jnp.ones(pos.shape, jnp.float32)
        floor_scale, attn_scale = self.temperature
        return (jnp.log1p(jnp.floor((pos.astype(jnp.float32) + 1.0) / floor_scale))
                * attn_scale + 1.0)


def _int(config, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"layers: config.{name} must be a positive int; got {value!r} "
                         f"({type(config).__name__})")
    return int(value)


def _layer_types(config, n: int) -> list:
    types = getattr(config, "layer_types", None)
    if types is None:
        # Mistral, Phi-3: one mask for every layer, sliding when the window is set.
        sliding = getattr(config, "sliding_window", None) is not None
        return [SLIDING if sliding else FULL] * n
    types = list(types)
    if len(types) != n:
        raise ValueError(f"layers: config.layer_types has {len(types)} entries for "
                         f"num_hidden_layers={n} ({type(config).__name__})")
    for i, t in enumerate(types):
        if t not in (FULL, SLIDING, CHUNKED):
            raise NotImplementedError(
                f"layers: layer {i} of {type(config).__name__} is {t!r}; fnattn maps "
                f"{FULL!r}, {SLIDING!r} and {CHUNKED!r} layers (softmax attention) only")
    return types


def _scale(config, model_type: str, head_dim: int, layer: int) -> float:
    if model_type == "gpt2":
        scale = head_dim ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer + 1)
        return scale
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return float(scalar) ** -0.5 if scalar is not None else head_dim ** -0.5


def layers(config, *, sinks: Any = None, impl: str = "auto") -> tuple:
    """One :class:`LayerAttention` per decoder layer of ``config``.

    Args:
      config: a ``transformers.PretrainedConfig`` of a decoder (a composite one,
        such as Llama 4's or Gemma 3's, is read through ``get_text_config()``).
      sinks: for families with attention sinks (gpt-oss), the sink logits of
        every layer, an array (num_layers, num_attention_heads) (the models'
        ``self_attn.sinks`` weights, stacked); each layer's spec gets its row.
        Refused for other families.
      impl: the specs' ``impl``.

    Returns:
      a tuple of :class:`LayerAttention`, one per layer.

    >>> from transformers import MistralConfig
    >>> c = MistralConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    ...                   hidden_size=256, sliding_window=4096)
    >>> l = layers(c)[0]
    >>> l.spec.mask, l.num_heads, l.num_kv_heads, l.head_dim
    ((causal() & sliding_window(left=4095, right=0)), 8, 2, 32)
    """
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"layers: config must be a transformers.PretrainedConfig "
                        f"(AutoConfig.from_pretrained(...)); got {type(config).__name__}")
    config = config.get_text_config()
    model_type = getattr(config, "model_type", "")
    n = _int(config, "num_hidden_layers", config.num_hidden_layers)
    hq = _int(config, "num_attention_heads", config.num_attention_heads)
    hkv = getattr(config, "num_key_value_heads", None)
    hkv = hq if hkv is None else _int(config, "num_key_value_heads", hkv)
    if hq % hkv:
        raise ValueError(f"layers: num_attention_heads={hq} is not a multiple of "
                         f"num_key_value_heads={hkv} ({type(config).__name__})")
    head_dim = getattr(config, "head_dim", None)
    head_dim = (_int(config, "head_dim", head_dim) if head_dim is not None
                else _int(config, "hidden_size // num_attention_heads",
                          config.hidden_size // hq))
    softcap = getattr(config, "attn_logit_softcapping", None)
    softcap = None if softcap is None else float(softcap)
    has_sinks = model_type in _SINK_FAMILIES
    if has_sinks and sinks is None:
        raise ValueError(f"layers: {model_type} layers have learned attention sinks (one "
                         f"logit per head, the weights self_attn.sinks): pass "
                         f"sinks=array of shape (num_layers, num_attention_heads)=({n}, {hq})")
    if sinks is not None:
        if not has_sinks:
            raise ValueError(f"layers: sinks given, but {model_type or type(config).__name__} "
                             "attention has no sinks")
        if tuple(np.shape(sinks)) != (n, hq):
            raise ValueError(f"layers: sinks must have shape (num_layers, num_attention_heads)="
                             f"({n}, {hq}); got {tuple(np.shape(sinks))}")
    temperature = None
    if getattr(config, "attn_temperature_tuning", False) and hasattr(config, "no_rope_layers"):
        temperature = (float(config.floor_scale), float(config.attn_scale))

    out = []
    for i, layer_type in enumerate(_layer_types(config, n)):
        mask, window, chunk = masks.causal(), None, None
        if layer_type == SLIDING and getattr(config, "sliding_window", None) is not None:
            window = _int(config, "sliding_window", config.sliding_window)
            mask = mask & masks.sliding_window(left=window - 1)
        elif layer_type == SLIDING:
            layer_type = FULL  # no window set: the modeling code attends to all
        if layer_type == CHUNKED:
            chunk = _int(config, "attention_chunk_size", config.attention_chunk_size)
            mask = mask & masks.chunked(chunk)
        spec = AttentionSpec(mask=mask, scale=_scale(config, model_type, head_dim, i),
                             softcap=softcap, impl=impl,
                             sinks=None if sinks is None else jnp.asarray(sinks)[i])
        uses_rope = (not hasattr(config, "no_rope_layers")) or bool(config.no_rope_layers[i])
        out.append(LayerAttention(layer_type=layer_type, spec=spec, num_heads=hq,
                                  num_kv_heads=hkv, head_dim=head_dim, window=window,
                                  chunk_size=chunk,
                                  temperature=None if uses_rope else temperature))
    return tuple(out)


def stacked_spec(attn_layers) -> AttentionSpec:
    """One spec for every layer, its arrays stacked on a leading layer axis: the
    ``xs`` of a ``jax.lax.scan`` over the layers, which gives each layer its own
    window (``masks.NO_WINDOW`` for full layers), chunk and sinks.

    The mask is ``causal()``, with ``sliding_window(left=...)`` if some layer
    slides and ``chunked(...)`` if some is chunked, their sizes (num_layers,)
    int32 arrays. The static fields (scale, soft-cap, impl) must agree across
    the layers: a GPT-2 config with ``scale_attn_by_inverse_layer_idx`` scales
    each layer differently (fold the factor into q, or unroll).

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from transformers import Gemma2Config
    >>> config = Gemma2Config(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    ...                       head_dim=8, hidden_size=16, sliding_window=3,
    ...                       query_pre_attn_scalar=8)
    >>> attn = layers(config)
    >>> spec = stacked_spec(attn)
    >>> spec.mask.b.left.tolist()                                 # W - 1, or no window
    [2, 1073741824, 2, 1073741824]
    >>> x = jax.random.normal(jax.random.key(0), (1, 9, 2, 8))
    >>> def layer(x, spec):
    ...     return x + fnattn.attention(spec, x, x[:, :, :1], x[:, :, :1]).out, None
    >>> y, _ = jax.jit(lambda x: jax.lax.scan(layer, x, spec))(x)
    >>> z = x
    >>> for l in attn:                                            # the same, unrolled
    ...     z = z + fnattn.attention(l.spec, z, z[:, :, :1], z[:, :, :1]).out
    >>> bool(jnp.allclose(y, z, atol=1e-5))
    True
    """
    attn_layers = tuple(attn_layers)
    if not attn_layers or not all(isinstance(l, LayerAttention) for l in attn_layers):
        raise TypeError("stacked_spec: attn_layers must be the LayerAttention tuple that "
                        "layers(config) returns")
    first = attn_layers[0].spec
    for name in ("scale", "softcap", "impl"):
        values = [getattr(l.spec, name) for l in attn_layers]
        if len(set(values)) > 1:
            raise ValueError(f"stacked_spec: the layers' {name} differ ({values}); one "
                             f"scanned spec has one {name}. Fold a per-layer scale into q, "
                             "or call each layer with its own spec")
    mask = masks.causal()
    if any(l.window is not None for l in attn_layers):
        # (both sides arrays: every leaf has the layer axis that scan slices)
        mask = mask & masks.sliding_window(left=jnp.array(
            [masks.NO_WINDOW if l.window is None else l.window - 1 for l in attn_layers],
            jnp.int32), right=jnp.zeros((len(attn_layers),), jnp.int32))
    if any(l.chunk_size is not None for l in attn_layers):
        mask = mask & masks.chunked(jnp.array(
            [masks.NO_WINDOW if l.chunk_size is None else l.chunk_size for l in attn_layers],
            jnp.int32))
    sinks = None
    if first.sinks is not None:
        sinks = jnp.stack([jnp.asarray(l.spec.sinks) for l in attn_layers])
    return first.replace(mask=mask, sinks=sinks)
