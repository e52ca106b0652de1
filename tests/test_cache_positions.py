"""Positions from the paged caches: TokenSlots.positions (allocate_slots) and
ragged_metadata(..., return_positions=True) give each new token's position in its
sequence. Against a plain-Python count over a walk with unsorted and padded slot ids,
capacity overflows and releases, in both caches; and end to end, RoPE applied at the
cache's positions in a serving loop equals RoPE at 0 .. L-1 on the dense tokens under
fnattn.reference. Everything under jax.jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, PagedKVCache, masks
from fnattn.cache import LayeredPagedKVCache, TokenSlots, write_tokens

# 7 pages of 3 slots, 2 kv heads, head dim 6 (even, for RoPE), 4 slots of at most 3
# pages (capacity 9).
N, PS, HKV, D, S, P = 7, 3, 2, 6, 4, 3
CAP = P * PS
HQ = 4


def make(layered, num_pages=N):
    if layered:
        return LayeredPagedKVCache.create(num_layers=2, num_pages=num_pages, page_size=PS,
                                          num_kv_heads=HKV, head_dim=D, max_seqs=S,
                                          max_pages_per_seq=P)
    return PagedKVCache.create(num_pages=num_pages, page_size=PS, num_kv_heads=HKV,
                               head_dim=D, max_seqs=S, max_pages_per_seq=P)


def expected_positions(lengths, seq_ids):
    """Each token's position: its slot's length before the step plus the earlier tokens
    of that slot in the step; -1 without a slot. Returns (positions, new lengths)."""
    lengths = list(lengths)
    seen = [0] * S
    pos = []
    for s in seq_ids:
        if 0 <= s < S:
            pos.append(lengths[s] + seen[s])
            seen[s] += 1
        else:
            pos.append(-1)
    return pos, [min(lengths[s] + seen[s], CAP) for s in range(S)]


@pytest.mark.parametrize("layered", [False, True])
def test_allocate_slots_positions_follow_each_slots_length(layered):
    """Unsorted ids, padding (-1 and past max_seqs), a step past a slot's capacity (its
    positions still count on; the tokens are not stored), releases; a pool big enough
    never to run out, so only the capacity limits."""
    step = jax.jit(lambda c, ids: c.allocate_slots(ids))
    release = jax.jit(lambda c, s: c.release(s))
    cache = make(layered, num_pages=S * P)
    lengths = [0] * S
    steps = [[2, 0, 2, -1, 1, 2], [0, 0, 3, 2, S, -1], [1, 1, 1, 1, 1, 1],
             [1, 1, 1, 1, 0, 3], "release 1", [1, 3, 1, 2, 2, 2], [2, 2, 2, 2, 2, 2]]
    went_past = False
    for ids in steps:
        if ids == "release 1":
            cache, lengths[1] = release(cache, jnp.int32(1)), 0
            continue
        want, lengths = expected_positions(lengths, ids)
        cache, slots = step(cache, jnp.array(ids, jnp.int32))
        assert slots.positions.dtype == jnp.int32
        assert slots.positions.tolist() == want
        assert cache.lengths.tolist() == lengths
        # A token past the capacity has its position but no slot in the pool.
        past = np.array(want) >= CAP
        went_past |= past.any()
        assert (np.asarray(slots.index)[past] == S * P * PS).all()   # num_pages * page_size
    assert went_past


@pytest.mark.parametrize("layered", [False, True])
def test_ragged_metadata_positions_equal_allocate_slots_positions(layered):
    """Tokens packed by slot: the positions ragged_metadata derives from the lengths
    after the step equal those allocate_slots counts from the lengths before it."""

    @jax.jit
    def step(cache, ids):
        cache, slots = cache.allocate_slots(ids)
        meta, pos = cache.ragged_metadata(ids, return_positions=True)
        plain = cache.ragged_metadata(ids)
        return cache, slots.positions, pos, meta, plain

    cache = make(layered)
    lengths = [0] * S
    for ids in ([0, 0, 0, 2, 2, -1], [0, 1, 1, 2, 3, 3], [1, 2, 2, 2, -1, -1],
                [-1] * 6):
        want, lengths = expected_positions(lengths, ids)
        cache, from_slots, pos, meta, plain = step(cache, jnp.array(ids, jnp.int32))
        assert pos.dtype == jnp.int32
        assert pos.tolist() == want == from_slots.tolist()
        assert meta.keys() == plain.keys()
        for name in meta:
            np.testing.assert_array_equal(meta[name], plain[name])


def rope(x, pos):
    """Rotary embedding of x (T, H, D) at integer positions pos (T,), in float32 (the
    halves rotated as in GPT-NeoX / Llama)."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = pos.astype(jnp.float32)[:, None, None] * freq
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * jnp.cos(ang) - b * jnp.sin(ang),
                            a * jnp.sin(ang) + b * jnp.cos(ang)], axis=-1)


SPEC = AttentionSpec(mask=masks.causal())


@functools.partial(jax.jit, donate_argnums=0)
def serve(cache, ids, q, k, v):
    """One step of a layered cache's model with RoPE at the cache's positions."""
    cache, slots = cache.allocate_slots(ids)
    meta = cache.ragged_metadata(ids)
    q, k = rope(q, slots.positions), rope(k, slots.positions)

    def layer(_, pools):
        kp, vp = write_tokens(*pools, slots, k, v)
        return None, (kp, vp, fnattn.ragged_paged_attention(SPEC, q, kp, vp, **meta).out)

    _, (kp, vp, out) = jax.lax.scan(layer, None, (cache.k_pages, cache.v_pages))
    return cache.replace(k_pages=kp, v_pages=vp), out


_reference = jax.jit(lambda q, k, v: fnattn.reference(SPEC, q[None], k[None], v[None]).out[0])


def test_rope_at_cache_positions_equals_rope_on_the_dense_sequence():
    """Prefill, decode, chunked prefill, a release and a new sequence in the freed slot:
    every live row equals fnattn.reference on the dense sequence with RoPE at
    0 .. L-1, in every layer."""
    rng = np.random.default_rng(0)
    cache = make(True, num_pages=12)
    dense = {s: (np.zeros((0, HQ, D), np.float32), np.zeros((0, HKV, D), np.float32),
                 np.zeros((0, HKV, D), np.float32)) for s in range(S)}
    steps = [[0, 0, 0, 0, 2, 2, -1], [0, 1, 1, 2, -1, -1, -1], [0, 2, 2, 2, 3, 3, 3],
             "release 0", [0, 0, 1, 3, -1, -1, -1]]
    for ids in steps:
        if ids == "release 0":
            cache = jax.jit(lambda c: c.release(0))(cache)
            dense[0] = tuple(x[:0] for x in dense[0])
            continue
        ids = np.array(ids, np.int32)
        q = rng.standard_normal((len(ids), HQ, D)).astype(np.float32)
        k = rng.standard_normal((len(ids), HKV, D)).astype(np.float32)
        v = rng.standard_normal((len(ids), HKV, D)).astype(np.float32)
        cache, out = serve(cache, jnp.asarray(ids), q, k, v)
        for s in range(S):
            rows = ids == s
            if not rows.any():
                continue
            dense[s] = tuple(np.concatenate([a, b[rows]]) for a, b in zip(dense[s], (q, k, v)))
            dq, dk, dv = (jnp.asarray(x) for x in dense[s])
            pos = jnp.arange(dq.shape[0])
            want = _reference(rope(dq, pos), rope(dk, pos), dv)[-rows.sum():]
            for layer in range(2):
                np.testing.assert_allclose(out[layer][rows], want, atol=2e-5, rtol=2e-5)


def test_hand_built_slots_have_no_positions_and_still_write():
    kp = vp = jnp.zeros((1, 3, 2, 1))
    slots = TokenSlots(jnp.array([5, 0]))
    assert slots.positions is None
    kp, _ = jax.jit(write_tokens)(kp, vp, slots, jnp.ones((2, 1, 1)), jnp.ones((2, 1, 1)))
    assert kp[0, :, :, 0].tolist() == [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]
