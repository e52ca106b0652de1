"""All-gather attention: every device gathers the whole K and V and attends
its own queries.

K, V and the key-side mask operands are gathered along the mesh axis (tiled)
and put back in the sequence's natural order, so that keys sit at positions
``0 .. N*L - 1``; a bias or array mask's key columns, given in the layout's
key order, are put in natural order too. Each query piece (one, or two for
"zigzag") is then one call of the flash lowering at its global positions,
sinks included. The backward is JAX's: the gathers transpose to
reduce-scatters of dK and dV.

Peak memory holds the whole K and V on every device: the better choice when K
and V are small next to Q (GQA/MQA: ``Hkv`` much smaller than ``Hq``), for short
sequences, or with document (segment) masks whose documents span devices.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

from fnattn import _dispatch
from fnattn.context.common import Problem, pair_call
from fnattn.context.layouts import Piece, _order, pieces


def _natural(x, P: Problem, axis: int):
    if P.layout == "contiguous" or x.shape[axis] == 1:
        return x
    inverse = np.argsort(_order(x.shape[axis], P.axis_size, P.layout))
    return jnp.take(x, jnp.asarray(inverse), axis=axis)


def attention(P: Problem, q, k, v, bias4, sinks, ops, key, base):
    """``(out, lse)`` of all-gather attention on this device's shard ("bthd")."""
    N, L = P.axis_size, P.L
    gather = lambda x, axis: _natural(  # noqa: E731
        lax.all_gather(x, P.axis_name, axis=axis, tiled=True), P, axis)
    k_all, v_all = gather(k, 1), gather(v, 1)
    ops_all = tuple(
        gather(op, 3) if kind == "travel" and N > 1 else
        _natural(op, P, 3) if kind == "columns" else op
        for op, (_, kind) in zip(ops, P.op_kinds))
    if bias4 is not None and P.bias_kind == "columns":
        bias4 = _natural(bias4, P, 3)
    rank = lax.axis_index(P.axis_name)
    every_key = Piece(0, N * L, 0, 1)
    outs, lses = [], []
    for qp in pieces(P.layout, L, rank, N):
        cfg, qx, kx, vx, bx, leaves, seed, _ = pair_call(
            P, qp, every_key, 0, q=q, k=k_all, v=v_all, bias4=bias4, ops=ops_all, key=key,
            base=base, full_keys=True)
        out, lse = _dispatch.attend(P.table, cfg, qx, kx, vx, bx, sinks, leaves, seed)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)
