"""The XLA decode lowering's "mixed" and "reduce" forms on this machine.

    python benchmarks/decode_forms.py                  # the grid behind xla.choose's CPU rule
    python benchmarks/decode_forms.py --quick          # a few rows
    python benchmarks/decode_forms.py --forms mixed,dot,mixed/1 --grid 1x32768x2x7x64

``fnattn.decoding.xla.choose`` picks, for a few query rows per kv head, between
the "mixed" form (logits by a batched product) and the "reduce" form (logits
by a multiply-reduce, which reads K in place on a CPU). This script times both
on the same compiled call of ``fnattn.decode`` (causal, one query token, float32
unless ``--dtype``), alternating them three times per row (the median of
each), next to ``jax.nn.dot_product_attention`` with ``key_value_seq_lengths``
in the same run, with XLA's temporary bytes for each. Results go to
``results/decode_forms_<device>.md``. ``--forms`` names other forms to time
("dot", the third), and ``form/n`` a form held to ``n`` splits of the cache.
"""

import argparse
import itertools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import fnattn
from fnattn import AttentionSpec, masks
from fnattn.decoding import xla

HERE = os.path.dirname(os.path.abspath(__file__))


def median_time(f, args, n=5):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def compiled(form, spec, args):
    """``fnattn.decode`` compiled with its XLA lowering held to ``form`` (None:
    its own choice; ``"mixed/1"``: the form with one split, where the rule's
    split count is otherwise kept)."""
    original = xla.choose
    if form is not None:
        name, _, splits = form.partition("/")

        def choose(cfg, rows, cache_len, **kw):
            ns = original(cfg, rows, cache_len, **kw)[1]
            return name, int(splits) if splits else ns
        xla.choose = choose
    try:
        f = jax.jit(lambda q, k, v, L: fnattn.decode(spec, q, k, v, kv_lengths=L).out)
        return f.lower(*args).compile()
    finally:
        xla.choose = original


def row(dtype, B, S, Hkv, R, D, rounds=3, forms=("mixed", "reduce")):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, 1, Hkv * R, D), dtype)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), dtype)
    L = jnp.full((B,), S - 3, jnp.int32)
    args = (q, k, v, L)
    spec = AttentionSpec(mask=masks.causal(), impl="xla")
    cfg = fnattn.decoding.api.Cfg(scale=1.0, softcap=None, mask_treedef=None, num_splits=None)
    chosen = xla.choose(cfg, R, S, batch=B, kv_heads=Hkv, dtype=dtype, cpu=True)[0]
    forms = tuple(forms)
    # (the form the rule picks is timed too, for the ratio to jax.nn)
    calls = {form: compiled(form, spec, args) for form in dict.fromkeys(forms + (chosen,))}
    calls["jax.nn"] = jax.jit(lambda q, k, v, L: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=L)).lower(*args).compile()
    times = {name: [] for name in calls}
    for c in calls.values():
        jax.block_until_ready(c(*args))
    for _ in range(rounds):
        for name, c in calls.items():
            times[name].append(median_time(c, args))
    t = {name: statistics.median(ts) for name, ts in times.items()}
    mem = {name: c.memory_analysis().temp_size_in_bytes / 2**20 for name, c in calls.items()}
    return dict(dtype=jnp.dtype(dtype).name, B=B, S=S, Hkv=Hkv, R=R, D=D, t=t, mem=mem,
                chosen=chosen, forms=forms)


def line(r):
    t, m, chosen = r["t"], r["mem"], r["chosen"]
    fastest = min(r["forms"], key=t.get)
    return ("| " + " | ".join(
        [r["dtype"], *(str(r[x]) for x in ("B", "S", "Hkv", "R", "D"))]
        + [f"{t[f] * 1e3:.2f}" for f in r["forms"]]
        + [f"{fastest} ({t[chosen] / t[fastest]:.2f})", f"{t['jax.nn'] * 1e3:.2f}",
           f"{t['jax.nn'] / t[chosen]:.2f}",
           " / ".join(f"{m[f]:.1f}" for f in (*r["forms"], "jax.nn")), chosen]) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="four rows")
    ap.add_argument("--out", default=None, help="results/<name>.md (default: by device)")
    ap.add_argument("--forms", default="mixed,reduce",
                    help="forms to time, comma-separated: mixed, reduce, dot, or form/n "
                         "for n splits of the cache")
    ap.add_argument("--grid", default=None,
                    help="rows BxSxHkvxRxD, comma-separated (instead of the whole grid)")
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    forms = tuple(args.forms.split(","))
    if args.grid:
        grid = [tuple(int(x) for x in item.split("x")) for item in args.grid.split(",")]
    elif args.quick:
        grid = [(1, 4096, 2, 4, 64), (4, 8192, 2, 4, 64), (8, 4096, 1, 4, 64),
                (4, 8192, 8, 2, 128)]
    else:
        grid = [(B, S, Hkv, R, D) for (B, S) in ((1, 4096), (1, 32768), (4, 8192), (8, 4096),
                                                 (8, 32768))
                for Hkv, R, D in itertools.product((1, 2, 4, 8), (2, 4, 7), (64, 128))
                if B * S * Hkv * D <= 8 * 32768 * 4 * 64]
    dev = jax.devices()[0]
    head = (f"# The XLA decode lowering's forms on {dev.device_kind} ({dev.platform})\n\n"
            f"`python benchmarks/decode_forms.py {' '.join(argv or sys.argv[1:])}`; jax "
            f"{jax.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
            "Causal, one query token, Hq = Hkv * R. Times in ms (the median of three "
            "alternating rounds of medians of 5 calls; `form/n`: held to n splits of the "
            "cache); fastest: the fastest of them, and how many times faster it is than "
            "the form `xla.choose` picks on a CPU (the last column); vs jax.nn: "
            "`jax.nn.dot_product_attention` time over the picked form's. Memory: XLA "
            f"temporaries, MB ({' / '.join(forms)} / jax.nn).\n\n"
            "| dtype | B | S | Hkv | R | D | " + " | ".join(forms)
            + " | fastest | jax.nn | vs jax.nn | temp MB | chosen |\n"
            + "|---" * (11 + len(forms)) + "|")
    print(head, flush=True)
    lines = []
    for B, S, Hkv, R, D in grid:
        lines.append(line(row(dtype, B, S, Hkv, R, D, forms=forms)))
        print(lines[-1], flush=True)
    name = args.out or f"decode_forms_{dev.platform}"
    path = name + ".md" if os.sep in name else os.path.join(HERE, "results", name + ".md")
    with open(path, "w") as fh:
        fh.write(head + "\n" + "\n".join(lines) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
