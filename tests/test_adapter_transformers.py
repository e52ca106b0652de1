"""fnattn.adapters.transformers on the configs of Llama, Qwen2, Qwen3, Mistral, Gemma 2,
gpt-oss, GPT-2, Phi-3, Llama 4 and Cohere2 (transformers' config classes; no torch).

Every layer's spec, under jax.jit, against a float64 NumPy transcription of that
family's eager attention in transformers (its scaling, its mask functions from
masking_utils: causal ``kv_idx <= q_idx``, sliding ``kv_idx > q_idx - W``, chunked
``kv_idx // C == q_idx // C``; Gemma 2's tanh soft-cap; gpt-oss's sink column dropped
after the softmax; GQA by repeating kv heads), over a whole sequence and over the last
query rows of a cache (absolute positions, as with ``cache_position``)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import fnattn
from fnattn.adapters.transformers import LayerAttention, layers, stacked_spec

SMALL = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, **SMALL),
    "qwen2": lambda: transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True,
                                              sliding_window=3, max_window_layers=2, **SMALL),
    "qwen3": lambda: transformers.Qwen3Config(num_hidden_layers=4, head_dim=6,
                                              use_sliding_window=True, sliding_window=4,
                                              max_window_layers=1, **SMALL),
    "mistral": lambda: transformers.MistralConfig(num_hidden_layers=2, sliding_window=3,
                                                  num_attention_heads=4, num_key_value_heads=1,
                                                  hidden_size=32),
    "gemma2": lambda: transformers.Gemma2Config(num_hidden_layers=4, head_dim=8,
                                                sliding_window=3, query_pre_attn_scalar=12,
                                                attn_logit_softcapping=2.0, **SMALL),
    "gpt_oss": lambda: transformers.GptOssConfig(num_hidden_layers=4, head_dim=8,
                                                 sliding_window=3, **SMALL),
    "gpt2": lambda: transformers.GPT2Config(n_layer=3, n_head=4, n_embd=32,
                                            scale_attn_by_inverse_layer_idx=True),
    "phi3": lambda: transformers.Phi3Config(num_hidden_layers=2, sliding_window=5, **SMALL),
    "llama4": lambda: transformers.Llama4TextConfig(num_hidden_layers=4, head_dim=8,
                                                    attention_chunk_size=4, **SMALL),
    "cohere2": lambda: transformers.Cohere2Config(num_hidden_layers=4, sliding_window=3,
                                                  **SMALL),
}


# ----------------------------------------------------------------------------------
# transformers' eager attention, transcribed in float64 NumPy
# ----------------------------------------------------------------------------------


def hf_layer(family, config, i):
    """(scaling, mask_fn(q_idx, kv_idx), softcap, sinks?) of layer i, as each family's
    modeling code builds them."""
    c = config
    causal = lambda q, k: k <= q  # noqa: E731  masking_utils.causal_mask_function

    def sliding(w):            # sliding_window_overlay & causal
        return lambda q, k: (k > q - w) & (k <= q)

    def chunked(size):         # chunked_overlay (no left padding) & causal
        return lambda q, k: (k // size == q // size) & (k <= q)

    if family == "gpt2":
        hd = c.n_embd // c.n_head
        scaling = hd ** -0.5 if c.scale_attn_weights else 1.0
        if c.scale_attn_by_inverse_layer_idx:
            scaling /= float(i + 1)
        return scaling, causal, None, False
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if family == "cohere2":
        hd = c.hidden_size // c.num_attention_heads
    scaling = c.query_pre_attn_scalar ** -0.5 if family == "gemma2" else hd ** -0.5
    if family in ("mistral", "phi3"):
        # create_sliding_window_causal_mask for every layer when the window is set
        mask = causal if c.sliding_window is None else sliding(c.sliding_window)
    elif family == "llama":
        mask = causal
    elif family == "llama4":
        mask = chunked(c.attention_chunk_size) if c.layer_types[i] == "chunked_attention" \
            else causal
    else:  # qwen2, qwen3, gemma2, gpt_oss, cohere2: per layer_types
        mask = sliding(c.sliding_window) if c.layer_types[i] == "sliding_attention" else causal
    softcap = c.attn_logit_softcapping if family == "gemma2" else None
    return scaling, mask, softcap, family == "gpt_oss"


def hf_eager_attention(family, config, i, q, k, v, sinks=None):
    """q (B, Tq, Hq, D), k/v (B, Tk, Hkv, D): the last Tq of Tk positions."""
    scaling, mask_fn, softcap, has_sinks = hf_layer(family, config, i)
    q, k, v = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)  # repeat_kv
    w = q @ k.transpose(0, 1, 3, 2) * scaling
    if softcap is not None:
        w = np.tanh(w / softcap) * softcap
    Tq, Tk = q.shape[2], k.shape[2]
    q_idx = np.arange(Tk - Tq, Tk)[:, None]      # cache_position
    kv_idx = np.arange(Tk)[None, :]
    w = np.where(mask_fn(q_idx, kv_idx), w, -np.inf)
    if has_sinks:
        s = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                            (*w.shape[:3], 1))
        w = np.concatenate([w, s], axis=-1)
    w = w - w.max(-1, keepdims=True)
    p = np.exp(w)
    p = p / p.sum(-1, keepdims=True)
    if has_sinks:
        p = p[..., :-1]
    return (p @ v).transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------


_attend = jax.jit(lambda spec, q, k, v: fnattn.attention(spec, q, k, v).out)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_layer_equals_the_float64_transcription(family):
    config = CONFIGS[family]()
    n = config.get_text_config().num_hidden_layers
    rng = np.random.default_rng(sorted(CONFIGS).index(family))
    sinks = rng.standard_normal((n, 4)).astype(np.float32) if family == "gpt_oss" else None
    got = layers(config, sinks=sinks)
    assert len(got) == n and all(isinstance(l, LayerAttention) for l in got)
    B, T = 2, 13
    for i, layer in enumerate(got):
        Hq, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
        k = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
        s = None if sinks is None else sinks[i]
        for tq in (T, 3):  # the whole sequence; the last rows over a cache
            want = hf_eager_attention(family, config, i, q[:, T - tq:], k, v, s)
            out = _attend(layer.spec, q[:, T - tq:], k, v)
            np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5,
                                       err_msg=f"{family} layer {i} Tq={tq}")


def test_what_each_config_says():
    """Layer patterns, windows in fnattn's terms (HF's W keys = left=W-1), scales,
    soft-caps and head shapes, read from each family's config."""
    def summary(family):
        return [(l.layer_type[:4], l.window, l.chunk_size) for l in layers(
            CONFIGS[family](), sinks=np.zeros((4, 4)) if family == "gpt_oss" else None)]

    assert summary("qwen2") == [("full", None, None)] * 2 + [("slid", 3, None)] * 2
    assert summary("qwen3") == [("full", None, None)] + [("slid", 4, None)] * 3
    assert summary("gemma2") == [("slid", 3, None), ("full", None, None)] * 2
    assert summary("gpt_oss") == [("slid", 3, None), ("full", None, None)] * 2
    assert summary("cohere2") == [("slid", 3, None)] * 3 + [("full", None, None)]
    assert summary("llama4") == [("chun", None, 4)] * 3 + [("full", None, None)]
    assert summary("mistral") == [("slid", 3, None)] * 2
    assert summary("phi3") == [("slid", 5, None)] * 2
    assert summary("llama") == [("full", None, None)] * 2
    sw = layers(CONFIGS["gemma2"]())[0]
    assert repr(sw.spec.mask) == "(causal() & sliding_window(left=2, right=0))"
    assert sw.spec.scale == 12 ** -0.5 and sw.spec.softcap == 2.0
    assert (sw.num_heads, sw.num_kv_heads, sw.head_dim) == (4, 2, 8)
    assert repr(layers(CONFIGS["llama4"]())[0].spec.mask) == "(causal() & chunked(4))"
    assert [l.spec.scale for l in layers(CONFIGS["gpt2"]())] == \
        [8 ** -0.5, 8 ** -0.5 / 2, 8 ** -0.5 / 3]
    g2 = layers(CONFIGS["gpt2"]())[0]
    assert (g2.num_heads, g2.num_kv_heads, g2.head_dim) == (4, 4, 8)
    assert layers(CONFIGS["qwen3"]())[0].head_dim == 6
    m = layers(CONFIGS["mistral"]())[0]
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (4, 1, 8)
    # Qwen2 without use_sliding_window: no window anywhere.
    plain = transformers.Qwen2Config(num_hidden_layers=3, sliding_window=3, **SMALL)
    assert [l.window for l in layers(plain)] == [None] * 3
    assert all(repr(l.spec.mask) == "causal()" for l in layers(plain))


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "llama4", "qwen2", "cohere2",
                                    "mistral"])
def test_a_scan_over_the_stacked_spec_equals_the_layers_one_by_one(family):
    """Every layer's window, chunk and sinks sliced from the stacked spec by
    lax.scan: the same as the unrolled layers with their own specs (forward and the
    gradient of the input)."""
    config = CONFIGS[family]()
    n = config.get_text_config().num_hidden_layers
    rng = np.random.default_rng(11)
    sinks = rng.standard_normal((n, 4)).astype(np.float32) if family == "gpt_oss" else None
    attn = layers(config, sinks=sinks)
    spec = stacked_spec(attn)
    hkv, d = attn[0].num_kv_heads, attn[0].head_dim
    x = jnp.asarray(rng.standard_normal((2, 13, 4, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, d, d)) / np.sqrt(d), jnp.float32)

    def layer(x, spec, w):
        kv = (x @ w)[:, :, :hkv]
        return x + fnattn.attention(spec, x, kv, kv).out

    def scanned(x):
        return jax.lax.scan(lambda x, a: (layer(x, *a), None), x, (spec, w))[0]

    def unrolled(x):
        for i, l in enumerate(attn):
            x = layer(x, l.spec, w[i])
        return x

    f = lambda g: jax.value_and_grad(lambda x: jnp.sum(jnp.sin(g(x))))  # noqa: E731
    a, b = jax.jit(f(scanned))(x), jax.jit(f(unrolled))(x)
    for p, q in zip(a, b):
        np.testing.assert_allclose(p, q, atol=2e-5, rtol=2e-5)


def test_stacked_spec_refuses_layers_that_differ_in_scale():
    with pytest.raises(ValueError, match=r"stacked_spec: the layers' scale differ"):
        stacked_spec(layers(CONFIGS["gpt2"]()))


def test_llama4_temperature_tuning_scales_the_queries_of_its_nope_layers():
    config = CONFIGS["llama4"]()
    got = layers(config)
    pos = np.arange(0, 40000, 997)
    want = np.log1p(np.floor((pos + 1.0) / config.floor_scale)) * config.attn_scale + 1.0
    for i, l in enumerate(got):
        nope = not config.no_rope_layers[i]
        assert (l.temperature is not None) == nope
        scales = jax.jit(l.query_scales)(pos)
        np.testing.assert_allclose(scales, want if nope else np.ones_like(want), rtol=1e-6)
    off = transformers.Llama4TextConfig(num_hidden_layers=4, attn_temperature_tuning=False,
                                        **SMALL)
    assert all(l.temperature is None for l in layers(off))


def test_composite_configs_are_read_through_their_text_config():
    config = transformers.Llama4Config(text_config=dict(num_hidden_layers=4, head_dim=8,
                                                        attention_chunk_size=4, **SMALL))
    assert [l.chunk_size for l in layers(config)] == [4, 4, 4, None]


def test_messages():
    with pytest.raises(ValueError, match=r"gpt_oss layers have learned attention sinks.*"
                                         r"sinks=array of shape \(num_layers, "
                                         r"num_attention_heads\)=\(4, 4\)"):
        layers(CONFIGS["gpt_oss"]())
    with pytest.raises(ValueError, match=r"sinks must have shape .*=\(4, 4\); got \(4, 3\)"):
        layers(CONFIGS["gpt_oss"](), sinks=np.zeros((4, 3)))
    with pytest.raises(ValueError, match="sinks given, but llama attention has no sinks"):
        layers(CONFIGS["llama"](), sinks=np.zeros((2, 4)))
    with pytest.raises(TypeError, match="config must be a transformers.PretrainedConfig"):
        layers({"num_hidden_layers": 2})
    odd = CONFIGS["qwen3"]()
    odd.layer_types = ["full_attention", "linear_attention", "full_attention",
                       "full_attention"]
    with pytest.raises(NotImplementedError, match="layer 1 of Qwen3Config is 'linear_attention'"):
        layers(odd)


def test_import_fnattn_does_not_import_transformers():
    code = ("import sys, fnattn, fnattn.adapters; "
            "assert 'transformers' not in sys.modules, 'transformers'; "
            "assert 'fnattn.adapters.transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
