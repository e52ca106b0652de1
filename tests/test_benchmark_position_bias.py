"""benchmarks/position_bias.py: each row computes what it says, and the table is written."""

import json
import types

import pytest

from benchmark_scripts import benchmark_module

bench = benchmark_module("position_bias")


@pytest.mark.parametrize("impl", bench.IMPLS)
def test_every_row_runs(impl, capsys):
    bench.child(dict(B=1, T=64, H=2, D=8, impl=impl, mode="fwd+bwd", reps=1, dtype="float32",
                     jaxnn="xla"))
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["status"] == "ok" and res["time_s"] > 0 and res["gflops"] > 0


def test_table_has_the_ratio_to_jax_nn(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS", str(tmp_path))
    rows = [dict(T=64, mode="fwd", impl=impl, status="ok", time_s=t, min_s=t, max_s=t,
                 gflops=1.0, peak_mb=1.0, xla_mb=1.0, vs_jax_nn=0.02 / t, B=1, H=2, D=8,
                 reps=1, device="cpu", jax="0")
            for impl, t in (("jax.nn:xla", 0.02), ("fnattn+alibi", 0.01))]
    rows.append(dict(T=64, mode="fwd", impl="fnattn+bias", status="timeout > 1 s"))
    args = types.SimpleNamespace(out="t", T="64", modes="fwd", B=1, H=2, D=8, reps=1,
                                 dtype="float32", jaxnn="xla")
    bench.write(rows, args, 1.0)
    text = (tmp_path / "t.md").read_text()
    assert "| 64 | fwd | fnattn+alibi | 10.0 | 1.0 | 2.00x |" in text
    assert "timeout > 1 s" in text
