"""What each Pallas lowering can compile of a user's functions.

A ``masks.from_fn`` predicate and a ``position_bias.from_fn`` term are
arbitrary ``jnp`` code, evaluated on every tile inside the kernels. Each
Pallas backend lowers its own set of primitives (Triton has no ``erf`` or
``round``; Mosaic TPU no ``expm1``, ``atan`` or ``cosh``; Mosaic GPU none of
``log1p``, ``sqrt``, ``pow``, ``floor``, ``ceil``, ``expm1``, the
trigonometric functions past sin and cos, nor a ``custom_jvp`` function such
as ``jax.nn.relu``). So a kernel checks, at trace time, the primitives of
every such function of the spec (traced once on tile-shaped indices, the
function's gradient with respect to a term's arrays included) against the
set its backend was tested to lower (``tests/test_functions.py`` lowers each
set in the flash kernels for cuda and tpu). impl="auto" then sends a call it
cannot compile to a lowering that can (the XLA one computes any function);
naming the kernel (impl="pallas", or its block sizes) raises
``NotImplementedError`` naming the function and the primitive.

>>> import jax.numpy as jnp
>>> from fnattn import masks, position_bias
>>> kerple = position_bias.from_fn(
...     lambda b, h, q, k, r: -r * jnp.log1p(jnp.abs(q - k)), jnp.ones(4))
>>> m = position_bias.attach(masks.causal(), kerple)
>>> refusals(m, TRITON)
[]
>>> refusals(m, MOSAIC_GPU)  # doctest: +ELLIPSIS
['the position term from_fn(<lambda>, ...) uses log1p, which the Pallas Mosaic GPU ...']
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fnattn import masks, position_bias

__all__ = ["Backend", "MOSAIC_GPU", "MOSAIC_TPU", "TRITON", "config_refusals", "primitives",
           "refusals", "refuse"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """A Pallas backend: the primitives it lowers inside a kernel's tile code.

    ``bool_not``: whether it lowers ``not`` of booleans (Mosaic GPU's layouts
    take no 1-bit registers there). ``gradient``: how its backward kernels
    differentiate a term in its learned arrays: "vjp" (a sum over the tile of
    the cotangent) or "jvp" (the term's tangent tile, summed along the query
    rows by the kernel)."""

    name: str
    allowed: frozenset
    bool_not: bool = True
    gradient: str = "vjp"


# Elementwise primitives every backend lowers on tiles (and scalars broadcast
# to tiles, as masks.tile_args gives them), with ``jit`` around any of them.
_COMMON = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "clamp", "convert_element_type",
    "cos", "div", "eq", "exp", "exp2", "ge", "gt", "integer_pow", "jit", "le", "log",
    "log2", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or", "pjit",
    "rem", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "square", "sub", "tanh", "xor"})

# What the gradient of a term's arrays adds (a sum over the tile; jax 0.11
# differentiates tanh with one_minus_square): the backward kernels that sum it.
_GRADIENT = frozenset({"add_any", "one_minus_square", "reduce_sum"})

TRITON = Backend("Pallas Triton kernels", _COMMON | _GRADIENT | {
    "atan", "ceil", "cosh", "custom_jvp_call", "expm1", "floor", "log1p", "pow", "sinh",
    "sqrt", "tan"})
MOSAIC_TPU = Backend("Pallas Mosaic TPU kernels", _COMMON | _GRADIENT | {
    "ceil", "custom_jvp_call", "erf", "floor", "log1p", "pow", "round", "sqrt", "tan"})
# The common set (whose every member the Triton forward, which recomputes the
# Mosaic GPU forward's flagged blocks, also lowers; sqrt is left out: it lowers
# under jax 0.11 only). Its backward differentiates a learned term in forward
# mode (no sum over the tile), and lowers no add_any, the sum of the tangents
# of an array's value used more than once in the function: such a term's
# learned arrays take the Triton backward.
MOSAIC_GPU = Backend("Pallas Mosaic GPU kernels", _COMMON | {"one_minus_square"},
                     bool_not=False, gradient="jvp")


# Rewrites in operations every backend compiles, named in a refusal.
_REWRITES = {
    "custom_jvp_call": "jnp.maximum(x, 0.0) for jax.nn.relu(x)",
    "expm1": "jnp.exp(x) - 1.0 for expm1",
    "log1p": "jnp.log(1.0 + x) for log1p",
    "not (of booleans)": "jnp.logical_xor(x, True) for ~x",
    "pow": "jnp.exp2(y * jnp.log2(x)) for x ** y with x > 0",
    "sqrt": "x * lax.rsqrt(x) for sqrt(x) with x > 0",
}


def _functions(node):
    """The ``from_fn`` predicates and terms inside a mask (or a mask rebuilt from
    its treedef), as ``(what, node)`` pairs."""
    if node is None:
        return []
    if isinstance(node, (list, tuple)):
        return [f for part in node for f in _functions(part)]
    if isinstance(node, masks.Canonical):
        return _functions(node._inner())
    if isinstance(node, masks.FromFn):
        return [("the mask predicate", node)]
    if isinstance(node, position_bias.FromFn):
        return [("the position term", node)]
    found = []
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            child = getattr(node, f.name)
            if isinstance(child, (masks.Mask, position_bias.PositionBias)):
                found += _functions(child)
    return found


def _walk(jaxpr, out: set):
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "not" and any(getattr(v.aval, "dtype", None) == jnp.bool_
                                 for v in eqn.invars):
            name = "not (of booleans)"
        elif eqn.params.get("accuracy") is not None:
            # (jax 0.12 differentiates erf with an exp of HIGHEST accuracy, which
            # Mosaic TPU does not lower: no set holds these names)
            name = f"{name} (accuracy {getattr(eqn.params['accuracy'], 'name', 'set')})"
        out.add(name)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _walk(inner, out)


def primitives(node, gradient=None) -> frozenset:
    """The primitives a ``from_fn`` predicate or term computes on a kernel's tile
    (with ``gradient``, "vjp" or "jvp" (:attr:`Backend.gradient`), a term's
    derivative in its arrays too, which the backward kernels sum when they are
    learned), traced once per function on scalar batch and head indices and
    (8, 1) query and (1, 128) key indices. A function that fails to trace
    there gives ``{"<untraceable>"}``.

    >>> import jax.numpy as jnp
    >>> sorted(primitives(masks.from_fn(lambda b, h, q, k: k <= q + h)))
    ['add', 'broadcast_in_dim', 'le']
    """
    if isinstance(node, masks.FromFn):
        return _primitives(masks.FromFn, node.fn, 0, None)
    return _primitives(position_bias.FromFn, node.fn, len(node.arrays), gradient or None)


@functools.lru_cache(maxsize=256)
def _primitives(kind, fn, n, gradient) -> frozenset:
    node = kind(fn) if kind is masks.FromFn else kind(fn, (jnp.zeros(1),) * n)
    i32 = jnp.int32
    pos = masks.Positions(b=jax.ShapeDtypeStruct((), i32), h=jax.ShapeDtypeStruct((), i32),
                          q=jax.ShapeDtypeStruct((8, 1), i32),
                          q_pos=jax.ShapeDtypeStruct((8, 1), i32),
                          k=jax.ShapeDtypeStruct((1, 128), i32))
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    if isinstance(node, masks.FromFn):
        traced, args = (lambda p: node.predicate(p, ())), (pos,)
    else:
        def traced(p, *values):
            value = node.value(p, values)
            if not (values and gradient):
                return value
            if gradient == "jvp":  # the tangent tile in each value
                def at(j, x):
                    return node.value(p, values[:j] + (x,) + values[j + 1:])
                return value, [jax.jvp(functools.partial(at, j), (values[j],),
                                       (jnp.ones_like(values[j]),))[1]
                               for j in range(len(values))]
            _, back = jax.vjp(lambda *v: node.value(p, v), *values)
            return value, back(jnp.ones_like(value))

        args = (pos,) + (scalar,) * n
    try:
        jaxpr = jax.make_jaxpr(traced)(*args)
    except Exception:  # noqa: BLE001 - then no kernel is trusted with it
        return frozenset({"<untraceable>"})
    out = set()
    _walk(jaxpr.jaxpr, out)
    return frozenset(out)


def refusals(mask, backend: Backend, gradient: bool = False) -> list:
    """Why ``backend``'s kernels cannot compile the ``from_fn`` functions of
    ``mask`` (a mask, a mask rebuilt from a treedef, None, a position term, or
    a tuple of those; a position term may ride inside the mask): one line per
    function, naming what it uses that the backend does not lower. Empty when
    they can. ``gradient``: the kernels also compute the gradient of a term's
    arrays (``Config.term_grad``)."""
    why = []
    for what, node in _functions(mask):
        bad = set(primitives(node, gradient and backend.gradient)) - backend.allowed
        if backend.bool_not:
            bad.discard("not (of booleans)")
        if bad:
            hints = "".join(f"write {_REWRITES[p]}; " for p in sorted(bad) if p in _REWRITES)
            why.append(f"{what} {node!r} uses {', '.join(sorted(bad))}, which the "
                       f"{backend.name} do not compile ({hints}the XLA lowerings compute "
                       "any function)")
    return why


def config_refusals(cfg, backend: Backend) -> list:
    """:func:`refusals` of a flash call's static configuration: its mask and
    term rebuilt from ``cfg.mask_treedef``, their gradient where
    ``cfg.term_grad`` asks for it."""
    return refusals(masks.from_treedef(cfg.mask_treedef), backend, bool(cfg.term_grad))


def refuse(where: str, why: list) -> None:
    """Raises ``NotImplementedError`` for the :func:`refusals` ``why`` (``where``
    names the call), for a kernel asked for by name; nothing when empty."""
    if why:
        raise NotImplementedError(f"{where}: {'; '.join(why)}; impl='xla' computes it, and "
                                  "impl='auto' chooses a lowering that does")
