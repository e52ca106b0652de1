"""Pins the exact wording of the errors raised at trace time.

Each message names the function, the argument, what was expected and what was
given (both shapes or values), and where it helps, the fix. Changing a message
is a deliberate act: update it here.
"""

import jax
import jax.numpy as jnp
import pytest

import fnattn
from fnattn import AttentionSpec, masks

Q = jnp.zeros((3, 7, 4, 5))  # B=3, Tq=7, Hq=4, D=5
K = jnp.zeros((3, 11, 2, 5))  # Tk=11, Hkv=2


def call(spec, q=Q, k=K, v=K):
    return jax.jit(fnattn.attention)(spec, q, k, v)


def i32(*shape):
    return jnp.zeros(shape, jnp.int32)


CALLS = [
    ("head dim", AttentionSpec(), dict(k=jnp.zeros((3, 11, 2, 6)), v=jnp.zeros((3, 11, 2, 6))),
     ValueError, "attention: head-dim mismatch: k must have head dim D=5 like q (3, 7, 4, 5); "
                 "got k (3, 11, 2, 6)"),
    ("gqa", AttentionSpec(), dict(k=jnp.zeros((3, 11, 3, 5)), v=jnp.zeros((3, 11, 3, 5))),
     ValueError, "attention: the number of query heads Hq=4 must be a multiple of the number "
                 "of key/value heads Hkv=3; got q (3, 7, 4, 5) and k (3, 11, 3, 5), read as "
                 "(B, T, H, D) for layout 'bthd'"),
    ("gqa, wrong layout", AttentionSpec(layout="bhtd"), {},
     ValueError, "attention: the number of query heads Hq=7 must be a multiple of the number "
                 "of key/value heads Hkv=11; got q (3, 7, 4, 5) and k (3, 11, 2, 5), read as "
                 "(B, H, T, D) for layout 'bhtd'"),
    ("batch", AttentionSpec(), dict(k=jnp.zeros((2, 11, 2, 5)), v=jnp.zeros((2, 11, 2, 5))),
     ValueError, "attention: batch mismatch: k must have batch B=3 like q (3, 7, 4, 5); "
                 "got k (2, 11, 2, 5)"),
    ("v length", AttentionSpec(), dict(v=jnp.zeros((3, 13, 2, 5))),
     ValueError, "attention: v must have shape (B, Tk, Hkv, Dv)=(3, 11, 2, Dv) matching k "
                 "(3, 11, 2, 5); got v (3, 13, 2, 5)"),
    ("int q", AttentionSpec(), dict(q=jnp.zeros((3, 7, 4, 5), jnp.int32)),
     TypeError, "attention: q must be a floating-point array (float32, bfloat16 or float16); "
                "got int32 with shape (3, 7, 4, 5)"),
    ("int k", AttentionSpec(), dict(k=jnp.zeros((3, 11, 2, 5), jnp.int8)),
     TypeError, "attention: k must be a floating-point array (float32, bfloat16 or float16); "
                "got int8 with shape (3, 11, 2, 5)"),
    ("int v", AttentionSpec(), dict(v=jnp.zeros((3, 11, 2, 5), jnp.uint8)),
     TypeError, "attention: v must be a floating-point array (float32, bfloat16 or float16); "
                "got uint8 with shape (3, 11, 2, 5)"),
    ("mixed dtypes", AttentionSpec(), dict(v=jnp.zeros((3, 11, 2, 5), jnp.bfloat16)),
     TypeError, "attention: q, k and v must share a dtype; got q float32, k float32, v bfloat16"),
    ("rank", AttentionSpec(), dict(q=jnp.zeros((3, 7, 20))),
     ValueError, "attention: q must have 4 axes (B, T, H, D) for layout 'bthd'; "
                 "got shape (3, 7, 20)"),
    ("rank bhtd", AttentionSpec(layout="bhtd"), dict(k=jnp.zeros((3, 2, 11))),
     ValueError, "attention: k must have 4 axes (B, H, T, D) for layout 'bhtd'; "
                 "got shape (3, 2, 11)"),
    ("empty keys", AttentionSpec(), dict(k=jnp.zeros((3, 0, 2, 5)), v=jnp.zeros((3, 0, 2, 5))),
     ValueError, "attention: k must have no empty axis (B, T, H, D); got shape (3, 0, 2, 5). "
                 "To attend to no key, mask the keys instead (e.g. "
                 "masks.lengths(kv_lengths=...) with a length of 0)."),
    ("q segment ids length", AttentionSpec(mask=masks.segments(i32(3, 6), i32(3, 11))), {},
     ValueError, "attention: segments: q_segment_ids must have shape (batch, Tq)=(3, 7); "
                 "got (3, 6)"),
    ("kv segment ids batch", AttentionSpec(mask=masks.segments(i32(3, 7), i32(2, 11))), {},
     ValueError, "attention: segments: kv_segment_ids must have shape (batch, Tk)=(3, 11); "
                 "got (2, 11)"),
    ("segment ids rank", AttentionSpec(mask=masks.segments(i32(7), i32(3, 11))), {},
     ValueError, "attention: segments: q_segment_ids must have shape (batch, Tq)=(3, 7); "
                 "got (7,)"),
    ("segment ids dtype", AttentionSpec(mask=masks.segments(jnp.zeros((3, 7)), i32(3, 11))), {},
     TypeError, "attention: segments: q_segment_ids must be integer; got float32"),
    ("kv lengths batch", AttentionSpec(mask=masks.lengths(kv_lengths=i32(4))), {},
     ValueError, "attention: lengths: kv_lengths must have shape (batch,)=(3,); got (4,)"),
    ("q lengths batch", AttentionSpec(mask=masks.lengths(q_lengths=i32(3, 1))), {},
     ValueError, "attention: lengths: q_lengths must have shape (batch,)=(3,); got (3, 1)"),
    ("lengths dtype", AttentionSpec(mask=masks.lengths(kv_lengths=jnp.zeros(3))), {},
     TypeError, "attention: lengths: kv_lengths must be integer; got float32"),
    ("prefix batch", AttentionSpec(mask=masks.prefix_lm(i32(2))), {},
     ValueError, "attention: prefix_lm: prefix_lengths must have shape (batch,)=(3,); got (2,)"),
    ("prefix dtype", AttentionSpec(mask=masks.prefix_lm(jnp.zeros(3))), {},
     TypeError, "attention: prefix_lm: prefix_lengths must be integer; got float32"),
    ("array mask", AttentionSpec(mask=masks.from_array(jnp.zeros((7, 10), bool))), {},
     ValueError, "attention: from_array: mask must be broadcastable to (batch, heads, Tq, Tk)="
                 "(3, 4, 7, 11) with full Tq and Tk axes; got (7, 10)"),
    ("array mask heads", AttentionSpec(mask=masks.from_array(jnp.zeros((3, 3, 7, 11), bool))), {},
     ValueError, "attention: from_array: mask must be broadcastable to (batch, heads, Tq, Tk)="
                 "(3, 4, 7, 11) with full Tq and Tk axes; got (3, 3, 7, 11)"),
    ("mask inside a composition", AttentionSpec(mask=masks.causal() & ~masks.lengths(i32(5))), {},
     ValueError, "attention: lengths: q_lengths must have shape (batch,)=(3,); got (5,)"),
    ("bias length", AttentionSpec(bias=jnp.zeros((3, 4, 7, 10))), {},
     ValueError, "attention: bias must be broadcastable to (B, Hq, Tq, Tk)=(3, 4, 7, 11); "
                 "got (3, 4, 7, 10)"),
    ("bias batch", AttentionSpec(bias=jnp.zeros((2, 1, 7, 11))), {},
     ValueError, "attention: bias must be broadcastable to (B, Hq, Tq, Tk)=(3, 4, 7, 11); "
                 "got (2, 1, 7, 11)"),
    ("bias rank", AttentionSpec(bias=jnp.zeros((1, 3, 4, 7, 11))), {},
     ValueError, "attention: bias must be broadcastable to (B, Hq, Tq, Tk)=(3, 4, 7, 11); "
                 "got (1, 3, 4, 7, 11)"),
    ("bias dtype", AttentionSpec(bias=jnp.zeros((7, 11), jnp.int32)), {},
     TypeError, "attention: bias must be a floating-point array (float32, bfloat16 or float16); "
                "got int32 with shape (7, 11)"),
    ("sinks length", AttentionSpec(sinks=jnp.zeros((2,))), {},
     ValueError, "attention: sinks must have shape (Hq,)=(4,), one logit per query head; "
                 "got (2,)"),
    ("sinks rank", AttentionSpec(sinks=jnp.zeros((1, 4))), {},
     ValueError, "attention: sinks must have shape (Hq,)=(4,), one logit per query head; "
                 "got (1, 4)"),
    ("dropout without key", AttentionSpec(dropout_rate=0.1), {},
     ValueError, "attention: dropout_rate=0.1 needs a dropout_key (a PRNG key, e.g. "
                 "jax.random.key(0))"),
]


@pytest.mark.parametrize("name,spec,args,exc,message", CALLS, ids=[c[0] for c in CALLS])
def test_call_message(name, spec, args, exc, message):
    with pytest.raises(exc) as info:
        call(spec, **args)
    assert str(info.value) == message


CONSTRUCTION = [
    ("layout", lambda: AttentionSpec(layout="btdh"), ValueError,
     "AttentionSpec: layout must be one of ('bthd', 'bhtd'); got 'btdh'"),
    ("impl", lambda: AttentionSpec(impl="flash"), ValueError,
     "AttentionSpec: impl must be one of ('auto', 'xla', 'pallas', 'cudnn', 'reference'); "
     "got 'flash'"),
    ("scale", lambda: AttentionSpec(scale=0.0), ValueError,
     "AttentionSpec: scale must be a positive finite float or None; got 0.0"),
    ("traced scale", lambda: AttentionSpec(scale=jnp.float32(0.5)), TypeError,
     "AttentionSpec: scale is static configuration and must be a Python float or None; got "
     "ArrayImpl Array(0.5, dtype=float32). A traced or array value cannot be static: to learn "
     "a scale, multiply q by it before the call."),
    ("dropout rate", lambda: AttentionSpec(dropout_rate=1.0), ValueError,
     "AttentionSpec: dropout_rate must be in [0, 1); got 1.0"),
    ("array as mask", lambda: AttentionSpec(mask=jnp.ones((7, 11), bool)), TypeError,
     "AttentionSpec: mask must be an fnattn.masks mask or None; got ArrayImpl. Wrap a boolean "
     "array with masks.from_array."),
    ("window < 0", lambda: masks.sliding_window(left=-2), ValueError,
     "sliding_window: left must be a non-negative int or None; got -2"),
    ("window right < 0", lambda: masks.sliding_window(2, right=-1), ValueError,
     "sliding_window: right must be a non-negative int or None; got -1"),
    ("window not int", lambda: masks.sliding_window(2.5), ValueError,
     "sliding_window: left must be a non-negative int or None; got 2.5"),
    ("window unbounded", lambda: masks.sliding_window(None, None), ValueError,
     "sliding_window: left and right cannot both be None; use full()"),
    ("chunk", lambda: masks.chunked(0), ValueError,
     "chunked: size must be a positive int; got 0"),
    ("lengths", lambda: masks.lengths(), ValueError,
     "lengths: give q_lengths, kv_lengths or both"),
    ("from_array float", lambda: masks.from_array(jnp.ones((3, 3))), TypeError,
     "from_array: mask must be boolean; got float32. An additive float mask (0 to attend, "
     "-inf or a large negative number to mask) is a bias: pass it as AttentionSpec(bias=...); "
     "a float mask of 1s and 0s converts with `mask > 0`."),
    ("from_array int", lambda: masks.from_array(jnp.ones((3, 3), jnp.int32)), TypeError,
     "from_array: mask must be boolean; got int32. Convert it with `mask != 0` (True attends)."),
    ("window bool", lambda: masks.sliding_window(True), ValueError,
     "sliding_window: left must be a non-negative int or None; got True"),
    ("chunk bool", lambda: masks.chunked(True), ValueError,
     "chunked: size must be a positive int; got True"),
    ("lengths of strings", lambda: masks.lengths(kv_lengths="3"), TypeError,
     "lengths: kv_lengths must be a JAX array (or a list / NumPy array of ints); got str '3'"),
    ("block sizes int", lambda: AttentionSpec(block_sizes=16), TypeError,
     "AttentionSpec: block_sizes must be None, a block-size object (fnattn.XlaBlockSizes, "
     "TritonBlockSizes, MosaicBlockSizes, DecodeBlockSizes, PagedBlockSizes) or a tuple of "
     "them, one per lowering; got int 16"),
    ("from_fn", lambda: masks.from_fn(3), TypeError,
     "from_fn: predicate must be callable; got int"),
    ("mask & array", lambda: masks.causal() & jnp.ones((3, 3), bool), TypeError,
     "cannot combine a mask with ArrayImpl using `&`; both sides must be fnattn.masks objects "
     "(wrap a boolean array with masks.from_array)"),
    ("mask | bool", lambda: masks.causal() | True, TypeError,
     "cannot combine a mask with bool using `|`; both sides must be fnattn.masks objects"),
]


@pytest.mark.parametrize("name,make,exc,message", CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION])
def test_construction_message(name, make, exc, message):
    with pytest.raises(exc) as info:
        make()
    assert str(info.value) == message


BOOL_MESSAGE = (
    "A mask has no truth value. To combine masks use `&` (both allow), `|` (either allows) and "
    "`~` (negation), not the Python keywords `and`, `or`, `not`, which call bool() on the mask; "
    "and test for a missing mask with `mask is None`.")


@pytest.mark.parametrize("misuse", [
    lambda m: m and masks.causal(),
    lambda m: m or masks.causal(),
    lambda m: not m,
    lambda m: 1 if m else 0,
])
def test_bool_of_a_mask_explains_and_versus_ampersand(misuse):
    with pytest.raises(TypeError) as info:
        misuse(masks.sliding_window(left=3))
    assert str(info.value) == BOOL_MESSAGE


def test_from_fn_must_return_booleans():
    spec = AttentionSpec(mask=masks.from_fn(lambda b, h, q, k: q - k))
    with pytest.raises(TypeError) as info:
        call(spec)
    assert str(info.value) == (
        "from_fn: the predicate <lambda> must return booleans; got int32. Return a comparison, "
        "e.g. `lambda b, h, q, k: k <= q`, or `x != 0` for an integer x.")


def test_float64_is_refused_by_the_pallas_kernels():
    with jax.enable_x64(True):
        q = jnp.zeros((1, 3, 2, 4), jnp.float64)
        with pytest.raises(NotImplementedError) as info:
            jax.jit(fnattn.attention)(AttentionSpec(impl="pallas"), q, q, q)
    assert str(info.value) == (
        "flash: float64 inputs are not supported by impl='pallas' (the Triton and Mosaic "
        "kernels compute in float32); impl='auto' or 'xla' compute float64 in float64 on every "
        "platform, or cast q, k and v to float32.")


def test_reference_names_itself():
    with pytest.raises(ValueError) as info:
        jax.jit(fnattn.reference)(AttentionSpec(), Q, jnp.zeros((3, 11, 2, 6)),
                                  jnp.zeros((3, 11, 2, 6)))
    assert str(info.value).startswith("reference: head-dim mismatch:")


def test_errors_are_raised_at_trace_time_before_any_computation():
    traced = []

    def f(q):
        traced.append(1)
        return fnattn.attention(AttentionSpec(sinks=jnp.zeros(2)), q, K, K)

    with pytest.raises(ValueError, match="sinks must have shape"):
        jax.jit(f).trace(Q)
    assert traced == [1]
