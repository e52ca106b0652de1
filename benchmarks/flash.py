"""Benchmark fnattn.flash against jax.nn.dot_product_attention and tokamax.

Every (implementation, configuration, pass) runs in its own subprocess, so peak
memory is that configuration's alone. Peak memory is the child's peak resident
set size minus its resident size just before the timed function was first
called (CPU), or the device allocator's peak bytes in use (GPU).

    python benchmarks/flash.py                # CPU sweep: B=1, H=8, D=64, f32
    python benchmarks/flash.py --quick        # a short subset
    python benchmarks/flash.py --gpu          # GPU sweep: bf16, B*T=16k, H*D=2048

Writes benchmarks/results/flash_<device>.{md,csv,png}.
"""

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def child(cfg):
    """Runs one measurement and prints a JSON line."""
    import resource

    import jax
    import jax.numpy as jnp
    import numpy as np

    B, T, H, D = cfg["B"], cfg["T"], cfg["H"], cfg["D"]
    causal, impl, mode = cfg["causal"], cfg["impl"], cfg["mode"]
    dtype = jnp.dtype(cfg["dtype"])
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, T, H, D), dtype) for kk in ks)

    if impl == "fnattn":
        import fnattn
        from fnattn import AttentionSpec, masks
        spec = AttentionSpec(mask=masks.causal() if causal else None, return_lse=False)

        def f(q, k, v):
            return fnattn.flash(spec, q, k, v).out
    elif impl.startswith("jax.nn"):
        which = impl.split(":")[1]

        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=which)
    elif impl.startswith("tokamax"):
        import tokamax
        which = impl.split(":")[1]

        def f(q, k, v):
            return tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation=which)
    else:
        raise ValueError(impl)

    if mode == "fwd":
        fn = jax.jit(f)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(),
                              argnums=(0, 1, 2)))
    gpu = jax.devices()[0].platform == "gpu"
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    jax.block_until_ready(fn(q, k, v))
    times = []
    for _ in range(cfg["reps"]):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times.append(time.perf_counter() - t0)
    if gpu:
        peak = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    t = float(np.median(times))
    flops = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0) * (1.0 if mode == "fwd" else 3.5)
    print(json.dumps(dict(time_s=t, gflops=flops / t / 1e9, peak_mb=peak / 2**20,
                          device=jax.devices()[0].device_kind, jax=jax.__version__)))


def run_one(cfg, timeout):
    try:
        # The configuration travels in the environment: tokamax parses absl flags
        # from the command line when imported.
        env = dict(os.environ, FNATTN_BENCH_CHILD=json.dumps(cfg))
        p = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(status=f"timeout>{timeout}s")
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or ["?"])[-1][:120]
        return dict(status=f"error: {err}")
    return dict(status="ok", **json.loads(lines[-1]))


def main():
    if os.environ.get("FNATTN_BENCH_CHILD"):
        return child(json.loads(os.environ["FNATTN_BENCH_CHILD"]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", default=None)
    ap.add_argument("--impls", default=None, help="comma-separated subset of the peers")
    ap.add_argument("--ts", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--ds", default=None, help="comma-separated head dims (GPU sweep)")
    args = ap.parse_args()

    if args.gpu:
        impls = ["fnattn", "jax.nn:cudnn", "jax.nn:xla", "tokamax:triton"]
        configs = [dict(B=16384 // T, T=T, H=2048 // D, D=D, dtype="bfloat16")
                   for D in (64, 128, 256) for T in (1024, 2048, 4096, 8192, 16384)]
        if args.quick:
            configs = [c for c in configs if c["D"] == 128 and c["T"] in (8192,)]
        if args.ds:
            configs = [c for c in configs if c["D"] in {int(x) for x in args.ds.split(",")}]
        limits = {}
        reps = 10
    else:
        impls = ["fnattn", "jax.nn:xla", "tokamax:xla_chunked"]
        Ts = (1024, 4096, 8192) if args.quick else (1024, 2048, 4096, 8192, 16384, 32768)
        configs = [dict(B=1, T=T, H=8, D=64, dtype="float32") for T in Ts]
        # jax.nn needs ~19 GB at 16k and 69 GB at 32k; tokamax xla_chunked takes
        # minutes per call beyond 16k on this CPU.
        limits = {"jax.nn:xla": 8192, "tokamax:xla_chunked": 16384}
        reps = 3
    if args.impls:
        impls = [i for i in impls if i in args.impls.split(",")]
    if args.ts:
        configs = [c for c in configs if c["T"] in {int(x) for x in args.ts.split(",")}]
    rows = []
    for base in configs:
        for causal in (False, True):
            for mode in ("fwd", "fwd+bwd"):
                for impl in impls:
                    cfg = dict(base, causal=causal, mode=mode, impl=impl, reps=reps)
                    if base["T"] > limits.get(impl, 1 << 30) or (
                            mode == "fwd+bwd" and impl != "fnattn" and not args.gpu
                            and base["T"] > 4096):
                        res = dict(status="skipped (memory/time)")
                    else:
                        res = run_one(cfg, args.timeout)
                    row = dict(cfg, **res)
                    rows.append(row)
                    print(_fmt(row), flush=True)
    write(rows, args)


def _fmt(r):
    s = (f"{r['impl']:22s} T={r['T']:6d} D={r['D']:3d} causal={int(r['causal'])} "
         f"{r['mode']:8s} ")
    if r["status"] != "ok":
        return s + r["status"]
    return s + f"{r['time_s'] * 1e3:10.2f} ms {r['gflops']:9.1f} GFLOP/s {r['peak_mb']:9.1f} MB"


def write(rows, args):
    ok = [r for r in rows if r["status"] == "ok"]
    device = ok[0]["device"] if ok else "unknown"
    jaxv = ok[0]["jax"] if ok else "?"
    stem = args.out or ("flash_gpu_" + device.replace(" ", "_") if args.gpu else "flash_cpu")
    os.makedirs(RESULTS, exist_ok=True)
    cmd = "python benchmarks/flash.py " + " ".join(a for a in sys.argv[1:])
    header = (f"# fnattn.flash benchmark\n\n- date: {datetime.date.today()}\n"
              f"- device: {device} ({platform.machine()}, {os.cpu_count()} CPUs visible)\n"
              f"- jax: {jaxv}, python {platform.python_version()}\n- command: `{cmd}`\n"
              "- time: median of several calls after compilation; GFLOP/s counts "
              "4·B·H·T²·D (halved when causal; ×3.5 for forward+backward)\n"
              "- peak memory: CPU: peak RSS increase of the process running that one "
              "configuration; GPU: allocator peak bytes in use\n\n")
    with open(os.path.join(RESULTS, stem + ".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["impl", "B", "T", "H", "D", "dtype", "causal", "mode",
                                           "status", "time_s", "gflops", "peak_mb"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = ["| T | D | causal | pass | impl | time (ms) | GFLOP/s | peak MB | speed-up of fnattn |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = next((x for x in rows if x["impl"] == "fnattn" and x["status"] == "ok" and all(
            x[c] == r[c] for c in ("T", "D", "causal", "mode"))), None)
        if r["status"] != "ok":
            lines.append(f"| {r['T']} | {r['D']} | {int(r['causal'])} | {r['mode']} | {r['impl']} "
                         f"| {r['status']} | | | |")
            continue
        speed = f"{r['time_s'] / ref['time_s']:.2f}×" if ref and r["impl"] != "fnattn" else ""
        lines.append(f"| {r['T']} | {r['D']} | {int(r['causal'])} | {r['mode']} | {r['impl']} | "
                     f"{r['time_s'] * 1e3:.1f} | {r['gflops']:.1f} | {r['peak_mb']:.0f} | {speed} |")
    with open(os.path.join(RESULTS, stem + ".md"), "w") as fh:
        fh.write(header + "\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, causal in zip(axes, (False, True)):
        for impl in sorted({r["impl"] for r in rows}):
            for mode, style in (("fwd", "-o"), ("fwd+bwd", "--s")):
                pts = [(r["T"], r["gflops"]) for r in ok if r["impl"] == impl
                       and r["causal"] == causal and r["mode"] == mode and r["D"] == ok[0]["D"]]
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{impl} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"{'causal' if causal else 'full'} attention, {device}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, stem + ".png"), dpi=110)


if __name__ == "__main__":
    main()
