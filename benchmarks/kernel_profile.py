"""Where the Mosaic GPU flash forward spends its cycles, region by region.

Runs the forward once with Mosaic GPU's profiler on
(:data:`fnattn.flash.mosaic_gpu.PROFILE`): every warpgroup of every program
records the SM clock when it enters and leaves the kernel's named regions
(waits for Q, K, V and the other consumer's turn, the two products, the
softmax, the epilogue; the producer's waits for free slots). The trace is
summed here into cycles per program and per region, by warpgroup role, and a
line fitted through each consumer's cycles against the kv-tiles it visited
gives the cost of one tile (the slope) and of one item (the intercept: Q, the
first K, the epilogue), which is what a short row of packed documents pays
more often than a long one. Needs a Hopper GPU (and jax with the Mosaic GPU
profiler: 0.11).

    python benchmarks/kernel_profile.py                       # documents, causal, none
    python benchmarks/kernel_profile.py --cases documents --T 8192

Profiling adds a few cycles per region (two shared-memory stores); the times
are for comparing regions, not for the tables of ``gpu.py``.
"""

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def regions(events):
    """``{(tid, name): [cycles, ...]}``: the duration of every region of a Chrome
    trace's events (``ph`` "B"/"E" pairs, ``ts`` in thousands of cycles),
    nested regions matched per ``tid``.

    >>> ev = [dict(name="a", ph="B", ts=0.0, tid=1), dict(name="b", ph="B", ts=0.5, tid=1),
    ...       dict(name="b", ph="E", ts=1.0, tid=1), dict(name="a", ph="E", ts=2.0, tid=1)]
    >>> sorted(regions(ev).items())
    [((1, 'a'), [2000.0]), ((1, 'b'), [500.0])]
    """
    open_, out = collections.defaultdict(list), collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "B":
            open_[e["tid"]].append((e["name"], e["ts"]))
        elif e.get("ph") == "E" and open_[e["tid"]]:
            name, t0 = open_[e["tid"]].pop()
            out[(e["tid"], name)].append(round((e["ts"] - t0) * 1e3, 3))
    return out


def summarize(spans, threads=3):
    """Per role ("consumer": warpgroups 0 and 1, "producer": 2), per region:
    programs seen, occurrences and cycles per program, cycles per occurrence;
    and for the consumers the fit ``cycles = item + tile * kv-tiles`` over their
    traces (``None`` when fewer than two tile counts occur).

    >>> spans = {(1, "consumer"): [1000.0], (1, "full_qk"): [100.0] * 2,
    ...          (4, "consumer"): [1400.0], (4, "full_qk"): [100.0] * 4}
    >>> s = summarize(spans)
    >>> s["fit"]
    {'item': 600.0, 'tile': 200.0, 'traces': 2}
    >>> s["consumer"]["full_qk"]["per_program"], s["consumer"]["full_qk"]["each"]
    (3.0, 100.0)
    """
    roles = {"consumer": collections.defaultdict(list), "producer": collections.defaultdict(list)}
    tids = {"consumer": set(), "producer": set()}
    tiles, totals = collections.defaultdict(int), {}
    for (tid, name), durs in spans.items():
        role = "producer" if (tid - 1) % threads == 2 else "consumer"
        roles[role][name].append(durs)
        tids[role].add(tid)
        if role == "consumer" and name.endswith("_qk"):
            tiles[tid] += len(durs)
        if role == "consumer" and name == "consumer":
            totals[tid] = sum(durs)
    out = {}
    for role, by_name in roles.items():
        n = max(len(tids[role]), 1)
        out[role] = {name: dict(per_program=sum(len(d) for d in ds) / n,
                                cycles=sum(sum(d) for d in ds) / n,
                                each=float(np.mean([x for d in ds for x in d])))
                     for name, ds in sorted(by_name.items())}
    xs = np.array([tiles[t] for t in totals], float)
    ys = np.array([totals[t] for t in totals], float)
    out["fit"] = None
    if len(set(xs.tolist())) > 1:
        slope, icept = np.polyfit(xs, ys, 1)
        out["fit"] = dict(item=round(float(icept), 1), tile=round(float(slope), 1),
                          traces=len(xs))
    return out


def table(case, s):
    lines = [f"### {case}", ""]
    if s["fit"]:
        f = s["fit"]
        lines += [f"Consumer cycles ≈ {f['item']:.0f} per item + {f['tile']:.0f} per kv-tile "
                  f"(least squares over {f['traces']} consumer traces).", ""]
    lines += ["| role | region | per program | cycles per program | cycles each |",
              "|---|---|---|---|---|"]
    for role in ("consumer", "producer"):
        for name, r in s[role].items():
            lines.append(f"| {role} | {name} | {r['per_program']:.1f} | {r['cycles']:.0f} | "
                         f"{r['each']:.0f} |")
    return lines + [""]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="documents,causal,none")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--entries", type=int, default=600,
                    help="profiler words per warpgroup (events past them are dropped; the "
                         "buffer takes shared memory: 2048 left too little for the kernel)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from fnattn.flash import mosaic_gpu
    import gpu

    where = tempfile.mkdtemp(prefix="fnattn_profile_")
    mosaic_gpu.PROFILE = (args.entries, where)
    T, D = args.T, args.D
    B, H = max(1, 16384 // T), 2048 // D
    q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16)
               for kk in jax.random.split(jax.random.key(0), 3))
    dev = jax.devices()[0].device_kind
    lines = [f"# Mosaic GPU forward, cycles by region ({dev}, jax {jax.__version__})", "",
             f"`python benchmarks/kernel_profile.py {' '.join(sys.argv[1:])}`; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; bf16, B={B}, T={T}, "
             f"H={H}, D={D}; the default block sizes (one program per item).", ""]
    for case in args.cases.split(","):
        seg = None
        if case == "documents":
            seg = jnp.asarray(np.broadcast_to(gpu.document_ids(T), (B, T)).copy())
        f = jax.jit(gpu.flash_peer("fnattn:mosaic_gpu_bwd", case != "none", seg))
        before = set(glob.glob(os.path.join(where, "*.json")))
        jax.block_until_ready(f(q, k, v))
        time.sleep(1.0)
        new = sorted(set(glob.glob(os.path.join(where, "*.json"))) - before)
        if not new:
            lines += [f"### {case}", "", "no trace was written", ""]
            continue
        with open(new[-1]) as fh:
            trace = json.load(fh)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        s = summarize(regions(events))
        part = table(case, s)
        lines += part
        print("\n".join(part), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "kernel_profile.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
