"""The dense XLA lowering: the whole (Tq, Tk) logit matrix, every spec feature.

Straightforward and exact; memory grows as Tq * Tk. The backward recomputes the
forward and differentiates it with ``jax.vjp``. ``fnattn.flash`` is the O(T)
memory alternative.
"""

import jax
import jax.numpy as jnp

from fnattn._dispatch import Lowering
from fnattn.reference import dense_attention


def _forward(cfg, q, k, v, bias, sinks, mask, seed):
    out, lse = dense_attention(q, k, v, bias=bias, sinks=sinks, mask=mask, seed=seed,
                               scale=cfg.scale, softcap=cfg.softcap,
                               dropout_rate=cfg.dropout_rate, upcast=False,
                               q_offset=cfg.q_offset)
    # The backward recomputes the forward: lse's rounding error is not needed.
    return out.astype(q.dtype), lse, jnp.zeros_like(lse)


def _backward(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse):
    def f(q, k, v, bias, sinks):
        return _forward(cfg, q, k, v, bias, sinks, mask, seed)[:2]

    _, vjp = jax.vjp(f, q, k, v, bias, sinks)
    return vjp((d_out, d_lse.astype(jnp.float32)))


DENSE = Lowering("xla-dense", _forward, _backward)
