"""benchmarks/paged_problems.py and benchmarks/timing.py: their doctests, and the
plain gather baseline computing what fnattn.paged_attention does."""

import doctest

import numpy as np
from benchmark_scripts import benchmark_module


def test_doctests():
    for name in ("paged_problems", "timing"):
        assert doctest.testmod(benchmark_module(name)).failed == 0


def test_gather_baseline_matches_paged_attention():
    bench = benchmark_module("paged_problems")
    prob = bench.decode_problem(batch=3, context=37, num_q_heads=4, num_kv_heads=2,
                                head_dim=8, page_size=4, dtype=np.float32, q_len=2)
    got = bench.gather_decode(*prob.args)
    want = bench.decode_fn(impl="xla")(*prob.args)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert bench.decode_bytes(prob) == 2 * 3 * 37 * 2 * 8 * 4 + 2 * 3 * 2 * 4 * 8 * 4
