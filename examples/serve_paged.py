"""Greedy serving of several requests through one multi-layer paged KV cache.

Requests arrive at different steps with prompts of different lengths. Every
step runs one jitted forward of a small two-layer model over a packed batch
that mixes the prompts of newly arrived requests (prefill) with the last
token of every running request (decode):

* ``LayeredPagedKVCache.allocate(seq_ids)`` makes room for the step's tokens
  once, for all layers (one page table, one set of lengths);
* ``lax.scan`` over the layers hands each layer its own pools, and
  ``fnattn.ragged_paged_attention_with_update`` writes the layer's new K/V
  into them and attends, causally, to the cached context and the new tokens;
* finished requests give their pages back with ``release``.

Every generated sequence is then checked against the model run without a
cache, over the whole sequence, with ``fnattn.attention``: the same greedy
tokens and logits within float32 rounding.

    python examples/serve_paged.py          # ~15 s on a 2-core CPU
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from fnattn import AttentionSpec, masks
from fnattn.cache import LayeredPagedKVCache

VOCAB, MODEL, Q_HEADS, KV_HEADS, HEAD, LAYERS, MAX_LEN = 64, 64, 4, 2, 16, 2, 64


def init(key):
    ks = iter(jax.random.split(key, 16))

    def w(*shape):
        return jax.random.normal(next(ks), shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)

    return {"embed": jax.random.normal(next(ks), (VOCAB, MODEL)),
            "pos": jax.random.normal(next(ks), (MAX_LEN, MODEL)) * 0.5,
            "head": w(MODEL, VOCAB),
            # per-layer weights stacked on axis 0, for lax.scan
            "wq": w(LAYERS, MODEL, Q_HEADS * HEAD), "wk": w(LAYERS, MODEL, KV_HEADS * HEAD),
            "wv": w(LAYERS, MODEL, KV_HEADS * HEAD), "wo": w(LAYERS, Q_HEADS * HEAD, MODEL),
            "w1": w(LAYERS, MODEL, 2 * MODEL), "w2": w(LAYERS, 2 * MODEL, MODEL)}


def norm(x):
    return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def block(x, p, attend):
    """One layer on tokens x (..., T, MODEL); ``attend(q, k, v)`` does attention."""
    h = norm(x)
    lead = h.shape[:-1]
    q = (h @ p["wq"]).reshape(lead + (Q_HEADS, HEAD))
    k = (h @ p["wk"]).reshape(lead + (KV_HEADS, HEAD))
    v = (h @ p["wv"]).reshape(lead + (KV_HEADS, HEAD))
    a, extra = attend(q, k, v)
    x = x + a.reshape(lead + (-1,)) @ p["wo"]
    return x + jax.nn.gelu(norm(x) @ p["w1"]) @ p["w2"], extra


LAYER_KEYS = ("wq", "wk", "wv", "wo", "w1", "w2")
SPEC = AttentionSpec(mask=masks.causal())


@jax.jit
def serve_step(params, cache, tokens, positions, seq_ids):
    """One packed step: tokens (T,) at positions (T,) of sequences seq_ids (T,),
    sorted by slot, -1 for padding. Returns the logits (T, VOCAB) and the cache."""
    cache = cache.allocate(seq_ids)             # pages for the new tokens, all layers
    meta = cache.ragged_metadata(seq_ids)
    x = params["embed"][tokens] + params["pos"][positions]

    def layer(x, per_layer):
        p, kp, vp = per_layer

        def attend(q, k, v):
            res, kp2, vp2 = fnattn.ragged_paged_attention_with_update(SPEC, q, k, v, kp, vp,
                                                                      **meta)
            return res.out, (kp2, vp2)
        return block(x, p, attend)

    layers = {n: params[n] for n in LAYER_KEYS}
    x, (kp, vp) = jax.lax.scan(layer, x, (layers, cache.k_pages, cache.v_pages))
    return norm(x) @ params["head"], cache.replace(k_pages=kp, v_pages=vp)


@jax.jit
def full_forward(params, tokens):
    """The model without a cache on one whole sequence (T,): logits (T, VOCAB)."""
    T = tokens.shape[0]
    x = params["embed"][tokens] + params["pos"][:T]

    def attend(q, k, v):
        return fnattn.attention(SPEC, q[None], k[None], v[None]).out[0], None

    for i in range(LAYERS):
        x, _ = block(x, {n: params[n][i] for n in LAYER_KEYS}, attend)
    return norm(x) @ params["head"]


def serve(params, requests, *, max_new, batch_tokens, cache, step_fn=None):
    """Runs the requests (arrival step, prompt) to completion; returns the generated
    tokens and the logits of each, and the number of steps. ``step_fn``: another
    model's ``serve_step`` (the same arguments and results)."""
    step_fn = serve_step if step_fn is None else step_fn
    waiting = sorted(enumerate(requests), key=lambda r: r[1][0])
    free_slots = list(range(cache.max_seqs))
    running = {}    # slot -> request index
    out = {i: ([], []) for i in range(len(requests))}
    pending = {}    # slot -> tokens to feed this step
    step = 0
    while waiting or running:
        while waiting and waiting[0][1][0] <= step and free_slots:
            i, (_, prompt) = waiting.pop(0)
            slot = free_slots.pop(0)
            running[slot] = i
            pending[slot] = list(prompt)                       # prefill
        slots = sorted(pending)
        toks, pos, ids, last = [], [], [], {}
        for s in slots:
            i = running[s]
            start = len(requests[i][1]) + len(out[i][0]) - len(pending[s])
            toks += pending[s]
            pos += range(start, start + len(pending[s]))
            ids += [s] * len(pending[s])
            last[s] = len(toks) - 1
        assert len(toks) <= batch_tokens, "raise --batch-tokens"
        pad = batch_tokens - len(toks)
        logits, cache = step_fn(params, cache, jnp.array(toks + [0] * pad, jnp.int32),
                                jnp.array(pos + [0] * pad, jnp.int32),
                                jnp.array(ids + [-1] * pad, jnp.int32))
        logits = np.asarray(logits)
        pending = {}
        for s in slots:
            i = running[s]
            nxt = int(np.argmax(logits[last[s]]))               # greedy
            out[i][0].append(nxt)
            out[i][1].append(logits[last[s]])
            if len(out[i][0]) == max_new:
                del running[s]
                cache = cache.release(s)                        # its pages go back
                free_slots.append(s)
            else:
                pending[s] = [nxt]                              # decode
        step += 1
    return out, step, cache


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=8)
    args = ap.parse_args(argv)

    params = init(jax.random.key(0))
    rng = np.random.default_rng(0)
    requests = [(int(rng.integers(0, 6)), rng.integers(0, VOCAB, int(rng.integers(3, 12))).tolist())
                for _ in range(args.requests)]
    cache = LayeredPagedKVCache.create(num_layers=LAYERS, num_pages=32, page_size=8,
                                       num_kv_heads=KV_HEADS, head_dim=HEAD, max_seqs=4,
                                       max_pages_per_seq=MAX_LEN // 8)
    out, steps, cache = serve(params, requests, max_new=args.max_new, batch_tokens=48,
                              cache=cache)
    print(f"{len(requests)} requests served in {steps} packed steps "
          f"(at most 4 at once, prefill and decode mixed)")
    worst = 0.0
    for i, (arrival, prompt) in enumerate(requests):
        gen, logits = out[i]
        seq = jnp.array(prompt + gen, jnp.int32)
        ref = np.asarray(full_forward(params, seq))[len(prompt) - 1:-1]
        assert np.argmax(ref, -1).tolist() == gen, f"request {i}: greedy tokens differ"
        worst = max(worst, float(np.max(np.abs(ref - np.stack(logits)))))
        print(f"request {i}: arrives at step {arrival}, prompt {len(prompt):2d} tokens, "
              f"generated {gen}")
    print(f"every request equals the model run without a cache; max |logit difference| "
          f"{worst:.1e}")
    assert worst < 1e-3, worst
    assert int(cache.num_free) == cache.num_pages, "pages were not all given back"
    return worst


if __name__ == "__main__":
    main()
