"""Paged attention: decode and mixed prefill/decode batches over a paged KV cache.

**The pool.** Keys and values live in two pools of fixed-size pages shared by
all sequences, laid out **heads-major**::

    k_pages: (Hkv, num_pages, page_size, D)      v_pages: (Hkv, num_pages, page_size, Dv)

so that one (kv head, page) is one contiguous ``page_size x D`` tile: a single
contiguous read on a GPU, a legal TPU block for every page size and head dim
(the last two axes are whole), and gathering a sequence's pages gives the
(Hkv, keys, D) operand of a batched matrix product with no transpose. (Writing
one token touches ``Hkv`` rows instead of one; decode reads far more than it
writes.) ``page_table[s, j]`` is the pool page holding positions
``j * page_size .. (j + 1) * page_size - 1`` of sequence ``s``.

**Positions.** A sequence with context length ``L`` (all its tokens, the new
ones included) and ``n`` new query tokens has its query ``i`` at position
``L - n + i`` and the key in logical slot ``j`` at position ``j``. The spec's
mask (``causal()``, ``sliding_window(...)``, ``chunked(...)``, their
combinations, ``from_fn``) then means what it means in dense attention on the
same tokens: the result equals ``fnattn.reference`` on q (1, n, Hq, D) and the
sequence's keys (1, L, Hkv, D). ``mask=None`` is full attention over the
context (for one query token per sequence that is the same as causal). Masks
that hold arrays (segments, lengths, from_array) are refused: the page table and
the lengths already say which keys exist.

**Lowerings** (``spec.impl``), chosen per platform when the program is lowered
(:func:`fnattn._dispatch.select`):

========  =====================================  ==============================
platform  impl="auto"                            impl="pallas"
========  =====================================  ==============================
cuda      Pallas Triton (fnattn/paged/triton)    the same
tpu       Pallas Mosaic (fnattn/paged/mosaic)    the same
other     XLA (fnattn/paged/xla)                 Triton kernels, interpreted
========  =====================================  ==============================

On a Hopper GPU, ``paged_attention`` and ``ragged_paged_attention`` (and its
``_with_update`` form) with
:class:`fnattn.decoding.mosaic_gpu.MosaicGpuDecodeBlockSizes` among the spec's
block sizes run the Pallas Mosaic GPU kernel (fnattn/paged/mosaic_gpu.py)
under either impl instead; it has not been timed on a GPU yet, so it is not
the default.

The Mosaic kernel needs a page size that is a multiple of 8; on TPU,
``impl="auto"`` runs other page sizes with the XLA lowering and
``impl="pallas"`` raises ``NotImplementedError`` (at trace time, on every
platform, since every branch is traced).

Quantized pools (:class:`fnattn.quant.QuantizedArray`: every format, per-tensor
or per-token scales) and latent pools (``value_dim`` with no ``v_pages``) run
with the table above, except that a spec asking for the Mosaic GPU kernel runs
them with the XLA lowering (that kernel reads float pools with separate values
only): the Triton and Mosaic kernels dequantize each tile after its load and
take a latent pool's values from the key tile they loaded. The update form
writes quantized pools with XLA (:func:`fnattn.quant.write`) before the
kernel runs; float latent pools are written by the kernels, keys only.
Derivatives through quantized pools are reverse mode only.

Speculative tree verification (``draft_parents``, a tree over each
sequence's new tokens: :mod:`fnattn.paged.tree`) runs with the XLA lowering
on every platform under ``impl="auto"``; ``impl="pallas"`` raises
``NotImplementedError`` for it (no kernel takes a tree yet).

``impl="xla"`` is the XLA lowering everywhere, ``impl="reference"`` the plain
gather-everything implementation (:mod:`fnattn.paged.reference`).

**Gradients.** The attention-only forms are differentiable with respect to q,
the pools and ``spec.sinks`` on every lowering, in either mode and to any order:
one ``jax.custom_jvp`` wraps the platform choice, and its tangent and backward
are ``jax.jvp`` and ``jax.vjp`` of the XLA lowering. The form
that writes the cache (:func:`ragged_paged_attention_with_update`) is for
inference and is not differentiable.

**Bad run-time values** never make a lowering read or write outside the pools
(see :mod:`fnattn.paged.common`); ``checked=True`` reports them as
``jax.experimental.checkify`` errors.
"""

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jax.experimental import checkify
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, _dispatch, _latent, _linear, _partition, position_bias, quant
from fnattn._serving import refuse_float64, refuse_traced_sizes, traced_sizes
from fnattn.decoding.mosaic_gpu import MosaicGpuDecodeBlockSizes
from fnattn._varying import varying_like
from fnattn.flash import blocks
from fnattn.paged import common, reference, xla
from fnattn.paged import tree as treemod
from fnattn.paged.common import I32, Cfg
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["paged_attention", "ragged_paged_attention", "ragged_paged_attention_with_update",
           "check_inputs", "lowering_table", "paged_attention_with", "ragged_paged_attention_with",
           "ragged_paged_attention_with_update_with"]


# ----------------------------------------------------------------------------------
# Lowering tables
# ----------------------------------------------------------------------------------


def lowering_table(impl: str):
    """The (platform, forward) pairs for ``impl``; forward(cfg, q, kp, vp, sinks, meta, nk, nv)."""
    if impl in ("auto", "pallas"):
        # (Pallas is imported only when needed)
        from fnattn.paged import mosaic, mosaic_gpu, triton
    if impl == "auto":
        return (("default", xla.forward),
                ("cuda", functools.partial(mosaic_gpu.gpu_forward, triton.auto_forward)),
                ("tpu", _tpu_auto))
    if impl == "xla":
        return (("default", xla.forward),)
    if impl == "pallas":
        return (("default", triton.forward_interpret),
                ("cuda", functools.partial(mosaic_gpu.gpu_forward, triton.forward)),
                ("tpu", mosaic.forward))
    if impl == "reference":
        return (("default", _reference_forward),)
    if impl == "cudnn":
        raise NotImplementedError(
            "paged attention: impl='cudnn' has no paged lowering; use impl='auto' (Triton "
            "kernels on NVIDIA GPUs) or impl='xla'.")
    raise ValueError(f"paged attention: no lowering for impl={impl!r}")


def quantized_table(impl: str, feature: str = "quantized pools (fnattn.quant.QuantizedArray "
                                               "k_pages/v_pages)"):
    """The lowering table for quantized pools (:mod:`fnattn.quant`) and latent
    pools (``value_dim``): the Triton kernel on NVIDIA GPUs and the Mosaic kernel
    on TPU, which dequantize each tile after its load and take latent values
    from the key tile (every format and scale kind of :mod:`fnattn.quant`); the
    XLA lowering elsewhere, and where those kernels would hand a call to it
    anyway (symbolic sizes, page sizes Mosaic refuses, ``from_fn`` functions).
    A spec that asks for the Mosaic GPU kernel (``MosaicGpuDecodeBlockSizes``),
    which reads float pools with separate values only, runs them with the Triton
    kernel, as the contiguous decode does. ``feature`` names them in errors."""
    del feature
    if impl == "auto":
        from fnattn.paged import triton
        return (("default", xla.forward), ("cuda", triton.auto_forward), ("tpu", _tpu_auto))
    if impl == "pallas":
        from fnattn.paged import mosaic, triton
        return (("default", triton.forward_interpret), ("cuda", triton.forward),
                ("tpu", mosaic.forward))
    return lowering_table(impl)


def tree_table(impl: str):
    """The lowering table for speculative tree verification (``draft_parents``):
    the XLA lowering on every platform under impl="auto" (no Pallas kernel
    takes a tree yet)."""
    if impl in ("auto", "xla"):
        return (("default", xla.forward),)
    if impl == "reference":
        return (("default", _reference_forward),)
    if impl == "pallas":
        raise NotImplementedError(
            "paged attention: impl='pallas' has no kernel for speculative tree verification "
            "(draft_parents) yet: the Triton, Mosaic TPU and Mosaic GPU kernels take "
            "positional masks only. The XLA lowering runs trees: use impl='auto' (which runs "
            "it on every platform for them) or impl='xla'.")
    return lowering_table(impl)


def traced_sizes_table(impl: str):
    """The lowering table for masks whose window or chunk sizes are arrays
    (:func:`fnattn._serving.traced_sizes`): the XLA lowering, whose schedule
    (the key chunks it skips) is computed from the sizes' values, on every
    platform under impl="auto" (the Pallas kernels' schedules are built from
    static sizes: impl="pallas" refuses them)."""
    if impl in ("auto", "xla"):
        return (("default", xla.forward),)
    if impl == "pallas":
        refuse_traced_sizes("paged attention", "Pallas paged kernels (Triton, Mosaic TPU, "
                            "Mosaic GPU)", "fnattn/paged/xla.py")
    return lowering_table(impl)


def _tpu_auto(cfg, *args):
    """impl="auto" on TPU: the Mosaic kernel, or the XLA lowering for a cache it cannot
    run (see ``fnattn.paged.mosaic.unsupported``), decided from the static config."""
    from fnattn.paged import mosaic
    fwd = xla.forward if mosaic.unsupported(cfg) else mosaic.forward
    return fwd(cfg, *args)


def _reference_forward(cfg, q, k_pages, v_pages, sinks, meta, new_k=None, new_v=None):
    if cfg.update:
        k_pages, v_pages = xla.write_tokens(cfg, meta, k_pages, v_pages, new_k, new_v)
        return (*reference.attend(cfg, q, k_pages, v_pages, sinks, meta), k_pages, v_pages)
    return reference.attend(cfg, q, k_pages, v_pages, sinks, meta)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _attend(table, cfg, q, k_pages, v_pages, sinks, meta):
    return _forward(table, cfg, q, k_pages, v_pages, sinks, meta)


def _forward(table, cfg, q, k_pages, v_pages, sinks, meta, new_k=None, new_v=None):
    # split along the kv heads of sharded pools under jit (fnattn._partition)
    return _partition.paged(functools.partial(_dispatch.select, table), cfg, q, k_pages,
                            v_pages, sinks, meta, new_k, new_v)


@_attend.defjvp
def _attend_jvp(table, cfg, primals, tangents):
    q, k_pages, v_pages, sinks, meta = primals
    tq, tk, tv, tsinks, _ = tangents
    out, lse = _attend(table, cfg, *primals)  # second order comes back here
    leaves, treedef = jax.tree_util.tree_flatten(meta)
    t_out, t_lse = _linear.tangent(_Derivatives(cfg, treedef),
                                   (q, k_pages, v_pages, sinks, *leaves),
                                   (tq, tk, tv, tsinks), (out, lse))
    return (out, lse), (t_out, t_lse)


@dataclasses.dataclass(frozen=True)
class _Derivatives(_linear.Rule):
    """Derivatives of paged attention on every platform: those of the XLA
    lowering (``jax.jvp`` and ``jax.vjp`` of it). Residuals (q, k_pages,
    v_pages, sinks, *meta leaves); tangents of (q, k_pages, v_pages, sinks)."""

    cfg: Any
    meta_treedef: Any

    def _split(self, res):
        q, k_pages, v_pages, sinks, *leaves = res
        return q, k_pages, v_pages, sinks, jax.tree_util.tree_unflatten(self.meta_treedef,
                                                                         leaves)

    def smooth(self, res):
        q, k_pages, v_pages, sinks, meta = self._split(res)
        return _xla_fn(self.cfg, meta), (q, k_pages, v_pages, sinks)

    def tangent(self, res, lin):
        return self.smooth_tangent(res, lin)

    def cotangent(self, res, cts):
        q, k_pages, v_pages, sinks, meta = self._split(res)
        d_out, d_lse = cts
        return _partition.paged(_grads, self.cfg, q, k_pages, v_pages, sinks, meta, None, None,
                                d_out, d_lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend_stored(table, cfg, q, k_pages, v_pages, sinks, meta):
    """:func:`_attend` for quantized pools (pytrees of codes and scales), in
    reverse mode only: the backward is ``jax.vjp`` of the XLA lowering, through
    the dequantization (the scales get cotangents, the integer codes float0)."""
    return _forward(table, cfg, q, k_pages, v_pages, sinks, meta)


def _stored_fwd(table, cfg, q, k_pages, v_pages, sinks, meta):
    return (_forward(table, cfg, q, k_pages, v_pages, sinks, meta),
            (q, k_pages, v_pages, sinks, meta))


def _stored_bwd(table, cfg, res, cts):
    q, k_pages, v_pages, sinks, meta = res
    grads = _grads(cfg, q, k_pages, v_pages, sinks, meta, None, None, *cts)
    zero = lambda x: (np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
                      if jnp.issubdtype(x.dtype, jnp.integer) else jnp.zeros_like(x))
    return (*grads, jax.tree_util.tree_map(zero, meta))


_attend_stored.defvjp(_stored_fwd, _stored_bwd)


def _xla_fn(cfg, meta):
    """The XLA lowering as a function of the differentiable inputs (q, k_pages,
    v_pages, sinks)."""
    def f(q, k_pages, v_pages, sinks):
        return xla.attend(cfg, q, k_pages, v_pages, sinks, meta, sanitize=True)
    return f


def _grads(cfg, q, k_pages, v_pages, sinks, meta, new_k, new_v, d_out, d_lse):
    del new_k, new_v
    _, vjp = jax.vjp(_xla_fn(cfg, meta), q, k_pages, v_pages, sinks)
    return vjp((d_out, d_lse.astype(jnp.float32)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _attend_update(table, cfg, q, k_pages, v_pages, sinks, meta, new_k, new_v):
    return _forward(table, cfg, q, k_pages, v_pages, sinks, meta, new_k, new_v)


@_attend_update.defjvp
def _update_jvp(table, cfg, primals, tangents):
    raise NotImplementedError(
        "ragged_paged_attention_with_update is not differentiable, in either mode (it is the "
        "inference form that writes the cache); differentiate ragged_paged_attention "
        "instead, on a pool that already holds the new tokens.")


# ----------------------------------------------------------------------------------
# Trace-time validation
# ----------------------------------------------------------------------------------


def _shape(x):
    return tuple(x.shape) if quant.is_quantized(x) else tuple(jnp.shape(x))


def _check_int(fn, name, x, shape, what):
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{fn}: {name} must be an integer array; got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if _shape(x) != shape:
        raise ValueError(f"{fn}: {name} must have shape {what}={shape}; got {_shape(x)}")


def _check_pools(fn, q_heads, head_dim, dtype, k_pages, v_pages, q_desc, *, layout=None,
                 other_q_heads=None):
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if quant.is_quantized(x):
            quant.check(fn, name, x)
        else:
            _checks.check_float(f"{fn}: {name}", x)
        if x.ndim != 4:
            raise ValueError(f"{fn}: {name} must have 4 axes (Hkv, num_pages, page_size, "
                             f"{'D' if name == 'k_pages' else 'Dv'}); got shape {_shape(x)}")
        if 0 in x.shape:
            raise ValueError(f"{fn}: {name} must have no empty axis; got shape {_shape(x)}")
    Hkv, N, ps, Dk = k_pages.shape
    if Dk != head_dim:
        raise ValueError(f"{fn}: k_pages must have head dim D={head_dim} like q {q_desc}: "
                         f"expected (Hkv, num_pages, page_size, {head_dim}); got "
                         f"{_shape(k_pages)}")
    if v_pages.shape[:3] != (Hkv, N, ps):
        raise ValueError(f"{fn}: v_pages must have shape (Hkv, num_pages, page_size, Dv)="
                         f"({Hkv}, {N}, {ps}, Dv) matching k_pages {_shape(k_pages)}; got "
                         f"{_shape(v_pages)}")
    if q_heads % Hkv:
        raise ValueError(f"{fn}: the number of query heads Hq={q_heads} (q {q_desc}) must be "
                         f"a multiple of the number of kv heads Hkv={Hkv} (k_pages "
                         f"{_shape(k_pages)}, axis 0)"
                         + _fewer_heads_hint(q_heads, k_pages.shape, layout, other_q_heads))
    # a quantized pool holds codes; its values come out in q's dtype
    k_dtype, v_dtype = (dtype if quant.is_quantized(x) else x.dtype for x in (k_pages, v_pages))
    if not (dtype == k_dtype == v_dtype):
        raise TypeError(f"{fn}: q, k_pages and v_pages must share a dtype; got q {dtype}, "
                        f"k_pages {k_pages.dtype}, v_pages {v_pages.dtype}")
    return Hkv, N, ps, v_pages.shape[3]


def _fewer_heads_hint(q_heads, pool_shape, layout, other_q_heads):
    """What to do when Hq < Hkv: q in the other layout, or a pool that is not
    heads-major (its axis 0 is then the number of pages)."""
    Hkv = pool_shape[0]
    if q_heads >= Hkv:
        return ""
    if layout is not None:
        hint = _checks.layout_hint(layout, other_q_heads, Hkv, q_only=True)
        if hint:
            return hint
    if q_heads % pool_shape[2] == 0:
        return (". The pools are heads-major, (Hkv, num_pages, page_size, D): one laid out "
                "(num_pages, page_size, Hkv, D) converts with pages.transpose(2, 0, 1, 3).")
    return ". There cannot be fewer query heads than kv heads: check q's layout and the pools'."


def _check_spec(fn, spec: AttentionSpec, num_q_heads):
    if spec.position_bias is not None:
        position_bias.check_serving(fn, spec.position_bias, (1, num_q_heads, 1, 1),
                                    per_batch=False, what="paged attention")
    if spec.bias is not None:
        raise NotImplementedError(f"{fn}: spec.bias is not supported by paged attention (no "
                                  "paged lowering takes a bias); fnattn.attention and "
                                  "fnattn.flash do.")
    if spec.dropout_rate > 0:
        raise NotImplementedError(f"{fn}: dropout is not supported by paged attention (an "
                                  "inference kernel); fnattn.attention and fnattn.flash "
                                  "support it.")
    if traced_sizes(spec.mask):   # window / chunk sizes as data: the XLA lowering
        bad = [x for x in jax.tree_util.tree_leaves(spec.mask) if jnp.ndim(x) != 0]
        if bad:
            raise ValueError(
                f"{fn}: a window or chunk size given as an array must be a scalar here (one "
                f"per call, e.g. per layer inside lax.scan; paged attention has no batch "
                f"rows); got shape {tuple(jnp.shape(bad[0]))}")
    elif spec.mask is not None and jax.tree_util.tree_leaves(spec.mask):
        raise NotImplementedError(
            f"{fn}: masks that hold arrays ({spec.mask!r}) are not supported by paged "
            "attention; use positional masks (causal, sliding_window, chunked, their "
            "combinations, from_fn), whose window and chunk sizes may be int scalars "
            "(one per layer inside lax.scan). The page table and lengths already say which "
            "keys exist.")
    if spec.sinks is not None:
        _checks.check_float(f"{fn}: sinks", spec.sinks)
        if _shape(spec.sinks) != (num_q_heads,):
            raise ValueError(f"{fn}: sinks must have shape (Hq,)=({num_q_heads},), one logit "
                             f"per query head; got {_shape(spec.sinks)}")


def _make_cfg(spec, *, num_q_heads, num_kv_heads, head_dim, v_head_dim, num_pages, page_size,
              pages_per_seq, max_seqs, total_tokens, uniform_q, update, value_dim=None,
              tree=False):
    treedef = None if spec.mask is None else jax.tree_util.tree_structure(spec.mask)
    term = spec.position_bias
    return Cfg(term_treedef=None if term is None else jax.tree_util.tree_structure(term),
               num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
               v_head_dim=v_head_dim, num_pages=num_pages, page_size=page_size,
               pages_per_seq=pages_per_seq, max_seqs=max_seqs, total_tokens=total_tokens,
               scale=_checks.resolve_scale(spec, head_dim), softcap=spec.softcap,
               mask_treedef=treedef, has_sinks=spec.sinks is not None, uniform_q=uniform_q,
               update=update, block_sizes=common.pick_block_sizes(spec.block_sizes),
               mosaic_gpu=blocks.pick(spec.block_sizes, MosaicGpuDecodeBlockSizes, None),
               value_dim=value_dim, tree=tree)


# ----------------------------------------------------------------------------------
# Checked mode
# ----------------------------------------------------------------------------------


def check_inputs(k_pages, *, page_table, context_lengths, query_start_loc=None, num_seqs=None,
                 total_tokens: Optional[int] = None, new_tokens: Optional[int] = None,
                 draft_parents=None) -> None:
    """Reports bad run-time metadata as ``jax.experimental.checkify`` errors.

    The paged functions never read or write outside the pools whatever these
    values are (see :mod:`fnattn.paged.common`); this says *that* a value was
    wrong. Call it inside a function transformed by ``checkify.checkify`` (or
    pass ``checked=True`` to the paged functions, which call it).

    Checks, for the live sequences ``s < num_seqs``: ``0 <= num_seqs <= max_seqs``;
    ``query_start_loc`` starts at 0 (no token before the first sequence's is left
    uncovered), never decreases and ends at most at ``total_tokens`` (the tokens
    after it are padding); ``new tokens <= context_lengths[s] <= pages_per_seq *
    page_size``; every page-table entry that holds a position ``< context_lengths[s]``
    is in ``[0, num_pages)``. Without ``query_start_loc`` (``paged_attention``)
    every sequence is live and has ``new_tokens`` queries. With
    ``draft_parents`` (packed, (total_tokens,)), every live token's parent is
    in ``[-1, row)`` (``row``: its index among its sequence's new tokens).

    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import checkify
    >>> from fnattn.paged import check_inputs
    >>> pool = jnp.zeros((1, 4, 2, 8))
    >>> def f(table, lengths):
    ...     check_inputs(pool, page_table=table, context_lengths=lengths, new_tokens=1)
    >>> err, _ = jax.jit(checkify.checkify(f))(jnp.array([[0, 9]]), jnp.array([3]))
    >>> print(err.get())  # doctest: +ELLIPSIS
    page_table[0, 1] = 9 is outside the pool [0, 4)...
    """
    _, N, ps, _ = k_pages.shape
    S, P = page_table.shape
    cap = P * ps
    lengths = context_lengths.astype(I32)
    if query_start_loc is None:
        n_live = jnp.int32(S)
        q_len = jnp.full((S,), new_tokens or 0, I32)
    else:
        n_live = jnp.reshape(num_seqs, (-1,))[0].astype(I32)
        checkify.check((n_live >= 0) & (n_live <= S),
                       "num_seqs = {n} is outside [0, max_seqs={S}]", n=n_live, S=jnp.int32(S))
        n_live = jnp.clip(n_live, 0, S)
        loc = query_start_loc.astype(I32)
        checkify.check(loc[0] >= 0, "query_start_loc[0] = {x} is negative", x=loc[0])
        # Tokens after query_start_loc[num_seqs] are padding (documented: zeros and
        # lse = -inf); tokens before query_start_loc[0] are a gap no sequence covers.
        checkify.check((loc[0] <= 0) | (n_live == 0),
                       "query_start_loc[0] = {x}: the packed query tokens 0 to {y} belong to "
                       "no sequence (the first sequence starts at token 0; padding tokens "
                       "go after query_start_loc[num_seqs])", x=loc[0], y=loc[0] - 1)
        idx = jnp.arange(S, dtype=I32)
        dec = (loc[1:] < loc[:-1]) & (idx < n_live)
        bad = jnp.argmax(dec)
        checkify.check(~dec.any(), "query_start_loc decreases at sequence {s}: "
                       "query_start_loc[{s}] = {a} > query_start_loc[{s1}] = {b}",
                       s=bad, s1=bad + 1, a=loc[bad], b=loc[bad + 1])
        if total_tokens is not None:
            checkify.check(loc[n_live] <= total_tokens,
                           "query_start_loc[num_seqs] = {x} is past the {T} packed tokens",
                           x=loc[n_live], T=jnp.int32(total_tokens))
        q_len = loc[1:] - loc[:-1]
    live = jnp.arange(S, dtype=I32) < n_live
    bad_len = live & ((lengths < 0) | (lengths > cap))
    s = jnp.argmax(bad_len)
    checkify.check(~bad_len.any(), "context_lengths[{s}] = {x} is outside [0, {cap}] "
                   "(pages_per_seq * page_size)", s=s, x=lengths[s], cap=jnp.int32(cap))
    short = live & (lengths < q_len)
    s = jnp.argmax(short)
    checkify.check(~short.any(), "context_lengths[{s}] = {x} is less than the sequence's "
                   "{n} new tokens (the context includes them)", s=s, x=lengths[s], n=q_len[s])
    used = (jnp.arange(P, dtype=I32)[None, :] * ps < jnp.clip(lengths, 0, cap)[:, None])
    bad_page = used & live[:, None] & ((page_table < 0) | (page_table >= N))
    flat = jnp.argmax(bad_page.reshape(-1))
    s, j = flat // P, flat % P
    checkify.check(~bad_page.any(), "page_table[{s}, {j}] = {x} is outside the pool [0, {N})",
                   s=s, j=j, x=page_table[s, j].astype(I32), N=jnp.int32(N))
    if draft_parents is not None:
        if query_start_loc is None:
            loc = jnp.arange(S + 1, dtype=I32) * (new_tokens or 0)
            n_live = jnp.int32(S)
        treemod.check(draft_parents.reshape(-1), query_start_loc=loc, num_seqs=n_live,
                      max_seqs=S)


# ----------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------

# The integer metadata of the ragged forms: Python lists and NumPy arrays convert.
_META = ("page_table", "context_lengths", "query_start_loc", "num_seqs", "draft_parents")

def _tree_rule(i):
    if i == 0:
        return ("a sequence's first new token has no earlier one: its parent is -1 (a root, "
                "attached to the context)")
    return (f"a parent is -1 (a root, attached to the context) or the index of an earlier new "
            f"token of the same sequence, 0 <= parent < {i}: parents come before their "
            "children and are indices among the sequence's own new tokens")


def _concrete(*xs):
    return all(x is None or not isinstance(x, jax.core.Tracer) for x in xs)


def _check_tree_values(fn, parents, query_start_loc=None, num_seqs=None):
    """A ValueError, at trace time, for concrete ``draft_parents`` that do not
    describe a tree of each sequence's new tokens (traced ones: ``checked=True``)."""
    if parents is None or not _concrete(parents, query_start_loc, num_seqs):
        return
    p = np.asarray(parents)
    if not np.issubdtype(p.dtype, np.integer):
        return   # (reported by the function itself)
    p = p.astype(np.int64)
    if p.ndim == 2:                                  # paged_attention: (B, Tq)
        i = np.arange(p.shape[1])[None, :]
        bad = np.argwhere((p < -1) | (p >= i))
        if bad.size:
            b, i = (int(x) for x in bad[0])
            raise ValueError(f"{fn}: draft_parents[{b}, {i}] = {p[b, i]} is not a parent of new "
                             f"token {i} of sequence {b}: " + _tree_rule(i))
        return
    loc = np.asarray(query_start_loc).astype(np.int64).reshape(-1)
    T, S = p.shape[0], loc.shape[0] - 1
    loc = np.maximum.accumulate(np.clip(loc, 0, T))
    n = int(np.clip(np.asarray(num_seqs).reshape(-1)[0], 0, S))
    for seq in range(n):
        lo, hi = int(loc[seq]), int(loc[seq + 1])
        row = np.arange(hi - lo)
        bad = np.flatnonzero((p[lo:hi] < -1) | (p[lo:hi] >= row))
        if bad.size:
            r = int(bad[0])
            raise ValueError(
                f"{fn}: draft_parents[{lo + r}] = {p[lo + r]} is not a parent of token {lo + r} "
                f"(new token {r} of sequence {seq}, whose new tokens are packed rows {lo} to "
                f"{hi - 1}): " + _tree_rule(r))


def _check_parents_shape(fn, parents, shape, what):
    if parents is not None:
        _check_int(fn, "draft_parents", parents, shape, what)


def _ragged_precheck(fn):
    def check(a):
        p, loc, q, n = (a.get(k) for k in ("draft_parents", "query_start_loc", "q", "num_seqs"))
        if p is None or loc is None or n is None or not _concrete(p, loc, n):
            return
        # (wrong shapes are reported by the function itself)
        if np.shape(p) != np.shape(q)[:1] or np.ndim(loc) != 1 or np.shape(n) not in ((), (1,)):
            return
        _check_tree_values(fn, p, loc, n)
    return check


def _paged_precheck(a):
    p = a.get("draft_parents")
    if p is not None and _concrete(p) and np.ndim(p) == 2:
        _check_tree_values("paged_attention", p)


def run(spec, q, k_pages, v_pages, meta_args, cfg, *, table=None, new_k=None, new_v=None,
        parents=None):
    """Sanitises the metadata and dispatches (``table`` overrides ``spec.impl``'s)."""
    if cfg.tree and table is not None and any(
            f not in (xla.forward, _reference_forward) for _, f in table):
        tree_table("pallas")   # a kernel's table: refused (NotImplementedError)
    sizes = traced_sizes(spec.mask)
    if sizes and table is not None and any(
            f not in (xla.forward, _reference_forward) for _, f in table):
        traced_sizes_table("pallas")   # a kernel's table: refused (NotImplementedError)
    if table is None:
        if sizes:
            table = traced_sizes_table(spec.impl)
        elif cfg.tree:
            table = tree_table(spec.impl)
        elif cfg.value_dim is not None:
            table = quantized_table(spec.impl, "latent pools (value_dim, no v_pages)")
        elif quant.is_quantized(k_pages) or quant.is_quantized(v_pages):
            table = quantized_table(spec.impl)
        else:
            table = lowering_table(spec.impl)
    meta = common.sanitize(cfg, *meta_args)
    if parents is not None:
        meta = meta._replace(parents=parents.astype(I32))
    if sizes:
        meta = meta._replace(sizes=tuple(jnp.asarray(x, I32)
                                         for x in jax.tree_util.tree_leaves(spec.mask)))
    if spec.position_bias is not None:
        # the term's arrays, one value per head; constants (a tangent raises)
        arrays = position_bias.per_head_arrays(spec.position_bias, 1, cfg.num_q_heads)
        if arrays is not None:
            meta = meta._replace(terms=arrays[:, 0])
    if cfg.update:
        return _attend_update(table, cfg, q, k_pages, v_pages, spec.sinks, meta, new_k, new_v)
    # inside shard_map: gradients typed like their inputs (see fnattn._dispatch.attend)
    q, k_pages, v_pages, sinks = varying_like((q, k_pages, v_pages, spec.sinks), q, k_pages,
                                              v_pages, spec.sinks, meta)
    stored = quant.is_quantized(k_pages) or quant.is_quantized(v_pages)
    return (_attend_stored if stored else _attend)(table, cfg, q, k_pages, v_pages, sinks, meta)


@_checks.entry_point("fnattn.paged_attention",
                     ints=("page_table", "kv_lengths", "draft_parents"),
                     precheck=_paged_precheck)
@jaxtyped(typechecker=beartype)
def paged_attention(spec: AttentionSpec, q: Shaped[Array, "..."], k_pages: quant.Cache,
                    v_pages: Optional[quant.Cache], *, page_table: Shaped[Array, "..."],
                    kv_lengths: Shaped[Array, "..."],
                    draft_parents: Optional[Shaped[Array, "..."]] = None,
                    value_dim: Optional[int] = None,
                    checked: bool = False) -> AttentionOutput:
    """Decode: a few new query tokens per sequence against a paged KV cache.

    Args:
      spec: the :class:`AttentionSpec` (mask, scale, softcap, sinks, impl,
        block_sizes as :class:`fnattn.PagedBlockSizes`, a position term whose
        arrays are per head such as ALiBi; no bias, no dropout; window and
        chunk sizes may be int32 scalars, run with the XLA lowering:
        :func:`traced_sizes_table`).
      q: (B, Tq, Hq, D) ("bthd") or (B, Hq, Tq, D) ("bhtd"): the Tq newest
        tokens of each sequence (Tq is small: 1 for decode, a few for
        speculative decoding).
      k_pages: the pool of keys, (Hkv, num_pages, page_size, D); Hq must be a
        multiple of Hkv.
      v_pages: the pool of values, (Hkv, num_pages, page_size, Dv).
      page_table: (B, max_pages_per_seq) int32: pool page of each logical page.
      kv_lengths: (B,) int: keys of each sequence, the Tq new ones included
        (they must already be in the pool). This and ``page_table`` may be
        Python lists or NumPy arrays (converted with ``jnp.asarray``).
      draft_parents: (B, Tq) int, speculative tree verification: the Tq new
        tokens of sequence ``b`` form a tree, ``draft_parents[b, i]`` the index
        of token i's parent among them (``0 <= parent < i``) or -1 for a root
        (attached to the context). Each new token then sees the whole context
        and, among the new tokens, its ancestors and itself only, at position
        ``kv_lengths[b] - Tq + depth`` (:mod:`fnattn.paged.tree`,
        :func:`fnattn.draft_positions`). Runs with the XLA lowering.
      value_dim: a latent pool (multi-head latent attention): ``v_pages`` is
        None and the values are the first ``value_dim`` channels of ``k_pages``.
      checked: also report bad run-time values with ``checkify`` (wrap the call
        in ``checkify.checkify``); see :func:`check_inputs`.

    Returns:
      :class:`AttentionOutput` with ``out`` like q with head dim Dv, ``lse``
      (B, Hq, Tq) float32. Query ``i`` of sequence ``b`` is at position
      ``kv_lengths[b] - Tq + i``.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> cache = fnattn.PagedKVCache.create(num_pages=8, page_size=4, num_kv_heads=2,
    ...                                    head_dim=16, max_seqs=2, max_pages_per_seq=3)
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 2, 7, 2, 16))  # seq, token, Hkv, D
    >>> slots = jnp.repeat(jnp.arange(2), 7)                             # 7 tokens per slot
    >>> cache = cache.append(slots, k.reshape(14, 2, 16), v.reshape(14, 2, 16))
    >>> q = jax.random.normal(jax.random.key(1), (2, 1, 4, 16))
    >>> spec = AttentionSpec(mask=masks.causal())
    >>> res = jax.jit(fnattn.paged_attention)(spec, q, cache.k_pages, cache.v_pages,
    ...                                       page_table=cache.page_table,
    ...                                       kv_lengths=cache.lengths)
    >>> ref = fnattn.reference(spec, q, k, v)                   # the dense problem
    >>> bool(jnp.allclose(res.out, ref.out, atol=1e-5)), res.lse.shape
    (True, (2, 4, 1))
    """
    return paged_attention_with(None, spec, q, k_pages, v_pages, page_table=page_table,
                                kv_lengths=kv_lengths, draft_parents=draft_parents,
                                value_dim=value_dim, checked=checked)


def paged_attention_with(table, spec, q, k_pages, v_pages, *, page_table, kv_lengths,
                         draft_parents=None, value_dim=None, checked=False):
    """:func:`paged_attention` with an explicit lowering table (None: ``spec.impl``'s)."""
    fn = "paged_attention"
    _checks.check_float(f"{fn}: q", q)
    refuse_float64(fn, q=q, k_pages=k_pages, v_pages=v_pages)
    if q.ndim != 4:
        want = "(B, Tq, Hq, D)" if spec.layout == "bthd" else "(B, Hq, Tq, D)"
        raise ValueError(f"{fn}: q must have 4 axes {want} for layout {spec.layout!r}; "
                         f"got shape {_shape(q)}")
    qb = _checks.to_bthd(q, spec.layout)
    B, Tq, Hq, D = qb.shape
    if 0 in qb.shape:
        raise ValueError(f"{fn}: q must have no empty axis; got shape {_shape(q)}")
    v_like = _latent.values(fn, k_pages, v_pages, value_dim, q, k_name="k_pages",
                            v_name="v_pages")
    Hkv, N, ps, Dv = _check_pools(fn, Hq, D, q.dtype, k_pages, v_like, _shape(q),
                                  layout=spec.layout,
                                  other_q_heads=q.shape[1 if spec.layout == "bthd" else 2])
    if page_table.ndim != 2 or page_table.shape[0] != B:
        raise ValueError(f"{fn}: page_table must have shape (B, max_pages_per_seq) with B={B} "
                         f"from q {_shape(q)}; got {_shape(page_table)}")
    _check_int(fn, "page_table", page_table, _shape(page_table), "(B, max_pages_per_seq)")
    _check_int(fn, "kv_lengths", kv_lengths, (B,), "(B,)")
    _check_parents_shape(fn, draft_parents, (B, Tq), "(B, Tq) from q")
    _check_tree_values(fn, draft_parents)
    _check_spec(fn, spec, Hq)
    cfg = _make_cfg(spec, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, v_head_dim=Dv,
                    num_pages=N, page_size=ps, pages_per_seq=page_table.shape[1], max_seqs=B,
                    total_tokens=B * Tq, uniform_q=Tq, update=False, value_dim=value_dim,
                    tree=draft_parents is not None)
    if checked:
        quant.check_pool_scales(k_pages=k_pages, v_pages=v_pages)
        check_inputs(k_pages, page_table=page_table, context_lengths=kv_lengths,
                     new_tokens=Tq, draft_parents=draft_parents)
    loc = jnp.arange(B + 1, dtype=I32) * Tq
    out, lse = run(spec, qb.reshape(B * Tq, Hq, D), k_pages, v_pages,
                   (page_table, kv_lengths, loc, jnp.int32(B)), cfg, table=table,
                   parents=None if draft_parents is None else draft_parents.reshape(-1))
    out = _checks.from_bthd(out.reshape(B, Tq, Hq, Dv), spec.layout)
    lse = lse.reshape(Hq, B, Tq).transpose(1, 0, 2)
    return AttentionOutput(out, lse if spec.return_lse else None)


def _ragged_checks(fn, spec, q, k_pages, v_pages, page_table, context_lengths,
                   query_start_loc, num_seqs, value_dim=None, draft_parents=None, **new_kv):
    _checks.check_float(f"{fn}: q", q)
    refuse_float64(fn, q=q, **new_kv, k_pages=k_pages, v_pages=v_pages)
    if spec.layout != "bthd":
        raise ValueError(f"{fn}: q is packed (total_tokens, Hq, D); spec.layout must be "
                         f"'bthd'; got {spec.layout!r}")
    if q.ndim != 3 or 0 in q.shape:
        raise ValueError(f"{fn}: q must have shape (total_tokens, Hq, D) with no empty axis; "
                         f"got {_shape(q)}")
    T, Hq, D = q.shape
    v_like = _latent.values(fn, k_pages, v_pages, value_dim, q, k_name="k_pages",
                            v_name="v_pages")
    Hkv, N, ps, Dv = _check_pools(fn, Hq, D, q.dtype, k_pages, v_like, _shape(q))
    if page_table.ndim != 2:
        raise ValueError(f"{fn}: page_table must have shape (max_seqs, max_pages_per_seq); "
                         f"got {_shape(page_table)}")
    S, P = page_table.shape
    _check_int(fn, "page_table", page_table, (S, P), "(max_seqs, max_pages_per_seq)")
    _check_int(fn, "context_lengths", context_lengths, (S,),
               f"(max_seqs,) with max_seqs from page_table {_shape(page_table)}")
    _check_int(fn, "query_start_loc", query_start_loc, (S + 1,),
               f"(max_seqs + 1,) with max_seqs from page_table {_shape(page_table)}")
    if not hasattr(num_seqs, "dtype") or not jnp.issubdtype(num_seqs.dtype, jnp.integer) \
            or _shape(num_seqs) not in ((), (1,)):
        raise TypeError(f"{fn}: num_seqs must be an int32 scalar or (1,) array; got "
                        f"{getattr(num_seqs, 'dtype', type(num_seqs).__name__)} "
                        f"{_shape(num_seqs)}")
    _check_parents_shape(fn, draft_parents, (T,), f"(total_tokens,) from q {_shape(q)}")
    _check_tree_values(fn, draft_parents, query_start_loc, num_seqs)
    _check_spec(fn, spec, Hq)
    return T, Hq, D, Hkv, N, ps, Dv, S, P


@_checks.entry_point("fnattn.ragged_paged_attention", ints=_META,
                     precheck=_ragged_precheck("ragged_paged_attention"))
@jaxtyped(typechecker=beartype)
def ragged_paged_attention(spec: AttentionSpec, q: Shaped[Array, "..."],
                           k_pages: quant.Cache, v_pages: Optional[quant.Cache], *,
                           page_table: Shaped[Array, "..."],
                           context_lengths: Shaped[Array, "..."],
                           query_start_loc: Shaped[Array, "..."],
                           num_seqs: Shaped[Array, "..."],
                           draft_parents: Optional[Shaped[Array, "..."]] = None,
                           value_dim: Optional[int] = None,
                           checked: bool = False) -> AttentionOutput:
    """A mixed batch of prefill and decode sequences over a paged KV cache.

    Sequence ``s < num_seqs`` owns the packed query rows
    ``query_start_loc[s] .. query_start_loc[s + 1] - 1``: its ``n`` newest
    tokens, at positions ``context_lengths[s] - n .. context_lengths[s] - 1``.
    Their keys and values must already be in the pool (see
    :func:`ragged_paged_attention_with_update` for the form that writes them).
    For causal prefill and decode use ``AttentionSpec(mask=masks.causal())``
    (optionally ``& masks.sliding_window(...)``); ``mask=None`` is full
    attention over each sequence's context.

    Args:
      spec: the :class:`AttentionSpec` (as for :func:`paged_attention`; layout
        must be "bthd").
      q: (total_tokens, Hq, D), the new tokens of every sequence, packed.
      k_pages: (Hkv, num_pages, page_size, D).
      v_pages: (Hkv, num_pages, page_size, Dv).
      page_table: (max_seqs, max_pages_per_seq) int32.
      context_lengths: (max_seqs,) int32, all tokens of each sequence.
      query_start_loc: (max_seqs + 1,) int32 cumulative token offsets.
      num_seqs: int32 scalar or (1,) array: live sequences (the rest are padding).
        The metadata arguments may be Python lists (or ints) or NumPy arrays
        (converted with ``jnp.asarray``).
      draft_parents: (total_tokens,) int, speculative tree verification: the
        new tokens of each sequence form a tree, entry ``t`` the index of
        token t's parent among its sequence's new tokens (``0 <= parent <
        row``, row = ``t - query_start_loc[s]``) or -1 for a root (attached to
        the context). Each new token sees the sequence's whole context
        (``context_lengths[s] - n`` tokens) and, among the new tokens, its
        ancestors and itself only, at position ``context - n + depth``
        (:mod:`fnattn.paged.tree`, :func:`fnattn.draft_positions`); a chain
        ``-1, 0, 1, ...`` is causal prefill, ``-1`` alone a decode token.
        Runs with the XLA lowering (see docs/serving.md).
      value_dim: a latent pool (multi-head latent attention): ``v_pages`` is
        None and the values are the first ``value_dim`` channels of ``k_pages``
        (no second pool, no copy; see docs/serving.md).
      checked: report bad run-time values with ``checkify`` (:func:`check_inputs`).

    Returns:
      :class:`AttentionOutput` with ``out`` (total_tokens, Hq, Dv) and ``lse``
      (Hq, total_tokens) float32. Rows that belong to no live sequence are 0
      (``lse = -inf``).

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> cache = fnattn.PagedKVCache.create(num_pages=8, page_size=4, num_kv_heads=1,
    ...                                    head_dim=8, max_seqs=2, max_pages_per_seq=4)
    >>> k = v = jax.random.normal(jax.random.key(0), (6, 1, 8))
    >>> cache = cache.append(jnp.array([0, 1, 1, 1, 1, 1]), k, v)  # seq 0: 1, seq 1: 5 tokens
    >>> q = jax.random.normal(jax.random.key(1), (6, 2, 8))
    >>> res = jax.jit(fnattn.ragged_paged_attention)(
    ...     AttentionSpec(mask=masks.causal()), q, cache.k_pages, cache.v_pages,
    ...     page_table=cache.page_table, context_lengths=cache.lengths,
    ...     query_start_loc=jnp.array([0, 1, 6]), num_seqs=jnp.int32(2))
    >>> res.out.shape, res.lse.shape
    ((6, 2, 8), (2, 6))
    """
    return ragged_paged_attention_with(
        None, spec, q, k_pages, v_pages, page_table=page_table, context_lengths=context_lengths,
        query_start_loc=query_start_loc, num_seqs=num_seqs, draft_parents=draft_parents,
        value_dim=value_dim, checked=checked)


def ragged_paged_attention_with(table, spec, q, k_pages, v_pages, *, page_table,
                                context_lengths, query_start_loc, num_seqs, draft_parents=None,
                                value_dim=None, checked=False):
    """:func:`ragged_paged_attention` with an explicit lowering table."""
    fn = "ragged_paged_attention"
    T, Hq, D, Hkv, N, ps, Dv, S, P = _ragged_checks(
        fn, spec, q, k_pages, v_pages, page_table, context_lengths, query_start_loc, num_seqs,
        value_dim, draft_parents)
    cfg = _make_cfg(spec, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, v_head_dim=Dv,
                    num_pages=N, page_size=ps, pages_per_seq=P, max_seqs=S, total_tokens=T,
                    uniform_q=None, update=False, value_dim=value_dim,
                    tree=draft_parents is not None)
    if checked:
        quant.check_pool_scales(k_pages=k_pages, v_pages=v_pages)
        check_inputs(k_pages, page_table=page_table, context_lengths=context_lengths,
                     query_start_loc=query_start_loc, num_seqs=num_seqs, total_tokens=T,
                     draft_parents=draft_parents)
    out, lse = run(spec, q, k_pages, v_pages,
                   (page_table, context_lengths, query_start_loc, num_seqs), cfg, table=table,
                   parents=draft_parents)
    return AttentionOutput(out, lse if spec.return_lse else None)


@_checks.entry_point("fnattn.ragged_paged_attention_with_update", ints=_META,
                     precheck=_ragged_precheck("ragged_paged_attention_with_update"))
@jaxtyped(typechecker=beartype)
def ragged_paged_attention_with_update(
        spec: AttentionSpec, q: Shaped[Array, "..."], k: Shaped[Array, "..."],
        v: Optional[Shaped[Array, "..."]], k_pages: quant.Cache,
        v_pages: Optional[quant.Cache], *, page_table: Shaped[Array, "..."],
        context_lengths: Shaped[Array, "..."], query_start_loc: Shaped[Array, "..."],
        num_seqs: Shaped[Array, "..."], draft_parents: Optional[Shaped[Array, "..."]] = None,
        value_dim: Optional[int] = None, checked: bool = False):
    """:func:`ragged_paged_attention` that first writes the new tokens' k/v into the cache.

    Token row ``t`` of sequence ``s`` (``n`` new tokens, context ``L``) is at
    position ``pos = L - n + (t - query_start_loc[s])`` and goes to page
    ``page_table[s, pos // page_size]``, offset ``pos % page_size``. Writes to
    invalid slots (a page entry outside the pool, a negative position, padding
    tokens and sequences) are dropped. The attention then sees the updated
    cache: the result equals writing first and calling
    :func:`ragged_paged_attention`.

    The pools are inputs and outputs (functional); donate them
    (``jax.jit(..., donate_argnums=...)``) and the update is in place: the
    Pallas kernels alias them to their outputs (``input_output_aliases``).
    On GPUs the Triton kernel writes the new tokens *inside* the attention
    kernel and reads them from ``k``/``v`` rather than from the pool, so there
    is no second pass. Not differentiable. The arguments past ``v`` are those
    of :func:`ragged_paged_attention`.

    Args:
      q: (total_tokens, Hq, D).
      k: (total_tokens, Hkv, D), the new tokens' keys.
      v: (total_tokens, Hkv, Dv), the new tokens' values (None for a latent pool,
        ``value_dim``: ``k`` holds the latent and rope channels).

    Returns:
      ``(AttentionOutput, k_pages, v_pages)`` with the updated pools.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> kp, vp = jnp.zeros((2, 1, 4, 2, 8))                # 4 pages of 2 slots each
    >>> q = k = v = jnp.ones((3, 1, 8))                    # 3 new tokens of one sequence
    >>> f = jax.jit(fnattn.ragged_paged_attention_with_update, donate_argnums=(4, 5))
    >>> res, kp, vp = f(AttentionSpec(mask=masks.causal()), q, k, v, kp, vp,
    ...                 page_table=jnp.array([[2, 0]]), context_lengths=jnp.array([3]),
    ...                 query_start_loc=jnp.array([0, 3]), num_seqs=jnp.int32(1))
    >>> kp[0, :, :, 0].tolist()                            # positions 0, 1 -> page 2; 2 -> page 0
    [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    """
    return ragged_paged_attention_with_update_with(
        None, spec, q, k, v, k_pages, v_pages, page_table=page_table,
        context_lengths=context_lengths, query_start_loc=query_start_loc, num_seqs=num_seqs,
        draft_parents=draft_parents, value_dim=value_dim, checked=checked)


def _new_tokens(x, pool):
    """New tokens as the pool stores them: cast to a float pool's dtype; kept in
    float for a quantized pool, whose write quantizes them (fnattn.quant.write)."""
    if x is None or quant.is_quantized(pool):
        return x
    return x.astype(pool.dtype)


def ragged_paged_attention_with_update_with(table, spec, q, k, v, k_pages, v_pages, *,
                                            page_table, context_lengths, query_start_loc,
                                            num_seqs, draft_parents=None, value_dim=None,
                                            checked=False):
    """:func:`ragged_paged_attention_with_update` with an explicit lowering table."""
    fn = "ragged_paged_attention_with_update"
    if value_dim is not None and v is not None:
        raise ValueError(f"{fn}: a latent pool (value_dim={value_dim}) has no separate values: "
                         "pass v=None (k holds the latent and rope channels)")
    T, Hq, D, Hkv, N, ps, Dv, S, P = _ragged_checks(
        fn, spec, q, k_pages, v_pages, page_table, context_lengths, query_start_loc, num_seqs,
        value_dim, draft_parents, k=k, v=v)
    news = (("k", k, (T, Hkv, D)), ("v", v, (T, Hkv, Dv)))
    for name, x, want in news[:1 if v is None else 2]:
        _checks.check_float(f"{fn}: {name}", x)
        if _shape(x) != want:
            raise ValueError(f"{fn}: {name} must have shape (total_tokens, Hkv, "
                             f"{'D' if name == 'k' else 'Dv'})={want} from q {_shape(q)} and "
                             f"the pools; got {_shape(x)}")
    cfg = _make_cfg(spec, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, v_head_dim=Dv,
                    num_pages=N, page_size=ps, pages_per_seq=P, max_seqs=S, total_tokens=T,
                    uniform_q=None, update=True, value_dim=value_dim,
                    tree=draft_parents is not None)
    if checked:
        quant.check_pool_scales(k_pages=k_pages, v_pages=v_pages)
        check_inputs(k_pages, page_table=page_table, context_lengths=context_lengths,
                     query_start_loc=query_start_loc, num_seqs=num_seqs, total_tokens=T,
                     draft_parents=draft_parents)
    out, lse, k_pages, v_pages = run(
        spec, q, k_pages, v_pages, (page_table, context_lengths, query_start_loc, num_seqs),
        cfg, table=table, new_k=_new_tokens(k, k_pages), new_v=_new_tokens(v, v_pages),
        parents=draft_parents)
    return AttentionOutput(out, lse if spec.return_lse else None), k_pages, v_pages
