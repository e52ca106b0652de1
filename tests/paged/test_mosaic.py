"""The Pallas Mosaic (TPU) lowering of paged attention (fnattn/paged/mosaic.py).

* interpret mode on CPU against the dense problems (float64 NumPy, and
  ``fnattn.reference`` for some): ragged mixed prefill/decode batches with
  padding tokens and padding sequences, MHA/GQA/MQA (groups padded to a power of
  two), sinks, soft-cap, windows and other positional masks, several key blocks
  per item (the double-buffered page copies, a last block past the page table),
  split-K, the cache update inside the kernel, decode through
  ``paged_attention`` with its gradients, low-precision dtypes;
* the TPU interpreter (``pltpu.InterpretParams``) with NaN-filled scratch
  memory, its race detector and its bounds checks on every DMA, on well-formed
  and on corrupted metadata (which must never make the kernels leave the pools);
* page sizes the kernel refuses (not a multiple of 8): ``impl="pallas"`` raises,
  ``impl="auto"`` runs them with the XLA lowering;
* lowering for TPU on CPU over dtypes, head dims, groups, masks, forms and splits.

Pages are 8 or 16 slots here (the kernel's minimum is 8), so the problems are
short and interpret mode stays fast.
"""

import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import fnattn  # noqa: E402
from fnattn import AttentionSpec, PagedBlockSizes, masks  # noqa: E402
from fnattn.paged import api, common, mosaic, xla  # noqa: E402
from lowering import cheap_compiles, tpu_target  # noqa: E402
from problems import (assert_close, check_ragged, check_update, expected, make,  # noqa: E402
                      meta)


@pytest.fixture(autouse=True, scope="module")
def _cheap_compiles():
    with cheap_compiles():
        yield


INTERPRET = (("default", mosaic.forward_interpret),)
XLA = (("default", xla.forward),)
ON_TPU = (("default", xla.forward), ("tpu", mosaic.forward))
KERNEL = "fnattn_paged_mosaic"
WRITE_KERNEL = "fnattn_paged_mosaic_write"

# (L, n) per sequence: chunked prefill, a long decode, prefill from scratch, a
# one-token sequence, a context that fills whole pages, a live sequence with no
# new token. Contexts up to 21 keys: 3 pages of 8.
MIXED = [(11, 3), (21, 1), (8, 8), (1, 1), (16, 2), (9, 0)]

# Each case has its own GQA shape and tiling, so that together they cover MHA,
# MQA, a group of 5 (padded to 8 rows), a non-power-of-two block_q, one page per
# key block, two pages per block with a last block that runs past the page table,
# the whole capacity in one block (the default), keys after the query (a
# two-sided window), split-K without sinks.
CASES = {
    "full-gqa": dict(mask=None),
    "causal-sinks-softcap": dict(mask=masks.causal(), softcap=4.0, sinks=True,
                                 blocks=PagedBlockSizes(block_q=2, block_k=16)),
    "window-mha": dict(mask=masks.causal() & masks.sliding_window(3), heads=(3, 3),
                       blocks=PagedBlockSizes(block_q=4, block_k=8)),
    "chunked-mqa-splits": dict(mask=masks.chunked(4) & masks.causal(), scale=0.3, heads=(5, 1),
                               blocks=PagedBlockSizes(block_q=3, block_k=8, num_splits=2)),
    "from-fn-two-sided": dict(
        mask=masks.from_fn(lambda b, h, q, k: (k + h) % 3 != 0) & masks.sliding_window(2, 1),
        heads=(4, 4), blocks=PagedBlockSizes(block_q=1, block_k=16)),
}


def spec_for(case, **kw):
    c = dict(CASES[case])
    Hq, Hkv = c.pop("heads", (6, 2))
    sinks = jnp.linspace(-1.0, 2.0, Hq) if c.pop("sinks", False) else None
    blocks = c.pop("blocks", None)
    return AttentionSpec(sinks=sinks, block_sizes=blocks, **c, **kw), Hq, Hkv


def mixed(Hq, Hkv, **kw):
    kw = dict(D=16, Dv=8, page_size=8, max_seqs=8, pad_tokens=3, seed=1) | kw
    return make(MIXED, Hq=Hq, Hkv=Hkv, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_interpret_ragged_matches_dense(case):
    spec, Hq, Hkv = spec_for(case)
    # One case against fnattn.reference itself, the others against float64 NumPy.
    check_ragged(INTERPRET, spec, mixed(Hq, Hkv), use_reference=case == "causal-sinks-softcap")


def test_interpret_split_k_with_sinks():
    """Three splits of one-page key blocks merged outside the kernel, the sinks counted
    once; the window leaves each item one or two key blocks, so some splits are empty
    (0 and -inf from the kernel, which the merge must ignore)."""
    p = mixed(6, 2, seed=2)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(6), softcap=5.0,
                         sinks=jnp.linspace(-1.0, 2.0, 6),
                         block_sizes=PagedBlockSizes(block_q=2, block_k=8, num_splits=3))
    check_ragged(INTERPRET, spec, p)


def test_interpret_update_writes_the_pools():
    """The new tokens land in their slots and nothing else changes: not the pad tokens
    (whose rows a padding sequence's query_start_loc claims, with junk page-table
    entries and lengths), not the pool's other pages, not the old tokens."""
    p = mixed(4, 2, D=8, Dv=8, seed=3)
    assert int(p.query_start_loc[-1]) > int(p.query_start_loc[len(MIXED)])  # padding owns rows
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.arange(4.0),
                         block_sizes=PagedBlockSizes(block_q=2, block_k=8, num_splits=2))
    check_update(INTERPRET, spec, p)


def test_write_tokens_alone_drops_padding_and_invalid_slots():
    """mosaic.write_tokens against the XLA scatter, with no live sequence (nothing may
    change) and with a page entry outside the pool and one negative (writes dropped)."""
    p = mixed(2, 2, D=8, Dv=8, seed=4)
    spec = AttentionSpec(mask=masks.causal())
    T = p.q.shape[0]
    S, P = p.page_table.shape
    N = p.k_pages.shape[1]
    cfg = api._make_cfg(spec, num_q_heads=2, num_kv_heads=2, head_dim=8, v_head_dim=8,
                        num_pages=N, page_size=8, pages_per_seq=P, max_seqs=S, total_tokens=T,
                        uniform_q=None, update=True)
    table = p.page_table.at[0, 1].set(N + 4).at[2, 0].set(-2)

    def both(num_seqs):
        m = common.sanitize(cfg, table, p.context_lengths, p.query_start_loc, num_seqs)
        args = (cfg, m, p.k_old, p.v_old, p.k_new, p.v_new)
        return mosaic.write_tokens(*args, interpret=True), xla.write_tokens(*args)

    f = jax.jit(both)
    (kp, vp), (kx, vx) = f(jnp.int32(0))
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(p.k_old))
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(p.v_old))
    (kp, vp), (kx, vx) = f(p.num_seqs)
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(kx))
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(vx))
    assert not np.array_equal(np.asarray(kp), np.asarray(p.k_old))


def test_interpret_bfloat16():
    """bfloat16 pools and queries: the products run in bfloat16 (float32 accumulation)."""
    p = mixed(6, 2, dtype=jnp.bfloat16, seed=5)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.linspace(-1.0, 1.0, 6), softcap=8.0,
                         block_sizes=PagedBlockSizes(block_q=4, block_k=16))
    check_ragged(INTERPRET, spec, p, tol=3e-2)


def _decode_problem(Tq, dtype=jnp.float32):
    return make([(17, Tq), (Tq, Tq), (9, Tq)], Hq=4, Hkv=1, D=8, page_size=8, dtype=dtype,
                 seed=6 + Tq)


def _decode(table, spec, p, q, k_pages, v_pages):
    return api.paged_attention_with(table, spec, q, k_pages, v_pages, page_table=p.page_table,
                                    kv_lengths=p.context_lengths)


def test_interpret_decode_float16_bthd():
    """paged_attention, one token per sequence (one item each) in float16, which runs in
    float32 (TPUs have no float16 arithmetic) and returns float16."""
    p = _decode_problem(1, jnp.float16)
    spec = AttentionSpec(mask=masks.causal(), softcap=6.0, sinks=jnp.ones(4))
    res = jax.jit(lambda spec, q, kp, vp: _decode(INTERPRET, spec, p, q, kp, vp))(
        spec, p.q[:, None], p.k_pages, p.v_pages)
    assert res.out.dtype == jnp.float16 and res.out.shape == (3, 1, 4, 8)
    assert res.lse.dtype == jnp.float32 and res.lse.shape == (3, 4, 1)
    assert_close(res.out[:, 0], res.lse[:, :, 0].T, *expected(spec, p), 3e-3)


def test_interpret_decode_bhtd_and_gradients():
    """paged_attention with Tq=3 in the "bhtd" layout through the custom_jvp: the forward
    equals the dense problem, the gradients the XLA lowering's."""
    B, Tq, Hq, D = 3, 3, 4, 8
    p = _decode_problem(Tq)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.zeros(Hq), layout="bhtd",
                         block_sizes=PagedBlockSizes(block_k=8))
    q = p.q.reshape(B, Tq, Hq, D).transpose(0, 2, 1, 3)

    def loss(table, q, kp, vp):
        r = _decode(table, spec, p, q, kp, vp)
        return jnp.sum(jnp.sin(r.out)) + jnp.sum(r.lse), r

    (_, r1), g1, (_, r2), g2 = (
        x for t in (INTERPRET, XLA)
        for x in jax.jit(jax.value_and_grad(functools.partial(loss, t), argnums=(0, 1, 2),
                                            has_aux=True))(q, p.k_pages, p.v_pages))
    assert r1.lse.shape == (B, Hq, Tq)
    out = r1.out.transpose(0, 2, 1, 3).reshape(B * Tq, Hq, D)
    assert_close(out, r1.lse.transpose(1, 0, 2).reshape(Hq, B * Tq), *expected(spec, p), 2e-5)
    np.testing.assert_allclose(r1.out, r2.out, atol=2e-5)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


# ----------------------------------------------------------------------------------
# The TPU interpreter: NaN scratch memory, race detection, bounds-checked DMAs
# ----------------------------------------------------------------------------------


def tpu_interpret(dma_execution_mode):
    """The lowering table of the TPU interpreter with NaN scratch memory and races
    detected. DMAs are done when waited for ("on_wait": a read before its wait sees
    NaN or stale data, and the race detector reports it) or as soon as started
    ("eager": a copy started into the buffer being computed on overwrites it)."""
    ip = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True,
                               dma_execution_mode=dma_execution_mode)
    return (("default", functools.partial(mosaic._forward, interpret=ip)),)


@pytest.fixture
def no_races(capfd):
    yield
    out, _ = capfd.readouterr()
    assert "RACE DETECTED" not in out, out


def test_tpu_interpreter_update_splits_window(no_races):
    """Eager DMAs, pools NaN wherever no live token is: the double-buffered page copies (the (21, 1) item's split 0 has two
    one-page key blocks, so block 1 is copied while block 0 is computed on), copies
    from the pools (an out-of-bounds page raises), HBM-to-HBM cache writes, empty
    splits, padding sequences and tokens."""
    from problems import poisoned
    p = poisoned(mixed(4, 2, D=8, Dv=8, max_seqs=7, pad_tokens=2, seed=7), old=True)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(17),
                         sinks=jnp.arange(4.0) - 1,
                         block_sizes=PagedBlockSizes(block_q=8, block_k=8, num_splits=2))
    check_update(tpu_interpret("eager"), spec, p)


def test_tpu_interpreter_corrupted_metadata_stays_in_the_pools(no_races):
    """Page entries outside the pool (reads masked, writes dropped), more sequences than
    max_seqs, a decreasing query_start_loc, a context shorter than its new tokens
    (negative positions): the kernels stay inside the pools (the TPU interpreter
    raises otherwise) and agree with the XLA lowering on the sanitised metadata."""
    # The last slot holds the longest context: its second key block (pages 2 and 3 of
    # a 3-page table) ends past the flattened page table, which the kernel must not read.
    seqs = [(11, 3), (9, 0), (8, 8), (1, 1), (16, 2), (21, 1)]
    p = make(seqs, Hq=4, Hkv=2, D=8, page_size=8, seed=8)
    N = p.k_pages.shape[1]
    table = p.page_table.at[0, 1].set(N + 7).at[1, 0].set(-3).at[5, 1].set(N)
    loc = p.query_start_loc.at[3].set(2)  # [0, 3, 3, 2, 12, ..]: (1, 1) gets 9 tokens
    lengths = p.context_lengths.at[4].set(1)  # (16, 2) -> (1, 2): positions -1 and 0
    m = dict(page_table=table, context_lengths=lengths, query_start_loc=loc,
             num_seqs=jnp.int32(99))
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.ones(4),
                         block_sizes=PagedBlockSizes(block_q=8, block_k=16))

    def run(table):
        return jax.jit(lambda q, k, v, kp, vp, m: api.ragged_paged_attention_with_update_with(
            table, spec, q, k, v, kp, vp, **m))(p.q, p.k_new, p.v_new, p.k_old, p.v_old, m)

    (res, kp, vp), (want, kx, vx) = run(tpu_interpret("on_wait")), run(XLA)
    np.testing.assert_allclose(res.out, want.out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(res.lse, want.lse, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(kx))
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(vx))


# ----------------------------------------------------------------------------------
# Page sizes the kernel refuses
# ----------------------------------------------------------------------------------


def _cfg(page_size):
    return api._make_cfg(AttentionSpec(), num_q_heads=4, num_kv_heads=2, head_dim=8,
                         v_head_dim=8, num_pages=8, page_size=page_size, pages_per_seq=2,
                         max_seqs=2, total_tokens=3, uniform_q=None, update=False)


def test_unsupported_page_sizes():
    assert mosaic.unsupported(_cfg(8)) is None and mosaic.unsupported(_cfg(48)) is None
    for ps in (1, 4, 12):
        assert f"a page size that is a multiple of 8 (got {ps}" in mosaic.unsupported(_cfg(ps))


def test_pallas_with_page_size_4_raises():
    """impl="pallas" refuses where the Mosaic kernel is lowered (for a TPU; a branch
    is traced only for its own platform), with a message naming what to use."""
    p = make([(7, 3), (5, 1)], Hq=4, Hkv=2, D=8, page_size=4, seed=9)
    spec = AttentionSpec(mask=masks.causal(), impl="pallas")
    msg = (r"paged attention: the Mosaic \(TPU\) kernel needs a page size that is a multiple "
           r"of 8 \(got 4: .*\)\. impl='auto' runs such a cache with the XLA lowering on TPU")
    ragged = jax.jit(lambda q, kp, vp: fnattn.ragged_paged_attention(spec, q, kp, vp, **meta(p)))
    paged = jax.jit(lambda q, kp, vp: fnattn.paged_attention(
        spec, q, kp, vp, page_table=p.page_table, kv_lengths=p.context_lengths))
    for f, q in ((ragged, p.q), (paged, p.q[:2, None])):
        with tpu_target(), pytest.raises(NotImplementedError, match=msg):
            f.trace(q, p.k_pages, p.v_pages).lower(lowering_platforms=("tpu",))


def test_auto_with_page_size_4_uses_xla_on_tpu():
    p = make([(7, 3), (5, 1)], Hq=4, Hkv=2, D=8, page_size=4, max_seqs=3, pad_tokens=1, seed=9)
    spec = AttentionSpec(mask=masks.causal(), impl="auto")
    check_ragged(None, spec, p)
    f = jax.jit(fnattn.ragged_paged_attention)
    for ps, kernels in ((4, []), (8, [KERNEL])):
        kp = jnp.zeros((2, 6, ps, 8))
        text = f.trace(spec, p.q, kp, kp, **meta(p)).lower(lowering_platforms=("tpu",)).as_text()
        assert re.findall(r'kernel_name = "(\w+)"', text) == kernels, ps


# ----------------------------------------------------------------------------------
# Lowering for TPU (Mosaic) on CPU: block-shape rules and primitive coverage
# ----------------------------------------------------------------------------------


LOWER = [
    # dtype, D, Dv, Hq, Hkv, mask, update, splits, page_size, block_k
    (jnp.bfloat16, 128, 128, 32, 8, masks.causal(), False, None, 16, None),
    (jnp.bfloat16, 64, 64, 8, 8, masks.causal() & masks.sliding_window(7), True, 4, 8, 32),
    (jnp.float32, 128, 128, 4, 1, None, False, 2, 16, 16),
    (jnp.float32, 64, 128, 12, 4, masks.chunked(8) & masks.causal(), True, None, 32, 64),
    (jnp.bfloat16, 128, 64, 10, 2, masks.sliding_window(5, 2), True, 3, 8, None),
    (jnp.float16, 64, 64, 6, 6, masks.from_fn(lambda b, h, q, k: (q + k) % 4 != 0), False,
     None, 16, 48),
]


def _lower_ids(c):
    dtype, D, Dv, Hq, Hkv, _, upd, splits, ps, _ = c
    return (f"{jnp.dtype(dtype).name}-D{D}-Dv{Dv}-{Hq}x{Hkv}-ps{ps}-"
            f"{'update' if upd else 'attend'}-splits{splits}")


@pytest.mark.parametrize("dtype,D,Dv,Hq,Hkv,mask,upd,splits,ps,block_k", LOWER,
                         ids=[_lower_ids(c) for c in LOWER])
def test_lowers_for_tpu(dtype, D, Dv, Hq, Hkv, mask, upd, splits, ps, block_k):
    N, S, P, T = 32, 3, 5, 11
    q = jnp.zeros((T, Hq, D), dtype)
    k, v = jnp.zeros((T, Hkv, D), dtype), jnp.zeros((T, Hkv, Dv), dtype)
    kp = jnp.zeros((Hkv, N, ps, D), dtype)
    vp = jnp.zeros((Hkv, N, ps, Dv), dtype)
    spec = AttentionSpec(mask=mask, softcap=30.0, sinks=jnp.zeros(Hq),
                         block_sizes=PagedBlockSizes(block_k=block_k, num_splits=splits))
    m = dict(page_table=jnp.zeros((S, P), jnp.int32), context_lengths=jnp.zeros(S, jnp.int32),
             query_start_loc=jnp.zeros(S + 1, jnp.int32), num_seqs=jnp.int32(S))
    if upd:
        f = jax.jit(lambda q, kp, vp: api.ragged_paged_attention_with_update_with(
            ON_TPU, spec, q, k, v, kp, vp, **m), donate_argnums=(1, 2))
    else:
        f = jax.jit(lambda q, kp, vp: api.ragged_paged_attention_with(ON_TPU, spec, q, kp, vp,
                                                                      **m))
    decode = jax.jit(lambda q, kp, vp: api.paged_attention_with(
        ON_TPU, spec, q.reshape(T, 1, Hq, D), kp, vp, page_table=jnp.zeros((T, P), jnp.int32),
        kv_lengths=jnp.zeros(T, jnp.int32)))
    with tpu_target():
        text = f.trace(q, kp, vp).lower(lowering_platforms=("tpu",)).as_text()
        decode_text = decode.trace(q, kp, vp).lower(lowering_platforms=("tpu",)).as_text()
    names = re.findall(r'kernel_name = "(\w+)"', text)
    assert names == ([WRITE_KERNEL, KERNEL] if upd else [KERNEL])
    if upd:  # donated pools alias the outputs: the update is in place
        assert len(re.findall(r"tf\.aliasing_output", text)) == 2
    assert re.findall(r'kernel_name = "(\w+)"', decode_text) == [KERNEL]


def test_interpret_poisoned_pools_under_x64():
    """NaN in every unowned slot and in the keys a window hides, with x64 on: the
    kernels (attention and the update form) give the dense problem's answer."""
    from problems import poisoned_window_case
    spec, pp = poisoned_window_case(page_size=8, block_k=8)
    with jax.enable_x64(True):
        check_ragged(INTERPRET, spec, pp)     # expected: the clean tokens of each sequence
        check_update(INTERPRET, spec, pp)


def test_lowers_for_tpu_under_x64():
    with jax.enable_x64(True):
        test_lowers_for_tpu(*LOWER[1])
