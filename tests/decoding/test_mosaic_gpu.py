"""The Pallas Mosaic GPU lowering of fnattn.decode (fnattn/decoding/mosaic_gpu.py).

* the kernel in JAX's Mosaic GPU interpreter on CPU, under jax.jit, against
  each sequence's dense problem in float64 NumPy (tests/test_decoding.py's
  helpers): every positional mask, MHA/GQA/MQA, one to three query tokens,
  sinks, soft-cap, kv_starts, empty sequences, one split and several, D != Dv,
  wide heads, float16 and bfloat16. Slots outside each range hold huge finite
  values, and the XLA pass that recomputes poisoned calls is replaced by NaN,
  so these results are the kernel's own;
* NaN in the cache where the sequence does not look: the result is the XLA
  lowering's; a visible NaN key: NaN rows only;
* lowering for "cuda" on CPU (a Hopper GPU stood in for): one Mosaic GPU
  kernel, no Triton one, shared memory as estimated, under jax 0.10.2 and
  0.11.2; which kernel impl="auto" and impl="pallas" pick; refusals.
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decoding import MASKS, WINDOW, check, expected, hide_before_window
from lowering import gpu_target, mosaic_gpu_smem
from mosaic_gpu_interpreter import compile_once, reset_after_failure

import fnattn
from fnattn import AttentionSpec, DecodeBlockSizes, masks
from fnattn.decoding import api, triton, xla
from fnattn.decoding import mosaic_gpu as dm
from fnattn.decoding.mosaic_gpu import MosaicGpuDecodeBlockSizes, Tiles
from fnattn.flash import mosaic_gpu as flash_mgpu

pytest.importorskip("absl")   # (Mosaic GPU imports it)

S = 192   # three key blocks of 64
HUGE = 3e4


@pytest.fixture(scope="module", autouse=True)
def _fast_interpreter():
    with compile_once():
        yield


def route(monkeypatch):
    """Routes fnattn.decode to the interpreted kernel."""
    fwd = functools.partial(dm.forward, interpret=flash_mgpu.interpret_params())

    def interpreted(*args):
        try:
            return fwd(*args)
        except Exception:
            reset_after_failure()
            raise
    monkeypatch.setattr(api, "lowering_table", lambda impl: (("default", interpreted),))


@pytest.fixture
def kernel(monkeypatch):
    use_kernel(monkeypatch)


def use_kernel(monkeypatch):
    """The interpreted kernel, with the XLA pass that recomputes a poisoned call
    replaced by NaN: a result that matches came from the kernel."""
    route(monkeypatch)

    def nan_forward(cfg, q, k, v, *args):
        out, lse = xla.forward(cfg, q, k, v, *args)
        return jnp.full_like(out, jnp.nan), jnp.full_like(lse, jnp.nan)
    monkeypatch.setattr(dm, "xla", types.SimpleNamespace(forward=nan_forward))


def make(*, B=3, Tq=2, Hq=6, Hkv=2, D=64, Dv=64, dtype=jnp.bfloat16, seed=0,
         lengths=(150, 70, 0), starts=(10, 100, 3), outside=HUGE):
    """q, k, v, lengths, starts over a cache of ``S`` slots whose slots outside
    each sequence's range hold ``outside`` (huge, or NaN)."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, S, Hkv, Dv), jnp.float32)
    L, a = jnp.array(lengths[:B], jnp.int32), jnp.array(starts[:B], jnp.int32)
    slot = jnp.arange(S)[None, :, None, None]
    live = (slot >= a[:, None, None, None]) & (slot < (a + L)[:, None, None, None])
    return (q, jnp.where(live, k, outside).astype(dtype), jnp.where(live, v, outside).astype(dtype),
            L, a)


TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


@pytest.mark.parametrize("mask", list(MASKS))
def test_interpreted_masks(kernel, mask):
    """Every positional mask (a from_fn one among them), two query tokens, a
    group of 3, starts inside blocks, an empty sequence, two splits."""
    q, k, v, L, a = make()
    spec = AttentionSpec(mask=MASKS[mask], block_sizes=DecodeBlockSizes(num_splits=2))
    check(spec, q, k, v, L, a, tol=TOL[jnp.bfloat16])


@pytest.mark.parametrize("Hq,Hkv,Tq,splits", [(2, 2, 1, 1), (8, 1, 1, 3), (6, 2, 3, 1),
                                              (64, 1, 1, 2)])
def test_interpreted_mha_mqa_gqa_and_query_tokens(kernel, Hq, Hkv, Tq, splits):
    """Up to 64 rows per kv head (one wgmma slab): 64 query heads on one kv head."""
    q, k, v, L, a = make(Hq=Hq, Hkv=Hkv, Tq=Tq, seed=1, lengths=(192, 33, 64),
                         starts=(0, 159, 64))
    spec = AttentionSpec(mask=masks.causal(), block_sizes=DecodeBlockSizes(num_splits=splits))
    check(spec, q, k, v, L, a, tol=TOL[jnp.bfloat16])


@pytest.mark.parametrize("D,Dv,dtype", [(128, 64, jnp.float16), (64, 128, jnp.bfloat16),
                                        (256, 256, jnp.bfloat16)])
def test_interpreted_head_dims_and_dtypes(kernel, D, Dv, dtype):
    """D != Dv both ways, float16, and wide heads (partial outputs in the caches'
    dtype: Tiles.out_f32 False), with three splits."""
    q, k, v, L, a = make(D=D, Dv=Dv, dtype=dtype, seed=2, Hq=4, Hkv=2)
    spec = AttentionSpec(mask=masks.causal(), block_sizes=DecodeBlockSizes(num_splits=3))
    assert dm.plan(D, Dv, S).out_f32 == (max(D, Dv) <= 128)
    check(spec, q, k, v, L, a, tol=TOL[dtype])


@pytest.mark.parametrize("splits", [1, 3])
def test_interpreted_softcap_scale_and_sinks(kernel, splits):
    """Soft-cap, an explicit scale and sinks, infinite ones included: -inf is no
    sink, +inf takes all the mass (out 0, lse +inf)."""
    q, k, v, L, a = make(seed=3)
    sinks = jnp.array([0.5, jnp.inf, -jnp.inf, -1.0, 2.0, 0.0])
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(40), softcap=5.0,
                         scale=0.3, sinks=sinks,
                         block_sizes=DecodeBlockSizes(num_splits=splits))
    run = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L, kv_starts=a))
    res = run(q, k, v)
    out, lse = expected(spec, q, k, v, np.asarray(L), np.asarray(a))
    tol = TOL[jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(res.out, np.float64), out, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(res.lse) == np.inf, lse == np.inf)
    finite = np.isfinite(lse)
    np.testing.assert_allclose(np.asarray(res.lse)[finite], lse[finite], atol=tol, rtol=tol)


def _term(B, Hq, offset=0.0):
    """ALiBi plus a from_fn term of the sequence, the head, the key and a
    per-(sequence, head) array, offset by ``offset`` on every logit."""
    from fnattn import position_bias
    r = jnp.linspace(-0.5, 1.0, B * Hq).reshape(B, Hq)
    return position_bias.alibi(jnp.asarray(position_bias.alibi_slopes(Hq)) * 0.5) \
        + position_bias.from_fn(
            lambda b, h, q, k, r: jnp.where(k % 3 == h % 2, r, 0.0) * (b + 1) + offset, r)


@pytest.mark.parametrize("softcap,splits,offset", [(None, 1, 0.0), (5.0, 2, 0.0),
                                                   (None, 3, 1e4)])
def test_interpreted_position_terms(monkeypatch, softcap, splits, offset):
    """A position term (ALiBi and a from_fn of the sequence, head, key and a
    per-row array) added to the scaled logits before the cap, at each row's head and
    position: the XLA lowering's result (tests/test_position_bias.py checks
    that against the reference). Without a cap the row state is in natural
    units; an offset of 1e4 on every logit leaves out and lse - 1e4 as they
    were."""
    q, k, v, L, a = make(seed=9)
    B, Tq, Hq, _ = q.shape
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(90), softcap=softcap,
                         sinks=jnp.linspace(-1.0, 1.0, Hq),
                         position_bias=_term(B, Hq, offset),
                         block_sizes=DecodeBlockSizes(num_splits=splits))
    f = jax.jit(lambda spec, q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L, kv_starts=a))
    want = f(spec.replace(impl="xla"), q, k, v)
    use_kernel(monkeypatch)
    got = f(spec, q, k, v)
    tol = TOL[jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(got.out, np.float32),
                               np.asarray(want.out, np.float32), atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isneginf(got.lse), np.isneginf(want.lse))
    np.testing.assert_allclose(np.asarray(got.lse) - offset, np.asarray(want.lse) - offset,
                               atol=tol, rtol=tol)
    assert np.isfinite(np.asarray(got.out, np.float32)).all()


def test_interpreted_huge_terms_keep_rows_exact(monkeypatch):
    """Without a cap a term keeps the row state in natural units: rows whose
    every logit is about -4e30 (a slope of 1e30, no key within distance 4)
    still weigh their nearest keys as the XLA lowering does."""
    from fnattn import position_bias
    q, k, v, L, a = make(Tq=1, Hq=4, seed=11)
    spec = AttentionSpec(mask=~masks.sliding_window(3, 3),
                         position_bias=position_bias.alibi(jnp.array([1e30, 1.0, 1e20, 0.5])))
    f = jax.jit(lambda spec, q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L, kv_starts=a))
    want = f(spec.replace(impl="xla"), q, k, v)
    use_kernel(monkeypatch)
    got = f(spec, q, k, v)
    np.testing.assert_allclose(np.asarray(got.out, np.float32),
                               np.asarray(want.out, np.float32), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(got.lse, want.lse, rtol=1e-5)
    assert np.isfinite(np.asarray(got.out, np.float32)).all()


def test_interpreted_term_of_minus_infinity(monkeypatch):
    """A term of -inf hides keys as a mask does, on blocks every row sees whole
    too (sequence 0's first two blocks): rows that see no other key are 0 with
    lse -inf, the others as the XLA lowering's, from the kernel itself."""
    from fnattn import position_bias
    q, k, v, _, _ = make(B=3, Tq=1, Hq=4, seed=10)
    L, a = jnp.array([192, 40, 100]), jnp.array([0, 0, 64])
    term = position_bias.from_fn(lambda b, h, q, k: jnp.where(k < 128, -jnp.inf, 0.0))
    spec = AttentionSpec(mask=masks.causal(), position_bias=term)
    f = jax.jit(lambda spec, q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L, kv_starts=a))
    want = f(spec.replace(impl="xla"), q, k, v)
    use_kernel(monkeypatch)
    got = f(spec, q, k, v)
    assert np.isneginf(got.lse[1:]).all() and not np.asarray(got.out[1:], np.float32).any()
    np.testing.assert_array_equal(np.isneginf(got.lse), np.isneginf(want.lse))
    np.testing.assert_allclose(np.asarray(got.out, np.float32),
                               np.asarray(want.out, np.float32), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(got.lse[0], want.lse[0], atol=2e-2, rtol=2e-2)


def test_interpreted_default_tiles_and_splits(kernel):
    """No DecodeBlockSizes: the plan's block (64, dividing S = 192) and
    auto_splits' count for the interpreter's three "multiprocessors"."""
    assert dm.plan(64, 64, S) == Tiles(64, 4, True)
    assert dm.auto_splits(2 * 2, S // 64, flash_mgpu._programs(True)) == 1
    q, k, v, L, a = make(B=2, Hq=4, Hkv=2, seed=4, lengths=(190, 1), starts=(2, 0))
    check(AttentionSpec(mask=masks.causal()), q, k, v, L, a, tol=TOL[jnp.bfloat16])


@pytest.mark.parametrize("splits", [1, 2])
def test_poisoned_slots_give_the_xla_result(monkeypatch, splits):
    """NaN outside each range (read by the boundary blocks: 0 * NaN in P V) and in
    the sequence's own slots a window hides, infinite sinks: the call is
    computed again by the XLA lowering, whose answer it gives, finite. (Under
    x64 the interpreter cannot run the kernel; its lowering is tested there.)"""
    q, k, v, L, a = make(seed=5, outside=jnp.nan)
    k, v = hide_before_window(k, v, L, a, q.shape[1])
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(WINDOW),
                         sinks=jnp.array([0.0, jnp.inf, -jnp.inf, 1.0, -jnp.inf, 0.5]),
                         block_sizes=DecodeBlockSizes(num_splits=splits))

    def f(impl):
        return jax.jit(lambda q, k, v: fnattn.decode(spec.replace(impl=impl), q, k, v,
                                                     kv_lengths=L, kv_starts=a))
    want = f("xla")(q, k, v)
    route(monkeypatch)
    res = f("auto")(q, k, v)
    np.testing.assert_array_equal(np.asarray(res.out), np.asarray(want.out))
    np.testing.assert_array_equal(res.lse, want.lse)
    assert np.isfinite(np.asarray(res.out, np.float32)).all()


def test_a_visible_nan_key_gives_nan_rows_only(monkeypatch):
    """Honest NaN: rows that see a non-finite key are NaN, the others are not."""
    route(monkeypatch)
    q, k, v, L, a = make(B=2, seed=6, lengths=(100, 50), starts=(0, 0))
    k = k.at[0, 97, 0, 1].set(jnp.inf)       # sequence 0, kv head 0, position 97
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(4))
    res = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L, kv_starts=a))(
        q, k, v)
    out, lse = np.asarray(res.out, np.float32), np.asarray(res.lse)
    # queries at positions 98 and 99 see 94..98 and 95..99; heads 0-2 read kv head 0
    assert np.isnan(out[0, :, :3]).all() and np.isnan(lse[0, :3]).all()
    assert np.isfinite(out[0, :, 3:]).all() and np.isfinite(out[1]).all()


def test_gradients_through_the_kernel_are_xla_s(monkeypatch):
    """decode's derivatives are the XLA lowering's whatever the forward: through
    the kernel they equal impl="xla"'s, and so does the forward."""
    q, k, v, L, a = make(B=2, seed=7, lengths=(120, 64), starts=(3, 128))
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.linspace(-1.0, 1.0, 6))
    w = jnp.cos(jnp.arange(64.0))

    def loss(spec, q, k, v):
        out = fnattn.decode(spec, q, k, v, kv_lengths=L, kv_starts=a).out.astype(jnp.float32)
        return jnp.sum(out * w), out

    grads = jax.jit(jax.grad(loss, argnums=(1, 2, 3), has_aux=True))
    want, want_out = grads(spec.replace(impl="xla"), q, k, v)
    route(monkeypatch)
    got, got_out = grads(spec, q, k, v)
    np.testing.assert_allclose(got_out, want_out, atol=2e-2)
    for g, g0 in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g0, np.float32),
                                   atol=1e-2)


def test_interpreted_under_vmap(monkeypatch):
    """vmap over a leading axis adds a grid axis to the kernel: each slice's
    result is that slice's XLA result."""
    ks = jax.random.split(jax.random.key(8), 3)
    q = jax.random.normal(ks[0], (3, 2, 1, 4, 64)).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (3, 2, 128, 2, 64)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (3, 2, 128, 2, 64)).astype(jnp.bfloat16)
    L = jnp.array([[100, 5], [128, 0], [1, 64]])

    def f(spec):
        return jax.jit(jax.vmap(lambda q, k, v, L: fnattn.decode(spec, q, k, v,
                                                                 kv_lengths=L).out))
    want = f(AttentionSpec(mask=masks.causal(), impl="xla"))(q, k, v, L)
    route(monkeypatch)
    got = f(AttentionSpec(mask=masks.causal()))(q, k, v, L)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2)


# ----------------------------------------------------------------------------------
# Tiles, splits and refusals
# ----------------------------------------------------------------------------------


def test_plan_fits_shared_memory_and_prefers_float32_outputs():
    for D, Dv in [(64, 64), (128, 128), (128, 256), (256, 256)]:
        t = dm.plan(D, Dv, 4096)
        assert t.stages >= 2 and t.block_k in (64, 128)
        assert dm.smem_bytes(D, Dv, t.block_k, t.stages, 2, 4 if t.out_f32 else 2) \
            <= flash_mgpu.SMEM_BYTES
    assert dm.plan(128, 128, 4096) == Tiles(128, 2, True)
    assert dm.plan(256, 256, 4096) == Tiles(64, 2, False)
    assert dm.plan(128, 128, 4096, MosaicGpuDecodeBlockSizes(block_k=64)) == Tiles(64, 4, True)
    assert dm.plan(128, 128, 4096, MosaicGpuDecodeBlockSizes(max_concurrent_steps=1)) \
        == Tiles(128, 1, True)
    with pytest.raises(ValueError, match=r"needs \d+ bytes of shared memory"):
        dm.plan(256, 256, 4096, MosaicGpuDecodeBlockSizes(block_k=128, max_concurrent_steps=2))
    with pytest.raises(ValueError, match="must divide the cache length S=192"):
        dm.plan(64, 64, 192, MosaicGpuDecodeBlockSizes(block_k=128))


def test_auto_splits_fill_one_wave():
    assert dm.auto_splits(128, 64, 132) == 1      # B=16, Hkv=8: one program each
    assert dm.auto_splits(8, 512, 132) == 16      # B=1, Hkv=8, 32k keys
    assert dm.auto_splits(8, 6, 132) == 3         # at least two blocks per split
    assert dm.auto_splits(512, 512, 132) == 1


def cfg_of(mask=None, term=None):
    return api.Cfg(scale=0.1, softcap=None,
                   mask_treedef=None if mask is None else jax.tree_util.tree_structure(mask),
                   num_splits=None,
                   term_treedef=None if term is None else jax.tree_util.tree_structure(term))


def shapes(B=2, Tq=1, Hq=8, Hkv=2, D=128, Dv=128, S_=4096, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((B, Tq, Hq, D), dtype),
            jax.ShapeDtypeStruct((B, S_, Hkv, D), dtype),
            jax.ShapeDtypeStruct((B, S_, Hkv, Dv), dtype))


@pytest.mark.parametrize("what,kw,words", [
    ("dtype", dict(dtype=jnp.float32), "float32 caches"),
    ("D", dict(D=96), "head dim D=96"),
    ("Dv", dict(Dv=320), "head dim Dv=320"),
    ("rows", dict(Tq=3, Hq=64, Hkv=2), "96 query rows per kv head"),
    ("S", dict(S_=1000), "S=1000 slots"),
])
def test_supports_refuses_with_reasons(what, kw, words):
    assert dm.supports(cfg_of(), *shapes()) == []
    why = dm.supports(cfg_of(), *shapes(**kw))
    assert len(why) == 1 and words in why[0], (what, why)


def test_supports_refuses_functions_mosaic_gpu_cannot_lower():
    """In a mask or a position term; ALiBi and terms of lowered operations run."""
    from fnattn import position_bias
    assert dm.supports(cfg_of(term=position_bias.alibi(jnp.ones(8))), *shapes()) == []
    assert dm.supports(cfg_of(term=_term(2, 8)), *shapes()) == []
    sqrt_fn = masks.from_fn(lambda b, h, q, k: jnp.sqrt(1.0 * k) < 40)
    assert any("sqrt" in w for w in dm.supports(cfg_of(sqrt_fn), *shapes()))
    sqrt_term = position_bias.from_fn(lambda b, h, q, k: jnp.sqrt(1.0 * k))
    why = dm.supports(cfg_of(term=sqrt_term), *shapes())
    assert len(why) == 1 and "sqrt" in why[0], why
    assert dm.supports(cfg_of(MASKS["fn"]), *shapes()) == []


def test_block_sizes_are_checked():
    with pytest.raises(ValueError, match="block_k must be 64, 128 or None"):
        MosaicGpuDecodeBlockSizes(block_k=32)
    with pytest.raises(ValueError, match="max_concurrent_steps must be a positive int"):
        MosaicGpuDecodeBlockSizes(max_concurrent_steps=0)
    AttentionSpec(block_sizes=(MosaicGpuDecodeBlockSizes(), DecodeBlockSizes(num_splits=2)))


# ----------------------------------------------------------------------------------
# Lowering for "cuda" on CPU
# ----------------------------------------------------------------------------------


def lowered(spec, q, k, v):
    L = jax.ShapeDtypeStruct((q.shape[0],), jnp.int32)
    f = jax.jit(lambda q, k, v, L: fnattn.decode(spec, q, k, v, kv_lengths=L).out)
    with gpu_target():
        return f.trace(q, k, v, L).lower(lowering_platforms=("cuda",)).as_text()


def kernels(text):
    """(how many Mosaic GPU kernels, whether the Triton decode kernel) in a
    lowered program."""
    return len(re.findall(r"custom_call @mosaic_gpu", text)), triton.KERNEL_NAME in text


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(flash_mgpu, "available", lambda: None)


LOWER = [
    # D, Dv, Hq, Hkv, Tq, mask, softcap, sinks, splits, block sizes
    (128, 128, 32, 8, 1, masks.causal(), None, False, None, MosaicGpuDecodeBlockSizes()),
    (64, 64, 8, 8, 2, masks.causal() & masks.sliding_window(100), 30.0, True, 4,
     MosaicGpuDecodeBlockSizes(block_k=64, max_concurrent_steps=3)),
    (256, 256, 16, 2, 1, masks.chunked(64) & masks.causal(), 30.0, True, None,
     MosaicGpuDecodeBlockSizes()),
    (128, 64, 64, 1, 1, MASKS["fn"], None, False, 2, MosaicGpuDecodeBlockSizes(block_k=128)),
    (192, 128, 12, 4, 3, None, None, True, None, MosaicGpuDecodeBlockSizes()),
]


@pytest.mark.parametrize("D,Dv,Hq,Hkv,Tq,mask,softcap,sinks,splits,bs", LOWER)
def test_lowers_for_cuda(hopper, D, Dv, Hq, Hkv, Tq, mask, softcap, sinks, splits, bs):
    """Asked for by name on a Hopper GPU, impl="auto" and impl="pallas" lower to
    one Mosaic GPU kernel and no Triton kernel."""
    sizes = (bs,) + ((DecodeBlockSizes(num_splits=splits),) if splits else ())
    for impl in ("auto", "pallas"):
        spec = AttentionSpec(mask=mask, softcap=softcap, impl=impl, block_sizes=sizes,
                             sinks=jnp.linspace(-1.0, 1.0, Hq) if sinks else None)
        assert kernels(lowered(spec, *shapes(Hq=Hq, Hkv=Hkv, Tq=Tq, D=D, Dv=Dv))) == (1, False)


@pytest.mark.parametrize("D,Dv,bk,stages", [(128, 128, 64, 4), (128, 128, 128, 2),
                                            (256, 256, 64, 2), (64, 128, 64, 1)])
def test_lowering_counts_the_estimated_shared_memory(hopper, D, Dv, bk, stages):
    spec = AttentionSpec(mask=masks.causal(), block_sizes=MosaicGpuDecodeBlockSizes(
        block_k=bk, max_concurrent_steps=stages))
    tiles = dm.plan(D, Dv, 4096, spec.block_sizes)
    count = mosaic_gpu_smem(lambda: lowered(spec, *shapes(D=D, Dv=Dv)))
    assert count == dm.smem_bytes(D, Dv, bk, stages, 2, 4 if tiles.out_f32 else 2)


def test_lowering_picks_the_kernel(monkeypatch):
    """Without MosaicGpuDecodeBlockSizes, or without a Hopper GPU, decode lowers
    to the Triton kernel; asked for by name on Hopper, to this one; asked for a
    call it cannot take, it says why."""
    asked = AttentionSpec(block_sizes=MosaicGpuDecodeBlockSizes())
    assert kernels(lowered(AttentionSpec(), *shapes())) == (0, True)
    assert kernels(lowered(asked, *shapes())) == (0, True)        # (no Hopper here)
    monkeypatch.setattr(flash_mgpu, "available", lambda: None)
    assert kernels(lowered(AttentionSpec(), *shapes())) == (0, True)
    assert kernels(lowered(asked, *shapes())) == (1, False)
    with pytest.raises(NotImplementedError, match=r"S=1000 slots.*Pallas Triton kernel"):
        lowered(asked, *shapes(S_=1000))


@pytest.mark.parametrize("softcap,splits", [(None, None), (30.0, 4)])
def test_lowers_for_cuda_with_a_position_term(hopper, softcap, splits):
    """ALiBi and a from_fn term with a per-(sequence, head) array (its values
    reach shared memory beside the queries): one Mosaic GPU kernel, its shared
    memory as estimated."""
    bs = MosaicGpuDecodeBlockSizes(block_k=64, max_concurrent_steps=4)
    sizes = (bs,) + ((DecodeBlockSizes(num_splits=splits),) if splits else ())
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(300), softcap=softcap,
                         position_bias=_term(2, 32), block_sizes=sizes)
    args = shapes(Hq=32, Hkv=8, Tq=2)
    assert kernels(lowered(spec, *args)) == (1, False)
    count = mosaic_gpu_smem(lambda: lowered(spec, *args))
    assert count == dm.smem_bytes(128, 128, 64, 4, 2, 4, terms=2)
    assert dm.plan(128, 128, 4096, bs, terms=2) == Tiles(64, 4, True)


def test_lowers_for_cuda_under_x64(hopper):
    with jax.enable_x64(True):
        test_lowers_for_cuda(None, *LOWER[1])


# ----------------------------------------------------------------------------------
# On an NVIDIA GPU
# ----------------------------------------------------------------------------------

ON_GPU = jax.devices()[0].platform == "gpu"


@pytest.mark.skipif(not ON_GPU or flash_mgpu.available() is not None,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_mosaic_gpu_decode_matches_xla(D):
    """The compiled kernel against the XLA lowering: long ragged contexts with
    starts, several splits, a window, soft-cap, sinks, GQA, two query tokens,
    a position term without a cap; and NaN in every slot outside the ranges
    (the XLA pass)."""
    B, Sg, Hq, Hkv = 5, 4096, 32, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, 2, Hq, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, Sg, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, Sg, Hkv, D), jnp.bfloat16)
    L, a = jnp.array([4096, 3000, 17, 1, 0]), jnp.array([0, 1000, 5, 4000, 0])
    slot = jnp.arange(Sg)[None, :, None, None]
    live = (slot >= a[:, None, None, None]) & (slot < (a + L)[:, None, None, None])
    f = jax.jit(lambda spec, q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=L, kv_starts=a))
    for mask, splits, term in ((masks.causal(), None, False),
                               (masks.causal() & masks.sliding_window(300), 4, False),
                               (masks.causal(), 4, True)):
        sizes = (MosaicGpuDecodeBlockSizes(),) + (
            (DecodeBlockSizes(num_splits=splits),) if splits else ())
        spec = AttentionSpec(mask=mask, sinks=jnp.linspace(-1.0, 1.0, Hq),
                             softcap=None if term else 30.0,
                             position_bias=_term(B, Hq) if term else None, block_sizes=sizes)
        for kk, vv in ((k, v), (jnp.where(live, k, jnp.nan), jnp.where(live, v, jnp.nan))):
            got, want = f(spec, q, kk, vv), f(spec.replace(impl="xla"), q, k, v)
            np.testing.assert_allclose(np.asarray(got.out, np.float32),
                                       np.asarray(want.out, np.float32), atol=3e-2, rtol=3e-2)
            np.testing.assert_allclose(got.lse, want.lse, atol=3e-2, rtol=3e-2)
