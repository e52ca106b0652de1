"""Benchmark context parallelism (``fnattn.context.attention``) on 8 virtual CPU devices.

Causal attention, forward+backward (``jax.jit`` of ``jax.value_and_grad``),
B=1, H=8, D=64, float32, the sequence split over a mesh axis of 8 devices:
ring (contiguous and zigzag layouts) and all-gather, next to single-device
``fnattn.attention`` (flash) and ``jax.nn.dot_product_attention`` on the
whole sequence.

    python benchmarks/context_parallel.py            # T = 4k, 32k timed; 64k, 128k memory only
    python benchmarks/context_parallel.py --quick    # T = 2k timed, 8k memory only

Every (implementation, T) runs in its own subprocess; the 8-device ones set
``--xla_force_host_platform_device_count=8`` for themselves. Reported per row:

* agreement with one device: out, lse, dq, dk and dv of the whole sequence
  (restored to natural order) against single-device flash on the same inputs
  in the same run, as the largest absolute difference and a pass/fail under
  ``|x - ref| <= tol * (1 + |ref|)`` (tol 2e-5 for out/lse, 2e-4 for gradients);
* per-device memory: XLA's analysis of the compiled program (arguments +
  outputs + temporaries; a ``shard_map`` program is compiled once per device,
  so its figures are one device's), and its ratio to single-device flash;
  the process's RSS increase (all 8 virtual devices of one process together);
* bytes moved: the collective-permute (ring) or all-gather / reduce-scatter
  (all-gather) operations of the compiled HLO, multiplied by the trip counts of
  the loops around them, next to the analytic ring volume;
* time: median, minimum and maximum of several calls after a warm-up call.
  The 8 virtual devices share the machine's cores, so ring and all-gather wall
  time is the whole sequence's work plus the collectives run on the same
  cores: a cost measurement, not a speed-up measurement.

Work balance (non-empty 128x128 tiles per device, ``fnattn.context.work``) is
computed once per timed T. Writes ``benchmarks/results/context_parallel_<device>.{md,csv}``.
"""

import argparse
import csv
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from flash import _cpu_name  # the sibling benchmark (this directory is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
N_DEV = 8
IMPLS = ("flash", "jax.nn", "ring:contiguous", "ring:zigzag", "all_gather:zigzag")
OPTIONAL = ("ring:striped", "all_gather:contiguous", "all_gather:striped")
TOL = dict(out=2e-5, lse=2e-5, dq=2e-4, dk=2e-4, dv=2e-4)
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1,
         "s8": 1, "u8": 1}


# ----------------------------------------------------------------------------- child


def _hlo_collectives(text):
    """{op: (count, bytes)} of the collectives one run of the compiled HLO
    executes: an op inside a while loop counts its trip count times (nested
    loops multiply); an op inside a conditional counts as if taken."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = cur
            continue
        if cur is not None and line.strip() and line.strip() != "}":
            comps[cur].append(line.strip())
    entry = comps.pop("__entry__")
    mult = {entry: 1}
    order = [entry]
    while order:  # propagate multipliers from callers to callees
        c = order.pop()
        for ins in comps.get(c, ()):
            trip = 1
            if re.search(r"\swhile\(", ins):  # None: not known (data-dependent loop)
                t = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins)
                trip = int(t.group(1)) if t else None
            for callee in re.findall(
                    r"(?:body|condition|to_apply|calls|true_computation|false_computation)="
                    r"%?([\w.\-]+)", ins) + [x for g in re.findall(
                        r"branch_computations=\{([^}]*)\}", ins)
                        for x in re.findall(r"%?([\w.\-]+)", g)]:
                if callee in comps and callee not in mult:
                    is_body = re.search(rf"body=%?{re.escape(callee)}\b", ins)
                    f = trip if is_body else 1
                    mult[callee] = None if mult[c] is None or f is None else mult[c] * f
                    order.append(callee)
    found = {}
    for c, m in mult.items():
        for ins in comps[c]:
            op = re.search(r"=\s*(.*?)\s(collective-permute|all-gather|reduce-scatter|"
                           r"all-reduce|all-to-all)(-start)?\(", ins)
            if not op:
                continue
            if m is None:
                raise RuntimeError(f"a collective in a loop of unknown trip count: {ins[:200]}")
            shapes = re.findall(r"(\w+)\[([\d,]*)\]", op.group(1))
            if op.group(3):  # async start: the result tuple repeats the operand
                shapes = shapes[len(shapes) // 2:]
            nbytes = sum(BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d]
                                                         or [1])) for dt, dims in shapes)
            n, b = found.get(op.group(2), (0, 0))
            found[op.group(2)] = (n + m, b + m * nbytes)
    return found


def _jaxpr_ppermute_bytes(jaxpr):
    """Bytes one device sends with ppermute when ``jaxpr`` runs (scan bodies
    count their length times, a cond its largest branch)."""
    import jax.extend

    def subs(params):
        for v in params.values():
            for x in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(x, jax.extend.core.ClosedJaxpr):
                    yield x.jaxpr
                elif isinstance(x, jax.extend.core.Jaxpr):
                    yield x

    def count(j):
        n = nb = 0
        for eqn in j.eqns:
            name = eqn.primitive.name
            if name == "ppermute":
                n += len(eqn.invars)
                nb += sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
            if name == "cond":
                n2, b2 = max(count(b.jaxpr) for b in eqn.params["branches"])
                n, nb = n + n2, nb + b2
                continue
            times = eqn.params["length"] if name == "scan" else 1
            for s in subs(eqn.params):
                n2, b2 = count(s)
                n, nb = n + times * n2, nb + times * b2
        return n, nb

    return count(jaxpr)


def child_balance(cfg):
    import fnattn
    from fnattn import masks
    out = {}
    for layout in fnattn.context.LAYOUTS:
        w = fnattn.context.work(masks.causal(), cfg["T"], N_DEV, layout, block=128)
        out[layout] = [int(x) for x in w]
    print(json.dumps(dict(status="ok", work=out)))


def child(cfg):
    """One (implementation, T): compile, analyse, optionally run and compare."""
    import resource

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import fnattn
    from fnattn import AttentionSpec, masks

    B, T, H, D = cfg["B"], cfg["T"], cfg["H"], cfg["D"]
    impl = cfg["impl"]
    info = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                n_devices=len(jax.devices()))
    spec = AttentionSpec(mask=masks.causal())
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, w = (jax.random.normal(kk, (B, T, H, D), jnp.float32) for kk in ks)

    def loss_fn(attend):
        """(loss, (out, lse), (dq, dk, dv)) of ``sum(out * w)``."""
        def loss(q, k, v, w):
            out, lse = attend(q, k, v)
            return jnp.sum(out * w), (out, lse)

        def f(q, k, v, w):
            (val, aux), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
                q, k, v, w)
            return val, aux, g
        return f

    def _pair(res):
        return res.out, res.lse

    layout = None
    if impl == "flash":
        fn = jax.jit(loss_fn(lambda q, k, v: _pair(fnattn.attention(spec, q, k, v))))
    elif impl == "jax.nn":
        fn = jax.jit(loss_fn(lambda q, k, v: (jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla"), None)))
    else:
        strategy, layout = impl.split(":")
        mesh = Mesh(np.array(jax.devices()[:N_DEV]), ("seq",))
        seq = P(None, "seq")

        def local(q, k, v, w):
            def attend(q, k, v):
                return _pair(fnattn.context.attention(spec, q, k, v, axis_name="seq",
                                                      strategy=strategy, layout=layout))
            val, aux, g = loss_fn(attend)(q, k, v, w)
            return val[None], aux, g

        fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 4, out_specs=(
            P("seq"), (seq, P(None, None, "seq")), (seq,) * 3)))
        sharding = NamedSharding(mesh, seq)
        q, k, v, w = (jax.device_put(fnattn.context.reorder(x, N_DEV, layout), sharding)
                      for x in (q, k, v, w))
    args = (q, k, v, w)
    jax.block_until_ready(args)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    compiled = lowered.compile()
    res = dict(info, status="ok", compile_s=time.perf_counter() - t0)
    ma = compiled.memory_analysis()
    res.update(arg_mb=ma.argument_size_in_bytes / 2**20, out_mb=ma.output_size_in_bytes / 2**20,
               temp_mb=ma.temp_size_in_bytes / 2**20,
               alias_mb=ma.alias_size_in_bytes / 2**20)
    res["xla_mb"] = res["arg_mb"] + res["out_mb"] + res["temp_mb"] - res["alias_mb"]
    if layout is not None:
        colls = _hlo_collectives(compiled.as_text())
        res["hlo"] = {op: [n, b] for op, (n, b) in colls.items()}
        if impl.startswith("ring"):
            jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
            res["jaxpr_ppermute"] = list(_jaxpr_ppermute_bytes(jaxpr))
    if not cfg["run"]:
        res["status"] = "memory only"
        print(json.dumps(res))
        return

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    result = jax.block_until_ready(compiled(*args))
    first = time.perf_counter() - t0
    reps = cfg["reps"] if first < 8 else (2 if first < 60 else 1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    res.update(time_s=float(np.median(times)), min_s=min(times), max_s=max(times), reps=reps,
               first_s=first, peak_mb=peak / 2**20,
               load=round((load0 + os.getloadavg()[0]) / 2, 1))

    # The whole sequence's out, lse and gradients, in natural order.
    _, (out, lse), (dq, dk, dv) = result
    arrays = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if layout is not None:
        arrays = {n: fnattn.context.restore(x, N_DEV, layout, axis=2 if n == "lse" else 1)
                  for n, x in arrays.items()}
    arrays = {n: np.asarray(x) for n, x in arrays.items() if x is not None}
    ref_dir = cfg["ref_dir"]
    if impl == "flash":
        for n, x in arrays.items():
            np.save(os.path.join(ref_dir, f"{n}.npy"), x)
    elif os.path.exists(os.path.join(ref_dir, "out.npy")):
        err, ok = {}, True
        for n, x in arrays.items():
            ref = np.load(os.path.join(ref_dir, f"{n}.npy"))
            diff = np.abs(x.astype(np.float64) - ref)
            err[n] = float(diff.max())
            ok = ok and bool(np.all(diff <= TOL[n] * (1 + np.abs(ref))))
        res.update(err=err, match=ok)
    print(json.dumps(res))


# ----------------------------------------------------------------------------- parent


def run_child(cfg, timeout, n_devices):
    env = dict(os.environ, FNATTN_BENCH_CHILD=json.dumps(cfg), JAX_PLATFORMS="cpu")
    flags = env.get("XLA_FLAGS", "")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    if n_devices > 1:
        flags += f" --xla_force_host_platform_device_count={n_devices}"
    env["XLA_FLAGS"] = flags.strip()
    try:
        p = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(status=f"timeout > {timeout} s")
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        lines = p.stderr.strip().splitlines() or ["?"]
        errs = [x for x in lines if re.match(r"^[\w.]*(Error|Exception)\b", x)]
        err = (errs or lines)[-1][:200]
        if p.returncode in (-9, 137):
            err = "killed (out of memory?)"
        return dict(status=f"error: {err}")
    return json.loads(lines[-1])


def chunk_bytes(r):
    """One device's share of q (or k, or v): B * (T / N) * H * D * 4 bytes."""
    return r["B"] * (r["T"] // N_DEV) * r["H"] * r["D"] * 4


def analytic(r):
    """Bytes one device receives in forward+backward, by the algorithm: ring:
    K and V each step (N-1 forward, N-1 backward) and dK/dV (float32, N
    transfers backward); all-gather: the other devices' K and V once forward,
    their partial dK/dV once backward (reduce-scatter)."""
    kv = 2 * chunk_bytes(r)  # K and V, float32 here; dK/dV are float32 in any case
    if r["impl"].startswith("ring"):
        return dict(step=kv, fwd=(N_DEV - 1) * kv, bwd=(N_DEV - 1) * kv + N_DEV * kv,
                    total=2 * (N_DEV - 1) * kv + N_DEV * kv)
    return dict(step=kv, fwd=(N_DEV - 1) * kv, bwd=(N_DEV - 1) * kv, total=2 * (N_DEV - 1) * kv)


# What one device receives per collective, from its result's size (the
# algorithms XLA uses between N devices).
RECEIVED = {"collective-permute": 1.0, "all-gather": (N_DEV - 1) / N_DEV,
            "reduce-scatter": N_DEV - 1.0, "all-reduce": 2 * (N_DEV - 1) / N_DEV,
            "all-to-all": (N_DEV - 1) / N_DEV}


def moved(r):
    """(count, bytes received) of the compiled program's collectives, one device."""
    h = r.get("hlo") or {}
    return (sum(n for n, _ in h.values()),
            sum(b * RECEIVED[op] for op, (_, b) in h.items()))


def main():
    if os.environ.get("FNATTN_BENCH_CHILD"):
        cfg = json.loads(os.environ["FNATTN_BENCH_CHILD"])
        return child_balance(cfg) if cfg.get("balance") else child(cfg)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: T=2k timed, 8k memory only")
    ap.add_argument("--ts", default=None, help="timed sequence lengths (default 4096,32768)")
    ap.add_argument("--memory-ts", default=None,
                    help="compile-only sequence lengths (default 65536,131072; '' for none)")
    ap.add_argument("--impls", default=None,
                    help=f"comma-separated subset of {IMPLS + OPTIONAL}")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per row")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per row (fewer when slow)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--jaxnn-max", type=int, default=8192,
                    help="longest T for jax.nn (it materialises the (T, T) logits per head)")
    ap.add_argument("--out", default=None, help="file stem under benchmarks/results/")
    ap.add_argument("--save-json", default=None, help="also write the raw rows to this file")
    ap.add_argument("--from-json", default=None,
                    help="write the tables from raw rows saved by --save-json, run nothing")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        sys.argv = saved["argv"]
        balance = {int(t): b for t, b in saved["balance"].items()}
        return write(saved["rows"], balance, args, saved["H"], saved["D"], saved["seconds"],
                     saved["date"])

    ts = [2048] if args.quick else [4096, 32768]
    mts = [8192] if args.quick else [65536, 131072]
    if args.ts:
        ts = [int(x) for x in args.ts.split(",")]
    if args.memory_ts is not None:
        mts = [int(x) for x in args.memory_ts.split(",") if x]
    impls = list(IMPLS) if not args.impls else args.impls.split(",")
    for i in impls:
        if i not in IMPLS + OPTIONAL:
            ap.error(f"--impls: unknown {i!r}; expected some of {IMPLS + OPTIONAL}")
    if "flash" in impls:  # the reference runs first at every T
        impls.remove("flash")
        impls.insert(0, "flash")
    H, D = args.heads, 64
    rows, balance = [], {}
    started = time.time()
    tmp = tempfile.mkdtemp(prefix="fnattn_cp_")
    try:
        for T in ts:
            b = run_child(dict(balance=True, T=T), args.timeout, 1)
            balance[T] = b.get("work", b["status"])
            print(f"T={T} causal work per device (128x128 tiles): {balance[T]}", flush=True)
        for T, run in [(T, True) for T in ts] + [(T, False) for T in mts]:
            ref_dir = os.path.join(tmp, str(T))
            os.makedirs(ref_dir, exist_ok=True)
            for impl in impls:
                cfg = dict(B=1, T=T, H=H, D=D, impl=impl, run=run, reps=args.reps,
                           ref_dir=ref_dir)
                if impl == "jax.nn" and T > args.jaxnn_max:
                    res = dict(status=f"skipped (T > {args.jaxnn_max}: (T, T) logits)")
                else:
                    res = run_child(cfg, args.timeout, 1 if impl in ("flash", "jax.nn")
                                    else N_DEV)
                row = dict(cfg, **res)
                rows.append(row)
                print(_fmt(row), flush=True)
            shutil.rmtree(ref_dir, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.time() - started
    if args.save_json:
        with open(args.save_json, "w") as fh:
            json.dump(dict(argv=sys.argv, rows=rows, balance=balance, H=H, D=D,
                           seconds=seconds, date=_now()), fh)
    write(rows, balance, args, H, D, seconds)


def _fmt(r):
    s = f"{r['impl']:18s} T={r['T']:6d} "
    if r["status"] not in ("ok", "memory only"):
        return s + r["status"]
    s += (f"XLA per device {r['xla_mb']:7.1f} MB (arg {r['arg_mb']:.0f} out {r['out_mb']:.0f} "
          f"temp {r['temp_mb']:.0f}) compile {r['compile_s']:.0f} s")
    if "hlo" in r:
        s += " | " + ", ".join(f"{op} x{n} {b / 2**20:.0f} MiB" for op, (n, b) in r["hlo"].items())
    if r["status"] == "ok":
        s += (f" | {r['time_s'] * 1e3:9.1f} ms (min {r['min_s'] * 1e3:.0f}, max "
              f"{r['max_s'] * 1e3:.0f}, n={r['reps']}) RSS +{r['peak_mb']:.0f} MB load {r['load']}")
        if "err" in r:
            s += (" | vs flash: " + " ".join(f"{n} {e:.1e}" for n, e in r["err"].items())
                  + (" MATCH" if r["match"] else " MISMATCH"))
    return s


def _find(rows, impl, T):
    return next((x for x in rows if x["impl"] == impl and x["T"] == T
                 and x["status"] in ("ok", "memory only")), None)


def _now():
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def write(rows, balance, args, H, D, seconds, date=None):
    ok = [r for r in rows if r["status"] in ("ok", "memory only")]
    device = ok[0]["device"] if ok else "unknown"
    jaxv = ok[0]["jax"] if ok else "?"
    stem = args.out or f"context_parallel_{device.replace(' ', '_')}"
    os.makedirs(RESULTS, exist_ok=True)
    cmd = "python benchmarks/context_parallel.py " + shlex.join(sys.argv[1:])
    loads = [r["load"] for r in ok if "load" in r]
    header = (
        "# fnattn.context benchmark: context-parallel causal attention on 8 devices\n\n"
        f"- date: {date or _now()}\n"
        f"- machine: {device}; {_cpu_name()}, {os.cpu_count()} CPUs visible, "
        f"{platform.system()} {platform.machine()}; ring and all-gather on {N_DEV} virtual "
        f"CPU devices of one process (`--xla_force_host_platform_device_count={N_DEV}`), "
        "flash and jax.nn on one device\n"
        f"- jax {jaxv}, Python {platform.python_version()}\n"
        f"- command: `{cmd.strip()}` ({seconds / 60:.0f} min)\n"
        f"- problem: causal, B=1, H={H}, D={D}, float32, `jax.jit` of `jax.value_and_grad` "
        "of `sum(out * w)` with respect to q, k, v (out and lse returned too); ring and "
        "all-gather run inside `jax.shard_map` over a mesh axis of 8 devices, on inputs "
        "reordered for the layout before the call\n"
        "- **the 8 virtual devices share the machine's cores**: ring and all-gather wall "
        "time is the whole sequence's work plus the collectives, run on the same cores "
        "as one device's. It measures the cost of splitting the sequence, not a speed-up\n"
        + (f"- 1-minute load average during the timed runs: {min(loads)}–{max(loads)} "
           "(2 = both cores busy; other jobs shared the machine)\n" if loads else "")
        + "\n")
    fields = ["impl", "T", "B", "H", "D", "status", "time_s", "min_s", "max_s", "reps",
              "ratio_jaxnn", "ratio_flash_time", "compile_s", "arg_mb", "out_mb", "temp_mb",
              "alias_mb", "xla_mb", "chunk_mb", "ratio_flash_over_n", "excess_chunks",
              "peak_mb", "err_out", "err_lse", "err_dq", "err_dk", "err_dv", "match",
              "collective_count", "received_bytes", "analytic_bytes", "permute_count",
              "permute_bytes", "load"]
    out = []
    for r in rows:
        c = dict(r)
        for n, e in (r.get("err") or {}).items():
            c[f"err_{n}"] = e
        c["chunk_mb"] = chunk_bytes(r) / 2**20
        fl, jn = _find(rows, "flash", r["T"]), _find(rows, "jax.nn", r["T"])
        if fl and "xla_mb" in r and r["impl"] not in ("flash", "jax.nn"):
            c["ratio_flash_over_n"] = r["xla_mb"] / (fl["xla_mb"] / N_DEV)
            c["excess_chunks"] = (r["xla_mb"] - fl["xla_mb"] / N_DEV) / c["chunk_mb"]
        if "time_s" in r:
            if jn and "time_s" in jn:
                c["ratio_jaxnn"] = r["time_s"] / jn["time_s"]
            if fl and "time_s" in fl:
                c["ratio_flash_time"] = r["time_s"] / fl["time_s"]
        if "hlo" in r:
            c["collective_count"], c["received_bytes"] = moved(r)
            c["permute_count"], c["permute_bytes"] = r["hlo"].get("collective-permute", (0, 0))
            c["analytic_bytes"] = analytic(r)["total"]
        out.append(c)
    with open(os.path.join(RESULTS, stem + ".csv"), "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(out)

    def bad(c):
        return c["status"] not in ("ok", "memory only")

    timed = [c for c in out if c["status"] == "ok" or (bad(c) and c["T"] in _timed_ts(out))]
    md = [header, "## 1. Agreement with one device\n",
          "out, lse, dq, dk and dv of the whole sequence (restored to natural order) against "
          "single-device flash (`fnattn.attention`) on the same inputs in the same run: the "
          "largest absolute difference, and whether every element satisfies "
          "`|x - ref| <= tol · (1 + |ref|)` with tol 2e-5 for out and lse, 2e-4 for the "
          "gradients (jax.nn has no lse).\n",
          "| T | impl | out | lse | dq | dk | dv | match |", "|---|---|---|---|---|---|---|---|"]
    for c in timed:
        if c["impl"] == "flash" or bad(c):
            continue
        e = [f"{c[f'err_{n}']:.1e}" if f"err_{n}" in c else "–"
             for n in ("out", "lse", "dq", "dk", "dv")]
        match = ("yes" if c["match"] else "**no**") if "match" in c else "no reference"
        md.append(f"| {c['T']} | {c['impl']} | " + " | ".join(e) + f" | {match} |")

    md += ["", "## 2. Memory per device\n",
           "XLA's analysis of the compiled program: arguments (q, k, v, w) + outputs (loss, "
           "out, lse, dq, dk, dv) + temporaries, in MiB. A `shard_map` program is compiled "
           "once per device, so the ring and all-gather figures are ONE device's; flash and "
           "jax.nn hold the whole sequence on one device. `÷ (flash/8)`: this row over "
           "single-device flash's total divided by 8. Chunk: one device's share of q, "
           "B·(T/8)·H·D·4 bytes; `excess`: (this row − flash/8) in chunks. "
           "'memory only': compiled, not run. What the excess holds: see "
           "`benchmarks/README.md`.\n",
           "| T | impl | arg | out | temp | total per device | ÷ (flash/8) | chunk MiB | "
           "excess (chunks) | |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in out:
        head = f"| {c['T']} | {c['impl']} "
        if bad(c):
            md.append(head + f"| {c['status']} | | | | | | | |")
            continue
        rat = f"{c['ratio_flash_over_n']:.2f}" if "ratio_flash_over_n" in c else ""
        exc = f"{c['excess_chunks']:.1f}" if "excess_chunks" in c else ""
        note = "memory only" if c["status"] == "memory only" else ""
        md.append(head + f"| {c['arg_mb']:.1f} | {c['out_mb']:.1f} | {c['temp_mb']:.1f} | "
                  f"{c['xla_mb']:.1f} | {rat} | {c['chunk_mb']:.1f} | {exc} | {note} |")

    fits = []
    for impl in dict.fromkeys(c["impl"] for c in out if "excess_chunks" in c):
        pts = [(c["chunk_mb"], c["xla_mb"] - c["xla_mb"] / c["ratio_flash_over_n"])
               for c in out if c["impl"] == impl and "excess_chunks" in c]
        if len({x for x, _ in pts}) >= 2:
            slope, icpt = np.polyfit(*zip(*pts), 1)
            fits.append(f"{impl}: {slope:.1f} chunks + {icpt:.1f} MiB")
    if fits:
        md += ["", "Excess over flash/8 fitted over the T of this table as (chunks × chunk "
               "MiB + a fixed part that does not grow with T): " + "; ".join(fits) + "."]

    md += ["", "## 3. Work balance\n",
           "Causal, non-empty 128×128 tiles per device over its (query piece, key piece) "
           "pairs, `fnattn.context.work(masks.causal(), T, 8, layout, block=128)`.\n",
           "| T | layout | tiles per device | max / min |", "|---|---|---|---|"]
    for T, b in balance.items():
        if isinstance(b, str):
            md.append(f"| {T} | | {b} | |")
            continue
        for layout, w in b.items():
            md.append(f"| {T} | {layout} | {', '.join(map(str, w))} | "
                      f"{max(w) / min(w):.2f} |")

    md += ["", "## 4. Bytes moved per device\n",
           "Counted in the compiled per-device HLO: every collective, times the trip counts "
           "of the loops around it, as the bytes one device receives (collective-permute: "
           "its operand; all-gather: 7/8 of its result; reduce-scatter: 7 times its "
           "result). Analytic ring volume: each step sends the device's K and V chunk, "
           "2·B·L·H·D·4 bytes (L = T/8); forward 7 steps, backward 7 K/V steps and 8 dK/dV "
           "transfers (float32; the last brings them home): 22 steps' worth of K+V in all. "
           "Analytic all-gather: the other 7 devices' K and V forward, their partial dK/dV "
           "backward. For ring also the ppermute operands of the jaxpr (scan bodies times "
           "their length).\n",
           "| T | impl | K+V per step MiB | analytic fwd + bwd MiB | HLO: op ×count (MiB "
           "received) | jaxpr ppermute (arrays, MiB) | HLO ÷ analytic |",
           "|---|---|---|---|---|---|---|"]
    for c in out:
        if "received_bytes" not in c:
            continue
        a = analytic(c)
        ops = "; ".join(f"{op} ×{n} ({b * RECEIVED[op] / 2**20:.0f})"
                        for op, (n, b) in c["hlo"].items())
        jx = c.get("jaxpr_ppermute")
        jx = f"{jx[0]}, {jx[1] / 2**20:.0f}" if jx else ""
        md.append(f"| {c['T']} | {c['impl']} | {a['step'] / 2**20:.0f} | "
                  f"{a['fwd'] / 2**20:.0f} + {a['bwd'] / 2**20:.0f} = "
                  f"{a['total'] / 2**20:.0f} | {ops} | {jx} | "
                  f"{c['received_bytes'] / a['total']:.2f} |")

    no_jn = sorted(T for T in _timed_ts(out) if not any(
        c["impl"] == "jax.nn" and c["T"] == T and "time_s" in c for c in out))
    md += ["", "## 5. Time\n",
           "Median of several calls after a warm-up call, min and max beside it. "
           "`÷ jax.nn`: this row's median over `jax.nn.dot_product_attention`'s "
           "(implementation 'xla', which materialises the (T, T) logits of every head, so "
           "it runs only at the shorter T) in the same run at the same T, < 1: faster than "
           "jax.nn; `÷ flash`: over single-device flash's. RSS: the process's peak resident "
           "size increase over its size once the inputs exist (all 8 virtual devices of "
           "the process together; compilation included).\n",
           *([f"jax.nn is not timed at T = {', '.join(map(str, no_jn))}: its float32 "
              f"logits alone would take {H}·T²·4 bytes ("
              + ", ".join(f"{H * T * T * 4 / 2**30:.0f} GiB" for T in no_jn)
              + "), so this run has no ratio to jax.nn at that T; runs that include a T "
              "where it fits (the default run: 4096) give it there.\n"] if no_jn else []),
           "| T | impl | median ms | min–max ms | calls | ÷ jax.nn | ÷ flash | RSS MB |",
           "|---|---|---|---|---|---|---|---|"]
    for c in timed:
        head = f"| {c['T']} | {c['impl']} "
        if bad(c):
            md.append(head + f"| {c['status']} | | | | | |")
            continue
        jn = f"{c['ratio_jaxnn']:.2f}" if "ratio_jaxnn" in c else ""
        fl = f"{c['ratio_flash_time']:.2f}" if "ratio_flash_time" in c else ""
        md.append(head + f"| {c['time_s'] * 1e3:.0f} | {c['min_s'] * 1e3:.0f}–"
                  f"{c['max_s'] * 1e3:.0f} | {c['reps']} | {jn} | {fl} | {c['peak_mb']:.0f} |")
    with open(os.path.join(RESULTS, stem + ".md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print(f"wrote {os.path.join(RESULTS, stem)}.{{md,csv}}")


def _timed_ts(rows):
    return {r["T"] for r in rows if r.get("run")}


if __name__ == "__main__":
    main()
