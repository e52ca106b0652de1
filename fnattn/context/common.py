"""What the ring and the all-gather strategies share: validation, the static
description of a context-parallel problem, and the inputs of one (query piece,
key piece) call of the flash lowering.

Mask operands are handled in their canonical 4-D form ``(B|1, H|1, Tq|1, Tk|1)``
(see :mod:`fnattn.masks`), sorted by what their key axis holds:

* ``"none"``: size 1 (lengths, prefix lengths, positional masks' nothing);
* ``"travel"``: this device's keys (``L`` columns, e.g. key segment ids): the
  ring sends them along with K and V, the all-gather gathers them;
* ``"columns"``: every key of the sequence (``N * L`` columns, in the layout's
  key order: a bias or ``from_array`` mask): each step slices the visiting
  device's columns.
"""

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from fnattn import _checks, _dispatch, dropout, masks, position_bias
from fnattn.context.layouts import Piece, check_layout

I32 = jnp.int32
STRATEGIES = ("ring", "all_gather")
IMPLS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Problem:
    """Static description of one context-parallel call (hashable)."""

    table: Any
    axis_name: Any
    axis_size: int
    layout: str
    dims: _checks.Dims          # this device's shard (q_len == kv_len == L)
    scale: float
    softcap: Optional[float]
    dropout_rate: float
    block_sizes: Any
    mask_treedef: Any           # the user's mask structure, or None
    op_kinds: tuple             # per canonical operand: (q varies, key kind)
    bias_kind: Optional[str]    # key kind of the bias, None without a bias

    @property
    def L(self) -> int:
        return self.dims.q_len


def _key_kind(n: int, L: int, N: int, what: str, fn: str, q_varies: bool) -> str:
    if n == 1:
        return "none"
    if N == 1 and n == L:
        return "travel"  # one device: its keys are every key, sliced alike
    if n == N * L:
        return "columns"
    if n == L and not q_varies:
        return "travel"
    # An array with query rows and only L key columns (a local (L, L) block)
    # cannot say which keys of the other devices its rows see.
    raise ValueError(
        f"{fn}: {what} has {n} key columns; expected 1, the local key count L={L} (an "
        f"array of the keys' own values, like key segment ids, sent with K and V), or "
        f"all N*L={N * L} keys of the sequence (a bias or array mask: this device's "
        "query rows against every key, in the layout's key order)")


def _parts(mask):
    """The masks whose ``&``, ``|`` and ``~`` make ``mask``, in order.

    >>> from fnattn import masks
    >>> _parts(masks.causal() & ~(masks.chunked(4) | masks.sliding_window(2)))
    [causal(), chunked(4), sliding_window(left=2, right=0)]
    """
    if isinstance(mask, (masks.And, masks.Or)):
        return _parts(mask.a) + _parts(mask.b)
    if isinstance(mask, masks.Not):
        return _parts(mask.a)
    return [mask]


def prepare(spec, q, k, v, *, axis_name, strategy: str, layout: str, fn: str):
    """Validates and returns ``(problem, q, k, v, bias4, ops, key, base)`` with
    q, k, v in "bthd", the bias in 4-D form (or None), the mask's canonical
    operands, and the dropout key's two words and base offsets (or None)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"{fn}: strategy must be one of {STRATEGIES}; got {strategy!r}")
    if spec.impl not in IMPLS:
        raise NotImplementedError(
            f"{fn}: impl={spec.impl!r} has no context-parallel lowering; the per-step "
            f"computation is the flash lowering of impl='auto' (the platform's kernel), "
            "'xla' (blockwise XLA loops) or 'pallas' (the Pallas kernels)")
    dims = _checks.check_qkv(q, k, v, spec.layout, fn=fn)
    if dims.q_len != dims.kv_len:
        raise ValueError(
            f"{fn}: q and k/v must hold equally long shards of one sequence; got "
            f"{dims.q_len} query and {dims.kv_len} key tokens per device (for a few new "
            "tokens against a sharded cache use fnattn.context.decode)")
    N = int(lax.axis_size(axis_name))
    L = dims.q_len
    check_layout(layout, L, fn)
    B, Hq = dims.batch, dims.num_q_heads
    _checks.check_spec_arrays(spec.replace(bias=None, mask=None), dims, fn=fn,
                              position_bias=True)

    bias4, bias_kind = None, None
    if spec.bias is not None:
        _checks.check_float(f"{fn}: bias", spec.bias)
        bs = tuple(spec.bias.shape)
        bias4 = jnp.reshape(spec.bias, (1,) * (4 - len(bs)) + bs) if len(bs) <= 4 else None
        if bias4 is None or any(n not in (1, w) for n, w in zip(bias4.shape[:3], (B, Hq, L))):
            raise ValueError(f"{fn}: bias must be broadcastable to (B, Hq, L, N*L)="
                             f"{(B, Hq, L, N * L)} (this device's query rows, every key); "
                             f"got {bs}")
        bias_kind = _key_kind(bias4.shape[3], L, N, f"bias {bs}", fn, q_varies=True)

    ops, kinds, treedef = (), (), None
    # A position term rides with the mask's arrays (fnattn.position_bias), and a
    # ring step evaluates it at the global positions it gives the mask.
    mask = position_bias.attach(spec.mask, spec.position_bias, constant=False)
    if mask is not None:
        treedef = jax.tree_util.tree_structure(mask)
        ops = tuple(mask.operands())
        # Each part is checked on its own key count: an array mask may hold
        # every key column beside segment ids of this device's tokens.
        for part in ([] if spec.mask is None else _parts(spec.mask)):
            errors = []
            for tk in dict.fromkeys((L, N * L)):
                try:
                    part.validate(B, Hq, L, tk)
                    break
                except (ValueError, TypeError) as e:
                    errors.append(e)
            else:
                raise type(errors[0])(f"{fn}: {errors[0]} (the mask's arrays hold this "
                                      f"device's L={L} tokens, and every N*L={N * L} key "
                                      "column for an array mask)")
        for i, op in enumerate(ops):
            if op.shape[2] not in (1, L):
                raise ValueError(f"{fn}: mask operand {i} has {op.shape[2]} query rows; "
                                 f"expected 1 or this device's L={L}")
            q_varies = op.shape[2] > 1
            kinds += ((q_varies, _key_kind(op.shape[3], L, N, f"mask operand {i} "
                                           f"{tuple(op.shape)}", fn, q_varies)),)

    key = base = None
    if spec.dropout_rate > 0:
        # Axes other than the sequence's that q varies over, with no offsets:
        # one independent mask per shard along them (fnattn.dropout).
        seq_axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
        key = dropout._key_words(dropout.key_for_shard(
            spec.dropout_key, spec.dropout_offsets, q, sequence_axes=seq_axes))
        base = (jnp.zeros((4,), I32) if spec.dropout_offsets is None
                else jnp.asarray(spec.dropout_offsets).astype(I32))

    from fnattn.flash import api as flash_api
    q, k, v = (_checks.to_bthd(x, spec.layout) for x in (q, k, v))
    # The flash lowerings (impl="xla": the blockwise XLA loops, not the dense
    # one): a ring step's backward must take its probabilities from the global
    # lse it is given, which the dense lowering's recomputing backward does not.
    problem = Problem(
        table=flash_api.lowering_table(spec.impl, q.dtype), axis_name=axis_name, axis_size=N,
        layout=layout, dims=dims, scale=_checks.resolve_scale(spec, dims.head_dim),
        softcap=spec.softcap, dropout_rate=float(spec.dropout_rate),
        block_sizes=spec.block_sizes, mask_treedef=treedef, op_kinds=kinds,
        bias_kind=bias_kind)
    return problem, q, k, v, bias4, ops, key, base


def piece_positions(p: Piece):
    return jnp.asarray(p.start, I32) + p.stride * jnp.arange(p.size, dtype=I32)


def _slice(x, axis: int, start, size: int):
    if isinstance(start, int):
        return lax.slice_in_dim(x, start, start + size, axis=axis)
    return lax.dynamic_slice_in_dim(x, jnp.asarray(start, I32), size, axis=axis)


def slice_op(x, q_varies: bool, kind: str, qp: Piece, kp: Piece, src, L: int):
    """A canonical operand (or the 4-D bias) cut to the pair (qp, kp); ``x`` is
    the visiting device's copy for "travel" operands."""
    if q_varies and x.shape[2] > 1:
        x = _slice(x, 2, qp.lo, qp.size)
    if kind == "travel":
        x = _slice(x, 3, kp.lo, kp.size)
    elif kind == "columns":
        x = _slice(x, 3, src * L + kp.lo, kp.size)
    return x


def pair_call(P: Problem, qp: Piece, kp: Piece, src, *, q, k, v, bias4, ops, key, base,
              full_keys: bool = False):
    """The arguments of the flash lowering for query piece ``qp`` against key
    piece ``kp`` of device ``src``: ``(cfg, q, k, v, bias, mask_leaves, seed,
    nonempty)``. ``ops`` are the canonical operands with "travel" ones already
    the visiting device's; ``full_keys``: k/v hold the whole sequence in
    natural order (the all-gather), ``kp`` covering it."""
    qx = _slice(q, 1, qp.lo, qp.size)
    kx = k if full_keys else _slice(k, 1, kp.lo, kp.size)
    vx = v if full_keys else _slice(v, 1, kp.lo, kp.size)
    bx = None
    if bias4 is not None:
        bx = slice_op(bias4, True, "none" if full_keys else P.bias_kind, qp, kp, src, P.L)
    q_pos, k_pos = piece_positions(qp), piece_positions(kp)
    mask = None  # no mask: positions change nothing
    if P.mask_treedef is not None:
        cut = tuple(slice_op(op, qv, "none" if full_keys else kind, qp, kp, src, P.L)
                    for op, (qv, kind) in zip(ops, P.op_kinds))
        mask = masks.AtPositions(masks.Canonical(cut, P.mask_treedef), q_pos, k_pos)
    leaves, treedef = jax.tree_util.tree_flatten(mask)
    d = P.dims
    cfg = _dispatch.Config(dims=d._replace(q_len=qp.size, kv_len=kx.shape[1]), scale=P.scale,
                           softcap=P.softcap, dropout_rate=P.dropout_rate,
                           mask_treedef=treedef, block_sizes=P.block_sizes)
    seed = None
    if key is not None:
        offsets = base + jnp.stack([I32(0), I32(0), jnp.asarray(qp.start, I32),
                                    jnp.asarray(kp.start, I32)])
        seed = dropout.seed_from_key(key, offsets, jnp.array([qp.stride, kp.stride], I32))
    if mask is None:
        nonempty = jnp.bool_(True)
    else:
        cls = masks.block_classes(mask, d.batch, d.num_q_heads, qp.size, kx.shape[1],
                                  qp.size, kx.shape[1])
        nonempty = jnp.any(cls != masks.EMPTY)
    return cfg, qx, kx, vx, bx, tuple(leaves), seed, nonempty
