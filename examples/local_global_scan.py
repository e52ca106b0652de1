"""Train a model that alternates local and global layers, its layers in one ``lax.scan``.

Gemma 2/3, gpt-oss, Cohere 2 and Llama 4 interleave sliding-window (or chunked)
layers with global ones: here five local layers to one global, as Gemma 3
does, with a learned sink per head on the local layers and a RoPE base per
layer kind. With static window sizes each kind of layer is its own trace, and
the layers are unrolled in Python (compile time grows with depth). fnattn takes
the window size as data: one int32 per layer, ``masks.NO_WINDOW`` for the
global layers, so the whole stack is one ``lax.scan`` over stacked weights::

    def body(x, layer):
        weights, left, sinks = layer          # left: a traced int32
        mask = masks.causal() & masks.sliding_window(left=left)
        ...fnattn.attention(AttentionSpec(mask=mask, sinks=sinks), q, k, v)...

The empty tiles of each layer's window are still skipped (the schedule comes
from the traced value). A layer without sinks gets sinks of ``-inf`` in the
scan (a sink of -inf is no sink). Hugging Face's ``sliding_window=W`` (W keys,
the current one included) is ``sliding_window(left=W - 1)``.

The script builds the same model unrolled in Python with static masks
(``sliding_window(left=W - 1)`` or ``causal()``, ``sinks=None`` on the global
layers), checks that the two give the same logits and gradients to float32
rounding, trains the scanned one (loss and gradient through the scan) on
counting sequences, and checks that the loss went down and that the trained
model still equals its unrolled twin.

It also prints each form's first call of the loss and gradient (trace, lower,
compile: CPU time) and the size of the compiled program (HLO fusions). The
scanned program holds one layer whatever the depth; XLA:CPU compiles each
distinct kernel once, so unrolled identical layers share theirs and a few
layers unrolled cost little more than the kinds of layer they hold
(``benchmarks/results/traced_window_cpu.md`` measures 12 layers at T = 4096).

    python examples/local_global_scan.py            # ~20 s on a 2-core CPU
    python examples/local_global_scan.py --layers 12 --seq 256 --window 32
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from fnattn import AttentionSpec, masks

VOCAB = 64


# ----------------------------------------------------------------------------------
# The layer pattern: per-layer data for the scan, Python values for the unrolled twin
# ----------------------------------------------------------------------------------


def pattern(layers, window, period=6):
    """Per layer: whether it is local (every ``period``-th layer is global), its
    window as fnattn's ``left`` (HF's ``sliding_window=W`` is ``left=W - 1``),
    whether it has sinks (the local layers) and its RoPE base."""
    local = [(i + 1) % period != 0 for i in range(layers)]
    return dict(local=local,
                left=[window - 1 if lo else None for lo in local],
                has_sinks=local,
                rope_base=[10_000.0 if lo else 1_000_000.0 for lo in local])


def scan_data(pat):
    """The pattern as arrays, one entry per layer (the scan's xs)."""
    return dict(left=jnp.array([masks.NO_WINDOW if w is None else w for w in pat["left"]],
                               jnp.int32),
                has_sinks=jnp.array(pat["has_sinks"]),
                rope_base=jnp.array(pat["rope_base"], jnp.float32))


# ----------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------


def init(key, *, layers, d_model, q_heads, kv_heads):
    """Parameters; every layer's weights stacked on a leading axis of ``layers``."""
    d_head = d_model // q_heads
    k = jax.random.split(key, 8)

    def dense(key, shape):
        return jax.random.normal(key, (layers,) + shape) / np.sqrt(shape[0])

    return {
        "embed": jax.random.normal(k[0], (VOCAB, d_model)) * 0.5,
        "out": jax.random.normal(k[1], (d_model, VOCAB)) / np.sqrt(d_model),
        "layers": {
            "wq": dense(k[2], (d_model, q_heads * d_head)),
            "wk": dense(k[3], (d_model, kv_heads * d_head)),
            "wv": dense(k[4], (d_model, kv_heads * d_head)),
            "wo": dense(k[5], (q_heads * d_head, d_model)),
            "w1": dense(k[6], (d_model, 4 * d_model)),
            "w2": dense(k[7], (4 * d_model, d_model)),
            "sinks": jnp.zeros((layers, q_heads)),
        },
    }


def rms(x):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def rope(x, base, pos=None):
    """Rotary position embedding of ``x`` (B, T, H, D) with the base ``base``
    (a Python float or a traced scalar), at positions ``0..T-1``; or of packed
    tokens ``x`` (N, H, D) at positions ``pos`` (N,)."""
    D = x.shape[-1]
    if pos is None:
        pos = jnp.arange(x.shape[1])
    freq = base ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    angle = pos.astype(jnp.float32)[:, None] * freq                      # (T, D/2)
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)


def block(x, p, mask, sinks, rope_base, *, q_heads, kv_heads):
    """One layer (attention, then an MLP), the same code for both forms: the
    scan hands it traced window sizes and sinks, the unrolled twin static ones."""
    B, T, _ = x.shape
    h = rms(x)
    q = rope((h @ p["wq"]).reshape(B, T, q_heads, -1), rope_base)
    k = rope((h @ p["wk"]).reshape(B, T, kv_heads, -1), rope_base)
    v = (h @ p["wv"]).reshape(B, T, kv_heads, -1)
    att = fnattn.attention(AttentionSpec(mask=mask, sinks=sinks), q, k, v).out
    x = x + att.reshape(B, T, -1) @ p["wo"]
    return x + jax.nn.gelu(rms(x) @ p["w1"]) @ p["w2"]


def forward_scanned(params, tokens, data, **heads):
    """Every layer in one ``lax.scan``: window sizes, sinks and RoPE bases as data."""
    def body(x, layer):
        p, left, has_sinks, base = layer
        mask = masks.causal() & masks.sliding_window(left=left)
        sinks = jnp.where(has_sinks, p["sinks"], -jnp.inf)   # -inf: no sink
        return block(x, p, mask, sinks, base, **heads), None

    x = params["embed"][tokens]
    xs = (params["layers"], data["left"], data["has_sinks"], data["rope_base"])
    x, _ = jax.lax.scan(body, x, xs)
    return rms(x) @ params["out"]


def forward_unrolled(params, tokens, pat, **heads):
    """The same model, its layers unrolled in Python with static masks."""
    x = params["embed"][tokens]
    for i, left in enumerate(pat["left"]):
        p = jax.tree.map(lambda a: a[i], params["layers"])
        mask = masks.causal() if left is None else masks.causal() & masks.sliding_window(left)
        sinks = p["sinks"] if pat["has_sinks"][i] else None
        x = block(x, p, mask, sinks, pat["rope_base"][i], **heads)
    return rms(x) @ params["out"]


def loss_fn(params, tokens, forward, layout, **heads):
    logits = forward(params, tokens[:, :-1], layout, **heads)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    return nll[:, 1:].mean()   # (the second token is a guess: one token shows no stride)


def counting_batch(rng, batch, seq):
    """Rows of ``seq + 1`` tokens counting from a random start by a random
    stride (1 to 3) modulo VOCAB: each token follows from the two before it."""
    start = rng.integers(0, VOCAB, (batch, 1))
    stride = rng.integers(1, 4, (batch, 1))
    return ((start + stride * np.arange(seq + 1)) % VOCAB).astype(np.int32)


# ----------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------


def max_rel(a, b):
    """The largest difference over leaves, relative to each leaf's largest value."""
    errs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)),
                        a, b)
    return max(jax.tree.leaves(errs))


def checks(pat, data, heads):
    """``compare(params, tokens)``: the scanned form's logits and gradients
    against the unrolled one's (largest relative differences), each form
    compiled once; ``first``: each form's first call of the loss and gradient
    (trace + lower + compile, CPU seconds) and its HLO fusions."""
    logits = {"scanned": jax.jit(lambda p, t: forward_scanned(p, t, data, **heads)),
              "unrolled": jax.jit(lambda p, t: forward_unrolled(p, t, pat, **heads))}
    grads = {name: jax.jit(jax.value_and_grad(
        lambda p, t, forward=forward, layout=layout: loss_fn(p, t, forward, layout, **heads)))
        for name, forward, layout in (("scanned", forward_scanned, data),
                                      ("unrolled", forward_unrolled, pat))}
    first = {}

    def compare(params, tokens):
        for name, f in grads.items():
            if name not in first:
                t0 = time.process_time()
                compiled = f.lower(params, tokens).compile()
                first[name] = (time.process_time() - t0, compiled.as_text().count(" fusion("))
                grads[name] = compiled
        out = {name: (logits[name](params, tokens), grads[name](params, tokens))
               for name in grads}
        return (max_rel(out["scanned"][0], out["unrolled"][0]),
                max_rel(out["scanned"][1], out["unrolled"][1]))

    return compare, first


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--window", type=int, default=8, help="HF's sliding_window")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=0.02)
    args = ap.parse_args(argv)

    heads = dict(q_heads=4, kv_heads=2)  # grouped-query attention
    pat = pattern(args.layers, args.window)
    data = scan_data(pat)
    params = init(jax.random.key(0), layers=args.layers, d_model=args.d_model, **heads)
    rng = np.random.default_rng(0)
    probe = jnp.asarray(counting_batch(rng, args.batch, args.seq))

    compare, first = checks(pat, data, heads)
    logit_err, grad_err = compare(params, probe)
    print(f"{args.layers} layers ({sum(pat['local'])} local, window {args.window}; "
          f"{args.layers - sum(pat['local'])} global), T={args.seq}")
    print(f"at init: scanned vs unrolled: logits {logit_err:.1e}, gradients {grad_err:.1e} "
          "(largest difference relative to the largest value)")
    print("first call of the loss and gradient (trace + lower + compile, CPU time): "
          + "; ".join(f"{k} {t:.2f} s, {n} HLO fusions" for k, (t, n) in first.items()))

    # Train the scanned form (Adam, written out to keep the example self-contained).
    @jax.jit
    def step(params, m, v, i, tokens):
        loss, g = jax.value_and_grad(loss_fn)(params, tokens, forward_scanned, data, **heads)
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
        c1, c2 = 1 - 0.9 ** (i + 1), 1 - 0.999 ** (i + 1)
        params = jax.tree.map(lambda p, m, v: p - args.lr * (m / c1) / (jnp.sqrt(v / c2) + 1e-8),
                              params, m, v)
        return params, m, v, loss

    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    losses = []
    for i in range(args.steps):
        params, m, v, loss = step(params, m, v, jnp.float32(i),
                                  jnp.asarray(counting_batch(rng, args.batch, args.seq)))
        losses.append(float(loss))
    for i in sorted({0, args.steps // 2, args.steps - 1}):
        print(f"step {i:4d}: loss {losses[i]:.3f}")

    trained_logit_err, trained_grad_err = compare(params, probe)
    print(f"trained: scanned vs unrolled: logits {trained_logit_err:.1e}, "
          f"gradients {trained_grad_err:.1e}")
    worst = max(logit_err, grad_err, trained_logit_err, trained_grad_err)
    assert worst < 1e-4, f"the scanned and unrolled forms differ: {worst:.1e}"
    assert losses[-1] < 0.7 * losses[0], f"the loss did not go down: {losses[0]:.3f} -> " \
                                         f"{losses[-1]:.3f}"
    print("the scanned model equals its unrolled twin; the loss went down")
    return dict(logits=logit_err, grads=grad_err, trained_logits=trained_logit_err,
                trained_grads=trained_grad_err, losses=losses)


if __name__ == "__main__":
    main()
