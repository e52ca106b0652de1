"""Ring attention: K and V travel around the mesh axis, queries stay.

Device ``r`` holds its queries and, at step ``s``, the keys and values of
device ``src = r - s (mod N)``. At every step the transfer of the next step's
K/V (and the key-side mask operands) to the next device is issued before the
step's computation, so that the two overlap; ``N - 1`` transfers per pass, none
wasted. Each step computes every (query piece, key piece) pair of the layout
with the platform's flash lowering (Triton on NVIDIA GPUs, Mosaic on TPU, the
blockwise XLA loops elsewhere), at the pieces' global positions, skipping pairs
whose tiles are all masked (a ``lax.cond`` on the mask's tile bounds). The
partial results are folded into a running ``(acc, m, l)`` state with the exact
merge; the sinks join once, at the end.

**Backward.** One ``custom_jvp`` whose tangent (:mod:`fnattn._linear`) is
transposed into the ring backward: the residuals are the inputs, the output and
the global ``lse`` (with its rounding error ``lse_lo``); each step recomputes its
pairs' probabilities from the global ``lse`` with the flash lowering's backward.
dQ stays on the device; dK and dV are accumulated in float32 and travel with K
and V (``N - 1`` K/V transfers and ``N`` dK/dV transfers: the last one brings
them home). The sink gradient comes from the global statistics; the gradient
of inputs replicated along the axis (sinks, a replicated bias) is summed over
it by JAX, since they are made to vary like q first. Forward mode
(``jvp``, ``jacfwd``) and second-order derivatives are those of all-gather
attention, which computes the same function: they gather K and V (and their
tangents) instead of passing them around.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fnattn import _dispatch, _linear, _online
from fnattn.context import gather
from fnattn._varying import varying_like
from fnattn.context.common import Problem, pair_call
from fnattn.context.layouts import pieces

F32 = jnp.float32


def _ring_perm(N: int):
    return [(i, (i + 1) % N) for i in range(N)]


def _travel(P: Problem, ops):
    return tuple(op for op, (_, kind) in zip(ops, P.op_kinds) if kind == "travel")


def _with_travel(P: Problem, ops, travel):
    it = iter(travel)
    return tuple(next(it) if kind == "travel" else op for op, (_, kind) in zip(ops, P.op_kinds))


def attention(P: Problem, q, k, v, bias4, sinks, ops, key, base):
    """``(out, lse)`` of ring attention on this device's shard ("bthd")."""
    q, k, v, bias4, sinks = varying_like((q, k, v, bias4, sinks), q, k, v, bias4, sinks, ops,
                                         key, base)
    out, lse, _ = _ring(P, q, k, v, bias4, sinks, ops, key, base)
    return out, lse


def _fold(state, out, lse, lo):
    """Folds one part's (out (B,S,H,Dv), lse, lse_lo (B,H,S)) into (acc, m, l)."""
    acc, m, l = state
    m_new = jnp.maximum(m, lse)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    a = jnp.exp(m - m_use)
    w = jnp.exp((lse - m_use) + lo)
    o = jnp.swapaxes(out, 1, 2).astype(F32)  # (B, H, S, Dv)
    return acc * a[..., None] + w[..., None] * o, m_new, l * a + w


def _pair_forward(P, qp, kp, src, inputs):
    cfg, qx, kx, vx, bx, leaves, seed, nonempty = pair_call(P, qp, kp, src, **inputs)

    def run():
        return _dispatch._select(_dispatch._wrap(P.table), "fwd", cfg, qx, kx, vx, bx, None,
                                 leaves, seed)

    def skip():
        B, H, S = qx.shape[0], qx.shape[2], qx.shape[1]
        out = jnp.zeros((B, S, H, vx.shape[-1]), qx.dtype)
        lse = jnp.full((B, H, S), -jnp.inf, F32)
        return varying_like((out, lse, jnp.zeros_like(lse)), qx, kx, vx, bx, leaves, seed)

    return lax.cond(nonempty, lambda: varying_like(run(), qx, kx, vx, bx, leaves, seed), skip)


def _forward(P: Problem, q, k, v, bias4, sinks, ops, key, base):
    N, L = P.axis_size, P.L
    rank = lax.axis_index(P.axis_name)
    qps = pieces(P.layout, L, rank, N)
    B, Hq, Dv = q.shape[0], q.shape[2], v.shape[-1]

    def init(p):
        acc = jnp.zeros((B, Hq, p.size, Dv), F32)
        m = jnp.full((B, Hq, p.size), -jnp.inf, F32)
        return varying_like((acc, m, jnp.zeros_like(m)), q, k, v)

    def step(states, s, k, v, travel):
        src = (rank - s) % N
        inputs = dict(q=q, k=k, v=v, bias4=bias4, ops=_with_travel(P, ops, travel), key=key,
                      base=base)
        states = list(states)
        for i, qp in enumerate(qps):
            for kp in pieces(P.layout, L, src, N):
                states[i] = _fold(states[i], *_pair_forward(P, qp, kp, src, inputs))
        return tuple(states)

    def body(carry, s):
        states, k, v, travel = carry
        # The next step's K/V leave before this step's computation starts.
        nxt = lax.ppermute((k, v, travel), P.axis_name, _ring_perm(N))
        return (step(states, s, k, v, travel), *nxt), None

    states = tuple(init(p) for p in qps)
    carry = (states, k, v, _travel(P, ops))
    (states, k, v, travel), _ = lax.scan(body, carry, jnp.arange(N - 1))
    states = step(states, N - 1, k, v, travel)

    outs, lses, los = [], [], []
    for acc, m, l in states:
        if sinks is not None:
            acc, m, l = _online.join_sink(acc, m, l, sinks.astype(F32)[None, :, None])
        safe = jnp.where(l == 0, 1.0, l)
        outs.append(jnp.where((l == 0)[..., None], 0.0, acc / safe[..., None]))
        lse, lo = _online.lse_parts(m, l)
        lses.append(lse)
        los.append(lo)
    out = jnp.swapaxes(jnp.concatenate(outs, axis=2), 1, 2).astype(q.dtype)
    return out, jnp.concatenate(lses, axis=2), jnp.concatenate(los, axis=2)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ring(P, q, k, v, bias4, sinks, ops, key, base):
    return _forward(P, q, k, v, bias4, sinks, ops, key, base)


@_ring.defjvp
def _ring_jvp(P, primals, tangents):
    q, k, v, bias4, sinks, ops, key, base = primals
    out, lse, lo = _ring(P, *primals)  # second order comes back here
    res = (q, k, v, bias4, sinks, key, base, out, lse, lo, *ops)
    t_out, t_lse = _linear.tangent(_Derivatives(P), res, tangents[:5], (out, lse))
    return (out, lse, lo), (t_out, t_lse, jnp.zeros_like(lo))


@dataclasses.dataclass(frozen=True)
class _Derivatives(_linear.Rule):
    """Reverse mode runs the ring backward; forward mode and the derivatives of
    either with respect to their inputs (second order) differentiate all-gather
    attention (:mod:`fnattn.context.gather`), which computes the same function
    and gathers K, V and their tangents."""

    P: Problem

    def _split(self, res):
        q, k, v, bias4, sinks, key, base, out, lse, lo, *ops = res
        return (q, k, v, bias4, sinks, tuple(ops), key, base), (out, lse, lo)

    def smooth(self, res):
        (q, k, v, bias4, sinks, ops, key, base), _ = self._split(res)

        def f(q, k, v, bias4, sinks):
            return gather.attention(self.P, q, k, v, bias4, sinks, ops, key, base)

        return f, (q, k, v, bias4, sinks)

    def tangent(self, res, lin):
        return self.smooth_tangent(res, lin)

    def cotangent(self, res, cts):
        inputs, outputs = self._split(res)
        return _ring_bwd(self.P, inputs + outputs, cts)[:5]


def _add_rows(acc, x, lo: int, size: int):
    return lax.dynamic_update_slice_in_dim(
        acc, lax.slice_in_dim(acc, lo, lo + size, axis=1) + x.astype(acc.dtype), lo, axis=1)


def _add_bias(P: Problem, acc, g, qp, kp, src):
    """Adds a pair's bias gradient at the bias rows and key columns it came from."""
    start = [0, 0, qp.lo if acc.shape[2] > 1 else 0, 0]
    if P.bias_kind == "columns":
        start[3] = src * P.L + kp.lo
    elif P.bias_kind == "travel":
        start[3] = kp.lo
    start = [jnp.asarray(s, jnp.int32) for s in start]
    cur = lax.dynamic_slice(acc, start, g.shape)
    return lax.dynamic_update_slice(acc, cur + g.astype(F32), start)


def _ring_bwd(P, res, cts):
    q, k, v, bias4, sinks, ops, key, base, out, lse, lse_lo = res
    d_out, d_lse = cts
    N, L = P.axis_size, P.L
    rank = lax.axis_index(P.axis_name)
    qps = pieces(P.layout, L, rank, N)
    perm = _ring_perm(N)

    def pair_backward(qp, kp, src, inputs):
        cfg, qx, kx, vx, bx, leaves, seed, nonempty = pair_call(P, qp, kp, src, **inputs)
        rows = lambda x, axis: lax.slice_in_dim(x, qp.lo, qp.lo + qp.size, axis=axis)  # noqa
        stats = (rows(out, 1), rows(lse, 2), rows(lse_lo, 2), rows(d_out, 1), rows(d_lse, 2))

        def run():
            dq, dk, dv, db, _ = _dispatch._select(_dispatch._wrap(P.table), "bwd", cfg, qx, kx,
                                                  vx, bx, None, leaves, seed, *stats)
            return dq, dk, dv, db

        def skip():
            return (jnp.zeros_like(qx), jnp.zeros_like(kx), jnp.zeros_like(vx),
                    None if bx is None else jnp.zeros_like(bx))

        refs = (qx, kx, vx, bx, leaves, seed, stats)
        return lax.cond(nonempty, lambda: varying_like(run(), *refs),
                        lambda: varying_like(skip(), *refs))

    def step(s, k, v, travel, dq, dk, dv, dbias):
        src = (rank - s) % N
        inputs = dict(q=q, k=k, v=v, bias4=bias4, ops=_with_travel(P, ops, travel), key=key,
                      base=base)
        for qp in qps:
            for kp in pieces(P.layout, L, src, N):
                gq, gk, gv, gb = pair_backward(qp, kp, src, inputs)
                dq = _add_rows(dq, gq, qp.lo, qp.size)
                dk = _add_rows(dk, gk, kp.lo, kp.size)
                dv = _add_rows(dv, gv, kp.lo, kp.size)
                if dbias is not None:
                    dbias = _add_bias(P, dbias, gb, qp, kp, src)
        return dq, dk, dv, dbias

    def body(carry, s):
        k, v, travel, dq, dk, dv, dbias = carry
        k_next, v_next, travel_next = lax.ppermute((k, v, travel), P.axis_name, perm)
        dq, dk, dv, dbias = step(s, k, v, travel, dq, dk, dv, dbias)
        dk, dv = lax.ppermute((dk, dv), P.axis_name, perm)
        return (k_next, v_next, travel_next, dq, dk, dv, dbias), None

    zeros = lambda x: None if x is None else varying_like(  # noqa: E731
        jnp.zeros(x.shape, F32), q, k, v, x)
    carry = (k, v, _travel(P, ops), zeros(q), zeros(k), zeros(v), zeros(bias4))
    (k, v, travel, dq, dk, dv, dbias), _ = lax.scan(body, carry, jnp.arange(N - 1))
    dq, dk, dv, dbias = step(N - 1, k, v, travel, dq, dk, dv, dbias)
    # dK/dV of device r + 1's keys: one more hop brings them home.
    dk, dv = lax.ppermute((dk, dv), P.axis_name, perm)

    dsinks = None
    if sinks is not None:
        delta = jnp.einsum("bthd,bthd->bht", out.astype(F32), d_out.astype(F32)) - d_lse
        dsinks = _online.sink_grad(sinks, lse, lse_lo, delta).astype(sinks.dtype)
    none = lambda tree: jax.tree_util.tree_map(lambda _: None, tree)  # noqa: E731
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if dbias is None else dbias.astype(bias4.dtype), dsinks, none(ops),
            none(key), none(base))


