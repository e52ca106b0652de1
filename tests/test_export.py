"""``jax.export`` of every variant: symbolic sizes, several platforms at once, and
round trips (serialize, deserialize, call on the CPU) checked against ``jax.jit``
of the same function and against ``fnattn.reference``.

Exports for "cuda" and "tpu" only lower here (no such device); the Pallas
Triton kernels lower to a custom call that JAX gives no compatibility
guarantee for, so an export holding one names it in ``disabled_checks``
(:data:`TRITON`), as a user must.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import fnattn
from fnattn import AttentionSpec, masks

import lowering  # tests/ is on sys.path
from np_attention import np_attention, np_attention_grads
from paged import problems

F32, I32 = jnp.float32, jnp.int32
TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
PLATFORM_SETS = [("cpu", "cuda", "tpu"), ("cpu", "cuda"), ("cpu", "tpu"), ("cuda", "tpu")]
# For decode and paged: every branch lowered (all three) and a set without the CPU
# (the pairs with it are covered by attention's test above).
SERVING_PLATFORM_SETS = [("cpu", "cuda", "tpu"), ("cuda", "tpu")]
CAUSAL = masks.causal()


@pytest.fixture(autouse=True, scope="module")
def _cheap_compiles():
    # every call compiles an exported module for its shapes: few optimisations
    with lowering.cheap_compiles():
        yield


def _target(platforms):
    """Where Pallas kernels find the device they are lowered for (tests/lowering.py)."""
    if "cuda" in platforms:
        return lowering.target("cuda")
    if "tpu" in platforms:
        return lowering.target("tpu")
    return contextlib.nullcontext()


def export_(f, args, platforms=("cpu",)):
    """``jax.export`` of ``jax.jit(f)`` at ``args`` (ShapeDtypeStructs), serialized and
    deserialized again."""
    with _target(platforms):
        exp = export.export(jax.jit(f), platforms=platforms, disabled_checks=[TRITON])(*args)
    back = export.deserialize(exp.serialize())
    assert back.platforms == tuple(platforms)
    # (symbolic sizes of a deserialized artifact belong to a scope of their own)
    assert str((back.in_avals, back.out_avals)) == str((exp.in_avals, exp.out_avals))
    return back


def call(exp, *args):
    return jax.jit(exp.call)(*args)


def S(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def assert_close(got, want, tol=2e-5):
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        fin = np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(g), fin)
        np.testing.assert_allclose(g[fin], w[fin], atol=tol, rtol=tol)


def qkv(B, Tq, Tk, Hq=4, Hkv=2, D=8, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, Tq, Hq, D)), jax.random.normal(kk, (B, Tk, Hkv, D)),
            jax.random.normal(kv, (B, Tk, Hkv, D)))


def attention_fn(name, impl, **spec):
    spec = AttentionSpec(mask=CAUSAL, impl=impl, **spec)
    fn = getattr(fnattn, name)

    def f(q, k, v):
        res = fn(spec, q, k, v)
        return res.out, res.lse

    return f


def np_causal(Tq, Tk):
    """The float64 NumPy attention's mask for ``masks.causal()`` (bottom-right aligned)."""
    return np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + (Tk - Tq)


def expected(q, k, v, softcap=None):
    """(out, lse) of the float64 NumPy attention (tests/np_attention.py)."""
    out, lse, _ = np_attention(q, k, v, softcap=softcap, mask=np_causal(q.shape[1], k.shape[1]))
    return out.astype(np.float32), lse.astype(np.float32)


def expected_grads(q, k, v):
    """Gradients of sum(out ** 2) (:func:`loss_grads`) by the float64 NumPy attention."""
    mask = np_causal(q.shape[1], k.shape[1])
    out, _, _ = np_attention(q, k, v, mask=mask)
    g = np_attention_grads(q, k, v, 2 * out, mask=mask)
    return tuple(g[n].astype(np.float32) for n in ("dq", "dk", "dv"))


def loss_grads(f):
    return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0] ** 2), argnums=(0, 1, 2))


# ----------------------------------------------------------------------------------
# attention / flash: symbolic batch and sequence lengths
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, impl, shapes", [
    ("attention", "auto", ((2, 5, 9), (1, 13, 13))),  # one export, several shapes
    ("attention", "xla", ((2, 5, 9),)),                # (the dense lowering)
    ("flash", "xla", ((1, 13, 13),))])
def test_symbolic_batch_and_lengths(name, impl, shapes):
    b, tq, tk = export.symbolic_shape("b, tq, tk")
    f = attention_fn(name, impl, softcap=20.0)
    exp = export_(f, [S((b, tq, 4, 8)), S((b, tk, 2, 8)), S((b, tk, 2, 8))])
    assert str(exp.in_avals[0].shape) == "(b, tq, 4, 8)"
    for B, Tq, Tk in shapes:  # (Tq < Tk: the causal diagonal is offset)
        args = qkv(B, Tq, Tk)
        assert_close(call(exp, *args), expected(*args, softcap=20.0))


def test_symbolic_batch_pallas():
    # The interpreted Triton kernels (impl="pallas" on a CPU) take a symbolic
    # batch: a dynamic axis of their grid.
    b, = export.symbolic_shape("b")
    f = attention_fn("attention", "pallas")
    exp = export_(f, [S((b, 16, 2, 16)), S((b, 16, 1, 16)), S((b, 16, 1, 16))])
    args = qkv(3, 16, 16, Hq=2, Hkv=1, D=16)
    assert_close(call(exp, *args), expected(*args))


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_gradient_symbolic(impl):
    # impl="auto": batch and length symbolic, for every platform at once;
    # impl="pallas" (interpreted on the CPU): the batch.
    b, t = export.symbolic_shape("b, t")
    T = t if impl == "auto" else 16
    platforms = ("cpu", "cuda", "tpu") if impl == "auto" else ("cpu",)
    f = attention_fn("attention", impl)
    exp = export_(loss_grads(f), [S((b, T, 2, 16)), S((b, T, 1, 16)), S((b, T, 1, 16))],
                  platforms)
    args = qkv(2, 16, 16, Hq=2, Hkv=1, D=16)
    assert_close(call(exp, *args), expected_grads(*args), tol=1e-4)


def test_pallas_refuses_symbolic_lengths():
    t, = export.symbolic_shape("t")
    f = attention_fn("attention", "pallas")
    args = [S((1, t, 2, 8)), S((1, t, 1, 8)), S((1, t, 1, 8))]
    with pytest.raises(NotImplementedError, match=r"symbolic sizes.*Tq=t.*impl='auto'"):
        export_(f, args)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_symbolic_sizes_on_accelerators(platform):
    # impl="auto" lowers symbolic sizes for every platform (the XLA lowering where
    # a kernel's grid cannot take them); impl="pallas" keeps the kernels, and
    # only Mosaic (TPU) takes a symbolic batch.
    b, t = export.symbolic_shape("b, t")
    bt = [S((b, t, 2, 8)), S((b, t, 1, 8)), S((b, t, 1, 8))]
    exp = export_(loss_grads(attention_fn("attention", "auto")), bt, (platform,))
    assert exp.platforms == (platform,)
    batch = [S((b, 128, 2, 128)), S((b, 128, 1, 128)), S((b, 128, 1, 128))]
    pallas = attention_fn("attention", "pallas")
    if platform == "tpu":
        text = export_(pallas, batch, ("tpu",)).mlir_module()
        assert "tpu_custom_call" in text
    else:
        with pytest.raises(NotImplementedError, match=r"Triton kernels cannot take symbolic "
                                                      r"sizes.*B=b.*impl='auto'"):
            export_(pallas, batch, ("cuda",))


# ----------------------------------------------------------------------------------
# attention / flash: several platforms in one artifact
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("platforms", PLATFORM_SETS, ids="+".join)
@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_multi_platform(impl, platforms):
    f = attention_fn("flash", impl)
    args = qkv(1, 16, 16, Hq=2, Hkv=1, D=16)
    exp = export_(f, [S(x.shape) for x in args], platforms)
    text = exp.mlir_module()
    if "cuda" in platforms:
        assert "__gpu$xla.gpu.triton" in text
    if "tpu" in platforms:
        assert "tpu_custom_call" in text
    if "cpu" in platforms:
        assert_close(call(exp, *args), expected(*args))


# ----------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------


def decode_fn(impl):
    spec = AttentionSpec(mask=CAUSAL, impl=impl)
    return lambda q, k, v, lengths: fnattn.decode(spec, q, k, v, kv_lengths=lengths)


def decode_args(B, S_, seed=1):
    q, k, v = qkv(B, 1, S_, Hq=4, Hkv=2, D=16, seed=seed)
    lengths = jnp.asarray(np.random.default_rng(seed).integers(1, S_ + 1, B), I32)
    return q, k, v, lengths


def decode_expected(q, k, v, lengths):
    """Each sequence's (out, lse) over its valid keys, by the float64 NumPy attention."""
    outs, lses = [], []
    for b, L in enumerate(np.asarray(lengths)):
        out, lse = expected(q[b:b + 1], k[b:b + 1, :L], v[b:b + 1, :L])
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("impl, shapes", [("auto", ((3, 20), (1, 64))), ("xla", ((2, 9),))])
def test_decode_symbolic(impl, shapes):
    b, s = export.symbolic_shape("b, s")  # batch and cache length
    f = decode_fn(impl)
    exp = export_(f, [S((b, 1, 4, 16)), S((b, s, 2, 16)), S((b, s, 2, 16)), S((b,), I32)])
    for B, S_ in shapes:
        args = decode_args(B, S_)
        got = call(exp, *args)
        assert_close((got.out, got.lse), decode_expected(*args))


@pytest.mark.parametrize("platforms", SERVING_PLATFORM_SETS, ids="+".join)
@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_decode_multi_platform(impl, platforms):
    f = decode_fn(impl)
    args = decode_args(2, 32)
    exp = export_(f, [S(x.shape, x.dtype) for x in args], platforms)
    if "cpu" in platforms:
        got = call(exp, *args)
        assert_close((got.out, got.lse), decode_expected(*args))


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_decode_pallas_refuses_symbolic(platform):
    b, = export.symbolic_shape("b")
    args = [S((b, 1, 4, 16)), S((b, 32, 2, 16)), S((b, 32, 2, 16)), S((b,), I32)]
    kernel = "Mosaic" if platform == "tpu" else "Triton"
    with pytest.raises(NotImplementedError, match=rf"{kernel}.*symbolic.*B"):
        export_(decode_fn("pallas"), args, (platform,))
    export_(decode_fn("auto"), args, (platform,))  # the XLA lowering takes them


# ----------------------------------------------------------------------------------
# paged and ragged paged attention
# ----------------------------------------------------------------------------------


def paged_fn(impl):
    spec = AttentionSpec(mask=CAUSAL, impl=impl)
    return lambda q, kp, vp, pt, lengths: fnattn.paged_attention(
        spec, q, kp, vp, page_table=pt, kv_lengths=lengths)


def ragged_fn(impl):
    spec = AttentionSpec(mask=CAUSAL, impl=impl)
    return lambda q, kp, vp, pt, lengths, loc, n: fnattn.ragged_paged_attention(
        spec, q, kp, vp, page_table=pt, context_lengths=lengths, query_start_loc=loc,
        num_seqs=n)


def update_fn(impl):
    spec = AttentionSpec(mask=CAUSAL, impl=impl)
    return lambda q, k, v, kp, vp, pt, lengths, loc, n: \
        fnattn.ragged_paged_attention_with_update(
            spec, q, k, v, kp, vp, page_table=pt, context_lengths=lengths,
            query_start_loc=loc, num_seqs=n)


def ragged_args(p):
    return (p.q, p.k_pages, p.v_pages, p.page_table, p.context_lengths, p.query_start_loc,
            p.num_seqs)


def update_args(p):
    return (p.q, p.k_new, p.v_new, p.k_old, p.v_old, p.page_table, p.context_lengths,
            p.query_start_loc, p.num_seqs)


def paged_args(p, n):
    """paged_attention's arguments for a problem whose sequences all have n new tokens."""
    B = len(p.seqs)
    return (p.q.reshape(B, n, *p.q.shape[1:]), p.k_pages, p.v_pages, p.page_table,
            p.context_lengths)


def symbolic_like(args, dims):
    """ShapeDtypeStructs of ``args`` with the axes in ``dims`` ({(arg, axis): dim}) symbolic."""
    out = []
    for i, x in enumerate(args):
        shape = list(jnp.shape(x))
        for (j, axis), d in dims.items():
            if j == i:
                shape[axis] = d
        out.append(S(tuple(shape), x.dtype))
    return out


PAGED_SMALL = dict(seqs=[(5, 1), (9, 1)])
PAGED_LARGE = dict(seqs=[(3, 1), (12, 1), (7, 1)], pages_per_seq=3, num_pages=14)


@pytest.mark.parametrize("impl, sizes", [("auto", (PAGED_SMALL, PAGED_LARGE)),
                                         ("xla", (PAGED_LARGE,))])
def test_paged_symbolic(impl, sizes):
    b, n = export.symbolic_shape("b, n")  # sequences and pages in the pool
    f = paged_fn(impl)
    exp = export_(f, symbolic_like(paged_args(problems.make(**PAGED_SMALL), 1), {
        (0, 0): b, (1, 1): n, (2, 1): n, (3, 0): b, (4, 0): b}))
    for p in (problems.make(**kw) for kw in sizes):
        got = call(exp, *paged_args(p, 1))
        want_out, want_lse = problems.expected(AttentionSpec(mask=CAUSAL), p)
        assert_close((got.out[:, 0], got.lse[:, :, 0]), (want_out, want_lse.T))


RAGGED_SMALL = dict(seqs=[(5, 2), (9, 3)], pad_tokens=1)
RAGGED_LARGE = dict(seqs=[(3, 3), (12, 1), (7, 4)], max_seqs=4, pages_per_seq=3, num_pages=15,
                    pad_tokens=2)


@pytest.mark.parametrize("form, impl, sizes", [
    ("ragged", "auto", (RAGGED_SMALL, RAGGED_LARGE)), ("ragged", "xla", (RAGGED_LARGE,)),
    ("update", "auto", (RAGGED_LARGE,))])
def test_ragged_symbolic(form, impl, sizes):
    # tokens, sequence slots and pages in the pool all symbolic
    t, m, n = export.symbolic_shape("t, m, n")
    if form == "ragged":
        f, of = ragged_fn(impl), ragged_args
        dims = {(0, 0): t, (1, 1): n, (2, 1): n, (3, 0): m, (4, 0): m, (5, 0): m + 1}
    else:
        f, of = update_fn(impl), update_args
        dims = {(0, 0): t, (1, 0): t, (2, 0): t, (3, 1): n, (4, 1): n, (5, 0): m, (6, 0): m,
                (7, 0): m + 1}
    exp = export_(f, symbolic_like(of(problems.make(**RAGGED_SMALL)), dims))
    for p in (problems.make(**kw) for kw in sizes):
        got = call(exp, *of(p))
        res = got[0] if form == "update" else got
        want_out, want_lse = problems.expected(AttentionSpec(mask=CAUSAL), p)
        assert_close((res.out, res.lse), (want_out, want_lse))
        if form == "update":  # the written pools hold every token: those of the full problem
            for pool, want in zip(got[1:], (p.k_pages, p.v_pages)):
                live = np.asarray(p.used_pages)
                np.testing.assert_array_equal(np.asarray(pool)[:, live], np.asarray(want)[:, live])


@pytest.mark.parametrize("platforms", SERVING_PLATFORM_SETS, ids="+".join)
@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_paged_multi_platform(impl, platforms):
    p = problems.make([(5, 2), (9, 3)], page_size=8, pad_tokens=1)
    ragged = ragged_fn(impl)
    for f, args in ((paged_fn(impl), paged_args(problems.make([(5, 1), (9, 1)], page_size=8), 1)),
                    (ragged, ragged_args(p)), (update_fn(impl), update_args(p))):
        exp = export_(f, [S(jnp.shape(x), x.dtype) for x in args], platforms)
        # on the CPU (the interpreted kernels of impl="pallas": one form, they are slow)
        if platforms == ("cpu", "cuda", "tpu") and (impl == "auto" or f is ragged):
            assert_close(call(exp, *args), jax.jit(f)(*args))


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_paged_pallas_refuses_symbolic(platform):
    t, = export.symbolic_shape("t")
    p = problems.make([(5, 2), (9, 3)], page_size=8)
    args = symbolic_like(ragged_args(p), {(0, 0): t})
    kernel = "Mosaic" if platform == "tpu" else "Triton"
    with pytest.raises(NotImplementedError, match=rf"{kernel}.*symbolic.*total_tokens"):
        export_(ragged_fn("pallas"), args, (platform,))
    export_(ragged_fn("auto"), args, (platform,))
