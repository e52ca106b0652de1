"""``dependent``: ``lax.platform_dependent`` whose branches are traced and
lowered for their own platform only.

``lax.platform_dependent`` traces every branch when it is called and, when a
function is lowered for several platforms at once (``jax.export(...,
platforms=("cpu", "cuda", "tpu"))``), lowers each branch it keeps *for every
one of those platforms*: a Pallas Triton kernel in the "cuda" branch is then
also lowered for the CPU ("Only interpret mode is supported on CPU backend")
and for the TPU (Mosaic refuses a Triton-style kernel: a bare
``AssertionError``). :func:`dependent` binds one primitive instead, with a
lowering rule per platform: the rule for platform ``p`` traces the branch of
``p`` (``mlir.lower_fun``) with ``p`` as the only lowering platform, so each
kernel is lowered for the platform it was written for, whatever the set of
platforms exported. A branch other than the default is traced only when
lowered for its platform: a CPU program never traces the GPU or TPU kernels
(nor computes their schedules), and a branch may raise
``NotImplementedError`` for what only its platform cannot do (symbolic sizes
that a kernel grid cannot take) without failing the others.

The output types come from the ``default`` branch, traced once when the
primitive is bound (and lowered from that trace); if the default refuses the
inputs (``NotImplementedError``), from the first branch that accepts them,
and the default raises only where it is lowered. Every branch must return
the same types (as for ``lax.platform_dependent``). ``vmap`` maps every
branch (under the vmap's axis name, which a collective in a branch may use)
and ``jvp`` differentiates every branch (forward mode only; a Pallas
branch cannot be differentiated anyway: fnattn differentiates around the
dispatch, never through it).

>>> import jax, jax.numpy as jnp
>>> f = lambda x: dependent(x, default=lambda x: x + 1.0, cuda=lambda x: x + 2.0)
>>> jax.jit(f)(jnp.zeros(2)).tolist()  # on a CPU: the default branch
[1.0, 1.0]
>>> exp = jax.export.export(jax.jit(f), platforms=("cpu", "cuda"))(jnp.zeros(2))
>>> exp.platforms
('cpu', 'cuda')
>>> jax.jit(jax.vmap(f))(jnp.zeros((3, 2))).shape
(3, 2)
>>> jax.jit(lambda x: jax.jvp(f, (x,), (2 * x,)))(jnp.ones(2))[1].tolist()
[2.0, 2.0]
"""

from typing import Callable

import jax
import jax.numpy as jnp
from jax import tree_util
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from fnattn import _jax_private

__all__ = ["axis_name_of", "dependent", "mixed_einsum"]

# Platforms with a rule of their own; any other platform lowers the default.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


class _Branches:
    """The branches of one call (compared by identity: a primitive parameter)."""

    def __init__(self, fns: dict, default: Callable, types_jaxpr, default_jaxpr,
                 needs_devices: bool = False):
        self.fns = fns                      # platform -> f(*flat) -> flat outputs
        self.default = default              # the same for the other platforms
        self.types_jaxpr = types_jaxpr      # a traced branch: the output types
        self.default_jaxpr = default_jaxpr  # the default, traced (None: it refused)
        self.needs_devices = needs_devices  # a branch's lowering needs the devices

    @property
    def prim(self):
        return _p_devices if self.needs_devices else _p

    def default_fn(self):
        if self.default_jaxpr is None:
            return self.default
        return jex_core.jaxpr_as_fun(self.default_jaxpr)


def _flat(fn, in_tree):
    def flat(*leaves):
        return tree_util.tree_leaves(fn(*tree_util.tree_unflatten(in_tree, leaves)))
    return flat


def dependent(*args, default: Callable, needs_devices: bool = False, **branches: Callable):
    """``branches[p](*args)`` when lowered for platform ``p``, ``default(*args)``
    for the platforms without a branch (the keywords of
    ``lax.platform_dependent``: "cpu", "cuda", "rocm", "tpu").

    ``needs_devices``: a branch calls something whose lowering needs the devices
    the program is lowered for (cuDNN's attention, a ``custom_partitioning``):
    ``jit`` cannot see inside a branch before lowering it, so it is told here
    (such a program cannot be lowered for an ``AbstractMesh``, as with that
    call made directly)."""
    for p in branches:
        if p not in PLATFORMS:
            raise ValueError(f"dependent: no platform {p!r}; one of {PLATFORMS}")
    leaves, in_tree = tree_util.tree_flatten(args)
    fns = {p: _flat(fn, in_tree) for p, fn in branches.items()}
    out_trees = []

    def traced(fn):
        def f(*leaves_):
            flat_out, out_tree = tree_util.tree_flatten(
                fn(*tree_util.tree_unflatten(in_tree, leaves_)))
            out_trees.append(out_tree)
            return flat_out
        return f

    refusals = []
    default_jaxpr = jaxpr = None
    for name, fn in (("default", default), *branches.items()):
        try:
            jaxpr = jax.make_jaxpr(traced(fn))(*leaves)
        except NotImplementedError as e:
            refusals.append((name, e))
            continue
        default_jaxpr = jaxpr if name == "default" else None
        break
    if jaxpr is None:
        if len(refusals) == 1:
            raise refusals[0][1]
        raise NotImplementedError("\n".join(
            f"{'other platforms' if name == 'default' else name}: {e}" for name, e in refusals))
    branches_ = _Branches(fns, _flat(default, in_tree), jaxpr, default_jaxpr, needs_devices)
    outs = branches_.prim.bind(*leaves, branches=branches_)
    return tree_util.tree_unflatten(out_trees[-1], outs)


_p = jex_core.Primitive("fnattn_platform_dependent")
_p.multiple_results = True
_p_devices = jex_core.Primitive("fnattn_platform_dependent_with_devices")
_p_devices.multiple_results = True


def _abstract_eval(*avals, branches):
    del avals
    # (the effects of a Pallas interpreter's branch: its ordered callbacks)
    return list(branches.types_jaxpr.out_avals), branches.types_jaxpr.effects


def _impl(*args, branches):
    # Eagerly: lowered for the platform of the default device, as under jit
    # (under jax.disable_jit() too, where a jit would bind the primitive again).
    with jax.disable_jit(False):
        return jax.jit(lambda *a: branches.prim.bind(*a, branches=branches))(*args)


def _rule(platform):
    def rule(ctx, *args, branches):
        if platform is None or platform not in branches.fns:
            fn = branches.default_fn()
        else:
            fn = _checked(branches.fns[platform], branches.types_jaxpr.out_avals, platform)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return rule


def _checked(fn, avals, platform):
    """``fn`` whose outputs must have the types ``avals`` (those of the default)."""
    def f(*args):
        outs = fn(*args)
        got = [(tuple(jax.typeof(o).shape), jax.typeof(o).dtype) for o in outs]
        want = [(tuple(a.shape), a.dtype) for a in avals]
        if [str(g) for g in got] != [str(w) for w in want]:
            raise TypeError(f"dependent: branches must have equal output types; the "
                            f"{platform!r} branch returned {got}, the default {want}")
        return outs
    return f


def axis_name_of(axis_data):
    """The axis name of the ``jax.vmap`` level a batching rule of
    ``batching.fancy_primitive_batchers`` is called for, or None for an unnamed
    one (fnattn's rules map their functions again under that name)."""
    return None if axis_data.name is _jax_private.get("no_axis_name") else axis_data.name


def _batch(axis_data, args, dims, *, branches):
    # Each branch mapped under a vmap of the same axis: its name too, so that a
    # collective in a branch (a psum, an axis_index) finds the axis of a
    # ``jax.vmap(..., axis_name=...)`` it is called under.
    name = axis_name_of(axis_data)
    axes = tuple(dims)  # (None: not mapped)
    if name is None and all(d is None for d in axes):
        # nothing mapped and no axis a collective could name (JAX 0.11 asks,
        # for the primal of a jacfwd): unmapped outputs
        outs = branches.prim.bind(*args, branches=branches)
        return list(outs), [None] * len(outs)

    def mapped(fn):
        return jax.vmap(fn, in_axes=axes, out_axes=0, axis_name=name,
                        axis_size=axis_data.size, spmd_axis_name=axis_data.spmd_name)

    others = {p: mapped(fn) for p, fn in branches.fns.items()}
    outs = dependent(*args, default=mapped(branches.default_fn()),
                     needs_devices=branches.needs_devices, **others)
    return list(outs), [0] * len(outs)


def _jvp(primals, tangents, *, branches):
    # The primal outputs from the primitive itself, the tangents from a second
    # one whose branches are each branch's jvp: forward mode works; reverse
    # mode would need a transpose of the second, which fnattn never asks for
    # (it differentiates around the dispatch).
    outs = branches.prim.bind(*primals, branches=branches)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    n = len(primals)

    def tangent_of(fn):
        return lambda *xs: jax.jvp(lambda *a: tuple(fn(*a)), xs[:n], xs[n:])[1]

    others = {p: tangent_of(fn) for p, fn in branches.fns.items()}
    return outs, list(dependent(*primals, *tangents, default=tangent_of(branches.default_fn()),
                                needs_devices=branches.needs_devices, **others))


for _prim in (_p, _p_devices):
    _prim.def_effectful_abstract_eval(_abstract_eval)
    _prim.def_impl(_impl)
    for _plat in PLATFORMS:
        mlir.register_lowering(_prim, _rule(_plat), platform=_plat)
    mlir.register_lowering(_prim, _rule(None))
    batching.fancy_primitive_batchers[_prim] = _batch
    ad.primitive_jvps[_prim] = _jvp
# ``jit`` keeps the devices when lowering a program that holds this one.
# (a jax without that set: the test of fnattn/_jax_private.py names it)
_jax_private.get("prim_requires_devices_during_lowering", set()).add(_p_devices)


def mixed_einsum(subscripts: str, a, b, acc):
    """``jnp.einsum(subscripts, a, b, preferred_element_type=acc)`` for operands
    in a narrower float dtype (bfloat16, float16) than ``acc``, on every platform.

    XLA's CPU runtime runs some such dots, depending on the operands' layouts
    after its transposes are folded in, in a thunk that takes no BF16 x BF16 =
    F32 ("UNIMPLEMENTED: Unsupported element type for DotThunk::Execute"): a
    batched product whose contracted axis is not the minor one, as the dense
    forward gets from "bhtd" inputs. On the CPU the operands are cast to
    ``acc`` first. The product of two bfloat16 or float16 values is exact in
    float32, so both forms sum the same terms; elsewhere the narrow operands
    go to the matrix units as they are. Forward mode and ``vmap`` only (as
    :func:`dependent`): for code fnattn differentiates around, never through.

    >>> import jax, jax.numpy as jnp
    >>> a = jnp.ones((2, 2, 8, 4), jnp.bfloat16)
    >>> f = lambda a: mixed_einsum("bhtd,bhsd->bhts", a, a, jnp.float32)
    >>> jax.jit(f)(a).dtype, float(jax.jit(f)(a)[0, 0, 0, 0])
    (dtype('float32'), 4.0)
    """
    def product(x, y):
        return jnp.einsum(subscripts, x, y, preferred_element_type=acc)

    if a.dtype == acc and b.dtype == acc:
        return product(a, b)
    return dependent(a, b, default=product,
                     cpu=lambda x, y: product(x.astype(acc), y.astype(acc)))
