"""Hypothesis strategies for attention problems, reusable by every variant's tests.

Building blocks (each a strategy):

* ``dtypes(names)``, ``layouts(names)``: a jnp dtype, a layout string.
* ``gqa_heads(max_kv=3, max_group=3)``: ``(Hq, Hkv)`` with ``Hq`` a multiple of ``Hkv``
  (MHA, GQA and MQA).
* ``sizes(max_t=13)``: a dict of B, Tq, Tk, Hq, Hkv, D, Dv (Tq and Tk independent, so
  both alignments occur).
* ``ragged_lengths(B, T)``: int32 (B,) lengths in ``[0, T]``, zero included (rows or
  keys fully masked).
* ``segment_ids(B, T, max_segments=3, sorted_=True)``: int32 (B, T) document ids.
* ``mask_trees(B, Tq, Tk, depth=2, H=1)``: a random composition with ``&``, ``|``, ``~``
  of every mask kind, carrying random arrays (dense ones per head when ``H > 1``).
* ``problems(...)``: a whole :class:`Problem` (spec, q, k, v in the drawn layout, and
  the matching keyword arguments of ``tests/np_attention.py``), with optional bias
  (several broadcast shapes), sinks, soft-cap, scale and dropout.
* ``examples(n)``: a test's bound on its examples under the "ci" profile (where
  they are slow), lifted under "dev" to that profile's count.
* Hostile inputs: ``extreme_bias(B, Hq, Tq, Tk)`` (whole rows of -1e30, ``finfo.min``,
  -1e9, -1e8 or -inf, single logits of 1e10), ``extreme_sinks(Hq)`` (-inf, +inf or
  ordinary), and ``poison_hidden_keys(k, v, visible)``, which writes NaN and inf
  into the K/V of keys no query row may see.

Every array is drawn through a NumPy generator seeded by Hypothesis, so examples
are reproducible under the derandomized "ci" profile and shrink sensibly.

>>> from hypothesis import given
>>> from strategies import problems
>>> @given(problems(impl="xla"))
... def test_something(p):
...     ...
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings, strategies as st

from fnattn import AttentionSpec, masks
from fnattn import dropout as fn_dropout

__all__ = ["Problem", "dtypes", "layouts", "gqa_heads", "sizes", "ragged_lengths",
           "segment_ids", "mask_trees", "problems", "MASK_KINDS", "extreme_bias",
           "extreme_sinks", "poison_hidden_keys", "EXTREME_ROW_VALUES", "examples"]


def examples(n: int) -> settings:
    """``@settings(max_examples=n)`` under the derandomized "ci" profile (the
    default: a slow test's bound there); under any other profile that profile's
    own ``max_examples``, so that ``HYPOTHESIS_PROFILE=dev`` searches every test
    as long as the others (an explicit ``max_examples`` would override it)."""
    if settings.get_current_profile_name() == "ci":
        return settings(max_examples=n)
    return settings()


def assert_out_lse(out, lse, want_out, want_lse, tol=2e-5):
    """out and lse equal (-inf exactly where expected), no NaN or inf in out."""
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    # +inf only where a sink of +inf takes the whole row
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(want_lse))
    assert not np.isnan(lse).any()
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=tol)
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.where(fin, lse, 0), np.where(fin, want_lse, 0),
                               atol=tol, rtol=tol)


MASK_KINDS = ("causal", "window", "chunked", "segments", "lengths", "prefix", "array", "fn",
              "full")


@dataclasses.dataclass
class Problem:
    """A drawn attention problem.

    Attributes:
      spec: the AttentionSpec.
      q, k, v: inputs in ``spec.layout``.
      np_kwargs: keyword arguments of ``np_attention`` / ``np_attention_grads``
        (mask as a dense array, dropout as a dense keep array).
      dims: (B, Tq, Tk, Hq, Hkv, D, Dv).
    """

    spec: Any
    q: Any
    k: Any
    v: Any
    np_kwargs: dict
    dims: tuple


def _rng(draw):
    return np.random.default_rng(draw(st.integers(0, 2**16)))


def dtypes(names=("float32", "bfloat16", "float16")):
    return st.sampled_from(names).map(jnp.dtype)


def layouts(names=("bthd", "bhtd")):
    return st.sampled_from(names)


@st.composite
def gqa_heads(draw, max_kv=3, max_group=3):
    hkv = draw(st.integers(1, max_kv))
    return hkv * draw(st.integers(1, max_group)), hkv


@st.composite
def sizes(draw, max_t=13, max_b=3, head_dims=(2, 3, 5, 8), v_head_dims=(2, 3, 5)):
    hq, hkv = draw(gqa_heads())
    return dict(B=draw(st.integers(1, max_b)), Tq=draw(st.integers(1, max_t)),
                Tk=draw(st.integers(1, max_t)), Hkv=hkv, Hq=hq,
                D=draw(st.sampled_from(head_dims)), Dv=draw(st.sampled_from(v_head_dims)))


@st.composite
def ragged_lengths(draw, B, T):
    rs = _rng(draw)
    lengths = rs.integers(0, T + 1, (B,))
    if draw(st.booleans()):  # make the extremes likely
        lengths[rs.integers(0, B)] = draw(st.sampled_from([0, T]))
    return jnp.asarray(lengths, jnp.int32)


@st.composite
def segment_ids(draw, B, T, max_segments=3, sorted_=True):
    rs = _rng(draw)
    ids = rs.integers(0, draw(st.integers(1, max_segments)), (B, T))
    return jnp.asarray(np.sort(ids, 1) if sorted_ else ids, jnp.int32)


def _mod3(b, h, q, k):
    # a module-level predicate: from_fn masks are static and compared by identity
    return (q * 2 + k + h) % 3 != 1


@st.composite
def mask_trees(draw, B, Tq, Tk, depth=2, H=1, kinds=MASK_KINDS):
    """A random composition of mask kinds, with random arrays."""
    if depth > 0 and draw(st.booleans()):
        op = draw(st.sampled_from(["and", "or", "not"]))
        a = draw(mask_trees(B, Tq, Tk, depth - 1, H, kinds))
        if op == "not":
            return ~a
        b = draw(mask_trees(B, Tq, Tk, depth - 1, H, kinds))
        return a & b if op == "and" else a | b
    leaf = draw(st.sampled_from(kinds))
    if leaf == "causal":
        return masks.causal()
    if leaf == "full":
        return masks.full()
    if leaf == "window":
        return masks.sliding_window(draw(st.integers(0, 6)),
                                    draw(st.one_of(st.none(), st.integers(0, 3))))
    if leaf == "chunked":
        return masks.chunked(draw(st.integers(1, 6)))
    if leaf == "segments":
        sorted_ = draw(st.booleans())
        return masks.segments(draw(segment_ids(B, Tq, sorted_=sorted_)),
                              draw(segment_ids(B, Tk, sorted_=sorted_)))
    if leaf == "lengths":
        which = draw(st.sampled_from(["q", "kv", "both"]))
        ql = draw(ragged_lengths(B, Tq)) if which in ("q", "both") else None
        kl = draw(ragged_lengths(B, Tk)) if which in ("kv", "both") else None
        return masks.lengths(ql, kl)
    if leaf == "prefix":
        return masks.prefix_lm(draw(ragged_lengths(B, Tk)))
    if leaf == "array":
        rs = _rng(draw)
        heads = draw(st.sampled_from(sorted({1, H})))
        return masks.from_array(jnp.asarray(rs.random((B, heads, Tq, Tk)) < 0.7))
    return masks.from_fn(_mod3)


@st.composite
def problems(draw, *, dtypes=("float32",), layouts=("bthd", "bhtd"), impl="auto",
             features=True, bias=True, sinks=True, softcap=True, dropout=True,
             equal_head_dims=False, max_t=13, mask_kinds=MASK_KINDS):
    """A whole attention problem; see the module docstring.

    ``features=False`` draws no bias, sinks, soft-cap, scale or dropout; the
    single flags switch one feature off (for lowerings that lack it), and
    ``equal_head_dims`` draws ``Dv == D``.
    """
    d = draw(sizes(max_t=max_t))
    if equal_head_dims:
        d["Dv"] = d["D"]
    B, Tq, Tk, Hq, Hkv, D, Dv = (d[n] for n in ("B", "Tq", "Tk", "Hq", "Hkv", "D", "Dv"))
    dtype = jnp.dtype(draw(st.sampled_from(dtypes)))
    layout = draw(st.sampled_from(layouts))
    rs = _rng(draw)
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), dtype)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), dtype)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, Dv)), dtype)
    mask = draw(st.one_of(st.none(), mask_trees(B, Tq, Tk, H=Hq, kinds=mask_kinds)))
    bias_arr = sinks_arr = key = None
    cap = scale = None
    rate = 0.0
    if features:
        if bias and draw(st.booleans()):
            shape = draw(st.sampled_from([(1, Hq, Tq, Tk), (B, 1, Tq, Tk), (Tq, Tk),
                                          (B, Hq, Tq, Tk)]))
            bias_arr = jnp.asarray(rs.standard_normal(shape), jnp.float32)
        if sinks and draw(st.booleans()):
            sinks_arr = jnp.asarray(rs.standard_normal((Hq,)), jnp.float32)
        if softcap:
            cap = draw(st.sampled_from([None, 1.5, 20.0]))
        scale = draw(st.sampled_from([None, 0.3]))
        if dropout and draw(st.booleans()):
            rate = draw(st.sampled_from([0.1, 0.5]))
            key = jax.random.key(draw(st.integers(0, 100)))
    spec = AttentionSpec(mask=mask, scale=scale, softcap=cap, bias=bias_arr, sinks=sinks_arr,
                         dropout_rate=rate, dropout_key=key, layout=layout, impl=impl)
    kw = dict(scale=scale, softcap=cap,
              bias=None if bias_arr is None else np.asarray(bias_arr),
              sinks=None if sinks_arr is None else np.asarray(sinks_arr))
    if mask is not None:
        kw["mask"] = np.asarray(masks.materialize(mask, B, Hq, Tq, Tk))
    if rate:
        b, h, qi, ki = np.ix_(range(B), range(Hq), range(Tq), range(Tk))
        kw["keep"] = np.asarray(
            fn_dropout.keep_mask(fn_dropout.seed_from_key(key), b, h, qi, ki, rate))
        kw["rate"] = rate
    if layout == "bhtd":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    return Problem(spec, q, k, v, kw, (B, Tq, Tk, Hq, Hkv, D, Dv))


EXTREME_ROW_VALUES = (-1e30, float(np.finfo(np.float32).min), -1e9, -1e8, -np.inf)


@st.composite
def extreme_bias(draw, B, Hq, Tq, Tk):
    """A float32 (B, Hq, Tq, Tk) bias: small noise, with some whole query rows set
    to one of ``EXTREME_ROW_VALUES`` (the additive padding masks users write) and
    some single logits raised to 1e10."""
    rs = _rng(draw)
    bias = 0.5 * rs.standard_normal((B, Hq, Tq, Tk))
    for _ in range(draw(st.integers(1, 3))):
        value = draw(st.sampled_from(EXTREME_ROW_VALUES))
        b, h, q = rs.integers(0, B), rs.integers(0, Hq), rs.integers(0, Tq)
        heads = slice(None) if draw(st.booleans()) else slice(h, h + 1)
        bias[b, heads, q] = value
    if draw(st.booleans()):
        bias[rs.integers(0, B), rs.integers(0, Hq), rs.integers(0, Tq), rs.integers(0, Tk)] = 1e10
    return jnp.asarray(bias, jnp.float32)


@st.composite
def extreme_sinks(draw, Hq):
    """float32 (Hq,) sinks, each -inf, +inf or an ordinary logit."""
    rs = _rng(draw)
    kinds = draw(st.lists(st.sampled_from(["-inf", "+inf", "finite"]), min_size=Hq,
                          max_size=Hq))
    value = {"-inf": -np.inf, "+inf": np.inf}
    return jnp.asarray([value.get(kd, rs.standard_normal()) for kd in kinds], jnp.float32)


def poison_hidden_keys(k, v, visible):
    """K and V ("bthd") with NaN / inf written into every key that no query row of
    its batch row and kv head may see; ``visible`` is a boolean array broadcastable
    to (B, Hq, Tq, Tk). The answer must not change."""
    B, Tk, Hkv, _ = k.shape
    vis = np.broadcast_to(np.asarray(visible), (B, visible.shape[1], visible.shape[2], Tk))
    seen = vis.any(axis=2)                                              # (B, H|1, Tk)
    if seen.shape[1] > 1:
        seen = seen.reshape(B, Hkv, -1, Tk).any(axis=2)
    hidden = np.broadcast_to(~np.swapaxes(seen, 1, 2), (B, Tk, Hkv))[..., None]
    k = jnp.where(hidden, jnp.asarray(np.nan, k.dtype), k)
    v = jnp.where(hidden, jnp.asarray(np.inf, v.dtype), v)
    return k, v
