"""Window and chunk sizes as data in the serving variants: fnattn.decode and
decode_with_update with masks.sliding_window / masks.chunked given an int array
(a traced scalar, one per layer inside lax.scan, or one per row) and
masks.NO_WINDOW for global layers, through the XLA lowering.

Under jax.jit with the sizes as arguments: the traced size equals the static
one (forward and gradients, the one-pass and the looped forms); NO_WINDOW equals
the causal mask; a 3-layer lax.scan over local and global layers equals the
unrolled static calls; NaN in the keys a window hides never reaches the
outputs; impl="pallas" refuses traced sizes, and impl="auto" lowers them to XLA
for cuda and tpu while static sizes keep their kernels."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowering import target

import fnattn
from fnattn import AttentionSpec, masks
from fnattn.decoding import DecodeBlockSizes
from fnattn.decoding.update import decode_with_update

B, S, HQ, HKV, D, TQ = 2, 48, 4, 2, 8, 3
LENGTHS = jnp.array([41, 13], jnp.int32)


def window(w):
    return masks.causal() & masks.sliding_window(left=w)


def chunk(c):
    return masks.causal() & masks.chunked(c)


def cache(seed=0):
    rs = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rs.standard_normal(s), jnp.float32)  # noqa: E731
    return f(B, TQ, HQ, D), f(B, S, HKV, D), f(B, S, HKV, D)


def out_and_dq(spec, q, k, v, lengths=LENGTHS):
    def loss(q):
        res = fnattn.decode(spec, q, k, v, kv_lengths=lengths)
        return jnp.sum(jnp.sin(res.out)), res
    (_, res), dq = jax.value_and_grad(loss, has_aux=True)(q)
    return res.out, res.lse, dq


@pytest.mark.parametrize("blocks", [None, DecodeBlockSizes(block_k=16)],
                         ids=["one-pass", "looped"])
@pytest.mark.parametrize("make", [window, chunk], ids=["window", "chunk"])
def test_decode_traced_size_equals_the_static_one(make, blocks):
    q, k, v = cache()
    traced = jax.jit(lambda s, q, k, v: out_and_dq(
        AttentionSpec(mask=make(s), block_sizes=blocks), q, k, v))
    static = jax.jit(out_and_dq, static_argnums=0)
    for size in (1, 5, 16, 40):
        got = traced(jnp.int32(size), q, k, v)
        want = static(AttentionSpec(mask=make(size), block_sizes=blocks), q, k, v)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-6)
    # NO_WINDOW is the global layer: the causal mask
    got = traced(jnp.int32(masks.NO_WINDOW), q, k, v)
    want = static(AttentionSpec(mask=masks.causal(), block_sizes=blocks), q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-6)


def test_decode_one_size_per_row():
    q, k, v = cache(1)
    sizes = jnp.array([4, 9], jnp.int32)
    got = jax.jit(lambda s, q, k, v: out_and_dq(AttentionSpec(mask=window(s)), q, k, v))(
        sizes, q, k, v)
    for b in range(B):
        want = jax.jit(out_and_dq, static_argnums=0)(
            AttentionSpec(mask=window(int(sizes[b]))), q[b:b + 1], k[b:b + 1], v[b:b + 1],
            LENGTHS[b:b + 1])
        for a, w in zip(got, want):
            np.testing.assert_allclose(a[b:b + 1], w, atol=2e-6, rtol=2e-6)


def test_decode_with_update_traced_size_equals_the_static_one():
    q, k, v = cache(2)
    kc, vc = k.at[:, 30:].set(0.0), v.at[:, 30:].set(0.0)
    lengths = jnp.array([30, 7], jnp.int32)   # before the TQ new tokens

    def step(spec, q, k, v, kc, vc):
        res, kc, vc = decode_with_update(spec, q, k[:, :TQ], v[:, :TQ], kc, vc,
                                         kv_lengths=lengths)
        return res.out, kc, vc

    traced = jax.jit(lambda s, *a: step(AttentionSpec(mask=chunk(s)), *a))
    static = jax.jit(step, static_argnums=0)
    for size in (2, 8, masks.NO_WINDOW):
        want_mask = masks.causal() if size == masks.NO_WINDOW else chunk(size)
        got = traced(jnp.int32(size), q, k, v, kc, vc)
        want = static(AttentionSpec(mask=want_mask), q, k, v, kc, vc)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-6)


def test_scanned_layers_equal_the_unrolled_static_calls():
    """Three layers (window 4, global, window 9) in one lax.scan over their
    windows and caches; the unrolled form builds each layer's static mask."""
    q, k, v = cache(3)
    windows = [4, None, 9]
    xs = jnp.array([masks.NO_WINDOW if w is None else w for w in windows], jnp.int32)
    ks = jnp.stack([k, k * 0.5, -k])
    vs = jnp.stack([v, v[:, ::-1], v * 2])
    wq = jnp.asarray(np.random.default_rng(4).standard_normal((3, D, D)) / 3, jnp.float32)

    def layer(x, w, k, v, mask):
        return x + fnattn.decode(AttentionSpec(mask=mask), x @ w, k, v,
                                 kv_lengths=LENGTHS).out

    def scanned(x, wq):
        return jax.lax.scan(lambda x, a: (layer(x, a[1], a[2], a[3], window(a[0])), None),
                            x, (xs, wq, ks, vs))[0]

    def unrolled(x, wq):
        for i, w in enumerate(windows):
            x = layer(x, wq[i], ks[i], vs[i], masks.causal() if w is None else window(w))
        return x

    loss = lambda f: lambda x, wq: jnp.sum(jnp.sin(f(x, wq)))  # noqa: E731
    a = jax.jit(jax.value_and_grad(loss(scanned), argnums=(0, 1)))(q, wq)
    b = jax.jit(jax.value_and_grad(loss(unrolled), argnums=(0, 1)))(q, wq)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("blocks", [None, DecodeBlockSizes(block_k=16)],
                         ids=["one-pass", "looped"])
def test_nan_outside_the_window_never_reaches_the_outputs(blocks):
    q, k, v = cache(5)
    w = 6   # sequence 0 (41 keys) sees positions 32.. at most; poison 0..31
    kn, vn = k.at[0, :32].set(jnp.nan), v.at[0, :32].set(jnp.inf)
    f = jax.jit(lambda s, q, k, v: out_and_dq(AttentionSpec(mask=window(s),
                                                            block_sizes=blocks), q, k, v))
    got, want = f(jnp.int32(w), q, kn, vn), f(jnp.int32(w), q, k, v)
    for a, b in zip(got, want):
        assert bool(jnp.all(jnp.isfinite(a)))
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-6)


def test_pallas_refuses_traced_sizes():
    q, k, v = cache()
    spec = AttentionSpec(mask=window(jnp.int32(4)), impl="pallas")
    with pytest.raises(NotImplementedError, match=r"sizes given as arrays.*Pallas decode "
                       r"kernels.*fnattn/decoding/xla\.py.*impl='auto'"):
        fnattn.decode(spec, q, k, v, kv_lengths=LENGTHS)
    with pytest.raises(ValueError, match="shape \\(\\) or \\(batch,\\)"):
        fnattn.decode(AttentionSpec(mask=window(jnp.array([1, 2, 3]))), q, k, v,
                      kv_lengths=LENGTHS)


KERNELS = {"cuda": r"triton|mosaic_gpu", "tpu": r"tpu_custom_call"}


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_lowers_traced_sizes_to_xla_for_cuda_and_tpu(platform):
    """impl="auto": a traced window has no kernel custom call in the program
    lowered for cuda and tpu; the same static window keeps its kernel."""
    q, k, v = (x.astype(jnp.bfloat16) for x in cache())

    def lowered(f, *args):
        with target(platform):
            return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()

    traced = lowered(lambda s, q, k, v: fnattn.decode(
        AttentionSpec(mask=window(s)), q, k, v, kv_lengths=LENGTHS).out,
        jnp.int32(4), q, k, v)
    static = lowered(lambda q, k, v: fnattn.decode(
        AttentionSpec(mask=window(4)), q, k, v, kv_lengths=LENGTHS).out, q, k, v)
    assert not re.search(KERNELS[platform], traced)
    assert re.search(KERNELS[platform], static)
