"""masks.block_selection (NSA / MoBA block selection) against float64 NumPy, under jax.jit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, XlaBlockSizes, masks
from lowering import target
from np_attention import np_attention_grads

BQ, BK = 8, 16
TQ, TK = 40, 96                  # 5 query blocks, 6 key blocks
B, HQ, HKV, D = 2, 4, 2, 8


def np_block_map(sel, Tq, Tk):
    """(B|1, H|1, nQ, nK) bool -> (B|1, H|1, Tq, Tk)."""
    dense = np.repeat(np.repeat(np.asarray(sel), BQ, axis=-2), BK, axis=-1)
    return dense[..., :Tq, :Tk]


def random_map(key, shape):
    return jax.random.bernoulli(key, 0.4, shape)


def test_render_and_materialize_match_the_map():
    sel = random_map(jax.random.key(0), (B, 1, 5, 6))
    mask = masks.block_selection(sel, block_q=BQ, block_k=BK)
    dense = masks.materialize(mask, B, HQ, TQ, TK)
    np.testing.assert_array_equal(np.broadcast_to(dense, (B, 1, TQ, TK)),
                                  np_block_map(sel, TQ, TK))


def test_integer_lists_and_a_wide_map():
    """Lists with -1 padding, repeats and out-of-range entries; 70 key blocks (3 words)."""
    nk = 70
    lists = jnp.array([[0, 69, 69, -1, 31], [30, 29, 100, 1, -1]])
    mask = masks.block_selection(lists, block_q=1, block_k=1, num_k_blocks=nk)
    want = np.zeros((2, nk), bool)
    want[0, [0, 69, 31]] = True
    want[1, [30, 29, 1]] = True
    dense = np.asarray(masks.materialize(mask, 1, 1, 2, nk))[0, 0]
    np.testing.assert_array_equal(dense, want)


def test_visited_tiles_are_exactly_the_selected_ones():
    sel = random_map(jax.random.key(1), (B, 1, 5, 6))
    mask = masks.block_selection(sel, block_q=BQ, block_k=BK)
    cls = np.asarray(jax.jit(lambda m: masks.block_classes(m, B, HQ, TQ, TK, BQ, BK))(mask))
    np.testing.assert_array_equal(np.broadcast_to(cls, (B, 1, 5, 6)),
                                  np.where(np.asarray(sel), masks.FULL, masks.EMPTY))
    # with causal: selected tiles below the diagonal FULL, on it PARTIAL, above EMPTY
    both = mask & masks.causal()
    cls = np.asarray(jax.jit(lambda m: masks.block_classes(m, B, HQ, TQ, TK, BQ, BK))(both))
    causal = np.asarray(masks.block_classes(masks.causal(), 1, 1, TQ, TK, BQ, BK))
    want = np.where(np.asarray(sel), causal, masks.EMPTY)
    np.testing.assert_array_equal(np.broadcast_to(cls, want.shape), want)


@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_attention_forward_and_backward_match_numpy(impl):
    ks = jax.random.split(jax.random.key(2), 6)
    q = jax.random.normal(ks[0], (B, TQ, HQ, D))
    k = jax.random.normal(ks[1], (B, TK, HKV, D))
    v = jax.random.normal(ks[2], (B, TK, HKV, D))
    d_out = jax.random.normal(ks[3], (B, TQ, HQ, D))
    spec0 = AttentionSpec(impl=impl, block_sizes=XlaBlockSizes(block_q=BQ, block_k=BK),
                          softcap=5.0)

    @jax.jit
    def run(sel, q, k, v):
        window = masks.causal() & masks.sliding_window(12)
        mask = (masks.block_selection(sel, block_q=BQ, block_k=BK) & masks.causal()) | window
        spec = spec0.replace(mask=mask)
        out, pullback = jax.vjp(lambda q, k, v: fnattn.attention(spec, q, k, v).out, q, k, v)
        return out, pullback(d_out)

    qpos = np.arange(TQ)[:, None] + (TK - TQ)
    kk = np.arange(TK)[None, :]
    window = (kk <= qpos) & (kk >= qpos - 12)
    # the selection changes between calls: one compiled program
    for seed in (3, 4):
        sel = random_map(jax.random.key(seed), (B, 1, 5, 6))
        out, (dq, dk, dv) = run(sel, q, k, v)
        allowed = (np_block_map(sel, TQ, TK) & (kk <= qpos)) | window
        want = np_attention_grads(np.asarray(q, np.float64), np.asarray(k, np.float64),
                                  np.asarray(v, np.float64), np.asarray(d_out, np.float64),
                                  softcap=5.0, mask=allowed)
        np.testing.assert_allclose(out, want["out"], atol=2e-5)
        for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
            np.testing.assert_allclose(got, want[name], atol=5e-5, err_msg=name)
    assert run._cache_size() == 1


def test_bad_selection_is_refused_with_the_shapes():
    sel = jnp.ones((5, 6), bool)
    with pytest.raises(ValueError, match="key blocks of 16 cover 96 keys; attention has Tk=100"):
        masks.materialize(masks.block_selection(sel, block_q=BQ, block_k=BK), 1, 1, TQ, 100)
    with pytest.raises(ValueError, match="q_len=50"):
        masks.block_selection(sel, block_q=BQ, block_k=BK, q_len=50)
    with pytest.raises(ValueError, match="need num_k_blocks"):
        masks.block_selection(jnp.zeros((5, 2), jnp.int32), block_q=BQ, block_k=BK)


def test_pallas_kernels_in_interpret_mode_match_the_reference():
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (1, 32, 2, 16))
    k = jax.random.normal(ks[1], (1, 64, 1, 16))
    sel = random_map(ks[2], (1, 1, 2, 4))
    mask = masks.block_selection(sel, block_q=16, block_k=16) & masks.causal()

    def grads(spec):
        return jax.jit(jax.value_and_grad(
            lambda q, k: jnp.sum(fnattn.attention(spec, q, k, k).out ** 2), argnums=(0, 1)))(q, k)

    (got, (dq, dk)), (want, (rq, rk)) = (grads(AttentionSpec(mask=mask, impl=impl))
                                         for impl in ("pallas", "reference"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(dq, rq, atol=2e-5)
    np.testing.assert_allclose(dk, rk, atol=2e-5)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_cuda_and_tpu(platform):
    T, D = 512, 64
    q = jax.ShapeDtypeStruct((1, T, 4, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, 2, D), jnp.bfloat16)
    sel = jax.ShapeDtypeStruct((1, 1, T // 128, T // 128), jnp.bool_)

    def loss(sel, q, k, v):
        mask = masks.block_selection(sel, block_q=128, block_k=128) & masks.causal()
        out = fnattn.attention(AttentionSpec(mask=mask), q, k, v).out
        return jnp.sum(out.astype(jnp.float32))

    with target(platform):
        text = jax.jit(jax.grad(loss, argnums=(1, 2, 3))).trace(sel, q, kv, kv).lower(
            lowering_platforms=(platform,)).as_text()
    names = set(re.findall(r'(fnattn_flash\w*)', text))
    if platform == "cuda":
        assert {"fnattn_flash_fwd", "fnattn_flash_dq", "fnattn_flash_dkdv"} <= names, names
    else:
        assert {"fnattn_flash_mosaic_fwd", "fnattn_flash_mosaic_dq",
                "fnattn_flash_mosaic_dkv"} <= names, names
