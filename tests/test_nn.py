"""fnattn.nn.dot_product_attention against jax.nn.dot_product_attention itself.

Three parts: (1) a grid of argument combinations compared with ``jax.nn``
(``implementation="xla"``) on outputs, residuals and gradients; (2) JAX's own
``dot_product_attention`` tests (``tests/nn_test.py`` in jax-ml/jax) rewritten
for this function; (3) the error messages for arguments users get wrong.

Where the two functions are documented to differ (rows that see no key), the
comparison covers the rows both define, and the other rows are checked against
the documented behaviour: zeros and a residual of -inf.
"""

import re
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnattn.nn import dot_product_attention

jax_dpa = partial(jax.nn.dot_product_attention, implementation="xla")


# Inputs come from NumPy (an eager jax.random or jnp call compiles a small program
# for every new shape: most of the CI time of a file like this one).
def normal(seed, shape, dtype=np.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def f32(x):
    return np.asarray(x).astype(np.float32)


def run_jit(f, *args):
    """``jax.jit(f)(*args)`` compiled without XLA's backend optimisations: these
    programs run once on tiny inputs, and compiling them is most of the test
    time (halved this way)."""
    compiled = jax.jit(f).lower(*args).compile(
        compiler_options={"xla_backend_optimization_level": 0})
    return compiled(*args)


# Tolerances against jax.nn: both compute logits and softmax in float32, but in a
# different order (fnattn's flash lowering is blockwise), and in bfloat16 jax.nn
# rounds the weights to bfloat16 before multiplying by value.
TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2)}
GRAD_TOL = {"float32": dict(atol=1e-4, rtol=1e-4), "bfloat16": dict(atol=6e-2, rtol=6e-2)}


def visible(shape4, *, mask=None, is_causal=False, window=None, q_lengths=None,
            kv_lengths=None):
    """The (B, N, T, S) boolean visibility of jax.nn's arguments, in NumPy."""
    B, N, T, S = shape4
    t = np.arange(T)[:, None]
    s = np.arange(S)[None, :]
    ok = np.ones((B, N, T, S), bool)
    if mask is not None:
        m = np.asarray(mask)
        ok &= m.reshape((1,) * (4 - m.ndim) + m.shape)
    if is_causal:
        ok &= s <= t
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        ok &= (s >= t - left) & (s <= t + right)
    if q_lengths is not None:
        ok &= np.arange(T)[None, None, :, None] < np.asarray(q_lengths)[:, None, None, None]
    if kv_lengths is not None:
        ok &= np.arange(S)[None, None, None, :] < np.asarray(kv_lengths)[:, None, None, None]
    return ok


def case(name, *, B=2, T=8, S=8, N=2, K=2, H=8, tnh=False, bias=None, mask=None,
         is_causal=False, window=None, q_lengths=None, kv_lengths=None, scale=None,
         impl=None, dtype="float32"):
    """One point of the grid. ``bias``/``mask``: the shape to pass (any rank
    broadcastable to (B, N, T, S), or to (N, T, S) with ``tnh``); ``impl``: the
    ``implementation`` of fnattn's side (jax.nn's is always "xla")."""
    return pytest.param(dict(B=1 if tnh else B, T=T, S=S, N=N, K=K, H=H, tnh=tnh, bias=bias,
                             mask=mask, is_causal=is_causal, window=window,
                             q_lengths=q_lengths, kv_lengths=kv_lengths, scale=scale,
                             impl=impl, dtype=dtype), id=f"{name}-{impl}-{dtype}")


# Every argument, every implementation and both dtypes, each combination once (a
# full product would not fit the CI time of a CPU).
BF16 = "bfloat16"
GRID = [
    case("plain"),
    case("causal", is_causal=True, impl="cudnn", dtype=BF16),
    case("causal-T<S", T=5, S=13, is_causal=True),
    case("causal-T>S", T=13, S=5, is_causal=True, impl="cudnn"),
    case("window-asymmetric-T<S", T=7, S=11, window=(3, 1), impl="xla"),
    case("window-asymmetric-T>S", T=11, S=7, window=(0, 2)),
    case("window-causal", T=9, S=9, window=(3, 2), is_causal=True, impl="cudnn"),
    case("window-causal-T<S", T=5, S=13, window=(1, 4), is_causal=True, dtype=BF16),
    case("window-negative-left", T=9, S=9, window=(-1, 3)),
    case("window-negative-right-T<S", T=6, S=10, window=(4, -2), impl="xla"),
    case("q-lengths-bias", q_lengths=[8, 3], bias=(2, 2, 8, 8)),
    case("lengths-empty-kv-bias-heads", T=6, S=10, q_lengths=[4, 6], kv_lengths=[7, 0],
         bias=(1, 2, 6, 10), impl="xla"),
    case("lengths-causal", q_lengths=[5, 8], kv_lengths=[8, 2], is_causal=True, impl="cudnn",
         dtype=BF16),
    case("bias-3d-mask-1d", T=5, S=7, bias=(2, 5, 7), mask=(7,), scale=0.3),
    case("bias-2d-mask-key-padding", T=5, S=7, bias=(5, 7), mask=(2, 1, 1, 7), impl="xla"),
    case("bias-keys-mask-2d", T=5, S=7, bias=(1, 1, 1, 7), mask=(5, 7), dtype=BF16),
    case("bias-batch-keys-mask-rows", T=5, S=7, bias=(2, 1, 1, 7), mask=(2, 1, 5, 1),
         impl="cudnn"),
    case("gqa-causal", N=4, K=2, is_causal=True),
    case("mqa-window-int", N=4, K=1, T=6, S=9, window=2, impl="xla", dtype=BF16),
    case("gqa-bias-mask-heads", N=6, K=2, bias=(2, 6, 8, 8), mask=(2, 6, 8, 8)),
    case("bias-batch-mask-heads", T=5, S=7, bias=(2, 1, 5, 7), mask=(1, 2, 5, 7), impl="xla"),
    case("tnh-bias-mask", tnh=True, T=5, S=7, N=4, K=2, bias=(4, 5, 7), mask=(1, 5, 7),
         impl="xla", dtype=BF16),
    case("tnh-lengths-causal", tnh=True, T=6, S=6, q_lengths=[4], kv_lengths=[5],
         is_causal=True),
    case("scale-zero", scale=0.0, impl="xla"),
    case("scale-negative-bias", scale=-0.5, bias=(1, 2, 8, 8), dtype=BF16),
    case("everything", T=6, S=10, N=4, K=2, bias=(2, 4, 6, 10), mask=(2, 1, 6, 10),
         is_causal=True, window=(5, 1), q_lengths=[6, 4], kv_lengths=[9, 7], scale=0.5),
    case("everything", T=10, S=6, N=4, K=1, bias=(1, 4, 10, 6), mask=(1, 1, 10, 6),
         is_causal=True, window=(3, 0), q_lengths=[9, 10], kv_lengths=[6, 5], impl="xla",
         dtype=BF16),
]


def make_inputs(c, dtype, seed=0):
    rs = np.random.default_rng(seed)
    B, T, S, N, K, H = (c[n] for n in "BTSNKH")

    def normal(*shape):
        return jnp.asarray(rs.standard_normal(shape).astype(dtype))

    lead = () if c["tnh"] else (B,)
    q, k, v = normal(*lead, T, N, H), normal(*lead, S, K, H), normal(*lead, S, K, H)
    bias = None if c["bias"] is None else normal(*c["bias"])
    mask = None if c["mask"] is None else jnp.asarray(rs.random(c["mask"]) < 0.7)
    lengths = [None if c[n] is None else jnp.asarray(c[n], jnp.int32)
               for n in ("q_lengths", "kv_lengths")]
    return q, k, v, bias, mask, *lengths


def run_both(c, q, k, v, bias, mask, q_lengths, kv_lengths):
    """Output, residual and gradients w.r.t. (q, k, v, bias) of fnattn and of
    jax.nn, for a cotangent that is zero on the rows no key is visible to."""
    static = dict(is_causal=c["is_causal"], local_window_size=c["window"], scale=c["scale"],
                  return_residual=True)
    B, N, T, S = c["B"], c["N"], c["T"], c["S"]
    ok = visible((B, N, T, S), mask=mask, is_causal=c["is_causal"], window=c["window"],
                 q_lengths=q_lengths, kv_lengths=kv_lengths)
    alive = np.swapaxes(ok.any(-1), 1, 2)                      # (B, T, N)
    if c["tnh"]:
        alive = alive[0]
    cot = jnp.asarray((np.random.default_rng(1).standard_normal(q.shape)
                       * alive[..., None]).astype(q.dtype))

    def results(fn, q, k, v, bias, mask, ql, kvl):
        def g(q, k, v, bias):
            return fn(q, k, v, bias, mask, query_seq_lengths=ql, key_value_seq_lengths=kvl,
                      **static)
        (out, res), vjp = jax.vjp(g, q, k, v, bias)
        return out, res, vjp((cot, jnp.ones_like(res)))

    def both(*args):
        return (results(partial(dot_product_attention, implementation=c["impl"]), *args),
                results(jax_dpa, *args))

    return alive, *run_jit(both, q, k, v, bias, mask, q_lengths, kv_lengths)


@pytest.mark.parametrize("c", GRID)
def test_grid_against_jax_nn(c):
    check_against_jax_nn(c)


def check_against_jax_nn(c):
    """Compare fnattn with jax.nn on one point ``c`` of :func:`case` (also the
    check of ``property_tests/test_nn_props.py``)."""
    dtype = c["dtype"]
    inputs = make_inputs(c, jnp.dtype(dtype).type)
    alive, (out, res, grads), (out_j, res_j, grads_j) = run_both(c, *inputs)
    q, k, v, bias = inputs[:4]
    assert out.shape == out_j.shape == q.shape and out.dtype == q.dtype
    assert res.shape == res_j.shape == q.shape[:-1] and res.dtype == q.dtype
    # Rows both define: equal to jax.nn's.
    np.testing.assert_allclose(f32(out)[alive], f32(out_j)[alive], **TOL[dtype])
    np.testing.assert_allclose(f32(res)[alive], f32(res_j)[alive], **TOL[dtype])
    # Rows that see no key: zeros and -inf (jax.nn: the mean of value or zeros,
    # and a large negative finite number).
    assert not f32(out)[~alive].any()
    assert np.isneginf(f32(res)[~alive]).all()
    # Gradients (the residual's cotangent is ignored by both: no gradient).
    for name, g, g_j, x in zip("q k v bias".split(), grads, grads_j, (q, k, v, bias)):
        if x is None:
            assert g is None and g_j is None
            continue
        assert g.shape == x.shape and g.dtype == x.dtype, name
        np.testing.assert_allclose(f32(g), f32(g_j), err_msg=name, **GRAD_TOL[dtype])


def test_grid_windows_are_top_left_aligned():
    # The alignment itself, independent of jax.nn: T=3 queries, S=6 keys.
    q = jnp.asarray(np.zeros((3, 1, 4), np.float32))
    k = jnp.asarray(np.zeros((6, 1, 4), np.float32))
    v = jnp.asarray(np.eye(6, dtype=np.float32)[:, None, :])  # out = the weights
    causal, window = jax.jit(lambda q, k, v: [
        dot_product_attention(q, k, v, **kw)
        for kw in (dict(is_causal=True), dict(local_window_size=(1, 2)))])(q, k, v)
    seen = (np.asarray(causal)[:, 0] > 0).astype(int)
    np.testing.assert_array_equal(seen, [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                                         [1, 1, 1, 0, 0, 0]])
    seen = (np.asarray(window)[:, 0] > 0).astype(int)
    np.testing.assert_array_equal(seen, [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                                         [0, 1, 1, 1, 1, 0]])


def test_rows_that_see_no_key_are_zeros_not_the_mean_of_value():
    # The documented difference, pinned on both sides.
    q, v = normal(0, (1, 3, 1, 4)), normal(1, (1, 5, 1, 4))
    k = v
    mask = np.ones((1, 1, 3, 5), bool)
    mask[..., 1, :] = False  # row 1 sees nothing
    (out, res), (out_j, res_j) = jax.jit(lambda q, k, v, mask: [
        fn(q, k, v, mask=mask, return_residual=True)
        for fn in (dot_product_attention, jax_dpa)])(q, k, v, mask)
    np.testing.assert_array_equal(np.asarray(out[0, 1]), 0.0)
    assert np.isneginf(np.asarray(res[0, 1])).all()
    np.testing.assert_allclose(np.asarray(out_j)[0, 1, 0], np.asarray(v)[0, :, 0].mean(0),
                               atol=1e-6)
    assert np.isfinite(np.asarray(res_j)[0, 1]).all() and np.asarray(res_j)[0, 1, 0] < -1e37
    np.testing.assert_allclose(np.asarray(out[0, ::2]), np.asarray(out_j[0, ::2]), atol=1e-6)


def test_hidden_keys_contribute_nothing_even_if_not_finite():
    q, k, v = normal(0, (1, 4, 2, 8)), normal(1, (1, 6, 2, 8)), normal(2, (1, 6, 2, 8))
    bad = np.asarray(v).copy()
    bad[:, 4:] = np.nan
    f = partial(dot_product_attention, key_value_seq_lengths=np.array([4], np.int32))
    out, out_finite = jax.jit(lambda q, k, v, bad: (f(q, k, bad), f(q, k, v)))(q, k, v, bad)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_finite), atol=1e-6)


def test_value_head_dim_may_differ():
    # jax.nn refuses Hv != H; fnattn computes it (checked on the rows of value).
    q, k, v = normal(0, (2, 5, 4, 8)), normal(1, (2, 7, 2, 8)), normal(2, (2, 7, 2, 8))
    f = partial(dot_product_attention, is_causal=True, implementation="xla")
    out, out_full = jax.jit(lambda q, k, v: (f(q, k, v[..., :3]), f(q, k, v)))(q, k, v)
    assert out.shape == (2, 5, 4, 3)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_full)[..., :3], atol=1e-6)


# -----------------------------------------------------------------------------------
# JAX's own tests (jax-ml/jax tests/nn_test.py, the dot_product_attention ones),
# rewritten for fnattn's function with smaller sizes. JAX compares
# implementation="cudnn" with its XLA path and asserts that a cuDNN custom call
# was emitted; here fnattn's implementations are compared with jax.nn's XLA path,
# and the cuDNN-only parts are left out: the custom-call assertions (there is
# no cuDNN on a CPU) and the skips for GPU compute capability, ROCm and CUDA 13.
# -----------------------------------------------------------------------------------


def _close(a, b, atol, rtol):
    np.testing.assert_allclose(f32(a), f32(b), atol=atol, rtol=rtol)


# JAX runs the product dtype x group_num x use_vmap x impl; here a cover in which
# every value of each factor meets every value of each other one (CI time).
# jax.nn's float16 path does not compile on a CPU under jit ("The precision
# 'F16_F16_F32' is not supported by dot_general on CPU"), so in float16 the
# reference is jax.nn on the inputs cast to float32, and "cudnn" (which calls
# jax.nn) runs in bfloat16 only.
@pytest.mark.parametrize("dtype,group_num,use_vmap,impl", [
    (jnp.bfloat16, 1, False, "xla"),
    (jnp.float16, 1, False, None),
    (jnp.bfloat16, 1, True, "cudnn"),
    (jnp.bfloat16, 2, False, "xla"),
    (jnp.float16, 2, False, None),
    (jnp.bfloat16, 2, True, "cudnn"),
    (jnp.float16, 4, True, "xla"),
    (jnp.bfloat16, 4, True, None),
    (jnp.bfloat16, 4, False, "cudnn"),
], ids=str)
def test_jax_dot_product_attention(dtype, group_num, use_vmap, impl):
    B, S, T, N, H, G = 2, 32, 32, 4, 16, group_num
    q = normal(0, (B, T, N, H), dtype)
    k = normal(1, (B, S, N // G, H), dtype)
    v = normal(2, (B, S, N // G, H), dtype)
    g_out = normal(3, (B, T, N, H), dtype)
    g_lse = normal(4, (B, T, N), dtype)

    ans = partial(dot_product_attention, implementation=impl)
    ans_lse = partial(dot_product_attention, implementation=impl, return_residual=True)
    if use_vmap:
        ans = jax.vmap(ans, in_axes=(0, 0, 0, None, None), out_axes=0)
        ans_lse = jax.vmap(ans_lse, in_axes=(0, 0, 0, None, None), out_axes=0)
    ref = partial(jax.nn.dot_product_attention, implementation=None)
    ref_lse = partial(ref, return_residual=True)
    ref_dtype = jnp.float32 if dtype == jnp.float16 else dtype

    def both(q, k, v):
        # The reference runs plain multi-head attention on repeated K and V.
        k_ref, v_ref = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
        q_ref, k_ref, v_ref, go, gl = (x.astype(ref_dtype) for x in (q, k_ref, v_ref, g_out,
                                                                     g_lse))
        # jax.nn's residual carries no gradient, so one vjp of the reference
        # serves both calls: its gradients ignore the residual's cotangent.
        lse_r, vjp_lr = jax.vjp(ref_lse, q_ref, k_ref, v_ref, None, None)
        out_a, vjp_a = jax.vjp(ans, q, k, v, None, None)
        lse_a, vjp_la = jax.vjp(ans_lse, q, k, v, None, None)
        d_r = vjp_lr((go, gl))[:3]
        return ((lse_r[0], d_r, lse_r, d_r),
                (out_a, vjp_a(g_out)[:3], lse_a, vjp_la((g_out, g_lse))[:3]))

    (out_r, d_r, lse_r, dl_r), (out_a, d_a, lse_a, dl_a) = run_jit(both, q, k, v)

    def fold(d):  # gradients of repeated K, V summed over each group
        dq, dk, dv = d
        return dq, *(x.reshape(B, S, N // G, G, H).sum(3) for x in (dk, dv))

    assert out_a.dtype == lse_a[0].dtype == lse_a[1].dtype == dtype
    _close(out_r, out_a, .01, .01)
    for x, y in zip(fold(d_r), d_a):
        _close(x, y, .01, .01)
    _close(lse_r[0], lse_a[0], .01, .01)
    _close(lse_r[1], lse_a[1], .01, .01)
    for x, y in zip(fold(dl_r), dl_a):
        _close(x, y, .01, .01)


@pytest.mark.parametrize("mask_mode", [
    "bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
    ("bias", "causal"), ("causal", "sliding_window")], ids=str)
def test_jax_dot_product_attention_mask(mask_mode):
    mask_mode = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
    dtype = jnp.bfloat16
    B, S, T, N, H = 2, 16, 16, 4, 8
    q, k, v = normal(0, (B, T, N, H), dtype), normal(1, (B, S, N, H), dtype), normal(
        2, (B, S, N, H), dtype)
    g_out = normal(3, (B, T, N, H), dtype)
    bias = mask = q_len = kv_len = window = None
    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_len = np.array([T // 2, T // 4], np.int32)
        kv_len = np.array([S // 4, S // 2], np.int32)
    if "custom" in mask_mode:  # a causal mask, given as an array
        mask = np.tril(np.ones((T, S), bool))[None, None]
    if "bias" in mask_mode:
        bias = normal(4, (1, N, T, S), dtype)
    if "sliding_window" in mask_mode:
        window = (3, 2) if is_causal else (3, 0)

    def with_args(fn):
        return lambda q, k, v, b, m, ql, kvl: fn(
            q, k, v, b, m, is_causal=is_causal, query_seq_lengths=ql,
            key_value_seq_lengths=kvl, local_window_size=window)

    def both(q, k, v, bias, mask, q_len, kv_len):
        res = []
        for fn in (partial(jax.nn.dot_product_attention, implementation=None),
                   dot_product_attention):
            out, vjp = jax.vjp(with_args(fn), q, k, v, bias, mask, q_len, kv_len)
            res.append((out, vjp(g_out)[:4]))
        return res

    (out_r, (dq_r, dk_r, dv_r, db_r)), (out_a, (dq_a, dk_a, dv_a, db_a)) = run_jit(
        both, q, k, v, bias, mask, q_len, kv_len)
    _close(out_r, out_a, .01, .01)
    _close(dq_r, dq_a, .02, .02)
    _close(dk_r, dk_a, .02, .02)
    _close(dv_r, dv_a, .01, .01)
    if bias is None:
        assert db_r is None and db_a is None
    else:
        _close(db_r, db_a, .02, .02)


def test_jax_dot_product_attention_float64_mask_debug_infs():
    # JAX's regression test for float64 inputs with a 1-D mask under debug_infs
    # (jax-ml/jax issue 37422): no inf reaches an output, no warning.
    with jax.enable_x64(True):
        T, S, K, N, H = 5, 7, 3, 6, 11
        mask = np.arange(S) <= S // 2
        args = (np.zeros((T, N, H)), np.zeros((S, K, H)), np.zeros((S, K, H)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with jax.debug_infs(True):
                out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask))(*args)
                out.block_until_ready()
        assert out.dtype == jnp.float64 and out.shape == (T, N, H)
        np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_jax_dot_product_attention_bias_gradient(batch_size, use_vmap):
    dtype = jnp.bfloat16
    B, S, N, H = batch_size, 32, 4, 16
    x = normal(0, (B, S, N, H), dtype)
    bias = normal(1, (B, N, S, S), dtype)
    mask = np.ones((1, 1, S), bool)

    def attn(fn):
        f = lambda x, bias, mask: fn(query=x, key=x, value=x, bias=bias, mask=mask,  # noqa: E731
                                     is_causal=False)
        return jax.vmap(f, in_axes=(0, 0, None)) if use_vmap else f

    def both(x, bias, mask):
        res = []
        for fn in (partial(jax.nn.dot_product_attention, implementation=None),
                   partial(dot_product_attention, implementation="xla")):
            y, vjp = jax.vjp(attn(fn), x, bias, mask)
            res.append((y, vjp(x)[1]))
        return res

    (y_r, dbias_r), (y_a, dbias_a) = run_jit(both, x, bias, mask)
    _close(y_r, y_a, .01, .01)
    _close(dbias_a, dbias_r, .1, .1)


def test_jax_dot_product_attention_local_window_without_mask():
    B, T, N, H = 2, 32, 4, 16
    q, k, v = (normal(i, (B, T, N, H)) for i in range(3))

    @jax.jit
    def run(q, k, v):
        return [fn(q, k, v, mask=None, local_window_size=window)
                for fn in (dot_product_attention, jax_dpa) for window in ((16, 16), (1, 1))]

    large, small, large_j, small_j = run(q, k, v)
    assert not np.allclose(large, small), "the window must change the output without a mask"
    _close(large, large_j, 1e-5, 1e-5)
    _close(small, small_j, 1e-5, 1e-5)


# -----------------------------------------------------------------------------------
# Error messages: each names the function and the argument, what was expected and
# what was given.
# -----------------------------------------------------------------------------------

Q = np.zeros((3, 7, 4, 5), np.float32)  # B=3, T=7, N=4, H=5
KV = np.zeros((3, 11, 2, 5), np.float32)  # S=11, K=2


def zeros(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)

ERRORS = [
    ("implementation", dict(implementation="flash"), ValueError,
     "dot_product_attention: implementation must be None, 'xla' or 'cudnn'; got 'flash'. "
     "None runs fnattn's flash lowering for the platform, 'xla' the dense XLA lowering, "
     "'cudnn' jax.nn's cuDNN kernel on NVIDIA GPUs; for fnattn's other lowerings "
     "('pallas', 'reference') call fnattn.attention with AttentionSpec(impl=...)."),
    ("float mask", dict(mask=zeros(7, 11)), TypeError,
     "dot_product_attention: mask must be boolean (True attends); got float32 with shape "
     "(7, 11). An additive float mask (0 to attend, a large negative number to hide) is a "
     "bias: pass it as bias=...; a mask of 1s and 0s converts with `mask > 0`."),
    ("int mask", dict(mask=zeros(7, 11, dtype=np.int32)), TypeError,
     "dot_product_attention: mask must be boolean (True attends); got int32 with shape "
     "(7, 11). Convert it with `mask != 0` (True attends)."),
    ("mask rank", dict(mask=zeros(1, 3, 4, 7, 11, dtype=bool)), ValueError,
     "dot_product_attention: mask must have at most 4 axes, broadcastable to (B, N, T, S)="
     "(3, 4, 7, 11); got shape (1, 3, 4, 7, 11)"),
    ("mask shape", dict(mask=zeros(2, 1, 7, 11, dtype=bool)), ValueError,
     "dot_product_attention: mask must be broadcastable to (B, N, T, S)=(3, 4, 7, 11) (each "
     "axis full or 1; leading axes may be left out); got shape (2, 1, 7, 11)"),
    ("bias shape", dict(bias=zeros(2, 7, 11)), ValueError,
     "dot_product_attention: bias must be broadcastable to (B, N, T, S)=(3, 4, 7, 11) (each "
     "axis full or 1; leading axes may be left out); got shape (1, 2, 7, 11)"),
    ("bias dtype", dict(bias=zeros(7, 11, dtype=np.int32)), TypeError,
     "dot_product_attention: bias must be a floating-point array (float32, bfloat16 or "
     "float16); got int32 with shape (7, 11)"),
    ("query rank", dict(query=zeros(7, 5)), ValueError,
     "dot_product_attention: query, key and value must be (B, T|S, N|K, H) (4 axes) or "
     "(T|S, N|K, H) (3 axes, no batch); got query (7, 5), key (3, 11, 2, 5), value "
     "(3, 11, 2, 5)"),
    ("value rank", dict(value=zeros(1, 3, 11, 2, 5)), ValueError,
     "dot_product_attention: query, key and value must be (B, T|S, N|K, H) (4 axes) or "
     "(T|S, N|K, H) (3 axes, no batch); got query (3, 7, 4, 5), key (3, 11, 2, 5), value "
     "(1, 3, 11, 2, 5)"),
    ("no batch against a batch of 3", dict(query=zeros(7, 4, 5)), ValueError,
     "dot_product_attention: key must have shape (B, S, K, H)=(1, S, K, 5) to match query "
     "(1, 7, 4, 5); got key (3, 11, 2, 5)"),
    ("dtypes", dict(key=KV.astype(jnp.bfloat16)), TypeError,
     "dot_product_attention: query, key and value must share a dtype; got query float32, "
     "key bfloat16, value float32"),
    ("int query", dict(query=zeros(3, 7, 4, 5, dtype=np.int32)), TypeError,
     "dot_product_attention: query must be a floating-point array (float32, bfloat16 or "
     "float16); got int32 with shape (3, 7, 4, 5)"),
    ("head dim", dict(key=zeros(3, 11, 2, 6)), ValueError,
     "dot_product_attention: key must have shape (B, S, K, H)=(3, S, K, 5) to match query "
     "(3, 7, 4, 5); got key (3, 11, 2, 6)"),
    ("value", dict(value=zeros(3, 10, 2, 5)), ValueError,
     "dot_product_attention: value must have shape (B, S, K, Hv)=(3, 11, 2, Hv) to match "
     "key (3, 11, 2, 5); got value (3, 10, 2, 5)"),
    ("heads", dict(key=zeros(3, 11, 3, 5), value=zeros(3, 11, 3, 5)), ValueError,
     "dot_product_attention: the number of query heads N=4 must be a multiple of the number "
     "of key/value heads K=3; got query (3, 7, 4, 5) and key (3, 11, 3, 5), read as "
     "(B, T, N, H)"),
    ("lengths shape", dict(query_seq_lengths=np.array([7, 7], np.int32)), ValueError,
     "dot_product_attention: query_seq_lengths must have shape (B,)=(3,), one length per "
     "batch row; got (2,)"),
    ("lengths dtype", dict(key_value_seq_lengths=np.array([1.0, 2.0, 3.0], np.float32)), TypeError,
     "dot_product_attention: key_value_seq_lengths must be an integer array of shape "
     "(B,)=(3,); got float32"),
    ("window", dict(local_window_size=(1, 2, 3)), TypeError,
     "dot_product_attention: local_window_size must be None, an int w (the same as (w, w)) "
     "or a pair of ints (left, right), query t seeing keys t-left .. t+right; got tuple "
     "(1, 2, 3). It is static configuration: a traced window cannot size the mask."),
    ("is_causal", dict(is_causal="yes"), TypeError,
     "dot_product_attention: is_causal must be a Python bool; got str 'yes'. It is static "
     "configuration: a traced value cannot choose the mask."),
    ("scale", dict(scale=float("inf")), ValueError,
     "dot_product_attention: scale must be finite; got inf"),
    ("scale type", dict(scale="0.5"), TypeError,
     "dot_product_attention: scale must be a number or a float scalar; got str '0.5'"),
]


def message_of(e):
    # Under jit JAX appends a note about its traceback filtering to the message.
    return str(e.value).split("\n--------------------")[0]


@pytest.mark.parametrize("kwargs,exc,message", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_error_messages(kwargs, exc, message):
    args = dict(query=Q, key=KV, value=KV) | kwargs
    with pytest.raises(exc) as e:
        jax.jit(partial(dot_product_attention, **args))()
    assert message_of(e) == message


def test_traced_scale_and_mixed_ranks_as_jax_nn():
    q = normal(0, (1, 5, 4, 8))
    k = v = normal(1, (7, 2, 8))  # no batch axis

    @jax.jit
    def both(q, k, v, s):
        return [(fn(q, k, v, scale=s, is_causal=True),
                 jax.grad(lambda s: jnp.sum(fn(q, k, v, scale=s, is_causal=True) ** 2))(s))
                for fn in (dot_product_attention, jax_dpa)]

    (out, ds), (out_j, ds_j) = both(q, k, v, 0.7)
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_j), atol=1e-5)
    np.testing.assert_allclose(float(ds), float(ds_j), rtol=1e-4)


def test_error_traced_is_causal():
    with pytest.raises(TypeError, match=re.escape(
            "dot_product_attention: is_causal must be a Python bool; got")):
        jax.jit(lambda c: dot_product_attention(Q, KV, KV, is_causal=c))(True)
