"""fnattn.context on one device: layouts, positions, work counts, the errors of
context-parallel attention, and masks.at_positions. (Several devices:
tests/multi_device/context_checks.py; random problems:
property_tests/test_context_props.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import fnattn
from fnattn import AttentionSpec, masks
from fnattn.context import layouts

F32 = jnp.float32


@pytest.mark.parametrize("layout, order", [
    ("contiguous", list(range(12))),
    ("zigzag", [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]),
    ("striped", [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]),
])
def test_reorder_restore_and_positions(layout, order):
    x = jnp.arange(12)[None, :, None]
    r = fnattn.context.reorder(x, 3, layout)
    assert r[0, :, 0].tolist() == order
    assert (fnattn.context.restore(r, 3, layout) == x).all()
    # device r's global positions are its slice of the order
    for rank in range(3):
        got = fnattn.context.positions(layout, 4, rank, 3).tolist()
        assert got == order[4 * rank:4 * rank + 4]


def test_layout_errors():
    with pytest.raises(ValueError, match="divisible by 6"):
        fnattn.context.reorder(jnp.zeros((1, 8)), 3, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        fnattn.context.reorder(jnp.zeros((1, 8)), 2, "spiral")


def test_work_counts_tiles_per_device():
    # contiguous causal, 2 tile rows per device: device r computes its rows
    # against the 2r tile columns before it (4r tiles) and its diagonal (3)
    w = fnattn.context.work(masks.causal(), 512, 4, "contiguous", block=64)
    assert w.tolist() == [3, 7, 11, 15]
    for layout in ("zigzag", "striped"):
        w = fnattn.context.work(masks.causal(), 4096, 4, layout, block=128)
        assert w.max() / w.min() <= 1.1, (layout, w)
    # without a mask every tile is work, in every layout
    assert fnattn.context.work(None, 512, 4, "zigzag", block=64).tolist() == [16] * 4


def _one_device(fn):
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(None, "seq"),
                                 out_specs=P(None, "seq")))


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_one_device_equals_attention_with_gradients(strategy):
    rs = np.random.default_rng(0)
    q = jnp.asarray(rs.standard_normal((2, 16, 4, 8)), F32)
    k = jnp.asarray(rs.standard_normal((2, 16, 2, 8)), F32)
    ids = jnp.asarray(np.sort(rs.integers(0, 3, (2, 16)), 1), jnp.int32)
    sinks = jnp.asarray(rs.standard_normal((4,)), F32)

    def spec(ids):
        return AttentionSpec(mask=masks.causal() & masks.segments(ids), sinks=sinks,
                             softcap=10.0, block_sizes=fnattn.XlaBlockSizes(8, 8))

    def loss_cp(q, k, ids):
        res = fnattn.context.attention(spec(ids), q, k, k, axis_name="seq", strategy=strategy,
                                       layout="zigzag")
        return res.out.sum() + res.lse.sum()

    def grads(q, k, ids):
        return jax.grad(loss_cp, argnums=(0, 1))(q, k, ids)

    got = _one_device(grads)(q, k, ids)
    want = jax.grad(lambda q, k: (lambda r: r.out.sum() + r.lse.sum())(
        fnattn.attention(spec(ids), q, k, k)), argnums=(0, 1))(q, k)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def _call(spec, q, k, v=None, **kw):
    v = k if v is None else v
    return _one_device(lambda q, k, v: fnattn.context.attention(spec, q, k, v, axis_name="seq",
                                                                **kw).out)(q, k, v)


@pytest.mark.parametrize("spec, shapes, kw, error, message", [
    (AttentionSpec(), ((1, 8, 2, 4), (1, 8, 2, 4)), dict(strategy="tree"), ValueError,
     "strategy must be one of"),
    (AttentionSpec(), ((1, 8, 2, 4), (1, 8, 2, 4)), dict(layout="spiral"), ValueError,
     "layout must be one of"),
    (AttentionSpec(impl="cudnn"), ((1, 8, 2, 4), (1, 8, 2, 4)), {}, NotImplementedError,
     "impl='cudnn' has no context-parallel lowering"),
    (AttentionSpec(), ((1, 8, 2, 4), (1, 6, 2, 4)), {}, ValueError,
     "equally long shards.*8 query and 6 key"),
    (AttentionSpec(), ((1, 7, 2, 4), (1, 7, 2, 4)), dict(layout="zigzag"), ValueError,
     "must be even; got 7"),
    (AttentionSpec(bias=jnp.zeros((1, 2, 8, 5))), ((1, 8, 2, 4), (1, 8, 2, 4)), {},
     ValueError, "bias .* has 5 key columns; expected 1, the local key count L=8"),
    (AttentionSpec(mask=masks.segments(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 3),
                                                                          jnp.int32))),
     ((1, 8, 2, 4), (1, 8, 2, 4)), {}, ValueError, "kv_segment_ids must have shape"),
])
def test_errors_name_what_is_wrong(spec, shapes, kw, error, message):
    q = jnp.zeros(shapes[0], F32)
    k = jnp.zeros(shapes[1], F32)
    with pytest.raises(error, match=message):
        _call(spec, q, k, **kw)


def test_at_positions_reproduces_the_default_alignment_and_shifts_it():
    Tq, Tk = 3, 7
    m = masks.causal() & masks.sliding_window(2)
    default = masks.materialize(m, 1, 1, Tq, Tk)
    explicit = masks.at_positions(m, jnp.arange(Tq) + Tk - Tq, jnp.arange(Tk))
    np.testing.assert_array_equal(masks.materialize(explicit, 1, 1, Tq, Tk), default)
    # a shard of queries 10..12 against keys 8..14: the rows of the whole mask
    whole = np.asarray(masks.materialize(m, 1, 1, 16, 16))[0, 0]
    shard = masks.at_positions(m, jnp.arange(10, 13), jnp.arange(8, 15))
    np.testing.assert_array_equal(masks.materialize(shard, 1, 1, 3, 7)[0, 0],
                                  whole[10:13, 8:15])


def test_at_positions_passes_positions_to_lengths_and_from_fn():
    m = masks.lengths(q_lengths=jnp.array([11]), kv_lengths=jnp.array([9])) & masks.from_fn(
        lambda b, h, q, k: (q + k) % 2 == 0)
    got = masks.materialize(masks.at_positions(m, jnp.array([9, 10, 11]), jnp.array([6, 7, 8, 9])),
                            1, 1, 3, 4)
    # query 11 and key 9 fail the lengths; (q + k) even elsewhere
    assert np.asarray(got)[0, 0].astype(int).tolist() == [[0, 1, 0, 0], [1, 0, 1, 0],
                                                           [0, 0, 0, 0]]


@pytest.mark.parametrize("q_pos, kv_pos, error, message", [
    (jnp.arange(3.0), jnp.arange(4), TypeError, "q_positions must be integer"),
    (jnp.arange(3), jnp.arange(5), ValueError, r"kv_positions must have shape \(T,\)=\(4,\)"),
    (jnp.zeros((2, 3), jnp.int32), jnp.arange(4), ValueError, r"\(batch, T\)=\(1, 3\)"),
])
def test_at_positions_errors(q_pos, kv_pos, error, message):
    q = jnp.zeros((1, 3, 1, 4), F32)
    k = jnp.zeros((1, 4, 1, 4), F32)
    spec = AttentionSpec(mask=masks.at_positions(masks.causal(), q_pos, kv_pos))
    with pytest.raises(error, match=message):
        jax.jit(fnattn.attention)(spec, q, k, k)


def test_pieces_of_each_layout():
    assert layouts.pieces("contiguous", 4, 2, 3) == (layouts.Piece(0, 4, 8, 1),)
    assert layouts.pieces("striped", 4, 2, 3) == (layouts.Piece(0, 4, 2, 3),)
    assert layouts.pieces("zigzag", 4, 2, 3) == (layouts.Piece(0, 2, 4, 1),
                                                 layouts.Piece(2, 2, 6, 1))


@pytest.mark.parametrize("what, spec", [
    ("bias", AttentionSpec(bias=jnp.zeros((1, 1, 4, 4)))),
    ("mask operand 0", AttentionSpec(mask=masks.from_array(jnp.ones((1, 1, 4, 4), bool)))),
])
def test_local_query_by_key_blocks_are_refused_on_several_devices(what, spec):
    # With 2 devices, an array of this device's 4 query rows against only 4 key
    # columns cannot say which of the other device's keys its rows see: refused
    # (not sliced as if it held all 8). The mesh axis is emulated by vmap.
    q = jnp.zeros((2, 1, 4, 2, 4), F32)
    f = jax.vmap(lambda q: fnattn.context.attention(spec, q, q, q, axis_name="seq").out,
                 axis_name="seq")
    with pytest.raises(ValueError, match=f"{what} .* has 4 key columns; expected 1, the "
                                         "local key count L=4"):
        jax.jit(f)(q)


def test_array_mask_with_every_key_column_beside_local_segment_ids():
    """A mask that combines an array holding every key column (this device's rows
    against all N*L keys) with segment ids holding this device's L tokens: each
    part is checked against its own key count, and the result is one device's.
    (Found by the dev Hypothesis profile: the whole mask was checked against one
    key count, so no count fitted both parts.) The mesh axis is emulated by vmap;
    the gradients on 8 devices: tests/multi_device/context_checks.py."""
    N, B, T, H, D = 3, 2, 6, 2, 4
    rs = np.random.default_rng(33)
    q, k, v = (jnp.asarray(rs.standard_normal((B, T, H, D)), F32) for _ in range(3))
    dense = jnp.asarray(rs.random((B, 1, T, T)) < 0.7)
    ids = jnp.asarray([[0, 1, 1, 2, 2, 2], [0, 0, 0, 1, 2, 2]], jnp.int32)
    mask = masks.from_array(dense) & (masks.causal() | masks.segments(ids))
    spec = AttentionSpec(mask=mask, softcap=5.0, sinks=jnp.asarray([0.8, -0.3], F32))
    whole = jax.jit(fnattn.attention)(spec, q, k, v)

    L = T // N
    rows = lambda x, axis: jnp.stack(jnp.split(x, N, axis=axis))  # noqa: E731

    def device(q, k, v, dense, ids):
        local = masks.from_array(dense) & (masks.causal() | masks.segments(ids))
        return fnattn.context.attention(spec.replace(mask=local), q, k, v, axis_name="seq")

    res = jax.jit(jax.vmap(device, axis_name="seq"))(
        rows(q, 1), rows(k, 1), rows(v, 1), rows(dense, 2), rows(ids, 1))
    assert res.out.shape == (N, B, L, H, D)
    out = jnp.concatenate(list(res.out), axis=1)
    lse = jnp.concatenate(list(res.lse), axis=2)
    np.testing.assert_allclose(out, whole.out, atol=3e-5, rtol=3e-5)
    np.testing.assert_allclose(lse, whole.lse, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_derivatives_under_a_named_vmap(strategy):
    """``jax.vmap(..., axis_name=)`` emulates the mesh axis on one device: the
    gradients (taken around and inside the vmap), the jvp and a Hessian-vector
    product equal those of attention on the whole sequence, also with an unnamed
    vmap around the named one. (The ring's derivative maps hold its
    ``ppermute``s; they failed with "unbound axis name" when batched without
    the axis' name.)"""
    N, B, T, H, D = 2, 2, 8, 2, 4
    rs = np.random.default_rng(7)
    q, k, v, t = (jnp.asarray(rs.standard_normal((B, T, H, D)), F32) for _ in range(4))
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.asarray([0.5, -1.0], F32))
    rows = lambda x: jnp.stack(jnp.split(x, N, axis=1))  # noqa: E731
    whole = lambda x: jnp.concatenate(list(x), axis=1)  # noqa: E731

    def device(q, k, v):
        return fnattn.context.attention(spec, q, k, v, axis_name="seq", strategy=strategy).out

    def dense(q, k, v):
        return fnattn.attention(spec, q, k, v).out

    def loss(f):
        return lambda q, k, v: (jnp.sin(f(q, k, v)) ** 2).sum()

    emulated = jax.vmap(device, axis_name="seq")
    want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(q, k, v)
    around = jax.jit(jax.grad(loss(emulated), argnums=(0, 1, 2)))(rows(q), rows(k), rows(v))
    inside = jax.jit(jax.vmap(jax.grad(loss(device), argnums=(0, 1, 2)), axis_name="seq"))(
        rows(q), rows(k), rows(v))
    for got in (around, inside):
        for g, w in zip(got, want):
            np.testing.assert_allclose(whole(g), w, atol=2e-5, rtol=2e-5)

    _, t_got = jax.jit(lambda *x: jax.jvp(emulated, x, (rows(t),) * 3))(rows(q), rows(k), rows(v))
    _, t_want = jax.jvp(dense, (q, k, v), (t, t, t))
    np.testing.assert_allclose(whole(t_got), t_want, atol=2e-5, rtol=2e-5)

    def hvp(f, x):
        return jax.jvp(jax.grad(lambda q: loss(f)(q, x[1], x[2])), (x[0],), (x[3],))[1]

    np.testing.assert_allclose(
        whole(jax.jit(lambda *x: hvp(emulated, x))(rows(q), rows(k), rows(v), rows(t))),
        jax.jit(lambda *x: hvp(dense, x))(q, k, v, t), atol=2e-4, rtol=2e-4)

    # an unnamed vmap (over two problems) around the named one
    stacked = jax.vmap(jax.grad(loss(emulated), argnums=(0, 1, 2)))
    both = jax.jit(stacked)(*(jnp.stack([rows(x), rows(x)[:, ::-1]]) for x in (q, k, v)))
    for g, w in zip(both, want):
        np.testing.assert_allclose(whole(g[0]), w, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(whole(g[1]), w[::-1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_forward_mode_with_alibi_under_a_named_vmap(strategy):
    """The tangent of ALiBi attention on 4 emulated devices is finite and equals
    the whole sequence's. (It was NaN on some rows for each of these draws,
    5 of the 8 such seeds among the first 30: the flash XLA forward's running
    maximum carried a derivative, which JAX splits among the logits equal to
    it, and XLA:CPU computed the logits once with a fused multiply-add for the
    maximum and once without for the comparison, so that no logit equalled
    it: 0 / 0. The maximum is now a constant shift,
    ``fnattn._online.running_max``. Found by the context property tests.)"""
    N, T, Hq, D = 4, 8, 3, 4
    rows = lambda x: jnp.stack(jnp.split(x, N, axis=1))  # noqa: E731
    for seed in (0, 1, 2, 7, 13):
        rs = np.random.default_rng(seed)
        q = jnp.asarray(rs.standard_normal((1, T, Hq, D)), F32)
        k, v, t = (jnp.asarray(rs.standard_normal((1, T, 1, D)), F32) for _ in range(3))
        slopes = jnp.asarray(rs.uniform(0.1, 1.0, (Hq,)), F32)
        spec = AttentionSpec(position_bias=fnattn.position_bias.alibi(slopes), impl="xla",
                             block_sizes=fnattn.XlaBlockSizes(8, 8))

        def device(q, k, v):
            return fnattn.context.attention(spec, q, k, v, axis_name="seq",
                                            strategy=strategy).out

        emulated = jax.vmap(device, axis_name="seq")
        _, t_got = jax.jit(lambda v, t: jax.jvp(lambda v: emulated(rows(q), rows(k), v),
                                                (v,), (t,)))(rows(v), rows(t))
        _, t_want = jax.jit(lambda v, t: jax.jvp(
            lambda v: fnattn.attention(spec, q, k, v).out, (v,), (t,)))(v, t)
        np.testing.assert_allclose(jnp.concatenate(list(t_got), axis=1), t_want, atol=2e-5,
                                   rtol=2e-5, err_msg=f"seed {seed}")
