"""``python -m fnattn``: check and time every variant available on this machine.

For each variant and lowering: whether it matches the reference on a small case
(forward and gradient), then its median time and peak memory on a moderate case
next to ``jax.nn.dot_product_attention`` measured in the same run. Ring
attention splits the sequence over every local device (checked against flash
on one device). Peak memory
is XLA's compiled temporary-buffer size for the call (inputs and outputs
excluded), the same measure for every row. Exits with status 1 if any check
fails.

``python -m fnattn --quick`` runs the same checks and times the same rows at
small sizes (T = 256, decode S = 256): a smoke test of an installation in
seconds, whose times say little.
"""

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import fnattn
from fnattn import AttentionSpec, masks, position_bias
from fnattn.flash import mosaic_gpu


def _jaxnn(spec, q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=isinstance(spec.mask, masks.Causal))


def _alibi(num_heads):
    return {"position_bias": position_bias.alibi(
        jnp.asarray(position_bias.alibi_slopes(num_heads)))}


# (name, function(spec, q, k, v) -> out, spec changes: a dict, or a function of the
# number of query heads giving one). One line per variant.
VARIANTS = (
    ("attention impl=auto (flash)", lambda s, q, k, v: fnattn.attention(s, q, k, v).out, {}),
    ("flash impl=xla", lambda s, q, k, v: fnattn.flash(s, q, k, v).out, {"impl": "xla"}),
    ("attention impl=xla (dense)", lambda s, q, k, v: fnattn.attention(s, q, k, v).out,
     {"impl": "xla"}),
    ("attention impl=cudnn (jax.nn)", lambda s, q, k, v: fnattn.attention(s, q, k, v).out,
     {"impl": "cudnn"}),
    ("attention impl=auto + ALiBi", lambda s, q, k, v: fnattn.attention(s, q, k, v).out,
     _alibi),
    ("reference", lambda s, q, k, v: fnattn.reference(s, q, k, v).out, {}),
)


def _changes(changes, num_heads):
    return changes(num_heads) if callable(changes) else changes


def _inputs(B, T, Hq, Hkv, D, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, T, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, T, Hkv, D), dtype)
    return q, k, v


def check(fn, changes, dtype):
    """Max abs error of output and dq against the reference on a small causal case."""
    q, k, v = _inputs(2, 97, 4, 2, 32, dtype)
    spec = AttentionSpec(mask=masks.causal()).replace(**_changes(changes, q.shape[2]))
    ref_spec = spec.replace(impl="reference")

    def loss(f, s):
        return lambda q: jnp.sum(f(s, q, k, v).astype(jnp.float32) ** 2)

    out = jax.jit(lambda q: fn(spec, q, k, v))(q)
    ref = jax.jit(lambda q: fnattn.reference(ref_spec, q, k, v).out)(q)
    g = jax.jit(jax.grad(loss(fn, spec)))(q)
    gr = jax.jit(jax.grad(loss(lambda s, q, k, v: fnattn.reference(s, q, k, v).out, ref_spec)))(q)
    err = max(float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))),
              float(jnp.max(jnp.abs(g.astype(jnp.float32) - gr.astype(jnp.float32))))
              / max(1.0, float(jnp.max(jnp.abs(gr.astype(jnp.float32))))))
    return err


def timeit(fn, spec, q, *arrays, reps):
    f = jax.jit(lambda q, *arrays: fn(spec, q, *arrays))
    compiled = f.lower(q, *arrays).compile()
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", float("nan")) if mem is not None else float("nan")
    jax.block_until_ready(compiled(q, *arrays))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, *arrays))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), temp


def _decode_inputs(B, S, Hq, Hkv, D, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, 1, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, S, Hkv, D), dtype)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), dtype)
    return q, k, v


def _to_pages(k, v, page_size):
    """A contiguous cache (B, S, Hkv, D) as paged pools with permuted pages."""
    B, S, Hkv, _ = k.shape
    P = S // page_size
    table = jax.random.permutation(jax.random.key(7), B * P).astype(jnp.int32).reshape(B, P)

    def pool(x):
        pages = x.reshape(B, P, page_size, Hkv, -1).transpose(3, 0, 1, 2, 4)
        return jnp.zeros((Hkv, B * P, page_size, x.shape[-1]), x.dtype).at[:, table].set(pages)

    return pool(k), pool(v), table


def serving(gpu, dtype, tol, quick=False):
    """Decode (contiguous and paged) checked against the reference and timed next to
    jax.nn.dot_product_attention with key_value_seq_lengths. Returns True on failure."""
    B, S, Hq, Hkv, D = (16, 8192, 32, 8, 128) if gpu else (8, 4096, 8, 2, 64)
    if quick:
        B, S = 2, 256
    hopper = gpu and mosaic_gpu.available() is None
    print(f"\ndecode: one query token, B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} "
          f"{jnp.dtype(dtype).name}, causal; check on B=3 S=96 against the reference"
          + (" (S=128 D=64 for the Mosaic GPU kernels)" if hopper else ""))
    spec = AttentionSpec(mask=masks.causal())
    lengths = jnp.array([96, 33, 1], jnp.int32)

    def run_decode(q, k, v, L, spec=spec):
        return fnattn.decode(spec, q, k, v, kv_lengths=L).out

    def run_paged(q, kp, vp, table, L, spec=spec):
        return fnattn.paged_attention(spec, q, kp, vp, page_table=table, kv_lengths=L).out

    failed = False
    q, k, v = _decode_inputs(B, S, Hq, Hkv, D, dtype, seed=1)
    L = jnp.full((B,), S, jnp.int32)
    base_t, base_m = timeit(lambda s, q, k, v: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=L), None, q, k, v, reps=10)
    print(f"{'variant':32s} {'check':18s} {'time':>10s} {'temp mem':>10s} {'vs jax.nn':>9s}")
    print(f"{'jax.nn.dot_product_attention':32s} {'(baseline)':18s} {base_t * 1e3:8.2f}ms "
          f"{base_m / 2**20:8.1f}MB {1.0:8.2f}x")
    # The check: B=3 S=96 D=32; S=128 D=64 for the Mosaic GPU kernels (their
    # caches' lengths and head dims are multiples of 64).
    small = _decode_inputs(3, 96, 4, 2, 32, dtype)
    rows = [("decode (contiguous cache)", run_decode, small, False),
            ("paged_attention (page 16)", run_paged, small, True)]
    if hopper:
        mspec = spec.replace(block_sizes=fnattn.MosaicGpuDecodeBlockSizes())
        small = _decode_inputs(3, 128, 4, 2, 64, dtype)
        rows += [("decode (Mosaic GPU kernel)", functools.partial(run_decode, spec=mspec),
                  small, False),
                 ("paged (page 16, Mosaic GPU)", functools.partial(run_paged, spec=mspec),
                  small, True)]
    for name, fn, (qs, ks, vs), paged in rows:
        small_cache = _to_pages(ks, vs, 16) if paged else (ks, vs)
        big_cache = _to_pages(k, v, 16) if paged else (k, v)
        out = jax.jit(fn)(qs, *small_cache, lengths).astype(jnp.float32)
        err = 0.0
        for b in range(3):
            n = int(lengths[b])
            ref = fnattn.reference(spec, qs[b:b + 1], ks[b:b + 1, :n], vs[b:b + 1, :n]).out
            err = max(err, float(jnp.max(jnp.abs(out[b:b + 1] - ref.astype(jnp.float32)))))
        status = "PASS" if err <= tol else "FAIL"
        failed |= status == "FAIL"
        t, m = timeit(lambda s, q, *cache, fn=fn: fn(q, *cache, L), None, q, *big_cache,
                      reps=10)
        print(f"{name:32s} {status + f' ({err:.1e})':18s} {t * 1e3:8.2f}ms {m / 2**20:8.1f}MB "
              f"{base_t / t:8.2f}x")
    return failed


def context_parallel(dtype, tol, shape, base_t):
    """Ring attention (zigzag) over every local device, checked against flash on
    one device and timed next to jax.nn. Returns True on failure."""
    from jax.sharding import Mesh, PartitionSpec as P
    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    spec = AttentionSpec(mask=masks.causal())
    print(f"\ncontext parallelism: ring attention, zigzag layout, the sequence split over "
          f"{n} device(s) with jax.shard_map" + (
              " (one device: one ring step; on a CPU try XLA_FLAGS="
              "--xla_force_host_platform_device_count=8)" if n == 1 else ""))

    def ring(q, k, v):
        zig = lambda x: fnattn.context.reorder(x, n, "zigzag")  # noqa: E731
        f = jax.shard_map(lambda q, k, v: fnattn.context.attention(
            spec, q, k, v, axis_name="seq", layout="zigzag").out, mesh=mesh,
            in_specs=P(None, "seq"), out_specs=P(None, "seq"))
        return fnattn.context.restore(f(zig(q), zig(k), zig(v)), n, "zigzag")

    q, k, v = _inputs(2, 32 * n, 4, 2, 32, dtype)
    loss = lambda f: lambda q: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
    flash = lambda q, k, v: fnattn.attention(spec, q, k, v).out  # noqa: E731
    out, ref = jax.jit(ring)(q, k, v), jax.jit(flash)(q, k, v)
    g, gr = jax.jit(jax.grad(loss(ring)))(q), jax.jit(jax.grad(loss(flash)))(q)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    err = max(float(jnp.max(jnp.abs(f32(out) - f32(ref)))),
              float(jnp.max(jnp.abs(f32(g) - f32(gr)))) / max(1.0, float(jnp.max(jnp.abs(f32(gr))))))
    status = "PASS" if err <= tol else "FAIL"
    B, T, H, D = shape
    T -= T % (2 * n)
    t, m = timeit(lambda s, q, k, v: ring(q, k, v), None, *_inputs(B, T, H, H, D, dtype, 1),
                  reps=5)
    print(f"{'ring (zigzag), causal':32s} {status + f' ({err:.1e})':18s} {t * 1e3:8.1f}ms "
          f"{m / 2**20:8.1f}MB {base_t / t:8.2f}x  (vs jax.nn causal above; memory per device)")
    return status == "FAIL"


def forward_mode(dtype, tol, shape):
    """jax.jvp through attention (impl="auto"), checked against the reference's
    own jvp and timed next to jax.nn's. Returns True on failure."""
    print("\nforward-mode differentiation: jax.jvp with tangents for q, k and v, causal")
    spec = AttentionSpec(mask=masks.causal())

    def jvp(fn):
        return lambda s, q, k, v: jax.jvp(lambda q, k, v: fn(s, q, k, v), (q, k, v),
                                          (v.mean() + q, k, v))[1]

    fast = lambda s, q, k, v: fnattn.attention(s, q, k, v).out  # noqa: E731
    ref = lambda s, q, k, v: fnattn.attention(s.replace(impl="reference"), q, k, v).out  # noqa
    q, k, v = _inputs(2, 97, 4, 2, 32, dtype)
    got = jax.jit(lambda q, k, v: jvp(fast)(spec, q, k, v))(q, k, v).astype(jnp.float32)
    want = jax.jit(lambda q, k, v: jvp(ref)(spec, q, k, v))(q, k, v).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - want))) / max(1.0, float(jnp.max(jnp.abs(want))))
    status = "PASS" if err <= tol else "FAIL"
    B, T, H, D = shape
    args = _inputs(B, T, H, H, D, dtype, 1)
    # (jax.nn's cuDNN path has no forward mode: its XLA path is the baseline)
    nn = lambda s, q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, implementation="xla")
    base_t, base_m = timeit(jvp(nn), spec, *args, reps=3)
    t, m = timeit(jvp(fast), spec, *args, reps=3)
    print(f"{'jax.jvp of jax.nn (xla)':32s} {'(baseline)':18s} {base_t * 1e3:8.1f}ms "
          f"{base_m / 2**20:8.1f}MB {1.0:8.2f}x")
    print(f"{'jax.jvp of attention impl=auto':32s} {status + f' ({err:.1e})':18s} "
          f"{t * 1e3:8.1f}ms {m / 2**20:8.1f}MB {base_t / t:8.2f}x")
    return status == "FAIL"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m fnattn",
        description="Check and time every attention variant available on this machine.")
    parser.add_argument("--quick", action="store_true",
                        help="the same checks, timed at small sizes (a smoke test)")
    quick = parser.parse_args(argv).quick
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    B, T, H, D = (4, 4096, 16, 128) if gpu else (1, 2048, 8, 64)
    if quick:
        B, T, H, D = 1, 256, 2, 32
    tol = 2e-2 if gpu else 1e-4
    print(f"fnattn {fnattn.__version__} | jax {jax.__version__} | {dev.platform}: "
          f"{dev.device_kind} | {len(jax.devices())} device(s)")
    print(f"check: B=2 T=97 Hq=4 Hkv=2 D=32 causal, {jnp.dtype(dtype).name}, output and dq vs "
          f"reference (tolerance {tol})")
    print(f"timing: B={B} T={T} H={H} D={D} {jnp.dtype(dtype).name}, causal and full; "
          "memory = XLA temporary buffers\n")
    q, k, v = _inputs(B, T, H, H, D, dtype, seed=1)
    failed = False
    rows = []
    for causal in (False, True):
        spec0 = AttentionSpec(mask=masks.causal() if causal else None)
        base_t, base_m = timeit(_jaxnn, spec0, q, k, v, reps=5)
        rows.append(("jax.nn.dot_product_attention", causal, "(baseline)", base_t, base_m, 1.0))
        for name, fn, changes in VARIANTS:
            if name == "reference" and not causal:
                continue
            if causal:
                try:
                    err = check(fn, changes, dtype)
                    status = "PASS" if err <= tol else "FAIL"
                except NotImplementedError as e:
                    status, err = "n/a", str(e).split(".")[0]
                failed |= status == "FAIL"
                verdict = f"{status} ({err:.1e})" if isinstance(err, float) else f"{status}"
            else:
                verdict = ""
            t, m = timeit(fn, spec0.replace(**_changes(changes, H)), q, k, v, reps=5)
            rows.append((name, causal, verdict, t, m, base_t / t))
    print(f"{'variant / lowering':32s} {'mask':7s} {'check':18s} {'time':>10s} "
          f"{'temp mem':>10s} {'vs jax.nn':>9s}")
    for name, causal, verdict, t, m, speed in rows:
        print(f"{name:32s} {'causal' if causal else 'full':7s} {verdict:18s} "
              f"{t * 1e3:8.1f}ms {m / 2**20:8.1f}MB {speed:8.2f}x")
    causal_base = next(t for name, causal, _, t, _, _ in rows
                       if name.startswith("jax.nn") and causal)
    failed |= forward_mode(dtype, tol, (B, T, H, D))
    failed |= context_parallel(dtype, tol, (B, T, H, D), causal_base)
    failed |= serving(gpu, dtype, tol, quick)
    if failed:
        print("\nSOME CHECKS FAILED")
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
