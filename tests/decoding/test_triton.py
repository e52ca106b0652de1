"""The Pallas Triton lowering of fnattn.decode (fnattn/decoding/triton.py).

* interpret mode on CPU against each sequence's dense problem in float64 NumPy
  (the helpers of tests/test_decoding.py), under jax.jit: every positional
  mask, MHA/GQA/MQA, one to three query tokens, sinks, soft-cap, kv_starts,
  empty sequences, one split and several, head dims that are not powers of
  two, low precision. Cache slots outside each sequence's range hold NaN: a
  kernel that read one would fail;
* gradients through impl="pallas" (the kernel forward, the XLA backward) equal
  impl="xla"'s;
* lowering to Triton IR for "cuda" on CPU over dtypes, head dims, groups, masks
  and splits; the launch plan and the key-block ranges.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decoding import (MASKS, check, check_poisoned_window_under_x64,
                           nan_problem as make)
from lowering import cheap_compiles, gpu_target

import fnattn
from fnattn import AttentionSpec, DecodeBlockSizes, masks
from fnattn.decoding import api, common, triton


@pytest.fixture(autouse=True, scope="module")
def _cheap_compiles():
    with cheap_compiles():
        yield


def route(monkeypatch):
    """Routes fnattn.decode to the interpreted kernel, with key blocks of 16."""
    fwd = functools.partial(triton._forward, interpret=True, block_k=16)
    monkeypatch.setattr(api, "lowering_table", lambda impl: (("default", fwd),))


@pytest.fixture
def kernel(monkeypatch):
    route(monkeypatch)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("splits", [1, 2])
def test_masks_and_splits(kernel, mask, splits):
    """D=7, Dv=5 (padded to 16 in the loads), a group of 3 (6 rows padded to 16)."""
    q, k, v, L, a = make()
    spec = AttentionSpec(mask=MASKS[mask], block_sizes=DecodeBlockSizes(num_splits=splits))
    check(spec, q, k, v, L, a)


@pytest.mark.parametrize("Hq,Hkv,Tq", [(3, 3, 1), (5, 1, 3), (8, 2, 2), (4, 1, 1)])
def test_mha_mqa_gqa_and_query_tokens(kernel, Hq, Hkv, Tq):
    q, k, v, L, a = make(Tq=Tq, Hq=Hq, Hkv=Hkv, D=16, Dv=16, seed=1, lengths=(40, 5, 33),
                         starts=(0, 2, 7))
    spec = AttentionSpec(mask=masks.causal(), block_sizes=DecodeBlockSizes(num_splits=2))
    check(spec, q, k, v, L, a)


@pytest.mark.parametrize("splits", [1, 4])
def test_sinks_softcap_scale_starts(kernel, splits):
    """With one split the kernel applies the sinks; with four the merge does, once."""
    q, k, v, L, a = make(seed=2, lengths=(10, 3, 0), starts=(5, 37, 7))
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(6), softcap=3.0, scale=0.4,
                         sinks=jnp.linspace(-1.0, 2.0, 6),
                         block_sizes=DecodeBlockSizes(num_splits=splits))
    res = check(spec, q, k, v, L, a)
    np.testing.assert_array_equal(np.asarray(res.out[2]), 0.0)          # no key, a sink
    np.testing.assert_allclose(res.lse[2], jnp.tile(spec.sinks[:, None], (1, 2)), rtol=1e-6)


@pytest.mark.parametrize("splits", [1, 8])
def test_empty_sequences_give_zeros_and_minus_inf(kernel, splits):
    """Eight splits of three key blocks: most programs have no block (0 and -inf)."""
    q, k, v, L, a = make(seed=3, lengths=(0, 40, 0), starts=(3, 0, 40))
    res = check(AttentionSpec(block_sizes=DecodeBlockSizes(num_splits=splits)), q, k, v, L, a)
    assert np.all(np.asarray(res.out)[[0, 2]] == 0)
    assert np.all(np.isneginf(np.asarray(res.lse)[[0, 2]]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision(kernel, dtype):
    q, k, v, L, a = make(Tq=3, D=24, Dv=24, dtype=jnp.dtype(dtype), seed=4)
    spec = AttentionSpec(mask=masks.causal(), softcap=8.0, sinks=jnp.zeros(6),
                         block_sizes=DecodeBlockSizes(num_splits=2))
    res = check(spec, q, k, v, L, a, tol=2e-2)
    assert res.out.dtype == jnp.dtype(dtype)


def test_pallas_impl_forward_and_gradients_match_xla():
    """impl="pallas" on CPU: the interpreted kernel forward (default plan) and the XLA
    backward through the custom_jvp, under jit, against impl="xla"."""
    q, k, v, L, a = make(Tq=2, D=8, Dv=8, seed=5, lengths=(30, 9, 1), starts=(0, 17, 3))
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)   # gradients: finite everywhere
    sinks = jnp.linspace(-0.5, 1.0, 6)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(6), softcap=4.0,
                         block_sizes=DecodeBlockSizes(num_splits=4))
    rs = np.random.default_rng(0)
    d_out = jnp.asarray(rs.standard_normal((3, 2, 6, 8)), jnp.float32)

    def loss(impl, q, k, v, sinks):
        r = fnattn.decode(spec.replace(impl=impl, sinks=sinks), q, k, v, kv_lengths=L,
                          kv_starts=a)
        return jnp.sum(r.out * d_out) + jnp.sum(jnp.sin(r.lse)), r

    run = {impl: jax.jit(jax.value_and_grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3),
                                            has_aux=True))(q, k, v, sinks)
           for impl in ("pallas", "xla")}
    (_, r1), g1 = run["pallas"]
    (_, r2), g2 = run["xla"]
    np.testing.assert_allclose(r1.out, r2.out, atol=2e-5)
    np.testing.assert_allclose(r1.lse, r2.lse, atol=2e-5)
    for x, y in zip(g1, g2):
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)


def test_pallas_impl_under_vmap():
    """vmap over a leading axis adds a grid axis to the kernel."""
    q, k, v, L, _ = make(D=8, Dv=8, seed=6, lengths=(30, 9, 1), starts=(0, 0, 0))
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    qs, ks, vs = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
    Ls = jnp.stack([L, L[::-1]])
    spec = AttentionSpec(mask=masks.causal())

    def run(impl):
        def f(q, k, v, L):
            return fnattn.decode(spec.replace(impl=impl), q, k, v, kv_lengths=L)
        return jax.jit(jax.vmap(f))(qs, ks, vs, Ls)

    got, want = run("pallas"), run("xla")
    np.testing.assert_allclose(got.out, want.out, atol=2e-5)
    np.testing.assert_allclose(got.lse, want.lse, atol=2e-5)


LOWER = [
    # dtype, D, Dv, Hq, Hkv, Tq, mask, splits (None: the launch plan's)
    (jnp.bfloat16, 128, 128, 32, 8, 1, masks.causal(), None),
    (jnp.bfloat16, 64, 64, 8, 8, 2, masks.causal() & masks.sliding_window(7), 4),
    (jnp.float16, 80, 80, 12, 4, 3, masks.chunked(8) & masks.causal(), None),
    (jnp.float32, 256, 128, 4, 1, 1, None, 2),
    (jnp.bfloat16, 96, 96, 40, 2, 2, masks.from_fn(lambda b, h, q, k: (q + k) % 4 != 0), 8),
]


@pytest.mark.parametrize("dtype,D,Dv,Hq,Hkv,Tq,mask,splits", LOWER)
def test_lowers_for_cuda(dtype, D, Dv, Hq, Hkv, Tq, mask, splits):
    B, S_ = 2, 1024
    q = jnp.zeros((B, Tq, Hq, D), dtype)
    k, v = jnp.zeros((B, S_, Hkv, D), dtype), jnp.zeros((B, S_, Hkv, Dv), dtype)
    L = jnp.zeros((B,), jnp.int32)
    for impl in ("auto", "pallas"):
        spec = AttentionSpec(mask=mask, softcap=30.0, sinks=jnp.zeros(Hq), impl=impl,
                             block_sizes=DecodeBlockSizes(num_splits=splits))
        f = jax.jit(functools.partial(decode, spec))
        with gpu_target():
            text = f.trace(q, k, v, L).lower(lowering_platforms=("cuda",)).as_text()
        assert triton.KERNEL_NAME in text, impl


def decode(spec, q, k, v, L):
    return fnattn.decode(spec, q, k, v, kv_lengths=L)


def test_launch_plan():
    """Splits give about two programs per multiprocessor of an H100 when (sequence,
    kv head) pairs are few, never below 8 key blocks per split; a split count from
    DecodeBlockSizes is used as is."""
    plan = triton.launch_plan(1, 8, 32768, 128, 128)
    assert plan == triton.Plan(block_k=64, num_splits=33, num_warps=4, num_stages=2)  # 264 / 8
    assert triton.launch_plan(4, 8, 32768, 128, 128).num_splits == 8    # 264 // 32
    assert triton.launch_plan(16, 8, 4096, 128, 128).num_splits == 2   # 264 // 128
    assert triton.launch_plan(32, 8, 4096, 128, 128).num_splits == 1   # 256 programs
    assert triton.launch_plan(64, 8, 32768, 128, 128).num_splits == 1   # 512 programs
    assert triton.launch_plan(1, 8, 1024, 128, 128).num_splits == 2     # 16 blocks / 8
    assert triton.launch_plan(1, 1, 100, 64, 64).num_splits == 1
    assert triton.launch_plan(1, 8, 1000, 80, 80, num_splits=5).num_splits == 5
    assert triton.launch_plan(1, 8, 4096, 256, 256).block_k == 32
    assert triton.launch_plan(1, 8, 20, 64, 64).block_k == 32           # pow2(20)
    assert triton.launch_plan(1, 8, 4096, 128, 128, rows=128).num_warps == 8
    assert triton.launch_plan(1, 8, 4096, 128, 128, block_k=100, num_warps=8,
                              num_stages=4) == triton.Plan(128, 4, 8, 4)  # 32 blocks / 8


def test_block_sizes_reach_the_kernel_launch():
    """DecodeBlockSizes' block_k, num_warps and num_stages are the launch's."""
    B, S, Hq, Hkv, D = 2, 1024, 8, 2, 64
    q = jnp.zeros((B, 1, Hq, D), jnp.bfloat16)
    k = v = jnp.zeros((B, S, Hkv, D), jnp.bfloat16)
    L = jnp.zeros((B,), jnp.int32)
    texts = []
    for bs in (DecodeBlockSizes(num_splits=2),
               DecodeBlockSizes(num_splits=2, block_k=128, num_warps=8, num_stages=3)):
        spec = AttentionSpec(mask=masks.causal(), impl="pallas", block_sizes=bs)
        with gpu_target():
            texts.append(jax.jit(functools.partial(decode, spec)).trace(q, k, v, L).lower(
                lowering_platforms=("cuda",)).as_text())
    assert "num_warps = 4" in texts[0] and "num_warps = 8" in texts[1]
    assert "num_stages = 2" in texts[0] and "num_stages = 3" in texts[1]
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        DecodeBlockSizes(num_warps=3)
    with pytest.raises(ValueError, match="block_k must be a positive int"):
        DecodeBlockSizes(block_k=0)


def test_block_ranges_skip_blocks_outside_the_window():
    """A window of 8 over 1000 keys visits 2 blocks of 16 (positions 991..999 from the
    first key: blocks 61 and 62), of which none is seen whole by the query;
    slot-aligned blocks shift with the start."""
    mask = masks.causal() & masks.sliding_window(8)
    L, a = jnp.array([1000, 5, 0]), jnp.array([0, 30, 9])
    r = common.block_ranges(mask, 1, L, jnp.zeros_like(L), 16, 64)
    assert r.lo.tolist() == [61, 0, 0] and r.hi.tolist() == [63, 1, 0]
    assert r.full_lo.tolist() == r.full_hi.tolist()  # (no block seen whole)
    r = common.block_ranges(None, 1, L, a, 16, 64)
    assert r.lo.tolist() == [0, 1, 0] and r.hi.tolist() == [63, 3, 0]
    # blocks wholly inside [0, L) from slot a: sequence 0 all but its last block
    # (992..1007 is past 999), sequence 1 none (5 keys from slot 30)
    assert r.full_lo.tolist() == [0, 0, 0] and r.full_hi.tolist() == [62, 0, 0]
    r = common.block_ranges(mask, 2, L, a, 16, 64)
    assert r.lo.tolist() == [61, 1, 0] and r.hi.tolist() == [63, 3, 0]
    # a window of 400: the last query (position 999) sees 599..999, the first of
    # two (998) sees 598..998, so blocks 38 (608..623) to 61 (976..991) whole
    r = common.block_ranges(masks.causal() & masks.sliding_window(400), 2, L[:1],
                            a[:1] * 0, 16, 64)
    assert r.full_lo.tolist() == [38] and r.full_hi.tolist() == [62]


ON_GPU = jax.devices()[0].platform == "gpu"


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_matches_xla(dtype):
    """The compiled kernel (impl="auto" on a GPU) against the XLA lowering, with long
    ragged contexts, several splits, a window and sinks."""
    B, Sg, Hq, Hkv, D = 5, 4096, 32, 8, 128
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, 2, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, Sg, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, Sg, Hkv, D), dtype)
    L, a = jnp.array([4096, 3000, 17, 1, 0]), jnp.array([0, 1000, 5, 4000, 0])
    tol = 2e-3 if dtype == jnp.float32 else 3e-2
    for mask in (masks.causal(), masks.causal() & masks.sliding_window(300)):
        spec = AttentionSpec(mask=mask, sinks=jnp.linspace(-1.0, 1.0, Hq), softcap=30.0)
        f = jax.jit(lambda spec, q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L,
                                                        kv_starts=a))
        got, want = f(spec, q, k, v), f(spec.replace(impl="xla"), q, k, v)
        np.testing.assert_allclose(np.asarray(got.out, np.float32),
                                   np.asarray(want.out, np.float32), atol=tol, rtol=tol)
        np.testing.assert_allclose(got.lse, want.lse, atol=tol, rtol=tol)


def test_poisoned_slots_the_window_hides_under_x64(monkeypatch):
    """NaN in the sequence's own slots that a window hides from every query (as well as
    outside its range), infinite sinks, x64 on: the kernel gives the XLA lowering's answer."""
    q, k, v, L, a = make()
    check_poisoned_window_under_x64(
        q, k, v, L, a, jnp.array([0.0, jnp.inf, -jnp.inf, 1.0, -jnp.inf, 0.5]),
        lambda: route(monkeypatch))


def test_lowers_for_cuda_under_x64():
    with jax.enable_x64(True):
        test_lowers_for_cuda(*LOWER[1])
