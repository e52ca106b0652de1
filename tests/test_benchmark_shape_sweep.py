"""benchmarks/shape_sweep.py at tiny sizes: every entry and floor gets a ratio
and a memory figure per cell, decode cells too, oversized decode cells are
reported with the bytes they need, and the table and heat map are written."""

import os

import pytest

from benchmark_scripts import benchmark_module

bench = benchmark_module("shape_sweep")


def test_tiny_sweep_writes_ratios_memory_table_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS", str(tmp_path))
    pytest.importorskip("matplotlib")
    rows, drows = bench.main(
        ["--ts", "16,24", "--hs", "4", "--ds", "8", "--groups", "mha,gqa", "--masks",
         "none,causal,padding", "--dtypes", "float32", "--tokens", "32", "--reps", "1",
         "--min-ms", "0", "--floors", "--decode-bs", "1,4096", "--decode-ss", "16",
         "--max-gib", "0.01", "--out", "tiny"])
    assert len(rows) == 2 * 2 * 3 * 2
    for r in rows:
        assert r["B"] == 32 // r["T"] and r["K"] == (1 if r["group"] == "gqa" else 4)
        for name in ("attention", "nn", "dense", "blockwise"):
            assert r[f"{name}_status"] == "ok", (name, r)
            assert r[f"{name}_x"] > 0 and r[f"{name}_mb"] > 0
    ok = [r for r in drows if r["status"] == "ok"]
    assert [r["B"] for r in ok] == [1] and ok[0]["attention_x"] > 0
    big = [r for r in drows if r["B"] == 4096][0]
    assert big["status"].startswith("not run: needs") and big["need_gib"] > 0.01
    text = open(os.path.join(tmp_path, "tiny.md")).read()
    assert "| 24 | 1 | 4 | 1 | 8 | padding | float32 | fwd+bwd |" in text
    assert "not run: needs" in text
    assert os.path.getsize(os.path.join(tmp_path, "tiny.png")) > 1000
    assert os.path.getsize(os.path.join(tmp_path, "tiny.csv")) > 100


def test_decode_bytes_counts_the_cache_and_the_logits():
    # B=1, S=1024, 8 kv heads of 128, f32: K and V 8 MiB, q/out, 2x f32 logits of 32 heads
    need = bench.decode_bytes(1, 1024, "float32")
    assert need == 2 * 1024 * 8 * 128 * 4 + 2 * 32 * 128 * 4 + 2 * 4 * 32 * 1024


def test_unknown_entries_and_masks_are_refused_by_name():
    with pytest.raises(SystemExit):
        bench.parse(["--entries", "attention,nope"])
    with pytest.raises(SystemExit):
        bench.parse(["--masks", "sliding"])
