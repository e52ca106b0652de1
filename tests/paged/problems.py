"""Paged problems built from per-sequence tokens, and their dense expected results.

A problem is a list of sequences ``(L, n)`` (context length, new tokens). Every
sequence gets its own keys/values (L, Hkv, D) and queries (n, Hq, D); the
pages of all sequences are a random permutation of the pool, whose other slots
hold large garbage (so a lowering that reads an unmasked slot fails). The
expected result of sequence ``s`` is ``fnattn.reference`` on the dense problem
q (1, n, Hq, D), k/v (1, L, Hkv, D), computed under ``jax.jit`` one sequence at
a time, independently of any paging code.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from cases import np_mask  # tests/ is on sys.path

GARBAGE = 1e4


@dataclasses.dataclass
class Problem:
    seqs: list            # [(L, n)] of the live sequences
    q: Any                # (T, Hq, D) packed, padding rows at the end
    k_tok: list           # per sequence (L, Hkv, D)
    v_tok: list
    k_pages: Any          # pools holding every sequence's tokens
    v_pages: Any
    k_old: Any            # pools holding only positions < L - n (for the update form)
    v_old: Any
    k_new: Any            # (T, Hkv, D): the new tokens' k/v, packed like q
    v_new: Any
    page_table: Any       # (max_seqs, P)
    context_lengths: Any  # (max_seqs,)
    query_start_loc: Any  # (max_seqs + 1,)
    num_seqs: Any         # int32 scalar
    used_pages: Any       # bool (num_pages,): pages holding some live token


def make(seqs, *, Hq=4, Hkv=2, D=8, Dv=None, page_size=4, pages_per_seq=None, num_pages=None,
         max_seqs=None, pad_tokens=0, dtype=jnp.float32, seed=0):
    Dv = D if Dv is None else Dv
    rng = np.random.default_rng(seed)
    need = [-(-L // page_size) for L, _ in seqs]
    P = pages_per_seq or max(max(need), 1)
    S = max_seqs or len(seqs)
    N = num_pages or sum(need) + 3
    perm = rng.permutation(N)
    table = rng.integers(0, N, size=(S, P)).astype(np.int32)  # junk in unused entries
    kp = rng.uniform(-GARBAGE, GARBAGE, (Hkv, N, page_size, D)).astype(np.float32)
    vp = rng.uniform(-GARBAGE, GARBAGE, (Hkv, N, page_size, Dv)).astype(np.float32)
    kp_old, vp_old = kp.copy(), vp.copy()
    used = np.zeros(N, bool)
    k_tok, v_tok, qs, k_new, v_new = [], [], [], [], []
    nxt = 0
    for s, (L, n) in enumerate(seqs):
        k = rng.standard_normal((L, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((L, Hkv, Dv)).astype(np.float32)
        qs.append(rng.standard_normal((n, Hq, D)).astype(np.float32))
        k_tok.append(k)
        v_tok.append(v)
        k_new.append(k[L - n:])
        v_new.append(v[L - n:])
        for j in range(need[s]):
            page = perm[nxt]
            nxt += 1
            table[s, j] = page
            used[page] = True
        for pos in range(L):
            page, off = table[s, pos // page_size], pos % page_size
            kp[:, page, off] = k[pos]
            vp[:, page, off] = v[pos]
            if pos < L - n:
                kp_old[:, page, off] = k[pos]
                vp_old[:, page, off] = v[pos]
    Hq_ = qs[0].shape[1] if qs else Hq
    q = np.concatenate(qs + [rng.standard_normal((pad_tokens, Hq_, D)).astype(np.float32)])
    pad = lambda xs, d: np.concatenate(  # noqa: E731
        xs + [rng.standard_normal((pad_tokens, Hkv, d)).astype(np.float32)])
    loc = np.zeros(S + 1, np.int32)
    loc[1:len(seqs) + 1] = np.cumsum([n for _, n in seqs])
    loc[len(seqs) + 1:] = loc[len(seqs)] + rng.integers(0, 3, S - len(seqs)).cumsum()
    lengths = rng.integers(0, P * page_size + 1, S).astype(np.int32)  # junk for padding
    lengths[:len(seqs)] = [L for L, _ in seqs]
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return Problem(seqs=list(seqs), q=cast(q), k_tok=[cast(x) for x in k_tok],
                   v_tok=[cast(x) for x in v_tok], k_pages=cast(kp), v_pages=cast(vp),
                   k_old=cast(kp_old), v_old=cast(vp_old), k_new=cast(pad(k_new, D)),
                   v_new=cast(pad(v_new, Dv)), page_table=jnp.asarray(table),
                   context_lengths=jnp.asarray(lengths), query_start_loc=jnp.asarray(loc),
                   num_seqs=jnp.int32(len(seqs)), used_pages=used)


def poisoned(p: Problem, value=np.nan, *, old=False, hidden=None) -> Problem:
    """The problem with every pool slot that holds no live token set to ``value``
    (NaN: a released request's pages, never-written memory; slots past a
    sequence's length in its own last page). A lowering that lets an unowned slot
    reach a result, an lse or a gradient fails. ``old``: the pools of the update
    form (``k_old``/``v_old``) too, with the new tokens' slots poisoned as well.
    ``hidden(L, n, pos)``: also poison the live keys it is true for (keys the
    mask hides from every query of their sequence, e.g. before a window)."""
    Hkv, N, ps, _ = p.k_pages.shape
    live = np.zeros((N, ps), bool)
    live_old = np.zeros((N, ps), bool)
    table = np.asarray(p.page_table)
    for s, (L, n) in enumerate(p.seqs):
        for pos in range(L):
            keep = hidden is None or not hidden(L, n, pos)
            live[table[s, pos // ps], pos % ps] = keep
            live_old[table[s, pos // ps], pos % ps] = keep and pos < L - n
    put = lambda x, keep: jnp.where(jnp.asarray(keep)[None, :, :, None], x, value)  # noqa: E731
    return dataclasses.replace(
        p, k_pages=put(p.k_pages, live), v_pages=put(p.v_pages, live),
        k_old=put(p.k_old, live_old) if old else p.k_old,
        v_old=put(p.v_old, live_old) if old else p.v_old)


def poisoned_window_case(page_size: int, block_k: int):
    """(spec, poisoned problem) for a kernel under x64: a causal window of 4 that
    hides the older keys, NaN in every unowned slot, in the hidden keys and in
    the update form's pools, sinks of every kind (finite, +inf, -inf)."""
    from fnattn import AttentionSpec, PagedBlockSizes, masks
    p = make([(12, 2), (9, 1), (4, 4)], Hq=4, Hkv=2, D=8, page_size=page_size, max_seqs=4,
             pad_tokens=1, seed=6)
    pp = poisoned(p, old=True, hidden=lambda L, n, pos: pos < L - n - 4)
    spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(4),
                         sinks=jnp.array([0.5, jnp.inf, -jnp.inf, 0.0]),
                         block_sizes=PagedBlockSizes(block_k=block_k))
    return spec, pp


_reference = jax.jit(fnattn.reference)


def expected(spec, p: Problem, *, use_reference=False):
    """(out (T, Hq, Dv) f32, lse (Hq, T)) of every sequence's dense problem.

    By default from the float64 NumPy attention of tests/np_attention.py (fast: no
    compilation per sequence shape); with ``use_reference`` from ``fnattn.reference``
    under jit, one sequence at a time."""
    if not use_reference:
        return _expected_np(spec, p)
    T, Hq = p.q.shape[:2]
    Dv = p.v_tok[0].shape[-1] if p.v_tok else p.v_pages.shape[-1]
    out = np.zeros((T, Hq, Dv), np.float32)
    lse = np.full((Hq, T), -np.inf, np.float32)
    start = 0
    for s, (L, n) in enumerate(p.seqs):
        if n and L:
            res = _reference(spec, p.q[None, start:start + n], p.k_tok[s][None],
                             p.v_tok[s][None])
            out[start:start + n] = np.asarray(res.out[0], np.float32)
            lse[:, start:start + n] = np.asarray(res.lse[0])
        elif n and spec.sinks is not None:
            lse[:, start:start + n] = np.asarray(spec.sinks, np.float32)[:, None]
        start += n
    return out, lse


def _expected_np(spec, p: Problem):
    from np_attention import np_attention
    T, Hq, D = p.q.shape
    Dv = p.v_pages.shape[-1]
    out = np.zeros((T, Hq, Dv), np.float32)
    lse = np.full((Hq, T), -np.inf, np.float32)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    sinks = None if spec.sinks is None else f64(spec.sinks)
    start = 0
    for s, (L, n) in enumerate(p.seqs):
        if n and L:
            o, l, _ = np_attention(f64(p.q[start:start + n])[None], f64(p.k_tok[s])[None],
                                   f64(p.v_tok[s])[None], scale=spec.scale,
                                   softcap=spec.softcap, sinks=sinks,
                                   mask=np_mask(spec.mask, s, Hq, n, L))
            out[start:start + n] = o[0]
            lse[:, start:start + n] = l[0]
        elif n and sinks is not None:
            lse[:, start:start + n] = sinks[:, None]
        start += n
    return out, lse


def dense_packed(spec, p: Problem, q, ks, vs):
    """``fnattn.reference`` on every sequence's dense tokens (ks[s], vs[s]), packed like
    q: (out (T, Hq, Dv), lse (Hq, T)), padding rows 0 and -inf. Differentiable."""
    outs, lses, start = [], [], 0
    for s, (_, n) in enumerate(p.seqs):
        r = fnattn.reference(spec, q[None, start:start + n], ks[s][None], vs[s][None])
        outs.append(r.out[0])
        lses.append(r.lse[0])
        start += n
    pad = q.shape[0] - start
    out = jnp.concatenate(outs + [jnp.zeros((pad,) + outs[0].shape[1:])])
    lse = jnp.concatenate(lses + [jnp.full((lses[0].shape[0], pad), -jnp.inf)], axis=1)
    return out, lse


def to_pool(p: Problem, per_seq, like):
    """Per-sequence token arrays (L, Hkv, D) placed at their pool slots of an array
    of zeros shaped like the pool ``like`` (e.g. dense gradients as pool gradients)."""
    ps = like.shape[2]
    pool = np.zeros(like.shape, np.float32)
    for s, (L, _) in enumerate(p.seqs):
        for pos in range(L):
            pool[:, int(p.page_table[s, pos // ps]), pos % ps] = per_seq[s][pos]
    return pool


def assert_close(out, lse, want_out, want_lse, tol):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    lse = np.asarray(lse)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    np.testing.assert_allclose(np.where(np.isfinite(lse), lse, 0),
                               np.where(np.isfinite(want_lse), want_lse, 0), atol=tol, rtol=tol)


def meta(p: Problem):
    return dict(page_table=p.page_table, context_lengths=p.context_lengths,
                query_start_loc=p.query_start_loc, num_seqs=p.num_seqs)


def ragged(table, spec, p: Problem):
    """ragged_paged_attention under jit with a lowering table (None: spec.impl's)."""
    from fnattn.paged import api
    f = jax.jit(lambda spec, q, kp, vp, m: api.ragged_paged_attention_with(
        table, spec, q, kp, vp, **m))
    return f(spec, p.q, p.k_pages, p.v_pages, meta(p))


def update(table, spec, p: Problem):
    """The cache-writing form on the pools that hold only the old tokens."""
    from fnattn.paged import api
    f = jax.jit(lambda spec, q, k, v, kp, vp, m: api.ragged_paged_attention_with_update_with(
        table, spec, q, k, v, kp, vp, **m))
    return f(spec, p.q, p.k_new, p.v_new, p.k_old, p.v_old, meta(p))


def check_ragged(table, spec, p: Problem, tol=2e-5, use_reference=False):
    res = ragged(table, spec, p)
    assert res.out.shape == (p.q.shape[0], p.q.shape[1], p.v_pages.shape[-1])
    assert res.out.dtype == p.q.dtype and res.lse.dtype == jnp.float32
    assert_close(res.out, res.lse, *expected(spec, p, use_reference=use_reference), tol)
    return res


def check_update(table, spec, p: Problem, tol=2e-5):
    res, kp, vp = update(table, spec, p)
    assert_close(res.out, res.lse, *expected(spec, p), tol)
    assert_pools_equal(kp, p.k_pages)
    assert_pools_equal(vp, p.v_pages)
    return res


def quantized(p: Problem, k_format, v_format=None, *, scale=None) -> Problem:
    """The problem with quantized pools (``fnattn.quant``; per-tensor formats get
    ``scale``, default one that saturates the pools' garbage), and its dense tokens
    replaced by what the pools hold dequantized: the expected results are then
    the float64 reference on the dequantized cache (quantization is the only
    approximation, and it is not tested here). The new tokens stay float: the
    update form quantizes them, and ``k_pages``/``v_pages`` are what it must
    write, bit for bit (each slot's codes and scale depend on its own values)."""
    from fnattn import quant
    v_format = k_format if v_format is None else v_format

    def q(x, fmt):
        s = None if fmt.per_token else (4.0 / fmt.max_code if scale is None else scale)
        return quant.quantize(x, fmt, scale=s)

    kp, vp = q(p.k_pages, k_format), q(p.v_pages, v_format)
    kd, vd = (np.asarray(quant.dequantize(x)) for x in (kp, vp))
    table, ps = np.asarray(p.page_table), p.k_pages.shape[2]

    def tokens(pool, s, L):
        return jnp.asarray(np.stack([pool[:, table[s, j // ps], j % ps] for j in range(L)])
                           if L else pool[:, :0, 0].transpose(1, 0, 2))

    k_tok = [tokens(kd, s, L) for s, (L, _) in enumerate(p.seqs)]
    v_tok = [tokens(vd, s, L) for s, (L, _) in enumerate(p.seqs)]
    return dataclasses.replace(p, k_pages=kp, v_pages=vp, k_old=q(p.k_old, k_format),
                               v_old=q(p.v_old, v_format), k_tok=k_tok, v_tok=v_tok)


def assert_pools_equal(got, want):
    """Pools (float or quantized: codes and scales) equal bit for bit."""
    g, w = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(g, w):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1
                                      else np.asarray(a),
                                      np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1
                                      else np.asarray(b))
