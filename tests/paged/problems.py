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
    T = sum(n for _, n in seqs) + pad_tokens
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


_reference = jax.jit(fnattn.reference)


def expected(spec, p: Problem):
    """(out (T, Hq, Dv) f32, lse (Hq, T)) from fnattn.reference per sequence."""
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


def assert_close(out, lse, want_out, want_lse, tol):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    lse = np.asarray(lse)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    np.testing.assert_allclose(np.where(np.isfinite(lse), lse, 0),
                               np.where(np.isfinite(want_lse), want_lse, 0), atol=tol, rtol=tol)
