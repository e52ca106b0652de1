"""The dense XLA lowering: the whole (Tq, Tk) logit matrix, every spec feature.

Straightforward and exact; memory grows as Tq * Tk. The output is divided by
the row sums after ``P @ V`` (:func:`fnattn.reference.dense_attention`'s
``late_normalize``). The backward recomputes the forward in the accumulation
dtype (float32, or float64 for float64 inputs) and differentiates it with
``jax.vjp`` (the tangent pass with ``jax.jvp``), so that low-precision inputs
never see a gradient product (dO.V under loss scaling) overflow their dtype.
``fnattn.flash`` is the O(T) memory alternative.
"""

import jax
import jax.numpy as jnp

from fnattn import position_bias
from fnattn._dispatch import Lowering
from fnattn.reference import dense_attention


def _forward(cfg, q, k, v, bias, sinks, mask, seed):
    out, lse = dense_attention(q, k, v, bias=bias, sinks=sinks, mask=mask, seed=seed,
                               scale=cfg.scale, softcap=cfg.softcap,
                               dropout_rate=cfg.dropout_rate, upcast=False,
                               q_offset=cfg.q_offset, late_normalize=True)
    # The backward recomputes the forward: lse's rounding error is not needed.
    return out.astype(q.dtype), lse, jnp.zeros_like(lse)


def dense(cfg, mask, seed):
    """``(q, k, v, bias, sinks) -> (out, lse)``: the dense forward of ``cfg`` as plain
    JAX code (differentiable any number of times), computing in the inputs' dtype."""
    def f(q, k, v, bias, sinks):
        return dense_attention(q, k, v, bias=bias, sinks=sinks, mask=mask, seed=seed,
                               scale=cfg.scale, softcap=cfg.softcap,
                               dropout_rate=cfg.dropout_rate, upcast=True,
                               q_offset=cfg.q_offset, late_normalize=True)
    return f


def differentiable(cfg, mask, seed, q, k, v, bias, sinks):
    """``(f, primals)``: the dense forward as a function of (q, k, v, bias, sinks)
    and of the position term's arrays being differentiated (``cfg.term_grad``)."""
    which = cfg.term_grad
    leaves = jax.tree_util.tree_leaves(mask)

    def f(q, k, v, bias, sinks, *terms):
        return dense(cfg, position_bias.with_leaves(mask, which, terms), seed)(
            q, k, v, bias, sinks)

    return f, (q, k, v, bias, sinks, *[leaves[i] for i in which])


def _backward(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse):
    acc = jnp.promote_types(jnp.float32, q.dtype)
    f, primals = differentiable(cfg, mask, seed, q, k, v, bias, sinks)
    up = tuple(None if x is None else x.astype(acc) for x in primals)
    _, vjp = jax.vjp(f, *up)
    grads = vjp((d_out.astype(acc), d_lse.astype(acc)))
    return tuple(None if g is None else g.astype(x.dtype) for g, x in zip(grads, primals))


def _tangent(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, *tangents):
    """(d_out, d_lse): ``jax.jvp`` of the forward, in the accumulation dtype."""
    del out, lse, lse_lo
    acc = jnp.promote_types(jnp.float32, q.dtype)
    f, primals = differentiable(cfg, mask, seed, q, k, v, bias, sinks)
    up = lambda xs: tuple(None if x is None else x.astype(acc) for x in xs)  # noqa: E731
    _, (d_out, d_lse) = jax.jvp(f, up(primals), up(tangents))
    return d_out.astype(q.dtype), d_lse.astype(jnp.float32)


DENSE = Lowering("xla-dense", _forward, _backward, _tangent)
