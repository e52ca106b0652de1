"""benchmarks/layered_cache.py on small sizes: a run writes every row, and the
carried form's temporaries stay below the xs/ys form's (which restacks the pools)."""

import re

from benchmark_scripts import benchmark_module


def test_small_run_writes_every_row(tmp_path):
    bench = benchmark_module("layered_cache")
    out = tmp_path / "lc.md"
    bench.main(["--layers", "3", "--batch", "2", "--capacity", "64", "--prompt", "8",
                "--reps", "1", "--out", str(out)])
    text = out.read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| form", "| ---"))}
    assert set(rows) == {"carry", "xs/ys", "unrolled, stacked pools",
                         "unrolled, a cache per layer", "one call, q_lengths",
                         "one call per prompt"}, rows
    mem = {k: float(v[3]) for k, v in rows.items() if len(v) == 4}
    assert len(mem) == 4 and mem["carry"] < mem["xs/ys"], mem
    assert re.search(r"2 prompts of \[2, 8\] tokens", text)
