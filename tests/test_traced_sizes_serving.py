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


# ---------------------------------------------------------------------------------
# Paged: paged_attention, ragged_paged_attention (+ update); one size per call
# ---------------------------------------------------------------------------------

NP, PS, PPS = 16, 4, 8                     # pages, page size, pages per sequence
PLEN = jnp.array([29, 11], jnp.int32)
TABLE = jnp.arange(B * PPS, dtype=jnp.int32).reshape(B, PPS)
PBLOCKS = fnattn.PagedBlockSizes(block_k=4)   # one page per step: chunks to skip


def pools(seed=0):
    rs = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rs.standard_normal(s), jnp.float32)  # noqa: E731
    return f(B, TQ, HQ, D), f(HKV, NP, PS, D), f(HKV, NP, PS, D)


def paged_out_and_dq(spec, q, kp, vp):
    def loss(q):
        res = fnattn.paged_attention(spec, q, kp, vp, page_table=TABLE, kv_lengths=PLEN)
        return jnp.sum(jnp.sin(res.out)), res
    (_, res), dq = jax.value_and_grad(loss, has_aux=True)(q)
    return res.out, res.lse, dq


def ragged(spec, q, kp, vp):
    """Both sequences' TQ newest tokens, packed."""
    res = fnattn.ragged_paged_attention(
        spec, q.reshape(B * TQ, HQ, D), kp, vp, page_table=TABLE, context_lengths=PLEN,
        query_start_loc=jnp.arange(B + 1, dtype=jnp.int32) * TQ, num_seqs=jnp.int32(B))
    return res.out, res.lse


def ragged_update(spec, q, kp, vp):
    new = q[:, :, :HKV].reshape(B * TQ, HKV, D)
    res, kp, vp = fnattn.ragged_paged_attention_with_update(
        spec, q.reshape(B * TQ, HQ, D), new, -new, kp, vp, page_table=TABLE,
        context_lengths=PLEN, query_start_loc=jnp.arange(B + 1, dtype=jnp.int32) * TQ,
        num_seqs=jnp.int32(B))
    return res.out, kp, vp


@pytest.mark.parametrize("fn", [paged_out_and_dq, ragged, ragged_update],
                         ids=["paged", "ragged", "ragged-update"])
@pytest.mark.parametrize("make", [window, chunk], ids=["window", "chunk"])
def test_paged_traced_size_equals_the_static_one(make, fn):
    q, kp, vp = pools()
    traced = jax.jit(lambda s, *a: fn(AttentionSpec(mask=make(s), block_sizes=PBLOCKS), *a))
    static = jax.jit(fn, static_argnums=0)
    for size in (1, 6, 13, masks.NO_WINDOW):
        want_mask = masks.causal() if size == masks.NO_WINDOW else make(size)
        got = traced(jnp.int32(size), q, kp, vp)
        want = static(AttentionSpec(mask=want_mask, block_sizes=PBLOCKS), q, kp, vp)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("make", [window, chunk], ids=["window", "chunk"])
def test_paged_key_blocks_skipped_equal_the_static_ones(make):
    """The key chunks the XLA lowering visits (common.key_block_ranges) for a
    traced size are the static mask's, the ones a window leaves empty skipped."""
    from types import SimpleNamespace

    from fnattn.paged import common
    seq, row0 = jnp.array([0, 1], jnp.int32), jnp.zeros((2,), jnp.int32)
    rows, kv_len = jnp.array([TQ, TQ], jnp.int32), jnp.array([61, 30], jnp.int32)

    def ranges(mask, meta):
        cfg = SimpleNamespace(capacity=64, mask_treedef=jax.tree_util.tree_structure(mask),
                              mask=lambda: masks.from_treedef(
                                  jax.tree_util.tree_structure(mask)))
        return common.key_block_ranges(cfg, seq, row0, rows, kv_len - TQ, kv_len, 4,
                                       meta=meta)

    traced = jax.jit(lambda s: ranges(make(s), common.Meta(
        None, None, None, None, sizes=tuple(jax.tree_util.tree_leaves(make(s))))))
    for size in (3, 8, 20):
        got, want = traced(jnp.int32(size)), ranges(make(size), None)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        assert int(want[0][0]) > 0   # sequence 0 skips its first key blocks


def test_paged_scanned_layers_equal_the_unrolled_static_calls():
    q, kp, vp = pools(3)
    windows = [5, None, 2]
    xs = jnp.array([masks.NO_WINDOW if w is None else w for w in windows], jnp.int32)
    kps, vps = jnp.stack([kp, -kp, kp * 0.5]), jnp.stack([vp, vp * 2, -vp])
    wq = jnp.asarray(np.random.default_rng(4).standard_normal((3, D, D)) / 3, jnp.float32)

    def layer(x, w, kp, vp, mask):
        return x + fnattn.paged_attention(AttentionSpec(mask=mask, block_sizes=PBLOCKS), x @ w,
                                          kp, vp, page_table=TABLE, kv_lengths=PLEN).out

    def scanned(x, wq):
        return jax.lax.scan(lambda x, a: (layer(x, a[1], a[2], a[3], window(a[0])), None),
                            x, (xs, wq, kps, vps))[0]

    def unrolled(x, wq):
        for i, w in enumerate(windows):
            x = layer(x, wq[i], kps[i], vps[i], masks.causal() if w is None else window(w))
        return x

    loss = lambda f: lambda x, wq: jnp.sum(jnp.sin(f(x, wq)))  # noqa: E731
    a = jax.jit(jax.value_and_grad(loss(scanned), argnums=(0, 1)))(q, wq)
    b = jax.jit(jax.value_and_grad(loss(unrolled), argnums=(0, 1)))(q, wq)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, atol=2e-5, rtol=2e-5)


def test_paged_nan_outside_the_window_never_reaches_the_outputs():
    q, kp, vp = pools(5)
    # sequence 0 (29 keys, pages 0..7) with window 6 sees positions >= 20: poison
    # pages 0..3 (positions 0..15), one of them in a visited-free chunk, one not
    kn, vn = kp.at[:, :4].set(jnp.nan), vp.at[:, :4].set(jnp.inf)
    for blocks in (PBLOCKS, fnattn.PagedBlockSizes(block_k=32)):
        f = jax.jit(lambda s, *a: paged_out_and_dq(
            AttentionSpec(mask=window(s), block_sizes=blocks), *a))
        got, want = f(jnp.int32(6), q, kn, vn), f(jnp.int32(6), q, kp, vp)
        for a, b in zip(got, want):
            assert bool(jnp.all(jnp.isfinite(a)))
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-6)


def test_paged_refusals():
    q, kp, vp = pools()
    with pytest.raises(NotImplementedError, match=r"sizes given as arrays.*Pallas paged "
                       r"kernels.*fnattn/paged/xla\.py.*impl='auto'"):
        paged_out_and_dq(AttentionSpec(mask=window(jnp.int32(4)), impl="pallas"), q, kp, vp)
    with pytest.raises(ValueError, match="must be a scalar here"):
        ragged(AttentionSpec(mask=window(jnp.array([1, 2]))), q, kp, vp)


def test_paged_trees_take_traced_sizes():
    """A draft tree with a traced window equals the static window (the XLA lowering)."""
    q, kp, vp = pools()
    parents = jnp.array([[-1, 0, 0], [-1, 0, 1]], jnp.int32)
    tree = jax.jit(lambda spec: fnattn.paged_attention(
        spec, q, kp, vp, page_table=TABLE, kv_lengths=PLEN, draft_parents=parents).out)
    got = tree(AttentionSpec(mask=window(jnp.int32(4)), block_sizes=PBLOCKS))
    want = tree(AttentionSpec(mask=window(4), block_sizes=PBLOCKS))
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    assert not np.allclose(got, tree(AttentionSpec(mask=window(9), block_sizes=PBLOCKS)))


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_paged_lowers_traced_sizes_to_xla_for_cuda_and_tpu(platform):
    q, kp, vp = (x.astype(jnp.bfloat16) for x in pools())
    kp, vp = (jnp.pad(x, ((0, 0), (0, 0), (0, 16 - PS), (0, 128 - D))) for x in (kp, vp))
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, 128 - D)))

    def lowered(f, *args):
        with target(platform):
            return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()

    call = lambda mask, q, kp, vp: fnattn.paged_attention(  # noqa: E731
        AttentionSpec(mask=mask), q, kp, vp, page_table=TABLE, kv_lengths=PLEN).out
    traced = lowered(lambda s, *a: call(window(s), *a), jnp.int32(4), q, kp, vp)
    static = lowered(lambda *a: call(window(4), *a), q, kp, vp)
    assert not re.search(KERNELS[platform], traced)
    assert re.search(KERNELS[platform], static)


def test_quantized_caches_take_traced_sizes():
    """int8 caches and pools (the reverse-mode-only path): forward and dq as static."""
    q, k, v = cache(6)
    kq, vq = fnattn.quant.quantize(k, "int8"), fnattn.quant.quantize(v, "int8")
    traced = jax.jit(lambda s, q, k, v: out_and_dq(AttentionSpec(mask=window(s)), q, k, v))
    static = jax.jit(out_and_dq, static_argnums=0)
    for a, b in zip(traced(jnp.int32(5), q, kq, vq),
                    static(AttentionSpec(mask=window(5)), q, kq, vq)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-6)
    q, kp, vp = pools(6)
    kq, vq = fnattn.quant.quantize(kp, "int8"), fnattn.quant.quantize(vp, "int8")
    traced = jax.jit(lambda s, *a: paged_out_and_dq(
        AttentionSpec(mask=chunk(s), block_sizes=PBLOCKS), *a))
    for a, b in zip(traced(jnp.int32(8), q, kq, vq), jax.jit(paged_out_and_dq, static_argnums=0)(
            AttentionSpec(mask=chunk(8), block_sizes=PBLOCKS), q, kq, vq)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-6)
