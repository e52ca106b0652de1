"""``fnattn.decode``: a few query tokens per sequence against a contiguous KV cache.

The cache holds ``S`` slots per sequence; sequence ``b`` owns the slots
``[kv_starts[b], kv_starts[b] + kv_lengths[b])``, the ``Tq`` new tokens
included (they must already be written, as in every serving loop). Positions
are logical: the key in slot ``kv_starts[b] + j`` is at position ``j`` and
query ``i`` at position ``kv_lengths[b] - Tq + i``, so the spec's positional
mask (``causal()``, ``sliding_window``, ``chunked``, their combinations,
``from_fn``) means exactly what it means in dense attention over the
sequence's tokens: the result equals :func:`fnattn.reference` on q and the
``kv_lengths[b]`` valid keys. Slots outside the valid range are never seen;
a sequence of length 0 gives zeros and ``lse = -inf``.

**Split-K.** The cache is cut into ``num_splits`` contiguous ranges whose
partial results (out, lse) are computed independently (in parallel) and
combined exactly by the merge of :mod:`fnattn.merging`. With few sequences and
long contexts this is what keeps every core (or every GPU multiprocessor)
busy. ``AttentionSpec(block_sizes=DecodeBlockSizes(num_splits=...))`` sets it;
otherwise each lowering picks its own: the XLA lowering two ranges
(:func:`fnattn.decoding.xla.choose`), the Triton kernel enough (sequence, kv
head, split) programs to fill the GPU (:func:`fnattn.decoding.triton.launch_plan`),
the Mosaic kernel one.

**Lowerings**, chosen per platform (:func:`fnattn._dispatch.select`) inside one
``jax.custom_jvp`` (whose tangent and backward are ``jax.jvp`` and ``jax.vjp``
of the XLA lowering, so ``decode`` is differentiable, in either mode and to any
order, with respect to q, the caches and the sinks on every platform):

========  =========================================  ==========================
platform  impl="auto"                                impl="pallas"
========  =========================================  ==========================
cuda      Pallas Triton (fnattn/decoding/triton.py)  the same
tpu       Pallas Mosaic (fnattn/decoding/mosaic.py)  the same
other     XLA (fnattn/decoding/xla.py)               Triton kernel, interpreted
========  =========================================  ==========================

On a Hopper GPU, a spec whose block sizes include
:class:`fnattn.decoding.mosaic_gpu.MosaicGpuDecodeBlockSizes` runs the Pallas
Mosaic GPU kernel (fnattn/decoding/mosaic_gpu.py) under either impl instead
(:func:`fnattn.decoding.mosaic_gpu.gpu_forward`); it has not been timed on a
GPU yet, so it is not the default.

**Quantized and latent caches** (:mod:`fnattn.quant` ``QuantizedArray``
caches; ``value_dim`` with no ``v_cache``): the Pallas kernels dequantize each
tile of codes right after loading it (per-token scales loaded beside it; the
4-bit format's nibbles unpacked in the kernel) and take a latent cache's
values from the key tile they loaded (:func:`quantized_table`): Triton reads
every format on cuda, Mosaic every format its jax version loads on tpu (else
``impl="auto"`` runs the XLA lowering there). Elsewhere ``impl="auto"`` runs
the XLA lowering, which reads a quantized cache a chunk of slots at a time,
its codes converted to q's dtype for the products and its scales applied to
the logits and the probabilities.
No dequantized copy of a cache is made. Derivatives of quantized caches are
reverse mode only.

``impl="xla"`` is the XLA lowering everywhere. On TPU, ``impl="auto"`` reads
float16 caches with the XLA lowering (the kernel would first copy them to
float32). float64 inputs are refused at trace time (``TypeError``): every
lowering computes in float32; cast them.

**Bad run-time values** (a length past the cache, a negative start) are
clipped to the cache (``0 <= start``, ``start + length <= S``), never read out
of bounds; ``checked=True`` reports them as ``jax.experimental.checkify``
errors (:func:`check_inputs`). Cache slots outside a sequence's range may hold
anything, NaN included: they contribute nothing to its result or gradients.

The XLA lowering reads every cached key once: decode is bound by memory
bandwidth, and XLA fuses the products, softmax and split merge into a few
passes over the cache.
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

from fnattn import (_checks, _dispatch, _latent, _linear, _partition, _serving, position_bias,
                    quant)
from fnattn._varying import varying_like
from fnattn.decoding import xla
from fnattn.decoding.common import Cfg, DecodeBlockSizes  # (re-exported: their home is common)
from fnattn.flash import blocks
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["Cfg", "DecodeBlockSizes", "check_inputs", "decode", "lowering_table",
           "quantized_table", "traced_sizes_table"]

I32 = jnp.int32


def _given_splits(spec, S) -> Optional[int]:
    """``DecodeBlockSizes.num_splits`` from the spec (validated), or None."""
    b = blocks.pick(spec.block_sizes, DecodeBlockSizes, None)
    if b is None or b.num_splits is None:
        return None
    if S % b.num_splits:
        raise ValueError(f"decode: DecodeBlockSizes(num_splits={b.num_splits}) must "
                         f"divide the cache length S={S}")
    return b.num_splits


def _logical(fn, name, x, q):
    """A quantized cache, checked, as the float array it stands for (shape and
    q's dtype) for the checks of float caches."""
    if not quant.is_quantized(x):
        return x
    quant.check(fn, name, x)
    return jax.ShapeDtypeStruct(x.shape, getattr(q, "dtype", jnp.float32))


def _to_bthd(x, layout):
    if quant.is_quantized(x):
        return x if layout == "bthd" else x.swapaxes(1, 2)
    return _checks.to_bthd(x, layout)


def _check(spec, q, k_cache, v_cache, kv_lengths, kv_starts, value_dim=None, fn="decode"):
    v_like = _latent.values(fn, k_cache, v_cache, value_dim, q, k_name="k_cache",
                            v_name="v_cache")
    dims = _checks.check_qkv(q, _logical(fn, "k_cache", k_cache, q),
                             _logical(fn, "v_cache", v_like, q), spec.layout, fn=fn)
    _serving.refuse_float64(fn, q=q, k_cache=k_cache, v_cache=v_cache)
    B = dims.batch
    for name, x in (("kv_lengths", kv_lengths), ("kv_starts", kv_starts)):
        if x is None:
            continue
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{fn}: {name} must be an integer array; got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if tuple(jnp.shape(x)) != (B,):
            raise ValueError(f"{fn}: {name} must have shape (B,)=({B},), one per sequence "
                             f"of q {tuple(q.shape)}; got {tuple(jnp.shape(x))}")
    if spec.position_bias is not None:
        position_bias.check_serving(
            fn, spec.position_bias, (dims.batch, dims.num_q_heads, dims.q_len, dims.kv_len),
            per_batch=True, what="decode")
    if spec.bias is not None:
        raise NotImplementedError(f"{fn}: spec.bias is not supported by decode; "
                                  "fnattn.attention and fnattn.flash take a bias.")
    if spec.dropout_rate > 0:
        raise NotImplementedError(f"{fn}: dropout is not supported by decode (an inference "
                                  "variant); fnattn.attention and fnattn.flash support it.")
    if _serving.traced_sizes(spec.mask):   # window / chunk sizes as data: XLA lowering
        spec.mask.validate(B, dims.num_q_heads, dims.q_len, dims.kv_len)
    elif spec.mask is not None and jax.tree_util.tree_leaves(spec.mask):
        raise NotImplementedError(
            f"{fn}: masks that hold arrays ({spec.mask!r}) are not supported by decode; use "
            "positional masks (causal, sliding_window, chunked, their combinations, "
            "from_fn), whose window and chunk sizes may be arrays (one per layer inside "
            "lax.scan). kv_lengths and kv_starts already say which keys exist.")
    if spec.sinks is not None:
        _checks.check_float(f"{fn}: sinks", spec.sinks)
        if tuple(spec.sinks.shape) != (dims.num_q_heads,):
            raise ValueError(f"{fn}: sinks must have shape (Hq,)=({dims.num_q_heads},), one "
                             f"logit per query head; got {tuple(spec.sinks.shape)}")
    return dims


def check_inputs(cache_len: int, new_tokens: int, kv_lengths, kv_starts=None) -> None:
    """Reports the run-time values that :func:`decode` would clip, as
    ``jax.experimental.checkify`` errors.

    ``decode`` never reads outside the cache whatever these values are (it clips
    them: ``0 <= start <= S``, ``0 <= length <= S - start``); this says *that* a
    value was wrong. Call it inside a function transformed by
    ``checkify.checkify`` (or pass ``checked=True`` to :func:`decode`, which calls
    it with the cache length ``S`` and the ``Tq`` new tokens).

    Checks, for every sequence ``b``: ``kv_lengths[b] >= 0``; ``0 <= kv_starts[b]
    <= S``; ``kv_starts[b] + kv_lengths[b] <= S``; and ``kv_lengths[b]`` is 0 (an
    empty sequence) or at least ``Tq`` (the length includes the new tokens).

    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import checkify
    >>> from fnattn.decoding.api import check_inputs
    >>> f = lambda lengths, starts: check_inputs(16, 1, lengths, starts)
    >>> err, _ = jax.jit(checkify.checkify(f))(jnp.array([4, 9]), jnp.array([0, 10]))
    >>> print(err.get())  # doctest: +ELLIPSIS
    kv_starts[1] + kv_lengths[1] = 10 + 9 is past the cache's S=16 slots...
    """
    S = cache_len
    lengths = kv_lengths.astype(I32)
    B = lengths.shape[0]
    starts = jnp.zeros((B,), I32) if kv_starts is None else kv_starts.astype(I32)
    neg = lengths < 0
    b = jnp.argmax(neg)
    checkify.check(~neg.any(), "kv_lengths[{b}] = {x} is negative", b=b, x=lengths[b])
    if kv_starts is not None:
        out = (starts < 0) | (starts > S)
        b = jnp.argmax(out)
        checkify.check(~out.any(), "kv_starts[{b}] = {x} is outside the cache [0, S={S}]",
                       b=b, x=starts[b], S=jnp.int32(S))
    past = (starts >= 0) & (starts <= S) & (lengths > S - starts)  # (no int32 overflow)
    b = jnp.argmax(past)
    checkify.check(~past.any(), "kv_starts[{b}] + kv_lengths[{b}] = {a} + {x} is past the "
                   "cache's S={S} slots", b=b, a=starts[b], x=lengths[b], S=jnp.int32(S))
    short = (lengths > 0) & (lengths < new_tokens)
    b = jnp.argmax(short)
    checkify.check(~short.any(), "kv_lengths[{b}] = {x} is less than the Tq={n} new tokens "
                   "(the length includes them; 0 marks an empty sequence)", b=b, x=lengths[b],
                   n=jnp.int32(new_tokens))


@_checks.entry_point("fnattn.decode", ints=("kv_lengths", "kv_starts"))
@jaxtyped(typechecker=beartype)
def decode(spec: AttentionSpec, q: Shaped[Array, "..."], k_cache: quant.Cache,
           v_cache: Optional[quant.Cache], *, kv_lengths: Shaped[Array, "..."],
           kv_starts: Optional[Shaped[Array, "..."]] = None,
           value_dim: Optional[int] = None, checked: bool = False) -> AttentionOutput:
    """Attention of the newest ``Tq`` tokens of each sequence over its cached keys.

    Args:
      spec: the :class:`AttentionSpec` (mask, scale, softcap, sinks, layout,
        ``block_sizes=DecodeBlockSizes(...)``, a position term whose arrays
        are per batch row and head such as ALiBi; no bias, no dropout, no
        masks that hold arrays but window and chunk sizes, () or (B,), which
        run with the XLA lowering: :func:`traced_sizes_table`).
      q: (B, Tq, Hq, D) in "bthd" or (B, Hq, Tq, D) in "bhtd" (Tq small: 1 for
        plain decoding, a few for speculative decoding).
      k_cache: (B, S, Hkv, D) or (B, Hkv, S, D); Hq a multiple of Hkv.
      v_cache: (B, S, Hkv, Dv) or (B, Hkv, S, Dv).
      kv_lengths: (B,) int, valid keys of each sequence (new tokens included).
        Values are clipped to the cache: ``0 <= start``, ``start + length <= S``.
        This and ``kv_starts`` may be Python lists or NumPy arrays (converted
        with ``jnp.asarray``).
      kv_starts: (B,) int, first valid slot of each sequence (default 0).
      value_dim: a latent cache (multi-head latent attention): ``v_cache`` is
        None and the values are the first ``value_dim`` channels of
        ``k_cache`` (no second cache, no copy); see docs/serving.md.
      checked: also report the values that would be clipped (and lengths below
        Tq) with ``checkify``: wrap the call in ``checkify.checkify``; see
        :func:`check_inputs`.

    Returns:
      :class:`AttentionOutput` with ``out`` like q with head dim Dv, ``lse``
      (B, Hq, Tq) float32.

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> k = v = jax.random.normal(jax.random.key(0), (2, 64, 2, 16))   # cache of 64 slots
    >>> q = jax.random.normal(jax.random.key(1), (2, 1, 8, 16))        # one new token
    >>> spec = AttentionSpec(mask=masks.causal())
    >>> res = jax.jit(fnattn.decode)(spec, q, k, v, kv_lengths=jnp.array([40, 9]))
    >>> ref = fnattn.reference(spec, q[1:], k[1:, :9], v[1:, :9])      # sequence 1's 9 keys
    >>> bool(jnp.allclose(res.out[1:], ref.out, atol=1e-5)), res.lse.shape
    (True, (2, 8, 1))

    With ``checked=True`` a length past the cache is reported instead of clipped:

    >>> from jax.experimental import checkify
    >>> f = checkify.checkify(lambda q, k, v, L: fnattn.decode(spec, q, k, v, kv_lengths=L,
    ...                                                         checked=True))
    >>> err, res = jax.jit(f)(q, k, v, jnp.array([40, 70]))
    >>> print(err.get())  # doctest: +ELLIPSIS
    kv_starts[1] + kv_lengths[1] = 0 + 70 is past the cache's S=64 slots...
    """
    dims = _check(spec, q, k_cache, v_cache, kv_lengths, kv_starts, value_dim)
    B, _, S, _, Hkv, D, _ = dims
    qb, kb = (_to_bthd(x, spec.layout) for x in (q, k_cache))
    vb = None if v_cache is None else _to_bthd(v_cache, spec.layout)
    scale = _checks.resolve_scale(spec, D)
    ns = _given_splits(spec, S)
    if checked:
        quant.check_pool_scales(k_cache=k_cache, v_cache=v_cache)
        check_inputs(S, qb.shape[1], kv_lengths, kv_starts)
    starts = jnp.zeros((B,), I32) if kv_starts is None else kv_starts.astype(I32)
    starts = jnp.clip(starts, 0, S)
    lengths = jnp.clip(kv_lengths.astype(I32), 0, S - starts)
    term, terms = spec.position_bias, None
    if term is not None:   # its arrays: constants (a tangent raises)
        terms = position_bias.per_head_arrays(term, B, qb.shape[2])
    cfg = Cfg(scale=scale, softcap=spec.softcap,
              mask_treedef=None if spec.mask is None else jax.tree_util.tree_structure(spec.mask),
              num_splits=ns, block_sizes=spec.block_sizes,
              term_treedef=None if term is None else jax.tree_util.tree_structure(term),
              value_dim=value_dim)
    # inside shard_map: gradients typed like their inputs (see fnattn._dispatch.attend)
    qb, kb, vb, sinks = varying_like((qb, kb, vb, spec.sinks), qb, kb, vb, spec.sinks, starts,
                                     lengths)
    # window / chunk sizes as data (one per layer inside lax.scan): the XLA lowering
    sizes = tuple(jax.tree_util.tree_leaves(spec.mask)) if cfg.mask_treedef else ()
    if sizes:
        table = traced_sizes_table(spec.impl)
    elif value_dim is not None or quant.is_quantized(kb) or quant.is_quantized(vb):
        table = quantized_table(spec.impl)
    else:
        table = lowering_table(spec.impl)
    attend = _attend_stored if quant.is_quantized(kb) or quant.is_quantized(vb) else _attend
    out, lse = attend(table, cfg, qb, kb, vb, starts, lengths, sinks, terms, sizes)
    out = _checks.from_bthd(out, spec.layout)
    return AttentionOutput(out, lse if spec.return_lse else None)


def lowering_table(impl: str):
    """The (platform, forward) pairs for ``impl``.

    ``forward(cfg, q, k, v, starts, lengths, sinks, terms) -> (out, lse)`` on
    "bthd" arrays: out (B, Tq, Hq, Dv) in q's dtype, lse (B, Hq, Tq) float32;
    ``terms``: the position term's arrays
    (:func:`fnattn.position_bias.per_head_arrays`) or None.
    """
    if impl in ("auto", "pallas"):
        # (Pallas is imported only when needed)
        from fnattn.decoding import mosaic, mosaic_gpu, triton
    if impl == "auto":
        return (("default", xla.forward), ("cpu", xla.cpu_forward),
                ("cuda", functools.partial(mosaic_gpu.gpu_forward, triton.auto_forward)),
                ("tpu", mosaic.auto_forward))
    if impl == "pallas":
        return (("default", triton.forward_interpret),
                ("cuda", functools.partial(mosaic_gpu.gpu_forward, triton.forward)),
                ("tpu", mosaic.forward))
    if impl == "xla":
        return (("default", xla.forward),)
    if impl == "reference":
        return (("default", xla.reference_forward),)
    if impl == "cudnn":
        raise NotImplementedError("decode: impl='cudnn' has no decode lowering; use "
                                  "impl='auto' or 'xla'.")
    raise ValueError(f"decode: no lowering for impl={impl!r}")


def quantized_table(impl: str):
    """The lowering table for quantized caches (:mod:`fnattn.quant`) and latent
    caches (``value_dim``): the Pallas kernels on cuda (Triton; Mosaic GPU
    routes them to Triton, :func:`fnattn.decoding.mosaic_gpu.gpu_forward`)
    and tpu (Mosaic, or the XLA lowering under impl="auto" for a format it
    cannot load, :func:`fnattn.decoding.mosaic.unsupported`), which dequantize
    each tile after loading it and take latent values from the key tiles;
    elsewhere under impl="auto" the XLA lowering, which reads a quantized
    cache a chunk of slots at a time (impl="pallas": the Triton kernel,
    interpreted)."""
    if impl == "auto":
        return (("default", xla.forward),) + tuple(
            entry for entry in lowering_table(impl) if entry[0] in ("cuda", "tpu"))
    return lowering_table(impl)


def traced_sizes_table(impl: str):
    """The lowering table for masks whose window or chunk sizes are arrays
    (:func:`fnattn._serving.traced_sizes`): the XLA lowering on every platform
    under impl="auto" and "xla" (its positions compare with the sizes' values;
    the Pallas kernels' schedules are built from static sizes, so
    impl="pallas" refuses them)."""
    if impl == "auto":
        return (("default", xla.forward), ("cpu", xla.cpu_forward))
    if impl == "pallas":
        _serving.refuse_traced_sizes(
            "decode", "Pallas decode kernels (Triton, Mosaic TPU, Mosaic GPU)",
            "fnattn/decoding/xla.py")
    return lowering_table(impl)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _attend(table, cfg, q, k, v, starts, lengths, sinks, terms, sizes):
    return _forward(table, cfg, q, k, v, starts, lengths, sinks, terms, sizes)


def _forward(table, cfg, q, k, v, starts, lengths, sinks, terms, sizes):
    # split along the batch and heads of sharded inputs under jit (fnattn._partition);
    # traced mask sizes (only in the XLA tables) come after the terms
    def call(q, k, v, starts, lengths, sinks, terms, *sizes):
        return _dispatch.select(table, cfg, q, k, v, starts, lengths, sinks, terms,
                                *((sizes,) if sizes else ()))
    return _partition.decode(call, q, k, v, starts, lengths, sinks, terms,
                             allow=_splittable(cfg), mask_sizes=tuple(sizes))


def _splittable(cfg) -> str:
    """Which of the batch ("b") and the heads ("h") jit may split: not an index
    that a ``from_fn`` mask or position term reads (a shard would see its local
    one)."""
    mask = position_bias.attach(cfg.mask, cfg.term, constant=False)
    if mask is None:
        return "bh"
    return _partition.mask_roles(mask, _partition.Sizes(0, 0, 0))[1]


@_attend.defjvp
def _attend_jvp(table, cfg, primals, tangents):
    # (the terms' tangents are zero: their arrays refuse one before they get here)
    q, k, v, starts, lengths, sinks, terms, sizes = primals
    tq, tk, tv, _, _, tsinks, _, _ = tangents
    out, lse = _attend(table, cfg, *primals)  # second order comes back here
    t_out, t_lse = _linear.tangent(_Derivatives(cfg),
                                   (q, k, v, sinks, starts, lengths, terms, *sizes),
                                   (tq, tk, tv, tsinks), (out, lse))
    return (out, lse), (t_out, t_lse)


@dataclasses.dataclass(frozen=True)
class _Derivatives(_linear.Rule):
    """Derivatives of decode on every platform: those of the XLA lowering (its
    ``jax.jvp`` forward, its ``jax.vjp`` backward), which reads the cache
    once per pass, like the forward. Residuals (q, k, v, sinks, starts,
    lengths, terms, *sizes); tangents of (q, k, v, sinks)."""

    cfg: Any

    def smooth(self, res):
        q, k, v, sinks, starts, lengths, terms, *sizes = res
        return _xla_fn(self.cfg, starts, lengths, terms, sizes), (q, k, v, sinks)

    def tangent(self, res, lin):
        return self.smooth_tangent(res, lin)

    def cotangent(self, res, cts):
        q, k, v, sinks, starts, lengths, terms, *sizes = res
        d_out, d_lse = cts
        return _partition.decode(functools.partial(_grads, self.cfg), q, k, v, starts, lengths,
                                 sinks, terms, d_out, d_lse, allow=_splittable(self.cfg),
                                 mask_sizes=tuple(sizes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend_stored(table, cfg, q, k, v, starts, lengths, sinks, terms, sizes):
    """:func:`_attend` for quantized caches (pytrees of codes and scales), in
    reverse mode only: the backward is ``jax.vjp`` of the XLA lowering, which
    differentiates through the dequantization (the scales get cotangents, the
    integer codes float0 zeros)."""
    return _forward(table, cfg, q, k, v, starts, lengths, sinks, terms, sizes)


def _stored_fwd(table, cfg, q, k, v, starts, lengths, sinks, terms, sizes):
    return (_forward(table, cfg, q, k, v, starts, lengths, sinks, terms, sizes),
            (q, k, v, starts, lengths, sinks, terms, sizes))


def _stored_bwd(table, cfg, res, cts):
    q, k, v, starts, lengths, sinks, terms, sizes = res
    dq, dk, dv, dsinks = _grads(cfg, q, k, v, starts, lengths, sinks, terms, *cts, *sizes)
    ints = lambda x: np.zeros(jnp.shape(x), jax.dtypes.float0)  # noqa: E731
    return (dq, dk, dv, ints(starts), ints(lengths), dsinks,
            None if terms is None else jnp.zeros_like(terms), tuple(ints(x) for x in sizes))


_attend_stored.defvjp(_stored_fwd, _stored_bwd)


def _xla_fn(cfg, starts, lengths, terms, sizes=()):
    """The XLA lowering as a function of the differentiable inputs (q, k, v, sinks)."""
    def f(q, k, v, sinks):
        return xla.forward(cfg, q, k, v, starts, lengths, sinks, terms, tuple(sizes),
                           sanitize=True)
    return f


def _grads(cfg, q, k, v, starts, lengths, sinks, terms, d_out, d_lse, *sizes):
    _, vjp = jax.vjp(_xla_fn(cfg, starts, lengths, terms, sizes), q, k, v, sinks)
    return vjp((d_out.astype(q.dtype), d_lse.astype(jnp.float32)))
