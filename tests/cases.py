"""Feature cases shared by the tests of every lowering.

A case builds (spec, q, k, v) with distinct prime sizes, plus the matching
arguments of the float64 NumPy attention in ``np_attention``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fnattn import AttentionSpec, dropout, masks


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int = 2
    Tq: int = 7
    Tk: int = 11
    Hq: int = 6
    Hkv: int = 2
    D: int = 5
    Dv: int = 5
    mask: str = "none"
    bias: bool = False
    softcap: float | None = None
    sinks: bool = False
    dropout: float = 0.0
    scale: float | None = None
    dtype: str = "float32"


CASES = [
    Case("plain"),
    Case("mha", Hq=3, Hkv=3),
    Case("mqa", Hq=5, Hkv=1),
    Case("dv", Dv=3),
    Case("scale", scale=0.7),
    Case("causal", mask="causal"),
    Case("causal_square", Tq=11, mask="causal"),
    Case("window", Tq=11, mask="window"),
    Case("chunked", Tq=11, mask="chunked"),
    Case("segments", Tq=11, mask="segments"),
    Case("lengths", mask="lengths"),
    Case("prefix", Tq=11, mask="prefix"),
    Case("array", mask="array"),
    Case("fn", mask="fn"),
    Case("algebra", Tq=11, mask="algebra"),
    Case("bias", bias=True),
    Case("softcap", softcap=2.0),
    Case("sinks", sinks=True),
    Case("sinks_masked", sinks=True, mask="lengths"),
    Case("dropout", dropout=0.3),
    Case("everything", Tq=11, mask="causal_segments", bias=True, softcap=3.0, sinks=True,
         dropout=0.2, Dv=3),
    Case("bf16", mask="causal", dtype="bfloat16"),
    Case("f16", mask="causal", dtype="float16"),
]


# Edge cases beyond CASES: more queries than keys (causal rows before the first key
# see nothing), a single query or key, a group of 3, saturating soft-cap, Dv > D.
EXTRA_CASES = [
    Case("causal_tall", Tq=13, Tk=7, mask="causal"),
    Case("window_tall_sinks", Tq=13, Tk=7, mask="window", sinks=True),
    Case("single_query", Tq=1, mask="causal", sinks=True),
    Case("single_key", Tq=5, Tk=1, mask="causal", bias=True),
    Case("gqa3", Tq=11, Hq=9, Hkv=3, mask="causal_segments"),
    Case("saturated_softcap", scale=3.0, softcap=0.5, bias=True),
    Case("dv_larger", D=3, Dv=7, mask="prefix", Tq=11),
    Case("dropout_array_sinks_bias", dropout=0.5, sinks=True, bias=True, mask="array"),
    Case("lengths_bf16_sinks", mask="lengths", sinks=True, dtype="bfloat16"),
]


def build_mask(kind, B, Hq, Tq, Tk, rs):
    seg_q = np.sort(rs.integers(0, 3, (B, Tq)), axis=1)
    seg_k = np.sort(rs.integers(0, 3, (B, Tk)), axis=1)
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.sliding_window(left=3)
    if kind == "chunked":
        return masks.chunked(4) & masks.causal()
    if kind == "segments":
        return masks.segments(jnp.asarray(seg_q), jnp.asarray(seg_k))
    if kind == "lengths":
        # the second batch row has q_length 0 -> fully masked rows
        return masks.lengths(jnp.array([Tq - 2, 0][:B]), jnp.array([Tk - 3, Tk][:B]))
    if kind == "prefix":
        return masks.prefix_lm(jnp.array([3, 6][:B]))
    if kind == "array":
        return masks.from_array(jnp.asarray(rs.random((B, 1, Tq, Tk)) < 0.6))
    if kind == "fn":
        return masks.from_fn(lambda b, h, q, k: (q + k + h) % 3 != 0)
    if kind == "algebra":
        return (masks.causal() & ~masks.sliding_window(left=1)) | masks.chunked(5)
    if kind == "causal_segments":
        return masks.causal() & masks.segments(jnp.asarray(seg_q), jnp.asarray(seg_k))
    raise ValueError(kind)


def make(case: Case, *, layout="bthd", seed=0, impl="auto"):
    """Returns spec, q, k, v (jax, in `layout`) and np_kwargs for np_attention."""
    rs = np.random.default_rng(seed)
    B, Tq, Tk, Hq, Hkv, D, Dv = (case.B, case.Tq, case.Tk, case.Hq, case.Hkv, case.D, case.Dv)
    dt = jnp.dtype(case.dtype)
    q = jnp.asarray(rs.standard_normal((B, Tq, Hq, D)), dt)
    k = jnp.asarray(rs.standard_normal((B, Tk, Hkv, D)), dt)
    v = jnp.asarray(rs.standard_normal((B, Tk, Hkv, Dv)), dt)
    mask = build_mask(case.mask, B, Hq, Tq, Tk, rs)
    bias = jnp.asarray(rs.standard_normal((1, Hq, Tq, Tk)), jnp.float32) if case.bias else None
    sinks = jnp.asarray(rs.standard_normal((Hq,)), jnp.float32) if case.sinks else None
    key = jax.random.key(seed) if case.dropout else None
    spec = AttentionSpec(mask=mask, scale=case.scale, softcap=case.softcap, bias=bias,
                         sinks=sinks, dropout_rate=case.dropout, dropout_key=key,
                         layout=layout, impl=impl)
    np_kwargs = dict(scale=case.scale, softcap=case.softcap,
                     bias=None if bias is None else np.asarray(bias),
                     sinks=None if sinks is None else np.asarray(sinks))
    if mask is not None:
        np_kwargs["mask"] = np.asarray(masks.materialize(mask, B, Hq, Tq, Tk))
    if case.dropout:
        bi, hi, qi, ki = np.ix_(np.arange(B), np.arange(Hq), np.arange(Tq), np.arange(Tk))
        keep = np.asarray(dropout.keep_mask(dropout.seed_from_key(key), bi, hi, qi, ki,
                                            case.dropout))
        np_kwargs.update(keep=keep, rate=case.dropout)
    if layout == "bhtd":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    return spec, q, k, v, np_kwargs


def tolerance(dtype):
    return {"float32": 2e-5, "bfloat16": 3e-2, "float16": 4e-3}[jnp.dtype(dtype).name]


def to_bthd(x, layout):
    return x if layout == "bthd" else jnp.swapaxes(x, 1, 2)


def check_case(attn, case: Case, *, impl, layout="bthd", block_sizes=None, grad_tol=1e-4):
    """Checks ``attn(spec, q, k, v)`` on ``case`` against float64 NumPy.

    The forward (out, lse, which rows are -inf) always; for float32 cases also the
    gradients of q, k, v, bias and sinks through a random linear function of both
    out and lse, in the same compiled function.
    """
    from np_attention import np_attention, np_attention_grads, reduce_to  # tests/ is on sys.path

    spec, q, k, v, kw = make(case, impl=impl, layout=layout)
    if block_sizes is not None:
        spec = spec.replace(block_sizes=block_sizes)

    def f64(x):
        return np.asarray(to_bthd(jnp.asarray(x, jnp.float32), layout), np.float64)

    rs = np.random.default_rng(1)
    d_out = jnp.asarray(rs.standard_normal((case.B, case.Tq, case.Hq, case.Dv)), jnp.float32)
    d_lse = jnp.asarray(rs.standard_normal((case.B, case.Hq, case.Tq)), jnp.float32)
    d_out_l = to_bthd(d_out, layout)

    def loss(q, k, v, bias, sinks):
        res = attn(spec.replace(bias=bias, sinks=sinks), q, k, v)
        lse = jnp.where(jnp.isfinite(res.lse), res.lse, 0.0)
        return jnp.sum(res.out.astype(jnp.float32) * d_out_l) + jnp.sum(lse * d_lse), res

    args = (q, k, v, spec.bias, spec.sinks)
    if case.dtype == "float32":
        (_, res), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                                     has_aux=True))(*args)
    else:
        res, grads = jax.jit(lambda *a: loss(*a)[1])(*args), None
    out, lse, _ = np_attention(f64(q), f64(k), f64(v), **kw)
    assert res.out.dtype == q.dtype and res.lse.dtype == jnp.float32
    assert f64(res.out).shape == (case.B, case.Tq, case.Hq, case.Dv)
    assert res.lse.shape == (case.B, case.Hq, case.Tq)
    np.testing.assert_array_equal(np.isneginf(np.asarray(res.lse)), np.isneginf(lse))
    tol = tolerance(case.dtype) * 10
    np.testing.assert_allclose(f64(res.out), out, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(res.lse), lse, atol=tol, rtol=tol)
    if grads is None:
        return
    ref = np_attention_grads(f64(q), f64(k), f64(v), np.asarray(d_out), np.asarray(d_lse), **kw)
    for name, g in zip(("dq", "dk", "dv"), grads[:3]):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(f64(g), ref[name], atol=grad_tol, rtol=grad_tol, err_msg=name)
    if spec.bias is None:
        assert grads[3] is None
    else:
        assert grads[3].shape == spec.bias.shape
        np.testing.assert_allclose(np.asarray(grads[3]), reduce_to(ref["dbias"], spec.bias.shape),
                                   atol=grad_tol, rtol=grad_tol, err_msg="dbias")
    if spec.sinks is not None:
        np.testing.assert_allclose(np.asarray(grads[4]), ref["dsinks"], atol=grad_tol,
                                   rtol=grad_tol, err_msg="dsinks")


def np_mask(mask, b, Hq, n, L):
    """A positional mask for sequence ``b`` as a NumPy (1, Hq, n, L) bool array: n
    queries at positions L - n .. L - 1 over L keys (bottom-right aligned), from the
    mask's own predicate on NumPy index arrays (positional masks use comparisons and
    integer division only). None for no mask."""
    if mask is None:
        return None
    h = np.arange(Hq)[None, :, None, None]
    q = np.arange(n)[None, None, :, None]
    k = np.arange(L)[None, None, None, :]
    pos = masks.Positions(b=np.full((1, 1, 1, 1), b), h=h, q=q, q_pos=q + (L - n), k=k)
    return np.broadcast_to(np.asarray(mask.predicate(pos, [])), (1, Hq, n, L))


def vjp(f, spec, q, k, v, d_out, d_lse):
    """``((out, lse), (dq, dk, dv, dbias, dsinks))`` of ``f(spec, q, k, v)`` with
    explicit cotangents, in one jitted call (so ``lse``'s cotangent reaches rows
    whose ``lse`` is infinite, which a scalar loss would turn into inf or NaN)."""
    def g(q, k, v, bias, sinks):
        r = f(spec.replace(bias=bias, sinks=sinks), q, k, v)
        return r.out, r.lse

    def run(q, k, v, bias, sinks, d_out, d_lse):
        res, pullback = jax.vjp(g, q, k, v, bias, sinks)
        return res, pullback((d_out.astype(res[0].dtype), d_lse.astype(res[1].dtype)))

    return jax.jit(run)(q, k, v, spec.bias, spec.sinks, d_out, d_lse)


def assert_float64_equals(out, lse, grads, want):
    """``out``, ``lse`` and ``grads`` (dq, dk, dv, dbias, dsinks) are float64 and
    equal the float64 NumPy model ``want`` (np_attention_grads) to 1e-12 (values)
    and 1e-10 (gradients; dbias reduced to its broadcast shape)."""
    from np_attention import reduce_to
    assert out.dtype == lse.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), want["out"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), want["lse"], rtol=1e-12, atol=1e-12)
    for name, g in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads):
        assert g.dtype == jnp.float64, name
        w = reduce_to(want[name], g.shape) if name == "dbias" else want[name]
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-10, err_msg=name)
