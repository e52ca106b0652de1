"""End to end: a tiny decoder served from a PagedKVCache with ragged paged attention.

A two-layer decoder (embedding, per-layer q/k/v projections with GQA and rotary
embeddings, attention, MLP, logits; random float32 weights) generates tokens
greedily for a stream of prompts of different lengths. The serving loop keeps
``MAX_SEQS`` slots: the first step prefills the first prompts as one ragged batch,
later steps decode one token per live sequence; a sequence that has its tokens
releases its slot, and a waiting prompt joins in the freed slot at the next step
(its prefill packed with the other sequences' decode tokens). Every step is one
jitted call: ``PagedKVCache.allocate`` and ``ragged_paged_attention_with_update``
per layer.

At every step, the logits of every new token and the greedy next token of every
live sequence equal recomputing the whole sequence from scratch with dense causal
attention (``fnattn.reference`` with ``masks.causal()``). At one pure decode step
the same logits also come from ``fnattn.decode`` on contiguous caches (filled
from the from-scratch keys and values at random offsets, garbage elsewhere).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from fnattn import AttentionSpec, DecodeBlockSizes, PagedKVCache, masks

VOCAB, DIM, HQ, HKV, HD, MLP, LAYERS = 61, 24, 4, 2, 8, 40, 2
PAGE, PAGES_PER_SEQ, NUM_PAGES, MAX_SEQS = 4, 6, 16, 3
CAPACITY = PAGE * PAGES_PER_SEQ            # tokens one slot holds
PREFILL_TOKENS = 24                        # packed tokens of a step that prefills
CONTIGUOUS_S = 32                          # slots per sequence of the contiguous cache

# (prompt length, tokens to generate): six requests for three slots.
REQUESTS = [(6, 3), (11, 6), (3, 5), (9, 2), (5, 7), (7, 4)]

CAUSAL = AttentionSpec(mask=masks.causal())


# ----------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------


def init_params(key):
    keys = iter(jax.random.split(key, 2 + 6 * LAYERS))

    def normal(shape, fan_in):
        return jax.random.normal(next(keys), shape, jnp.float32) * fan_in ** -0.5

    layers = [dict(wq=normal((DIM, HQ * HD), DIM), wk=normal((DIM, HKV * HD), DIM),
                   wv=normal((DIM, HKV * HD), DIM), wo=normal((HQ * HD, DIM), HQ * HD),
                   w1=normal((DIM, MLP), DIM), w2=normal((MLP, DIM), MLP))
              for _ in range(LAYERS)]
    return dict(embed=normal((VOCAB, DIM), 1), layers=layers, unembed=normal((DIM, VOCAB), DIM))


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def rope(x, positions):
    """Rotary embedding of x (..., T, H, HD) at integer positions (..., T)."""
    half = HD // 2
    freq = 1.0 / 100.0 ** (jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                            x1 * jnp.sin(angle) + x2 * jnp.cos(angle)], axis=-1)


def project_qkv(layer, x, positions):
    """x (..., T, DIM) -> q (..., T, HQ, HD), k and v (..., T, HKV, HD)."""
    h = rms_norm(x)
    lead = x.shape[:-1]
    q = (h @ layer["wq"]).reshape(*lead, HQ, HD)
    k = (h @ layer["wk"]).reshape(*lead, HKV, HD)
    v = (h @ layer["wv"]).reshape(*lead, HKV, HD)
    return rope(q, positions), rope(k, positions), v


def finish_layer(layer, x, attn):
    """Output projection and MLP, both residual; attn (..., T, HQ, HD)."""
    x = x + attn.reshape(*attn.shape[:-2], HQ * HD) @ layer["wo"]
    return x + jax.nn.gelu(rms_norm(x) @ layer["w1"]) @ layer["w2"]


def logits_of(params, x):
    return rms_norm(x) @ params["unembed"]


@jax.jit
def forward_from_scratch(params, tokens):
    """Dense causal model on (B, L) tokens: logits (B, L, VOCAB) and per layer (k, v)."""
    B, L = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    x = params["embed"][tokens]
    kvs = []
    for layer in params["layers"]:
        q, k, v = project_qkv(layer, x, positions)
        kvs.append((k, v))
        x = finish_layer(layer, x, fnattn.reference(CAUSAL, q, k, v).out)
    return logits_of(params, x), kvs


@jax.jit
def paged_step(params, caches, tokens, seq_ids, positions):
    """One serving step over packed tokens (sorted by slot, -1 slots for padding).

    Makes room for the new tokens in every layer's cache, then per layer writes their
    k/v into the pages and attends over each sequence's context in one call."""
    caches = [cache.allocate(seq_ids) for cache in caches]
    meta = caches[0].ragged_metadata(seq_ids)   # the same pages in every layer
    x = params["embed"][tokens]
    updated = []
    for layer, cache in zip(params["layers"], caches):
        q, k, v = project_qkv(layer, x, positions)
        res, k_pages, v_pages = fnattn.ragged_paged_attention_with_update(
            CAUSAL, q, k, v, cache.k_pages, cache.v_pages, **meta)
        updated.append(cache.replace(k_pages=k_pages, v_pages=v_pages))
        x = finish_layer(layer, x, res.out)
    return logits_of(params, x), updated


release = jax.jit(PagedKVCache.release)


@jax.jit
def contiguous_decode_step(params, k_caches, v_caches, tokens, positions, kv_lengths, kv_starts):
    """One token per sequence against contiguous (B, S, HKV, HD) caches with fnattn.decode;
    the new token's k/v is written at slot ``kv_starts + positions`` first."""
    B = tokens.shape[0]
    x = params["embed"][tokens][:, None]
    spec = CAUSAL.replace(block_sizes=DecodeBlockSizes(num_splits=2))
    rows = jnp.arange(B)
    for layer, k_cache, v_cache in zip(params["layers"], k_caches, v_caches):
        q, k, v = project_qkv(layer, x, positions[:, None])
        slot = kv_starts + positions
        k_cache = k_cache.at[rows, slot].set(k[:, 0])
        v_cache = v_cache.at[rows, slot].set(v[:, 0])
        res = fnattn.decode(spec, q, k_cache, v_cache, kv_lengths=kv_lengths,
                            kv_starts=kv_starts)
        x = finish_layer(layer, x, res.out)
    return logits_of(params, x)[:, 0]


# ----------------------------------------------------------------------------------
# The serving loop
# ----------------------------------------------------------------------------------


def check_decode_on_contiguous_cache(params, ref_kvs, live, seqs, paged_last_logits, rng):
    """fnattn.decode on contiguous caches holding the earlier tokens (from scratch) at
    random offsets gives the paged step's logits."""
    B = MAX_SEQS
    k_caches = [rng.uniform(-50, 50, (B, CONTIGUOUS_S, HKV, HD)).astype(np.float32)
                for _ in range(LAYERS)]
    v_caches = [rng.uniform(-50, 50, (B, CONTIGUOUS_S, HKV, HD)).astype(np.float32)
                for _ in range(LAYERS)]
    tokens = np.zeros(B, np.int32)
    positions = np.zeros(B, np.int32)
    lengths = np.zeros(B, np.int32)
    starts = np.zeros(B, np.int32)
    for s, r in live.items():
        n = len(seqs[r])                           # the new token is at position n - 1
        starts[s] = rng.integers(0, CONTIGUOUS_S - n + 1)
        for i, (k, v) in enumerate(ref_kvs):
            k_caches[i][s, starts[s]:starts[s] + n - 1] = np.asarray(k[s, :n - 1])
            v_caches[i][s, starts[s]:starts[s] + n - 1] = np.asarray(v[s, :n - 1])
        tokens[s], positions[s], lengths[s] = seqs[r][-1], n - 1, n
    logits = contiguous_decode_step(params, [jnp.asarray(c) for c in k_caches],
                                    [jnp.asarray(c) for c in v_caches], jnp.asarray(tokens),
                                    jnp.asarray(positions), jnp.asarray(lengths),
                                    jnp.asarray(starts))
    for s in live:
        np.testing.assert_allclose(np.asarray(logits[s]), paged_last_logits[s], atol=1e-4,
                                   rtol=1e-4, err_msg=f"fnattn.decode, slot {s}")


def test_greedy_generation_with_paged_cache_matches_recomputing_from_scratch():
    params = init_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, VOCAB, L)) for L, _ in REQUESTS]
    caches = [PagedKVCache.create(NUM_PAGES, PAGE, HKV, HD, max_seqs=MAX_SEQS,
                                  max_pages_per_seq=PAGES_PER_SEQ) for _ in range(LAYERS)]
    waiting = collections.deque(range(len(REQUESTS)))
    slots = [None] * MAX_SEQS            # request in each slot
    seqs = {}                            # request -> its tokens so far
    events = []                          # (step, "join"|"finish", slot, request)
    decode_checked = False
    step = 0
    while waiting or any(r is not None for r in slots):
        joined = set()
        for s in range(MAX_SEQS):
            if slots[s] is None and waiting:
                r = waiting.popleft()
                slots[s], seqs[r] = r, list(prompts[r])
                joined.add(r)
                events.append((step, "join", s, r))
        live = {s: r for s, r in enumerate(slots) if r is not None}

        # Packed tokens, by slot; a joining request brings its whole prompt.
        tokens, seq_ids, positions, rows = [], [], [], {}
        for s, r in live.items():
            new = seqs[r] if r in joined else seqs[r][-1:]
            first = len(seqs[r]) - len(new)
            rows[s] = range(len(tokens), len(tokens) + len(new))
            tokens += new
            seq_ids += [s] * len(new)
            positions += range(first, len(seqs[r]))
        T = PREFILL_TOKENS if joined else MAX_SEQS
        pad = T - len(tokens)
        assert pad >= 0
        logits, caches = paged_step(
            params, caches, jnp.asarray(tokens + [0] * pad, jnp.int32),
            jnp.asarray(seq_ids + [-1] * pad, jnp.int32),
            jnp.asarray(positions + [0] * pad, jnp.int32))
        logits = np.asarray(logits)

        # The cache: every layer has the same pages; lengths are the sequences' lengths;
        # live sequences own disjoint pages.
        table = np.asarray(caches[0].page_table)
        for cache in caches[1:]:
            np.testing.assert_array_equal(np.asarray(cache.page_table), table)
        want_lengths = [len(seqs[slots[s]]) if slots[s] is not None else 0
                        for s in range(MAX_SEQS)]
        assert np.asarray(caches[0].lengths).tolist() == want_lengths
        owned = np.concatenate([table[s, :-(-len(seqs[r]) // PAGE)] for s, r in live.items()])
        assert (owned >= 0).all() and len(set(owned.tolist())) == len(owned)

        # Recompute every live sequence from scratch (padded at the end: causal
        # attention makes the padding invisible to the real tokens).
        batch = np.zeros((MAX_SEQS, CAPACITY), np.int32)
        for s, r in live.items():
            batch[s, :len(seqs[r])] = seqs[r]
        ref_logits, ref_kvs = forward_from_scratch(params, jnp.asarray(batch))
        ref_logits = np.asarray(ref_logits)
        last = {}
        for s, r in live.items():
            n = len(seqs[r])
            got = logits[list(rows[s])]
            want = ref_logits[s, n - len(rows[s]):n]
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4,
                                       err_msg=f"step {step}, slot {s}, request {r}")
            last[s] = got[-1]
            assert got[-1].argmax() == want[-1].argmax()

        if not joined and len(live) >= 2 and not decode_checked:
            check_decode_on_contiguous_cache(params, ref_kvs, live, seqs, last, rng)
            decode_checked = True

        for s, r in live.items():
            seqs[r].append(int(last[s].argmax()))
            if len(seqs[r]) == REQUESTS[r][0] + REQUESTS[r][1]:
                caches = [release(cache, jnp.int32(s)) for cache in caches]
                slots[s] = None
                events.append((step, "finish", s, r))
        step += 1

    assert decode_checked
    assert all(len(seqs[r]) == L + n for r, (L, n) in enumerate(REQUESTS))
    # The schedule did what the test is about: requests finished at different steps,
    # and some joined mid-way in a slot freed by another.
    finish_steps = [e[0] for e in events if e[1] == "finish"]
    assert len(set(finish_steps)) > 1
    assert any(e[1] == "join" and e[0] > 0 for e in events)
    # Every page is back on the free stack.
    for cache in caches:
        assert int(cache.num_free) == NUM_PAGES
        assert not np.asarray(cache.lengths).any()
        assert (np.asarray(cache.page_table) == -1).all()
        assert sorted(np.asarray(cache.free_pages).tolist()) == list(range(NUM_PAGES))
