"""``decode_with_update``: :func:`fnattn.decode` that first writes the new tokens'
k/v into the contiguous cache, in one call.

Sequence ``b`` owns the cache slots ``[kv_starts[b], kv_starts[b] + kv_lengths[b])``
*after* the update, as in :func:`fnattn.decode`: ``kv_lengths`` counts the
``Tq`` new tokens, which go to the last ``Tq`` of those slots,
``kv_starts[b] + kv_lengths[b] - Tq + i`` for token ``i``. So a loop that
wrote by hand and then called ``decode`` passes the same arguments here, plus
the new k/v. The new tokens attend to the cached keys and, by the spec's mask,
to each other (``masks.causal()``: token ``i`` sees the new tokens up to ``i``).

**A sequence that does not fit** (``kv_starts[b] + kv_lengths[b] > S``, a
length below ``Tq``, a negative length or start) has no right answer: nothing
is written into its row of the cache and its ``out`` and ``lse`` are NaN, so
that an overflowing generation cannot pass for a result. (Clipping, as
``decode`` does for a read, would put the new tokens over older ones and
attend at positions that are not theirs; dropping the writes alone would
attend without them.) A length of 0 is an empty sequence: nothing is written,
``out`` is 0 and ``lse`` is ``-inf``. Where the lengths are known at trace time
(arrays rather than tracers, outside ``jax.jit``) a sequence that does not fit
raises ``ValueError``; ``checked=True`` reports traced ones through
``jax.experimental.checkify`` (:func:`fnattn.decoding.api.check_inputs`).
Stop a sequence before its slots run out: ``kv_starts + kv_lengths + Tq <= S``
for the next step.

**Per-sequence counts of new tokens** (``q_lengths``, (B,) int, traced): row
``b`` of q, k_new and v_new holds ``q_lengths[b]`` new tokens followed by
padding (right-padded inputs, ``0 <= q_lengths[b] <= Tq``), so prompts of
different lengths are prefilled into their rows in one call and decoded
together in the next. ``kv_lengths`` still counts the keys after the update,
the sequence's new tokens included: token ``i < q_lengths[b]`` goes to slot
``kv_starts[b] + kv_lengths[b] - q_lengths[b] + i`` and sits at position
``kv_lengths[b] - q_lengths[b] + i`` for the mask and the position term.
Padding rows write nothing and give ``out`` 0 and ``lse`` -inf (and no
gradient reaches their q, k_new or v_new); a sequence with ``q_lengths[b] =
0`` takes no part in the step (its slots are untouched; it may have any
length). Such a sequence fits when ``0 <= q_lengths[b] <= min(Tq,
kv_lengths[b])`` and its slots lie in the cache; one that does not is
treated as above (NaN, nothing written, ``ValueError`` for concrete values,
``checkify`` errors with ``checked=True``: :func:`check_q_lengths`). The
spec's mask and position term see positions, as without ``q_lengths``; a
``masks.from_fn`` mask, which reads the raw query row, is refused with
``q_lengths`` (the rows of a sequence are shifted to place its tokens). The kernels are the ones of
:func:`fnattn.decode`, given each sequence's tokens as its last rows.

**Gradients** with respect to q, the new k/v and the caches come from JAX: the
write is a scatter (whose derivative is a gather) and :func:`fnattn.decode` is
differentiable. Slots a step overwrites get no gradient through the old cache.
"""

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jax.experimental import checkify
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, _serving, masks, quant
from fnattn.decoding import api
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["check_q_lengths", "decode_with_update"]

I32 = jnp.int32
_FN = "decode_with_update"


def _check(spec, q, k_new, v_new, k_cache, v_cache, kv_lengths, kv_starts, value_dim=None):
    """decode's checks (named for this function), then those of the new tokens."""
    if value_dim is not None and v_new is not None:
        raise ValueError(f"{_FN}: a latent cache (value_dim={value_dim}) has no separate "
                         "values: pass v_new=None (k_new holds the latent and rope channels)")
    try:
        dims = api._check(spec, q, k_cache, v_cache, kv_lengths, kv_starts, value_dim)
    except (TypeError, ValueError, NotImplementedError) as e:
        msg = str(e)
        if msg.startswith("decode: "):
            raise type(e)(f"{_FN}: {msg[len('decode: '):]}") from None
        raise
    _serving.refuse_float64(_FN, k_new=k_new, v_new=v_new)
    B, Tq, S, _, Hkv, D, Dv = dims
    bthd = spec.layout == "bthd"
    for name, x, d in (("k_new", k_new, D), ("v_new", v_new, Dv))[:1 if v_new is None else 2]:
        _checks.check_float(f"{_FN}: {name}", x)
        want = (B, Tq, Hkv, d) if bthd else (B, Hkv, Tq, d)
        if tuple(x.shape) != want:
            axes = "(B, Tq, Hkv, " if bthd else "(B, Hkv, Tq, "
            axes += ("D)" if name == "k_new" else "Dv)")
            raise ValueError(f"{_FN}: {name} must have shape {axes}={want} for layout "
                             f"{spec.layout!r}, from q {tuple(q.shape)} and the cache "
                             f"{tuple(k_cache.shape if name == 'k_new' else v_cache.shape)}; "
                             f"got {tuple(x.shape)}")
    if Tq > S:
        raise ValueError(f"{_FN}: the Tq={Tq} new tokens of a sequence (q {tuple(q.shape)}) "
                         f"cannot fit in a cache of S={S} slots (k_cache "
                         f"{tuple(k_cache.shape)}); use a cache of at least {Tq} slots.")
    return dims


def _fits(lengths, starts, S, Tq):
    """Per sequence: its Tq new tokens fit (or it is empty); works on numpy and jax."""
    return ((starts >= 0) & (starts <= S) & (lengths >= 0) & (lengths <= S - starts)
            & ((lengths == 0) | (lengths >= Tq)))


def _fits_ragged(lengths, starts, q_lengths, S, Tq):
    """Per sequence with ``q_lengths`` new tokens: they are 0..Tq, no more than its
    length, and its slots lie in the cache; works on numpy and jax."""
    return ((starts >= 0) & (starts <= S) & (lengths >= 0) & (lengths <= S - starts)
            & (q_lengths >= 0) & (q_lengths <= Tq) & (q_lengths <= lengths))


def _refuse_static_overflow(kv_lengths, kv_starts, S, Tq, q_lengths=None):
    if q_lengths is not None:
        return _refuse_static_ragged(kv_lengths, kv_starts, q_lengths, S, Tq)
    if any(isinstance(x, jax.core.Tracer) for x in (kv_lengths, kv_starts)):
        return
    lengths = np.asarray(kv_lengths).astype(np.int64)
    starts = np.zeros_like(lengths) if kv_starts is None else np.asarray(kv_starts, np.int64)
    bad = ~_fits(lengths, starts, S, Tq)
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(
            f"{_FN}: sequence {b} does not fit: its slots would be kv_starts[{b}] = "
            f"{starts[b]} to kv_starts[{b}] + kv_lengths[{b}] = {starts[b] + lengths[b]}, "
            f"holding its Tq={Tq} new tokens, in a cache of S={S} slots (0 <= kv_starts, "
            f"kv_lengths = 0 or >= Tq, kv_starts + kv_lengths <= S). kv_lengths counts the "
            f"new tokens; stop the sequence or give it a longer cache.")


def _refuse_static_ragged(kv_lengths, kv_starts, q_lengths, S, Tq, fn=_FN):
    if any(isinstance(x, jax.core.Tracer) for x in (kv_lengths, kv_starts, q_lengths)):
        return
    lengths = np.asarray(kv_lengths).astype(np.int64)
    starts = np.zeros_like(lengths) if kv_starts is None else np.asarray(kv_starts, np.int64)
    n = np.asarray(q_lengths).astype(np.int64)
    bad = ~_fits_ragged(lengths, starts, n, S, Tq)
    if not bad.any():
        return
    b = int(np.argmax(bad))
    if not 0 <= n[b] <= Tq:
        raise ValueError(f"{fn}: q_lengths[{b}] = {n[b]} must be in [0, Tq={Tq}], the number "
                         f"of new tokens of sequence {b} among its Tq rows of q")
    if n[b] > lengths[b]:
        raise ValueError(f"{fn}: q_lengths[{b}] = {n[b]} new tokens exceed kv_lengths[{b}] = "
                         f"{lengths[b]}: kv_lengths counts the keys after the update, the new "
                         "tokens included")
    raise ValueError(
        f"{fn}: sequence {b} does not fit: its slots would be kv_starts[{b}] = {starts[b]} "
        f"to kv_starts[{b}] + kv_lengths[{b}] = {starts[b] + lengths[b]}, in a cache of "
        f"S={S} slots (0 <= kv_starts, 0 <= kv_lengths, kv_starts + kv_lengths <= S); stop "
        "the sequence or give it a longer cache.")


def check_q_lengths(cache_len: int, new_tokens: int, kv_lengths, q_lengths,
                    kv_starts=None, fn: str = _FN) -> None:
    """The ``checkify`` checks of ``checked=True`` with ``q_lengths``: the slots
    as :func:`fnattn.decoding.api.check_inputs` checks them, and
    ``0 <= q_lengths[b] <= min(Tq, kv_lengths[b])``.

    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import checkify
    >>> f = lambda L, n: check_q_lengths(16, 4, L, n)
    >>> err, _ = jax.jit(checkify.checkify(f))(jnp.array([4, 9]), jnp.array([4, 5]))
    >>> print(err.get())  # doctest: +ELLIPSIS
    decode_with_update: q_lengths[1] = 5 is outside [0, Tq=4]...
    """
    api.check_inputs(cache_len, 0, kv_lengths, kv_starts)
    lengths, n = kv_lengths.astype(I32), q_lengths.astype(I32)
    out = (n < 0) | (n > new_tokens)
    b = jnp.argmax(out)
    checkify.check(~out.any(), f"{fn}: q_lengths[{{b}}] = {{x}} is outside [0, Tq={{t}}] (the "
                   "new tokens among a sequence's rows)", b=b, x=n[b], t=jnp.int32(new_tokens))
    more = (n > lengths) & ~out
    b = jnp.argmax(more)
    checkify.check(~more.any(), f"{fn}: q_lengths[{{b}}] = {{x}} exceeds kv_lengths[{{b}}] = "
                   "{L} (kv_lengths counts the keys after the update, the new tokens included)",
                   b=b, x=n[b], L=lengths[b])


def check_q_lengths_arg(fn, q_lengths, B):
    """Trace-time checks of ``q_lengths``: an integer array of shape (B,)."""
    if not hasattr(q_lengths, "dtype") or not jnp.issubdtype(q_lengths.dtype, jnp.integer):
        raise TypeError(f"{fn}: q_lengths must be an integer array; got "
                        f"{getattr(q_lengths, 'dtype', type(q_lengths).__name__)}")
    if tuple(jnp.shape(q_lengths)) != (B,):
        raise ValueError(f"{fn}: q_lengths must have shape (B,)=({B},), the number of new "
                         f"tokens of each sequence; got {tuple(jnp.shape(q_lengths))}")


def _reads_query_rows(mask) -> bool:
    """Whether the mask holds a ``masks.from_fn`` predicate (which reads raw query rows)."""
    if isinstance(mask, masks.FromFn):
        return True
    return any(isinstance(getattr(mask, a, None), masks.Mask)
               and _reads_query_rows(getattr(mask, a)) for a in ("a", "b", "mask"))


def refuse_row_masks(fn, spec):
    if spec.mask is not None and _reads_query_rows(spec.mask):
        raise NotImplementedError(
            f"{fn}: a masks.from_fn mask ({spec.mask!r}) reads the raw query row, which "
            "q_lengths shifts (each sequence's tokens become its last rows); with q_lengths use "
            "positional masks (causal, sliding_window, chunked, their combinations), or call "
            "without q_lengths.")


def plan(lengths, starts, q_lengths, S, Tq):
    """``(fits, n, slot)``: per sequence whether it fits, its number of new tokens
    (0 where it does not fit) and the cache slot of each of its Tq rows, (B, Tq),
    ``S`` (dropped) for rows that write nothing."""
    i = jnp.arange(Tq, dtype=I32)[None, :]
    if q_lengths is None:
        fits = _fits(lengths, starts, S, Tq)
        n = jnp.where(fits & (lengths > 0), Tq, 0).astype(I32)
    else:
        fits = _fits_ragged(lengths, starts, q_lengths.astype(I32), S, Tq)
        n = jnp.where(fits, q_lengths.astype(I32), 0)
    slot = (starts + lengths - n)[:, None] + i
    return fits, n, jnp.where(i < n[:, None], slot, S)   # S: dropped (never wraps, clips)


def ragged_decode(spec, q, k_cache, v_cache, lengths, starts, n, fits, value_dim):
    """:func:`fnattn.decode` with ``n[b]`` new tokens in the first rows of sequence b
    (the rest padding): its tokens are moved to its last rows, where decode
    places the newest tokens, and moved back; padding rows give 0 and -inf."""
    bthd = spec.layout == "bthd"
    t_axis = 1 if bthd else 2
    Tq = q.shape[t_axis]
    i = jnp.arange(Tq, dtype=I32)[None, :]
    shift = (Tq - n)[:, None]                                  # (B, 1)

    def rows(x, index, valid, fill):    # x[b, index[b, j]] along the token axis
        shape = [x.shape[0]] + [1] * (x.ndim - 1)
        shape[t_axis] = Tq
        idx = jnp.clip(index, 0, Tq - 1).reshape(shape)
        got = jnp.take_along_axis(x, idx, axis=t_axis)
        return jnp.where(valid.reshape(shape), got, jnp.asarray(fill, x.dtype))

    q_moved = rows(q, i - shift, i >= shift, 0)
    live = fits & (n > 0)
    res = api.decode(spec, q_moved, k_cache, v_cache, kv_lengths=jnp.where(live, lengths, 0),
                     kv_starts=starts, value_dim=value_dim)
    valid = i < n[:, None]
    out = rows(res.out, i + shift, valid, 0)
    bad = ~fits
    out = jnp.where(bad[:, None, None, None], jnp.nan, out).astype(res.out.dtype)
    lse = None
    if res.lse is not None:   # (B, Hq, Tq): the token axis is 2
        idx = jnp.clip(i + shift, 0, Tq - 1)[:, None, :]
        lse = jnp.take_along_axis(res.lse, idx, axis=2)
        lse = jnp.where(valid[:, None, :], lse, -jnp.inf)
        lse = jnp.where(bad[:, None, None], jnp.nan, lse)
    return AttentionOutput(out, lse)


def attend_written(spec, q, k_cache, v_cache, lengths, starts, q_lengths, n, fits,
                   value_dim):
    """:func:`fnattn.decode` on caches that hold the new tokens (``plan``'s ``fits``
    and ``n``): sequences that do not fit are NaN; with ``q_lengths``, padding rows
    0 and -inf."""
    if q_lengths is not None:
        return ragged_decode(spec, q, k_cache, v_cache, lengths, starts, n, fits, value_dim)
    res = api.decode(spec, q, k_cache, v_cache, kv_lengths=lengths, kv_starts=starts,
                     value_dim=value_dim)
    bad = ~fits
    out = jnp.where(bad[:, None, None, None], jnp.nan, res.out).astype(res.out.dtype)
    lse = None if res.lse is None else jnp.where(bad[:, None, None], jnp.nan, res.lse)
    return AttentionOutput(out, lse)


def _concrete_checks(a):
    """What only concrete lengths tell, checked before the call is compiled."""
    _, Tq, S, *_ = _check(a["spec"], a["q"], a["k_new"], a["v_new"], a["k_cache"],
                          a["v_cache"], a["kv_lengths"], a.get("kv_starts"),
                          a.get("value_dim"))
    _refuse_static_overflow(a["kv_lengths"], a.get("kv_starts"), S, Tq, a.get("q_lengths"))


@_checks.entry_point("fnattn.decode_with_update", ints=("kv_lengths", "kv_starts", "q_lengths"),
                     concrete=_concrete_checks)
@jaxtyped(typechecker=beartype)
def decode_with_update(spec: AttentionSpec, q: Shaped[Array, "..."],
                       k_new: Shaped[Array, "..."], v_new: Optional[Shaped[Array, "..."]],
                       k_cache: quant.Cache, v_cache: Optional[quant.Cache], *,
                       kv_lengths: Shaped[Array, "..."],
                       kv_starts: Optional[Shaped[Array, "..."]] = None,
                       q_lengths: Optional[Shaped[Array, "..."]] = None,
                       value_dim: Optional[int] = None, checked: bool = False):
    """Writes the new tokens' k/v into the cache, then :func:`fnattn.decode` on it.

    Token ``i`` of sequence ``b`` goes to slot ``kv_starts[b] + kv_lengths[b] - Tq + i``
    (the lengths count the new tokens, as in ``decode``); the result equals
    writing there by hand and calling ``decode`` with the same arguments. A
    sequence whose tokens do not fit in ``[kv_starts[b], S)`` gets NaN and
    writes nothing (a ``ValueError`` where the lengths are not traced; see the
    module docstring). With ``q_lengths``, sequence ``b`` has only its first
    ``q_lengths[b]`` rows as new tokens (``Tq`` replaced by ``q_lengths[b]``
    above; padding rows give zeros): ragged prompts prefilled in one call.

    Args:
      spec: as for :func:`fnattn.decode`.
      q: (B, Tq, Hq, D) in "bthd" or (B, Hq, Tq, D) in "bhtd".
      k_new: (B, Tq, Hkv, D) or (B, Hkv, Tq, D), the new tokens' keys, cast to
        the cache's dtype.
      v_new: (B, Tq, Hkv, Dv) or (B, Hkv, Tq, Dv).
      k_cache: (B, S, Hkv, D) or (B, Hkv, S, D).
      v_cache: (B, S, Hkv, Dv) or (B, Hkv, S, Dv).
      kv_lengths: (B,) int, keys of each sequence after the update (its new
        tokens included; 0: an empty sequence, nothing written).
      kv_starts: (B,) int, first slot of each sequence (default 0).
      q_lengths: (B,) int, the new tokens of each sequence, ``0 .. Tq`` (rows
        past them are padding); None: ``Tq`` for every sequence of nonzero
        length (the program is then the one without this argument).
      value_dim: a latent cache, as for :func:`fnattn.decode`: ``v_new`` and
        ``v_cache`` are None and ``k_new`` holds the latent and rope channels.
      checked: report sequences that do not fit through ``checkify`` (wrap the
        call in ``checkify.checkify``).

    Returns:
      ``(AttentionOutput, k_cache, v_cache)``: the result as :func:`fnattn.decode`'s
      and the updated caches (``v_cache`` None for a latent cache; donate the caches
      under ``jax.jit`` and the write is in place).

    >>> import jax, jax.numpy as jnp, fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> from fnattn.decoding import decode_with_update
    >>> kc, vc = jnp.zeros((2, 2, 8, 1, 4))                     # 8 slots per sequence
    >>> q = kn = vn = jnp.ones((2, 1, 1, 4))                    # one new token each
    >>> step = jax.jit(decode_with_update, donate_argnums=(4, 5))
    >>> res, kc, vc = step(AttentionSpec(mask=masks.causal()), q, kn, vn, kc, vc,
    ...                    kv_lengths=jnp.array([3, 1]))
    >>> kc[:, :, 0, 0].tolist()                                 # written at slots 2 and 0
    [[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    >>> res.out.shape
    (2, 1, 1, 4)

    Two prompts of 3 and 1 tokens, right-padded to Tq=3, prefilled in one call:

    >>> kc, vc = jnp.zeros((2, 2, 8, 1, 4))
    >>> x = jnp.arange(1., 4.)[None, :, None, None] * jnp.ones((2, 3, 1, 4))
    >>> res, kc, vc = step(AttentionSpec(mask=masks.causal()), x, x, x, kc, vc,
    ...                    kv_lengths=jnp.array([3, 1]), q_lengths=jnp.array([3, 1]))
    >>> kc[:, :, 0, 0].tolist()                                 # row 1: its first token only
    [[1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    >>> res.out[1, :, 0, 0].tolist()                            # padding rows: zeros
    [1.0, 0.0, 0.0]
    """
    B, Tq, S, _, _, _, _ = _check(spec, q, k_new, v_new, k_cache, v_cache, kv_lengths,
                                  kv_starts, value_dim)
    if q_lengths is not None:
        check_q_lengths_arg(_FN, q_lengths, B)
        refuse_row_masks(_FN, spec)
    _refuse_static_overflow(kv_lengths, kv_starts, S, Tq, q_lengths)
    if checked:
        quant.check_pool_scales(k_cache=k_cache, v_cache=v_cache)
        if q_lengths is None:
            api.check_inputs(S, Tq, kv_lengths, kv_starts)
        else:
            check_q_lengths(S, Tq, kv_lengths, q_lengths, kv_starts)
    lengths = kv_lengths.astype(I32)
    starts = jnp.zeros((B,), I32) if kv_starts is None else kv_starts.astype(I32)
    fits, n, slot = plan(lengths, starts, q_lengths, S, Tq)
    rows = jnp.arange(B, dtype=I32)[:, None]

    def put(cache, new):
        # (a quantized cache gets quantize's codes and per-token scales: quant.write)
        if spec.layout == "bthd":
            return quant.write(cache, (rows, slot), new)
        # The advanced indices (rows, slot) are apart: their (B, Tq) axes come first.
        return quant.write(cache, (rows, slice(None), slot), jnp.swapaxes(new, 1, 2))

    k_cache = put(k_cache, k_new)
    v_cache = None if v_cache is None else put(v_cache, v_new)   # (None: a latent cache)
    res = attend_written(spec, q, k_cache, v_cache, lengths, starts, q_lengths, n, fits,
                         value_dim)
    return res, k_cache, v_cache
