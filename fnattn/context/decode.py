"""``fnattn.context.decode``: decoding from a KV cache sharded along its slots.

Called inside ``jax.shard_map``: the cache's slot axis ``S`` is split across
the devices of the mesh axis ``axis_name`` (a name or a tuple of names), device
``i`` holding the global slots ``[i * S_local, (i + 1) * S_local)``, so that a
context too long for one device's memory (a million tokens) is decoded from the
caches of N devices. The queries, ``kv_lengths`` / ``kv_starts`` (global, as
:func:`fnattn.decode` takes them) and the sinks are replicated along the axis.
Every device gets the whole result, equal to :func:`fnattn.decode` on the
unsharded cache (out, lse, and the gradients with respect to q, the caches
and the sinks).

How: each device runs :func:`fnattn.decode` (its platform's kernel) on its own
slots, without sinks, and the partial ``(out, lse)`` are combined by
:func:`fnattn.merging.merge_across` (one ``pmax`` and one ``psum``), where the
sinks join the denominator once. Nothing of the cache moves between devices.

**Positions.** As in :func:`fnattn.decode`: the key in global slot
``kv_starts[b] + j`` is at position ``j`` and query ``t`` at position
``kv_lengths[b] - Tq + t``; the ``Tq`` new tokens (already written in the cache)
may straddle a device boundary. A device's slice cannot be given to the local
``decode`` with those global positions, so the keys are split by what the mask
does with them:

* the keys every query sees: one local ``decode`` with no mask over this
  device's share of that contiguous range (``kv_starts`` / ``kv_lengths``);
* the at most ``2 (Tq - 1)`` keys that some queries see and others do not
  (around the newest tokens, and at the far edge of a sliding window): gathered
  from the cache and attended densely with the mask evaluated at their global
  positions (only when ``Tq > 1`` and the mask is not full).

This is exact for masks that let each query see one contiguous band of
positions around its own: no mask, ``masks.full()``, ``masks.causal()``,
``masks.sliding_window(left, right)`` and their ``&`` / ``|`` combinations.
Other masks (``chunked``, ``from_fn``, ``~``, masks that hold arrays) are
refused with ``NotImplementedError``.

**Position terms** (:mod:`fnattn.position_bias`) whose arrays are per head or
per (batch row, head), as :func:`fnattn.decode` takes them, are evaluated at
the global positions: the local decode gets the term as a ``from_fn`` term
whose values are the term's arrays and the offsets of its queries' and keys'
positions (float32, exact below 2**24 slots), and the gathered keys' dense
part gets it through :func:`fnattn.masks.at_positions`. Their arrays are
constants, as in every serving variant.

Like :func:`fnattn.decode`: no bias, no dropout; lengths and starts past the
(global) cache are clipped to it; cache slots outside a sequence's range may
hold anything.
"""

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from beartype import beartype
from jax import lax
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, masks, position_bias, quant
from fnattn.core import attention
from fnattn.decoding import decode as local_decode
from fnattn.merging import merge, merge_across
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["decode"]

I32 = jnp.int32
F32 = jnp.float32

_SUPPORTED = ("no mask, masks.full(), masks.causal(), masks.sliding_window(left, right) "
              "and their & / | combinations")


# Positions travel to the local decode's term as float32 offsets: exact below 2**24.
_EXACT_POSITIONS = 1 << 24


@dataclasses.dataclass(frozen=True)
class _Shifted:
    """A position term evaluated at positions shifted by per-row offsets: the
    function of a ``from_fn`` term whose values are the term's own (``n`` of
    them), then the queries' and the keys' offsets. Hashable (the term's
    structure, not its arrays), so equal calls share their traces."""

    treedef: Any
    n: int
    __name__ = "at_global_positions"

    def __call__(self, b, h, q_pos, k, *values):
        term = masks.from_treedef(self.treedef)  # (value() reads ``values``)
        dq, dk = (x.astype(I32) for x in values[self.n:])
        pos = masks.Positions(b=b, h=h, q=q_pos, q_pos=q_pos + dq, k=k + dk)
        return term.value(pos, values[:self.n])


def _at_global_positions(term, B, Hq, *, q_shift, k_shift):
    """``term`` for a decode whose queries and keys sit ``q_shift`` and ``k_shift``
    (B,) positions before their global ones: a ``from_fn`` term of per-(row,
    head) values (the term's arrays, held constant, and the two offsets)."""
    values = position_bias.per_head_arrays(term, B, Hq)
    values = [] if values is None else list(values)
    offsets = [jnp.broadcast_to(x.astype(F32)[:, None], (B, Hq)) for x in (q_shift, k_shift)]
    fn = _Shifted(jax.tree_util.tree_structure(term), len(values))
    return position_bias.from_fn(fn, *values, *offsets)


def _band(mask):
    """``(left, right)`` such that query position p sees exactly the keys in
    ``[p - left, p + right]`` (None: unbounded), or None if the mask is not such
    a band. Every band holds p, so an ``&`` of bands is the band of the minima,
    an ``|`` the band of the maxima."""
    if mask is None or isinstance(mask, masks.Full):
        return None, None
    if isinstance(mask, masks.Causal):
        return None, 0
    if isinstance(mask, masks.SlidingWindow):
        return mask.left, mask.right
    if isinstance(mask, (masks.And, masks.Or)):
        a, b = _band(mask.a), _band(mask.b)
        if a is None or b is None:
            return None
        if isinstance(mask, masks.And):
            pick = lambda x, y: y if x is None else x if y is None else min(x, y)  # noqa: E731
        else:
            pick = lambda x, y: None if x is None or y is None else max(x, y)  # noqa: E731
        return pick(a[0], b[0]), pick(a[1], b[1])
    return None


def _gather_slots(x, idx, layout):
    """x (B, S, H, D) or (B, H, S, D), idx (B, F) -> the slots idx, in x's layout
    (a quantized cache: those slots' codes and scales, dequantized)."""
    if quant.is_quantized(x):
        data = _gather_slots(x.data, idx, layout)
        scale = x.scale
        if x.format.per_token:
            scale = _gather_slots(scale[..., None], idx, layout)[..., 0]
        return quant.dequantize(x.replace(data=data, scale=scale))
    if layout == "bthd":
        return jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
    return jnp.take_along_axis(x, idx[:, None, :, None], axis=2)


@jaxtyped(typechecker=beartype)
def decode(spec: AttentionSpec, q: Shaped[Array, "..."], k_cache: quant.Cache,
           v_cache: quant.Cache, *, kv_lengths: Shaped[Array, "..."], axis_name,
           kv_starts: Optional[Shaped[Array, "..."]] = None) -> AttentionOutput:
    """:func:`fnattn.decode` with the cache's slots split along a mesh axis.

    Call it inside ``jax.shard_map``; see the module docstring for how the work
    is split and which masks are supported.

    Args:
      spec: the :class:`AttentionSpec`, as for :func:`fnattn.decode` (mask:
        none, full, causal, sliding windows, their ``&`` / ``|``; its sinks are
        replicated).
      q: (B, Tq, Hq, D) in "bthd" or (B, Hq, Tq, D) in "bhtd", replicated along
        ``axis_name``.
      k_cache: this device's slots of the cache, (B, S_local, Hkv, D) or
        (B, Hkv, S_local, D): device ``i`` of the axis holds the global slots
        ``[i * S_local, (i + 1) * S_local)``.
      v_cache: this device's slots of the values, like ``k_cache`` with head dim Dv.
        Either may be a :class:`fnattn.quant.QuantizedArray` (its codes and
        per-token scales split along the slots alike).
      kv_lengths: (B,) int, the global number of valid keys of each sequence (the
        new tokens included), replicated along the axis.
      axis_name: the mesh axis (a name, or a tuple of names, in the order in
        which they split the slots) along which the cache is sharded.
      kv_starts: (B,) int, the global first valid slot of each sequence (default
        0), replicated along the axis.

    Returns:
      :class:`AttentionOutput` like :func:`fnattn.decode`'s, on every device of
      the axis (replicated along it).

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from fnattn import AttentionSpec, masks
    >>> from fnattn.context.decode import decode
    >>> mesh = Mesh(jax.devices()[:1], ("seq",))
    >>> k = v = jax.random.normal(jax.random.key(0), (2, 64, 2, 16))   # cache of 64 slots
    >>> q = jax.random.normal(jax.random.key(1), (2, 1, 8, 16))        # one new token
    >>> spec = AttentionSpec(mask=masks.causal())
    >>> def on_device(q, k, v, lengths):
    ...     return decode(spec, q, k, v, kv_lengths=lengths, axis_name="seq")
    >>> cache = P(None, "seq")                                         # slots split
    >>> f = jax.shard_map(on_device, mesh=mesh, in_specs=(P(), cache, cache, P()),
    ...                   out_specs=P())
    >>> res = jax.jit(f)(q, k, v, jnp.array([40, 9]))
    >>> want = fnattn.decode(spec, q, k, v, kv_lengths=jnp.array([40, 9]))
    >>> bool(jnp.allclose(res.out, want.out, atol=1e-5)), bool(jnp.allclose(res.lse, want.lse))
    (True, True)
    """
    fn = "context.decode"
    band = _band(spec.mask)
    if band is None:
        raise NotImplementedError(
            f"{fn}: the mask {spec.mask!r} is not supported: with the cache split across "
            "devices, each device's decode sees its own slots, and only masks under which "
            "each query sees one band of positions around its own can be split exactly. "
            f"Supported: {_SUPPORTED}. For other masks, gather the keys the mask can see "
            "(a chunk is short) and call fnattn.decode on one device, or attend each "
            "device's slots with fnattn.attention and masks.at_positions (global positions) "
            "and combine the parts with fnattn.merging.merge_across.")
    from fnattn.decoding.api import _logical   # (a quantized cache: checked as what it holds)
    dims = _checks.check_qkv(q, _logical(fn, "k_cache", k_cache, q),
                             _logical(fn, "v_cache", v_cache, q), spec.layout, fn=fn)
    B, Tq, S, Hq = dims.batch, dims.q_len, dims.kv_len, dims.num_q_heads
    term = spec.position_bias
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    total = lax.axis_size(names) * S            # the global cache length
    if term is not None:
        position_bias.check_serving(fn, term, (B, Hq, Tq, total), per_batch=True,
                                    what="fnattn.context.decode")
        if total >= _EXACT_POSITIONS:
            raise ValueError(f"{fn}: a position term over a cache of {total} slots: the "
                             "shards carry their position offsets as float32, exact below "
                             f"{_EXACT_POSITIONS} slots")
    for name, x in (("kv_lengths", kv_lengths), ("kv_starts", kv_starts)):
        if x is not None and (not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != (B,)):
            raise ValueError(f"{fn}: {name} must be an integer array of shape (B,)=({B},), "
                             f"global and replicated along {axis_name!r}; got {x.dtype} "
                             f"{tuple(x.shape)}")
    if spec.sinks is not None:
        _checks.check_float(f"{fn}: sinks", spec.sinks)
        if tuple(spec.sinks.shape) != (Hq,):
            raise ValueError(f"{fn}: sinks must have shape (Hq,)=({Hq},), one logit per "
                             f"query head; got {tuple(spec.sinks.shape)}")
    base = lax.axis_index(names) * S            # this device's first global slot
    # The clipping of fnattn.decode, on the global cache.
    starts = jnp.zeros((B,), I32) if kv_starts is None else kv_starts.astype(I32)
    starts = jnp.clip(starts, 0, total)
    lengths = jnp.clip(kv_lengths.astype(I32), 0, total - starts)
    left, right = band
    p0, p1 = lengths - Tq, lengths - 1           # positions of the first and last query

    # Positions [lo, hi) seen by every query: [p1 - left, p0 + right] within [0, L).
    lo = jnp.zeros_like(lengths) if left is None else jnp.maximum(p1 - left, 0)
    hi = lengths if right is None else jnp.clip(p0 + right + 1, lo, lengths)
    a = jnp.clip(starts + lo - base, 0, S)
    e = jnp.clip(starts + hi - base, 0, S)
    # The local decode places its keys at j (slot a + j) and its queries at
    # e - a - Tq + t: a position term is evaluated at the global positions.
    shifted = None if term is None else _at_global_positions(
        term, B, Hq, q_shift=lengths - e + a, k_shift=base + a - starts)
    local = spec.replace(mask=None, sinks=None, return_lse=True, position_bias=shifted)
    part = local_decode(local, q, k_cache, v_cache, kv_lengths=e - a, kv_starts=a)
    parts = [(part.out.astype(F32), part.lse)]

    # The keys some queries see and others do not: below lo (a window's far edge,
    # Tq - 1 positions from p0 - left) and from hi on (the newest tokens, among
    # p0 + 1 .. p1). Both ranges hold at most Tq - 1 positions.
    steps = jnp.arange(Tq - 1, dtype=I32)[None]
    ranges = []
    if left is not None and Tq > 1:
        pos = (p0 - left)[:, None] + steps
        ranges.append((pos, (pos >= 0) & (pos < lengths[:, None])))
    if right is not None and right < Tq - 1:
        pos = (p0 + 1)[:, None] + steps
        ranges.append((pos, (pos >= hi[:, None]) & (pos < lengths[:, None])))
    if ranges:
        pos = jnp.concatenate([p for p, _ in ranges], axis=1)          # (B, F)
        slot = starts[:, None] + pos - base
        mine = jnp.concatenate([ok for _, ok in ranges], axis=1) & (slot >= 0) & (slot < S)
        idx = jnp.clip(slot, 0, S - 1)
        # Slots not ours (or outside the sequence) may hold anything: zeroed.
        keep = mine[:, :, None, None] if spec.layout == "bthd" else mine[:, None, :, None]
        keys = [jnp.where(keep, _gather_slots(x, idx, spec.layout), 0).astype(q.dtype)
                for x in (k_cache, v_cache)]
        t = jnp.arange(Tq, dtype=I32)[None, :, None]
        seen = mine[:, None, :]
        if spec.mask is not None:
            at = masks.Positions(b=jnp.arange(B, dtype=I32)[:, None, None], h=jnp.int32(0),
                                 q=t, q_pos=p0[:, None, None] + t, k=pos[:, None, :])
            seen = seen & spec.mask.predicate(at, [])
        edge_mask = masks.from_array(seen[:, None])
        if term is not None:   # (evaluated at the queries' and the gathered keys' positions)
            edge_mask = masks.at_positions(position_bias.attach(edge_mask, term),
                                           p0[:, None] + jnp.arange(Tq, dtype=I32), pos)
        dense = spec.replace(mask=edge_mask, sinks=None, position_bias=None,
                             return_lse=True, impl="xla", block_sizes=None)
        edge = attention(dense, q, *keys)
        parts.append((edge.out.astype(F32), edge.lse))
    if len(parts) > 1:
        merged = merge(parts, layout=spec.layout)
        parts = [(merged.out, merged.lse)]
    out, lse = parts[0]
    res = merge_across(out, lse, names, layout=spec.layout, sinks=spec.sinks)
    return AttentionOutput(res.out.astype(q.dtype), res.lse if spec.return_lse else None)
