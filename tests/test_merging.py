"""fnattn.merge: partial results over disjoint key sets combine into the exact result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks
from fnattn.merging import merge_across
from np_attention import np_attention

B, Tq, Tk, Hq, Hkv, D, Dv = 2, 5, 13, 6, 2, 7, 3


def _inputs(seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, Tk, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, Tk, Hkv, Dv), dtype)
    return q, k, v


def _parts(spec, q, k, v, cuts):
    """Attention over k[:, a:b] for consecutive cuts, with the key positions of the
    whole sequence (the mask of every part is the whole mask restricted to it)."""
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        keep = (jnp.arange(Tk) >= a) & (jnp.arange(Tk) < b)
        base = masks.full() if spec.mask is None else spec.mask
        part_spec = spec.replace(mask=base & masks.from_array(jnp.broadcast_to(keep, (Tq, Tk))))
        out.append(fnattn.attention(part_spec, q, k, v))
    return out


@pytest.mark.parametrize("cuts", [(0, 13), (0, 4, 13), (0, 1, 6, 12, 13), (0, 0, 13)])
@pytest.mark.parametrize("mask", [None, "causal", "window"])
def test_merge_of_parts_equals_whole(cuts, mask):
    q, k, v = _inputs()
    m = {None: None, "causal": masks.causal(),
         "window": masks.causal() & masks.sliding_window(2)}[mask]
    spec = AttentionSpec(mask=m, softcap=5.0, impl="xla")

    @jax.jit
    def f(q, k, v):
        return fnattn.merge(_parts(spec, q, k, v, cuts)), fnattn.attention(spec, q, k, v)

    merged, whole = f(q, k, v)
    np.testing.assert_array_equal(np.isneginf(merged.lse), np.isneginf(whole.lse))
    np.testing.assert_allclose(merged.out, whole.out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.where(np.isfinite(whole.lse), merged.lse, 0),
                               np.where(np.isfinite(whole.lse), whole.lse, 0), atol=2e-6)


def test_sinks_are_counted_once():
    q, k, v = _inputs(1)
    sinks = jnp.linspace(-1.0, 1.5, Hq)
    spec = AttentionSpec(mask=masks.causal(), impl="xla")

    @jax.jit
    def f(q, k, v, sinks):
        parts = _parts(spec, q, k, v, (0, 3, 8, 13))
        return fnattn.merge(parts, sinks=sinks), fnattn.attention(spec.replace(sinks=sinks),
                                                                  q, k, v)

    merged, whole = f(q, k, v, sinks)
    np.testing.assert_allclose(merged.out, whole.out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(merged.lse, whole.lse, atol=2e-6, rtol=1e-5)


def test_rows_no_part_sees_are_zero_with_finite_gradients():
    q, k, v = _inputs(2)
    # Query rows 0 and 1 see no key in either part (lengths mask on the queries).
    spec = AttentionSpec(mask=masks.lengths(q_lengths=jnp.array([3, 5])), impl="xla")

    def loss(q, k, v, sinks):
        parts = _parts(spec, q, k, v, (0, 6, 13))
        res = fnattn.merge(parts, sinks=sinks)
        return jnp.sum(res.out ** 2) + jnp.sum(jnp.where(jnp.isfinite(res.lse), res.lse, 0)), res

    sinks = jnp.zeros((Hq,))
    (_, res), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, sinks)
    assert np.all(np.asarray(res.out)[0, 3:] == 0)
    np.testing.assert_array_equal(np.asarray(res.lse)[0, :, 3:], 0.0)  # = the sink
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    res = jax.jit(lambda q, k, v: fnattn.merge(_parts(spec, q, k, v, (0, 6, 13))))(q, k, v)
    assert np.all(np.isneginf(np.asarray(res.lse)[0, :, 3:]))
    assert np.all(np.asarray(res.out)[0, 3:] == 0)


def test_gradients_through_merge_match_the_whole():
    q, k, v = _inputs(3)
    spec = AttentionSpec(mask=masks.causal(), impl="xla")
    w = jax.random.normal(jax.random.key(9), (B, Tq, Hq, Dv))

    def merged(q, k, v):
        res = fnattn.merge(_parts(spec, q, k, v, (0, 5, 13)))
        return jnp.sum(res.out * w) + jnp.sum(res.lse)

    def whole(q, k, v):
        res = fnattn.attention(spec, q, k, v)
        return jnp.sum(res.out * w) + jnp.sum(res.lse)

    g1 = jax.jit(jax.grad(merged, argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(whole, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_forward_mode_through_merge_matches_the_whole():
    q, k, v = _inputs(4)
    spec = AttentionSpec(mask=masks.causal(), impl="auto")
    tangents = tuple(jax.random.normal(jax.random.key(i), x.shape)
                     for i, x in enumerate((q, k, v)))

    def merged(q, k, v):
        res = fnattn.merge(_parts(spec, q, k, v, (0, 5, 13)))
        return res.out, res.lse

    def whole(q, k, v):
        res = fnattn.attention(spec, q, k, v)
        return res.out, res.lse

    t1 = jax.jit(lambda: jax.jvp(merged, (q, k, v), tangents)[1])()
    t2 = jax.jit(lambda: jax.jvp(whole, (q, k, v), tangents)[1])()
    for a, b in zip(t1, t2):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", ["bhtd", "thd"])
def test_layouts(layout):
    q, k, v = _inputs(4)
    spec = AttentionSpec(impl="xla")
    parts = _parts(spec, q, k, v, (0, 7, 13))
    out, lse, _ = np_attention(np.asarray(q, np.float64), np.asarray(k, np.float64),
                               np.asarray(v, np.float64))
    if layout == "bhtd":
        conv = [(jnp.swapaxes(p.out, 1, 2), p.lse) for p in parts]
        res = jax.jit(lambda c: fnattn.merge(c, layout="bhtd"))(conv)
        np.testing.assert_allclose(jnp.swapaxes(res.out, 1, 2), out, atol=1e-5)
        np.testing.assert_allclose(res.lse, lse, atol=1e-5)
    else:  # sequence 0 only, packed tokens
        conv = [(p.out[0], p.lse[0]) for p in parts]
        res = jax.jit(lambda c: fnattn.merge(c, layout="thd"))(conv)
        np.testing.assert_allclose(res.out, out[0], atol=1e-5)
        np.testing.assert_allclose(res.lse, lse[0], atol=1e-5)


def test_low_precision_output_keeps_dtype():
    q, k, v = _inputs(5, jnp.bfloat16)
    spec = AttentionSpec(impl="xla")
    res = jax.jit(lambda q, k, v: fnattn.merge(_parts(spec, q, k, v, (0, 6, 13))))(q, k, v)
    assert res.out.dtype == jnp.bfloat16 and res.lse.dtype == jnp.float32
    whole = fnattn.attention(spec, q, k, v)
    np.testing.assert_allclose(res.out.astype(np.float32), whole.out.astype(np.float32),
                               atol=3e-2)


def test_bad_input_messages():
    out, lse = jnp.zeros((2, 5, 6, 3)), jnp.zeros((2, 6, 5))
    with pytest.raises(ValueError, match=r"at least one"):
        fnattn.merge([])
    with pytest.raises(ValueError, match=r"layout must be one of \('bthd', 'bhtd', 'thd'\)"):
        fnattn.merge([(out, lse)], layout="tbhd")
    with pytest.raises(ValueError, match=r"parts\[0\].lse must have shape \(2, 6, 5\) to go "
                                         r"with out \(2, 5, 6, 3\).*got \(2, 5, 6\)"):
        fnattn.merge([(out, jnp.zeros((2, 5, 6)))])
    with pytest.raises(ValueError, match=r"parts\[1\].out has shape \(2, 5, 6, 4\)"):
        fnattn.merge([(out, lse), (jnp.zeros((2, 5, 6, 4)), lse)])
    with pytest.raises(ValueError, match=r"parts\[0\] has no lse"):
        fnattn.merge([fnattn.AttentionOutput(out, None)])
    with pytest.raises(TypeError, match=r"parts\[0\] must be an AttentionOutput or an"):
        fnattn.merge([out])
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\)=\(6,\)"):
        fnattn.merge([(out, lse)], sinks=jnp.zeros((5,)))


def test_a_part_with_lse_minus_inf_contributes_nothing_even_if_its_out_is_nan():
    """A part in which a row sees nothing (lse = -inf) may carry any out (a kernel's
    unwritten buffer, NaN): the merge, and every gradient, ignore it."""
    q, k, v = _inputs(seed=4)
    spec = AttentionSpec(mask=masks.causal())
    a, b = _parts(spec, q, k, v, (0, 6, 13))
    lse_b = b.lse.at[:, 1:3].set(-jnp.inf)                     # heads 1, 2: part b empty
    out_b = b.out.at[:, :, 1:3].set(jnp.nan)
    want = fnattn.merge([a, (jnp.where(jnp.isnan(out_b), 0.0, out_b), lse_b)])

    def loss(out_a, lse_a, out_b, lse_b):
        res = fnattn.merge([(out_a, lse_a), (out_b, lse_b)])
        return jnp.sum(res.out * jnp.cos(res.out)) + jnp.sum(jnp.sin(res.lse)), res

    (_, res), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        a.out, a.lse, out_b, lse_b)
    np.testing.assert_allclose(res.out, want.out, atol=1e-6)
    np.testing.assert_allclose(res.lse, want.lse, atol=1e-6)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(grads[2][:, :, 1:3], 0.0)
    np.testing.assert_array_equal(grads[3][:, 1:3], 0.0)


@pytest.mark.parametrize("sink", [np.inf, -np.inf])
def test_infinite_sinks(sink):
    """-inf is no sink; +inf takes all the mass: out 0, lse +inf, no gradient to the
    parts and d(sink) = the sum of d(lse) over the head's rows. Head 0 keeps a finite
    sink; row 0 is seen by no part."""
    q, k, v = _inputs(seed=5)
    parts = _parts(AttentionSpec(), q, k, v, (0, 5, 13))
    outs = jnp.stack([p.out.at[:, 0].set(0.0) for p in parts])
    lses = jnp.stack([p.lse.at[:, :, 0].set(-jnp.inf) for p in parts])
    sinks = jnp.full((Hq,), sink, jnp.float32).at[0].set(0.5)
    rs = np.random.default_rng(0)
    d_out = jnp.asarray(rs.standard_normal(outs.shape[1:]), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal(lses.shape[1:]), jnp.float32)

    def f(outs, lses, sinks):
        res = fnattn.merge([(outs[0], lses[0]), (outs[1], lses[1])], sinks=sinks)
        return res.out, res.lse

    @jax.jit
    def run(outs, lses, sinks):
        res, vjp = jax.vjp(f, outs, lses, sinks)
        return res, vjp((d_out, d_lse))

    (out, lse), (g_outs, g_lses, g_sinks) = run(outs, lses, sinks)
    finite = jnp.zeros(Hq).at[0].set(0.5)
    (out0, lse0), (g_outs0, g_lses0, g_sinks0) = run(outs, lses, finite)
    for g in (g_outs, g_lses, g_sinks):
        assert np.isfinite(np.asarray(g)).all()
    # head 0: as with finite sinks everywhere
    np.testing.assert_allclose(out[:, :, 0], out0[:, :, 0], atol=1e-6)
    np.testing.assert_allclose(g_sinks[0], g_sinks0[0], atol=1e-5)
    if sink == np.inf:
        np.testing.assert_array_equal(out[:, :, 1:], 0.0)
        assert (np.asarray(lse)[:, 1:] == np.inf).all()
        np.testing.assert_array_equal(g_outs[:, :, :, 1:], 0.0)
        np.testing.assert_array_equal(g_lses[:, :, 1:], 0.0)
        np.testing.assert_allclose(g_sinks[1:], np.asarray(d_lse)[:, 1:].sum((0, 2)),
                                   rtol=1e-6)
    else:
        none = jax.jit(lambda o, l: fnattn.merge([(o[0], l[0]), (o[1], l[1])]))(outs, lses)
        np.testing.assert_allclose(out[:, :, 1:], none.out[:, :, 1:], atol=1e-6)
        np.testing.assert_array_equal(np.isneginf(lse[:, 1:]), np.isneginf(none.lse[:, 1:]))
        assert np.isneginf(np.asarray(lse)[:, 1:, 0]).all()
        np.testing.assert_array_equal(out[:, 0, 1:], 0.0)
        np.testing.assert_array_equal(g_sinks[1:], 0.0)


# ---------------------------------------------------------------------------------
# merge_across: the parts held along a named axis. Under vmap the mapped axis plays
# the mesh axis (tests/multi_device/decode_checks.py runs it across 8 devices).
# ---------------------------------------------------------------------------------


def _across(outs, lses, sinks=None, layout="bthd"):
    return jax.vmap(lambda o, l: merge_across(o, l, "parts", layout=layout, sinks=sinks),
                    axis_name="parts")(outs, lses)


def _stacked_parts(seed):
    """Three parts along the keys (in stacked form); in the last part heads 1, 2 see
    nothing (lse -inf, out NaN), and row 0 of sequence 1 is seen by no part."""
    q, k, v = _inputs(seed)
    parts = _parts(AttentionSpec(mask=masks.causal(), impl="xla"), q, k, v, (0, 4, 9, 13))
    outs = jnp.stack([p.out for p in parts])
    lses = jnp.stack([p.lse for p in parts])
    outs = outs.at[2, :, :, 1:3].set(jnp.nan).at[:, 1, 0].set(jnp.nan)
    lses = lses.at[2, :, 1:3].set(-jnp.inf).at[:, 1, :, 0].set(-jnp.inf)
    return outs, lses


def test_merge_across_equals_merge_with_gradients():
    outs, lses = _stacked_parts(6)
    sinks = jnp.linspace(-1.0, 1.0, Hq).at[3].set(-jnp.inf)
    rs = np.random.default_rng(1)
    d_out = jnp.asarray(rs.standard_normal(outs.shape[1:]), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal(lses.shape[1:]), jnp.float32)

    def loss(res):
        return jnp.sum(res.out * d_out) + jnp.sum(jnp.where(jnp.isfinite(res.lse), res.lse,
                                                            0) * d_lse)

    def across(outs, lses, sinks):
        res = _across(outs, lses, sinks)
        return loss(fnattn.AttentionOutput(res.out[1], res.lse[1])), res

    def whole(outs, lses, sinks):
        res = fnattn.merge([(outs[i], lses[i]) for i in range(3)], sinks=sinks)
        return loss(res), res

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))  # noqa
    (_, res), g = grad(across)(outs, lses, sinks)
    (_, ref), g_ref = grad(whole)(outs, lses, sinks)
    for i in range(3):   # every part holds the merged result
        np.testing.assert_allclose(res.out[i], ref.out, atol=1e-6)
        np.testing.assert_array_equal(res.lse[i], ref.lse)
    assert np.isneginf(np.asarray(ref.lse)[1, 3, 0])        # no part, sink -inf
    np.testing.assert_allclose(np.asarray(ref.lse)[1, 0, 0], -1.0)  # no part: the sink
    for a, b in zip(g, g_ref):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    np.testing.assert_array_equal(g[0][2, :, :, 1:3], 0.0)   # the empty part: no gradient


@pytest.mark.parametrize("layout", ["bhtd", "thd"])
def test_merge_across_layouts_and_infinite_sink(layout):
    outs, lses = _stacked_parts(7)
    sinks = jnp.zeros((Hq,)).at[2].set(jnp.inf)              # head 2 takes all the mass
    if layout == "bhtd":
        outs = jnp.swapaxes(outs, 2, 3)
    else:
        outs, lses = outs[:, 0], lses[:, 0]
    res = jax.jit(lambda o, l, s: _across(o, l, s, layout))(outs, lses, sinks)
    ref = fnattn.merge([(outs[i], lses[i]) for i in range(3)], layout=layout, sinks=sinks)
    np.testing.assert_allclose(res.out[0], ref.out, atol=1e-6)
    np.testing.assert_array_equal(res.lse[2], ref.lse)
    assert (np.asarray(ref.lse)[..., 2, :] == np.inf).all()


def test_merge_across_keeps_low_precision_dtype():
    outs, lses = _stacked_parts(8)
    res = jax.jit(_across)(outs.astype(jnp.bfloat16), lses)
    ref = fnattn.merge([(outs[i], lses[i]) for i in range(3)])
    assert res.out.dtype == jnp.bfloat16 and res.lse.dtype == jnp.float32
    np.testing.assert_allclose(res.out[0].astype(np.float32), ref.out, atol=2e-2)


def test_merge_across_bad_input_messages():
    out, lse = jnp.zeros((2, 5, 6, 3)), jnp.zeros((2, 6, 5))
    with pytest.raises(ValueError, match=r"merge_across: lse must have shape \(2, 6, 5\) to "
                                         r"go with out \(2, 5, 6, 3\).*got \(2, 5, 6\)"):
        merge_across(out, jnp.zeros((2, 5, 6)), "seq")
    with pytest.raises(ValueError, match=r"merge_across: sinks must have shape \(H,\)=\(6,\)"):
        merge_across(out, lse, "seq", sinks=jnp.zeros((5,)))
    with pytest.raises(ValueError, match=r"merge_across: layout must be one of"):
        merge_across(out, lse, "seq", layout="tbhd")
    with pytest.raises(TypeError, match=r"merge_across: axis_name must be a mesh axis name"):
        merge_across(out, lse, ())
