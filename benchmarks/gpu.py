"""One-shot GPU benchmark: every flash peer and the decode kernels in one process.

Made for a GPU machine lent for minutes: everything runs in one Python process
(one JAX start-up, one compilation per row), each section within its own time
budget, and every row is printed as soon as it is measured.

    python benchmarks/gpu.py                      # flash (T=8k, D=128) and decode
    python benchmarks/gpu.py --flash-grid full    # D 64/128/256 x T 1k..32k
    python benchmarks/gpu.py --sections decode --out-dir /tmp/res
    python benchmarks/gpu.py --softcap 30 --dropout 0.1 --modes fwd,bwd

Sections:

* ``flash``: forward and forward+backward (``jax.grad`` of ``sum(out * w)``
  with respect to q, k and v), bf16, ``B·T = 16k`` tokens, ``H·D = 2048``,
  causal and not, for every peer that can run here:
  ``fnattn`` (``impl="auto"``: cuDNN for the specs it computes exactly,
  otherwise the Mosaic GPU kernels on Hopper where they take the spec, else the
  Triton kernels), ``fnattn:triton`` (``impl="pallas"``), ``fnattn:mosaic_gpu``
  (the Mosaic GPU forward, with the Triton backward), ``fnattn:mosaic_gpu_bwd``
  (the same forward with the Mosaic GPU backward,
  ``fnattn/flash/mosaic_gpu_bwd.py``; its forward row repeats the previous one's),
  ``fnattn:mosaic_gpu_redo`` and ``fnattn:mosaic_gpu_pass`` (those two with
  ``hidden_keys="redo"``, the default at power-of-two head dims: no pass over K
  and V before a masked forward, the Triton forward recomputes flagged rows; or
  with ``hidden_keys="pass"``: an elementwise pass over K and V first),
  ``fnattn:mosaic_gpu_persistent`` (``persistent=True``: one program per
  multiprocessor walking the q-tiles in turn, heaviest first),
  ``fnattn:mosaic_gpu_persistent_tiles`` (the same, ``walk="tiles"``: in the
  grid's order), ``fnattn:tuned`` (only when ``--impls`` names it: ``impl="auto"``
  with the block sizes ``fnattn.tune.autotune`` picks on the row's inputs, for
  the row's direction, ``--tune-reps`` calls per candidate; the row gives the
  choice, the tuning's time and its gain over the spec as given; where cuDNN
  takes the spec the row says so),
  ``jax.nn:cudnn``, ``jax.nn:xla``, ``tokamax:mosaic``, ``tokamax:triton`` and
  ``jax:attention_mgpu`` (JAX's Mosaic GPU example kernel; its backward has no
  causal mask); ``pass:hidden_keys`` times alone the elementwise pass over K
  and V that the Mosaic GPU forward runs for masked specs, and ``pass:schedule``
  the XLA work that builds its visiting table and id arrays for a mask holding
  arrays (forward rows only): with them, the kernel's own share of a row.
  ``--modes bwd`` times the backward alone (the forward and its residuals
  computed by ``jax.vjp`` outside the timed call).
  A document-masked row (packed documents with segment ids, causal) compares
  fnattn with ``jax.nn`` given the same mask as an array. Its TFLOP/s count the
  causal FLOPs; the column "per visited tile" counts the dense FLOPs times the
  fraction of tiles the schedule visits, and the table's last lines give that
  rate over the same peer's dense (no mask) rate, with the share of the visited
  tiles that are PARTIAL and the visited tiles per q tile (:func:`tile_mix`).
  ``--doc-align N`` adds a documents row whose boundaries are rounded to
  multiples of N.
  Each fnattn row's output is compared with ``jax.nn:cudnn``'s (or the XLA
  one's) on the same inputs.
* ``decode``: one new token per sequence against a contiguous cache
  (``fnattn.decode``, and ``fnattn.decode:mosaic_gpu``: its Mosaic GPU kernel,
  ``MosaicGpuDecodeBlockSizes``, skipped without a Hopper GPU; ``--decode-sweep``
  times its block sizes and ring depths too; both again with ALiBi,
  ``+alibi``, not compared with a reference) and a paged cache
  (``fnattn.paged_attention``, and ``fnattn.paged_attention:mosaic_gpu``, page 16,
  pages a random permutation of the pool), bf16, Hq=32, Hkv=8, D=128, B 1..64,
  context 4k..32k, next to plain ``jnp`` and ``jax.nn``; bandwidth counts the
  visible K and V once plus q and the output, against the device's peak HBM
  bandwidth and against a device-to-device copy measured in the same run.

Time: ``n`` calls issued back to back and waited for once (so host dispatch
overlaps the device work, as in a training or serving loop), the median of
``--reps`` such batches. Memory: XLA's temporary plus output buffers of the
compiled call (``memory_analysis``). FLOPs: ``fnattn.cost.estimate`` (causal
counts half; forward+backward is 3.5 forwards), the same count for every peer.

``--kernel-times``: each fnattn row is also profiled (:func:`kernel_times`):
the device time per call of every kernel it launches.

Writes ``<out-dir>/gpu_<section>_<device>.{md,csv}``.
"""

import argparse
import csv
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)   # paged_problems

import fnattn  # noqa: E402
from fnattn import AttentionSpec, core, cost, masks, position_bias, tune  # noqa: E402

PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


# ----------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------


def timed(fn, args, reps, min_batch_s=0.05):
    """(median s, min s, max s, XLA MB, result) of ``fn(*args)`` compiled once."""
    compiled = jax.jit(fn).lower(*args).compile()
    try:
        ma = compiled.memory_analysis()
        mem = (ma.temp_size_in_bytes + ma.output_size_in_bytes) / 2**20
    except Exception:  # noqa: BLE001 - not every backend reports it
        mem = float("nan")
    out = jax.block_until_ready(compiled(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    one = time.perf_counter() - t0
    n = max(1, min(200, int(min_batch_s / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            r = compiled(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times)), min(times), max(times), mem, out


def timed_pair(fa, fb, args, reps, min_batch_s=0.05):
    """Medians (s) of ``fa`` and ``fb`` timed in alternating batches, so that clock
    and temperature drift reach both alike: (median a, median b)."""
    ca, cb = (jax.jit(f).lower(*args).compile() for f in (fa, fb))
    jax.block_until_ready((ca(*args), cb(*args)))
    t0 = time.perf_counter()
    jax.block_until_ready(ca(*args))
    n = max(1, min(200, int(min_batch_s / max(time.perf_counter() - t0, 1e-6))))
    ta, tb = [], []
    for _ in range(reps):
        for c, ts in ((ca, ta), (cb, tb)):
            t0 = time.perf_counter()
            for _ in range(n):
                r = c(*args)
            jax.block_until_ready(r)
            ts.append((time.perf_counter() - t0) / n)
    return float(np.median(ta)), float(np.median(tb))


def kernel_times(fn, args, calls=20):
    """``{kernel: device µs per call}`` of ``fn(*args)`` from a profiler trace of
    ``calls`` calls issued back to back: the events on the device planes'
    stream lines (``/device:GPU:n``), summed by name. None where the trace has
    no device plane (the CPU). Splits a row's time into its attention kernel
    and the XLA work around it (passes, tables, merges, layout changes)."""
    import glob
    import tempfile
    from jax.profiler import ProfileData
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                r = compiled(*args)
            jax.block_until_ready(r)
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return device_kernel_totals(ProfileData.from_file(files[0]), calls)


def device_kernel_totals(data, calls):
    """``{event name: µs per call}`` over the stream lines of the device planes of
    a ``jax.profiler.ProfileData`` (its lines other than XLA's summaries where
    no line is a stream), or None without a device plane."""
    totals = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")]
        for line in lines or [ln for ln in plane.lines if "XLA" not in ln.name]:
            for ev in line.events:
                totals[ev.name] = totals.get(ev.name, 0.0) + ev.duration_ns / 1e3 / calls
    return totals or None


def _kernels_line(totals, top=6):
    """The kernels of :func:`kernel_times`, longest first, on one line."""
    if not totals:
        return "kernels: no device plane in the trace"
    items = sorted(totals.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{name[:48]} {us:.1f}" for name, us in items[:top])
    rest = sum(us for _, us in items[top:])
    return (f"kernels (µs/call, {len(items)} kinds, {sum(totals.values()):.1f} in all): {shown}"
            + (f", {len(items) - top} more {rest:.1f}" if len(items) > top else ""))


def _diff(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)))


# ----------------------------------------------------------------------------------
# flash peers
# ----------------------------------------------------------------------------------


def _mosaic_gpu_lowering(backward):
    """The lowering table of the Mosaic GPU forward, with the Triton backward or
    (``backward``) the Mosaic GPU one."""
    from fnattn.flash import api, mosaic_gpu, mosaic_gpu_bwd, xla
    low = mosaic_gpu_bwd.LOWERING if backward else mosaic_gpu.LOWERING
    return (("default", xla.LOWERING), ("cuda", api._with_tangent(low)))


def _mask(causal, segments=None):
    """The row's mask: packed documents (causal within each) when ``segments`` are
    given, else causal or none."""
    if segments is not None:
        return masks.causal() & masks.segments(segments, segments)
    return masks.causal() if causal else None


def _program_tile(D):
    """``(rows, keys)`` of one step of a Mosaic GPU forward program at head dim ``D``
    with the default block sizes (two consumers of ``block_q`` rows each), as
    ``fnattn.flash.mosaic_gpu.forward`` lays them out."""
    from fnattn.flash.mosaic_gpu import MosaicGpuBlockSizes
    bs = MosaicGpuBlockSizes.default(D)
    return 2 * bs.block_q, bs.block_k


# Peers running the Mosaic GPU forward (and backward) with one option of
# MosaicGpuBlockSizes pinned.
PINNED = {"fnattn:mosaic_gpu_redo": dict(hidden_keys="redo"),
          "fnattn:mosaic_gpu_pass": dict(hidden_keys="pass"),
          "fnattn:mosaic_gpu_persistent": dict(persistent=True),
          "fnattn:mosaic_gpu_persistent_tiles": dict(persistent=True, walk="tiles")}


def tuned_peer(causal, segments, softcap, dropout, qkv, mode, reps, budget=None):
    """``(f, facts)``: fnattn's default path with block sizes from
    ``fnattn.tune.autotune`` on these inputs (forward, or forward and backward
    for the other modes), and what the tuning chose and cost, for the row."""
    spec = AttentionSpec(mask=_mask(causal, segments), return_lse=False, softcap=softcap,
                         dropout_rate=dropout, dropout_key=jax.random.key(7) if dropout else None)
    start = time.time()
    tuned = tune.autotune(fnattn.flash, spec, *qkv, backward=mode != "fwd", reps=reps,
                          max_seconds=budget)
    facts = dict(tune_s=time.time() - start, tuned_speedup=tuned.speedup,
                 tune_complete=tuned.complete,
                 tuned=" ".join(map(repr, tuned.block_sizes)) or "(as given)",
                 tune_trials=len(tuned.trials),
                 tune_failed=sum(t.seconds is None for t in tuned.trials))
    return (lambda q, k, v: fnattn.flash(tuned.spec, q, k, v).out), facts


def flash_peer(impl, causal, segments=None, softcap=None, dropout=0.0):
    """``f(q, k, v) -> out`` for one peer, or raises (the row records why)."""
    mask = _mask(causal, segments)
    if softcap is not None and impl.startswith(("jax.nn", "jax:")):
        raise NotImplementedError("no soft-cap")
    if dropout and not impl.startswith("fnattn"):
        raise NotImplementedError("no dropout with fnattn's keep mask")
    if impl in ("fnattn", "fnattn:triton", "fnattn:mosaic_gpu", "fnattn:mosaic_gpu_bwd",
                *PINNED):
        spec = AttentionSpec(mask=mask, return_lse=False, softcap=softcap, dropout_rate=dropout,
                             dropout_key=jax.random.key(7) if dropout else None,
                             impl="pallas" if impl == "fnattn:triton" else "auto")
        if impl in PINNED:
            from fnattn.flash.mosaic_gpu import MosaicGpuBlockSizes
            if mask is None and "hidden_keys" in PINNED[impl]:
                raise NotImplementedError("no pass over K and V without a mask")
            table = _mosaic_gpu_lowering(backward=True)

            def pinned(q, k, v):
                bs = dataclasses.replace(MosaicGpuBlockSizes.default(q.shape[-1]),
                                         **PINNED[impl])
                return core.run(spec.replace(block_sizes=bs), q, k, v, fn="flash",
                                table=table).out
            return pinned
        if impl.startswith("fnattn:mosaic_gpu"):
            table = _mosaic_gpu_lowering(backward=impl == "fnattn:mosaic_gpu_bwd")
            return lambda q, k, v: core.run(spec, q, k, v, fn="flash", table=table).out
        return lambda q, k, v: fnattn.flash(spec, q, k, v).out
    if impl == "pass:hidden_keys":
        # The elementwise pass over K and V that the Mosaic GPU forward runs for
        # masked specs (mosaic_gpu._hidden_keys_inert), alone: how much of that
        # forward's time it is.
        from fnattn.flash.mosaic_gpu import _hidden_keys_inert
        if mask is None:
            raise NotImplementedError("no pass without a mask")
        return lambda q, k, v: _hidden_keys_inert(k, v)
    if impl == "pass:schedule":
        # The XLA work before the Mosaic GPU forward's kernel for a mask holding
        # arrays: its visiting table and the int32 stacks of the arrays.
        from fnattn._checks import Dims
        from fnattn.flash import mosaic_gpu as mg
        if mask is None or not mask.num_operands:
            raise NotImplementedError("no XLA work: the table is a constant without mask arrays")

        def schedule(q, k, v):
            B, T, H, D = q.shape
            rows, bk = _program_tile(D)
            table = mg.dynamic_schedule(mask, Dims(B, T, T, H, k.shape[2], D, D), None, rows, bk)
            return table, mg.id_arrays(mask, -(-T // rows) * rows, -(-T // bk) * bk)[2]
        return schedule
    if impl.startswith("jax.nn:"):
        which = impl.split(":")[1]
        if segments is not None:
            def f(q, k, v):
                T = q.shape[1]
                allowed = (segments[:, :, None] == segments[:, None, :]) & jnp.tril(
                    jnp.ones((T, T), bool))
                return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None],
                                                    implementation=which)
            return f
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation=which)
    if impl.startswith("tokamax:"):
        import tokamax
        which = impl.split(":")[1]
        if segments is not None:
            raise NotImplementedError("segment ids through tokamax's public API")
        return lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, logits_soft_cap=softcap, implementation=which)
    if impl == "jax:attention_mgpu":
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am
        if segments is not None:
            raise NotImplementedError("no segment ids")
        cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
                              block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
        # (its shared-memory tiles are float16: it takes float16 inputs only)
        def f(q, k, v):
            q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
            return am.attention(q, k, v, cfg)
        f.cast_inputs = jnp.float16
        return f
    raise ValueError(impl)


# jax.nn:cudnn first: its output is what the fnattn rows are compared with.
FLASH_IMPLS = ("jax.nn:cudnn", "fnattn", "fnattn:tuned", "fnattn:triton", "fnattn:mosaic_gpu",
               "fnattn:mosaic_gpu_bwd", *PINNED, "pass:hidden_keys", "pass:schedule", "jax.nn:xla",
               "tokamax:mosaic", "tokamax:triton", "jax:attention_mgpu")


def flash_section(args, rows, deadline):
    if args.flash_grid == "full":
        grid = [(T, D) for D in (64, 128, 256) for T in (1024, 2048, 4096, 8192, 16384, 32768)]
    elif args.flash_grid == "core":
        grid = [(8192, 128), (2048, 128), (32768, 128), (8192, 64), (8192, 256)]
    else:
        grid = [tuple(int(x) for x in item.split("x")) for item in args.flash_grid.split(",")]
    grid = [(item + item[-1:])[:3] for item in grid]    # (T, D, Dv); TxD: Dv = D
    # (fnattn:tuned times tens of candidates per row before its own: only when named)
    impls = ([i for i in FLASH_IMPLS if i in args.impls.split(",")] if args.impls
             else [i for i in FLASH_IMPLS if i != "fnattn:tuned"])
    modes = args.modes.split(",")
    for T, D, Dv in grid:
        B, H = max(1, 16384 // T), 2048 // D
        ks = jax.random.split(jax.random.key(T + D), 4)
        q, k, v, w = (jax.random.normal(kk, (B, T, H, d), jnp.bfloat16)
                      for kk, d in zip(ks, (D, D, Dv, Dv)))
        label_D = D if Dv == D else f"{D}/{Dv}"   # (the tables' D column)
        cases = [(c, None, None, 0.0, "causal" if c else "none") for c in (False, True)]
        if args.softcap:
            cases.append((True, None, args.softcap, 0.0, "causal+softcap"))
        if args.dropout:
            cases.append((True, None, None, args.dropout, "causal+dropout"))
        if T == args.doc_T and D == Dv == 128:
            # packed documents of random lengths (mean T/8), causal within each; with
            # --doc-align, the same cuts rounded to that multiple as a second row
            for align in (0,) + ((args.doc_align,) if args.doc_align else ()):
                seg = jnp.asarray(np.broadcast_to(document_ids(T, align), (B, T)).copy())
                cases.append((True, seg, None, 0.0,
                              "documents" + (f"@{align}" if align else "")))
        for causal, seg, cap, drop, label in cases:
            visited, partial, per_row = tile_mix(_mask(causal, seg), B, H, T, D)
            for mode in modes:
                ref_out = None
                for impl in impls:
                    if time.time() > deadline:
                        print("flash: time budget spent, stopping", flush=True)
                        return
                    row = dict(section="flash", impl=impl, B=B, T=T, H=H, D=label_D,
                               causal=int(causal),
                               mask=label, mode=mode)
                    if impl.startswith("pass:") and mode != "fwd":
                        continue
                    if impl == "jax.nn:xla" and B * H * T * T * 4 > args.xla_max_bytes:
                        rows.append(dict(row, status="skipped (T×T logits too large)"))
                        print(_flash_line(rows[-1]), flush=True)
                        continue
                    try:
                        if impl == "fnattn:tuned":
                            f, facts = tuned_peer(causal, seg, cap, drop, (q, k, v), mode,
                                                  args.tune_reps, args.tune_budget)
                            row.update(facts)
                        else:
                            f = flash_peer(impl, causal, seg, cap, drop)
                        fn, inputs_of = _pass(f, mode, w)
                        inputs = (q, k, v)
                        cast = getattr(f, "cast_inputs", None)
                        if cast is not None:  # (cast outside the timed call)
                            inputs = tuple(x.astype(cast) for x in inputs)
                        inputs = inputs_of(*inputs)
                        t, lo, hi, mem, out = timed(fn, inputs, args.reps)
                        if (impl == "fnattn" and seg is None and not cap and not drop
                                and args.pair_reps and mode != "bwd"):
                            # fnattn's default against cuDNN, batches alternating
                            ta, tb = timed_pair(fn, _pass(flash_peer("jax.nn:cudnn", causal),
                                                          mode, w)[0], inputs, args.pair_reps)
                            row.update(paired_ms=ta * 1e3, paired_cudnn_ms=tb * 1e3,
                                       cudnn_over_fnattn=tb / ta)
                        flops = _flops(masks.causal() if causal else None, q, k, v, mode)
                        dense = _flops(None, q, k, v, mode)
                        row.update(status="ok", time_ms=t * 1e3, min_ms=lo * 1e3, max_ms=hi * 1e3,
                                   tflops=flops / t / 1e12, xla_mb=mem, visited=visited,
                                   partial=partial, tiles_per_row=per_row,
                                   tflops_visited=dense * visited / t / 1e12)
                        if impl.startswith("pass:"):  # (no attention FLOPs: its time only)
                            row.update(tflops=float("nan"), tflops_visited=float("nan"))
                        if args.kernel_times and impl.startswith("fnattn"):
                            row["kernels"] = _kernels_line(kernel_times(fn, inputs))
                        o = out if mode == "fwd" else out[0]
                        del inputs
                        if impl.startswith("jax.nn") and ref_out is None:
                            ref_out = o
                        if ref_out is not None and impl.startswith("fnattn"):
                            row["diff_vs_jax_nn"] = _diff(o, ref_out)
                        del out, o
                    except Exception as e:  # noqa: BLE001 - a peer that cannot run
                        msg = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                        row.update(status="error: " + msg)
                        if args.verbose:
                            traceback.print_exc()
                    rows.append(row)
                    print(_flash_line(row), flush=True)
                    if "kernels" in row:
                        print("    " + row["kernels"], flush=True)
        del q, k, v, w


def _pass(f, mode, w):
    """``(fn, inputs_of)``: what is timed for ``mode`` and how its inputs are made
    from (q, k, v): the forward; the gradient of ``sum(out * w)`` (forward and
    backward); or the backward alone (``bwd``: the forward and its residuals
    are computed once, outside the timed call, by ``jax.vjp``)."""
    if mode == "fwd":
        return f, lambda *qkv: qkv
    if mode == "bwd":
        def inputs_of(*qkv):
            out, f_vjp = jax.vjp(f, *qkv)
            return f_vjp, w.astype(out.dtype)
        return (lambda f_vjp, ct: f_vjp(ct)), inputs_of

    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * w.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2)), lambda *qkv: qkv


def _flops(mask, q, k, v, mode):
    """``fnattn.cost.estimate``'s FLOPs of ``mode`` (fwd, bwd or fwd+bwd) for a mask
    without arrays (or none)."""
    spec = AttentionSpec(mask=mask)
    fwd = cost.estimate(spec, q, k, v).flops
    bwd = cost.estimate(spec, q, k, v, backward=True).flops
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def document_ids(T, align=0):
    """Segment ids of 8 packed documents over ``T`` tokens, cut at 7 random places
    (seed 0); with ``align``, each cut rounded to a multiple of ``align`` (cuts
    that meet are merged, so there may be fewer documents).

    >>> np.bincount(document_ids(8192))  # tokens per document
    array([ 336,  281, 1593,  311, 1664, 1030, 1748, 1229])
    >>> np.bincount(document_ids(8192, align=128))
    array([ 384,  256, 1536,  384, 1664, 1024, 1664, 1280])
    """
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, T), size=7, replace=False))
    if align:
        cuts = np.unique(np.round(cuts / align).astype(int) * align)
        cuts = cuts[(cuts > 0) & (cuts < T)]
    seg = np.zeros(T, np.int32)
    for c in cuts:
        seg[c:] += 1
    return seg


def tile_mix(mask, B, H, T, D):
    """How a mask's schedule visits the (q tile, kv tile) pairs with the Mosaic GPU
    forward's default tiles for ``D``: the fraction visited (not EMPTY, against
    the T² of a dense call), the share of those that are PARTIAL (mask code on
    the tile), and the visited tiles per q tile (the work a program does
    between loading Q and writing O; T / block_k for a dense call).

    >>> ids = jnp.asarray(document_ids(8192))[None]
    >>> [round(x, 3) for x in tile_mix(masks.causal() & masks.segments(ids, ids),
    ...                                1, 1, 8192, 128)]
    [0.108, 0.392, 6.891]
    >>> tile_mix(None, 1, 1, 8192, 128)
    (1.0, 0.0, 64.0)
    """
    cls = np.asarray(masks.block_classes(mask, B, H, T, T, *_program_tile(D)))
    cls = np.broadcast_to(cls, (B, H) + cls.shape[2:])
    visited = cls != masks.EMPTY
    n = int(visited.sum())
    return (n / visited.size, int((cls == masks.PARTIAL).sum()) / max(n, 1),
            n / (visited.size // visited.shape[-1]))


def _flash_line(r):
    s = (f"{r['impl']:20s} T={r['T']:6d} D={r['D']!s:>3} {r['mask']:14s} {r['mode']:8s} ")
    if r["status"] != "ok":
        return s + r["status"]
    extra = f"  |out - jax.nn| {r['diff_vs_jax_nn']:.1e}" if "diff_vs_jax_nn" in r else ""
    if "cudnn_over_fnattn" in r:
        extra += (f"  alternating with cuDNN: {r['paired_ms']:.3f} vs {r['paired_cudnn_ms']:.3f} ms"
                  f" ({r['cudnn_over_fnattn']:.3f}x)")
    if "tuned" in r:
        extra += (f"\n    tuned in {r['tune_s']:.0f} s"
                  f"{'' if r.get('tune_complete', True) else ' (budget spent)'} "
                  f"({r['tune_trials']} trials, "
                  f"{r['tune_failed']} failed; {r['tuned_speedup'] or 0:.3f}x the spec as "
                  f"given): {r['tuned']}")
    return s + (f"{r['time_ms']:8.3f} ms ({r['min_ms']:.3f}-{r['max_ms']:.3f}) "
                f"{r['tflops']:6.1f} TFLOP/s  xla {r['xla_mb']:7.0f} MB{extra}")


# ----------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------


def copy_bandwidth(reps):
    """Bytes read + written per second of a device-to-device copy of 2 GiB."""
    x = jnp.ones((2**30,), jnp.bfloat16)
    t, *_ = timed(lambda x: x[::-1], (x,), reps)  # (a reversal: not elided)
    return 2 * x.nbytes / t


def decode_section(args, rows, deadline):
    import paged_problems as bench
    from fnattn.paged.common import PagedBlockSizes
    from fnattn.decoding import mosaic_gpu as mgpu_decode
    from fnattn.decoding.api import DecodeBlockSizes
    from fnattn.decoding.mosaic_gpu import MosaicGpuDecodeBlockSizes
    from fnattn.flash import mosaic_gpu
    from fnattn.flash.mosaic_gpu import SMEM_BYTES

    dev = jax.devices()[0]
    peak = next((bw for name, bw in PEAK_BW.items() if name in dev.device_kind), None)
    copy_bw = copy_bandwidth(args.reps)
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s"
          + (f" ({copy_bw / peak:.0%} of the {peak / 1e12:.2f} TB/s peak)" if peak else ""),
          flush=True)
    Hq, Hkv, D, ps, dtype = 32, 8, 128, 16, jnp.bfloat16
    no_hopper = mosaic_gpu.available()   # (why the Mosaic GPU rows cannot run, or None)
    grid = [tuple(int(x) for x in item.split("x")) for item in args.decode_grid.split(",")]
    for B, S in grid:
        if time.time() > deadline:
            print("decode: time budget spent, stopping", flush=True)
            return
        prob = bench.decode_problem(batch=B, context=S, num_q_heads=Hq, num_kv_heads=Hkv,
                                    head_dim=D, page_size=ps, dtype=dtype)
        nbytes = bench.decode_bytes(prob)
        ks = jax.random.split(jax.random.key(B + S), 3)
        cont = (jax.random.normal(ks[0], (B, 1, Hq, D), dtype),
                jax.random.normal(ks[1], (B, S, Hkv, D), dtype),
                jax.random.normal(ks[2], (B, S, Hkv, D), dtype), jnp.full((B,), S, jnp.int32))

        def dec(block_sizes=None, alibi=False):
            term = (position_bias.alibi(jnp.asarray(position_bias.alibi_slopes(Hq)))
                    if alibi else None)
            spec = AttentionSpec(mask=masks.causal(), return_lse=False, block_sizes=block_sizes,
                                 position_bias=term)
            return lambda q, k, v, n: fnattn.decode(spec, q, k, v, kv_lengths=n).out

        from decode import jnp_decode  # (benchmarks/decode.py's plain baseline)
        entries = [("contiguous", "fnattn.decode", dec(), cont),
                   ("contiguous", "fnattn.decode:mosaic_gpu", dec(MosaicGpuDecodeBlockSizes()),
                    cont),
                   # (with ALiBi: the term's cost on each kernel; no reference computes it)
                   ("contiguous", "fnattn.decode+alibi", dec(alibi=True), cont),
                   ("contiguous", "fnattn.decode:mosaic_gpu+alibi",
                    dec(MosaicGpuDecodeBlockSizes(), alibi=True), cont),
                   ("contiguous", "jnp einsum+softmax", jnp_decode, cont),
                   ("contiguous", "jax.nn:cudnn", _jaxnn_decode("cudnn"), cont),
                   ("contiguous", "jax.nn:xla", _jaxnn_decode("xla"), cont),
                   ("paged", "fnattn.paged_attention", bench.decode_fn("auto"), prob.args),
                   ("paged", "fnattn.paged_attention:mosaic_gpu", bench.decode_fn(
                       "auto", (MosaicGpuDecodeBlockSizes(), PagedBlockSizes())), prob.args),
                   ("paged", "jnp gather+softmax", bench.gather_decode, prob.args)]
        if f"{B}x{S}" in args.decode_sweep.split(","):
            for ns in (None, 8):
                for bk in (64, 128):
                    for st in (2, 3, 4):
                        if mgpu_decode.smem_bytes(D, D, bk, st) <= SMEM_BYTES:
                            entries.append((
                                "contiguous", f"fnattn.decode:mosaic_gpu splits={ns} bk={bk} "
                                f"stages={st}", dec((MosaicGpuDecodeBlockSizes(
                                    block_k=bk, max_concurrent_steps=st),
                                    DecodeBlockSizes(num_splits=ns))), cont))
            for ns in (None, 8):
                for bk in (64, 128):
                    for st in (2, 3, 4):
                        entries.append(("contiguous", f"fnattn.decode splits={ns} bk={bk} "
                                        f"stages={st}", dec(DecodeBlockSizes(
                                            num_splits=ns, block_k=bk, num_stages=st)), cont))
            for ns in (None, 16):
                for bk in (64, 128):
                    for st in (2, 3, 4):
                        entries.append(("paged", f"fnattn.paged splits={ns} bk={bk} stages={st}",
                                        bench.decode_fn("auto", PagedBlockSizes(
                                            block_k=bk, num_splits=ns, num_stages=st)),
                                        prob.args))
        if f"{B}x{S}" in args.split_sweep.split(","):
            for ns in (int(x) for x in args.splits.split(",")):
                if ns <= S // 64:
                    if S % ns == 0:  # (an explicit split count must divide S there)
                        entries.append(("contiguous", f"fnattn.decode splits={ns}",
                                        dec(DecodeBlockSizes(num_splits=ns)), cont))
                    entries.append(("paged", f"fnattn.paged splits={ns}",
                                    bench.decode_fn("auto", PagedBlockSizes(num_splits=ns)),
                                    prob.args))
        refs = {}
        for cache, name, fn, fargs in entries:
            if time.time() > deadline:
                break
            row = dict(section="decode", cache=cache, impl=name, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D,
                       page_size=ps if cache == "paged" else "")
            if "mosaic_gpu" in name and no_hopper is not None:
                # (elsewhere the spec runs the Triton kernel: a row named for a
                # kernel it did not time would mislead)
                row.update(status="skipped: " + no_hopper)
                rows.append(row)
                print(_decode_line(row), flush=True)
                continue
            try:
                t, lo, hi, mem, out = timed(fn, fargs, args.reps)
                if not name.startswith("fnattn"):
                    refs.setdefault(cache, out)
                row.update(status="ok", time_ms=t * 1e3, min_ms=lo * 1e3, max_ms=hi * 1e3,
                           gb_s=nbytes / t / 1e9, frac_peak=(nbytes / t / peak) if peak else None,
                           frac_copy=nbytes / t / copy_bw, xla_mb=mem)
                if cache in refs and name.startswith("fnattn") and "+alibi" not in name:
                    row["diff"] = _diff(out, refs[cache])
                if args.kernel_times and name in ("fnattn.decode", "fnattn.decode:mosaic_gpu",
                                                  "fnattn.paged_attention",
                                                  "fnattn.paged_attention:mosaic_gpu"):
                    row["kernels"] = _kernels_line(kernel_times(fn, fargs))
            except Exception as e:  # noqa: BLE001
                row.update(status="error: " + f"{type(e).__name__}: {e}".splitlines()[0][:160])
                if args.verbose:
                    traceback.print_exc()
            rows.append(row)
            print(_decode_line(row), flush=True)
            if "kernels" in row:
                print("    " + row["kernels"], flush=True)
    rows.append(dict(section="decode", cache="copy", impl="device-to-device copy", status="ok",
                     gb_s=copy_bw / 1e9, frac_peak=copy_bw / peak if peak else None))


def _jaxnn_decode(which):
    def f(q, k, v, lengths):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                            implementation=which)
    return f


def _decode_line(r):
    s = f"{r['cache']:10s} {r['impl']:38s} B={r['B']:3d} S={r['S']:6d} "
    if r["status"] != "ok":
        return s + r["status"]
    return s + (f"{r['time_ms']:8.3f} ms {r['gb_s']:7.0f} GB/s "
                + (f"{r['frac_peak']:6.1%} of peak " if r.get("frac_peak") else "")
                + f"{r['frac_copy']:6.1%} of copy  xla {r['xla_mb']:6.0f} MB"
                + (f"  |diff| {r['diff']:.1e}" if "diff" in r else ""))


# ----------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------


def write(rows, section, args, started):
    dev = jax.devices()[0]
    kind = dev.device_kind.replace(" ", "_").replace("/", "_")
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"gpu_{section}_{kind}")
    mine = [r for r in rows if r["section"] == section]
    if not mine:
        return
    fields = sorted({k for r in mine for k in r}, key=lambda k: (k != "impl", k))
    with open(stem + ".csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(mine)
    head = [f"# fnattn GPU benchmark: {section}", "",
            f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
            f"- device: {dev.device_kind}; {os.cpu_count()} CPUs, {platform.machine()}",
            f"- jax {jax.__version__}, Python {platform.python_version()}",
            f"- command: `python benchmarks/gpu.py {' '.join(sys.argv[1:])}` "
            f"({(time.time() - started) / 60:.1f} min for the whole run)",
            "- time: median of batches of calls issued back to back; XLA MB: temporary + "
            "output buffers of the compiled call; 'alternating': fnattn's default and cuDNN "
            "timed in alternating batches (medians), the steadier ratio", ""]
    if section == "flash":
        lines = ["| T | D | mask | pass | impl | ms | TFLOP/s | per visited tile | XLA MB | "
                 "÷ cuDNN time | |out − jax.nn| |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            h = f"| {r['T']} | {r['D']} | {r['mask']} | {r['mode']} | {r['impl']} "
            if r["status"] != "ok":
                lines.append(h + f"| {r['status']} | | | | | |")
                continue
            cud = next((x for x in mine if x["impl"] == "jax.nn:cudnn" and x["status"] == "ok"
                        and all(x[c] == r[c] for c in ("T", "D", "mask", "mode"))), None)
            ratio = f"{cud['time_ms'] / r['time_ms']:.2f}×" if cud else ""
            if "cudnn_over_fnattn" in r:
                ratio += (f" (alternating: {r['cudnn_over_fnattn']:.3f}×, {r['paired_ms']:.3f} vs "
                          f"{r['paired_cudnn_ms']:.3f} ms)")
            d = f"{r['diff_vs_jax_nn']:.1e}" if "diff_vs_jax_nn" in r else ""
            lines.append(h + f"| {r['time_ms']:.3f} | {r['tflops']:.0f} | "
                         f"{r['tflops_visited']:.0f} ({r['visited']:.1%}) | {r['xla_mb']:.0f} | "
                         f"{ratio} | {d} |")
        lines += [""] + _visited_rates(mine)
        tuned = [r for r in mine if "tuned" in r]
        if tuned:  # (fnattn:tuned rows)
            lines += ["", "What `fnattn.tune.autotune` chose for the fnattn:tuned rows:", ""]
            lines += [f"- T {r['T']}, D {r['D']}, {r['mask']}, {r['mode']}: {r['tuned']} "
                      f"({r['tune_trials']} trials, {r['tune_failed']} failed, "
                      f"{r['tune_s']:.0f} s; {r['tuned_speedup'] or 0:.3f}× the spec as given)"
                      for r in tuned]
        head.append("- TFLOP/s: `fnattn.cost.estimate`'s FLOPs (4·B·H·T²·D forward, halved "
                    "when causal, ×2.5 backward, ×3.5 forward+backward) over the time; the "
                    "documents rows count the causal FLOPs. Per visited tile: the dense "
                    "FLOPs times the fraction of tiles the mask's schedule visits (in "
                    "brackets; the Mosaic GPU forward's tiles), over the time. ÷ cuDNN time: "
                    "jax.nn:cudnn's time over this row's (> 1: faster than cuDNN)\n")
    else:
        lines = ["| cache | impl | B | S | ms | GB/s | % of peak HBM | % of copy | XLA MB | "
                 "|diff| |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            if r["cache"] == "copy":
                lines.append(f"| copy | device-to-device copy | | | | {r['gb_s']:.0f} | "
                             f"{(r['frac_peak'] or 0):.1%} | 100% | | |")
                continue
            h = f"| {r['cache']} | {r['impl']} | {r['B']} | {r['S']} "
            if r["status"] != "ok":
                lines.append(h + f"| {r['status']} | | | | | |")
                continue
            fp = f"{r['frac_peak']:.1%}" if r.get("frac_peak") else ""
            d = f"{r['diff']:.1e}" if "diff" in r else ""
            lines.append(h + f"| {r['time_ms']:.3f} | {r['gb_s']:.0f} | {fp} | "
                         f"{r['frac_copy']:.1%} | {r['xla_mb']:.0f} | {d} |")
        peak = next((f"{name} {bw / 1e12:.2f} TB/s" for name, bw in PEAK_BW.items()
                     if name in dev.device_kind), "unknown for this device")
        head.append("- GB/s: K and V of the visible context read once, plus q and the output, "
                    f"over the time; peak HBM: the data sheet's ({peak})\n")
    kernels = [f"- {r['impl']}, " + ", ".join(
        f"{c} {r[c]}" for c in ("T", "D", "mask", "mode", "B", "S") if c in r)
        + f": {r['kernels']}" for r in mine if "kernels" in r]
    if kernels:  # (--kernel-times)
        lines += ["", "Device time per kernel and call (a profiler trace of 20 calls):", ""]
        lines += kernels
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(head + lines) + "\n")
    print("wrote", stem + ".md", flush=True)


def _visited_rates(rows):
    """Lines comparing each documents row's rate per visited tile with the same
    peer's dense rate (mask none, same T, D and pass)."""
    out = []
    for r in rows:
        if (not r["mask"].startswith("documents") or r["status"] != "ok"
                or not r["impl"].startswith("fnattn")):
            continue
        dense = next((x for x in rows if x["mask"] == "none" and x["status"] == "ok" and
                      all(x[c] == r[c] for c in ("impl", "T", "D", "mode"))), None)
        if dense is not None:
            out.append(f"- {r['mask']}, {r['mode']}, {r['impl']}: {r['tflops_visited']:.0f} "
                       f"TFLOP/s per visited tile = {r['tflops_visited'] / dense['tflops']:.0%} "
                       f"of its dense rate ({dense['tflops']:.0f})"
                       + (f"; {r['partial']:.0%} of its visited tiles PARTIAL, "
                          f"{r['tiles_per_row']:.1f} per q tile (dense: "
                          f"{dense['tiles_per_row']:.0f})" if "partial" in r else ""))
    return out


def parser() -> argparse.ArgumentParser:
    """The command line of this script."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="flash,decode")
    ap.add_argument("--flash-grid", default="8192x128",
                    help="'full', 'core', or comma-separated TxD items (TxDxDv: a value "
                         "head dim unlike D)")
    ap.add_argument("--impls", default=None, help="comma-separated flash peers")
    ap.add_argument("--modes", default="fwd,fwd+bwd",
                    help="comma-separated: fwd, fwd+bwd, bwd (the backward alone)")
    ap.add_argument("--doc-T", type=int, default=8192, help="T of the document-masked row")
    ap.add_argument("--doc-align", type=int, default=0,
                    help="also a documents row with the cuts rounded to this multiple (128: "
                         "PARTIAL tiles only on the diagonals), to tell the cost of mask code "
                         "on PARTIAL tiles from the cost per q tile")
    ap.add_argument("--softcap", type=float, default=None,
                    help="also a causal row with this soft-cap (which cuDNN cannot run)")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="also a causal row with this dropout rate (fnattn's peers only)")
    ap.add_argument("--decode-grid", default="16x4096,16x16384,64x4096,64x8192,1x32768,4x16384")
    ap.add_argument("--decode-sweep", default="",
                    help="BxS items at which split and block-size variants of the decode "
                         "kernels are timed too")
    ap.add_argument("--split-sweep", default="",
                    help="BxS items at which both decode kernels are timed at each of "
                         "--splits (default block sizes otherwise)")
    ap.add_argument("--splits", default="1,2,3,4,5,6,8,16,32,64",
                    help="split counts of --split-sweep (those above S/64 are left out, and "
                         "for the contiguous cache those that do not divide S)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tune-reps", type=int, default=3,
                    help="timed calls per candidate of the fnattn:tuned rows' autotune")
    ap.add_argument("--tune-budget", type=float, default=240,
                    help="seconds each fnattn:tuned row's autotune may take (max_seconds)")
    ap.add_argument("--pair-reps", type=int, default=10,
                    help="alternating batches of fnattn (impl='auto') and cuDNN (0: none)")
    ap.add_argument("--xla-max-bytes", type=float, default=8e9)
    ap.add_argument("--budget", default="flash=300,decode=120",
                    help="seconds per section")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--kernel-times", action="store_true",
                    help="profile each fnattn row: device time per kernel per call")
    return ap


def main():
    ap = parser()
    args = ap.parse_args()
    unknown = sorted(set(args.impls.split(",")) - set(FLASH_IMPLS)) if args.impls else []
    if unknown:
        ap.error(f"unknown --impls {unknown}; choose from {list(FLASH_IMPLS)}")
    budgets = {k: float(v) for k, v in (x.split("=") for x in args.budget.split(","))}
    dev = jax.devices()[0]
    print(f"{dev.device_kind} jax {jax.__version__}", flush=True)
    started = time.time()
    rows = []
    for section in args.sections.split(","):
        deadline = time.time() + budgets.get(section, 300)
        try:
            {"flash": flash_section, "decode": decode_section}[section](args, rows, deadline)
        finally:
            write(rows, section, args, started)
    with open(os.path.join(args.out_dir, "gpu_rows.json"), "w") as fh:
        json.dump(rows, fh)


if __name__ == "__main__":
    main()
