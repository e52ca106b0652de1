"""One ``custom_jvp`` around the choice of lowering.

A *lowering* is a forward, a backward and a tangent pass::

    fwd(cfg, q, k, v, bias, sinks, mask, seed) -> (out, lse, lse_lo)
    bwd(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse)
        -> (dq, dk, dv, dbias, dsinks)
    jvp(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo,
        tq, tk, tv, tbias, tsinks) -> (t_out, t_lse)

on "bthd" inputs (with ``cfg.term_grad``, the indices of the mask leaves
being differentiated, a position term's arrays: ``jvp`` takes their tangents
after ``tsinks`` and ``bwd`` returns their cotangents after ``dsinks``), with
``out`` in q's dtype and ``lse`` and ``lse_lo`` float32
(B, Hq, Tq), so that every branch has the same output types. ``lse_lo`` is the
rounding error of ``lse`` (see :func:`fnattn._online.lse_parts`): the pair
``lse + lse_lo`` is ``m + log(l)`` to twice float32's precision, so that a
backward that recomputes probabilities as ``exp((s - lse) - lse_lo)`` stays
exact when ``|lse|`` is so large (a row of -1e30 bias) that ``exp(s - lse)``
alone would be off by a factor up to ``exp(ulp(lse) / 2)``. Only ``out`` and
``lse`` reach the user; ``lse_lo`` is a residual of the backward. A *table*
maps platform names ("default", "cuda", "rocm", "tpu", "cpu") to lowerings;
:func:`fnattn._platforms.dependent` (a ``lax.platform_dependent`` whose
branches are traced and lowered only for their own platform) chooses one per
platform when the program is lowered.

**Derivatives.** The forward is one platform choice inside a single
``jax.custom_jvp``. Its tangent is :func:`fnattn._linear.tangent` of
:class:`Derivatives`: a primitive running the ``jvp`` pass, whose transpose
is the ``bwd`` pass (again one platform choice). So forward mode
(``jvp``, ``linearize``, ``jacfwd``) runs the tangent pass; reverse mode
linearises, transposes the tangent away without tracing it, and runs the
backward kernels with the residuals a ``custom_vjp`` would keep; second-order
derivatives differentiate the dense formulation. ``jit``, ``vmap``,
``checkpoint``, ``scan`` and ``shard_map`` compose with all of it. Under
``jit`` with inputs sharded along the batch or the heads, each pass runs on
every device on its own batch rows and heads (:mod:`fnattn._partition`),
with no collective; ``_select`` itself (what code inside ``shard_map``
calls) is never split.
"""

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from fnattn import _linear, _partition, _platforms, position_bias
from fnattn._checks import Dims
from fnattn._varying import varying_like


@dataclasses.dataclass(frozen=True)
class Lowering:
    """A forward and a backward implementation of one variant on one platform."""

    name: str
    fwd: Callable
    bwd: Callable
    jvp: Optional[Callable] = None
    # The backward takes None for a cotangent of ``out`` or ``lse`` that is zero
    # (the program does not use that output); others get arrays of zeros.
    takes_absent_cotangents: bool = False
    # ``needs_devices(cfg, q, k, v, bias, sinks, mask, seed, *rest)``: whether the
    # call's lowering needs the devices (see :func:`fnattn._platforms.dependent`).
    needs_devices: Optional[Callable] = None


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration handed to every lowering (hashable)."""

    dims: Dims
    scale: float
    softcap: Optional[float]
    dropout_rate: float
    mask_treedef: Any
    block_sizes: Any = None
    q_offset: Optional[int] = None
    # Indices of the mask leaves (a position term's arrays, such as ALiBi's
    # slopes) being differentiated: the tangent pass then takes their tangents
    # after those of (q, k, v, bias, sinks), and the backward returns their
    # cotangents after (dq, dk, dv, dbias, dsinks). Set only by the derivative
    # rule, for the derivatives that need them.
    term_grad: tuple = ()

    def mask(self, leaves):
        return jax.tree_util.tree_unflatten(self.mask_treedef, leaves)


def select(table, cfg, *args, needs_devices=False):
    """Calls ``fn(cfg, *args)`` of the platform being lowered for.

    ``table`` holds (platform, fn) pairs with a "default" entry; with only that
    entry it is called directly, otherwise :func:`fnattn._platforms.dependent`
    lowers each platform's entry for it (tracing it only then). Shared by every
    variant's dispatch.
    """
    branches = {plat: functools.partial(fn, cfg) for plat, fn in table}
    if "default" not in branches:
        raise ValueError(
            f"lowering table {[plat for plat, _ in table]} has no 'default' entry; every "
            "table needs one for the platforms without their own lowering")
    default = branches.pop("default")
    if not branches:
        return default(*args)
    return _platforms.dependent(*args, default=default, needs_devices=needs_devices,
                                **branches)


def _select(table, fn_name, cfg, *args):
    if all(plat != "default" for plat, _ in table):
        raise ValueError(
            f"lowering table {[(plat, low.name) for plat, low in table]} has no 'default' "
            "entry; every table needs one for the platforms without their own lowering")
    needs = any(low.needs_devices is not None and low.needs_devices(cfg, *args)
                for _, low in table)
    return select(tuple((plat, getattr(low, fn_name)) for plat, low in table), cfg, *args,
                  needs_devices=needs)


def _select_split(table, fn_name, cfg, *args):
    """``_select`` run by every device on its batch rows and heads when the
    inputs are sharded along them under ``jit`` (:mod:`fnattn._partition`);
    exactly ``_select`` on one device, inside ``shard_map`` and under ``vmap``."""
    return _partition.flash(functools.partial(_select, _wrap(table), fn_name), cfg, *args)


def _with_mask(fn):
    @functools.wraps(fn)
    def wrapped(cfg, q, k, v, bias, sinks, mask_leaves, seed, *rest):
        return fn(cfg, q, k, v, bias, sinks, cfg.mask(mask_leaves), seed, *rest)
    return wrapped


def attend(table, cfg, q, k, v, bias, sinks, mask_leaves, seed):
    """``(out, lse)`` of the lowering ``table`` picks, differentiable in q, k, v,
    bias, sinks and the arrays of a position term riding with the mask
    (ALiBi's slopes: ``Config.term_grad``).

    Inside ``jax.shard_map`` the differentiable inputs are first made to vary
    over the same mesh axes (:func:`fnattn._varying.varying_like`): the
    cotangents then have the types the backward must return, and the
    gradient of an input that was replicated along an axis is summed over it
    (the transpose of that broadcast), as plain JAX code would have it.
    """
    q, k, v, bias, sinks = varying_like((q, k, v, bias, sinks), q, k, v, bias, sinks,
                                        mask_leaves, seed)
    # (and so do a position term's arrays, which take gradients too)
    terms = position_bias.term_leaves(cfg.mask(mask_leaves))
    if terms:
        leaves = list(mask_leaves)
        for i, x in zip(terms, varying_like(tuple(leaves[i] for i in terms), q, k, v)):
            leaves[i] = x
        mask_leaves = tuple(leaves)
    out, lse, _ = _attend(table, cfg, q, k, v, bias, sinks, mask_leaves, seed)
    return out, lse


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _attend(table, cfg, q, k, v, bias, sinks, mask_leaves, seed):
    return _select_split(table, "fwd", cfg, q, k, v, bias, sinks, mask_leaves, seed)


def _attend_jvp(table, cfg, primals, tangents):
    q, k, v, bias, sinks, mask_leaves, seed = primals
    # the primal through _attend itself, so that a derivative of this rule
    # (second order) comes back here instead of differentiating a kernel
    out, lse, lse_lo = _attend(table, cfg, *primals)
    res = (q, k, v, bias, sinks, seed, out, lse, lse_lo, *mask_leaves)
    lin = _linear.instantiate(primals[:5], tangents[:5])
    # A position term's arrays (ALiBi's slopes) are differentiated only when
    # asked (a tangent that is not a symbolic zero): the passes then carry
    # them (Config.term_grad). A mask's own arrays select keys: their
    # derivative is zero.
    terms = position_bias.term_leaves(cfg.mask(mask_leaves))
    which = tuple(i for i in terms if not _linear.is_zero(tangents[5][i]))
    other = [i for i, t in enumerate(tangents[5]) if i not in terms and not _linear.is_zero(t)
             and jnp.issubdtype(jnp.result_type(mask_leaves[i]), jnp.floating)]
    if other:
        raise NotImplementedError(
            f"differentiating with respect to float arrays of the mask ({cfg.mask_treedef}) "
            "is not implemented here; only a position term's arrays (ALiBi's slopes) "
            "riding with the spec's mask are differentiated")
    if which:
        cfg = dataclasses.replace(cfg, term_grad=which)
        lin += tuple(tangents[5][i] for i in which)
    t_out, t_lse = _linear.tangent(Derivatives(table, cfg), res, lin, (out, lse))
    # lse_lo is a rounding error, a residual only: no tangent of its own
    return (out, lse, lse_lo), (t_out, t_lse, jnp.zeros_like(lse_lo))


_attend.defjvp(_attend_jvp, symbolic_zeros=True)


@dataclasses.dataclass(frozen=True)
class Derivatives(_linear.Rule):
    """The tangent and cotangent maps of a flash or dense lowering table.

    Residuals ``(q, k, v, bias, sinks, seed, out, lse, lse_lo, *mask_leaves)``;
    tangents of ``(q, k, v, bias, sinks)``; cotangents of ``(out, lse)``. The
    tangent is each lowering's ``jvp``, the cotangent its ``bwd`` (what
    reverse mode runs), and derivatives of either with respect to the
    residuals (second order) come from the dense formulation.
    """

    table: Any
    cfg: Config
    # A zero cotangent of ``out`` or ``lse`` reaches ``cotangent`` as None
    # (:func:`fnattn._linear.tangent`): a backward that cannot take an lse
    # cotangent (cuDNN's) then knows it has none.
    absent_zero_cotangents = True

    def tangent(self, res, lin):
        q, k, v, bias, sinks, seed, out, lse, lse_lo, *mask_leaves = res
        return _select_tangent(self.table, self.cfg, q, k, v, bias, sinks, tuple(mask_leaves),
                               seed, out, lse, lse_lo, *lin)

    def cotangent(self, res, cts):
        q, k, v, bias, sinks, seed, out, lse, lse_lo, *mask_leaves = res
        return tuple(_select_split(self.table, "bwd", self.cfg, q, k, v, bias, sinks,
                                   tuple(mask_leaves), seed, out, lse, lse_lo, *cts))

    def smooth(self, res):
        from fnattn import xla  # (fnattn.xla builds on this module)
        q, k, v, bias, sinks, seed, _, _, _, *mask_leaves = res
        dense, x = xla.differentiable(self.cfg, self.cfg.mask(mask_leaves), seed,
                                      q, k, v, bias, sinks)
        acc = jnp.promote_types(jnp.float32, q.dtype)

        def f(*xs):
            out, lse = dense(*[None if x is None else x.astype(acc) for x in xs])
            return out.astype(q.dtype), lse.astype(jnp.float32)

        return f, x


def _select_tangent(table, cfg, *args):
    """The tangent pass of the lowering ``table`` picks: one call when every
    platform shares it (the blockwise XLA pass of the flash tables), a
    ``platform_dependent`` choice otherwise."""
    table = _wrap(table)
    missing = [low.name for _, low in table if low.jvp is None]
    if missing:
        raise NotImplementedError(
            f"forward-mode differentiation (jvp) is not implemented by the lowerings "
            f"{missing}; the flash lowerings (impl='auto', 'xla', 'pallas') and the dense "
            "one (fnattn.attention with impl='xla') implement it")
    fns = {low.jvp for _, low in table}
    if len(fns) == 1:
        fn = fns.pop()
    else:
        fn = functools.partial(select, tuple((plat, low.jvp) for plat, low in table))
    return _partition.flash(fn, cfg, *args)


@functools.lru_cache(maxsize=None)
def _wrap(table):
    return tuple((plat, Lowering(low.name, _with_mask(low.fwd),
                                 _with_mask(low.bwd if low.takes_absent_cotangents
                                            else _zero_cotangents(low.bwd)),
                                 _with_mask_cached(low.jvp), True,
                                 None if low.needs_devices is None
                                 else _with_mask(low.needs_devices)))
                 for plat, low in table)


def _zero_cotangents(bwd):
    """``bwd`` given arrays of zeros for the cotangents that are None."""
    @functools.wraps(bwd)
    def wrapped(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse):
        if d_out is None:
            d_out = jnp.zeros_like(out)
        if d_lse is None:
            d_lse = jnp.zeros_like(lse)
        return bwd(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse)
    return wrapped


@functools.lru_cache(maxsize=None)
def _with_mask_cached(fn):
    # one wrapper per function, so that platforms sharing a tangent pass share it
    return None if fn is None else _with_mask(fn)
