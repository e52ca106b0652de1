"""Benchmark decode: fnattn.decode and fnattn.paged_attention against plain jnp.

One new query token per sequence against a cache of ``context`` keys, causal:

* contiguous cache (B, S, Hkv, D): ``fnattn.decode`` against a plain ``jnp``
  implementation (repeat K/V over the GQA group, einsum, masked softmax, einsum)
  and ``jax.nn.dot_product_attention(key_value_seq_lengths=...)``;
* paged cache (pages a random permutation of the pool): ``fnattn.paged_attention``
  against the plain ``jnp`` gather-every-page-then-softmax implementation
  (``benchmarks/paged_problems.py``'s ``gather_decode``).

    python benchmarks/decode.py             # CPU: f32, Hq=8, Hkv=2, D=64, page 16
    python benchmarks/decode.py --quick     # a few sizes
    python benchmarks/decode.py --gpu       # GPU: bf16, Hq=32, Hkv=8, D=128, page 16

Time is the median of several calls after compilation (min and max beside it);
bandwidth counts every cached key and value of the visible context once, plus q
and the output (``paged_problems.decode_bytes``); on a GPU it is also given
as a fraction of the device's peak HBM bandwidth. Memory is XLA's estimate for
the compiled call (temporary plus output buffers): what the call needs beyond
its inputs. Writes ``benchmarks/results/decode_<device>.{md,csv}``.
"""

import argparse
import csv
import datetime
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import fnattn  # noqa: E402
from fnattn import AttentionSpec, masks, position_bias  # noqa: E402
import paged_problems as bench  # noqa: E402
import timing  # noqa: E402

RESULTS = os.path.join(HERE, "results")

# Peak HBM bandwidth (bytes/s) by device kind, from the vendors' data sheets.
PEAK_BW = {"H100 80GB HBM3": 3.35e12, "H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


def peak_bandwidth(kind: str):
    for name, bw in PEAK_BW.items():
        if name in kind:
            return bw
    return None


def contiguous_problem(B, S, Hq, Hkv, D, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, 1, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), dtype)
    return q, k, v, jnp.full((B,), S, jnp.int32)


def fnattn_decode(q, k, v, lengths):
    spec = AttentionSpec(mask=masks.causal(), return_lse=False)
    return fnattn.decode(spec, q, k, v, kv_lengths=lengths).out


def fnattn_decode_alibi(q, k, v, lengths):
    slopes = jnp.asarray(position_bias.alibi_slopes(q.shape[2]))
    spec = AttentionSpec(mask=masks.causal(), return_lse=False,
                         position_bias=position_bias.alibi(slopes))
    return fnattn.decode(spec, q, k, v, kv_lengths=lengths).out


def jnp_decode_alibi(q, k, v, lengths):
    return jnp_decode(q, k, v, lengths, alibi=True)


def jnp_decode(q, k, v, lengths, alibi=False):
    """What one writes with plain jnp: repeat K/V per group, einsum, softmax, einsum
    (with ``alibi``: ALiBi's ``-slope * (q_pos - k)`` added to the logits)."""
    B, Tq, Hq, D = q.shape
    G = Hq // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * D ** -0.5
    if alibi:
        slopes = jnp.asarray(position_bias.alibi_slopes(Hq))[None, :, None, None]
        dist = (lengths[:, None, None, None] - 1) - jnp.arange(k.shape[1])[None, None, None, :]
        s = s - slopes * jnp.abs(dist).astype(jnp.float32)
    ok = jnp.arange(k.shape[1])[None, None, None, :] < lengths[:, None, None, None]
    p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v).astype(q.dtype)


def jaxnn_decode(q, k, v, lengths):
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)


def measure(fn, args, reps):
    """(median, min, max seconds, XLA's temporary + output MiB, the result)."""
    m = timing.measure(fn, args, reps)
    return m.median, m.min, m.max, m.temp_mib + m.output_mib, m.out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="skip configurations with more than this many cached tokens (B*S)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--alibi", action="store_true",
                    help="contiguous cache only, with ALiBi: fnattn.decode with "
                         "position_bias.alibi beside plain jnp with the same term")
    args = ap.parse_args()
    dev = jax.devices()[0]
    if args.gpu:
        Hq, Hkv, D, ps, dtype = 32, 8, 128, 16, jnp.bfloat16
        Bs, Ss = (1, 4, 16, 64), (1024, 4096, 8192, 16384, 32768)
        max_tokens = args.max_tokens or 2 ** 21
        reps = args.reps or 50
    else:
        Hq, Hkv, D, ps, dtype = 8, 2, 64, 16, jnp.float32
        Bs, Ss = (1, 4, 16, 64), (1024, 4096, 8192, 32768)
        max_tokens = args.max_tokens or 2 ** 19
        reps = args.reps or 10
    if args.quick:
        Bs, Ss = (1, 16), (1024, 8192)
    peak = peak_bandwidth(dev.device_kind) if args.gpu else None
    rows = []
    started = time.time()
    for B in Bs:
        for S in Ss:
            if B * S > max_tokens:
                continue
            prob = bench.decode_problem(batch=B, context=S, num_q_heads=Hq, num_kv_heads=Hkv,
                                        head_dim=D, page_size=ps, dtype=dtype)
            nbytes = bench.decode_bytes(prob)
            groups = {
                "paged": [("fnattn.paged_attention", bench.decode_fn("auto"), prob.args),
                          ("jnp gather+softmax", bench.gather_decode, prob.args)],
            }
            cont = contiguous_problem(B, S, Hq, Hkv, D, dtype)
            groups["contiguous"] = [("fnattn.decode", fnattn_decode, cont),
                                    ("jnp einsum+softmax", jnp_decode, cont),
                                    ("jax.nn.dot_product_attention", jaxnn_decode, cont)]
            if args.alibi:
                groups = {"contiguous+alibi": [
                    ("fnattn.decode + ALiBi", fnattn_decode_alibi, cont),
                    ("jnp einsum+softmax + ALiBi", jnp_decode_alibi, cont),
                    ("fnattn.decode", fnattn_decode, cont),
                    ("jnp einsum+softmax", jnp_decode, cont)]}
            for cache, entries in groups.items():
                base = None
                results = []
                for name, fn, fargs in entries:
                    try:
                        t, lo, hi, mem, out = measure(fn, fargs, reps)
                    except Exception as e:  # noqa: BLE001  (a peer that cannot run)
                        print(f"{cache:10s} {name:30s} B={B:3d} S={S:6d}  error: {e}"[:200])
                        continue
                    results.append((name, t, lo, hi, mem, out))
                for name, t, lo, hi, mem, out in results:
                    # against the peers computing the same (with ALiBi or without)
                    same = [r for r in results if r[0].endswith("ALiBi") == name.endswith("ALiBi")]
                    ref_out = next((r[5] for r in same if not r[0].startswith("fnattn")), None)
                    base = next((r[1] for r in same if r[0].startswith("jnp")), None)
                    err = (float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                 - ref_out.astype(jnp.float32))))
                           if ref_out is not None else float("nan"))
                    row = dict(cache=cache, impl=name, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D,
                               page_size=ps if cache == "paged" else "",
                               dtype=jnp.dtype(dtype).name,
                               time_ms=t * 1e3, min_ms=lo * 1e3, max_ms=hi * 1e3,
                               gb_s=nbytes / t / 1e9,
                               peak_frac=(nbytes / t / peak) if peak else "",
                               xla_mb=mem, speedup_vs_jnp=(base / t) if base else "",
                               max_abs_diff=err)
                    rows.append(row)
                    print(f"{cache:10s} {name:30s} B={B:3d} S={S:6d} {t * 1e3:9.3f} ms "
                          f"(min {lo * 1e3:.3f}, max {hi * 1e3:.3f})  {nbytes / t / 1e9:7.2f} GB/s"
                          + (f" ({nbytes / t / peak:5.1%} of peak)" if peak else "")
                          + f"  xla {mem:8.1f} MB  x{row['speedup_vs_jnp'] or 0:.2f} vs jnp"
                          f"  |diff| {err:.1e}", flush=True)
    write(rows, args, dev, time.time() - started)


def write(rows, args, dev, elapsed):
    os.makedirs(RESULTS, exist_ok=True)
    kind = dev.device_kind.replace(" ", "_").replace("/", "_")
    stem = args.out or f"decode_{'gpu_' if args.gpu else ''}{kind}"
    with open(os.path.join(RESULTS, stem + ".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cmd = "python benchmarks/decode.py " + " ".join(sys.argv[1:])
    lines = [
        "# fnattn decode benchmark", "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- device: {dev.device_kind} ({platform.machine()}, {os.cpu_count()} CPUs visible, "
        f"load average {os.getloadavg()[0]:.1f} at the end)",
        f"- jax: {jax.__version__}, python {platform.python_version()}",
        f"- command: `{cmd.strip()}` ({elapsed / 60:.1f} min)",
        "- one query token per sequence, causal; time: median of repeated calls after "
        "compilation; GB/s: cached K and V of the context read once, plus q and the output; "
        "speed-up: the plain jnp implementation of the same cache layout divided by this row; "
        "memory: XLA's estimate of the call's temporary and output buffers; |diff|: largest "
        "difference from the first non-fnattn row of the group computing the same (with "
        "ALiBi or without)", "",
        "| cache | impl | B | S | time (ms) | GB/s |" + (" % of peak |" if args.gpu else "")
        + " XLA MB | speed-up vs jnp | jax.nn ÷ this | |diff| |",
        "|---|---|---|---|---|---|" + ("---|" if args.gpu else "") + "---|---|---|---|",
    ]
    for r in rows:
        nn = next((x["time_ms"] for x in rows if x["B"] == r["B"] and x["S"] == r["S"]
                   and x["impl"].startswith("jax.nn")), None)
        frac = f" {r['peak_frac']:.1%} |" if args.gpu and r["peak_frac"] != "" else (
            " |" if args.gpu else "")
        sp = f"{r['speedup_vs_jnp']:.2f}×" if r["speedup_vs_jnp"] != "" else ""
        vs_nn = f"{nn / r['time_ms']:.2f}×" if nn else ""
        lines.append(f"| {r['cache']} | {r['impl']} | {r['B']} | {r['S']} | "
                     f"{r['time_ms']:.3f} | {r['gb_s']:.2f} |{frac} {r['xla_mb']:.1f} | {sp} | "
                     f"{vs_nn} | {r['max_abs_diff']:.1e} |")
    with open(os.path.join(RESULTS, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", os.path.join(RESULTS, stem + ".md"))


if __name__ == "__main__":
    main()
