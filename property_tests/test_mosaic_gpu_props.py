"""Fuzzed problems on the Mosaic GPU kernels (fnattn/flash/mosaic_gpu.py forward,
fnattn/flash/mosaic_gpu_bwd.py backward), run by JAX's Mosaic GPU interpreter on CPU.

Random masks of every kind those kernels read (causal, windows, chunks, segment ids,
lengths, prefix-LM, ``from_fn`` and their ``&``, ``|``, ``~``), GQA ratios, query and
key lengths that are not multiples of the 64-row tiles, head dims the kernels
pad to 64 (a value head dim unlike the query's among them), float16 and bfloat16,
soft-cap, sinks (-inf, +inf or ordinary), dropout, an ALiBi or ``from_fn``
term (its arrays fixed), one program per q-tile or
persistent programs, and NaN / inf in the K and V of keys no row may see. Out, lse
and every gradient must be those of the float32 reference on the same (rounded)
inputs, with no NaN; rows that see nothing give 0 and lse -inf.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import fnattn
from fnattn import AttentionSpec, core, masks, position_bias
from fnattn.flash.mosaic_gpu import MosaicGpuBlockSizes
from mosaic_gpu_interpreter import compile_once, flash_table, reset_after_failure
from strategies import MASK_KINDS, extreme_sinks, gqa_heads, mask_trees, poison_hidden_keys
from test_reliability import _assert_same, _run

F32 = jnp.float32
# The smallest tiles: 128 query rows a forward program, 64 a backward step, 128
# keys a backward program.
SMALL = MosaicGpuBlockSizes(block_q=64, block_k=64, max_concurrent_steps=2)
# Every kind but dense arrays along queries and keys, which the kernels refuse.
KINDS = tuple(kind for kind in MASK_KINDS if kind != "array")


@functools.cache
def _table():
    return flash_table("flash-mosaic-gpu-fuzz-interpret")


def _kernels(spec, q, k, v):
    return core.run(spec, q, k, v, fn="flash", table=_table())


def _decay(b, h, q, k, r):
    return -r * jnp.log(1.0 + jnp.abs(q - k).astype(F32)) + jnp.where(h == 0, 0.5, 0.0)


@st.composite
def problems(draw, head_dims=((64, 64), (40, 64), (64, 24))):
    """``(spec, q, k, v, d_out, d_lse)`` of a drawn problem whose head dims
    ``(D, Dv)`` are one of ``head_dims``: by default pairs the kernels compute at
    64 (zero columns pad 40 and 24 there), since the interpreter slows down
    with wider heads, whose own paths (dQ in two halves at 128, the column
    split above) have tests of their own in tests/flash/."""
    hq, hkv = draw(gqa_heads(max_kv=2, max_group=2))
    B = draw(st.integers(1, 2))
    Tq, Tk = draw(st.integers(1, 200)), draw(st.integers(1, 200))
    dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float16]))
    rs = np.random.default_rng(draw(st.integers(0, 2**16)))

    def normal(*shape, dtype=dtype):  # values the kernel's dtype holds exactly
        return jnp.asarray(rs.standard_normal(shape), F32).astype(dtype)

    D, Dv = draw(st.sampled_from(head_dims))
    q, k, v = normal(B, Tq, hq, D), normal(B, Tk, hkv, D), normal(B, Tk, hkv, Dv)
    mask = draw(st.one_of(st.none(), mask_trees(B, Tq, Tk, H=hq, kinds=KINDS)))
    if mask is not None:
        k, v = poison_hidden_keys(k, v, masks.materialize(mask, B, hq, Tq, Tk))
    rate = draw(st.sampled_from([0.0, 0.0, 0.3]))
    term = None  # a position term, its arrays held fixed
    kind = draw(st.sampled_from([None, None, "alibi", "from_fn"]))
    if kind == "alibi":
        term = position_bias.alibi(jnp.asarray(rs.uniform(-0.5, 2.0, hq), F32))
    elif kind == "from_fn":  # per (batch row, head) rates, in operations Mosaic GPU compiles
        term = position_bias.from_fn(_decay, jnp.asarray(rs.uniform(0.0, 2.0, (B, hq)), F32))
    spec = AttentionSpec(mask=mask, softcap=draw(st.sampled_from([None, 20.0])),
                         position_bias=term,
                         sinks=draw(extreme_sinks(hq)) if draw(st.booleans()) else None,
                         dropout_rate=rate, dropout_key=jax.random.key(rs.integers(99)) if rate
                         else None, return_lse=True,
                         block_sizes=dataclasses.replace(SMALL, persistent=draw(st.booleans())))
    do = normal(B, Tq, hq, Dv).astype(F32)
    dl = jnp.asarray(rs.standard_normal((B, hq, Tq)), F32)
    return spec, q, k, v, do, dl


@settings(max_examples=4)
@given(problems())
def test_mosaic_gpu_kernels_match_the_reference(problem):
    spec, q, k, v, do, dl = problem
    want = _run(fnattn.reference, spec, *(x.astype(F32) for x in (q, k, v)), do, dl)
    try:
        with compile_once():
            got = _run(_kernels, spec, q, k, v, do, dl)
    except Exception:
        reset_after_failure()
        raise
    names = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")
    for name, a, b in zip(names, (*got[:2], *got[2]), (*want[:2], *want[2])):
        assert (a is None) == (b is None), name
        if a is not None:  # (no bias: its gradient is None)
            _assert_same(name, a, b, 3e-2)
