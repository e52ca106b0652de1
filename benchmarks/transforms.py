"""The cost of each differentiation mode through fnattn, next to jax.nn.

For ``fnattn.attention`` (impl "auto") and ``jax.nn.dot_product_attention``
(implementation "xla") on this machine's default device, at each T: the time
of the forward, of forward + backward (``jax.grad`` of ``out.sum()`` for q, k
and v), of forward mode (``jax.jvp`` with tangents for q, k and v) and of a
Hessian-vector product (``jax.jvp`` of ``jax.grad``), each as the median of
several calls after a warm-up, and XLA's temporary-buffer estimate for each
compiled program (``memory_analysis().temp_size_in_bytes``, the memory the
program needs beyond its inputs and outputs).

    python benchmarks/transforms.py                 # T = 1k, 4k (CPU)
    python benchmarks/transforms.py --ts 1024 --reps 5
    python benchmarks/transforms.py --out transforms_cpu_before   # another name

Every (implementation, T, mode) runs in its own subprocess. Writes
``benchmarks/results/<out>.{md,csv}`` (default ``transforms_<device>``).
The same script runs on an older checkout too (a mode it cannot
differentiate is recorded as failed), which is how "reverse mode unchanged"
is measured: the grad rows of two checkouts, each next to jax.nn in its own run.
"""

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import time

from flash import _cpu_name  # the sibling benchmark (this directory is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
MODES = ("fwd", "grad", "jvp", "hvp")


def child(cfg):
    import jax
    import jax.numpy as jnp
    import numpy as np

    B, T, H, D = cfg["B"], cfg["T"], cfg["H"], cfg["D"]
    causal, impl, mode = cfg["causal"], cfg["impl"], cfg["mode"]
    if impl == "fnattn":
        import fnattn
        from fnattn import AttentionSpec, masks
        spec = AttentionSpec(mask=masks.causal() if causal else None, return_lse=False)
        f = lambda q, k, v: fnattn.attention(spec, q, k, v).out  # noqa: E731
    else:
        f = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=bool(causal), implementation="xla")
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.float32) for kk in ks)
    loss = lambda q, k, v: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
    if mode == "fwd":
        g = f
    elif mode == "grad":
        g = jax.grad(loss, argnums=(0, 1, 2))
    elif mode == "jvp":
        g = lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v))  # noqa: E731
    else:
        g = lambda q, k, v: jax.jvp(  # noqa: E731
            lambda q: jax.grad(loss)(q, k, v), (q,), (v.reshape(q.shape),))
    out = {}
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(g).lower(q, k, v).compile()
        out["compile_s"] = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        out["temp_mib"] = None if mem is None else mem.temp_size_in_bytes / 2**20
        jax.block_until_ready(compiled(q, k, v))
        times = []
        for _ in range(cfg["reps"]):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            times.append(time.perf_counter() - t0)
        out["ms"] = 1e3 * float(np.median(times))
        out["ok"] = True
    except Exception as e:  # a checkout that cannot run this mode
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    out["jax"] = jax.__version__
    out["device"] = jax.devices()[0].device_kind
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ts", default="1024,4096")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--causal", default="1")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    rows = []
    for T in [int(t) for t in args.ts.split(",")]:
        for causal in [int(c) for c in args.causal.split(",")]:
            for mode in args.modes.split(","):
                for impl in ("fnattn", "jax.nn"):
                    cfg = dict(B=1, T=T, H=8, D=64, causal=causal, impl=impl, mode=mode,
                               reps=args.reps)
                    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", ""))
                    env["PYTHONPATH"] = os.pathsep.join(
                        filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))
                    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                                          capture_output=True, text=True, env=env, timeout=1800)
                    try:
                        res = json.loads(proc.stdout.strip().splitlines()[-1])
                    except (IndexError, json.JSONDecodeError):
                        res = dict(ok=False, error=(proc.stderr.strip().splitlines() or ["?"])[-1])
                    row = dict(cfg, **res)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    device = next((r["device"] for r in rows if "device" in r), "cpu")
    stem = args.out or f"transforms_{device.replace(' ', '_')}"
    os.makedirs(RESULTS, exist_ok=True)
    keys = ["T", "causal", "mode", "impl", "ok", "ms", "compile_s", "temp_mib", "error"]
    with open(os.path.join(RESULTS, stem + ".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = ["# Differentiation modes: fnattn.attention (auto) vs jax.nn (xla)", "",
             f"{datetime.date.today()} · {_cpu_name() if device == 'cpu' else device} · "
             f"jax {rows[0].get('jax', '?')} · B=1, H=8, D=64, float32 · "
             f"`python benchmarks/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}` · "
             f"load average {os.getloadavg()[0]:.1f}", "",
             "| T | causal | mode | fnattn ms | jax.nn ms | fnattn / jax.nn | fnattn temp MiB "
             "| jax.nn temp MiB |", "|---|---|---|---|---|---|---|---|"]
    for T in sorted({r["T"] for r in rows}):
        for causal in sorted({r["causal"] for r in rows}):
            for mode in args.modes.split(","):
                a = next(r for r in rows if (r["T"], r["causal"], r["mode"], r["impl"]) ==
                         (T, causal, mode, "fnattn"))
                b = next(r for r in rows if (r["T"], r["causal"], r["mode"], r["impl"]) ==
                         (T, causal, mode, "jax.nn"))
                fmt = lambda r, key, f: f.format(r[key]) if r.get("ok") and r.get(key) is not None else ("failed" if not r.get("ok") else "–")  # noqa
                ratio = (f"{a['ms'] / b['ms']:.2f}" if a.get("ok") and b.get("ok") else "–")
                lines.append(f"| {T} | {causal} | {mode} | {fmt(a, 'ms', '{:.1f}')} | "
                             f"{fmt(b, 'ms', '{:.1f}')} | {ratio} | {fmt(a, 'temp_mib', '{:.1f}')} | "
                             f"{fmt(b, 'temp_mib', '{:.1f}')} |")
    failed = [r for r in rows if not r.get("ok")]
    if failed:
        lines += ["", "Failed:"] + [f"- {r['impl']} T={r['T']} {r['mode']}: {r.get('error')}"
                                    for r in failed]
    with open(os.path.join(RESULTS, stem + ".md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
