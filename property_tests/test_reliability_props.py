"""Fuzzed hostile inputs: extreme bias rows, infinite sinks and NaN/inf in the K/V
of keys nobody may see, on random masks, GQA ratios and sizes. Every lowering
must give the reference's out, lse and gradients, with no NaN (see
``tests/test_reliability.py`` for the hand-built cases and why the float32
reference, not float64 NumPy, is the yardstick here)."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import fnattn
from fnattn import AttentionSpec, XlaBlockSizes, masks
from lowering import cheap_compiles
from strategies import (examples, extreme_bias, extreme_sinks, mask_trees, poison_hidden_keys,
                        sizes)
from test_reliability import LOWERINGS, _compare, _run


@st.composite
def hostile(draw, *, sinks=True, max_t=11, equal_head_dims=False):
    d = draw(sizes(max_t=max_t, v_head_dims=(2, 3, 5, 8)))
    if equal_head_dims:
        d["Dv"] = d["D"]
    B, Tq, Tk, Hq, Hkv, D, Dv = (d[n] for n in ("B", "Tq", "Tk", "Hq", "Hkv", "D", "Dv"))
    rs = np.random.default_rng(draw(st.integers(0, 2**16)))
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, Dv)), jnp.float32)
    mask = draw(st.one_of(st.none(), mask_trees(B, Tq, Tk, H=Hq)))
    if mask is not None:
        k, v = poison_hidden_keys(k, v, masks.materialize(mask, B, Hq, Tq, Tk))
    spec = AttentionSpec(mask=mask, bias=draw(extreme_bias(B, Hq, Tq, Tk)),
                         sinks=draw(extreme_sinks(Hq)) if sinks and draw(st.booleans()) else None,
                         softcap=draw(st.sampled_from([None, 20.0])),
                         block_sizes=XlaBlockSizes(draw(st.integers(1, 6)),
                                                   draw(st.integers(1, 6))))
    do = jnp.asarray(rs.standard_normal((B, Tq, Hq, Dv)), jnp.float32)
    dl = jnp.asarray(rs.standard_normal((B, Hq, Tq)), jnp.float32)
    return spec, q, k, v, do, dl


def _check(lowering, problem):
    spec, q, k, v, do, dl = problem
    want = _run(fnattn.reference, spec, q, k, v, do, dl)
    with cheap_compiles():
        got = _run(LOWERINGS[lowering], spec, q, k, v, do, dl)
    _compare(got, want, 3e-4)


@examples(10)
@given(st.sampled_from(["xla", "flash-xla"]), hostile())
def test_xla_lowerings_on_hostile_inputs(lowering, problem):
    _check(lowering, problem)


@examples(4)
@given(st.sampled_from(["triton-interpret", "mosaic-interpret"]), hostile(max_t=9))
def test_kernels_on_hostile_inputs(lowering, problem):
    _check(lowering, problem)


@examples(4)
@given(hostile(sinks=False, equal_head_dims=True))
def test_cudnn_delegate_on_hostile_inputs(problem):
    spec, *rest = problem
    _check("cudnn", (spec.replace(softcap=None), *rest))
