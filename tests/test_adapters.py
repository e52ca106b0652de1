"""fnattn.adapters: flax's and equinox's attention layers give the same outputs and
gradients with fnattn inside as with their own attention, for the same parameters."""

import functools
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention_weights
from jax.experimental import checkify

from fnattn import AttentionSpec, masks
from fnattn.adapters import equinox as fnattn_eqx
from fnattn.adapters.flax import attention_fn, make_attention_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = dict(atol=2e-5, rtol=2e-5)


def randn(seed: int, shape: tuple) -> np.ndarray:
    # NumPy inputs: no eager JAX op to compile before the jitted code runs.
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def close(a, b, **tol):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **(tol or TOL))


def tree_close(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        close(x, y, atol=5e-5, rtol=5e-5)


@functools.cache
def nnx_pair():
    """The same nnx layer twice (same seed, same parameters): flax's attention, fnattn's.
    Grouped-query: 4 query heads, 2 key/value heads. (Built once; the tests only read it.)"""
    args = dict(num_heads=4, num_kv_heads=2, in_features=12, qkv_features=16, decode=False)
    return (nnx.MultiHeadAttention(**args, rngs=nnx.Rngs(0)),
            nnx.MultiHeadAttention(**args, rngs=nnx.Rngs(0), attention_fn=attention_fn))


@nnx.jit
def nnx_out_and_grads(layer, x, mask):
    def loss(layer):
        y = layer(x, mask=mask)
        return (y * jnp.cos(y)).sum(), y
    grads, y = nnx.grad(loss, has_aux=True)(layer)
    return y, nnx.state(grads, nnx.Param)


# -- flax nnx --------------------------------------------------------------------------


def test_nnx_causal_two_batch_axes_gqa():
    ref_layer, layer = nnx_pair()
    x = randn(1, (2, 3, 11, 12))       # two batch axes
    mask = nnx.make_causal_mask(x[..., 0])                         # float32 (2, 3, 1, 11, 11)
    assert mask.dtype == jnp.float32
    y_ref, g_ref = nnx_out_and_grads(ref_layer, x, mask)
    y, g = nnx_out_and_grads(layer, x, mask)
    assert y.shape == (2, 3, 11, 12)
    close(y, y_ref)
    tree_close(g, g_ref)


def test_nnx_is_causal_flag():
    ref_layer, layer = nnx_pair()
    x = randn(2, (3, 7, 12))
    f = nnx.jit(lambda layer, x: layer(x, is_causal=True))
    close(f(layer, x), f(ref_layer, x))


def test_nnx_padding_mask():
    ref_layer, layer = nnx_pair()
    x = randn(3, (3, 13, 12))
    lengths = jnp.array([13, 9, 4])
    valid = (jnp.arange(13)[None] < lengths[:, None]).astype(jnp.float32)   # (3, 13)
    # Padded keys are hidden from every query: the same on both sides.
    key_pad = nnx.make_attention_mask(jnp.ones_like(valid), valid)
    f = nnx.jit(lambda layer, x, m: layer(x, mask=m))
    close(f(layer, x, key_pad), f(ref_layer, x, key_pad))
    # Padded queries too: those rows see no key. fnattn's attention gives zeros there
    # (the layer's output is then its output bias); flax's gives the mean of the values.
    both = nnx.make_attention_mask(valid, valid)
    y, y_ref = f(layer, x, both), f(ref_layer, x, both)
    keep = np.asarray(valid, bool)
    close(np.asarray(y)[keep], np.asarray(y_ref)[keep])
    close(np.asarray(y)[~keep], np.broadcast_to(layer.out.bias[...], y[~keep].shape))


def test_nnx_decode():
    # Cached decoding: flax builds a float mask of the filled slots, (B, 1, 1, S).
    def layer(**kw):
        m = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=True,
                                   rngs=nnx.Rngs(0), **kw)
        m.init_cache((2, 4, 8))
        return m
    ref_layer, fn_layer = layer(), layer(attention_fn=attention_fn)
    x = randn(21, (2, 4, 8))
    step = nnx.jit(lambda m, token: m(token))
    for i in range(4):
        close(step(fn_layer, x[:, i:i + 1]), step(ref_layer, x[:, i:i + 1]))


def test_nnx_causal_top_left_cross_attention():
    # is_causal with q_length != kv_length: query t sees keys s <= t, as flax's.
    q = randn(4, (2, 5, 4, 8))
    k = randn(5, (2, 9, 2, 8))
    v = randn(6, (2, 9, 2, 8))
    f = jax.jit(lambda a, b, c: attention_fn(a, b, c, is_causal=True))
    for q_, k_, v_ in ((q, k, v), (k.repeat(2, 2), q[:, :, :2], q[:, :, :2])):
        close(f(q_, k_, v_), nnx.dot_product_attention(q_, k_, v_, is_causal=True))


def test_bias_and_dtype():
    q = randn(7, (2, 6, 3, 8))
    k = v = randn(8, (2, 6, 3, 8))
    bias = randn(9, (3, 6, 6))          # no batch axis
    ref = nnx.dot_product_attention(q, k, v, bias=bias)
    close(jax.jit(lambda q, k, v, b: attention_fn(q, k, v, b))(q, k, v, bias), ref)
    out = jax.jit(lambda q, k, v: attention_fn(q, k, v, dtype=jnp.bfloat16))(q, k, v)
    assert out.dtype == jnp.bfloat16
    close(out.astype(jnp.float32), nnx.dot_product_attention(q, k, v), atol=3e-2, rtol=3e-2)


# -- flax linen ------------------------------------------------------------------------


def test_linen_matches_default():
    x = randn(10, (2, 9, 12))
    mask = nn.make_causal_mask(x[..., 0])
    ref_layer = nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=12)
    layer = nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=12,
                                            attention_fn=attention_fn)
    params = jax.jit(ref_layer.init)(jax.random.key(0), x, mask=mask)

    @functools.partial(jax.jit, static_argnums=1)
    def run(params, mod):
        return jax.value_and_grad(lambda p: jnp.sin(mod.apply(p, x, mask=mask)).sum())(params)

    (l_ref, g_ref), (l, g) = run(params, ref_layer), run(params, layer)
    close(l, l_ref, atol=1e-4, rtol=1e-5)
    tree_close(g, g_ref)


def test_linen_dropout_and_spec():
    x = randn(11, (2, 8, 12))
    fn = make_attention_fn(AttentionSpec(mask=masks.sliding_window(left=3), impl="xla"))
    layer = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.4,
                                            deterministic=False, attention_fn=fn)
    params = jax.jit(layer.init)(jax.random.key(0), x)
    run = jax.jit(lambda p, r: layer.apply(p, x, rngs={"dropout": r}))
    a, b, c = run(params, jax.random.key(1)), run(params, jax.random.key(1)), run(
        params, jax.random.key(2))
    assert a.shape == x.shape and bool(jnp.isfinite(a).all())
    close(a, b, atol=0, rtol=0)
    assert not np.allclose(a, c)
    # The sliding window holds: with no dropout, equal to flax's with the window's mask.
    det = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn)
    ref = nn.MultiHeadDotProductAttention(num_heads=2)
    t = jnp.arange(8)
    window = ((t[None] <= t[:, None]) & (t[None] >= t[:, None] - 3))[None]
    close(jax.jit(det.apply)(params, x), jax.jit(lambda p: ref.apply(p, x, mask=window))(params))


# -- dropout ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def weights_probe(shape_q, kv_len, num_kv_heads):
    """q, k and a one-hot v, so that the output row is the attention weights."""
    q = randn(12, shape_q)
    batch = shape_q[:-3]
    k = randn(13, batch + (kv_len, num_kv_heads, shape_q[-1]))
    v = jnp.broadcast_to(jnp.eye(kv_len)[:, None, :], batch + (kv_len, num_kv_heads, kv_len))
    return q, k, v


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout(broadcast):
    rate = 0.5
    q, k, v = weights_probe((2, 3, 7, 4, 8), 11, 2)                 # two batch axes, GQA
    run = jax.jit(lambda q, k, v, r, rate, det: attention_fn(
        q, k, v, dropout_rng=r, dropout_rate=rate, deterministic=det,
        broadcast_dropout=broadcast, is_causal=True), static_argnums=(4, 5))
    w = run(q, k, v, jax.random.key(0), 0.0, False)                 # rate 0: no dropout
    weights = jax.jit(functools.partial(dot_product_attention_weights, is_causal=True))(q, k)
    close(w, jnp.swapaxes(weights, -2, -3))
    close(run(q, k, v, jax.random.key(0), rate, True), w)           # deterministic
    d = run(q, k, v, jax.random.key(0), rate, False)
    close(d, run(q, k, v, jax.random.key(0), rate, False), atol=0, rtol=0)
    assert not np.array_equal(d, run(q, k, v, jax.random.key(1), rate, False))
    d, w = np.asarray(d), np.asarray(w)
    kept = d != 0
    visible = w != 0
    assert not (kept & ~visible).any()
    close(d[kept], w[kept] / (1 - rate))                            # rescaled by 1/(1-rate)
    frac = kept[visible].mean()
    assert 0.4 < frac < 0.6, frac
    # kept: (2, 3, Tq, H, Tk). Shared across batch rows and heads, or drawn for each.
    same = kept == kept[:1, :1, :, :1]
    assert same.all() if broadcast else not same.all()


def test_nnx_dropout():
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, dropout_rate=0.3,
                                   decode=False, rngs=nnx.Rngs(0, dropout=1),
                                   attention_fn=attention_fn)
    x = randn(14, (3, 6, 8))
    f = nnx.jit(lambda layer, x, det: layer(x, deterministic=det), static_argnums=2)
    a, b, c = f(layer, x, False), f(layer, x, False), f(layer, x, True)
    assert a.shape == x.shape and bool(jnp.isfinite(a).all())
    assert not np.allclose(a, b)                                    # the rng stream moves on
    assert not np.allclose(a, c)
    ref_layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
                                       rngs=nnx.Rngs(0))
    close(c, nnx.jit(lambda layer, x: layer(x))(ref_layer, x))


# -- refusals and messages -------------------------------------------------------------


def test_float_mask_values_other_than_0_and_1():
    q = k = v = randn(15, (2, 5, 2, 4))
    additive = jnp.where(jnp.tri(5, dtype=bool), 0.0, -1e9)[None, None]
    with pytest.raises(ValueError, match=r"attention_fn: a float32 mask must hold only 1 "
                       r"\(attend\) and 0 \(hide\); this one \(shape \(1, 1, 5, 5\)\) also "
                       r"holds \[-1000000000.0\]\. An additive mask .* pass it as bias="):
        attention_fn(q, k, v, mask=additive)
    # Traced: the rows holding such a value are NaN; checked=True reports it.
    bad = jnp.tri(5).at[3, 1].set(0.5)
    out = jax.jit(lambda m: attention_fn(q, k, v, mask=m))(bad)
    assert np.isnan(out[:, 3]).all() and np.isfinite(np.delete(np.asarray(out), 3, 1)).all()
    checked = make_attention_fn(checked=True)
    err, _ = jax.jit(checkify.checkify(lambda m: checked(q, k, v, mask=m)))(bad)
    assert "the mask holds 0.5; a numeric mask must hold only 1 (attend) and 0" in err.get()
    err, _ = jax.jit(checkify.checkify(lambda m: checked(q, k, v, mask=m)))(jnp.tri(5))
    assert err.get() is None


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(precision="highest"), ValueError, "attention_fn: precision must be None; got "
     "'highest'"),
    (dict(module=object()), ValueError, "sow_weights=False"),
    (dict(qk_attn_weights_einsum=jnp.einsum), ValueError,
     "qk_attn_weights_einsum must be None"),
    (dict(dropout_rate=0.1), ValueError, "needs dropout_rng"),
    (dict(dropout_rate=1.0, deterministic=True), ValueError, r"dropout_rate must be in \[0, 1\)"),
    (dict(is_causal=jnp.array(True)), TypeError, "is_causal must be a Python bool"),
    (dict(mask=jnp.ones((2, 3, 5, 5))), ValueError, r"mask must be broadcastable to "
     r"\[batch..., num_heads, q_length, kv_length\]=\(2, 2, 5, 5\).*got shape \(2, 3, 5, 5\)"),
])
def test_flax_refusals(kwargs, error, match):
    q = k = v = jnp.ones((2, 5, 2, 4))
    with pytest.raises(error, match=match):
        attention_fn(q, k, v, **kwargs)


def test_make_attention_fn_refusals():
    with pytest.raises(ValueError, match="Dropout comes from the module"):
        make_attention_fn(AttentionSpec(dropout_rate=0.1, dropout_key=jax.random.key(0)))
    with pytest.raises(ValueError, match="spec.layout must be 'bthd'"):
        make_attention_fn(AttentionSpec(layout="bhtd"))


def test_nnx_sow_weights_refused():
    _, layer = nnx_pair()
    with pytest.raises(ValueError, match="fnattn never forms the weights"):
        layer(jnp.ones((2, 5, 12)), sow_weights=True)


# -- equinox ---------------------------------------------------------------------------


def eqx_pair(dropout_p=0.0, spec=None):
    mha = eqx.nn.MultiheadAttention(4, 16, key_size=12, value_size=12, qk_size=8, vo_size=6,
                                    use_query_bias=True, dropout_p=dropout_p,
                                    key=jax.random.key(0))
    return mha, fnattn_eqx.MultiheadAttention(mha, spec)


def test_equinox_matches_multihead_attention():
    mha, attn = eqx_pair()
    x = randn(16, (3, 7, 16))
    y = randn(17, (3, 10, 12))
    # One mask per head ((num_heads, q_seq, kv_seq); (q_seq, kv_seq) in the next test).
    mask = np.random.default_rng(18).uniform(size=(4, 7, 10)) > 0.4
    mask[..., 0] = True

    def rotate(q, k, v):                                             # a process_heads
        return q[:, ::-1], k * 2.0, v

    @eqx.filter_jit
    def run(model):
        def loss(model):
            out = jax.vmap(lambda x, y: model(x, y, y, mask, process_heads=rotate))(x, y)
            return jnp.sin(out).sum(), out
        return eqx.filter_grad(loss, has_aux=True)(model)

    g_ref, y_ref = run(mha)
    g, y = run(attn)
    assert y.shape == (3, 7, 16)
    close(y, y_ref)
    tree_close(g.mha, g_ref)


def test_equinox_spec_and_sinks():
    # A causal spec equals equinox's with the causal mask; sinks are trainable fields.
    x = randn(19, (2, 6, 16))
    mha, attn = eqx_pair(spec=AttentionSpec(mask=masks.causal(), sinks=jnp.zeros(4)))
    tri = jnp.tri(6, dtype=bool)
    f = eqx.filter_jit(lambda m, mask: jax.vmap(lambda x: m(x, x[:, :12], x[:, :12], mask))(x))
    with_sinks = f(attn, None)
    assert not np.allclose(with_sinks, f(mha, tri))      # a zero sink still takes weight
    close(f(attn, tri), with_sinks)                      # a (q_seq, kv_seq) mask, & the spec's
    _, plain = eqx_pair(spec=AttentionSpec(mask=masks.causal()))
    close(f(plain, None), f(mha, tri))
    g = eqx.filter_grad(lambda m: f(m, None).sum())(attn)
    assert g.spec.sinks.shape == (4,) and bool(jnp.any(g.spec.sinks != 0))


def test_equinox_dropout():
    mha, attn = eqx_pair(dropout_p=0.5)
    x = randn(20, (5, 16))
    y = x[:, :12]
    f = eqx.filter_jit(lambda m, key, inference: m(x, y, y, key=key, inference=inference))
    close(f(attn, None, True), f(mha, None, True))                   # inference: no dropout
    a, b = f(attn, jax.random.key(1), False), f(attn, jax.random.key(1), False)
    close(a, b, atol=0, rtol=0)
    assert not np.allclose(a, f(attn, jax.random.key(2), False))
    assert not np.allclose(a, f(attn, None, True))
    close(eqx.nn.inference_mode(attn)(x, y, y), f(mha, None, True))
    with pytest.raises(ValueError, match=r"MultiheadAttention: dropout is on \(mha.dropout.p="
                                         r"0.5, inference=False\) and needs key="):
        attn(x, y, y)


def test_equinox_messages():
    mha, attn = eqx_pair()
    x = jnp.ones((5, 16))
    y = jnp.ones((4, 12))
    with pytest.raises(ValueError, match=r"mask must have shape \(q_seq, kv_seq\)=\(5, 4\) or "
                                         r"\(num_heads, q_seq, kv_seq\)=\(4, 5, 4\); got \(4, 5\)"):
        attn(x, y, y, jnp.ones((4, 5), bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        attn(x, y, y, jnp.ones((5, 4)))
    with pytest.raises(TypeError, match="The spec comes first"):
        fnattn_eqx.attention(jnp.ones((5, 2, 4)), jnp.ones((5, 2, 4)), jnp.ones((5, 2, 4)),
                             jnp.ones((5, 2, 4)))
    with pytest.raises(ValueError, match="query_heads must have 3 axes"):
        fnattn_eqx.attention(AttentionSpec(), jnp.ones((1, 5, 2, 4)), jnp.ones((5, 2, 4)),
                             jnp.ones((5, 2, 4)))
    with pytest.raises(ValueError, match="the spec's dropout fields must be unset"):
        fnattn_eqx.MultiheadAttention(mha, AttentionSpec(dropout_rate=0.1,
                                                         dropout_key=jax.random.key(0)))


# -- imports ---------------------------------------------------------------------------


def python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_core_imports_neither_flax_nor_equinox():
    res = python("import sys, fnattn, fnattn.adapters, fnattn.adapters.flax\n"
                 "assert not {'flax', 'equinox'} & set(sys.modules), "
                 "sorted({'flax', 'equinox'} & set(sys.modules))\n"
                 "sys.modules['equinox'] = None  # as if it were not installed\n"
                 "try:\n"
                 "    import fnattn.adapters.equinox\n"
                 "except ImportError as e:\n"
                 "    print(e)\n")
    assert res.returncode == 0, res.stderr
    assert "pip install 'fnattn[equinox]'" in res.stdout
