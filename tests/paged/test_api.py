"""The public paged entry points (fnattn/paged/api.py), whatever the lowering:

* the exact wording of every trace-time error;
* checked mode: each bad run-time value reported by checkify with its message, and
  nothing for good input (junk in dead slots and unused page-table entries included);
* without checked mode, the same bad values are safe: the calls run, give finite
  values that follow the documented sanitising rules (checked against a float64
  NumPy model of those rules), rows of no live sequence are exactly 0 with
  lse = -inf, and the update form writes nothing outside the slots of live tokens;
* gradients with respect to q, the pools and the sinks against the dense problems'
  gradients; the update form refused by jax.grad.
"""

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import fnattn  # noqa: E402
from fnattn import AttentionSpec, masks  # noqa: E402
from problems import dense_packed, expected, make, poisoned, to_pool  # noqa: E402
from problems import meta as metadata  # noqa: E402
from problems import ragged as ragged_with  # noqa: E402

# ----------------------------------------------------------------------------------
# (a) Trace-time messages
# ----------------------------------------------------------------------------------

f32, i32 = jnp.float32, jnp.int32
Q = jnp.zeros((5, 6, 7))          # T=5, Hq=6, D=7
KP = jnp.zeros((3, 11, 2, 7))     # Hkv=3, 11 pages of 2 slots
VP = jnp.zeros((3, 11, 2, 13))    # Dv=13
KNEW, VNEW = jnp.zeros((5, 3, 7)), jnp.zeros((5, 3, 13))
META = dict(page_table=jnp.zeros((4, 3), i32), context_lengths=jnp.zeros((4,), i32),
            query_start_loc=jnp.zeros((5,), i32), num_seqs=jnp.int32(2))
PQ = jnp.zeros((2, 1, 6, 7))      # B=2, Tq=1
PMETA = dict(page_table=jnp.zeros((2, 3), i32), kv_lengths=jnp.zeros((2,), i32))
PLAIN = AttentionSpec()


def ragged(spec=PLAIN, q=Q, kp=KP, vp=VP, **meta):
    return jax.jit(fnattn.ragged_paged_attention)(spec, q, kp, vp, **{**META, **meta})


def update(spec=PLAIN, q=Q, k=KNEW, v=VNEW, kp=KP, vp=VP, **meta):
    return jax.jit(fnattn.ragged_paged_attention_with_update)(spec, q, k, v, kp, vp,
                                                              **{**META, **meta})


def paged(spec=PLAIN, q=PQ, kp=KP, vp=VP, **meta):
    return jax.jit(fnattn.paged_attention)(spec, q, kp, vp, **{**PMETA, **meta})


FLOAT = "must be a floating-point array (float32, bfloat16 or float16); got"
RP = "ragged_paged_attention"
CUDNN = ("paged attention: impl='cudnn' has no paged lowering; use impl='auto' (Triton "
         "kernels on NVIDIA GPUs) or impl='xla'.")
ARRAY_MASK = ("masks that hold arrays ({}) are not supported by paged attention; use "
              "positional masks (causal, sliding_window, chunked, their combinations, "
              "from_fn), whose window and chunk sizes may be int scalars (one per layer "
              "inside lax.scan). The page table and lengths already say which keys exist.")
BIAS = ("spec.bias is not supported by paged attention (no paged lowering takes a bias); "
        "fnattn.attention and fnattn.flash do.")
DROPOUT = ("dropout is not supported by paged attention (an inference kernel); "
           "fnattn.attention and fnattn.flash support it.")
KEY = jax.random.key(0)
SEGMENTS = masks.segments(jnp.zeros((1, 5), i32), jnp.zeros((1, 5), i32))

CALLS = [
    # ragged_paged_attention: q
    ("q rank", ragged, dict(q=jnp.zeros((5, 42))), ValueError,
     f"{RP}: q must have shape (total_tokens, Hq, D) with no empty axis; got (5, 42)"),
    ("q empty", ragged, dict(q=jnp.zeros((0, 6, 7))), ValueError,
     f"{RP}: q must have shape (total_tokens, Hq, D) with no empty axis; got (0, 6, 7)"),
    ("q int", ragged, dict(q=jnp.zeros((5, 6, 7), i32)), TypeError,
     f"{RP}: q {FLOAT} int32 with shape (5, 6, 7)"),
    ("layout", ragged, dict(spec=AttentionSpec(layout="bhtd")), ValueError,
     f"{RP}: q is packed (total_tokens, Hq, D); spec.layout must be 'bthd'; got 'bhtd'"),
    # the pools
    ("k_pages rank", ragged, dict(kp=jnp.zeros((3, 22, 7))), ValueError,
     f"{RP}: k_pages must have 4 axes (Hkv, num_pages, page_size, D); got shape (3, 22, 7)"),
    ("v_pages rank", ragged, dict(vp=jnp.zeros((3, 11, 26))), ValueError,
     f"{RP}: v_pages must have 4 axes (Hkv, num_pages, page_size, Dv); got shape "
     "(3, 11, 26)"),
    ("empty pool", ragged, dict(kp=jnp.zeros((3, 0, 2, 7)), vp=jnp.zeros((3, 0, 2, 13))),
     ValueError, f"{RP}: k_pages must have no empty axis; got shape (3, 0, 2, 7)"),
    ("k_pages int", ragged, dict(kp=jnp.zeros((3, 11, 2, 7), jnp.int8)), TypeError,
     f"{RP}: k_pages {FLOAT} int8 with shape (3, 11, 2, 7)"),
    ("head dim", ragged, dict(kp=jnp.zeros((3, 11, 2, 8))), ValueError,
     f"{RP}: k_pages must have head dim D=7 like q (5, 6, 7): expected (Hkv, num_pages, "
     "page_size, 7); got (3, 11, 2, 8)"),
    # BUG (fnattn/paged/api.py:201): the message formats the tuple (Hkv, N, ps, 'Dv'),
    # so Python's repr of the string leaks in: "(3, 11, 2, 'Dv')". The wording the
    # dense functions use (tests/test_messages.py, "v length") is "(3, 11, 2, Dv)".
    ("v_pages pages", ragged, dict(vp=jnp.zeros((3, 10, 2, 13))), ValueError,
     f"{RP}: v_pages must have shape (Hkv, num_pages, page_size, Dv)=(3, 11, 2, Dv) "
     "matching k_pages (3, 11, 2, 7); got (3, 10, 2, 13)"),
    ("gqa", ragged, dict(kp=jnp.zeros((4, 11, 2, 7)), vp=jnp.zeros((4, 11, 2, 13))),
     ValueError, f"{RP}: the number of query heads Hq=6 (q (5, 6, 7)) must be a multiple of "
                 "the number of kv heads Hkv=4 (k_pages (4, 11, 2, 7), axis 0)"),
    ("pool dtype", ragged, dict(kp=jnp.zeros((3, 11, 2, 7), jnp.bfloat16)), TypeError,
     f"{RP}: q, k_pages and v_pages must share a dtype; got q float32, k_pages bfloat16, "
     "v_pages float32"),
    ("q dtype", ragged, dict(q=jnp.zeros((5, 6, 7), jnp.float16)), TypeError,
     f"{RP}: q, k_pages and v_pages must share a dtype; got q float16, k_pages float32, "
     "v_pages float32"),
    # the metadata
    ("page_table rank", ragged, dict(page_table=jnp.zeros((12,), i32)), ValueError,
     f"{RP}: page_table must have shape (max_seqs, max_pages_per_seq); got (12,)"),
    ("page_table dtype", ragged, dict(page_table=jnp.zeros((4, 3))), TypeError,
     f"{RP}: page_table must be an integer array; got float32"),
    ("context_lengths shape", ragged, dict(context_lengths=jnp.zeros((5,), i32)), ValueError,
     f"{RP}: context_lengths must have shape (max_seqs,) with max_seqs from page_table "
     "(4, 3)=(4,); got (5,)"),
    ("context_lengths dtype", ragged, dict(context_lengths=jnp.zeros((4,))), TypeError,
     f"{RP}: context_lengths must be an integer array; got float32"),
    ("query_start_loc shape", ragged, dict(query_start_loc=jnp.zeros((4,), i32)), ValueError,
     f"{RP}: query_start_loc must have shape (max_seqs + 1,) with max_seqs from page_table "
     "(4, 3)=(5,); got (4,)"),
    ("query_start_loc dtype", ragged, dict(query_start_loc=jnp.zeros((5,), f32)), TypeError,
     f"{RP}: query_start_loc must be an integer array; got float32"),
    ("num_seqs shape", ragged, dict(num_seqs=jnp.zeros((2,), i32)), TypeError,
     f"{RP}: num_seqs must be an int32 scalar or (1,) array; got int32 (2,)"),
    ("num_seqs dtype", ragged, dict(num_seqs=jnp.float32(2)), TypeError,
     f"{RP}: num_seqs must be an int32 scalar or (1,) array; got float32 ()"),
    # the spec
    ("sinks shape", ragged, dict(spec=AttentionSpec(sinks=jnp.zeros(3))), ValueError,
     f"{RP}: sinks must have shape (Hq,)=(6,), one logit per query head; got (3,)"),
    ("sinks rank", ragged, dict(spec=AttentionSpec(sinks=jnp.zeros((1, 6)))), ValueError,
     f"{RP}: sinks must have shape (Hq,)=(6,), one logit per query head; got (1, 6)"),
    ("sinks dtype", ragged, dict(spec=AttentionSpec(sinks=jnp.zeros(6, i32))), TypeError,
     f"{RP}: sinks {FLOAT} int32 with shape (6,)"),
    ("bias", ragged, dict(spec=AttentionSpec(bias=jnp.zeros((5, 5)))), NotImplementedError,
     f"{RP}: {BIAS}"),
    ("dropout", ragged, dict(spec=AttentionSpec(dropout_rate=0.1, dropout_key=KEY)),
     NotImplementedError, f"{RP}: {DROPOUT}"),
    ("array mask", ragged, dict(spec=AttentionSpec(mask=masks.lengths(kv_lengths=jnp.ones(
        (4,), i32)))), NotImplementedError, f"{RP}: " + ARRAY_MASK.format("lengths(...)")),
    ("array mask in a composition", ragged,
     dict(spec=AttentionSpec(mask=masks.causal() & SEGMENTS)), NotImplementedError,
     f"{RP}: " + ARRAY_MASK.format("(causal() & segments(...))")),
    ("cudnn", ragged, dict(spec=AttentionSpec(impl="cudnn")), NotImplementedError, CUDNN),
    # ragged_paged_attention_with_update: the same checks under its own name, and k, v
    ("update head dim", update, dict(kp=jnp.zeros((3, 11, 2, 8))), ValueError,
     f"{RP}_with_update: k_pages must have head dim D=7 like q (5, 6, 7): expected "
     "(Hkv, num_pages, page_size, 7); got (3, 11, 2, 8)"),
    ("update k shape", update, dict(k=jnp.zeros((5, 2, 7))), ValueError,
     f"{RP}_with_update: k must have shape (total_tokens, Hkv, D)=(5, 3, 7) from q (5, 6, 7) "
     "and the pools; got (5, 2, 7)"),
    ("update v shape", update, dict(v=jnp.zeros((4, 3, 13))), ValueError,
     f"{RP}_with_update: v must have shape (total_tokens, Hkv, Dv)=(5, 3, 13) from q "
     "(5, 6, 7) and the pools; got (4, 3, 13)"),
    ("update k int", update, dict(k=jnp.zeros((5, 3, 7), i32)), TypeError,
     f"{RP}_with_update: k {FLOAT} int32 with shape (5, 3, 7)"),
    ("update num_seqs", update, dict(num_seqs=jnp.zeros((1, 1), i32)), TypeError,
     f"{RP}_with_update: num_seqs must be an int32 scalar or (1,) array; got int32 (1, 1)"),
    ("update bias", update, dict(spec=AttentionSpec(bias=jnp.zeros(()))), NotImplementedError,
     f"{RP}_with_update: {BIAS}"),
    ("update cudnn", update, dict(spec=AttentionSpec(impl="cudnn")), NotImplementedError,
     CUDNN),
    # paged_attention
    ("paged q rank", paged, dict(q=jnp.zeros((2, 6, 7))), ValueError,
     "paged_attention: q must have 4 axes (B, Tq, Hq, D) for layout 'bthd'; got shape "
     "(2, 6, 7)"),
    ("paged q rank bhtd", paged, dict(q=jnp.zeros((2, 6, 7)), spec=AttentionSpec(layout="bhtd")),
     ValueError, "paged_attention: q must have 4 axes (B, Hq, Tq, D) for layout 'bhtd'; got "
                 "shape (2, 6, 7)"),
    ("paged q empty", paged, dict(q=jnp.zeros((2, 0, 6, 7))), ValueError,
     "paged_attention: q must have no empty axis; got shape (2, 0, 6, 7)"),
    ("paged q int", paged, dict(q=jnp.zeros((2, 1, 6, 7), i32)), TypeError,
     f"paged_attention: q {FLOAT} int32 with shape (2, 1, 6, 7)"),
    ("paged head dim bhtd", paged, dict(q=jnp.zeros((2, 6, 1, 7)), kp=jnp.zeros((3, 11, 2, 8)),
                                        spec=AttentionSpec(layout="bhtd")), ValueError,
     "paged_attention: k_pages must have head dim D=7 like q (2, 6, 1, 7): expected "
     "(Hkv, num_pages, page_size, 7); got (3, 11, 2, 8)"),
    ("paged gqa", paged, dict(kp=jnp.zeros((4, 11, 2, 7)), vp=jnp.zeros((4, 11, 2, 13))),
     ValueError, "paged_attention: the number of query heads Hq=6 (q (2, 1, 6, 7)) must be a "
                 "multiple of the number of kv heads Hkv=4 (k_pages (4, 11, 2, 7), axis 0)"),
    # A "bthd" q read as "bhtd": Hq is the 1 at axis 1.
    ("paged gqa, wrong layout", paged, dict(spec=AttentionSpec(layout="bhtd")), ValueError,
     "paged_attention: the number of query heads Hq=1 (q (2, 1, 6, 7)) must be a multiple of "
     "the number of kv heads Hkv=3 (k_pages (3, 11, 2, 7), axis 0). Read as (B, T, H, D) "
     "(layout 'bthd') q has Hq=6: if that is its layout, pass AttentionSpec(layout='bthd'), "
     "the default."),
    ("paged pool dtype", paged, dict(vp=jnp.zeros((3, 11, 2, 13), jnp.float16)), TypeError,
     "paged_attention: q, k_pages and v_pages must share a dtype; got q float32, k_pages "
     "float32, v_pages float16"),
    ("paged v_pages int", paged, dict(vp=jnp.zeros((3, 11, 2, 13), i32)), TypeError,
     f"paged_attention: v_pages {FLOAT} int32 with shape (3, 11, 2, 13)"),
    ("paged page_table batch", paged, dict(page_table=jnp.zeros((3, 3), i32)), ValueError,
     "paged_attention: page_table must have shape (B, max_pages_per_seq) with B=2 from q "
     "(2, 1, 6, 7); got (3, 3)"),
    ("paged page_table rank", paged, dict(page_table=jnp.zeros((2,), i32)), ValueError,
     "paged_attention: page_table must have shape (B, max_pages_per_seq) with B=2 from q "
     "(2, 1, 6, 7); got (2,)"),
    ("paged page_table dtype", paged, dict(page_table=jnp.zeros((2, 3))), TypeError,
     "paged_attention: page_table must be an integer array; got float32"),
    ("paged kv_lengths shape", paged, dict(kv_lengths=jnp.zeros((3,), i32)), ValueError,
     "paged_attention: kv_lengths must have shape (B,)=(2,); got (3,)"),
    ("paged kv_lengths dtype", paged, dict(kv_lengths=jnp.zeros((2,), jnp.float16)), TypeError,
     "paged_attention: kv_lengths must be an integer array; got float16"),
    ("paged sinks", paged, dict(spec=AttentionSpec(sinks=jnp.zeros(2))), ValueError,
     "paged_attention: sinks must have shape (Hq,)=(6,), one logit per query head; got (2,)"),
    ("paged bias", paged, dict(spec=AttentionSpec(bias=jnp.zeros((2, 6, 1, 4)))),
     NotImplementedError, f"paged_attention: {BIAS}"),
    ("paged dropout", paged, dict(spec=AttentionSpec(dropout_rate=0.5, dropout_key=KEY)),
     NotImplementedError, f"paged_attention: {DROPOUT}"),
    ("paged array mask", paged, dict(spec=AttentionSpec(mask=masks.from_array(
        jnp.ones((1, 4), bool)))), NotImplementedError,
     "paged_attention: " + ARRAY_MASK.format("from_array(...)")),
    ("paged cudnn", paged, dict(spec=AttentionSpec(impl="cudnn", mask=masks.causal())),
     NotImplementedError, CUDNN),
]


@pytest.mark.parametrize("name,fn,args,exc,message", CALLS, ids=[c[0] for c in CALLS])
def test_trace_time_message(name, fn, args, exc, message):
    with pytest.raises(exc, match="^" + re.escape(message)) as info:
        fn(**args)
    assert str(info.value) == message  # exactly: match() also sees JAX's traceback note


def test_positional_masks_and_any_integer_metadata_are_accepted():
    """The checks refuse what they should and nothing more: int8/uint32 metadata, a
    (1,) num_seqs, from_fn and composed positional masks trace fine."""
    spec = AttentionSpec(mask=masks.causal() & ~masks.from_fn(lambda b, h, q, k: k == 0)
                         & masks.sliding_window(3), sinks=jnp.zeros(6), softcap=2.0)
    meta = dict(page_table=jnp.zeros((4, 3), jnp.int8),
                context_lengths=jnp.zeros((4,), jnp.uint32),
                query_start_loc=jnp.zeros((5,), jnp.int16), num_seqs=jnp.ones((1,), i32))
    out = jax.eval_shape(lambda: fnattn.ragged_paged_attention(spec, Q, KP, VP, **meta))
    assert out.out.shape == (5, 6, 13) and out.lse.shape == (6, 5)
    out = jax.eval_shape(lambda: fnattn.paged_attention(
        spec.replace(layout="bhtd"), PQ.transpose(0, 2, 1, 3), KP, VP, **PMETA))
    assert out.out.shape == (2, 6, 1, 13) and out.lse.shape == (2, 6, 1)


# ----------------------------------------------------------------------------------
# Bad run-time values: one problem, each field spoiled in turn
# ----------------------------------------------------------------------------------

# Three live sequences (L, n) and a dead slot; 3-slot pages, 3 pages per sequence
# (capacity 9). Unused page-table entries (of live and dead slots) point to pages no
# live sequence uses, each its own, so that what a spoiled call reads and writes
# there is defined and never collides; those pages hold the problem's large garbage.
SEQS = [(7, 3), (5, 1), (4, 4)]
PS, CAP = 3, 9


def base_problem():
    p = make(SEQS, Hq=4, Hkv=2, D=8, page_size=PS, pages_per_seq=3, max_seqs=4,
             num_pages=12, pad_tokens=2, seed=7)
    table = np.asarray(p.page_table).copy()
    spare = iter(np.flatnonzero(~p.used_pages).tolist())
    need = [-(-L // PS) for L, _ in SEQS] + [0]
    for s in range(4):
        for j in range(need[s], 3):
            table[s, j] = next(spare)
    p.page_table = jnp.asarray(table)
    # The dead slot: one token (row 8) at position 1 when num_seqs lets it live.
    p.context_lengths = p.context_lengths.at[3].set(2)
    p.query_start_loc = p.query_start_loc.at[4].set(9)
    return p


P0 = base_problem()
T = P0.q.shape[0]  # 10 rows: 3 + 1 + 4 live, 2 padding
N = P0.k_pages.shape[1]


def spoil(**changes):
    """The base metadata with some entries changed: name=[(index, value), ...]."""
    m = dict(page_table=np.asarray(P0.page_table).copy(),
             context_lengths=np.asarray(P0.context_lengths).copy(),
             query_start_loc=np.asarray(P0.query_start_loc).copy(),
             num_seqs=np.asarray(P0.num_seqs).copy())
    for name, edits in changes.items():
        for index, value in edits:
            m[name][index] = value
    return {k: jnp.asarray(v) for k, v in m.items()}


# name: (metadata, the message checked mode reports)
BAD = {
    "page outside the pool": (
        spoil(page_table=[((0, 1), N + 5), ((2, 0), -7)]),
        f"page_table[0, 1] = {N + 5} is outside the pool [0, {N})"),
    "negative page": (
        spoil(page_table=[((1, 1), -1)]),
        f"page_table[1, 1] = -1 is outside the pool [0, {N})"),
    "length beyond capacity": (
        spoil(context_lengths=[(0, 2 ** 30), (1, CAP + 4)]),
        "context_lengths[0] = 1073741824 is outside [0, 9] (pages_per_seq * page_size)"),
    "negative length": (
        spoil(context_lengths=[(0, -3)]),
        "context_lengths[0] = -3 is outside [0, 9] (pages_per_seq * page_size)"),
    "length smaller than new tokens": (
        spoil(context_lengths=[(2, 2)]),
        "context_lengths[2] = 2 is less than the sequence's 4 new tokens (the context "
        "includes them)"),
    # Rows 0-4 for sequence 0, none for 1, 5-7 for 2 (a running maximum; taken
    # literally, 2 would start at row 4, inside 0's rows).
    "query_start_loc decreasing": (
        spoil(query_start_loc=[(1, 5)]),
        "query_start_loc decreases at sequence 1: query_start_loc[1] = 5 > "
        "query_start_loc[2] = 4"),
    "query_start_loc decreasing to an earlier row": (
        spoil(query_start_loc=[(2, 1)]),
        "query_start_loc decreases at sequence 1: query_start_loc[1] = 3 > "
        "query_start_loc[2] = 1"),
    "query_start_loc negative": (
        spoil(query_start_loc=[(0, -4)]),
        "query_start_loc[0] = -4 is negative"),
    "query_start_loc past the tokens": (
        spoil(query_start_loc=[(3, T + 7)]),
        f"query_start_loc[num_seqs] = {T + 7} is past the {T} packed tokens"),
    "num_seqs too large": (
        spoil(num_seqs=[((), 99)]),
        "num_seqs = 99 is outside [0, max_seqs=4]"),
    "num_seqs negative": (
        spoil(num_seqs=[((), -1)]),
        "num_seqs = -1 is outside [0, max_seqs=4]"),
    "query tokens no sequence covers": (
        spoil(query_start_loc=[(0, 2)]),
        "query_start_loc[0] = 2: the packed query tokens 0 to 1 belong to no sequence (the "
        "first sequence starts at token 0; padding tokens go after query_start_loc[num_seqs])"),
}
GOOD = {
    "good": spoil(),
    # Junk where it does not matter: the dead slot's length and pages, page entries
    # past every live length, query offsets of dead slots.
    "good with junk in dead slots": spoil(
        page_table=[((3, 0), -5), ((3, 2), 10 ** 6), ((1, 2), -1), ((2, 2), N)],
        context_lengths=[(3, 2 ** 31 - 1)], query_start_loc=[(4, 2)]),
}

SPEC = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.3, -2.0, 1.0, 0.0]))


def _ragged_checked(q, kp, vp, m):
    return fnattn.ragged_paged_attention(SPEC, q, kp, vp, checked=True, **m)


def _update_checked(q, k, v, kp, vp, m):
    return fnattn.ragged_paged_attention_with_update(SPEC, q, k, v, kp, vp, checked=True, **m)


def _paged_checked(q, kp, vp, table, lengths):
    return fnattn.paged_attention(SPEC, q, kp, vp, page_table=table, kv_lengths=lengths,
                                  checked=True)


checked_ragged = jax.jit(checkify.checkify(_ragged_checked))
checked_update = jax.jit(checkify.checkify(_update_checked))
checked_paged = jax.jit(checkify.checkify(_paged_checked))


def reported(err):
    """The message of a checkify error, without checkify's own suffix; None if none."""
    msg = err.get()
    return None if msg is None else msg.removesuffix(" (`check` failed)")


@pytest.mark.parametrize("case", list(BAD) + list(GOOD))
def test_checked_mode_reports_each_bad_value(case):
    m, message = BAD[case] if case in BAD else (GOOD[case], None)
    err, res = checked_ragged(P0.q, P0.k_pages, P0.v_pages, m)
    assert reported(err) == message
    assert res.out.shape == (T, 4, 8)
    err, _ = checked_update(P0.q, P0.k_new, P0.v_new, P0.k_old, P0.v_old, m)
    assert reported(err) == message


def test_checked_paged_attention():
    p = make([(5, 2), (2, 2), (9, 2)], Hq=4, Hkv=2, D=8, page_size=PS, seed=8)
    q = p.q.reshape(3, 2, 4, 8)
    lengths, table = p.context_lengths, p.page_table
    cases = [
        (table, lengths, None),
        (table.at[2, 2].set(N + 100), lengths, f"page_table[2, 2] = {N + 100} is outside "
                                              f"the pool [0, {p.k_pages.shape[1]})"),
        (table.at[1, 1].set(-1), lengths, None),  # past kv_lengths[1] = 2: unused
        (table, lengths.at[1].set(10), "context_lengths[1] = 10 is outside [0, 9] "
                                       "(pages_per_seq * page_size)"),
        (table, lengths.at[0].set(1), "context_lengths[0] = 1 is less than the sequence's 2 "
                                      "new tokens (the context includes them)"),
    ]
    for t, lens, message in cases:
        err, _ = checked_paged(q, p.k_pages, p.v_pages, t, lens)
        assert reported(err) == message


# ----------------------------------------------------------------------------------
# Without checked mode: the same bad values are safe
# ----------------------------------------------------------------------------------


def np_paged(q, kp, vp, m, *, sinks, new_k=None, new_v=None):
    """The documented semantics of spoiled metadata, in float64 NumPy: sanitise (page
    entries outside the pool -> no page, lengths clipped to [0, capacity], num_seqs
    to [0, max_seqs], query offsets clipped to [0, T] and made non-decreasing), write
    the live tokens whose slot is valid, then causal attention of every live token
    over the keys below its sequence's length that have a page.

    Returns out, lse, the pools, owner (T,) (-1: row of no live sequence) and
    written (num_pages, page_size) bool."""
    q = np.asarray(q, np.float64)
    kp, vp = np.array(kp, np.float64), np.array(vp, np.float64)
    table = np.asarray(m["page_table"]).astype(np.int64)
    Tq, Hq, D = q.shape
    Hkv, Np, ps, Dv = vp.shape
    S, Pp = table.shape
    cap = Pp * ps
    G = Hq // Hkv
    live = np.arange(S) < np.clip(int(m["num_seqs"]), 0, S)
    pt = np.where((table >= 0) & (table < Np), table, -1)
    loc = np.maximum.accumulate(np.clip(np.asarray(m["query_start_loc"]).astype(np.int64),
                                        0, Tq))
    kv_len = np.where(live, np.clip(np.asarray(m["context_lengths"]).astype(np.int64), 0, cap),
                      0)
    q_len = np.where(live, loc[1:] - loc[:-1], 0)
    owner, pos = np.full(Tq, -1), np.zeros(Tq, int)
    written = np.zeros((Np, ps), bool)
    for s in range(S):
        for i in range(q_len[s]):
            t = loc[s] + i
            owner[t], pos[t] = s, kv_len[s] - q_len[s] + i
            page = pt[s, pos[t] // ps] if 0 <= pos[t] < cap else -1
            if new_k is not None and page >= 0:
                assert not written[page, pos[t] % ps]  # the problem has no collisions
                written[page, pos[t] % ps] = True
                kp[:, page, pos[t] % ps] = np.asarray(new_k, np.float64)[t]
                vp[:, page, pos[t] % ps] = np.asarray(new_v, np.float64)[t]
    out, lse = np.zeros((Tq, Hq, Dv)), np.full((Hq, Tq), -np.inf)
    sinks = np.asarray(sinks, np.float64)
    scale = D ** -0.5
    for t in np.flatnonzero(owner >= 0):
        s = owner[t]
        keys = [k for k in range(min(kv_len[s], pos[t] + 1)) if pt[s, k // ps] >= 0]
        for h in range(Hq):
            kk = np.array([kp[h // G, pt[s, k // ps], k % ps] for k in keys]).reshape(-1, D)
            vv = np.array([vp[h // G, pt[s, k // ps], k % ps] for k in keys]).reshape(-1, Dv)
            logits = np.append(kk @ q[t, h] * scale, sinks[h])
            mx = logits.max()
            w = np.exp(logits - mx)
            out[t, h] = w[:-1] @ vv / w.sum()
            lse[h, t] = mx + np.log(w.sum())
    return out, lse, kp, vp, owner, written


def _attend(impl):
    return jax.jit(lambda q, kp, vp, m: fnattn.ragged_paged_attention(
        SPEC.replace(impl=impl), q, kp, vp, **m))


def _write(impl):
    return jax.jit(lambda q, k, v, kp, vp, m: fnattn.ragged_paged_attention_with_update(
        SPEC.replace(impl=impl), q, k, v, kp, vp, **m))


ATTEND = {impl: _attend(impl) for impl in ("xla", "reference")}
WRITE = {impl: _write(impl) for impl in ("xla", "reference")}


def _check_safe(res, want_out, want_lse, owner):
    out, lse = np.asarray(res.out), np.asarray(res.lse)
    assert np.isfinite(out).all() and not np.isnan(lse).any() and (lse < np.inf).all()
    dead = owner < 0
    assert (out[dead] == 0).all() and (lse[:, dead] == -np.inf).all()
    # The pools' garbage is ~1e4, so a wrong slot read is off by far more than this.
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    np.testing.assert_allclose(np.where(np.isfinite(lse), lse, 0),
                               np.where(np.isfinite(want_lse), want_lse, 0), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("case", list(BAD) + list(GOOD))
def test_bad_values_without_checked_mode_are_safe(case, impl):
    m = BAD[case][0] if case in BAD else GOOD[case]
    res = ATTEND[impl](P0.q, P0.k_pages, P0.v_pages, m)
    out, lse, _, _, owner, _ = np_paged(P0.q, P0.k_pages, P0.v_pages, m, sinks=SPEC.sinks)
    _check_safe(res, out, lse, owner)

    res, kp, vp = WRITE[impl](P0.q, P0.k_new, P0.v_new, P0.k_old, P0.v_old, m)
    out, lse, kp_want, vp_want, owner, written = np_paged(
        P0.q, P0.k_old, P0.v_old, m, sinks=SPEC.sinks, new_k=P0.k_new, new_v=P0.v_new)
    _check_safe(res, out, lse, owner)
    # Nothing written out of place: every slot but those of live tokens is bit-identical
    # to the input pools; those hold exactly the new tokens.
    kp, vp = np.asarray(kp), np.asarray(vp)
    np.testing.assert_array_equal(kp[:, ~written], np.asarray(P0.k_old)[:, ~written])
    np.testing.assert_array_equal(vp[:, ~written], np.asarray(P0.v_old)[:, ~written])
    np.testing.assert_array_equal(kp[:, written], kp_want[:, written].astype(np.float32))
    np.testing.assert_array_equal(vp[:, written], vp_want[:, written].astype(np.float32))
    if case == "num_seqs negative":
        assert not written.any() and (owner < 0).all()


def test_the_model_of_the_bad_values_agrees_with_the_problem_on_good_input():
    """np_paged on the good metadata is the dense problem of every sequence, and the
    spoiled cases do exercise what they are named for."""
    from problems import expected
    out, lse, _, _, owner, written = np_paged(P0.q, P0.k_old, P0.v_old, GOOD["good"],
                                              sinks=SPEC.sinks, new_k=P0.k_new,
                                              new_v=P0.v_new)
    want_out, want_lse = expected(SPEC, P0)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)
    assert owner.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, -1, -1] and written.sum() == 8
    owner_big = np_paged(P0.q, P0.k_pages, P0.v_pages, BAD["num_seqs too large"][0],
                         sinks=SPEC.sinks)[4]
    assert owner_big[8] == 3  # the dead slot came alive


# ----------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------


def _loss(out, lse):
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse))


GRAD_SPEC = AttentionSpec(mask=masks.causal() & masks.sliding_window(5), softcap=3.0,
                          sinks=jnp.array([0.1, -1.0, 2.0, 0.0]))


def _dense_grads(p, spec, uniform=False):
    """Gradients of the packed loss computed from fnattn.reference on each sequence's
    dense tokens, scattered to the pool slots that hold them: (dq, dk_pages, dv_pages,
    dsinks)."""
    def loss(q, ks, vs, sinks):
        out, lse = dense_packed(spec.replace(sinks=sinks), p, q, ks, vs)
        if uniform:  # paged_attention's (B, Hq, Tq) lse
            B, Tq = len(p.seqs), p.seqs[0][1]
            lse = lse.reshape(-1, B, Tq).transpose(1, 0, 2)
        return _loss(out, lse)

    dq, dks, dvs, dsinks = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(
        p.q, p.k_tok, p.v_tok, spec.sinks)
    return (np.asarray(dq), to_pool(p, dks, p.k_pages), to_pool(p, dvs, p.v_pages),
            np.asarray(dsinks))


def _ragged_grads(spec, p, pools=None):
    """Gradients (dq, dk_pages, dv_pages, dsinks) of the packed loss through
    fnattn.ragged_paged_attention on ``p``'s metadata, over ``pools`` (a problem
    whose q and pools to use; default ``p``)."""
    pools = p if pools is None else pools

    def loss(q, kp, vp, sinks):
        r = fnattn.ragged_paged_attention(spec.replace(sinks=sinks), q, kp, vp, **metadata(p))
        return _loss(r.out, r.lse)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(pools.q, pools.k_pages,
                                                         pools.v_pages, spec.sinks)


def _assert_grads(got, want, used_pages):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, atol=1e-4, rtol=1e-4)
    # The garbage slots of unused pages get exactly zero gradient.
    for g in got[1:3]:
        assert not np.asarray(g)[:, ~used_pages].any()


def test_ragged_gradients_match_dense_gradients():
    """impl="auto": the default, whose custom_jvp wraps the platform choice."""
    p = make([(6, 2), (9, 1), (4, 4)], Hq=4, Hkv=2, D=5, page_size=3, max_seqs=4,
             pad_tokens=1, seed=6)
    spec = GRAD_SPEC
    _assert_grads(_ragged_grads(spec, p), _dense_grads(p, spec), p.used_pages)


def test_paged_attention_gradients_match_dense_gradients():
    """impl="reference" and layout "bhtd": a forward other than the backward's (XLA)."""
    B, Tq, Hq, D = 3, 2, 4, 5
    p = make([(6, Tq), (2, Tq), (8, Tq)], Hq=Hq, Hkv=2, D=D, page_size=3, seed=9)
    spec = GRAD_SPEC.replace(layout="bhtd", impl="reference")

    def paged_loss(q, kp, vp, sinks):
        r = fnattn.paged_attention(spec.replace(sinks=sinks), q, kp, vp,
                                   page_table=p.page_table, kv_lengths=p.context_lengths)
        return _loss(r.out.transpose(0, 2, 1, 3).reshape(B * Tq, Hq, D), r.lse)

    q = p.q.reshape(B, Tq, Hq, D).transpose(0, 2, 1, 3)
    got = jax.jit(jax.grad(paged_loss, argnums=(0, 1, 2, 3)))(q, p.k_pages, p.v_pages,
                                                             spec.sinks)
    got = (got[0].transpose(0, 2, 1, 3).reshape(B * Tq, Hq, D),) + tuple(got[1:])
    _assert_grads(got, _dense_grads(p, spec.replace(layout="bthd", impl="auto"), uniform=True),
                  p.used_pages)


def test_the_update_form_is_not_differentiable():
    p = P0

    def loss(q, kp):
        res, kp, _ = fnattn.ragged_paged_attention_with_update(
            SPEC, q, p.k_new, p.v_new, kp, p.v_old, page_table=p.page_table,
            context_lengths=p.context_lengths, query_start_loc=p.query_start_loc,
            num_seqs=p.num_seqs)
        return res.out.sum() + kp.sum()

    message = ("ragged_paged_attention_with_update is not differentiable, in either mode (it "
               "is the inference form that writes the cache); differentiate "
               "ragged_paged_attention instead, on a pool that already holds the new tokens.")
    for argnums in (0, 1):
        with pytest.raises(NotImplementedError, match="^" + re.escape(message)) as info:
            jax.jit(jax.grad(loss, argnums=argnums))(p.q, p.k_old)
        assert str(info.value) == message
    with pytest.raises(NotImplementedError, match="^" + re.escape(message)):
        jax.jit(lambda q: jax.jvp(lambda q: loss(q, p.k_old), (q,), (q,)))(p.q)


# ----------------------------------------------------------------------------------
# Poisoned pools, infinite sinks, x64, float64
# ----------------------------------------------------------------------------------

WIN = 4


def _hidden(L, n, pos):
    """Keys a causal window of WIN keys hides from all n new queries of a sequence."""
    return pos < L - n - WIN


POISON_SPEC = AttentionSpec(mask=masks.causal() & masks.sliding_window(WIN), softcap=3.0,
                            sinks=jnp.array([0.1, -1.0, 2.0, 0.0]))


def test_poisoned_pools_reach_neither_results_nor_gradients():
    """NaN in every pool slot that holds no live token (unowned pages, slots past a
    length) and in the keys the window hides: the ragged result (impl="auto") is the
    dense problem's on the clean tokens, the gradients are the dense gradients, and
    every poisoned slot gets exactly 0."""
    p = make([(12, 2), (9, 1), (4, 4)], Hq=4, Hkv=2, D=5, page_size=3, max_seqs=4,
             pad_tokens=1, seed=6)
    pp = poisoned(p, hidden=_hidden)
    spec = POISON_SPEC
    res = ragged_with(None, spec, pp)
    want_out, want_lse = expected(spec, p)
    np.testing.assert_allclose(res.out, want_out, atol=1e-5)
    np.testing.assert_allclose(res.lse, want_lse, atol=1e-5)

    got = _ragged_grads(spec, p, pp)
    dense = _dense_grads(p, spec)
    for g, w in zip(got, dense):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), w, atol=1e-4, rtol=1e-4)
    bad = np.isnan(np.asarray(pp.k_pages))
    for g in got[1:3]:
        np.testing.assert_array_equal(np.asarray(g)[bad], 0.0)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_poisoned_pools_paged_attention_and_update(impl):
    """paged_attention and the update form on pools whose unowned slots are NaN."""
    p = make([(7, 2), (2, 2), (9, 2)], Hq=4, Hkv=2, D=8, page_size=PS, max_seqs=3, seed=8)
    pp = poisoned(p, old=True)
    spec = SPEC.replace(impl=impl)
    want_out, want_lse = expected(spec, p)
    res = jax.jit(lambda q, kp, vp: fnattn.paged_attention(
        spec, q, kp, vp, page_table=p.page_table, kv_lengths=p.context_lengths))(
        pp.q.reshape(3, 2, 4, 8), pp.k_pages, pp.v_pages)
    np.testing.assert_allclose(res.out.reshape(6, 4, 8), want_out, atol=1e-5)
    np.testing.assert_allclose(res.lse.transpose(1, 0, 2).reshape(4, 6), want_lse, atol=1e-5)
    res, kp, _ = jax.jit(lambda q, k, v, kp, vp: fnattn.ragged_paged_attention_with_update(
        spec, q, k, v, kp, vp, page_table=p.page_table, context_lengths=p.context_lengths,
        query_start_loc=p.query_start_loc, num_seqs=p.num_seqs))(
        pp.q, pp.k_new, pp.v_new, pp.k_old, pp.v_old)
    np.testing.assert_allclose(res.out, want_out, atol=1e-5)
    np.testing.assert_allclose(res.lse, want_lse, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_infinite_sinks(impl):
    """-inf: no sink (a sequence of no keys gives 0 and -inf); +inf: out 0, lse +inf, no
    gradient to q/k/v from those rows, d(sink) = the sum of d(lse) over its rows."""
    p = make([(6, 2), (0, 1), (4, 4)], Hq=4, Hkv=2, D=5, page_size=3, max_seqs=3, seed=3)
    sinks = jnp.array([0.5, jnp.inf, -jnp.inf, jnp.inf])
    spec = AttentionSpec(mask=masks.causal(), impl=impl)
    rs = np.random.default_rng(2)
    d_out = jnp.asarray(rs.standard_normal((7, 4, 5)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((4, 7)), jnp.float32)

    @jax.jit
    def run(q, kp, vp, sinks):
        def f(q, kp, vp, sinks):
            r = fnattn.ragged_paged_attention(spec.replace(sinks=sinks), q, kp, vp,
                                              **metadata(p))
            return r.out, r.lse
        res, vjp = jax.vjp(f, q, kp, vp, sinks)
        return res, vjp((d_out, d_lse))

    (out, lse), (dq, dk, dv, ds) = run(p.q, p.k_pages, p.v_pages, sinks)
    for x in (out, dq, dk, dv, ds):
        assert np.isfinite(np.asarray(x)).all()
    out, lse = np.asarray(out), np.asarray(lse)
    assert (out[:, [1, 3]] == 0).all() and (lse[[1, 3]] == np.inf).all()
    np.testing.assert_array_equal(np.asarray(dq)[:, [1, 3]], 0.0)
    np.testing.assert_allclose(np.asarray(ds)[[1, 3]], np.asarray(d_lse)[[1, 3]].sum(1),
                               rtol=1e-6)
    assert np.asarray(ds)[2] == 0.0
    want_out, want_lse = expected(spec.replace(sinks=sinks.at[1:].set(0.0)), p)
    np.testing.assert_allclose(out[:, 0], want_out[:, 0], atol=1e-5)
    none_out, none_lse = expected(spec, p)
    np.testing.assert_allclose(out[:, 2], none_out[:, 2], atol=1e-5)
    np.testing.assert_array_equal(lse[2, 2], -np.inf)   # the sequence of no keys


@pytest.mark.parametrize("impl", ["xla", "reference", "auto"])
def test_x64_float32_inputs(impl):
    """With jax_enable_x64 every paged variant traces and gives the float32 answer."""
    spec = SPEC.replace(impl=impl)
    want = ATTEND["xla"](P0.q, P0.k_pages, P0.v_pages, GOOD["good"])
    with jax.enable_x64(True):
        m = {k: jnp.asarray(v, jnp.int64) for k, v in GOOD["good"].items()}
        res = jax.jit(lambda q, kp, vp, m: fnattn.ragged_paged_attention(
            spec, q, kp, vp, **m))(P0.q, P0.k_pages, P0.v_pages, m)
        upd, _, _ = jax.jit(lambda q, k, v, kp, vp, m: fnattn.ragged_paged_attention_with_update(
            spec, q, k, v, kp, vp, **m))(P0.q, P0.k_new, P0.v_new, P0.k_old, P0.v_old, m)
        paged = jax.jit(lambda q, kp, vp: fnattn.paged_attention(
            spec, q, kp, vp, page_table=P0.page_table[:2], kv_lengths=jnp.array([7, 5])))(
            P0.q[:2, None], P0.k_pages, P0.v_pages)
    for r in (res, upd):
        assert r.out.dtype == jnp.float32
        np.testing.assert_allclose(r.out, want.out, atol=1e-6)
        np.testing.assert_allclose(r.lse, want.lse, atol=1e-6)
    assert paged.out.shape == (2, 1, 4, 8) and np.isfinite(np.asarray(paged.out)).all()


def test_float64_is_refused():
    with jax.enable_x64(True):
        q64 = jnp.zeros((5, 6, 7), jnp.float64)
        with pytest.raises(TypeError) as info:
            jax.jit(lambda q: ragged(PLAIN, q=q))(q64)
        assert str(info.value) == (
            "ragged_paged_attention: float64 inputs are not supported (q is float64): the "
            "serving variants compute in float32; cast q, k_pages, v_pages to float32 "
            "(x.astype(jnp.float32)).")
        kp64 = KP.astype(jnp.float64)
        with pytest.raises(TypeError, match=r"^paged_attention: float64 inputs are not "
                                            r"supported \(k_pages is float64\)"):
            jax.jit(lambda kp: paged(kp=kp, vp=VP))(kp64)
        with pytest.raises(TypeError, match=r"^ragged_paged_attention_with_update: float64 "
                                            r"inputs are not supported \(k, v are float64\)"):
            jax.jit(lambda k, v: update(k=k, v=v))(KNEW.astype(jnp.float64),
                                                   VNEW.astype(jnp.float64))
