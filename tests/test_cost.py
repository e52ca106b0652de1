"""fnattn.cost: FLOPs, transcendentals and bytes of a spec, the mask density
against the materialised mask, and the cost estimates the Mosaic kernels carry."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, cost, masks
from lowering import target

F32, BF16 = jnp.float32, jnp.bfloat16


def sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("name, mask", [
    ("causal", masks.causal()),
    ("window", masks.sliding_window(left=100)),
    ("two-sided window", masks.sliding_window(left=64, right=200)),
    ("chunked", masks.chunked(256)),
    ("causal & chunked", masks.causal() & masks.chunked(300)),
    ("window | chunked", masks.sliding_window(left=50) | masks.chunked(128)),
])
@pytest.mark.parametrize("tq, tk", [(1024, 1024), (700, 1000)])
def test_density_matches_the_materialised_mask(name, mask, tq, tk):
    est = cost.mask_density(mask, 1, 1, tq, tk)
    true = float(jax.jit(lambda: masks.materialize(mask, 1, 1, tq, tk))().mean())
    # PARTIAL tiles count 1/2: the error is at most half their share of the pairs
    cls = masks.block_classes_static(mask, 1, 1, tq, tk, 16, 16)
    bound = 0.5 * float(np.mean(cls == masks.PARTIAL)) + 1e-9
    assert abs(est - true) <= bound, (est, true, bound)
    assert abs(est - true) < 0.06 * max(true, 0.1)


def test_full_attention_counts():
    B, T, Hq, Hkv, D, Dv = 2, 300, 8, 2, 64, 32
    q, k, v = sds(B, T, Hq, D, dtype=BF16), sds(B, 500, Hkv, D, dtype=BF16), sds(B, 500, Hkv, Dv,
                                                                              dtype=BF16)
    c = cost.estimate(AttentionSpec(), q, k, v)
    pairs = B * Hq * T * 500
    assert c.flops == 2 * (D + Dv) * pairs and c.transcendentals == pairs
    assert c.density == 1.0 and c.exact
    io = 2 * (B * T * Hq * D + B * 500 * Hkv * (D + Dv) + B * T * Hq * Dv) + 4 * B * Hq * T
    assert c.bytes_accessed == io
    bwd = cost.estimate(AttentionSpec(), q, k, k, backward=True)
    fwd = cost.estimate(AttentionSpec(), q, k, k)
    assert bwd.flops == 2.5 * fwd.flops                       # D = Dv
    assert bwd.bytes_accessed > 1.9 * fwd.bytes_accessed
    capped = cost.estimate(AttentionSpec(softcap=30.0), q, k, v)
    assert capped.transcendentals == 2 * pairs and capped.flops == c.flops


def test_layouts_masks_with_arrays_and_bias():
    q = sds(2, 4, 64, 32)                                     # bhtd
    spec = AttentionSpec(layout="bhtd", mask=masks.causal())
    c = cost.estimate(spec, q, q, q)
    assert c.exact and c.density == pytest.approx(0.5, abs=1e-6)
    assert c.flops == pytest.approx(2 * 64 * 2 * 4 * 64 * 64 * 0.5)
    ids = jnp.zeros((2, 64), jnp.int32)
    seg = cost.estimate(AttentionSpec(mask=masks.causal() & masks.segments(ids)),
                        sds(2, 64, 4, 32), sds(2, 64, 4, 32))
    assert not seg.exact and seg.density == 1.0                # data-dependent: an upper bound
    bias = jnp.zeros((1, 4, 64, 64), BF16)
    with_bias = cost.estimate(AttentionSpec(bias=bias), sds(2, 64, 4, 32), sds(2, 64, 4, 32))
    plain = cost.estimate(AttentionSpec(), sds(2, 64, 4, 32), sds(2, 64, 4, 32))
    assert with_bias.bytes_accessed == plain.bytes_accessed + bias.size * 2
    with pytest.raises(ValueError, match=r"cost.estimate: q, k and v must be 4-D"):
        cost.estimate(AttentionSpec(), sds(4, 64, 32), sds(4, 64, 32))


def _estimates(txt):
    """The cost estimates of the Mosaic custom calls in a lowered module."""
    found = re.findall(r'cost_estimate\\22: (\{.*?\})', txt.replace("\\0A", ""))
    return [json.loads(x.replace("\\22", '"')) for x in found]


@pytest.mark.parametrize("mask", [None, masks.causal(), masks.sliding_window(left=128)])
def test_mosaic_kernels_carry_the_cost_of_the_tiles_they_visit(mask):
    B, T, H, D = 1, 512, 2, 128
    bs = fnattn.MosaicBlockSizes(128, 128, 128, 128, 128, 128)
    spec = AttentionSpec(mask=mask, impl="pallas", block_sizes=bs)
    x = jnp.zeros((B, T, H, D), BF16)

    def loss(q, k, v):
        return fnattn.attention(spec, q, k, v).out.astype(F32).sum()

    with target("tpu"):
        txt = jax.jit(jax.grad(loss, (0, 1, 2))).trace(x, x, x).lower(
            lowering_platforms=("tpu",)).as_text()
    est = _estimates(txt)
    assert len(est) == 3, len(est)                              # forward, dq, dk/dv
    cls = masks.block_classes_static(mask, B, H, T, T, 128, 128)
    visited = int(np.sum(np.broadcast_to(cls, (B, H, 4, 4)) != masks.EMPTY))
    pairs = visited * 128 * 128
    flops = sorted(e["flops"] for e in est)
    assert flops == sorted([2 * 2 * D * pairs, 2 * 3 * D * pairs, 2 * 4 * D * pairs])
    assert all(e["transcendentals"] == pairs and e["bytes_accessed"] > 0 for e in est)
    whole = cost.estimate(spec, x, x, x)
    if mask is None:
        assert min(flops) == whole.flops


def test_decode_and_ragged_paged_kernels_carry_upper_bounds():
    """The lengths are data: every query is counted against the whole cache (decode)
    or a whole sequence's pages (ragged paged), and the whole cache/pool is read."""
    B, Tq, Hq, Hkv, S, D = 2, 1, 8, 2, 1024, 128
    q = jnp.zeros((B, Tq, Hq, D), BF16)
    kc = jnp.zeros((B, S, Hkv, D), BF16)
    L = jnp.zeros((B,), jnp.int32)
    dec = jax.jit(lambda q, k, L: fnattn.decode(AttentionSpec(impl="pallas"), q, k, k,
                                                kv_lengths=L))
    N, ps, P, T, seqs = 32, 16, 5, 11, 3
    kp = jnp.zeros((Hkv, N, ps, D), BF16)
    m = dict(page_table=jnp.zeros((seqs, P), jnp.int32),
             context_lengths=jnp.zeros(seqs, jnp.int32),
             query_start_loc=jnp.zeros(seqs + 1, jnp.int32), num_seqs=jnp.int32(seqs))
    rag = jax.jit(lambda q, kp: fnattn.ragged_paged_attention(
        AttentionSpec(impl="pallas", softcap=20.0), q, kp, kp, **m))
    rq = jnp.zeros((T, Hq, D), BF16)  # (made outside: jax 0.11 runs nothing under the target)
    with target("tpu"):
        dtxt = dec.trace(q, kc, L).lower(lowering_platforms=("tpu",)).as_text()
        rtxt = rag.trace(rq, kp).lower(lowering_platforms=("tpu",)).as_text()
    [d] = _estimates(dtxt)
    assert d["flops"] == 2 * 2 * D * B * Tq * Hq * S and d["transcendentals"] == B * Tq * Hq * S
    assert d["bytes_accessed"] == 2 * (B * S * Hkv * 2 * D + B * Tq * Hq * 2 * D)
    [r] = _estimates(rtxt)
    assert r["flops"] == 2 * 2 * D * T * Hq * P * ps
    assert r["transcendentals"] == 2 * T * Hq * P * ps                # with the soft-cap's tanh
    assert r["bytes_accessed"] == 2 * (N * ps * Hkv * 2 * D + T * Hq * 2 * D)


def test_quantized_caches_count_their_codes_and_scales():
    from fnattn import quant
    q = jax.ShapeDtypeStruct((2, 1, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 512, 2, 64), jnp.bfloat16)
    full = cost.estimate(AttentionSpec(), q, k, k)
    scales = 2 * 512 * 2 * 4
    for fmt, code_bytes in (("int8", 2 * 512 * 2 * 64), ("int4", 2 * 512 * 2 * 32)):
        kq = quant.empty(k.shape, fmt)
        c = cost.estimate(AttentionSpec(), q, kq, kq)
        assert c.bytes_accessed == full.bytes_accessed - 2 * (k.size * 2) \
            + 2 * (code_bytes + scales)
        assert c.flops == full.flops
