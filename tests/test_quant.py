"""fnattn.quant: formats, saturation, round trips, packing and bad input (under jax.jit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from fnattn import quant
from fnattn.quant import QuantFormat

FORMATS = [QuantFormat(n, g) for n in quant.FORMATS for g in ("token", "tensor")]
IDS = [f"{f.name}-{f.granularity}" for f in FORMATS]


def _quantize(x, fmt, scale=None):
    return jax.jit(lambda x, s: quant.quantize(x, fmt, scale=s))(x, scale)


def _half_step(fmt, y):
    """Half a quantization step at each code value y (= x / scale), in code units."""
    if not fmt.is_float:
        return np.full_like(y, 0.5)
    fi = jnp.finfo(fmt.storage_dtype)
    eps, tiny = float(fi.eps), float(fi.smallest_subnormal)
    # the step at |y| is 2**floor(log2|y|) * eps (normal) or the subnormal step
    e = np.floor(np.log2(np.maximum(np.abs(y), float(fi.smallest_normal))))
    return np.maximum(2.0 ** e * eps, tiny) / 2


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_round_trip_within_half_a_step(fmt):
    x = np.asarray(jax.random.normal(jax.random.key(0), (3, 11, 2, 16)), np.float32) * 3
    scale = None if fmt.per_token else 6.0 / fmt.max_code    # |x| > 6 saturates
    qa = _quantize(jnp.asarray(x), fmt, scale)
    assert qa.data.dtype == fmt.storage_dtype
    assert qa.data.shape == (3, 11, 2, 16 // fmt.per_byte)
    assert qa.shape == x.shape
    s = np.asarray(qa.scale, np.float64)
    s = s[..., None] if fmt.per_token else s
    back = np.asarray(jax.jit(quant.dequantize)(qa), np.float64)
    y = x / s
    inside = np.abs(y) <= fmt.max_code * (1 + 1e-6)
    err = np.abs(back - x) / s                                   # in code units
    assert (err[inside] <= _half_step(fmt, y)[inside] * (1 + 1e-5) + 1e-5).all()
    # outside the range: saturated to the largest code, same sign
    np.testing.assert_allclose(back[~inside], np.sign(x[~inside]) * fmt.max_code
                               * np.broadcast_to(s, x.shape)[~inside], rtol=1e-6)
    if not fmt.per_token:
        assert (~inside).any()           # the test reaches saturation
    if fmt.per_token:   # every row reaches the largest code: its scale is amax / max_code
        np.testing.assert_allclose(s[..., 0], np.abs(x).max(-1) / fmt.max_code, rtol=1e-6)


@pytest.mark.parametrize("name", quant.FORMATS)
def test_saturates_never_makes_nan_or_inf(name):
    m = QuantFormat(name).max_code
    x = jnp.array([[m * 1.1 + 1, -1e30, 3.4e38, -3.4e38, 1.0, 0.0, 448.0, -7.0]])
    qa = _quantize(x, QuantFormat(name, "tensor"), 1.0)
    back = np.asarray(jax.jit(quant.dequantize)(qa))
    assert np.isfinite(back).all()
    np.testing.assert_array_equal(back[0, :4], [m, -m, m, -m])
    assert back[0, 4] == 1.0 and back[0, 5] == 0.0


def test_nan_stays_nan_in_float8_and_is_zero_in_ints():
    x = jnp.array([[jnp.nan, 1.0]])
    for name in quant.FORMATS:
        back = np.asarray(jax.jit(quant.dequantize)(_quantize(x, QuantFormat(name, "tensor"),
                                                              1.0)))
        assert np.isnan(back[0, 0]) == name.startswith("float"), name
        assert back[0, 1] == 1.0


def test_int4_packs_split_halves():
    # channel j in the low nibble, channel j + D/2 in the high nibble of byte j
    x = jnp.array([[1.0, -2.0, 7.0, -7.0, 3.0, 0.0, -1.0, 5.0]])
    qa = _quantize(x, QuantFormat("int4", "tensor"), 1.0)
    codes = np.array([1, -2, 7, -7, 3, 0, -1, 5])
    want = ((codes[:4] & 0xF) | ((codes[4:] & 0xF) << 4)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(qa.data)[0], want)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.dequantize)(qa))[0], codes)


def test_traced_tensor_scale_and_zero_rows():
    x = jnp.zeros((2, 4, 8))
    qa = _quantize(x, QuantFormat("int8"))
    np.testing.assert_array_equal(qa.scale, 1.0)         # an all-zero row: scale 1, codes 0
    qa = _quantize(x + 1, QuantFormat("float8_e5m2", "tensor"), jnp.float32(0.25))
    np.testing.assert_array_equal(jax.jit(quant.dequantize)(qa), 1.0)


def test_write_is_bit_identical_to_quantize():
    fmt = QuantFormat("int4")
    pool = quant.empty((2, 5, 4, 8), fmt)
    new = jax.random.normal(jax.random.key(1), (2, 3, 8))

    @jax.jit
    def f(pool, new):
        return quant.write(pool, (slice(None), jnp.array([4, 0, 9]), jnp.array([1, 2, 3])), new)

    out = f(pool, new)
    ref = quant.quantize(new, fmt)
    np.testing.assert_array_equal(out.data[:, 4, 1], ref.data[:, 0])
    np.testing.assert_array_equal(out.data[:, 0, 2], ref.data[:, 1])
    np.testing.assert_array_equal(out.scale[:, 0, 2], ref.scale[:, 1])
    assert (np.asarray(out.data[:, 1:4]) == 0).all()      # index 9 (out of range) dropped


def test_quantized_array_is_a_pytree_that_indexes_leading_axes():
    qa = quant.quantize(jnp.ones((3, 4, 8)), "int8")
    leaves, treedef = jax.tree_util.tree_flatten(qa)
    assert len(leaves) == 2
    sub = jax.jit(lambda a: a[1:])(qa)
    assert sub.shape == (2, 4, 8) and sub.scale.shape == (2, 4)
    stacked = jax.lax.scan(lambda c, a: (c, a), None, qa)[1]
    assert stacked.format == qa.format and stacked.scale.shape == (3, 4)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_tensor_scales_are_refused(bad):
    with pytest.raises(ValueError, match="scale must be"):
        quant.quantize(jnp.ones((2, 4)), QuantFormat("int8", "tensor"), scale=bad)
    with pytest.raises(ValueError, match="scale must be"):
        quant.quantize(jnp.ones((2, 4)), QuantFormat("int8", "tensor"), scale=jnp.float32(bad))


def test_traced_bad_scale_is_reported_in_checked_mode():
    f = checkify.checkify(lambda x, s: quant.quantize(x, QuantFormat("int8", "tensor"),
                                                      scale=s, checked=True).data)
    err, _ = jax.jit(f)(jnp.ones((2, 4)), jnp.float32(-2.0))
    with pytest.raises(checkify.JaxRuntimeError, match="scale must be finite and > 0"):
        err.throw()
    err, _ = jax.jit(f)(jnp.ones((2, 4)), jnp.float32(2.0))
    assert err.get() is None


def test_bad_input_messages():
    with pytest.raises(ValueError, match="head dim, which must be even.*head dim 7"):
        quant.quantize(jnp.ones((2, 7)), "int4")
    with pytest.raises(ValueError, match="must be a scalar, shape \\(\\)"):
        quant.quantize(jnp.ones((2, 4)), QuantFormat("int8", "tensor"), scale=jnp.ones(2))
    with pytest.raises(ValueError, match="needs its scale"):
        quant.quantize(jnp.ones((2, 4)), QuantFormat("int8", "tensor"))
    with pytest.raises(ValueError, match="computes its scales from x"):
        quant.quantize(jnp.ones((2, 4)), QuantFormat("int8"), scale=2.0)
    with pytest.raises(TypeError, match="floating-point"):
        quant.quantize(jnp.ones((2, 4), jnp.int32), "int8")
    with pytest.raises(ValueError, match="granularity"):
        QuantFormat("int8", "channel")
    qa = quant.quantize(jnp.ones((2, 3, 4)), "int8")
    with pytest.raises(ValueError, match=r"scale must have shape data.shape\[:-1\]"):
        quant.check("decode", "k_cache", qa.replace(scale=jnp.ones((2,))))
    with pytest.raises(TypeError, match="stored as int8"):
        quant.check("decode", "k_cache", qa.replace(data=qa.data.astype(jnp.float32)))
