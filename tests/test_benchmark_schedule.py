"""benchmarks/schedule.py on small sequences: its baseline (each table row
ordered by a sort) builds the same tables as fnattn's scatter, a run writes
every row, and ``--lowered`` lowers both programs for cuda."""

import jax
import numpy as np

from benchmark_scripts import benchmark_module
from fnattn import masks
from fnattn.flash import blocks


def test_the_sort_baseline_builds_the_same_tables():
    schedule = benchmark_module("schedule")
    ids = schedule.documents(2048, 300)
    mask = masks.causal() & masks.segments(ids, ids)
    fresh = [schedule.passes(2048, 2) for _ in range(2)]   # (traced once each)
    ours = jax.jit(lambda m: {n: f(m) for n, f in fresh[0].items()})(mask)
    real, blocks.ranked_order = blocks.ranked_order, schedule.sorted_order
    try:
        theirs = jax.jit(lambda m: {n: f(m) for n, f in fresh[1].items()})(mask)
    finally:
        blocks.ranked_order = real
    for name in ours:
        for a, b in zip(jax.tree_util.tree_leaves(ours[name]),
                        jax.tree_util.tree_leaves(theirs[name])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    # documents of about 300 tokens: some tiles of 128 visited, most not
    count = np.asarray(ours["xla flash"].count)
    assert 0 < count.min() and count.max() < 16


def test_small_run_writes_every_row(tmp_path):
    schedule = benchmark_module("schedule")
    schedule.main(["--ts", "1024,2048", "--reps", "1", "--heads", "2", "--doc", "300",
                   "--jaxnn-max", "1024", "--out", str(tmp_path / "schedule")])
    lines = (tmp_path / "schedule.md").read_text().splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| 1024 ")
            or line.startswith("| 2048 ")]
    passes = ["classes"] + [p + s for p in ("xla flash", "triton", "mosaic gpu fwd",
                                             "mosaic gpu bwd") for s in ("", " (sort)")]
    assert [r[2] for r in rows] == passes + ["jax.nn fwd"] + passes
    for r in rows:
        assert float(r[3]) > 0 and (r[5].endswith("x") == (r[2] in passes[1::2]))


def test_lowered_run_compares_the_programs_for_cuda(tmp_path):
    schedule = benchmark_module("schedule")
    schedule.main(["--lowered", "--ts", "4096", "--out", str(tmp_path / "lowered")])
    rows = [line.split(" | ") for line in (tmp_path / "lowered.md").read_text().splitlines()
            if line.startswith("| 4096 ")]
    assert [r[1] for r in rows] == ["forward", "gradient"]
    for r in rows:   # (small enough to embed: the same programs)
        assert float(r[2]) == float(r[4]) > 0
