"""Fuzzed global positions and context parallelism.

* ``masks.at_positions`` with random (unsorted, repeated) positions: the tile
  classes that block skipping uses are sound (an EMPTY tile holds no allowed
  pair, a FULL tile no masked one), and flash at those positions equals the
  reference.
* ``fnattn.context.attention`` over random axis sizes, layouts, strategies,
  mask compositions (segments, lengths, prefix-LM, array masks, windows...),
  GQA ratios, sinks, soft-cap and dropout equals ``fnattn.attention`` on the
  whole sequence. The mesh axis is emulated with ``jax.vmap(axis_name=...)``,
  under which ``ppermute``, ``all_gather`` and ``axis_index`` mean what they
  mean inside ``shard_map``, so hundreds of "devices" cost one process; and so
  do its derivatives, reverse and forward mode, against those on the whole
  sequence (on 8 real devices: ``tests/multi_device/context_checks.py``).
* ``fnattn.context.decode`` over a cache split along emulated devices, with
  every band mask, random lengths and starts and NaN outside the sequences,
  equals ``fnattn.decode`` on the whole cache, forward and gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import fnattn
from fnattn import AttentionSpec, masks, position_bias
from fnattn.context.decode import decode as context_decode
from strategies import assert_out_lse, examples, gqa_heads, mask_trees

MASKS = ("causal", "full", "window", "chunked", "segments", "lengths", "prefix", "array", "fn")


@st.composite
def positioned_masks(draw):
    B, Tq, Tk = draw(st.integers(1, 2)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
    rs = np.random.default_rng(draw(st.integers(0, 2**16)))
    span = draw(st.sampled_from([4, 16, 64]))
    q_pos = rs.integers(0, span, (B, Tq) if draw(st.booleans()) else (Tq,))
    kv_pos = rs.integers(0, span, (B, Tk) if draw(st.booleans()) else (Tk,))
    if draw(st.booleans()):  # sorted positions, as shards of a sequence have
        q_pos, kv_pos = np.sort(q_pos, -1), np.sort(kv_pos, -1)
    inner = draw(mask_trees(B, Tq, Tk, H=2, kinds=MASKS))
    m = masks.at_positions(inner, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32))
    return m, B, Tq, Tk, draw(st.integers(1, 5)), draw(st.integers(1, 5))


@given(positioned_masks())
def test_tile_classes_at_positions_are_sound(problem):
    m, B, Tq, Tk, bq, bk = problem
    dense = np.broadcast_to(np.asarray(masks.materialize(m, B, 2, Tq, Tk)), (B, 2, Tq, Tk))
    classes = np.asarray(masks.block_classes(m, B, 2, Tq, Tk, bq, bk))
    classes = np.broadcast_to(classes, (B, 2) + classes.shape[2:])
    for i in range(classes.shape[2]):
        for j in range(classes.shape[3]):
            tile = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            c = classes[:, :, i, j]
            assert not tile[c == masks.EMPTY].any()
            assert tile[c == masks.FULL].all()


@examples(6)
@given(positioned_masks(), st.integers(0, 100))
def test_flash_at_positions_equals_the_reference(problem, seed):
    m, B, Tq, Tk, bq, bk = problem
    rs = np.random.default_rng(seed)
    q = jnp.asarray(rs.standard_normal((B, Tq, 2, 4)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, 1, 4)), jnp.float32)
    spec = AttentionSpec(mask=m, block_sizes=fnattn.XlaBlockSizes(bq, bk))
    res = jax.jit(fnattn.attention)(spec, q, k, k)
    ref = fnattn.reference(spec, q, k, k)
    np.testing.assert_allclose(res.out, ref.out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(res.lse, ref.lse, atol=2e-5, rtol=2e-5)


def _split(x, N, layout, axes, split_axis):
    """A global array reordered along ``axes`` and cut into N shards along
    ``split_axis``, stacked on a new leading axis."""
    for a in axes:
        x = fnattn.context.reorder(x, N, layout, axis=a)
    return jnp.stack(jnp.split(x, N, axis=split_axis))


@st.composite
def context_problems(draw):
    N = draw(st.sampled_from([1, 2, 3, 4]))
    layout = draw(st.sampled_from(fnattn.context.LAYOUTS))
    strategy = draw(st.sampled_from(["ring", "all_gather"]))
    per = 2 * draw(st.integers(1, 4)) if layout == "zigzag" else draw(st.integers(2, 7))
    B, T = draw(st.integers(1, 2)), N * per
    Hq, Hkv = draw(gqa_heads(max_kv=2, max_group=3))
    mask = draw(st.one_of(st.none(), mask_trees(B, T, T, H=Hq, kinds=MASKS)))
    return dict(N=N, layout=layout, strategy=strategy, B=B, T=T, Hq=Hq, Hkv=Hkv, mask=mask,
                sinks=draw(st.booleans()), softcap=draw(st.sampled_from([None, 5.0])),
                dropout=draw(st.sampled_from([0.0, 0.3])), seed=draw(st.integers(0, 100)),
                block=draw(st.integers(1, 8)), alibi=draw(st.booleans()))


def _setup(p):
    """``((q, k, v, sinks, slopes), whole, emulated, shard, gather)`` of a
    drawn problem: ``whole(q, k, v, sinks, slopes)`` is ``fnattn.attention`` on
    the whole sequence (ALiBi with ``slopes`` where drawn), ``emulated`` the
    same on ``N`` devices emulated by a named ``jax.vmap`` (taking
    ``shard``-ed q, k, v and the replicated sinks and slopes), and
    ``gather`` turns a stacked per-device result back into the whole one
    (``axis``: its sequence axis)."""
    N, layout, B, T = p["N"], p["layout"], p["B"], p["T"]
    rs = np.random.default_rng(p["seed"])
    q = jnp.asarray(rs.standard_normal((B, T, p["Hq"], 4)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, T, p["Hkv"], 4)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, T, p["Hkv"], 4)), jnp.float32)
    sinks = jnp.asarray(rs.standard_normal((p["Hq"],)), jnp.float32) if p["sinks"] else None
    slopes = jnp.asarray(rs.uniform(0.1, 1.0, (p["Hq"],)), jnp.float32) if p["alibi"] else None
    spec = AttentionSpec(mask=p["mask"], softcap=p["softcap"],
                         dropout_rate=p["dropout"],
                         dropout_key=jax.random.key(3) if p["dropout"] else None,
                         block_sizes=fnattn.XlaBlockSizes(p["block"], p["block"]))

    def with_(spec, sinks, slopes):
        return spec.replace(sinks=sinks, position_bias=None if slopes is None
                            else position_bias.alibi(slopes))

    def whole(q, k, v, sinks, slopes):
        return fnattn.attention(with_(spec, sinks, slopes), q, k, v)

    # Per-device mask leaves: (B, T) ids and (B, H, T, T) arrays are cut along
    # the sequence (an array mask keeps every key column); (B,) lengths are global.
    leaves, treedef = jax.tree_util.tree_flatten(p["mask"])
    local, axes = [], []
    for x in leaves:
        if x.ndim == 2:
            local.append(_split(x, N, layout, (1,), 1))
        elif x.ndim == 4:
            local.append(_split(x, N, layout, (2, 3), 2))
        else:
            local.append(x)
        axes.append(0 if x.ndim in (2, 4) else None)

    def device(q, k, v, sinks, slopes, leaves):
        s = with_(spec.replace(mask=jax.tree_util.tree_unflatten(treedef, leaves)), sinks,
                  slopes)
        return fnattn.context.attention(s, q, k, v, axis_name="seq", strategy=p["strategy"],
                                        layout=layout)

    def emulated(q, k, v, sinks, slopes):
        return jax.vmap(device, in_axes=(0, 0, 0, None, None, axes), axis_name="seq")(
            q, k, v, sinks, slopes, local)

    def shard(x, axis=1):
        return _split(x, N, layout, (axis,), axis)

    def gather(x, axis=1):
        return fnattn.context.restore(jnp.concatenate(list(x), axis=axis), N, layout, axis=axis)

    return (q, k, v, sinks, slopes), whole, emulated, shard, gather


@examples(8)
@given(context_problems())
def test_context_parallel_forward_equals_one_device(p):
    (q, k, v, *replicated), whole, emulated, shard, gather = _setup(p)
    want = jax.jit(whole)(q, k, v, *replicated)
    res = jax.jit(emulated)(shard(q), shard(k), shard(v), *replicated)
    np.testing.assert_allclose(gather(res.out), want.out, atol=3e-5, rtol=3e-5)
    np.testing.assert_allclose(gather(res.lse, 2), want.lse, atol=3e-5, rtol=3e-5)


@examples(5)
@given(context_problems())
def test_context_parallel_derivatives_equal_one_device(p):
    """Reverse mode (cotangents on out and lse) and forward mode, in q, k, v and
    the replicated sinks and ALiBi slopes (whose gradients JAX sums over the
    axis), against the same derivatives of attention on the whole sequence."""
    x, whole, emulated, shard, gather = _setup(p)
    rs = np.random.default_rng(p["seed"] + 1)
    draw = lambda a: None if a is None else jnp.asarray(  # noqa: E731
        rs.standard_normal(a.shape), jnp.float32)
    want = jax.jit(whole)(*x)
    d_out, d_lse, tangents = draw(want.out), draw(want.lse), [draw(a) for a in x]

    def pullback(f, x, cts):
        def outputs(*x):
            res = f(*x)
            return res.out, res.lse

        return jax.vjp(outputs, *x)[1](cts)

    xs = (shard(x[0]), shard(x[1]), shard(x[2]), *x[3:])
    got = jax.jit(pullback, static_argnums=0)(emulated, xs, (shard(d_out), shard(d_lse, 2)))
    ref = jax.jit(pullback, static_argnums=0)(whole, x, (d_out, d_lse))
    names = ("q", "k", "v", "sinks", "slopes")
    for n, (g, r) in enumerate(zip(got, ref)):
        if r is not None:
            np.testing.assert_allclose(g if n >= 3 else gather(g), r, atol=1e-4, rtol=1e-4,
                                       err_msg=f"gradient of {names[n]}")

    ts = (shard(tangents[0]), shard(tangents[1]), shard(tangents[2]), *tangents[3:])
    _, t_got = jax.jit(lambda x, t: jax.jvp(emulated, x, t))(xs, ts)
    _, t_ref = jax.jit(lambda x, t: jax.jvp(whole, x, t))(x, tuple(tangents))
    np.testing.assert_allclose(gather(t_got.out), t_ref.out, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(gather(t_got.lse, 2), t_ref.lse, atol=1e-4, rtol=1e-4)


@st.composite
def band_masks(draw):
    """The masks ``fnattn.context.decode`` splits exactly: none, full, causal,
    windows (either side open) and their & / | combinations."""
    side = st.one_of(st.none(), st.integers(0, 6))
    window = side.flatmap(lambda left: st.builds(
        masks.sliding_window, st.just(left), st.integers(0, 6) if left is None else side))
    leaf = st.one_of(st.just(masks.causal()), st.just(masks.full()), window)
    kind = draw(st.sampled_from(["none", "leaf", "and", "or"]))
    if kind == "none":
        return None
    if kind == "leaf":
        return draw(leaf)
    a, b = draw(leaf), draw(leaf)
    return a & b if kind == "and" else a | b


@examples(15)
@given(st.sampled_from([1, 2, 3, 4]), st.integers(1, 5), st.integers(1, 3), st.integers(1, 4),
       gqa_heads(max_kv=2, max_group=3), band_masks(), st.booleans(),
       st.sampled_from([None, 3.0]), st.sampled_from(["bthd", "bhtd"]),
       st.sampled_from(["auto", "xla"]), st.integers(0, 100))
def test_context_decode_equals_decode(N, per, B, Tq, heads, mask, with_sinks, softcap, layout,
                                      impl, seed):
    """``fnattn.context.decode`` with the cache's slots split over N emulated
    devices (a named ``jax.vmap``) equals ``fnattn.decode`` on the whole cache:
    out and lse on every device, and the gradients in q, both caches and the
    sinks (taken around the vmap, of the devices' mean: inside it a replicated
    loss would count each device's cotangent N times, as ``shard_map``'s
    varying-axes types do not). Lengths and starts are drawn anywhere in the
    cache (empty, shorter than Tq, over device boundaries); slots outside every
    sequence hold NaN."""
    (Hq, Hkv), S, D = heads, N * per, 4
    rs = np.random.default_rng(seed)
    starts = rs.integers(0, S + 1, B)
    lengths = rs.integers(0, S - starts + 1)
    q = rs.standard_normal((B, Tq, Hq, D))
    k, v = rs.standard_normal((2, B, S, Hkv, D))
    slot = np.arange(S)[None]
    outside = (slot < starts[:, None]) | (slot >= (starts + lengths)[:, None])
    k[outside], v[outside] = np.nan, np.nan
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    sinks = jnp.asarray(rs.standard_normal(Hq), jnp.float32) if with_sinks else None
    w = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    starts, lengths = jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32)
    spec = AttentionSpec(mask=mask, softcap=softcap, layout=layout, impl=impl)
    seq = 1 if layout == "bthd" else 2
    if layout == "bhtd":
        q, k, v, w = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, w))

    def whole(q, k, v, sinks):
        return fnattn.decode(spec.replace(sinks=sinks), q, k, v, kv_lengths=lengths,
                             kv_starts=starts)

    def devices(q, k, v, sinks):
        return jax.vmap(
            lambda k, v: context_decode(spec.replace(sinks=sinks), q, k, v, kv_lengths=lengths,
                                        kv_starts=starts, axis_name="seq"),
            axis_name="seq")(k, v)

    def shard(x):
        return jnp.stack(jnp.split(x, N, axis=seq))

    def loss(f, on_devices):
        def of(q, k, v, sinks):
            out = f(q, k, v, sinks).out.astype(jnp.float32)
            return jnp.sum((out.mean(0) if on_devices else out) * w)
        return of

    want = jax.jit(whole)(q, k, v, sinks)
    got = jax.jit(devices)(q, shard(k), shard(v), sinks)
    for n in range(N):
        assert_out_lse(got.out[n], got.lse[n], want.out, want.lse, tol=3e-5)
    argnums = (0, 1, 2) + ((3,) if with_sinks else ())
    g_want = jax.jit(jax.grad(loss(whole, False), argnums))(q, k, v, sinks)
    g_got = jax.jit(jax.grad(loss(devices, True), argnums))(q, shard(k), shard(v), sinks)
    for name, x, y in zip(("q", "k", "v", "sinks"), g_got, g_want):
        if name in ("k", "v"):
            x = jnp.concatenate(list(x), axis=seq)
            assert bool(jnp.isfinite(x).all()), f"gradient of {name}: not finite"
        np.testing.assert_allclose(x, y, atol=5e-5, rtol=5e-5, err_msg=f"gradient of {name}")
