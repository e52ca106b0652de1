"""A composable, traceable mask algebra.

A mask says which (query, key) pairs may attend. Masks are frozen pytrees: the
arrays they hold (segment ids, lengths, prefix lengths, dense boolean masks) are
leaves, so a mask can be built from traced values inside ``jax.jit`` and passed
through ``jax.vmap``; everything else (predicates, window and chunk sizes given
as Python ints) is static. Window and chunk sizes may also be integer arrays
(traced, e.g. one per layer inside ``lax.scan``): then they are leaves too.

Masks combine with ``&`` (both allow), ``|`` (either allows) and ``~`` (negation).

Positions and alignment
-----------------------
Every mask is a predicate over ``(batch, head, q, k)``. Query rows are numbered
``0 .. Tq-1`` and key columns ``0 .. Tk-1``. Positional masks (causal, sliding
window, chunked, prefix-LM) compare the key index with the **aligned query
position** ``q_pos = q + (Tk - Tq)``: when ``Tq != Tk`` the queries are the *last*
``Tq`` positions of the key sequence (bottom-right alignment). This is what
decoding and chunked prefill need: a single query against ``Tk`` cached keys
sees all of them under ``causal()``. When ``Tq == Tk`` it is the usual
``k <= q``. Masks that index arrays (segments, lengths, ``from_array``) use the
raw row index ``q``.

The protocol every mask implements
----------------------------------
Lowerings never look at mask classes. They use three methods:

* ``operands()`` returns the mask's arrays in canonical 4-D form
  ``(B|1, H|1, Tq|1, Tk|1)``: a size-1 axis means "does not vary along it".
  A kernel slices each operand to its tile along the non-1 axes.
* ``predicate(pos, ops)`` evaluates the mask elementwise, where ``pos`` holds
  broadcastable index arrays and ``ops`` the operand tiles, in the same order.
  Only elementwise ``jnp`` operations are used, so the same code runs in the
  reference, in an XLA loop and inside a Pallas kernel.
* ``tile_bounds(tiles, ops)`` says, per (q-block, kv-block) tile, whether some
  pair in the tile *may* be allowed and whether *all* pairs certainly are; this
  is what block-sparse lowerings use to skip empty tiles and to skip mask
  evaluation on full ones. See :func:`block_classes`.

Example:

  >>> import jax.numpy as jnp
  >>> from fnattn import masks
  >>> m = masks.causal() & masks.sliding_window(left=2)
  >>> print(masks.render(m, 5, 5))
  x . . . .
  x x . . .
  x x x . .
  . x x x .
  . . x x x
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = [
    "Mask",
    "Positions",
    "TileBounds",
    "causal",
    "sliding_window",
    "chunked",
    "NO_WINDOW",
    "segments",
    "lengths",
    "prefix_lm",
    "from_array",
    "from_fn",
    "at_positions",
    "full",
    "materialize",
    "block_classes",
    "block_classes_static",
    "render",
    "dense_positions",
    "EMPTY",
    "PARTIAL",
    "FULL",
]

# Tile classes produced by `block_classes`.
EMPTY = 0
PARTIAL = 1
FULL = 2


class Positions(NamedTuple):
    """Broadcastable integer index arrays at which a mask is evaluated.

    Attributes:
      b: batch index.
      h: query-head index.
      q: raw query row index (``0 .. Tq-1``), used to index operands.
      q_pos: aligned query position, compared with ``k`` by positional masks.
      k: key index (``0 .. Tk-1``).
    """

    b: Any
    h: Any
    q: Any
    q_pos: Any
    k: Any


class TileBounds(NamedTuple):
    """Inclusive index ranges of tiles, as broadcastable arrays.

    ``q_lo``/``q_hi`` are raw query rows, ``pos_lo``/``pos_hi`` the aligned query
    positions of those rows, ``k_lo``/``k_hi`` key indices. ``b`` and ``h`` are the
    batch and head indices of each tile.
    """

    b: Any
    h: Any
    q_lo: Any
    q_hi: Any
    pos_lo: Any
    pos_hi: Any
    k_lo: Any
    k_hi: Any


class OperandStats(NamedTuple):
    """Per-tile minimum and maximum of one operand (shapes broadcast with tiles)."""

    lo: Any
    hi: Any


def _to4d(x: Array, axes: str) -> Array:
    """Reshape an array whose axes are named by a subset of "bhqk" to 4-D."""
    shape = []
    it = iter(x.shape)
    for ax in "bhqk":
        shape.append(next(it) if ax in axes else 1)
    return jnp.reshape(x, shape)


class Mask:
    """Base class of all masks. Build masks with the functions of this module."""

    # -- protocol -----------------------------------------------------------------
    def operands(self) -> tuple[Array, ...]:
        return ()

    def predicate(self, pos: Positions, ops: Sequence[Array]) -> Array:
        raise NotImplementedError

    def tile_bounds(self, t: TileBounds, ops: Sequence[OperandStats]) -> tuple[Any, Any]:
        """Returns ``(may_any, all_true)`` per tile (conservative)."""
        raise NotImplementedError

    def validate(self, batch: int, num_heads: int, q_len: int, kv_len: int) -> None:
        """Raises ``ValueError`` naming the argument if an operand does not fit."""

    @property
    def num_operands(self) -> int:
        # Every array leaf is exactly one operand, in the same order.
        return len(jax.tree_util.tree_leaves(self))

    # -- algebra ------------------------------------------------------------------
    def __and__(self, other: "Mask") -> "Mask":
        _check_mask(other, "&")
        return And(self, other)

    def __or__(self, other: "Mask") -> "Mask":
        _check_mask(other, "|")
        return Or(self, other)

    def __invert__(self) -> "Mask":
        return Not(self)

    def __bool__(self):
        raise TypeError(
            "A mask has no truth value. To combine masks use `&` (both allow), "
            "`|` (either allows) and `~` (negation), not the Python keywords "
            "`and`, `or`, `not`, which call bool() on the mask; and test for "
            "a missing mask with `mask is None`."
        )


def _check_mask(other, op):
    if not isinstance(other, Mask):
        hint = (" (wrap a boolean array with masks.from_array)"
                if hasattr(other, "shape") and hasattr(other, "dtype") else "")
        raise TypeError(
            f"cannot combine a mask with {type(other).__name__} using `{op}`; "
            f"both sides must be fnattn.masks objects{hint}")


def _register(cls, data=(), meta=()):
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))
    return cls


def _bool_shape_check(name, arr, expected, batch, num_heads, q_len, kv_len):
    shape = tuple(arr.shape)
    want = dict(zip("bhqk", (batch, num_heads, q_len, kv_len)))
    for ax, n in zip(expected, shape):
        if n != want[ax] and not (n == 1 and ax in "bh"):
            names = {"b": "batch", "h": "heads", "q": "Tq", "k": "Tk"}
            exp = tuple(want[a] for a in expected)
            raise ValueError(
                f"{name} must have shape ({', '.join(names[a] for a in expected)})"
                f"={exp}; got {shape}")


# ---------------------------------------------------------------------------------
# Combinators
# ---------------------------------------------------------------------------------


def _split(masks, ops):
    out, i = [], 0
    for m in masks:
        n = m.num_operands
        out.append(ops[i:i + n])
        i += n
    return out


class And(Mask):
    a: Mask
    b: Mask

    def operands(self):
        return self.a.operands() + self.b.operands()

    def predicate(self, pos, ops):
        oa, ob = _split((self.a, self.b), ops)
        return self.a.predicate(pos, oa) & self.b.predicate(pos, ob)

    def tile_bounds(self, t, ops):
        oa, ob = _split((self.a, self.b), ops)
        any_a, all_a = self.a.tile_bounds(t, oa)
        any_b, all_b = self.b.tile_bounds(t, ob)
        return any_a & any_b, all_a & all_b

    def validate(self, *dims):
        self.a.validate(*dims)
        self.b.validate(*dims)

    def __repr__(self):
        return f"({self.a!r} & {self.b!r})"


def conjuncts(mask) -> list:
    """The masks whose ``&`` is ``mask`` (``[]`` for None), in order: what a
    lowering with native forms for some masks (cuDNN's) inspects.

    >>> conjuncts(causal() & sliding_window(4) & lengths(None, [3]))
    [causal(), sliding_window(left=4, right=0), lengths(...)]
    """
    if mask is None:
        return []
    if isinstance(mask, And):
        return conjuncts(mask.a) + conjuncts(mask.b)
    return [mask]


class Or(Mask):
    a: Mask
    b: Mask

    def operands(self):
        return self.a.operands() + self.b.operands()

    def predicate(self, pos, ops):
        oa, ob = _split((self.a, self.b), ops)
        return self.a.predicate(pos, oa) | self.b.predicate(pos, ob)

    def tile_bounds(self, t, ops):
        oa, ob = _split((self.a, self.b), ops)
        any_a, all_a = self.a.tile_bounds(t, oa)
        any_b, all_b = self.b.tile_bounds(t, ob)
        return any_a | any_b, all_a | all_b

    def validate(self, *dims):
        self.a.validate(*dims)
        self.b.validate(*dims)

    def __repr__(self):
        return f"({self.a!r} | {self.b!r})"


class Not(Mask):
    a: Mask

    def operands(self):
        return self.a.operands()

    def predicate(self, pos, ops):
        # (an xor with True, not a bitwise not: Mosaic GPU under jax 0.11 lowers no
        # not of booleans, whose 1-bit registers its layouts do not take)
        return jnp.logical_xor(self.a.predicate(pos, ops), True)

    def tile_bounds(self, t, ops):
        any_a, all_a = self.a.tile_bounds(t, ops)
        return ~all_a, ~any_a

    def validate(self, *dims):
        self.a.validate(*dims)

    def __repr__(self):
        return f"~{self.a!r}"


And = _register(And, data=("a", "b"))
Or = _register(Or, data=("a", "b"))
Not = _register(Not, data=("a",))


# ---------------------------------------------------------------------------------
# Positional masks (no arrays)
# ---------------------------------------------------------------------------------


def _tile_const(t: TileBounds, value: bool):
    """A constant per tile; a NumPy array when the bounds are (the static
    classes of :func:`block_classes_static`, computed without JAX)."""
    if isinstance(t.pos_lo, np.ndarray) and isinstance(t.k_lo, np.ndarray):
        return np.full(np.broadcast_shapes(t.pos_lo.shape, t.k_lo.shape), value)
    return jnp.full(jnp.broadcast_shapes(jnp.shape(t.pos_lo), jnp.shape(t.k_lo)), value, bool)


class Full(Mask):
    def predicate(self, pos, ops):
        return jnp.ones(jnp.broadcast_shapes(jnp.shape(pos.q_pos), jnp.shape(pos.k)), bool)

    def tile_bounds(self, t, ops):
        x = _tile_const(t, True)
        return x, x

    def __repr__(self):
        return "full()"


class Causal(Mask):
    def predicate(self, pos, ops):
        return pos.k <= pos.q_pos

    def tile_bounds(self, t, ops):
        return t.k_lo <= t.pos_hi, t.k_hi <= t.pos_lo

    def __repr__(self):
        return "causal()"


class SlidingWindow(Mask):
    left: int | None
    right: int | None

    def predicate(self, pos, ops):
        ok = None
        if self.left is not None:
            ok = pos.k >= pos.q_pos - self.left
        if self.right is not None:
            r = pos.k <= pos.q_pos + self.right
            ok = r if ok is None else ok & r
        return ok

    def tile_bounds(self, t, ops):
        any_, all_ = True, True
        if self.left is not None:
            any_ = t.k_hi >= t.pos_lo - self.left
            all_ = t.k_lo >= t.pos_hi - self.left
        if self.right is not None:
            any_ = any_ & (t.k_lo <= t.pos_hi + self.right)
            all_ = all_ & (t.k_hi <= t.pos_lo + self.right)
        return any_, all_

    def __repr__(self):
        return f"sliding_window(left={self.left}, right={self.right})"


class Chunked(Mask):
    size: int

    def predicate(self, pos, ops):
        return (pos.q_pos // self.size) == (pos.k // self.size)

    def tile_bounds(self, t, ops):
        s = self.size
        q0, q1, k0, k1 = t.pos_lo // s, t.pos_hi // s, t.k_lo // s, t.k_hi // s
        return (q0 <= k1) & (k0 <= q1), (q0 == q1) & (k0 == k1) & (q0 == k0)

    def __repr__(self):
        return f"chunked({self.size})"


class SlidingWindowArray(Mask):
    """:class:`SlidingWindow` whose sides are int arrays, () or (B,) (a traced
    window: one per layer inside ``lax.scan``, or one per batch row); None
    leaves a side unbounded. Its tile classes come from the values, as a
    segment mask's do from its ids."""

    left: Array | None
    right: Array | None

    def operands(self):
        return tuple(_to4d(x, "b") if jnp.ndim(x) == 1 else
                     jnp.reshape(x, (1, 1, 1, 1))
                     for x in (self.left, self.right) if x is not None)

    def predicate(self, pos, ops):
        ops = list(ops)
        ok = True
        if self.left is not None:
            ok = pos.k >= pos.q_pos - ops.pop(0)
        if self.right is not None:
            ok = ok & (pos.k <= pos.q_pos + ops.pop(0))
        return ok

    def tile_bounds(self, t, ops):
        # The widest window a tile's rows have may see a key; the narrowest must.
        ops = list(ops)
        any_, all_ = True, True
        if self.left is not None:
            s = ops.pop(0)
            any_, all_ = t.k_hi >= t.pos_lo - s.hi, t.k_lo >= t.pos_hi - s.lo
        if self.right is not None:
            s = ops.pop(0)
            any_ = any_ & (t.k_lo <= t.pos_hi + s.hi)
            all_ = all_ & (t.k_hi <= t.pos_lo + s.lo)
        return any_, all_

    def validate(self, batch, num_heads, q_len, kv_len):
        for name, x in (("left", self.left), ("right", self.right)):
            if x is not None and tuple(jnp.shape(x)) not in ((), (batch,)):
                raise ValueError(f"sliding_window: an array {name} must have shape () or "
                                 f"(batch,)=({batch},); got {tuple(jnp.shape(x))}")

    def __repr__(self):
        side = lambda x: None if x is None else "<array>"  # noqa: E731
        return f"sliding_window(left={side(self.left)}, right={side(self.right)})"


class ChunkedArray(Mask):
    """:class:`Chunked` whose size is an int array, () or (B,) (traced, as for
    :class:`SlidingWindowArray`)."""

    size: Array

    def operands(self):
        x = self.size
        return (_to4d(x, "b") if jnp.ndim(x) == 1 else jnp.reshape(x, (1, 1, 1, 1)),)

    def predicate(self, pos, ops):
        (s,) = ops
        return (pos.q_pos // s) == (pos.k // s)

    def tile_bounds(self, t, ops):
        # The operand varies along the batch only: each tile has one size (lo == hi).
        (st,) = ops
        s = st.lo
        q0, q1, k0, k1 = t.pos_lo // s, t.pos_hi // s, t.k_lo // s, t.k_hi // s
        return (q0 <= k1) & (k0 <= q1), (q0 == q1) & (k0 == k1) & (q0 == k0)

    def validate(self, batch, num_heads, q_len, kv_len):
        if tuple(jnp.shape(self.size)) not in ((), (batch,)):
            raise ValueError(f"chunked: an array size must have shape () or (batch,)="
                             f"({batch},); got {tuple(jnp.shape(self.size))}")

    def __repr__(self):
        return "chunked(<array>)"


Full = _register(Full)
Causal = _register(Causal)
SlidingWindow = _register(SlidingWindow, meta=("left", "right"))
Chunked = _register(Chunked, meta=("size",))
SlidingWindowArray = _register(SlidingWindowArray, data=("left", "right"))
ChunkedArray = _register(ChunkedArray, data=("size",))

#: A window or chunk size that limits nothing at any position below it: the
#: "global" value of a traced size (``sliding_window(left=NO_WINDOW)`` sees every
#: earlier key, ``chunked(NO_WINDOW)`` is one chunk), so that local and global
#: layers can share one trace inside ``lax.scan``.
NO_WINDOW = 1 << 30


def full() -> Mask:
    """Every query attends to every key (the same as passing no mask)."""
    return Full()


def causal() -> Mask:
    """Key ``k`` is visible to query ``q`` when ``k <= q + (Tk - Tq)``.

    >>> print(render(causal(), 3, 5))
    x x x . .
    x x x x .
    x x x x x
    """
    return Causal()


def _is_size_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _size_array(fn: str, name: str, x):
    """A window or chunk size given as an array: int32, shape () or (B,)."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.integer) or jnp.ndim(x) > 1:
        raise TypeError(f"{fn}: an array {name} must be an integer scalar or a (batch,) "
                        f"integer array (one size per batch row); got {dtype}"
                        f"[{','.join(map(str, jnp.shape(x)))}]")
    return jnp.asarray(x, jnp.int32)


def sliding_window(left: int | None, right: int | None = 0) -> Mask:
    """Keys within ``[q_pos - left, q_pos + right]`` are visible.

    ``left=None`` (or ``right=None``) leaves that side unbounded. The default
    ``right=0`` makes the window causal; ``sliding_window(left=w)`` alone is
    local causal attention over the ``w`` previous tokens and the current one
    (Hugging Face's ``sliding_window=W``, W keys with the current one, is
    ``left=W - 1``).

    A side may be an integer array instead of a Python int: a scalar (traced,
    e.g. one per layer inside ``lax.scan``) or one size per batch row (B,).
    The blocks it leaves empty are still skipped, from a schedule computed
    from the values at run time (as for :func:`segments`); :data:`NO_WINDOW`
    is "no window" for the global layers of such a scan. Static ints keep the
    schedule computed at trace time.

    >>> print(render(sliding_window(left=1, right=1), 4, 4))
    x x . .
    x x x .
    . x x x
    . . x x
    >>> w = jnp.array([1, NO_WINDOW])                        # one window per batch row
    >>> materialize(causal() & sliding_window(left=w), 2, 1, 3, 3)[:, 0, 2].tolist()
    [[False, True, True], [True, True, True]]
    """
    if _is_size_array(left) or _is_size_array(right):
        sides = [None if x is None else _size_array("sliding_window", name, x)
                 for name, x in (("left", left), ("right", right))]
        if sides == [None, None]:
            raise ValueError("sliding_window: left and right cannot both be None; use full()")
        return SlidingWindowArray(*sides)
    for name, w in (("left", left), ("right", right)):
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer))
                              or w < 0):
            raise ValueError(
                f"sliding_window: {name} must be a non-negative int or None; got {w!r}")
    if left is None and right is None:
        raise ValueError("sliding_window: left and right cannot both be None; use full()")
    return SlidingWindow(None if left is None else int(left),
                         None if right is None else int(right))


def chunked(size: int) -> Mask:
    """Keys in the same chunk of ``size`` positions as the query are visible.

    Usually combined with ``causal()``, as in chunked local attention.

    ``size`` may be an integer array, a scalar (traced, e.g. per layer) or
    (B,), as for :func:`sliding_window`; :data:`NO_WINDOW` is one chunk.

    >>> print(render(chunked(2) & causal(), 4, 4))
    x . . .
    x x . .
    . . x .
    . . x x
    """
    if _is_size_array(size):
        return ChunkedArray(_size_array("chunked", "size", size))
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0:
        raise ValueError(f"chunked: size must be a positive int; got {size!r}")
    return Chunked(int(size))


# ---------------------------------------------------------------------------------
# Masks that carry arrays
# ---------------------------------------------------------------------------------


def _minmax_bounds_equal(qs: OperandStats, ks: OperandStats):
    may = (qs.lo <= ks.hi) & (ks.lo <= qs.hi)
    all_ = (qs.lo == qs.hi) & (ks.lo == ks.hi) & (qs.lo == ks.lo)
    return may, all_


class Segments(Mask):
    q_segment_ids: Array
    kv_segment_ids: Array

    def operands(self):
        return (_to4d(jnp.asarray(self.q_segment_ids), "bq"),
                _to4d(jnp.asarray(self.kv_segment_ids), "bk"))

    def predicate(self, pos, ops):
        qid, kid = ops
        return qid == kid

    def tile_bounds(self, t, ops):
        # Exact when segment ids are sorted along the sequence (packed documents),
        # conservative otherwise.
        return _minmax_bounds_equal(*ops)

    def validate(self, batch, num_heads, q_len, kv_len):
        for name, arr, ax in (("q_segment_ids", self.q_segment_ids, "bq"),
                              ("kv_segment_ids", self.kv_segment_ids, "bk")):
            if jnp.ndim(arr) != 2:
                raise ValueError(
                    f"segments: {name} must have shape (batch, "
                    f"{'Tq' if ax == 'bq' else 'Tk'})="
                    f"{(batch, q_len if ax == 'bq' else kv_len)}; got {tuple(jnp.shape(arr))}")
            if not jnp.issubdtype(jnp.result_type(arr), jnp.integer):
                raise TypeError(f"segments: {name} must be integer; got {jnp.result_type(arr)}")
            _bool_shape_check(f"segments: {name}", arr, ax, batch, num_heads, q_len, kv_len)

    def __repr__(self):
        return "segments(...)"


class Lengths(Mask):
    q_lengths: Array | None
    kv_lengths: Array | None

    def operands(self):
        ops = []
        if self.q_lengths is not None:
            ops.append(_to4d(jnp.asarray(self.q_lengths), "b"))
        if self.kv_lengths is not None:
            ops.append(_to4d(jnp.asarray(self.kv_lengths), "b"))
        return tuple(ops)

    def predicate(self, pos, ops):
        ops = list(ops)
        ok = True
        if self.q_lengths is not None:
            ok = pos.q < ops.pop(0)
        if self.kv_lengths is not None:
            ok = ok & (pos.k < ops.pop(0))
        return ok

    def tile_bounds(self, t, ops):
        ops = list(ops)
        any_, all_ = True, True
        if self.q_lengths is not None:
            s = ops.pop(0)
            any_, all_ = t.q_lo < s.lo, t.q_hi < s.lo
        if self.kv_lengths is not None:
            s = ops.pop(0)
            any_, all_ = any_ & (t.k_lo < s.lo), all_ & (t.k_hi < s.lo)
        return any_, all_

    def validate(self, batch, num_heads, q_len, kv_len):
        for name, arr in (("q_lengths", self.q_lengths), ("kv_lengths", self.kv_lengths)):
            if arr is None:
                continue
            if tuple(jnp.shape(arr)) != (batch,):
                raise ValueError(
                    f"lengths: {name} must have shape (batch,)=({batch},); "
                    f"got {tuple(jnp.shape(arr))}")
            if not jnp.issubdtype(jnp.result_type(arr), jnp.integer):
                raise TypeError(f"lengths: {name} must be integer; got {jnp.result_type(arr)}")

    def __repr__(self):
        return "lengths(...)"


class PrefixLM(Mask):
    prefix_lengths: Array

    def operands(self):
        return (_to4d(jnp.asarray(self.prefix_lengths), "b"),)

    def predicate(self, pos, ops):
        (p,) = ops
        return (pos.k < p) | (pos.k <= pos.q_pos)

    def tile_bounds(self, t, ops):
        (p,) = ops
        return (t.k_lo < p.lo) | (t.k_lo <= t.pos_hi), (t.k_hi < p.lo) | (t.k_hi <= t.pos_lo)

    def validate(self, batch, num_heads, q_len, kv_len):
        if tuple(jnp.shape(self.prefix_lengths)) != (batch,):
            raise ValueError(
                f"prefix_lm: prefix_lengths must have shape (batch,)=({batch},); "
                f"got {tuple(jnp.shape(self.prefix_lengths))}")
        if not jnp.issubdtype(jnp.result_type(self.prefix_lengths), jnp.integer):
            raise TypeError(f"prefix_lm: prefix_lengths must be integer; got "
                            f"{jnp.result_type(self.prefix_lengths)}")

    def __repr__(self):
        return "prefix_lm(...)"


class FromArray(Mask):
    mask: Array

    def operands(self):
        m = jnp.asarray(self.mask)
        return (jnp.reshape(m, (1,) * (4 - m.ndim) + m.shape),)

    def predicate(self, pos, ops):
        return ops[0]

    def tile_bounds(self, t, ops):
        (s,) = ops
        return s.hi, s.lo

    def validate(self, batch, num_heads, q_len, kv_len):
        shape = tuple(jnp.shape(self.mask))
        want = (batch, num_heads, q_len, kv_len)
        padded = (1,) * (4 - len(shape)) + shape
        ok = len(shape) <= 4 and padded[2:] == (q_len, kv_len) and all(
            n in (1, w) for n, w in zip(padded[:2], want[:2]))
        if not ok:
            raise ValueError(
                "from_array: mask must be broadcastable to (batch, heads, Tq, Tk)="
                f"{want} with full Tq and Tk axes; got {shape}")

    def __repr__(self):
        return "from_array(...)"


def tile_args(*args) -> tuple:
    """The arguments of a user's function (a ``from_fn`` predicate or position
    term) with the scalars among them broadcast to the tile the others span.

    Inside a kernel the batch and head indices (and a term's per-head values)
    are scalars beside index tiles; given as tiles, every operation of the
    function runs on tiles, which the Pallas lowerings take for any
    elementwise operation (Triton's, for one, mistypes a ``select`` of
    scalars). Arrays that already share a shape (the XLA lowerings) are
    returned as they are.

    >>> [jnp.shape(x) for x in tile_args(0, jnp.zeros((2, 1)), jnp.zeros((1, 3)))]
    [(2, 3), (2, 1), (1, 3)]
    """
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in args))
    if not shape:
        return args
    return tuple(jnp.broadcast_to(x, shape) if jnp.ndim(x) == 0 else x for x in args)


class FromFn(Mask):
    fn: Callable

    def predicate(self, pos, ops):
        out = self.fn(*tile_args(pos.b, pos.h, pos.q, pos.k))
        if jnp.result_type(out) != jnp.bool_:
            # An int result would be read as "nonzero attends": refuse the guess.
            raise TypeError(
                f"from_fn: the predicate {getattr(self.fn, '__name__', 'fn')} must return "
                f"booleans; got {jnp.result_type(out)}. Return a comparison, e.g. "
                "`lambda b, h, q, k: k <= q`, or `x != 0` for an integer x.")
        return jnp.broadcast_to(out, jnp.broadcast_shapes(
            jnp.shape(out), jnp.shape(pos.q), jnp.shape(pos.k)))

    def tile_bounds(self, t, ops):
        # An arbitrary predicate gives no tile information: every tile is partial.
        return _tile_const(t, True), _tile_const(t, False)

    def __repr__(self):
        return f"from_fn({getattr(self.fn, '__name__', 'fn')})"


class AtPositions(Mask):
    mask: Mask
    q_positions: Array
    kv_positions: Array

    def operands(self):
        def batched(x):  # (T,) is shared by the batch: (1, T)
            x = jnp.asarray(x)
            return x[None] if x.ndim == 1 else x
        return self.mask.operands() + (_to4d(batched(self.q_positions), "bq"),
                                       _to4d(batched(self.kv_positions), "bk"))

    def predicate(self, pos, ops):
        *inner, qp, kp = ops
        gpos = Positions(b=pos.b, h=pos.h, q=qp, q_pos=qp, k=kp)
        ok = self.mask.predicate(gpos, tuple(inner))
        return jnp.broadcast_to(ok, jnp.broadcast_shapes(
            jnp.shape(ok), jnp.shape(pos.q), jnp.shape(pos.k)))

    def tile_bounds(self, t, ops):
        *inner, qp, kp = ops
        # Per-tile minimum and maximum of the positions bound every positional
        # mask's test (each is monotone in q_pos and k), whatever their order.
        g = t._replace(q_lo=qp.lo, q_hi=qp.hi, pos_lo=qp.lo, pos_hi=qp.hi,
                       k_lo=kp.lo, k_hi=kp.hi)
        return self.mask.tile_bounds(g, tuple(inner))

    def validate(self, batch, num_heads, q_len, kv_len):
        for name, arr, n in (("q_positions", self.q_positions, q_len),
                             ("kv_positions", self.kv_positions, kv_len)):
            shape = tuple(jnp.shape(arr))
            if not jnp.issubdtype(jnp.result_type(arr), jnp.integer):
                raise TypeError(f"at_positions: {name} must be integer; got "
                                f"{jnp.result_type(arr)}")
            if shape not in ((n,), (1, n), (batch, n)):
                raise ValueError(
                    f"at_positions: {name} must have shape (T,)=({n},) or (batch, T)="
                    f"{(batch, n)}; got {shape}")
        self.mask.validate(batch, num_heads, q_len, kv_len)

    def __repr__(self):
        return f"at_positions({self.mask!r})"


class Canonical(Mask):
    """A mask whose arrays are already its canonical 4-D operands (internal:
    what context parallelism slices and sends between devices)."""

    ops: tuple
    treedef: Any

    def _inner(self):
        return from_treedef(self.treedef)

    def operands(self):
        return tuple(self.ops)

    def predicate(self, pos, ops):
        return self._inner().predicate(pos, ops)

    def tile_bounds(self, t, ops):
        return self._inner().tile_bounds(t, ops)

    def __repr__(self):
        return f"canonical({self._inner()!r})"


Segments = _register(Segments, data=("q_segment_ids", "kv_segment_ids"))
Lengths = _register(Lengths, data=("q_lengths", "kv_lengths"))
PrefixLM = _register(PrefixLM, data=("prefix_lengths",))
FromArray = _register(FromArray, data=("mask",))
FromFn = _register(FromFn, meta=("fn",))
AtPositions = _register(AtPositions, data=("mask", "q_positions", "kv_positions"))
Canonical = _register(Canonical, data=("ops",), meta=("treedef",))


def _array(fn: str, name: str, x):
    """A mask's array argument as a JAX array: Python lists, tuples and NumPy
    arrays are converted here (a list would otherwise become a pytree of Python
    ints that ``jit`` cannot trace); JAX arrays and tracers pass unchanged."""
    if x is None or isinstance(x, jax.Array):
        return x
    if isinstance(x, (list, tuple, range, np.ndarray, np.generic, int)) \
            and not isinstance(x, bool):
        try:
            return jnp.asarray(x)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"{fn}: {name} must be an array (or a rectangular list of "
                            f"ints); got {type(x).__name__}: {e}") from None
    raise TypeError(f"{fn}: {name} must be a JAX array (or a list / NumPy array of ints); "
                    f"got {type(x).__name__} {x!r}")


def segments(q_segment_ids, kv_segment_ids=None) -> Mask:
    """Packed documents: query and key attend when their segment ids are equal.

    Args:
      q_segment_ids: int array (batch, Tq).
      kv_segment_ids: int array (batch, Tk); defaults to ``q_segment_ids``.

    >>> ids = jnp.array([[0, 0, 1, 1, 1]])
    >>> print(render(segments(ids), 5, 5))
    x x . . .
    x x . . .
    . . x x x
    . . x x x
    . . x x x
    """
    q_segment_ids = _array("segments", "q_segment_ids", q_segment_ids)
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    return Segments(q_segment_ids, _array("segments", "kv_segment_ids", kv_segment_ids))


def lengths(q_lengths=None, kv_lengths=None) -> Mask:
    """Padding: rows ``q >= q_lengths[b]`` and keys ``k >= kv_lengths[b]`` are masked.

    Fully masked query rows produce zeros and ``lse = -inf``.

    >>> print(render(lengths(kv_lengths=jnp.array([3])), 2, 5))
    x x x . .
    x x x . .
    """
    if q_lengths is None and kv_lengths is None:
        raise ValueError("lengths: give q_lengths, kv_lengths or both")
    return Lengths(_array("lengths", "q_lengths", q_lengths),
                   _array("lengths", "kv_lengths", kv_lengths))


def prefix_lm(prefix_lengths) -> Mask:
    """Prefix-LM: the first ``prefix_lengths[b]`` keys are visible to every query,
    the rest causally.

    >>> print(render(prefix_lm(jnp.array([2])), 4, 4))
    x x . .
    x x . .
    x x x .
    x x x x
    """
    return PrefixLM(_array("prefix_lm", "prefix_lengths", prefix_lengths))


def from_array(mask) -> Mask:
    """A dense boolean mask broadcastable to (batch, heads, Tq, Tk); True attends.

    >>> print(render(from_array(jnp.eye(3, dtype=bool)), 3, 3))
    x . .
    . x .
    . . x
    """
    mask = _array("from_array", "mask", mask) if isinstance(mask, (list, tuple)) else mask
    dtype = jnp.result_type(mask)
    if not jnp.issubdtype(dtype, jnp.bool_):
        hint = ""
        if jnp.issubdtype(dtype, jnp.floating):
            hint = (" An additive float mask (0 to attend, -inf or a large negative number "
                    "to mask) is a bias: pass it as AttentionSpec(bias=...); a float mask "
                    "of 1s and 0s converts with `mask > 0`.")
        elif jnp.issubdtype(dtype, jnp.integer):
            hint = " Convert it with `mask != 0` (True attends)."
        raise TypeError(f"from_array: mask must be boolean; got {dtype}.{hint}")
    return FromArray(mask)


def from_fn(predicate: Callable) -> Mask:
    """A mask from an index predicate ``predicate(b, h, q, k) -> bool``.

    The predicate receives broadcastable int32 arrays (batch, query head, raw query
    row, key index) and must use elementwise ``jnp`` operations only, so that every
    lowering can evaluate it on a tile. It is static: it takes part in the jit cache
    key by identity. It gives no block-sparsity information (every tile is treated
    as partial); combine it with ``&`` and a structured mask to get skipping.

    >>> print(render(from_fn(lambda b, h, q, k: (q + k) % 2 == 0), 3, 3))
    x . x
    . x .
    x . x
    """
    if not callable(predicate):
        raise TypeError(f"from_fn: predicate must be callable; got {type(predicate).__name__}")
    return FromFn(predicate)


def at_positions(mask: Mask | None, q_positions, kv_positions) -> Mask:
    """``mask`` evaluated at given token positions instead of row and key indices.

    Positional masks (causal, sliding window, chunked, prefix-LM, lengths,
    ``from_fn``) compare *positions*: by default query row ``q`` is at
    ``q + Tk - Tq`` and key ``k`` at ``k``. With explicit positions, query row
    ``q`` is at ``q_positions[..., q]`` and key ``k`` at ``kv_positions[..., k]``
    (no alignment is added), so a call on one shard of a long sequence (tokens
    8192-12287, or the two chunks of a zigzag layout) gets exactly its rows of
    the whole sequence's mask. ``lengths`` compare positions with the lengths,
    ``from_fn`` receives positions. Masks that hold per-token arrays
    (segments, ``from_array``) still index them by the call's own rows and keys.
    Block skipping keeps working: tile bounds come from the minimum and maximum
    position of each tile. Dropout is not a mask: it hashes the call's own
    indices shifted by ``AttentionSpec.dropout_offsets`` (enough for a
    contiguous shard); :func:`fnattn.context.attention` gives every layout
    its global dropout positions.

    Args:
      mask: the mask to move (None: full attention, which positions do not change).
      q_positions: int array (Tq,) shared by the batch, or (batch, Tq).
      kv_positions: int array (Tk,) or (batch, Tk).

    >>> import jax.numpy as jnp
    >>> m = at_positions(causal(), jnp.array([4, 5]), jnp.arange(8))
    >>> print(render(m, 2, 8))
    x x x x x . . .
    x x x x x x . .
    """
    mask = Full() if mask is None else mask
    if not isinstance(mask, Mask):
        raise TypeError(f"at_positions: mask must be an fnattn.masks mask or None; got "
                        f"{type(mask).__name__}")
    return AtPositions(mask, _array("at_positions", "q_positions", q_positions),
                       _array("at_positions", "kv_positions", kv_positions))


# ---------------------------------------------------------------------------------
# Materialisation and block description
# ---------------------------------------------------------------------------------


def from_treedef(treedef) -> Mask | None:
    """The mask whose structure is ``treedef`` (None for None), its arrays (if it
    holds any) replaced by placeholders.

    Kernels keep only the mask's static structure,
    ``jax.tree_util.tree_structure(mask)``; this rebuilds the mask from it to call
    its predicate, which reads the arrays' tiles from its ``ops`` argument. (The
    placeholders are not None, which would read as an absent optional array such
    as ``q_lengths``.) The same rebuilds a position term
    (:mod:`fnattn.position_bias`) from its structure.

    >>> import jax
    >>> m = from_treedef(jax.tree_util.tree_structure(causal() & sliding_window(4)))
    >>> bool(m.predicate(Positions(b=0, h=0, q=5, q_pos=5, k=3), []))
    True
    """
    if treedef is None:
        return None
    return jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)


def materialize(mask: Mask | None, batch: int, num_heads: int, q_len: int, kv_len: int,
                *, q_offset: int | None = None, validate: bool = True) -> Array:
    """The mask as a dense boolean array broadcastable to (batch, heads, Tq, Tk).

    ``q_offset`` overrides the alignment ``Tk - Tq`` between query rows and key
    positions.
    """
    if mask is None:
        return jnp.ones((1, 1, q_len, kv_len), bool)
    if validate:
        mask.validate(batch, num_heads, q_len, kv_len)
    pos = dense_positions(batch, num_heads, q_len, kv_len, q_offset=q_offset)
    out = mask.predicate(pos, mask.operands())
    return jnp.broadcast_to(out, jnp.broadcast_shapes(jnp.shape(out), (1, 1, q_len, kv_len)))


def dense_positions(batch: int, num_heads: int, q_len: int, kv_len: int, *,
                    q_offset: int | None = None) -> Positions:
    """The :class:`Positions` of the whole (batch, heads, Tq, Tk) logit array,
    broadcastable; ``q_offset`` overrides the alignment ``Tk - Tq``.

    >>> pos = dense_positions(1, 2, 2, 3)
    >>> pos.q_pos.reshape(-1).tolist(), pos.k.reshape(-1).tolist()
    ([1, 2], [0, 1, 2])
    """
    off = kv_len - q_len if q_offset is None else q_offset
    b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(num_heads, dtype=jnp.int32)[None, :, None, None]
    q = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
    k = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
    return Positions(b=b, h=h, q=q, q_pos=q + off, k=k)


def _reduce_blocks(x: Array, axis: int, blk: int, fn) -> Array:
    n = x.shape[axis]
    if n == 1:
        return x
    nb = -(-n // blk)
    pad = nb * blk - n
    if pad:
        x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)], mode="edge")
    x = x.reshape(x.shape[:axis] + (nb, blk) + x.shape[axis + 1:])
    return fn(x, axis=axis + 1)


def _tile_minmax(op: Array, block_q: int, block_k: int) -> OperandStats:
    x = op.astype(jnp.int32) if op.dtype == jnp.bool_ else op
    lo = _reduce_blocks(_reduce_blocks(x, 2, block_q, jnp.min), 3, block_k, jnp.min)
    hi = _reduce_blocks(_reduce_blocks(x, 2, block_q, jnp.max), 3, block_k, jnp.max)
    if op.dtype == jnp.bool_:
        lo, hi = lo.astype(bool), hi.astype(bool)
    return OperandStats(lo, hi)


class _TileGrid:
    """The (q-block, kv-block) tile coordinates that :func:`block_classes` hands to
    a mask's ``tile_bounds``, in the array module ``xp`` (``jnp`` inside a trace,
    ``np`` for :func:`block_classes_static`), and the classes from its answer."""

    def __init__(self, xp, dtype, batch, q_len, kv_len, block_q, block_k, q_offset):
        self.xp, self.dtype, self.batch = xp, dtype, batch
        self.nq, self.nk = -(-q_len // block_q), -(-kv_len // block_k)
        self.off = kv_len - q_len if q_offset is None else q_offset
        qb = xp.arange(self.nq, dtype=dtype)[None, None, :, None]
        kb = xp.arange(self.nk, dtype=dtype)[None, None, None, :]
        self.q_lo = qb * block_q
        self.q_hi = xp.minimum(self.q_lo + block_q, q_len) - 1
        self.k_lo = kb * block_k
        self.k_hi = xp.minimum(self.k_lo + block_k, kv_len) - 1
        self.in_range = ((qb + 1) * block_q <= q_len) & ((kb + 1) * block_k <= kv_len)

    def bounds(self, num_heads) -> TileBounds:
        xp, dt = self.xp, self.dtype
        return TileBounds(b=xp.arange(self.batch, dtype=dt)[:, None, None, None],
                          h=xp.arange(num_heads, dtype=dt)[None, :, None, None],
                          q_lo=self.q_lo, q_hi=self.q_hi, pos_lo=self.q_lo + self.off,
                          pos_hi=self.q_hi + self.off, k_lo=self.k_lo, k_hi=self.k_hi)

    def classes(self, may, all_):
        """EMPTY=0, PARTIAL=1, FULL=2 from the tiles a mask may and must fully see
        (``True, True`` for no mask: FULL except the ragged edge tiles)."""
        xp = self.xp
        shape = xp.broadcast_shapes(xp.shape(may), xp.shape(all_), (1, 1, self.nq, self.nk))
        may = xp.broadcast_to(may, shape)
        all_ = xp.broadcast_to(all_ & self.in_range, shape)
        # A sum of two predicates. (A nested jnp.where here was miscompiled by
        # XLA:CPU in jax 0.10.2 for some shapes.)
        return (may | all_).astype(xp.int8) + all_.astype(xp.int8)


def block_classes(mask: Mask | None, batch: int, num_heads: int, q_len: int, kv_len: int,
                  block_q: int, block_k: int, *, q_offset: int | None = None) -> Array:
    """Classifies each (q-block, kv-block) tile as EMPTY, PARTIAL or FULL.

    Computed from the mask's arrays with O(T) work per operand plus one value per
    tile, so it runs inside ``jit`` in milliseconds even for very long sequences.
    The classification is conservative: EMPTY and FULL are certain, PARTIAL may
    still be empty or full. Tiles that run past ``q_len`` or ``kv_len`` are never
    FULL, so a kernel that skips mask evaluation on FULL tiles needs no bounds
    check there.

    Returns:
      int8 array of shape (B|1, H|1, ceil(Tq/block_q), ceil(Tk/block_k)).

    >>> c = block_classes(causal(), 1, 1, 8, 8, 4, 4)
    >>> c[0, 0].tolist()
    [[1, 0], [2, 1]]
    """
    grid = _TileGrid(jnp, jnp.int32, batch, q_len, kv_len, block_q, block_k, q_offset)
    if mask is None:
        return grid.classes(True, True)
    mask.validate(batch, num_heads, q_len, kv_len)
    stats = [_tile_minmax(op, block_q, block_k) for op in mask.operands()]
    return grid.classes(*mask.tile_bounds(grid.bounds(num_heads), stats))


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def block_classes_static(mask: Mask | None, batch: int, num_heads: int, q_len: int,
                         kv_len: int, block_q: int, block_k: int, *,
                         q_offset: int | None = None) -> np.ndarray | None:
    """:func:`block_classes` computed with NumPy at trace time, or None.

    The tile classes of a mask that holds no arrays (or of no mask) depend only
    on static sizes: this returns them as a read-only NumPy int8 array equal to
    ``block_classes(...)``, without running a JAX operation (eager JAX
    operations each compile a small program: slow on a first call). Lowerings
    use it to size their grids to the schedule at trace time. Returns None
    when the classes are not static: the mask holds arrays, or a size is not a
    Python int (a symbolic dimension under ``jax.export``); call
    :func:`block_classes` then. Results are cached per mask structure and sizes.

    >>> block_classes_static(causal(), 1, 1, 8, 8, 4, 4)[0, 0].tolist()
    [[1, 0], [2, 1]]
    >>> same = [np.array_equal(block_classes_static(m, 2, 3, 13, 21, 4, 8, q_offset=off),
    ...                        block_classes(m, 2, 3, 13, 21, 4, 8, q_offset=off))
    ...         for m in (None, full(), causal(), sliding_window(3, 1), ~causal(),
    ...                   chunked(4) & causal(), from_fn(lambda b, h, q, k: k < q) | causal())
    ...         for off in (None, 5)]
    >>> all(same)
    True
    >>> block_classes_static(segments(jnp.zeros((1, 8), jnp.int32)), 1, 1, 8, 8, 4, 4) is None
    True
    """
    if mask is not None and mask.num_operands:
        return None
    sizes = (batch, num_heads, q_len, kv_len, block_q, block_k)
    if not all(_is_int(x) for x in sizes) or not (q_offset is None or _is_int(q_offset)):
        return None
    treedef = None if mask is None else jax.tree_util.tree_structure(mask)
    return _block_classes_np(treedef, *(int(x) for x in sizes),
                             None if q_offset is None else int(q_offset))


@functools.lru_cache(maxsize=256)
def _block_classes_np(treedef, batch, num_heads, q_len, kv_len, block_q, block_k, q_offset):
    """NumPy :func:`block_classes` of the array-free mask ``treedef`` (None: no
    mask), or None if its ``tile_bounds`` needs JAX arrays."""
    grid = _TileGrid(np, np.int64, batch, q_len, kv_len, block_q, block_k, q_offset)
    if treedef is None:
        out = np.array(grid.classes(True, True))
    else:
        mask = from_treedef(treedef)
        mask.validate(batch, num_heads, q_len, kv_len)
        try:
            # A mask's bounds written with jnp functions run eagerly here.
            with jax.ensure_compile_time_eval():
                may, all_ = mask.tile_bounds(grid.bounds(num_heads), [])
            may, all_ = np.asarray(may, bool), np.asarray(all_, bool)
        except Exception:  # e.g. bounds that cannot run outside a trace
            return None
        out = np.array(grid.classes(may, all_))
    out.flags.writeable = False
    return out


def render(mask: Mask | None, q_len: int, kv_len: int, *, batch: int = 0, head: int = 0) -> str:
    """Draws the mask of one (batch, head) as a grid: ``x`` attends, ``.`` does not."""
    nb, nh = batch + 1, head + 1
    dense = np.asarray(materialize(mask, nb, nh, q_len, kv_len, validate=False))
    dense = dense[min(batch, dense.shape[0] - 1), min(head, dense.shape[1] - 1)]
    return "\n".join(" ".join("x" if v else "." for v in row) for row in dense)


# ---------------------------------------------------------------------------------
# Block selection (NSA, MoBA): key blocks chosen per query block by data
# ---------------------------------------------------------------------------------

# Key blocks per int32 word of a row's selection (30: shifts stay below the sign bit).
_SELECTION_BITS = 30


class BlockSelection(Mask):
    """Per query row, the set of selected key blocks as bits of ``len(words)``
    int32 words (bit ``n`` of word ``w``: key block ``30 * w + n``). Rows of one
    query block share their words, so the operands are (B|1, H|1, Tq, 1) and
    O(Tq * num_k_blocks / 30) in size, never (Tq, Tk). Build it with
    :func:`block_selection`."""

    words: tuple
    block_q: int
    block_k: int
    num_k_blocks: int

    def operands(self):
        return tuple(jnp.asarray(w)[..., None] for w in self.words)

    def predicate(self, pos, ops):
        kb = pos.k // self.block_k
        word = jnp.zeros((), jnp.int32)
        for w, op in enumerate(ops):
            word = jnp.where(kb // _SELECTION_BITS == w, op, word)
        bit = jnp.right_shift(word, kb % _SELECTION_BITS) & 1
        return (bit == 1) & (kb < self.num_k_blocks)

    def tile_bounds(self, t, ops):
        # Exact where the tile's rows share their words (the lowering's block_q a
        # divisor of the selection's): any / every selected bit in the tile's range
        # of key blocks. Rows with different words: "may", never "all".
        kb_lo, kb_hi = t.k_lo // self.block_k, t.k_hi // self.block_k
        may, all_ = False, True
        for w, s in enumerate(ops):
            lo_b = jnp.clip(kb_lo - _SELECTION_BITS * w, 0, _SELECTION_BITS)
            hi_b = jnp.clip(kb_hi - _SELECTION_BITS * w + 1, 0, _SELECTION_BITS)
            m = jnp.left_shift(jnp.int32(1), hi_b) - jnp.left_shift(jnp.int32(1), lo_b)
            same = s.lo == s.hi
            may = may | jnp.where(same, (s.lo & m) != 0, m != 0)
            all_ = all_ & same & ((s.lo & m) == m)
        return may, all_ & (kb_hi < self.num_k_blocks)

    def validate(self, batch, num_heads, q_len, kv_len):
        for w in self.words:
            shape = tuple(jnp.shape(w))
            if len(shape) != 3 or shape[2] != q_len or shape[0] not in (1, batch) \
                    or shape[1] not in (1, num_heads):
                raise ValueError(
                    f"block_selection: the selection was built for q_len={shape[-1]} (rows "
                    f"{shape}); attention has (batch, heads, Tq)={(batch, num_heads, q_len)}."
                    " Pass q_len= (and a batch / head axis of 1 or the problem's).")
        if self.num_k_blocks * self.block_k < kv_len:
            raise ValueError(
                f"block_selection: {self.num_k_blocks} key blocks of {self.block_k} cover "
                f"{self.num_k_blocks * self.block_k} keys; attention has Tk={kv_len}. Give "
                f"the map ceil(Tk / block_k)={-(-kv_len // self.block_k)} key blocks")

    def __repr__(self):
        return (f"block_selection(block_q={self.block_q}, block_k={self.block_k}, "
                f"num_k_blocks={self.num_k_blocks})")


BlockSelection = _register(BlockSelection, data=("words",),
                           meta=("block_q", "block_k", "num_k_blocks"))


def block_selection(selected, *, block_q: int, block_k: int, q_len: int | None = None,
                    num_k_blocks: int | None = None) -> Mask:
    """Query block ``i`` attends to the key blocks selected for it (NSA, MoBA).

    Query block ``i`` is rows ``i * block_q .. (i + 1) * block_q - 1``; key block
    ``j`` is keys ``j * block_k ..`` (key indices, as the positional masks use).
    The selection may be traced (it changes every step without recompiling) and
    composes with ``&``, ``|``, ``~`` and the positional masks (``causal()``
    within the selected blocks, a sliding window beside them).

    With the flash lowering's block sizes equal to (or dividing) ``block_q`` and
    ``block_k`` (``XlaBlockSizes(block_q=..., block_k=...)``), the tiles it visits
    are exactly the selected ones, each without a mask evaluation unless another
    mask cuts it. The mask's arrays are ``ceil(num_k_blocks / 30)`` int32 words per
    query row, never (Tq, Tk).

    Args:
      selected: a boolean map (nQ, nK), (B, nQ, nK) or (B|1, H|1, nQ, nK) of the
        selected key blocks of each query block; or integer lists of them, the
        same shapes with a last axis of n selected block indices (``-1`` and
        indices outside ``[0, num_k_blocks)`` select nothing; repeats are one).
      block_q: query rows per query block.
      block_k: keys per key block.
      q_len: query rows (default ``nQ * block_q``).
      num_k_blocks: key blocks, with integer lists (a boolean map says it: nK).

    >>> import jax.numpy as jnp
    >>> sel = block_selection(jnp.array([[True, False, True], [False, True, False]]),
    ...                       block_q=2, block_k=2)
    >>> print(render(sel, 4, 6))
    x x . . x x
    x x . . x x
    . . x x . .
    . . x x . .
    >>> lists = block_selection(jnp.array([[0, 2], [1, -1]]), block_q=2, block_k=2,
    ...                         num_k_blocks=3)
    >>> render(lists, 4, 6) == render(sel, 4, 6)
    True
    """
    fn = "block_selection"
    for name, n in (("block_q", block_q), ("block_k", block_k)):
        if not _is_int(n) or n < 1:
            raise ValueError(f"{fn}: {name} must be a positive Python int; got {n!r}")
    sel = _array(fn, "selected", selected)
    if sel.ndim not in (2, 3, 4):
        raise ValueError(f"{fn}: selected must have shape (nQ, nK), (B, nQ, nK) or "
                         f"(B, H, nQ, nK); got {tuple(sel.shape)}")
    sel = sel[None, None] if sel.ndim == 2 else (sel[:, None] if sel.ndim == 3 else sel)
    if sel.dtype != jnp.bool_:
        if not jnp.issubdtype(sel.dtype, jnp.integer):
            raise TypeError(f"{fn}: selected must be a boolean map or integer lists; got "
                            f"{sel.dtype}")
        if num_k_blocks is None:
            raise ValueError(f"{fn}: integer lists of key blocks need num_k_blocks=")
        ok = (sel >= 0) & (sel < num_k_blocks)
        hot = (sel[..., None] == jnp.arange(num_k_blocks)) & ok[..., None]
        sel = jnp.any(hot, axis=-2)
    nq, nk = sel.shape[-2:]
    if num_k_blocks is not None and num_k_blocks != nk:
        raise ValueError(f"{fn}: num_k_blocks={num_k_blocks} but the map has {nk} key blocks")
    q_len = nq * block_q if q_len is None else q_len
    if not _is_int(q_len) or not (nq - 1) * block_q < q_len <= nq * block_q:
        raise ValueError(f"{fn}: q_len={q_len!r} must be covered by the map's {nq} query "
                         f"blocks of {block_q} (between {(nq - 1) * block_q + 1} and "
                         f"{nq * block_q})")
    n_words = -(-nk // _SELECTION_BITS)
    bits = jnp.pad(sel, [(0, 0)] * 3 + [(0, n_words * _SELECTION_BITS - nk)])
    bits = bits.reshape(sel.shape[:3] + (n_words, _SELECTION_BITS)).astype(jnp.int32)
    words = jnp.sum(jnp.left_shift(bits, jnp.arange(_SELECTION_BITS, dtype=jnp.int32)),
                    axis=-1, dtype=jnp.int32)                      # (B|1, H|1, nQ, W)
    rows = jnp.repeat(words, block_q, axis=2)[:, :, :q_len]         # (B|1, H|1, Tq, W)
    return BlockSelection(tuple(rows[..., w] for w in range(n_words)), block_q, block_k, nk)


__all__ += ["block_selection"]
