"""Dequantizing inside a kernel: what the Pallas decode kernels do with a tile
of :mod:`fnattn.quant` codes right after loading it.

A tile's logical values are ``codes * scale`` computed in float32 and cast to
the compute dtype: exactly :func:`fnattn.quant.dequantize` on the same
elements, so a kernel and the XLA lowering multiply the same numbers. The
4-bit format's bytes hold channel ``j`` in their low nibble and channel
``j + D/2`` in their high one (*split halves*, see :mod:`fnattn.quant`);
:func:`nibble` takes either out of bytes widened to int32 with integer
arithmetic only (every backend lowers it; no bitcast, no int8 shifts).
"""

import jax.numpy as jnp

from fnattn import quant

F32 = jnp.float32
I32 = jnp.int32


def nibble(byte, high):
    """The signed 4-bit code (-8..7; the quantizer writes -7..7) in the low
    nibble of ``byte`` (an int32 0..255), or its high one where ``high``
    (a bool array broadcasting with ``byte``, or a Python bool)."""
    n = jnp.where(high, byte >> 4, byte & 15) if not isinstance(high, bool) else (
        byte >> 4 if high else byte & 15)
    return (n ^ 8) - 8


def codes_f32(fmt: quant.QuantFormat, codes, high=None):
    """A tile of stored codes as float32 values before the scale. 4-bit:
    ``codes`` are bytes and ``high`` says which nibble each element takes."""
    if fmt.per_byte == 1:
        return codes.astype(F32)
    return nibble(codes.astype(I32), high).astype(F32)


def values(fmt: quant.QuantFormat, codes, scale, dtype, high=None):
    """A tile's logical values in ``dtype``: ``codes_f32 * scale`` (``scale``
    a float32 scalar or an array broadcasting with the tile: a column of
    per-token scales)."""
    return (codes_f32(fmt, codes, high) * scale).astype(dtype)


def compute_dtype(q, k):
    """The dtype a kernel computes the products in: a quantized cache's values
    are dequantized to q's dtype (as the XLA lowering does), a float cache's
    stay its own."""
    return q.dtype if quant.is_quantized(k) else k.dtype


def tensor_scales(k, v):
    """float32 (2,) of the per-tensor scales of ``k`` and ``v`` (1 for a float
    or per-token cache, or for no ``v``): one small operand for the kernels."""
    def one(x):
        if quant.is_quantized(x) and not x.format.per_token:
            return jnp.asarray(x.scale, F32).reshape(())
        return jnp.ones((), F32)
    return jnp.stack([one(k), one(v)])


def describe(x) -> str:
    """A cache's format for messages: "int8 (per-token scales)" or a dtype name."""
    if quant.is_quantized(x):
        return f"{x.format.name} ({'per-token' if x.format.per_token else 'per-tensor'} scales)"
    return jnp.dtype(x.dtype).name
