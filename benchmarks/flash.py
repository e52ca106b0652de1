"""Benchmark fnattn.flash against jax.nn.dot_product_attention and tokamax.

Every (implementation, configuration, pass) runs in its own subprocess, so its
peak memory is its own and one crash or time-out cannot spoil the others.

    python benchmarks/flash.py                # CPU sweep: B=1, H=8, D=64, f32, T=1k..32k
    python benchmarks/flash.py --quick        # a short subset (T=1k, 4k, 8k)
    python benchmarks/flash.py --gpu          # GPU sweep: bf16, B*T=16k, H*D=2048, D=64/128/256

Peers: ``jax.nn.dot_product_attention`` (implementation "xla"; also "cudnn" on
GPU) and, when it can be imported, tokamax's ``dot_product_attention``
("xla_chunked" on CPU, "triton" on GPU); a missing peer is skipped with a note.
``--impls fnattn:dense`` adds fnattn's dense XLA lowering (``impl="xla"``,
what ``fnattn.nn.dot_product_attention(implementation="xla")`` runs), the
algorithm of jax.nn's "xla":

    python benchmarks/flash.py --impls fnattn,fnattn:dense,jax.nn:xla --ts 1024,2048,4096

Measured per configuration: the median, minimum and maximum of several calls
after a warm-up call (the spread shows the noise of a shared machine); FLOP/s
counting ``4 B H T^2 D`` for the forward (halved when causal) and 3.5 times
that for forward+backward; peak memory, on CPU as the increase of the child's
peak resident set size over its size once the inputs exist (so it includes
compilation) and XLA's own estimate from the compiled program (temporary plus
output buffers), on GPU the allocator's peak bytes in use.

Writes ``benchmarks/results/flash_<device>.{md,csv,png}``.
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
    """Runs one measurement and prints one JSON line."""
    import resource

    import jax
    import jax.numpy as jnp
    import numpy as np

    B, T, H, D = cfg["B"], cfg["T"], cfg["H"], cfg["D"]
    causal, impl, mode = cfg["causal"], cfg["impl"], cfg["mode"]
    dtype = jnp.dtype(cfg["dtype"])
    dev = jax.devices()[0]
    info = dict(device=dev.device_kind, jax=jax.__version__)

    if impl in ("fnattn", "fnattn:dense"):
        import fnattn
        from fnattn import AttentionSpec, masks
        dense = impl == "fnattn:dense"  # the dense XLA lowering (jax.nn's "xla" algorithm)
        spec = AttentionSpec(mask=masks.causal() if causal else None, return_lse=False,
                             impl="xla" if dense else "auto")
        attend = fnattn.attention if dense else fnattn.flash

        def f(q, k, v):
            return attend(spec, q, k, v).out
    elif impl.startswith("jax.nn"):
        which = impl.split(":")[1]

        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=which)
    elif impl.startswith("tokamax"):
        try:
            import tokamax
        except ImportError as e:
            print(json.dumps(dict(info, status=f"skipped: tokamax not importable ({e})")))
            return
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
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, T, H, D), dtype) for kk in ks)
    jax.block_until_ready((q, k, v))
    gpu = dev.platform == "gpu"
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    compiled = fn.lower(q, k, v).compile()
    try:
        ma = compiled.memory_analysis()
        xla_bytes = ma.temp_size_in_bytes + ma.output_size_in_bytes
    except Exception:  # noqa: BLE001 - not every backend reports it
        xla_bytes = float("nan")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v))
    first = time.perf_counter() - t0
    # Long configurations get fewer timed calls, so the sweep fits in its budget.
    reps = cfg["reps"] if first < 8 else (2 if first < 40 else 1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - t0)
    if gpu:
        peak = dev.memory_stats()["peak_bytes_in_use"]
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    t = float(np.median(times))
    # FLOPs of the pairs the mask lets through (fnattn.cost: causal counts half;
    # forward + backward is 3.5 forwards), the same count for every implementation
    from fnattn import AttentionSpec, cost, masks
    cspec = AttentionSpec(mask=masks.causal() if causal else None)
    flops = cost.estimate(cspec, q, k, v).flops
    if mode != "fwd":
        flops += cost.estimate(cspec, q, k, v, backward=True).flops
    print(json.dumps(dict(info, status="ok", time_s=t, min_s=min(times), max_s=max(times),
                          reps=reps, gflops=flops / t / 1e9, peak_mb=peak / 2**20,
                          xla_mb=xla_bytes / 2**20,
                          load=round((load0 + os.getloadavg()[0]) / 2, 1))))


def run_one(cfg, timeout):
    try:
        # The configuration travels in the environment: tokamax parses absl flags
        # from the command line when imported.
        env = dict(os.environ, FNATTN_BENCH_CHILD=json.dumps(cfg))
        p = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(status=f"timeout > {timeout} s")
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or ["?"])[-1][:120]
        if p.returncode in (-9, 137):
            err = "killed (out of memory?)"
        return dict(status=f"error: {err}")
    return json.loads(lines[-1])


def main():
    if os.environ.get("FNATTN_BENCH_CHILD"):
        return child(json.loads(os.environ["FNATTN_BENCH_CHILD"]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="the GPU sweep (bf16, TFLOP/s)")
    ap.add_argument("--quick", action="store_true", help="a short subset")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per configuration")
    ap.add_argument("--out", default=None, help="file stem under benchmarks/results/")
    ap.add_argument("--impls", default=None, help="comma-separated subset of the peers")
    ap.add_argument("--ts", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--ds", default=None, help="comma-separated head dims (GPU sweep)")
    ap.add_argument("--modes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both")
    ap.add_argument("--causal", default="0,1", help="0 (full), 1 (causal) or both")
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
        reps = args.reps or 10
    else:
        impls = ["fnattn", "jax.nn:xla", "tokamax:xla_chunked"]
        Ts = (1024, 4096, 8192) if args.quick else (1024, 2048, 4096, 8192, 16384, 32768)
        configs = [dict(B=1, T=T, H=8, D=64, dtype="float32") for T in Ts]
        # jax.nn materialises the (T, T) logits of all heads: 5 GB at T=8k forward,
        # ~19 GB at 16k; its backward needs several such arrays. tokamax's
        # xla_chunked takes minutes per call beyond these lengths on a 2-core CPU.
        limits = {("jax.nn:xla", "fwd"): 8192, ("jax.nn:xla", "fwd+bwd"): 4096,
                  ("fnattn:dense", "fwd"): 8192, ("fnattn:dense", "fwd+bwd"): 4096,
                  ("tokamax:xla_chunked", "fwd"): 16384,
                  ("tokamax:xla_chunked", "fwd+bwd"): 8192}
        reps = args.reps or 5
    if args.impls:
        known = impls + ["fnattn:dense"]
        unknown = [i for i in args.impls.split(",") if i not in known]
        if unknown:
            ap.error(f"--impls: unknown {unknown}; known here: {known}")
        impls = [i for i in known if i in args.impls.split(",")]
    if args.ts:
        configs = [c for c in configs if c["T"] in {int(x) for x in args.ts.split(",")}]
    modes = [m for m in ("fwd", "fwd+bwd") if m in args.modes.split(",")]
    causals = [c == "1" for c in args.causal.split(",")]
    rows = []
    started = time.time()
    for base in configs:
        for causal in causals:
            for mode in modes:
                for impl in impls:
                    cfg = dict(base, causal=causal, mode=mode, impl=impl, reps=reps)
                    limit = limits.get((impl, mode), 1 << 30)
                    if base["T"] > limit:
                        res = dict(status=f"skipped (T > {limit}: memory/time)")
                    else:
                        res = run_one(cfg, args.timeout)
                    row = dict(cfg, **res)
                    rows.append(row)
                    print(_fmt(row, args.gpu), flush=True)
    write(rows, args, time.time() - started)


def _unit(gpu):
    return ("TFLOP/s", 1e-3) if gpu else ("GFLOP/s", 1.0)


def _fmt(r, gpu):
    s = (f"{r['impl']:22s} T={r['T']:6d} D={r['D']:3d} causal={int(r['causal'])} "
         f"{r['mode']:8s} ")
    if r["status"] != "ok":
        return s + r["status"]
    name, mul = _unit(gpu)
    return s + (f"{r['time_s'] * 1e3:10.1f} ms (min {r['min_s'] * 1e3:.1f}, max "
                f"{r['max_s'] * 1e3:.1f}, n={r['reps']}) {r['gflops'] * mul:8.1f} {name} "
                f"peak {r['peak_mb']:8.0f} MB  xla {r['xla_mb']:8.0f} MB  load {r['load']}")


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write(rows, args, seconds):
    ok = [r for r in rows if r["status"] == "ok"]
    device = ok[0]["device"] if ok else "unknown"
    jaxv = ok[0]["jax"] if ok else "?"
    stem = args.out or ("flash_gpu_" + device.replace(" ", "_") if args.gpu else "flash_cpu")
    os.makedirs(RESULTS, exist_ok=True)
    unit, mul = _unit(args.gpu)
    cmd = "python benchmarks/flash.py " + " ".join(sys.argv[1:])
    loads = [r["load"] for r in ok]
    header = (
        f"# fnattn.flash benchmark\n\n"
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n"
        f"- machine: {device}; {_cpu_name()}, {os.cpu_count()} CPUs visible, "
        f"{platform.system()} {platform.machine()}\n"
        f"- jax {jaxv}, Python {platform.python_version()}\n"
        f"- command: `{cmd.strip()}` ({seconds / 60:.0f} min)\n"
        f"- time: median of several calls after a warm-up call (min and max beside it: "
        f"the machine is shared, so the spread is the noise); {unit} counts "
        f"`fnattn.cost.estimate`'s FLOPs: 4·B·H·T²·D for the forward, halved when causal, "
        f"×3.5 for forward+backward\n"
        f"- peak MB: CPU: increase of the configuration's own process peak RSS over its "
        f"size once the inputs exist (includes compilation); GPU: allocator peak bytes "
        f"in use. XLA MB: the compiled program's temporary + output buffers\n"
        + (f"- 1-minute load average during the runs: {min(loads)}–{max(loads)} "
           f"(2 = both cores busy)\n" if loads and not args.gpu else "")
        + "- speed-up: that peer's median time / fnattn's median time in the same "
          "configuration (> 1: fnattn is faster)\n\n")
    fields = ["impl", "B", "T", "H", "D", "dtype", "causal", "mode", "status", "time_s", "min_s",
              "max_s", "reps", "gflops", "peak_mb", "xla_mb", "load"]
    with open(os.path.join(RESULTS, stem + ".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = [f"| T | D | causal | pass | impl | median ms | min–max ms | {unit} | peak MB "
             "| XLA MB | fnattn speed-up |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['T']} | {r['D']} | {int(r['causal'])} | {r['mode']} | {r['impl']} "
        if r["status"] != "ok":
            lines.append(head + f"| {r['status']} | | | | | |")
            continue
        ref = next((x for x in ok if x["impl"] == "fnattn" and all(
            x[c] == r[c] for c in ("T", "D", "causal", "mode"))), None)
        speed = f"{r['time_s'] / ref['time_s']:.2f}×" if ref and r["impl"] != "fnattn" else ""
        lines.append(head + f"| {r['time_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.0f}–"
                     f"{r['max_s'] * 1e3:.0f} | {r['gflops'] * mul:.1f} | {r['peak_mb']:.0f} | "
                     f"{r['xla_mb']:.0f} | {speed} |")
    with open(os.path.join(RESULTS, stem + ".md"), "w") as fh:
        fh.write(header + "\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: table and CSV written, no plot")
        return
    ds = sorted({r["D"] for r in ok}) or [0]
    fig, axes = plt.subplots(len(ds), 2, figsize=(11, 4 * len(ds)), squeeze=False)
    for row_axes, D in zip(axes, ds):
        for ax, causal in zip(row_axes, (False, True)):
            for impl in sorted({r["impl"] for r in rows}):
                for mode, style in (("fwd", "-o"), ("fwd+bwd", "--s")):
                    pts = sorted((r["T"], r["gflops"] * mul) for r in ok if r["impl"] == impl
                                 and r["causal"] == causal and r["mode"] == mode and r["D"] == D)
                    if pts:
                        ax.plot(*zip(*pts), style, label=f"{impl} {mode}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(unit)
            ax.set_title(f"{'causal' if causal else 'full'} attention, D={D}, {device}",
                         fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, stem + ".png"), dpi=110)


if __name__ == "__main__":
    main()
