"""benchmarks/quant.py at tiny sizes: its tables have every format's row, the
bytes halve (8-bit) and quarter (4-bit), and the latent decode's table."""

from benchmark_scripts import benchmark_module


def test_quick_tables():
    bench = benchmark_module("quant")
    rows = bench.timing_rows(2, 64, 4, 2, 16, 8, reps=1)
    assert [r[:2] for r in rows] == [(kind, label) for kind in ("decode", "paged")
                                     for label, _ in bench.FORMATS]
    by = {(r[0], r[1]): r[2] for r in rows}
    for kind in ("decode", "paged"):
        assert by[kind, "int8 per-token"] == by[kind, "bf16"] // 2 + 2 * 2 * 64 * 2 * 4
        assert by[kind, "int4 per-token"] == by[kind, "bf16"] // 4 + 2 * 2 * 64 * 2 * 4
    mla = bench.mla_rows(2, 64, 4, 16, 8, reps=1)
    assert [r[0].split(",")[0] for r in mla] == ["MQA", "latent", "MQA"]
    assert mla[1][1] == mla[0][1] < mla[2][1]   # the latent: one array, no value cache
