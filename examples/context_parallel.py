"""Context parallelism with ``jax.shard_map``: one long packed sequence split over devices.

A training step of a one-layer attention model whose sequence axis is split
over the ``"context"`` axis of a ``(data, context)`` mesh; K/V travel around a
ring (``strategy="ring"``) and the zigzag layout balances the causal work.
Everything is JAX's own ``Mesh`` and ``shard_map``: fnattn only provides the
per-device function. The loss and every gradient are checked against the same
step on one device.

Runs on a CPU with 8 virtual devices (set here when ``XLA_FLAGS`` does not
already ask for some); on a machine with 8 accelerators it uses those.

    python examples/context_parallel.py      # ~20 s on a 2-core CPU
"""

import os
import sys

if "jax" not in sys.modules and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fnattn  # noqa: E402
from fnattn import AttentionSpec, masks  # noqa: E402


def init(key, d_model, q_heads, kv_heads, d_head):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    s = d_model ** -0.5
    return {"wq": jax.random.normal(k1, (d_model, q_heads, d_head)) * s,
            "wk": jax.random.normal(k2, (d_model, kv_heads, d_head)) * s,
            "wv": jax.random.normal(k3, (d_model, kv_heads, d_head)) * s,
            "wo": jax.random.normal(k4, (q_heads, d_head, d_model)) * (q_heads * d_head) ** -0.5,
            "sinks": jnp.zeros((q_heads,))}


def layer(params, x, ids, attend):
    q = jnp.einsum("btm,mhd->bthd", x, params["wq"])
    k = jnp.einsum("btm,mhd->bthd", x, params["wk"])
    v = jnp.einsum("btm,mhd->bthd", x, params["wv"])
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), sinks=params["sinks"])
    return jnp.einsum("bthd,hdm->btm", attend(spec, q, k, v).out, params["wo"])


def loss_on_one_device(params, x, ids, y):
    return jnp.mean((layer(params, x, ids, fnattn.attention) - y) ** 2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--strategy", default="ring", choices=("ring", "all_gather"))
    args = ap.parse_args(argv)

    devices = np.array(jax.devices())
    n = len(devices)
    data = 2 if n % 2 == 0 and n > 2 else 1
    mesh = Mesh(devices.reshape(data, n // data), ("data", "context"))
    ctx = mesh.shape["context"]
    print(f"{n} devices: mesh {dict(mesh.shape)}, strategy {args.strategy!r}, layout 'zigzag'")

    B, T, M, Hq, Hkv, D = 2 * data, args.seq, 32, 4, 2, 16
    rs = np.random.default_rng(0)
    x = jnp.asarray(rs.standard_normal((B, T, M)), jnp.float32)
    y = jnp.asarray(rs.standard_normal((B, T, M)), jnp.float32)
    ids = jnp.asarray(np.sort(rs.integers(0, 4, (B, T)), axis=1), jnp.int32)  # packed docs
    params = init(jax.random.key(0), M, Hq, Hkv, D)

    def attend_split(spec, q, k, v):
        return fnattn.context.attention(spec, q, k, v, axis_name="context",
                                        strategy=args.strategy, layout="zigzag")

    def per_device(params, x, ids, y):
        def loss(params):
            err = layer(params, x, ids, attend_split) - y
            return jax.lax.psum(jnp.sum(err ** 2), ("data", "context")) / (B * T * M)
        return jax.value_and_grad(loss)(params)

    tokens = P("data", "context")
    step = jax.jit(jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(P(), tokens, tokens, tokens),
        out_specs=(P(), P())))
    # shard_map cuts the sequence into contiguous pieces: put it in zigzag order first
    xz, idz, yz = (fnattn.context.reorder(a, ctx, "zigzag") for a in (x, ids, y))
    loss, grads = step(params, xz, idz, yz)
    # (the weights are replicated: shard_map's psum in the backward sums their gradients)

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_on_one_device))(params, x, ids, y)
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
    print(f"loss sharded {float(loss):.6f}, one device {float(ref_loss):.6f}; "
          f"max relative gradient difference {err:.1e}")
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert err < 1e-4, err
    return float(loss), float(ref_loss), err


if __name__ == "__main__":
    main()
