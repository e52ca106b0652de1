"""Top-k token selection (fnattn.selected_attention / selected_decode) against dense
attention over as many contiguous keys, on this machine.

    python benchmarks/selection.py                 # decode and a 4k-token prefill chunk
    python benchmarks/selection.py --quick         # smaller sizes, for a check

Each row times, in one run and alternating the calls ``--rounds`` times (the
median of each), the selected attention over K keys chosen from a T-key
context (one key from each run of T/K positions, at a random offset: spread
over the whole cache, as an indexer's picks are) against
``jax.nn.dot_product_attention`` over K contiguous keys (the target: the same
work, no gather), with XLA's temporary bytes of each compiled call. "sort"
is the default (repeated indices removed by a sort of each row),
"unique" passes ``unique=True`` (lax.top_k's indices). Decode also times an
int8 cache (fnattn.quant, per-token scales: the selected codes and scales
gathered, then dequantized) and an MLA latent cache (``value_dim = D / 2``, no
values: one gather). Results go to ``results/selection_<device>.md``.
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

import fnattn
from fnattn import AttentionSpec, quant

HERE = os.path.dirname(os.path.abspath(__file__))


def spread_indices(key, lead, T, K):
    """(*lead, K) distinct positions: one from each run of T // K."""
    stride = T // K
    off = jax.random.randint(key, lead + (K,), 0, stride)
    return (jnp.arange(K, dtype=jnp.int32) * stride + off).astype(jnp.int32)


def compile_(f, *args):
    return jax.jit(f).lower(*args).compile()


def row(name, B, Tq, T, K, Hq, Hkv, D, rounds, grad=False):
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, Tq, Hq, D))
    k = jax.random.normal(ks[1], (B, T, Hkv, D))
    v = jax.random.normal(ks[2], (B, T, Hkv, D))
    idx = spread_indices(ks[3], (B, Tq), T, K)
    spec = AttentionSpec()
    lengths = jnp.full((B,), T, jnp.int32)
    kc, vc = k[:, :K], v[:, :K]

    def dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v)

    if Tq == 1:
        def sel(unique):
            return lambda q, k, v, i: fnattn.selected_decode(spec, q, k, v, i, kv_lengths=lengths,
                                                             unique=unique).out
    else:
        def sel(unique):
            return lambda q, k, v, i: fnattn.selected_attention(spec, q, k, v, i,
                                                                unique=unique).out
    calls = {"jax.nn (K contiguous)": (dense, (q, kc, vc)),
             "selected, unique": (sel(True), (q, k, v, idx)),
             "selected, sort": (sel(False), (q, k, v, idx))}
    if Tq == 1 and not grad:
        kq, vq = quant.quantize(k, "int8"), quant.quantize(v, "int8")
        calls["selected int8 cache, unique"] = (sel(True), (q, kq, vq, idx))
        latent = lambda q, k, i: fnattn.selected_decode(  # noqa: E731
            spec, q, k, None, i, kv_lengths=lengths, value_dim=D // 2, unique=True).out
        calls["selected latent (value_dim=D/2), unique"] = (latent, (q, k, idx))
    if grad:
        calls = {f"{n} fwd+bwd": (jax.grad(lambda q, k, v, *r, f=f: jnp.sum(f(q, k, v, *r)),
                                           argnums=(0, 1, 2)), a)
                 for n, (f, a) in calls.items()}
    compiled = {n: (compile_(f, *a), a) for n, (f, a) in calls.items()}
    times = {n: [] for n in compiled}
    for c, a in compiled.values():
        jax.block_until_ready(c(*a))
    for _ in range(rounds):
        for n, (c, a) in compiled.items():
            t = time.perf_counter()
            jax.block_until_ready(c(*a))
            times[n].append(time.perf_counter() - t)
    base = statistics.median(next(iter(times.values())))
    out = []
    for n, (c, _) in compiled.items():
        med = statistics.median(times[n])
        temp = c.memory_analysis().temp_size_in_bytes
        out.append((name, n, med * 1e3, med / base, temp / 2 ** 20))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-rounds", type=int, default=41,
                   help="rounds of the decode rows (milliseconds each: more rounds, steadier)")
    p.add_argument("--grad", action="store_true", help="also forward+backward of the prefill")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.quick:
        shapes = [("decode B=2", 2, 1, 4096, 256, 16, 1, 64),
                  ("prefill 256", 1, 256, 4096, 256, 16, 1, 64)]
    else:
        shapes = [("decode B=4", 4, 1, 32768, 2048, 16, 1, 128),
                  ("prefill chunk 4096", 1, 4096, 32768, 2048, 16, 1, 128)]
    rows = []
    for name, *s in shapes:
        rows += row(name, *s, a.decode_rounds if s[1] == 1 else a.rounds)
        print(rows[-5:], flush=True)
        if a.grad and s[1] > 1:
            rows += row(name, *s, a.rounds, grad=True)
            print(rows[-3:], flush=True)
    dev = jax.devices()[0]
    lines = [f"# Top-k token selection vs dense attention over K contiguous keys ({dev.platform})",
             "", f"jax {jax.__version__}, {dev.device_kind}, {os.cpu_count()} CPUs (shared, noisy: "
             f"medians of {a.rounds} alternating rounds, {a.decode_rounds} for decode). Command: "
             f"python benchmarks/selection.py --rounds {a.rounds}"
             + (" --quick" if a.quick else "") + (" --grad" if a.grad else ""), "",
             "Shapes (B, Tq, T context, K selected, Hq, Hkv, D): "
             + "; ".join(f"{n}: {s}" for n, *s in shapes), "",
             "| case | call | ms | x jax.nn over K keys | XLA temp MiB |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.1f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    path = a.out or os.path.join(HERE, "results", f"selection_{dev.platform}"
                                 + ("_quick" if a.quick else "") + ".md")
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
