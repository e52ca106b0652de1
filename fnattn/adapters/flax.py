"""``attention_fn`` for flax: fnattn inside ``flax.nnx.MultiHeadAttention`` and
``flax.linen.MultiHeadDotProductAttention``.

Pass :data:`attention_fn` (or one made by :func:`make_attention_fn` from an
:class:`~fnattn.AttentionSpec`, to choose the lowering, add a soft-cap, sinks
or a structured mask) as the module's ``attention_fn=``; the module's
parameters, masks and dropout settings stay as they are.

What it takes, as flax passes it:

- ``query``, ``key``, ``value``: ``[batch..., length, num_heads, head_dim]``
  with any number of leading batch axes (none included); fewer key/value heads
  than query heads is grouped-query attention.
- ``mask``: broadcastable to ``[batch..., num_heads, q_length, kv_length]``,
  boolean or numeric. Flax's ``make_attention_mask`` and ``make_causal_mask``
  give float32 1s and 0s, which become a boolean mask (1 attends). Any other
  value (an additive mask of 0 and -inf, say) has no meaning here: where the
  mask is a concrete array it raises ``ValueError``; where it is traced (under
  ``jit``) the query rows whose mask holds such a value get NaN, so that the
  mistake cannot pass for a result, and ``make_attention_fn(checked=True)``
  also reports it through ``jax.experimental.checkify``. An additive mask is a
  ``bias``.
- ``bias``: added to the logits, broadcastable like the mask.
- ``is_causal``: query ``t`` sees keys ``s <= t`` (aligned at the top left, as
  flax's and ``jax.nn``'s).
- ``dropout_rate``, ``deterministic``, ``dropout_rng``, ``broadcast_dropout``:
  when ``dropout_rate > 0`` and not ``deterministic``, fnattn's dropout (a hash
  of the positions, see :mod:`fnattn.dropout`) with ``dropout_rng`` as its key.
  With ``broadcast_dropout=True`` (flax's default) one ``(q_length,
  kv_length)`` mask is shared by every batch row and head, as in flax; with
  ``False`` each row and head draws its own. The bits differ from flax's
  ``jax.random.bernoulli`` draw; the rate and the rescaling by ``1 / (1 -
  rate)`` are the same.
- ``dtype``: q, k and v are cast to it (None: their promoted dtype), and the
  output has it. The softmax is computed in float32 whatever the dtype, as
  with ``force_fp32_for_softmax=True``.

What it refuses, with a message: ``precision`` other than None (fnattn's
lowerings choose their own: products in the inputs' dtype, accumulated in
float32), ``module`` (``sow_weights=True``: fnattn never forms the attention
weights), and linen's ``qk_attn_weights_einsum`` / ``attn_weights_value_einsum``
(custom einsums cannot enter fnattn's lowerings).

Where flax and fnattn differ: a query row that sees no key gives zeros in
fnattn (flax's softmax gives the mean of the values); everything else agrees
to rounding.

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> from fnattn.adapters.flax import attention_fn
>>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
...                                rngs=nnx.Rngs(0), attention_fn=attention_fn)
>>> x = jnp.ones((3, 5, 8))
>>> layer(x, mask=nnx.make_causal_mask(x[..., 0])).shape
(3, 5, 8)
"""

import math
import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from fnattn import masks
from fnattn.core import attention
from fnattn.spec import AttentionSpec

__all__ = ["attention_fn", "make_attention_fn"]

_FN = "attention_fn"
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def _static_bool(name: str, x) -> bool:
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(f"{_FN}: {name} must be a Python bool; got {type(x).__name__} {x!r}. "
                    "It is static configuration: a traced value cannot choose the "
                    "computation.")


def _rate(dropout_rate) -> float:
    if isinstance(dropout_rate, (bool, np.bool_)) or not isinstance(dropout_rate,
                                                                     numbers.Real):
        raise TypeError(f"{_FN}: dropout_rate must be a Python float in [0, 1); got "
                        f"{type(dropout_rate).__name__} {dropout_rate!r}. It is static "
                        "configuration (the module's dropout_rate).")
    rate = float(dropout_rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{_FN}: dropout_rate must be in [0, 1); got {rate!r}. A rate of "
                         "1 drops every weight and leaves nothing to rescale.")
    return rate


def _causal_top_left(q_len: int, kv_len: int) -> masks.Mask:
    """Query ``t`` sees keys ``s <= t``. fnattn's positional masks place query
    ``t`` at ``t + kv_len - q_len``, so the diagonal moves by that shift."""
    shift = kv_len - q_len
    if shift == 0:
        return masks.causal()
    if shift > 0:
        # s <= pos - shift  <=>  not (s >= pos - (shift - 1))
        return ~masks.sliding_window(left=shift - 1, right=None)
    return masks.sliding_window(left=None, right=-shift)


def _to_4d(name: str, x, batch_shape: tuple, full: tuple):
    """``x`` broadcastable to ``batch_shape + full[1:]`` as (1 or B, H or 1, T or 1,
    S or 1), its batch axes flattened; ``full`` is (B, H, T, S)."""
    want = batch_shape + full[1:]
    what = f"[batch..., num_heads, q_length, kv_length]={want}"
    if x.ndim > len(want):
        raise ValueError(f"{_FN}: {name} must be broadcastable to {what}; got shape "
                         f"{_shape(x)}, with more axes than that")
    x = jnp.reshape(x, (1,) * (len(want) - x.ndim) + x.shape)
    if any(n not in (1, w) for n, w in zip(x.shape, want)):
        raise ValueError(f"{_FN}: {name} must be broadcastable to {what} (each axis full "
                         f"or 1; leading axes may be left out); got shape {_shape(x)}")
    nb = len(batch_shape)
    if all(n == 1 for n in x.shape[:nb]):
        return jnp.reshape(x, (1,) + x.shape[nb:])
    x = jnp.broadcast_to(x, batch_shape + x.shape[nb:])
    return jnp.reshape(x, (full[0],) + x.shape[nb:])


def _boolean_mask(mask, batch_shape: tuple, full: tuple, checked: bool):
    """The mask as booleans (1 or B, 1 or H, T, S), and, for a traced numeric mask,
    the (1 or B, 1 or H, 1 or T) query rows that hold a value other than 0 and 1."""
    if not isinstance(mask, jax.Array):
        mask = jnp.asarray(mask)
    given = _shape(mask)
    traced = isinstance(mask, jax.core.Tracer)
    if mask.dtype != jnp.bool_:
        if not (jnp.issubdtype(mask.dtype, jnp.floating)
                or jnp.issubdtype(mask.dtype, jnp.integer)):
            raise TypeError(f"{_FN}: mask must be boolean or hold 1s and 0s; got "
                            f"{mask.dtype} with shape {given}")
        if not traced:
            values = np.asarray(mask)
            wrong = (values != 0) & (values != 1)
            if wrong.any():
                found = np.unique(values[wrong])[:4].tolist()
                raise ValueError(
                    f"{_FN}: a {mask.dtype} mask must hold only 1 (attend) and 0 (hide); "
                    f"this one (shape {given}) also holds {found}. An additive mask "
                    "(0 to attend, -inf or a large negative number to hide) is a bias: "
                    "pass it as bias=...; to attend where the mask is nonzero, pass "
                    "mask != 0.")
    mask = _to_4d("mask", mask, batch_shape, full)
    bad_rows = None
    if mask.dtype != jnp.bool_:
        if traced:
            bad = (mask != 0) & (mask != 1)
            bad_rows = bad.any(axis=-1)
            if checked:
                first = jnp.argmax(bad.reshape(-1))
                checkify.check(~bad.any(), "attention_fn: the mask holds {x}; a numeric mask "
                               "must hold only 1 (attend) and 0 (hide). An additive mask "
                               "(0 and -inf) is a bias.", x=mask.reshape(-1)[first])
        mask = mask != 0
    return jnp.broadcast_to(mask, mask.shape[:2] + full[2:]), bad_rows


def _bias(bias, batch_shape: tuple, full: tuple):
    if not isinstance(bias, jax.Array):
        bias = jnp.asarray(bias)
    if bias.dtype not in _FLOATS:
        raise TypeError(f"{_FN}: bias must be a floating-point array; got {bias.dtype} "
                        f"with shape {_shape(bias)}")
    return _to_4d("bias", bias, batch_shape, full)


def _over_leading(fn, arrays: tuple, sizes: tuple):
    """``fn`` on every index of the leading ``len(sizes)`` axes of ``arrays``; an
    array (or None) whose axis has size 1 where the size is larger is shared."""
    if not sizes:
        return fn(*arrays)
    n = sizes[0]
    args, axes = [], []
    for x in arrays:
        if x is None or x.shape[0] != n:
            args.append(None if x is None else x[0])
            axes.append(None)
        else:
            args.append(x)
            axes.append(0)
    return jax.vmap(lambda *a: _over_leading(fn, a, sizes[1:]), in_axes=tuple(axes))(*args)


def _shared_dropout(spec: AttentionSpec, q, k, v, mask, bias):
    """Attention with one dropout mask for every batch row and head.

    fnattn's keep bits depend on (batch row, head, query, key); a call on one row
    and one head sees indices (0, 0, q, k) only, so mapping the call over rows and
    heads with one key gives every row and head the same (q, k) mask.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    g = Hq // Hkv
    sizes = (B, Hkv, g)

    def by_group(x):
        # (X, 1 or Hq, ...) -> (X, 1 or Hkv, 1 or g, ...)
        if x is None:
            return None
        if x.shape[1] == 1:
            return x[:, :, None]
        return jnp.reshape(x, (x.shape[0], Hkv, g) + x.shape[2:])

    qs = jnp.moveaxis(q.reshape(B, T, Hkv, g, D), 1, 3)   # (B, Hkv, g, T, D)
    ks = jnp.moveaxis(k, 1, 2)[:, :, None]                 # (B, Hkv, 1, S, D)
    vs = jnp.moveaxis(v, 1, 2)[:, :, None]
    sinks = None if spec.sinks is None else jnp.reshape(spec.sinks, (1, Hkv, g))

    def one(qi, ki, vi, mi, bi, si):
        parts = [m for m in (spec.mask, None if mi is None else masks.from_array(mi[None, None]))
                 if m is not None]
        mask_i = None
        for m in parts:
            mask_i = m if mask_i is None else mask_i & m
        spec_i = spec.replace(mask=mask_i, bias=None if bi is None else bi[None, None],
                              sinks=None if si is None else si[None])
        res = attention(spec_i, qi[None, :, None], ki[None, :, None], vi[None, :, None])
        return res.out[0, :, 0]

    out = _over_leading(one, (qs, ks, vs, by_group(mask), by_group(bias), sinks), sizes)
    return jnp.moveaxis(out, 3, 1).reshape(B, T, Hq, out.shape[-1])   # (B, T, Hq, Dv)


def make_attention_fn(spec: Optional[AttentionSpec] = None, *,
                      checked: bool = False) -> Callable[..., jax.Array]:
    """An ``attention_fn`` for flax's attention modules, computing ``spec``.

    Args:
      spec: what to compute besides what the module passes: the lowering
        (``impl``), ``scale``, ``softcap``, ``sinks``, ``block_sizes``, a mask
        combined with the module's mask by ``&`` (array-free masks such as
        ``masks.sliding_window`` fit any batch; a mask holding arrays must match
        the batch axes flattened into one), a ``bias`` added to the module's.
        Dropout comes from the module, so the spec's dropout fields must be
        unset; its layout must be "bthd" (flax's). None: ``AttentionSpec()``.
      checked: also report a traced numeric mask holding values other than 0
        and 1 through ``jax.experimental.checkify`` (wrap the call in
        ``checkify.checkify``); the rows holding them are NaN either way.

    Returns:
      ``attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
      dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
      precision=None, module=None, *, is_causal=False, force_fp32_for_softmax=False,
      qk_attn_weights_einsum=None, attn_weights_value_einsum=None)``, flax's
      signature, returning ``[batch..., q_length, num_heads, v_head_dim]``.

    >>> import jax, jax.numpy as jnp
    >>> from flax import linen as nn
    >>> from fnattn import AttentionSpec, masks
    >>> from fnattn.adapters.flax import make_attention_fn
    >>> fn = make_attention_fn(AttentionSpec(mask=masks.sliding_window(left=2), softcap=20.0))
    >>> layer = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn)
    >>> x = jnp.ones((4, 6, 8))
    >>> params = layer.init(jax.random.key(0), x)
    >>> jax.jit(layer.apply)(params, x).shape
    (4, 6, 8)
    """
    if spec is None:
        spec = AttentionSpec()
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"make_attention_fn: spec must be an fnattn.AttentionSpec or None; "
                        f"got {type(spec).__name__}")
    if spec.layout != "bthd":
        raise ValueError(f"make_attention_fn: spec.layout must be 'bthd', flax's "
                         f"[batch..., length, num_heads, head_dim]; got {spec.layout!r}. "
                         "Leave the layout at its default.")
    set_fields = ((["dropout_rate"] if spec.dropout_rate else [])
                  + [name for name in ("dropout_key", "dropout_offsets")
                     if getattr(spec, name) is not None])
    if set_fields:
        raise ValueError("make_attention_fn: the spec's dropout fields must be unset; got "
                         f"{', '.join(set_fields)} set. Dropout comes from the module (its "
                         "dropout_rate, deterministic and dropout rngs).")
    if not isinstance(checked, bool):
        raise TypeError(f"make_attention_fn: checked must be a bool; got {checked!r}")
    base = spec.replace(return_lse=False)

    def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array,
                     bias: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
                     broadcast_dropout: bool = True, dropout_rng: Optional[jax.Array] = None,
                     dropout_rate: float = 0.0, deterministic: bool = False,
                     dtype=None, precision=None, module=None, *, is_causal: bool = False,
                     force_fp32_for_softmax: bool = False, qk_attn_weights_einsum=None,
                     attn_weights_value_einsum=None) -> jax.Array:
        """Flax's ``attention_fn`` computed by fnattn (see :mod:`fnattn.adapters.flax`).

        Args:
          query: ``[batch..., q_length, num_heads, head_dim]``.
          key: ``[batch..., kv_length, num_kv_heads, head_dim]``; ``num_heads``
            a multiple of ``num_kv_heads``.
          value: ``[batch..., kv_length, num_kv_heads, v_head_dim]``.
          bias: added to the logits; broadcastable to ``[batch..., num_heads,
            q_length, kv_length]``.
          mask: broadcastable like ``bias``; boolean, or 1 (attend) and 0 (hide).
          broadcast_dropout: one dropout mask shared by every batch row and head.
          dropout_rng: the dropout key (a PRNG key), needed when dropout is on.
          dropout_rate: the probability of dropping a weight, in [0, 1).
          deterministic: no dropout.
          dtype: the dtype q, k, v are cast to and the output has (None: theirs,
            promoted).
          precision: must be None.
          module: must be None (flax's ``sow_weights=True`` passes the module).
          is_causal: query ``t`` sees keys ``s <= t``.
          force_fp32_for_softmax: accepted either way: fnattn's softmax is
            always float32.
          qk_attn_weights_einsum: must be None.
          attn_weights_value_einsum: must be None.

        Returns:
          ``[batch..., q_length, num_heads, v_head_dim]`` in ``dtype``.

        >>> import jax.numpy as jnp
        >>> from fnattn.adapters.flax import attention_fn
        >>> q = k = v = jnp.ones((2, 3, 5, 4, 8))            # two batch axes
        >>> attention_fn(q, k, v, mask=jnp.ones((2, 3, 1, 5, 5))).shape
        (2, 3, 5, 4, 8)
        """
        if module is not None:
            raise ValueError(
                f"{_FN}: module is set, which flax does to sow the attention weights "
                "(sow_weights=True); fnattn never forms the weights. Call the module with "
                "sow_weights=False, or use flax's own attention_fn to inspect weights.")
        if precision is not None:
            raise ValueError(
                f"{_FN}: precision must be None; got {precision!r}. fnattn's lowerings "
                "choose their own (products in the inputs' dtype, accumulated in float32). "
                "Build the module with precision=None; for float32 attention keep the "
                "module's dtype float32.")
        for name, fn in (("qk_attn_weights_einsum", qk_attn_weights_einsum),
                         ("attn_weights_value_einsum", attn_weights_value_einsum)):
            if fn is not None:
                raise ValueError(f"{_FN}: {name} must be None; got {fn!r}. A custom einsum "
                                 "(quantized, say) cannot enter fnattn's lowerings; use "
                                 "flax's own attention_fn with it.")
        _static_bool("force_fp32_for_softmax", force_fp32_for_softmax)
        shared = _static_bool("broadcast_dropout", broadcast_dropout)
        causal = _static_bool("is_causal", is_causal)
        rate = _rate(dropout_rate)
        dropping = rate > 0.0 and not _static_bool("deterministic", deterministic)
        if dropping and dropout_rng is None:
            raise ValueError(f"{_FN}: dropout_rate={rate} with deterministic=False needs "
                             "dropout_rng (a PRNG key); got None. Give the module its "
                             "dropout rngs, or call it with deterministic=True.")

        query, key, value = (x if isinstance(x, jax.Array) else jnp.asarray(x)
                             for x in (query, key, value))
        dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
        if dtype not in _FLOATS:
            raise TypeError(f"{_FN}: attention is computed in a floating-point dtype; got "
                            f"dtype {dtype} (query {query.dtype}, key {key.dtype}, value "
                            f"{value.dtype}). Pass float inputs or dtype=jnp.float32.")
        query, key, value = (x.astype(dtype) for x in (query, key, value))
        if not (query.ndim == key.ndim == value.ndim >= 3):
            raise ValueError(f"{_FN}: query, key and value must have the same rank, at least "
                             "3 ([batch..., length, num_heads, head_dim]); got shapes "
                             f"{_shape(query)}, {_shape(key)}, {_shape(value)}")
        batch_shape = query.shape[:-3]
        if not key.shape[:-3] == value.shape[:-3] == batch_shape:
            raise ValueError(f"{_FN}: query, key and value must share their batch axes "
                             f"{batch_shape} ([batch..., length, num_heads, head_dim]); got "
                             f"shapes {_shape(query)}, {_shape(key)}, {_shape(value)}")
        T, Hq, D = query.shape[-3:]
        S, Hkv, Dk = key.shape[-3:]
        if Dk != D or value.shape[-3:-1] != (S, Hkv) or Hq % Hkv:
            raise ValueError(f"{_FN}: key must be [batch..., kv_length, num_kv_heads, {D}] "
                             f"and value [batch..., kv_length, num_kv_heads, v_head_dim] with "
                             f"num_heads={Hq} a multiple of num_kv_heads; got query "
                             f"{_shape(query)}, key {_shape(key)}, value {_shape(value)}")
        B = math.prod(batch_shape)
        full = (B, Hq, T, S)
        q, k, v = (jnp.reshape(x, (B,) + x.shape[-3:]) for x in (query, key, value))

        mask_arr = bad_rows = None
        if mask is not None:
            mask_arr, bad_rows = _boolean_mask(mask, batch_shape, full, checked)
        if bias is not None:
            bias = _bias(bias, batch_shape, full)
        if base.bias is not None:
            extra = jnp.reshape(base.bias, (1,) * (4 - jnp.ndim(base.bias)) + jnp.shape(base.bias))
            bias = extra if bias is None else bias + extra
        positional = _causal_top_left(T, S) if causal else None
        spec = base.replace(bias=None)
        if dropping:
            spec = spec.replace(dropout_rate=rate, dropout_key=dropout_rng)

        if dropping and shared:
            if jax.tree_util.tree_leaves(spec.mask):
                raise ValueError(
                    f"{_FN}: broadcast_dropout=True maps the call over batch rows and "
                    "heads, which a spec mask holding arrays (segments, lengths, "
                    "from_array) cannot follow. Pass that mask as the module's mask, or "
                    "build the module with broadcast_dropout=False.")
            if positional is not None:
                spec = spec.replace(mask=positional if spec.mask is None
                                    else spec.mask & positional)
            out = _shared_dropout(spec, q, k, v, mask_arr, bias)
        else:
            parts = [m for m in (spec.mask, positional,
                                 None if mask_arr is None else masks.from_array(mask_arr))
                     if m is not None]
            combined = None
            for m in parts:
                combined = m if combined is None else combined & m
            out = attention(spec.replace(mask=combined, bias=bias), q, k, v).out
        if bad_rows is not None:
            # (1|B, 1|H, 1|T) -> (1|B, 1|T, 1|H, 1): a row whose mask held a value other
            # than 0 and 1 cannot pass for a result.
            out = jnp.where(jnp.moveaxis(bad_rows, 1, 2)[..., None], jnp.nan, out)
        return jnp.reshape(out, batch_shape + out.shape[1:])

    return attention_fn


attention_fn = make_attention_fn()
"""Flax's ``attention_fn`` computed by fnattn with the default spec; see
:func:`make_attention_fn`."""
