"""benchmarks/tree_verify.py on small sizes: a run writes every row, each with a ratio."""

from benchmark_scripts import benchmark_module


def test_small_run_writes_every_row(tmp_path):
    bench = benchmark_module("tree_verify")
    out = tmp_path / "tv.md"
    bench.main(["--context", "64", "--drafts", "8", "--heads", "2", "--kv-heads", "1",
                "--head-dim", "16", "--page-size", "8", "--window", "16", "--reps", "1",
                "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")][2:]
    assert len(rows) == 8, rows
    assert all(line.count("x |") == 1 for line in rows)
    assert "| causal prefill | " in rows[0] and "1.000x" in rows[0]
