"""Ring attention: K and V travel around the mesh axis, queries stay.

Device ``r`` holds its queries and, at step ``s``, the keys and values of
device ``src = r - s (mod N)``. At every step the transfer of the next step's
K/V (and the key-side mask operands) to the next device is issued before the
step's computation, so that the two overlap; ``N - 1`` transfers per pass, none
wasted. Each step computes every (query piece, key piece) pair of the layout
with the flash lowering ``fnattn.flash`` runs for ``spec.impl`` on the platform
(for "auto", the routing table of docs/flash.md), at the pieces' global positions, skipping pairs
whose tiles are all masked (a ``lax.cond`` on the mask's tile bounds). The
partial results are folded into a running ``(acc, m, l)`` state with the exact
merge; the sinks join once, at the end.

**Backward.** One ``custom_jvp`` whose tangent (:mod:`fnattn._linear`) is
transposed into the ring backward: the residuals are the inputs, the output and
the global ``lse`` (with its rounding error ``lse_lo``); each step recomputes its
pairs' probabilities from the global ``lse`` with the flash lowering's backward.
dQ stays on the device; dK and dV are accumulated in float32 and travel with K
and V (``N - 1`` K/V transfers and ``N`` dK/dV transfers: the last one brings
them home). The sink gradient comes from the global statistics; a position
term's arrays (ALiBi's slopes), when differentiated, get each pair's gradient
from the flash backward (``Config.term_grad``), summed over the steps; the
gradient of inputs replicated along the axis (sinks, a replicated bias, the
slopes) is summed over it by JAX, since they are made to vary like q first. Forward mode
(``jvp``, ``jacfwd``) and second-order derivatives are those of all-gather
attention, which computes the same function: they gather K and V (and their
tangents) instead of passing them around.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fnattn import _dispatch, _linear, _online, masks, position_bias
from fnattn.context import gather
from fnattn._varying import varying_like
from fnattn.context.common import Problem, pair_call, slice_op
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
    # a position term's arrays take gradients too: typed to vary like q, so
    # that JAX sums their gradient over the axis
    ops = list(ops)
    for n in _term_ops(P):
        ops[n] = varying_like(ops[n], q, k, v)
    out, lse, _ = _ring(P, q, k, v, bias4, sinks, tuple(ops), key, base)
    return out, lse


def _term_ops(P: Problem) -> tuple:
    """The canonical operands of the position term riding with the mask."""
    if P.mask_treedef is None:
        return ()
    return tuple(position_bias.term_operands(masks.from_treedef(P.mask_treedef)))


def _fold(state, out, lse, lo):
    """Folds one part's (out (B,S,H,Dv), lse, lse_lo (B,H,S)) into (acc, m, l)."""
    acc, m, l = state
    m_new = jnp.maximum(m, lse)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    a = jnp.exp(m - m_use)
    w = jnp.exp((lse - m_use) + lo)
    o = jnp.swapaxes(out, 1, 2).astype(F32)  # (B, H, S, Dv)
    return acc * a[..., None] + w[..., None] * o, m_new, l * a + w


def _unless_empty(P: Problem, pass_: str, cfg, args: tuple, nonempty, skip):
    """The flash lowering's ``pass_`` ("fwd" or "bwd") on ``args``, or
    ``skip(*args)`` where ``nonempty`` is false (a pair whose tiles are all
    masked).

    The ``lax.cond`` sits inside each platform's branch of the lowering's
    choice, not around it: a program exported for several platforms then holds
    under the condition only the kernel of the platform it runs on. (With the
    choice inside a ``lax.cond`` in ``shard_map``, XLA keeps every platform's
    kernel, and a CPU refuses the Triton and Mosaic custom calls: "No FFI
    handler registered".)"""
    def guard(fn):
        def guarded(cfg, *a):
            *a, ok = a
            return lax.cond(ok, lambda: varying_like(fn(cfg, *a), *a),
                            lambda: varying_like(skip(*a), *a))
        return guarded

    table = tuple((plat, dataclasses.replace(low, **{pass_: guard(getattr(low, pass_))}))
                  for plat, low in _dispatch._wrap(P.table))
    return _dispatch._select(table, pass_, cfg, *args, nonempty)


def _pair_forward(P, qp, kp, src, inputs):
    cfg, qx, kx, vx, bx, leaves, seed, nonempty = pair_call(P, qp, kp, src, **inputs)

    def skip(q, k, v, *_):
        B, H, S = q.shape[0], q.shape[2], q.shape[1]
        out = jnp.zeros((B, S, H, v.shape[-1]), q.dtype)
        lse = jnp.full((B, H, S), -jnp.inf, F32)
        return out, lse, jnp.zeros_like(lse)

    return _unless_empty(P, "fwd", cfg, (qx, kx, vx, bx, None, leaves, seed), nonempty, skip)


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


def _ring_jvp(P, primals, tangents):
    q, k, v, bias4, sinks, ops, key, base = primals
    out, lse, lo = _ring(P, *primals)  # second order comes back here
    res = (q, k, v, bias4, sinks, key, base, out, lse, lo, *ops)
    lin = _linear.instantiate(primals[:5], tangents[:5])
    # the position term's operands being differentiated (ALiBi's slopes)
    which = tuple(n for n in _term_ops(P) if not _linear.is_zero(tangents[5][n])
                  and jnp.issubdtype(ops[n].dtype, jnp.floating))
    lin += tuple(tangents[5][n] for n in which)
    t_out, t_lse = _linear.tangent(_Derivatives(P, which), res, lin, (out, lse))
    return (out, lse, lo), (t_out, t_lse, jnp.zeros_like(lo))


_ring.defjvp(_ring_jvp, symbolic_zeros=True)


@dataclasses.dataclass(frozen=True)
class _Derivatives(_linear.Rule):
    """Reverse mode runs the ring backward; forward mode and the derivatives of
    either with respect to their inputs (second order) differentiate all-gather
    attention (:mod:`fnattn.context.gather`), which computes the same function
    and gathers K, V and their tangents."""

    P: Problem
    # the canonical operands (a position term's) differentiated, after
    # (q, k, v, bias4, sinks)
    which: tuple = ()

    def _split(self, res):
        q, k, v, bias4, sinks, key, base, out, lse, lo, *ops = res
        return (q, k, v, bias4, sinks, tuple(ops), key, base), (out, lse, lo)

    def smooth(self, res):
        (q, k, v, bias4, sinks, ops, key, base), _ = self._split(res)

        def f(q, k, v, bias4, sinks, *terms):
            ops_ = list(ops)
            for n, x in zip(self.which, terms):
                ops_[n] = x
            return gather.attention(self.P, q, k, v, bias4, sinks, tuple(ops_), key, base)

        return f, (q, k, v, bias4, sinks, *[ops[n] for n in self.which])

    def tangent(self, res, lin):
        return self.smooth_tangent(res, lin)

    def cotangent(self, res, cts):
        inputs, outputs = self._split(res)
        return _ring_bwd(self.P, inputs + outputs, cts, self.which)


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


def _ring_bwd(P, res, cts, which=()):
    """The ring backward: (dq, dk, dv, dbias, dsinks), then the gradients of the
    canonical operands ``which`` (a position term's, summed over every pair
    this device computes; the sum over devices is JAX's, since they vary)."""
    q, k, v, bias4, sinks, ops, key, base, out, lse, lse_lo = res
    d_out, d_lse = cts
    N, L = P.axis_size, P.L
    rank = lax.axis_index(P.axis_name)
    qps = pieces(P.layout, L, rank, N)
    perm = _ring_perm(N)
    for n in which:
        if P.op_kinds[n][1] == "travel":
            raise NotImplementedError(
                "context.attention (ring): gradients into a position term's arrays that hold "
                "each device's keys are not implemented; strategy='all_gather' computes them")

    def pair_backward(qp, kp, src, inputs):
        cfg, qx, kx, vx, bx, leaves, seed, nonempty = pair_call(P, qp, kp, src, **inputs)
        # the pair's mask leaves are its cut canonical operands, then positions
        cfg = dataclasses.replace(cfg, term_grad=which)
        rows = lambda x, axis: lax.slice_in_dim(x, qp.lo, qp.lo + qp.size, axis=axis)  # noqa
        stats = (rows(out, 1), rows(lse, 2), rows(lse_lo, 2), rows(d_out, 1), rows(d_lse, 2))

        def skip(q, k, v, b, sinks, leaves, *_):
            return (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v),
                    None if b is None else jnp.zeros_like(b), None,
                    *(jnp.zeros(leaves[n].shape, leaves[n].dtype) for n in which))

        dq, dk, dv, db, _, *d_ops = _unless_empty(
            P, "bwd", cfg, (qx, kx, vx, bx, None, leaves, seed, *stats), nonempty, skip)
        return dq, dk, dv, db, tuple(d_ops)

    def add_ops(d_ops, g_ops, qp, kp, src):
        """Adds a pair's operand gradients where its cut of each operand came from."""
        out_ = []
        for n, acc, g in zip(which, d_ops, g_ops):
            qv, kind = P.op_kinds[n]
            cut = functools.partial(slice_op, q_varies=qv, kind=kind, qp=qp, kp=kp, src=src,
                                    L=L)
            _, back = jax.vjp(cut, ops[n])
            out_.append(acc + back(g.astype(ops[n].dtype))[0].astype(F32))
        return tuple(out_)

    def step(s, k, v, travel, dq, dk, dv, dbias, d_ops):
        src = (rank - s) % N
        inputs = dict(q=q, k=k, v=v, bias4=bias4, ops=_with_travel(P, ops, travel), key=key,
                      base=base)
        for qp in qps:
            for kp in pieces(P.layout, L, src, N):
                gq, gk, gv, gb, g_ops = pair_backward(qp, kp, src, inputs)
                dq = _add_rows(dq, gq, qp.lo, qp.size)
                dk = _add_rows(dk, gk, kp.lo, kp.size)
                dv = _add_rows(dv, gv, kp.lo, kp.size)
                if dbias is not None:
                    dbias = _add_bias(P, dbias, gb, qp, kp, src)
                d_ops = add_ops(d_ops, g_ops, qp, kp, src)
        return dq, dk, dv, dbias, d_ops

    def body(carry, s):
        k, v, travel, dq, dk, dv, dbias, d_ops = carry
        k_next, v_next, travel_next = lax.ppermute((k, v, travel), P.axis_name, perm)
        dq, dk, dv, dbias, d_ops = step(s, k, v, travel, dq, dk, dv, dbias, d_ops)
        dk, dv = lax.ppermute((dk, dv), P.axis_name, perm)
        return (k_next, v_next, travel_next, dq, dk, dv, dbias, d_ops), None

    zeros = lambda x: None if x is None else varying_like(  # noqa: E731
        jnp.zeros(x.shape, F32), q, k, v, x)
    carry = (k, v, _travel(P, ops), zeros(q), zeros(k), zeros(v), zeros(bias4),
             tuple(zeros(ops[n]) for n in which))
    (k, v, travel, dq, dk, dv, dbias, d_ops), _ = lax.scan(body, carry, jnp.arange(N - 1))
    dq, dk, dv, dbias, d_ops = step(N - 1, k, v, travel, dq, dk, dv, dbias, d_ops)
    # dK/dV of device r + 1's keys: one more hop brings them home.
    dk, dv = lax.ppermute((dk, dv), P.axis_name, perm)

    dsinks = None
    if sinks is not None:
        delta = jnp.einsum("bthd,bthd->bht", out.astype(F32), d_out.astype(F32)) - d_lse
        dsinks = _online.sink_grad(sinks, lse, lse_lo, delta).astype(sinks.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if dbias is None else dbias.astype(bias4.dtype), dsinks,
            *(g.astype(ops[n].dtype) for n, g in zip(which, d_ops)))


