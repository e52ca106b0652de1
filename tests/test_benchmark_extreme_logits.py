"""benchmarks/extreme_logits.py: its rows measure what they say, and its verdict
tells a lowering that strays from one that does not."""

import jax.numpy as jnp

from benchmark_scripts import benchmark_module

bench = benchmark_module("extreme_logits")


def test_the_xla_lowering_is_as_good_as_the_reference_at_any_size():
    for scale in (1.0, 1e8):
        res = bench.row("xla", dict(impl="xla"), scale, True, jnp.float32)
        assert res["status"] == "ok" and res["verdict"] == "ok", res
        assert res["max_logit"] > scale  # the logits grow with q
        assert res["dv"] < 1e-5 * res["dv_max"]


def test_a_lowering_that_strays_is_told(monkeypatch):
    flash = bench.fnattn.flash

    def off(spec, q, k, v):  # out and lse 1 % off: the gradients follow
        res = flash(spec, q, k, v)
        return res.__class__(out=res.out * 1.01, lse=res.lse * 1.01)

    monkeypatch.setattr(bench.fnattn, "flash", off)
    res = bench.row("off", dict(impl="xla"), 1.0, False, jnp.float32)
    assert res["verdict"] == "off" and res["out"] > 1e-3 * res["out_max"]


def test_table(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS", str(tmp_path))
    rows = [bench.row("xla", dict(impl="xla"), 10.0, False, jnp.float32),
            dict(lowering="mosaic_gpu", scale=1.0, causal=True, status="NotImplementedError")]
    args = bench.parser().parse_args(["--scales", "10", "--out", "t"])
    text = bench.write(rows, args, jnp.float32)
    assert text == (tmp_path / "t.md").read_text()
    assert "| xla | False | 10 | " in text and text.count("| ok |") == 1
    assert "| mosaic_gpu | True | 1 | | NotImplementedError |" in text


def test_the_triton_kernels_hold_where_the_docs_say():
    """docs/spec_and_masks.md ("Extreme inputs"): the Triton kernels (interpreted)
    are as good as the float32 reference for logits from q.k up to 4e4, causal
    or not, and to 4e8 without a mask (the backward's base-2 lse in two
    parts); a float32 base-2 lse put them off from 4e4."""
    for scale, causal in ((1e4, True), (1e4, False), (1e8, False)):
        res = bench.row("pallas", dict(impl="pallas"), scale, causal, jnp.float32)
        assert res["verdict"] == "ok" and 4 * scale < res["max_logit"] < 5 * scale, res
