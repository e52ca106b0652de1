"""Benchmark quantized KV caches (fnattn.quant): bytes, time per decode step, accuracy.

* **Bytes** of the pools per format against bfloat16's, counted from the arrays
  (codes and scales): 8-bit formats hold 1/2 of bf16's bytes plus one float32
  scale per (token, kv head) (per-token) or per tensor; int4 1/4 plus the scales.
* **Time** of one decode step (one new token per sequence, causal) with the
  XLA lowering (``impl="xla"``), bfloat16 queries, for ``fnattn.decode`` on a
  contiguous cache and ``fnattn.paged_attention`` on a paged pool (pages a
  random permutation), each format beside the bf16 cache in the same run:
  every format's call compiled, then ``--reps`` rounds that time each once in
  turn (``timing.interleaved``); the median (min and max beside it), the
  ratios to bf16 of the medians and of the minima, and XLA's estimate of the
  compiled call's temporary buffers.
* **Accuracy**: the error of the output against the unquantized float32 cache,
  per format, on Gaussian K/V and on K with outlier channels (4 channels of
  every head 20x larger, as in trained models' keys), as the largest absolute
  error and the RMS error relative to the RMS of the output.

    python benchmarks/quant.py                  # B=8, S=32k, Hq=32, Hkv=8, D=128
    python benchmarks/quant.py --quick          # small sizes (a smoke test)

Writes ``benchmarks/results/quant_<device>.md``. The CPU is shared and noisy:
ratios are within one run, of interleaved calls.
"""

import argparse
import datetime
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import fnattn  # noqa: E402
from fnattn import AttentionSpec, masks, quant  # noqa: E402
from fnattn.quant import QuantFormat  # noqa: E402
import timing  # noqa: E402

RESULTS = os.path.join(HERE, "results")

# (label, format or None for the bf16 cache); per-tensor scales fit Gaussian data
FORMATS = [("bf16", None),
           ("int8 per-token", QuantFormat("int8")),
           ("fp8 e4m3 per-token", QuantFormat("float8_e4m3fn")),
           ("fp8 e4m3 per-tensor", QuantFormat("float8_e4m3fn", "tensor")),
           ("fp8 e5m2 per-tensor", QuantFormat("float8_e5m2", "tensor")),
           ("int4 per-token", QuantFormat("int4"))]
ACCURACY_FORMATS = [f for f in FORMATS if f[1] is not None] + [
    ("fp8 e5m2 per-token", QuantFormat("float8_e5m2")),
    ("int8 per-tensor", QuantFormat("int8", "tensor"))]


def tensor_scale(fmt, x):
    """A per-tensor scale from the data's largest magnitude (what a calibration gives)."""
    return float(jnp.max(jnp.abs(x.astype(jnp.float32)))) / fmt.max_code


def as_cache(x, fmt):
    if fmt is None:
        return x
    return quant.quantize(x, fmt, scale=None if fmt.per_token else tensor_scale(fmt, x))


SPEC = AttentionSpec(mask=masks.causal(), return_lse=False, impl="xla")


def decode_step(q, k, v, lengths):
    return fnattn.decode(SPEC, q, k, v, kv_lengths=lengths).out


def paged_step(q, kp, vp, table, lengths):
    return fnattn.paged_attention(SPEC, q, kp, vp, page_table=table, kv_lengths=lengths).out


def nbytes(x):
    return x.nbytes if quant.is_quantized(x) else x.size * x.dtype.itemsize


def timing_rows(B, S, Hq, Hkv, D, ps, reps, variants=("decode", "paged")):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, 1, Hq, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, S, Hkv, D), jnp.bfloat16)
    lengths = jnp.full((B,), S, jnp.int32)
    N = B * S // ps
    perm = np.random.default_rng(0).permutation(N).astype(np.int32)
    table = jnp.asarray(perm.reshape(B, S // ps))
    # pool page perm[b * P + j] holds tokens j * ps .. of sequence b (heads-major)
    inv = np.argsort(perm)

    def to_pool(x):  # (B, S, Hkv, D) -> (Hkv, N, ps, D) in the table's order
        pages = x.reshape(B * S // ps, ps, Hkv, D)[jnp.asarray(inv)]
        return pages.transpose(2, 0, 1, 3)

    rows = []
    if "decode" in variants:   # every format's cache at once: timed in interleaved rounds
        caches = [(label, as_cache(k, fmt), as_cache(v, fmt)) for label, fmt in FORMATS]
        ms = timing.interleaved([(decode_step, (q, kc, vc, lengths)) for _, kc, vc in caches],
                                reps)
        for (label, kc, vc), m in zip(caches, ms):
            rows.append(("decode", label, nbytes(kc) + nbytes(vc), m.median, m.min, m.max,
                         m.temp_mib))
            print(rows[-1], flush=True)
        del caches
    if "paged" not in variants:
        return rows
    kp, vp = to_pool(k), to_pool(v)
    del k, v
    caches = [(label, as_cache(kp, fmt), as_cache(vp, fmt)) for label, fmt in FORMATS]
    del kp, vp
    ms = timing.interleaved([(paged_step, (q, kc, vc, table, lengths)) for _, kc, vc in caches],
                            reps)
    for (label, kc, vc), m in zip(caches, ms):
        rows.append(("paged", label, nbytes(kc) + nbytes(vc), m.median, m.min, m.max,
                     m.temp_mib))
        print(rows[-1], flush=True)
    return rows


def mla_rows(B, S, Hq, Dc, Dr, reps):
    """Latent decode (values = the keys' first Dc channels, value_dim) against MQA
    decodes over the same (Dc + Dr)-wide keys: with v the keys themselves (one
    array, read for both products) and with a separate Dc-wide value cache (the
    latent stored twice), bf16, one kv head."""
    keys = jax.random.split(jax.random.key(2), 2)
    q = jax.random.normal(keys[0], (B, 1, Hq, Dc + Dr), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, 1, Dc + Dr), jnp.bfloat16)
    lengths = jnp.full((B,), S, jnp.int32)
    spec = SPEC.replace(scale=(128 + Dr) ** -0.5)   # DeepSeek-V2: (nope 128 + rope 64) ** -0.5
    latent = lambda q, k, n: fnattn.decode(spec, q, k, None, kv_lengths=n,  # noqa: E731
                                           value_dim=Dc).out
    same = lambda q, k, n: fnattn.decode(spec, q, k, k, kv_lengths=n).out  # noqa: E731
    twice = lambda q, k, v, n: fnattn.decode(spec, q, k, v, kv_lengths=n).out  # noqa: E731
    calls = (("MQA, v = the keys (one array)", same, (q, k, lengths)),
             ("latent, value_dim=Dc (no value cache)", latent, (q, k, lengths)),
             ("MQA, a separate Dc-wide value cache", twice, (q, k, k[..., :Dc] + 0, lengths)))
    ms = timing.interleaved([(fn, args) for _, fn, args in calls], reps)
    rows = []
    for (label, _, args), m in zip(calls, ms):
        rows.append((label, sum(nbytes(a) for a in args[1:-1]), m.median, m.min, m.max,
                     m.temp_mib))
        print(rows[-1], flush=True)
    return rows


def accuracy_rows(B, S, Hq, Hkv, D):
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (B, 1, Hq, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.float32)
    v = jax.random.normal(keys[2], (B, S, Hkv, D), jnp.float32)
    outlier = jnp.ones((D,)).at[:4].set(20.0)
    lengths = jnp.full((B,), S, jnp.int32)
    spec = AttentionSpec(mask=masks.causal(), return_lse=False, impl="xla")
    f = jax.jit(lambda q, k, v: fnattn.decode(spec, q, k, v, kv_lengths=lengths).out)
    rows = []
    for data, kk in (("Gaussian K/V", k), ("K with outlier channels", k * outlier)):
        want = np.asarray(f(q, kk, v), np.float64)
        rms = np.sqrt(np.mean(want ** 2))
        for label, fmt in ACCURACY_FORMATS:
            got = np.asarray(f(q, as_cache(kk, fmt), as_cache(v, fmt)), np.float64)
            err = np.abs(got - want)
            rows.append((data, label, float(err.max()),
                         float(np.sqrt(np.mean(err ** 2)) / rms)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--mla-only", action="store_true", help="only the latent (MLA) decode")
    ap.add_argument("--variants", default="decode,paged", help="decode, paged or both")
    args = ap.parse_args()
    if args.quick:
        B, S, Hq, Hkv, D, ps = 2, 1024, 8, 2, 64, 16
        acc = (2, 512, 8, 2, 64)
        mla = (2, 1024, 16, 64, 16)
    else:
        B, S, Hq, Hkv, D, ps = 8, 32768, 32, 8, 128, 16
        acc = (2, 4096, 32, 8, 128)
        mla = (4, 16384, 16, 512, 64)
    dev = jax.devices()[0]
    lines = [f"# Quantized KV caches ({dev.platform})", "",
             f"`python benchmarks/quant.py{' --quick' if args.quick else ''}"
             f"{' --mla-only' if args.mla_only else ''}` on "
             f"{platform.machine()} ({os.cpu_count()} cores, shared and noisy), jax "
             f"{jax.__version__}, {datetime.date.today()}. XLA lowering (impl='xla'), "
             "bfloat16 queries, one new token per sequence, causal.", ""]
    if args.mla_only:
        lines = lines[:-1] + [f"## Latent (MLA) decode: B={mla[0]}, S={mla[1]}, Hq={mla[2]}, "
                              f"Dc={mla[3]}, Dr={mla[4]}, bf16", "",
                              "| variant | cache bytes | time (s) median [min, max] | "
                              "median / MQA with v = the keys | min / that | temp MiB |",
                              "|---|---|---|---|---|---|"]
        rows = mla_rows(*mla, args.reps)
        for label, nb, t, lo, hi, mem in rows:
            lines.append(f"| {label} | {nb} | {t:.3f} [{lo:.3f}, {hi:.3f}] | "
                         f"{t / rows[0][2]:.2f}x | {lo / rows[0][3]:.2f}x | {mem:.0f} |")
        text = "\n".join(lines) + "\n"
        print(text)
        out = args.out or os.path.join(RESULTS, f"quant_mla_{dev.platform}"
                                       f"{'_quick' if args.quick else ''}.md")
        with open(out, "w") as f:
            f.write(text)
        return
    if not args.skip_timing:
        rows = timing_rows(B, S, Hq, Hkv, D, ps, args.reps, args.variants.split(","))
        base = {r[0]: r for r in rows if r[1] == "bf16"}
        lines += [f"## Bytes and time per step: B={B}, S={S}, Hq={Hq}, Hkv={Hkv}, D={D}, "
                  f"page {ps}", "",
                  "| variant | cache | K+V bytes | bytes / bf16 | codes / bf16 | time (s) "
                  "median [min, max] | median / bf16 | min / bf16 | temp MiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        elems = 2 * B * S * Hkv * D
        for kind, label, nb, t, lo, hi, mem in rows:
            b = base[kind]
            fmt = dict(FORMATS)[label]
            codes = elems * 2 if fmt is None else elems // fmt.per_byte
            lines.append(f"| {kind} | {label} | {nb} | {nb / b[2]:.4f} | "
                         f"{codes / (elems * 2):.4f} | {t:.3f} [{lo:.3f}, {hi:.3f}] | "
                         f"{t / b[3]:.2f}x | {lo / b[4]:.2f}x | {mem:.0f} |")
        lines.append("")
    lines += [f"## Accuracy against the float32 cache: B={acc[0]}, S={acc[1]}, Hq={acc[2]}, "
              f"Hkv={acc[3]}, D={acc[4]}", "",
              "Per-tensor scales from the data's largest magnitude. Error of the decode "
              "output (float32 queries) against the unquantized cache's.", "",
              "| data | cache | max abs error | RMS error / RMS output |", "|---|---|---|---|"]
    for data, label, mx, rel in accuracy_rows(*acc):
        lines.append(f"| {data} | {label} | {mx:.2e} | {rel:.2e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or os.path.join(RESULTS, f"quant_{dev.platform}"
                                   f"{'_quick' if args.quick else ''}.md")
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
