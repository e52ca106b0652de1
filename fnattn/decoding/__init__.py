"""``fnattn.decode``: decode against a contiguous KV cache (see :mod:`fnattn.decoding.api`);
``decode_with_update`` also writes the new tokens' k/v (:mod:`fnattn.decoding.update`)."""

from fnattn.decoding.api import DecodeBlockSizes, decode
from fnattn.decoding.update import decode_with_update

__all__ = ["DecodeBlockSizes", "decode", "decode_with_update"]
