"""fnattn: attention variants as pure JAX functions.

>>> import jax, jax.numpy as jnp, fnattn
>>> q = k = v = jnp.ones((1, 4, 2, 8))
>>> jax.jit(fnattn.attention)(fnattn.AttentionSpec(), q, k, v).out.shape
(1, 4, 2, 8)
"""

from fnattn import _jax_private, context, cost, dropout, masks, position_bias, quant, sharding
from fnattn.core import attention
from fnattn.decoding import DecodeBlockSizes, decode, decode_with_update
from fnattn.decoding.mosaic_gpu import MosaicGpuDecodeBlockSizes
from fnattn.flash.api import flash
from fnattn.flash.mosaic import MosaicBlockSizes
from fnattn.flash.mosaic_gpu import MosaicGpuBlockSizes
from fnattn.flash.mosaic_gpu_bwd import MosaicGpuBwdBlockSizes
from fnattn.flash.triton import TritonBlockSizes
from fnattn.flash.xla import XlaBlockSizes
from fnattn.merging import merge
from fnattn.nn import dot_product_attention
from fnattn.reference import reference
from fnattn.cache import LayeredKVCache, LayeredPagedKVCache, PagedKVCache
from fnattn.paged import (PagedBlockSizes, draft_ancestor_mask, draft_positions,
                          paged_attention, ragged_paged_attention,
                          ragged_paged_attention_with_update)
from fnattn.spec import AttentionOutput, AttentionSpec
from fnattn.selection import (selected_attention, selected_decode, selected_decode_with_update,
                              selected_paged_attention, selected_ragged_paged_attention,
                              selected_ragged_paged_attention_with_update)
from fnattn import tune  # noqa: E402  (after the variants it tunes)

__all__ = [
    "AttentionOutput",
    "AttentionSpec",
    "DecodeBlockSizes",
    "LayeredKVCache",
    "LayeredPagedKVCache",
    "MosaicBlockSizes",
    "MosaicGpuBlockSizes",
    "MosaicGpuBwdBlockSizes",
    "MosaicGpuDecodeBlockSizes",
    "PagedBlockSizes",
    "PagedKVCache",
    "TritonBlockSizes",
    "XlaBlockSizes",
    "flash",
    "attention",
    "context",
    "cost",
    "decode",
    "decode_with_update",
    "dot_product_attention",
    "draft_ancestor_mask",
    "draft_positions",
    "dropout",
    "masks",
    "merge",
    "paged_attention",
    "position_bias",
    "quant",
    "ragged_paged_attention",
    "ragged_paged_attention_with_update",
    "reference",
    "selected_attention",
    "selected_decode",
    "selected_decode_with_update",
    "selected_paged_attention",
    "selected_ragged_paged_attention",
    "selected_ragged_paged_attention_with_update",
    "sharding",
    "tune",
]

__version__ = "0.1.0"

_jax_private.check_version()  # one warning past the newest jax fnattn was tested with
