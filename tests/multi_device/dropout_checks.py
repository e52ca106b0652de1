"""Dropout without offsets in fnattn.context.attention on a ("data", "seq") mesh:
the sequence axis is not folded (the ring's global positions tell its shards
apart, as with offsets), the data axis is: on two data shards holding the same
batch rows, data shard d equals the whole-sequence call with
``dropout.shard_key(key, d)``, forward and gradients, and the two differ."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import fnattn
from fnattn import AttentionSpec, masks

F32 = jnp.float32


def _close(name, x, y, tol):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol, err_msg=name)


def check_context_dropout_folds_data_axes_only():
    rs = np.random.default_rng(3)
    B, T, Hq, Hkv, D, N = 1, 32, 2, 1, 8, 4
    one = [jnp.asarray(rs.standard_normal((B, T, h, D)), F32) for h in (Hq, Hkv, Hkv)]
    q, k, v = (jnp.concatenate([x, x]) for x in one)   # the same rows on both data shards
    key = jax.random.key(11)
    spec = AttentionSpec(mask=masks.causal(), dropout_rate=0.3, dropout_key=key,
                         impl="xla", block_sizes=fnattn.XlaBlockSizes(8, 8))
    mesh = Mesh(np.array(jax.devices()[:2 * N]).reshape(2, N), ("data", "seq"))

    def loss_and_grads(f, spec, q, k, v):
        def loss(q, k, v):
            out = f(spec, q, k, v).out
            return jnp.sum(out * out), out
        (_, out), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, g

    ctx = lambda s, q, k, v: fnattn.context.attention(s, q, k, v, axis_name="seq")  # noqa
    sp = P("data", "seq")
    out, grads = jax.jit(jax.shard_map(lambda q, k, v: loss_and_grads(ctx, spec, q, k, v),
                                       mesh=mesh, in_specs=(sp, sp, sp),
                                       out_specs=(sp, (sp, sp, sp))))(q, k, v)
    whole = jax.jit(lambda key, q, k, v: loss_and_grads(
        fnattn.attention, spec.replace(dropout_key=key), q, k, v))
    outs = []
    for d in range(2):
        want, g_want = whole(fnattn.dropout.shard_key(key, d), *one)
        _close(f"context dropout data shard {d} out", out[d:d + 1], want, 1e-5)
        for name, a, b in zip("qkv", grads, g_want):
            _close(f"context dropout data shard {d} d{name}", a[d:d + 1], b, 1e-4)
        outs.append(np.asarray(want))
    assert not np.allclose(outs[0], outs[1], atol=1e-3)


CHECKS = [check_context_dropout_folds_data_axes_only]
