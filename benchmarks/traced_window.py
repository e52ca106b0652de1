"""Window sizes as data against static ints, on the XLA flash lowering.

Two tables, timed under ``jax.jit`` in one run (median of ``--reps`` calls after
a warm-up; the machine is shared and noisy):

* **one layer** at ``--t`` (default 8192): causal attention within a window of
  ``--window`` keys, ``fnattn.flash(impl="xla")`` (the blockwise XLA lowering,
  which skips the tiles outside the window), forward and forward +
  backward, with the window a static int and with it a traced int32 (a jit
  argument); ``jax.nn.dot_product_attention`` (causal, ``local_window_size``,
  XLA) forward as the baseline of the same run; peak temporary memory from XLA's
  memory analysis.
* **a 12-layer model** (``--layers``) at ``--model-t`` (default 4096) with a
  5:1 local:global pattern (layers 6 and 12 global): each layer
  ``x + flash(x Wq, x Wk, x Wv)``, scanned (one layer traced, the windows
  as ``lax.scan`` xs, ``masks.NO_WINDOW`` for the global layers) against
  unrolled (a Python loop, each layer its static mask). First call (trace,
  lower and compile, each timed, from empty caches; the process's CPU time
  too) and step time, forward and forward + backward, programs of one layer
  (traced window, static window, static global: the floor of a scanned
  program's first call), and the
  tiles each layer visits (non-empty tiles of the block classes at the XLA
  lowering's tile size: from the traced windows, and from the static masks).

    python benchmarks/traced_window.py
    python benchmarks/traced_window.py --t 2048 --model-t 1024 --reps 2 --out /tmp/x.md

Writes ``results/traced_window_<device>.md`` (``--out``).
"""

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import fnattn  # noqa: E402
from fnattn import AttentionSpec, masks  # noqa: E402
from fnattn._checks import Dims  # noqa: E402
from fnattn.flash.xla import XlaBlockSizes  # noqa: E402


def timed(f, *args, reps):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def first_call(f, *args):
    """Trace, lower and compile ``jax.jit(f)`` from empty caches: the wall time
    of each stage, the process's CPU time over all three (all threads: less
    sensitive than wall time to other jobs on a shared machine), the HLO
    fusions of the compiled program, and the compiled function."""
    jax.clear_caches()
    jf = jax.jit(f)
    c0, t0 = time.process_time(), time.perf_counter()
    traced = jf.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3, c3 = time.perf_counter(), time.process_time()
    fusions = compiled.as_text().count(" fusion(")
    return dict(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2, first=t3 - t0, cpu=c3 - c0,
                fusions=fusions), compiled


def peak(f, *args):
    try:
        m = f.lower(*args).compile().memory_analysis()
        return m.temp_size_in_bytes / 2**20
    except Exception:  # no memory analysis on this backend
        return float("nan")


def window(w):
    return masks.causal() & masks.sliding_window(left=w)


def one_layer(T, W, reps, H=4, D=64):
    rs = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rs.standard_normal((1, T, H, D)), jnp.float32) for _ in range(3))

    def fwd_static(q, k, v):
        return fnattn.flash(AttentionSpec(mask=window(W), impl="xla"), q, k, v).out

    def fwd_traced(w, q, k, v):
        return fnattn.flash(AttentionSpec(mask=window(w), impl="xla"), q, k, v).out

    def grad(f):
        return jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(-3, -2, -1))

    w = jnp.int32(W)
    rows = []
    for name, f, args in (
            ("fwd", fwd_static, (q, k, v)), ("fwd", fwd_traced, (w, q, k, v)),
            ("fwd+bwd", grad(fwd_static), (q, k, v)), ("fwd+bwd", grad(fwd_traced),
                                                       (w, q, k, v))):
        jf = jax.jit(f)
        rows.append((name, "traced" if len(args) == 4 else "static",
                     timed(jf, *args, reps=reps), peak(jf, *args)))
    nn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(W, 0), implementation="xla"))
    base = timed(nn, q, k, v, reps=max(1, reps // 2))
    return rows, base, peak(nn, q, k, v)


def model(T, W, L, reps, H=4, D=64):
    rs = np.random.default_rng(1)
    x = jnp.asarray(rs.standard_normal((1, T, H, D)), jnp.float32)
    wts = jnp.asarray(rs.standard_normal((L, 3, D, D)) / np.sqrt(D), jnp.float32)
    local = [(i + 1) % 6 != 0 for i in range(L)]          # 5 local : 1 global
    xs = jnp.array([W if lo else masks.NO_WINDOW for lo in local], jnp.int32)

    def layer(x, w, mask):
        spec = AttentionSpec(mask=mask, impl="xla")
        return x + fnattn.flash(spec, x @ w[0], x @ w[1], x @ w[2]).out

    def scanned(x, wts):
        return jax.lax.scan(lambda x, a: (layer(x, a[1], window(a[0])), None), x, (xs, wts))[0]

    def unrolled(x, wts):
        for i in range(L):
            x = layer(x, wts[i], window(W) if local[i] else masks.causal())
        return x

    # the floor: a program of one layer (its first call is the least a scanned
    # program, which holds one layer, can cost)
    def one_traced(x, wts):
        return layer(x, wts[0], window(xs[0]))

    def one_local(x, wts):
        return layer(x, wts[0], window(W))

    def one_global(x, wts):
        return layer(x, wts[0], masks.causal())

    out, floor = {}, {}
    forms = (("scanned", scanned), ("unrolled", unrolled), ("1 layer, traced window", one_traced),
             ("1 layer, static window", one_local), ("1 layer, static global", one_global))
    for form, f in forms:
        loss = lambda x, w, f=f: jnp.sum(f(x, w) ** 2)  # noqa: E731
        for mode, g in (("fwd", f), ("fwd+bwd", jax.grad(loss, argnums=(0, 1)))):
            stages, compiled = first_call(g, x, wts)
            if form in ("scanned", "unrolled"):
                out[form, mode] = (stages, timed(compiled, x, wts, reps=reps))
            else:
                floor[form, mode] = stages
    # tiles visited: the XLA lowering's tile size for this shape
    b = XlaBlockSizes.default(Dims(batch=1, q_len=T, kv_len=T, num_q_heads=H,
                                   num_kv_heads=H, head_dim=D, v_head_dim=D))
    bq, bk = min(b.block_q, T), min(b.block_k, T)
    traced = jax.jit(jax.vmap(lambda w: jnp.sum(
        masks.block_classes(window(w), 1, 1, T, T, bq, bk) != masks.EMPTY)))(xs)
    static = [int(np.sum(masks.block_classes_static(window(W) if lo else masks.causal(),
                                                    1, 1, T, T, bq, bk) != masks.EMPTY))
              for lo in local]
    return out, floor, np.asarray(traced).tolist(), static, (bq, bk)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--t", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--model-t", type=int, default=4096)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    dev = jax.devices()[0]
    rows, base, base_mem = one_layer(a.t, a.window, a.reps)
    mod, floor, tiles_traced, tiles_static, (bq, bk) = model(a.model_t, a.window, a.layers,
                                                      max(1, a.reps // 2))
    lines = [
        f"# Traced window sizes against static ints ({dev.platform}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "",
        f"jax {jax.__version__}; `python benchmarks/traced_window.py "
        + " ".join(argv) + "`; median of "
        f"{a.reps} calls (model: {max(1, a.reps // 2)}); a shared, noisy CPU.",
        "",
        f"## One layer: T={a.t}, window {a.window}, B=1, H=4, D=64, float32, "
        "fnattn.flash(impl='xla')",
        "",
        "| pass | window | time (s) | vs static | vs jax.nn fwd | temp memory (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    static = {r[0]: r[2] for r in rows if r[1] == "static"}
    for name, kind, t, mem in rows:
        lines.append(f"| {name} | {kind} | {t:.4f} | {t / static[name]:.3f}x | "
                     f"{t / base:.3f}x | {mem:.1f} |")
    lines.append(f"| fwd | jax.nn (xla) | {base:.4f} | | 1.000x | {base_mem:.1f} |")
    lines += [
        "",
        f"## {a.layers} layers, 5 local : 1 global, T={a.model_t}, window {a.window}",
        "",
        "First call = trace + lower + compile from empty caches (wall time; CPU time: "
        "every thread of the process over the same span, less sensitive to other jobs); "
        "fusions: the HLO fusion instructions of the compiled program (XLA:CPU compiles "
        "each distinct one once, so identical unrolled layers share their kernels). "
        "Targets: scanned first call <= 0.3x unrolled; step within 1.1x. "
        "The 1-layer rows are the floor of a scanned program (it holds one layer).",
        "",
        "| pass | form | trace (s) | lower (s) | compile (s) | first call (s) | vs unrolled "
        "| CPU (s) | vs unrolled | fusions | step (s) | vs unrolled |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in ("fwd", "fwd+bwd"):
        u, us = mod["unrolled", mode]
        rows_ = [(form, *mod[form, mode]) for form in ("scanned", "unrolled")]
        rows_ += [(form, st, None) for (form, m), st in floor.items() if m == mode]
        for form, st, s in rows_:
            step = "" if s is None else f"{s:.4f} | {s / us:.3f}x"
            lines.append(
                f"| {mode} | {form} | {st['trace']:.2f} | {st['lower']:.2f} | "
                f"{st['compile']:.2f} | {st['first']:.2f} | {st['first'] / u['first']:.3f}x | "
                f"{st['cpu']:.2f} | {st['cpu'] / u['cpu']:.3f}x | {st['fusions']} | "
                + (step or " | ") + " |")
    lines += ["", f"Tiles visited per layer (non-empty {bq}x{bk} tiles): traced "
              f"{tiles_traced}; static {tiles_static}; "
              f"{'equal' if tiles_traced == tiles_static else 'DIFFERENT'}.", ""]
    text = "\n".join(lines)
    print(text)
    out = a.out or os.path.join(HERE, "results", f"traced_window_{dev.platform}.md")
    with open(out, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
