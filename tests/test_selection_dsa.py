"""DeepSeek-V3.2's sparse attention step (DSA), ported with fnattn.selected_attention,
against a float64 NumPy transcription of the ``transformers`` ``deepseek_v32`` layer.

The transcription follows that model's semantics (written from its description,
no torch needed): MLA projections (q through a low-rank ``q_a`` / RMSNorm /
``q_b``; keys and values from a compressed latent through RMSNorm and
``kv_b``, the rope part of the key shared by the heads, RoPE interleaved);
the lightning indexer (its own queries from the q latent, one LayerNorm'd key
per token, RoPE half-split on the first ``qk_rope_head_dim`` features, scores
``sum_h w[s, h] * H**-0.5 * relu(D**-0.5 * q[s, h] . k[t])`` with ``w`` a
projection of the hidden state), the causal mask on the scores, the top
``min(index_topk, T)`` keys, and attention with the causal mask intersected with
that selection. Tiny random weights; the test compares the layer's output
(after ``o_proj``), the logits a model would feed on. The second test serves the
same step from an MLA latent cache (``value_dim``, no values), contiguous and paged.
"""

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from fnattn import AttentionSpec, masks
from fnattn.selection import blockwise_top_k

CFG = dict(hidden=32, heads=4, q_lora=16, kv_lora=16, nope=8, rope=4, v=8,
           index_heads=8, index_dim=8, topk=6, eps=1e-6, theta=10000.0)


def weights(seed=0):
    c = CFG
    rng = np.random.default_rng(seed)
    qk = c["nope"] + c["rope"]
    shapes = dict(q_a=(c["hidden"], c["q_lora"]), q_a_norm=(c["q_lora"],),
                  q_b=(c["q_lora"], c["heads"] * qk),
                  kv_a=(c["hidden"], c["kv_lora"] + c["rope"]), kv_a_norm=(c["kv_lora"],),
                  kv_b=(c["kv_lora"], c["heads"] * (c["nope"] + c["v"])),
                  o=(c["heads"] * c["v"], c["hidden"]),
                  wq_b=(c["q_lora"], c["index_heads"] * c["index_dim"]),
                  wk=(c["hidden"], c["index_dim"]), k_norm_w=(c["index_dim"],),
                  k_norm_b=(c["index_dim"],), weights_proj=(c["hidden"], c["index_heads"]))
    w = {n: rng.normal(size=s) / np.sqrt(s[0]) for n, s in shapes.items()}
    for n in ("q_a_norm", "kv_a_norm", "k_norm_w"):
        w[n] = 1.0 + 0.1 * rng.normal(size=shapes[n])
    w["k_norm_b"] = 0.1 * rng.normal(size=shapes["k_norm_b"])
    return w


# ----------------------------------------------------------------------------------
# float64 NumPy transcription
# ----------------------------------------------------------------------------------


def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def np_layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def np_cos_sin(S, dim, theta):
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    ang = np.arange(S)[:, None] * inv[None]
    ang = np.concatenate([ang, ang], -1)              # (S, dim)
    return np.cos(ang), np.sin(ang)


def np_rope_half(x, cos, sin):
    """x (..., S, dim) rotated as halves (the indexer's form)."""
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


def np_rope_interleaved(x, cos, sin):
    """x (..., S, dim) whose rotation pairs are adjacent features (MLA's form):
    regrouped as halves, then rotated."""
    d = x.shape[-1]
    x = x.reshape(x.shape[:-1] + (d // 2, 2)).swapaxes(-1, -2).reshape(x.shape)
    return np_rope_half(x, cos, sin)


def np_dsa(w, x, *, select=True):
    """x (B, S, hidden) -> (layer output (B, S, hidden), top-k indices, index scores);
    ``select=False``: dense causal attention (what the selection changes)."""
    c = CFG
    B, S, _ = x.shape
    H, nope, rope, dv = c["heads"], c["nope"], c["rope"], c["v"]
    cos, sin = np_cos_sin(S, rope, c["theta"])
    q_lat = np_rms(x @ w["q_a"], w["q_a_norm"], c["eps"])
    q = (q_lat @ w["q_b"]).reshape(B, S, H, nope + rope).transpose(0, 2, 1, 3)  # (B, H, S, .)
    q_pass, q_rot = q[..., :nope], q[..., nope:]
    ckv = x @ w["kv_a"]
    k_lat, k_rot = ckv[..., :c["kv_lora"]], ckv[..., c["kv_lora"]:]
    kv = (np_rms(k_lat, w["kv_a_norm"], c["eps"]) @ w["kv_b"]).reshape(B, S, H, nope + dv)
    kv = kv.transpose(0, 2, 1, 3)
    k_pass, v = kv[..., :nope], kv[..., nope:]
    q_rot = np_rope_interleaved(q_rot, cos, sin)
    k_rot = np_rope_interleaved(k_rot[:, None], cos, sin)                  # (B, 1, S, rope)
    qs = np.concatenate([q_pass, q_rot], -1)
    ks = np.concatenate([k_pass, np.broadcast_to(k_rot, k_pass.shape[:-1] + (rope,))], -1)

    # the lightning indexer
    Hi, Di = c["index_heads"], c["index_dim"]
    qi = (q_lat @ w["wq_b"]).reshape(B, S, Hi, Di)
    ki = np_layer_norm(x @ w["wk"], w["k_norm_w"], w["k_norm_b"], c["eps"])   # (B, S, Di)
    qi = np.concatenate([np_rope_half(qi[..., :rope].transpose(0, 2, 1, 3), cos, sin)
                         .transpose(0, 2, 1, 3), qi[..., rope:]], -1)
    ki = np.concatenate([np_rope_half(ki[..., :rope], cos, sin), ki[..., rope:]], -1)
    relu = np.maximum(np.einsum("bshd,btd->bsht", qi, ki) * Di ** -0.5, 0.0)
    wts = (x @ w["weights_proj"]) * Hi ** -0.5                                # (B, S, Hi)
    scores = np.einsum("bsh,bsht->bst", wts, relu)
    causal = np.arange(S)[None, :] <= np.arange(S)[:, None]
    scores = np.where(causal, scores, -np.inf)
    k = min(c["topk"], S)
    top = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    selected = np.zeros((B, S, S), bool)
    np.put_along_axis(selected, top, True, axis=-1)

    allowed = (causal[None] & (selected if select else True))[:, None]                              # (B, 1, S, S)
    s = np.einsum("bhqd,bhkd->bhqk", qs, ks) * (nope + rope) ** -0.5
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    attn = np.einsum("bhqk,bhkd->bqhd", p, v).reshape(B, S, H * dv)
    return attn @ w["o"], top, scores


# ----------------------------------------------------------------------------------
# the port: JAX, with fnattn.selected_attention over the indexer's top-k
# ----------------------------------------------------------------------------------


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def rope_half(x, cos, sin):
    """x (B, S, ..., dim); cos/sin (S, dim)."""
    h = x.shape[-1] // 2
    shape = (x.shape[1],) + (1,) * (x.ndim - 3) + (x.shape[-1],)
    rot = jnp.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos.reshape(shape) + rot * sin.reshape(shape)


def rope_interleaved(x, cos, sin):
    d = x.shape[-1]
    x = x.reshape(x.shape[:-1] + (d // 2, 2)).swapaxes(-1, -2).reshape(x.shape)
    return rope_half(x, cos, sin)


def dsa_layer(w, x, *, blockwise=False):
    """The same layer in "bthd": x (B, S, hidden) -> (output, top-k indices)."""
    c = CFG
    B, S, _ = x.shape
    H, nope, rope, dv = c["heads"], c["nope"], c["rope"], c["v"]
    inv = 1.0 / c["theta"] ** (jnp.arange(0, rope, 2) / rope)
    ang = jnp.arange(S)[:, None] * inv[None]
    ang = jnp.concatenate([ang, ang], -1)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    q_lat = rms(x @ w["q_a"], w["q_a_norm"], c["eps"])
    q = (q_lat @ w["q_b"]).reshape(B, S, H, nope + rope)
    ckv = x @ w["kv_a"]
    k_lat, k_rot = ckv[..., :c["kv_lora"]], ckv[..., c["kv_lora"]:]
    kv = (rms(k_lat, w["kv_a_norm"], c["eps"]) @ w["kv_b"]).reshape(B, S, H, nope + dv)
    q = jnp.concatenate([q[..., :nope], rope_interleaved(q[..., nope:], cos, sin)], -1)
    k_rot = rope_interleaved(k_rot[:, :, None], cos, sin)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rot, (B, S, H, rope))], -1)
    v = kv[..., nope:]

    Hi, Di = c["index_heads"], c["index_dim"]
    qi = (q_lat @ w["wq_b"]).reshape(B, S, Hi, Di)
    ki = layer_norm(x @ w["wk"], w["k_norm_w"], w["k_norm_b"], c["eps"])
    qi = jnp.concatenate([rope_half(qi[..., :rope], cos, sin), qi[..., rope:]], -1)
    ki = jnp.concatenate([rope_half(ki[..., :rope], cos, sin), ki[..., rope:]], -1)
    wts = (x @ w["weights_proj"]) * Hi ** -0.5
    kk = min(c["topk"], S)

    def scores_at(start, size):
        kb = jax.lax.dynamic_slice_in_dim(ki, start, size, axis=1)
        relu = jax.nn.relu(jnp.einsum("bshd,btd->bsht", qi, kb) * Di ** -0.5)
        s = jnp.einsum("bsh,bsht->bst", wts, relu)
        key = start + jnp.arange(size)
        return jnp.where(key[None, None] <= jnp.arange(S)[None, :, None], s, -jnp.inf)

    if blockwise:   # the scores one block of keys at a time (never (S, S))
        _, top = blockwise_top_k(lambda start: scores_at(start, 4), S, kk, block_k=4)
    else:
        _, top = jax.lax.top_k(scores_at(0, S), kk)
    # (lax.top_k fills rows with fewer than k causal keys with future ones, which the
    # causal mask removes, as the model's mask intersection does; blockwise_top_k
    # gives -1 there)
    res = fnattn.selected_attention(AttentionSpec(mask=masks.causal()), q, k, v, top)
    return res.out.reshape(B, S, H * dv) @ w["o"], top


def test_dsa_layer_matches_the_float64_transcription():
    w64 = weights(0)
    x64 = np.random.default_rng(1).normal(size=(2, 16, CFG["hidden"]))
    want, want_top, scores = np_dsa(w64, x64)
    # The selection is well defined: no tie at the k-th finite score of any row.
    k = CFG["topk"]
    srt = -np.sort(-scores, axis=-1)
    finite = np.isfinite(srt[..., k])
    assert np.all(np.abs(srt[..., k - 1][finite] - srt[..., k][finite]) > 1e-4)
    # and it matters: dense causal attention differs
    assert np.abs(np_dsa(w64, x64, select=False)[0] - want).max() > 1e-2
    w = {n: jnp.asarray(a, jnp.float32) for n, a in w64.items()}
    x = jnp.asarray(x64, jnp.float32)
    for blockwise in (False, True):
        out, top = jax.jit(dsa_layer, static_argnames="blockwise")(w, x, blockwise=blockwise)
        # the same keys selected (where they are past keys: the rest are masked anyway)
        S = x.shape[1]
        for b in range(2):
            for s in range(S):
                got = {int(j) for j in np.asarray(top[b, s]) if 0 <= j <= s}
                assert got == {int(j) for j in want_top[b, s] if j <= s}, (blockwise, b, s)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)


def dsa_latent(w, x, top, form):
    """The same attention step served from an MLA latent cache (the up-projections
    absorbed into the query and the output): one kv head of kv_lora + rope
    channels per token, the values its first kv_lora channels (``value_dim``), the
    indexer's ``top`` selecting positions; ``form`` "decode" (a contiguous cache)
    or "paged" (the ragged paged form over a pool of pages)."""
    c = CFG
    B, S, _ = x.shape
    H, nope, rope, dv, r = c["heads"], c["nope"], c["rope"], c["v"], c["kv_lora"]
    inv = 1.0 / c["theta"] ** (jnp.arange(0, rope, 2) / rope)
    ang = jnp.arange(S)[:, None] * inv[None]
    ang = jnp.concatenate([ang, ang], -1)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    q_lat = rms(x @ w["q_a"], w["q_a_norm"], c["eps"])
    q = (q_lat @ w["q_b"]).reshape(B, S, H, nope + rope)
    ckv = x @ w["kv_a"]
    latent = rms(ckv[..., :r], w["kv_a_norm"], c["eps"])                   # (B, S, r)
    k_rot = rope_interleaved(ckv[..., r:][:, :, None], cos, sin)[:, :, 0]   # (B, S, rope)
    cache = jnp.concatenate([latent, k_rot], -1)[:, :, None]               # (B, S, 1, r + rope)
    w_kv = w["kv_b"].reshape(r, H, nope + dv)
    q_abs = jnp.einsum("bshn,rhn->bshr", q[..., :nope], w_kv[..., :nope])
    q_full = jnp.concatenate([q_abs, rope_interleaved(q[..., nope:], cos, sin)], -1)
    spec = AttentionSpec(mask=masks.causal(), scale=(nope + rope) ** -0.5)
    if form == "decode":
        o = fnattn.selected_decode(spec, q_full, cache, None, top, value_dim=r,
                                   kv_lengths=jnp.full((B,), S, jnp.int32), unique=True).out
    else:
        ps = 4
        n_pages = S // ps
        # sequence b's pages are b, b + B, b + 2B, ...: interleaved in the pool
        table = jnp.arange(n_pages)[None, :] * B + jnp.arange(B)[:, None]
        pool = jnp.zeros((1, B * n_pages, ps, r + rope))
        pool = pool.at[0, table].set(cache[:, :, 0].reshape(B, n_pages, ps, r + rope))
        o = fnattn.selected_ragged_paged_attention(
            spec, q_full.reshape(B * S, H, r + rope), pool, None, top.reshape(B * S, -1),
            page_table=table, context_lengths=jnp.full((B,), S),
            query_start_loc=jnp.arange(B + 1) * S, num_seqs=jnp.int32(B), value_dim=r).out
        o = o.reshape(B, S, H, r)
    out = jnp.einsum("bshr,rhd->bshd", o, w_kv[..., nope:]).reshape(B, S, H * dv)
    return out @ w["o"]


def test_dsa_layer_over_a_latent_cache_matches_the_float64_transcription():
    w64 = weights(2)
    x64 = np.random.default_rng(3).normal(size=(2, 16, CFG["hidden"]))
    want, _, _ = np_dsa(w64, x64)
    assert np.abs(np_dsa(w64, x64, select=False)[0] - want).max() > 1e-2   # selection matters
    w = {n: jnp.asarray(a, jnp.float32) for n, a in w64.items()}
    x = jnp.asarray(x64, jnp.float32)
    _, top = jax.jit(dsa_layer)(w, x)
    for form in ("decode", "paged"):
        out = jax.jit(dsa_latent, static_argnames="form")(w, x, top, form=form)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4, err_msg=form)
