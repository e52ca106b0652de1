"""The Pallas Triton lowering of paged attention (fnattn/paged/triton.py).

* interpret mode on CPU against the dense problems (fnattn.reference / float64
  NumPy): ragged batches with splits, non-power-of-two head dims and groups, the
  cache update inside the kernel, decode through paged_attention, gradients;
* lowering to Triton IR for "cuda" on CPU over dtypes, head dims, masks and forms;
* the compiled kernels on an NVIDIA GPU against the XLA lowering (skipped elsewhere).
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from fnattn import AttentionSpec, PagedBlockSizes, masks  # noqa: E402
from fnattn.paged import api, triton, xla  # noqa: E402
from lowering import gpu_target  # noqa: E402
from problems import check_ragged, check_update, make  # noqa: E402

ON_GPU = jax.devices()[0].platform == "gpu"
INTERPRET = (("default", triton.forward_interpret),)
CUDA = (("default", xla.forward), ("cuda", triton.forward))
MIXED = [(7, 3), (13, 1), (5, 5), (1, 1), (10, 2)]


def test_interpret_ragged_with_splits():
    """Three splits per item (merged with the sinks), two-token items, a window."""
    p = make(MIXED, Hq=6, Hkv=2, D=16, page_size=3, max_seqs=7, pad_tokens=2, seed=1)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(6), softcap=4.0,
                         sinks=jnp.linspace(-1.0, 2.0, 6),
                         block_sizes=PagedBlockSizes(block_q=2, block_k=16, num_splits=3))
    check_ragged(INTERPRET, spec, p, use_reference=True)


def test_interpret_odd_head_dims_and_group():
    """D=7, Dv=5 (padded to 16 inside the loads), a group of 3 (padded to 4), one split."""
    p = make(MIXED, Hq=6, Hkv=2, D=7, Dv=5, page_size=5, max_seqs=6, seed=2)
    check_ragged(INTERPRET, AttentionSpec(mask=masks.chunked(4) & masks.causal()), p)


def test_interpret_update_inside_the_kernel():
    p = make(MIXED, Hq=4, Hkv=2, D=8, page_size=4, max_seqs=6, pad_tokens=3, seed=3)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.arange(4.0),
                         block_sizes=PagedBlockSizes(block_q=2, num_splits=2))
    check_update(INTERPRET, spec, p)


def test_interpret_decode_and_gradients():
    """paged_attention with Tq=2 through the custom_jvp: gradients equal the XLA path's."""
    B, Tq, Hq, D = 3, 2, 4, 8
    p = make([(9, Tq), (4, Tq), (2, Tq)], Hq=Hq, Hkv=1, D=D, page_size=4, seed=4)
    q = p.q.reshape(B, Tq, Hq, D)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.zeros(Hq))

    def loss(table, q, kp, vp):
        r = api.paged_attention_with(table, spec, q, kp, vp, page_table=p.page_table,
                                     kv_lengths=p.context_lengths)
        return jnp.sum(jnp.sin(r.out)) + jnp.sum(r.lse), r

    outs = [jax.jit(jax.value_and_grad(functools.partial(loss, t), argnums=(0, 1, 2),
                                       has_aux=True))(q, p.k_pages, p.v_pages)
            for t in (INTERPRET, (("default", xla.forward),))]
    (_, r1), g1 = outs[0]
    (_, r2), g2 = outs[1]
    np.testing.assert_allclose(r1.out, r2.out, atol=2e-5)
    np.testing.assert_allclose(r1.lse, r2.lse, atol=2e-5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-4)


LOWER = [
    # dtype, D, Dv, Hq, Hkv, mask, update, splits
    (jnp.bfloat16, 128, 128, 32, 8, masks.causal(), False, None),
    (jnp.bfloat16, 64, 64, 8, 8, masks.causal() & masks.sliding_window(7), True, 4),
    (jnp.float16, 80, 80, 12, 4, masks.chunked(8) & masks.causal(), True, None),
    (jnp.float32, 256, 128, 4, 1, None, False, 2),
]


@pytest.mark.parametrize("dtype,D,Dv,Hq,Hkv,mask,upd,splits", LOWER)
def test_lowers_for_cuda(dtype, D, Dv, Hq, Hkv, mask, upd, splits):
    N, ps, S, P, T = 32, 16, 3, 5, 11
    q = jnp.zeros((T, Hq, D), dtype)
    kp = jnp.zeros((Hkv, N, ps, D), dtype)
    vp = jnp.zeros((Hkv, N, ps, Dv), dtype)
    spec = AttentionSpec(mask=mask, softcap=30.0, sinks=jnp.zeros(Hq),
                         block_sizes=PagedBlockSizes(num_splits=splits))
    m = dict(page_table=jnp.zeros((S, P), jnp.int32), context_lengths=jnp.zeros(S, jnp.int32),
             query_start_loc=jnp.zeros(S + 1, jnp.int32), num_seqs=jnp.int32(S))
    if upd:
        f = lambda q, kp, vp: api.ragged_paged_attention_with_update_with(  # noqa: E731
            CUDA, spec, q, q[:, :Hkv], q[:, :Hkv, :Dv], kp, vp, **m)
    else:
        f = lambda q, kp, vp: api.ragged_paged_attention_with(CUDA, spec, q, kp, vp, **m)  # noqa: E731,E501
    decode = lambda q, kp, vp: api.paged_attention_with(  # noqa: E731
        CUDA, spec, q.reshape(T, 1, Hq, D), kp, vp, page_table=jnp.zeros((T, P), jnp.int32),
        kv_lengths=jnp.zeros(T, jnp.int32))
    with gpu_target():
        text = jax.jit(f).trace(q, kp, vp).lower(lowering_platforms=("cuda",)).as_text()
        decode_text = jax.jit(decode).trace(q, kp, vp).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "fnattn_paged_triton" in text
    assert "fnattn_paged_triton" in decode_text


def test_launch_plan():
    """Splits give about two programs per multiprocessor of an H100 when there are
    few items and many key blocks, never below 8 key blocks per split; a split
    count given in the block sizes is used as is."""
    cfg = api._make_cfg(AttentionSpec(), num_q_heads=32, num_kv_heads=8, head_dim=128,
                        v_head_dim=128, num_pages=4096, page_size=16, pages_per_seq=2048,
                        max_seqs=1, total_tokens=1, uniform_q=1, update=False)
    bq, bk, splits, _ = triton.launch_plan(cfg)
    assert (bq, bk) == (1, 64) and splits == 33  # min(264 // 8 programs, 512 blocks / 8)
    sixteen = dataclasses_replace(cfg, max_seqs=16, total_tokens=16)
    assert triton.launch_plan(sixteen)[2] == 2   # 264 // (16 * 8)
    many = dataclasses_replace(cfg, max_seqs=256, total_tokens=256)
    assert triton.launch_plan(many)[2] == 1
    fixed = dataclasses_replace(cfg, block_sizes=PagedBlockSizes(num_splits=5, block_k=100))
    assert triton.launch_plan(fixed)[1:3] == (128, 5)


def dataclasses_replace(x, **kw):
    import dataclasses
    return dataclasses.replace(x, **kw)


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_matches_xla(dtype):
    p = make([(300, 3), (1000, 1), (64, 64), (17, 1)], Hq=32, Hkv=8, D=128, page_size=16,
             max_seqs=6, pad_tokens=5, dtype=dtype, seed=7)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.zeros(32), softcap=30.0)
    tol = 2e-3 if dtype == jnp.float32 else 3e-2
    check_ragged(None, spec, p, tol=tol)
    check_update(None, spec.replace(block_sizes=PagedBlockSizes(num_splits=4)), p, tol=tol)


def test_interpret_poisoned_pools_under_x64():
    """NaN in every unowned slot and in the keys a window hides, with x64 on: the
    kernels (attention and the update form) give the dense problem's answer."""
    from problems import poisoned_window_case
    spec, pp = poisoned_window_case(page_size=4, block_k=16)
    with jax.enable_x64(True):
        check_ragged(INTERPRET, spec, pp)     # expected: the clean tokens of each sequence
        check_update(INTERPRET, spec, pp)


def test_lowers_for_cuda_under_x64():
    with jax.enable_x64(True):
        test_lowers_for_cuda(*LOWER[1])
