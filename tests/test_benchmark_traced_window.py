"""benchmarks/traced_window.py on small sizes: a run writes every row, and the tiles
the traced windows visit equal the static masks'."""

from benchmark_scripts import benchmark_module


def test_small_run_writes_every_row_and_equal_tiles(tmp_path):
    bench = benchmark_module("traced_window")
    out = tmp_path / "tw.md"
    bench.main(["--t", "512", "--window", "32", "--model-t", "256", "--layers", "6",
                "--reps", "1", "--out", str(out)])
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| fwd")]
    assert len(rows) == 5 + 4, rows
    assert "; equal." in text
