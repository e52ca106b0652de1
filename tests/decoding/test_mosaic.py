"""The Pallas Mosaic (TPU) lowering of fnattn.decode (fnattn/decoding/mosaic.py).

* interpret mode on CPU against each sequence's dense problem in float64 NumPy,
  under jax.jit: every positional mask, one split and several (more splits
  than blocks: empty ones), blocks of one kv head's columns (D = 128), of two
  (D = 64) and of all of them (D = 7), MHA/GQA/MQA, one to three query tokens,
  sinks, soft-cap, kv_starts, empty sequences, bfloat16 and float16. Key
  blocks of 8 slots over a 40-slot cache (the last block ragged); slots outside
  each sequence's range hold NaN;
* the TPU interpreter (``pltpu.InterpretParams``) with NaN-filled scratch and
  race detection;
* lowering for TPU on CPU over dtypes, head dims, groups, masks and splits, with
  impl="auto" and impl="pallas"; what the kernel refuses.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_decoding import (MASKS, check, check_poisoned_window_under_x64,
                           nan_problem as make)
from lowering import cheap_compiles, tpu_target

import fnattn
from fnattn import AttentionSpec, DecodeBlockSizes, masks
from fnattn.decoding import api, mosaic


@pytest.fixture(autouse=True, scope="module")
def _cheap_compiles():
    with cheap_compiles():
        yield


def route(monkeypatch, interpret=True, block_k=8):
    fwd = functools.partial(mosaic._forward, interpret=interpret, block_k=block_k)
    monkeypatch.setattr(api, "lowering_table", lambda impl: (("default", fwd),))


@pytest.fixture
def kernel(monkeypatch):
    route(monkeypatch)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("splits", [1, 8])
def test_masks_and_splits(kernel, mask, splits):
    """D=7, Dv=5 and 2 kv heads: one block holds both heads' columns (14 lanes)."""
    q, k, v, L, a = make()
    spec = AttentionSpec(mask=MASKS[mask], block_sizes=DecodeBlockSizes(num_splits=splits))
    check(spec, q, k, v, L, a)


@pytest.mark.parametrize("Hq,Hkv,D,Dv,Tq", [(6, 2, 128, 128, 1), (8, 4, 64, 64, 2),
                                            (5, 1, 7, 5, 3), (3, 3, 16, 8, 1)])
def test_head_blocks_and_groups(kernel, Hq, Hkv, D, Dv, Tq):
    """One kv head per block (D=128), two (D=64), the only one (MQA), all three (MHA)."""
    assert mosaic.heads_per_program(Hkv, D, Dv) == {128: 1, 64: 2, 7: 1, 16: 3}[D]
    q, k, v, L, a = make(Tq=Tq, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv, seed=1, lengths=(40, 5, 33),
                         starts=(0, 2, 7))
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(20),
                         block_sizes=DecodeBlockSizes(num_splits=2))
    check(spec, q, k, v, L, a)


@pytest.mark.parametrize("splits", [1, 4])
def test_sinks_softcap_scale_starts(kernel, splits):
    q, k, v, L, a = make(seed=2, lengths=(10, 3, 0), starts=(5, 37, 7))
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(6), softcap=3.0, scale=0.4,
                         sinks=jnp.linspace(-1.0, 2.0, 6),
                         block_sizes=DecodeBlockSizes(num_splits=splits))
    res = check(spec, q, k, v, L, a)
    np.testing.assert_array_equal(np.asarray(res.out[2]), 0.0)
    np.testing.assert_allclose(res.lse[2], jnp.tile(spec.sinks[:, None], (1, 2)), rtol=1e-6)


def test_empty_sequences_give_zeros_and_minus_inf(kernel):
    q, k, v, L, a = make(seed=3, lengths=(0, 40, 0), starts=(3, 0, 40))
    res = check(AttentionSpec(), q, k, v, L, a)
    assert np.all(np.asarray(res.out)[[0, 2]] == 0)
    assert np.all(np.isneginf(np.asarray(res.lse)[[0, 2]]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision(monkeypatch, dtype):
    """bfloat16 blocks of 16 slots; float16 runs in float32 and returns float16."""
    route(monkeypatch, block_k=16)
    q, k, v, L, a = make(Tq=3, Hq=4, Hkv=2, D=128, Dv=128, dtype=jnp.dtype(dtype), seed=4)
    spec = AttentionSpec(mask=masks.causal(), softcap=8.0, sinks=jnp.zeros(4))
    res = check(spec, q, k, v, L, a, tol=2e-2)
    assert res.out.dtype == jnp.dtype(dtype)


@pytest.fixture
def no_races(capfd):
    yield
    out, _ = capfd.readouterr()
    assert "RACE DETECTED" not in out, out


def test_tpu_interpreter(monkeypatch, no_races):
    """NaN-filled scratch (an accumulator read before its first write would show),
    race detection, a ragged last block, empty splits, two heads per block."""
    route(monkeypatch, interpret=pltpu.InterpretParams(uninitialized_memory="nan",
                                                       detect_races=True), block_k=16)
    q, k, v, L, a = make(Tq=1, Hq=8, Hkv=4, D=64, Dv=64, seed=5, lengths=(40, 9, 0),
                         starts=(0, 17, 3))
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.linspace(-1.0, 1.0, 8),
                         block_sizes=DecodeBlockSizes(num_splits=2))
    check(spec, q, k, v, L, a)


# ----------------------------------------------------------------------------------
# Lowering for TPU (Mosaic) on CPU
# ----------------------------------------------------------------------------------


def tpu_kernels(spec, q, k, v):
    L = jnp.zeros((q.shape[0],), jnp.int32)
    f = jax.jit(lambda q, k, v, L: fnattn.decode(spec, q, k, v, kv_lengths=L))
    with tpu_target():
        text = f.trace(q, k, v, L).lower(lowering_platforms=("tpu",)).as_text()
    return re.findall(r'kernel_name = "(\w+)"', text)


LOWER = [
    # dtype, D, Dv, Hq, Hkv, Tq, mask, splits, S
    (jnp.bfloat16, 128, 128, 32, 8, 1, masks.causal(), None, 4096),
    (jnp.bfloat16, 64, 64, 8, 8, 2, masks.causal() & masks.sliding_window(7), 4, 1024),
    (jnp.float32, 80, 80, 12, 4, 3, masks.chunked(8) & masks.causal(), None, 1000),
    (jnp.float32, 256, 128, 4, 1, 1, None, 2, 2048),
    (jnp.bfloat16, 96, 96, 40, 2, 2, masks.from_fn(lambda b, h, q, k: (q + k) % 4 != 0), 8, 640),
    (jnp.bfloat16, 128, 128, 16, 2, 1, masks.sliding_window(5, 2), None, 300),
]


@pytest.mark.parametrize("dtype,D,Dv,Hq,Hkv,Tq,mask,splits,S_", LOWER)
def test_lowers_for_tpu(dtype, D, Dv, Hq, Hkv, Tq, mask, splits, S_):
    q = jnp.zeros((2, Tq, Hq, D), dtype)
    k, v = jnp.zeros((2, S_, Hkv, D), dtype), jnp.zeros((2, S_, Hkv, Dv), dtype)
    for impl in ("auto", "pallas"):
        spec = AttentionSpec(mask=mask, softcap=30.0, sinks=jnp.zeros(Hq), impl=impl,
                             block_sizes=DecodeBlockSizes(num_splits=splits))
        assert tpu_kernels(spec, q, k, v) == [mosaic.KERNEL_NAME], impl


def test_float16_auto_uses_xla_and_pallas_converts():
    """A float16 cache would be copied to float32 for the kernel: impl="auto" reads it
    with the XLA lowering instead; impl="pallas" runs the kernel."""
    q = jnp.zeros((1, 1, 8, 128), jnp.float16)
    k = jnp.zeros((1, 256, 2, 128), jnp.float16)
    assert tpu_kernels(AttentionSpec(impl="auto"), q, k, k) == []
    assert tpu_kernels(AttentionSpec(impl="pallas"), q, k, k) == [mosaic.KERNEL_NAME]


def test_float64_is_refused():
    k = jax.ShapeDtypeStruct((1, 16, 2, 8), jnp.float64)
    assert mosaic.unsupported(None, k, k, k).startswith("a float32, bfloat16 or float16 "
                                                        "cache (got float64")
    assert mosaic.unsupported(None, k, jax.ShapeDtypeStruct((1, 16, 2, 8), jnp.float32),
                              k) is None
    with jax.enable_x64(True):
        q = jnp.zeros((1, 1, 4, 8), jnp.float64)
        kv = jnp.zeros((1, 16, 2, 8), jnp.float64)
        L = jnp.ones((1,), jnp.int32)
        for impl in ("auto", "pallas"):  # refused by decode itself, before any lowering
            with pytest.raises(TypeError, match=r"decode: float64 inputs are not supported"):
                jax.jit(fnattn.decode)(AttentionSpec(impl=impl), q, kv, kv, kv_lengths=L)


def test_poisoned_slots_the_window_hides_under_x64(monkeypatch):
    """NaN in the sequence's own slots that a window hides from every query (as well as
    outside its range), two kv heads per block (D=64: each head's product reads the
    other's columns), infinite sinks, x64 on: the kernel gives the XLA lowering's answer."""
    q, k, v, L, a = make(Hq=4, Hkv=2, D=64, Dv=64)
    check_poisoned_window_under_x64(q, k, v, L, a, jnp.array([0.0, jnp.inf, -jnp.inf, 1.0]),
                                    lambda: route(monkeypatch))


def test_lowers_for_tpu_under_x64():
    with jax.enable_x64(True):
        test_lowers_for_tpu(*LOWER[1])
