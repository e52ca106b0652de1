"""Every JAX transformation through the fast lowerings, against the same
transformation of ``fnattn.reference``: forward mode (``jvp``, ``linearize``,
``jacfwd``), higher-order reverse mode (grad of grad, ``hessian``, ``jacrev``
of ``jacrev``, forward over reverse), and their composition with ``vmap``,
``checkpoint``, ``scan`` and ``shard_map``. Everything runs under ``jax.jit``.
The table in docs/transformations.md lists what these tests cover.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import fnattn
from fnattn import AttentionSpec, masks

LOWERINGS = ["auto", "xla", "pallas"]  # flash blockwise XLA, dense XLA, Triton interpreted


def _problem(seed=0, B=2, Tq=9, Tk=13, Hq=4, Hkv=2, D=8):
    ks = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D))
    k = jax.random.normal(ks[1], (B, Tk, Hkv, D))
    v = jax.random.normal(ks[2], (B, Tk, Hkv, D))
    bias = 0.5 * jax.random.normal(ks[3], (1, Hq, Tq, Tk))
    sinks = jax.random.normal(ks[4], (Hq,))
    # two documents in the first row, one in the others
    seg_q = jnp.zeros((B, Tq), jnp.int32).at[0, Tq // 2:].set(1)
    seg_k = jnp.zeros((B, Tk), jnp.int32).at[0, Tk // 2:].set(1)
    spec = AttentionSpec(mask=masks.causal() & masks.segments(seg_q, seg_k), softcap=5.0)
    tangents = tuple(jax.random.normal(kk, x.shape) for kk, x in zip(ks[5:], (q, k, v)))
    t_bias = jax.random.normal(ks[0], bias.shape)
    t_sinks = jax.random.normal(ks[1], sinks.shape)
    return spec, (q, k, v, bias, sinks), tangents + (t_bias, t_sinks)


def _fn(spec, impl):
    """(q, k, v, bias, sinks) -> (out, lse) through ``impl``."""
    def f(q, k, v, bias, sinks):
        res = fnattn.attention(spec.replace(bias=bias, sinks=sinks, impl=impl), q, k, v)
        return res.out, res.lse
    return f


def _finite(x):
    x = np.asarray(x)
    return np.where(np.isfinite(x), x, 0.0)


def _close(got, want, tol=2e-5):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        assert np.isfinite(g).all(), "non-finite derivative"
        np.testing.assert_allclose(g, w, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------
# Forward mode
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", LOWERINGS)
def test_jvp_of_every_input_matches_the_reference(impl):
    spec, primals, tangents = _problem()
    run = lambda impl: jax.jit(  # noqa: E731
        lambda p, t: jax.jvp(_fn(spec, impl), p, t))(primals, tangents)
    (out, lse), (t_out, t_lse) = run(impl)
    (r_out, r_lse), (rt_out, rt_lse) = run("reference")
    _close((out, _finite(lse)), (r_out, _finite(r_lse)))
    _close((t_out, t_lse), (rt_out, rt_lse), tol=5e-5)
    assert float(jnp.abs(t_out).max()) > 0.1  # the tangent is not trivially zero


def test_linearize_and_jacfwd_match_the_reference():
    spec, (q, k, v, bias, sinks), (tq, tk, tv, *_) = _problem(B=1, Tq=5, Tk=6, Hq=2, Hkv=1,
                                                              D=4)

    def lin(impl):
        f = lambda q, k, v: _fn(spec, impl)(q, k, v, bias, sinks)  # noqa: E731
        _, f_lin = jax.linearize(f, q, k, v)
        return f_lin(tq, tk, tv), f_lin(2 * tq, 0 * tk, tv)

    _close(jax.jit(lambda: lin("auto"))(), jax.jit(lambda: lin("reference"))(), tol=5e-5)

    def jac(impl):
        return jax.jacfwd(lambda k: _fn(spec, impl)(q, k, v, bias, sinks)[0])(k)

    got, want = jax.jit(lambda: jac("auto"))(), jax.jit(lambda: jac("reference"))()
    assert got.shape == q.shape[:3] + v.shape[3:] + k.shape
    _close(got, want, tol=5e-5)


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_jvp_on_hostile_inputs(impl):
    """Fully masked rows, keys past the lengths holding NaN, -inf and +inf sinks:
    tangents equal the reference's, finite, and zero where the output is fixed."""
    B, Tq, Tk, Hq, Hkv, D = 2, 6, 10, 4, 2, 8
    ks = jax.random.split(jax.random.key(3), 6)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D))
    k = jax.random.normal(ks[1], (B, Tk, Hkv, D))
    v = jax.random.normal(ks[2], (B, Tk, Hkv, D))
    kv_len = jnp.array([7, 0])  # the second row sees nothing
    live = (jnp.arange(Tk) < kv_len[:, None])[:, :, None, None]
    k, v = jnp.where(live, k, jnp.nan), jnp.where(live, v, jnp.inf)
    sinks = jnp.array([-jnp.inf, jnp.inf, 0.5, -1.0])
    spec = AttentionSpec(mask=masks.lengths(kv_lengths=kv_len) & masks.causal())
    tangents = tuple(jax.random.normal(kk, x.shape) for kk, x in zip(ks[3:], (q, k, v)))
    t_sinks = jnp.ones((Hq,))

    def run(impl):
        f = lambda q, k, v, s: _fn(spec, impl)(q, k, v, None, s)  # noqa: E731
        return jax.jvp(f, (q, k, v, sinks), tangents + (t_sinks,))[1]

    (t_out, t_lse), (r_out, r_lse) = jax.jit(lambda: run(impl))(), jax.jit(
        lambda: run("reference"))()
    _close((t_out, t_lse), (r_out, r_lse), tol=5e-5)
    assert not np.asarray(t_out[1]).any()  # nothing seen: out stays 0
    assert not np.asarray(t_out[:, :, 1]).any()  # the +inf sink takes every row's mass
    np.testing.assert_array_equal(np.asarray(t_lse[1, 2:]), 1.0)  # lse = sink there


def test_jvp_with_dropout_and_bhtd_matches_the_reference():
    spec, (q, k, v, bias, sinks), tangents = _problem(seed=1)
    spec = spec.replace(dropout_rate=0.3, dropout_key=jax.random.key(7), layout="bhtd")
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    tangents = tuple(jnp.swapaxes(t, 1, 2) for t in tangents[:3]) + tangents[3:]
    run = lambda impl: jax.jit(  # noqa: E731
        lambda: jax.jvp(_fn(spec, impl), (q, k, v, bias, sinks), tangents)[1])()
    _close(run("auto"), run("reference"), tol=5e-5)


def test_flash_and_bfloat16_tangents():
    spec, (q, k, v, bias, sinks), (tq, tk, tv, *_) = _problem(seed=2)
    q, k, v, tq, tk, tv = (x.astype(jnp.bfloat16) for x in (q, k, v, tq, tk, tv))

    def run(fn):
        return jax.jvp(lambda q, k, v: fn(spec, q, k, v).out, (q, k, v), (tq, tk, tv))[1]

    got = jax.jit(lambda: run(fnattn.flash))()
    want = jax.jit(lambda: run(lambda s, *a: fnattn.attention(s.replace(impl="reference"),
                                                              *a)))()
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=6e-2, rtol=6e-2)


# ----------------------------------------------------------------------------------
# Higher-order reverse mode
# ----------------------------------------------------------------------------------


def _second_order(spec, impl, primals):
    f = _fn(spec, impl)

    def loss(q, k, v, bias, sinks):
        out, lse = f(q, k, v, bias, sinks)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) ** 2)

    def grad_norm(*x):  # grad of grad: d/dx |d loss/dx|^2
        g = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*x)
        return sum(jnp.sum(gi ** 2) for gi in g)

    gg = jax.grad(grad_norm, argnums=(0, 1, 2, 3, 4))(*primals)
    hess_sinks = jax.hessian(lambda s: loss(*primals[:4], s))(primals[4])
    q = primals[0]
    jj = jax.jacrev(jax.jacrev(lambda qs: loss(q.at[0, 0, 0, :2].set(qs), *primals[1:])))(
        q[0, 0, 0, :2])
    return gg, hess_sinks, jj


@pytest.mark.parametrize("impl", LOWERINGS)
def test_grad_of_grad_hessian_and_jacrev_of_jacrev(impl):
    spec, primals, _ = _problem(B=1, Tq=6, Tk=7, Hq=2, Hkv=1, D=4)
    got = jax.jit(lambda p: _second_order(spec, impl, p))(primals)
    want = jax.jit(lambda p: _second_order(spec, "reference", p))(primals)
    _close(got, want, tol=2e-4)
    assert got[1].shape == (2, 2) and float(jnp.abs(got[1]).max()) > 0


def test_forward_over_reverse_hessian_vector_product():
    spec, (q, k, v, bias, sinks), (tq, tk, tv, *_) = _problem(seed=4)

    def hvp(impl):
        loss = lambda q, k, v: jnp.sum(_fn(spec, impl)(q, k, v, bias, sinks)[0] ** 2)  # noqa
        return jax.jvp(jax.grad(loss, argnums=(0, 1, 2)), (q, k, v), (tq, tk, tv))[1]

    _close(jax.jit(lambda: hvp("auto"))(), jax.jit(lambda: hvp("reference"))(), tol=2e-4)


# ----------------------------------------------------------------------------------
# What each mode runs, and composition with the other transformations
# ----------------------------------------------------------------------------------


def test_reverse_mode_runs_the_backward_and_no_tangent_pass():
    spec, (q, k, v, bias, sinks), (tq, tk, tv, *_) = _problem()
    f = _fn(spec, "auto")
    grad = str(jax.make_jaxpr(jax.grad(lambda q: f(q, k, v, bias, sinks)[0].sum()))(q))
    assert "fnattn_cotangent" in grad and "fnattn_tangent" not in grad
    jvp = str(jax.make_jaxpr(lambda t: jax.jvp(lambda q: f(q, k, v, bias, sinks), (q,),
                                               (t,)))(tq))
    assert "fnattn_tangent" in jvp and "fnattn_cotangent" not in jvp


def test_vmap_checkpoint_and_scan_compose_with_forward_mode():
    spec, (q, k, v, bias, sinks), (tq, tk, tv, *_) = _problem(B=1)

    def run(impl):
        f = lambda q, k, v: _fn(spec, impl)(q, k, v, bias, sinks)[0]  # noqa: E731
        # vmap of jvp, over a stack of two problems and tangents
        stack = lambda x: jnp.stack([x, 0.5 * x])  # noqa: E731
        vj = jax.vmap(lambda q, t: jax.jvp(lambda q: f(q, k, v), (q,), (t,))[1])(
            stack(q), stack(tq))

        # jvp of a scan of checkpointed layers
        def layers(q):
            def layer(c, _):
                return jax.checkpoint(lambda c: f(c, k, v))(c), None
            return jax.lax.scan(layer, q, None, length=2)[0]

        sj = jax.jvp(layers, (q,), (tq,))[1]
        # jacfwd under vmap
        vjf = jax.vmap(jax.jacfwd(lambda s: _fn(spec, impl)(q, k, v, bias, s)[1]))(
            jnp.stack([sinks, -sinks]))
        return vj, sj, vjf

    _close(jax.jit(lambda: run("auto"))(), jax.jit(lambda: run("reference"))(), tol=5e-5)


def test_forward_mode_and_grad_of_grad_inside_shard_map():
    spec, (q, k, v, bias, sinks), (tq, tk, tv, *_) = _problem()
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def run(impl):
        f = lambda q, k, v: _fn(spec, impl)(q, k, v, None, sinks)[0]  # noqa: E731

        def body(q, k, v, tq):
            t = jax.jvp(lambda q: f(q, k, v), (q,), (tq,))[1]
            gg = jax.grad(lambda q: jnp.sum(jax.grad(lambda q: f(q, k, v).sum())(q) ** 2))(q)
            return t, gg

        spec4 = P("data")
        return jax.shard_map(body, mesh=mesh, in_specs=(spec4,) * 4,
                             out_specs=(spec4, spec4))(q, k, v, tq)

    _close(jax.jit(lambda: run("auto"))(), jax.jit(lambda: run("reference"))(), tol=2e-4)


# ----------------------------------------------------------------------------------
# Serving variants
# ----------------------------------------------------------------------------------


def _decode_problem():
    B, Tq, S, Hq, Hkv, D = 3, 2, 16, 4, 2, 8
    ks = jax.random.split(jax.random.key(5), 8)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D))
    k = jax.random.normal(ks[1], (B, S, Hkv, D))
    v = jax.random.normal(ks[2], (B, S, Hkv, D))
    lengths = jnp.array([11, 2, 16])
    live = (jnp.arange(S) < lengths[:, None])[:, :, None, None]
    k, v = jnp.where(live, k, jnp.nan), jnp.where(live, v, jnp.nan)  # poisoned slots
    sinks = jax.random.normal(ks[3], (Hq,))
    t = tuple(jax.random.normal(kk, x.shape) for kk, x in zip(ks[4:], (q, k, v, sinks)))
    return (q, k, v, sinks), t, lengths


def _decode_fn(impl, lengths):
    def f(q, k, v, sinks):
        if impl == "dense":  # the same problem as dense attention over the valid keys
            spec = AttentionSpec(mask=masks.lengths(kv_lengths=lengths), sinks=sinks,
                                 impl="reference")
            res = fnattn.attention(spec, q, k, v)
        else:
            res = fnattn.decode(AttentionSpec(sinks=sinks, impl=impl), q, k, v,
                                kv_lengths=lengths)
        return res.out, res.lse
    return f


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_decode_jvp_and_grad_of_grad(impl):
    primals, tangents, lengths = _decode_problem()

    def run(impl):
        f = _decode_fn(impl, lengths)
        t = jax.jvp(f, primals, tangents)[1]

        def grad_norm(q, sinks):
            g = jax.grad(lambda q, s: jnp.sum(jnp.sin(f(q, *primals[1:3], s)[0])),
                         argnums=(0, 1))(q, sinks)
            return jnp.sum(g[0] ** 2) + jnp.sum(g[1] ** 2)

        return t, jax.grad(grad_norm, argnums=(0, 1))(primals[0], primals[3])

    _close(jax.jit(lambda: run(impl))(), jax.jit(lambda: run("dense"))(), tol=1e-4)


def test_paged_and_ragged_paged_forward_mode_and_second_order():
    from paged import problems  # tests/paged
    p = problems.make([(9, 3), (5, 3)], pad_tokens=2)
    meta = problems.meta(p)
    sinks = jnp.array([0.3, -0.2, 1.0, 0.0])
    spec = AttentionSpec(mask=masks.causal(), sinks=sinks)
    tq = jax.random.normal(jax.random.key(1), p.q.shape)
    tk = jax.random.normal(jax.random.key(2), p.k_pages.shape)
    ts = jnp.ones_like(sinks)

    def ragged(q, kp, vp, s):
        r = fnattn.ragged_paged_attention(spec.replace(sinks=s), q, kp, vp, **meta)
        return r.out, jnp.where(jnp.isfinite(r.lse), r.lse, 0.0)

    def dense(q, s):  # each sequence on its dense tokens, through fnattn.reference
        out, lse = problems.dense_packed(spec.replace(sinks=s), p, q, p.k_tok, p.v_tok)
        return out, jnp.where(jnp.isfinite(lse), lse, 0.0)

    primals = (p.q, p.k_pages, p.v_pages, sinks)

    @jax.jit
    def run():
        t_q = jax.jvp(lambda q, s: ragged(q, p.k_pages, p.v_pages, s), (p.q, sinks), (tq, ts))[1]
        r_q = jax.jvp(dense, (p.q, sinks), (tq, ts))[1]
        # the pools' tangent against reverse mode: <ct, J t> == <J^T ct, t>
        (out, lse), t_pool = jax.jvp(lambda kp: ragged(p.q, kp, p.v_pages, sinks),
                                     (p.k_pages,), (tk,))
        _, vjp = jax.vjp(lambda kp: ragged(p.q, kp, p.v_pages, sinks), p.k_pages)
        ct = (jnp.cos(out), jnp.sin(lse))
        lhs = jnp.sum(ct[0] * t_pool[0]) + jnp.sum(ct[1] * t_pool[1])
        rhs = jnp.sum(vjp(ct)[0] * tk)
        # grad of grad with respect to q
        gg = lambda f: jax.grad(  # noqa: E731
            lambda q: jnp.sum(jax.grad(lambda q: jnp.sum(jnp.sin(f(q)[0])))(q) ** 2))(p.q)
        return (t_q, r_q, lhs, rhs, gg(lambda q: ragged(q, *primals[1:])),
                gg(lambda q: dense(q, sinks)))

    t_q, r_q, lhs, rhs, gg, r_gg = run()
    n = sum(L for _, L in p.seqs)  # live tokens (padding rows are 0 in both)
    _close(jax.tree_util.tree_map(lambda x: x[:n], t_q),
           jax.tree_util.tree_map(lambda x: x[:n], r_q), tol=5e-5)
    np.testing.assert_allclose(float(lhs), float(rhs), rtol=1e-4)
    assert abs(float(lhs)) > 1e-3
    _close(gg[:n], r_gg[:n], tol=2e-4)

    def paged(q, s):
        B, Tq = len(p.seqs), 3
        q4 = q[:B * Tq].reshape(B, Tq, *q.shape[1:])
        r = fnattn.paged_attention(spec.replace(sinks=s, layout="bthd"), q4, p.k_pages,
                                   p.v_pages, page_table=p.page_table,
                                   kv_lengths=p.context_lengths[:B])
        return r.out.reshape(B * Tq, *r.out.shape[2:])

    got = jax.jit(lambda: jax.jvp(paged, (p.q, sinks), (tq, ts))[1])()
    want = jax.jit(lambda: jax.jvp(lambda q, s: dense(q, s)[0], (p.q, sinks), (tq, ts))[1])()
    _close(got, want[:got.shape[0]], tol=5e-5)
