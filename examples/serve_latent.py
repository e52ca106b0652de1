"""Serving a multi-head latent attention (MLA) model from a latent paged cache.

A tiny DeepSeek-V2/V3 style model: per token, each layer keeps one latent
``c`` of ``LATENT`` channels and one rotary key of ``ROPE`` channels, shared
by every head. With the key up-projection absorbed into the query
(``q_nope @ W_uk^T``), attention is MQA whose keys are the ``LATENT + ROPE``
channels of ``[c, k_rope]`` and whose values are ``c``, their first
``LATENT`` channels: the cache holds one pool of width ``LATENT + ROPE`` per
layer and no value pool (``LayeredPagedKVCache`` with ``v_pages=None``), and
``fnattn.ragged_paged_attention_with_update(..., v=None, v_pages=None,
value_dim=LATENT)`` writes the new latents and attends to them. The value
up-projection ``W_uv`` then applies to the ``LATENT``-channel output.

The requests and the serving loop are those of ``examples/serve_paged.py``.
Each generated sequence is checked against the same model run without a
cache in its unabsorbed form (full heads of ``NOPE + ROPE`` key channels and
``VALUE`` value channels, ``fnattn.attention`` over the whole sequence): the
same greedy tokens and logits within float32 rounding. ``--formats`` adds
an int8 latent cache (per-token scales: half a bfloat16 cache's bytes),
checked within its quantization.

    python examples/serve_latent.py          # ~20 s on a 2-core CPU
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_paged  # noqa: E402  (the requests and the serving loop)
import fnattn  # noqa: E402
from fnattn import AttentionSpec, masks  # noqa: E402
from fnattn.cache import LayeredPagedKVCache  # noqa: E402

VOCAB, MODEL, HEADS, LAYERS, MAX_LEN = serve_paged.VOCAB, 64, 4, 2, serve_paged.MAX_LEN
LATENT, ROPE, NOPE, VALUE = 32, 8, 16, 16
SPEC = AttentionSpec(mask=masks.causal(), scale=(NOPE + ROPE) ** -0.5)
BOUND = {"float32": 1e-3, "int8": 0.1}   # max |logit difference| (logits are O(1)-O(10))


def init(key):
    ks = iter(jax.random.split(key, 16))

    def w(*shape):
        return jax.random.normal(next(ks), shape) / np.sqrt(shape[-2])

    return {"embed": jax.random.normal(next(ks), (VOCAB, MODEL)),
            "head": w(MODEL, VOCAB),
            # per-layer weights stacked on axis 0, for lax.scan
            "wq": w(LAYERS, MODEL, HEADS * (NOPE + ROPE)),
            "wc": w(LAYERS, MODEL, LATENT),          # down-projection to the latent
            "wr": w(LAYERS, MODEL, ROPE),            # the shared rotary key
            "wuk": w(LAYERS, HEADS, LATENT, NOPE),   # up-projections of the latent
            "wuv": w(LAYERS, HEADS, LATENT, VALUE),
            "wo": w(LAYERS, HEADS * VALUE, MODEL),
            "w1": w(LAYERS, MODEL, 2 * MODEL), "w2": w(LAYERS, 2 * MODEL, MODEL)}


LAYER_KEYS = ("wq", "wc", "wr", "wuk", "wuv", "wo", "w1", "w2")


def rope(x, positions):
    """Rotary embedding of x (..., T, heads, ROPE) at positions (T,)."""
    half = ROPE // 2
    freq = 1.0 / (10000.0 ** (np.arange(half) / half))
    angle = positions[:, None].astype(jnp.float32) * freq              # (T, half)
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def projections(x, p, positions):
    """q_nope (T, H, NOPE), q_rope (T, H, ROPE), the latent c (T, LATENT) and the
    rotary key (T, 1, ROPE) of tokens x (T, MODEL)."""
    h = serve_paged.norm(x)
    q = (h @ p["wq"]).reshape(-1, HEADS, NOPE + ROPE)
    q_rope = rope(q[..., NOPE:], positions)
    k_rope = rope((h @ p["wr"])[:, None], positions)
    return q[..., :NOPE], q_rope, h @ p["wc"], k_rope


def finish(x, p, heads_out):
    """The rest of the layer from the heads' outputs (T, H, VALUE)."""
    x = x + heads_out.reshape(x.shape[0], -1) @ p["wo"]
    return x + jax.nn.gelu(serve_paged.norm(x) @ p["w1"]) @ p["w2"]


def absorbed_layer(x, p, positions, attend):
    """One layer in the absorbed form: ``attend(q_abs, latent)`` -> (T, H, LATENT)."""
    q_nope, q_rope, c, k_rope = projections(x, p, positions)
    q_abs = jnp.concatenate([jnp.einsum("thn,hcn->thc", q_nope, p["wuk"]), q_rope], -1)
    latent = jnp.concatenate([c[:, None], k_rope], -1)                 # (T, 1, LATENT + ROPE)
    o_lat, extra = attend(q_abs, latent)
    return finish(x, p, jnp.einsum("thc,hcv->thv", o_lat, p["wuv"])), extra


@jax.jit
def serve_step(params, cache, tokens, positions, seq_ids):
    """One packed step over the latent cache (see ``serve_paged.serve_step``)."""
    cache = cache.allocate(seq_ids)
    meta = cache.ragged_metadata(seq_ids)
    x = params["embed"][tokens]

    def layer(x, per_layer):
        p, pool = per_layer

        def attend(q_abs, latent):
            res, pool2, _ = fnattn.ragged_paged_attention_with_update(
                SPEC, q_abs, latent, None, pool, None, value_dim=LATENT, **meta)
            return res.out, pool2
        return absorbed_layer(x, p, positions, attend)

    layers = {n: params[n] for n in LAYER_KEYS}
    x, pools = jax.lax.scan(layer, x, (layers, cache.k_pages))
    return serve_paged.norm(x) @ params["head"], cache.replace(k_pages=pools)


@jax.jit
def full_forward(params, tokens):
    """The model without a cache, unabsorbed, on one whole sequence (T,): logits."""
    T = tokens.shape[0]
    positions = jnp.arange(T)
    x = params["embed"][tokens]
    for i in range(LAYERS):
        p = {n: params[n][i] for n in LAYER_KEYS}
        q_nope, q_rope, c, k_rope = projections(x, p, positions)
        k = jnp.concatenate([jnp.einsum("tc,hcn->thn", c, p["wuk"]),
                             jnp.broadcast_to(k_rope, (T, HEADS, ROPE))], -1)
        v = jnp.einsum("tc,hcv->thv", c, p["wuv"])
        q = jnp.concatenate([q_nope, q_rope], -1)
        x = finish(x, p, fnattn.attention(SPEC, q[None], k[None], v[None]).out[0])
    return serve_paged.norm(x) @ params["head"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=6)
    ap.add_argument("--formats", default="float32,int8")
    args = ap.parse_args(argv)

    params = init(jax.random.key(0))
    rng = np.random.default_rng(0)
    requests = [(int(rng.integers(0, 6)), rng.integers(0, VOCAB, int(rng.integers(3, 12))).tolist())
                for _ in range(args.requests)]
    worst = {}
    for name in args.formats.split(","):
        cache = LayeredPagedKVCache.create(
            num_layers=LAYERS, num_pages=32, page_size=8, num_kv_heads=1,
            head_dim=LATENT + ROPE, v_head_dim=1, max_seqs=4, max_pages_per_seq=MAX_LEN // 8,
            quant_format=None if name == "float32" else name)
        cache = cache.replace(v_pages=None)      # the values are the latents' first channels
        out, steps, cache = serve_paged.serve(params, requests, max_new=args.max_new,
                                              batch_tokens=48, cache=cache,
                                              step_fn=serve_step)
        diff, same = 0.0, 0
        for i, (_, prompt) in enumerate(requests):
            gen, logits = out[i]
            ref = np.asarray(full_forward(params, jnp.array(prompt + gen, jnp.int32)))
            d = np.abs(ref[len(prompt) - 1:-1] - np.stack(logits)).max(-1)   # per step
            diff = max(diff, float(d.max()))
            top2 = np.sort(ref[len(prompt) - 1:-1], -1)[:, -2:]
            clear = (top2[:, 1] - top2[:, 0]) > 2 * d              # a clear winner
            agree = np.argmax(ref[len(prompt) - 1:-1], -1) == np.asarray(gen)
            assert agree[clear].all(), f"{name}, request {i}: a clear greedy token differs"
            same += int(agree.sum())
        print(f"{name} latent cache ({cache.k_pages.nbytes} bytes, one pool of width "
              f"{LATENT + ROPE} per layer, no value pool): {len(requests)} requests in {steps} "
              f"steps; max |logit difference| against the unabsorbed model without a cache "
              f"{diff:.1e}; greedy tokens equal {same}/{len(requests) * args.max_new}")
        assert diff < BOUND[name], (name, diff)
        assert int(cache.num_free) == cache.num_pages, "pages were not all given back"
        worst[name] = diff
    return worst


if __name__ == "__main__":
    main()
