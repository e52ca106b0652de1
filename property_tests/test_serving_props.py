"""Fuzzed serving problems: merge, decode and ragged paged attention against dense ones.

* ``fnattn.merge``: attention over a concatenation of keys equals the merge of
  attention over the parts, for any split points (empty parts, parts in which some
  rows see no key), in any order, in every layout, and with sinks given once to
  the merge of parts computed without them.
* ``fnattn.decode``: ragged ``kv_lengths`` (0 and the whole cache included) and
  ``kv_starts``, 1 to 3 queries, MHA/GQA/MQA, every split-K factor, positional
  masks, soft-cap and sinks (some of -inf or +inf), ALiBi (some slopes huge), with
  large numbers, NaN or inf in every slot outside a sequence's range, on the XLA
  lowering and the Triton kernel: equals each sequence's dense problem.
  Its gradients (impl "auto", "xla" and "pallas") are each sequence's dense ones,
  exactly zero on the other slots, and its forward-mode tangents agree with them.
* ``fnattn.ragged_paged_attention`` (impl="xla", and impl="pallas", i.e. the
  Triton kernels interpreted on CPU) and its cache-writing form: random mixes of
  prefill, chunked-prefill, decode and idle sequences on permuted pages with
  padding tokens and padding sequences, page sizes, GQA ratios, windows, split
  and block sizes: equals each sequence's dense problem. With NaN or inf in every
  slot that holds no live token, its gradients and tangents are the dense ones,
  and the poisoned slots' gradients exactly zero.

The expected results are float64 NumPy (``tests/np_attention.py``). Sizes are drawn
from small sets so that few distinct shapes are compiled; the jitted functions are
module-level so that repeated shapes hit the compilation cache.
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import fnattn
from fnattn import AttentionSpec, DecodeBlockSizes, PagedBlockSizes, masks, position_bias
from cases import np_mask
from np_attention import np_attention, np_attention_grads
from strategies import assert_out_lse, examples, ragged_lengths

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "paged"))
import problems as paged  # noqa: E402  (tests/paged/problems.py)

HEADS = st.sampled_from([(2, 2), (4, 2), (3, 1)])   # MHA, GQA, MQA
TOL = 2e-5


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _rng(draw):
    return np.random.default_rng(draw(st.integers(0, 2**16)))


@st.composite
def positional_masks(draw, max_window=4, max_chunk=5):
    """None, causal, causal & sliding_window(w) or chunked(c) & causal."""
    kind = draw(st.sampled_from(["none", "causal", "window", "chunked"]))
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.causal() & masks.sliding_window(draw(st.integers(0, max_window)))
    return masks.chunked(draw(st.integers(1, max_chunk))) & masks.causal()


# ----------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------

@st.composite
def merge_problems(draw):
    """q, k, v (bthd), a dense (B, Hq, Tq, Tk) mask and sorted split points."""
    B = draw(st.sampled_from([1, 2]))
    Tq = draw(st.sampled_from([1, 3, 4]))
    Tk = draw(st.sampled_from([5, 8]))
    Hq, Hkv = draw(HEADS)
    rs = _rng(draw)
    q = rs.standard_normal((B, Tq, Hq, 4)).astype(np.float32)
    k = rs.standard_normal((B, Tk, Hkv, 4)).astype(np.float32)
    v = rs.standard_normal((B, Tk, Hkv, 3)).astype(np.float32)
    kind = draw(st.sampled_from(["positional", "random"]))
    if kind == "positional":
        m = draw(positional_masks())
        dense = np.asarray(masks.materialize(m, B, Hq, Tq, Tk))
    else:
        dense = rs.random((B, Hq, Tq, Tk)) < 0.5
        dense[rs.integers(B), rs.integers(Hq), rs.integers(Tq)] = False  # a row sees no key
    dense = np.broadcast_to(dense, (B, Hq, Tq, Tk)).copy()
    # 1 to 3 cut points anywhere in [0, Tk], repeats allowed: empty parts occur.
    cuts = sorted(draw(st.integers(0, Tk)) for _ in range(draw(st.integers(1, 3))))
    return q, k, v, dense, [0, *cuts, Tk]


def _to_layout(out, lse, layout):
    """A bthd (out, lse) in ``layout`` ("thd": a list over b)."""
    if layout == "bthd":
        return out, lse
    if layout == "bhtd":
        return jnp.swapaxes(out, 1, 2), lse
    return [(out[b], lse[b]) for b in range(out.shape[0])]


@functools.partial(jax.jit, static_argnames=("bounds", "order", "layout", "impl", "softcap"))
def _attend_parts_and_merge(q, k, v, dense_mask, sinks, *, bounds, order, layout, impl,
                            softcap):
    """Attention (without sinks) over keys ``bounds[i]:bounds[i + 1]`` for every i, then
    ``fnattn.merge`` of the parts taken in ``order`` (a list of results for "thd")."""
    B, Tq, Hq, _ = q.shape
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            # Attention over no key: out = 0, lse = -inf (fnattn refuses an empty k
            # axis and tells the caller to mask the keys; this is what that gives).
            parts.append((jnp.zeros((B, Tq, Hq, v.shape[-1])),
                          jnp.full((B, Hq, Tq), -jnp.inf)))
            continue
        spec = AttentionSpec(mask=masks.from_array(dense_mask[..., a:b]), softcap=softcap,
                             impl=impl)
        r = fnattn.attention(spec, q, k[:, a:b], v[:, a:b])
        parts.append((r.out, r.lse))
    parts = [_to_layout(*parts[i], layout) for i in order]
    if layout == "thd":
        return [fnattn.merge([p[b] for p in parts], layout="thd", sinks=sinks)
                for b in range(B)]
    return fnattn.merge(parts, layout=layout, sinks=sinks)


@given(merge_problems(), st.sampled_from(["bthd", "bhtd", "thd"]),
       st.sampled_from(["xla", "reference"]), st.booleans(), st.booleans(),
       st.integers(0, 2**16))
def test_merge_of_parts_equals_attention_over_all_keys(prob, layout, impl, use_sinks,
                                                       use_softcap, seed):
    q, k, v, dense, bounds = prob
    B, Tq, Hq, _ = q.shape
    rs = np.random.default_rng(seed)
    sinks = jnp.asarray(rs.standard_normal(Hq) * 2, jnp.float32) if use_sinks else None
    softcap = 2.0 if use_softcap else None
    order = tuple(int(i) for i in rs.permutation(len(bounds) - 1))  # any order merges alike
    res = _attend_parts_and_merge(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                  jnp.asarray(dense), sinks, bounds=tuple(bounds), order=order,
                                  layout=layout, impl=impl, softcap=softcap)
    want_out, want_lse, _ = np_attention(q, k, v, softcap=softcap, mask=dense,
                                         sinks=None if sinks is None else _f64(sinks))
    if layout == "thd":
        for b in range(B):
            assert res[b].out.dtype == jnp.float32 and res[b].lse.dtype == jnp.float32
            assert_out_lse(res[b].out, res[b].lse, want_out[b], want_lse[b], 1e-5)
        return
    assert res.out.dtype == jnp.float32 and res.lse.dtype == jnp.float32
    out = res.out if layout == "bthd" else jnp.swapaxes(res.out, 1, 2)
    assert_out_lse(out, res.lse, want_out, want_lse, 1e-5)


# ----------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------

DECODE_S = 12  # cache slots per sequence; splits are its divisors


@jax.jit
def _decode(spec, q, k_cache, v_cache, kv_lengths, kv_starts):
    return fnattn.decode(spec, q, k_cache, v_cache, kv_lengths=kv_lengths, kv_starts=kv_starts)


def _decode_cache(rs, B, Tq, Hq, Hkv, lengths, garbage):
    """``q, k, v, starts, k_seq, v_seq`` (NumPy float32, bthd, D = 4, Dv = 3):
    each sequence's keys ``k_seq[b]`` at slots ``starts[b]`` onwards of a cache
    of ``DECODE_S`` slots. The other slots hold garbage that must never be seen:
    large numbers, NaN or inf (a released request's leftovers)."""
    S = DECODE_S
    starts = np.array([rs.integers(0, S - L + 1) for L in lengths], np.int32)
    k = rs.uniform(-1e4, 1e4, (B, S, Hkv, 4)).astype(np.float32)
    v = rs.uniform(-1e4, 1e4, (B, S, Hkv, 3)).astype(np.float32)
    if garbage != "large":
        k[:] = v[:] = np.nan if garbage == "nan" else np.inf
        v[..., 1] = -np.inf if garbage == "inf" else np.nan
    q = rs.standard_normal((B, Tq, Hq, 4)).astype(np.float32)
    k_seq = [rs.standard_normal((L, Hkv, 4)).astype(np.float32) for L in lengths]
    v_seq = [rs.standard_normal((L, Hkv, 3)).astype(np.float32) for L in lengths]
    for b, (a, L) in enumerate(zip(starts, lengths)):
        k[b, a:a + L], v[b, a:a + L] = k_seq[b], v_seq[b]
    return q, k, v, starts, k_seq, v_seq


def _alibi(rs, Hq, kind, mask):
    """``(term, slopes, mask)``: no term, ALiBi with ordinary slopes, or with one
    head's slope huge (1e8 to 1e30) and, half the time, the keys within
    distance 1 hidden, so that every logit such a row sees is huge."""
    if kind == "no":
        return None, None, mask
    slopes = rs.uniform(0.1, 1.0, Hq)
    if kind == "huge":
        slopes[rs.integers(Hq)] = rs.choice([1e8, 1e20, 1e30])
        if rs.integers(2):
            far = ~masks.sliding_window(1, 0)
            mask = far if mask is None else mask & far
    slopes = np.asarray(slopes, np.float32)
    return position_bias.alibi(jnp.asarray(slopes)), slopes, mask


def _alibi_bias(slopes, Tq, L):
    """The term of one sequence of ``L`` keys, (1, Hq, Tq, L) float64."""
    q_pos = L - Tq + np.arange(Tq)
    dist = np.abs(q_pos[:, None] - np.arange(L)[None, :])
    return -np.asarray(slopes, np.float64)[None, :, None, None] * dist[None, None]


@given(st.sampled_from([1, 2, 3]), st.integers(1, 3), HEADS, st.data(),
       positional_masks(), st.sampled_from([1, 2, 3, 4, 6, 12]), st.sampled_from([None, 2.0]),
       st.sampled_from(["no", "finite", "-inf", "+inf"]), st.sampled_from([None, 0.4]),
       st.sampled_from(["bthd", "bhtd"]), st.sampled_from(["large", "nan", "inf"]),
       st.sampled_from(["no", "alibi", "huge"]), st.sampled_from(["auto", "pallas"]))
def test_decode_equals_dense_per_sequence(B, Tq, heads, data, mask, num_splits, softcap,
                                          sink_kind, scale, layout, garbage, term_kind, impl):
    """Also with ALiBi, some slopes huge (every logit a row sees may be -1e30
    times a distance), on the XLA lowering and on the Triton kernel
    (interpreted)."""
    Hq, Hkv = heads
    S = DECODE_S
    rs = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    lengths = np.asarray(data.draw(ragged_lengths(B, S)))      # 0 and S included
    q, k, v, starts, k_seq, v_seq = _decode_cache(rs, B, Tq, Hq, Hkv, lengths, garbage)
    term, slopes, mask = _alibi(rs, Hq, term_kind, mask)
    use_sinks = sink_kind != "no"
    sinks = None
    if use_sinks:
        sinks = rs.standard_normal(Hq)
        if sink_kind != "finite":
            sinks[rs.integers(Hq)] = np.inf if sink_kind == "+inf" else -np.inf
        sinks = jnp.asarray(sinks, jnp.float32)
    spec = AttentionSpec(mask=mask, softcap=softcap, sinks=sinks, scale=scale, layout=layout,
                         block_sizes=DecodeBlockSizes(num_splits=num_splits),
                         position_bias=term, impl=impl)
    t = (lambda x: x) if layout == "bthd" else (lambda x: np.swapaxes(x, 1, 2))
    res = _decode(spec, jnp.asarray(t(q)), jnp.asarray(t(k)), jnp.asarray(t(v)),
                  jnp.asarray(lengths, jnp.int32), jnp.asarray(starts))
    assert res.out.dtype == jnp.float32 and res.lse.shape == (B, Hq, Tq)
    want_out = np.zeros((B, Tq, Hq, 3))
    want_lse = np.full((B, Hq, Tq), -np.inf)
    for b, L in enumerate(lengths):
        if L == 0:
            if use_sinks:
                want_lse[b] = _f64(sinks)[:, None]
            continue
        o, l, _ = np_attention(q[b:b + 1], k_seq[b][None], v_seq[b][None], scale=scale,
                               softcap=softcap, sinks=None if sinks is None else _f64(sinks),
                               mask=np_mask(mask, b, Hq, Tq, int(L)),
                               bias=None if term is None else _alibi_bias(slopes, Tq, int(L)))
        want_out[b], want_lse[b] = o[0], l[0]
    assert_out_lse(t(np.asarray(res.out)), res.lse, want_out, want_lse)


def _pullback_and_tangents(variant, spec, q, k, v, d_out, d_lse, tangents, **kw):
    """The pullback of (d_out, d_lse) and the jvp along ``tangents`` (of q, k, v
    and the sinks) of ``variant(spec, q, k, v, **kw)``'s (out, lse)."""
    def f(q, k, v, sinks):
        r = variant(spec.replace(sinks=sinks), q, k, v, **kw)
        return r.out, r.lse

    primals = (q, k, v, spec.sinks)
    _, pullback = jax.vjp(f, *primals)
    _, (t_out, t_lse) = jax.jvp(f, primals, tangents)
    return pullback((d_out, d_lse)), t_out, t_lse


def _tangents_for(rs, primals):
    """Random float32 tangents of the arrays ``primals`` (None for absent sinks)."""
    return [None if x is None else rs.standard_normal(np.shape(x)).astype(np.float32)
            for x in primals]


def _check_derivatives(got, want, t_out, t_lse, d_out, d_lse, tangents):
    """Gradients ``got`` (dq, dk, dv, dsinks) against the float64 ``want`` (dict),
    finite; the tangents finite and equal to them by duality:
    <d_out, t_out> + <d_lse, t_lse> = sum of <gradient, tangent>."""
    names = ("dq", "dk", "dv", "dsinks")
    for name, x, t in zip(names, got, tangents):
        if t is None:
            continue
        x = np.asarray(x, np.float64)
        assert np.isfinite(x).all(), name
        np.testing.assert_allclose(x, want[name], atol=1e-4, rtol=1e-4, err_msg=name)
    t_out, t_lse = np.asarray(t_out, np.float64), np.asarray(t_lse, np.float64)
    assert np.isfinite(t_out).all() and np.isfinite(t_lse).all()
    lhs = (t_out * d_out).sum() + (t_lse * d_lse).sum()
    terms = [(want[n] * t).sum() for n, t in zip(names, tangents) if t is not None]
    assert abs(lhs - sum(terms)) <= 1e-4 * (1 + sum(abs(t) for t in terms)), (lhs, terms)


@functools.partial(jax.jit, static_argnames="impl")
def _decode_derivatives(spec, q, k, v, lengths, starts, d_out, d_lse, tangents, *, impl):
    return _pullback_and_tangents(fnattn.decode, spec.replace(impl=impl), q, k, v, d_out,
                                  d_lse, tangents, kv_lengths=lengths, kv_starts=starts)


@examples(10)
@given(st.sampled_from([1, 2, 3]), st.integers(1, 3), HEADS, st.data(),
       positional_masks(), st.sampled_from([1, 2, 3, 4, 6, 12]), st.sampled_from([None, 2.0]),
       st.sampled_from(["no", "finite", "-inf"]), st.sampled_from([None, 0.4]),
       st.sampled_from(["large", "nan", "inf"]), st.sampled_from(["auto", "xla", "pallas"]))
def test_decode_derivatives_equal_dense_per_sequence(B, Tq, heads, data, mask, num_splits,
                                                     softcap, sink_kind, scale, garbage, impl):
    """Gradients and forward-mode tangents of decode over a cache whose slots
    outside each sequence hold large numbers, NaN or inf: the gradients of the
    sequences' slots are each sequence's dense ones (float64 NumPy), those of the
    other slots exactly zero, and a jvp along random tangents (garbage slots
    included) is finite and agrees with them by duality."""
    Hq, Hkv = heads
    rs = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    lengths = np.asarray(data.draw(ragged_lengths(B, DECODE_S)))
    q, k, v, starts, k_seq, v_seq = _decode_cache(rs, B, Tq, Hq, Hkv, lengths, garbage)
    sinks = None
    if sink_kind != "no":
        sinks = rs.standard_normal(Hq)
        if sink_kind == "-inf":
            sinks[rs.integers(Hq)] = -np.inf
    spec = AttentionSpec(mask=mask, softcap=softcap, scale=scale,
                         sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32),
                         block_sizes=DecodeBlockSizes(num_splits=num_splits))
    d_out = rs.standard_normal((B, Tq, Hq, 3)).astype(np.float32)
    d_lse = rs.standard_normal((B, Hq, Tq)).astype(np.float32)
    tangents = _tangents_for(rs, (q, k, v, sinks))
    grads, t_out, t_lse = _decode_derivatives(
        spec, *(jnp.asarray(x) for x in (q, k, v, lengths, starts, d_out, d_lse)),
        tuple(None if t is None else jnp.asarray(t) for t in tangents), impl=impl)
    want = dict(dq=np.zeros(q.shape), dk=np.zeros(k.shape), dv=np.zeros(v.shape),
                dsinks=np.zeros(Hq))
    for b, (a, L) in enumerate(zip(starts, lengths)):
        if L == 0:   # lse is the sink: its cotangent goes there, nothing else moves
            if sinks is not None:
                want["dsinks"] += np.where(np.isfinite(sinks), d_lse[b].sum(-1), 0.0)
            continue
        g = np_attention_grads(q[b:b + 1], k_seq[b][None], v_seq[b][None], d_out[b:b + 1],
                               d_lse[b:b + 1], scale=scale, softcap=softcap, sinks=sinks,
                               mask=np_mask(mask, b, Hq, Tq, int(L)))
        want["dq"][b] = g["dq"][0]
        want["dk"][b, a:a + L], want["dv"][b, a:a + L] = g["dk"][0], g["dv"][0]
        if sinks is not None:
            want["dsinks"] += g["dsinks"]
    _check_derivatives(grads, want, t_out, t_lse, d_out, d_lse, tangents)
    for b, (a, L) in enumerate(zip(starts, lengths)):   # the garbage slots: exactly zero
        outside = np.ones(DECODE_S, bool)
        outside[a:a + L] = False
        assert not np.asarray(grads[1])[b, outside].any()
        assert not np.asarray(grads[2])[b, outside].any()


# ----------------------------------------------------------------------------------
# ragged paged attention
# ----------------------------------------------------------------------------------

MAX_L = 13            # longest context
MAX_SEQS = 5          # page-table rows; the rows past the live sequences are padding
NUM_PAGES = 4 * -(-MAX_L // 2) + 3
T_BUCKETS = (12, 28)  # packed token counts (the rest of a bucket is padding tokens)


@st.composite
def sequences(draw, max_seqs=4):
    """[(L, n)]: prefill (n = L), chunked prefill (n < L), decode (n = 1) and idle
    (n = 0: a live sequence with no new token this step)."""
    seqs = []
    for _ in range(draw(st.integers(1, max_seqs))):
        kind = draw(st.sampled_from(["prefill", "chunked", "decode", "idle"]))
        if kind == "prefill":
            n = draw(st.integers(1, 6))
            seqs.append((n, n))
        elif kind == "chunked":
            n = draw(st.integers(1, 5))
            seqs.append((draw(st.integers(n + 1, MAX_L)), n))
        else:
            seqs.append((draw(st.integers(1, MAX_L)), int(kind == "decode")))
    return seqs


@st.composite
def ragged_problems(draw, page_sizes=(2, 3, 4), block_sizes=True, impl="xla"):
    """(spec, paged.Problem) with the pool, table and metadata shapes from small sets."""
    seqs = draw(sequences())
    Hq, Hkv = draw(HEADS)
    ps = draw(st.sampled_from(page_sizes))
    Dv = draw(st.sampled_from([3, 4]))
    tokens = sum(n for _, n in seqs) + draw(st.integers(0, 2))  # a few padding tokens
    T = min(t for t in T_BUCKETS if t >= tokens)
    p = paged.make(seqs, Hq=Hq, Hkv=Hkv, D=4, Dv=Dv, page_size=ps,
                   pages_per_seq=-(-MAX_L // ps), num_pages=NUM_PAGES, max_seqs=MAX_SEQS,
                   pad_tokens=T - sum(n for _, n in seqs), seed=draw(st.integers(0, 2**16)))
    bs = None
    if block_sizes and draw(st.booleans()):
        bs = PagedBlockSizes(block_q=draw(st.sampled_from([None, 1, 2, 3])),
                             block_k=draw(st.sampled_from([None, 2, 4, 5])),
                             num_splits=draw(st.sampled_from([None, 1, 2, 3])))
    rs = _rng(draw)
    sinks = jnp.asarray(rs.standard_normal(Hq), jnp.float32) if draw(st.booleans()) else None
    spec = AttentionSpec(mask=draw(positional_masks()), softcap=draw(st.sampled_from([None, 3.0])),
                         sinks=sinks, scale=draw(st.sampled_from([None, 0.6])), block_sizes=bs,
                         impl=impl)
    return spec, p


@jax.jit
def _ragged(spec, q, k_pages, v_pages, meta):
    return fnattn.ragged_paged_attention(spec, q, k_pages, v_pages, **meta)


@jax.jit
def _ragged_update(spec, q, k, v, k_pages, v_pages, meta):
    return fnattn.ragged_paged_attention_with_update(spec, q, k, v, k_pages, v_pages, **meta)


def _check_ragged(spec, p):
    res = _ragged(spec, p.q, p.k_pages, p.v_pages, paged.meta(p))
    assert res.out.dtype == p.q.dtype and res.lse.dtype == jnp.float32
    paged.assert_close(res.out, res.lse, *paged.expected(spec, p), TOL)


def _check_update(spec, p):
    # The pools hold only the old tokens (and garbage elsewhere); the call writes
    # the new ones, attends, and leaves every other slot as it was.
    res, kp, vp = _ragged_update(spec, p.q, p.k_new, p.v_new, p.k_old, p.v_old, paged.meta(p))
    paged.assert_close(res.out, res.lse, *paged.expected(spec, p), TOL)
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(p.k_pages))
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(p.v_pages))


@given(ragged_problems())
def test_ragged_paged_xla_equals_dense_per_sequence(prob):
    _check_ragged(*prob)


@examples(10)
@given(ragged_problems())
def test_ragged_paged_update_xla_writes_then_equals_dense(prob):
    _check_update(*prob)


@functools.partial(jax.jit, static_argnames="impl")
def _ragged_derivatives(spec, q, k_pages, v_pages, meta, d_out, d_lse, tangents, *, impl):
    return _pullback_and_tangents(fnattn.ragged_paged_attention, spec.replace(impl=impl), q,
                                  k_pages, v_pages, d_out, d_lse, tangents, **meta)


@examples(8)
@given(ragged_problems(), st.sampled_from([None, np.nan, np.inf]),
       st.sampled_from(["auto", "xla"]), st.integers(0, 2**16))
def test_ragged_paged_derivatives_equal_dense_per_sequence(prob, poison, impl, seed):
    """Gradients and forward-mode tangents of ragged paged attention over pools
    whose slots that hold no live token are large numbers, NaN or inf: dq and
    the pools' gradients at the live slots are each sequence's dense ones
    (float64 NumPy), the other slots' gradients exactly zero, and a jvp along
    random tangents (every slot included) is finite and agrees by duality."""
    spec, p = prob
    pp = p if poison is None else paged.poisoned(p, poison)
    rs = np.random.default_rng(seed)
    T, Hq, D = p.q.shape
    Dv = p.v_pages.shape[-1]
    d_out = rs.standard_normal((T, Hq, Dv)).astype(np.float32)
    d_lse = rs.standard_normal((Hq, T)).astype(np.float32)
    tangents = _tangents_for(rs, (pp.q, pp.k_pages, pp.v_pages, spec.sinks))
    grads, t_out, t_lse = _ragged_derivatives(
        spec, pp.q, pp.k_pages, pp.v_pages, paged.meta(p), jnp.asarray(d_out),
        jnp.asarray(d_lse), tuple(None if t is None else jnp.asarray(t) for t in tangents),
        impl=impl)
    sinks = None if spec.sinks is None else _f64(spec.sinks)
    want = dict(dq=np.zeros((T, Hq, D)), dsinks=np.zeros(Hq))
    dks, dvs, start = [], [], 0
    for s, (L, n) in enumerate(p.seqs):
        rows = slice(start, start + n)
        if n == 0:
            dks.append(np.zeros((L,) + p.k_tok[s].shape[1:]))
            dvs.append(np.zeros((L,) + p.v_tok[s].shape[1:]))
            continue
        g = np_attention_grads(_f64(p.q[rows])[None], _f64(p.k_tok[s])[None],
                               _f64(p.v_tok[s])[None], d_out[None, rows],
                               d_lse[:, rows][None], scale=spec.scale, softcap=spec.softcap,
                               sinks=sinks, mask=np_mask(spec.mask, s, Hq, n, L))
        want["dq"][rows] = g["dq"][0]
        dks.append(g["dk"][0])
        dvs.append(g["dv"][0])
        if sinks is not None:
            want["dsinks"] += g["dsinks"]
        start += n
    want["dk"] = paged.to_pool(p, dks, p.k_pages)
    want["dv"] = paged.to_pool(p, dvs, p.v_pages)
    _check_derivatives(grads, want, t_out, t_lse, d_out, d_lse, tangents)
    if poison is not None:   # the poisoned slots: exactly zero
        bad = ~np.isfinite(np.asarray(pp.k_pages))[..., 0]
        assert not np.asarray(grads[1])[bad].any() and not np.asarray(grads[2])[bad].any()


# The Mosaic branch (traced on every platform) needs pages of a multiple of 8 rows.
_pallas_problems = ragged_problems(page_sizes=(8,), impl="pallas")


@examples(4)
@given(_pallas_problems)
def test_ragged_paged_pallas_interpret_equals_dense_per_sequence(prob):
    _check_ragged(*prob)


@examples(3)
@given(_pallas_problems)
def test_ragged_paged_update_pallas_interpret_equals_dense(prob):
    _check_update(*prob)
