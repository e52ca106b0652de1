"""What building the block-sparse schedule of a document mask costs, by sequence length.

A mask holding arrays (segment ids of packed documents, here) has its tile
classes and the kernels' visiting tables computed in XLA at every call, so that
a new packing does not recompile. This times, under ``jax.jit`` on this
machine, for causal attention within packed documents (mean length
``--doc``) at tiles of 128 x 128:

* ``classes``: :func:`fnattn.masks.block_classes` alone;
* ``xla flash``: the classes and the XLA flash lowering's FULL and PARTIAL
  schedules (:func:`fnattn.flash.blocks.schedule`, forward);
* ``triton``: the classes and the Triton kernels' table, forward;
* ``mosaic gpu fwd`` / ``bwd``: the Mosaic GPU kernels' visiting tables
  (:func:`fnattn.flash.mosaic_gpu.dynamic_schedule`, the backward's transposed);
* ``... (sort)``: the same tables with each row ordered by a sort, as fnattn
  built them before :func:`fnattn.flash.blocks.ranked_order`: the baseline of
  the same run;
* ``jax.nn fwd``: ``jax.nn.dot_product_attention`` (causal, B=1, H=8, D=64,
  float32) at the same T, up to ``--jaxnn-max`` (its (T, T) logits), for scale.

    python benchmarks/schedule.py                         # T = 8k ... 256k
    python benchmarks/schedule.py --ts 8192,131072 --reps 5
    python benchmarks/schedule.py --lowered               # programs for cuda, causal
    python benchmarks/schedule.py --lowered --platform tpu --ts 1048576

``--lowered`` instead lowers causal ``fnattn.attention`` (B=1, H=8, D=128,
bfloat16) and its gradient for "cuda" or "tpu" (``--platform``; on any machine:
an abstract H100 or TPU v5e) at each T, and reports the StableHLO text's size
and the trace + lower time, with the tables of an array-free mask embedded up to
:data:`fnattn.flash.blocks.EMBEDDED_TILES` tiles (fnattn's rule) and embedded
whatever their size (the rule before it), in the same run.

Writes ``results/schedule_<device>.md``, or with ``--lowered``
``results/schedule_lowered_<platform>.md`` (``--out``).
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fnattn import masks  # noqa: E402
from fnattn._checks import Dims  # noqa: E402
from fnattn.flash import blocks, mosaic_gpu, triton  # noqa: E402

TILE = 128


def sorted_order(xp, rank, ranks):
    """The baseline: each row's columns by rank, then column, with a sort."""
    n = rank.shape[-1]
    return xp.argsort(rank * n + xp.arange(n, dtype=np.int32), axis=-1).astype(np.int32)


def documents(T, mean, seed=0):
    """(1, T) int32 ids of packed documents, about ``mean`` tokens each."""
    rs = np.random.default_rng(seed)
    cuts = np.sort(rs.choice(np.arange(1, T), max(T // mean - 1, 0), replace=False))
    return jnp.asarray(np.searchsorted(cuts, np.arange(T), side="right")[None], jnp.int32)


def passes(T, H):
    """``{name: f(mask)}``: each schedule pass, jitted."""
    d = Dims(1, T, T, H, H, 64, 64)

    def classes(m):
        return masks.block_classes(m, 1, H, T, T, TILE, TILE)

    return {
        "classes": classes,
        "xla flash": lambda m: blocks.schedule(classes(m)),
        "triton": lambda m: triton._table(jnp, blocks.schedule, classes(m), False, 1),
        "mosaic gpu fwd": lambda m: mosaic_gpu.dynamic_schedule(m, d, None, TILE, TILE),
        "mosaic gpu bwd": lambda m: mosaic_gpu.dynamic_schedule(m, d, None, TILE, TILE,
                                                                transpose=True),
    }


def timed(f, args, reps):
    """Median and minimum seconds of ``reps`` calls after a first (compiling) one."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts)


DEVICES = {"cuda": ("NVIDIA H100 80GB HBM3", 132, "gpu"), "tpu": ("TPU v5 lite", 1, "tpu")}


def target(platform):
    """A context in which a program lowers for ``platform`` ("cuda" or "tpu")
    without such a device: an abstract mesh of one abstract H100 or TPU v5e (a
    nullcontext on a JAX without them)."""
    import contextlib
    kind, cores, name = DEVICES[platform]
    try:
        dev = jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform=name)
        mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                         abstract_device=dev)
    except (AttributeError, TypeError):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


def lowered_sizes(T, embedded, platform="cuda"):
    """``[(program, MB of StableHLO text, seconds to trace and lower)]`` of causal
    attention and its gradient lowered for ``platform`` at ``T``; ``embedded``
    (tiles): the limit of :data:`fnattn.flash.blocks.EMBEDDED_TILES` to lower with."""
    import fnattn
    from fnattn import AttentionSpec
    spec = AttentionSpec(mask=masks.causal())
    q = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16)
    programs = {"forward": lambda q: fnattn.attention(spec, q, q, q).out,
                "gradient": jax.grad(lambda q: fnattn.attention(spec, q, q, q).out.astype(
                    jnp.float32).sum())}
    real, blocks.EMBEDDED_TILES = blocks.EMBEDDED_TILES, embedded
    out = []
    try:
        for name, f in programs.items():
            jax.clear_caches()
            with target(platform):
                start = time.perf_counter()
                text = jax.jit(f).trace(q).lower(lowering_platforms=(platform,)).as_text()
                out.append((name, len(text) / 2**20, time.perf_counter() - start))
    finally:
        blocks.EMBEDDED_TILES = real
        jax.clear_caches()
    return out


def main_lowered(args):
    platform = args.platform
    lowered_sizes(2048, blocks.EMBEDDED_TILES, platform)   # (warm: the first lowering imports)
    start = time.time()
    lines = [f"# Causal attention lowered for {platform}: the program's size and time", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- jax: {jax.__version__}; lowered on {jax.devices()[0].platform} for an abstract "
             f"{DEVICES[platform][0]}",
             f"- command: `python benchmarks/schedule.py {' '.join(args.argv)}`",
             "- fnattn.attention, causal, B = 1, H = 8, D = 128, bfloat16 (the "
             f"{'Triton' if platform == 'cuda' else 'Mosaic TPU'} kernels); "
             "MB: the StableHLO text; s: trace and lower, after jax.clear_caches(); embedded: "
             f"array-free masks' tables embedded up to {blocks.EMBEDDED_TILES} tiles (now); "
             "always: embedded whatever their size (before)", "",
             "| T | program | embedded MB | embedded s | always MB | always s |",
             "|---|---|---|---|---|---|"]
    for T in (int(t) for t in args.ts.split(",")):
        now = lowered_sizes(T, blocks.EMBEDDED_TILES, platform)
        before = lowered_sizes(T, float("inf"), platform)
        for (name, mb, s), (_, mb0, s0) in zip(now, before):
            lines.append(f"| {T} | {name} | {mb:.2f} | {s:.2f} | {mb0:.2f} | {s0:.2f} |")
            print(lines[-1], flush=True)
    lines.insert(4, f"- took {(time.time() - start) / 60:.1f} min")
    out = args.out or os.path.join(HERE, "results", f"schedule_lowered_{platform}")
    with open(out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {out}.md")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ts", default="8192,32768,65536,131072,262144")
    ap.add_argument("--doc", type=int, default=1024, help="mean document length")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--jaxnn-max", type=int, default=8192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--lowered", action="store_true",
                    help="program sizes lowered for --platform instead of the tables' times")
    ap.add_argument("--platform", choices=("cuda", "tpu"), default="cuda")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.lowered:
        return main_lowered(args)
    dev = jax.devices()[0]
    start = time.time()
    rows = []
    for T in (int(t) for t in args.ts.split(",")):
        ids = documents(T, args.doc)
        mask = masks.causal() & masks.segments(ids, ids)
        timings = {}
        for name, f in passes(T, args.heads).items():
            timings[name] = timed(jax.jit(f), (mask,), args.reps)
        # The baseline: fresh functions (JAX caches a traced function by its
        # identity), traced with the sort in place of blocks.ranked_order,
        # which the modules call through their reference to blocks.
        real, blocks.ranked_order = blocks.ranked_order, sorted_order
        try:
            jax.clear_caches()
            for name, f in passes(T, args.heads).items():
                if name != "classes":
                    timings[name + " (sort)"] = timed(jax.jit(f), (mask,), args.reps)
        finally:
            blocks.ranked_order = real
            jax.clear_caches()
        if T <= args.jaxnn_max:
            q = jax.random.normal(jax.random.key(0), (1, T, 8, 64), jnp.float32)
            f = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True))
            timings["jax.nn fwd"] = timed(f, (q,), args.reps)
        table = jax.eval_shape(passes(T, args.heads)["mosaic gpu fwd"], mask)
        names = [n for p in passes(T, args.heads) for n in (p, p + " (sort)")] + ["jax.nn fwd"]
        for name in (n for n in names if n in timings):
            med, low = timings[name]
            base = timings.get(name + " (sort)")
            rows.append((T, T // TILE, name, med * 1e3, low * 1e3,
                         f"{base[0] / med:.2f}x" if base else "",
                         table.size * 4 / 2**20 if name == "mosaic gpu fwd" else None))
            print(rows[-1], flush=True)
    write(rows, args, dev, time.time() - start)


def write(rows, args, dev, elapsed):
    name = dev.device_kind.replace(" ", "_") if dev.platform != "cpu" else "cpu"
    out = args.out or os.path.join(HERE, "results", f"schedule_{name}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# The block-sparse schedule of a document mask, by sequence length", "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- device: {dev.platform} ({dev.device_kind}, {os.cpu_count()} CPUs visible, load "
        f"average {load:.1f} at the end)",
        f"- jax: {jax.__version__}",
        f"- command: `python benchmarks/schedule.py {' '.join(args.argv)}` "
        f"({elapsed / 60:.1f} min)",
        f"- causal within packed documents of about {args.doc} tokens, B = 1, H = "
        f"{args.heads} (the classes do not depend on the head), tiles {TILE} x {TILE}; "
        "time: median (and minimum) of the calls after compilation; sort ÷ this: the "
        "same pass with each table row ordered by a sort (the previous implementation), "
        "over this row's time; table MB: the Mosaic GPU forward's visiting table",
        "",
        "| T | tiles per axis | pass | ms | min ms | sort ÷ this | table MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for T, n, pname, med, low, ratio, mb in rows:
        lines.append(f"| {T} | {n} | {pname} | {med:.2f} | {low:.2f} | {ratio} | "
                     f"{'' if mb is None else f'{mb:.1f}'} |")
    with open(out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {out}.md")


if __name__ == "__main__":
    main()
