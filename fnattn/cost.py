"""What an attention call costs: FLOPs, transcendentals and bytes, from a spec and shapes.

:func:`estimate` is the count a roofline needs: the matrix-product FLOPs of
the (query, key) pairs the mask lets through, the exponentials (and the
soft-cap's tanh) of those pairs, and the bytes every operand must cross
memory at least once. The benchmarks divide it by time for their FLOP/s, and
the Mosaic TPU kernels hand the per-call share to XLA's scheduler as a
``pl.CostEstimate`` (:func:`tiles`).

**Mask density.** For a mask that holds no arrays (causal, windows, chunks
and their combinations) the density is computed at trace time from the mask's
tile classes on a grid of at most 1024 x 1024 tiles (16 x 16 pairs for sequences
up to 16k): a FULL tile counts 1, a PARTIAL tile 1/2 and an EMPTY tile 0, so
causal attention comes out at about 1/2 and a window of ``w`` keys at about
``w / Tk`` (the error is at most half the share of PARTIAL tiles). A mask with arrays (segment ids, lengths, an
array mask) depends on data: its density is reported as 1 (an upper bound)
with ``exact=False``.

>>> import jax, jax.numpy as jnp
>>> from fnattn import AttentionSpec, masks, cost
>>> q = k = v = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
>>> c = cost.estimate(AttentionSpec(mask=masks.causal()), q, k, v)
>>> round(c.density, 3), f"{c.flops / 1e9:.1f} GFLOP", c.exact
(0.5, '34.4 GFLOP', True)
>>> w = cost.estimate(AttentionSpec(mask=masks.sliding_window(left=511)), q, k, v)
>>> round(w.density, 3)       # each row sees 512 keys, fewer near the start
0.117
"""

from typing import Any, NamedTuple, Optional

import numpy as np

from fnattn import masks
from fnattn.spec import AttentionSpec

__all__ = ["Cost", "estimate", "mask_density", "serving", "tiles"]

MAX_TILES = 1024  # per axis, for the density grid


def _density_block(q_len, kv_len):
    n = max(q_len, kv_len)
    b = 16
    while -(-n // b) > MAX_TILES:
        b *= 2
    return b


class Cost(NamedTuple):
    """An attention call's cost (floats: counts can pass 2**31).

    Attributes:
      flops: matrix-product FLOPs (2 per multiply-add) of the visited pairs.
      transcendentals: ``exp`` (and ``tanh`` with a soft-cap) evaluations.
      bytes_accessed: bytes every input and output crosses memory at least once.
      density: the fraction of (query, key) pairs the mask lets through.
      exact: whether ``density`` is the mask's (False: a data-dependent mask,
        counted as dense).
    """

    flops: float
    transcendentals: float
    bytes_accessed: float
    density: float
    exact: bool

    def as_pallas(self):
        """This cost as a ``jax.experimental.pallas.CostEstimate`` (ints)."""
        from jax.experimental import pallas as pl
        return pl.CostEstimate(flops=int(self.flops), transcendentals=int(self.transcendentals),
                               bytes_accessed=int(self.bytes_accessed))


def _shape_dtype(x):
    return tuple(x.shape), np.dtype(x.dtype)


def mask_density(mask: Optional[masks.Mask], batch: int, num_heads: int, q_len: int,
                 kv_len: int, *, q_offset: Optional[int] = None) -> Optional[float]:
    """The fraction of (query, key) pairs ``mask`` lets through, or None when it
    depends on arrays (see the module docstring for how it is counted).

    >>> from fnattn import masks
    >>> mask_density(masks.causal(), 1, 1, 1024, 1024)
    0.5
    >>> mask_density(None, 1, 1, 10, 10), mask_density(masks.lengths(kv_lengths=[3]), 1, 1, 8, 8)
    (1.0, None)
    """
    if mask is None:
        return 1.0
    blk = _density_block(q_len, kv_len)
    classes = masks.block_classes_static(mask, batch, num_heads, q_len, kv_len, blk, blk,
                                         q_offset=q_offset)
    if classes is None:
        return None
    weight = np.where(classes == masks.FULL, 1.0, np.where(classes == masks.PARTIAL, 0.5, 0.0))
    # tiles at the ragged ends hold fewer pairs
    nq, nk = classes.shape[-2:]
    rows = np.minimum(blk, q_len - blk * np.arange(nq))
    cols = np.minimum(blk, kv_len - blk * np.arange(nk))
    pairs = rows[:, None] * cols[None, :]
    return float((weight * pairs).sum() / (pairs.sum() * np.prod(classes.shape[:2])))


def _nbytes(x, shape, dtype) -> int:
    """Bytes of an operand: a quantized cache (:mod:`fnattn.quant`) counts its
    codes (two 4-bit values a byte) and its scales."""
    from fnattn import quant
    if quant.is_quantized(x):
        return x.nbytes
    return int(np.prod(shape)) * dtype.itemsize


def _pair_costs(d: int, dv: int, *, backward: bool, softcap: bool):
    """FLOPs and transcendentals per visited (query, key) pair."""
    cd, cv = KERNEL_PASSES["backward" if backward else "forward"]
    return 2 * (cd * d + cv * dv), 2 if softcap else 1


def estimate(spec: AttentionSpec, q: Any, k: Any, v: Any = None, *,
             backward: bool = False) -> Cost:
    """The cost of ``fnattn.attention(spec, q, k, v)`` (or of its backward).

    ``q``, ``k`` and ``v`` are arrays or anything with ``shape`` and ``dtype``
    (``jax.ShapeDtypeStruct``), in ``spec.layout``; ``v`` defaults to ``k``.
    ``backward=True`` gives the backward pass alone (the probabilities are
    recomputed: about 2.5x the forward's FLOPs when D = Dv). Bytes count q,
    k, v, out and lse once each (plus d_out, dq, dk, dv in the backward, and
    the bias and its gradient when given): the traffic no kernel can avoid.

    >>> import jax, jax.numpy as jnp
    >>> from fnattn import AttentionSpec
    >>> x = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.float32)
    >>> estimate(AttentionSpec(), x, x).flops == 4 * 2 * 4 * 256 * 256 * 64
    True
    """
    v = k if v is None else v
    (qs, qdt), (ks, kdt), (vs, vdt) = _shape_dtype(q), _shape_dtype(k), _shape_dtype(v)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise ValueError(f"cost.estimate: q, k and v must be 4-D in layout {spec.layout!r}; "
                         f"got q {qs}, k {ks}, v {vs}")
    if spec.layout == "bhtd":
        (B, Hq, Tq, D), (_, _, Tk, _), Dv = qs, ks, vs[3]
    else:
        (B, Tq, Hq, D), (_, Tk, _, _), Dv = qs, ks, vs[3]
    density = mask_density(spec.mask, B, Hq, Tq, Tk)
    exact = density is not None
    density = 1.0 if density is None else density
    pairs = B * Hq * Tq * Tk * density
    fl, tr = _pair_costs(D, Dv, backward=backward, softcap=spec.softcap is not None)
    out_bytes = B * Tq * Hq * Dv * qdt.itemsize
    lse_bytes = B * Hq * Tq * 4
    io = (np.prod(qs) * qdt.itemsize + _nbytes(k, ks, kdt) + _nbytes(v, vs, vdt)
          + out_bytes + lse_bytes)
    bias = spec.bias
    bias_bytes = 0 if bias is None else np.prod(np.shape(bias)) * np.dtype(bias.dtype).itemsize
    if backward:
        # reads q, k, v, out, d_out, lse; writes dq, dk, dv (the size of q, k, v)
        io = 2 * io - lse_bytes + out_bytes
        bias_bytes *= 2
    return Cost(flops=float(fl * pairs), transcendentals=float(tr * pairs),
                bytes_accessed=float(io + bias_bytes), density=float(density), exact=exact)


KERNEL_PASSES = {
    # FLOPs per (query, key) pair, in units of 2 * (d, dv): what each kernel multiplies
    "forward": (1, 1),          # s = q k^T, o += p v
    "backward": (3, 2),         # one fused pass: s, dp = do v^T, dv += p^T do, dq, dk
    "backward_dq": (2, 1),      # s, dp, dq += ds k
    "backward_dkv": (2, 2),     # s, dp, dv += p^T do, dk += ds^T q
}


def tiles(n_tiles, block_rows: int, block_cols: int, d: int, dv: int, *, kernel: str,
          softcap: bool, bytes_accessed: float):
    """A ``pl.CostEstimate`` for a kernel call that visits ``n_tiles`` tiles of
    ``block_rows x block_cols`` (query, key) pairs (a NumPy count when the
    schedule is static, else the grid's size: an upper bound). ``kernel`` is
    one of :data:`KERNEL_PASSES`: a backward split into a dq and a dk/dv kernel
    recomputes the probabilities in each.

    >>> tiles(4, 128, 128, 64, 64, kernel="forward", softcap=False, bytes_accessed=0).flops
    16777216
    """
    cd, cv = KERNEL_PASSES[kernel]
    pairs = int(n_tiles) * block_rows * block_cols
    return Cost(float(2 * (cd * d + cv * dv) * pairs), float((2 if softcap else 1) * pairs),
                float(bytes_accessed), 1.0, True).as_pallas()


def serving(tokens: int, q_heads: int, keys_per_token: int, d: int, dv: int, *,
            softcap: bool, cache_bytes: float, io_bytes: float):
    """A ``pl.CostEstimate`` for a decode or paged kernel call whose ``tokens``
    queries (of ``q_heads`` heads) each see at most ``keys_per_token`` keys
    (the cache's capacity: the lengths are data, so an upper bound), reading
    ``cache_bytes`` of K/V and ``io_bytes`` of queries and outputs.

    >>> serving(4, 8, 1024, 128, 128, softcap=False, cache_bytes=2**20, io_bytes=0).flops
    16777216
    """
    pairs = int(tokens) * q_heads * keys_per_token
    fl, tr = _pair_costs(d, dv, backward=False, softcap=softcap)
    return Cost(float(fl * pairs), float(tr * pairs), float(cache_bytes + io_bytes), 1.0,
                False).as_pallas()
