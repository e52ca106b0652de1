"""Delegate to ``jax.nn.dot_product_attention``.

On NVIDIA GPUs this is ``implementation="cudnn"`` (cuDNN's fused kernel); on
every other platform it is ``jax.nn``'s own XLA path, chosen at trace time by
``jax.lax.platform_dependent``. Masks are passed in the forms ``jax.nn``
understands natively (``is_causal``, ``local_window_size``, sequence lengths);
any other mask is materialised as a dense boolean array, which is what
``jax.nn`` accepts. Features ``jax.nn`` cannot express raise
``NotImplementedError`` naming the feature and a lowering that has it.

Three gaps of ``jax.nn`` are closed here so that the delegate keeps fnattn's
contract: rows that see no key give ``out = 0`` and ``lse = -inf`` (jax.nn gives
the mean of ``v``); a bias of -inf is a mask (jax.nn's backward gives NaN for a
row whose every bias is -inf); and gradients flow through ``lse`` (jax.nn stops
them).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

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
    if mask is None:
        return kwargs
    parts = masks.conjuncts(mask)
    square = dims.q_len == dims.kv_len
    # jax.nn's is_causal and windows align top-left: native only when Tq == Tk.
    causal = square and any(isinstance(m, masks.Causal) for m in parts)
    windows = []
    for m in parts:
        if isinstance(m, masks.Causal) and square:
            kwargs["is_causal"] = True
        elif isinstance(m, masks.SlidingWindow) and square:
            windows.append(m)
        elif isinstance(m, masks.Lengths):
            for name, arr in (("query_seq_lengths", m.q_lengths),
                              ("key_value_seq_lengths", m.kv_lengths)):
                if arr is None:
                    continue
                if name in kwargs:  # two length masks: jax.nn takes one of each
                    return None
                kwargs[name] = jnp.asarray(arr, jnp.int32)
        else:
            return None
    if len(windows) > 1:
        return None
    if windows:
        (w,) = windows
        left = w.left if w.left is not None else dims.kv_len
        # Under causal the right side of a window changes nothing; without it, jax.nn
        # (cuDNN) takes no right side at all.
        right = 0 if causal else (w.right if w.right is not None else dims.kv_len)
        if right != 0:
            return None
        kwargs["local_window_size"] = (left, right)
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

    def nn(q, k, v, bias, akw):
        try:
            return lax.platform_dependent(q, k, v, bias, akw,
                                          default=branch("xla"), cuda=branch("cudnn"))
        except RuntimeError as e:
            # jax.nn refuses to trace its cuDNN path where no cuDNN is installed; then
            # no CUDA executable can be produced from this process anyway.
            if "cuDNN" not in str(e):
                raise
            return branch("xla")(q, k, v, bias, akw)

    mask_leaves, mask_treedef = jax.tree_util.tree_flatten(spec.mask)

    def allowed(leaves):
        mask = jax.tree_util.tree_unflatten(mask_treedef, leaves)
        return masks.materialize(mask, dims.batch, dims.num_q_heads, dims.q_len, dims.kv_len,
                                 validate=False)

    bias = spec.bias
    visible = allowed(tuple(mask_leaves)) if spec.mask is not None else None
    if bias is not None:
        # -inf in the bias masks the key: jax.nn's backward turns a row whose every
        # logit is -inf into NaN, so such entries become a large finite negative
        # number (their weight is exactly 0 beside any finite logit, and the where
        # gives the original bias a zero gradient there) and the row is dead below.
        masked = bias == -jnp.inf
        big = float(jnp.finfo(bias.dtype).max)
        # jax.nn fills masked logits with -0.7 * max: a visible logit below that
        # (a row of finfo.min bias) would lose to the keys the mask hides. Visible
        # logits are floored at -0.5 * max (in value only: the gradient passes as
        # if unclamped); a row of them stays a uniform softmax, as in float32 any
        # row of such logits is.
        floor = -0.5 * big
        floored = bias + lax.stop_gradient(jnp.maximum(bias, floor) - bias)
        visible = ~masked if visible is None else visible & ~masked
        # Where a row's logits were all floored its lse is shifted back: the bias
        # dominates such logits, so the row's largest visible bias is its max.
        row_max = jnp.max(jnp.where(visible, bias.astype(jnp.float32), -jnp.inf), axis=-1)
        lse_shift = lax.stop_gradient(jnp.where(row_max < floor, row_max - floor, 0.0))
        bias = jnp.where(masked, jnp.asarray(-0.7 * big, bias.dtype), floored)
        # (B|1, Hq|1, Tq, Tk), whatever the rank the bias broadcasts from
        visible = visible.reshape((1,) * (4 - visible.ndim) + visible.shape)
    if visible is not None:
        # Keys that no query row of their (batch, kv head) may see are zeroed, so
        # that NaN or inf in unused cache slots or padding cannot reach the output
        # through 0 * NaN in jax.nn's weights-times-values product. (A key seen by
        # some rows but not others is used as it is: jax.nn works on whole rows.)
        used = jnp.any(visible, axis=2)                                 # (B|1, Hq|1, Tk)
        if used.shape[1] > 1:
            used = jnp.any(used.reshape(used.shape[0], dims.num_kv_heads, -1, dims.kv_len),
                           axis=2)
        used = jnp.swapaxes(used, 1, 2)[..., None]                       # (B|1, Tk, H|1, 1)
        k = jnp.where(used, k, jnp.zeros((), k.dtype))
        v = jnp.where(used, v, jnp.zeros((), v.dtype))
    out, lse = _with_lse_gradient(nn, allowed, scale)(q, k, v, bias, array_kw,
                                                       tuple(mask_leaves))
    if spec.bias is not None:
        lse = lse + lse_shift.reshape((1,) * (3 - lse_shift.ndim) + lse_shift.shape)
    if visible is not None:
        # jax.nn fills masked logits with a large finite negative number, so a row
        # that sees no key comes back as the mean of v (and cuDNN leaves padded rows
        # unspecified). fnattn's contract is out = 0, lse = -inf there. Dead rows
        # are read off the mask and the bias, not off lse: a row whose logits are
        # all -1e30 (a finite bias) is a softmax like any other.
        dead = jnp.broadcast_to(~jnp.any(visible, axis=-1), lse.shape)
        out = jnp.where(jnp.swapaxes(dead, 1, 2)[..., None], jnp.zeros((), out.dtype), out)
        lse = jnp.where(dead, -jnp.inf, lse)
    return AttentionOutput(out, lse)


def _with_lse_gradient(nn, allowed, scale):
    """``nn`` (jax.nn's call) with a gradient through ``lse`` as well as ``out``.

    jax.nn returns its logsumexp under ``stop_gradient``; fnattn's contract is that
    gradients flow through ``lse`` (merging partial results needs them). The
    ``out`` cotangent goes to jax.nn's own backward (cuDNN's on NVIDIA GPUs); a
    non-zero ``lse`` cotangent adds ``d lse / d s = p``, computed densely, so only
    code that differentiates through ``lse`` pays O(Tq * Tk) memory for it.
    """

    @jax.custom_vjp
    def f(q, k, v, bias, akw, mask_leaves):
        return nn(q, k, v, bias, akw)

    def fwd(q, k, v, bias, akw, mask_leaves):
        q, k, v, bias, akw, mask_leaves = jax.tree_util.tree_map(
            lambda p: p.value, (q, k, v, bias, akw, mask_leaves))
        (out, lse), vjp = jax.vjp(lambda q, k, v, bias: nn(q, k, v, bias, akw), q, k, v, bias)
        return (out, lse), (vjp, q, k, bias, mask_leaves, jnp.zeros_like(lse))

    def bwd(res, cotangents):
        vjp, q, k, bias, mask_leaves, zero_lse = res
        d_out, d_lse = cotangents
        if isinstance(d_out, SymbolicZero):
            d_out = jnp.zeros(d_out.shape, d_out.dtype)
        dq, dk, dv, dbias = vjp((d_out, zero_lse))
        if not isinstance(d_lse, SymbolicZero):
            dq_l, dk_l, dbias_l = _lse_vjp(q, k, bias, allowed(mask_leaves), scale, d_lse)
            dq = (dq + dq_l).astype(dq.dtype)
            dk = (dk + dk_l).astype(dk.dtype)
            if bias is not None:
                dbias = (dbias + dbias_l).astype(dbias.dtype)
        # akw and the mask leaves are integer or boolean: no cotangent.
        return dq, dk, dv, dbias, None, tuple(None for _ in mask_leaves)

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def _lse_vjp(q, k, bias, allowed, scale, d_lse):
    """Cotangents of q, k, bias from ``d_lse`` (B, Hq, Tq): ``d lse / d s = p``."""
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    # q in the logits' (B, Hkv, G, Tq, D) order (as fnattn.reference.dense_attention)
    qg = q.astype(jnp.float32).reshape(B, Tq, Hkv, G, D).transpose(0, 2, 3, 1, 4)
    k32 = k.astype(jnp.float32)
    s = jnp.einsum("bhgqd,bkhd->bhgqk", qg, k32).reshape(B, Hq, Tq, -1) * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    s = jnp.where(allowed, s, -jnp.inf)
    # a constant shift (as fnattn._online.running_max): second order
    # differentiates this backward, and the derivative of the maximum cancels
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    w = e / jnp.where(denom > 0, denom, 1.0) * d_lse.astype(jnp.float32)[..., None]
    wg = w.reshape(B, Hkv, G, Tq, -1)
    dq = jnp.einsum("bhgqk,bkhd->bhgqd", wg, k32).transpose(0, 3, 1, 2, 4).reshape(q.shape)
    dq = dq * scale
    dk = jnp.einsum("bhgqk,bhgqd->bkhd", wg, qg) * scale
    dbias = None
    if bias is not None:
        axes = tuple(i for i, n in enumerate((1,) * (4 - bias.ndim) + bias.shape) if n == 1)
        dbias = jnp.sum(w, axis=axes, keepdims=True).reshape(bias.shape)
    return dq, dk, dbias
