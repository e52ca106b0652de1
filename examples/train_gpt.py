"""Train a small GPT on packed documents with attention sinks, next to ``jax.nn``.

Several documents are packed into each training row; a token may only attend
to earlier tokens of its own document, and every head has a learned sink logit
(a "no-op" slot that takes attention mass without adding a value). With fnattn
that is one spec::

    AttentionSpec(mask=masks.causal() & masks.segments(doc_ids), sinks=sinks)

``jax.nn.dot_product_attention`` has neither segment ids nor sinks, so the
same model written with it needs an explicit (B, 1, T, T) boolean mask and an
extra all-zero key/value column whose bias is the sink. The script trains both
models from the same initial parameters on the same batches and checks that
their losses agree at every step (and that the loss went down).

    python examples/train_gpt.py            # ~15 s on a 2-core CPU
    python examples/train_gpt.py --steps 200 --seq 256
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from fnattn import AttentionSpec, masks

VOCAB = 32
BOS = 0


# ----------------------------------------------------------------------------------
# Data: packed rows of documents that count upwards from a random start (mod VOCAB-1)
# ----------------------------------------------------------------------------------


def packed_batch(rng, batch, seq):
    """Tokens (B, T+1) and document ids (B, T+1): documents of random length
    packed back to back, each ``BOS, s, s+1, s+2, ...``; a model that reads its
    own document only can predict every token after the second."""
    tokens = np.zeros((batch, seq + 1), np.int32)
    ids = np.zeros((batch, seq + 1), np.int32)
    for b in range(batch):
        t, doc = 0, 0
        while t < seq + 1:
            n = min(int(rng.integers(4, seq // 2)), seq + 1 - t)
            start = int(rng.integers(0, VOCAB - 1))
            tokens[b, t:t + n] = np.r_[BOS, 1 + (start + np.arange(n - 1)) % (VOCAB - 1)]
            ids[b, t:t + n] = doc
            t, doc = t + n, doc + 1
    return tokens, ids


# ----------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------


def init(key, *, layers, d_model, q_heads, kv_heads, seq):
    d_head = d_model // q_heads
    keys = iter(jax.random.split(key, 4 + 6 * layers))

    def dense(shape):
        return jax.random.normal(next(keys), shape) / np.sqrt(shape[0])

    params = {"embed": jax.random.normal(next(keys), (VOCAB, d_model)) * 0.1,
              "pos": jax.random.normal(next(keys), (seq, d_model)) * 0.1,
              "out": dense((d_model, VOCAB)), "layers": []}
    for _ in range(layers):
        params["layers"].append({
            "wq": dense((d_model, q_heads * d_head)),
            "wk": dense((d_model, kv_heads * d_head)),
            "wv": dense((d_model, kv_heads * d_head)),
            "wo": dense((q_heads * d_head, d_model)),
            "w1": dense((d_model, 4 * d_model)), "w2": dense((4 * d_model, d_model)),
            "sinks": jnp.zeros((q_heads,)),
        })
    return params


def attend_fnattn(q, k, v, ids, sinks):
    spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), sinks=sinks)
    return fnattn.attention(spec, q, k, v).out


def attend_jax_nn(q, k, v, ids, sinks):
    """The same attention through ``jax.nn.dot_product_attention``: the document
    mask as a boolean array, the sinks as one extra key with K = V = 0 whose
    logit is the sink (the bias of that column)."""
    B, T, Hq, _ = q.shape
    same_doc = ids[:, :, None] == ids[:, None, :]
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = (same_doc & causal)[:, None]                                    # (B, 1, T, T)
    mask = jnp.concatenate([mask, jnp.ones((B, 1, T, 1), bool)], axis=-1)  # the sink column
    zero = jnp.zeros_like(k[:, :1])
    k, v = jnp.concatenate([k, zero], 1), jnp.concatenate([v, zero], 1)
    bias = jnp.zeros((1, Hq, T, T + 1)).at[..., T].set(sinks[None, :, None])
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask)


def forward(params, tokens, ids, attend, *, q_heads, kv_heads):
    B, T = tokens.shape
    x = params["embed"][tokens] + params["pos"][:T]
    for p in params["layers"]:
        h = x - x.mean(-1, keepdims=True)
        h = h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)
        q = (h @ p["wq"]).reshape(B, T, q_heads, -1)
        k = (h @ p["wk"]).reshape(B, T, kv_heads, -1)
        v = (h @ p["wv"]).reshape(B, T, kv_heads, -1)
        x = x + attend(q, k, v, ids, p["sinks"]).reshape(B, T, -1) @ p["wo"]
        x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    return x @ params["out"]


def loss_fn(params, tokens, ids, attend, **heads):
    logits = forward(params, tokens[:, :-1], ids[:, :-1], attend, **heads)
    targets = tokens[:, 1:]
    # the first token of each document cannot be predicted from the one before it
    valid = (ids[:, 1:] == ids[:, :-1]).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    return (nll * valid).sum() / valid.sum()


def make_step(attend, lr, **heads):
    @jax.jit
    def step(params, momentum, tokens, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, ids, attend, **heads)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
        params = jax.tree.map(lambda p, m: p - lr * m, params, momentum)
        return params, momentum, loss
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args(argv)

    heads = dict(q_heads=4, kv_heads=2)  # grouped-query attention
    params = init(jax.random.key(0), layers=args.layers, d_model=args.d_model,
                  seq=args.seq, **heads)
    runs = {}
    for name, attend in (("fnattn", attend_fnattn), ("jax.nn", attend_jax_nn)):
        step = make_step(attend, args.lr, **heads)
        p, m = params, jax.tree.map(jnp.zeros_like, params)
        rng = np.random.default_rng(0)  # the same batches for both
        losses, t0 = [], time.perf_counter()
        for _ in range(args.steps):
            tokens, ids = packed_batch(rng, args.batch, args.seq)
            p, m, loss = step(p, m, tokens, ids)
            losses.append(float(loss))
        runs[name] = (np.array(losses), time.perf_counter() - t0)

    (a, ta), (b, tb) = runs["fnattn"], runs["jax.nn"]
    print(f"{'step':>5} {'fnattn':>9} {'jax.nn':>9}")
    for i in range(0, args.steps, max(1, args.steps // 8)):
        print(f"{i:5d} {a[i]:9.4f} {b[i]:9.4f}")
    print(f"{args.steps - 1:5d} {a[-1]:9.4f} {b[-1]:9.4f}")
    diff = float(np.max(np.abs(a - b) / np.abs(b)))
    print(f"max relative loss difference {diff:.2e}; "
          f"time incl. compile: fnattn {ta:.1f} s, jax.nn {tb:.1f} s")
    assert diff < 1e-3, f"the losses differ: max relative difference {diff:.2e}"
    assert a[-1] < 0.7 * a[0], f"the loss did not go down: {a[0]:.3f} -> {a[-1]:.3f}"
    return a, b


if __name__ == "__main__":
    main()
