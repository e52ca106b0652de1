"""``fnattn.context.attention``: one sequence split over the devices of a mesh axis."""

from beartype import beartype
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks
from fnattn.context import gather, ring
from fnattn.context.common import prepare
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["attention"]


@_checks.entry_point("fnattn.context.attention")
@jaxtyped(typechecker=beartype)
def attention(spec: AttentionSpec, q: Shaped[Array, "..."], k: Shaped[Array, "..."],
              v: Shaped[Array, "..."], *, axis_name, strategy: str = "ring",
              layout: str = "contiguous") -> AttentionOutput:
    """Context-parallel attention, called inside ``jax.shard_map``.

    The sequence is split over the mesh axis ``axis_name`` (a name, or a tuple
    of names): each device holds ``L`` of the ``N * L`` tokens of q, k and v, as
    ``shard_map`` cuts them after :func:`fnattn.context.reorder` with the same
    ``layout``. The result is this device's rows of ``fnattn.attention`` on the
    whole sequence: out, lse and every gradient, for every mask, soft-cap,
    bias, sinks, dropout (bit for bit the unsharded mask) and GQA.

    What the spec's arrays hold on each device:

    * segment ids: this device's tokens, sharded like q and k;
    * lengths, prefix lengths: global (replicated), compared with global positions;
    * a bias or ``from_array`` mask: this device's query rows against all
      ``N * L`` keys, in the layout's key order (shard its query axis only);
    * sinks, dropout key: replicated (the sink joins once; its gradient, like a
      replicated bias's, is summed over the axis).

    ``jax.vmap(..., axis_name=...)`` over stacked shards emulates the axis on
    one device, forward and every derivative (what the tests do).

    Args:
      spec: the :class:`fnattn.AttentionSpec`; ``impl`` "auto" (the platform's
        flash kernel per step), "xla" or "pallas".
      q: this device's queries, (B, L, Hq, D) in "bthd" or (B, Hq, L, D).
      k: this device's keys, (B, L, Hkv, D).
      v: this device's values, (B, L, Hkv, Dv).
      axis_name: the mesh axis that splits the sequence.
      strategy: "ring" (K/V travel around the axis, overlapped with compute; memory
        O(L) per device) or "all_gather" (gather K/V once; best when K/V are small).
      layout: "contiguous", "zigzag" or "striped" (see :mod:`fnattn.context.layouts`).

    Returns:
      :class:`fnattn.AttentionOutput` of this device's rows.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:1], ("seq",))
    >>> spec = fnattn.AttentionSpec(mask=fnattn.masks.causal())
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> f = jax.jit(jax.shard_map(
    ...     lambda q, k, v: fnattn.context.attention(spec, q, k, v, axis_name="seq").out,
    ...     mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq")))
    >>> bool(jnp.allclose(f(q, k, v), fnattn.attention(spec, q, k, v).out, atol=1e-5))
    True
    """
    fn = "context.attention"
    P, qb, kb, vb, bias4, ops, key, base = prepare(spec, q, k, v, axis_name=axis_name,
                                                   strategy=strategy, layout=layout, fn=fn)
    impl = ring if strategy == "ring" else gather
    out, lse = impl.attention(P, qb, kb, vb, bias4, spec.sinks, ops, key, base)
    return AttentionOutput(_checks.from_bthd(out, spec.layout),
                           lse if spec.return_lse else None)
