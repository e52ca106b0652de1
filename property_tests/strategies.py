"""Hypothesis strategies for attention problems: sizes, masks, features, dtypes."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from fnattn import AttentionSpec, dropout, masks


@dataclasses.dataclass
class Problem:
    spec: Any
    q: Any
    k: Any
    v: Any
    np_kwargs: dict
    dims: tuple


@st.composite
def sizes(draw, max_t=13):
    hkv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3]))
    return dict(B=draw(st.integers(1, 3)), Tq=draw(st.integers(1, max_t)),
                Tk=draw(st.integers(1, max_t)), Hkv=hkv, Hq=hkv * group,
                D=draw(st.sampled_from([2, 3, 5, 8])), Dv=draw(st.sampled_from([2, 3, 5])))


@st.composite
def mask_trees(draw, B, Tq, Tk, depth=2):
    """A random composition of every mask kind, with random arrays."""
    rs = np.random.default_rng(draw(st.integers(0, 2**16)))
    leaf = draw(st.sampled_from(["causal", "window", "chunked", "segments", "lengths",
                                 "prefix", "array", "fn"]))
    if depth > 0 and draw(st.booleans()):
        op = draw(st.sampled_from(["and", "or", "not"]))
        a = draw(mask_trees(B, Tq, Tk, depth - 1))
        if op == "not":
            return ~a
        b = draw(mask_trees(B, Tq, Tk, depth - 1))
        return a & b if op == "and" else a | b
    if leaf == "causal":
        return masks.causal()
    if leaf == "window":
        return masks.sliding_window(draw(st.integers(0, 6)), draw(st.one_of(st.none(),
                                                                         st.integers(0, 3))))
    if leaf == "chunked":
        return masks.chunked(draw(st.integers(1, 6)))
    if leaf == "segments":
        n = draw(st.integers(1, 3))
        return masks.segments(jnp.asarray(np.sort(rs.integers(0, n, (B, Tq)), 1)),
                              jnp.asarray(np.sort(rs.integers(0, n, (B, Tk)), 1)))
    if leaf == "lengths":
        return masks.lengths(jnp.asarray(rs.integers(0, Tq + 1, (B,))),
                             jnp.asarray(rs.integers(0, Tk + 1, (B,))))
    if leaf == "prefix":
        return masks.prefix_lm(jnp.asarray(rs.integers(0, Tk + 1, (B,))))
    if leaf == "array":
        return masks.from_array(jnp.asarray(rs.random((B, 1, Tq, Tk)) < 0.7))
    return masks.from_fn(_mod3)


def _mod3(b, h, q, k):
    return (q * 2 + k + h) % 3 != 1


@st.composite
def problems(draw, *, dtypes=("float32",), layouts=("bthd", "bhtd"), impl="auto",
             features=True, max_t=13):
    d = draw(sizes(max_t=max_t))
    B, Tq, Tk, Hq, Hkv, D, Dv = (d[n] for n in ("B", "Tq", "Tk", "Hq", "Hkv", "D", "Dv"))
    dtype = jnp.dtype(draw(st.sampled_from(dtypes)))
    layout = draw(st.sampled_from(layouts))
    rs = np.random.default_rng(draw(st.integers(0, 2**16)))
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), dtype)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), dtype)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, Dv)), dtype)
    mask = draw(st.one_of(st.none(), mask_trees(B, Tq, Tk)))
    bias = sinks = key = None
    softcap = scale = None
    rate = 0.0
    if features:
        if draw(st.booleans()):
            shape = draw(st.sampled_from([(1, Hq, Tq, Tk), (B, 1, Tq, Tk), (Tq, Tk)]))
            bias = jnp.asarray(rs.standard_normal(shape), jnp.float32)
        if draw(st.booleans()):
            sinks = jnp.asarray(rs.standard_normal((Hq,)), jnp.float32)
        softcap = draw(st.sampled_from([None, 1.5, 20.0]))
        scale = draw(st.sampled_from([None, 0.3]))
        if draw(st.booleans()):
            rate = draw(st.sampled_from([0.1, 0.5]))
            key = jax.random.key(draw(st.integers(0, 100)))
    spec = AttentionSpec(mask=mask, scale=scale, softcap=softcap, bias=bias, sinks=sinks,
                         dropout_rate=rate, dropout_key=key, layout=layout, impl=impl)
    kw = dict(scale=scale, softcap=softcap, bias=None if bias is None else np.asarray(bias),
              sinks=None if sinks is None else np.asarray(sinks))
    if mask is not None:
        kw["mask"] = np.asarray(masks.materialize(mask, B, Hq, Tq, Tk))
    if rate:
        b, h, qi, ki = np.ix_(range(B), range(Hq), range(Tq), range(Tk))
        kw["keep"] = np.asarray(dropout.keep_mask(dropout.seed_from_key(key), b, h, qi, ki, rate))
        kw["rate"] = rate
    if layout == "bhtd":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    return Problem(spec, q, k, v, kw, (B, Tq, Tk, Hq, Hkv, D, Dv))
