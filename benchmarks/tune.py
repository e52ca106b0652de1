"""What ``fnattn.tune.autotune`` gains on this machine, next to jax.nn.

For each T, mask (causal; packed documents, causal within each) and direction
(forward; forward + backward, ``jax.grad`` of ``sum(out * w)`` for q, k and v):

1. ``fnattn.tune.autotune(fnattn.flash, spec, q, k, v)`` for that direction,
   and how long it took;
2. three programs timed in the same process, their calls interleaved (one
   call of each in turn, ``--reps`` rounds after a warm-up, each round starting
   with the next program), so that a machine whose speed drifts slows all
   three alike: fnattn with the default
   block sizes, fnattn with the tuned ones, and ``jax.nn.dot_product_attention``
   (implementation "xla", given the same mask as a boolean array);
3. XLA's memory estimate of each compiled program (temporary + output
   buffers).

    python benchmarks/tune.py                     # CPU: B=1, H=8, D=64, f32, T = 2k, 4k
    python benchmarks/tune.py --ts 1024 --reps 3  # quicker

Writes ``benchmarks/results/<out>.{md,csv}`` (default ``tune_<device>``).
"""

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import fnattn  # noqa: E402
from fnattn import AttentionSpec, masks, tune  # noqa: E402
from gpu import document_ids  # noqa: E402  (the sibling benchmark's packed documents)


def programs(label, q, k, v, w, backward, reps):
    """(tuned, {name: jitted f(q, k, v)}, {name: dense mask or None})."""
    T = q.shape[1]
    if label == "causal":
        mask, allowed = masks.causal(), None
    else:
        seg = jnp.asarray(document_ids(T)[None])
        mask = masks.causal() & masks.segments(seg)
        allowed = ((seg[:, :, None] == seg[:, None, :])
                   & jnp.tril(jnp.ones((T, T), bool)))[:, None]
    spec = AttentionSpec(mask=mask, return_lse=False)
    start = time.perf_counter()
    tuned = tune.autotune(fnattn.flash, spec, q, k, v, backward=backward, reps=reps)
    tune_s = time.perf_counter() - start

    def jaxnn(q, k, v):
        if allowed is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jax.nn.dot_product_attention(q, k, v, mask=allowed, implementation="xla")

    fns = {"fnattn default": lambda q, k, v: fnattn.flash(spec, q, k, v).out,
           "fnattn tuned": lambda q, k, v: fnattn.flash(tuned.spec, q, k, v).out,
           "jax.nn xla": jaxnn}
    if backward:
        def grad_of(f):
            return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2))
        fns = {n: grad_of(f) for n, f in fns.items()}
    return tuned, tune_s, {n: jax.jit(f) for n, f in fns.items()}


def interleaved(compiled, args, reps):
    """Median seconds per program, the programs' calls taken in turn."""
    times = {n: [] for n in compiled}
    for c in compiled.values():
        jax.block_until_ready(c(*args))
    names = list(compiled)
    for r in range(reps):
        # each round starts with the next program: none always runs right after
        # jax.nn's (T, T) buffers went through the caches
        for n in names[r % len(names):] + names[:r % len(names)]:
            c = compiled[n]
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def memory_mb(compiled):
    m = compiled.memory_analysis()
    return (m.temp_size_in_bytes + m.output_size_in_bytes) / 2**20 if m is not None else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ts", default="2048,4096")
    ap.add_argument("--masks", default="causal,documents")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds timed per row")
    ap.add_argument("--tune-reps", type=int, default=3, help="timed calls per candidate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    started = time.time()
    dev = jax.devices()[0]
    rows = []
    for T in (int(t) for t in args.ts.split(",")):
        ks = jax.random.split(jax.random.key(T), 4)
        q, k, v, w = (jax.random.normal(kk, (args.B, T, args.H, args.D), jnp.float32)
                      for kk in ks)
        for label in args.masks.split(","):
            for mode in args.modes.split(","):
                tuned, tune_s, fns = programs(label, q, k, v, w, mode != "fwd", args.tune_reps)
                compiled = {n: f.lower(q, k, v).compile() for n, f in fns.items()}
                secs = interleaved(compiled, (q, k, v), args.reps)
                outs = {n: c(q, k, v) for n, c in compiled.items()}
                ref = outs["jax.nn xla"]
                for n, c in compiled.items():
                    diff = max(float(jnp.max(jnp.abs(a - b)))
                               for a, b in zip(jax.tree_util.tree_leaves(outs[n]),
                                               jax.tree_util.tree_leaves(ref)))
                    row = dict(T=T, mask=label, mode=mode, impl=n, ms=secs[n] * 1e3,
                               over_jaxnn=secs["jax.nn xla"] / secs[n],
                               over_default=secs["fnattn default"] / secs[n],
                               xla_mb=memory_mb(c), diff_vs_jaxnn=diff)
                    if n == "fnattn tuned":
                        row.update(tuned=" ".join(map(repr, tuned.block_sizes)) or "(as given)",
                                   tune_s=tune_s, trials=len(tuned.trials))
                    rows.append(row)
                    print(f"T={T:6d} {label:9s} {mode:8s} {n:15s} {row['ms']:9.2f} ms  "
                          f"{row['over_jaxnn']:5.2f}x jax.nn  {row['over_default']:5.2f}x "
                          f"default  {row['xla_mb'] or 0:7.0f} MB  |diff| {diff:.1e}"
                          + (f"  tuned in {tune_s:.0f} s: {row['tuned']}" if "tuned" in row
                             else ""), flush=True)
                del compiled, outs, fns

    kind = "cpu" if dev.platform == "cpu" else dev.device_kind.replace(" ", "_")
    stem = os.path.join(HERE, "results", args.out or f"tune_{kind}")
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(stem + ".csv", "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=fields)
        wr.writeheader()
        wr.writerows(rows)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# fnattn.tune.autotune against the default block sizes and jax.nn", "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- device: {dev.device_kind} ({dev.platform}); {os.cpu_count()} CPUs, "
        f"{platform.machine()}; 1-minute load average at the end {load:.1f}",
        f"- jax {jax.__version__}, Python {platform.python_version()}",
        f"- command: `python benchmarks/tune.py {' '.join(sys.argv[1:])}` "
        f"({(time.time() - started) / 60:.1f} min)",
        f"- B={args.B}, H={args.H}, D={args.D}, float32; ms: median of {args.reps} "
        "interleaved rounds; ×: the other's time over this row's (> 1: this row faster); "
        "MB: XLA's temporary + output buffers", "",
        "| T | mask | pass | impl | ms | × jax.nn | × default | XLA MB | max abs diff vs jax.nn | "
        "tuned block sizes (tuning time, trials) |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = (f"{r['tuned']} ({r['tune_s']:.0f} s, {r['trials']})" if "tuned" in r else "")
        lines.append(f"| {r['T']} | {r['mask']} | {r['mode']} | {r['impl']} | {r['ms']:.2f} | "
                     f"{r['over_jaxnn']:.2f} | {r['over_default']:.2f} | "
                     f"{r['xla_mb'] or 0:.0f} | {r['diff_vs_jaxnn']:.1e} | {extra} |")
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("wrote", stem + ".md")


if __name__ == "__main__":
    main()
