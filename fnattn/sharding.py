"""Sharding rules as a function: the ``PartitionSpec`` of every operand of an
attention call, from the names of the mesh axes that split it.

:func:`rules` takes the mode of the call (training, prefill, decode over a
contiguous cache, paged or ragged-paged attention), the layout, and the mesh
axes you split the batch, the heads and the sequence over; it returns a small
frozen NamedTuple whose fields are named like the call's arguments, each a
``jax.sharding.PartitionSpec``, ready for ``jax.shard_map``'s ``in_specs`` and
``out_specs`` (or for ``NamedSharding``). Its ``spec`` field is a pytree shaped
like the :class:`~fnattn.AttentionSpec` you gave, with a ``PartitionSpec`` in
place of every array (mask arrays, bias, sinks, dropout key and offsets), so
``in_specs=(rules.spec, rules.q, rules.k, rules.v)`` matches
``(spec, q, k, v)``. Nothing is registered and nothing is read from an ambient
mesh: what you pass is all there is.

How each array is split (``batch``, ``heads``, ``kv_heads``, ``sequence`` are
the axes you name; "-" is not split)::

    mode               q / out         k, v or caches / pools      lse
    train, prefill     B, T, Hq        B, T, Hkv                   B, Hq, T
    decode             B, -, Hq        caches B, S, Hkv            B, Hq, -
    paged              B, -, Hq        pools Hkv, pages=B, -, -    B, Hq, -
    ragged_paged       tokens=B, Hq    pools Hkv, pages=B, -, -    Hq, tokens=B

(shown for layout "bthd"; "bhtd" swaps T and H as the arrays do.)

* **train / prefill** (:func:`fnattn.attention`, :func:`fnattn.flash`, and
  ``fnattn.context.attention`` when ``sequence`` is given): the sequence axis
  splits T of q, k, v, out and lse; each device holds a contiguous run of
  tokens (of the reordered sequence for the load-balanced layouts).
* **decode** (:func:`fnattn.decode`, and ``fnattn.context.decode`` when
  ``sequence`` is given): the sequence axis splits the caches' slots S (a long
  context decoded from several devices' caches); the new query tokens, the
  lengths and the output are replicated along it.
* **paged** (:func:`fnattn.paged_attention`) and **ragged_paged**
  (:func:`fnattn.ragged_paged_attention`): the heads split the pools' leading
  kv-head axis. A batch axis makes each batch shard an independent cache: its
  sequences, its page-table rows (holding indices into *its own* pages) and
  its ``num_pages / n`` pages of the pools (for ragged batches also its own
  packed tokens, its ``query_start_loc`` run of ``max_seqs / n + 1`` offsets,
  and its own ``num_seqs``, so ``num_seqs`` is then an array with one count per
  shard; ``draft_parents``, indices within each sequence, splits like the
  tokens, or like the sequences for ``paged_attention``). The sequence cannot
  be split: a pool has no sequence axis.

**The spec's arrays** are split by what they index. Segment ids (B, T) and
positions (T,) / (B, T) split like the batch and the sequence of the tokens
they describe; lengths and prefix lengths (B,) like the batch; a dense
``from_array`` mask or a bias, broadcastable to (B, Hq, Tq, Tk), like the batch,
the heads and (with a sequence axis) its query rows, never its key columns:
context-parallel attention gives every device all the key columns of its
query rows. Sinks (Hq,) split like the heads; the dropout key and offsets are
replicated. A size-1 (broadcast) axis of a mask array or bias is never split.

**Checks.** Give ``mesh`` (a ``Mesh``, an ``AbstractMesh`` or a mapping from
axis name to size) and ``shapes`` (arrays or shape tuples, by argument name)
and every split is checked: an axis size that does not divide the dimension
it splits raises ``ValueError`` naming the argument, the dimension, its size
and the axis size. So do GQA splits that would separate a query head from its
kv head: with ``kv_heads`` equal to ``heads`` (the default) the kv heads must
divide among the devices like the query heads; ``kv_heads=None`` (kv heads
replicated while the query heads are split) is multi-query attention only
(Hkv = 1).

>>> import jax, jax.numpy as jnp
>>> from fnattn import AttentionSpec, masks, sharding
>>> ids = jnp.zeros((8, 64), jnp.int32)
>>> spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), sinks=jnp.zeros(4))
>>> r = sharding.rules(spec, batch="data", heads="model", sequence="context")
>>> r.q
P('data', 'context', 'model', None)
>>> r.lse
P('data', 'model', 'context')
>>> r.spec.mask.b.q_segment_ids, r.spec.sinks
(P('data', 'context'), P('model',))
>>> sharding.rules(mode="decode", batch="data", sequence="context").k_cache
P('data', 'context', None, None)
"""

from collections.abc import Mapping
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fnattn import _checks, dropout
from fnattn.core import attention
from fnattn.spec import LAYOUTS, AttentionOutput, AttentionSpec

__all__ = ["MODES", "SAME_AS_HEADS", "DenseRules", "DecodeRules", "PagedRules",
           "RaggedPagedRules", "rules", "sharded_attention"]

MODES = ("train", "prefill", "decode", "paged", "ragged_paged")
STRATEGIES = ("ring", "all_gather")
SEQUENCE_LAYOUTS = ("contiguous", "zigzag", "striped")

AxisName = Union[str, Sequence[str], None]


class _SameAsHeads:
    """The default of ``kv_heads``: the kv heads split like the query heads."""

    def __repr__(self):
        return "SAME_AS_HEADS"


SAME_AS_HEADS = _SameAsHeads()


class DenseRules(NamedTuple):
    """Partition specs of :func:`fnattn.attention` / :func:`fnattn.flash` (and
    ``fnattn.context.attention``): modes "train" and "prefill"."""

    q: P
    k: P
    v: P
    out: P
    lse: P
    spec: Any


class DecodeRules(NamedTuple):
    """Partition specs of :func:`fnattn.decode` (and ``fnattn.context.decode``)."""

    q: P
    k_cache: P
    v_cache: P
    kv_lengths: P
    kv_starts: P
    out: P
    lse: P
    spec: Any


class PagedRules(NamedTuple):
    """Partition specs of :func:`fnattn.paged_attention`. ``cache`` is a
    :class:`fnattn.PagedKVCache` of specs (None with a batch axis: the cache's
    one ``num_free`` count cannot be split; keep one cache per batch shard)."""

    q: P
    k_pages: P
    v_pages: P
    page_table: P
    kv_lengths: P
    draft_parents: P
    out: P
    lse: P
    spec: Any
    cache: Any


class RaggedPagedRules(NamedTuple):
    """Partition specs of :func:`fnattn.ragged_paged_attention` (and its
    ``_with_update`` form, whose new ``k``/``v`` split like ``q`` with the kv
    heads: ``k``, ``v``). ``cache`` as in :class:`PagedRules`."""

    q: P
    k: P
    v: P
    k_pages: P
    v_pages: P
    page_table: P
    context_lengths: P
    query_start_loc: P
    num_seqs: P
    draft_parents: P
    out: P
    lse: P
    spec: Any
    cache: Any


# ---------------------------------------------------------------------------------
# Axis names and mesh sizes
# ---------------------------------------------------------------------------------


def _axis(name: str, value) -> Optional[Union[str, tuple]]:
    """A user's axis argument as a PartitionSpec entry: None, a name, or a tuple."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        value = tuple(value)
        return None if not value else value[0] if len(value) == 1 else value
    raise TypeError(f"sharding: {name} must be a mesh axis name, a tuple of names or None; "
                    f"got {type(value).__name__} {value!r}")


def _names(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _mesh_sizes(mesh) -> Optional[dict]:
    if mesh is None:
        return None
    shape = getattr(mesh, "shape", mesh)
    if not isinstance(shape, Mapping):
        raise TypeError("sharding: mesh must be a jax.sharding.Mesh, an AbstractMesh or a "
                        f"mapping from axis name to size; got {type(mesh).__name__}")
    return dict(shape)


def _size(entry, sizes) -> Optional[int]:
    if sizes is None:
        return None
    n = 1
    for a in _names(entry):
        n *= sizes[a]
    return n


def _describe(entry, sizes) -> str:
    names = _names(entry)
    what = repr(names[0]) if len(names) == 1 else repr(names)
    return f"mesh axis {what} of size {_size(entry, sizes)}"


# ---------------------------------------------------------------------------------
# What each dimension of each array is
# ---------------------------------------------------------------------------------

# Dimension roles: "b" batch, "h" query heads, "kvh" kv heads, "q" query tokens,
# "k" key tokens that travel with k/v (kv-side mask arrays, cache slots),
# "kcols" the key columns of a dense (Tq, Tk) array (never split), "pages" pool
# pages, None not split.
_DIM_NAMES = {"b": "batch", "h": "query heads", "kvh": "kv heads", "q": "query tokens",
              "k": "key tokens", "kcols": "key columns", "pages": "pages",
              "tokens": "packed tokens", "seqs": "sequences"}


def _tensor(layout, t_role, h_role):
    return ("b", t_role, h_role, None) if layout == "bthd" else ("b", h_role, t_role, None)


def _operand_roles(mode, layout):
    """The roles of each dimension of each operand of ``mode``."""
    if mode in ("train", "prefill"):
        return {"q": _tensor(layout, "q", "h"), "k": _tensor(layout, "k", "kvh"),
                "v": _tensor(layout, "k", "kvh"), "out": _tensor(layout, "q", "h"),
                "lse": ("b", "h", "q")}
    if mode == "decode":
        cache = _tensor(layout, "k", "kvh")
        return {"q": _tensor(layout, None, "h"), "k_cache": cache, "v_cache": cache,
                "kv_lengths": ("b",), "kv_starts": ("b",), "out": _tensor(layout, None, "h"),
                "lse": ("b", "h", None)}
    pool = ("kvh", "pages", None, None)
    if mode == "paged":
        return {"q": _tensor(layout, None, "h"), "k_pages": pool, "v_pages": pool,
                "page_table": ("seqs", None), "kv_lengths": ("seqs",),
                "draft_parents": ("seqs", None),
                "out": _tensor(layout, None, "h"), "lse": ("b", "h", None)}
    return {"q": ("tokens", "h", None), "k": ("tokens", "kvh", None),
            "v": ("tokens", "kvh", None), "k_pages": pool, "v_pages": pool,
            "page_table": ("seqs", None), "context_lengths": ("seqs",),
            "query_start_loc": ("seqs",), "num_seqs": ("seqs",), "draft_parents": ("tokens",),
            "out": ("tokens", "h", None),
            "lse": ("h", "tokens")}


def _nontrivial(shape):
    return [(i, n) for i, n in enumerate(shape) if n != 1]


def _mask_leaf_roles(mask, leaves):
    """Per mask leaf, the role of each of its dimensions, read from the mask's
    canonical operands (B|1, H|1, Tq|1, Tk|1): the operand is the leaf with
    size-1 axes inserted, so the leaf's non-1 dimensions are the operand's, in
    order."""
    ops = jax.eval_shape(lambda m: m.operands(), mask)
    if len(ops) != len(leaves):
        raise ValueError(f"sharding: mask {mask!r} has {len(leaves)} arrays but "
                         f"{len(ops)} operands; cannot tell how to split them")
    out = []
    for (path, leaf), op in zip(leaves, ops):
        shape = tuple(jnp.shape(leaf))
        dense = op.shape[2] != 1 and op.shape[3] != 1
        names = ("b", "h", "q", "kcols" if dense else "k")
        ours, theirs = _nontrivial(shape), _nontrivial(op.shape)
        if [n for _, n in ours] != [n for _, n in theirs]:
            raise ValueError(f"sharding: cannot tell which of (batch, heads, Tq, Tk) the axes "
                             f"of spec{path} {shape} are (its operand is {tuple(op.shape)})")
        roles = [None] * len(shape)
        for (i, _), (j, _) in zip(ours, theirs):
            roles[i] = names[j]
        out.append(tuple(roles))
    return out


def _spec_leaf_roles(spec):
    """``[(path, shape, roles, broadcast)]`` for every array leaf of ``spec``,
    in ``jax.tree_util`` order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(spec)
    entries, mask_leaves, term_leaves = [], [], []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        field = getattr(path[0], "name", None)
        shape = tuple(jnp.shape(leaf))
        if field == "mask":
            mask_leaves.append((name, leaf))
            entries.append([name, shape, None, True])
        elif field == "bias":
            padded = ("b", "h", "q", "kcols")
            entries.append([name, shape, padded[4 - len(shape):] if len(shape) <= 4
                            else (None,) * len(shape), True])
        elif field == "sinks":
            entries.append([name, shape, ("h",) * len(shape), False])
        elif field == "position_bias":  # ALiBi's slopes (Hq,): split like the heads
            term_leaves.append((name, leaf))
            entries.append([name, shape, "term", True])
        else:  # the dropout key and offsets: replicated
            entries.append([name, None, (), False])
    if mask_leaves:
        roles = iter(_mask_leaf_roles(spec.mask, mask_leaves))
        for e in entries:
            if e[2] is None:
                e[2] = next(roles)
    if term_leaves:  # (a term's arrays have canonical operands, as a mask's do)
        roles = iter(_mask_leaf_roles(spec.position_bias, term_leaves))
        for e in entries:
            if e[2] == "term":
                e[2] = next(roles)
    return [tuple(e) for e in entries]


# ---------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------


def _shape_of(name, x):
    if hasattr(x, "shape"):
        return tuple(x.shape)
    if isinstance(x, (tuple, list)) and all(isinstance(n, int) for n in x):
        return tuple(x)
    raise TypeError(f"sharding.rules: shapes[{name!r}] must be an array, a "
                    f"ShapeDtypeStruct or a tuple of ints; got {type(x).__name__} {x!r}")


def _place(arg, shape, roles, assign, sizes, *, broadcast):
    """The PartitionSpec of one array: each dimension gets the mesh axes of its
    role; a broadcast (size-1) dimension of a broadcastable array gets none; an
    axis that does not divide its dimension is refused."""
    if shape is not None and len(shape) != len(roles):
        raise ValueError(f"sharding.rules: {arg} must have {len(roles)} "
                         f"ax{'is' if len(roles) == 1 else 'es'} "
                         f"({', '.join(_DIM_NAMES.get(r, '-') if r else '-' for r in roles)}); "
                         f"got shape {shape}")
    entries = []
    for i, role in enumerate(roles):
        entry = assign.get(role)
        if entry is not None and shape is not None:
            n = shape[i]
            if broadcast and n == 1:
                entry = None
            elif sizes is not None and n % _size(entry, sizes):
                raise ValueError(
                    f"sharding.rules: {arg} {shape} has {_DIM_NAMES[role]} of size {n} "
                    f"along axis {i}, which {_describe(entry, sizes)} does not divide; "
                    f"pad it to a multiple of {_size(entry, sizes)} or split it over "
                    "other mesh axes")
        entries.append(entry)
    return P(*entries)


def _refuse_index_reads(spec, *, batch, heads):
    """A ``from_fn`` mask or position term that reads the batch row or the head
    index sees a shard's *local* index inside ``shard_map``: refuse a split of
    that axis rather than let it answer for the wrong rows or heads."""
    from fnattn import _partition, position_bias
    mask = position_bias.attach(spec.mask, spec.position_bias, constant=False)
    if mask is None:
        return
    _, allow = _partition.mask_roles(mask, _partition.Sizes(0, 0, 0))
    for axis, name, role in ((batch, "batch", "b"), (heads, "heads", "h")):
        if axis is not None and role not in allow:
            index = "batch row" if role == "b" else "head index"
            what = " and ".join(f"{n} {x!r}" for n, x in (
                ("mask", spec.mask), ("position term", spec.position_bias)) if x is not None)
            raise ValueError(
                f"sharding.rules: {name}={axis!r} would split an axis that the spec reads "
                f"(its {what} may read the {index}, as a from_fn can): inside shard_map it "
                f"would see each shard's local {index}. Leave "
                f"{name} unsplit, or write the per-{name} part as arrays (masks.segments, "
                "masks.from_array, position_bias.alibi, position_bias.from_fn(fn, "
                "*arrays)), which split with it.")


def rules(spec: Optional[AttentionSpec] = None, *, mode: str = "train",
          layout: Optional[str] = None, batch: AxisName = None, heads: AxisName = None,
          kv_heads: Any = SAME_AS_HEADS, sequence: AxisName = None, mesh: Any = None,
          shapes: Optional[Mapping] = None):
    """The ``PartitionSpec`` of every operand of an attention call.

    Args:
      spec: the :class:`~fnattn.AttentionSpec` of the call, whose arrays get
        specs in ``.spec``; None if there is none (``.spec`` is then None).
      mode: "train" or "prefill" (dense attention; the same specs), "decode"
        (a contiguous cache), "paged" or "ragged_paged" (a paged pool); see
        the module docstring.
      layout: "bthd" or "bhtd"; defaults to ``spec.layout`` (or "bthd").
      batch: the mesh axis (a name, a tuple of names, major first, or None)
        that splits the batch.
      heads: the same for the query heads.
      sequence: the same for the sequence (T in train/prefill, the cache
        slots S in decode; refused in the paged modes).
      kv_heads: the axis that splits the kv heads: the same as ``heads`` by
        default (GQA groups stay together); None replicates them (multi-query
        attention only).
      mesh: a ``Mesh``, an ``AbstractMesh`` or a mapping from axis name to size:
        with it the axis names are checked and (with ``shapes``) every split.
      shapes: arrays, ``ShapeDtypeStruct``\\ s or shape tuples by argument name
        (the field names of the result, e.g. ``dict(q=q, k=k, v=v)``), checked
        against the splits. The spec's arrays are always checked (their size-1
        broadcast axes are never split).

    Returns:
      :class:`DenseRules` (train, prefill), :class:`DecodeRules`,
      :class:`PagedRules` or :class:`RaggedPagedRules`: a ``PartitionSpec`` per
      argument of the call, ``out`` and ``lse`` for the result, and ``spec``.

    Raises:
      ValueError: a split that does not divide its dimension, GQA heads split
        apart, an axis used twice or missing from the mesh, or a sequence split
        in a paged mode.

    >>> import jax, jax.numpy as jnp
    >>> from fnattn import AttentionSpec, sharding
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> bias = jnp.zeros((1, 4, 16, 16))        # one bias for the whole batch
    >>> r = sharding.rules(AttentionSpec(bias=bias, layout="bhtd"), batch="data", mesh=mesh)
    >>> r.q, r.spec.bias                        # B=1: the bias is not split
    (P('data', None, None, None), P(None, None, None, None))
    >>> sharding.rules(mode="ragged_paged", heads="data").k_pages
    P('data', None, None, None)
    >>> sharding.rules(batch="data", mesh={"data": 4},  # doctest: +ELLIPSIS
    ...                shapes=dict(q=(6, 16, 2, 8)))
    Traceback (most recent call last):
    ...
    ValueError: sharding.rules: q (6, 16, 2, 8) has batch of size 6 along axis 0, which mesh ...
    """
    if mode not in MODES:
        raise ValueError(f"sharding.rules: mode must be one of {MODES}; got {mode!r}")
    if spec is not None and not isinstance(spec, AttentionSpec):
        raise TypeError(f"sharding.rules: spec must be an AttentionSpec or None; got "
                        f"{type(spec).__name__}")
    if layout is None:
        layout = "bthd" if spec is None else spec.layout
    if layout not in LAYOUTS:
        raise ValueError(f"sharding.rules: layout must be one of {LAYOUTS}; got {layout!r}")
    if spec is not None and spec.layout != layout:
        raise ValueError(f"sharding.rules: layout={layout!r} but spec.layout="
                         f"{spec.layout!r}; leave layout out to use the spec's")
    if mode == "ragged_paged" and layout != "bthd":
        raise ValueError("sharding.rules: mode='ragged_paged' packs q as (total_tokens, Hq, "
                         f"D) and needs layout 'bthd'; got {layout!r}")
    batch, heads, sequence = (_axis(n, v) for n, v in (("batch", batch), ("heads", heads),
                                                        ("sequence", sequence)))
    kv_heads = heads if kv_heads is SAME_AS_HEADS else _axis("kv_heads", kv_heads)
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(
            f"sharding.rules: kv_heads={kv_heads!r} must be heads={heads!r} (each device "
            "holds the kv heads of its query heads) or None (kv heads replicated: "
            "multi-query attention); a split of the kv heads that differs from the query "
            "heads' would pair query heads with the wrong kv heads")
    if sequence is not None and mode in ("paged", "ragged_paged"):
        raise ValueError(
            f"sharding.rules: mode={mode!r} cannot split the sequence (sequence="
            f"{sequence!r}): a page pool has no sequence axis, a sequence's pages lie "
            "anywhere in it. The paged modes split the batch (each batch shard an "
            "independent cache with its own pages) and the heads (the pools' kv-head "
            "axis). To spread one long context over devices use mode='decode' with a "
            "contiguous cache split along its slots (fnattn.context.decode).")
    used = {}
    for role, entry in (("batch", batch), ("heads", heads), ("sequence", sequence)):
        for a in _names(entry):
            if a in used:
                raise ValueError(f"sharding.rules: mesh axis {a!r} is given for both "
                                 f"{used[a]} and {role}; each axis can split one of them")
            used[a] = role
    sizes = _mesh_sizes(mesh)
    if sizes is not None:
        for a, role in used.items():
            if a not in sizes:
                raise ValueError(f"sharding.rules: {role}={a!r} is not an axis of the mesh, "
                                 f"whose axes are {tuple(sizes)}")

    if spec is not None:
        _refuse_index_reads(spec, batch=batch, heads=heads)
    assign = {"b": batch, "h": heads, "kvh": kv_heads, "pages": batch, "tokens": batch,
              "seqs": batch}
    if mode in ("train", "prefill"):
        assign.update(q=sequence, k=sequence)
    elif mode == "decode":
        assign.update(k=sequence)
    roles = _operand_roles(mode, layout)

    shapes = dict(shapes or {})
    unknown = sorted(set(shapes) - set(roles))
    if unknown:
        raise ValueError(f"sharding.rules: shapes has no argument {', '.join(unknown)} in "
                         f"mode={mode!r}; its arguments are {', '.join(roles)}")
    shapes = {k: _shape_of(k, x) for k, x in shapes.items()}
    _check_gqa(mode, layout, shapes, heads, kv_heads, sizes)
    if shapes.get("num_seqs") == ():  # ragged_paged_attention takes a scalar too
        if batch is not None:
            n = _size(batch, sizes)
            raise ValueError(
                f"sharding.rules: num_seqs is one scalar, which batch={batch!r} cannot "
                "split: with a batch axis each batch shard is its own cache with its own "
                "count, so give num_seqs as an int32 array of shape "
                f"({'n' if n is None else n},), one count per shard")
        roles["num_seqs"] = ()
    fields = {name: _place(name, shapes.get(name), r, assign, sizes, broadcast=False)
              for name, r in roles.items()}

    spec_specs = None
    if spec is not None:
        flat, treedef = jax.tree_util.tree_flatten(spec)
        leaf_specs = [
            _place(f"spec{path}", shape, leaf_roles, assign, sizes, broadcast=broadcast)
            for path, shape, leaf_roles, broadcast in _spec_leaf_roles(spec)]
        assert len(leaf_specs) == len(flat)
        spec_specs = jax.tree_util.tree_unflatten(treedef, leaf_specs)

    if mode in ("train", "prefill"):
        return DenseRules(spec=spec_specs, **fields)
    if mode == "decode":
        return DecodeRules(spec=spec_specs, **fields)
    cache = None
    if batch is None:
        from fnattn.cache import PagedKVCache
        cache = PagedKVCache(k_pages=fields["k_pages"], v_pages=fields["v_pages"],
                             page_table=P(None, None), lengths=P(None), free_pages=P(None),
                             num_free=P())
    if mode == "paged":
        return PagedRules(spec=spec_specs, cache=cache, **fields)
    return RaggedPagedRules(spec=spec_specs, cache=cache, **fields)


def _check_gqa(mode, layout, shapes, heads, kv_heads, sizes):
    """Refuses a split of the heads that separates a query head from its kv head."""
    if heads is None:
        return
    h_axis = {"bthd": 2, "bhtd": 1}[layout]
    q_shape = shapes.get("q")
    if mode == "ragged_paged":
        h_axis = 1
    kv_name = next((n for n in ("k", "k_cache", "k_pages", "v", "v_cache", "v_pages")
                    if n in shapes), None)
    if kv_name is None:
        return
    kv_shape = shapes[kv_name]
    kv_axis = 0 if kv_name.endswith("pages") else 1 if mode == "ragged_paged" else h_axis
    if len(kv_shape) <= kv_axis:
        return  # the rank is refused, naming the argument, by _place
    hkv = kv_shape[kv_axis]
    hq = q_shape[h_axis] if q_shape is not None and len(q_shape) > h_axis else None
    n = _size(heads, sizes)
    if kv_heads is None:
        if hkv != 1 and (n is None or n > 1):
            raise ValueError(
                f"sharding.rules: kv_heads=None replicates the kv heads while heads={heads!r} "
                f"splits the query heads; that pairs query heads with the right kv head only "
                f"for multi-query attention (Hkv=1), but {kv_name} {kv_shape} has Hkv={hkv}. "
                "Leave kv_heads out to split the kv heads like the query heads.")
        return
    if n is not None and hkv % n:
        groups = f" (GQA groups of {hq // hkv} query heads each)" if hq and hq % hkv == 0 \
            else ""
        raise ValueError(
            f"sharding.rules: {kv_name} {kv_shape} has Hkv={hkv} kv heads{groups}, which "
            f"{_describe(heads, sizes)} splitting the heads does not divide: a device's "
            "query heads would need kv heads held by another device. Split the heads over "
            f"an axis whose size divides {hkv}, or replicate the kv heads "
            "(kv_heads=None) if Hkv is 1.")


# ---------------------------------------------------------------------------------
# The common case in one call
# ---------------------------------------------------------------------------------


def _reorder_spec(spec, axis_size, seq_layout, fn):
    """The spec's per-token arrays in the layout's token order (``fn`` is
    ``fnattn.context.reorder``): the query rows and key tokens of mask arrays
    and of the bias alike (dense arrays keep all their key columns, in the
    reordered key order)."""
    flat, treedef = jax.tree_util.tree_flatten(spec)
    out = []
    for leaf, (_, _, roles, _) in zip(flat, _spec_leaf_roles(spec)):
        for axis, (role, n) in enumerate(zip(roles, jnp.shape(leaf))):
            if role in ("q", "k", "kcols") and n != 1:
                leaf = fn(leaf, axis_size, seq_layout, axis=axis)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def sharded_attention(spec: AttentionSpec, q, k, v, *, mesh, batch: AxisName = None,
                      heads: AxisName = None, kv_heads: Any = SAME_AS_HEADS,
                      sequence: AxisName = None, strategy: str = "ring",
                      layout: str = "contiguous") -> AttentionOutput:
    """:func:`fnattn.attention` on global arrays, split over ``mesh`` by
    :func:`rules` and run with ``jax.shard_map``.

    Without a sequence axis each device runs :func:`fnattn.attention` on its
    batch rows and heads; with one it runs ``fnattn.context.attention`` (context
    parallelism with ``strategy`` "ring" or "all_gather", the tokens in
    ``layout`` "contiguous", "zigzag" or "striped" order: the wrapper reorders
    the inputs and restores the outputs). Dropout draws the unsharded problem's
    mask bit for bit (:func:`fnattn.dropout.shard_offsets`), and gradients with
    respect to q, k, v, the bias and the sinks are those of the unsharded call.
    The result is the same as ``fnattn.attention(spec, q, k, v)``, as global
    arrays sharded over the mesh. The call is compiled as a whole (``jax.jit``,
    once per mesh, axes and shapes), so that outside ``jit`` ``shard_map`` does
    not run each device's program one operation at a time; inside ``jit`` it is
    part of the caller's program.

    Args:
      spec: the :class:`~fnattn.AttentionSpec`, with global arrays (segment ids
        (B, T), bias (B|1, H|1, Tq, Tk), ...).
      q: global queries in ``spec.layout``.
      k: global keys in ``spec.layout``.
      v: global values in ``spec.layout``.
      mesh: the ``jax.sharding.Mesh`` to run on.
      batch: mesh axis, as for :func:`rules`.
      heads: mesh axis, as for :func:`rules`.
      kv_heads: mesh axis, as for :func:`rules`.
      sequence: mesh axis, as for :func:`rules`.
      strategy: of context parallelism; used only with ``sequence``.
      layout: of context parallelism; used only with ``sequence``.

    Returns:
      :class:`~fnattn.AttentionOutput` of global arrays.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks, sharding
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
    >>> spec = AttentionSpec(mask=masks.causal())
    >>> res = jax.jit(lambda q, k, v: sharding.sharded_attention(
    ...     spec, q, k, v, mesh=mesh, batch="data"))(q, k, v)
    >>> bool(jnp.allclose(res.out, fnattn.attention(spec, q, k, v).out, atol=1e-6))
    True
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"sharded_attention: strategy must be one of {STRATEGIES}; "
                         f"got {strategy!r}")
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"sharded_attention: layout (the token order of context "
                         f"parallelism) must be one of {SEQUENCE_LAYOUTS}; got {layout!r}. "
                         "The tensor layout is spec.layout.")
    # Compiled as a whole, as the entry points are: outside jit, shard_map would
    # run the per-device program one operation at a time (the ring's steps
    # eagerly, tens of seconds).
    return _compiled(spec, q, k, v, mesh=mesh, batch=batch, heads=heads, kv_heads=kv_heads,
                     sequence=sequence, strategy=strategy, layout=layout)


def _sharded_attention(spec, q, k, v, *, mesh, batch, heads, kv_heads, sequence, strategy,
                       layout):
    r = rules(spec, mode="train", batch=batch, heads=heads, kv_heads=kv_heads,
              sequence=sequence, mesh=mesh, shapes=dict(q=q, k=k, v=v))
    batch, heads, sequence = _axis("batch", batch), _axis("heads", heads), \
        _axis("sequence", sequence)
    t_axis = 1 if spec.layout == "bthd" else 2
    reordered = sequence is not None and layout != "contiguous"
    if reordered:
        from fnattn import context
        n_seq = _size(sequence, _mesh_sizes(mesh))
        spec = _reorder_spec(spec, n_seq, layout, context.reorder)
        q, k, v = (context.reorder(x, n_seq, layout, axis=t_axis) for x in (q, k, v))

    def local(spec, q, k, v):
        if spec.dropout_rate > 0:
            offsets = dropout.shard_offsets(q, layout=spec.layout, batch_axis=batch,
                                            head_axis=heads)
            if spec.dropout_offsets is not None:
                offsets = offsets + spec.dropout_offsets.astype(offsets.dtype)
            spec = spec.replace(dropout_offsets=offsets)
        if sequence is None:
            return attention(spec, q, k, v)
        from fnattn import context
        return context.attention(spec, q, k, v, axis_name=sequence, strategy=strategy,
                                 layout=layout)

    out_specs = AttentionOutput(r.out, r.lse if spec.return_lse else None)
    res = jax.shard_map(local, mesh=mesh, in_specs=(r.spec, r.q, r.k, r.v),
                        out_specs=out_specs)(spec, q, k, v)
    if reordered:
        res = AttentionOutput(
            context.restore(res.out, n_seq, layout, axis=t_axis),
            None if res.lse is None else context.restore(res.lse, n_seq, layout, axis=2))
    return res


_compiled = _checks.through_jit(_sharded_attention)
