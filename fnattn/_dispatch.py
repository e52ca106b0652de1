"""One ``custom_vjp`` around the choice of lowering.

A *lowering* is a pair of functions::

    fwd(cfg, q, k, v, bias, sinks, mask, seed) -> (out, lse, lse_lo)
    bwd(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse)
        -> (dq, dk, dv, dbias, dsinks)

on "bthd" inputs, with ``out`` in q's dtype and ``lse`` and ``lse_lo`` float32
(B, Hq, Tq), so that every branch has the same output types. ``lse_lo`` is the
rounding error of ``lse`` (see :func:`fnattn._online.lse_parts`): the pair
``lse + lse_lo`` is ``m + log(l)`` to twice float32's precision, so that a
backward that recomputes probabilities as ``exp((s - lse) - lse_lo)`` stays
exact when ``|lse|`` is so large (a row of -1e30 bias) that ``exp(s - lse)``
alone would be off by a factor up to ``exp(ulp(lse) / 2)``. Only ``out`` and
``lse`` reach the user; ``lse_lo`` is a residual of the backward. A *table* maps platform names
("default", "cuda", "rocm", "tpu", "cpu") to lowerings; at trace time
``jax.lax.platform_dependent`` traces every branch and lowering for a platform
keeps one. The forward and the backward are each one ``platform_dependent``,
inside a single ``custom_vjp``, which is what makes ``jit``, ``grad``, ``vmap``,
``checkpoint`` and ``scan`` compose with Pallas kernels. Under ``jit`` with
inputs sharded along the batch or the heads, each of them runs on every device
on its own batch rows and heads (:mod:`fnattn._partition`), with no collective;
``_select`` itself (what code inside ``shard_map`` calls) is never split.
"""

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
from jax import lax

from fnattn import _partition
from fnattn._checks import Dims
from fnattn._varying import varying_like


@dataclasses.dataclass(frozen=True)
class Lowering:
    """A forward and a backward implementation of one variant on one platform."""

    name: str
    fwd: Callable
    bwd: Callable


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

    def mask(self, leaves):
        return jax.tree_util.tree_unflatten(self.mask_treedef, leaves)


def select(table, cfg, *args):
    """Calls ``fn(cfg, *args)`` of the platform being lowered for.

    ``table`` holds (platform, fn) pairs with a "default" entry; with only that
    entry it is called directly, otherwise ``lax.platform_dependent`` traces every
    entry and lowering keeps one. Shared by every variant's dispatch.
    """
    branches = {plat: functools.partial(fn, cfg) for plat, fn in table}
    if "default" not in branches:
        raise ValueError(
            f"lowering table {[plat for plat, _ in table]} has no 'default' entry; every "
            "table needs one for the platforms without their own lowering")
    default = branches.pop("default")
    if not branches:
        return default(*args)
    return lax.platform_dependent(*args, default=default, **branches)


def _select(table, fn_name, cfg, *args):
    if all(plat != "default" for plat, _ in table):
        raise ValueError(
            f"lowering table {[(plat, low.name) for plat, low in table]} has no 'default' "
            "entry; every table needs one for the platforms without their own lowering")
    return select(tuple((plat, getattr(low, fn_name)) for plat, low in table), cfg, *args)


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
    bias and sinks.

    Inside ``jax.shard_map`` the differentiable inputs are first made to vary
    over the same mesh axes (:func:`fnattn._varying.varying_like`): the
    gradients then have the types the ``custom_vjp`` must return, and the
    gradient of an input that was replicated along an axis is summed over it
    (the transpose of that broadcast), as plain JAX code would have it.
    """
    q, k, v, bias, sinks = varying_like((q, k, v, bias, sinks), q, k, v, bias, sinks,
                                        mask_leaves, seed)
    return _attend(table, cfg, q, k, v, bias, sinks, mask_leaves, seed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(table, cfg, q, k, v, bias, sinks, mask_leaves, seed):
    out, lse, _ = _select_split(table, "fwd", cfg, q, k, v, bias, sinks, mask_leaves, seed)
    return out, lse


def _attend_fwd(table, cfg, q, k, v, bias, sinks, mask_leaves, seed):
    out, lse, lse_lo = _select_split(table, "fwd", cfg, q, k, v, bias, sinks, mask_leaves,
                                     seed)
    return (out, lse), (q, k, v, bias, sinks, mask_leaves, seed, out, lse, lse_lo)


def _attend_bwd(table, cfg, res, cotangents):
    q, k, v, bias, sinks, mask_leaves, seed, out, lse, lse_lo = res
    d_out, d_lse = cotangents
    dq, dk, dv, dbias, dsinks = _select_split(table, "bwd", cfg, q, k, v, bias, sinks,
                                              mask_leaves, seed, out, lse, lse_lo, d_out, d_lse)
    none_like = jax.tree_util.tree_map(lambda _: None, mask_leaves)
    return (dq, dk, dv, dbias, dsinks, none_like, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.lru_cache(maxsize=None)
def _wrap(table):
    return tuple((plat, Lowering(low.name, _with_mask(low.fwd), _with_mask(low.bwd)))
                 for plat, low in table)
