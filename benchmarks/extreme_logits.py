"""How far each flash lowering's out, lse and gradients stray from a float64
reference as the logits from ``q.k`` alone grow (no bias, no position term, no
soft-cap): a table per machine, for the docs' "Extreme inputs".

    python benchmarks/extreme_logits.py                       # this machine's lowerings
    python benchmarks/extreme_logits.py --scales 1,1e4,1e8 --out extreme_logits_cpu

Each row scales q by ``scale`` (q, k, v and the output cotangent otherwise
standard normal, B=1, T=128, H=2, D=64, causal and not), runs one lowering
under ``jax.jit`` forward and backward, and gives the largest absolute error of
``out``, ``lse``, ``dq``, ``dk`` and ``dv`` against the float64 reference
(:func:`float64_attention`: the tests' NumPy ground truth) on the same
(rounded) inputs, beside the error of the float32 reference itself
("ref32"), and the largest
absolute value of the float64 gradient. A lowering is as good as the float32
reference where its errors are of the reference's size; ``verdict`` says
``ok`` when each error is within 10 times the float32 reference's plus
``tol`` times the size of the quantity (``tol``: 1e-3 in float32, 2e-2 in
bfloat16; the size: the largest float64 value, and for dq and dk at least
``scale * max|k or q| * max|dO . v|``, what rounding in dS is multiplied by),
``off`` otherwise and ``nan`` where the lowering gave a non-finite value the
reference does not have.

Lowerings: on a CPU ``xla`` and ``pallas`` (the Triton kernels, interpreted);
on an NVIDIA GPU also ``auto`` (cuDNN or the Mosaic GPU kernels, per
:mod:`fnattn.flash.api`) and ``mosaic_gpu`` (the Mosaic GPU forward and
backward, asked for by their block sizes). The table goes to
``benchmarks/results/<out>.md`` with the device and the jax version.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.join(ROOT, "tests"))

import fnattn  # noqa: E402
from fnattn import AttentionSpec, masks  # noqa: E402
from np_attention import np_attention_grads  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
ON_GPU = jax.devices()[0].platform == "gpu"


def lowerings():
    """(name, spec changes) of this machine's lowerings."""
    rows = [("xla", dict(impl="xla")), ("pallas", dict(impl="pallas"))]
    if ON_GPU:
        from fnattn.flash.mosaic_gpu_bwd import MosaicGpuBwdBlockSizes
        rows += [("auto", dict(impl="auto")),
                 ("mosaic_gpu", dict(impl="auto", block_sizes=MosaicGpuBwdBlockSizes()))]
    return rows


def problem(scale, dtype, B=1, T=128, H=2, D=64, seed=0):
    """q (times ``scale``), k, v and the output cotangent, rounded to ``dtype``."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, d_out = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in keys)
    return tuple(x.astype(dtype) for x in (q * scale, k, v, d_out))


def _err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.isfinite(a).all() and np.isfinite(b).all():
        return float("nan")
    return float(np.max(np.abs(a - b)))


def float64_attention(q, k, v, d_out, causal):
    """``dict(out, lse, dq, dk, dv)`` of softmax attention in float64 ((B, T, H,
    D) inputs, scale ``D ** -0.5``), the gradients of ``sum(out * d_out)``: the
    test suite's NumPy ground truth, ``tests/np_attention.py``, written apart
    from fnattn's code."""
    T = np.shape(q)[1]
    mask = np.tril(np.ones((T, T), bool)) if causal else None
    res = np_attention_grads(q, k, v, d_out, mask=mask)
    return {key: res[key] for key in ("out", "lse", "dq", "dk", "dv")}


def _size(key, f64) -> float:
    """The size float32 rounding is measured against, beyond the largest value
    itself: ``dq = scale * dS @ k`` and ``dk = scale * dS^T @ q`` carry the
    rounding of ``dS`` (relative to ``dP = dO . v``) times the size of k or q,
    where the exact gradient may be 0 (a row that sees one key only)."""
    q, k, v, d_out = f64
    if key not in ("dq", "dk"):
        return 0.0
    dp = float(np.max(np.abs(np.einsum("bqhd,bkhd->bhqk", d_out, v))))
    other = k if key == "dq" else q
    return q.shape[-1] ** -0.5 * float(np.max(np.abs(other))) * dp


def _value_and_grads(fn, q, k, v, d_out):
    def loss(q, k, v):
        res = fn(q, k, v)
        return jnp.sum(res.out.astype(d_out.dtype) * d_out), res.lse
    (_, lse), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return fn(q, k, v).out, lse, grads


def row(name, changes, scale, causal, dtype):
    """One table row (a dict) for lowering ``name`` at ``scale``."""
    q, k, v, d_out = problem(scale, dtype)
    spec = AttentionSpec(mask=masks.causal() if causal else None, return_lse=True)
    f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, d_out)]
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    truth = float64_attention(*f64, causal)
    ref32 = jax.jit(lambda *a: _value_and_grads(
        lambda q, k, v: fnattn.reference(spec, q, k, v), *a))(*f32)
    lowered = spec.replace(**changes)
    try:
        got = jax.jit(lambda *a: _value_and_grads(
            lambda q, k, v: fnattn.flash(lowered, q, k, v), *a))(q, k, v, d_out)
    except Exception as e:  # noqa: BLE001 (a lowering that refuses the call: said in the row)
        return dict(lowering=name, scale=scale, causal=causal, status=f"{type(e).__name__}")
    tol = 1e-3 if dtype == jnp.float32 else 2e-2

    def flat(res):
        out, lse, (dq, dk, dv) = res
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    t, r, g = truth, flat(ref32), flat(got)
    res = dict(lowering=name, scale=scale, causal=causal, status="ok",
               max_logit=float(np.max(np.abs(np.einsum("bqhd,bkhd->bhqk", f64[0], f64[1])))
                               * q.shape[-1] ** -0.5))
    verdict = "ok"
    for key in t:
        err, base = _err(g[key], t[key]), _err(r[key], t[key])
        top = float(np.max(np.abs(np.asarray(t[key], np.float64)[np.isfinite(t[key])]),
                           initial=0.0))
        res[key], res[key + "_ref32"], res[key + "_max"] = err, base, top
        if np.isnan(err):
            verdict = "nan"
        elif verdict == "ok" and not err <= 10 * base + tol * max(top, _size(key, f64)):
            verdict = "off"
    res["verdict"] = verdict
    return res


def write(rows, args, dtype) -> str:
    """The markdown table of ``rows`` under ``benchmarks/results/<args.out>.md``."""
    head = ("| lowering | causal | q scale | max logit | out (ref32) | lse (ref32) | "
            "dq (ref32) / max | dk (ref32) / max | dv (ref32) / max | verdict |")
    lines = [f"# Flash lowerings at huge logits from q.k: {jax.devices()[0].device_kind}, "
             f"jax {jax.__version__}, {jnp.dtype(dtype).name}", "",
             "`" + (f'XLA_FLAGS="{os.environ["XLA_FLAGS"]}" ' if os.environ.get("XLA_FLAGS")
                    else "")
             + f"python benchmarks/extreme_logits.py --scales {args.scales} --out {args.out}"
             + (f" --dtype {args.dtype}" if args.dtype else "") + "`", "",
             "Largest absolute error against the float64 reference; in brackets the "
             "float32 reference's own; after the slash the largest float64 value.", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['lowering']} | {r['causal']} | {r['scale']:g} | | "
                         f"{r['status']} | | | | | |")
            continue
        cells = [f"{r[k]:.1e} ({r[k + '_ref32']:.1e})" for k in ("out", "lse")]
        cells += [f"{r[k]:.1e} ({r[k + '_ref32']:.1e}) / {r[k + '_max']:.1e}"
                  for k in ("dq", "dk", "dv")]
        lines.append(f"| {r['lowering']} | {r['causal']} | {r['scale']:g} | "
                     f"{r['max_logit']:.1e} | " + " | ".join(cells) + f" | {r['verdict']} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, args.out + ".md"), "w") as f:
        f.write(text)
    return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="1,1e2,1e3,1e4,1e6,1e8,1e12",
                    help="the factors q is multiplied by, comma-separated")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="the inputs' dtype (float32 on a CPU, bfloat16 on a GPU by default)")
    ap.add_argument("--out", default="extreme_logits_" + ("gpu" if ON_GPU else "cpu"),
                    help="the table's name under benchmarks/results (or a path)")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if ON_GPU else "float32"))
    rows = [row(name, changes, float(s), causal, dtype)
            for name, changes in lowerings() for s in args.scales.split(",")
            for causal in (True, False)]
    print(write(rows, args, dtype))


if __name__ == "__main__":
    main()
