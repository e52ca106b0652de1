"""``dot_product_attention``: the signature and semantics of ``jax.nn``'s, computed by fnattn.

Swapping ``jax.nn.dot_product_attention`` for ``fnattn.nn.dot_product_attention``
is the whole migration: the arguments, the layouts (``BTNH`` and ``TNH``), the
alignment of ``is_causal`` and ``local_window_size`` and the residual are
``jax.nn``'s. The keyword arguments become an :class:`~fnattn.AttentionSpec`
(a mask built from :mod:`fnattn.masks`, the bias, the scale, the lowering)
and :func:`fnattn.attention` computes it.

Where the two differ (rows that see no key, non-finite values in hidden keys,
``implementation``), fnattn keeps its own contract; ``docs/drop_in.md`` lists
every difference.
"""

import math
import numbers
import types
from typing import Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from fnattn import masks
from fnattn.core import attention
from fnattn.spec import AttentionSpec

__all__ = ["dot_product_attention", "IMPLEMENTATIONS"]

_FN = "dot_product_attention"

# jax.nn's `implementation` -> AttentionSpec.impl. None asks for the best
# lowering of the platform (fnattn's flash); "xla" keeps the algorithm jax.nn's
# "xla" names, a dense XLA computation of the whole (T, S) logit matrix, on
# every platform; "cudnn" is jax.nn's cuDNN kernel on NVIDIA GPUs.
IMPLEMENTATIONS = types.MappingProxyType({None: "auto", "xla": "xla", "cudnn": "cudnn"})

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def _as_array(name: str, x) -> jax.Array:
    if isinstance(x, jax.Array):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{_FN}: {name} must be an array; got {type(x).__name__}: {e}") from None


def _float_array(name: str, x) -> jax.Array:
    x = _as_array(name, x)
    if x.dtype not in _FLOATS:
        raise TypeError(f"{_FN}: {name} must be a floating-point array (float32, bfloat16 "
                        f"or float16); got {x.dtype} with shape {_shape(x)}")
    return x


def _implementation(implementation) -> str:
    if implementation is None or (isinstance(implementation, str)
                                  and implementation in IMPLEMENTATIONS):
        return IMPLEMENTATIONS[implementation]
    raise ValueError(
        f"{_FN}: implementation must be None, 'xla' or 'cudnn'; got {implementation!r}. "
        "None runs fnattn's flash lowering for the platform, 'xla' the dense XLA lowering, "
        "'cudnn' jax.nn's cuDNN kernel on NVIDIA GPUs; for fnattn's other lowerings "
        "('pallas', 'reference') call fnattn.attention with AttentionSpec(impl=...).")


def _static_bool(name: str, x) -> bool:
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(f"{_FN}: {name} must be a Python bool; got {type(x).__name__} {x!r}. "
                    "It is static configuration: a traced value cannot choose the mask.")


def _window(local_window_size) -> tuple[int, int] | None:
    """``local_window_size`` as ``(left, right)``: an int ``w`` is ``(w, w)``."""
    if local_window_size is None:
        return None

    def is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))

    if is_int(local_window_size):
        return int(local_window_size), int(local_window_size)
    if (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
            and all(is_int(w) for w in local_window_size)):
        return int(local_window_size[0]), int(local_window_size[1])
    raise TypeError(
        f"{_FN}: local_window_size must be None, an int w (the same as (w, w)) or a pair "
        f"of ints (left, right), query t seeing keys t-left .. t+right; got "
        f"{type(local_window_size).__name__} {local_window_size!r}. It is static "
        "configuration: a traced window cannot size the mask.")


def _scale(scale) -> float | jax.Array | None:
    """A number as a Python float; a traced scalar (jit argument) as it is."""
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(
            scale, (numbers.Real, np.ndarray, jax.Array)):
        raise TypeError(f"{_FN}: scale must be a number or a float scalar; got "
                        f"{type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except jax.errors.ConcretizationTypeError:
        if np.ndim(scale) == 0 and jnp.issubdtype(jnp.result_type(scale), jnp.floating):
            return scale
        raise TypeError(f"{_FN}: scale must be a number or a float scalar; got "
                        f"{jnp.result_type(scale)} with shape {_shape(scale)}") from None
    except (TypeError, ValueError):
        raise TypeError(f"{_FN}: scale must be a number or a float scalar; got "
                        f"{type(scale).__name__} {scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{_FN}: scale must be finite; got {value!r}")
    return value


def _positional_mask(q_len: int, kv_len: int, is_causal: bool,
                     window: tuple[int, int] | None) -> masks.Mask | None:
    """``is_causal`` and ``window`` as array-free fnattn masks, top-left aligned.

    Query ``t`` (0-based, whatever ``T`` and ``S``) may see key ``s`` when
    ``s <= t`` (causal) and ``t - left <= s <= t + right`` (window). fnattn's
    positional masks compare ``s`` with ``q_pos = t + (S - T)`` instead, so the
    bounds move by ``S - T``; a bound that ends up on the wrong side of the
    diagonal (``s <= q_pos - c``, ``c > 0``) is the negation of a one-sided
    window. Array-free masks keep fnattn's static block skipping.
    """
    hi = lo = None  # s <= t + hi, s >= t - lo
    if is_causal:
        hi = 0
    if window is not None:
        lo, right = window
        hi = right if hi is None else min(hi, right)
    if hi is None and lo is None:
        return None
    shift = kv_len - q_len
    right = None if hi is None else hi - shift  # s <= q_pos + right
    left = None if lo is None else lo + shift   # s >= q_pos - left
    parts = []
    if right is not None and right < 0:
        # s <= q_pos + right  <=>  not (s >= q_pos + right + 1)
        parts.append(~masks.sliding_window(left=-right - 1, right=None))
        right = None
    if left is not None and left < 0:
        # s >= q_pos - left  <=>  not (s <= q_pos - left - 1)
        parts.append(~masks.sliding_window(left=None, right=-left - 1))
        left = None
    if left is None and right == 0:
        parts.append(masks.causal())
    elif left is not None or right is not None:
        parts.append(masks.sliding_window(left=left, right=right))
    return _all_of(parts)


def _all_of(parts: list) -> masks.Mask | None:
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    return mask


def _to4d(name: str, x: jax.Array, want: tuple, what: str) -> jax.Array:
    """``x`` (rank <= 4) with leading unit axes, checked broadcastable to ``want``."""
    if x.ndim > 4:
        raise ValueError(f"{_FN}: {name} must have at most 4 axes, broadcastable to "
                         f"{what}={want}; got shape {_shape(x)}")
    x = jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)
    if any(n not in (1, w) for n, w in zip(x.shape, want)):
        raise ValueError(f"{_FN}: {name} must be broadcastable to {what}={want} (each axis "
                         f"full or 1; leading axes may be left out); got shape "
                         f"{_shape(x)}")
    return x


def _lengths(name: str, x, batch: int) -> jax.Array | None:
    if x is None:
        return None
    x = _as_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{_FN}: {name} must be an integer array of shape (B,)=({batch},); "
                        f"got {x.dtype}")
    if _shape(x) != (batch,):
        raise ValueError(f"{_FN}: {name} must have shape (B,)=({batch},), one length per "
                         f"batch row; got {_shape(x)}")
    return x


@overload
def dot_product_attention(
        query: ArrayLike, key: ArrayLike, value: ArrayLike,
        bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
        scale: float | None = None, is_causal: bool = False,
        query_seq_lengths: ArrayLike | None = None,
        key_value_seq_lengths: ArrayLike | None = None,
        local_window_size: int | tuple[int, int] | None = None,
        implementation: Literal["xla", "cudnn"] | None = None,
        return_residual: Literal[False] = ...) -> jax.Array: ...


@overload
def dot_product_attention(
        query: ArrayLike, key: ArrayLike, value: ArrayLike,
        bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
        scale: float | None = None, is_causal: bool = False,
        query_seq_lengths: ArrayLike | None = None,
        key_value_seq_lengths: ArrayLike | None = None,
        local_window_size: int | tuple[int, int] | None = None,
        implementation: Literal["xla", "cudnn"] | None = None,
        return_residual: Literal[True] = ...) -> tuple[jax.Array, jax.Array]: ...


def dot_product_attention(
        query: ArrayLike, key: ArrayLike, value: ArrayLike,
        bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
        scale: float | None = None, is_causal: bool = False,
        query_seq_lengths: ArrayLike | None = None,
        key_value_seq_lengths: ArrayLike | None = None,
        local_window_size: int | tuple[int, int] | None = None,
        implementation: Literal["xla", "cudnn"] | None = None,
        return_residual: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``jax.nn.dot_product_attention``, computed by :func:`fnattn.attention`.

    Same arguments, layouts and meaning as ``jax.nn``'s: B batch, T query
    length, S key length, N query heads, K key/value heads (N a multiple of K:
    query head n reads key/value head ``n // (N // K)``), H head dim.

    Rows that see no key give zeros (``jax.nn`` gives the mean of ``value``,
    or zeros for rows past ``query_seq_lengths``) and a residual of ``-inf``
    (``jax.nn``: a large negative number). ``docs/drop_in.md`` lists every
    difference.

    Args:
      query: (B, T, N, H), or (T, N, H) without a batch axis.
      key: (B, S, K, H), or (S, K, H); the same dtype as ``query``.
      value: (B, S, K, Hv), or (S, K, Hv); the same dtype as ``query``.
      bias: float array added to the logits, broadcastable to (B, N, T, S)
        (N, T, S without a batch axis); leading axes may be left out.
        Differentiable.
      mask: boolean array broadcastable to (B, N, T, S); True attends.
      scale: multiplier of ``query . key``; None means ``1/sqrt(H)``. A number
        (zero and negative numbers included), or a traced float scalar, which
        then multiplies ``query`` before the products (rounded to its dtype).
      is_causal: query ``t`` sees keys ``s <= t`` (aligned at the top left:
        the first query sees the first key, also when T != S).
      query_seq_lengths: int (B,); rows ``t >= query_seq_lengths[b]`` see no key.
      key_value_seq_lengths: int (B,); keys ``s >= key_value_seq_lengths[b]``
        are hidden.
      local_window_size: ``(left, right)``: query ``t`` sees keys
        ``t - left <= s <= t + right`` (top-left aligned); an int ``w`` means
        ``(w, w)``.
      implementation: None (fnattn's flash lowering for the platform:
        ``AttentionSpec(impl="auto")``), ``"xla"`` (the dense XLA lowering,
        ``impl="xla"``: the whole (T, S) logit matrix, as ``jax.nn``'s "xla")
        or ``"cudnn"`` (``impl="cudnn"``: ``jax.nn``'s cuDNN kernel on NVIDIA
        GPUs, its XLA path elsewhere).
      return_residual: also return the log-sum-exp of each row's logits.

    Returns:
      The output, shaped like ``query`` (with ``value``'s head dim), in its
      dtype; with ``return_residual``, ``(output, residual)``, the residual
      (B, T, N) (or (T, N)) in ``query``'s dtype and, as in ``jax.nn``,
      without gradient (for a differentiable one use :func:`fnattn.attention`,
      whose ``lse`` is).

    Raises:
      ValueError: an unknown ``implementation``, shapes that do not fit.
      TypeError: a non-boolean ``mask``, a non-float input, a traced
        ``is_causal`` or ``local_window_size``.

    >>> import jax, jax.numpy as jnp
    >>> from fnattn.nn import dot_product_attention
    >>> q = jax.random.normal(jax.random.key(0), (2, 3, 4, 8))   # T=3 queries
    >>> k = v = jax.random.normal(jax.random.key(1), (2, 5, 2, 8))  # S=5 keys, GQA
    >>> out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
    ((2, 3, 4, 8), True)
    """
    impl = _implementation(implementation)
    query = _float_array("query", query)
    key = _float_array("key", key)
    value = _float_array("value", value)
    if any(x.ndim not in (3, 4) for x in (query, key, value)):
        raise ValueError(
            f"{_FN}: query, key and value must be (B, T|S, N|K, H) (4 axes) or "
            f"(T|S, N|K, H) (3 axes, no batch); got query {_shape(query)}, key "
            f"{_shape(key)}, value {_shape(value)}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"{_FN}: query, key and value must share a dtype; got query "
                        f"{query.dtype}, key {key.dtype}, value {value.dtype}")
    out_shape = query.shape[:-1] + value.shape[-1:]
    residual_shape = query.shape[:-1]
    # Without a batch axis, the batch is 1 (for each array on its own, as jax.nn).
    query, key, value = (x[None] if x.ndim == 3 else x for x in (query, key, value))
    B, T, N, H = query.shape
    _, S, K, _ = key.shape
    if key.shape[0] != B or key.shape[3] != H:
        raise ValueError(f"{_FN}: key must have shape (B, S, K, H)=({B}, S, K, {H}) to match "
                         f"query {_shape(query)}; got key {_shape(key)}")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"{_FN}: value must have shape (B, S, K, Hv)=({B}, {S}, {K}, Hv) "
                         f"to match key {_shape(key)}; got value {_shape(value)}")
    if N % K:
        raise ValueError(f"{_FN}: the number of query heads N={N} must be a multiple of the "
                         f"number of key/value heads K={K}; got query {_shape(query)} and "
                         f"key {_shape(key)}, read as (B, T, N, H)")
    full = (B, N, T, S)
    what = "(B, N, T, S)"
    if bias is not None:
        bias = _to4d("bias", _float_array("bias", bias), full, what)
    parts = []
    if mask is not None:
        mask = _as_array("mask", mask)
        if mask.dtype != jnp.bool_:
            hint = (" An additive float mask (0 to attend, a large negative number to hide) "
                    "is a bias: pass it as bias=...; a mask of 1s and 0s converts with "
                    "`mask > 0`." if jnp.issubdtype(mask.dtype, jnp.floating) else
                    " Convert it with `mask != 0` (True attends).")
            raise TypeError(f"{_FN}: mask must be boolean (True attends); got {mask.dtype} "
                            f"with shape {_shape(mask)}.{hint}")
        mask = _to4d("mask", mask, full, what)
        # fnattn's dense masks have full T and S axes; B and N may stay 1.
        parts.append(masks.from_array(jnp.broadcast_to(mask, mask.shape[:2] + (T, S))))
    q_lengths = _lengths("query_seq_lengths", query_seq_lengths, B)
    kv_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths, B)
    if q_lengths is not None or kv_lengths is not None:
        parts.append(masks.lengths(q_lengths=q_lengths, kv_lengths=kv_lengths))
    positional = _positional_mask(T, S, _static_bool("is_causal", is_causal),
                                  _window(local_window_size))
    if positional is not None:
        parts.append(positional)
    return_residual = _static_bool("return_residual", return_residual)
    scale = _scale(scale)
    if isinstance(scale, jax.Array):
        # A traced scale multiplies the query (in float32, then rounded to its dtype).
        acc = jnp.promote_types(jnp.float32, query.dtype)
        query = (query.astype(acc) * scale.astype(acc)).astype(query.dtype)
        scale = 1.0
    elif scale is not None and scale <= 0:
        # fnattn's scale is positive; a sign or a zero moves onto the query exactly.
        query = -query if scale < 0 else jnp.zeros_like(query)
        scale = -scale if scale < 0 else 1.0
    spec = AttentionSpec(mask=_all_of(parts), scale=scale, bias=bias,
                         return_lse=return_residual, impl=impl)
    res = attention(spec, query, key, value)
    out = jnp.reshape(res.out, out_shape)
    if not return_residual:
        return out
    residual = jnp.swapaxes(res.lse, 1, 2).astype(key.dtype)  # (B, N, T) -> (B, T, N)
    return out, jax.lax.stop_gradient(jnp.reshape(residual, residual_shape))
