"""fnattn.flash routing and fnattn.attention's use of it."""

import jax
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks
from fnattn.flash import api

Q = jax.random.normal(jax.random.key(0), (2, 13, 4, 8))
K = jax.random.normal(jax.random.key(1), (2, 13, 2, 8))


def test_auto_routes_to_flash_xla_lowering():
    assert fnattn.core.lowering_table("auto") == api.lowering_table("auto")
    table = dict(api.lowering_table("auto"))
    assert (table["default"].name, table["cuda"].name, table["tpu"].name) == (
        "flash-xla", "flash-auto-cuda", "flash-mosaic")


@pytest.mark.parametrize("impl", ["auto", "xla", "reference"])
def test_impls_agree(impl):
    spec = AttentionSpec(mask=masks.causal(), impl=impl)
    res = jax.jit(fnattn.flash)(spec, Q, K, K)
    ref = jax.jit(fnattn.reference)(spec, Q, K, K)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=2e-6)


def test_cudnn_is_not_a_flash_lowering():
    with pytest.raises(NotImplementedError, match="not a flash lowering"):
        jax.jit(fnattn.flash)(AttentionSpec(impl="cudnn"), Q, K, K)


def test_pallas_runs_the_triton_kernels_interpreted_off_gpu():
    spec = AttentionSpec(mask=masks.causal(), impl="pallas",
                         block_sizes=fnattn.TritonBlockSizes(16, 16, 16, 16, 16, 16))
    res = jax.jit(fnattn.flash)(spec, Q, K, K)
    ref = jax.jit(fnattn.reference)(spec, Q, K, K)
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ref.out), atol=2e-6)


def test_validation_names_flash():
    with pytest.raises(ValueError, match="flash: head-dim mismatch"):
        jax.jit(fnattn.flash)(AttentionSpec(), Q, K[..., :4], K)
