"""``fnattn.merge``: exact combination of partial attention results.

Attention over the keys ``K = K_1 ∪ … ∪ K_n`` (disjoint parts) is a weighted
average of the attention over each part::

    lse   = log(sum_i exp(lse_i))                       (+ exp(sink) if given)
    out   = sum_i exp(lse_i - lse) * out_i

This is the building block of split-K decode, cascade (shared-prefix) decoding
and ring attention. A part in which a query row sees no key has ``out_i = 0``
and ``lse_i = -inf`` (what every fnattn variant returns for such rows) and
contributes nothing, whatever its ``out_i`` holds (NaN included); a row that no
part sees gives ``out = 0`` and ``lse = -inf`` (or ``lse = sinks[h]`` with a
sink), with no NaN in the result or in any gradient. A sink of -inf is no
sink; a sink of +inf takes all the mass (``out = 0``, ``lse = +inf``).

**Sinks** join the denominator once: compute the parts *without* sinks and pass
``sinks=`` here (see :mod:`fnattn.spec`).

**Across devices.** :func:`merge_across` is the same merge when each device
along a mesh axis holds one part (inside ``jax.shard_map``): one ``pmax`` of the
lse and one ``psum`` of the rescaled outputs and denominators, never a gather
of every part.
"""

from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from beartype import beartype
from jax import lax
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks
from fnattn.spec import AttentionOutput

__all__ = ["MERGE_LAYOUTS", "merge", "merge_across", "merge_stacked", "shifted_exp"]

# How out's axes relate to lse's (lse's axes are listed as positions in out).
# "bthd": out (B, T, H, Dv), lse (B, H, T)    -- fnattn.attention, flash, decode
# "bhtd": out (B, H, T, Dv), lse (B, H, T)
# "thd":  out (T, H, Dv),    lse (H, T)       -- ragged_paged_attention
MERGE_LAYOUTS = {"bthd": (0, 2, 1), "bhtd": (0, 1, 2), "thd": (1, 0)}

def _lse_in_out_order(lse, layout):
    """lse permuted to out's axis order (without Dv)."""
    perm = MERGE_LAYOUTS[layout]
    inv = [perm.index(i) for i in range(len(perm))]
    return jnp.transpose(lse, inv)


def _lse_from_out_order(x, layout):
    return jnp.transpose(x, MERGE_LAYOUTS[layout])


def _check_pair(prefix, out, lse, layout):
    """Validates one partial result; ``prefix`` names it ("merge: parts[2]",
    "merge_across: "), the messages add ".out" / "out"."""
    sep = "" if prefix.endswith(" ") else "."
    _checks.check_float(f"{prefix}{sep}out", out)
    _checks.check_float(f"{prefix}{sep}lse", lse)
    rank = len(MERGE_LAYOUTS[layout]) + 1
    if out.ndim != rank:
        raise ValueError(f"{prefix}{sep}out must have {rank} axes for layout {layout!r}; got "
                         f"shape {tuple(out.shape)}")
    want = tuple(_lse_from_out_order(jnp.zeros(out.shape[:-1], jnp.int8), layout).shape)
    if tuple(lse.shape) != want:
        raise ValueError(f"{prefix}{sep}lse must have shape {want} to go with out "
                         f"{tuple(out.shape)} in layout {layout!r}; got {tuple(lse.shape)}")


def _sink_in_out_order(sinks, lse_shape_out_order, layout):
    """sinks (H,) broadcast to lse's shape in out's axis order."""
    h_axis = {"bthd": 2, "bhtd": 1, "thd": 1}[layout]
    shape = [1] * len(lse_shape_out_order)
    shape[h_axis] = sinks.shape[0]
    return jnp.broadcast_to(sinks.astype(jnp.float32).reshape(shape), lse_shape_out_order)


@jax.custom_jvp
def shifted_exp(x, m):
    """``exp(x - m)`` for a shift ``m`` (typically a running or joint maximum, which
    carries no gradient), with ``x == m`` giving 1 even where both are infinite.

    Its derivative with respect to ``x`` is its value (as for ``exp``), so a logit
    of +inf that takes all the mass (``x = m = +inf``: value 1) gets the gradient
    of a probability of 1, not 0 or NaN; ``x = -inf`` gives 0 and gradient 0.
    """
    return jnp.where(x == m, 1.0, jnp.exp(x - m))


@shifted_exp.defjvp
def _shifted_exp_jvp(primals, tangents):
    x, m = primals
    tx, tm = tangents
    y = shifted_exp(x, m)
    return y, y * (tx - tm)


def merge_stacked(outs, lses, sink=None):
    """Merges stacked parts: ``outs`` (P, ..., Dv), ``lses`` (P, ...) float32 in the
    same axis order; ``sink`` broadcastable to ``lses[0]``. Returns (out f32, lse).

    Gradient-safe for parts and rows with ``lse = -inf``: such a part contributes
    nothing, whatever its ``out`` holds (NaN included), to the result or to any
    gradient. Infinite sinks are defined as in :func:`fnattn._online.join_sink`: a
    sink of -inf is no sink; a sink of +inf takes all the mass (out 0, lse +inf,
    and d(sink) = d(lse)). A part whose lse is NaN makes its rows NaN.
    """
    lses = lses.astype(jnp.float32)
    m = jnp.max(lses, axis=0)
    if sink is not None:
        sink = jnp.asarray(sink, jnp.float32)
        m = jnp.maximum(m, sink)
    # Rows that saw nothing (m = -inf) shift by 0, so that every weight is exp(-inf) = 0.
    m = jax.lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    w = shifted_exp(lses, m)                 # exp(-inf) = 0: empty parts drop out
    denom = jnp.sum(w, axis=0)
    if sink is not None:
        denom = denom + shifted_exp(sink, m)
    empty = denom == 0                       # (NaN stays NaN)
    safe = jnp.where(empty, 1.0, denom)
    weights = w / safe
    # A part of weight 0 (lse = -inf, or below an infinite sink) contributes nothing
    # even where its out holds NaN: 0 * NaN would be NaN.
    outs = jnp.where(w[..., None] > 0, outs.astype(jnp.float32), 0.0)
    out = jnp.sum(weights[..., None] * outs, axis=0)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(safe))
    return out, lse


@jaxtyped(typechecker=beartype)
def merge(parts: Sequence, *, layout: str = "bthd",
          sinks: Optional[Shaped[Array, "_"]] = None) -> AttentionOutput:
    """Combines partial results over disjoint key sets into the exact result.

    Args:
      parts: a non-empty sequence of :class:`AttentionOutput` (with ``lse``) or
        ``(out, lse)`` pairs, all of the same shapes. Each part is attention of
        the same queries over its own, disjoint, set of keys.
      layout: how ``out`` and ``lse`` are laid out: "bthd" (out (B, T, H, Dv),
        lse (B, H, T): :func:`fnattn.attention`, :func:`fnattn.decode`,
        :func:`fnattn.paged_attention`), "bhtd" (out (B, H, T, Dv)) or "thd"
        (out (T, H, Dv), lse (H, T): :func:`fnattn.ragged_paged_attention`).
      sinks: optional (H,) logits that join the denominator once; the parts must
        have been computed without sinks.

    Returns:
      :class:`AttentionOutput` with ``out`` in the first part's dtype and ``lse``
      float32.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec
    >>> q = jax.random.normal(jax.random.key(0), (1, 3, 2, 8))
    >>> k = v = jax.random.normal(jax.random.key(1), (1, 10, 2, 8))
    >>> spec = AttentionSpec()
    >>> a = fnattn.attention(spec, q, k[:, :4], v[:, :4])
    >>> b = fnattn.attention(spec, q, k[:, 4:], v[:, 4:])
    >>> both = fnattn.merge([a, b])
    >>> full = fnattn.attention(spec, q, k, v)
    >>> bool(jnp.allclose(both.out, full.out, atol=1e-5)), bool(jnp.allclose(both.lse, full.lse))
    (True, True)
    """
    if layout not in MERGE_LAYOUTS:
        raise ValueError(f"merge: layout must be one of {tuple(MERGE_LAYOUTS)}; got {layout!r}")
    if len(parts) == 0:
        raise ValueError("merge: parts must hold at least one (out, lse) part; got none")
    outs, lses = [], []
    for i, part in enumerate(parts):
        if isinstance(part, AttentionOutput):
            out, lse = part.out, part.lse
        elif isinstance(part, tuple) and len(part) == 2:
            out, lse = part
        else:
            raise TypeError(f"merge: parts[{i}] must be an AttentionOutput or an (out, lse) "
                            f"pair; got {type(part).__name__}")
        if lse is None:
            raise ValueError(f"merge: parts[{i}] has no lse; compute it with "
                             "AttentionSpec(return_lse=True)")
        _check_pair(f"merge: parts[{i}]", out, lse, layout)
        if i and (out.shape != outs[0].shape or out.dtype != outs[0].dtype):
            raise ValueError(f"merge: parts[{i}].out has shape {tuple(out.shape)} and dtype "
                             f"{out.dtype}; parts[0].out has {tuple(outs[0].shape)} and "
                             f"{outs[0].dtype}")
        outs.append(out)
        lses.append(_lse_in_out_order(lse, layout))
    sink = None
    if sinks is not None:
        _checks.check_float("merge: sinks", sinks)
        h = {"bthd": 2, "bhtd": 1, "thd": 1}[layout]
        if sinks.shape[0] != outs[0].shape[h]:
            raise ValueError(f"merge: sinks must have shape (H,)=({outs[0].shape[h]},), one "
                             f"logit per head of out {tuple(outs[0].shape)}; got "
                             f"{tuple(sinks.shape)}")
        sink = _sink_in_out_order(sinks, outs[0].shape[:-1], layout)
    out, lse = merge_stacked(jnp.stack(outs), jnp.stack(lses), sink)
    return AttentionOutput(out.astype(outs[0].dtype), _lse_from_out_order(lse, layout))


def _axis_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


@jaxtyped(typechecker=beartype)
def merge_across(out: Shaped[Array, "..."], lse: Shaped[Array, "..."], axis_name, *,
                 layout: str = "bthd",
                 sinks: Optional[Shaped[Array, "_"]] = None) -> AttentionOutput:
    """:func:`merge` of the parts held by the devices along a mesh axis.

    Called inside ``jax.shard_map`` (or ``jax.vmap`` with an ``axis_name``):
    each device along ``axis_name`` holds one part, ``(out, lse)``, attention of
    the same queries over its own disjoint set of keys (its shard of a KV cache,
    one step of a ring). Every device gets the exact merged result, the same on
    each (replicated along the axis). The guarantees of :func:`merge` hold: a
    device whose row saw nothing (``lse = -inf``, whatever its ``out`` holds,
    NaN included) contributes nothing; a row no device saw gives ``out = 0``
    and ``lse = -inf`` (``sinks[h]`` with a sink); infinite sinks as in
    :func:`merge`; no NaN in the result or any gradient.

    It moves one ``pmax`` of the lse and one ``psum`` of the rescaled outputs
    (float32) and denominators, never the parts themselves. Differentiable: the
    shift by the maximum carries no gradient (the result does not depend on
    it), the rest is ``psum``'s exact transpose. Use ``shard_map``'s default
    ``check_vma=True``, under which the gradient of a replicated input (the
    sinks) is summed over the devices that share it.

    Args:
      out: this device's part, laid out as ``layout`` says (see :func:`merge`).
      lse: this device's log-sum-exp of the part, float, shaped as in :func:`merge`.
      axis_name: the mesh axis (a name, or a tuple of names) along which the
        devices hold the parts.
      layout: "bthd", "bhtd" or "thd", as in :func:`merge`.
      sinks: optional (H,) logits, replicated along ``axis_name``, that join the
        denominator once; the parts must have been computed without sinks.

    Returns:
      :class:`AttentionOutput` with ``out`` in ``out``'s dtype (accumulated in
      float32) and ``lse`` float32, equal on every device along the axis.

    Under ``vmap`` the mapped axis plays the mesh axis: the merge of stacked parts.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec
    >>> from fnattn.merging import merge_across
    >>> q = jax.random.normal(jax.random.key(0), (1, 3, 2, 8))
    >>> k = v = jax.random.normal(jax.random.key(1), (1, 12, 2, 8))
    >>> spec = AttentionSpec()
    >>> parts = [fnattn.attention(spec, q, k[:, i:i + 4], v[:, i:i + 4]) for i in (0, 4, 8)]
    >>> outs = jnp.stack([p.out for p in parts])
    >>> lses = jnp.stack([p.lse for p in parts])
    >>> res = jax.vmap(lambda o, l: merge_across(o, l, "parts"), axis_name="parts")(outs, lses)
    >>> full = fnattn.attention(spec, q, k, v)
    >>> bool(jnp.allclose(res.out[2], full.out, atol=1e-5))    # every part holds the result
    True
    >>> bool(jnp.allclose(res.lse[0], full.lse))
    True

    Inside ``shard_map``, with the keys split along the mesh axis "seq" (one device here):

    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:1], ("seq",))
    >>> def on_device(q, k, v):
    ...     part = fnattn.attention(spec, q, k, v)   # this device's keys
    ...     return merge_across(part.out, part.lse, "seq")
    >>> kv = P(None, "seq")
    >>> f = jax.shard_map(on_device, mesh=mesh, in_specs=(P(), kv, kv), out_specs=P())
    >>> bool(jnp.allclose(jax.jit(f)(q, k, v).out, full.out, atol=1e-5))
    True
    """
    fn = "merge_across"
    if layout not in MERGE_LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {tuple(MERGE_LAYOUTS)}; got {layout!r}")
    _check_pair(f"{fn}: ", out, lse, layout)
    names = _axis_names(axis_name)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{fn}: axis_name must be a mesh axis name or a non-empty tuple of "
                        f"them; got {axis_name!r}")
    sink = None
    if sinks is not None:
        _checks.check_float(f"{fn}: sinks", sinks)
        h = {"bthd": 2, "bhtd": 1, "thd": 1}[layout]
        if sinks.shape[0] != out.shape[h]:
            raise ValueError(f"{fn}: sinks must have shape (H,)=({out.shape[h]},), one logit "
                             f"per head of out {tuple(out.shape)}; got {tuple(sinks.shape)}")
        sink = _sink_in_out_order(sinks, out.shape[:-1], layout)
    merged, merged_lse = _merge_across(out, _lse_in_out_order(lse, layout), names, sink)
    return AttentionOutput(merged.astype(out.dtype), _lse_from_out_order(merged_lse, layout))


def _merge_across(out, lse, axis_name, sink):
    """out (..., Dv), lse (...) in the same order, sink broadcast like lse or None ->
    (out float32, lse float32), merged over ``axis_name``; as :func:`merge_stacked`."""
    lse = lse.astype(jnp.float32)
    # The maximum is only a shift (the result does not depend on it): no gradient
    # flows through it, which is exact, and pmax needs none.
    m = lax.pmax(lax.stop_gradient(lse), axis_name)
    if sink is not None:
        m = jnp.maximum(m, lax.stop_gradient(sink))
    m = jnp.where(m == -jnp.inf, 0.0, m)     # nothing seen anywhere: every weight 0
    w = shifted_exp(lse, m)
    # A part of weight 0 contributes nothing even where its out is NaN (0 * NaN is
    # NaN, and so would be the gradient of w through the product).
    part = jnp.where(w[..., None] > 0, out.astype(jnp.float32), 0.0)
    # The denominators ride along as one more feature: a single all-reduce.
    both = lax.psum(jnp.concatenate([w[..., None] * part, w[..., None]], axis=-1), axis_name)
    num, denom = both[..., :-1], both[..., -1]
    if sink is not None:
        denom = denom + shifted_exp(sink, m)
    empty = denom == 0                       # (NaN stays NaN)
    safe = jnp.where(empty, 1.0, denom)
    return num / safe[..., None], jnp.where(empty, -jnp.inf, m + jnp.log(safe))
