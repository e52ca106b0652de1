"""Fuzzed attention problems: every lowering of `attention` against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import fnattn
from fnattn import AttentionSpec, masks
from np_attention import np_attention, np_attention_grads, reduce_to
from strategies import problems


def bthd(x, layout):
    return np.asarray(jnp.asarray(x, jnp.float32) if layout == "bthd"
                      else jnp.swapaxes(jnp.asarray(x, jnp.float32), 1, 2), np.float64)


@given(problems(dtypes=("float32", "bfloat16", "float16"), impl="xla"))
def test_forward_matches_float64_numpy(p):
    res = jax.jit(fnattn.attention)(p.spec, p.q, p.k, p.v)
    lay = p.spec.layout
    out, lse, _ = np_attention(bthd(p.q, lay), bthd(p.k, lay), bthd(p.v, lay), **p.np_kwargs)
    tol = 1e-4 if p.q.dtype == jnp.float32 else 6e-2
    np.testing.assert_allclose(bthd(res.out, lay), out, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(res.lse), lse, atol=tol, rtol=tol)


@given(problems(impl="xla"), st.integers(0, 1000))
def test_gradients_match_float64_numpy(p, seed):
    lay = p.spec.layout
    rs = np.random.default_rng(seed)
    B, Tq, Tk, Hq, Hkv, D, Dv = p.dims
    d_out = jnp.asarray(rs.standard_normal((B, Tq, Hq, Dv)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((B, Hq, Tq)), jnp.float32)
    d_out_l = d_out if lay == "bthd" else jnp.swapaxes(d_out, 1, 2)

    def loss(q, k, v, bias, sinks):
        r = fnattn.attention(p.spec.replace(bias=bias, sinks=sinks), q, k, v)
        return jnp.sum(r.out * d_out_l) + jnp.sum(jnp.where(jnp.isfinite(r.lse), r.lse, 0) * d_lse)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(p.q, p.k, p.v, p.spec.bias, p.spec.sinks)
    ref = np_attention_grads(bthd(p.q, lay), bthd(p.k, lay), bthd(p.v, lay), np.asarray(d_out),
                             np.asarray(d_lse), **p.np_kwargs)
    for name, x in zip(("dq", "dk", "dv"), g[:3]):
        np.testing.assert_allclose(bthd(x, lay), ref[name], atol=2e-4, rtol=2e-4, err_msg=name)
    if p.spec.bias is not None:
        np.testing.assert_allclose(np.asarray(g[3]), reduce_to(ref["dbias"], p.spec.bias.shape),
                                   atol=2e-4, rtol=2e-4)
    if p.spec.sinks is not None:
        np.testing.assert_allclose(np.asarray(g[4]), ref["dsinks"], atol=2e-4, rtol=2e-4)


@given(problems(impl="xla", layouts=("bthd",)))
def test_attention_equals_reference(p):
    a = jax.jit(fnattn.attention)(p.spec, p.q, p.k, p.v)
    r = jax.jit(fnattn.reference)(p.spec, p.q, p.k, p.v)
    np.testing.assert_allclose(np.asarray(a.out), np.asarray(r.out), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(a.lse), np.asarray(r.lse), atol=1e-5, rtol=1e-5)


@given(problems(impl="xla", layouts=("bthd",), features=False))
def test_vmap_over_batch_equals_batched_call(p):
    B = p.dims[0]
    full = jax.jit(fnattn.attention)(p.spec, p.q, p.k, p.v)
    # every array of the mask with a leading batch axis is split along it
    mask_leaves, treedef = jax.tree_util.tree_flatten(p.spec.mask)
    axes = [0 if leaf.ndim >= 1 and leaf.shape[0] == B and B > 1 else None for leaf in mask_leaves]
    if B == 1 or any(a is None and leaf.ndim > 1 for a, leaf in zip(axes, mask_leaves)):
        return
    per = [leaf[:, None] if a == 0 else leaf for a, leaf in zip(axes, mask_leaves)]
    spec = p.spec.replace(mask=jax.tree_util.tree_unflatten(treedef, per))
    spec_axes = jax.tree_util.tree_map(lambda _: None, p.spec.replace(mask=None)).replace(
        mask=jax.tree_util.tree_unflatten(treedef, axes))
    f = jax.jit(jax.vmap(fnattn.attention, in_axes=(spec_axes, 0, 0, 0)))
    res = f(spec, p.q[:, None], p.k[:, None], p.v[:, None])
    np.testing.assert_allclose(np.asarray(res.out[:, 0]), np.asarray(full.out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(res.lse[:, 0]), np.asarray(full.lse), atol=1e-5)


@given(st.integers(1, 3), st.integers(1, 9), st.integers(2, 13), st.integers(0, 2**16),
       st.sampled_from(["segments", "array", "none"]))
def test_position_free_masks_are_invariant_to_permuting_keys(B, Tq, Tk, seed, kind):
    rs = np.random.default_rng(seed)
    q = jnp.asarray(rs.standard_normal((B, Tq, 4, 3)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, 2, 3)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, Tk, 2, 5)), jnp.float32)
    perm = rs.permutation(Tk)
    if kind == "segments":
        qi, ki = rs.integers(0, 3, (B, Tq)), rs.integers(0, 3, (B, Tk))
        m, mp = masks.segments(jnp.asarray(qi), jnp.asarray(ki)), masks.segments(
            jnp.asarray(qi), jnp.asarray(ki[:, perm]))
    elif kind == "array":
        arr = rs.random((B, 1, Tq, Tk)) < 0.6
        m, mp = masks.from_array(jnp.asarray(arr)), masks.from_array(jnp.asarray(arr[..., perm]))
    else:
        m = mp = None
    f = jax.jit(fnattn.attention)
    a = f(AttentionSpec(mask=m, impl="xla"), q, k, v)
    b = f(AttentionSpec(mask=mp, impl="xla"), q, k[:, perm], v[:, perm])
    np.testing.assert_allclose(np.asarray(a.out), np.asarray(b.out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.lse), np.asarray(b.lse), atol=1e-5)
