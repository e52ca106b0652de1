"""Window and chunk sizes as data: masks.sliding_window(left=...) and masks.chunked(...)
with an integer array (a traced scalar, one per layer inside lax.scan, or one per batch
row), and masks.NO_WINDOW for the global layers.

Under jax.jit with the sizes as arguments: the reference, the XLA flash lowering and
the dense XLA lowering against the same masks with static ints (forward and
gradients) and a float64 NumPy attention; a 3-layer lax.scan over local and global
layers against the unrolled static layers; per-row windows against per-row static
calls; the tile classes (hence the tiles visited) equal the static ones; static ints
keep their array-free masks and their programs; and bad sizes are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_attention import np_attention

import fnattn
from fnattn import AttentionSpec, XlaBlockSizes, masks

B, T, HQ, HKV, D = 2, 37, 4, 2, 8
BLOCKS = XlaBlockSizes(8, 8)


def qkv(seed=0, Tq=T, Tk=T):
    rs = np.random.default_rng(seed)
    return (jnp.asarray(rs.standard_normal((B, Tq, HQ, D)), jnp.float32),
            jnp.asarray(rs.standard_normal((B, Tk, HKV, D)), jnp.float32),
            jnp.asarray(rs.standard_normal((B, Tk, HKV, D)), jnp.float32))


def out_and_grads(spec, q, k, v, fn=fnattn.attention):
    def loss(q, k, v):
        res = fn(spec, q, k, v)
        row = res.out.shape[1:]  # the same weights in every batch row
        w = jnp.cos(jnp.arange(np.prod(row), dtype=jnp.float32)).reshape(row)
        return jnp.sum(res.out * w), res
    (_, res), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return res.out, res.lse, g


def window(w):
    return masks.causal() & masks.sliding_window(left=w)


def chunk(c):
    return masks.causal() & masks.chunked(c)


KINDS = {"window": window, "chunk": chunk,
         "two_sided": lambda w: masks.sliding_window(left=w, right=w // 2 if isinstance(
             w, int) else w // 2)}


@pytest.mark.parametrize("impl,fn", [("xla", fnattn.attention), ("xla", fnattn.flash),
                                     ("reference", fnattn.attention)],
                         ids=["attention-xla", "flash-xla", "reference"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_traced_size_equals_the_static_one(impl, fn, kind):
    """fnattn.attention's XLA lowering (dense at these sizes), fnattn.flash's
    blockwise XLA loops (which skip tiles) and the reference."""
    make = KINDS[kind]
    q, k, v = qkv()

    @jax.jit
    def traced(size, q, k, v):
        return out_and_grads(AttentionSpec(mask=make(size), impl=impl, block_sizes=BLOCKS),
                             q, k, v, fn)

    static = jax.jit(lambda spec, q, k, v: out_and_grads(spec, q, k, v, fn))
    for size in (1, 5, 16, 40):
        got = traced(jnp.int32(size), q, k, v)
        want = static(AttentionSpec(mask=make(size), impl=impl, block_sizes=BLOCKS), q, k, v)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-6)
    # And against float64 NumPy on the materialized static mask.
    dense = np.asarray(masks.materialize(make(5), B, HQ, T, T))
    ref = np_attention(np.asarray(q), np.asarray(k), np.asarray(v), mask=dense)[0]
    np.testing.assert_allclose(traced(jnp.int32(5), q, k, v)[0], ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("make", [window, chunk], ids=["window", "chunk"])
def test_no_window_is_the_global_layer(make):
    q, k, v = qkv(1)
    f = jax.jit(lambda s, q, k, v: fnattn.attention(
        AttentionSpec(mask=make(s), impl="xla", block_sizes=BLOCKS), q, k, v).out)
    causal = jax.jit(lambda q, k, v: fnattn.attention(
        AttentionSpec(mask=masks.causal(), impl="xla", block_sizes=BLOCKS), q, k, v).out)
    np.testing.assert_allclose(f(jnp.int32(masks.NO_WINDOW), q, k, v), causal(q, k, v),
                               atol=2e-6)


def test_one_size_per_batch_row():
    q, k, v = qkv(2)
    sizes = jnp.array([3, 11], jnp.int32)
    for make in (window, chunk):
        got = jax.jit(lambda s, q, k, v: out_and_grads(
            AttentionSpec(mask=make(s), impl="xla", block_sizes=BLOCKS), q, k, v,
            fnattn.flash))(sizes, q, k, v)
        for b in range(B):
            want = jax.jit(lambda q, k, v, size=int(sizes[b]): out_and_grads(
                AttentionSpec(mask=make(size), impl="xla", block_sizes=BLOCKS), q, k, v))(
                    q[b:b + 1], k[b:b + 1], v[b:b + 1])
            np.testing.assert_allclose(got[0][b:b + 1], want[0], atol=2e-6)
            for g, gw in zip(got[2], want[2]):
                np.testing.assert_allclose(g[b:b + 1], gw, atol=2e-5)


def test_scanned_local_and_global_layers_equal_the_unrolled_static_layers():
    """Three layers (window 4, global, window 9) in one lax.scan with the windows as
    xs; the unrolled form builds each layer's static mask. Forward and gradients."""
    q, k, v = qkv(3)
    windows = [4, None, 9]
    xs = jnp.array([masks.NO_WINDOW if w is None else w for w in windows], jnp.int32)
    wq = jnp.asarray(np.random.default_rng(4).standard_normal((3, D, D)) / 3, jnp.float32)

    def layer(x, w, mask):
        spec = AttentionSpec(mask=mask, impl="xla", block_sizes=BLOCKS)
        return x + fnattn.flash(spec, x @ w, k, v).out   # the blockwise XLA loops

    def scanned(x, wq):
        return jax.lax.scan(lambda x, a: (layer(x, a[1], window(a[0])), None),
                            x, (xs, wq))[0]

    def unrolled(x, wq):
        for i, w in enumerate(windows):
            x = layer(x, wq[i], masks.causal() if w is None else window(w))
        return x

    loss = lambda f: lambda x, wq: jnp.sum(jnp.sin(f(x, wq)))  # noqa: E731
    a = jax.jit(jax.value_and_grad(loss(scanned), argnums=(0, 1)))(q, wq)
    b = jax.jit(jax.value_and_grad(loss(unrolled), argnums=(0, 1)))(q, wq)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("make", [window, chunk], ids=["window", "chunk"])
def test_tiles_visited_equal_the_static_masks(make):
    """The classes computed from the traced size (which the flash lowerings turn into
    their visiting lists) are the static mask's, EMPTY tiles and all."""
    for size in (3, 8, 20):
        got = jax.jit(lambda s: masks.block_classes(make(s), B, HQ, 61, 61, 8, 8))(
            jnp.int32(size))
        want = masks.block_classes_static(make(size), B, HQ, 61, 61, 8, 8)
        np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)
        assert (want == masks.EMPTY).sum() > 0
    per_row = jax.jit(lambda s: masks.block_classes(make(s), B, HQ, 61, 61, 8, 8))(
        jnp.array([3, 20], jnp.int32))
    for b, size in enumerate((3, 20)):
        np.testing.assert_array_equal(
            per_row[b], masks.block_classes_static(make(size), 1, HQ, 61, 61, 8, 8)[0])


def test_static_ints_keep_their_array_free_masks_and_programs():
    assert type(masks.sliding_window(4)) is masks.SlidingWindow
    assert type(masks.chunked(4)) is masks.Chunked
    assert jax.tree_util.tree_leaves(window(4)) == []
    assert type(masks.sliding_window(jnp.int32(4))) is masks.SlidingWindowArray
    q, k, v = qkv()
    f = jax.jit(lambda q, k, v: fnattn.attention(
        AttentionSpec(mask=window(4), impl="xla", block_sizes=BLOCKS), q, k, v).out)
    g = jax.jit(lambda q, k, v: fnattn.attention(
        AttentionSpec(mask=window(np.int64(4).item()), impl="xla", block_sizes=BLOCKS),
        q, k, v).out)
    assert f.lower(q, k, v).as_text() == g.lower(q, k, v).as_text()


def test_context_attention_takes_a_traced_window():
    """fnattn.context.attention over a 4-way sequence axis (emulated with vmap) with
    the window traced: the rows of fnattn.attention on the whole sequence."""
    N, L = 4, 8
    q, k, v = qkv(5, Tq=N * L, Tk=N * L)

    def split(x):  # (B, N*L, H, D) -> (N, B, L, H, D) in the contiguous layout
        return jnp.moveaxis(x.reshape(B, N, L, *x.shape[2:]), 1, 0)

    @jax.jit
    def ring(w, q, k, v):
        spec = AttentionSpec(mask=window(w), impl="xla", block_sizes=BLOCKS)
        return jax.vmap(lambda q, k, v: fnattn.context.attention(spec, q, k, v,
                                                                 axis_name="seq").out,
                        axis_name="seq")(split(q), split(k), split(v))

    for w in (3, 13):
        got = ring(jnp.int32(w), q, k, v)
        want = fnattn.attention(AttentionSpec(mask=window(w)), q, k, v).out
        np.testing.assert_allclose(got, split(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("make,message", [
    (lambda: masks.sliding_window(left=jnp.float32(3)),
     "sliding_window: an array left must be an integer scalar or a (batch,) integer array "
     "(one size per batch row); got float32[]"),
    (lambda: masks.chunked(jnp.zeros((2, 3), jnp.int32)),
     "chunked: an array size must be an integer scalar or a (batch,) integer array (one size "
     "per batch row); got int32[2,3]"),
])
def test_bad_sizes_are_refused(make, message):
    with pytest.raises(TypeError) as info:
        make()
    assert str(info.value) == message


def test_a_size_per_row_must_match_the_batch():
    q, k, v = qkv()
    spec = AttentionSpec(mask=window(jnp.array([1, 2, 3], jnp.int32)))
    with pytest.raises(ValueError, match=r"sliding_window: an array left must have shape \(\) "
                                         r"or \(batch,\)=\(2,\); got \(3,\)"):
        jax.jit(fnattn.attention)(spec, q, k, v)


# ----------------------------------------------------------------------------------
# The Pallas kernels: interpret mode against the reference, lowering for cuda and tpu
# ----------------------------------------------------------------------------------


def _pallas_cases():
    """(name, mask maker from a size array, the size arrays)."""
    return [("window", window, jnp.int32(5)),
            ("window_per_row", window, jnp.array([3, 40], jnp.int32)),
            ("chunk", chunk, jnp.int32(16))]


def _interpret_against_reference(lowering, block_sizes, Tq, Tk, Hq, Hkv, D, dtype, tol):
    from fnattn import core
    rs = np.random.default_rng(7)
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), dtype)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), dtype)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), dtype)
    table = (("default", lowering),)

    def run(f, size, make):
        def loss(q, k, v):
            res = f(AttentionSpec(mask=make(size), block_sizes=block_sizes), q, k, v)
            return jnp.sum(res.out.astype(jnp.float32) ** 2), res
        (_, res), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return res.out, res.lse, g

    kernel = lambda s, q, k, v: core.run(s, q, k, v, fn="flash", table=table)  # noqa: E731
    for name, make, size in _pallas_cases():
        got = jax.jit(lambda s: run(kernel, s, make))(size)
        want = jax.jit(lambda s: run(fnattn.reference, s, make))(size)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, atol=tol * max(1.0, np.abs(b).max()), rtol=tol,
                                       err_msg=name)


def test_triton_interpreted_takes_traced_sizes():
    from lowering import cheap_compiles
    from fnattn.flash import triton
    with cheap_compiles():
        _interpret_against_reference(triton.INTERPRET_LOWERING,
                                     triton.TritonBlockSizes(*(16,) * 6), 41, 41, 2, 1, 16,
                                     jnp.float32, 2e-5)


def test_mosaic_tpu_interpreted_takes_traced_sizes():
    from lowering import cheap_compiles
    from fnattn.flash import mosaic
    with cheap_compiles():
        _interpret_against_reference(mosaic.INTERPRET_LOWERING,
                                     mosaic.MosaicBlockSizes(*(128,) * 6), 200, 200, 2, 1,
                                     16, jnp.float32, 2e-5)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower_with_traced_sizes(platform):
    """The Triton (cuda) and Mosaic (tpu) forward and backward kernels lower with
    the window and chunk sizes as jit arguments, one per batch row."""
    import re

    from fnattn import core, xla
    from fnattn.flash import mosaic, triton
    from lowering import target
    lowering = triton.LOWERING if platform == "cuda" else mosaic.LOWERING
    table = (("default", xla.DENSE), (platform, lowering))
    q = jax.ShapeDtypeStruct((B, 512, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, 512, 2, 128), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((B,), jnp.int32)
    for make in (window, chunk):
        def loss(s, q, k, v):
            res = core.run(AttentionSpec(mask=make(s)), q, k, v, fn="flash", table=table)
            return jnp.sum(res.out.astype(jnp.float32))
        with target(platform):
            text = jax.jit(jax.grad(loss, argnums=(1, 2, 3))).trace(sizes, q, kv, kv).lower(
                lowering_platforms=(platform,)).as_text()
        if platform == "cuda":
            assert "fnattn_flash_fwd" in text and "fnattn_flash_dkdv" in text
        else:
            names = set(re.findall(r'kernel_name = "(\w+)"', text))
            assert {"fnattn_flash_mosaic_fwd", "fnattn_flash_mosaic_dkv"} <= names, names


def test_mosaic_gpu_kernel_lowers_with_traced_sizes():
    """The Mosaic GPU forward lowers for cuda with the sizes as jit arguments (read
    as one scalar per batch row, like lengths)."""
    pytest.importorskip("absl")
    from fnattn import core
    from fnattn.flash import mosaic_gpu
    from lowering import gpu_target
    q = jax.ShapeDtypeStruct((B, 1000, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, 1000, 2, 128), jnp.bfloat16)
    table = (("default", mosaic_gpu.LOWERING),)
    for make, size in ((window, jax.ShapeDtypeStruct((), jnp.int32)),
                       (window, jax.ShapeDtypeStruct((B,), jnp.int32)),
                       (chunk, jax.ShapeDtypeStruct((B,), jnp.int32))):
        f = jax.jit(lambda s, q, k: core.run(AttentionSpec(mask=make(s)), q, k, k, fn="flash",
                                             table=table).out)
        with gpu_target():
            text = f.trace(size, q, k).lower(lowering_platforms=("cuda",)).as_text()
        assert "custom_call @mosaic_gpu" in text


def test_mosaic_gpu_gradient_lowers_with_traced_sizes():
    """The Mosaic GPU backward (``mosaic_gpu_bwd``) lowers beside its forward with
    the sizes per batch row as jit arguments: two Mosaic GPU custom calls."""
    pytest.importorskip("absl")
    import re

    from fnattn import core
    from fnattn.flash import mosaic_gpu_bwd
    from lowering import gpu_target
    q = jax.ShapeDtypeStruct((B, 1000, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, 1000, 2, 128), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((B,), jnp.int32)
    for make in (window, chunk):
        def loss(s, q, k, v):
            res = core.run(AttentionSpec(mask=make(s)), q, k, v, fn="flash",
                           table=(("default", mosaic_gpu_bwd.LOWERING),))
            return jnp.sum(res.out.astype(jnp.float32)) + jnp.sum(res.lse)
        with gpu_target():
            text = jax.jit(jax.grad(loss, argnums=(1, 2, 3))).trace(sizes, q, k, k).lower(
                lowering_platforms=("cuda",)).as_text()
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2


def test_mosaic_gpu_interpreted_takes_traced_sizes():
    import functools

    from fnattn.flash import mosaic_gpu
    from fnattn._dispatch import Lowering
    from mosaic_gpu_interpreter import compile_once, reset_after_failure
    interpreted = Lowering("flash-mosaic-gpu-interpret",
                           functools.partial(mosaic_gpu.forward,
                                             interpret=mosaic_gpu.interpret_params()),
                           mosaic_gpu.LOWERING.bwd)
    from fnattn import core
    rs = np.random.default_rng(8)
    q = jnp.asarray(rs.standard_normal((B, 128, 2, 64)), jnp.float16)
    k = jnp.asarray(rs.standard_normal((B, 128, 2, 64)), jnp.float16)
    v = jnp.asarray(rs.standard_normal((B, 128, 2, 64)), jnp.float16)
    small = mosaic_gpu.MosaicGpuBlockSizes(block_q=64, block_k=64, max_concurrent_steps=2)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    with compile_once():
        for make, size in ((window, jnp.array([5, 70], jnp.int32)),
                           (chunk, jnp.int32(48))):
            try:
                got = jax.jit(lambda s: core.run(
                    AttentionSpec(mask=make(s), block_sizes=small), q, k, v, fn="flash",
                    table=(("default", interpreted),)))(size)
            except Exception:
                reset_after_failure()
                raise
            want = jax.jit(lambda s: fnattn.reference(AttentionSpec(mask=make(s)),
                                                      *(x.astype(jnp.float32)
                                                        for x in (q, k, v))))(size)
            np.testing.assert_allclose(f32(got.out), f32(want.out), atol=2e-2, rtol=2e-2)
            np.testing.assert_allclose(f32(got.lse), f32(want.lse), atol=2e-2, rtol=2e-2)
