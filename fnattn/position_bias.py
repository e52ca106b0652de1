"""Logit terms computed from positions inside the kernels: ALiBi and any
elementwise function of (batch, head, query position, key position) and of
per-head parameters, learnable.

``AttentionSpec(position_bias=...)`` adds the term where ``bias`` is added,
before the soft-cap::

    s = scale * (q . k) + bias[b, h, q, k] + position_bias(b, h, q_pos, k)

Unlike ``bias``, nothing of size ``Tq x Tk`` is stored or read: every lowering
computes a tile's term from the tile's indices (and from small arrays such as
ALiBi's per-head slopes, or the per-head parameters of a :func:`from_fn`).
Block-sparse skipping is unchanged: the term never hides a key, the mask does.

``q_pos`` is the *aligned* query position, as for the positional masks
(:mod:`fnattn.masks`): with ``Tq != Tk`` the queries are the last ``Tq``
positions of the keys, so a chunk of queries against a longer cache gets the
distances of its true positions.

>>> import jax, jax.numpy as jnp
>>> import fnattn
>>> from fnattn import AttentionSpec, masks, position_bias
>>> slopes = position_bias.alibi_slopes(4)
>>> slopes.tolist()
[0.25, 0.0625, 0.015625, 0.00390625]
>>> spec = AttentionSpec(mask=masks.causal(), position_bias=position_bias.alibi(slopes))
>>> q = jax.random.normal(jax.random.key(0), (1, 64, 4, 16))
>>> k = v = jax.random.normal(jax.random.key(1), (1, 64, 2, 16))
>>> res = jax.jit(fnattn.flash)(spec, q, k, v)
>>> ref = fnattn.reference(spec, q, k, v)
>>> bool(jnp.allclose(res.out, ref.out, atol=1e-5))
True

Where it runs: :func:`fnattn.attention`, :func:`fnattn.flash` and
:func:`fnattn.reference`, with every ``impl`` but "cudnn": the blockwise XLA
lowering, the Pallas Triton kernels, the Pallas Mosaic TPU kernels and the
dense XLA lowering. On an NVIDIA GPU ``impl="auto"`` gives such a spec to the
Triton kernels (cuDNN computes no term; the Mosaic GPU forward computes it
when the spec's block sizes include ``MosaicGpuBlockSizes``, with the Triton
backward unless ``MosaicGpuBwdBlockSizes`` asks for the Mosaic GPU one, until
an H100 timing makes them the default). A ``from_fn`` term runs
in a kernel whose backend compiles every operation of its function (checked
when the spec is traced, :mod:`fnattn._functions`); impl="auto" runs one it
cannot on the XLA lowering, and the kernel asked for by name refuses it.
:func:`fnattn.context.attention` (ring and all-gather context parallelism)
evaluates it at each step's global positions. The serving variants
(:func:`fnattn.decode`, ``decode_with_update``, the paged and ragged paged
ones, with or without the cache update) take terms whose arrays are per head
(and, for decode, per batch row): ALiBi. Every one of their lowerings computes
them (XLA, Triton, Mosaic TPU, and Mosaic GPU asked for by name).
:func:`fnattn.context.decode` takes them too,
at the global positions of every device's slots. ``impl="cudnn"`` raises
``NotImplementedError``.

**Gradients.** q, k, v, ``bias`` and ``sinks`` as usual, and the term's own
arrays: learnable ALiBi slopes, learnable parameters of a ``from_fn`` term
(``from_fn(fn, *arrays)``). :func:`fnattn.attention` and
:func:`fnattn.flash` differentiate them in every lowering that computes the
term, in both modes and to any order: the backward kernels (XLA blockwise,
Triton, Mosaic TPU, Mosaic GPU) sum ``dS * d(term)/d(array)`` over the tiles
they visit, with no extra pass and nothing of size ``Tq x Tk``; the tangent
pass (forward mode) carries the term's tangent; second-order derivatives come
from the dense formulation. Only when differentiated: a spec whose arrays are
held fixed runs the same kernels as before. The kernels sum one value per
batch row and head, the form of every term's arrays (ALiBi's (Hq,), a
``from_fn``'s (Hq,) or (B, Hq)). :func:`fnattn.context.attention` (ring and
all-gather) differentiates them too, summing over the devices. The serving
variants take the arrays as constants: differentiating with respect to them
there raises ``NotImplementedError``.

>>> slopes = jnp.asarray(alibi_slopes(4))
>>> def loss(slopes):
...     spec = AttentionSpec(mask=masks.causal(), position_bias=alibi(slopes))
...     return jnp.sum(fnattn.flash(spec, q, k, v).out ** 2)
>>> g = jax.jit(jax.grad(loss))(slopes)
>>> g_ref = jax.grad(lambda s: jnp.sum(fnattn.reference(AttentionSpec(
...     mask=masks.causal(), position_bias=alibi(s)), q, k, v).out ** 2))(slopes)
>>> bool(jnp.allclose(g, g_ref, rtol=1e-4, atol=1e-4))
True
"""

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fnattn import masks

Array = jax.Array

__all__ = ["PositionBias", "alibi", "alibi_slopes", "from_fn", "present", "term"]


class PositionBias:
    """Base class of the position terms. Build them with :func:`alibi` and
    :func:`from_fn`; add two with ``+``.

    The protocol (the same shape as a mask's): ``operands()`` gives the term's
    arrays in the canonical 4-D form ``(B|1, H|1, Tq|1, Tk|1)``, which a kernel
    slices to its tile; ``value(pos, ops)`` computes the term elementwise from
    :class:`fnattn.masks.Positions` and the operand tiles.
    """

    def operands(self) -> tuple:
        return ()

    def value(self, pos: masks.Positions, ops: Sequence[Array]) -> Array:
        raise NotImplementedError

    def validate(self, batch: int, num_heads: int, q_len: int, kv_len: int) -> None:
        """Raises ``ValueError`` naming the argument if an array does not fit."""

    @property
    def num_operands(self) -> int:
        return len(jax.tree_util.tree_leaves(self))

    def __add__(self, other: "PositionBias") -> "PositionBias":
        if not isinstance(other, PositionBias):
            raise TypeError(f"cannot add {type(other).__name__} to a position bias; both "
                            "sides must be fnattn.position_bias terms")
        return Sum(self, other)


class ALiBi(PositionBias):
    slopes: Array

    def operands(self):
        return (jnp.reshape(jnp.asarray(self.slopes, jnp.float32), (1, -1, 1, 1)),)

    def value(self, pos, ops):
        (slope,) = ops
        dist = jnp.abs(pos.q_pos - pos.k).astype(jnp.float32)
        return -slope.astype(jnp.float32) * dist

    def validate(self, batch, num_heads, q_len, kv_len):
        shape = tuple(jnp.shape(self.slopes))
        if shape != (num_heads,):
            raise ValueError(f"alibi: slopes must have shape (Hq,)=({num_heads},), one "
                             f"slope per query head; got {shape}")
        dtype = jnp.result_type(self.slopes)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"alibi: slopes must be a float array; got {dtype}")

    def __repr__(self):
        return "alibi(...)"


class FromFn(PositionBias):
    fn: Callable
    arrays: tuple = ()

    def operands(self):
        # (Hq,) -> (1, Hq, 1, 1); (B, Hq) -> (B, Hq, 1, 1)
        return tuple(jnp.reshape(jnp.asarray(x, jnp.float32), (-1 if jnp.ndim(x) == 2 else 1,
                                                               jnp.shape(x)[-1], 1, 1))
                     for x in self.arrays)

    def value(self, pos, ops):
        out = self.fn(*masks.tile_args(pos.b, pos.h, pos.q_pos, pos.k,
                                       *(jnp.asarray(op).astype(jnp.float32) for op in ops)))
        dtype = jnp.result_type(out)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"position_bias.from_fn: {getattr(self.fn, '__name__', 'fn')} must return "
                f"floats (an additive logit term); got {dtype}. For a mask use "
                "fnattn.masks.from_fn.")
        return jnp.asarray(out, jnp.float32)

    def validate(self, batch, num_heads, q_len, kv_len):
        name = getattr(self.fn, "__name__", "fn")
        for n, x in enumerate(self.arrays):
            shape = tuple(jnp.shape(x))
            if shape not in ((num_heads,), (batch, num_heads)):
                raise ValueError(
                    f"position_bias.from_fn({name}): array {n} must have shape (Hq,)="
                    f"({num_heads},) or (B, Hq)={(batch, num_heads)}, one value per query "
                    f"head (and batch row); got {shape}")
            dtype = jnp.result_type(x)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(f"position_bias.from_fn({name}): array {n} must be a float "
                                f"array; got {dtype}")

    def __repr__(self):
        name = getattr(self.fn, "__name__", "fn")
        return f"from_fn({name}{', ...' * bool(self.arrays)})"


class Sum(PositionBias):
    a: PositionBias
    b: PositionBias

    def operands(self):
        return (*self.a.operands(), *self.b.operands())

    def value(self, pos, ops):
        n = self.a.num_operands
        return self.a.value(pos, ops[:n]) + self.b.value(pos, ops[n:])

    def validate(self, *dims):
        self.a.validate(*dims)
        self.b.validate(*dims)

    def __repr__(self):
        return f"({self.a!r} + {self.b!r})"


ALiBi = masks._register(ALiBi, data=("slopes",))
FromFn = masks._register(FromFn, data=("arrays",), meta=("fn",))
Sum = masks._register(Sum, data=("a", "b"))


def alibi(slopes) -> PositionBias:
    """ALiBi: ``-slopes[h] * |q_pos - k|``, a linear penalty on the distance.

    Args:
      slopes: float array (Hq,), one slope per query head (see
        :func:`alibi_slopes` for the usual geometric sequence). A leaf of
        the spec: it traces, vmaps, splits with the heads and takes
        gradients (learnable slopes) through :func:`fnattn.attention` and
        :func:`fnattn.flash`.

    >>> import jax.numpy as jnp
    >>> from fnattn import masks
    >>> t = alibi(jnp.array([0.5]))
    >>> pos = masks.Positions(b=0, h=0, q=3, q_pos=3, k=jnp.arange(5))
    >>> t.value(pos, t.operands()).reshape(-1).tolist()
    [-1.5, -1.0, -0.5, -0.0, -0.5]
    """
    if not isinstance(slopes, jax.Array):
        if isinstance(slopes, (list, tuple, np.ndarray)):
            slopes = jnp.asarray(slopes, jnp.float32)
        else:
            raise TypeError(f"alibi: slopes must be an array (Hq,); got {type(slopes).__name__}")
    return ALiBi(slopes)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The geometric slopes of ALiBi's paper for ``num_heads`` heads, as a NumPy
    float32 array: ``2 ** (-8 (h + 1) / n)`` for the nearest power of two ``n``
    at or below ``num_heads``, then the odd terms of the sequence for ``2n``
    heads for the remaining ones.

    >>> alibi_slopes(2).tolist()
    [0.0625, 0.00390625]
    >>> len(alibi_slopes(12))
    12
    """
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be a positive int; got {num_heads!r}")
    n = 2 ** int(math.floor(math.log2(num_heads)))
    first = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    extra = [2.0 ** (-4.0 * (h + 1) / n) for h in range(0, 2 * (num_heads - n), 2)]
    return np.asarray(first + extra, np.float32)


def from_fn(fn: Callable, *arrays) -> PositionBias:
    """A term ``fn(b, h, q_pos, k, *values) -> float`` of the batch row, the
    query head, the aligned query position and the key index (broadcastable
    int32 arrays), and of per-head parameters.

    ``arrays``: float arrays of shape (Hq,) or (B, Hq), one value per query
    head (and batch row); ``fn`` receives each as ``values[i]``, the value of
    the tile's head (and row), broadcastable like the indices. They are leaves
    of the spec: traced, vmapped, split with the heads, and **learnable**:
    ``fnattn.attention`` and ``fnattn.flash`` differentiate them in every
    lowering that computes the term (the backward kernels sum ``dS *
    d(term)/d(value)`` beside dq), so a learned relative-position scheme
    (KERPLE's ``-r1 * log(1 + r2 |q - k|)``, a learned decay, ...) trains in
    the fast kernels without a ``Tq x Tk`` array.

    ``fn`` must use elementwise ``jnp`` operations only (every lowering calls it
    on a tile, Pallas kernels included) and close over no arrays (pass them as
    ``arrays``); it is static, part of the jit cache key by identity.

    >>> import jax.numpy as jnp
    >>> from fnattn import masks
    >>> t = from_fn(lambda b, h, q, k: jnp.where(k == 0, 1.0, 0.0))  # favour the first key
    >>> pos = masks.Positions(b=0, h=0, q=2, q_pos=2, k=jnp.arange(3))
    >>> t.value(pos, ()).tolist()
    [1.0, 0.0, 0.0]
    >>> def kerple(b, h, q, k, r1, r2):  # learnable per-head r1, r2 > 0
    ...     return -r1 * jnp.log1p(r2 * jnp.abs(q - k))
    >>> t = from_fn(kerple, jnp.array([1.0, 2.0]), jnp.array([0.5, 0.5]))
    >>> ops = [op[:, 1] for op in t.operands()]  # head 1's values
    >>> np.round(np.asarray(t.value(pos, ops), np.float64).reshape(-1), 3).tolist()
    [-1.386, -0.811, -0.0]
    """
    if not callable(fn):
        raise TypeError(f"position_bias.from_fn: fn must be callable; got {type(fn).__name__}")
    fixed = []
    for n, x in enumerate(arrays):
        if isinstance(x, (list, tuple, np.ndarray)):
            x = jnp.asarray(x, jnp.float32)
        if not isinstance(x, jax.Array) or jnp.ndim(x) not in (1, 2):
            raise TypeError(f"position_bias.from_fn: array {n} must be an array of shape (Hq,) "
                            f"or (B, Hq); got {getattr(x, 'shape', type(x).__name__)}")
        fixed.append(x)
    return FromFn(fn, tuple(fixed))


# ----------------------------------------------------------------------------------
# How the lowerings carry the term: inside the mask
# ----------------------------------------------------------------------------------


class Biased(masks.Mask):
    """The spec's mask (or None) with its position term riding along.

    The flash and dense lowerings move a mask's arrays to their tiles already;
    carrying the term's arrays among them gives every lowering the term's
    tiles with no plumbing of its own. The predicate and the tile bounds are
    the mask's; :func:`term` is what a lowering adds to a tile's logits.
    """

    mask: Any
    bias: PositionBias

    def _n(self):
        return 0 if self.mask is None else self.mask.num_operands

    def operands(self):
        inner = () if self.mask is None else tuple(self.mask.operands())
        return (*inner, *self.bias.operands())

    def predicate(self, pos, ops):
        if self.mask is None:
            return masks.Full().predicate(pos, ())
        return self.mask.predicate(pos, ops[:self._n()])

    def tile_bounds(self, t, ops):
        if self.mask is None:
            return masks.Full().tile_bounds(t, ())
        return self.mask.tile_bounds(t, ops[:self._n()])

    def validate(self, *dims):
        if self.mask is not None:
            self.mask.validate(*dims)
        self.bias.validate(*dims)

    def __repr__(self):
        return f"biased({self.mask!r}, {self.bias!r})"


Biased = masks._register(Biased, data=("mask", "bias"))


def _biased(mask):
    """The :class:`Biased` mask ``mask`` is, or holds inside the wrappers of
    context parallelism (``masks.AtPositions`` around ``masks.Canonical``);
    None without a position term."""
    if isinstance(mask, masks.AtPositions):
        return _biased(mask.mask)
    if isinstance(mask, masks.Canonical):
        return _biased(mask._inner())
    return mask if isinstance(mask, Biased) else None


def present(mask) -> bool:
    """Whether ``mask`` (a mask, a placeholder from a treedef, or None) carries
    a position term, itself or inside the wrappers of context parallelism
    (``masks.AtPositions`` around ``masks.Canonical``)."""
    return _biased(mask) is not None


def parts(mask) -> list:
    """The terms whose sum is the position term riding with ``mask`` (through
    ``+`` and the wrappers of context parallelism); empty without one.

    >>> t = alibi(jnp.ones(2)) + from_fn(lambda b, h, q, k: 0.0 * k)
    >>> [type(p).__name__ for p in parts(attach(None, t))]
    ['FromFn', 'ALiBi']
    """
    b = _biased(mask)
    found, todo = [], [] if b is None else [b.bias]
    while todo:
        t = todo.pop()
        if isinstance(t, Sum):
            todo += [t.a, t.b]
        else:
            found.append(t)
    return found


def term(mask, pos: masks.Positions, tiles: Sequence[Array]):
    """The position term of a tile (float32, broadcastable with ``pos``), or None.

    ``tiles`` are the tiles of all of ``mask``'s operands, in order. Inside
    ``masks.AtPositions`` (a ring step of context parallelism) the term is
    evaluated at the positions it gives, like the mask."""
    tiles = tuple(tiles)
    if isinstance(mask, masks.AtPositions):
        *inner, qp, kp = tiles
        return term(mask.mask, masks.Positions(b=pos.b, h=pos.h, q=qp, q_pos=qp, k=kp), inner)
    if isinstance(mask, masks.Canonical):
        return term(mask._inner(), pos, tiles)
    if not isinstance(mask, Biased):
        return None
    return mask.bias.value(pos, tiles[mask._n():])


def attach(mask, bias: PositionBias | None, *, constant: bool = True):
    """``mask`` with ``bias`` riding along (``mask`` itself when ``bias`` is None).

    ``constant``: the term's arrays refuse a tangent (for a variant that computes
    no gradient for them; a silent zero would be a wrong gradient). The flash
    and dense lowerings differentiate them (``_dispatch.Config.term_grad``)."""
    if bias is None:
        return mask
    return Biased(mask, constants(bias) if constant else bias)


def term_leaves(mask) -> tuple:
    """Indices, in ``jax.tree_util.tree_leaves(mask)``, of the float arrays of
    the position term riding with ``mask`` (:func:`attach`): the leaves a
    gradient can flow to (ALiBi's slopes). Empty without a term. Sees through
    the wrappers of context parallelism (``masks.AtPositions`` around
    ``masks.Canonical``, whose leaves are the canonical operands)."""
    if isinstance(mask, masks.AtPositions):
        return term_leaves(mask.mask)
    if isinstance(mask, masks.Canonical):
        return tuple(n for n in term_operands(mask)
                     if jnp.issubdtype(jnp.result_type(mask.ops[n]), jnp.floating))
    if not isinstance(mask, Biased):
        return ()
    n = len(jax.tree_util.tree_leaves(mask.mask))
    return tuple(n + i for i, x in enumerate(jax.tree_util.tree_leaves(mask.bias))
                 if jnp.issubdtype(jnp.result_type(x), jnp.floating))


def term_operands(mask) -> range:
    """Indices, in ``mask.operands()``, of the term's operands (see
    :class:`Biased`), through the wrappers of context parallelism."""
    # (AtPositions's positions come after its mask's operands; Canonical's
    # operands are its mask's)
    b = _biased(mask)
    if b is None:
        return range(0)
    n = b._n()
    return range(n, n + b.bias.num_operands)


def kernel_grad_operands(term_grad: tuple, mask, kernel: str) -> tuple:
    """The operands (indices in ``mask.operands()``) whose gradient a backward
    kernel sums beside dq, one value per batch row and head, when
    ``term_grad`` (``Config.term_grad``) asks for the term's arrays; empty
    otherwise. An operand that varies along the queries or keys raises
    ``NotImplementedError`` naming ``kernel`` and the lowering that takes it."""
    if not term_grad:
        return ()
    ops = mask.operands()
    term_ops = tuple(term_operands(mask))
    for n in term_ops:
        if ops[n].shape[2] != 1 or ops[n].shape[3] != 1:
            raise NotImplementedError(
                f"flash ({kernel}): gradients into a position term's arrays that vary along "
                f"the queries or keys (shape {tuple(ops[n].shape)}) are not implemented; the "
                "blockwise XLA lowering (impl='xla') computes them")
    return term_ops


def kernel_leaf_grads(mask, term_grad: tuple, term_ops: tuple, sums) -> tuple:
    """The cotangents of the leaves ``term_grad`` from a backward kernel's sums:
    ``sums`` holds, per operand of ``term_ops`` (:func:`kernel_grad_operands`),
    its gradient summed per (batch row, head), (B, Hq); each is reduced over
    the axes its operand is broadcast along, then mapped back to the user's
    arrays (:func:`leaf_cotangents`). Empty when nothing is differentiated."""
    if not term_grad:
        return ()
    ops = mask.operands()
    d_ops = {}
    for n, g in zip(term_ops, sums):
        g = jnp.reshape(g, g.shape + (1, 1))
        d_ops[n] = g.sum(tuple(a for a in (0, 1) if ops[n].shape[a] == 1), keepdims=True)
    return leaf_cotangents(mask, term_grad, d_ops)


def with_leaves(mask, which: Sequence[int], values: Sequence[Array]):
    """``mask`` with the leaves at indices ``which`` replaced by ``values``."""
    leaves, treedef = jax.tree_util.tree_flatten(mask)
    for i, x in zip(which, values):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def leaf_cotangents(mask, which: Sequence[int], d_ops: dict) -> tuple:
    """Cotangents of the leaves ``which`` of ``mask`` from those of its operands.

    ``d_ops`` maps an index in ``mask.operands()`` to its cotangent (an array of
    the operand's shape); the others are zero. A lowering computes the gradient
    of the term's operands (canonical 4-D, what its tiles are cut from); this is
    the transpose of :meth:`PositionBias.operands` back to the user's arrays.
    """
    leaves = jax.tree_util.tree_leaves(mask)
    primals = [leaves[i] for i in which]
    ops, back = jax.vjp(lambda *xs: tuple(with_leaves(mask, which, xs).operands()), *primals)
    cts = []
    for n, op in enumerate(ops):
        if not jnp.issubdtype(op.dtype, jnp.inexact):
            cts.append(np.zeros(op.shape, jax.dtypes.float0))
        else:
            d = d_ops.get(n)
            cts.append(jnp.zeros(op.shape, op.dtype) if d is None else d.astype(op.dtype))
    return tuple(g.astype(x.dtype) for g, x in zip(back(tuple(cts)), primals))


def constants(term: PositionBias) -> PositionBias:
    """``term`` with its arrays refusing a tangent (for the variants that compute
    no gradient for them; a silent zero would be a wrong gradient)."""
    return jax.tree_util.tree_map(_constant, term)


# ----------------------------------------------------------------------------------
# The serving variants: a term's arrays per batch row and head only
# ----------------------------------------------------------------------------------


def check_serving(fn: str, term: PositionBias, dims: tuple, *, per_batch: bool,
                  what: str) -> None:
    """Validates ``term`` for ``dims`` = (batch, heads, Tq, Tk) and raises
    ``NotImplementedError`` if its arrays vary along queries or keys (or along
    the batch, unless ``per_batch``): a serving variant (``what``) carries them
    to its rows one value per (batch row,) head."""
    try:
        term.validate(*dims)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{fn}: {e}") from None
    along = ("queries or keys" if per_batch else "sequences, queries or keys")
    takes = "batch row and head" if per_batch else "head"
    for op in jax.eval_shape(lambda t: t.operands(), term):
        if op.shape[2] != 1 or op.shape[3] != 1 or (not per_batch and op.shape[0] != 1):
            raise NotImplementedError(
                f"{fn}: a position term whose arrays vary along {along} ({term!r}) is not "
                f"supported by {what}, which takes arrays per {takes} "
                "(position_bias.alibi); fnattn.attention takes any")


def per_head_arrays(term: PositionBias, batch: int, num_heads: int):
    """A term's arrays as constants (:func:`constants`), float32 (n, batch,
    num_heads), or None without arrays; each an operand (B|1, H|1, 1, 1)
    broadcast (:func:`check_serving`)."""
    ops = constants(term).operands()
    if not ops:
        return None
    return jnp.stack([jnp.broadcast_to(op[:, :, 0, 0].astype(jnp.float32),
                                       (batch, num_heads)) for op in ops])


@jax.custom_jvp
def _constant(x):
    return x


@_constant.defjvp
def _constant_jvp(primals, tangents):
    raise NotImplementedError(
        "position_bias: differentiating with respect to a position term's arrays (ALiBi's "
        "slopes) is not implemented by the serving variants (decode, paged, "
        "fnattn.context.decode), which take them as constants; fnattn.attention, "
        "fnattn.flash, fnattn.context.attention and fnattn.reference differentiate them.")
