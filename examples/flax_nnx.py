"""A ``flax.nnx`` language model whose attention is fnattn, through the adapter.

``flax.nnx.MultiHeadAttention`` takes an ``attention_fn``: passing
``fnattn.adapters.flax.attention_fn`` is the whole change. The module's
parameters, its (float) causal mask and its settings stay as they are. The
script builds the same model twice from the same seed, once with flax's own
attention and once with fnattn's, trains both with plain SGD on the same
batches, and checks that the outputs, the gradients and every step's loss
agree. A third model uses ``make_attention_fn`` for what flax's attention has
no argument for: a sliding window and a soft-cap, on top of the module's mask.

Needs the ``flax`` extra: ``pip install fnattn[flax]``.

    python examples/flax_nnx.py            # ~15 s on a 2-core CPU
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fnattn import AttentionSpec, masks
from fnattn.adapters.flax import attention_fn, make_attention_fn

VOCAB, MODEL, HEADS = 32, 64, 4


class LM(nnx.Module):
    def __init__(self, attn_fn, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, MODEL, rngs=rngs)
        kwargs = {} if attn_fn is None else {"attention_fn": attn_fn}
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=MODEL, decode=False,
                                           rngs=rngs, **kwargs)
        self.mlp = nnx.Linear(MODEL, MODEL, rngs=rngs)
        self.head = nnx.Linear(MODEL, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(x, mask=nnx.make_causal_mask(tokens))   # float32 0/1 mask
        x = x + jax.nn.gelu(self.mlp(x))
        return self.head(x)


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
    return nll.mean()


@nnx.jit
def train_step(model, tokens, lr):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
    return loss, grads


def batches(rng, n, batch, seq):
    """Counting sequences with a random start and stride: predictable from context."""
    for _ in range(n):
        start = rng.integers(0, VOCAB, (batch, 1))
        stride = rng.integers(1, 4, (batch, 1))
        yield jnp.asarray((start + stride * np.arange(seq + 1)) % VOCAB, jnp.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.0)
    args = ap.parse_args(argv)

    flax_model = LM(None, rngs=nnx.Rngs(0))
    ours = LM(attention_fn, rngs=nnx.Rngs(0))              # the same parameters
    tokens = next(batches(np.random.default_rng(1), 1, args.batch, args.seq))
    out_flax, out_ours = flax_model(tokens[:, :-1]), nnx.jit(lambda m, t: m(t))(ours,
                                                                                tokens[:, :-1])
    out_err = float(jnp.max(jnp.abs(out_flax - out_ours)))
    g_flax = nnx.grad(loss_fn)(flax_model, tokens)
    g_ours = nnx.jit(nnx.grad(loss_fn))(ours, tokens)
    grad_err = max(float(jnp.max(jnp.abs(a - b)))
                   for a, b in zip(jax.tree.leaves(g_flax), jax.tree.leaves(g_ours)))
    print(f"same parameters: max |output difference| {out_err:.1e}, "
          f"max |gradient difference| {grad_err:.1e}")

    losses = {}
    for name, model in (("flax", flax_model), ("fnattn", ours)):
        losses[name] = np.array([float(train_step(model, t, args.lr)[0]) for t in batches(
            np.random.default_rng(0), args.steps, args.batch, args.seq)])
    a, b = losses["fnattn"], losses["flax"]
    for i in range(0, args.steps, max(1, args.steps // 6)):
        print(f"step {i:3d}: loss fnattn {a[i]:.4f}  flax {b[i]:.4f}")
    diff = float(np.max(np.abs(a - b)))
    print(f"max |loss difference| over {args.steps} steps {diff:.1e}")

    # What flax's attention cannot express: a window and a soft-cap, with the causal mask.
    windowed = LM(make_attention_fn(AttentionSpec(mask=masks.sliding_window(left=8),
                                                  softcap=20.0)), rngs=nnx.Rngs(0))
    w_loss = float(nnx.jit(loss_fn)(windowed, tokens))
    print(f"sliding window of 8 + soft-cap 20 through make_attention_fn: loss {w_loss:.4f}")

    assert out_err < 1e-4 and grad_err < 1e-4, (out_err, grad_err)
    assert diff < 1e-3 * max(1.0, float(np.max(b))), diff
    assert a[-1] < 0.7 * a[0], "the loss did not go down"
    assert np.isfinite(w_loss)
    return out_err, grad_err, diff


if __name__ == "__main__":
    main()
