"""The batch/head partitioning rule of ``fnattn._partition`` on one device: which
mesh axes split what, the operands' roles, the shard's dropout seed. (The
compiled, multi-device behaviour is checked by
``tests/multi_device/jit_sharding_checks.py``.)"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import fnattn
from fnattn import AttentionSpec, _partition, dropout, masks
from fnattn._partition import Shard, Sizes

MESH = {"data": 2, "model": 2, "fsdp": 2}
Q, KV = ("b", None, "h", None), ("b", None, "k", None)


def test_choose_takes_the_axes_that_divide():
    sizes = Sizes(batch=6, q_heads=12, kv_heads=4)
    assert _partition.choose([Q, KV], [P("data", None, "model"), None], sizes, MESH) == (
        ("data",), ("model",))
    # q replicated: k decides; a sequence split is ignored (gathered)
    assert _partition.choose([Q, KV], [P(None, "fsdp"), P("data", None, "model")], sizes,
                             MESH) == (("data",), ("model",))
    # 4 kv heads split 4 ways; a batch of 6 is not split 4 ways, only 2
    assert _partition.choose([Q], [P(("data", "fsdp"), None, ("model", "fsdp"))], sizes,
                             MESH) == (("data",), ("model", "fsdp"))
    # a GQA group may not be cut: 3 kv heads are not split 2 ways
    assert _partition.choose([Q], [P("data", None, "model")], Sizes(2, 6, 3), MESH) == (
        ("data",), ())
    assert _partition.choose([Q], [P("data", None, "model")], sizes, MESH, allow="h") == (
        (), ("model",))


def test_partition_specs_and_rule():
    specs = _partition.partition_specs([Q, KV, ("h",), (None,)], ("data",), ("model",))
    assert [tuple(s) for s in specs] == [("data", None, "model", None),
                                         ("data", None, "model", None), ("model",), (None,)]
    rule = _partition.sharding_rule([Q, KV, ()], [("b", "h", None)], Sizes(2, 8, 1))
    # one kv head: no head factor is shared (the heads are never split)
    assert rule.operand_mappings[0][2] != rule.operand_mappings[1][2]
    assert rule.operand_mappings[2] == ()


def test_mask_and_bias_roles():
    sizes = Sizes(batch=3, q_heads=4, kv_heads=2)
    ids = jnp.zeros((3, 5), jnp.int32)
    mask = (masks.causal() & masks.segments(ids)) | ~masks.lengths(kv_lengths=jnp.ones(3, int))
    mask = mask & masks.from_array(jnp.ones((4, 5, 5), bool)) & masks.prefix_lm(jnp.ones(3, int))
    roles, allow = _partition.mask_roles(mask, sizes)
    assert roles == [("b", None), ("b", None), ("b",), ("h", None, None), ("b",)]
    assert allow == "bh"
    assert len(roles) == len(jax.tree_util.tree_leaves(mask))
    _, allow = _partition.mask_roles(masks.from_fn(lambda b, h, q, k: k <= q + b), sizes)
    assert allow == "h"
    _, allow = _partition.mask_roles(masks.from_fn(lambda b, h, q, k: k <= q), sizes)
    assert allow == "bh"
    assert _partition.bias_roles((3, 1, 5, 5), sizes) == (("b", None, None, None), "h")
    assert _partition.bias_roles((5, 5), sizes) == ((None, None), "bh")


def test_shard_seed_is_the_offset_seed():
    key = jax.random.key(11)
    seed = dropout.seed_from_key(key)
    got = _partition.fold_seed(seed, Shard(2, 2, 1, jnp.int32(6), jnp.int32(2)))
    want = dropout.seed_from_key(key, jnp.array([6, 2, 0, 0]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert _partition.fold_seed(seed, Shard(2, 2, 1)) is seed


def test_unsplit_call_composes_on_one_device():
    """On one device the wrapper changes nothing, under vmap and second-order
    gradients (which the XLA decode backward has)."""
    rs = np.random.default_rng(0)
    q = jnp.asarray(rs.standard_normal((2, 3, 1, 4, 8)), jnp.float32)
    kc = jnp.asarray(rs.standard_normal((2, 3, 16, 2, 8)), jnp.float32)
    lengths = jnp.array([16, 5, 9])

    def loss(q, kc):
        res = fnattn.decode(AttentionSpec(mask=masks.causal(), impl="xla"), q, kc, kc,
                            kv_lengths=lengths)
        return jnp.sum(res.out ** 2)

    hess = jax.jit(jax.vmap(jax.grad(lambda q, kc: jnp.sum(jax.grad(loss)(q, kc) ** 2))))
    assert hess(q, kc).shape == q.shape


def _explicit_mesh(n=1):
    return jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def test_explicit_context_mesh_on_one_device():
    """Under ``jax.set_mesh`` of a mesh with Explicit axes (``jax.make_mesh``'s
    default) flash and decode give what they give without a mesh, forward and
    gradients, in the Pallas interpreter. (The values then carry the mesh in
    their types, which the interpreter's state updates once refused with a
    ShardingTypeError; every variant goes through the same fnattn._partition.)"""
    rs = np.random.default_rng(3)
    q = jnp.asarray(rs.standard_normal((2, 16, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rs.standard_normal((2, 16, 2, 8)), jnp.float32) for _ in range(2))
    lengths = jnp.array([16, 5], jnp.int32)
    spec = AttentionSpec(mask=masks.causal(), impl="pallas")

    def loss(q, k, v):
        out = fnattn.attention(spec, q, k, v).out
        dec = fnattn.decode(spec, q[:, :1], k, v, kv_lengths=lengths).out
        return jnp.sum(out ** 2) + jnp.sum(dec ** 2)

    f = jax.value_and_grad(loss, argnums=(0, 1, 2))
    want = jax.jit(f)(q, k, v)
    with jax.set_mesh(_explicit_mesh()):
        got = jax.jit(f)(q, k, v)
        # outside jit too, on an array made under the mesh (its sharding names
        # the mesh; jax 0.11 once gave a scalar made like it that sharding)
        eager = fnattn.attention(spec.replace(impl="xla"), q + jnp.zeros(q.shape), k, v).out
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(
        fnattn.attention(spec.replace(impl="xla"), q, k, v).out), rtol=1e-5, atol=1e-5)


def test_traced_window_and_chunk_sizes_split_with_the_batch():
    sizes = Sizes(batch=3, q_heads=4, kv_heads=2)
    mask = (masks.causal() & masks.sliding_window(left=jnp.ones(3, jnp.int32), right=None)
            & masks.chunked(jnp.int32(4)))
    roles, allow = _partition.mask_roles(mask, sizes)
    assert roles == [("b",), ()] and allow == "bh"
