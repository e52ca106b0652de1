"""What ALiBi costs: fnattn's in-kernel term against the same logits as a bias array.

Causal attention with ALiBi (``-slope[h] * |q - k|``), B=1, H=8, D=64, float32 by
default (``--dtype bfloat16 --jaxnn cudnn`` on a GPU):

* ``jax.nn:xla``: ``jax.nn.dot_product_attention(is_causal=True)`` without ALiBi,
  the baseline of every ratio;
* ``jax.nn:xla+bias``: the same with ALiBi as a ``(1, H, T, T)`` bias array,
  what a ``jax.nn`` user writes;
* ``fnattn``: ``fnattn.flash`` causal, without ALiBi;
* ``fnattn+alibi``: with ``AttentionSpec(position_bias=position_bias.alibi(...))``;
* ``fnattn+bias``: with ALiBi as a bias array;
* ``fnattn+alibi:learned`` and ``jax.nn:xla+bias:learned`` (forward and backward
  only): the same with the slopes differentiated too (learnable ALiBi; for
  ``jax.nn`` through the bias array it builds from them);
* ``fnattn+alibi:mosaic_gpu``: ``fnattn+alibi`` with ``MosaicGpuBlockSizes`` in
  the spec, which asks a Hopper GPU for the Mosaic GPU forward (ALiBi runs
  there only when asked until timed; elsewhere the row is ``fnattn+alibi``);
* ``fnattn+alibi:mosaic_gpu_bwd``: the same with ``MosaicGpuBwdBlockSizes`` too,
  which asks for the Mosaic GPU backward as well (the slopes held fixed), and
  ``fnattn+alibi:mosaic_gpu_bwd:learned`` (forward and backward only) with the
  slopes learned, their gradient summed by that backward;
* ``fnattn+decay``, ``fnattn+decay:mosaic_gpu``, ``fnattn+decay:mosaic_gpu_bwd``:
  a ``position_bias.from_fn`` term instead, ``-slope[h] * log(1 + |q - k|)``
  (a logarithmic decay, in operations every kernel compiles), on the default
  kernels and asking for the Mosaic GPU forward and backward.

The bias arrays are built from the slopes inside the jitted function (an ALiBi
model builds them per call or keeps them; either way they exist in memory).
Every measurement runs in its own subprocess, so its peak memory (the rise of
the child's peak resident set over its size once the inputs exist) is its own;
``xla_mb`` is XLA's estimate of the compiled program's temporary and output
buffers. Times are medians of ``--reps`` calls after a warm-up.

    python benchmarks/position_bias.py            # T = 1k, 2k, 4k; fwd and fwd+bwd
    python benchmarks/position_bias.py --T 2048 --modes fwd
    python benchmarks/position_bias.py --T 8192 --H 16 --D 128 --dtype bfloat16 \
        --jaxnn cudnn                                # a GPU: the Triton kernels, cuDNN

On a GPU the peak memory is the allocator's peak bytes in use.

Writes ``benchmarks/results/position_bias_<device>.{md,csv}``.
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
IMPLS = ("jax.nn:xla", "jax.nn:xla+bias", "fnattn", "fnattn+alibi", "fnattn+bias",
         "fnattn+alibi:learned", "jax.nn:xla+bias:learned", "fnattn+alibi:mosaic_gpu",
         "fnattn+alibi:mosaic_gpu_bwd", "fnattn+alibi:mosaic_gpu_bwd:learned", "fnattn+decay",
         "fnattn+decay:mosaic_gpu", "fnattn+decay:mosaic_gpu_bwd")


def _decay(b, h, q, k, slope):
    """The ``fnattn+decay`` rows' term: a logarithmic decay with the distance."""
    import jax.numpy as jnp
    return -slope * jnp.log(1.0 + jnp.abs(q - k).astype(jnp.float32))


def child(cfg):
    """Runs one measurement and prints one JSON line."""
    import resource

    import jax
    import jax.numpy as jnp
    import numpy as np

    import fnattn
    from fnattn import AttentionSpec, cost, masks, position_bias

    B, T, H, D, impl, mode = cfg["B"], cfg["T"], cfg["H"], cfg["D"], cfg["impl"], cfg["mode"]
    learned = impl.endswith(":learned")
    impl = impl.removesuffix(":learned")
    mosaic_gpu = impl.endswith((":mosaic_gpu", ":mosaic_gpu_bwd"))
    blocks = None
    if mosaic_gpu:
        blocks = fnattn.MosaicGpuBlockSizes()
        if impl.endswith("_bwd"):
            blocks = (blocks, fnattn.MosaicGpuBwdBlockSizes())
    impl = impl.removesuffix(":mosaic_gpu_bwd").removesuffix(":mosaic_gpu")

    def alibi_bias(slopes):
        dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
        return (-slopes[:, None, None] * dist)[None]  # (1, H, T, T)

    if impl.startswith("jax.nn"):
        def f(q, k, v, slopes):
            bias = alibi_bias(slopes) if impl.endswith("+bias") else None
            return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True,
                                                implementation=cfg["jaxnn"])
    else:
        def f(q, k, v, slopes):
            spec = AttentionSpec(mask=masks.causal(), return_lse=False, block_sizes=blocks)
            if impl == "fnattn+alibi":
                spec = spec.replace(position_bias=position_bias.alibi(slopes))
            elif impl == "fnattn+decay":
                spec = spec.replace(position_bias=position_bias.from_fn(_decay, slopes))
            elif impl == "fnattn+bias":
                spec = spec.replace(bias=alibi_bias(slopes))
            return fnattn.flash(spec, q, k, v).out

    if mode == "fwd":
        fn = jax.jit(f)
    else:
        argnums = (0, 1, 2, 3) if learned else (0, 1, 2)
        fn = jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=argnums))
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.dtype(cfg["dtype"])) for kk in ks)
    slopes = jnp.asarray(position_bias.alibi_slopes(H))
    jax.block_until_ready((q, k, v))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    compiled = fn.lower(q, k, v, slopes).compile()
    try:
        ma = compiled.memory_analysis()
        xla_bytes = ma.temp_size_in_bytes + ma.output_size_in_bytes
    except Exception:  # noqa: BLE001 - not every backend reports it
        xla_bytes = float("nan")
    jax.block_until_ready(compiled(q, k, v, slopes))
    times = []
    for _ in range(cfg["reps"]):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, slopes))
        times.append(time.perf_counter() - t0)
    if jax.devices()[0].platform == "gpu":
        peak = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    t = float(np.median(times))
    cspec = AttentionSpec(mask=masks.causal())
    flops = cost.estimate(cspec, q, k, v).flops
    if mode != "fwd":
        flops += cost.estimate(cspec, q, k, v, backward=True).flops
    print(json.dumps(dict(status="ok", device=jax.devices()[0].device_kind, jax=jax.__version__,
                          time_s=t, min_s=min(times), max_s=max(times), gflops=flops / t / 1e9,
                          peak_mb=peak / 2**20, xla_mb=xla_bytes / 2**20)))


def run_one(cfg, timeout):
    env = dict(os.environ, FNATTN_BENCH_CHILD=json.dumps(cfg))
    try:
        p = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(status=f"timeout > {timeout} s")
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or ["?"])[-1][:120]
        return dict(status=f"error: {err}")
    return json.loads(lines[-1])


def parser() -> argparse.ArgumentParser:
    """The command line of this script."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="1024,2048,4096")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--jaxnn", default="xla", choices=("xla", "cudnn"),
                    help="jax.nn.dot_product_attention's implementation")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", default=None, help="file stem (default: position_bias_<device>)")
    return ap


def main():
    ap = parser()
    args = ap.parse_args()
    impls = args.impls.split(",")
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        ap.error(f"unknown --impls {unknown}; choose from {IMPLS}")
    start = time.time()
    rows = []
    for T in (int(t) for t in args.T.split(",")):
        for mode in args.modes.split(","):
            group = []
            for impl in impls:
                if mode == "fwd" and impl.endswith(":learned"):
                    continue  # the forward of a learned term is the forward
                cfg = dict(B=args.B, T=T, H=args.H, D=args.D, impl=impl, mode=mode,
                           reps=args.reps, dtype=args.dtype, jaxnn=args.jaxnn)
                res = dict(cfg, **run_one(cfg, args.timeout))
                group.append(res)
                print(_line(res), flush=True)
            base = next((r for r in group if r["impl"] == "jax.nn:xla"
                         and r["status"] == "ok"), None)
            for r in group:
                r["vs_jax_nn"] = (base["time_s"] / r["time_s"]
                                  if base and r["status"] == "ok" else float("nan"))
            rows.extend(group)
    write(rows, args, time.time() - start)


def _label(r):
    """The row's name, with jax.nn's implementation as run."""
    return r["impl"].replace("jax.nn:xla", f"jax.nn:{r.get('jaxnn', 'xla')}")


def _line(r):
    if r["status"] != "ok":
        return f"T={r['T']:>6} {r['mode']:8} {_label(r):16} {r['status']}"
    return (f"T={r['T']:>6} {r['mode']:8} {_label(r):16} {r['time_s'] * 1e3:9.1f} ms "
            f"{r['gflops']:7.1f} GFLOP/s peak {r['peak_mb']:8.0f} MiB xla {r['xla_mb']:8.0f} MiB")


def write(rows, args, seconds):
    ok = [r for r in rows if r["status"] == "ok"]
    device = ok[0]["device"] if ok else "unknown"
    stem = args.out or "position_bias_" + device.lower().replace(" ", "_")
    os.makedirs(RESULTS, exist_ok=True)
    fields = ["T", "mode", "impl", "status", "time_s", "min_s", "max_s", "gflops", "vs_jax_nn",
              "peak_mb", "xla_mb", "B", "H", "D", "reps"]
    with open(os.path.join(RESULTS, stem + ".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    jax_version = ok[0]["jax"] if ok else "?"
    lines = [
        f"# ALiBi in the kernel against a bias array ({device})",
        "",
        f"`python benchmarks/position_bias.py {' '.join(sys.argv[1:])}`".replace(" `", "`")
        + " on "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores), jax "
        f"{jax_version}, {datetime.date.today().isoformat()}, {seconds / 60:.1f} min. "
        f"Causal, B={args.B}, H={args.H}, D={args.D}, {args.dtype}; median of {args.reps} "
        f"calls. `vs jax.nn` is the time of `jax.nn.dot_product_attention` ({args.jaxnn}, "
        "causal, no ALiBi) "
        "over the row's, in the same run. Peak memory: the rise of the process's peak "
        "resident set (compilation included); XLA: temporary and output buffers.",
        "",
        "| T | pass | implementation | ms | GFLOP/s | vs jax.nn | peak MiB | XLA MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['T']} | {r['mode']} | {_label(r)} | {r['status']} | | | | |")
            continue
        lines.append(f"| {r['T']} | {r['mode']} | {_label(r)} | {r['time_s'] * 1e3:.1f} | "
                     f"{r['gflops']:.1f} | {r['vs_jax_nn']:.2f}x | {r['peak_mb']:.0f} | "
                     f"{r['xla_mb']:.0f} |")
    with open(os.path.join(RESULTS, stem + ".md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {os.path.join(RESULTS, stem)}.{{md,csv}}")


if __name__ == "__main__":
    if "FNATTN_BENCH_CHILD" in os.environ:
        child(json.loads(os.environ["FNATTN_BENCH_CHILD"]))
    else:
        main()
