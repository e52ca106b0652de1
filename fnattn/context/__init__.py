"""``fnattn.context``: attention over a sequence split across devices.

Called inside ``jax.shard_map`` with the name of the mesh axis that splits the
sequence, the way ``jax.lax.psum`` takes one:

* :func:`attention`: ring or all-gather context parallelism for training and
  prefill, with contiguous, zigzag or striped layouts (:mod:`.layouts`);
* :func:`decode`: decoding from a KV cache whose slots are split across devices
  (partial results merged with :func:`fnattn.merging.merge_across`);
* :func:`reorder` / :func:`restore`: a global sequence to and from a layout's order;
* :func:`positions`: the global positions of a device's tokens;
* :func:`work`: tiles per device, the load balance of a layout under a mask.

Every other fnattn function runs inside ``shard_map`` on its device's share of
the batch and heads as it is.
"""

from fnattn.context.api import attention
from fnattn.context.decode import decode
from fnattn.context.layouts import LAYOUTS, positions, reorder, restore, work

__all__ = ["LAYOUTS", "attention", "decode", "positions", "reorder", "restore", "work"]
