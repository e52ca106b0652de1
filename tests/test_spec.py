"""AttentionSpec: a frozen pytree with static configuration."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks


def test_frozen_and_replace():
    spec = AttentionSpec(softcap=3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.softcap = 2.0
    spec2 = spec.replace(softcap=4.0, layout="bhtd")
    assert (spec2.softcap, spec2.layout, spec.softcap) == (4.0, "bhtd", 3.0)


def test_pytree_leaves_are_the_arrays():
    ids = jnp.zeros((2, 5), jnp.int32)
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), bias=jnp.ones((5, 5)),
                         sinks=jnp.zeros(3), softcap=2.0, dropout_rate=0.1,
                         dropout_key=jax.random.key(0))
    leaves, treedef = jax.tree_util.tree_flatten(spec)
    assert len(leaves) == 5  # q ids, kv ids, bias, sinks, key
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.softcap == 2.0 and back.dropout_rate == 0.1


def test_static_fields_retrace_and_arrays_do_not():
    traces = []

    @jax.jit
    def f(spec, q):
        traces.append(1)
        return fnattn.attention(spec, q, q, q).out

    q = jnp.ones((1, 5, 2, 3))
    spec = AttentionSpec(bias=jnp.zeros((5, 5)), sinks=jnp.zeros(2), softcap=2.0, impl="xla")
    f(spec, q)
    f(spec.replace(bias=jnp.ones((5, 5)), sinks=jnp.ones(2)), q)
    assert len(traces) == 1
    f(spec.replace(softcap=3.0), q)
    assert len(traces) == 2
    f(spec.replace(scale=0.5), q)
    assert len(traces) == 3
    # new array values inside the mask do not retrace either
    ids = jnp.zeros((1, 5), jnp.int32)
    f(spec.replace(mask=masks.segments(ids)), q)
    f(spec.replace(mask=masks.segments(ids + 1)), q)
    assert len(traces) == 4


def test_grad_with_respect_to_spec_arrays():
    q = jax.random.normal(jax.random.key(0), (1, 5, 2, 3))
    spec = AttentionSpec(bias=jnp.zeros((5, 5)), sinks=jnp.zeros(2), impl="xla")
    g = jax.jit(jax.grad(lambda s: fnattn.attention(s, q, q, q).out.sum()))(spec)
    assert g.bias.shape == (5, 5) and g.sinks.shape == (2,)
    assert np.abs(np.asarray(g.sinks)).sum() > 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(layout="tbhd"), "layout must be one of"),
    (dict(impl="flash"), "impl must be one of"),
    (dict(scale=-1.0), "scale must be a positive finite float"),
    (dict(softcap=0.0), "softcap must be a positive finite float"),
    (dict(dropout_rate=1.0), r"dropout_rate must be in \[0, 1\)"),
    (dict(mask=np.ones((3, 3), bool)), "Wrap a boolean array with masks.from_array"),
    (dict(return_lse=1), "return_lse must be a bool"),
])
def test_static_validation(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AttentionSpec(**kwargs)
