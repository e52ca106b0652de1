"""benchmarks/gpu_backlog.py without a GPU: every step's command line is one
its script takes (an unknown peer or flag would cost a lent GPU's only call),
and the runner keeps to its budget, cuts a step at its limit and reports."""

import ast
import os
import sys

import pytest

from benchmark_scripts import benchmark_module

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(scope="module")
def backlog():
    return benchmark_module("gpu_backlog")


def _gpu_tests_in(path):
    """Names of the ``test_gpu_*`` functions of a test file."""
    with open(os.path.join(ROOT, path)) as fh:
        tree = ast.parse(fh.read())
    return [n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_gpu_")]


def test_every_step_is_a_command_its_script_takes(backlog):
    gpu, position_bias = benchmark_module("gpu"), benchmark_module("position_bias")
    names = [s.name for s in backlog.STEPS]
    assert len(set(names)) == len(names)
    for step in backlog.STEPS:
        argv = backlog.command(step, "/tmp/out")[1:]
        assert "{out}" not in " ".join(argv)
        assert 0 < step.least <= step.limit, step.name
        if argv[:2] == ["-m", "pytest"]:
            files = [a for a in argv if a.endswith(".py")]
            assert files and all(_gpu_tests_in(f) for f in files), step.name
            continue
        script, args = argv[0], argv[1:]
        if script == "benchmarks/gpu.py":
            parsed = gpu.parser().parse_args(args)
            assert parsed.sections in ("flash", "decode"), step.name
            if parsed.sections == "decode":
                for item in parsed.decode_grid.split(","):
                    assert len([int(x) for x in item.split("x")]) == 2
                continue
            assert set(parsed.impls.split(",")) <= set(gpu.FLASH_IMPLS), step.name
            for item in parsed.flash_grid.split(","):
                assert 2 <= len([int(x) for x in item.split("x")]) <= 3
        elif script == "benchmarks/extreme_logits.py":
            parsed = benchmark_module("extreme_logits").parser().parse_args(args)
            assert all(float(x) > 0 for x in parsed.scales.split(",")), step.name
        elif script == "benchmarks/schedule.py":
            parsed = benchmark_module("schedule").parser().parse_args(args)
            assert all(int(t) % 128 == 0 for t in parsed.ts.split(",")), step.name
        else:
            assert script == "benchmarks/position_bias.py", step.name
            parsed = position_bias.parser().parse_args(args)
            assert set(parsed.impls.split(",")) <= set(position_bias.IMPLS), step.name


def test_the_first_steps_fit_one_call(backlog):
    """The GPU checks, the documents figure and the position terms fit the
    default budget at their limits (a lent machine's call is at most 600 s)."""
    first = backlog.STEPS[:3]
    assert [s.name for s in first] == ["gpu_tests", "documents", "terms"]
    assert sum(s.limit for s in first) <= backlog.parser().parse_args([]).budget <= 560


def test_the_gpu_script_refuses_an_unknown_peer():
    import subprocess
    res = subprocess.run([sys.executable, "benchmarks/gpu.py", "--impls", "fnattn,fnatn:triton"],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "unknown --impls ['fnatn:triton']" in res.stderr


def test_runner_cuts_skips_and_reports(backlog, tmp_path):
    Step = backlog.Step
    steps = (Step("quick", "prints", ("-c", "print('row 1'); print('row 2')"), 30, 1),
             Step("slow", "sleeps past its limit", ("-c", "import time; print('started', "
                                                    "flush=True); time.sleep(30)"), 2, 1),
             Step("late", "needs more than is left", ("-c", "print('never')"), 30, 600))
    results = backlog.run(steps, str(tmp_path), budget=120)
    status = {step.name: s for step, s, _, _ in results}
    assert status["quick"] == 0 and status["slow"] == "cut at 2 s"
    assert status["late"].startswith("skipped (")
    assert (tmp_path / "quick.log").read_text() == "row 1\nrow 2\n"
    assert (tmp_path / "slow.log").read_text() == "started\n"
    assert (tmp_path / "quick").is_dir() and not (tmp_path / "late").exists()
    text = backlog.report(results, str(tmp_path), "header")
    assert text == (tmp_path / "backlog.md").read_text()
    assert "## quick: 0," in text and "row 2" in text and "## slow: cut at 2 s" in text
    assert "## late: skipped" in text and "never" not in text.split("## late")[1].split("\n")[0]
