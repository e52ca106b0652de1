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
                 "(B, H, T, D) for layout 'bhtd'. Read as (B, T, H, D) (layout 'bthd') they "
                 "have Hq=4 and Hkv=2: if that is their layout, pass AttentionSpec("
                 "layout='bthd'), the default."),
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
     TypeError, "attention: q, k and v must share a dtype; got q float32, k float32, v bfloat16. "
                "Cast them to one, e.g. v.astype(q.dtype)."),
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


# ----------------------------------------------------------------------------------
# What users get wrong first: the spec forgotten, lists for arrays, a traced size,
# float masks, the other layout, float64. Each message says what to do.
# ----------------------------------------------------------------------------------

KP = jnp.zeros((2, 8, 4, 5))  # a pool: Hkv=2, 8 pages of 4 slots, D=5
Q1 = Q[:, :1]  # one new token per sequence
TABLE = jnp.array([[0, 1], [2, 3], [4, 5]])
LENGTHS = jnp.array([3, 4, 5])
RAGGED = dict(page_table=TABLE[:1], context_lengths=jnp.array([7]),
              query_start_loc=jnp.array([0, 7]), num_seqs=jnp.int32(1))


def spec_first(fn, shape, call):
    return (f"{fn}: the first argument must be an AttentionSpec; got a float32 array of shape "
            f"{shape}. The spec comes first: fnattn.{call}")


FORGOTTEN_SPEC = [
    ("attention", lambda: jax.jit(fnattn.attention)(Q, K, K),
     spec_first("attention", (3, 7, 4, 5), "attention(fnattn.AttentionSpec(), q, k, v)")),
    ("flash", lambda: jax.jit(fnattn.flash)(Q, K, K),
     spec_first("flash", (3, 7, 4, 5), "flash(fnattn.AttentionSpec(), q, k, v)")),
    ("reference", lambda: jax.jit(fnattn.reference)(Q, K, K),
     spec_first("reference", (3, 7, 4, 5), "reference(fnattn.AttentionSpec(), q, k, v)")),
    ("decode", lambda: jax.jit(fnattn.decode)(Q1, K, K, kv_lengths=LENGTHS),
     spec_first("decode", (3, 1, 4, 5),
                "decode(fnattn.AttentionSpec(), q, k_cache, v_cache, kv_lengths=...)")),
    ("paged", lambda: jax.jit(fnattn.paged_attention)(Q1, KP, KP, page_table=TABLE,
                                                      kv_lengths=LENGTHS),
     spec_first("paged_attention", (3, 1, 4, 5),
                "paged_attention(fnattn.AttentionSpec(), q, k_pages, v_pages, page_table=..., "
                "kv_lengths=...)")),
    ("ragged", lambda: jax.jit(fnattn.ragged_paged_attention)(Q[0], KP, KP, **RAGGED),
     spec_first("ragged_paged_attention", (7, 4, 5),
                "ragged_paged_attention(fnattn.AttentionSpec(), q, k_pages, v_pages, "
                "page_table=..., context_lengths=..., query_start_loc=..., num_seqs=...)")),
    ("ragged with update", lambda: jax.jit(fnattn.ragged_paged_attention_with_update)(
        Q[0], K[0, :7], K[0, :7], KP, KP, **RAGGED),
     spec_first("ragged_paged_attention_with_update", (7, 4, 5),
                "ragged_paged_attention_with_update(fnattn.AttentionSpec(), q, k, v, k_pages, "
                "v_pages, page_table=..., context_lengths=..., query_start_loc=..., "
                "num_seqs=...)")),
    ("the class", lambda: fnattn.attention(AttentionSpec, Q, K, K),
     "attention: the first argument must be an AttentionSpec; got the class AttentionSpec "
     "itself. Create one: fnattn.attention(fnattn.AttentionSpec(), q, k, v)"),
    ("a mask", lambda: fnattn.attention(masks.causal(), Q, K, K),
     "attention: the first argument must be an AttentionSpec; got the mask causal(). A mask "
     "goes inside the spec: fnattn.attention(fnattn.AttentionSpec(mask=mask), q, k, v)"),
    ("keywords only", lambda: fnattn.attention(q=Q, k=K, v=K),
     "attention: missing the spec: the first argument must be an AttentionSpec, as in "
     "fnattn.attention(fnattn.AttentionSpec(), q, k, v)"),
    ("an argument missing", lambda: jax.jit(fnattn.decode)(AttentionSpec(), Q1, K, K),
     "decode: missing a required argument: 'kv_lengths'; the call is "
     "fnattn.decode(fnattn.AttentionSpec(), q, k_cache, v_cache, kv_lengths=...)"),
]


@pytest.mark.parametrize("name,make,message", FORGOTTEN_SPEC, ids=[c[0] for c in FORGOTTEN_SPEC])
def test_a_forgotten_spec_says_where_it_goes(name, make, message):
    with pytest.raises(TypeError) as info:
        make()
    # (Python 3.12 and later say "a required keyword-only argument")
    assert str(info.value).replace("keyword-only argument", "argument") == message


def test_integer_lists_are_accepted_as_arrays():
    """Ids, lengths, positions, starts and page tables given as Python lists (or
    ints, or NumPy arrays) mean what jnp.asarray of them means, in a mask and at
    every entry point, under jit."""
    spec = AttentionSpec(mask=masks.segments([[0] * 3 + [1] * 4] * 3, [[0] * 5 + [1] * 6] * 3)
                         & masks.lengths(kv_lengths=[11, 9, 4])
                         & masks.at_positions(masks.causal(), list(range(4, 11)), range(11)))
    arrays = AttentionSpec(mask=masks.segments(jnp.array([[0] * 3 + [1] * 4] * 3),
                                               jnp.array([[0] * 5 + [1] * 6] * 3))
                           & masks.lengths(kv_lengths=jnp.array([11, 9, 4]))
                           & masks.at_positions(masks.causal(), jnp.arange(4, 11),
                                                jnp.arange(11)))
    q = jax.random.normal(jax.random.key(0), Q.shape)
    k = jax.random.normal(jax.random.key(1), K.shape)
    got = jax.jit(fnattn.attention)(spec, q, k, k).out
    assert jnp.array_equal(got, jax.jit(fnattn.attention)(arrays, q, k, k).out)
    assert not jnp.array_equal(got, jax.jit(fnattn.attention)(AttentionSpec(), q, k, k).out)

    plain = AttentionSpec()
    want = jax.jit(fnattn.decode)(plain, q[:, :1], k, k, kv_lengths=LENGTHS,
                                  kv_starts=jnp.array([0, 2, 1])).out
    got = jax.jit(fnattn.decode)(plain, q[:, :1], k, k, kv_lengths=[3, 4, 5],
                                 kv_starts=(0, 2, 1)).out
    assert jnp.array_equal(got, want)

    pool = jax.random.normal(jax.random.key(2), KP.shape)
    want = jax.jit(fnattn.paged_attention)(plain, q[:, :1], pool, pool, page_table=TABLE,
                                           kv_lengths=LENGTHS).out
    got = jax.jit(fnattn.paged_attention)(plain, q[:, :1], pool, pool,
                                          page_table=[[0, 1], [2, 3], [4, 5]],
                                          kv_lengths=[3, 4, 5]).out
    assert jnp.array_equal(got, want)
    want = fnattn.ragged_paged_attention(plain, q[0], pool, pool, **RAGGED).out
    got = fnattn.ragged_paged_attention(plain, q[0], pool, pool, page_table=[[0, 1]],
                                        context_lengths=[7], query_start_loc=[0, 7],
                                        num_seqs=1).out
    assert jnp.array_equal(got, want)


REFUSED_LISTS = [
    ("q as a list", lambda: jax.jit(fnattn.attention)(AttentionSpec(), [Q], K, K),
     "attention: q must be a JAX array; got a list of length 1. Pass a JAX array, e.g. "
     "jnp.asarray(q), in the documented shape."),
    ("sinks as a list", lambda: jax.jit(fnattn.attention)(AttentionSpec(sinks=[0.0] * 4), Q, K, K),
     "attention: sinks must be a JAX array; got list. Pass a JAX array, e.g. jnp.asarray(sinks)."),
    ("ragged lengths", lambda: fnattn.decode(AttentionSpec(), Q1, K, K, kv_lengths=[[1], [2, 3]]),
     "decode: kv_lengths must be an integer array; got a list of length 2 that jnp.asarray "
     "cannot convert to one array (ragged, not numbers, or out of range)"),
    ("lengths as a string", lambda: fnattn.paged_attention(AttentionSpec(), Q1, KP, KP,
                                                           page_table=TABLE, kv_lengths="345"),
     "paged_attention: kv_lengths must be an integer array; got str '345'"),
]


@pytest.mark.parametrize("name,make,message", REFUSED_LISTS, ids=[c[0] for c in REFUSED_LISTS])
def test_float_data_as_a_list_is_refused(name, make, message):
    with pytest.raises(TypeError) as info:
        make()
    assert str(info.value) == message


STATIC_FLOAT_HINT = (
    "pass a Python float known at trace time (float(x) for a concrete array; through "
    "jax.jit, a static argument: jax.jit(f, static_argnames=...)).")
TRACED = [
    ("window", lambda w: masks.sliding_window(left=w),
     "sliding_window: an array left must be an integer scalar or a (batch,) integer array "
     "(one size per batch row); got float32[]"),
    ("window right", lambda w: masks.sliding_window(None, right=w),
     "sliding_window: an array right must be an integer scalar or a (batch,) integer array "
     "(one size per batch row); got float32[]"),
    ("chunk", lambda w: masks.chunked(w),
     "chunked: an array size must be an integer scalar or a (batch,) integer array (one "
     "size per batch row); got float32[]"),
]


@pytest.mark.parametrize("name,make,message", TRACED, ids=[c[0] for c in TRACED])
def test_a_traced_size_must_be_an_integer(name, make, message):
    """Traced sizes are data (tests/test_traced_sizes.py); a float one is refused."""
    def f(w):
        return fnattn.attention(AttentionSpec(mask=make(w)), Q, K, K).out

    with pytest.raises(TypeError) as info:
        jax.jit(f)(4.0)
    assert str(info.value) == message


@pytest.mark.parametrize("field,rest", [("softcap", " or None"), ("dropout_rate", "")])
def test_a_traced_float_field_says_it_must_be_static(field, rest):
    def f(x):
        return fnattn.attention(AttentionSpec(**{field: x}), Q, K, K).out

    with pytest.raises(TypeError) as info:
        jax.jit(f)(0.5)
    assert str(info.value).startswith(
        f"AttentionSpec: {field} is static configuration and must be a Python float{rest}; "
        "got DynamicJaxprTracer")
    assert str(info.value).endswith("A traced or array value cannot be static: "
                                     + STATIC_FLOAT_HINT)


FIRST_MISTAKES = [
    ("window as a float array", lambda: masks.sliding_window(jnp.float32(4)),
     "sliding_window: an array left must be an integer scalar or a (batch,) integer array "
     "(one size per batch row); got float32[]"),
    ("float array as mask", lambda: AttentionSpec(mask=jnp.ones((7, 11))),
     "AttentionSpec: mask must be an fnattn.masks mask or None; got ArrayImpl. A float32 array "
     "is either an additive mask (0 to attend, -inf or a large negative number to mask), which "
     "is a bias: AttentionSpec(bias=mask); or 1s and 0s: mask=masks.from_array(mask > 0)."),
    ("int array as mask", lambda: AttentionSpec(mask=jnp.ones((7, 11), jnp.int32)),
     "AttentionSpec: mask must be an fnattn.masks mask or None; got ArrayImpl. Wrap an integer "
     "array as masks.from_array(mask != 0) (True attends)."),
    ("mask not called", lambda: AttentionSpec(mask=masks.causal),
     "AttentionSpec: mask must be an fnattn.masks mask or None; got function. Call it: "
     "masks.causal(...)."),
]


@pytest.mark.parametrize("name,make,message", FIRST_MISTAKES, ids=[c[0] for c in FIRST_MISTAKES])
def test_first_mistake_message(name, make, message):
    with pytest.raises(TypeError) as info:
        make()
    assert str(info.value) == message


def test_float_mask_of_ones_and_zeros_converts_as_the_message_says():
    ones = jnp.tril(jnp.ones((7, 11)), 4)
    spec = AttentionSpec(mask=masks.from_array(ones > 0))
    got = jax.jit(fnattn.attention)(spec, Q + 1.0, K, K + jnp.arange(11.0)[:, None, None])
    want = jax.jit(fnattn.attention)(AttentionSpec(mask=masks.causal()), Q + 1.0, K,
                                     K + jnp.arange(11.0)[:, None, None])
    assert jnp.allclose(got.out, want.out)


def bhtd(*shape):  # arrays laid out (B, H, T, D)
    return jnp.zeros(shape)


LAYOUT = [
    ("attention, bhtd arrays read as bthd",
     lambda: call(AttentionSpec(), bhtd(3, 4, 8, 5), bhtd(3, 2, 16, 5), bhtd(3, 2, 16, 5)),
     "attention: the number of query heads Hq=8 must be a multiple of the number of key/value "
     "heads Hkv=16; got q (3, 4, 8, 5) and k (3, 2, 16, 5), read as (B, T, H, D) for layout "
     "'bthd'. Read as (B, H, T, D) (layout 'bhtd') they have Hq=4 and Hkv=2: if that is their "
     "layout, pass AttentionSpec(layout='bhtd')."),
    ("attention, fewer query heads",
     lambda: call(AttentionSpec(), jnp.zeros((3, 7, 2, 5)), jnp.zeros((3, 11, 4, 5)),
                  jnp.zeros((3, 11, 4, 5))),
     "attention: the number of query heads Hq=2 must be a multiple of the number of key/value "
     "heads Hkv=4; got q (3, 7, 2, 5) and k (3, 11, 4, 5), read as (B, T, H, D) for layout "
     "'bthd'. There cannot be fewer query heads than key/value heads: check the layout and "
     "that q and k are not swapped."),
    ("decode, bhtd arrays read as bthd",
     lambda: jax.jit(fnattn.decode)(AttentionSpec(), bhtd(3, 4, 1, 5), bhtd(3, 2, 16, 5),
                                    bhtd(3, 2, 16, 5), kv_lengths=LENGTHS),
     "decode: the number of query heads Hq=1 must be a multiple of the number of key/value "
     "heads Hkv=16; got q (3, 4, 1, 5) and k (3, 2, 16, 5), read as (B, T, H, D) for layout "
     "'bthd'. Read as (B, H, T, D) (layout 'bhtd') they have Hq=4 and Hkv=2: if that is their "
     "layout, pass AttentionSpec(layout='bhtd')."),
    ("paged, bhtd q read as bthd",
     lambda: jax.jit(fnattn.paged_attention)(AttentionSpec(), bhtd(3, 4, 1, 5), KP, KP,
                                             page_table=TABLE, kv_lengths=LENGTHS),
     "paged_attention: the number of query heads Hq=1 (q (3, 4, 1, 5)) must be a multiple of "
     "the number of kv heads Hkv=2 (k_pages (2, 8, 4, 5), axis 0). Read as (B, H, T, D) "
     "(layout 'bhtd') q has Hq=4: if that is its layout, pass AttentionSpec(layout='bhtd')."),
    ("ragged, pools not heads-major",
     lambda: jax.jit(fnattn.ragged_paged_attention)(AttentionSpec(), Q[0], jnp.zeros((8, 4, 2, 5)),
                                                    jnp.zeros((8, 4, 2, 5)), **RAGGED),
     "ragged_paged_attention: the number of query heads Hq=4 (q (7, 4, 5)) must be a multiple "
     "of the number of kv heads Hkv=8 (k_pages (8, 4, 2, 5), axis 0). The pools are "
     "heads-major, (Hkv, num_pages, page_size, D): one laid out (num_pages, page_size, Hkv, D) "
     "converts with pages.transpose(2, 0, 1, 3)."),
]


@pytest.mark.parametrize("name,make,message", LAYOUT, ids=[c[0] for c in LAYOUT])
def test_fewer_query_heads_than_kv_heads_names_the_layout(name, make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


def f64(*shape):
    return jnp.zeros(shape, jnp.float64)


FLOAT64 = [
    ("decode", lambda: jax.jit(fnattn.decode)(AttentionSpec(), f64(3, 1, 4, 5), f64(3, 11, 2, 5),
                                              f64(3, 11, 2, 5), kv_lengths=LENGTHS),
     "decode: float64 inputs are not supported (q, k_cache, v_cache are float64): the serving "
     "variants compute in float32; cast q, k_cache, v_cache to float32 "
     "(x.astype(jnp.float32))."),
    ("paged", lambda: jax.jit(fnattn.paged_attention)(
        AttentionSpec(), f64(3, 1, 4, 5), f64(*KP.shape), f64(*KP.shape), page_table=TABLE,
        kv_lengths=LENGTHS),
     "paged_attention: float64 inputs are not supported (q, k_pages, v_pages are float64): the "
     "serving variants compute in float32; cast q, k_pages, v_pages to float32 "
     "(x.astype(jnp.float32))."),
    ("ragged", lambda: jax.jit(fnattn.ragged_paged_attention)(
        AttentionSpec(), f64(7, 4, 5), f64(*KP.shape), f64(*KP.shape), **RAGGED),
     "ragged_paged_attention: float64 inputs are not supported (q, k_pages, v_pages are "
     "float64): the serving variants compute in float32; cast q, k_pages, v_pages to float32 "
     "(x.astype(jnp.float32))."),
    ("ragged with update, the new tokens", lambda: jax.jit(
        fnattn.ragged_paged_attention_with_update)(
        AttentionSpec(), Q[0], f64(7, 2, 5), f64(7, 2, 5), KP, KP, **RAGGED),
     "ragged_paged_attention_with_update: float64 inputs are not supported (k, v are float64): "
     "the serving variants compute in float32; cast q, k, v, k_pages, v_pages to float32 "
     "(x.astype(jnp.float32))."),
    ("attention, one array float64", lambda: call(AttentionSpec(), Q, f64(3, 11, 2, 5), K),
     "attention: q, k and v must share a dtype; got q float32, k float64, v float32. Cast "
     "them to one, e.g. k.astype(q.dtype)."),
]


@pytest.mark.parametrize("name,make,message", FLOAT64, ids=[c[0] for c in FLOAT64])
def test_float64_says_what_to_do(name, make, message):
    with jax.enable_x64(True):
        with pytest.raises(TypeError) as info:
            make()
    assert str(info.value) == message


def test_float64_is_computed_in_float64_by_dense_attention():
    with jax.enable_x64(True):
        q = jax.random.normal(jax.random.key(0), (1, 5, 2, 4), jnp.float64)
        out = jax.jit(fnattn.attention)(AttentionSpec(impl="xla"), q, q, q).out
    assert out.dtype == jnp.float64


def test_decode_with_update_spec_first_and_list_lengths():
    q = jnp.zeros((2, 1, 4, 8))
    new = jnp.zeros((2, 1, 2, 8))
    cache = jnp.zeros((2, 16, 2, 8))
    with pytest.raises(TypeError, match=r"^decode_with_update: the first argument must be an "
                                        r"AttentionSpec; got a float32 array of shape \(2, 1, 4, 8\)"):
        fnattn.decode_with_update(q, new, new, cache, cache, kv_lengths=jnp.array([3, 4]))
    f = jax.jit(lambda L: fnattn.decode_with_update(AttentionSpec(), q, new, new, cache, cache,
                                                    kv_lengths=L)[0].out)
    listed = fnattn.decode_with_update(AttentionSpec(), q, new, new, cache, cache,
                                       kv_lengths=[3, 4])[0].out
    assert (listed == f(jnp.array([3, 4], jnp.int32))).all()
