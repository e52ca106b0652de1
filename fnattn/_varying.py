"""Types of per-device values inside ``jax.shard_map``.

With ``shard_map``'s default ``check_vma=True``, every value carries the set of
mesh axes it varies over, and three places in fnattn must state it:

* a loop's initial carry built from constants must vary like the values the
  loop body mixes into it (:func:`varying_like`);
* a derivative's cotangents must vary like its primal inputs, so fnattn
  makes the differentiable inputs vary alike before each ``custom_jvp`` (the
  transpose of that broadcast sums the gradient of a replicated input over the
  axes it was replicated along, as plain JAX code would);
* a ``pallas_call``'s ``out_shape`` must say how its outputs vary
  (:func:`out_shapes`, applied by :func:`pallas_call` to every kernel call).

Outside ``shard_map`` these functions change nothing.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

__all__ = ["inside_shard_map", "out_shapes", "pallas_call", "varying_axes", "varying_like"]


def inside_shard_map() -> bool:
    """Whether this trace is inside ``jax.shard_map`` (some mesh axis is manual).

    >>> inside_shard_map()
    False
    """
    return bool(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def varying_axes(x) -> frozenset:
    """The mesh axes the array ``x`` varies over inside ``jax.shard_map`` (empty
    outside it, and under ``check_vma=False``, where JAX does not track them).

    The set has had more than one home across JAX releases (``aval.vma``, or
    ``aval.manual_axis_type.varying``); whichever the running JAX has is read.

    >>> import jax.numpy as jnp
    >>> varying_axes(jnp.ones(3))
    frozenset()
    """
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def varying_like(init, *refs):
    """``init`` (a pytree of arrays) made to vary over every mesh axis that any
    array in ``refs`` varies over.

    ``full_like`` keeps the varying axes of its argument, so adding a zero made
    from every ref gives a leaf their union, through public API on every JAX
    version. A leaf whose type does not change is returned as it is (outside
    ``shard_map``: every leaf), so nothing is added to the computation.

    >>> import jax.numpy as jnp
    >>> x = jnp.zeros(3)
    >>> varying_like(x, jnp.ones(2)) is x
    True
    """
    leaves = jax.tree_util.tree_leaves(refs)
    if not leaves or not inside_shard_map():
        # Outside shard_map nothing varies. (Nor is full_like asked for a
        # scalar like an array whose sharding names its axes: outside jit,
        # under an Explicit mesh, jax would give the scalar that sharding.)
        return init
    zero = functools.reduce(lambda a, b: a + b,
                            [lax.full_like(r, 0, jnp.float32, ()) for r in leaves])

    def cast(x):
        y = x + zero.astype(x.dtype)
        return y if jax.typeof(y) != jax.typeof(x) else x

    return jax.tree_util.tree_map(cast, init)


def out_shapes(structs, *refs):
    """``structs`` (a pytree of ``jax.ShapeDtypeStruct``) typed to vary like the
    union of ``refs``; unchanged when that union is empty.

    The field that carries the varying axes has had more than one name across
    JAX releases; whichever the running JAX's ``ShapeDtypeStruct`` accepts is
    used.

    >>> import jax, jax.numpy as jnp
    >>> out_shapes([jax.ShapeDtypeStruct((2, 3), jnp.float32)], jnp.ones(4))
    [ShapeDtypeStruct(shape=(2, 3), dtype=float32)]
    """
    plain = jnp.zeros((), jnp.float32)
    probe = varying_like(plain, *refs)
    if probe is plain:
        return structs
    aval = jax.typeof(probe)

    def typed(s):
        for name in ("manual_axis_type", "vma"):
            value = getattr(aval, name, None)
            if value is None:
                continue
            try:
                return jax.ShapeDtypeStruct(s.shape, s.dtype, **{name: value})
            except TypeError:
                continue
        return s

    return jax.tree_util.tree_map(typed, structs)


def pallas_call(kernel, *, out_shape, **kwargs):
    """``pl.pallas_call`` whose outputs vary like the union of its inputs.

    Every fnattn kernel call goes through this, so the kernels run inside
    ``jax.shard_map`` with its default ``check_vma=True``.
    """
    def call(*args):
        return pl.pallas_call(kernel, out_shape=out_shapes(out_shape, *args), **kwargs)(*args)
    return call
