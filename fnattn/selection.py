"""Attention over keys chosen per query: top-k token selection (DeepSeek Sparse Attention).

Each query token attends to a given set of keys of its own sequence, named by
their positions: ``indices`` is (B, Tq, K) (every kv head sees the same keys,
as in DeepSeek-V3.2, whose MLA has one latent kv head) or (B, Tq, Hkv, K) (a
set per query token and kv head). The result is exactly dense attention of
the same spec with the keys outside the set masked out, computed without any
(Tq, Tk) array: memory and work grow as ``Tq * K``, never with the context.

**The index set.** For query ``t`` (and kv head ``h``) the keys attended are

    { j in indices[b, t, (h,) :] : 0 <= j < L_b }, each key once,

then the spec's mask is applied at (query position, key position ``j``), as it
would be in dense attention over the same sequence:

* **Duplicates count once**: the indices are a *set*. Attention over a set is
  what a mask means, so the result equals dense attention with a mask, merges
  exactly with a dense branch over the other keys (:func:`fnattn.merge`), and
  its gradients are those of that mask. (DSA's kernels count a repeated index
  twice; ``lax.top_k`` never repeats one, so for it the two agree.) Counting
  them once costs a sort of each row of indices; ``unique=True`` skips it,
  and then a repeated index counts as many times as it appears.
* **Out of range is not selected**: a negative index (``-1`` pads a row with
  fewer than K keys) or one at or past the sequence's length ``L_b`` (Tk for
  :func:`selected_attention`, ``kv_lengths[b]`` for the serving forms, or a
  position whose page the sequence does not own) selects nothing, and is
  never read: its gather reads the sequence's own first slot instead (first
  page, for a paged cache), whose value a select then replaces by zeros.
* **A row that selects nothing** (all padding, or every selected key masked)
  gives ``out = 0`` and ``lse = -inf`` (``lse = sinks[h]`` with a sink), with no
  NaN in the output or any gradient.
* **Unselected keys contribute exactly nothing**, whatever their K/V bits (NaN
  in a key nobody selected never reaches the output); a row that selects, and
  may see, a key with a non-finite K or V is NaN, as in dense attention.

**Spec features.** ``mask`` (evaluated at the selected positions: ``causal()``
keeps a query from the future keys it selected), ``scale``, ``softcap``,
``sinks`` (once per row, as in dense attention), ``return_lse`` and
``layout``. Not taken: ``bias`` (a (Tq, Tk) array: the thing this avoids),
``position_bias`` and dropout (each refused with a message).

**Lowering.** One XLA lowering on every platform (``impl`` "auto", "xla" and
"reference" all run it; "pallas" and "cudnn" raise ``NotImplementedError``).
It visits the query tokens in blocks (``lax.scan``); for a block it gathers
the selected keys and values, (tokens, Hkv, K, D), and computes the complete
softmax over them, so no online rescaling is needed. Derivatives follow
:mod:`fnattn._linear`: one tangent pass (forward mode) whose transpose is the
backward pass (reverse mode), both blockwise with the same gathers, the key
and value gradients scatter-added into the cache's shape; second order
differentiates the plain gather formulation.

**Caches.** The serving forms take MLA latent caches (``value_dim`` with no
values: the values are the first ``value_dim`` channels of the gathered keys,
their gradient added to the keys') and :mod:`fnattn.quant` quantized caches:
a block gathers the selected keys' codes and scales only and dequantizes
them to q's dtype, never the whole cache; reverse mode then runs, block by
block, ``jax.vjp`` of the block's forward (q, sinks and scales get gradients,
integer codes float0 zeros); forward mode is not defined for them.

Memory: besides the inputs and the result, the indices (4 bytes per entry,
twice) and one block's gathered keys, values and logits (``BLOCK_BYTES``; a
call of few tokens, decode, is one block). With several blocks XLA copies the
key and value stores into the loop's state once (O(context), not O(Tq * Tk)).
"""

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jax import lax
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, _latent, _linear, quant
from fnattn import _online as online
from fnattn import masks
from fnattn.merging import shifted_exp
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["selected_attention", "selected_decode", "selected_decode_with_update",
           "selected_paged_attention", "selected_ragged_paged_attention",
           "selected_ragged_paged_attention_with_update", "blockwise_top_k"]

F32 = jnp.float32
I32 = jnp.int32

# One block of query tokens gathers about this many bytes of keys and values
# (and forms logits of a similar size): large enough that the scan's steps are
# few, small enough to stay in cache.
BLOCK_BYTES = 2 ** 22
# Up to this many bytes in all (decode: a few tokens) the tokens form one block,
# with no loop: XLA copies the key and value stores into a loop's state (on a
# CPU, B=4 decode over a 32k-token cache: 130 MiB copied, 40x the gathers' time).
ONE_BLOCK_BYTES = 2 ** 25


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one call (hashable)."""

    scale: float
    softcap: Optional[float]
    mask_treedef: Any
    # The key store: (N, Hkv, D) tokens-first (a contiguous cache, free reshape)
    # or (Hkv, N, D) heads-first (the paged pools).
    heads_first: bool
    block_tokens: int
    # Whether the mask's operands are indexed by (batch, row, key position):
    # only selected_attention takes masks that hold arrays.
    mask_arrays: bool = False
    # A latent store (no value store): the values are the keys' first value_dim channels.
    value_dim: Optional[int] = None

    def mask(self, leaves):
        return None if self.mask_treedef is None else jax.tree_util.tree_unflatten(
            self.mask_treedef, leaves)


# ----------------------------------------------------------------------------------
# One block of query tokens
# ----------------------------------------------------------------------------------


def _flat(cfg, store, slot, tok):
    """Row indices into ``store`` flattened to (N * Hkv, D) for ``slot`` (t, Hkv, K);
    an unselected entry (-1) reads its sequence's own first slot (``tok[:, 3]``),
    whose value the caller discards with a select."""
    Hkv = slot.shape[1]
    h = jnp.arange(Hkv, dtype=I32)[None, :, None]
    s = jnp.where(slot >= 0, slot, tok[:, 3][:, None, None])
    if cfg.heads_first:
        return h * store.shape[1] + s
    return s * Hkv + h


def _gather(cfg, store, slot, tok, dtype=None):
    """The rows at ``slot`` (t, Hkv, K) of ``store``: (t, Hkv, K, D). One gather of
    whole rows (on a CPU 5-60x faster than a gather indexed by slot and head, or
    one in "fill" mode).

    A quantized store (:class:`fnattn.quant.QuantizedArray`) gathers the selected
    rows' codes and scales only, zeroes those of unselected entries (whose slot,
    and so whose scale, may hold anything) and dequantizes them to ``dtype``:
    the largest dequantized array is one block's selected keys."""
    ix = _flat(cfg, store, slot, tok)
    if not quant.is_quantized(store):
        flat = store.reshape(-1, store.shape[-1])
        return flat.at[ix].get(mode="promise_in_bounds")
    sel = slot >= 0
    data = store.data.reshape(-1, store.data.shape[-1]).at[ix].get(mode="promise_in_bounds")
    data = jnp.where(sel[..., None], data, jnp.zeros((), data.dtype))
    scale = jnp.asarray(store.scale, F32)
    if store.format.per_token:
        scale = scale.reshape(-1).at[ix].get(mode="promise_in_bounds")
        scale = jnp.where(sel, scale, jnp.zeros((), F32))
    return quant.dequantize(quant.QuantizedArray(data, scale, store.format), dtype)


def _scatter_add(cfg, store, slot, tok, x):
    """``store`` with ``x`` (t, Hkv, K, D) added at ``slot`` (x is 0 where unselected)."""
    flat = store.reshape(-1, store.shape[-1])
    flat = flat.at[_flat(cfg, store, slot, tok)].add(x.astype(store.dtype),
                                                     mode="promise_in_bounds")
    return flat.reshape(store.shape)


def _operand_at(op, b, h, q, k):
    """A mask operand (B|1, H|1, Tq|1, Tk|1) at the broadcastable indices: a
    gather of the entries a block needs, never a broadcast of the operand."""
    ix = [x if n > 1 else jnp.zeros((), I32) for x, n in zip((b, h, q, k), op.shape)]
    ix[3] = jnp.clip(ix[3], 0, op.shape[3] - 1)   # (unselected: -1, result unused)
    return op[tuple(ix)]


def _allowed(cfg, mask_leaves, tok, kpos, G):
    """(t, Hkv, K, G): selected and allowed by the mask."""
    ok = (kpos >= 0)[..., None]
    mask = cfg.mask(mask_leaves)
    if mask is None:
        return ok
    Hkv = kpos.shape[1]
    b = tok[:, 0][:, None, None, None]
    row = tok[:, 1][:, None, None, None]
    q_pos = tok[:, 2][:, None, None, None]
    h = (jnp.arange(Hkv, dtype=I32)[:, None] * G + jnp.arange(G, dtype=I32)[None])[None, :,
                                                                                   None, :]
    k = kpos[..., None]
    ops = [_operand_at(op, b, h, row, k) for op in mask.operands()] if cfg.mask_arrays else []
    pos = masks.Positions(b=b, h=h, q=row, q_pos=q_pos, k=k)
    return ok & mask.predicate(pos, ops)


def _sink(sinks, Hkv, G, acc):
    return None if sinks is None else sinks.astype(acc).reshape(1, Hkv, G)


def _clean(x, keep):
    """``x`` with its entries zeroed where not ``keep`` or not finite, and the keys
    (rows) that held a non-finite value while kept."""
    fin = jnp.isfinite(x)
    return jnp.where(keep & fin, x, jnp.zeros((), x.dtype)), keep & fin, jnp.any(
        keep & ~fin, axis=-1)


class _Block:
    """The gathered keys, logits and masks of one block of query tokens.

    Logits are laid out (tokens, Hkv, K, G), keys before the query heads of a
    group: on a CPU both products then run 2-3x faster than with the keys last.
    """

    def __init__(self, cfg, q, kstore, vstore, slot, kpos, tok, mask_leaves):
        t, Hq, D = q.shape
        Hkv = slot.shape[1]
        G = Hq // Hkv
        self.acc = acc = jnp.promote_types(F32, q.dtype)
        selected = (kpos >= 0)[..., None]
        # Unselected rows (read from the sequence's first slot) and non-finite
        # entries are zeroed; a selected key with a non-finite K or V gets a NaN
        # logit before the mask (_online.finite_keys's rule), so only the rows
        # that may see it are NaN.
        # (a latent store: the values are the keys' first value_dim channels)
        kg, vg = _gathered(cfg, q, kstore, vstore, slot, tok)
        Dv = cfg.value_dim
        if _clean_codes(cfg, kstore, vstore):
            # Nothing to clean: quantized stores, whose gathers zero the
            # unselected entries' codes and scales.
            vg = kg[..., :Dv] if vg is None else vg
            self.fk = self.fv = selected
            bad_k = bad_v = jnp.zeros(slot.shape, bool)
        elif cfg.mask_treedef is None:
            # Every row of a (token, kv head) sees every key it selected: a
            # non-finite one makes those rows NaN by itself; only the unselected
            # entries' reads need zeroing (one select, no pass for non-finite values).
            kg = jnp.where(selected, kg, jnp.zeros((), kg.dtype))
            vg = kg[..., :Dv] if vg is None else jnp.where(selected, vg, jnp.zeros((), vg.dtype))
            self.fk = self.fv = selected
            bad_k = bad_v = jnp.zeros(slot.shape, bool)
        else:
            kg, self.fk, bad_k = _clean(kg, selected)
            if vg is None:
                vg, self.fv, bad_v = kg[..., :Dv], self.fk[..., :Dv], jnp.zeros(slot.shape, bool)
            else:
                vg, self.fv, bad_v = _clean(vg, selected)
        self.kg, self.vg = kg, vg
        self.qg = q.reshape(t, Hkv, G, D)
        s = jnp.einsum("thkd,thgd->thkg", kg, self.qg.astype(kg.dtype),
                       preferred_element_type=acc) * cfg.scale
        self.raw = s
        if cfg.softcap is not None:
            s = cfg.softcap * jnp.tanh(s / cfg.softcap)
        s = jnp.where((bad_k | bad_v)[..., None], jnp.nan, s)
        self.allowed = _allowed(cfg, mask_leaves, tok, kpos, G)
        self.s = jnp.where(self.allowed, s, -jnp.inf)
        self.shape = (t, Hkv, G)

    def probs(self, lse):
        """exp(s - lse) from the forward's lse (t, Hq); 0 in rows of infinite lse."""
        lse = lse.astype(self.acc).reshape(self.shape)[:, :, None, :]
        fin = jnp.isfinite(lse)
        return jnp.where(fin, jnp.exp(self.s - jnp.where(fin, lse, 0.0)), 0.0)

    def cap_grad(self, cfg, x):
        """``x`` times the derivative of the soft cap at the raw logits."""
        if cfg.softcap is None:
            return x
        return x * (1.0 - jnp.square(jnp.tanh(self.raw / cfg.softcap)))


def _clean_codes(cfg, kstore, vstore):
    """Whether the gathered quantized stores need no cleaning: with no mask, as
    their gathers zero the unselected entries' codes and scales (every row sees
    every selected key). Under a mask a selected key's non-finite code (float8)
    or scale must still be kept from the rows that do not see it."""
    stores = [x for x in (kstore, vstore) if x is not None]
    return cfg.mask_treedef is None and all(quant.is_quantized(x) for x in stores)


def _gathered(cfg, q, kstore, vstore, slot, tok):
    """The gathered keys and values (None for a latent store)."""
    kg = _gather(cfg, kstore, slot, tok, q.dtype)
    return kg, None if vstore is None else _gather(cfg, vstore, slot, tok, q.dtype)


def _forward_block(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves):
    """(out (t, Hq, Dv) acc dtype, lse (t, Hq) f32) of one block; plain ``jnp``
    (differentiable: the smooth form)."""
    return _softmax_block(cfg, _Block(cfg, q, kstore, vstore, slot, kpos, tok, mask_leaves),
                          sinks)


def _softmax_block(cfg, blk, sinks):
    t, Hkv, G = blk.shape
    acc = blk.acc
    s = blk.s
    m = jnp.max(s, axis=2)                           # (t, Hkv, G)
    sink = _sink(sinks, Hkv, G, acc)
    inf_sink = None
    if sink is not None:
        # A sink of +inf takes all the mass (out 0, lse +inf); -inf is no sink.
        inf_sink = sink == jnp.inf
        sink = jnp.where(inf_sink, jnp.zeros((), acc), sink)
        m = jnp.maximum(m, sink)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(s - m[:, :, None, :])
    denom = jnp.sum(e, axis=2)
    if sink is not None:
        denom = denom + jnp.exp(sink - m)
    dead = denom == 0                      # (a NaN row stays NaN)
    safe = jnp.where(dead, 1.0, denom)
    lse = jnp.where(dead, -jnp.inf, m + jnp.log(safe))
    o = jnp.einsum("thkg,thkd->thgd", e.astype(blk.vg.dtype), blk.vg,
                   preferred_element_type=acc) / safe[..., None]
    if inf_sink is not None:
        inf_row = inf_sink & ~jnp.isnan(lse)
        lse = jnp.where(inf_row, jnp.inf, lse)
        o = jnp.where(inf_row[..., None], jnp.zeros((), acc), o)
    return o.reshape(t, Hkv * G, -1), lse.reshape(t, Hkv * G).astype(F32)


def _tangent_block(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves, out, lse,
                   tq, tk, tv, tsinks):
    """(t_out (t, Hq, Dv), t_lse (t, Hq)) of one block, linear in the tangents."""
    blk = _Block(cfg, q, kstore, vstore, slot, kpos, tok, mask_leaves)
    t, Hkv, G = blk.shape
    acc = blk.acc
    p = blk.probs(lse)
    ts = None
    if tq is not None:
        ts = jnp.einsum("thkd,thgd->thkg", blk.kg.astype(acc),
                        tq.reshape(blk.qg.shape).astype(acc))
    if tk is not None:
        tkg = jnp.where(blk.fk, _gather(cfg, tk, slot, tok), 0).astype(acc)
        tsk = jnp.einsum("thkd,thgd->thkg", tkg, blk.qg.astype(acc))
        ts = tsk if ts is None else ts + tsk
    t_lse = jnp.zeros((t, Hkv, G), acc)
    t_out = jnp.zeros((t, Hkv, G, blk.vg.shape[-1]), acc)
    if ts is not None:
        pts = jnp.where(blk.allowed, p * blk.cap_grad(cfg, ts * cfg.scale), 0.0)
        t_lse = t_lse + jnp.sum(pts, axis=2)
        t_out = t_out + jnp.einsum("thkg,thkd->thgd", pts, blk.vg.astype(acc))
    if tsinks is not None:
        lse_r = lse.astype(acc).reshape(t, Hkv, G)
        p_sink = shifted_exp(_sink(sinks, Hkv, G, acc), lse_r)
        t_lse = t_lse + p_sink * _sink(tsinks, Hkv, G, acc)
    if tv is not None:
        tvg = jnp.where(blk.fv, _gather(cfg, tv, slot, tok), 0).astype(acc)
        t_out = t_out + jnp.einsum("thkg,thkd->thgd", p, tvg)
    elif vstore is None and tk is not None:      # latent: the values move with the keys
        t_out = t_out + jnp.einsum("thkg,thkd->thgd", p, tkg[..., :cfg.value_dim])
    o = out.astype(acc).reshape(t_out.shape)
    t_out = t_out - t_lse[..., None] * jnp.where(jnp.isfinite(lse).reshape(t, Hkv, G, 1), o, 0.0)
    return t_out.reshape(t, Hkv * G, -1), t_lse.reshape(t, Hkv * G)


def _cotangent_block(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves, out, lse,
                     d_out, d_lse):
    """(dq (t, Hq, D), dkg, dvg (t, Hkv, K, D|Dv), dsinks (Hq,)) of one block."""
    blk = _Block(cfg, q, kstore, vstore, slot, kpos, tok, mask_leaves)
    t, Hkv, G = blk.shape
    acc = blk.acc
    p = blk.probs(lse)
    do = d_out.astype(acc).reshape(t, Hkv, G, -1)
    o = out.astype(acc).reshape(do.shape)
    fin = jnp.isfinite(lse).reshape(t, Hkv, G)
    rowdot = jnp.where(fin, jnp.sum(do * o, axis=-1), 0.0)
    dl = d_lse.astype(acc).reshape(t, Hkv, G)
    dp = jnp.einsum("thkd,thgd->thkg", blk.vg.astype(acc), do)
    ds = jnp.where(blk.allowed, p * (dp - (rowdot - dl)[:, :, None, :]), 0.0)
    ds = blk.cap_grad(cfg, ds) * cfg.scale
    dq = jnp.einsum("thkg,thkd->thgd", ds, blk.kg.astype(acc)).reshape(t, Hkv * G, -1)
    dkg = jnp.where(blk.fk, jnp.einsum("thkg,thgd->thkd", ds, blk.qg.astype(acc)), 0.0)
    dvg = jnp.where(blk.fv, jnp.einsum("thkg,thgd->thkd", p, do), 0.0)
    dsinks = None
    if sinks is not None:
        lse_r = lse.astype(acc).reshape(t, Hkv, G)
        p_sink = shifted_exp(_sink(sinks, Hkv, G, acc), lse_r)
        dsinks = jnp.sum(p_sink * (dl - rowdot), axis=0).reshape(Hkv * G)
    return dq, dkg, dvg, dsinks


# ----------------------------------------------------------------------------------
# The blockwise passes over all query tokens
# ----------------------------------------------------------------------------------


def _blocks(cfg, R):
    bt = max(1, min(cfg.block_tokens, R))
    return bt, -(-R // bt)


def _split(x, bt, nb, fill):
    """(R, ...) -> (nb, bt, ...), padded with ``fill``."""
    pad = nb * bt - x.shape[0]
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
    return x.reshape((nb, bt) + x.shape[1:])


def _join(x, R):
    return x.reshape((-1,) + x.shape[2:])[:R]


def _per_block(cfg, fn, R, row_args, fills, const_args):
    """``fn(*block_rows, *const_args)`` over the blocks of query tokens, stacked."""
    bt, nb = _blocks(cfg, R)
    if nb == 1:
        return fn(*row_args, *const_args)
    xs = tuple(None if x is None else _split(x, bt, nb, f) for x, f in zip(row_args, fills))
    ys = lax.map(lambda xs: fn(*xs, *const_args), xs)
    return jax.tree_util.tree_map(lambda y: _join(y, R), ys)


def _forward(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves):
    R = q.shape[0]
    out, lse = _per_block(
        cfg, lambda qb, sb, kb, tb, *c: _forward_block(cfg, qb, c[0], c[1], c[2], sb, kb, tb,
                                                       c[3:]),
        R, (q, slot, kpos, tok), (0, -1, -1, 0), (kstore, vstore, sinks, *mask_leaves))
    return out.astype(q.dtype), lse


def _tangent(cfg, res, lin):
    q, kstore, vstore, sinks, slot, kpos, tok, out, lse, *mask_leaves = res
    tq, tk, tv, tsinks = lin
    R = q.shape[0]

    def fn(qb, sb, kb, tb, ob, lb, tqb, *c):
        return _tangent_block(cfg, qb, kstore, vstore, sinks, sb, kb, tb, tuple(mask_leaves),
                              ob, lb, tqb, tk, tv, tsinks)

    t_out, t_lse = _per_block(cfg, fn, R, (q, slot, kpos, tok, out, lse, tq),
                              (0, -1, -1, 0, 0, 0, 0), ())
    return t_out.astype(out.dtype), t_lse.astype(F32)


def _cotangent(cfg, res, cts):
    q, kstore, vstore, sinks, slot, kpos, tok, out, lse, *mask_leaves = res
    d_out, d_lse = cts
    d_out = jnp.zeros_like(out) if d_out is None else d_out
    d_lse = jnp.zeros_like(lse) if d_lse is None else d_lse
    R = q.shape[0]
    bt, nb = _blocks(cfg, R)
    acc = jnp.promote_types(F32, q.dtype)
    dk0 = jnp.zeros(kstore.shape, acc)
    dv0 = None if vstore is None else jnp.zeros(vstore.shape, acc)
    ds0 = None if sinks is None else jnp.zeros(sinks.shape, acc)

    def step(carry, xs):
        dk, dv, dsk = carry
        qb, sb, kb, tb, ob, lb, dob, dlb = xs
        dq, dkg, dvg, dsb = _cotangent_block(cfg, qb, kstore, vstore, sinks, sb, kb, tb,
                                             tuple(mask_leaves), ob, lb, dob, dlb)
        if dv is None:             # latent: the values' gradient joins the keys' first channels
            pad = [(0, 0)] * (dkg.ndim - 1) + [(0, dkg.shape[-1] - dvg.shape[-1])]
            dkg = dkg + jnp.pad(dvg, pad)
        else:
            dv = _scatter_add(cfg, dv, sb, tb, dvg)
        dk = _scatter_add(cfg, dk, sb, tb, dkg)
        dsk = None if dsk is None else dsk + dsb
        return (dk, dv, dsk), dq

    rows = (q, slot, kpos, tok, out, lse, d_out, d_lse)
    if nb == 1:
        (dk, dv, dsk), dq = step((dk0, dv0, ds0), rows)
    else:
        xs = tuple(_split(x, bt, nb, f) for x, f in zip(rows, (0, -1, -1, 0, 0, 0, 0, 0)))
        (dk, dv, dsk), dq = lax.scan(step, (dk0, dv0, ds0), xs)
        dq = _join(dq, R)
    return (dq.astype(q.dtype), dk.astype(kstore.dtype),
            None if vstore is None else dv.astype(vstore.dtype),
            None if sinks is None else dsk.astype(sinks.dtype))


@dataclasses.dataclass(frozen=True)
class _Derivatives(_linear.Rule):
    """Tangent and cotangent maps of the blockwise lowering."""

    cfg: _Cfg

    def tangent(self, res, lin):
        return _tangent(self.cfg, res, lin)

    def cotangent(self, res, cts):
        return _cotangent(self.cfg, res, cts)

    def smooth(self, res):
        q, kstore, vstore, sinks, slot, kpos, tok, _, _, *mask_leaves = res
        cfg = dataclasses.replace(self.cfg, block_tokens=q.shape[0])

        def f(q, kstore, vstore, sinks):
            out, lse = _forward_block(cfg, q, kstore, vstore, sinks, slot, kpos, tok,
                                      tuple(mask_leaves))
            return out.astype(q.dtype), lse
        return f, (q, kstore, vstore, sinks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _attend(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves):
    return _forward(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves)


def _attend_jvp(cfg, primals, tangents):
    q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves = primals
    out, lse = _attend(cfg, *primals)
    lin = _linear.instantiate(primals[:4], tangents[:4])
    if sinks is None:
        lin = lin[:3] + (None,)
    res = (q, kstore, vstore, sinks, slot, kpos, tok, out, lse, *mask_leaves)
    t_out, t_lse = _linear.tangent(_Derivatives(cfg), res, lin, (out, lse))
    return (out, lse), (t_out, t_lse)


_attend.defjvp(_attend_jvp, symbolic_zeros=True)


# Quantized stores: reverse mode only, one block at a time.

def _part(store):
    """The differentiable part of a store: a float store itself; a quantized one's
    (codes where they are floats, else None; scales)."""
    if store is None or not quant.is_quantized(store):
        return store
    data = store.data if jnp.issubdtype(store.data.dtype, jnp.floating) else None
    return data, jnp.asarray(store.scale, F32)


def _with_part(store, part):
    if store is None or not quant.is_quantized(store):
        return part
    data, scale = part
    return quant.QuantizedArray(store.data if data is None else data, scale, store.format)


def _store_cotangent(store, d_part):
    """The cotangent of a store from that of its part (integer codes: float0 zeros)."""
    if store is None:
        return None
    if not quant.is_quantized(store):
        return d_part.astype(store.dtype)
    d_data, d_scale = d_part
    d_data = (np.zeros(store.data.shape, jax.dtypes.float0) if d_data is None
              else d_data.astype(store.data.dtype))
    return quant.QuantizedArray(d_data, d_scale.astype(jnp.result_type(store.scale)),
                                store.format)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend_stored(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves):
    """:func:`_attend` for quantized stores, in reverse mode only: the backward is,
    block by block, ``jax.vjp`` of the block's forward with respect to q, the
    sinks and the stores' scales (scatter-added: the codes get float0 zeros)."""
    return _forward(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves)


def _stored_fwd(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves):
    return (_forward(cfg, q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves),
            (q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves))


def _stored_bwd(cfg, res, cts):
    q, kstore, vstore, sinks, slot, kpos, tok, mask_leaves = res
    d_out, d_lse = cts
    R = q.shape[0]
    bt, nb = _blocks(cfg, R)
    parts = (_part(kstore), _part(vstore), sinks)

    def step(carry, xs):
        qb, sb, kb, tb, dob, dlb = xs

        def f(qb, kp, vp, snk):
            out, lse = _forward_block(cfg, qb, _with_part(kstore, kp), _with_part(vstore, vp),
                                      snk, sb, kb, tb, mask_leaves)
            return out.astype(qb.dtype), lse

        _, pullback = jax.vjp(f, qb, *parts)
        dq, *d_parts = pullback((dob.astype(q.dtype), dlb.astype(F32)))
        carry = jax.tree_util.tree_map(lambda a, b: a + b.astype(a.dtype), carry,
                                       tuple(d_parts))
        return carry, dq

    zeros = jax.tree_util.tree_map(
        lambda x: jnp.zeros(jnp.shape(x), F32 if x.dtype.itemsize < 4 else x.dtype), parts)
    rows = (q, slot, kpos, tok, d_out, d_lse)
    if nb == 1:
        (dk, dv, dsk), dq = step(zeros, rows)
    else:
        xs = tuple(_split(x, bt, nb, f) for x, f in zip(rows, (0, -1, -1, 0, 0, 0)))
        (dk, dv, dsk), dq = lax.scan(step, zeros, xs)
        dq = _join(dq, R)
    ints = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return (dq, _store_cotangent(kstore, dk), _store_cotangent(vstore, dv),
            None if sinks is None else dsk.astype(sinks.dtype), ints(slot),
            ints(kpos), ints(tok), jax.tree_util.tree_map(jnp.zeros_like, mask_leaves))


_attend_stored.defvjp(_stored_fwd, _stored_bwd)


# ----------------------------------------------------------------------------------
# Checks and index sets
# ----------------------------------------------------------------------------------


def _refuse(fn, spec, *, arrays_ok):
    if spec.impl in ("pallas", "cudnn"):
        raise NotImplementedError(
            f"{fn}: impl={spec.impl!r} has no lowering for top-k token selection yet; the "
            "XLA lowering (impl='auto', 'xla' or 'reference', every platform) has it")
    if spec.bias is not None:
        raise ValueError(
            f"{fn}: spec.bias is not taken (a (Tq, Tk) bias is what selection avoids "
            "forming); fold a per-key term into the keys or attend densely with "
            "fnattn.attention")
    if spec.position_bias is not None:
        raise NotImplementedError(
            f"{fn}: spec.position_bias is not implemented for selected keys; fnattn.attention "
            "and fnattn.flash take it")
    if spec.dropout_rate > 0:
        raise NotImplementedError(
            f"{fn}: dropout is not implemented for selected keys; use dropout_rate=0.0")
    if not arrays_ok and spec.mask is not None and spec.mask.num_operands:
        raise ValueError(
            f"{fn}: masks that hold arrays ({spec.mask!r}) are not taken here: the lengths "
            "(and the page table) already say which keys exist; use positional masks "
            "(causal, sliding_window, chunked, from_fn)")


def _check_sinks(fn, sinks, Hq):
    if sinks is None:
        return
    _checks.check_float(f"{fn}: spec.sinks", sinks)
    if tuple(sinks.shape) != (Hq,):
        raise ValueError(f"{fn}: spec.sinks must have shape (Hq,)=({Hq},); got "
                         f"{tuple(sinks.shape)}")


def _check_indices(fn, indices, lead, Hkv, what):
    """``indices`` (*lead, K) or (*lead, Hkv, K) -> (*lead, Hkv, K) int32."""
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{fn}: indices must be an integer array; got {indices.dtype}")
    lead = tuple(lead)
    n = len(lead)
    shape = tuple(indices.shape)
    ok = indices.ndim in (n + 1, n + 2) and shape[:n] == lead and (
        indices.ndim == n + 1 or shape[n] == Hkv) and shape[-1] >= 1
    if not ok:
        raise ValueError(
            f"{fn}: indices must have shape ({what}, K)={lead + ('K',)} or ({what}, Hkv, K)="
            f"{lead + (Hkv, 'K')} with K >= 1; got {shape}")
    idx = indices.astype(I32)
    if idx.ndim == n + 1:
        idx = jnp.broadcast_to(idx[..., None, :], lead + (Hkv, shape[-1]))
    return idx


def _as_set(idx, limit, unique):
    """Indices with those outside ``[0, limit)`` (broadcast with idx[..., :1]) and,
    unless ``unique``, repeated ones set to -1 (sorted along K then)."""
    idx = jnp.where((idx >= 0) & (idx < limit), idx, -1)
    if not unique and idx.shape[-1] > 1:
        idx = jnp.sort(idx, axis=-1)
        dup = jnp.concatenate([jnp.zeros(idx.shape[:-1] + (1,), bool),
                               idx[..., 1:] == idx[..., :-1]], axis=-1)
        idx = jnp.where(dup, -1, idx)
    return idx


def _block_tokens(R, Hq, Hkv, K, D, Dv, itemsize):
    per_token = Hkv * K * (D + Dv) * itemsize + 3 * Hq * K * 4
    if R * per_token <= ONE_BLOCK_BYTES:
        return R
    bt = max(1, BLOCK_BYTES // per_token)
    return 1 << (bt.bit_length() - 1)


def _run(spec, fn, q, kstore, vstore, slot, kpos, tok, *, heads_first, scale, mask_arrays,
         value_dim=None):
    """q (R, Hq, D) -> (out (R, Hq, Dv), lse (Hq, R)). ``vstore`` None: a latent
    store, the values the first ``value_dim`` channels of the keys."""
    R, Hq, D = q.shape
    Hkv, K = slot.shape[1], slot.shape[2]
    Dv = value_dim if vstore is None else vstore.shape[-1]
    stored = quant.is_quantized(kstore) or quant.is_quantized(vstore)
    # (a quantized store is gathered and dequantized to q's dtype)
    itemsize = jnp.dtype(q.dtype if stored else kstore.dtype).itemsize
    mask = spec.mask
    leaves, treedef = jax.tree_util.tree_flatten(mask)
    cfg = _Cfg(scale=scale, softcap=spec.softcap,
               mask_treedef=None if mask is None else treedef, heads_first=heads_first,
               block_tokens=_block_tokens(R, Hq, Hkv, K, D, 0 if vstore is None else Dv,
                                          itemsize),
               mask_arrays=mask_arrays, value_dim=None if vstore is not None else value_dim)
    attend = _attend_stored if stored else _attend
    out, lse = attend(cfg, q, kstore, vstore, spec.sinks, slot, kpos, tok, tuple(leaves))
    return out, lse.T


def _check_store(fn, name, x, want_shape, what):
    _checks.check_float(f"{fn}: {name}", x)
    if tuple(x.shape) != tuple(want_shape):
        raise ValueError(f"{fn}: {name} must have shape {what}={tuple(want_shape)}; got "
                         f"{tuple(x.shape)}")


def _check_int(fn, name, x, shape, what):
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{fn}: {name} must be an integer array {what}; got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {what}={tuple(shape)}; got "
                         f"{tuple(x.shape)}")


# ----------------------------------------------------------------------------------
# Public forms
# ----------------------------------------------------------------------------------


@_checks.entry_point("fnattn.selected_attention", ints=("indices",))
@jaxtyped(typechecker=beartype)
def selected_attention(spec: AttentionSpec, q: Shaped[Array, "..."], k: Shaped[Array, "..."],
                       v: Shaped[Array, "..."], indices: Shaped[Array, "..."], *,
                       unique: bool = False) -> AttentionOutput:
    """Attention of each query over the keys ``indices`` selects (top-k selection).

    Args:
      spec: the :class:`AttentionSpec` (mask, scale, softcap, sinks, layout;
        no bias, position_bias or dropout). The mask is evaluated at each
        selected key's position, queries aligned bottom-right as in
        :func:`fnattn.attention` (query ``t`` at position ``t + Tk - Tq``).
      q: (B, Tq, Hq, D) in "bthd" or (B, Hq, Tq, D) in "bhtd".
      k: (B, Tk, Hkv, D) or (B, Hkv, Tk, D); Hq a multiple of Hkv.
      v: (B, Tk, Hkv, Dv) or (B, Hkv, Tk, Dv).
      indices: (B, Tq, K) int, the key positions each query attends to (shared
        by the kv heads), or (B, Tq, Hkv, K) (one set per kv head), in either
        layout. Entries outside ``[0, Tk)`` (``-1`` padding) select nothing;
        repeated entries count once (see :mod:`fnattn.selection`).
      unique: the caller promises no repeated index in a row (``lax.top_k``'s
        indices): skips the sort that removes repeats.

    Returns:
      :class:`AttentionOutput` with ``out`` like q with head dim Dv, ``lse``
      (B, Hq, Tq) float32 (-inf where a row selected nothing).

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> q = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
    >>> k = v = jax.random.normal(jax.random.key(1), (1, 16, 1, 8))
    >>> idx = jnp.array([[[0, 3, 5], [1, 2, -1], [7, 7, 9], [-1, -1, -1]]])
    >>> res = jax.jit(fnattn.selected_attention)(AttentionSpec(), q, k, v, idx)
    >>> res.out.shape, res.lse[0, 0].tolist()[3]           # row 3 selected nothing
    ((1, 4, 2, 8), -inf)
    >>> keep = jnp.zeros((1, 1, 4, 16), bool).at[0, 0, 0, jnp.array([0, 3, 5])].set(True)
    >>> dense = fnattn.reference(AttentionSpec(mask=masks.from_array(keep)), q, k, v)
    >>> bool(jnp.allclose(res.out[:, 0], dense.out[:, 0], atol=1e-5))
    True
    """
    fn = "selected_attention"
    dims = _checks.check_qkv(q, k, v, spec.layout, fn=fn)
    _refuse(fn, spec, arrays_ok=True)
    B, Tq, Tk = dims.batch, dims.q_len, dims.kv_len
    Hq, Hkv = dims.num_q_heads, dims.num_kv_heads
    _check_sinks(fn, spec.sinks, Hq)
    if spec.mask is not None:
        spec.mask.validate(B, Hq, Tq, Tk)
    qb, kb, vb = (_checks.to_bthd(x, spec.layout) for x in (q, k, v))
    idx = _check_indices(fn, indices, (B, Tq), Hkv, "B, Tq")
    idx = _as_set(idx, Tk, unique)                                 # (B, Tq, Hkv, K)
    K = idx.shape[-1]
    b = jnp.arange(B, dtype=I32)[:, None, None, None]
    slot = jnp.where(idx >= 0, b * Tk + idx, -1).reshape(B * Tq, Hkv, K)
    rows = jnp.arange(Tq, dtype=I32)
    tok = jnp.stack([jnp.repeat(jnp.arange(B, dtype=I32), Tq), jnp.tile(rows, B),
                     jnp.tile(rows + (Tk - Tq), B),
                     jnp.repeat(jnp.arange(B, dtype=I32) * Tk, Tq)], axis=1)
    out, lse = _run(spec, fn, qb.reshape(B * Tq, Hq, dims.head_dim),
                    kb.reshape(B * Tk, Hkv, dims.head_dim),
                    vb.reshape(B * Tk, Hkv, dims.v_head_dim), slot, idx.reshape(B * Tq, Hkv, K),
                    tok, heads_first=False, scale=_checks.resolve_scale(spec, dims.head_dim),
                    mask_arrays=True)
    out = _checks.from_bthd(out.reshape(B, Tq, Hq, dims.v_head_dim), spec.layout)
    lse = lse.reshape(Hq, B, Tq).transpose(1, 0, 2)
    return AttentionOutput(out, lse if spec.return_lse else None)


def _store_like(fn, name, x, q):
    """A quantized cache, checked, as the float array it stands for (its logical
    shape, q's dtype) for the shape checks of float caches."""
    if not quant.is_quantized(x):
        return x
    quant.check(fn, name, x)
    return jax.ShapeDtypeStruct(x.shape, q.dtype)


def _check_cache(fn, spec, q, k_cache, v_cache, value_dim):
    """Dims of q and a contiguous cache (float, quantized or latent)."""
    v_like = _latent.values(fn, k_cache, v_cache, value_dim, q, k_name="k_cache",
                            v_name="v_cache")
    return _checks.check_qkv(q, _store_like(fn, "k_cache", k_cache, q),
                             _store_like(fn, "v_cache", v_like, q), spec.layout, fn=fn)


def _store_bthd(x, layout):
    if x is None or layout == "bthd":
        return x
    return x.swapaxes(1, 2) if quant.is_quantized(x) else jnp.swapaxes(x, 1, 2)


def _lead(x, *lead):
    """``x`` with its leading axes reshaped to ``lead`` (the head dim stays last)."""
    if x is None:
        return None
    if quant.is_quantized(x):
        return x.reshape_leading(*lead)
    return x.reshape(*lead, x.shape[-1])


@_checks.entry_point("fnattn.selected_decode", ints=("indices", "kv_lengths", "kv_starts"))
@jaxtyped(typechecker=beartype)
def selected_decode(spec: AttentionSpec, q: Shaped[Array, "..."], k_cache: quant.Cache,
                    v_cache: Optional[quant.Cache], indices: Shaped[Array, "..."], *,
                    kv_lengths: Shaped[Array, "..."],
                    kv_starts: Optional[Shaped[Array, "..."]] = None,
                    value_dim: Optional[int] = None, unique: bool = False) -> AttentionOutput:
    """:func:`fnattn.decode` over the selected positions of each sequence's cache.

    Args:
      spec: as for :func:`fnattn.decode` (positional masks only), "bthd" or "bhtd".
      q: (B, Tq, Hq, D) or (B, Hq, Tq, D): the newest Tq tokens of each
        sequence, query ``t`` at position ``kv_lengths[b] - Tq + t``.
      k_cache: (B, S, Hkv, D) or (B, Hkv, S, D) ("bhtd" is transposed once);
        a float array or a :class:`fnattn.quant.QuantizedArray` (only the
        selected keys' codes and scales are gathered and dequantized, to q's dtype).
      v_cache: (B, S, Hkv, Dv) or (B, Hkv, S, Dv), float or quantized; None for
        a latent cache (``value_dim``).
      indices: (B, Tq, K) or (B, Tq, Hkv, K) int: *positions* in the sequence
        (position ``j`` is cache slot ``kv_starts[b] + j``). Positions outside
        ``[0, kv_lengths[b])`` select nothing and are never read; repeats
        count once unless ``unique``.
      kv_lengths: (B,) int, tokens of each sequence (the new ones included),
        clipped to the cache as in :func:`fnattn.decode`.
      kv_starts: (B,) int, first slot of each sequence (default 0).
      value_dim: a latent cache (multi-head latent attention, DeepSeek-V3.2):
        ``v_cache`` is None and the values are the first ``value_dim``
        channels of the selected keys.
      unique: the caller promises no repeated index in a row.

    Returns:
      :class:`AttentionOutput` as :func:`fnattn.decode` returns.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec
    >>> k = v = jax.random.normal(jax.random.key(0), (2, 32, 1, 8))
    >>> q = jax.random.normal(jax.random.key(1), (2, 1, 4, 8))
    >>> idx = jnp.array([[[0, 5, 9]], [[2, 3, 20]]])             # 20 >= length 10: unused
    >>> res = jax.jit(fnattn.selected_decode)(AttentionSpec(), q, k, v, idx,
    ...                                      kv_lengths=jnp.array([16, 10]))
    >>> ref = fnattn.reference(AttentionSpec(), q[1:], k[1:, 2:4], v[1:, 2:4])
    >>> bool(jnp.allclose(res.out[1:], ref.out, atol=1e-5))
    True
    >>> lat = jax.jit(fnattn.selected_decode, static_argnames="value_dim")(
    ...     AttentionSpec(), q, k, None, idx, kv_lengths=jnp.array([16, 10]), value_dim=6)
    >>> lat.out.shape                                            # values: k[..., :6]
    (2, 1, 4, 6)
    """
    fn = "selected_decode"
    _refuse(fn, spec, arrays_ok=False)
    dims = _check_cache(fn, spec, q, k_cache, v_cache, value_dim)
    B, Tq, S = dims.batch, dims.q_len, dims.kv_len
    Hq, Hkv = dims.num_q_heads, dims.num_kv_heads
    _check_sinks(fn, spec.sinks, Hq)
    _check_int(fn, "kv_lengths", kv_lengths, (B,), "(B,)")
    starts = jnp.zeros((B,), I32) if kv_starts is None else kv_starts
    _check_int(fn, "kv_starts", starts, (B,), "(B,)")
    qb = _checks.to_bthd(q, spec.layout)
    kb, vb = _store_bthd(k_cache, spec.layout), _store_bthd(v_cache, spec.layout)
    starts = jnp.clip(starts.astype(I32), 0, S)
    lengths = jnp.clip(kv_lengths.astype(I32), 0, S - starts)
    idx = _check_indices(fn, indices, (B, Tq), Hkv, "B, Tq")
    idx = _as_set(idx, lengths[:, None, None, None], unique)
    K = idx.shape[-1]
    slot = jnp.where(idx >= 0, (jnp.arange(B, dtype=I32) * S + starts)[:, None, None, None]
                     + idx, -1).reshape(B * Tq, Hkv, K)
    rows = jnp.arange(Tq, dtype=I32)
    first = jnp.arange(B, dtype=I32) * S + jnp.minimum(starts, S - 1)
    tok = jnp.stack([jnp.repeat(jnp.arange(B, dtype=I32), Tq), jnp.tile(rows, B),
                     (lengths[:, None] - Tq + rows[None]).reshape(-1),
                     jnp.repeat(first, Tq)], axis=1)
    out, lse = _run(spec, fn, qb.reshape(B * Tq, Hq, dims.head_dim), _lead(kb, B * S, Hkv),
                    _lead(vb, B * S, Hkv), slot, idx.reshape(B * Tq, Hkv, K), tok,
                    heads_first=False, scale=_checks.resolve_scale(spec, dims.head_dim),
                    mask_arrays=False, value_dim=value_dim)
    out = _checks.from_bthd(out.reshape(B, Tq, Hq, dims.v_head_dim), spec.layout)
    lse = lse.reshape(Hq, B, Tq).transpose(1, 0, 2)
    return AttentionOutput(out, lse if spec.return_lse else None)


def _refuse_latent_values(fn, value_dim, v, v_name):
    if value_dim is not None and v is not None:
        raise ValueError(f"{fn}: a latent cache (value_dim={value_dim}) has no separate values: "
                         f"pass {v_name}=None (the new keys hold the latent and rope channels)")


@_checks.entry_point("fnattn.selected_decode_with_update",
                     ints=("indices", "kv_lengths", "kv_starts"))
@jaxtyped(typechecker=beartype)
def selected_decode_with_update(spec: AttentionSpec, q: Shaped[Array, "..."],
                                k_new: Shaped[Array, "..."],
                                v_new: Optional[Shaped[Array, "..."]],
                                k_cache: quant.Cache, v_cache: Optional[quant.Cache],
                                indices: Shaped[Array, "..."], *,
                                kv_lengths: Shaped[Array, "..."],
                                kv_starts: Optional[Shaped[Array, "..."]] = None,
                                value_dim: Optional[int] = None, unique: bool = False):
    """Writes the new tokens' k/v into the cache, then :func:`selected_decode` on it.

    Token ``i`` of sequence ``b`` goes to slot ``kv_starts[b] + kv_lengths[b] - Tq +
    i``, as in :func:`fnattn.decode_with_update`; a sequence whose tokens do not fit
    in ``[kv_starts[b], S)`` writes nothing and gets NaN. The new tokens are
    attended to only where ``indices`` select their positions (DSA's indexer
    scores the new tokens too). A quantized cache gets the codes and per-token
    scales :func:`fnattn.quant.quantize` gives (:func:`fnattn.quant.write`).

    Args:
      spec: as for :func:`selected_decode`.
      q: (B, Tq, Hq, D) or (B, Hq, Tq, D).
      k_new: (B, Tq, Hkv, D) or (B, Hkv, Tq, D), cast to the cache's dtype
        (quantized for a quantized cache).
      v_new: (B, Tq, Hkv, Dv) or (B, Hkv, Tq, Dv); None for a latent cache.
      k_cache: (B, S, Hkv, D) or (B, Hkv, S, D), float or quantized.
      v_cache: (B, S, Hkv, Dv) or (B, Hkv, S, Dv); None for a latent cache.
      indices: as for :func:`selected_decode` (positions, the new ones included).
      kv_lengths: (B,) int, tokens of each sequence after the update.
      kv_starts: (B,) int, first slot of each sequence (default 0).
      value_dim: a latent cache, as for :func:`selected_decode`.
      unique: the caller promises no repeated index in a row.

    Returns:
      ``(AttentionOutput, k_cache, v_cache)``.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec
    >>> cache = jnp.zeros((1, 8, 1, 4))
    >>> q, new = jnp.ones((1, 1, 2, 4)), jnp.ones((1, 1, 1, 4))
    >>> res, kc, vc = fnattn.selected_decode_with_update(
    ...     AttentionSpec(), q, new, new, cache, cache, jnp.array([[[2]]]), kv_lengths=[3])
    >>> kc[0, :, 0, 0].tolist(), res.out[0, 0, 0].tolist()   # position 2 written, read back
    ([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])
    """
    from fnattn.decoding.update import _fits
    fn = "selected_decode_with_update"
    _refuse_latent_values(fn, value_dim, v_new, "v_new")
    dims = _check_cache(fn, spec, q, k_cache, v_cache, value_dim)
    B, Tq, S = dims.batch, dims.q_len, dims.kv_len
    for name, new, cache in (("k_new", k_new, k_cache), ("v_new", v_new, v_cache)):
        if cache is None:
            continue
        want = list(cache.shape)
        want[1 if spec.layout == "bthd" else 2] = Tq
        _check_store(fn, name, new, want, "the cache's shape with Tq new tokens")
    _check_int(fn, "kv_lengths", kv_lengths, (B,), "(B,)")
    lengths = kv_lengths.astype(I32)
    starts = jnp.zeros((B,), I32) if kv_starts is None else kv_starts.astype(I32)
    fits = _fits(lengths, starts, S, Tq)
    slot = (starts + lengths - Tq)[:, None] + jnp.arange(Tq, dtype=I32)
    slot = jnp.where((fits & (lengths > 0))[:, None], slot, S)     # S: dropped
    rows = jnp.arange(B, dtype=I32)[:, None]

    def put(cache, new):
        if cache is None:
            return None
        if spec.layout == "bthd":
            return quant.write(cache, (rows, slot), new)
        # (the advanced indices (rows, slot) are apart: their (B, Tq) axes come first)
        return quant.write(cache, (rows, slice(None), slot), jnp.swapaxes(new, 1, 2))

    k_cache, v_cache = put(k_cache, k_new), put(v_cache, v_new)
    res = selected_decode(spec, q, k_cache, v_cache, indices, kv_lengths=kv_lengths,
                          kv_starts=kv_starts, value_dim=value_dim, unique=unique)
    bad = ~fits
    out = jnp.where(bad[:, None, None, None], jnp.nan, res.out).astype(res.out.dtype)
    lse = None if res.lse is None else jnp.where(bad[:, None, None], jnp.nan, res.lse)
    return AttentionOutput(out, lse), k_cache, v_cache


def _paged_slots(page_table, seq, idx, lengths, num_pages, page_size, unique):
    """Positions -> (positions as a set, pool slots); -1 where not selected: past the
    sequence's length, or on a page it does not own (negative or past the pool)."""
    P = page_table.shape[1]
    idx = _as_set(idx, jnp.minimum(lengths, P * page_size)[seq][:, None, None], unique)
    page = page_table[seq[:, None, None], jnp.clip(idx // page_size, 0, P - 1)]
    owned = (idx >= 0) & (page >= 0) & (page < num_pages)
    idx = jnp.where(owned, idx, -1)
    return idx, jnp.where(owned, page * page_size + idx % page_size, -1)


def _first_slot(page_table, seq, num_pages, page_size):
    """The pool slot an unselected entry reads (its value discarded): the first
    slot of the sequence's first page where it owns one, else slot 0."""
    page = page_table[seq, 0].astype(I32)
    return jnp.where((page >= 0) & (page < num_pages), page * page_size, 0)


def _check_paged(fn, q, head_dim, k_pages, v_pages, value_dim):
    """(Hkv, num_pages, page_size, Dv) of the pools (float, quantized or latent)."""
    v_like = _latent.values(fn, k_pages, v_pages, value_dim, q, k_name="k_pages",
                            v_name="v_pages")
    for name, x in (("k_pages", k_pages), ("v_pages", v_like)):
        if quant.is_quantized(x):
            quant.check(fn, name, x)
        else:
            _checks.check_float(f"{fn}: {name}", x)
    ks, vs = tuple(k_pages.shape), tuple(v_like.shape)
    if len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3]:
        raise ValueError(f"{fn}: k_pages and v_pages must have shapes (Hkv, num_pages, "
                         f"page_size, D) and (Hkv, num_pages, page_size, Dv); got {ks} and {vs}")
    Hkv, N, ps, D = ks
    q_heads = q.shape[-2]
    if D != head_dim or q_heads % Hkv:
        raise ValueError(f"{fn}: k_pages {ks} must have head dim D={head_dim} of q and a number "
                         f"of kv heads dividing Hq={q_heads}")
    return Hkv, N, ps, vs[-1]


@_checks.entry_point("fnattn.selected_paged_attention",
                     ints=("indices", "page_table", "kv_lengths"))
@jaxtyped(typechecker=beartype)
def selected_paged_attention(spec: AttentionSpec, q: Shaped[Array, "..."],
                             k_pages: quant.Cache, v_pages: Optional[quant.Cache],
                             indices: Shaped[Array, "..."], *, page_table: Shaped[Array, "..."],
                             kv_lengths: Shaped[Array, "..."], value_dim: Optional[int] = None,
                             unique: bool = False) -> AttentionOutput:
    """:func:`fnattn.paged_attention` over the selected positions of each sequence.

    Args:
      spec: as for :func:`fnattn.paged_attention` (positional masks only).
      q: (B, Tq, Hq, D) or (B, Hq, Tq, D), query ``t`` of sequence ``b`` at
        position ``kv_lengths[b] - Tq + t``.
      k_pages: the pool of keys, (Hkv, num_pages, page_size, D), float or a
        :class:`fnattn.quant.QuantizedArray` (the selected keys' codes and scales
        are gathered, then dequantized to q's dtype; never the whole pool).
      v_pages: the pool of values, (Hkv, num_pages, page_size, Dv), float or
        quantized; None for a latent pool (``value_dim``).
      indices: (B, Tq, K) or (B, Tq, Hkv, K) int, *positions* in the sequence,
        resolved through its page table. A position at or past
        ``kv_lengths[b]``, negative, or on a page the sequence does not own
        (a table entry that is negative or past the pool) selects nothing and
        is never read; repeats count once unless ``unique``.
      page_table: (B, max_pages_per_seq) int.
      kv_lengths: (B,) int.
      value_dim: a latent pool: ``v_pages`` is None and the values are the
        first ``value_dim`` channels of the selected keys.
      unique: the caller promises no repeated index in a row.

    Returns:
      :class:`AttentionOutput` as :func:`fnattn.paged_attention` returns.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec
    >>> kp = vp = jax.random.normal(jax.random.key(0), (1, 6, 4, 8))   # 6 pages of 4
    >>> q = jax.random.normal(jax.random.key(1), (1, 1, 2, 8))
    >>> table = jnp.array([[5, 2, -1]])                                 # positions 0..7
    >>> res = jax.jit(fnattn.selected_paged_attention)(
    ...     AttentionSpec(), q, kp, vp, jnp.array([[[1, 6, 9]]]), page_table=table,
    ...     kv_lengths=jnp.array([8]))                                  # 9: no page, unused
    >>> keys = jnp.stack([kp[0, 5, 1], kp[0, 2, 2]])[None, :, None]
    >>> ref = fnattn.reference(AttentionSpec(), q, keys, keys)
    >>> bool(jnp.allclose(res.out, ref.out, atol=1e-5))
    True
    """
    fn = "selected_paged_attention"
    _refuse(fn, spec, arrays_ok=False)
    _checks.check_float(f"{fn}: q", q)
    if q.ndim != 4:
        raise ValueError(f"{fn}: q must have 4 axes for layout {spec.layout!r}; got shape "
                         f"{tuple(q.shape)}")
    qb = _checks.to_bthd(q, spec.layout)
    B, Tq, Hq, D = qb.shape
    Hkv, N, ps, Dv = _check_paged(fn, qb, D, k_pages, v_pages, value_dim)
    _check_sinks(fn, spec.sinks, Hq)
    if page_table.ndim != 2 or page_table.shape[0] != B:
        raise ValueError(f"{fn}: page_table must have shape (B, max_pages_per_seq) with B={B}; "
                         f"got {tuple(page_table.shape)}")
    _check_int(fn, "page_table", page_table, page_table.shape, "(B, max_pages_per_seq)")
    _check_int(fn, "kv_lengths", kv_lengths, (B,), "(B,)")
    idx = _check_indices(fn, indices, (B, Tq), Hkv, "B, Tq").reshape(B * Tq, Hkv, -1)
    seq = jnp.repeat(jnp.arange(B, dtype=I32), Tq)
    lengths = kv_lengths.astype(I32)
    kpos, slot = _paged_slots(page_table.astype(I32), seq, idx, lengths, N, ps, unique)
    rows = jnp.arange(Tq, dtype=I32)
    tok = jnp.stack([seq, jnp.tile(rows, B), (lengths[:, None] - Tq + rows[None]).reshape(-1),
                     _first_slot(page_table, seq, N, ps)], axis=1)
    out, lse = _run(spec, fn, qb.reshape(B * Tq, Hq, D), _lead(k_pages, Hkv, N * ps),
                    _lead(v_pages, Hkv, N * ps), slot, kpos, tok, heads_first=True,
                    scale=_checks.resolve_scale(spec, D), mask_arrays=False, value_dim=value_dim)
    out = _checks.from_bthd(out.reshape(B, Tq, Hq, Dv), spec.layout)
    lse = lse.reshape(Hq, B, Tq).transpose(1, 0, 2)
    return AttentionOutput(out, lse if spec.return_lse else None)


class _Ragged:
    """The checked arguments of the ragged forms and each packed row's sequence."""

    def __init__(self, fn, spec, q, k_pages, v_pages, indices, page_table, context_lengths,
                 query_start_loc, num_seqs, value_dim):
        _refuse(fn, spec, arrays_ok=False)
        _checks.check_float(f"{fn}: q", q)
        if spec.layout != "bthd":
            raise ValueError(f"{fn}: q is packed (total_tokens, Hq, D); spec.layout must be "
                             f"'bthd'; got {spec.layout!r}")
        if q.ndim != 3:
            raise ValueError(f"{fn}: q must have shape (total_tokens, Hq, D); got "
                             f"{tuple(q.shape)}")
        T, Hq, D = q.shape
        Hkv, N, ps, Dv = _check_paged(fn, q, D, k_pages, v_pages, value_dim)
        _check_sinks(fn, spec.sinks, Hq)
        if page_table.ndim != 2:
            raise ValueError(f"{fn}: page_table must have shape (max_seqs, max_pages_per_seq); "
                             f"got {tuple(page_table.shape)}")
        S, P = page_table.shape
        _check_int(fn, "page_table", page_table, page_table.shape,
                   "(max_seqs, max_pages_per_seq)")
        _check_int(fn, "context_lengths", context_lengths, (S,), "(max_seqs,)")
        _check_int(fn, "query_start_loc", query_start_loc, (S + 1,), "(max_seqs + 1,)")
        num_seqs = jnp.reshape(num_seqs, ())
        if not jnp.issubdtype(num_seqs.dtype, jnp.integer):
            raise TypeError(f"{fn}: num_seqs must be an integer; got {num_seqs.dtype}")
        self.idx = _check_indices(fn, indices, (T,), Hkv, "total_tokens")
        self.dims = (T, Hq, D, Hkv, N, ps, Dv, P)
        loc = query_start_loc.astype(I32)
        r = jnp.arange(T, dtype=I32)
        seq = jnp.clip(jnp.searchsorted(loc, r, side="right").astype(I32) - 1, 0, S - 1)
        self.live = (r >= loc[0]) & (r < loc[jnp.clip(num_seqs, 0, S)]) & (seq < num_seqs)
        self.lengths = jnp.where(jnp.arange(S) < num_seqs, context_lengths.astype(I32), 0)
        self.seq = seq
        self.row = r - loc[seq]
        self.n = loc[seq + 1] - loc[seq]
        self.pos = self.lengths[seq] - self.n + self.row          # each row's position
        self.page_table = page_table.astype(I32)

    def slots(self):
        """The pool slot of each row's own token (N * page_size where it is not
        written: a row of no live sequence, a position outside the table or a
        page outside the pool)."""
        T, Hq, D, Hkv, N, ps, Dv, P = self.dims
        pos = self.pos
        page = self.page_table[self.seq, jnp.clip(pos // ps, 0, P - 1)]
        ok = self.live & (pos >= 0) & (pos < P * ps) & (page >= 0) & (page < N)
        return jnp.where(ok, page * ps + pos % ps, N * ps)

    def attend(self, fn, spec, q, k_pages, v_pages, unique, value_dim):
        T, Hq, D, Hkv, N, ps, Dv, P = self.dims
        idx = jnp.where(self.live[:, None, None], self.idx, -1)
        kpos, slot = _paged_slots(self.page_table, self.seq, idx, self.lengths, N, ps, unique)
        tok = jnp.stack([self.seq, self.row, self.pos,
                         _first_slot(self.page_table, self.seq, N, ps)], axis=1)
        out, lse = _run(spec, fn, q, _lead(k_pages, Hkv, N * ps), _lead(v_pages, Hkv, N * ps),
                        slot, kpos, tok, heads_first=True, scale=_checks.resolve_scale(spec, D),
                        mask_arrays=False, value_dim=value_dim)
        return AttentionOutput(out, lse if spec.return_lse else None)


@_checks.entry_point("fnattn.selected_ragged_paged_attention",
                     ints=("indices", "page_table", "context_lengths", "query_start_loc",
                           "num_seqs"))
@jaxtyped(typechecker=beartype)
def selected_ragged_paged_attention(spec: AttentionSpec, q: Shaped[Array, "..."],
                                    k_pages: quant.Cache, v_pages: Optional[quant.Cache],
                                    indices: Shaped[Array, "..."], *,
                                    page_table: Shaped[Array, "..."],
                                    context_lengths: Shaped[Array, "..."],
                                    query_start_loc: Shaped[Array, "..."],
                                    num_seqs: Shaped[Array, "..."],
                                    value_dim: Optional[int] = None,
                                    unique: bool = False) -> AttentionOutput:
    """:func:`fnattn.ragged_paged_attention` over each token's selected positions.

    Sequence ``s < num_seqs`` owns the packed rows ``query_start_loc[s] ..
    query_start_loc[s + 1] - 1``, its ``n`` newest tokens at positions
    ``context_lengths[s] - n ..``; ``indices[r]`` are positions in the
    sequence that owns row ``r``, resolved through its page table (outside
    ``[0, context_lengths[s])`` or on a page it does not own: not selected,
    never read). Rows of no live sequence give 0 and ``lse = -inf``.

    Args:
      spec: as for :func:`fnattn.ragged_paged_attention` (layout "bthd").
      q: (total_tokens, Hq, D).
      k_pages: (Hkv, num_pages, page_size, D), float or quantized (only the
        selected keys are dequantized).
      v_pages: (Hkv, num_pages, page_size, Dv), float or quantized; None for a
        latent pool (``value_dim``).
      indices: (total_tokens, K) or (total_tokens, Hkv, K) int.
      page_table: (max_seqs, max_pages_per_seq) int.
      context_lengths: (max_seqs,) int.
      query_start_loc: (max_seqs + 1,) int.
      num_seqs: int scalar or (1,): live sequences.
      value_dim: a latent pool: ``v_pages`` is None and the values are the
        first ``value_dim`` channels of the selected keys.
      unique: the caller promises no repeated index in a row.

    Returns:
      :class:`AttentionOutput` with ``out`` (total_tokens, Hq, Dv) and ``lse``
      (Hq, total_tokens) float32.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> kp = vp = jax.random.normal(jax.random.key(0), (1, 4, 4, 8))
    >>> q = jax.random.normal(jax.random.key(1), (3, 2, 8))   # 2 tokens of seq 0, 1 of seq 1
    >>> idx = jnp.array([[0, 4, 6], [0, 5, 6], [1, 2, 3]])
    >>> res = jax.jit(fnattn.selected_ragged_paged_attention)(
    ...     AttentionSpec(mask=masks.causal()), q, kp, vp, idx,
    ...     page_table=jnp.array([[0, 1], [2, 3]]), context_lengths=jnp.array([6, 3]),
    ...     query_start_loc=jnp.array([0, 2, 3]), num_seqs=2)
    >>> res.out.shape, res.lse.shape      # token 0 (position 4) sees keys 0 and 4 only
    ((3, 2, 8), (2, 3))
    """
    fn = "selected_ragged_paged_attention"
    rg = _Ragged(fn, spec, q, k_pages, v_pages, indices, page_table, context_lengths,
                 query_start_loc, num_seqs, value_dim)
    return rg.attend(fn, spec, q, k_pages, v_pages, unique, value_dim)


@_checks.entry_point("fnattn.selected_ragged_paged_attention_with_update",
                     ints=("indices", "page_table", "context_lengths", "query_start_loc",
                           "num_seqs"))
@jaxtyped(typechecker=beartype)
def selected_ragged_paged_attention_with_update(
        spec: AttentionSpec, q: Shaped[Array, "..."], k: Shaped[Array, "..."],
        v: Optional[Shaped[Array, "..."]], k_pages: quant.Cache,
        v_pages: Optional[quant.Cache], indices: Shaped[Array, "..."], *,
        page_table: Shaped[Array, "..."], context_lengths: Shaped[Array, "..."],
        query_start_loc: Shaped[Array, "..."], num_seqs: Shaped[Array, "..."],
        value_dim: Optional[int] = None, unique: bool = False):
    """Writes the new tokens' k/v into the pools, then
    :func:`selected_ragged_paged_attention` over the updated pools.

    The write is :func:`fnattn.ragged_paged_attention_with_update`'s: token row
    ``t`` of sequence ``s`` (``n`` new tokens, context ``L``) is at position
    ``L - n + (t - query_start_loc[s])`` and goes to page ``page_table[s, pos //
    page_size]``, offset ``pos % page_size``; writes of rows of no live
    sequence, of positions outside the page table, or to a page entry outside
    the pool are dropped. A quantized pool gets the codes and per-token scales
    of :func:`fnattn.quant.write` (bit for bit those of
    :func:`fnattn.quant.quantize`). The new tokens are attended to where
    ``indices`` select their positions (DSA's indexer scores them too). Donate
    the pools (``jax.jit(..., donate_argnums=(4, 5))``) for an update in place.

    Args:
      spec: as for :func:`selected_ragged_paged_attention`.
      q: (total_tokens, Hq, D).
      k: (total_tokens, Hkv, D), the new tokens' keys (latent and rope channels
        for a latent pool).
      v: (total_tokens, Hkv, Dv), the new tokens' values; None for a latent pool.
      k_pages: (Hkv, num_pages, page_size, D), float or quantized.
      v_pages: (Hkv, num_pages, page_size, Dv), float or quantized; None for a
        latent pool.
      indices: (total_tokens, K) or (total_tokens, Hkv, K) int, positions (the
        new tokens' included).
      page_table: (max_seqs, max_pages_per_seq) int.
      context_lengths: (max_seqs,) int, tokens of each sequence after the update.
      query_start_loc: (max_seqs + 1,) int.
      num_seqs: int scalar or (1,): live sequences.
      value_dim: a latent pool, as for :func:`selected_ragged_paged_attention`.
      unique: the caller promises no repeated index in a row.

    Returns:
      ``(AttentionOutput, k_pages, v_pages)`` with the updated pools.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> kp, vp = jnp.zeros((2, 1, 4, 2, 8))                # 4 pages of 2 slots each
    >>> q = k = v = jnp.ones((3, 1, 8))                    # 3 new tokens of one sequence
    >>> f = jax.jit(fnattn.selected_ragged_paged_attention_with_update,
    ...             donate_argnums=(4, 5))
    >>> res, kp, vp = f(AttentionSpec(mask=masks.causal()), q, k, v, kp, vp,
    ...                 jnp.array([[0, 2], [1, 2], [2, -1]]), page_table=jnp.array([[2, 0]]),
    ...                 context_lengths=jnp.array([3]), query_start_loc=jnp.array([0, 3]),
    ...                 num_seqs=jnp.int32(1))
    >>> kp[0, :, :, 0].tolist()                            # positions 0, 1 -> page 2; 2 -> page 0
    [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    >>> res.out[:, 0, 0].tolist()                          # each row sees a written key
    [1.0, 1.0, 1.0]
    """
    fn = "selected_ragged_paged_attention_with_update"
    _refuse_latent_values(fn, value_dim, v, "v")
    rg = _Ragged(fn, spec, q, k_pages, v_pages, indices, page_table, context_lengths,
                 query_start_loc, num_seqs, value_dim)
    T, Hq, D, Hkv, N, ps, Dv, P = rg.dims
    news = (("k", k, (T, Hkv, D)), ("v", v, (T, Hkv, Dv)))
    for name, x, want in news[:1 if v_pages is None else 2]:
        _check_store(fn, name, x, want, "(total_tokens, Hkv, D|Dv) from q and the pools")
    slot = rg.slots()

    def put(pool, new):
        if pool is None:
            return None
        flat = quant.write(_lead(pool, Hkv, N * ps), (slice(None), slot), jnp.swapaxes(new, 0, 1))
        return _lead(flat, Hkv, N, ps)

    k_pages, v_pages = put(k_pages, k), put(v_pages, v)
    res = rg.attend(fn, spec, q, k_pages, v_pages, unique, value_dim)
    return res, k_pages, v_pages


# ----------------------------------------------------------------------------------
# The indexer's side
# ----------------------------------------------------------------------------------


def blockwise_top_k(score_block, num_keys: int, k: int, *, block_k: int = 1024):
    """The ``k`` best keys by score, with the scores formed one block of keys at a time.

    ``score_block(start)`` returns the scores (..., block_k) of keys ``start ..
    start + block_k - 1`` (``start`` is traced; keys past ``num_keys`` are
    dropped here, and a score of -inf marks a key not to select, e.g. a
    future one). A running top-k is merged with each block by ``lax.top_k``
    over ``k + block_k`` candidates, so the memory is O(rows * (k + block_k)),
    never (rows, num_keys).

    Returns:
      ``(scores, indices)`` (..., k), best first; indices of -inf scores
      (fewer than ``k`` selectable keys) are -1, which
      :func:`selected_attention` reads as padding.

    >>> import jax, jax.numpy as jnp
    >>> s = jax.random.normal(jax.random.key(0), (3, 100))
    >>> blk = lambda start: jax.lax.dynamic_slice_in_dim(
    ...     jnp.pad(s, ((0, 0), (0, 28))), start, 32, axis=1)
    >>> vals, idx = jax.jit(lambda: blockwise_top_k(blk, 100, 5, block_k=32))()
    >>> ref_vals, ref_idx = jax.lax.top_k(s, 5)
    >>> bool((idx == ref_idx).all()), bool(jnp.allclose(vals, ref_vals))
    (True, True)
    """
    if k < 1 or block_k < 1:
        raise ValueError(f"blockwise_top_k: k and block_k must be >= 1; got {k} and {block_k}")
    n_blocks = -(-num_keys // block_k)

    def scores_at(j):
        start = j * block_k
        s = score_block(start).astype(F32)
        if s.shape[-1] != block_k:
            raise ValueError(f"blockwise_top_k: score_block must return (..., block_k="
                             f"{block_k}) scores; got {tuple(s.shape)}")
        ids = start + jnp.arange(block_k, dtype=I32)
        return jnp.where(ids < num_keys, s, -jnp.inf), jnp.broadcast_to(ids, s.shape)

    s0, i0 = scores_at(0)
    if k > block_k:
        pad = k - block_k
        s0 = jnp.pad(s0, [(0, 0)] * (s0.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
        i0 = jnp.pad(i0, [(0, 0)] * (i0.ndim - 1) + [(0, pad)], constant_values=-1)
    vals, pick = lax.top_k(s0, k)
    ids = jnp.take_along_axis(i0, pick, axis=-1)

    def step(j, carry):
        vals, ids = carry
        s, i = scores_at(j)
        cv, ci = jnp.concatenate([vals, s], -1), jnp.concatenate([ids, i], -1)
        v2, pick = lax.top_k(cv, k)
        return v2, jnp.take_along_axis(ci, pick, axis=-1)

    if n_blocks > 1:
        vals, ids = lax.fori_loop(1, n_blocks, step, (vals, ids))
    return vals, jnp.where(vals == -jnp.inf, -1, ids)
