"""The scripts in examples/ run and check what they claim (each in this process,
with small sizes; examples/context_parallel.py runs in the 8-device subprocess
of tests/test_shard_map.py, see tests/multi_device/examples_checks.py)."""

import importlib.util
import os

import numpy as np

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}",
                                                  os.path.join(EXAMPLES, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_gpt_losses_equal_jax_nn(capsys):
    a, b = load("train_gpt").main(["--steps", "25", "--seq", "48", "--batch", "4"])
    np.testing.assert_allclose(a, b, rtol=1e-3)
    assert a[-1] < 0.7 * a[0]
    assert "max relative loss difference" in capsys.readouterr().out


def test_every_example_is_tested():
    here = open(__file__).read()
    shard = open(os.path.join(os.path.dirname(__file__), "multi_device",
                              "examples_checks.py")).read()
    for f in sorted(os.listdir(EXAMPLES)):
        if f.endswith(".py"):
            name = f[:-3]
            assert f'"{name}"' in here or f"{name}.py" in shard, f"examples/{f} has no test"


def test_serve_paged_equals_the_model_without_a_cache(capsys):
    worst = load("serve_paged").main(["--requests", "5", "--max-new", "5"])
    assert worst < 1e-3
    assert "equals the model run without a cache" in capsys.readouterr().out


def test_flax_nnx_model_with_the_adapter_equals_flax(capsys):
    out_err, grad_err, loss_diff = load("flax_nnx").main([])
    assert out_err < 1e-4 and grad_err < 1e-4 and loss_diff < 1e-3
    assert "make_attention_fn" in capsys.readouterr().out


def test_serve_quantized_equals_the_float_model_within_the_quantization(capsys):
    worst = load("serve_quantized").main(["--requests", "3", "--max-new", "4"])
    assert worst["int8"] < 0.05 and worst["fp8"] < 0.25
    assert "greedy tokens equal" in capsys.readouterr().out


def test_local_global_scan_equals_its_unrolled_twin(capsys):
    r = load("local_global_scan").main(["--layers", "6", "--seq", "24", "--window", "5",
                                        "--batch", "4", "--d-model", "32", "--steps", "30"])
    for name in ("logits", "grads", "trained_logits", "trained_grads"):
        assert r[name] < 1e-5, (name, r[name])
    assert r["losses"][-1] < 0.7 * r["losses"][0]
    assert "equals its unrolled twin" in capsys.readouterr().out


def test_local_global_serve_equals_the_model_without_a_cache(capsys):
    worst = load("local_global_serve").main([])
    assert set(worst) == {"prefill", "tree", "after_accept"}
    assert max(worst.values()) < 1e-4, worst
    assert "every step equals the model without a cache" in capsys.readouterr().out


def test_serve_latent_equals_the_unabsorbed_model_without_a_cache(capsys):
    worst = load("serve_latent").main(["--requests", "3", "--max-new", "4"])
    assert worst["float32"] < 1e-3 and worst["int8"] < 0.1
    assert "no value pool" in capsys.readouterr().out
