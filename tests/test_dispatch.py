"""One custom_jvp around the platform choice: the branch lowered is the platform's.

A table with fake "cuda" and "tpu" lowerings (the dense XLA lowering with its
forward output or its gradients scaled by a recognisable constant) shows that
lowering for a platform keeps that platform's forward *and* backward, and that
on this CPU the "default" branch runs, under jit, grad, vmap and checkpoint.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, _dispatch, core, masks, xla
from lowering import target

# Distinctive factors, so that their constants cannot appear in HLO by accident.
CUDA_FWD, CUDA_BWD, TPU_FWD, TPU_BWD = 1237.0, 1279.0, 1249.0, 1291.0
CONSTANTS = {f: f"{f:.6e}" for f in (CUDA_FWD, CUDA_BWD, TPU_FWD, TPU_BWD)}


def _scaled(lowering, fwd_factor, bwd_factor, name):
    def fwd(cfg, *args):
        out, lse, lse_lo = lowering.fwd(cfg, *args)
        return (out * fwd_factor).astype(out.dtype), lse, lse_lo

    def bwd(cfg, *args):
        dq, dk, dv, dbias, dsinks = lowering.bwd(cfg, *args)
        return (dq * bwd_factor).astype(dq.dtype), dk, dv, dbias, dsinks

    return _dispatch.Lowering(name, fwd, bwd)


TABLE = (("default", xla.DENSE),
         ("cuda", _scaled(xla.DENSE, CUDA_FWD, CUDA_BWD, "fake-cuda")),
         ("tpu", _scaled(xla.DENSE, TPU_FWD, TPU_BWD, "fake-tpu")))


def run(spec, q, k=None, v=None):
    k = q if k is None else k
    v = q if v is None else v
    return core.run(spec, q, k, v, fn="test", table=TABLE)


def _constants_in(text):
    return {f for f, c in CONSTANTS.items() if c in text}


def test_lowering_keeps_only_the_platform_branch_forward_and_backward():
    q = jnp.ones((1, 3, 2, 4))
    spec = AttentionSpec()

    def f(q):
        out, vjp = jax.vjp(lambda q: run(spec, q).out, q)
        return out, vjp(jnp.ones_like(out))

    traced = jax.jit(f).trace(q)
    found = {plat: _constants_in(traced.lower(lowering_platforms=(plat,)).as_text())
             for plat in ("cuda", "tpu", "cpu")}
    assert found == {"cuda": {CUDA_FWD, CUDA_BWD}, "tpu": {TPU_FWD, TPU_BWD}, "cpu": set()}


def test_default_branch_runs_on_cpu_under_jit_and_grad():
    rs = np.random.default_rng(0)
    q = jnp.asarray(rs.standard_normal((2, 5, 3, 7)), jnp.float32)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.zeros(3), bias=jnp.zeros((5, 5)))
    out = jax.jit(run)(spec, q)
    ref = jax.jit(fnattn.reference)(spec, q, q, q)
    np.testing.assert_allclose(np.asarray(out.out), np.asarray(ref.out), atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.lse), np.asarray(ref.lse), atol=1e-6)

    def loss(attn):
        def f(q, bias, sinks):
            r = attn(spec.replace(bias=bias, sinks=sinks), q, q, q)
            return r.out.sum() + (r.lse ** 2).sum()
        return f

    g = jax.jit(jax.grad(loss(run), argnums=(0, 1, 2)))(q, spec.bias, spec.sinks)
    gr = jax.jit(jax.grad(loss(fnattn.reference), argnums=(0, 1, 2)))(q, spec.bias, spec.sinks)
    for a, b in zip(g, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_integer_and_key_leaves_get_no_cotangent():
    # segment ids, lengths and the dropout seed ride through the custom_jvp as
    # primal inputs; grad must not ask for their cotangents
    rs = np.random.default_rng(1)
    q = jnp.asarray(rs.standard_normal((2, 5, 3, 7)), jnp.float32)
    ids = jnp.asarray(rs.integers(0, 2, (2, 5)))
    spec = AttentionSpec(mask=masks.segments(ids) & masks.lengths(kv_lengths=jnp.array([5, 3])),
                         dropout_rate=0.3, dropout_key=jax.random.key(2))
    g = jax.jit(jax.grad(lambda q: run(spec, q).out.sum()))(q)
    gr = jax.jit(jax.grad(lambda q: fnattn.reference(spec, q, q, q).out.sum()))(q)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=1e-5)


def test_vmap_of_grad_and_checkpoint_through_dispatch():
    q = jax.random.normal(jax.random.key(1), (4, 1, 5, 3, 7))
    spec = AttentionSpec(mask=masks.causal())
    g = jax.jit(jax.vmap(jax.grad(jax.checkpoint(lambda q: run(spec, q).out.sum()))))(q)
    gr = jax.jit(jax.vmap(jax.grad(lambda q: fnattn.reference(spec, q, q, q).out.sum())))(q)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=1e-5)


def test_a_table_without_default_is_refused():
    q = jnp.ones((1, 3, 2, 4))
    with pytest.raises(ValueError, match=r"lowering table \[\('cuda', 'xla-dense'\)\] has no "
                                         "'default' entry"):
        core.run(AttentionSpec(), q, q, q, fn="test", table=(("cuda", xla.DENSE),))


def test_every_branch_must_return_the_same_types():
    def bad_fwd(cfg, q, *args):
        out, lse, lse_lo = xla.DENSE.fwd(cfg, q, *args)
        return out, lse.astype(jnp.float16), lse_lo  # lse must always be float32

    table = (("default", xla.DENSE), ("cuda", _dispatch.Lowering("bad", bad_fwd, xla.DENSE.bwd)))
    q = jnp.ones((1, 3, 2, 4))
    f = jax.jit(lambda q: core.run(AttentionSpec(), q, q, q, fn="test", table=table).out)
    f(q)  # a branch is traced where it is lowered: on a CPU, only the default
    with target("cuda"), pytest.raises(TypeError, match="branches must have equal output types"):
        f.trace(q).lower(lowering_platforms=("cuda",))


def test_lowerings_get_static_config():
    seen = []

    def fwd(cfg, q, k, v, bias, sinks, mask, seed):
        seen.append(cfg)
        return xla.DENSE.fwd(cfg, q, k, v, bias, sinks, mask, seed)

    table = (("default", _dispatch.Lowering("spy", fwd, xla.DENSE.bwd)),)
    q = jnp.ones((2, 5, 6, 4))
    k = jnp.ones((2, 7, 3, 4))
    v = jnp.ones((2, 7, 3, 3))
    spec = AttentionSpec(mask=masks.causal(), softcap=2.0, layout="bthd")
    jax.jit(lambda q: core.run(spec, q, k, v, fn="test", table=table).out)(q)
    (cfg,) = seen
    assert cfg.dims == (2, 5, 7, 6, 3, 4, 3)
    assert cfg.dims.group == 2
    assert cfg.scale == 0.5 and cfg.softcap == 2.0 and cfg.dropout_rate == 0.0
    hash(cfg)  # a custom_jvp nondiff argument must be hashable


def test_a_branch_may_use_the_axis_of_a_named_vmap():
    """``_platforms.dependent`` under ``jax.vmap(..., axis_name=)``: its branches
    are mapped under the same axis name, so a collective in a branch works (it
    raised "unbound axis name" when the branches were mapped without it), in
    forward mode too, and with an unnamed vmap around the named one."""
    from fnattn._platforms import dependent

    def f(x):
        return dependent(x, default=lambda x: x * jax.lax.axis_index("i") + jax.lax.psum(x, "i"),
                         cuda=lambda x: x)

    x = jnp.arange(6.0).reshape(3, 2)
    want = x * jnp.arange(3.0)[:, None] + x.sum(0)
    np.testing.assert_allclose(jax.jit(jax.vmap(f, axis_name="i"))(x), want)
    _, t = jax.jit(lambda x: jax.jvp(jax.vmap(f, axis_name="i"), (x,), (x,)))(x)
    np.testing.assert_allclose(t, want)
    both = jax.jit(jax.vmap(jax.vmap(f, axis_name="i")))(jnp.stack([x, 2 * x]))
    np.testing.assert_allclose(both, jnp.stack([want, 2 * want]))
    # jacfwd: a vmap whose primal is not mapped (JAX 0.11 still calls the rule)
    g = lambda x: dependent(x, default=lambda x: jnp.sin(x), cuda=lambda x: x)  # noqa: E731
    np.testing.assert_allclose(jax.jit(jax.jacfwd(g))(x[0]), jnp.diag(jnp.cos(x[0])))
