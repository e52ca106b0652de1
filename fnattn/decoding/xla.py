"""The XLA lowering of :func:`fnattn.decode` (every platform without a kernel).

The cache is cut into ``num_splits`` contiguous ranges by a free reshape
(never a repeat over the GQA group); each range's partial result is computed
in one pass and the parts are combined by the merge of
:mod:`fnattn.merging`, where the sinks join the denominator once. Three forms
of the products (see :func:`choose`) suit different numbers of query rows per
kv head, batch sizes and platforms: XLA on a CPU lays K out anew for the
batched logits product of the "mixed" form when there are several kv heads,
which the "reduce" form avoids, chosen on a CPU where it was measured faster;
with one kv head the keys-last "dot" form reads K in place there.
Plain ``jnp``: differentiable.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fnattn import _checks, quant
from fnattn import _online as online
from fnattn import masks
from fnattn.merging import merge_stacked

__all__ = ["choose", "cpu_forward", "forward", "reference_forward"]

F32 = jnp.float32
I32 = jnp.int32

# Measured on a 2-core x86 CPU (f32, B 1..64, S 1k..32k, Hkv 1..16, D 64/128): two
# forms of the same computation, neither best everywhere.
#   "mixed": logits by a batched product in the cache's own layout (b, n, c, h, r),
#            the output as a fused multiply-reduce over the keys: fastest when a kv
#            head has a few query rows (GQA decode), up to 5x jax.nn, with 2 splits;
#   "dot":   both products as batched matrix products with the keys last: fastest
#            for MHA (one row per kv head) and for 8 or more rows per kv head.
#   "reduce": "mixed" with the logits as a multiply-reduce over the head dim: on
#            a CPU, XLA then reads K in place where the batched product lays K
#            out anew. With float32 caches, several kv heads, B * S * Hkv >= 64k
#            and several sequences (or one, with 2 rows per kv head) it ran
#            0.97-2.41x as fast as "mixed" (51 rows, median 1.68x); elsewhere
#            (one kv head, small caches, one sequence of more rows) 0.29-1.65x
#            (60 rows, median 0.58x), and with bfloat16 mostly slower, so
#            "mixed" stays there
#            (benchmarks/results/decode_forms_cpu.md, python benchmarks/decode_forms.py).
#   On a CPU with one kv head (MQA), "dot" in one range instead of "mixed": K is
#   then a plain (keys, head dim) matrix for the batched product, which needs no
#   copy. In one run of 36 float32 rows (B 1-8, S 4k-32k, 2-7 rows, D 64/128) it
#   ran 1.52x as fast as "mixed" (geometric mean; 0.91-2.70x, 34 rows faster),
#   and 1.98x over 8 bfloat16 rows (1.56-2.64x); 2 splits did not pay (0.95x)
#   (benchmarks/results/decode_forms_cpu_mqa.md and decode_forms_cpu_mqa_bf16.md).
MIXED_MAX_ROWS = 7
MIXED_SPLITS = 2
REDUCE_MIN_KEYS = 65536   # B * S * Hkv at least


def choose(cfg, rows: int, cache_len: int, *, batch: int = 1, kv_heads: int = 1,
           dtype=F32, cpu: bool = False):
    """(form, num_splits) of the XLA lowering for ``rows = Tq * Hq / Hkv`` rows;
    ``cpu``: lowering for a CPU, where "reduce" or, with one kv head, "dot" may
    replace "mixed"."""
    form = "mixed" if 2 <= rows <= MIXED_MAX_ROWS else "dot"
    if cpu and form == "mixed" and kv_heads == 1:
        form = "dot"
    if (cpu and form == "mixed" and jnp.dtype(dtype) == jnp.dtype(F32) and kv_heads >= 2
            and _checks.is_static(batch) and (batch >= 2 or rows == 2)
            and _checks.is_static(cache_len)
            and batch * cache_len * kv_heads >= REDUCE_MIN_KEYS):
        form = "reduce"
    if cfg.num_splits is not None:
        return form, cfg.num_splits
    if not _checks.is_static(cache_len):  # symbolic (jax.export): one range
        return form, 1
    if form in ("mixed", "reduce") and cache_len % MIXED_SPLITS == 0 and cache_len >= 256:
        return form, MIXED_SPLITS
    return form, 1


# Quantized caches are read in chunks of slots of about this many bytes of
# dequantized keys (all sequences and kv heads), one chunk at a time: no
# dequantized copy of the cache, and the chunk is still in cache when the
# products read it. On a 2-core x86 CPU (B=8, S=32k, Hkv=8, D=128, bf16 q) one
# pass over the whole cache held 2.5 GB of temporaries and ran an int8 cache at
# 1.45x the bf16 cache's time (benchmarks/results/quant_cpu.md).
QUANT_CHUNK_BYTES = 2 ** 22
QUANT_MIN_CHUNK = 64


def _quant_chunk(S: int, per_slot: int):
    """The chunk length for a quantized cache of S slots, or None (one pass)."""
    if not _checks.is_static(S):
        return None
    want = max(QUANT_CHUNK_BYTES // max(per_slot, 1), QUANT_MIN_CHUNK)
    if S <= want:
        return None
    c = max(d for d in range(1, want + 1) if S % d == 0)
    return c if c >= QUANT_MIN_CHUNK else None


def _slots(x, first, n):
    """Slots [first, first + n) of a cache (B, S, Hkv, D), quantized or not."""
    if x is None:
        return None
    if quant.is_quantized(x):
        scale = (lax.dynamic_slice_in_dim(x.scale, first, n, axis=1) if x.format.per_token
                 else x.scale)
        data = x.data
        if x.format.is_float:
            # Sliced as bytes: XLA on a CPU widens a float8 array before slicing
            # it (1 GB of temporaries at B=8, S=32k, and 2.5x the time); the
            # barrier keeps it from folding the two bitcasts away.
            raw = lax.dynamic_slice_in_dim(lax.bitcast_convert_type(data, jnp.uint8), first,
                                           n, axis=1)
            data = lax.bitcast_convert_type(lax.optimization_barrier(raw), x.data.dtype)
        else:
            data = lax.dynamic_slice_in_dim(data, first, n, axis=1)
        return x.replace(data=data, scale=scale)
    return lax.dynamic_slice_in_dim(x, first, n, axis=1)


def _chunked(cfg, q, k, v, starts, lengths, sinks, terms, C, *, sanitize, cpu):
    """:func:`forward` over chunks of C slots, one at a time (``lax.map``), merged
    with the sinks: each chunk is dequantized as it is loaded."""
    S = k.shape[1]

    def part(j):
        first = j * C
        # a chunk's slot c is global slot first + c: its keys keep their positions
        o, l = forward(cfg, q, _slots(k, first, C), _slots(v, first, C), starts - first,
                       lengths, None, terms, sanitize=sanitize, cpu=cpu, whole=True)
        return o.astype(F32), jnp.swapaxes(l, 1, 2)          # lse as (B, Tq, Hq)

    outs, lses = lax.map(part, jnp.arange(S // C, dtype=I32))
    sink = None if sinks is None else sinks.astype(F32)
    out, lse = merge_stacked(outs, lses, sink)
    return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2)


def forward(cfg, q, k, v, starts, lengths, sinks, terms=None, *, sanitize=None, cpu=False,
            whole=False):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv) q.dtype, lse (B, Hq, Tq).

    ``sanitize=None`` passes over the cache for non-finite keys only when it holds
    some (``_online.clean_unless_garbage``); ``True`` always does, which is what
    the backward differentiates (through a ``cond``, the untaken branch would
    get zero cotangents, and 0 times the NaN of a poisoned slot is NaN).
    ``cpu``: the program is lowered for a CPU (:func:`cpu_forward`), whose
    forms were measured (:func:`choose`). A quantized cache (:mod:`fnattn.quant`)
    is read in chunks of slots (:data:`QUANT_CHUNK_BYTES`) unless ``whole``.
    """
    B, _, Hkv, _ = k.shape
    if not whole and (quant.is_quantized(k) or quant.is_quantized(v)):
        C = _quant_chunk(k.shape[1], B * Hkv * k.shape[3] * jnp.dtype(q.dtype).itemsize)
        if C is not None:
            return _chunked(cfg, q, k, v, starts, lengths, sinks, terms, C,
                            sanitize=sanitize, cpu=cpu)
    dtype = q.dtype if quant.is_quantized(k) else k.dtype
    form, ns = choose(cfg, q.shape[1] * q.shape[2] // Hkv, k.shape[1], batch=B, kv_heads=Hkv,
                      dtype=dtype, cpu=cpu)
    f = functools.partial(_attend, cfg, q, k, v, starts, lengths, sinks, terms, num_splits=ns)
    if sanitize is None:
        # The rare garbage branch uses the "mixed" form, whose products with the
        # zeroed values fuse into one reduction (no copy of the cache), and keeps
        # K as it is (a non-finite K already gives its key a NaN logit).
        out, lse = online.clean_unless_garbage(
            lambda clean: (f(True, form="mixed", clean_keys=False) if clean
                           else f(False, form=form)))
    else:
        out, lse = f(sanitize, form=form)[:2]
    return out.astype(q.dtype), lse


def cpu_forward(cfg, q, k, v, starts, lengths, sinks, terms=None):
    """:func:`forward` on a CPU (the "cpu" entry of impl="auto"'s table)."""
    return forward(cfg, q, k, v, starts, lengths, sinks, terms, cpu=True)


def reference_forward(cfg, q, k, v, starts, lengths, sinks, terms=None):
    """One split, plain batched products (impl="reference")."""
    out, lse = online.clean_unless_garbage(functools.partial(
        _attend, cfg, q, k, v, starts, lengths, sinks, terms, num_splits=1, form="dot"))
    return out.astype(q.dtype), lse


def _attend(cfg, q, k, v, starts, lengths, sinks, terms, sanitize, *, num_splits, form,
            clean_keys=True):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv) f32, lse (B, Hq, Tq),
    and whether everything was finite (see ``_online.clean_unless_garbage``).
    ``clean_keys=False`` sanitises only V (enough for the forward)."""
    B, Tq, Hq, D = q.shape
    # Quantized caches (fnattn.quant): codes times scales in q's dtype, an
    # elementwise expression that XLA fuses into the passes that read it. A
    # latent cache (v None): the values are the keys' first value_dim channels.
    # The products of a latent cache take the keys whole as the values and keep
    # the output's first value_dim channels (a slice of the keys would be a copy).
    latent = v is None
    k = quant.dequantize(k, q.dtype)
    v = k if latent else quant.dequantize(v, q.dtype)
    _, S, Hkv, Dv = v.shape
    G, ns = Hq // Hkv, num_splits
    C = S // ns
    R = Tq * G                                   # rows of one kv head
    # q as (B, Hkv, R) rows, row r = t * G + g; scaled before the products.
    qr = (q.astype(F32) * cfg.scale).reshape(B, Tq, Hkv, G, D).transpose(0, 2, 1, 3, 4)
    qr = qr.reshape(B, Hkv, R, D)
    # Slots outside a sequence's range may hold anything (NaN from an earlier
    # request, never-written memory): when sanitising, their logits become NaN
    # before the masking below (_online.finite_keys), so a key a row may not see
    # contributes nothing to it (forward and gradients) and a row that sees a
    # non-finite key gets NaN.
    bad = False
    if sanitize:
        k_clean, v, bad = online.finite_keys(k, v)
        k = k_clean if clean_keys else k
        bad = bad.reshape(B, ns, C, Hkv, 1)      # (b, n, c, h, r)
    kr = k.reshape(B, ns, C, Hkv, D)             # free reshapes (see the module docstring)
    vr = v.reshape(B, ns, C, Hkv, Dv)
    if form == "reduce":  # s[b, n, c, h, r] as a multiply-reduce: no copy of K
        s = jnp.sum(qr.astype(k.dtype)[:, None, None, :, :, :] * kr[:, :, :, :, None, :],
                    axis=-1, dtype=F32)
    elif form == "mixed":  # s[b, n, c, h, r]: keys in the cache's own order
        s = jnp.einsum("bhrd,bnchd->bnchr", qr.astype(k.dtype), kr, preferred_element_type=F32)
    else:                 # s[b, n, h, r, c]: keys last
        s = jnp.einsum("bhrd,bnchd->bnhrc", qr.astype(k.dtype), kr, preferred_element_type=F32)
    finite = sanitize or jnp.all(jnp.isfinite(s))    # before the cap hides an inf
    # Positions: key slot n*C + c is at logical position slot - start; row r is
    # query t = r // G of head h * G + r % G.
    slot = (jnp.arange(ns, dtype=I32)[:, None] * C + jnp.arange(C, dtype=I32)[None])
    kpos = slot[None, :, :, None, None] - starts[:, None, None, None, None]
    ok = (kpos >= 0) & (kpos < lengths[:, None, None, None, None])
    mask, term = cfg.mask, cfg.term
    if mask is not None or term is not None:
        r = jnp.arange(R, dtype=I32)
        t = (r // G)[None, None, None, None, :]
        h = (jnp.arange(Hkv, dtype=I32)[:, None] * G + r[None] % G)[None, None, None]
        b = jnp.arange(B, dtype=I32)[:, None, None, None, None]
        q_pos = lengths[:, None, None, None, None] - Tq + t
        pos = masks.Positions(b=b, h=h, q=t, q_pos=q_pos, k=kpos)
    if term is not None:   # added before the cap, as a bias is
        # the term's arrays (n, B, Hq) at each row: (B, 1, 1, Hkv, R)
        rows = [] if terms is None else [
            jnp.tile(x.reshape(B, Hkv, 1, G), (1, 1, Tq, 1)).reshape(B, Hkv, R)[:, None, None]
            for x in terms]
        add = jnp.broadcast_to(term.value(pos, rows), (B, ns, C, Hkv, R))
        s = s + (jnp.moveaxis(add, 2, -1) if form == "dot" else add)
    if cfg.softcap is not None:
        s = cfg.softcap * jnp.tanh(s / cfg.softcap)
    if mask is not None:
        ok = ok & mask.predicate(pos, [])
    kax = 2
    if form == "dot":     # ok and bad were built as (b, n, c, h, r)
        ok, kax = jnp.moveaxis(ok, 2, -1), 4
        bad = jnp.moveaxis(bad, 2, -1) if sanitize else bad
    if sanitize:
        s = jnp.where(bad, jnp.nan, s)
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=kax)                     # (B, ns, Hkv, R)
    m_safe = jax.lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    m_keys = jnp.expand_dims(m_safe, kax)
    shift = s - m_keys
    if term is not None and cfg.softcap is None:
        shift = online.snap_ties(shift, m_keys)
    p = jnp.exp(shift)
    l = jnp.sum(p, axis=kax)
    if form in ("mixed", "reduce"):
        o = jnp.sum(p[..., None] * vr[:, :, :, :, None, :].astype(F32), axis=2)
    else:
        o = jnp.einsum("bnhrc,bnchd->bnhrd", p.astype(v.dtype), vr, preferred_element_type=F32)
    empty = l == 0                               # (a row that saw a NaN key stays NaN)
    safe = jnp.where(empty, 1.0, l)
    part_lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(safe))
    part_out = o / safe[..., None]
    sink = None
    if sinks is not None:
        sinks = sinks.astype(F32).reshape(Hkv, G)
        sink = jnp.broadcast_to(jnp.tile(sinks, (1, Tq))[None], (B, Hkv, R))
    # (ns, B, Hkv, R, ...) parts -> merged (B, Hkv, R, Dv), (B, Hkv, R)
    out, lse = merge_stacked(jnp.moveaxis(part_out, 1, 0), jnp.moveaxis(part_lse, 1, 0), sink)
    out = out.reshape(B, Hkv, Tq, G, Dv).transpose(0, 2, 1, 3, 4).reshape(B, Tq, Hq, Dv)
    lse = lse.reshape(B, Hkv, Tq, G).transpose(0, 1, 3, 2).reshape(B, Hq, Tq)
    if not sanitize:
        finite = finite & jnp.all(jnp.isfinite(part_out))
    if latent:
        out = out[..., :cfg.value_dim]
    return out, lse, finite
