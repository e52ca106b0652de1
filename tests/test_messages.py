"""Pins the wording of trace-time errors: each names the argument and both shapes."""

import jax
import jax.numpy as jnp
import pytest

import fnattn
from fnattn import AttentionSpec, masks

Q = jnp.zeros((3, 7, 4, 5))
K = jnp.zeros((3, 11, 2, 5))


def call(spec, q=Q, k=K, v=K):
    return jax.jit(fnattn.attention)(spec, q, k, v)


CASES = [
    ("head dim", AttentionSpec(), dict(k=jnp.zeros((3, 11, 2, 6)), v=jnp.zeros((3, 11, 2, 6))),
     ValueError, "attention: head-dim mismatch: k must have head dim D=5 like q (3, 7, 4, 5); "
                 "got k (3, 11, 2, 6)"),
    ("gqa", AttentionSpec(), dict(k=jnp.zeros((3, 11, 3, 5)), v=jnp.zeros((3, 11, 3, 5))),
     ValueError, "the number of query heads Hq=4 must be a multiple of the number of key/value "
                 "heads Hkv=3"),
    ("batch", AttentionSpec(), dict(k=jnp.zeros((2, 11, 2, 5)), v=jnp.zeros((2, 11, 2, 5))),
     ValueError, "batch mismatch: k must have batch B=3 like q (3, 7, 4, 5); got k (2, 11, 2, 5)"),
    ("v", AttentionSpec(), dict(v=jnp.zeros((3, 13, 2, 5))),
     ValueError, "v must have shape (3, 11, 2, 'Dv') matching k (3, 11, 2, 5); got v (3, 13, 2, 5)"),
    ("int q", AttentionSpec(), dict(q=jnp.zeros((3, 7, 4, 5), jnp.int32)),
     TypeError, "attention: q must be a floating-point array (float32, bfloat16 or float16); "
                "got int32 with shape (3, 7, 4, 5)"),
    ("int k", AttentionSpec(), dict(k=jnp.zeros((3, 11, 2, 5), jnp.int8)),
     TypeError, "attention: k must be a floating-point array"),
    ("rank", AttentionSpec(), dict(q=jnp.zeros((3, 7, 20))),
     Exception, "q"),
    ("q segments", AttentionSpec(mask=masks.segments(jnp.zeros((3, 6), jnp.int32),
                                                      jnp.zeros((3, 11), jnp.int32))), {},
     ValueError, "segments: q_segment_ids must have shape (batch, Tq)=(3, 7); got (3, 6)"),
    ("kv segments", AttentionSpec(mask=masks.segments(jnp.zeros((3, 7), jnp.int32),
                                                       jnp.zeros((2, 11), jnp.int32))), {},
     ValueError, "segments: kv_segment_ids must have shape (batch, Tk)=(3, 11); got (2, 11)"),
    ("lengths", AttentionSpec(mask=masks.lengths(kv_lengths=jnp.zeros((4,), jnp.int32))), {},
     ValueError, "lengths: kv_lengths must have shape (batch,)=(3,); got (4,)"),
    ("prefix", AttentionSpec(mask=masks.prefix_lm(jnp.zeros((2,), jnp.int32))), {},
     ValueError, "prefix_lm: prefix_lengths must have shape (batch,)=(3,); got (2,)"),
    ("array", AttentionSpec(mask=masks.from_array(jnp.zeros((7, 10), bool))), {},
     ValueError, "from_array: mask must be broadcastable to (batch, heads, Tq, Tk)=(3, 4, 7, 11)"
                 " with full Tq and Tk axes; got (7, 10)"),
    ("bias", AttentionSpec(bias=jnp.zeros((3, 4, 7, 10))), {},
     ValueError, "attention: bias must be broadcastable to (B, Hq, Tq, Tk)=(3, 4, 7, 11); "
                 "got (3, 4, 7, 10)"),
    ("bias batch", AttentionSpec(bias=jnp.zeros((2, 1, 7, 11))), {},
     ValueError, "attention: bias must be broadcastable to (B, Hq, Tq, Tk)=(3, 4, 7, 11); "
                 "got (2, 1, 7, 11)"),
    ("sinks", AttentionSpec(sinks=jnp.zeros((2,))), {},
     ValueError, "attention: sinks must have shape (Hq,)=(4,), one logit per query head; "
                 "got (2,)"),
    ("dropout key", AttentionSpec(dropout_rate=0.1), {},
     ValueError, "attention: dropout_rate=0.1 needs a dropout_key"),
]


@pytest.mark.parametrize("name,spec,args,exc,message", CASES, ids=[c[0] for c in CASES])
def test_message(name, spec, args, exc, message):
    with pytest.raises(exc) as info:
        call(spec, **args)
    assert message in str(info.value)


def test_layout_message():
    with pytest.raises(ValueError, match=r"layout must be one of \('bthd', 'bhtd'\); got 'btdh'"):
        AttentionSpec(layout="btdh")


def test_window_message():
    with pytest.raises(ValueError, match=r"sliding_window: left must be a non-negative int or "
                                         r"None; got -2"):
        masks.sliding_window(left=-2)


def test_bool_mask_message():
    with pytest.raises(TypeError) as info:
        if masks.causal():
            pass
    msg = str(info.value)
    assert "A mask has no truth value" in msg and "`&`" in msg and "`and`" in msg


def test_reference_names_itself():
    with pytest.raises(ValueError, match="reference: head-dim mismatch"):
        jax.jit(fnattn.reference)(AttentionSpec(), Q, jnp.zeros((3, 11, 2, 6)),
                                  jnp.zeros((3, 11, 2, 6)))
