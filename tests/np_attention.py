"""Attention in float64 NumPy, written independently of fnattn's own code.

Forward and a hand-derived backward, used as ground truth by the tests.
Inputs are "bthd"; masks are dense boolean arrays broadcastable to (B, H, Tq, Tk)
and dropout is a dense keep array of the same shape.
"""

import numpy as np


def _expand_kv(x, group):
    return np.repeat(x, group, axis=2)


def np_attention(q, k, v, *, scale=None, bias=None, softcap=None, mask=None, sinks=None,
                 keep=None, rate=0.0):
    """Returns (out (B,Tq,Hq,Dv), lse (B,Hq,Tq), internals)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    ke, ve = _expand_kv(k, G), _expand_kv(v, G)
    s = np.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    t = softcap * np.tanh(s / softcap) if softcap is not None else s
    allowed = np.ones_like(t, bool) if mask is None else np.broadcast_to(mask, t.shape)
    tm = np.where(allowed, t, -np.inf)
    m = tm.max(-1)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, np.float64)[None, :, None])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(allowed, np.exp(tm - m[..., None]), 0.0)
    denom = e.sum(-1)
    if sinks is not None:
        psink_num = np.exp(np.asarray(sinks, np.float64)[None, :, None] - m)
        denom = denom + psink_num
    with np.errstate(divide="ignore"):
        lse = np.where(denom > 0, m + np.log(np.where(denom > 0, denom, 1.0)), -np.inf)
    p = e / np.where(denom > 0, denom, 1.0)[..., None]
    with np.errstate(invalid="ignore"):  # a sink of +inf: inf / inf (unused then)
        psink = psink_num / np.where(denom > 0, denom, 1.0) if sinks is not None else None
    keepf = np.ones_like(p) if keep is None else np.broadcast_to(keep, p.shape) / (1.0 - rate)
    pd = p * keepf
    out = np.einsum("bhqk,bkhd->bqhd", pd, ve)
    return out, lse, dict(s=s, p=p, pd=pd, keepf=keepf, psink=psink, ke=ke, ve=ve,
                          scale=scale, G=G)


def np_causal_tail(q, k, v, *, sinks=None):
    """Causal attention of the last Tq of Tk tokens (query i is at position
    Tk - Tq + i): (out (B, Tq, Hq, Dv), lse (B, Hq, Tq))."""
    Tq, Tk = q.shape[1], k.shape[1]
    mask = np.arange(Tk)[None, :] <= Tk - Tq + np.arange(Tq)[:, None]
    out, lse, _ = np_attention(q, k, v, mask=mask, sinks=sinks)
    return out, lse


def np_attention_grads(q, k, v, d_out, d_lse=None, *, scale=None, bias=None, softcap=None,
                       mask=None, sinks=None, keep=None, rate=0.0):
    """Returns dict of float64 gradients dq, dk, dv, dbias (full shape), dsinks."""
    q64 = np.asarray(q, np.float64)
    out, lse, it = np_attention(q, k, v, scale=scale, bias=bias, softcap=softcap, mask=mask,
                                sinks=sinks, keep=keep, rate=rate)
    B, Tq, Hq, D = q64.shape
    Hkv = np.shape(k)[2]
    G, scale = it["G"], it["scale"]
    do = np.asarray(d_out, np.float64)
    p, keepf, ke, ve = it["p"], it["keepf"], it["ke"], it["ve"]
    dve = np.einsum("bhqk,bqhd->bkhd", it["pd"], do)
    dpd = np.einsum("bqhd,bkhd->bhqk", do, ve)
    dp = dpd * keepf
    rowdot = (p * dp).sum(-1)
    dl = np.zeros_like(rowdot) if d_lse is None else np.asarray(d_lse, np.float64)
    dt = p * (dp - rowdot[..., None]) + p * dl[..., None]
    ds = dt * (1.0 - np.tanh(it["s"] / softcap) ** 2) if softcap is not None else dt
    dq = np.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dke = np.einsum("bhqk,bqhd->bkhd", ds, q64) * scale
    dk = dke.reshape(B, -1, Hkv, G, D).sum(3)
    dv = dve.reshape(B, -1, Hkv, G, dve.shape[-1]).sum(3)
    res = dict(dq=dq, dk=dk, dv=dv, dbias=ds, out=out, lse=lse)
    if sinks is not None:
        ps = it["psink"]
        res["dsinks"] = (-ps * rowdot + ps * dl).sum((0, 2))
    return res


def reduce_to(x, shape):
    """Sums a broadcast gradient back to `shape` (same rank or lower)."""
    padded = (1,) * (x.ndim - len(shape)) + tuple(shape)
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, padded)) if b == 1 and a != 1)
    return x.sum(axes, keepdims=True).reshape(shape)
