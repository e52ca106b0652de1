"""``fnattn.decode``: decode against a contiguous KV cache (see :mod:`fnattn.decoding.api`)."""

from fnattn.decoding.api import DecodeBlockSizes, decode, default_num_splits

__all__ = ["DecodeBlockSizes", "decode", "default_num_splits"]
