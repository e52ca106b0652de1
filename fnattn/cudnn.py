"""Delegate to ``jax.nn.dot_product_attention``.

On NVIDIA GPUs this is ``implementation="cudnn"`` (cuDNN's fused kernel); on
every other platform it is ``jax.nn``'s own XLA path, chosen at trace time by
``jax.lax.platform_dependent``. Masks are passed in the forms ``jax.nn``
understands natively (``is_causal``, ``local_window_size``, sequence lengths);
any other mask is materialised as a dense boolean array, which is what
``jax.nn`` accepts. Features ``jax.nn`` cannot express raise
``NotImplementedError`` naming the feature and a lowering that has it.
"""

import jax
import jax.numpy as jnp
from jax import lax

from fnattn import masks
from fnattn.spec import AttentionOutput


def unsupported_features(spec, dims, dtype) -> list[str]:
    feats = []
    if spec.softcap is not None:
        feats.append("softcap")
    if spec.sinks is not None:
        feats.append("sinks")
    if spec.dropout_rate > 0:
        feats.append("dropout")
    if dims.v_head_dim != dims.head_dim:
        feats.append(f"a value head dim Dv={dims.v_head_dim} different from D={dims.head_dim}")
    return feats


def _native_mask(mask, dims):
    """Splits a mask into jax.nn keyword arguments, or None if it has no native form."""
    kwargs = {}
    parts = []

    def flatten(m):
        if isinstance(m, masks.And):
            flatten(m.a)
            flatten(m.b)
        else:
            parts.append(m)

    if mask is None:
        return kwargs
    flatten(mask)
    window = None
    for m in parts:
        if isinstance(m, masks.Causal) and dims.q_len == dims.kv_len:
            kwargs["is_causal"] = True
        elif isinstance(m, masks.SlidingWindow) and dims.q_len == dims.kv_len and window is None:
            window = (m.left if m.left is not None else dims.kv_len,
                      m.right if m.right is not None else dims.kv_len)
        elif isinstance(m, masks.Lengths):
            if m.q_lengths is not None:
                kwargs["query_seq_lengths"] = jnp.asarray(m.q_lengths, jnp.int32)
            if m.kv_lengths is not None:
                kwargs["key_value_seq_lengths"] = jnp.asarray(m.kv_lengths, jnp.int32)
        else:
            return None
    if window is not None:
        kwargs["local_window_size"] = window
    return kwargs


def attention(spec, dims, q, k, v, *, scale: float):
    feats = unsupported_features(spec, dims, q.dtype)
    if feats:
        raise NotImplementedError(
            "impl='cudnn' (jax.nn.dot_product_attention) cannot express: "
            + ", ".join(feats) + ". Use impl='auto' (flash) or impl='xla', which support them.")
    kwargs = _native_mask(spec.mask, dims)
    if kwargs is None:
        dense = masks.materialize(spec.mask, dims.batch, dims.num_q_heads, dims.q_len, dims.kv_len)
        kwargs = {"mask": dense}

    def call(implementation):
        def f(q, k, v, bias, kw):
            out, lse = jax.nn.dot_product_attention(
                q, k, v, bias=bias, scale=scale, implementation=implementation,
                return_residual=True, **kw)
            return out.astype(q.dtype), jnp.swapaxes(lse.astype(jnp.float32), 1, 2)
        return f

    array_kw = {n: a for n, a in kwargs.items() if n != "is_causal" and n != "local_window_size"}
    static_kw = {n: a for n, a in kwargs.items() if n not in array_kw}

    def branch(implementation):
        f = call(implementation)
        return lambda q, k, v, bias, akw: f(q, k, v, bias, {**akw, **static_kw})

    try:
        out, lse = lax.platform_dependent(q, k, v, spec.bias, array_kw,
                                          default=branch("xla"), cuda=branch("cudnn"))
    except RuntimeError as e:
        # jax.nn refuses to trace its cuDNN path where no cuDNN is installed; then no
        # CUDA executable can be produced from this process anyway.
        if "cuDNN" not in str(e):
            raise
        out, lse = branch("xla")(q, k, v, spec.bias, array_kw)
    return AttentionOutput(out, lse)
