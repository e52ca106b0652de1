"""Speculative tree verification against a causal prefill of as many tokens, paged.

One request with ``--context`` tokens in a paged cache and ``--drafts`` new
tokens, ``fnattn.ragged_paged_attention`` (XLA lowering) under ``jax.jit``:

* **causal prefill**: the new tokens as a causal chunk (``masks.causal()``, no tree);
* **tree**: the same tokens as a random draft tree (``draft_parents``, each
  token's parent drawn among the earlier ones, a few roots), and as a chain
  (``-1, 0, 1, ...``, the prefill's pattern given as a tree);
* the same three with a sliding window of ``--window`` keys (chunks outside
  every draft's window skipped);
* **update**: ``ragged_paged_attention_with_update`` (writes the drafts, then
  attends), prefill against tree.

Timed interleaved in one process (median of ``--reps`` rounds, each round
calling every variant once, after a warm-up); temporary memory from XLA's
memory analysis.

    python benchmarks/tree_verify.py
    python benchmarks/tree_verify.py --context 256 --drafts 8 --reps 2 --out /tmp/t.md

Writes ``results/tree_verify_<device>.md`` (``--out``).
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
from fnattn import AttentionSpec, PagedKVCache, masks  # noqa: E402


def peak(f, *args):
    try:
        return f.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20
    except Exception:  # no memory analysis on this backend
        return float("nan")


def random_tree(rng, n):
    """Parents of a draft tree: a few roots, each later token under an earlier one."""
    return np.array([-1] + [int(rng.integers(-1, i)) if i % 16 == 0 else int(rng.integers(0, i))
                            for i in range(1, n)], np.int32)


def setup(C, n, Hq, Hkv, D, page_size):
    rng = np.random.default_rng(0)
    P = -(-(C + n) // page_size)
    cache = PagedKVCache.create(num_pages=P + 2, page_size=page_size, num_kv_heads=Hkv,
                                head_dim=D, max_seqs=1, max_pages_per_seq=P)
    k = jnp.asarray(rng.standard_normal((C + n, Hkv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((C + n, Hkv, D)), jnp.float32)
    full = cache.append(jnp.zeros(C + n, jnp.int32), k, v)
    old = cache.append(jnp.zeros(C, jnp.int32), k[:C], v[:C]).allocate(
        jnp.zeros(n, jnp.int32))
    q = jnp.asarray(rng.standard_normal((n, Hq, D)), jnp.float32)
    meta = dict(page_table=full.page_table, context_lengths=full.lengths,
                query_start_loc=jnp.array([0, n], jnp.int32), num_seqs=jnp.int32(1))
    return full, old, q, k[C:], v[C:], meta, random_tree(rng, n)


def variants(full, old, q, kn, vn, meta, tree, n, window):
    chain = np.array([-1] + list(range(n - 1)), np.int32)
    out = []
    for label, mask in (("", masks.causal()),
                        (f", window {window}", masks.causal() & masks.sliding_window(
                            left=window - 1))):
        spec = AttentionSpec(mask=mask, impl="xla")

        def attend(q, kp, vp, par, spec=spec):
            return fnattn.ragged_paged_attention(spec, q, kp, vp, **meta,
                                                 draft_parents=par).out

        def prefill(q, kp, vp, spec=spec):
            return fnattn.ragged_paged_attention(spec, q, kp, vp, **meta).out

        args = (q, full.k_pages, full.v_pages)
        out += [(f"causal prefill{label}", prefill, args),
                (f"tree{label}", attend, args + (jnp.asarray(tree),)),
                (f"chain as a tree{label}", attend, args + (jnp.asarray(chain),))]
    spec = AttentionSpec(mask=masks.causal(), impl="xla")

    def upd_prefill(q, k, v, kp, vp):
        return fnattn.ragged_paged_attention_with_update(spec, q, k, v, kp, vp, **meta)[0].out

    def upd_tree(q, k, v, kp, vp, par):
        return fnattn.ragged_paged_attention_with_update(spec, q, k, v, kp, vp, **meta,
                                                         draft_parents=par)[0].out

    uargs = (q, kn, vn, old.k_pages, old.v_pages)
    out += [("update: causal prefill", upd_prefill, uargs),
            ("update: tree", upd_tree, uargs + (jnp.asarray(tree),))]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--drafts", type=int, default=64)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    dev = jax.devices()[0]
    C, n = a.context, a.drafts
    full, old, q, kn, vn, meta, tree = setup(C, n, a.heads, a.kv_heads, a.head_dim,
                                             a.page_size)
    vs = [(name, jax.jit(f), args) for name, f, args in
          variants(full, old, q, kn, vn, meta, tree, n, a.window)]
    for _, f, args in vs:
        jax.block_until_ready(f(*args))
    times = {name: [] for name, _, _ in vs}
    for _ in range(a.reps):   # interleaved: one call of each per round
        for name, f, args in vs:
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(t) for k, t in times.items()}
    depth = int(np.asarray(fnattn.draft_positions(
        jnp.asarray(tree), context_lengths=jnp.array([n]),
        query_start_loc=jnp.array([0, n]))).max()) + 1
    lines = [
        f"## Tree verification against causal prefill ({dev.platform}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "",
        f"jax {jax.__version__}; `python benchmarks/tree_verify.py " + " ".join(argv)
        + f"`; median of {a.reps} interleaved rounds; a shared, noisy CPU.",
        "",
        f"One request: context {C}, {n} new tokens (the random tree: depth {depth}), "
        f"Hq={a.heads}, Hkv={a.kv_heads}, D={a.head_dim}, page size {a.page_size}, float32, "
        "ragged_paged_attention(impl='xla'). Target: tree <= 1.2x causal prefill.",
        "",
        "| variant | time (ms) | vs causal prefill | temp memory (MiB) |",
        "| --- | --- | --- | --- |",
    ]
    for name, f, args in vs:
        base = ("update: causal prefill" if name.startswith("update") else
                "causal prefill" + name.split("tree")[-1] if "tree" in name else name)
        lines.append(f"| {name} | {1e3 * med[name]:.2f} | {med[name] / med[base]:.3f}x | "
                     f"{peak(f, *args):.1f} |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    out = a.out or os.path.join(HERE, "results", f"tree_verify_{dev.platform}.md")
    with open(out, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
