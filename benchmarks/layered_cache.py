"""Serving from ``fnattn.LayeredKVCache``: the scanned layer loop with the cache in
the carry against the pools as ``lax.scan`` xs/ys and against a Python loop over
one cache per layer; and ragged prompts prefilled in one call (``q_lengths``)
against one call per prompt.

Timed under ``jax.jit`` with the caches donated, in one run (median of ``--reps``
calls after a warm-up; the machine is shared and noisy); peak temporary memory
from XLA's memory analysis of the compiled step.

* **decode step**: ``--layers`` layers, ``--batch`` rows of ``--capacity`` slots,
  one new token per row, ``fnattn.decode_with_update`` per layer (a toy layer:
  q, k, v are slices of the hidden state). Forms: ``carry`` (the cache in the
  scan carry, :meth:`LayeredKVCache.decode_with_update`), ``xs/ys`` (the pools
  as the scan's xs and ys), ``unrolled, stacked pools`` (a Python loop indexing
  the stacked pools and ``jnp.stack``-ing them back) and ``unrolled, a cache per
  layer`` (a Python loop over separate caches: no stack, but one trace per layer).
* **ragged prefill**: ``--batch`` prompts of lengths spread over
  ``[--prompt / 4, --prompt]``, one layer: one call right-padded to the longest
  with ``q_lengths``, against one call per prompt (each its own Tq).

    python benchmarks/layered_cache.py
    python benchmarks/layered_cache.py --layers 4 --capacity 256 --reps 2 --out /tmp/x.md

Writes ``results/layered_cache_<device>.md`` (``--out``).
"""

import argparse
import functools
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
from fnattn import AttentionSpec, LayeredKVCache, masks  # noqa: E402

SPEC = AttentionSpec(mask=masks.causal())
HQ, HKV, D = 8, 2, 64


def timed(f, make_args, reps):
    """(first call, median of the next ``reps``) seconds of f(*make_args()) (fresh,
    donated arguments each call; the first call traces and compiles)."""
    args = make_args()
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        args = make_args()
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def decode_forms(L, B, S):
    ql = jnp.ones((B,), jnp.int32)

    def carry(cache, x):
        cache = cache.allocate(ql)

        def layer(c, i):
            x, cache = c
            res, cache = cache.decode_with_update(i, SPEC, x, x[:, :, :HKV], x[:, :, :HKV],
                                                  q_lengths=ql)
            return (res.out, cache), None
        (x, cache), _ = jax.lax.scan(layer, (x, cache), jnp.arange(L))
        return cache, x

    def xs_ys(cache, x):
        cache = cache.allocate(ql)

        def layer(x, pools):
            k, v = pools
            res, k, v = fnattn.decode_with_update(SPEC, x, x[:, :, :HKV], x[:, :, :HKV], k, v,
                                                  kv_lengths=cache.lengths, q_lengths=ql)
            return res.out, (k, v)
        x, (k, v) = jax.lax.scan(layer, x, (cache.k_cache, cache.v_cache))
        return cache.replace(k_cache=k, v_cache=v), x

    def unrolled(ks, vs, lengths, x):
        lengths = lengths + ql
        ks, vs = list(ks), list(vs)
        for i in range(L):
            res, ks[i], vs[i] = fnattn.decode_with_update(
                SPEC, x, x[:, :, :HKV], x[:, :, :HKV], ks[i], vs[i], kv_lengths=lengths,
                q_lengths=ql)
            x = res.out
        return ks, vs, lengths, x

    def stacked(cache, x):
        """A Python loop over the stacked pools: index a layer, write, stack back."""
        cache = cache.allocate(ql)
        ks, vs = [], []
        for i in range(L):
            res, k, v = fnattn.decode_with_update(
                SPEC, x, x[:, :, :HKV], x[:, :, :HKV], cache.k_cache[i], cache.v_cache[i],
                kv_lengths=cache.lengths, q_lengths=ql)
            ks.append(k)
            vs.append(v)
            x = res.out
        return cache.replace(k_cache=jnp.stack(ks), v_cache=jnp.stack(vs)), x

    x = jax.random.normal(jax.random.key(0), (B, 1, HQ, D))
    filled = lambda: jnp.full((B,), S // 2, jnp.int32)  # noqa: E731  (fresh: donated)

    def layered():
        return LayeredKVCache.create(L, B, S, HKV, D).replace(lengths=filled())

    rows = []
    for name, f, make in (
            ("carry", carry, lambda: (layered(), x)),
            ("xs/ys", xs_ys, lambda: (layered(), x)),
            ("unrolled, stacked pools", stacked, lambda: (layered(), x)),
            ("unrolled, a cache per layer", unrolled,
             lambda: ([jnp.zeros((B, S, HKV, D)) for _ in range(L)],
                      [jnp.zeros((B, S, HKV, D)) for _ in range(L)], filled(), x))):
        jf = jax.jit(f, donate_argnums=(0, 1) if f is unrolled else 0)
        mem = jf.lower(*make()).compile().memory_analysis().temp_size_in_bytes / 2 ** 20
        rows.append((name, mem, jf, make))
    return rows


def prefill_forms(B, S, prompt):
    lengths = np.linspace(max(1, prompt // 4), prompt, B).astype(np.int32)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, prompt, HQ, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, prompt, HKV, D)), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def ragged(q, k, kc, vc, n):
        return fnattn.decode_with_update(SPEC, q, k, k, kc, vc, kv_lengths=n, q_lengths=n)

    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def one(q, k, kc, vc, n):
        return fnattn.decode_with_update(SPEC, q, k, k, kc, vc, kv_lengths=n)

    def per_prompt(kc, vc):
        outs = []
        for b in range(B):
            n = int(lengths[b])
            res, kb, vb = one(q[b:b + 1, :n], k[b:b + 1, :n], kc[b:b + 1], vc[b:b + 1],
                              jnp.array([n], jnp.int32))
            outs.append((res.out, kb, vb))
        return outs

    cache = lambda: (jnp.zeros((B, S, HKV, D)), jnp.zeros((B, S, HKV, D)))  # noqa: E731
    n = jnp.asarray(lengths)
    return lengths, (("one call, q_lengths", lambda kc, vc: ragged(q, k, kc, vc, n), cache),
                     ("one call per prompt", per_prompt, cache))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    dev = jax.devices()[0]
    L, B, S = a.layers, a.batch, a.capacity
    cache_mib = 2 * L * B * S * HKV * D * 4 / 2 ** 20
    lines = [
        f"# Serving from LayeredKVCache ({dev.platform}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "",
        f"jax {jax.__version__}; `python benchmarks/layered_cache.py " + " ".join(argv)
        + f"`; median of {a.reps} calls; a shared, noisy CPU.",
        "",
        f"## Decode step: {L} layers, B={B}, capacity {S} (half full), Hq={HQ}, Hkv={HKV}, "
        f"D={D}, float32; the cache is {cache_mib:.1f} MiB",
        "",
        "| form | step (ms) | vs carry | first call (s) | temp memory (MiB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows = decode_forms(L, B, S)
    times = {name: timed(jf, make, a.reps) for name, _, jf, make in rows}
    for name, mem, _, _ in rows:
        first, t = times[name]
        lines.append(f"| {name} | {t * 1e3:.2f} | {t / times['carry'][1]:.2f}x | {first:.2f} "
                     f"| {mem:.2f} |")
    lengths, forms = prefill_forms(B, S, a.prompt)
    lines += ["", f"## Ragged prefill: {B} prompts of {lengths.tolist()} tokens, one layer, "
              f"capacity {S}", "", "| form | time (ms) | vs one call | first call (s) |",
              "| --- | --- | --- | --- |"]
    pt = {name: timed(f, make, a.reps) for name, f, make in forms}
    first = forms[0][0]
    for name, _, _ in forms:
        f0, t = pt[name]
        lines.append(f"| {name} | {t * 1e3:.2f} | {t / pt[first][1]:.2f}x | {f0:.2f} |")
    text = "\n".join(lines) + "\n"
    out = a.out or os.path.join(HERE, "results", f"layered_cache_{dev.platform}.md")
    with open(out, "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
