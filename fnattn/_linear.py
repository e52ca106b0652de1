"""Derivatives of a fast lowering in both modes, from one pair of linear maps.

Every fnattn variant is a function ``y = f(x)`` (``x`` = q, k, v, bias, sinks,
``y`` = out, lse) computed by a kernel JAX cannot differentiate. Two linear
maps, evaluated at the *residuals* ``r`` (the inputs, the non-differentiable
operands and the forward's outputs), are all a derivative needs:

* the **tangent** ``T(r) : dx -> dy`` (forward mode: ``jvp``, ``linearize``,
  ``jacfwd``), a blockwise pass as cheap in memory as the forward;
* its **transpose** ``T(r)^T : dy -> dx``, which is the backward lowering that
  reverse mode has always run.

:func:`tangent` binds ``T`` as a primitive (``fnattn_tangent``) whose
transpose is the primitive ``fnattn_cotangent`` binding ``T^T`` (and back),
so a ``jax.custom_jvp`` whose tangent output is :func:`tangent` gives:

* forward mode: the tangent pass;
* reverse mode: JAX linearises through the ``custom_jvp`` and transposes the
  tangent primitive into the backward lowering, with the same residuals and
  the same kernels as a ``custom_vjp`` would run;
* ``vmap``: both primitives batch by tracing their maps under ``jax.vmap``
  (a linear operand that is not batched is broadcast, so that the transpose
  has the types it must return);
* higher order: the derivative of ``T(r) dx`` or ``T(r)^T dy`` with respect
  to the residuals comes from the rule's *smooth* form of ``f`` (plain JAX,
  differentiable any number of times; for attention the dense formulation,
  whose memory grows as Tq * Tk), the part linear in ``dx``/``dy`` from the
  primitives again. So ``jax.hessian``, grad of grad and
  forward-over-reverse work through every lowering.

A rule (:class:`Rule`) is a hashable object with the three methods. The maps
are traced to a jaxpr when the primitive is bound (``jax.make_jaxpr`` on the
values themselves, so types inside ``shard_map`` and under explicit
shardings are kept), and lowered with ``mlir.lower_fun``, so
``lax.platform_dependent`` inside a map chooses per platform as anywhere
else, also in a multi-platform ``jax.export``.
"""

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from fnattn import _platforms

__all__ = ["Rule", "tangent", "is_zero", "instantiate"]


class Rule:
    """The linear maps of one variant at one static configuration (hashable).

    ``res`` is a tuple of arrays (or None), ``lin`` the tuple of tangents of
    the differentiable inputs and ``cts`` the tuple of cotangents of the
    outputs, each in the order the variant chose.
    """

    def tangent(self, res: tuple, lin: tuple) -> tuple:
        """The output tangents, linear in ``lin``."""
        raise NotImplementedError

    def cotangent(self, res: tuple, cts: tuple) -> tuple:
        """The input cotangents (one per entry of ``lin``, None where the input
        is None), linear in ``cts``: the transpose of :meth:`tangent`."""
        raise NotImplementedError

    def smooth(self, res: tuple) -> tuple[Callable, tuple]:
        """``(f, x)``: the variant as plain JAX code that ``jax`` differentiates
        any number of times, and its differentiable inputs, taken from ``res``."""
        raise NotImplementedError

    # The smooth maps, for the derivatives of the fast ones with respect to ``res``.
    def smooth_tangent(self, res, lin):
        f, x = self.smooth(res)
        return tuple(jax.jvp(f, x, _zeros_for_none(x, lin))[1])

    def smooth_cotangent(self, res, cts):
        f, x = self.smooth(res)
        y, vjp = jax.vjp(f, *x)
        return tuple(vjp(tuple(jnp.zeros_like(o) if c is None else c
                               for o, c in zip(y, cts))))


def is_zero(t) -> bool:
    """Whether ``t`` is a symbolic zero tangent (a ``custom_jvp`` rule defined
    with ``symbolic_zeros=True`` sees inputs that are not differentiated so)."""
    return isinstance(t, jax.custom_derivatives.SymbolicZero)


def instantiate(primals, tangents) -> tuple:
    """``tangents`` with symbolic zeros made arrays of zeros typed like their
    primals (what a ``custom_jvp`` rule without ``symbolic_zeros`` receives)."""
    return tuple(jax.custom_derivatives.zero_from_primal(x) if is_zero(t) else t
                 for x, t in zip(primals, tangents))


def _zeros_for_none(x, lin):
    return tuple(None if xi is None else li for xi, li in zip(x, lin))


def tangent(rule: Rule, res: Sequence[Any], lin: Sequence[Any],
            like: Sequence[Any]) -> tuple:
    """``rule.tangent(res, lin)``, bound so that JAX can transpose it (into
    ``rule.cotangent``), batch it and differentiate it again.

    ``res`` and ``lin`` are flat tuples of arrays or None (an absent bias);
    ``like`` holds the primal outputs, whose types the tangents take. The
    result is the tuple ``rule.tangent`` returns (which must not hold None).

    >>> import jax, jax.numpy as jnp
    >>> class Scale(Rule):  # y = r * x, so dy = r * dx and dx = r * dy
    ...     def tangent(self, res, lin): return (res[0] * lin[0],)
    ...     def cotangent(self, res, cts): return (res[0] * cts[0],)
    ...     def smooth(self, res): return (lambda x: (res[0] * x,)), (res[1],)
    >>> @jax.custom_jvp
    ... def f(r, x): return r * x
    >>> @f.defjvp
    ... def f_jvp(primals, tangents):
    ...     r, x = primals
    ...     return f(r, x), tangent(Scale(), (r, x), (tangents[1],), (r * x,))[0]
    >>> jax.jit(jax.grad(f, argnums=1))(3.0, 2.0)
    Array(3., dtype=float32, weak_type=True)
    """
    return tuple(_bind(_TANGENT, rule, (), tuple(res), tuple(lin),
                       [jax.typeof(y) for y in like], [True] * len(like)))


# ----------------------------------------------------------------------------------
# The two primitives
# ----------------------------------------------------------------------------------

_TANGENT = jex_core.Primitive("fnattn_tangent")
_COTANGENT = jex_core.Primitive("fnattn_cotangent")
_TRANSPOSE = {_TANGENT: _COTANGENT, _COTANGENT: _TANGENT}


def _present(xs):
    return [x for x in xs if x is not None]


def _fill(arrays, keep):
    it = iter(arrays)
    return tuple(next(it) if k else None for k in keep)


def _function(prim, rule, vmaps, keep, smooth=False):
    """The map of ``prim`` as a function of the present arrays (residuals, then
    linear) returning its present outputs, under the recorded ``vmap`` levels
    (innermost first): ``vmaps[i]`` is ``(axes, name, spmd_name)``, the batch
    axis (0 or None) of each present residual at level i and the level's axis
    names (None where it has none), so that a collective inside the map
    (ring attention's ``ppermute``) finds the axis of a ``jax.vmap(...,
    axis_name=...)`` it was traced under; linear operands and outputs are
    batched along axis 0 at every level."""
    keep_res, keep_lin, keep_out = keep
    if prim is _TANGENT:
        fn = rule.smooth_tangent if smooth else rule.tangent
    else:
        fn = rule.smooth_cotangent if smooth else rule.cotangent
    n_res = sum(keep_res)

    def flat(*arrays):
        outs = fn(_fill(arrays[:n_res], keep_res), _fill(arrays[n_res:], keep_lin))
        # the outputs asked for (a tangent whose cotangent was absent is not)
        return tuple(_present(o if k else None for o, k in zip(outs, keep_out)))

    for axes, name, spmd_name in vmaps:
        flat = jax.vmap(flat, in_axes=tuple(axes) + (0,) * sum(keep_lin), axis_name=name,
                        spmd_axis_name=spmd_name)
    return flat


def _bind(prim, rule, vmaps, res, lin, out_avals, keep_out):
    """Binds ``prim`` on ``res`` and ``lin`` (tuples with None for absent
    operands); ``out_avals`` are the types of its present outputs and
    ``keep_out`` says which outputs are present.

    The tangent is traced only where it is evaluated or lowered: in reverse
    mode it is transposed away before that and costs no tracing at all. The
    cotangent (the backward, which reverse mode always runs) is traced here,
    once, on the values themselves, so that its types and effects (a Pallas
    interpreter's) are the primitive's."""
    keep = (tuple(x is not None for x in res), tuple(x is not None for x in lin),
            tuple(keep_out))
    args = _present(res) + _present(lin)
    callee = None
    if prim is _COTANGENT:
        callee = jax.make_jaxpr(_function(prim, rule, vmaps, keep))(*args)
    return prim.bind(*args, rule=rule, vmaps=tuple(vmaps), keep=keep,
                     out_avals=tuple(out_avals), callee=callee)


def _call(prim, *args, rule, vmaps, keep, out_avals, callee):
    if callee is not None:
        return jex_core.jaxpr_as_fun(callee)(*args)
    outs = _function(prim, rule, vmaps, keep)(*args)
    if len(outs) != len(out_avals) or any(
            o.shape != a.shape or o.dtype != a.dtype for o, a in zip(outs, out_avals)):
        raise AssertionError(
            f"{prim.name}: {type(rule).__name__} returned "
            f"{[(o.shape, o.dtype) for o in outs]}, declared {[a.str_short() for a in out_avals]}")
    return outs


def _abstract_eval(*args, out_avals, callee, **params):
    del args, params
    if callee is not None:
        return callee.out_avals, callee.effects
    return list(out_avals), jex_core.no_effects


def _transpose(prim, cts, *args, rule, vmaps, keep, out_avals, callee):
    del callee
    keep_res, keep_lin, keep_out = keep
    n_res = sum(keep_res)
    res, lin = args[:n_res], args[n_res:]
    if any(ad.is_undefined_primal(x) for x in res):
        raise NotImplementedError(
            f"{prim.name}: transposing with respect to a residual (an input the map is not "
            "linear in)")
    # zeros where JAX holds a symbolic zero (typed like the output: inside
    # shard_map, varying over the same mesh axes)
    if prim is _TANGENT and getattr(rule, "absent_zero_cotangents", False):
        # the rule's cotangent takes None for a zero cotangent
        cts = [None if type(ct) is ad.Zero else ct for ct in cts]
    else:
        cts = [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cts]
    lin_avals = [x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in lin]
    back = _bind(_TRANSPOSE[prim], rule, vmaps, _fill(res, keep_res), _fill(cts, keep_out),
                 lin_avals, keep_lin)
    return [None] * n_res + [ct if ad.is_undefined_primal(x) else None
                             for x, ct in zip(lin, back)]


def _batch(prim, axis_data, args, dims, *, rule, vmaps, keep, out_avals, callee):
    keep_res, keep_lin, keep_out = keep
    n_res = sum(keep_res)
    name = _platforms.axis_name_of(axis_data)
    if name is None and all(d is None for d in dims):
        # nothing batched and no axis a collective could name: the map as it is
        outs = prim.bind(*args, rule=rule, vmaps=vmaps, keep=keep, out_avals=out_avals,
                         callee=callee)
        return outs, [None] * len(outs)
    size = axis_data.size

    def front(x, d):
        return jnp.moveaxis(x, d, 0) if d != 0 else x

    res = [x if d is None else front(x, d) for x, d in zip(args[:n_res], dims[:n_res])]
    axes = tuple(None if d is None else 0 for d in dims[:n_res])
    # Linear operands are always batched: their cotangents then have the
    # batched types the transpose must return (JAX sums them back).
    lin = [jnp.broadcast_to(x, (size,) + x.shape) if d is None else front(x, d)
           for x, d in zip(args[n_res:], dims[n_res:])]
    level = (axes, name, axis_data.spmd_name)
    outs = _bind(prim, rule, vmaps + (level,), _fill(res, keep_res), _fill(lin, keep_lin),
                 [jex_core.unmapped_aval(size, 0, a) for a in out_avals], keep_out)
    return outs, [0] * len(outs)


def _jvp(prim, primals, tangents, *, rule, vmaps, keep, out_avals, callee):
    keep_res, keep_lin, keep_out = keep
    n_res = sum(keep_res)
    outs = prim.bind(*primals, rule=rule, vmaps=vmaps, keep=keep, out_avals=out_avals,
                     callee=callee)
    res, lin = list(primals[:n_res]), list(primals[n_res:])
    res_dot, lin_dot = tangents[:n_res], tangents[n_res:]
    parts = []
    if any(type(t) is not ad.Zero for t in lin_dot):
        # linear in lin: the map itself, on the tangents
        lin_dot = [ad.instantiate_zeros(t) if type(t) is ad.Zero else t for t in lin_dot]
        parts.append(_bind(prim, rule, vmaps, _fill(res, keep_res), _fill(lin_dot, keep_lin),
                           out_avals, keep_out))
    moving = [i for i, (x, t) in enumerate(zip(res, res_dot))
              if type(t) is not ad.Zero and jnp.issubdtype(x.dtype, jnp.inexact)]
    if moving:
        # with respect to the residuals: the smooth form, differentiated by JAX
        smooth = _function(prim, rule, vmaps, keep, smooth=True)

        def of_res(*moved):
            full = list(res)
            for i, x in zip(moving, moved):
                full[i] = x
            return smooth(*full, *lin)

        _, t = jax.jvp(of_res, tuple(res[i] for i in moving),
                       tuple(res_dot[i] for i in moving))
        parts.append(list(t))
    if not parts:
        return outs, [ad.Zero(a.to_tangent_aval()) for a in out_avals]
    total = list(parts[0])
    for p in parts[1:]:
        total = [a + b.astype(a.dtype) for a, b in zip(total, p)]
    return outs, total


for _p in (_TANGENT, _COTANGENT):
    _p.multiple_results = True
    _p.def_impl(functools.partial(_call, _p))
    _p.def_effectful_abstract_eval(_abstract_eval)
    mlir.register_lowering(_p, mlir.lower_fun(functools.partial(_call, _p),
                                              multiple_results=True))
    ad.primitive_jvps[_p] = functools.partial(_jvp, _p)
    ad.primitive_transposes[_p] = functools.partial(_transpose, _p)
    # the axis data (its name) too: a map may hold collectives over a vmap's axis
    batching.fancy_primitive_batchers[_p] = functools.partial(_batch, _p)
