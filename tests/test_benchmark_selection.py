"""benchmarks/selection.py's rows at tiny sizes: every call runs and is reported."""

from benchmark_scripts import benchmark_module


def test_rows_time_every_call_against_jax_nn():
    selection = benchmark_module("selection")
    for Tq in (1, 8):
        rows = selection.row("tiny", 2, Tq, 256, 16, 4, 1, 8, rounds=1, grad=Tq > 1)
        assert [r[1] for r in rows][0].startswith("jax.nn")
        assert len(rows) == (5 if Tq == 1 else 3) and rows[0][3] == 1.0
        assert all(r[2] > 0 and r[4] >= 0 for r in rows)


def test_spread_indices_are_distinct_and_in_range():
    import jax
    import numpy as np
    selection = benchmark_module("selection")
    idx = np.asarray(selection.spread_indices(jax.random.key(0), (3, 2), 1024, 64))
    assert idx.shape == (3, 2, 64) and idx.min() >= 0 and idx.max() < 1024
    assert all(len(set(r)) == 64 for r in idx.reshape(-1, 64))
