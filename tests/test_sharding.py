"""``fnattn.sharding.rules``: the PartitionSpecs of every mode and layout, the
spec's pytree of specs, and the splits it drops or refuses (with the wording of
its messages pinned). Pure rule checks on one device: meshes are described by
their axis sizes (a mapping or an ``AbstractMesh``); running the rules on 8
devices is ``tests/multi_device/sharding_checks.py``."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fnattn
from fnattn import AttentionSpec, masks, sharding

# Distinct sizes so that a swapped axis fails: B=6, T=10, Hq=4, Hkv=2, D=3.
B, T, HQ, HKV, D = 6, 10, 4, 2, 3
MESH = {"data": 2, "model": 2, "context": 5, "fsdp": 3}
AXES = dict(batch="data", heads="model", sequence="context")


def i32(*shape):
    return jnp.zeros(shape, jnp.int32)


def full_spec(layout="bthd"):
    mask = masks.at_positions(
        masks.causal() & masks.segments(i32(B, T)) & masks.lengths(kv_lengths=i32(B))
        & masks.from_array(jnp.ones((B, 1, T, T), bool)),
        jnp.arange(T), jnp.arange(T))
    return AttentionSpec(mask=mask, bias=jnp.zeros((1, HQ, T, T)), sinks=jnp.zeros(HQ),
                         dropout_rate=0.1, dropout_key=jax.random.key(0),
                         dropout_offsets=i32(4), layout=layout)


def leaves_by_path(tree):
    return {jax.tree_util.keystr(p): x
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_train_and_prefill(layout):
    for mode in ("train", "prefill"):
        r = sharding.rules(mode=mode, layout=layout, **AXES)
        assert isinstance(r, sharding.DenseRules)
        tok = P("data", "context", "model", None) if layout == "bthd" else \
            P("data", "model", "context", None)
        assert (r.q, r.k, r.v, r.out) == (tok, tok, tok, tok)
        assert r.lse == P("data", "model", "context")
        assert r.spec is None


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_decode_splits_the_cache_not_the_queries(layout):
    r = sharding.rules(mode="decode", layout=layout, **AXES)
    if layout == "bthd":
        assert r.q == r.out == P("data", None, "model", None)
        assert r.k_cache == r.v_cache == P("data", "context", "model", None)
    else:
        assert r.q == r.out == P("data", "model", None, None)
        assert r.k_cache == r.v_cache == P("data", "model", "context", None)
    assert r.kv_lengths == r.kv_starts == P("data")
    assert r.lse == P("data", "model", None)


def test_paged_modes():
    r = sharding.rules(mode="paged", batch="data", heads="model")
    assert r.k_pages == r.v_pages == P("model", "data", None, None)  # heads-major pools
    assert (r.q, r.page_table, r.kv_lengths) == (P("data", None, "model", None),
                                                 P("data", None), P("data"))
    assert r.lse == P("data", "model", None) and r.cache is None
    r = sharding.rules(mode="ragged_paged", batch="data", heads="model")
    assert r.q == r.out == P("data", "model", None) and r.k == P("data", "model", None)
    assert r.lse == P("model", "data")
    assert r.query_start_loc == r.num_seqs == r.context_lengths == P("data")
    # heads only: a PagedKVCache of specs, metadata replicated
    cache = sharding.rules(mode="ragged_paged", heads="model").cache
    assert cache.k_pages == P("model", None, None, None) and cache.num_free == P()
    assert cache.page_table == P(None, None)
    # a scalar num_seqs is fine when the batch is not split
    assert sharding.rules(mode="ragged_paged", heads="model",
                          shapes=dict(num_seqs=())).num_seqs == P()


def test_spec_pytree_matches_the_spec():
    spec = full_spec()
    r = sharding.rules(spec, mesh=MESH, **AXES)
    assert jax.tree_util.tree_structure(r.spec) == jax.tree_util.tree_structure(spec)
    got = leaves_by_path(r.spec)
    assert got == {
        ".mask.mask.a.a.b.q_segment_ids": P("data", "context"),
        ".mask.mask.a.a.b.kv_segment_ids": P("data", "context"),
        ".mask.mask.a.b.kv_lengths": P("data"),
        ".mask.mask.b.mask": P("data", None, "context", None),  # key columns: all
        ".mask.q_positions": P("context"),
        ".mask.kv_positions": P("context"),
        ".bias": P(None, "model", "context", None),  # B=1: not split
        ".sinks": P("model"),
        ".dropout_key": P(),
        ".dropout_offsets": P(),
    }
    # None fields stay None
    spec = AttentionSpec(mask=masks.causal())
    r = sharding.rules(spec, **AXES)
    assert jax.tree_util.tree_structure(r.spec) == jax.tree_util.tree_structure(spec)
    assert r.spec.bias is None and r.spec.sinks is None
    # decode: the query side of a mask array is not split, the key side is
    r = sharding.rules(AttentionSpec(mask=masks.segments(i32(B, 1), i32(B, T))),
                       mode="decode", **AXES)
    assert leaves_by_path(r.spec) == {".mask.q_segment_ids": P("data", None),
                                      ".mask.kv_segment_ids": P("data", "context")}


def test_size_one_broadcast_axes_are_not_split():
    spec = AttentionSpec(mask=masks.from_array(jnp.ones((B, 1, T, T), bool)),
                         bias=jnp.zeros((T, T)))
    r = sharding.rules(spec, mesh=MESH, **AXES)
    assert leaves_by_path(r.spec) == {".mask.mask": P("data", None, "context", None),
                                      ".bias": P("context", None)}
    r = sharding.rules(AttentionSpec(bias=jnp.zeros((B, HQ, 1, T))), mesh=MESH, **AXES)
    assert r.spec.bias == P("data", "model", None, None)


def test_tuple_axes_and_abstract_mesh():
    mesh = jax.sharding.AbstractMesh((2, 3), ("data", "fsdp"))
    r = sharding.rules(batch=("data", "fsdp"), mesh=mesh, shapes=dict(q=(B, T, HQ, D)))
    assert r.q == P(("data", "fsdp"), None, None, None)
    assert sharding.rules(batch=("data",)).q == P("data", None, None, None)
    with pytest.raises(ValueError, match=r"mesh axis \('data', 'fsdp'\) of size 6"):
        sharding.rules(batch=("data", "fsdp"), mesh=mesh, shapes=dict(q=(4, T, HQ, D)))


def test_usable_as_shard_map_in_specs():
    spec = full_spec()
    r = sharding.rules(spec, **AXES)
    mesh = jax.sharding.AbstractMesh((2, 2, 5), ("data", "model", "context"),
                                     axis_types=(jax.sharding.AxisType.Auto,) * 3)
    q = jax.ShapeDtypeStruct((B, T, HQ, D), jnp.float32)
    f = jax.shard_map(lambda s, q: q * s.sinks[:, None], mesh=mesh,
                      in_specs=(r.spec, r.q), out_specs=r.q)
    with jax.sharding.use_abstract_mesh(mesh):
        assert jax.eval_shape(f, spec, q).shape == (B, T, HQ, D)


def test_gqa_groups_stay_together():
    # kv heads replicated under split query heads: MQA only
    r = sharding.rules(heads="model", kv_heads=None, mesh=MESH,
                       shapes=dict(q=(B, T, HQ, D), k=(B, T, 1, D)))
    assert r.q == P(None, None, "model", None) and r.k == P(None, None, None, None)


ERRORS = [
    ("non-dividing q", dict(batch="data", mesh={"data": 4}, shapes=dict(q=(B, T, HQ, D))),
     "sharding.rules: q (6, 10, 4, 3) has batch of size 6 along axis 0, which mesh axis "
     "'data' of size 4 does not divide; pad it to a multiple of 4 or split it over other "
     "mesh axes"),
    ("non-dividing cache", dict(mode="decode", sequence="context", mesh={"context": 4},
                                shapes=dict(k_cache=(B, T, HKV, D))),
     "sharding.rules: k_cache (6, 10, 2, 3) has key tokens of size 10 along axis 1, which "
     "mesh axis 'context' of size 4 does not divide; pad it to a multiple of 4 or split it "
     "over other mesh axes"),
    ("non-dividing spec array",
     dict(spec=AttentionSpec(mask=masks.segments(i32(B, T))), batch="fsdp",
          mesh={"fsdp": 4}),
     "sharding.rules: spec.mask.q_segment_ids (6, 10) has batch of size 6 along axis 0, "
     "which mesh axis 'fsdp' of size 4 does not divide; pad it to a multiple of 4 or split "
     "it over other mesh axes"),
    ("gqa", dict(heads="model", mesh={"model": 4},
                 shapes=dict(q=(B, T, 8, D), k=(B, T, HKV, D))),
     "sharding.rules: k (6, 10, 2, 3) has Hkv=2 kv heads (GQA groups of 4 query heads "
     "each), which mesh axis 'model' of size 4 splitting the heads does not divide: a "
     "device's query heads would need kv heads held by another device. Split the heads "
     "over an axis whose size divides 2, or replicate the kv heads (kv_heads=None) if Hkv "
     "is 1."),
    ("gqa, replicated kv heads", dict(heads="model", kv_heads=None, mesh=MESH,
                                      shapes=dict(k=(B, T, HKV, D))),
     "sharding.rules: kv_heads=None replicates the kv heads while heads='model' splits the "
     "query heads; that pairs query heads with the right kv head only for multi-query "
     "attention (Hkv=1), but k (6, 10, 2, 3) has Hkv=2. Leave kv_heads out to split the kv "
     "heads like the query heads."),
    ("kv heads on another axis", dict(heads="model", kv_heads="data"),
     "sharding.rules: kv_heads='data' must be heads='model' (each device holds the kv heads "
     "of its query heads) or None (kv heads replicated: multi-query attention); a split of "
     "the kv heads that differs from the query heads' would pair query heads with the "
     "wrong kv heads"),
    ("paged sequence", dict(mode="paged", sequence="context"),
     "sharding.rules: mode='paged' cannot split the sequence (sequence='context'): a page "
     "pool has no sequence axis, a sequence's pages lie anywhere in it. The paged modes "
     "split the batch (each batch shard an independent cache with its own pages) and the "
     "heads (the pools' kv-head axis). To spread one long context over devices use "
     "mode='decode' with a contiguous cache split along its slots (fnattn.context.decode)."),
    ("axis twice", dict(batch="data", sequence=("context", "data")),
     "sharding.rules: mesh axis 'data' is given for both batch and sequence; each axis can "
     "split one of them"),
    ("axis not in mesh", dict(heads="tensor", mesh=MESH),
     "sharding.rules: heads='tensor' is not an axis of the mesh, whose axes are ('data', "
     "'model', 'context', 'fsdp')"),
    ("unknown shape name", dict(mode="decode", shapes=dict(k=(B, T, HKV, D))),
     "sharding.rules: shapes has no argument k in mode='decode'; its arguments are q, "
     "k_cache, v_cache, kv_lengths, kv_starts, out, lse"),
    ("rank", dict(shapes=dict(q=(B, T, HQ))),
     "sharding.rules: q must have 4 axes (batch, query tokens, query heads, -); got shape "
     "(6, 10, 4)"),
    ("scalar num_seqs", dict(mode="ragged_paged", batch="data", mesh=MESH,
                             shapes=dict(num_seqs=())),
     "sharding.rules: num_seqs is one scalar, which batch='data' cannot split: with a "
     "batch axis each batch shard is its own cache with its own count, so give num_seqs "
     "as an int32 array of shape (2,), one count per shard"),
    ("layout", dict(spec=AttentionSpec(), layout="bhtd"),
     "sharding.rules: layout='bhtd' but spec.layout='bthd'; leave layout out to use the "
     "spec's"),
    ("mode", dict(mode="serve"),
     "sharding.rules: mode must be one of ('train', 'prefill', 'decode', 'paged', "
     "'ragged_paged'); got 'serve'"),
]


@pytest.mark.parametrize("kwargs, message", [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_refusals(kwargs, message):
    kwargs = dict(kwargs)
    spec = kwargs.pop("spec", None)
    with pytest.raises(ValueError) as e:
        sharding.rules(spec, **kwargs)
    assert str(e.value) == message


def test_axis_argument_types():
    with pytest.raises(TypeError, match="batch must be a mesh axis name"):
        sharding.rules(batch=0)


def test_wrapper_refuses_unknown_strategy_and_layout():
    q = jnp.zeros((1, 4, 1, 2))
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    with pytest.raises(ValueError, match="strategy must be one of"):
        sharding.sharded_attention(AttentionSpec(), q, q, q, mesh=mesh, strategy="tree")
    with pytest.raises(ValueError, match="The tensor layout is spec.layout"):
        sharding.sharded_attention(AttentionSpec(), q, q, q, mesh=mesh, layout="bhtd")


def test_wrapper_outside_jit_is_compiled_once_per_mesh_axes_and_shapes(monkeypatch):
    """Called outside jit, the wrapper runs one compiled program (shard_map alone
    would run the devices' program one operation at a time), reused by the next
    call with the same mesh, axes and shapes; axes given as lists work alike."""
    traces = []
    rules = sharding.rules       # called once per trace of the wrapper's program
    monkeypatch.setattr(sharding, "rules", lambda *a, **kw: traces.append(1) or rules(*a, **kw))
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (2, 8, 2, 4)) for x in ks)
    ids = jnp.array([[0] * 5 + [1] * 3, [0] * 8], jnp.int32)
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids))
    jax.clear_caches()   # (a test before it in this process may have traced these shapes)
    first = sharding.sharded_attention(spec, q, k, v, mesh=mesh, batch="data")
    assert len(traces) == 1
    flipped = spec.replace(mask=masks.causal() & masks.segments(ids[::-1]))
    again = sharding.sharded_attention(flipped, q, k, v, mesh=mesh, batch="data")
    assert len(traces) == 1  # (new arrays, the same program)
    listed = sharding.sharded_attention(flipped, q, k, v, mesh=mesh, batch=["data"])
    assert jnp.allclose(first.out, fnattn.attention(spec, q, k, v).out, atol=1e-6)
    for res in (again, listed):
        assert jnp.allclose(res.out, fnattn.attention(flipped, q, k, v).out, atol=1e-6)
