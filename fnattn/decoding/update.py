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

**Gradients** with respect to q, the new k/v and the caches come from JAX: the
write is a scatter (whose derivative is a gather) and :func:`fnattn.decode` is
differentiable. Slots a step overwrites get no gradient through the old cache.
"""

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, _serving, quant
from fnattn.decoding import api
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["decode_with_update"]

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


def _refuse_static_overflow(kv_lengths, kv_starts, S, Tq):
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


def _concrete_checks(a):
    """What only concrete lengths tell, checked before the call is compiled."""
    _, Tq, S, *_ = _check(a["spec"], a["q"], a["k_new"], a["v_new"], a["k_cache"],
                          a["v_cache"], a["kv_lengths"], a.get("kv_starts"),
                          a.get("value_dim"))
    _refuse_static_overflow(a["kv_lengths"], a.get("kv_starts"), S, Tq)


@_checks.entry_point("fnattn.decode_with_update", ints=("kv_lengths", "kv_starts"),
                     concrete=_concrete_checks)
@jaxtyped(typechecker=beartype)
def decode_with_update(spec: AttentionSpec, q: Shaped[Array, "..."],
                       k_new: Shaped[Array, "..."], v_new: Optional[Shaped[Array, "..."]],
                       k_cache: quant.Cache, v_cache: Optional[quant.Cache], *,
                       kv_lengths: Shaped[Array, "..."],
                       kv_starts: Optional[Shaped[Array, "..."]] = None,
                       value_dim: Optional[int] = None, checked: bool = False):
    """Writes the new tokens' k/v into the cache, then :func:`fnattn.decode` on it.

    Token ``i`` of sequence ``b`` goes to slot ``kv_starts[b] + kv_lengths[b] - Tq + i``
    (the lengths count the new tokens, as in ``decode``); the result equals
    writing there by hand and calling ``decode`` with the same arguments. A
    sequence whose tokens do not fit in ``[kv_starts[b], S)`` gets NaN and
    writes nothing (a ``ValueError`` where the lengths are not traced; see the
    module docstring).

    Args:
      spec: as for :func:`fnattn.decode`.
      q: (B, Tq, Hq, D) in "bthd" or (B, Hq, Tq, D) in "bhtd".
      k_new: (B, Tq, Hkv, D) or (B, Hkv, Tq, D), the new tokens' keys, cast to
        the cache's dtype.
      v_new: (B, Tq, Hkv, Dv) or (B, Hkv, Tq, Dv).
      k_cache: (B, S, Hkv, D) or (B, Hkv, S, D).
      v_cache: (B, S, Hkv, Dv) or (B, Hkv, S, Dv).
      kv_lengths: (B,) int, keys of each sequence after the update (the Tq new
        tokens included; 0: an empty sequence, nothing written).
      kv_starts: (B,) int, first slot of each sequence (default 0).
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
    """
    B, Tq, S, _, _, _, _ = _check(spec, q, k_new, v_new, k_cache, v_cache, kv_lengths,
                                  kv_starts, value_dim)
    _refuse_static_overflow(kv_lengths, kv_starts, S, Tq)
    if checked:
        quant.check_pool_scales(k_cache=k_cache, v_cache=v_cache)
        api.check_inputs(S, Tq, kv_lengths, kv_starts)
    lengths = kv_lengths.astype(I32)
    starts = jnp.zeros((B,), I32) if kv_starts is None else kv_starts.astype(I32)
    fits = _fits(lengths, starts, S, Tq)
    write = fits & (lengths > 0)
    slot = (starts + lengths - Tq)[:, None] + jnp.arange(Tq, dtype=I32)
    slot = jnp.where(write[:, None], slot, S)  # S: dropped (never wraps, never clips)
    rows = jnp.arange(B, dtype=I32)[:, None]

    def put(cache, new):
        # (a quantized cache gets quantize's codes and per-token scales: quant.write)
        if spec.layout == "bthd":
            return quant.write(cache, (rows, slot), new)
        # The advanced indices (rows, slot) are apart: their (B, Tq) axes come first.
        return quant.write(cache, (rows, slice(None), slot), jnp.swapaxes(new, 1, 2))

    k_cache = put(k_cache, k_new)
    v_cache = None if v_cache is None else put(v_cache, v_new)   # (None: a latent cache)
    res = api.decode(spec, q, k_cache, v_cache, kv_lengths=kv_lengths, kv_starts=kv_starts,
                     value_dim=value_dim)
    bad = ~fits
    out = jnp.where(bad[:, None, None, None], jnp.nan, res.out).astype(res.out.dtype)
    lse = None if res.lse is None else jnp.where(bad[:, None, None], jnp.nan, res.lse)
    return AttentionOutput(out, lse), k_cache, v_cache
