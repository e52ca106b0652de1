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
    # one layer: 5 rows; the model: scanned and unrolled, and the three
    # one-layer floors, for each pass
    assert len(rows) == 5 + 2 * 5, rows
    for form in ("scanned", "unrolled", "1 layer, traced window", "1 layer, static window",
                 "1 layer, static global"):
        assert sum(f"| {form} |" in r for r in rows) == 2, form
    assert "; equal." in text
