"""fnattn's entry points called outside ``jax.jit``, next to ``jax.nn.dot_product_attention``.

Notebook and script code often calls a function without ``jit``. Each entry
point is timed on its first eager call (tracing and compiling included), then
on five more eager calls with new arrays of the same shapes (the median), and
against the same call under ``jax.jit`` (compiled beforehand, the median of
five): ``eager / jit`` is the price of calling outside ``jit``.

    python benchmarks/eager.py                   # writes results/eager_<platform>.md
    python benchmarks/eager.py --out NAME        # results/NAME.md

Rows: ``fnattn.attention`` (causal; packed documents with sinks),
``fnattn.decode`` (GQA, ragged lengths), ``fnattn.paged_attention`` (pages of
16), an eager ``jax.grad`` and ``jax.vmap`` (over the batch) of the causal
attention, and ``jax.nn.dot_product_attention`` (causal) and its ``jax.grad``,
all float32 on the default device. ``--fnattn PATH`` imports fnattn from another checkout (to time a
version before a change in the same run of this script).
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def cases(jax, jnp, np, fnattn, small=False):
    """(name, make(seed) -> args, fn(*args)) per row (``small``: tiny shapes)."""
    from fnattn import AttentionSpec, masks

    B, T, Hq, Hkv, D = (2, 64, 4, 2, 8) if small else (2, 1024, 8, 2, 64)
    S, P = (128, 16) if small else (4096, 16)

    def normal(r, *shape):
        return jnp.asarray(r.standard_normal(shape), jnp.float32)

    def dense(seed):
        r = np.random.default_rng(seed)
        return normal(r, B, T, Hq, D), normal(r, B, T, Hkv, D), normal(r, B, T, Hkv, D)

    def documents(seed):
        r = np.random.default_rng(seed)
        ids = jnp.asarray(np.sort(r.integers(0, 4, (B, T)), 1), jnp.int32)
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids),
                             sinks=normal(r, Hq))
        return (spec,) + dense(seed)

    def decode(seed):
        r = np.random.default_rng(seed)
        lengths = jnp.asarray(r.integers(1, S, (4,)), jnp.int32)
        return (normal(r, 4, 1, Hq, D), normal(r, 4, S, Hkv, D), normal(r, 4, S, Hkv, D),
                lengths)

    def paged(seed):
        r = np.random.default_rng(seed)
        pages = 4 * S // P
        table = jnp.asarray(r.permutation(pages).reshape(4, S // P), jnp.int32)
        lengths = jnp.asarray(r.integers(1, S, (4,)), jnp.int32)
        return (normal(r, 4, 1, Hq, D), normal(r, Hkv, pages, P, D), normal(r, Hkv, pages, P, D),
                table, lengths)

    causal = AttentionSpec(mask=masks.causal())
    return [
        ("fnattn.attention, causal", dense,
         lambda q, k, v: fnattn.attention(causal, q, k, v).out),
        ("fnattn.attention, documents + sinks", documents,
         lambda s, q, k, v: fnattn.attention(s, q, k, v).out),
        ("fnattn.decode", decode,
         lambda q, k, v, L: fnattn.decode(causal, q, k, v, kv_lengths=L).out),
        ("fnattn.paged_attention", paged,
         lambda q, k, v, t, L: fnattn.paged_attention(causal, q, k, v, page_table=t,
                                                      kv_lengths=L).out),
        ("jax.grad of fnattn.attention, causal", dense,
         lambda q, k, v: jax.grad(lambda q: fnattn.attention(causal, q, k, v).out.sum())(q)),
        ("jax.vmap of fnattn.attention, causal", dense,
         lambda q, k, v: jax.vmap(lambda q, k, v: fnattn.attention(
             causal, q[None], k[None], v[None]).out)(q, k, v)),
        ("jax.nn.dot_product_attention, causal", dense,
         lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
        ("jax.grad of jax.nn.dot_product_attention, causal", dense,
         lambda q, k, v: jax.grad(lambda q: jax.nn.dot_product_attention(
             q, k, v, is_causal=True).sum())(q)),
    ]


def timed(jax, fn, args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="results/<name>.md (default: eager_<platform>)")
    ap.add_argument("--fnattn", default=None, help="a checkout to import fnattn from")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a check of the script)")
    args = ap.parse_args(argv)
    if args.fnattn:
        sys.path.insert(0, os.path.abspath(args.fnattn))
    import jax
    import jax.numpy as jnp
    import numpy as np

    import fnattn

    rows = []
    for name, make, fn in cases(jax, jnp, np, fnattn, small=args.small):
        first = timed(jax, fn, make(0))
        again = statistics.median(timed(jax, fn, make(seed)) for seed in range(1, 6))
        jitted = jax.jit(fn)
        timed(jax, jitted, make(0))
        steady = statistics.median(timed(jax, jitted, make(seed)) for seed in range(1, 6))
        rows.append((name, first, again, steady))
        print(f"{name}: first {first:.3f} s, again {again * 1e3:.2f} ms, "
              f"jit {steady * 1e3:.2f} ms", flush=True)
    dev = jax.devices()[0]
    source = os.path.dirname(os.path.dirname(os.path.abspath(fnattn.__file__)))
    lines = [
        f"# fnattn's entry points outside jit on {dev.device_kind} ({dev.platform})", "",
        (f"`python benchmarks/eager.py {' '.join(argv or sys.argv[1:])}`; jax {jax.__version__}; "
        f"fnattn from `{source}`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        + ("tiny shapes. " if args.small else
           "float32; attention B=2 T=1024 Hq=8 Hkv=2 D=64; decode and paged B=4 S=4096 "
           "(pages of 16). ")
        + "first: the first eager call (trace and compile included); "
        "again: the median of 5 eager calls with new arrays; jit: the median of 5 "
        "calls of the jitted function."), "",
        "| call | first (s) | again (ms) | jit (ms) | again / jit |",
        "|---|---|---|---|---|"]
    for name, first, again, steady in rows:
        lines.append(f"| {name} | {first:.3f} | {again * 1e3:.2f} | {steady * 1e3:.2f} "
                     f"| {again / steady:.1f} |")
    name = args.out or f"eager_{dev.platform}"
    path = name + ".md" if os.sep in name else os.path.join(HERE, "results", name + ".md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
