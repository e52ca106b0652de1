"""The XLA lowering of paged attention (fnattn/paged/xla.py) against fnattn.reference
on the dense problem of every sequence, under jax.jit."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import fnattn  # noqa: E402
from fnattn import AttentionSpec, PagedBlockSizes, masks  # noqa: E402
from fnattn.paged import xla  # noqa: E402
from problems import (assert_close, check_ragged, check_update, dense_packed, expected,  # noqa: E402
                      make, poisoned, quantized, to_pool)
from fnattn import quant  # noqa: E402
from fnattn.quant import QuantFormat  # noqa: E402

XLA = (("default", xla.forward),)

# (L, n) per sequence: prefill from scratch, chunked prefill, decode, a one-token
# sequence, a sequence whose context is a whole number of pages.
MIXED = [(7, 3), (13, 1), (5, 5), (1, 1), (10, 2)]

# Each case its own GQA shape, so that the cases together cover MHA, MQA and groups.
CASES = {
    "full": dict(mask=None),
    "causal-sinks-softcap": dict(mask=masks.causal(), softcap=4.0, sinks=True),
    "window-mha": dict(mask=masks.causal() & masks.sliding_window(3), heads=(3, 3)),
    "chunked-mqa": dict(mask=masks.chunked(4) & masks.causal(), scale=0.3, heads=(5, 1)),
    "two-sided-window": dict(mask=masks.sliding_window(2, 1)),
    "from-fn": dict(mask=masks.from_fn(lambda b, h, q, k: (k + h) % 3 != 0) & masks.causal()),
}


def spec_for(case, **kw):
    c = dict(CASES[case])
    Hq, Hkv = c.pop("heads", (6, 2))
    sinks = jnp.linspace(-1.0, 2.0, Hq) if c.pop("sinks", False) else None
    return AttentionSpec(sinks=sinks, **c, **kw), Hq, Hkv


@pytest.mark.parametrize("case", list(CASES))
def test_ragged_matches_reference(case):
    spec, Hq, Hkv = spec_for(case)
    p = make(MIXED, Hq=Hq, Hkv=Hkv, D=7, Dv=5, page_size=3, max_seqs=7, pad_tokens=2, seed=1)
    # One case against fnattn.reference itself, the others against float64 NumPy.
    check_ragged(XLA, spec, p, use_reference=case == "causal-sinks-softcap")


def test_many_chunks_and_skipped_chunks():
    """Several key chunks per item; chunks that no item sees (past every length, or
    outside every window) are skipped at run time."""
    p = make([(41, 2), (29, 11), (3, 3)], Hq=4, Hkv=2, D=8, page_size=4, pages_per_seq=13,
             max_seqs=5, seed=3)
    blocks = PagedBlockSizes(block_q=3, block_k=8)
    for mask in (masks.causal(), masks.causal() & masks.sliding_window(5)):
        check_ragged(XLA, AttentionSpec(mask=mask, block_sizes=blocks), p)


def test_update_writes_the_tokens_then_attends():
    p = make(MIXED, Hq=4, Hkv=2, D=6, page_size=3, max_seqs=6, pad_tokens=3, seed=4)
    check_update(XLA, spec_for("causal-sinks-softcap")[0].replace(sinks=jnp.arange(4.)), p)


@pytest.mark.parametrize("layout,Tq", [("bthd", 1), ("bhtd", 3)])
def test_paged_attention_decode(layout, Tq):
    B, Hq, D = 3, 6, 8
    p = make([(11, Tq), (5, Tq), (Tq, Tq)], Hq=Hq, Hkv=3, D=D, page_size=4, seed=Tq)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.ones(Hq), layout=layout, impl="xla")
    q = p.q.reshape(B, Tq, Hq, D)
    qin = q if layout == "bthd" else q.transpose(0, 2, 1, 3)
    res = jax.jit(fnattn.paged_attention)(spec, qin, p.k_pages, p.v_pages,
                                          page_table=p.page_table, kv_lengths=p.context_lengths)
    assert res.lse.shape == (B, Hq, Tq)
    out = res.out if layout == "bthd" else res.out.transpose(0, 2, 1, 3)
    want_out, want_lse = expected(spec, p, use_reference=Tq == 1)
    assert_close(out.reshape(B * Tq, Hq, D), res.lse.transpose(1, 0, 2).reshape(Hq, B * Tq),
                 want_out, want_lse, 2e-5)


def test_low_precision():
    p = make(MIXED, Hq=4, Hkv=2, D=16, page_size=4, dtype=jnp.bfloat16, seed=5)
    res = check_ragged(XLA, AttentionSpec(mask=masks.causal()), p, tol=3e-2)
    assert res.out.dtype == jnp.bfloat16


def _loss(res):
    w = jnp.cos(jnp.arange(res.out.size, dtype=jnp.float32)).reshape(res.out.shape)
    lse = jnp.where(jnp.isfinite(res.lse), res.lse, 0.0)
    return jnp.sum(res.out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse))


def test_gradients_match_dense_gradients():
    """d/dq, d/dpools and d/dsinks through the custom_jvp, against the dense problem's
    gradients scattered to the same slots."""
    p = make([(6, 2), (9, 1), (4, 4)], Hq=4, Hkv=2, D=5, page_size=3, max_seqs=4,
             pad_tokens=1, seed=6)
    spec = AttentionSpec(mask=masks.causal(), softcap=3.0, sinks=jnp.array([0.1, -1., 2., 0.]),
                         impl="xla")

    def paged_loss(q, kp, vp, sinks):
        return _loss(fnattn.ragged_paged_attention(
            spec.replace(sinks=sinks), q, kp, vp, page_table=p.page_table,
            context_lengths=p.context_lengths, query_start_loc=p.query_start_loc,
            num_seqs=p.num_seqs))

    def dense_loss(q, ks, vs, sinks):
        # The same loss, from fnattn.reference on each sequence (padding rows: 0, -inf).
        out, lse = dense_packed(spec.replace(sinks=sinks), p, q, ks, vs)
        return _loss(fnattn.AttentionOutput(out, lse))

    g = jax.jit(jax.grad(paged_loss, argnums=(0, 1, 2, 3)))(p.q, p.k_pages, p.v_pages,
                                                          spec.sinks)
    gd = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2, 3)))(p.q, p.k_tok, p.v_tok, spec.sinks)
    np.testing.assert_allclose(g[0], gd[0], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(g[3], gd[3], atol=1e-4, rtol=1e-4)
    dk_want, dv_want = to_pool(p, gd[1], p.k_pages), to_pool(p, gd[2], p.v_pages)
    np.testing.assert_allclose(g[1], dk_want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(g[2], dv_want, atol=1e-4, rtol=1e-4)


# Quantized pools (fnattn.quant): every format and granularity, K and V in different ones.
QUANT = [(QuantFormat("int8"), QuantFormat("int8")),
         (QuantFormat("float8_e4m3fn"), QuantFormat("float8_e5m2", "tensor")),
         (QuantFormat("float8_e5m2"), QuantFormat("int4")),
         (QuantFormat("int4", "tensor"), QuantFormat("float8_e4m3fn", "tensor")),
         (QuantFormat("int8", "tensor"), QuantFormat("int4", "token"))]
QIDS = [f"{k.name}-{k.granularity}/{v.name}-{v.granularity}" for k, v in QUANT]


@pytest.mark.parametrize("formats", QUANT, ids=QIDS)
@pytest.mark.parametrize("case", ["causal-sinks-softcap", "window-mha", "chunked-mqa", "from-fn"])
def test_quantized_ragged_matches_reference_on_the_dequantized_cache(case, formats):
    spec, Hq, Hkv = spec_for(case)
    p = quantized(make(MIXED, Hq=Hq, Hkv=Hkv, D=8, Dv=6, page_size=3, max_seqs=7,
                       pad_tokens=2, seed=1), *formats)
    # impl="auto" (table None): quantized pools run the XLA lowering on every platform
    check_ragged(None, spec, p)


@pytest.mark.parametrize("formats", QUANT[:3], ids=QIDS[:3])
def test_quantized_many_chunks_and_alibi(formats):
    from fnattn import position_bias
    p = quantized(make([(41, 2), (29, 11), (3, 3)], Hq=4, Hkv=2, D=8, page_size=4,
                       pages_per_seq=13, max_seqs=5, seed=3), *formats)
    blocks = PagedBlockSizes(block_q=3, block_k=8)
    check_ragged(XLA, AttentionSpec(mask=masks.causal() & masks.sliding_window(5),
                                    block_sizes=blocks), p)
    alibi = position_bias.alibi(position_bias.alibi_slopes(4))
    res = jax.jit(lambda sp, q, kp, vp, m: fnattn.ragged_paged_attention(sp, q, kp, vp, **m))(
        AttentionSpec(mask=masks.causal(), position_bias=alibi, block_sizes=blocks), p.q,
        p.k_pages, p.v_pages, dict(page_table=p.page_table, context_lengths=p.context_lengths,
                                   query_start_loc=p.query_start_loc, num_seqs=p.num_seqs))
    # the same term on float pools holding the dequantized values
    f = jax.tree_util.tree_map(lambda x: x, p)
    ref = jax.jit(lambda sp, q, kp, vp, m: fnattn.ragged_paged_attention(sp, q, kp, vp, **m))(
        AttentionSpec(mask=masks.causal(), position_bias=alibi, block_sizes=blocks), f.q,
        quant.dequantize(p.k_pages), quant.dequantize(p.v_pages),
        dict(page_table=p.page_table, context_lengths=p.context_lengths,
             query_start_loc=p.query_start_loc, num_seqs=p.num_seqs))
    np.testing.assert_allclose(res.out, ref.out, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("formats", QUANT, ids=QIDS)
def test_quantized_update_writes_what_quantize_gives(formats):
    p = quantized(make(MIXED, Hq=4, Hkv=2, D=6, page_size=3, max_seqs=6, pad_tokens=3,
                       seed=4), *formats)
    check_update(None, spec_for("causal-sinks-softcap")[0].replace(sinks=jnp.arange(4.)), p)


@pytest.mark.parametrize("formats", QUANT[:2], ids=QIDS[:2])
def test_quantized_paged_attention_decode(formats):
    B, Hq, D, Tq = 3, 6, 8, 2
    p = quantized(make([(11, Tq), (5, Tq), (Tq, Tq)], Hq=Hq, Hkv=3, D=D, page_size=4, seed=2),
                  *formats)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.ones(Hq))
    res = jax.jit(fnattn.paged_attention)(spec, p.q.reshape(B, Tq, Hq, D), p.k_pages,
                                          p.v_pages, page_table=p.page_table,
                                          kv_lengths=p.context_lengths)
    assert_close(res.out.reshape(B * Tq, Hq, D), res.lse.transpose(1, 0, 2).reshape(Hq, B * Tq),
                 *expected(spec, p), 2e-5)


def test_quantized_pools_with_nan_codes_and_scales_in_unowned_slots():
    """NaN (and inf) in the codes and the scales of slots no sequence owns change nothing."""
    base = make(MIXED, Hq=4, Hkv=2, D=8, page_size=3, max_seqs=7, pad_tokens=2, seed=7)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.5, 1.0, -1.0, 0.0]))
    for formats in QUANT[:3]:
        p = quantized(base, *formats)
        want = expected(spec, p)
        bad = poisoned(base)                     # NaN in every unowned float slot
        keep = ~np.isnan(np.asarray(bad.k_pages))[..., 0]              # (Hkv, N, ps)
        def spoil(pool):
            scale = pool.scale
            if pool.format.per_token:
                scale = jnp.where(keep, scale, jnp.nan)
            data = pool.data
            if pool.format.is_float:
                data = jnp.where(keep[..., None], data, jnp.array(jnp.inf, data.dtype)
                                 if pool.format.name == "float8_e5m2" else
                                 jnp.array(jnp.nan, data.dtype))
            return pool.replace(data=data, scale=scale)
        pp = p.__class__(**{**p.__dict__, "k_pages": spoil(p.k_pages),
                            "v_pages": spoil(p.v_pages)})
        res = check_ragged(XLA, spec, pp)
        assert_close(res.out, res.lse, *want, 2e-5)


def test_quantized_pool_bad_input():
    p = quantized(make([(5, 1)], Hq=2, Hkv=1, D=8, page_size=4), QuantFormat("int8"))
    bad = p.k_pages.replace(scale=p.k_pages.scale[..., :2])
    with pytest.raises(ValueError, match=r"k_pages.scale must have shape data.shape\[:-1\]"):
        fnattn.ragged_paged_attention(AttentionSpec(), p.q, bad, p.v_pages, page_table=p.page_table,
                                      context_lengths=p.context_lengths,
                                      query_start_loc=p.query_start_loc, num_seqs=p.num_seqs)
    t = quant.quantize(p.v_pages.data.astype(jnp.float32), QuantFormat("int8", "tensor"),
                       scale=1.0)
    with pytest.raises(ValueError, match="v_pages: scale must be finite and > 0"):
        fnattn.ragged_paged_attention(AttentionSpec(), p.q, p.k_pages,
                                      t.replace(scale=jnp.float32(0.0)),
                                      page_table=p.page_table, context_lengths=p.context_lengths,
                                      query_start_loc=p.query_start_loc, num_seqs=p.num_seqs)


@pytest.mark.parametrize("fmt", [None, QuantFormat("int8"), QuantFormat("int4")],
                         ids=["float", "int8", "int4"])
def test_latent_pools_ragged_paged_and_update(fmt):
    """A latent pool (value_dim=Dc, v_pages None, one kv head): ragged, paged and the
    update form equal the same problem with a separate value pool holding the keys'
    first Dc channels (float64 reference on the dequantized pool)."""
    Dc, Dr = 6, 4
    p = make(MIXED, Hq=4, Hkv=1, D=Dc + Dr, Dv=Dc, page_size=3, max_seqs=7, pad_tokens=2,
             seed=11)
    if fmt is not None:
        p = quantized(p, fmt)
    kd = quant.dequantize(p.k_pages)
    # the same problem with separate values: the first Dc channels of the keys
    sep = p.__class__(**{**p.__dict__, "v_pages": kd[..., :Dc],
                         "v_tok": [x[..., :Dc] for x in p.k_tok]})
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.5, 0.0, -1.0, 1.0]))
    m = dict(page_table=p.page_table, context_lengths=p.context_lengths,
             query_start_loc=p.query_start_loc, num_seqs=p.num_seqs)
    res = jax.jit(lambda q, kp, m: fnattn.ragged_paged_attention(spec, q, kp, None,
                                                                 value_dim=Dc, **m))(
        p.q, p.k_pages, m)
    assert res.out.shape == (p.q.shape[0], 4, Dc)
    assert_close(res.out, res.lse, *expected(spec, sep), 2e-5)
    # the update form writes the latent (and rope) channels only
    old = p.k_old
    res, kp, vp = jax.jit(lambda q, k, kp, m: fnattn.ragged_paged_attention_with_update(
        spec, q, k, None, kp, None, value_dim=Dc, **m))(p.q, p.k_new, old, m)
    assert vp is None
    assert_close(res.out, res.lse, *expected(spec, sep), 2e-5)
    from problems import assert_pools_equal
    assert_pools_equal(kp, p.k_pages)


def test_latent_paged_attention_decode_and_bad_input():
    Dc = 6
    B, Tq = 3, 1
    p = make([(11, Tq), (5, Tq), (Tq, Tq)], Hq=4, Hkv=1, D=Dc + 2, Dv=Dc, page_size=4, seed=12)
    sep = p.__class__(**{**p.__dict__, "v_pages": p.k_pages[..., :Dc],
                         "v_tok": [x[..., :Dc] for x in p.k_tok]})
    spec = AttentionSpec(mask=masks.causal())
    res = jax.jit(lambda q, kp: fnattn.paged_attention(
        spec, q, kp, None, page_table=p.page_table, kv_lengths=p.context_lengths,
        value_dim=Dc))(p.q.reshape(B, Tq, 4, Dc + 2), p.k_pages)
    assert_close(res.out.reshape(B * Tq, 4, Dc), res.lse.transpose(1, 0, 2).reshape(4, B * Tq),
                 *expected(spec, sep), 2e-5)
    with pytest.raises(ValueError, match="a latent cache \\(value_dim=6\\) has no separate "
                                         "v_pages"):
        fnattn.paged_attention(spec, p.q.reshape(B, Tq, 4, Dc + 2), p.k_pages, p.k_pages,
                               page_table=p.page_table, kv_lengths=p.context_lengths,
                               value_dim=Dc)
    with pytest.raises(ValueError, match="value_dim must be an int in \\[1, D=8\\]"):
        fnattn.paged_attention(spec, p.q.reshape(B, Tq, 4, Dc + 2), p.k_pages, None,
                               page_table=p.page_table, kv_lengths=p.context_lengths,
                               value_dim=9)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_quantized_and_latent_caches_lower_to_the_kernels_on_gpu_and_tpu(platform):
    """impl='auto' on a GPU or a TPU runs quantized and latent contiguous caches
    (fnattn.decode) in the Pallas kernels (Triton, Mosaic TPU), which dequantize
    after the load: the programs lower for each platform and hold the kernel.
    (The kernels' numbers: tests/decoding/test_quantized_kernels.py.)"""
    from lowering import target
    p = quantized(make([(9, 1), (5, 1)], Hq=4, Hkv=1, D=8, page_size=4, seed=13),
                  QuantFormat("int8"), QuantFormat("float8_e4m3fn", "tensor"))
    spec = AttentionSpec(mask=masks.causal())
    q4 = p.q.reshape(2, 1, 4, 8)
    kc = quant.quantize(jnp.ones((2, 16, 1, 8)), "int4")
    calls = [
        (lambda q, k: fnattn.decode(spec, q, k, k, kv_lengths=jnp.array([9, 5])).out,
         (q4, kc)),
        (lambda q, k: fnattn.decode(spec, q, k, None, kv_lengths=jnp.array([9, 5]),
                                    value_dim=4).out, (q4, kc))]
    for f, args in calls:
        with target(platform):
            text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        kernel = "tpu_custom_call" if platform == "tpu" else "triton"
        assert kernel in text.lower()


def test_quantized_pools_gradients_with_respect_to_q_and_the_scales():
    """Reverse mode through quantized pools: d/dq equals d/dq on float pools holding the
    dequantized values, and d/dscale is the chain rule through the dequantization."""
    p = quantized(make([(6, 2), (9, 1)], Hq=4, Hkv=2, D=8, page_size=3, max_seqs=3, seed=14),
                  QuantFormat("int8"))
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.1, -1., 2., 0.]))
    m = dict(page_table=p.page_table, context_lengths=p.context_lengths,
             query_start_loc=p.query_start_loc, num_seqs=p.num_seqs)

    def loss(q, kp, vp):
        return _loss(fnattn.ragged_paged_attention(spec, q, kp, vp, **m))

    gq, gk = jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True))(p.q, p.k_pages, p.v_pages)
    kd, vd = quant.dequantize(p.k_pages), quant.dequantize(p.v_pages)
    gq_f, gk_f = jax.jit(jax.grad(loss, argnums=(0, 1)))(p.q, kd, vd)
    np.testing.assert_allclose(gq, gq_f, atol=1e-5, rtol=1e-5)
    # d/dscale[h, n, o] = sum_d dL/dk[h, n, o, d] * code[h, n, o, d]
    codes = p.k_pages.data.astype(jnp.float32)
    np.testing.assert_allclose(gk.scale, jnp.sum(gk_f * codes, -1), atol=1e-4, rtol=1e-4)
