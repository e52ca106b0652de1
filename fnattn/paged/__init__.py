"""``fnattn.paged``: attention over a paged KV cache (decode and ragged mixed batches).

See :mod:`fnattn.paged.api` for the layout, positions and lowerings, and
:class:`fnattn.PagedKVCache` for a cache that builds the page tables.
"""

from fnattn.paged.api import (check_inputs, paged_attention, ragged_paged_attention,
                              ragged_paged_attention_with_update)
from fnattn.paged.common import PagedBlockSizes
from fnattn.paged.tree import draft_ancestor_mask, draft_positions

__all__ = ["PagedBlockSizes", "check_inputs", "draft_ancestor_mask", "draft_positions",
           "paged_attention", "ragged_paged_attention", "ragged_paged_attention_with_update"]
