"""AttentionSpec: a frozen pytree whose arrays are leaves and whose settings are static."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionOutput, AttentionSpec, XlaBlockSizes, masks


def test_frozen_and_replace():
    spec = AttentionSpec(softcap=3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.softcap = 2.0
    spec2 = spec.replace(softcap=4.0, layout="bhtd")
    assert (spec2.softcap, spec2.layout, spec.softcap, spec.layout) == (4.0, "bhtd", 3.0, "bthd")
    with pytest.raises(ValueError, match="softcap must be a positive finite float"):
        spec.replace(softcap=-1.0)  # replace validates like the constructor
    with pytest.raises(TypeError, match="unexpected keyword argument 'softcapp'"):
        spec.replace(softcapp=1.0)


def test_defaults():
    spec = AttentionSpec()
    assert (spec.mask, spec.scale, spec.softcap, spec.bias, spec.sinks) == (None,) * 5
    assert (spec.dropout_rate, spec.dropout_key, spec.return_lse) == (0.0, None, True)
    assert (spec.layout, spec.impl, spec.block_sizes) == ("bthd", "auto", None)


def test_pytree_leaves_are_the_arrays_and_roundtrip():
    ids = jnp.zeros((2, 5), jnp.int32)
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), bias=jnp.ones((5, 5)),
                         sinks=jnp.zeros(3), softcap=2.0, dropout_rate=0.1,
                         dropout_key=jax.random.key(0), block_sizes=XlaBlockSizes(16, 16))
    leaves, treedef = jax.tree_util.tree_flatten(spec)
    assert len(leaves) == 5  # q ids, kv ids, bias, sinks, key
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.softcap == 2.0 and back.dropout_rate == 0.1
    assert back.block_sizes == XlaBlockSizes(16, 16)
    assert repr(back.mask) == "(causal() & segments(...))"
    # static fields are in the treedef: a different setting is a different treedef
    assert jax.tree_util.tree_structure(spec.replace(softcap=3.0)) != treedef
    assert jax.tree_util.tree_structure(spec.replace(bias=jnp.zeros((5, 5)))) == treedef


def test_static_fields_retrace_and_arrays_do_not():
    traces = []

    @jax.jit
    def f(spec, q):
        traces.append(1)
        return fnattn.attention(spec, q, q, q).out

    q = jnp.ones((1, 5, 5, 3))  # T = H, so that both layouts accept it
    spec = AttentionSpec(bias=jnp.zeros((5, 5)), sinks=jnp.zeros(5), softcap=2.0, impl="xla")
    f(spec, q)
    f(spec.replace(bias=jnp.ones((5, 5)), sinks=jnp.ones(5)), q)
    assert len(traces) == 1
    for n, change in enumerate([dict(softcap=3.0), dict(scale=0.5), dict(layout="bhtd"),
                                dict(return_lse=False), dict(impl="reference")], start=2):
        f(spec.replace(**change), q)
        assert len(traces) == n, change
    # new array values inside the mask do not retrace; a new mask structure does
    ids = jnp.zeros((1, 5), jnp.int32)
    f(spec.replace(mask=masks.segments(ids)), q)
    f(spec.replace(mask=masks.segments(ids + 1)), q)
    assert len(traces) == 7
    f(spec.replace(mask=masks.segments(ids) & masks.causal()), q)
    assert len(traces) == 8


def test_numpy_scalars_are_stored_as_python_floats_and_share_a_cache_entry():
    traces = []

    @jax.jit
    def f(spec, q):
        traces.append(1)
        return fnattn.attention(spec, q, q, q).out

    q = jnp.ones((1, 5, 2, 3))
    a = AttentionSpec(scale=np.float32(0.5), softcap=np.int64(3), impl="xla")
    assert type(a.scale) is float and type(a.softcap) is float and a.softcap == 3.0
    f(a, q)
    f(AttentionSpec(scale=0.5, softcap=3.0, impl="xla"), q)
    assert len(traces) == 1


def test_grad_with_respect_to_spec_arrays():
    q = jax.random.normal(jax.random.key(0), (1, 5, 2, 3))
    spec = AttentionSpec(bias=jnp.zeros((5, 5)), sinks=jnp.zeros(2), impl="xla")
    g = jax.jit(jax.grad(lambda s: fnattn.attention(s, q, q, q).out.sum()))(spec)
    assert isinstance(g, AttentionSpec)
    assert g.bias.shape == (5, 5) and g.sinks.shape == (2,)
    gr = jax.jit(jax.grad(lambda s: fnattn.reference(s, q, q, q).out.sum()))(spec)
    np.testing.assert_allclose(np.asarray(g.sinks), np.asarray(gr.sinks), atol=1e-6)
    assert np.abs(np.asarray(g.sinks)).sum() > 0


def test_spec_with_integer_arrays_needs_allow_int_for_grad():
    q = jax.random.normal(jax.random.key(0), (1, 5, 2, 3))
    spec = AttentionSpec(mask=masks.segments(jnp.zeros((1, 5), jnp.int32)), impl="xla")
    with pytest.raises(TypeError, match="allow_int"):
        jax.grad(lambda s: fnattn.attention(s, q, q, q).out.sum())(spec)
    g = jax.jit(jax.grad(lambda s: fnattn.attention(s, q, q, q).out.sum(), allow_int=True))(spec)
    assert g.mask.q_segment_ids.dtype == jax.dtypes.float0


def test_spec_as_vmap_in_axes_and_scan_input():
    rs = np.random.default_rng(1)
    q = jnp.asarray(rs.standard_normal((4, 1, 5, 2, 3)), jnp.float32)
    sinks = jnp.asarray(rs.standard_normal((4, 2)), jnp.float32)  # one set per example
    spec = AttentionSpec(sinks=sinks, mask=masks.causal(), impl="xla")
    axes = AttentionSpec(sinks=0, mask=masks.causal(), impl="xla")
    out = jax.jit(jax.vmap(lambda s, q: fnattn.attention(s, q, q, q).out, in_axes=(axes, 0)))(
        spec, q)
    # the same with lax.scan over the stacked specs
    _, out2 = jax.jit(lambda spec, q: jax.lax.scan(
        lambda c, xs: (c, fnattn.attention(xs[0], xs[1], xs[1], xs[1]).out), 0, (spec, q)))(
        spec, q)
    for i in range(4):
        one = fnattn.reference(spec.replace(sinks=sinks[i]), q[i], q[i], q[i]).out
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(one), atol=1e-6)
        np.testing.assert_allclose(np.asarray(out2[i]), np.asarray(one), atol=1e-6)


def test_attention_output_is_a_pytree():
    res = AttentionOutput(jnp.ones(3), jnp.zeros(2))
    leaves, treedef = jax.tree_util.tree_flatten(res)
    assert len(leaves) == 2
    assert jax.tree_util.tree_map(lambda x: x + 1, res).lse.tolist() == [1.0, 1.0]
    assert len(jax.tree_util.tree_leaves(AttentionOutput(jnp.ones(3)))) == 1


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(layout="tbhd"), ValueError, "layout must be one of"),
    (dict(impl="flash"), ValueError, "impl must be one of"),
    (dict(scale=-1.0), ValueError, "scale must be a positive finite float"),
    (dict(scale=float("nan")), ValueError, "scale must be a positive finite float"),
    (dict(softcap=0.0), ValueError, "softcap must be a positive finite float"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a positive finite float"),
    (dict(scale=True), TypeError, "scale is static configuration"),
    (dict(scale=jnp.float32(0.5)), TypeError, "scale is static configuration"),
    (dict(softcap="30"), TypeError, "softcap is static configuration"),
    (dict(dropout_rate=1.0), ValueError, r"dropout_rate must be in \[0, 1\)"),
    (dict(dropout_rate=-0.1), ValueError, r"dropout_rate must be in \[0, 1\)"),
    (dict(mask=np.ones((3, 3), bool)), TypeError, "Wrap a boolean array with masks.from_array"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    (dict(block_sizes=[16, 16]), TypeError, r"block_sizes must be None, a block-size object "
                                            r".* or a tuple of them, one per lowering; got list"),
    (dict(block_sizes=16), TypeError, "block_sizes must be None, a block-size object"),
    (dict(block_sizes=(fnattn.XlaBlockSizes(8, 8), 16)), TypeError, "got tuple"),
])
def test_static_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        AttentionSpec(**kwargs)


def test_traced_static_field_is_refused_inside_jit():
    @jax.jit
    def f(s):
        return AttentionSpec(softcap=s)

    with pytest.raises(TypeError, match="softcap is static configuration"):
        f(3.0)


def test_importing_fnattn_starts_no_jax_backend():
    """``import fnattn`` does no JAX work: a program may still choose its
    platforms (``jax_platforms``) or call ``jax.distributed.initialize`` after
    importing it, which a started backend refuses."""
    import subprocess
    import sys
    code = ("import fnattn, fnattn.flash, fnattn.paged, fnattn.context; "
            "print(fnattn._jax_private.get('backends_started')())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False"
