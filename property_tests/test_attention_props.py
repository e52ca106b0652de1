"""Fuzzed attention problems against an independent float64 NumPy attention.

Outputs and gradients (q, k, v, bias, sinks; through ``out`` and ``lse``) of the
reference and of the dense XLA and cuDNN-delegate lowerings, on random mask
compositions, GQA ratios, ragged lengths, dtypes and layouts; vmap over a batch
equals the batched call; masks that ignore positions are invariant to permuting
keys consistently.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import fnattn
from fnattn import AttentionSpec, masks
from np_attention import np_attention, np_attention_grads, reduce_to
from strategies import problems, segment_ids


def bthd(x, layout):
    x = jnp.asarray(x, jnp.float32)
    return np.asarray(x if layout == "bthd" else jnp.swapaxes(x, 1, 2), np.float64)


def _check_forward(p, res, tol):
    lay = p.spec.layout
    out, lse, _ = np_attention(bthd(p.q, lay), bthd(p.k, lay), bthd(p.v, lay), **p.np_kwargs)
    assert res.out.dtype == p.q.dtype and res.lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.isneginf(np.asarray(res.lse)), np.isneginf(lse))
    np.testing.assert_allclose(bthd(res.out, lay), out, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(res.lse), lse, atol=tol, rtol=tol)


def _check_forward_and_gradients(p, seed, tol=2e-4):
    """One compiled function gives out, lse and the gradients of a random loss."""
    lay = p.spec.layout
    rs = np.random.default_rng(seed)
    B, Tq, Tk, Hq, Hkv, D, Dv = p.dims
    d_out = jnp.asarray(rs.standard_normal((B, Tq, Hq, Dv)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((B, Hq, Tq)), jnp.float32)
    d_out_l = d_out if lay == "bthd" else jnp.swapaxes(d_out, 1, 2)

    def loss(q, k, v, bias, sinks):
        r = fnattn.attention(p.spec.replace(bias=bias, sinks=sinks), q, k, v)
        value = jnp.sum(r.out * d_out_l) + jnp.sum(jnp.where(jnp.isfinite(r.lse), r.lse, 0) * d_lse)
        return value, r

    (_, res), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        p.q, p.k, p.v, p.spec.bias, p.spec.sinks)
    _check_forward(p, res, 1e-4)
    ref = np_attention_grads(bthd(p.q, lay), bthd(p.k, lay), bthd(p.v, lay), np.asarray(d_out),
                             np.asarray(d_lse), **p.np_kwargs)
    for name, x in zip(("dq", "dk", "dv"), g[:3]):
        assert np.isfinite(np.asarray(x)).all(), name
        np.testing.assert_allclose(bthd(x, lay), ref[name], atol=tol, rtol=tol, err_msg=name)
    if p.spec.bias is not None:
        np.testing.assert_allclose(np.asarray(g[3]), reduce_to(ref["dbias"], p.spec.bias.shape),
                                   atol=tol, rtol=tol, err_msg="dbias")
    if p.spec.sinks is not None:
        np.testing.assert_allclose(np.asarray(g[4]), ref["dsinks"], atol=tol, rtol=tol,
                                   err_msg="dsinks")


def check_forward_mode(p, fn, seed, tol=2e-4):
    """``jax.jvp`` of ``fn`` (``fnattn.attention`` or a variant taking the same
    arguments) along random tangents of q, k, v, bias and sinks, against the
    float64 NumPy gradients by duality: for a random cotangent (d_out, d_lse),
    ``<d_out, t_out> + <d_lse, t_lse>`` equals ``<dq, t_q> + ... + <dsinks,
    t_sinks>``. The tangents are finite, zero on rows that see no key, and the
    primal is the forward's. Returns ``(t_out, t_lse)``."""
    lay = p.spec.layout
    rs = np.random.default_rng(seed)
    B, Tq, Tk, Hq, Hkv, D, Dv = p.dims
    d_out = rs.standard_normal((B, Tq, Hq, Dv))
    d_lse = rs.standard_normal((B, Hq, Tq))
    primals = (p.q, p.k, p.v, p.spec.bias, p.spec.sinks)
    tangents = tuple(None if x is None else jnp.asarray(rs.standard_normal(x.shape), x.dtype)
                     for x in primals)

    def f(q, k, v, bias, sinks):
        r = fn(p.spec.replace(bias=bias, sinks=sinks), q, k, v)
        return r.out, r.lse

    (out, lse), (t_out, t_lse) = jax.jit(lambda a, t: jax.jvp(f, a, t))(primals, tangents)
    _check_forward(p, fnattn.AttentionOutput(out, lse), 1e-4)
    t_out, t_lse = bthd(t_out, lay), np.asarray(t_lse, np.float64)
    assert np.isfinite(t_out).all() and np.isfinite(t_lse).all()
    empty = np.isneginf(np.asarray(lse))                       # (B, Hq, Tq)
    assert not t_lse[empty].any()
    assert not t_out[np.swapaxes(empty, 1, 2)].any()
    got = (t_out * d_out).sum() + (t_lse * d_lse).sum()
    ref = np_attention_grads(bthd(p.q, lay), bthd(p.k, lay), bthd(p.v, lay), d_out, d_lse,
                             **p.np_kwargs)
    terms = [(ref[n] * bthd(t, lay)).sum() for n, t in zip(("dq", "dk", "dv"), tangents)]
    if p.spec.bias is not None:
        terms.append((reduce_to(ref["dbias"], p.spec.bias.shape)
                      * np.asarray(tangents[3], np.float64)).sum())
    if p.spec.sinks is not None:
        terms.append((ref["dsinks"] * np.asarray(tangents[4], np.float64)).sum())
    want = sum(terms)
    scale = 1.0 + sum(abs(t) for t in terms)
    assert abs(got - want) <= tol * scale, (got, want, terms)
    return t_out, t_lse


LOW = {"bfloat16": 6e-2, "float16": 1e-2}


@given(st.sampled_from(["xla", "reference"]).flatmap(
    lambda impl: problems(impl=impl, dtypes=("bfloat16", "float16"))))
def test_low_precision_forward_matches_float64_numpy(p):
    res = jax.jit(fnattn.attention)(p.spec, p.q, p.k, p.v)
    _check_forward(p, res, LOW[p.q.dtype.name])


@given(st.sampled_from(["xla", "reference"]).flatmap(lambda impl: problems(impl=impl)),
       st.integers(0, 1000))
def test_forward_and_gradients_match_float64_numpy(p, seed):
    _check_forward_and_gradients(p, seed)


@given(problems(impl="cudnn", softcap=False, sinks=False, dropout=False, equal_head_dims=True),
       st.integers(0, 1000))
def test_cudnn_delegate_matches_float64_numpy(p, seed):
    _check_forward_and_gradients(p, seed)


@given(st.sampled_from(["xla", "reference"]).flatmap(lambda impl: problems(impl=impl)),
       st.integers(0, 1000))
def test_forward_mode_matches_float64_numpy(p, seed):
    check_forward_mode(p, fnattn.attention, seed)


@given(st.sampled_from(["xla", "reference"]).flatmap(
    lambda impl: problems(impl=impl, dropout=False)))
def test_vmap_over_batch_equals_batched_call(p):
    # Every array with a leading batch axis (mask arrays, a (B, ...) bias) is split
    # along it; the rest (sinks, per-head bias) is shared. Dropout is left out: under
    # vmap the batch index seen by the keep mask is 0 for every example.
    B = p.dims[0]
    full = jax.jit(fnattn.attention)(p.spec, p.q, p.k, p.v)
    leaves, treedef = jax.tree_util.tree_flatten(p.spec)
    batched = [leaf.ndim >= 1 and leaf.shape[0] == B and (leaf.ndim > 1 or leaf is not p.spec.sinks)
               for leaf in leaves]
    if p.spec.bias is not None and p.spec.bias.ndim < 4:
        # a (Tq, Tk) bias has no batch axis even when Tq == B
        batched = [b and leaf is not p.spec.bias for b, leaf in zip(batched, leaves)]
    per = [leaf[:, None] if b else leaf for b, leaf in zip(batched, leaves)]
    spec = jax.tree_util.tree_unflatten(treedef, per)
    axes = jax.tree_util.tree_unflatten(treedef, [0 if b else None for b in batched])
    f = jax.jit(jax.vmap(fnattn.attention, in_axes=(axes, 0, 0, 0)))
    res = f(spec, p.q[:, None], p.k[:, None], p.v[:, None])
    np.testing.assert_allclose(np.asarray(res.out[:, 0]), np.asarray(full.out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(res.lse[:, 0]), np.asarray(full.lse), atol=1e-5)


@given(st.integers(1, 3), st.integers(1, 9), st.integers(2, 13), st.integers(0, 2**16),
       st.sampled_from(["segments", "array", "segments&array", "none"]), st.booleans(),
       st.booleans(), st.sampled_from(["xla", "reference"]), st.data())
def test_position_free_masks_are_invariant_to_permuting_keys(B, Tq, Tk, seed, kind, use_bias,
                                                            use_sinks, impl, data):
    # Masks that never compare positions (segment ids, dense arrays) and a bias move
    # with the keys: permuting k, v, the kv ids, the mask's and the bias's key axis
    # together leaves out and lse unchanged.
    rs = np.random.default_rng(seed)
    Hq, Hkv = 4, 2
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, 3)), jnp.float32)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, 3)), jnp.float32)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, 5)), jnp.float32)
    perm = rs.permutation(Tk)
    parts, parts_p = [], []
    if "segments" in kind:
        qi = data.draw(segment_ids(B, Tq, sorted_=False))
        ki = data.draw(segment_ids(B, Tk, sorted_=False))
        parts.append(masks.segments(qi, ki))
        parts_p.append(masks.segments(qi, ki[:, perm]))
    if "array" in kind:
        arr = rs.random((B, Hq, Tq, Tk)) < 0.6
        parts.append(masks.from_array(jnp.asarray(arr)))
        parts_p.append(masks.from_array(jnp.asarray(arr[..., perm])))
    m = mp = None
    for a, b in zip(parts, parts_p):
        m, mp = (a, b) if m is None else (m & a, mp & b)
    bias = jnp.asarray(rs.standard_normal((B, Hq, Tq, Tk)), jnp.float32) if use_bias else None
    sinks = jnp.asarray(rs.standard_normal((Hq,)), jnp.float32) if use_sinks else None
    spec = AttentionSpec(mask=m, bias=bias, sinks=sinks, softcap=4.0, impl=impl)
    spec_p = spec.replace(mask=mp, bias=None if bias is None else bias[..., perm])
    f = jax.jit(fnattn.attention)
    a = f(spec, q, k, v)
    b = f(spec_p, q, k[:, perm], v[:, perm])
    np.testing.assert_allclose(np.asarray(a.out), np.asarray(b.out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.lse), np.asarray(b.lse), atol=1e-5)
