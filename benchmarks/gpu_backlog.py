"""What is still to be measured on a lent NVIDIA GPU, in one call, most needed first.

    python3 benchmarks/gpu_backlog.py --out-dir "$OUT"            # every step, 540 s in all
    python3 benchmarks/gpu_backlog.py --only documents,terms      # some of them
    python3 benchmarks/gpu_backlog.py --list                      # the steps, not run

A session that is lent a GPU gets 15 minutes of it, start-up included: about
one call of nine minutes. This script spends that call on :data:`STEPS` in
their order (the GPU checks of the kernels changed without a GPU first, then
the figure issue 10 still misses, then the rest), each step a process of its
own under its own time limit, so that a step cut short keeps the rows it has
printed and the next still runs. A step is skipped when less of the call's
budget is left than it needs (``least``). Before the first step the wheels
under ``.whl/`` (beartype, tokamax and its dependencies: see the README) are
installed into ``/tmp/site``, as ``gpu_session.sh`` does.

Each step writes its files under ``OUT/<step>/`` and its output to
``OUT/<step>.log``; ``OUT/backlog.md`` says for each step its command, its
exit status and time and its last lines.
"""

import argparse
import dataclasses
import glob
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclasses.dataclass(frozen=True)
class Step:
    """One measurement: ``argv`` after ``python3`` ("{out}" becomes the step's
    folder), at most ``limit`` seconds, skipped with fewer than ``least`` left."""

    name: str
    why: str
    argv: tuple
    limit: int
    least: int


_FLASH = ("benchmarks/gpu.py", "--out-dir", "{out}", "--sections", "flash", "--pair-reps", "0",
          "--reps", "3")

STEPS = (
    Step("gpu_tests", "the kernels changed since the last GPU: negated masks, from_fn terms "
         "and learned term arrays on Mosaic GPU, and the Mosaic GPU decode kernels, against "
         "XLA",
         ("-m", "pytest", "-v", "-p", "no:cacheprovider", "-k", "test_gpu_",
          "tests/flash/test_mosaic_gpu.py", "tests/flash/test_mosaic_gpu_bwd.py",
          "tests/test_position_bias.py", "tests/decoding/test_mosaic_gpu.py",
          "tests/paged/test_mosaic_gpu.py"), 150, 60),
    Step("documents", "segment ids per visited tile against dense (target 80 %), forward "
         "and backward, default and persistent, since the PARTIAL-step and backward changes",
         _FLASH + ("--impls", "jax.nn:cudnn,fnattn:mosaic_gpu_bwd,fnattn:mosaic_gpu_persistent",
                   "--flash-grid", "8192x128", "--modes", "fwd,bwd", "--doc-T", "8192",
                   "--doc-align", "128", "--kernel-times", "--budget", "flash=130"), 150, 90),
    # (one process per row: the baseline first, each kernel pair side by side)
    Step("terms", "ALiBi and a from_fn term on the Triton and the Mosaic GPU kernels, fixed "
         "and learned: whether to drop terms from mosaic_gpu._explicit_only and "
         "mosaic_gpu_bwd.route",
         ("benchmarks/position_bias.py", "--T", "8192", "--H", "16", "--D", "128", "--dtype",
          "bfloat16", "--jaxnn", "cudnn", "--reps", "5", "--timeout", "60", "--out",
          "{out}/position_bias_gpu", "--impls",
          "jax.nn:xla,fnattn+alibi,fnattn+alibi:mosaic_gpu,fnattn+alibi:mosaic_gpu_bwd,"
          "fnattn+alibi:learned,fnattn+alibi:mosaic_gpu_bwd:learned,fnattn+decay,"
          "fnattn+decay:mosaic_gpu,fnattn+decay:mosaic_gpu_bwd"), 180, 80),
    Step("decode", "the Mosaic GPU decode and paged decode kernels beside the Triton ones, "
         "jax.nn and a copy (% of HBM bandwidth, target 70 %), and decode with ALiBi on both",
         ("benchmarks/gpu.py", "--out-dir", "{out}", "--sections", "decode", "--reps", "3",
          "--decode-grid", "16x4096,64x8192,1x32768,4x16384", "--kernel-times", "--budget",
          "decode=50"), 60, 45),
    Step("extreme_logits", "how far the GPU kernels' out, lse and gradients stray from a "
         "float64 reference as the logits from q.k grow to 1e12: whether the compiled "
         "kernels round s * c - m alike in the forward and the backward (interpreted on a "
         "CPU: ok to 4e8 when they do, causal off from 4e6 when they do not)",
         ("benchmarks/extreme_logits.py", "--scales", "1,1e3,1e4,1e6,1e8,1e12", "--out",
          "{out}/extreme_logits_gpu"), 90, 45),
    Step("schedule", "the visiting tables of a document mask (ordered by a scatter, "
         "against the sort they replaced) at T = 32k to 1M, beside jax.nn at 8k",
         ("benchmarks/schedule.py", "--ts", "32768,131072,262144,1048576", "--reps", "5",
          "--out", "{out}/schedule_gpu"), 60, 30),
    Step("shapes", "head dims 64 and 256, T = 2k and 32k, beside cuDNN",
         _FLASH + ("--impls", "jax.nn:cudnn,fnattn,fnattn:mosaic_gpu_bwd", "--flash-grid",
                   "8192x64,8192x256,2048x128,32768x128", "--modes", "fwd,bwd",
                   "--budget", "flash=110"), 130, 70),
    Step("head_dims", "head dims padded to a multiple of 64 (96, 80, 192 with Dv = 128)",
         _FLASH + ("--impls", "jax.nn:cudnn,fnattn,fnattn:triton,fnattn:mosaic_gpu_bwd",
                   "--flash-grid", "8192x96,8192x192x128,8192x80", "--modes", "fwd,fwd+bwd",
                   "--budget", "flash=90"), 110, 60),
    Step("tuned", "fnattn.tune.autotune on the documents row",
         _FLASH + ("--impls", "fnattn,fnattn:tuned", "--flash-grid", "8192x128", "--modes",
                   "fwd", "--doc-T", "8192", "--tune-budget", "90", "--budget", "flash=120"),
         140, 100),
)


def command(step: Step, out: str) -> list:
    """The step's command line, its files going to ``out``."""
    return [sys.executable] + [a.replace("{out}", out) for a in step.argv]


def shown(step: Step) -> str:
    """The step's command as a shell line ("{out}" left as it is)."""
    return " ".join(shlex.quote(a) for a in ("python3",) + step.argv)


def install_wheels(target="/tmp/site") -> str:
    """Install the wheels under .whl/ into ``target``; what happened, in words."""
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    if not wheels:
        return "no wheels under .whl/"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                          "--no-compile", "--no-cache-dir", "--upgrade", "--target", target,
                          *wheels], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"installing the wheels failed:\n{res.stderr[-2000:]}")
    return f"{len(wheels)} wheels installed into {target}"


def run(steps, out_dir: str, budget: float, env=None, clock=time.monotonic) -> list:
    """Run ``steps`` in order within ``budget`` seconds; ``(step, status, seconds,
    tail)`` for each (status: the exit code, "cut at N s" or "skipped")."""
    env = dict(os.environ if env is None else env)
    end = clock() + budget
    results = []
    for step in steps:
        left = end - clock()
        if left < step.least:
            results.append((step, f"skipped ({left:.0f} s left, needs {step.least})", 0.0, ""))
            continue
        out = os.path.join(out_dir, step.name)
        os.makedirs(out, exist_ok=True)
        limit = min(step.limit, left)
        log = os.path.join(out_dir, f"{step.name}.log")
        start = clock()
        with open(log, "w") as fh:
            try:
                status = subprocess.run(command(step, out), cwd=ROOT, env=env, stdout=fh,
                                        stderr=subprocess.STDOUT, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                status = f"cut at {limit:.0f} s"
        seconds = clock() - start
        with open(log) as fh:
            tail = "".join(fh.readlines()[-8:])
        results.append((step, status, seconds, tail))
        print(f"{step.name}: {status} in {seconds:.0f} s", flush=True)
    return results


def report(results, out_dir: str, header: str) -> str:
    """``OUT/backlog.md``: each step's command, status, time and last lines."""
    lines = ["# The GPU backlog, one call", "", header, ""]
    for step, status, seconds, tail in results:
        lines += [f"## {step.name}: {status}, {seconds:.0f} s", "", step.why, "",
                  f"    {shown(step)}", ""]
        if tail:
            lines += ["```", tail.rstrip("\n"), "```", ""]
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "backlog.md"), "w") as fh:
        fh.write(text)
    return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    ap.add_argument("--budget", type=float, default=540, help="seconds for every step")
    ap.add_argument("--only", default="", help="comma-separated step names")
    ap.add_argument("--list", action="store_true", help="print the steps and stop")
    return ap


def main():
    ap = parser()
    args = ap.parse_args()
    names = [s.name for s in STEPS]
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - set(names))
    if unknown:
        ap.error(f"unknown steps {unknown}; choose from {names}")
    steps = [s for s in STEPS if not only or s.name in only]
    if args.list:
        for s in steps:
            print(f"{s.name} ({s.least}-{s.limit} s): {s.why}\n    {shown(s)}")
        return
    os.makedirs(args.out_dir, exist_ok=True)
    header = install_wheels()
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               FNATTN_TEST_XLA_OPT="1",
               PYTHONPATH=os.pathsep.join(p for p in ("/tmp/site", ROOT,
                                                      os.environ.get("PYTHONPATH")) if p))
    probe = subprocess.run([sys.executable, "-c", "import jax, jaxlib, beartype; "
                            "print('jax', jax.__version__, jax.devices()[0].device_kind)"],
                           env=env, capture_output=True, text=True)
    if probe.returncode:
        raise SystemExit("jax or beartype does not import (download the wheels first: "
                         f"benchmarks/README.md):\n{probe.stderr[-2000:]}")
    header += f"; {probe.stdout.strip()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    print(header, flush=True)
    print(report(run(steps, args.out_dir, args.budget, env), args.out_dir, header))


if __name__ == "__main__":
    main()
