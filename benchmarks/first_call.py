"""First-call time of ``jax.jit(fnattn.attention)`` next to ``jax.nn.dot_product_attention``.

Research code re-jits often, so the first call (trace, lower, compile, run)
matters as much as the steady state. Every (implementation, T, mask, pass,
repetition) runs in its own fresh subprocess with the persistent compilation
cache disabled, so nothing of an earlier call is cached: what is timed is a
first call.

    python benchmarks/first_call.py              # T = 1k and 8k, causal and not, fwd and grad
    python benchmarks/first_call.py --quick      # T = 1k only, 2 repetitions
    python benchmarks/first_call.py --no-exec    # stages up to compilation only
    python benchmarks/first_call.py --layers 12  # 12 calls in one program, as a model makes

Per configuration, through the staged API of ``jax.jit``: ``trace``
(``jax.jit(f).trace(q, k, v)``), ``lower`` (``.lower()``), ``compile``
(``.compile()``) and ``exec`` (the compiled call on the inputs, to
``block_until_ready``). ``first call`` is trace + lower + compile, the cost a
re-jit pays before any work is done. The passes are ``fwd``:
``jax.jit(fnattn.attention)(spec, q, k, v)`` (``impl="auto"``) and
``jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=c))``
(``implementation=None``, i.e. XLA); ``grad``: ``jax.jit(jax.grad(...,
argnums=(0, 1, 2)))`` of ``out.sum()``. Before timing, each child process
initialises the backend with one unrelated jitted call (``x + 1``), so backend
start-up is charged to neither side. Inputs are NumPy arrays put on the device
(generating them with ``jax.random`` would compile programs before the timing).

Each configuration runs ``--reps`` times (a fresh process each); the table
reports, per stage, the repetition with the smallest first-call time (the
machine is shared: the minimum is the least disturbed) and the ratio
fnattn / jax.nn of the first-call times. ``exec`` is measured in the first
repetition only (jax.nn at T = 8k takes several seconds and GBs).

Writes ``benchmarks/results/<out>.{md,csv}`` (``first_call_cpu`` by default).
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

from flash import _cpu_name  # the sibling benchmark (this directory is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
STAGES = ("trace", "lower", "compile", "exec")


def child(cfg):
    """Times one first call and prints one JSON line."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    import numpy as np

    B, T, H, D = cfg["B"], cfg["T"], cfg["H"], cfg["D"]
    causal, impl, mode = cfg["causal"], cfg["impl"], cfg["mode"]
    # The backend and jit's own machinery start up here, not in the timed call.
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros(3, np.float32)))
    rng = np.random.default_rng(0)
    q, k, v = (jax.device_put(rng.standard_normal((B, T, H, D), np.float32)) for _ in range(3))

    layers = cfg.get("layers", 1)
    if impl == "fnattn":
        import fnattn
        from fnattn import AttentionSpec, masks
        spec = AttentionSpec(mask=masks.causal() if causal else None)

        def attn(q, k, v):
            return fnattn.attention(spec, q, k, v).out
    elif impl == "floor":
        attn = _floor(B, T, H, D, bool(causal))
    else:
        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=bool(causal))
    if layers > 1:  # a model's worth of calls, each on the last one's output
        one = attn

        def attn(q, k, v):
            for _ in range(layers):
                q = q + one(q, k, v)
            return q
    if impl == "fnattn" and layers == 1:
        if mode == "fwd":
            fn, args = jax.jit(fnattn.attention), (spec, q, k, v)
        else:
            fn, args = jax.jit(jax.grad(
                lambda q, k, v: fnattn.attention(spec, q, k, v).out.sum(),
                argnums=(0, 1, 2))), (q, k, v)
    else:
        if mode == "fwd":
            fn = jax.jit(attn)
        else:
            fn = jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).sum(), argnums=(0, 1, 2)))
        args = (q, k, v)

    t = {}
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    t.update(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2, exec=None)
    if cfg["exec"]:
        jax.block_until_ready(compiled(*args))
        t["exec"] = time.perf_counter() - t3
    dev = jax.devices()[0]
    print(json.dumps(dict(cfg, **t, device=f"{dev.platform} ({dev.device_kind})",
                          jax=jax.__version__, load=os.getloadavg()[0])))


def _floor(B, T, H, D, causal, bq=512, bk=256):
    """The least a blockwise (O(T) memory) forward can be: plain-JAX online
    softmax, ``lax.map`` over query blocks and one ``fori_loop`` over key
    blocks, with none of fnattn's features (no tile skipping, an iota mask on
    every tile when causal, no lse, no ragged ends: T a multiple of 512).
    Its first call bounds from below what any loop-based lowering can reach."""
    import jax.numpy as jnp
    from jax import lax

    nq, nk = T // bq, T // bk

    def attn(q, k, v):
        qb = q.reshape(B, nq, bq, H, D).transpose(1, 0, 3, 2, 4).reshape(nq, B * H, bq, D)
        kb = k.reshape(B, nk, bk, H, D).transpose(1, 0, 3, 4, 2).reshape(nk, B * H, D, bk)
        vb = v.reshape(B, nk, bk, H, D).transpose(1, 0, 3, 2, 4).reshape(nk, B * H, bk, D)

        def q_block(xs):
            qi, i = xs
            qi = qi * D ** -0.5

            def step(j, c):
                m, l, acc = c
                s = jnp.einsum("hqd,hdk->hqk", qi, kb[j])
                if causal:
                    rows = i * bq + jnp.arange(bq)[:, None]
                    s = jnp.where(rows >= j * bk + jnp.arange(bk)[None, :], s, -jnp.inf)
                mn = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - mn[..., None])
                a = jnp.exp(m - mn)
                return mn, l * a + p.sum(-1), acc * a[..., None] + jnp.einsum(
                    "hqk,hkd->hqd", p, vb[j])
            init = (jnp.full((B * H, bq), -jnp.inf), jnp.zeros((B * H, bq)),
                    jnp.zeros((B * H, bq, D)))
            m, l, acc = lax.fori_loop(0, nk, step, init)
            return acc / l[..., None]
        o = lax.map(q_block, (qb, jnp.arange(nq)))
        return o.reshape(nq, B, H, bq, D).transpose(1, 0, 3, 2, 4).reshape(B, T, H, D)
    return attn


def run_child(cfg, timeout):
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
    try:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(cfg, status=f"timeout {timeout}s")
    for line in reversed(p.stdout.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line), status="ok")
    tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
    return dict(cfg, status=f"failed (rc {p.returncode}): {tail[0][:200]}")


def _first(r):
    return r["trace"] + r["lower"] + r["compile"]


def summarise(rows):
    """One row per configuration: the repetition with the smallest first call,
    with ``exec`` from the repetition that measured it."""
    out = {}
    for r in rows:
        key = (r["T"], r["causal"], r["mode"], r["impl"])
        s = out.setdefault(key, dict(T=r["T"], causal=r["causal"], mode=r["mode"],
                                     impl=r["impl"], status=r["status"], reps=0, exec=None,
                                     first=None, first_max=None))
        if r["status"] != "ok":
            continue
        s["reps"] += 1
        if r.get("exec") is not None:
            s["exec"] = r["exec"]
        s["first_max"] = max(s["first_max"] or 0.0, _first(r))
        if s["first"] is None or _first(r) < s["first"]:
            s.update({st: r[st] for st in ("trace", "lower", "compile")}, status="ok",
                     first=_first(r), device=r["device"], jax=r["jax"], load=r["load"])
    return out


def table(summary):
    lines = ["| T | causal | pass | impl | trace s | lower s | compile s | first call s "
             "(max) | exec s | fnattn / jax.nn |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(summary, key=lambda k: (k[0], k[2], k[1], k[3] != "fnattn")):
        s = summary[key]
        head = f"| {s['T']} | {s['causal']} | {s['mode']} | {s['impl']} "
        if s["status"] != "ok":
            lines.append(head + f"| {s['status']} | | | | | |")
            continue
        ratio = ""
        if s["impl"] != "jax.nn":
            peer = summary.get((s["T"], s["causal"], s["mode"], "jax.nn"))
            if peer and peer["status"] == "ok":
                ratio = f"**{s['first'] / peer['first']:.2f}×**"
        ex = "" if s["exec"] is None else f"{s['exec']:.2f}"
        lines.append(head + f"| {s['trace']:.3f} | {s['lower']:.3f} | {s['compile']:.3f} | "
                     f"{s['first']:.3f} ({s['first_max']:.3f}) | {ex} | {ratio} |")
    return "\n".join(lines)


def write(rows, summary, args, seconds):
    ok = [s for s in summary.values() if s["status"] == "ok"]
    device = ok[0]["device"] if ok else "unknown"
    jaxv = ok[0]["jax"] if ok else "?"
    loads = [r["load"] for r in rows if r["status"] == "ok"]
    cmd = "python benchmarks/first_call.py " + " ".join(sys.argv[1:])
    header = (
        "# First-call time: fnattn.attention (impl=\"auto\") vs jax.nn.dot_product_attention\n\n"
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n"
        f"- machine: {device}; {_cpu_name()}, {os.cpu_count()} CPUs visible, "
        f"{platform.system()} {platform.machine()}\n"
        f"- jax {jaxv}, Python {platform.python_version()}\n"
        f"- command: `{cmd.strip()}` ({seconds / 60:.1f} min)\n"
        f"- B={args.B}, H={args.H}, D={args.D}, float32; fwd = "
        "`jax.jit(fnattn.attention)(spec, q, k, v)` / `jax.jit(jax.nn.dot_product_attention)`; "
        "grad = `jax.jit(jax.grad(out.sum(), argnums=(0, 1, 2)))`"
        + (f"; {args.layers} layers: `x = x + attention(x, k, v)` {args.layers} times in "
           "the one program (q = x)" if args.layers > 1 else "") + "\n"
        f"- every row is a fresh process (persistent compilation cache off), backend "
        f"initialised by an unrelated `x + 1` first; {args.reps} repetitions per row: the "
        "stages of the one with the smallest first call, the largest first call in "
        "parentheses; exec (the compiled call, first repetition only) is not part of "
        "the first call\n"
        "- first call = trace + lower + compile; ratio = fnattn's / jax.nn's (the goal: "
        "≤ 1.5×)\n"
        "- floor: a bare plain-JAX blockwise online softmax (`lax.map` over 512-row query "
        "blocks, `fori_loop` over 256-key blocks, no tile skipping, no lse, an iota mask on "
        "every tile when causal): the least a loop-based O(T)-memory forward costs to "
        "compile on this backend; its ratio is in the last column too\n"
        + (f"- 1-minute load average during the runs: {min(loads):.2f}–{max(loads):.2f} "
           f"({os.cpu_count()} = all cores busy)\n" if loads else "")
        + "\n")
    stem = args.out
    os.makedirs(RESULTS, exist_ok=True)
    fields = ["impl", "B", "T", "H", "D", "layers", "causal", "mode", "rep", "status", "trace",
              "lower", "compile", "exec", "load"]
    with open(os.path.join(RESULTS, stem + ".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(RESULTS, stem + ".md"), "w") as fh:
        fh.write(header + table(summary) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ts", default="1024,8192", help="sequence lengths")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--modes", default="fwd,grad")
    ap.add_argument("--impls", default="fnattn,jax.nn,floor",
                    help="floor: a bare plain-JAX blockwise loop (the least a loop costs)")
    ap.add_argument("--reps", type=int, default=None,
                    help="fresh processes per configuration (3; 2 with --quick)")
    ap.add_argument("--no-exec", action="store_true", help="skip the compiled call")
    ap.add_argument("--quick", action="store_true", help="T=1k only, 2 repetitions")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--layers", type=int, default=1,
                    help="attention calls in one program, each on the last one's output")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", default="first_call_cpu", help="results file stem")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.quick:
        args.ts = "1024"
    if args.reps is None:
        args.reps = 2 if args.quick else 3
    start = time.time()
    rows = []
    for rep in range(args.reps):
        for T in (int(x) for x in args.ts.split(",")):
            for mode in args.modes.split(","):
                for causal in (int(x) for x in args.causal.split(",")):
                    for impl in args.impls.split(","):
                        cfg = dict(impl=impl, B=args.B, T=T, H=args.H, D=args.D,
                                   causal=causal, mode=mode, rep=rep, layers=args.layers,
                                   exec=rep == 0 and not args.no_exec)
                        r = run_child(cfg, args.timeout)
                        rows.append(r)
                        if r["status"] == "ok":
                            ex = "" if r["exec"] is None else f" exec {r['exec']:.2f}"
                            print(f"rep {rep} {impl:7s} T={T:5d} causal={causal} {mode:4s} "
                                  f"trace {r['trace']:.3f} lower {r['lower']:.3f} compile "
                                  f"{r['compile']:.3f} first {_first(r):.3f}{ex}", flush=True)
                        else:
                            print(f"rep {rep} {impl:7s} T={T:5d} causal={causal} {mode:4s} "
                                  f"{r['status']}", flush=True)
    summary = summarise(rows)
    print()
    print(table(summary))
    write(rows, summary, args, time.time() - start)


if __name__ == "__main__":
    main()
