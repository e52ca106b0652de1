"""Quantized KV caches: 8-bit and 4-bit storage with per-tensor or per-(token, head) scales.

A :class:`QuantizedArray` stands wherever the serving variants take a cache or
a pool (``fnattn.decode``'s ``k_cache``/``v_cache``, the paged functions'
``k_pages``/``v_pages``, :class:`fnattn.PagedKVCache`'s pools). It is a
pytree of two arrays and one static description:

* ``data``: the stored values, the cache's shape with the head dim last
  (halved for the 4-bit format, which packs two values a byte);
* ``scale``: float32, either ``()`` (one scale for the whole tensor) or
  ``data.shape[:-1]`` (one per token and kv head: per (B, S, Hkv) slot of a
  contiguous cache, per (Hkv, page, offset) slot of a pool). A scale pool
  has the pool's leading axes, so indexing the pool's pages with the same
  index moves the scales with them (page tables, writes, layers, sharding);
* ``format``: a frozen :class:`QuantFormat` (static, part of the trace).

The logical value of element ``x[..., d]`` is ``decode(data)[..., d] * scale[...]``
(:func:`dequantize`). The lowerings dequantize what they load, block by
block (a page chunk of the paged XLA lowering), and never hold a dequantized
copy of a pool.

**Formats** (:data:`FORMATS`):

==============  =========================  ============  ======================
name            stored as                  largest code  step at the largest
==============  =========================  ============  ======================
float8_e4m3fn   ``jnp.float8_e4m3fn``      448           32 (3 mantissa bits)
float8_e5m2     ``jnp.float8_e5m2``        57344         8192 (2 mantissa bits)
int8            ``jnp.int8``               127           1
int4            ``jnp.uint8``, two a byte  7             1
==============  =========================  ============  ======================

The 4-bit format is symmetric int4 (codes -7..7) packed two a byte along the
head dim in *split halves*: byte ``j`` of a head holds channel ``j`` in its low
nibble and channel ``j + D/2`` in its high nibble, so unpacking is two shifts
and a concatenation (no interleave), and a kernel may multiply the two halves
of q with the two nibble planes directly. It is stored as ``uint8`` rather
than JAX's ``int4``/``float4_e2m1fn`` dtypes, which not every supported jax
version loads and stores alike on every backend; the head dim must be even.

**Quantizing** divides by the scale, rounds to nearest (ties to even) and
*saturates*: values past the largest code become the largest code, so that no
finite input ever becomes NaN or inf (a plain cast of 500.0 to
``float8_e4m3fn``, which has no inf, gives NaN). NaN stays NaN in the float8
formats and becomes 0 in the integer ones (which cannot hold it). Per-token
scales are ``max |x| / largest code`` over the head dim (1 for an all-zero
row), so every row uses the whole range.

>>> import jax, jax.numpy as jnp
>>> from fnattn import quant
>>> x = jnp.array([[0.5, -1.0, 2.0, 500.0]])
>>> qa = quant.quantize(x, quant.QuantFormat("float8_e4m3fn", "tensor"), scale=1.0)
>>> quant.dequantize(qa).tolist()               # 500 saturates to 448, not NaN
[[0.5, -1.0, 2.0, 448.0]]
>>> qa = quant.quantize(x, quant.QuantFormat("int4"))           # per-token scales
>>> qa.data.shape, qa.data.dtype, qa.scale.shape, qa.shape
((1, 2), dtype('uint8'), (1,), (1, 4))
"""

import dataclasses
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify
from jaxtyping import Array, Shaped

__all__ = ["FORMATS", "QuantFormat", "QuantizedArray", "check_scales", "dequantize", "empty",
           "is_quantized", "partition_specs", "quantize"]

F32 = jnp.float32

# name -> (storage dtype, largest code, values per stored element)
_SPECS = {
    "float8_e4m3fn": (jnp.float8_e4m3fn, 448.0, 1),
    "float8_e5m2": (jnp.float8_e5m2, 57344.0, 1),
    "int8": (jnp.int8, 127.0, 1),
    "int4": (jnp.uint8, 7.0, 2),
}
FORMATS = tuple(_SPECS)
GRANULARITIES = ("token", "tensor")


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How a cache is quantized (static and hashable: a spec or a cache carries it).

    Attributes:
      name: one of :data:`FORMATS` ("float8_e4m3fn", "float8_e5m2", "int8", "int4").
      granularity: "token" (one scale per token and kv head, computed from
        the values when they are written) or "tensor" (one scale for the whole
        tensor, given by the caller).

    >>> QuantFormat("int8").granularity
    'token'
    >>> QuantFormat("int3")
    Traceback (most recent call last):
    ...
    ValueError: QuantFormat: name must be one of ('float8_e4m3fn', 'float8_e5m2', 'int8', 'int4'); got 'int3'
    """

    name: str
    granularity: str = "token"

    def __post_init__(self):
        if self.name not in _SPECS:
            raise ValueError(f"QuantFormat: name must be one of {FORMATS}; got {self.name!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"QuantFormat: granularity must be one of {GRANULARITIES}; got "
                             f"{self.granularity!r}")

    @property
    def storage_dtype(self):
        """The dtype of :attr:`QuantizedArray.data`."""
        return jnp.dtype(_SPECS[self.name][0])

    @property
    def max_code(self) -> float:
        """The largest magnitude a stored value represents (before the scale)."""
        return _SPECS[self.name][1]

    @property
    def per_byte(self) -> int:
        """Values per stored element: 2 for the packed 4-bit format, else 1."""
        return _SPECS[self.name][2]

    @property
    def is_float(self) -> bool:
        return self.name.startswith("float")

    @property
    def per_token(self) -> bool:
        return self.granularity == "token"

    def stored_dim(self, head_dim: int) -> int:
        """The stored head dim of a logical ``head_dim`` (halved when packed)."""
        return head_dim // self.per_byte


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A quantized array: ``data`` (stored codes), ``scale`` (float32, ``()`` or
    ``data.shape[:-1]``) and the static ``format`` (see the module docstring).

    ``shape`` is the logical shape (the head dim unpacked), ``dtype`` the
    stored dtype. Build one with :func:`quantize` or :func:`empty`; a pytree
    (``jit``, ``scan`` over a leading axis, ``tree_map`` all see the two arrays).
    """

    data: Any
    scale: Any
    format: QuantFormat

    @property
    def shape(self):
        s = tuple(jnp.shape(self.data))
        return s[:-1] + (s[-1] * self.format.per_byte,)

    @property
    def ndim(self) -> int:
        return jnp.ndim(self.data)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and the scales."""
        scale_bytes = (int(np.prod(self.scale.shape)) * np.dtype(self.scale.dtype).itemsize
                       if hasattr(self.scale, "shape") else 4)
        return int(np.prod(self.data.shape)) * np.dtype(self.data.dtype).itemsize + scale_bytes

    def replace(self, **changes) -> "QuantizedArray":
        return dataclasses.replace(self, **changes)

    def reshape_leading(self, *lead) -> "QuantizedArray":
        """The codes (and per-token scales) with their leading axes reshaped to
        ``lead`` (the head dim stays last)."""
        scale = self.scale.reshape(lead) if self.format.per_token else self.scale
        return QuantizedArray(self.data.reshape(*lead, self.data.shape[-1]), scale, self.format)

    def swapaxes(self, a: int, b: int) -> "QuantizedArray":
        """Swaps two leading axes of the codes and the per-token scales."""
        if a < 0 or b < 0 or max(a, b) >= self.ndim - 1:
            raise ValueError(f"QuantizedArray.swapaxes: axes ({a}, {b}) must be leading axes "
                             f"(0..{self.ndim - 2}), not the head dim")
        scale = jnp.swapaxes(self.scale, a, b) if self.format.per_token else self.scale
        return QuantizedArray(jnp.swapaxes(self.data, a, b), scale, self.format)

    def __getitem__(self, index) -> "QuantizedArray":
        """Indexes the leading axes of data and scales alike (not the head dim)."""
        scale = self.scale
        if self.format.per_token:
            scale = scale[index]
        return QuantizedArray(self.data[index], scale, self.format)


jax.tree_util.register_dataclass(QuantizedArray, data_fields=["data", "scale"],
                                 meta_fields=["format"])


# The annotation of a cache or pool argument: a float array or a QuantizedArray.
Cache = Union[Shaped[Array, "..."], QuantizedArray]


def is_quantized(x) -> bool:
    """Whether ``x`` is a :class:`QuantizedArray`."""
    return isinstance(x, QuantizedArray)


def _as_format(format) -> QuantFormat:
    if isinstance(format, str):
        return QuantFormat(format)
    if not isinstance(format, QuantFormat):
        raise TypeError(f"quantize: format must be a QuantFormat or one of {FORMATS}; got "
                        f"{type(format).__name__}")
    return format


def _check_head_dim(fn, fmt, shape):
    if len(shape) == 0:
        raise ValueError(f"{fn}: the array must have a head dim (its last axis); got a scalar")
    if fmt.per_byte == 2 and shape[-1] % 2:
        raise ValueError(f"{fn}: the 4-bit format packs two channels a byte along the head "
                         f"dim, which must be even; got shape {tuple(shape)} (head dim "
                         f"{shape[-1]}). Pad the head dim to {shape[-1] + 1} or use an "
                         f"8-bit format.")


def _check_tensor_scale(fn, scale):
    """A per-tensor scale: a Python float or a scalar array, > 0 and finite when known."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"{fn}: scale must be a finite number > 0; got {scale!r}")
        return jnp.asarray(scale, F32)
    if not hasattr(scale, "shape") or not jnp.issubdtype(getattr(scale, "dtype", None),
                                                          jnp.floating):
        raise TypeError(f"{fn}: a per-tensor scale must be a Python float or a floating "
                        f"scalar array; got {type(scale).__name__}")
    if tuple(jnp.shape(scale)) != ():
        raise ValueError(f"{fn}: a per-tensor scale must be a scalar, shape (); got shape "
                         f"{tuple(jnp.shape(scale))}. For one scale per token and kv head use "
                         f"QuantFormat(..., granularity='token').")
    _refuse_bad_concrete(fn, "scale", scale)
    return jnp.asarray(scale, F32)


def _refuse_bad_concrete(fn, name, scale):
    if isinstance(scale, jax.core.Tracer):
        return
    s = np.asarray(scale, np.float32)
    bad = ~(np.isfinite(s) & (s > 0))
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), s.shape) if s.ndim else ()
        raise ValueError(f"{fn}: {name} must be finite and > 0 everywhere; {name}"
                         f"{list(i) if s.ndim else ''} = {s[i]}. (Use checked=True to report "
                         f"traced scales through checkify.)")


def quantize(x, format, *, scale=None, checked: bool = False) -> QuantizedArray:
    """Quantizes ``x`` (float, head dim last) to ``format``; saturating.

    Args:
      x: a float array, head dim last (``(..., D)``; D even for "int4").
      format: a :class:`QuantFormat` or a format name (per-token scales).
      scale: the per-tensor scale (a Python float > 0 or a float scalar array;
        required for ``granularity="tensor"``, refused for "token", whose
        scales come from ``x``).
      checked: report a traced per-tensor scale that is not finite and > 0
        through ``checkify`` (a concrete one raises ``ValueError`` at once).

    Returns:
      A :class:`QuantizedArray`; the serving variants' update forms write
      exactly these codes and scales.

    >>> import jax.numpy as jnp
    >>> from fnattn import quant
    >>> qa = quant.quantize(jnp.array([[1.0, -2.0], [0.0, 0.0]]), "int8")
    >>> qa.data.tolist(), qa.scale.tolist()
    ([[64, -127], [0, 0]], [0.015748031437397003, 1.0])
    """
    fmt = _as_format(format)
    fn = "quantize"
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: x must be a floating-point array; got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    _check_head_dim(fn, fmt, jnp.shape(x))
    xf = jnp.asarray(x).astype(F32)
    if fmt.per_token:
        if scale is not None:
            raise ValueError(f"{fn}: {fmt} computes its scales from x (one per token and kv "
                             f"head); pass scale=None, or QuantFormat({fmt.name!r}, "
                             f"'tensor') for one given scale")
        amax = jnp.max(jnp.abs(xf), axis=-1)
        s = amax / fmt.max_code
        s = jnp.where(s > 0, s, 1.0)      # an all-zero row (or underflow): any scale works
        y = xf / s[..., None]
    else:
        if scale is None:
            raise ValueError(f"{fn}: {fmt} needs its scale: quantize(x, format, scale=...)")
        s = _check_tensor_scale(fn, scale)
        if checked:
            check_scales(s, name="scale")
        y = xf / s
    return QuantizedArray(_encode(fmt, y), s, fmt)


def _encode(fmt: QuantFormat, y):
    """Codes of ``y = x / scale`` (float32): rounded, saturated, packed."""
    m = fmt.max_code
    if fmt.is_float:
        # clip before the cast: float8_e4m3fn has no inf and casts overflow to NaN
        return jnp.clip(y, -m, m).astype(fmt.storage_dtype)
    c = jnp.clip(jnp.round(jnp.where(jnp.isnan(y), 0.0, y)), -m, m).astype(jnp.int8)
    if fmt.per_byte == 1:
        return c
    half = c.shape[-1] // 2
    lo = c[..., :half].astype(jnp.uint8) & jnp.uint8(0xF)
    hi = c[..., half:].astype(jnp.uint8) << jnp.uint8(4)
    return lo | hi


def decode_codes(fmt: QuantFormat, data, dtype=F32):
    """The stored codes as ``dtype`` values before the scale (4-bit: unpacked)."""
    if fmt.per_byte == 1:
        return data.astype(dtype)
    b = lax.bitcast_convert_type(data, jnp.int8)
    lo = lax.shift_right_arithmetic(lax.shift_left(b, jnp.int8(4)), jnp.int8(4))
    hi = lax.shift_right_arithmetic(b, jnp.int8(4))
    return jnp.concatenate([lo, hi], axis=-1).astype(dtype)


def code_halves(fmt: QuantFormat, data, dtype=F32):
    """The codes as ``dtype`` values like :func:`decode_codes`, except that the
    4-bit format's come as a pair ``(channels [0, D/2), channels [D/2, D))``,
    the two nibble planes unpacked apart (no concatenation): a product over
    the head dim takes them as two halves."""
    if fmt.per_byte == 1:
        return data.astype(dtype)
    b = lax.bitcast_convert_type(data, jnp.int8)
    lo = lax.shift_right_arithmetic(lax.shift_left(b, jnp.int8(4)), jnp.int8(4))
    return lo.astype(dtype), lax.shift_right_arithmetic(b, jnp.int8(4)).astype(dtype)


def einsum_codes(spec: str, a, b):
    """(internal) ``einsum(spec, a, b)`` in float32, where ``b`` may be the two
    halves of 4-bit codes (:func:`code_halves`), whose last axis is the first
    and the second half of the head dim: contracted with the two halves of
    ``a``'s last axis (logits), or the output's last axis concatenated (values).
    """
    if not isinstance(b, tuple):
        return jnp.einsum(spec, a, b, preferred_element_type=F32)
    lo, hi = b
    inputs, out = spec.split("->")
    if inputs.split(",")[1][-1] not in out:       # b's last axis is contracted
        half = lo.shape[-1]
        return (jnp.einsum(spec, a[..., :half], lo, preferred_element_type=F32)
                + jnp.einsum(spec, a[..., half:], hi, preferred_element_type=F32))
    return jnp.concatenate([jnp.einsum(spec, a, lo, preferred_element_type=F32),
                            jnp.einsum(spec, a, hi, preferred_element_type=F32)], -1)


def dequantize(x, dtype=F32):
    """The logical values of ``x`` as ``dtype`` (computed in float32); a plain
    array is returned cast to ``dtype``.

    >>> import jax.numpy as jnp
    >>> from fnattn import quant
    >>> x = jnp.array([[0.3, -1.1, 0.02, 0.9]])
    >>> err = jnp.abs(quant.dequantize(quant.quantize(x, "int8")) - x)
    >>> bool((err <= 1.1 / 127 / 2 + 1e-7).all())                # within half a step
    True
    """
    if not is_quantized(x):
        return jnp.asarray(x).astype(dtype)
    scale = jnp.asarray(x.scale, F32)
    vals = decode_codes(x.format, x.data, F32)
    vals = vals * (scale[..., None] if x.format.per_token else scale)
    return vals.astype(dtype)


def load(x, index, dtype):
    """``x[index]`` (leading axes only) as ``dtype`` values: what the lowerings
    read, block by block; a plain array is indexed (and cast)."""
    if not is_quantized(x):
        return x[index].astype(dtype)
    return dequantize(x[index], dtype)


def empty(shape, format, *, scale=None) -> QuantizedArray:
    """A zero-filled :class:`QuantizedArray` of logical ``shape`` (head dim last):
    codes 0, per-token scales 1 (written anew with each token), or the given
    per-tensor ``scale``.

    >>> from fnattn import quant
    >>> pool = quant.empty((2, 16, 8, 64), "int4")        # (Hkv, pages, page_size, D)
    >>> pool.data.shape, pool.scale.shape
    ((2, 16, 8, 32), (2, 16, 8))
    """
    fmt = _as_format(format)
    shape = tuple(int(n) for n in shape)
    _check_head_dim("quant.empty", fmt, shape)
    data = jnp.zeros(shape[:-1] + (fmt.stored_dim(shape[-1]),), fmt.storage_dtype)
    if fmt.per_token:
        if scale is not None:
            raise ValueError(f"quant.empty: {fmt} computes its scales when tokens are written; "
                             "pass scale=None")
        return QuantizedArray(data, jnp.ones(shape[:-1], F32), fmt)
    if scale is None:
        raise ValueError(f"quant.empty: {fmt} needs its scale: quant.empty(shape, format, "
                         "scale=...)")
    return QuantizedArray(data, _check_tensor_scale("quant.empty", scale), fmt)


def partition_specs(spec, format) -> QuantizedArray:
    """The partition specs of a quantized cache whose float counterpart has ``spec``
    (a ``PartitionSpec``, e.g. from :func:`fnattn.sharding.rules`): the codes
    take ``spec``, per-token scales ``spec`` without its last (head-dim) entry,
    a per-tensor scale is replicated. Use it for ``shard_map``'s ``in_specs`` or
    to build ``NamedSharding`` objects.

    >>> from jax.sharding import PartitionSpec as P
    >>> from fnattn import quant
    >>> s = quant.partition_specs(P("model", None, None, None), "int8")
    >>> tuple(s.data), tuple(s.scale)
    (('model', None, None, None), ('model', None, None))
    """
    from jax.sharding import PartitionSpec
    fmt = _as_format(format)
    entries = tuple(spec)
    scale = PartitionSpec(*entries[:-1]) if fmt.per_token else PartitionSpec()
    return QuantizedArray(spec, scale, fmt)


def check(fn: str, name: str, x: QuantizedArray) -> None:
    """Trace-time validation of a quantized cache argument ``name`` of ``fn``."""
    fmt = x.format
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"{fn}: {name}.format must be a QuantFormat; got {type(fmt).__name__}")
    data = x.data
    if not hasattr(data, "dtype") or data.dtype != fmt.storage_dtype:
        raise TypeError(f"{fn}: {name}.data must be stored as {fmt.storage_dtype} for "
                        f"{fmt}; got {getattr(data, 'dtype', type(data).__name__)}. Build it "
                        f"with fnattn.quant.quantize or fnattn.quant.empty.")
    want = tuple(jnp.shape(data))[:-1] if fmt.per_token else ()
    scale = x.scale
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = _check_tensor_scale(f"{fn}: {name}", scale) if not fmt.per_token else scale
    if not hasattr(scale, "dtype") or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"{fn}: {name}.scale must be a float array; got "
                        f"{getattr(scale, 'dtype', type(scale).__name__)}")
    if tuple(jnp.shape(scale)) != want:
        what = ("data.shape[:-1], one per token and kv head" if fmt.per_token
                else "(), one for the tensor")
        raise ValueError(f"{fn}: {name}.scale must have shape {what} = {want} for {fmt} "
                         f"(data {tuple(jnp.shape(data))}); got {tuple(jnp.shape(scale))}")
    if not fmt.per_token:
        _refuse_bad_concrete(f"{fn}: {name}", "scale", scale)


def check_scales(scale, *, name: str = "scale") -> None:
    """Reports scales that are not finite and > 0 through ``checkify`` (call
    inside ``checkify.checkify``; traced values). The serving variants'
    ``checked=True`` calls it for per-tensor scales (per-token scales of slots a
    sequence does not own may hold anything, like the slots)."""
    s = jnp.asarray(scale, F32)
    bad = ~(jnp.isfinite(s) & (s > 0))
    flat = jnp.argmax(bad.reshape(-1)) if s.ndim else jnp.int32(0)
    checkify.check(~bad.any(), f"{name} must be finite and > 0; got {name}"
                   + ("[flat {i}]" if s.ndim else "") + " = {x}", i=flat,
                   x=s.reshape(-1)[flat] if s.ndim else s)


def check_pool_scales(**pools) -> None:
    """``checked=True`` of the serving variants: :func:`check_scales` for each
    quantized per-tensor pool among ``pools`` (name -> cache or pool)."""
    for name, x in pools.items():
        if is_quantized(x) and not x.format.per_token:
            check_scales(x.scale, name=f"{name}.scale")


def pool_scale_like(new_scale, pool: QuantizedArray):
    """(internal) the scales to write beside new tokens' codes."""
    return new_scale.astype(jnp.result_type(pool.scale))


def write(pool, index, new, *, mode: Optional[str] = "drop"):
    """``pool.at[index].set(new)`` for a plain pool; for a :class:`QuantizedArray`,
    ``new`` (float, logical shape) quantized with :func:`quantize` and its codes
    and per-token scales scattered at ``index`` (leading axes), bit for bit
    what :func:`quantize` gives (a per-tensor pool keeps its scale)."""
    if not is_quantized(pool):
        return pool.at[index].set(new.astype(pool.dtype), mode=mode)
    fmt = pool.format
    qa = quantize(new, fmt, scale=None if fmt.per_token else pool.scale)
    data = pool.data.at[index].set(qa.data, mode=mode)
    scale = pool.scale
    if fmt.per_token:
        scale = scale.at[index].set(pool_scale_like(qa.scale, pool), mode=mode)
    return QuantizedArray(data, scale, fmt)
