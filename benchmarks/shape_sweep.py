"""Shape sweep: fnattn against ``jax.nn.dot_product_attention`` cell by cell.

Every cell (T, H, D, heads grouping, mask, dtype, pass) runs in *one* process:
``jax.nn.dot_product_attention(implementation="xla")`` and fnattn's entry
points are compiled side by side and then timed interleaved (round after
round, the order rotating), so the load of a shared machine falls on all of
them alike; each figure is the median of ``--reps`` rounds, each round timing
enough back-to-back calls to last ``--min-ms``. The ratio is jax.nn's time
over fnattn's (above 1: fnattn is faster). Peak memory is XLA's own figure for
the compiled program (temporary plus output buffers,
``compiled.memory_analysis()``).

    python benchmarks/shape_sweep.py                     # the default grid (see --help)
    python benchmarks/shape_sweep.py --ts 32,197 --hs 8 --ds 64 --dtypes float32
    python benchmarks/shape_sweep.py --no-sweep --decode-bs 1,8 --decode-ss 128,1024
    python benchmarks/shape_sweep.py --device gpu        # the same on a GPU (+ jax.nn cudnn)

Entries (``--entries``): ``attention`` is ``fnattn.attention`` with
``AttentionSpec(impl="auto")``, ``nn`` is ``fnattn.dot_product_attention``
(``implementation=None``), each with the mask of the cell. ``--floors`` adds
the two programs fnattn chooses between on the CPU, each forced: ``dense``
(``impl="xla"``: the whole (T, T) logit matrix) and ``blockwise``
(``fnattn.flash`` with ``impl="xla"``: the online-softmax loops); a cell
below 1.0x is explained by these (the cheapest program of each kind).

Masks: ``none``, ``causal`` (``is_causal=True`` / ``masks.causal()``) and
``padding`` (key lengths T, 7T/8, 3T/4, 5T/8 cycling over the batch:
``key_value_seq_lengths`` / ``masks.lengths(kv_lengths=...)``). Tokens per
call are fixed (``--tokens``): B = tokens // T (at least 1). ``gqa`` has
H / 4 key/value heads. ``fwd+bwd`` is ``jax.grad`` of ``out.sum()`` with
respect to q, k and v.

Decode cells (``--decode-bs`` x ``--decode-ss``): one query token over S keys,
H = 32 query heads over 8 key/value heads, D = 128, forward; a cell whose
inputs and jax.nn's logits would not fit in ``--max-gib`` is reported with the
bytes it needs instead of run (24 GiB: the machine's memory).

Writes ``benchmarks/results/<out>.{md,csv}`` and a heat map ``<out>.png`` of the
ratios (matplotlib; ``--no-plot`` without it).
"""

import argparse
import csv
import datetime
import itertools
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
TS = (16, 32, 64, 128, 197, 256, 512, 1024, 2048, 4096, 8192)
ENTRIES = ("attention", "nn")
FLOORS = ("dense", "blockwise")
MASKS = ("none", "causal", "padding")
GIB = 2 ** 30


def _ints(s):
    return tuple(int(x.replace("k", "")) * (1024 if x.endswith("k") else 1)
                 for x in s.split(",") if x)


def _strs(s):
    return tuple(x for x in s.split(",") if x)


def kv_lengths(B, T):
    """The padding cells' key lengths: T, 7T/8, 3T/4, 5T/8 cycling over the batch."""
    import numpy as np
    return np.array([T - (b % 4) * T // 8 for b in range(B)], np.int32)


def _functions(names, mask, T, causal_ok=True, gpu=False):
    """``name -> f(q, k, v, lengths)`` for jax.nn and each fnattn entry."""
    import jax

    import fnattn
    from fnattn import AttentionSpec, masks

    def fn_mask(lengths):
        if mask == "causal":
            return masks.causal()
        if mask == "padding":
            return masks.lengths(kv_lengths=lengths)
        return None

    def jnn(which):
        def f(q, k, v, lengths):
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=mask == "causal", implementation=which,
                key_value_seq_lengths=lengths if mask == "padding" else None)
        return f

    def spec_fn(entry, impl):
        def f(q, k, v, lengths):
            return entry(AttentionSpec(mask=fn_mask(lengths), impl=impl), q, k, v).out
        return f

    def nn(q, k, v, lengths):
        return fnattn.dot_product_attention(
            q, k, v, is_causal=mask == "causal",
            key_value_seq_lengths=lengths if mask == "padding" else None)

    table = {"jax.nn": jnn("xla"), "attention": spec_fn(fnattn.attention, "auto"), "nn": nn,
             "dense": spec_fn(fnattn.attention, "xla"),
             "blockwise": spec_fn(fnattn.flash, "xla")}
    if gpu:
        table["jax.nn:cudnn"] = jnn("cudnn")
    return {n: table[n] for n in names}


def _lowering(B, T, S, H, K, D, dtype, mask):
    """The name of the lowering impl="auto" takes on the CPU for this cell."""
    try:
        from fnattn.flash import api
        from fnattn._checks import Dims
    except ImportError:
        return "?"
    choose = getattr(api, "default_choice", None)
    if choose is None:
        return "blockwise"
    return choose(Dims(B, T, S, H, K, D, D), dtype)


def _time(compiled, args, min_ms):
    """Seconds per call: back-to-back calls lasting at least ``min_ms``."""
    import jax
    n, t = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            out = compiled(*args)
        jax.block_until_ready(out)
        t = time.perf_counter() - t0
        if t * 1e3 >= min_ms or n >= 1 << 12:
            return t / n, n
        n = max(n * 2, int(n * min_ms / max(t * 1e3, 1e-3)) + 1)


def measure(fns, args, mode, reps, min_ms):
    """``name -> dict(time_s, mb, compile_s)``, timed interleaved, medians of ``reps``."""
    import jax
    import jax.numpy as jnp

    compiled, info = {}, {}
    for name, f in fns.items():
        if mode == "fwd":
            g = jax.jit(f)
        else:
            def loss(q, k, v, lengths, f=f):
                return f(q, k, v, lengths).astype(jnp.float32).sum()
            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        t0 = time.perf_counter()
        try:
            c = g.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - a failing cell is reported, not fatal
            info[name] = dict(status=f"error: {type(e).__name__}: {str(e)[:120]}")
            continue
        comp = time.perf_counter() - t0
        try:
            ma = c.memory_analysis()
            mb = (ma.temp_size_in_bytes + ma.output_size_in_bytes) / 2**20
        except Exception:  # noqa: BLE001 - not every backend reports it
            mb = float("nan")
        jax.block_until_ready(c(*args))  # warm-up
        compiled[name] = c
        info[name] = dict(status="ok", mb=mb, compile_s=comp, times=[])
    names = list(compiled)
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        for name in order:
            info[name]["times"].append(_time(compiled[name], args, min_ms)[0])
    for name in names:
        info[name]["time_s"] = statistics.median(info[name].pop("times"))
    return info


def sweep_cells(a):
    for (T, H, D, group, mask, dtype) in itertools.product(
            a.ts, a.hs, a.ds, a.groups, a.masks, a.dtypes):
        if T >= a.big_t and (H, D) != (a.hs[0], a.ds[0]):
            continue  # long sequences: the first head shape only (see --big-t)
        for mode in a.passes:
            yield dict(T=T, H=H, D=D, group=group, mask=mask, dtype=dtype, mode=mode)


def run_cell(cell, a, names):
    import jax
    import jax.numpy as jnp
    import numpy as np

    T, H, D = cell["T"], cell["H"], cell["D"]
    B = max(1, a.tokens // T)
    K = H // 4 if cell["group"] == "gqa" else H
    dtype = jnp.dtype(cell["dtype"])
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, D)), dtype) for _ in range(2))
    lengths = jnp.asarray(kv_lengths(B, T))
    fns = _functions(names, cell["mask"], T, gpu=a.device == "gpu")
    info = measure(fns, (q, k, v, lengths), cell["mode"], a.reps, a.min_ms)
    row = dict(cell, B=B, K=K, lowering=_lowering(B, T, T, H, K, D, dtype, cell["mask"]))
    base = info.get("jax.nn", {})
    for name in names:
        i = info.get(name, {})
        row[f"{name}_status"] = i.get("status", "missing")
        row[f"{name}_ms"] = i.get("time_s", float("nan")) * 1e3
        row[f"{name}_mb"] = i.get("mb", float("nan"))
        row[f"{name}_compile_s"] = i.get("compile_s", float("nan"))
        if name != "jax.nn" and "time_s" in i and "time_s" in base:
            row[f"{name}_x"] = base["time_s"] / i["time_s"]
    del jax
    return row


def decode_cells(a):
    for B, S in itertools.product(a.decode_bs, a.decode_ss):
        for dtype in a.dtypes:
            yield dict(B=B, S=S, dtype=dtype)


def decode_bytes(B, S, dtype, H=32, K=8, D=128):
    """Bytes a decode cell holds at once: q, k, v, out and jax.nn's f32 logits (x2)."""
    import numpy as np
    item = np.dtype("float32").itemsize if dtype == "float32" else 2
    return (2 * B * S * K * D + 2 * B * H * D) * item + 2 * 4 * B * H * S


def run_decode(cell, a, names):
    import jax.numpy as jnp
    import numpy as np

    B, S = cell["B"], cell["S"]
    H, K, D = 32, 8, 128
    need = decode_bytes(B, S, cell["dtype"])
    row = dict(cell, H=H, K=K, D=D, need_gib=need / GIB)
    if need > a.max_gib * GIB:
        row["status"] = (f"does not fit in 24 GiB: needs {need / GIB:.1f} GiB" if need > 24 * GIB
                         else f"not run: needs {need / GIB:.1f} GiB > --max-gib {a.max_gib:g}")
        return row
    dtype = jnp.dtype(cell["dtype"])
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, 1, H, D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, D)), dtype) for _ in range(2))
    lengths = jnp.asarray(kv_lengths(B, S))
    fns = _functions(names, "none", 1, gpu=a.device == "gpu")
    info = measure(fns, (q, k, v, lengths), "fwd", a.reps, a.min_ms)
    row["status"] = "ok"
    base = info.get("jax.nn", {})
    for name in names:
        i = info.get(name, {})
        row[f"{name}_ms"] = i.get("time_s", float("nan")) * 1e3
        row[f"{name}_mb"] = i.get("mb", float("nan"))
        if name != "jax.nn" and "time_s" in i and "time_s" in base:
            row[f"{name}_x"] = base["time_s"] / i["time_s"]
    return row


def _fmt(x, spec=".2f"):
    return "" if x is None or x != x else format(x, spec)


def markdown(rows, drows, names, a, header):
    lines = list(header)
    ours = [n for n in names if n != "jax.nn"]
    if rows:
        cols = ["T", "B", "H", "Hkv", "D", "mask", "dtype", "pass", "lowering", "jax.nn ms"]
        for n in ours:
            cols += [f"{n} ms", f"{n} x"]
        cols += ["jax.nn MB"] + [f"{n} MB" for n in ours]
        lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            vals = [r["T"], r["B"], r["H"], r["K"], r["D"], r["mask"], r["dtype"], r["mode"],
                    r["lowering"], _fmt(r["jax.nn_ms"], ".3f")]
            for n in ours:
                x = r.get(f"{n}_x")
                bold = x is not None and x < 1.0
                vals += [_fmt(r[f"{n}_ms"], ".3f"),
                         (f"**{x:.2f}**" if bold else _fmt(x)) if x is not None
                         else r[f"{n}_status"]]
            vals += [_fmt(r["jax.nn_mb"], ".1f")] + [_fmt(r[f"{n}_mb"], ".1f") for n in ours]
            lines.append("| " + " | ".join(str(v) for v in vals) + " |")
    if drows:
        cols = ["B", "S", "dtype", "needs GiB", "jax.nn ms"]
        for n in ours:
            cols += [f"{n} ms", f"{n} x"]
        cols += ["jax.nn MB"] + [f"{n} MB" for n in ours]
        lines += ["", "Decode (one query token; H=32 over 8 KV heads, D=128, forward):", "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in drows:
            if r["status"] != "ok":
                lines.append(f"| {r['B']} | {r['S']} | {r['dtype']} | {r['need_gib']:.2f} | "
                             f"{r['status']} |" + " |" * (len(cols) - 5))
                continue
            vals = [r["B"], r["S"], r["dtype"], _fmt(r["need_gib"]), _fmt(r["jax.nn_ms"], ".3f")]
            for n in ours:
                x = r.get(f"{n}_x")
                vals += [_fmt(r.get(f"{n}_ms"), ".3f"),
                         (f"**{x:.2f}**" if x is not None and x < 1.0 else _fmt(x))]
            vals += [_fmt(r.get("jax.nn_mb"), ".1f")] + [_fmt(r.get(f"{n}_mb"), ".1f")
                                                         for n in ours]
            lines.append("| " + " | ".join(str(v) for v in vals) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, path, entry="attention"):
    """Heat map of jax.nn time / fnattn time: one panel per pass, a row per
    (H, Hkv, D, mask, dtype), a column per T."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = sorted({r["mode"] for r in rows}, key=("fwd", "fwd+bwd").index)
    ts = sorted({r["T"] for r in rows})
    keys = sorted({(r["H"], r["K"], r["D"], r["mask"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(3 + 0.7 * len(ts) * len(modes),
                                                      1.5 + 0.28 * len(keys)), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        grid = np.full((len(keys), len(ts)), np.nan)
        for r in rows:
            if r["mode"] == mode and r.get(f"{entry}_x") is not None:
                grid[keys.index((r["H"], r["K"], r["D"], r["mask"], r["dtype"])),
                     ts.index(r["T"])] = r[f"{entry}_x"]
        im = ax.imshow(np.log2(grid), cmap="RdYlGn", vmin=-1.5, vmax=1.5, aspect="auto")
        for (i, j), x in np.ndenumerate(grid):
            if x == x:
                ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(ts)), [str(t) for t in ts], fontsize=7)
        ax.set_yticks(range(len(keys)), [f"H{h}/{k} D{d} {m} {dt[:4]}"
                                         for h, k, d, m, dt in keys], fontsize=6)
        ax.set_xlabel("T")
        ax.set_title(f"{mode}: jax.nn time / fnattn.{entry} time", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="log2 ratio (green: fnattn faster)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ts", type=_ints, default=TS, help="sequence lengths (1k = 1024)")
    p.add_argument("--hs", type=_ints, default=(8, 32), help="query heads")
    p.add_argument("--ds", type=_ints, default=(64, 128), help="head dims")
    p.add_argument("--groups", type=_strs, default=("mha", "gqa"), help="mha, gqa (H/4 kv heads)")
    p.add_argument("--masks", type=_strs, default=MASKS, help=",".join(MASKS))
    p.add_argument("--dtypes", type=_strs, default=("float32", "bfloat16"))
    p.add_argument("--passes", type=_strs, default=("fwd", "fwd+bwd"))
    p.add_argument("--entries", type=_strs, default=ENTRIES, help=",".join(ENTRIES))
    p.add_argument("--floors", action="store_true",
                   help="also time the dense and the blockwise program, each forced")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per call (B * T)")
    p.add_argument("--big-t", type=int, default=2048,
                   help="from this T on, only the first of --hs and --ds (long cells are slow)")
    p.add_argument("--reps", type=int, default=5, help="interleaved rounds per cell (median)")
    p.add_argument("--min-ms", type=float, default=20.0, help="least duration of one timing")
    p.add_argument("--decode-bs", type=_ints, default=(1, 8, 64, 256))
    p.add_argument("--decode-ss", type=_ints, default=(128, 1024, 8192, 32768))
    p.add_argument("--max-gib", type=float, default=24.0,
                   help="decode cells needing more are reported, not run")
    p.add_argument("--no-sweep", action="store_true", help="decode cells only")
    p.add_argument("--no-decode", action="store_true", help="no decode cells")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--out", default=None, help="results/<out>.{md,csv,png}")
    a = p.parse_args(argv)
    bad = [e for e in a.entries if e not in ENTRIES]
    if bad:
        p.error(f"--entries: unknown {bad}; choose from {list(ENTRIES)}")
    bad = [m for m in a.masks if m not in MASKS]
    if bad:
        p.error(f"--masks: unknown {bad}; choose from {list(MASKS)}")
    return a


def main(argv=None):
    a = parse(argv)
    import jax
    jax.config.update("jax_platforms", a.device)
    names = ["jax.nn", *a.entries, *(FLOORS if a.floors else ())]
    if a.device == "gpu":
        names.append("jax.nn:cudnn")
    t_start = time.time()
    rows, drows = [], []
    cells = [] if a.no_sweep else list(sweep_cells(a))
    for i, cell in enumerate(cells):
        rows.append(run_cell(cell, a, names))
        r = rows[-1]
        print(f"[{i + 1}/{len(cells)}] " + " ".join(f"{k}={r[k]}" for k in cell) +
              f" {r['lowering']} " + " ".join(f"{n}={r.get(n + '_x', float('nan')):.2f}x"
                                              for n in names[1:]), flush=True)
    for cell in ([] if a.no_decode else decode_cells(a)):
        drows.append(run_decode(cell, a, names))
        r = drows[-1]
        print("decode", r["B"], r["S"], r["dtype"], r["status"],
              " ".join(f"{n}={r.get(n + '_x', float('nan')):.2f}x" for n in names[1:]),
              flush=True)
    dev = jax.devices()[0]
    out = a.out or f"shape_sweep_{a.device}"
    header = [
        "# Shape sweep: fnattn against jax.nn.dot_product_attention (implementation='xla')", "",
        f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"- machine: {dev.device_kind} ({dev.platform}); {platform.processor() or platform.machine()}"
        f", {os.cpu_count()} CPUs visible, shared",
        f"- jax {jax.__version__}, Python {platform.python_version()}",
        f"- command: `python benchmarks/shape_sweep.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
        f" ({(time.time() - t_start) / 60:.1f} min)",
        f"- {a.tokens} tokens per call (B = tokens // T); every cell in one process, its programs"
        f" timed interleaved, median of {a.reps} rounds of >= {a.min_ms:g} ms each",
        "- x = jax.nn's time / fnattn's (above 1: fnattn faster; bold: below 1);"
        " MB = XLA's temp + output bytes of the compiled program",
        "- attention = fnattn.attention(AttentionSpec(impl='auto')), nn = "
        "fnattn.dot_product_attention; dense / blockwise = the two CPU programs, forced",
        f"- 1-minute load average at the end: {os.getloadavg()[0]:.2f}",
    ]
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, out)
    with open(base + ".md", "w") as f:
        f.write(markdown(rows, drows, names, a, header))
    allrows = rows + [dict(r, kind="decode") for r in drows]
    if allrows:
        keys = sorted({k for r in allrows for k in r})
        with open(base + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(allrows)
    if rows and not a.no_plot:
        plot(rows, base + ".png")
    print(f"wrote {base}.md")
    return rows, drows


if __name__ == "__main__":
    main()
