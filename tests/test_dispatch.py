"""One custom_vjp around lax.platform_dependent: the branch lowered is the platform's."""

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from fnattn import AttentionSpec, _dispatch, core, masks, xla


def _scaled(lowering, factor, name):
    def fwd(cfg, *args):
        out, lse = lowering.fwd(cfg, *args)
        return (out * factor).astype(out.dtype), lse

    return _dispatch.Lowering(name, fwd, lowering.bwd)


FAKE_CUDA = _scaled(xla.DENSE, 2.0, "fake-cuda")
FAKE_TPU = _scaled(xla.DENSE, 3.0, "fake-tpu")
TABLE = (("default", xla.DENSE), ("cuda", FAKE_CUDA), ("tpu", FAKE_TPU))


def run(spec, q):
    return core.run(spec, q, q, q, fn="test", table=TABLE).out


def test_default_branch_runs_on_cpu_under_jit_and_grad():
    q = jax.random.normal(jax.random.key(0), (2, 5, 3, 7))
    spec = AttentionSpec(mask=masks.causal())
    out = jax.jit(run)(spec, q)
    ref = fnattn.reference(spec, q, q, q).out
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
    g = jax.jit(jax.grad(lambda q: run(spec, q).sum()))(q)
    gr = jax.jit(jax.grad(lambda q: fnattn.reference(spec, q, q, q).out.sum()))(q)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=1e-5)


def _constants_in(text):
    return {c for c in ("2.000000e+00", "3.000000e+00") if c in text}


def test_lowering_keeps_only_the_platform_branch():
    q = jnp.ones((1, 3, 2, 4))
    spec = AttentionSpec()
    traced = jax.jit(run).trace(spec, q)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert _constants_in(cuda) == {"2.000000e+00"}
    assert _constants_in(tpu) == {"3.000000e+00"}
    assert _constants_in(cpu) == set()


def test_vmap_of_grad_through_dispatch():
    q = jax.random.normal(jax.random.key(1), (4, 1, 5, 3, 7))
    spec = AttentionSpec(mask=masks.causal())
    g = jax.jit(jax.vmap(jax.grad(lambda q: run(spec, q).sum())))(q)
    gr = jax.jit(jax.vmap(jax.grad(lambda q: fnattn.reference(spec, q, q, q).out.sum())))(q)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=1e-5)
