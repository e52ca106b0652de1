"""Trace-time validation shared by every public entry point.

Messages name the argument, what was expected and what was given.
"""

import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


class Dims(NamedTuple):
    """Problem sizes, always in "bthd" terms."""

    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def _shape(x):
    return tuple(jnp.shape(x))


def check_float(name, x):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        arg = name.rsplit(": ", 1)[-1]
        raise TypeError(f"{name} must be a JAX array; got {type(x).__name__}. Pass a JAX "
                        f"array, e.g. jnp.asarray({arg}).")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point array (float32, bfloat16 or float16); "
            f"got {x.dtype} with shape {_shape(x)}")


def check_qkv(q, k, v, layout: str, *, fn: str = "attention") -> Dims:
    """Validates q, k, v and returns their sizes."""
    if layout not in ("bthd", "bhtd"):
        raise ValueError(f"{fn}: layout must be 'bthd' or 'bhtd'; got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(f"{fn}: {name}", x)
        if x.ndim != 4:
            want = "(B, T, H, D)" if layout == "bthd" else "(B, H, T, D)"
            raise ValueError(f"{fn}: {name} must have 4 axes {want} for layout {layout!r}; "
                             f"got shape {_shape(x)}")
        if 0 in x.shape:
            # Every lowering assumes at least one row, key, head and feature; an empty
            # key axis would otherwise fail deep inside a reduction or a grid.
            want = "(B, T, H, D)" if layout == "bthd" else "(B, H, T, D)"
            raise ValueError(f"{fn}: {name} must have no empty axis {want}; got shape "
                             f"{_shape(x)}. To attend to no key, mask the keys instead "
                             "(e.g. masks.lengths(kv_lengths=...) with a length of 0).")
    if not (q.dtype == k.dtype == v.dtype):
        odd = "k" if k.dtype != q.dtype else "v"
        raise TypeError(f"{fn}: q, k and v must share a dtype; got q {q.dtype}, "
                        f"k {k.dtype}, v {v.dtype}. Cast them to one, e.g. "
                        f"{odd}.astype(q.dtype).")
    if layout == "bthd":
        (B, Tq, Hq, D), (Bk, Tk, Hkv, Dk), (Bv, Tv, Hv, Dv) = q.shape, k.shape, v.shape
        v_want = f"(B, Tk, Hkv, Dv)=({B}, {Tk}, {Hkv}, Dv)"
    else:
        (B, Hq, Tq, D), (Bk, Hkv, Tk, Dk), (Bv, Hv, Tv, Dv) = q.shape, k.shape, v.shape
        v_want = f"(B, Hkv, Tk, Dv)=({B}, {Hkv}, {Tk}, Dv)"
    if Dk != D:
        raise ValueError(f"{fn}: head-dim mismatch: k must have head dim D={D} like q "
                         f"{_shape(q)}; got k {_shape(k)}")
    if Bk != B:
        raise ValueError(f"{fn}: batch mismatch: k must have batch B={B} like q "
                         f"{_shape(q)}; got k {_shape(k)}")
    if (Bv, Tv, Hv) != (Bk, Tk, Hkv):
        raise ValueError(f"{fn}: v must have shape {v_want} matching k {_shape(k)}; "
                         f"got v {_shape(v)}")
    if Hq % Hkv:
        axes = "(B, T, H, D)" if layout == "bthd" else "(B, H, T, D)"
        raise ValueError(f"{fn}: the number of query heads Hq={Hq} must be a multiple of the "
                         f"number of key/value heads Hkv={Hkv}; got q {_shape(q)} and k "
                         f"{_shape(k)}, read as {axes} for layout {layout!r}"
                         + _fewer_heads_hint(Hq, Hkv, q.shape, k.shape, layout))
    return Dims(B, Tq, Tk, Hq, Hkv, D, Dv)


def layout_hint(layout: str, q_heads_other: int, kv_heads_other: int, *,
                q_only: bool = False) -> str:
    """The hint for arrays that read right in the other layout, or ""."""
    other = "bhtd" if layout == "bthd" else "bthd"
    if q_heads_other % kv_heads_other:
        return ""
    axes = "(B, H, T, D)" if other == "bhtd" else "(B, T, H, D)"
    default = ", the default" if other == "bthd" else ""
    if q_only:
        return (f". Read as {axes} (layout {other!r}) q has Hq={q_heads_other}: if that is "
                f"its layout, pass AttentionSpec(layout={other!r}){default}.")
    return (f". Read as {axes} (layout {other!r}) they have Hq={q_heads_other} and "
            f"Hkv={kv_heads_other}: if that is their layout, pass "
            f"AttentionSpec(layout={other!r}){default}.")


def _fewer_heads_hint(Hq, Hkv, q_shape, k_shape, layout) -> str:
    """What to do when Hq is not a multiple of Hkv: only said when Hq < Hkv (more
    key/value heads than query heads), the sign of arrays in the other layout."""
    if Hq >= Hkv:
        return ""
    h = 1 if layout == "bthd" else 2  # the head axis of the other layout
    hint = layout_hint(layout, q_shape[h], k_shape[h])
    return hint or (". There cannot be fewer query heads than key/value heads: check the "
                    "layout and that q and k are not swapped.")


POSITION_BIAS_SUPPORT = (
    "fnattn.attention and fnattn.flash (every impl but 'cudnn'), fnattn.context.attention, "
    "the decode and paged variants (fnattn.context.decode included) and fnattn.reference "
    "compute it")


def refuse_position_bias(spec, fn: str) -> None:
    """``NotImplementedError`` if ``spec`` has a position term (for the variants
    and lowerings that do not compute one)."""
    if getattr(spec, "position_bias", None) is not None:
        raise NotImplementedError(
            f"{fn}: spec.position_bias is not supported here; {POSITION_BIAS_SUPPORT}")


def check_spec_arrays(spec, dims: Dims, *, fn: str = "attention",
                      position_bias: bool = False) -> None:
    """Validates the spec's arrays against the problem sizes.

    ``position_bias``: whether the caller computes ``spec.position_bias``; if
    not, a spec with one is refused (``NotImplementedError``)."""
    B, Tq, Tk, Hq = dims.batch, dims.q_len, dims.kv_len, dims.num_q_heads
    if not position_bias:
        refuse_position_bias(spec, fn)
    elif spec.position_bias is not None:
        try:
            spec.position_bias.validate(B, Hq, Tq, Tk)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{fn}: {e}") from None
    if spec.bias is not None:
        check_float(f"{fn}: bias", spec.bias)
        bs = _shape(spec.bias)
        want = (B, Hq, Tq, Tk)
        padded = (1,) * (4 - len(bs)) + bs
        if len(bs) > 4 or any(n not in (1, w) for n, w in zip(padded, want)):
            raise ValueError(f"{fn}: bias must be broadcastable to (B, Hq, Tq, Tk)={want}; "
                             f"got {bs}")
    if spec.sinks is not None:
        check_float(f"{fn}: sinks", spec.sinks)
        if _shape(spec.sinks) != (Hq,):
            raise ValueError(f"{fn}: sinks must have shape (Hq,)=({Hq},), one logit per "
                             f"query head; got {_shape(spec.sinks)}")
    if spec.dropout_rate > 0 and spec.dropout_key is None:
        raise ValueError(f"{fn}: dropout_rate={spec.dropout_rate} needs a dropout_key "
                         "(a PRNG key, e.g. jax.random.key(0))")
    if spec.dropout_offsets is not None:
        offsets = spec.dropout_offsets
        if (not hasattr(offsets, "dtype") or not jnp.issubdtype(offsets.dtype, jnp.integer)
                or _shape(offsets) != (4,)):
            raise ValueError(
                f"{fn}: dropout_offsets must be an integer array of shape (4,), the global "
                "index of this call's first (batch row, query head, query, key); got "
                f"{getattr(offsets, 'dtype', type(offsets).__name__)} with shape "
                f"{_shape(offsets)}")
    if spec.mask is not None:
        try:
            spec.mask.validate(B, Hq, Tq, Tk)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{fn}: {e}") from None


def to_bthd(x, layout):
    return x if layout == "bthd" else jnp.swapaxes(x, 1, 2)


def from_bthd(x, layout):
    return to_bthd(x, layout)


def resolve_scale(spec, head_dim: int) -> float:
    return float(spec.scale) if spec.scale is not None else float(head_dim) ** -0.5


def is_array(x) -> bool:
    return isinstance(x, jax.Array)


# ----------------------------------------------------------------------------------
# Symbolic sizes (jax.export shape polymorphism)
# ----------------------------------------------------------------------------------


def is_static(n) -> bool:
    """Whether the size ``n`` is a number at trace time, not a symbolic dimension
    of ``jax.export`` (``jax.export.symbolic_shape``).

    >>> b, = jax.export.symbolic_shape("b")
    >>> is_static(4), is_static(b), is_static(2 * b)
    (True, False, False)
    """
    return not jax.export.is_symbolic_dim(n)


def static_or(n, default):
    """``n`` if it is static (:func:`is_static`), else ``default``: the stand-in
    size a heuristic (tile or split sizes) uses for a symbolic dimension.

    >>> b, = jax.export.symbolic_shape("b")
    >>> static_or(4, 1), static_or(b, 1)
    (4, 1)
    """
    return n if is_static(n) else default


def symbolic_sizes(**sizes) -> list:
    """The names of the ``sizes`` that are symbolic (:func:`is_static`)."""
    return [name for name, n in sizes.items() if not is_static(n)]


def refuse_symbolic(lowering: str, why: str, alternative: str, **sizes) -> None:
    """Raises ``NotImplementedError`` if one of ``sizes`` is symbolic (``jax.export``
    with ``jax.export.symbolic_shape``), for a kernel that needs it static.

    ``why`` says what is sized by them (e.g. "its grid"), ``alternative``
    names the lowerings that take symbolic sizes.

    >>> b, = jax.export.symbolic_shape("b")
    >>> refuse_symbolic("decode: the Triton kernel", "its grid", "impl='xla'", B=b, S=64)
    Traceback (most recent call last):
    ...
    NotImplementedError: decode: the Triton kernel cannot take symbolic sizes (jax.export): B=b
    (its grid is sized by them); impl='xla' takes symbolic sizes, or export with static shapes.
    """
    names = symbolic_sizes(**sizes)
    if names:
        given = ", ".join(f"{n}={sizes[n]}" for n in names)
        verb = "are" if " and " in why else "is"
        takes = "take" if " and " in alternative else "takes"
        raise NotImplementedError(
            f"{lowering} cannot take symbolic sizes (jax.export): {given} ({why} {verb} sized "
            f"by them); {alternative} {takes} symbolic sizes, or export with static shapes.")


# ----------------------------------------------------------------------------------
# Public entry points: the spec first, arrays as arrays
# ----------------------------------------------------------------------------------


def _describe(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a {x.dtype} array of shape {_shape(x)}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of length {len(x)}"
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _check_spec_first(fn: str, call: str, args, kwargs) -> None:
    from fnattn.masks import Mask
    from fnattn.spec import AttentionSpec
    spec = args[0] if args else kwargs.get("spec", inspect.Parameter.empty)
    if isinstance(spec, AttentionSpec):
        return
    if spec is inspect.Parameter.empty:
        raise TypeError(f"{fn}: missing the spec: the first argument must be an "
                        f"AttentionSpec, as in {call}")
    if spec is AttentionSpec:
        raise TypeError(f"{fn}: the first argument must be an AttentionSpec; got the class "
                        f"AttentionSpec itself. Create one: {call}")
    if isinstance(spec, Mask):
        raise TypeError(f"{fn}: the first argument must be an AttentionSpec; got the mask "
                        f"{spec!r}. A mask goes inside the spec: "
                        + call.replace("AttentionSpec()", "AttentionSpec(mask=mask)"))
    raise TypeError(f"{fn}: the first argument must be an AttentionSpec; got "
                    f"{_describe(spec)}. The spec comes first: {call}")


def _as_int_array(fn: str, name: str, x):
    # Integer metadata (lengths, starts, page tables, offsets) is small and
    # unambiguous: a Python list or int, or a NumPy array, converts as jnp.asarray
    # would (under jit a list arrives as a list of scalars: they are stacked).
    if isinstance(x, (list, tuple, range, np.ndarray, np.generic, int)) \
            and not isinstance(x, bool):
        try:
            return jnp.asarray(x)
        except (TypeError, ValueError, OverflowError):
            raise TypeError(f"{fn}: {name} must be an integer array; got {_describe(x)} "
                            "that jnp.asarray cannot convert to one array (ragged, not "
                            "numbers, or out of range)") from None
    if not isinstance(x, jax.Array):
        raise TypeError(f"{fn}: {name} must be an integer array; got {_describe(x)}")
    return x


def _as_float_array(fn: str, name: str, x):
    # A NumPy array converts; a list is refused: a list of arrays (per head, per
    # layer) would stack along a new first axis, rarely the documented layout.
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    from fnattn import quant   # (a quantized cache stands where a cache goes)
    if quant.is_quantized(x):
        quant.check(fn, name, x)   # (here a concrete per-tensor scale is refused at once)
        return x
    if not isinstance(x, jax.Array):
        raise TypeError(f"{fn}: {name} must be a JAX array; got {_describe(x)}. Pass a JAX "
                        f"array, e.g. jnp.asarray({name}), in the documented shape.")
    return x


def entry_point(public: str, *, ints=(), concrete=None, precheck=None):
    """Decorates a public function whose first parameter is the spec (outside its
    jaxtyping/beartype check), so that the commonest mistakes get fnattn's
    messages instead of a type checker's: a first argument that is not an
    :class:`fnattn.AttentionSpec` (the spec forgotten), and arrays given as
    Python lists. The parameters named in ``ints`` (integer metadata) also take
    lists, Python ints and NumPy arrays (converted with ``jnp.asarray``); the
    other array parameters take NumPy arrays.

    The function runs through one ``jax.jit`` (:func:`through_jit`), so that
    a call outside ``jit`` compiles once; ``concrete(arguments)``, given,
    first checks what only concrete values can tell (the bound arguments by
    name) when no argument is traced. With ``checked=True`` it runs as it is
    (checkify's checks raise eagerly). ``precheck(arguments)``, given, runs on
    every call, traced or not, on the arguments as given (it checks those that
    are concrete: NumPy arrays and lists, also when closed over inside ``jit``).

    >>> @entry_point("fnattn.example", ints=("lengths",))
    ... def example(spec, q, *, lengths):
    ...     return lengths
    >>> example(jnp.zeros(3), jnp.zeros(3), lengths=[1, 2])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: example: the first argument must be an AttentionSpec; got a float32 array ...
    >>> from fnattn import AttentionSpec
    >>> example(AttentionSpec(), jnp.zeros(3), lengths=[1, 2]).dtype
    dtype('int32')
    """
    fn = public.removeprefix("fnattn.")

    def wrap(f):
        sig = inspect.signature(f)
        params = list(sig.parameters.values())[1:]
        call = ", ".join(["fnattn.AttentionSpec()"]
                         + [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
                         + [f"{p.name}=..." for p in params
                            if p.kind is p.KEYWORD_ONLY and p.default is p.empty])
        call = f"{public}({call})"
        # the array parameters: those annotated with jaxtyping's Array
        arrays = {p.name: p.default for p in params
                  if "Array" in str(p.annotation) or p.name in ints}
        # (an Optional array, such as the absent values of a latent cache, may be None)
        optional = {p.name for p in params
                    if "Optional" in str(p.annotation) or "NoneType" in str(p.annotation)}

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            _check_spec_first(fn, call, args, kwargs)
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as e:  # a missing or an unknown argument
                raise TypeError(f"{fn}: {e}; the call is {call}") from None
            if precheck is not None:
                precheck(bound.arguments)
            for name, default in arrays.items():
                if name not in bound.arguments:
                    continue
                x = bound.arguments[name]
                if x is None and (default is None or name in optional):
                    continue
                bound.arguments[name] = (_as_int_array(fn, name, x) if name in ints
                                         else _as_float_array(fn, name, x))
            if bound.arguments.get("checked"):  # checkify's checks: raised eagerly
                return f(*bound.args, **bound.kwargs)
            return jitted(*bound.args, **bound.kwargs)

        jitted = through_jit(
            f, before=None if concrete is None else (
                lambda args, kwargs: concrete(sig.bind(*args, **kwargs).arguments)))
        return wrapper

    return wrap


_ARRAY = object()   # where an array leaf goes in a call's static description


class _Static:
    """The hashable part of a call: its tree and its leaves that are not arrays.

    Trees are compared through :func:`_tree_key`, not ``PyTreeDef.__eq__``,
    which (jax 0.10 and 0.11) holds two dataclass nodes of different types with the
    same fields equal: ``masks.full()`` and ``masks.causal()`` would share a
    compiled program (``jax.jit`` matches static arguments by ``==``).
    """

    __slots__ = ("treedef", "leaves", "_key", "_hash")

    def __init__(self, treedef, leaves):
        self.treedef, self.leaves = treedef, leaves
        self._key = _tree_key(treedef)
        self._hash = hash((self._key, leaves))   # (TypeError where a leaf is unhashable)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (isinstance(other, _Static) and self._hash == other._hash
                and self._key == other._key
                and all(a is b or (a is not _ARRAY and b is not _ARRAY and type(a) is type(b)
                                   and a == b)
                        for a, b in zip(self.leaves, other.leaves)))


def _tree_key(treedef):
    """``treedef`` as nested tuples of each node's type, its static data (with
    their types) and its children: equal exactly when the trees are.

    >>> from fnattn import masks
    >>> key = lambda m: _tree_key(jax.tree_util.tree_structure(m))
    >>> key(masks.full()) == key(masks.causal()), key(masks.causal()) == key(masks.causal())
    (False, True)
    """
    data = treedef.node_data()
    if data is None:   # a leaf
        return None
    kind, aux = data
    return (kind, _aux_key(aux), tuple(_tree_key(c) for c in treedef.children()))


def _aux_key(x):
    if isinstance(x, jax.tree_util.PyTreeDef):   # (a mask holding a treedef)
        return (jax.tree_util.PyTreeDef, _tree_key(x))
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_aux_key(a) for a in x))
    return (type(x), x)


def through_jit(f, before=None):
    """``f(*args, **kwargs)`` through one ``jax.jit`` of ``f``, keyed on the
    arguments' tree, their non-array leaves (static) and the arrays' shapes and
    dtypes, as ``jax.numpy`` functions are.

    Otherwise a call outside ``jit`` would compile the variants' loops, conds
    and kernels anew each time (most of a second even for small inputs), and
    so would one under an eager ``jax.grad`` or ``jax.vmap``; inside ``jit``
    each key is traced once and shows in the jaxpr as a ``pjit`` named after
    ``f``. ``before(args, kwargs)`` runs first when no argument is traced.
    Arguments with leaves that cannot be hashed call ``f`` directly.

    >>> calls = []
    >>> def f(x, *, n):
    ...     calls.append(n)       # runs when traced
    ...     return x * n
    >>> g = through_jit(f)
    >>> [int(g(jnp.ones(()), n=3)) for _ in range(2)], calls   # traced once
    ([3, 3], [3])
    >>> int(jax.jit(lambda x: g(x, n=2))(jnp.ones(()))), calls
    (2, [3, 2])
    >>> float(jax.grad(lambda x: g(x, n=3))(jnp.ones(()))), calls   # (its first trace)
    (3.0, [3, 2])
    """
    def run(static, arrays):
        it = iter(arrays)
        leaves = [next(it) if leaf is _ARRAY else leaf for leaf in static.leaves]
        args, kwargs = jax.tree_util.tree_unflatten(static.treedef, leaves)
        return f(*args, **kwargs)

    run.__name__ = run.__qualname__ = getattr(f, "__name__", "run")
    jitted = jax.jit(run, static_argnums=0)

    @functools.wraps(f)
    def call(*args, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if before is not None and not any(isinstance(x, jax.core.Tracer) for x in leaves):
            before(args, kwargs)
        is_array = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
        arrays = [x for x, a in zip(leaves, is_array) if a]
        try:
            static = _Static(treedef, tuple(_ARRAY if a else x for x, a in zip(leaves, is_array)))
        except TypeError:
            return f(*args, **kwargs)
        try:
            return jitted(static, arrays)
        except Exception as e:
            # The call's own errors (shapes, dtypes, refusals) read as they would
            # eagerly: without the note jax.jit adds about its frames removed
            # from the traceback (JAX_TRACEBACK_FILTERING=off shows them).
            notes = getattr(e, "__notes__", None)
            if notes:
                e.__notes__ = [n for n in notes if "JAX has removed its internal frames" not in n]
            raise

    return call
