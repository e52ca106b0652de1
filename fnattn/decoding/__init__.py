"""``fnattn.decode``: decode against a contiguous KV cache (see :mod:`fnattn.decoding.api`)."""

from fnattn.decoding.api import DecodeBlockSizes, decode

__all__ = ["DecodeBlockSizes", "decode"]
