"""benchmarks/flash.py: a configuration runs in its own process and reports a
row, for fnattn's flash and dense lowerings alike; --impls names what it runs."""

import subprocess
import sys

from benchmark_scripts import benchmark_module

bench = benchmark_module("flash")


def test_one_configuration_of_each_fnattn_lowering_reports_a_row():
    for impl in ("fnattn", "fnattn:dense"):
        for mode in ("fwd", "fwd+bwd"):
            cfg = dict(B=1, T=64, H=2, D=16, dtype="float32", causal=True, mode=mode,
                       impl=impl, reps=1)
            res = bench.run_one(cfg, timeout=300)
            assert res["status"] == "ok", (impl, mode, res)
            assert res["time_s"] > 0 and res["gflops"] > 0 and res["xla_mb"] > 0


def test_an_unknown_implementation_is_refused_by_name():
    p = subprocess.run([sys.executable, bench.__file__, "--impls", "fnattn,nope"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown ['nope']" in p.stderr, p.stderr
