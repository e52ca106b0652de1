"""masks.block_selection (traced key blocks per query block) against a static
block-sparse mask that visits the same tiles, on this machine.

    python benchmarks/block_selection.py            # T = 32k, 16 of 512 key blocks
    python benchmarks/block_selection.py --quick    # T = 4k, 16 of 64

Query block i selects key blocks i-15 .. i (a band, so that a static mask can
visit the same tiles): ``block_selection(band) & causal()`` against
``causal() & sliding_window(15 * block)``, whose tiles are the same
blocks (computed at trace time, no schedule at run time). Also a random
selection of 16 blocks (the diagonal one included), for its own time. Both go
through ``fnattn.attention`` (impl="auto": the blockwise XLA lowering on a
CPU) with block sizes equal to the selection's; forward and forward+backward,
the median of ``--rounds`` alternating rounds, in one run, with XLA's temporary
bytes. Results go to ``results/block_selection_<device>.md``.
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from fnattn import AttentionSpec, XlaBlockSizes, masks

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    T, blk, n_sel = (4096, 64, 16) if a.quick else (32768, 64, 16)
    B, Hq, Hkv, D = 1, 4, 1, 64
    nb = T // blk
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, Hq, D))
    k = jax.random.normal(ks[1], (B, T, Hkv, D))
    v = jax.random.normal(ks[2], (B, T, Hkv, D))
    i = np.arange(nb)[:, None]
    j = np.arange(nb)[None, :]
    band = jnp.asarray((j <= i) & (j > i - n_sel))
    rng = np.random.default_rng(0)
    rand = np.zeros((nb, nb), bool)
    for r in range(nb):
        rand[r, rng.choice(r + 1, min(n_sel, r + 1), replace=False)] = True
        rand[r, r] = True
    rand = jnp.asarray(rand)
    sizes = XlaBlockSizes(block_q=blk, block_k=blk)
    # row i*blk sees keys from (i - 15) * blk: left = 15 * blk (see the docstring)
    window = masks.causal() & masks.sliding_window((n_sel - 1) * blk)

    def sel_fn(sel, q, k, v):
        mask = masks.block_selection(sel, block_q=blk, block_k=blk) & masks.causal()
        return fnattn.attention(AttentionSpec(mask=mask, block_sizes=sizes), q, k, v).out

    def static_fn(sel, q, k, v):
        return fnattn.attention(AttentionSpec(mask=window, block_sizes=sizes), q, k, v).out

    def grad(f):
        return jax.grad(lambda sel, q, k, v: jnp.sum(f(sel, q, k, v)), argnums=(1, 2, 3))

    cls_band = masks.block_classes(masks.block_selection(band, block_q=blk, block_k=blk)
                                   & masks.causal(), 1, 1, T, T, blk, blk)
    cls_win = masks.block_classes_static(window, 1, 1, T, T, blk, blk)
    same = bool(np.array_equal(np.asarray(cls_band) != 0, cls_win != 0))
    calls = {}
    for mode, wrap in (("fwd", lambda f: f), ("fwd+bwd", grad)):
        calls[f"static window, {mode}"] = (wrap(static_fn), band)
        calls[f"block_selection band, {mode}"] = (wrap(sel_fn), band)
        calls[f"block_selection random, {mode}"] = (wrap(sel_fn), rand)
    compiled = {n: (jax.jit(f).lower(s, q, k, v).compile(), s) for n, (f, s) in calls.items()}
    times = {n: [] for n in compiled}
    for c, s in compiled.values():
        jax.block_until_ready(c(s, q, k, v))
    for _ in range(a.rounds):
        for n, (c, s) in compiled.items():
            t = time.perf_counter()
            jax.block_until_ready(c(s, q, k, v))
            times[n].append(time.perf_counter() - t)
    dev = jax.devices()[0]
    lines = [f"# Block selection vs a static block-sparse mask ({dev.platform})", "",
             f"jax {jax.__version__}, {dev.device_kind}, {os.cpu_count()} CPUs (shared, noisy: "
             f"medians of {a.rounds} alternating rounds). Command: python "
             f"benchmarks/block_selection.py{' --quick' if a.quick else ''}", "",
             f"B={B}, T={T}, Hq={Hq}, Hkv={Hkv}, D={D}, float32, blocks {blk}x{blk}, {n_sel} of "
             f"{nb} key blocks per query block; band and window visit the same tiles: {same}", "",
             "| call | ms | x static window (same mode) | XLA temp MiB |", "|---|---:|---:|---:|"]
    for n, (c, _) in compiled.items():
        mode = n.split(", ")[1]
        base = statistics.median(times[f"static window, {mode}"])
        med = statistics.median(times[n])
        lines.append(f"| {n} | {med * 1e3:.1f} | {med / base:.2f} | "
                     f"{c.memory_analysis().temp_size_in_bytes / 2 ** 20:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    path = os.path.join(HERE, "results", f"block_selection_{dev.platform}"
                        + ("_quick" if a.quick else "") + ".md")
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
