"""The XLA lowering of :func:`fnattn.decode` (every platform without a kernel).

The cache is cut into ``num_splits`` contiguous ranges by a free reshape
(never a repeat over the GQA group); each range's partial result is computed
in one pass and the parts are combined by the merge of
:mod:`fnattn.merging`, where the sinks join the denominator once. Three forms
of the products (see :func:`choose`) suit different numbers of query rows per
kv head, batch sizes and platforms: XLA on a CPU lays K out anew for the
batched logits product of the "mixed" form when there are several kv heads,
which the "reduce" form avoids, chosen on a CPU where it was measured faster;
with one kv head the keys-last "dot" form reads K in place there. Large
caches and every quantized cache take a fourth, looped form instead
(:func:`_looped`): a chunk of slots at a time folded into an online softmax,
with O(chunk) temporaries, quantized codes passed to the products as q's
dtype and their scales applied to the logits and the probabilities.
Plain ``jnp``: differentiable.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fnattn import _checks, _serving, quant
from fnattn import _online as online
from fnattn import masks
from fnattn._varying import varying_like
from fnattn.merging import merge_stacked, shifted_exp

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


# Large caches and every quantized cache take the looped form (:func:`_looped`):
# a ``lax.fori_loop`` over chunks of slots, each gathered as (B, Hkv, chunk, D)
# (the layout the batched products take, no transpose) inside a ``lax.cond``
# that skips chunks no sequence owns, folded into an online softmax: the
# temporaries are one chunk's. Without the ``cond``, XLA on a CPU widened the
# whole bfloat16 or float8 cache to float32 before the loop, and the one-pass
# forms lay the whole cache out anew for their products: on a 2-core x86 CPU
# (B=8, S=32k, Hq=32, Hkv=8, D=128, bf16) one pass held 2 GB of temporaries and
# ran 9x the paged lowering's time (benchmarks/results/quant_cpu.md).
LOOP_MIN_BYTES = 2 ** 23      # float caches of at least this many bytes of K
LOOP_CHUNK_BYTES = 2 ** 21    # bytes of one chunk's keys, in the products' dtype
LOOP_MIN_CHUNK, LOOP_MAX_CHUNK = 16, 4096


def _loop_chunk(cfg, q, k, v):
    """The chunk length of the looped form, or None (the one-pass forms)."""
    B, S, Hkv, D = k.shape
    if not (_checks.is_static(S) and _checks.is_static(B)):
        return None   # symbolic sizes (jax.export): one pass
    given = getattr(cfg.block_sizes, "block_k", None)
    if given:
        return min(given, S)
    quantized = quant.is_quantized(k) or quant.is_quantized(v)
    dtype = _dot_dtype(q, k)
    per_slot = B * Hkv * D * jnp.dtype(dtype).itemsize
    if not quantized and per_slot * S < LOOP_MIN_BYTES:
        return None
    want = max(LOOP_CHUNK_BYTES // per_slot, 1)
    chunk = 1 << (want.bit_length() - 1)
    return min(max(chunk, LOOP_MIN_CHUNK), LOOP_MAX_CHUNK, S)


def _dot_dtype(q, x):
    """The products' input dtype for the cache ``x``: a float cache's own; the
    codes of a quantized one as q's dtype (exact: every format's codes are
    values of any float dtype of 16 bits or more)."""
    return q.dtype if quant.is_quantized(x) else x.dtype


def _load(x, index, dtype, dequantize: bool):
    """``(values, scale)`` of the slots ``index`` of a cache: a float cache's
    values and None; a quantized cache's codes as ``dtype`` and its scales
    (per token: one per gathered slot; per tensor: the scalar), which the
    products apply to the logits and the probabilities (``q . (c * s) = (q . c) * s``)
    so that no element of the cache is multiplied. ``dequantize``: the values
    codes times scales, and None (what the sanitising pass inspects)."""
    if not quant.is_quantized(x):
        return x[index].astype(dtype), None
    part = x[index]
    if dequantize:
        return quant.dequantize(part, dtype), None
    return quant.code_halves(x.format, part.data, dtype), jnp.asarray(part.scale, F32)


def _mask(cfg, sizes, rank: int):
    """The spec's mask and its predicate's operands at positions of ``rank`` axes
    (batch leading): none for a positional mask; a mask's traced window or chunk
    sizes (``sizes``, its leaves) rebuilt into it, () or (B,) each."""
    if not sizes:
        return cfg.mask, []
    mask = jax.tree_util.tree_unflatten(cfg.mask_treedef, list(sizes))
    return mask, _serving.size_operands(mask, rank)


def _looped(cfg, q, k, v, starts, lengths, sinks, terms, sizes, sanitize, *, chunk):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv) f32, lse (B, Hq, Tq),
    finite: the cache read ``chunk`` slots at a time (see :data:`LOOP_MIN_BYTES`).
    A latent cache (v None): the products take the keys whole as the values and
    the output keeps its first ``value_dim`` channels."""
    B, Tq, Hq, D = q.shape
    _, S, Hkv, _ = k.shape
    latent = v is None
    Dv = cfg.value_dim if latent else v.shape[3]
    Dacc = D if latent else Dv
    G = Hq // Hkv
    R, C = Tq * G, chunk
    n_chunks = -(-S // C)
    kdt = _dot_dtype(q, k)
    vdt = kdt if latent else _dot_dtype(q, v)
    # q as (B, Hkv, R, D) rows, row r = t * G + g; scaled before the products.
    qr = (q.astype(F32) * cfg.scale).reshape(B, Tq, Hkv, G, D).transpose(0, 2, 1, 3, 4)
    qr = qr.reshape(B, Hkv, R, D).astype(kdt)
    r = jnp.arange(R, dtype=I32)
    t = (r // G)[None, None, :, None]                               # (1, 1, R, 1)
    h = (jnp.arange(Hkv, dtype=I32)[:, None] * G + r[None] % G)[None, :, :, None]
    b = jnp.arange(B, dtype=I32)[:, None, None, None]
    q_pos = lengths[:, None, None, None] - Tq + t
    (mask, ops), term = _mask(cfg, sizes, 4), cfg.term
    rows = [] if terms is None or term is None else [
        jnp.tile(x.reshape(B, Hkv, 1, G), (1, 1, Tq, 1)).reshape(B, Hkv, R)[..., None]
        for x in terms]
    bi = jnp.arange(B, dtype=I32)[:, None, None]
    hi = jnp.arange(Hkv, dtype=I32)[None, :, None]

    def scaled(x, scale):     # a per-token (B, Hkv, C) or per-tensor scale on (B, Hkv, R, C)
        if scale is None:
            return x
        return x * (scale[:, :, None, :] if scale.ndim else scale)

    def fold(j, carry):
        m, l, acc, finite = carry
        slot = j * C + jnp.arange(C, dtype=I32)
        index = (bi, jnp.minimum(slot, S - 1)[None, None, :], hi)   # (B, Hkv, C) slots
        kc, ks = _load(k, index, kdt, sanitize)
        vc, vs = (kc, ks) if latent else _load(v, index, vdt, sanitize)
        # Slots outside a sequence's range may hold anything (NaN from an earlier
        # request, never-written memory): see _online.finite_keys.
        if sanitize:
            kc, vc, bad = online.finite_keys(kc, vc)
        s = scaled(quant.einsum_codes("bhrd,bhcd->bhrc", qr, kc), ks)
        finite_j = sanitize or jnp.all(jnp.isfinite(s))    # before the cap hides an inf
        kpos = slot[None, None, None, :] - starts[:, None, None, None]
        pos = masks.Positions(b=b, h=h, q=t, q_pos=q_pos, k=kpos)
        if term is not None:   # added before the cap, as a bias is
            s = s + term.value(pos, rows)
        if cfg.softcap is not None:
            s = cfg.softcap * jnp.tanh(s / cfg.softcap)
        ok = (kpos >= 0) & (kpos < lengths[:, None, None, None]) & (slot < S)
        if mask is not None:
            ok = ok & mask.predicate(pos, ops)
        if sanitize:
            s = jnp.where(bad[:, :, None, :], jnp.nan, s)
        s = jnp.where(ok, s, -jnp.inf)
        # The running max is only a shift: no gradient flows through it.
        m_new = lax.stop_gradient(jnp.maximum(m, s.max(-1)))
        m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)[..., None]
        shift = s - m_use
        if term is not None and cfg.softcap is None:
            shift = online.snap_ties(shift, m_use)
        p = jnp.exp(shift)
        alpha = jnp.exp(m - m_use[..., 0])
        l = l * alpha + p.sum(-1)
        pv = scaled(p, vs).astype(vdt)
        acc = acc * alpha[..., None] + quant.einsum_codes("bhrc,bhcd->bhrd", pv, vc)
        return m_new, l, acc, finite & finite_j

    carry = (jnp.full((B, Hkv, R), -jnp.inf, F32), jnp.zeros((B, Hkv, R), F32),
             jnp.zeros((B, Hkv, R, Dacc), F32), jnp.bool_(True))
    carry = varying_like(carry, q, k, v, starts, lengths, sinks, terms)
    if n_chunks == 1:
        m, l, acc, finite = fold(0, carry)
    else:
        first = jnp.min(jnp.where(lengths > 0, starts, S))
        last = jnp.max(jnp.where(lengths > 0, starts + lengths, 0))

        def step(j, carry):
            # The cond also keeps XLA from widening the whole cache before the loop.
            needed = (j * C < last) & ((j + 1) * C > first)
            return lax.cond(needed, functools.partial(fold, j), lambda c: c, carry)

        m, l, acc, finite = lax.fori_loop(0, n_chunks, step, carry)
    if sinks is not None:
        # Infinite sinks as in fnattn._online.join_sink: -inf is no sink, +inf takes all
        # the mass (out 0, lse +inf, d(sink) = d(lse): shifted_exp's derivative is 1).
        sink = jnp.broadcast_to(jnp.tile(sinks.astype(F32).reshape(Hkv, G), (1, Tq))[None],
                                (B, Hkv, R))
        m_fin = lax.stop_gradient(jnp.maximum(m, sink))
        m_use = jnp.where(m_fin == -jnp.inf, 0.0, m_fin)
        a = shifted_exp(m, m_use)
        l = l * a + shifted_exp(sink, m_use)
        acc = acc * a[..., None]
        m = m_fin
    empty = l == 0                        # (a row that saw a NaN key stays NaN)
    safe = jnp.where(empty, 1.0, l)
    out = acc[..., :Dv] / safe[..., None]
    lse = jnp.where(empty, -jnp.inf, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(safe))
    out = out.reshape(B, Hkv, Tq, G, Dv).transpose(0, 2, 1, 3, 4).reshape(B, Tq, Hq, Dv)
    lse = lse.reshape(B, Hkv, Tq, G).transpose(0, 1, 3, 2).reshape(B, Hq, Tq)
    return out, lse, finite & jnp.all(jnp.isfinite(acc))


def forward(cfg, q, k, v, starts, lengths, sinks, terms=None, sizes=(), *, sanitize=None,
            cpu=False):
    """q (B, Tq, Hq, D), k/v (B, S, Hkv, D|Dv) -> out (B, Tq, Hq, Dv) q.dtype, lse (B, Hq, Tq).

    ``sanitize=None`` passes over the cache for non-finite keys only when it holds
    some (``_online.clean_unless_garbage``); ``True`` always does, which is what
    the backward differentiates (through a ``cond``, the untaken branch would
    get zero cotangents, and 0 times the NaN of a poisoned slot is NaN).
    ``cpu``: the program is lowered for a CPU (:func:`cpu_forward`), whose
    forms were measured (:func:`choose`). ``sizes``: the leaves of a mask whose
    window or chunk sizes are arrays (:func:`fnattn._serving.traced_sizes`),
    which this lowering alone takes. Quantized caches (:mod:`fnattn.quant`),
    float caches of :data:`LOOP_MIN_BYTES` or more and specs whose
    ``DecodeBlockSizes`` give ``block_k`` take the looped form (:func:`_looped`),
    ``block_k`` (or about :data:`LOOP_CHUNK_BYTES`) slots at a time.
    """
    B, _, Hkv, _ = k.shape
    chunk = _loop_chunk(cfg, q, k, v)
    if chunk is not None:
        f = functools.partial(_looped, cfg, q, k, v, starts, lengths, sinks, terms, sizes,
                              chunk=chunk)
        out, lse = (online.clean_unless_garbage(f) if sanitize is None
                    else f(sanitize)[:2])
        return out.astype(q.dtype), lse
    dtype = q.dtype if quant.is_quantized(k) else k.dtype
    form, ns = choose(cfg, q.shape[1] * q.shape[2] // Hkv, k.shape[1], batch=B, kv_heads=Hkv,
                      dtype=dtype, cpu=cpu)
    f = functools.partial(_attend, cfg, q, k, v, starts, lengths, sinks, terms, sizes,
                          num_splits=ns)
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


def cpu_forward(cfg, q, k, v, starts, lengths, sinks, terms=None, sizes=()):
    """:func:`forward` on a CPU (the "cpu" entry of impl="auto"'s table)."""
    return forward(cfg, q, k, v, starts, lengths, sinks, terms, sizes, cpu=True)


def reference_forward(cfg, q, k, v, starts, lengths, sinks, terms=None, sizes=()):
    """One split, plain batched products (impl="reference")."""
    out, lse = online.clean_unless_garbage(functools.partial(
        _attend, cfg, q, k, v, starts, lengths, sinks, terms, sizes, num_splits=1,
        form="dot"))
    return out.astype(q.dtype), lse


def _attend(cfg, q, k, v, starts, lengths, sinks, terms, sizes, sanitize, *, num_splits, form,
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
    (mask, ops), term = _mask(cfg, sizes, 5), cfg.term
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
        ok = ok & mask.predicate(pos, ops)
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
