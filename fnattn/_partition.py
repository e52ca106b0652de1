"""Batch and head partitioning of one dispatch under plain ``jax.jit``.

A lowering is a loop (the XLA flash lowering) or a kernel (Pallas Triton or
Mosaic) that the compiler's partitioner cannot see into: given inputs sharded
along the batch and the heads it would gather them first. But attention is
independent per batch row and per kv-head group, so each device can run the
same lowering on its own rows and heads. :func:`partitioned` says so with
``jax.experimental.custom_partitioning``: every operand states which of its
axes is the batch (``"b"``), the query heads (``"h"``) or the kv heads
(``"k"``); the partitioner then calls back with the shardings it chose, and
the callback picks the mesh axes that split the batch and the heads
(:func:`choose`), asks for every other axis whole, and traces the lowering on
one device's shapes, with its static configuration recomputed for them. The
platform choice (``lax.platform_dependent``) stays inside, so on a GPU each
device runs the Triton kernel on its shard.

What is split, and what is not:

* the batch along the mesh axes that split q's batch axis (or the first
  operand's that is split), if their size divides the batch;
* the heads along the mesh axes that split q's head axis (or k's), if their
  size divides the number of **kv** heads: device ``i`` then holds query heads
  ``[i Hq/n, (i+1) Hq/n)`` and exactly the kv heads they read (GQA groups stay
  whole). MQA (one kv head), or a split that cuts a group, keeps the heads
  whole;
* never the sequence or the head dim: operands split along them are gathered
  first (a collective, and the right answer);
* a ``from_fn`` mask whose predicate reads the batch or head index keeps that
  axis whole (the predicate would see local indices); so does every axis of a
  mask kind this module does not know.

Dropout stays bit-identical: each shard folds its first batch row and query
head into the seed (``lax.axis_index`` of the splitting axes), exactly as
``AttentionSpec(dropout_offsets=...)`` does. Gradients of operands that are
broadcast along a split axis (``sinks`` along the batch, a bias with a size-1
batch or head axis) are summed over that axis: the one collective this adds,
and only when that gradient is used.

Shardy (the default partitioner) reads the rule of :func:`sharding_rule`; the
older GSPMD propagation reads the same decision through
``infer_sharding_from_operands``. Arrays whose *types* carry their sharding
(a mesh of ``AxisType.Explicit`` axes) are split at trace time instead, by
``jax.shard_map`` with the same choice; under a context mesh of Explicit
axes (``jax.set_mesh(jax.make_mesh(...))``) whose types split none of the
arrays, that ``shard_map`` runs the whole call on every device, and on one
device the call runs under Auto axes (``jax.sharding.auto_axes``). Where it
does nothing:

* in a process with one device, outside an Explicit mesh (the call is traced
  as it is);
* inside ``jax.shard_map`` (the values are already per device);
* under ``jax.vmap``, which runs the lowering unpartitioned
  (``jax.custom_batching.custom_vmap``): correct, and gathered;
* in derivatives of the partitioned call itself (second-order gradients
  through a backward), which are those of the unpartitioned call.
"""

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import (
    ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fnattn._varying import inside_shard_map

__all__ = ["Sizes", "Shard", "Out", "choose", "partition_specs", "sharding_rule",
           "partitioned", "mask_roles", "bias_roles", "fold_seed", "flash", "decode", "paged"]

Roles = tuple  # one entry per axis: "b" (batch), "h" (query heads), "k" (kv heads) or None


class Sizes(NamedTuple):
    """The whole problem's batch, query heads and kv heads."""

    batch: int
    q_heads: int
    kv_heads: int


class Shard(NamedTuple):
    """What one device computes: its sizes (static ints) and the global index of
    its first batch row and first query head (int32 scalars, or 0)."""

    batch: int
    q_heads: int
    kv_heads: int
    batch_offset: Any = 0
    head_offset: Any = 0


class Out(NamedTuple):
    """An output's roles, and the roles (``"b"``, ``"h"``) over whose split its
    per-device values are partial sums (the gradient of a broadcast operand)."""

    roles: Roles
    summed: str = ""


def _names(entry) -> tuple:
    if entry is None or not isinstance(entry, (str, tuple, list)):
        return ()  # None or PartitionSpec.UNCONSTRAINED
    return (entry,) if isinstance(entry, str) else tuple(entry)


def choose(roles: Sequence[Roles], specs: Sequence[Any], sizes: Sizes,
           mesh_shape: dict, allow: str = "bh") -> tuple:
    """``(batch_axes, head_axes)``: the mesh axes that split the batch and the heads.

    ``roles[i]`` names the axes of operand ``i`` and ``specs[i]`` is its
    ``PartitionSpec`` (or None). The first operand whose batch (heads) axis is
    split decides; of its mesh axes the longest leading run whose size divides
    the batch (the kv heads) is kept, if ``allow`` holds ``"b"`` (``"h"``) and
    the heads reuse no axis of the batch.

    >>> choose([("b", None, "h", None)], [P("data", None, "model")], Sizes(4, 8, 2),
    ...        {"data": 2, "model": 2})
    (('data',), ('model',))
    >>> choose([("b", None, "h", None)], [P("data", None, "model")], Sizes(4, 8, 1),
    ...        {"data": 2, "model": 2})  # MQA: the heads stay whole
    (('data',), ())
    >>> choose([("b", None, "h", None)], [P(("data", "fsdp"))], Sizes(2, 8, 1),
    ...        {"data": 2, "fsdp": 2})  # a batch of 2 splits 2 ways, not 4
    (('data',), ())
    >>> b, = jax.export.symbolic_shape("b")
    >>> choose([("b", None, "h", None)], [P("data", None, "model")], Sizes(b, 8, 2),
    ...        {"data": 2, "model": 2})  # a symbolic batch (jax.export) stays whole
    ((), ('model',))
    """
    batch, heads = None, None
    for r, spec in zip(roles, specs):
        if spec is None:
            continue
        entries = tuple(spec) + (None,) * (len(r) - len(tuple(spec)))
        for role, entry in zip(r, entries):
            axes = _names(entry)
            if not axes:
                continue
            if role == "b" and batch is None:
                batch = axes
            elif role in ("h", "k") and heads is None:
                heads = axes

    def dividing(axes, n):  # the longest leading run of axes whose size divides n
        if jax.export.is_symbolic_dim(n):
            return ()  # a symbolic size (jax.export) may not divide: keep it whole
        while axes and n % math.prod(mesh_shape[a] for a in axes):
            axes = axes[:-1]
        return axes

    batch = dividing(batch or (), sizes.batch) if "b" in allow else ()
    heads = dividing(heads or (), sizes.kv_heads) if "h" in allow else ()
    if set(heads) & set(batch):
        heads = ()
    return batch, heads


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def partition_specs(roles: Sequence[Roles], batch: tuple, heads: tuple) -> list:
    """The ``PartitionSpec`` of each operand for a choice of :func:`choose`.

    >>> [tuple(s) for s in partition_specs([("b", None, "k"), (None, "h")], ("data",),
    ...                                     ("x", "y"))]
    [('data', None, ('x', 'y')), (None, ('x', 'y'))]
    """
    pick = {"b": _entry(batch), "h": _entry(heads), "k": _entry(heads)}
    return [P(*(pick.get(role) for role in r)) for r in roles]


def sharding_rule(in_roles: Sequence[Roles], out_roles: Sequence[Roles],
                  sizes: Sizes) -> SdyShardingRule:
    """The Shardy rule: one factor for the batch, one for the kv heads (query heads
    are the compound ``(kv heads, group)``), and one factor per other axis, which
    must be replicated.

    >>> rule = sharding_rule([("b", None, "h", None), ("b", None, "k", None)], [("b", "h")],
    ...                      Sizes(2, 4, 2))
    >>> rule.operand_mappings, rule.result_mappings
    ((('b', 'x0', ('k', 'g'), 'x1'), ('b', 'x2', 'k', 'x3')), (('b', ('k', 'g')),))
    >>> rule.need_replication_factors, rule.factor_sizes
    (('x0', 'x1', 'x2', 'x3'), {'g': 2})
    """
    group = sizes.q_heads // sizes.kv_heads
    fresh = []

    def mapping(r):
        dims = []
        for role in r:
            if role == "b":
                dims.append("b")
            elif role in ("h", "k") and sizes.kv_heads == 1:
                # one kv head: the heads are never split (and a compound factor
                # may not hold a factor of size 1)
                fresh.append(f"x{len(fresh)}")
                dims.append(fresh[-1])
            elif role == "k" or (role == "h" and group == 1):
                dims.append("k")
            elif role == "h":
                dims.append(CompoundFactor("k", "g"))
            else:
                fresh.append(f"x{len(fresh)}")
                dims.append(fresh[-1])
        return ArrayMapping(*dims)

    ins = tuple(mapping(r) for r in in_roles)
    outs = tuple(mapping(r) for r in out_roles)
    whole = {d for m in ins + outs for d in m if isinstance(d, str)}
    compound = any(not isinstance(d, str) for m in ins + outs for d in m)
    factor_sizes = {}
    if compound:
        factor_sizes["g"] = group
        if "k" not in whole:
            factor_sizes["k"] = sizes.kv_heads
    return SdyShardingRule(ins, outs, need_replication_factors=tuple(fresh), **factor_sizes)


def _explicit_mesh(arrays):
    """The mesh of the arrays' types if some type is split along a mesh axis
    (explicit sharding), else None."""
    for a in arrays:
        sharding = getattr(jax.typeof(a), "sharding", None)
        if isinstance(sharding, NamedSharding) and any(_names(e) for e in sharding.spec):
            return sharding.mesh
    return None


def _explicit_context() -> bool:
    """Whether the context mesh (``jax.set_mesh``) has Explicit axes, as
    ``jax.make_mesh`` gives by default."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    return (not mesh.empty and explicit is not None
            and any(t == explicit for t in getattr(mesh, "axis_types", ())))


def _full(sizes: Sizes) -> Shard:
    return Shard(sizes.batch, sizes.q_heads, sizes.kv_heads)


def _is_pytree_operand(a) -> bool:
    from fnattn import quant
    return quant.is_quantized(a)


def _partition_leaves(body, args, in_roles, outs, sizes, allow):
    """:func:`partitioned` with pytree operands (a quantized pool: its codes and
    its scales) flattened into their arrays. A leaf takes the first ``ndim``
    roles of its operand: a per-token scale, whose axes are the codes' but the
    last, splits with them; a per-tensor scale is whole on every device."""
    flat, roles, defs = [], [], []
    for a, r in zip(args, in_roles):
        if _is_pytree_operand(a):
            leaves, treedef = jax.tree_util.tree_flatten(a)
            flat += leaves
            roles += [tuple(r)[:jnp.ndim(x)] for x in leaves]
            defs.append((treedef, len(leaves)))
        else:
            flat.append(a)
            roles.append(r)
            defs.append(None)

    def rebuild(flat_):
        it, rebuilt = iter(flat_), []
        for d in defs:
            if d is None:
                rebuilt.append(next(it))
            else:
                rebuilt.append(jax.tree_util.tree_unflatten(d[0], [next(it) for _ in range(d[1])]))
        return rebuilt

    # the outputs' structure (an update returns quantized pools): from one abstract trace
    shapes = jax.eval_shape(lambda *f: tuple(body(_full(sizes), *rebuild(f))), *flat)
    out_defs, flat_outs = [], []
    for r, o in zip(shapes, outs):
        if _is_pytree_operand(r):
            leaves, treedef = jax.tree_util.tree_flatten(r)
            flat_outs += [Out(tuple(o.roles)[:x.ndim], o.summed) for x in leaves]
            out_defs.append((treedef, len(leaves)))
        else:
            flat_outs.append(o)
            out_defs.append(None)

    def unflat(shard, *flat_):
        res = []
        for r in body(shard, *rebuild(flat_)):
            res += jax.tree_util.tree_leaves(r) if _is_pytree_operand(r) else [r]
        return tuple(res)

    res = iter(partitioned(unflat, flat, roles, flat_outs, sizes, allow))
    return tuple(next(res) if d is None else
                 jax.tree_util.tree_unflatten(d[0], [next(res) for _ in range(d[1])])
                 for d in out_defs)


def partitioned(body: Callable, args: Sequence[Any], in_roles: Sequence[Optional[Roles]],
                outs: Sequence[Optional[Out]], sizes: Sizes, allow: str = "bh"):
    """``body(shard, *args)``, split along the batch and the heads under ``jit``.

    Args:
      body: ``body(shard: Shard, *args) -> tuple`` of outputs; it must rebuild
        every static size from ``shard`` and fold its offsets where it hashes
        global indices (dropout).
      args: the operands; None entries are passed through as None.
      in_roles: the roles of each operand's axes (ignored for None operands).
      outs: an :class:`Out` per output of ``body``, None where that output is None.
      sizes: the whole problem's sizes.
      allow: which of batch ("b") and heads ("h") may be split.

    Returns:
      ``body``'s outputs (a tuple), equal to ``body(Shard(*sizes), *args)``.
    """
    if inside_shard_map():
        return tuple(body(_full(sizes), *args))  # per-device values already
    if any(_is_pytree_operand(a) for a in args):
        return _partition_leaves(body, args, in_roles, outs, sizes, allow)
    present = [i for i, a in enumerate(args) if a is not None]
    arrays = tuple(args[i] for i in present)
    roles = tuple(tuple(in_roles[i]) for i in present)
    out_specs = [o for o in outs if o is not None]

    def rebuild(arrays_):
        full = [None] * len(args)
        for i, a in zip(present, arrays_):
            full[i] = a
        return full

    def call(shard, *arrays_):
        res = tuple(body(shard, *rebuild(arrays_)))
        if len(res) != len(outs) or any((r is None) != (o is None) for r, o in zip(res, outs)):
            raise AssertionError(f"partitioned: body returned {len(res)} outputs, "
                                 f"{[r is None for r in res]} None; expected {outs}")
        return tuple(r for r in res if r is not None)

    def with_nones(res):
        """``call``'s outputs with None again where ``outs`` has None."""
        res = iter(res)
        return tuple(None if o is None else next(res) for o in outs)

    if jax.device_count() == 1:
        if _explicit_context() or _explicit_mesh(arrays) is not None:
            # Values typed with a mesh of Explicit axes (jax.make_mesh's
            # default): run as under Auto axes, where the Pallas interpreter's
            # state updates accept them.
            whole = tuple(P() for _ in out_specs)
            return with_nones(jax.sharding.auto_axes(
                functools.partial(call, _full(sizes)), out_sharding=whole)(*arrays))
        # Nothing to split (and custom_partitioning's inline lowering cannot
        # carry the ordered effects of Pallas's TPU interpreter).
        return tuple(body(_full(sizes), *args))

    def local(mesh, batch, heads, *arrays_):
        nb = math.prod(mesh.shape[a] for a in batch)
        nh = math.prod(mesh.shape[a] for a in heads)
        shard = Shard(sizes.batch // nb, sizes.q_heads // nh, sizes.kv_heads // nh)
        if batch:
            shard = shard._replace(batch_offset=lax.axis_index(batch) * shard.batch)
        if heads:
            shard = shard._replace(head_offset=lax.axis_index(heads) * shard.q_heads)
        res = call(shard, *arrays_)
        summed = []
        for x, o in zip(res, out_specs):
            axes = (batch if "b" in o.summed else ()) + (heads if "h" in o.summed else ())
            summed.append(lax.psum(x, axes) if axes else x)
        return tuple(summed)

    mesh = _explicit_mesh(arrays)
    if mesh is None and _explicit_context():
        # A context mesh of Explicit axes that splits none of the arrays: the
        # same shard_map, each device computing the whole call (jax 0.11's
        # custom_partitioning fails to lower under such a context).
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None:
        # Shardings in the types (explicit mesh axes): split right here.
        batch, heads = choose(roles, [jax.typeof(a).sharding.spec for a in arrays], sizes,
                              dict(mesh.shape), allow)
        in_specs = partition_specs(roles, batch, heads)
        arrays = [jax.sharding.reshard(a, NamedSharding(mesh, s))
                  for a, s in zip(arrays, in_specs)]
        return with_nones(jax.shard_map(
            functools.partial(local, mesh, batch, heads), mesh=mesh, in_specs=tuple(in_specs),
            out_specs=tuple(partition_specs([o.roles for o in out_specs], batch, heads)),
            check_vma=False)(*arrays))

    def decide(mesh, arg_shapes):
        """(mesh, batch axes, head axes) for the shardings the partitioner proposes."""
        if not isinstance(mesh, Mesh) or mesh.empty:
            # No mesh names the axes: compute on whole arrays, on every device.
            devices = sorted(arg_shapes[0].sharding.device_set, key=lambda d: d.id)
            return Mesh(np.array(devices), ("_fnattn_all",)), (), ()
        specs = [s.sharding.spec if isinstance(s.sharding, NamedSharding) else None
                 for s in arg_shapes]
        return (mesh, *choose(roles, specs, sizes, dict(mesh.shape), allow))

    def named(mesh, batch, heads, roles_):
        return tuple(NamedSharding(mesh, s) for s in partition_specs(roles_, batch, heads))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        mesh, batch, heads = decide(mesh, arg_shapes)
        return (mesh, functools.partial(local, mesh, batch, heads),
                named(mesh, batch, heads, [o.roles for o in out_specs]),
                named(mesh, batch, heads, roles))

    def infer(mesh, arg_shapes, result_shape):  # GSPMD propagation
        del result_shape
        mesh, batch, heads = decide(mesh, arg_shapes)
        return named(mesh, batch, heads, [o.roles for o in out_specs])

    # (inside jit, the constants the lowerings make stay inside its jaxpr:
    # custom_partitioning takes no closed-over constants)
    split = custom_partitioning(jax.jit(functools.partial(call, _full(sizes))))
    split.def_partition(partition, infer_sharding_from_operands=infer,
                        sharding_rule=sharding_rule(roles, [o.roles for o in out_specs], sizes))

    # custom_partitioning has no batching rule: under vmap, run unpartitioned.
    @custom_vmap
    def run(*arrays_):
        return split(*arrays_)

    @run.def_vmap
    def _(axis_size, in_batched, *arrays_):
        del axis_size
        axes = [0 if b else None for b in in_batched]
        res = jax.vmap(functools.partial(call, _full(sizes)), in_axes=axes)(*arrays_)
        return res, jax.tree_util.tree_map(lambda _: True, res)

    # Nor a differentiation rule: derivatives (of a backward, for second-order
    # gradients) are those of the unpartitioned call.
    @jax.custom_jvp
    def differentiable(*arrays_):
        return run(*arrays_)

    @differentiable.defjvp
    def _(primals, tangents):
        return jax.jvp(functools.partial(call, _full(sizes)), primals, tangents)

    return with_nones(differentiable(*arrays))


# ----------------------------------------------------------------------------------
# Roles of the spec's arrays
# ----------------------------------------------------------------------------------


def bias_roles(shape, sizes: Sizes) -> tuple:
    """``(roles, summed)`` of a bias broadcastable to (B, Hq, Tq, Tk): its batch and
    head axes where they are whole, and the splits its gradient is summed over.

    >>> bias_roles((1, 8, 5, 5), Sizes(4, 8, 2))
    ((None, 'h', None, None), 'b')
    """
    lead = 4 - len(shape)
    padded = (1,) * lead + tuple(shape)
    b = "b" if padded[0] == sizes.batch else None
    h = "h" if padded[1] == sizes.q_heads else None
    roles = (b, h, None, None)[lead:]
    summed = ("" if b else "b") + ("" if h else "h")
    return roles, summed


def _reads_batch_or_head(fn, n_values: int = 0) -> str:
    """Which of "b" and "h" a ``from_fn`` predicate (or position term, with
    ``n_values`` float values after the indices) reads (both if unknown)."""
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    try:
        jaxpr = jax.make_jaxpr(fn)(i32, i32, i32, i32, *[f32] * n_values).jaxpr
    except Exception:  # noqa: BLE001 - whatever it is, assume the worst
        return "bh"
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
    used |= {id(v) for v in jaxpr.outvars}
    return "".join(name for name, v in zip("bh", jaxpr.invars[:2]) if id(v) in used)


def _canonical_reads(m) -> str:
    """What the ``from_fn`` predicates and position terms inside a canonical
    mask read."""
    from fnattn import position_bias
    inner = m._inner()
    kinds = (_masks().FromFn, position_bias.FromFn)
    fns = [x for x in jax.tree_util.tree_leaves(inner, is_leaf=lambda x: isinstance(x, kinds))
           if isinstance(x, kinds)]
    return "".join(sorted({a for f in fns for a in _reads_batch_or_head(
        f.fn, len(getattr(f, "arrays", ())))}))


def _masks():
    from fnattn import masks
    return masks


def mask_roles(mask, sizes: Sizes) -> tuple:
    """``(roles of each leaf of the mask, allow)``: the batch and head axes of the
    mask's arrays, and which of "b" and "h" may be split (not the axes that a
    ``from_fn`` predicate reads, nor any for a mask kind unknown here).

    >>> from fnattn import masks
    >>> ids = jnp.zeros((4, 16), jnp.int32)
    >>> mask_roles(masks.causal() & masks.segments(ids), Sizes(4, 8, 2))
    ([('b', None), ('b', None)], 'bh')
    >>> mask_roles(masks.from_fn(lambda b, h, q, k: h < 2), Sizes(4, 8, 2))
    ([], 'b')
    """
    from fnattn import masks, position_bias

    roles, reads = [], set()

    def lead_roles(shape, names):  # names of the axes, e.g. "bq"
        out = []
        for name, n in zip(names, shape):
            out.append("b" if name == "b" and n == sizes.batch else
                       "h" if name == "h" and n == sizes.q_heads else None)
        return tuple(out)

    def walk(m):
        if m is None:
            return
        if isinstance(m, (masks.And, masks.Or)):
            walk(m.a)
            walk(m.b)
        elif isinstance(m, masks.Not):
            walk(m.a)
        elif isinstance(m, masks.FromFn):
            reads.update(_reads_batch_or_head(m.fn))
        elif isinstance(m, masks.Segments):
            roles.append(lead_roles(jnp.shape(m.q_segment_ids), "bq"))
            roles.append(lead_roles(jnp.shape(m.kv_segment_ids), "bk"))
        elif isinstance(m, masks.Lengths):
            for x in (m.q_lengths, m.kv_lengths):
                if x is not None:
                    roles.append(lead_roles(jnp.shape(x), "b"))
        elif isinstance(m, masks.PrefixLM):
            roles.append(lead_roles(jnp.shape(m.prefix_lengths), "b"))
        elif isinstance(m, masks.FromArray):
            shape = jnp.shape(m.mask)
            roles.append(lead_roles(shape, "bhqk"[4 - len(shape):]))
        elif isinstance(m, getattr(masks, "AtPositions", ())):
            walk(m.mask)
            for x in (m.q_positions, m.kv_positions):
                shape = jnp.shape(x)
                roles.append(lead_roles(shape, "bq"[2 - len(shape):]))
        elif isinstance(m, getattr(masks, "Canonical", ())):
            reads.update(_canonical_reads(m))
            roles.extend(lead_roles(jnp.shape(x), "bhqk") for x in m.ops)
        elif isinstance(m, (masks.Full, masks.Causal, masks.SlidingWindow, masks.Chunked)):
            pass
        elif isinstance(m, (masks.SlidingWindowArray, masks.ChunkedArray)):
            # sizes: one scalar, or one per batch row (split with the batch)
            for x in jax.tree_util.tree_leaves(m):
                roles.append(lead_roles(jnp.shape(x), "b"))
        elif isinstance(m, position_bias.Biased):
            walk(m.mask)
            term(m.bias)
        else:
            reads.update("bh")
            roles.extend((None,) * jnp.ndim(x) for x in jax.tree_util.tree_leaves(m))

    def term(t):  # a position term (fnattn.position_bias) riding with the mask
        if isinstance(t, position_bias.Sum):
            term(t.a)
            term(t.b)
        elif isinstance(t, position_bias.ALiBi):
            roles.append(lead_roles(jnp.shape(t.slopes), "h"))
        elif isinstance(t, position_bias.FromFn):
            reads.update(_reads_batch_or_head(t.fn, len(t.arrays)))
            for x in t.arrays:  # per head (Hq,) or per row and head (B, Hq)
                roles.append(lead_roles(jnp.shape(x), "bh"[2 - jnp.ndim(x):]))
        else:
            reads.update("bh")
            roles.extend((None,) * jnp.ndim(x) for x in jax.tree_util.tree_leaves(t))

    walk(mask)
    leaves = jax.tree_util.tree_leaves(mask)
    if len(roles) != len(leaves) or any(len(r) != jnp.ndim(x) for r, x in zip(roles, leaves)):
        # The walk does not match the flattening: split nothing rather than guess.
        return [(None,) * jnp.ndim(x) for x in leaves], ""
    return roles, "".join(a for a in "bh" if a not in reads)


# ----------------------------------------------------------------------------------
# The variants' dispatches
# ----------------------------------------------------------------------------------

Q4 = ("b", None, "h", None)     # q, out, d_out: (B, T, Hq, D)
KV4 = ("b", None, "k", None)    # k, v: (B, T, Hkv, D)
ROWS = ("b", "h", None)         # lse: (B, Hq, Tq)


def fold_seed(seed, shard: Shard):
    """The dropout seed of a shard: its first batch row and query head folded in
    as ``dropout.seed_from_key`` folds ``offsets`` (words 0 and 1)."""
    from fnattn import dropout
    if seed is None or all(isinstance(o, int) and o == 0
                           for o in (shard.batch_offset, shard.head_offset)):
        return seed
    consts = jnp.asarray(dropout._C[:2], jnp.uint32)
    offsets = jnp.stack([jnp.asarray(shard.batch_offset, jnp.uint32),
                         jnp.asarray(shard.head_offset, jnp.uint32)])
    return seed.at[:2].add(offsets * consts)


def flash(fn: Callable, cfg, q, k, v, bias, sinks, mask_leaves, seed, *residuals):
    """``fn(cfg, q, k, v, bias, sinks, mask_leaves, seed, *residuals)`` of a flash
    lowering (forward: no residuals, returns (out, lse, lse_lo); backward:
    residuals (out, lse, lse_lo, d_out, d_lse), returns (dq, dk, dv, dbias,
    dsinks); tangent: residuals (out, lse, lse_lo, tq, tk, tv, tbias, tsinks),
    returns (t_out, t_lse)), split along the batch and the heads. With
    ``cfg.term_grad`` the tangent takes the tangents of those mask leaves last,
    and the backward returns their cotangents last."""
    d = cfg.dims
    sizes = Sizes(d.batch, d.num_q_heads, d.num_kv_heads)
    leaf_roles, allow = mask_roles(cfg.mask(mask_leaves), sizes)
    bias_r, bias_summed = bias_roles(jnp.shape(bias), sizes) if bias is not None else (None, "")
    n = len(mask_leaves)
    in_roles = [Q4, KV4, KV4, bias_r, ("h",), *leaf_roles, (None,)]
    # the differentiated arrays of a position term (cfg.term_grad): their
    # gradients are summed over the batch and heads they are broadcast along
    term_roles = [leaf_roles[i] for i in cfg.term_grad]
    term_outs = [Out(r, "".join(a for a in "bh" if a not in r)) for r in term_roles]
    if len(residuals) == 5:  # backward: out, lse, lse_lo, d_out, d_lse
        in_roles += [Q4, ROWS, ROWS, Q4, ROWS]
        outs = [Out(Q4), Out(KV4), Out(KV4),
                None if bias is None else Out(bias_r, bias_summed),
                None if sinks is None else Out(("h",), "b"), *term_outs]
    elif residuals:  # tangent: out, lse, lse_lo and the tangents of q, k, v, bias, sinks
        in_roles += [Q4, ROWS, ROWS, Q4, KV4, KV4, bias_r, ("h",), *term_roles]
        outs = [Out(Q4), Out(ROWS)]
    else:
        outs = [Out(Q4), Out(ROWS), Out(ROWS)]

    def body(shard, q, k, v, bias, sinks, *rest):
        local = dataclasses.replace(cfg, dims=d._replace(
            batch=shard.batch, num_q_heads=shard.q_heads, num_kv_heads=shard.kv_heads))
        leaves, (seed, *res) = tuple(rest[:n]), rest[n:]
        return fn(local, q, k, v, bias, sinks, leaves, fold_seed(seed, shard), *res)

    return partitioned(body, (q, k, v, bias, sinks, *mask_leaves, seed, *residuals), in_roles,
                       outs, sizes, allow)


def decode(fn: Callable, q, k, v, starts, lengths, sinks, terms, *cotangents,
           allow: str = "bh", mask_sizes=()):
    """``fn(q, k, v, starts, lengths, sinks, terms, *cotangents, *mask_sizes)`` of
    decode on "bthd" arrays (forward: returns (out, lse); with cotangents (d_out,
    d_lse): returns (dq, dk, dv, dsinks)), split along the batch and the heads.
    ``terms``: a position term's arrays (n, B, Hq), or None. ``allow``: the axes
    that may be split (not those a ``from_fn`` mask or term reads).
    ``mask_sizes``: a mask's traced window or chunk sizes, () or (B,) each."""
    sizes = Sizes(q.shape[0], q.shape[2], k.shape[2])
    in_roles = [Q4, KV4, KV4, ("b",), ("b",), ("h",), (None, "b", "h")]
    if cotangents:
        in_roles += [Q4, ROWS]
        outs = [Out(Q4), Out(KV4), None if v is None else Out(KV4),  # (v None: latent)
                None if sinks is None else Out(("h",), "b")]
    else:
        outs = [Out(Q4), Out(ROWS)]
    in_roles += [("b",) if jnp.ndim(x) == 1 else () for x in mask_sizes]
    return partitioned(lambda shard, *args: fn(*args), (q, k, v, starts, lengths, sinks,
                                                        terms, *cotangents, *mask_sizes),
                       in_roles, outs, sizes, allow)


def paged(fn: Callable, cfg, q, k_pages, v_pages, sinks, meta, new_k=None, new_v=None,
          *cotangents):
    """``fn(cfg, q, k_pages, v_pages, sinks, meta, new_k, new_v, *cotangents)`` of
    paged attention (packed q (T, Hq, D), heads-major pools (Hkv, N, ps, D)), split
    along the kv heads only: the pools are shared by every sequence, so the
    tokens and sequences stay whole. Forward: returns (out, lse) or, with new
    tokens, (out, lse, k_pages, v_pages); with cotangents (d_out, d_lse): returns
    (dq, dk_pages, dv_pages, dsinks)."""
    sizes = Sizes(1, cfg.num_q_heads, cfg.num_kv_heads)
    pool, packed, tokens_kv = ("k", None, None, None), (None, "h", None), (None, "k", None)
    meta_leaves, meta_def = jax.tree_util.tree_flatten(meta)
    n = len(meta_leaves)
    # (the last leaf is a position term's arrays (n, Hq), if any: split with the heads)
    terms = getattr(meta, "terms", None) is not None
    meta_roles = [(None,) * jnp.ndim(x) for x in meta_leaves[:n - terms]]
    meta_roles += [(None, "h")] * terms
    in_roles = [packed, pool, pool, ("h",), *meta_roles, tokens_kv, tokens_kv]
    if cotangents:
        in_roles += [packed, ("h", None)]
        # (v_pages None: a latent pool, whose values are its keys' first channels)
        v_out = None if v_pages is None else Out(pool)
        outs = [Out(packed), Out(pool), v_out, None if sinks is None else Out(("h",))]
    else:
        v_out = None if v_pages is None else Out(pool)
        outs = [Out(packed), Out(("h", None))] + ([Out(pool), v_out] if cfg.update else [])

    def body(shard, q, k_pages, v_pages, sinks, *rest):
        local = dataclasses.replace(cfg, num_q_heads=shard.q_heads, num_kv_heads=shard.kv_heads)
        meta = jax.tree_util.tree_unflatten(meta_def, rest[:n])
        return fn(local, q, k_pages, v_pages, sinks, meta, *rest[n:])

    return partitioned(body, (q, k_pages, v_pages, sinks, *meta_leaves, new_k, new_v,
                              *cotangents), in_roles, outs, sizes, allow="h")
