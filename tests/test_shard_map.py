"""fnattn's functions inside ``jax.shard_map``, on a 2x2 mesh of 4 CPU devices;
then every multi-device check of ``tests/multi_device`` on 8 devices.

Data parallel along the batch and tensor parallel along the heads, under
``shard_map``'s default varying-axes check: each device runs flash (forward and
gradients, with a document mask whose segment ids are sharded with the batch
and sinks split like the heads), decode (forward and gradients) on its share of
a contiguous cache, and ragged paged attention on its kv heads of a paged pool.
Each result must equal the same call on the whole, unsharded arrays; the
gradient of the sinks, replicated along the batch axis, is summed over it. Dropout
with one replicated key and ``dropout.shard_offsets`` draws exactly the unsharded
mask; without offsets each shard draws its own (``dropout.shard_key``). And the
Triton and Mosaic kernels of all three, inside ``shard_map``, lower for GPU and TPU.

The host device count is fixed when JAX starts, so the checks run in a fresh
Python process (this file run as a script) with
``--xla_force_host_platform_device_count=8`` (one subprocess for every
multi-device check).
"""

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fnattn
from fnattn import AttentionSpec, masks

F32 = jnp.float32


def _close(name, x, y, tol=2e-5):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol, err_msg=name)


def check_flash(mesh, impl):
    rs = np.random.default_rng(0)
    B, T, Hq, Hkv, D = 4, 48, 4, 2, 8
    q = jnp.asarray(rs.standard_normal((B, T, Hq, D)), F32)
    k = jnp.asarray(rs.standard_normal((B, T, Hkv, D)), F32)
    v = jnp.asarray(rs.standard_normal((B, T, Hkv, D)), F32)
    ids = jnp.asarray(np.sort(rs.integers(0, 3, (B, T)), axis=1), jnp.int32)
    w = jnp.asarray(rs.standard_normal((B, T, Hq, D)), F32)
    sinks = jnp.asarray(rs.standard_normal((Hq,)), F32)

    def attend(q, k, v, ids, sinks):
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids), sinks=sinks,
                             softcap=20.0, impl=impl, block_sizes=fnattn.XlaBlockSizes(16, 16))
        return fnattn.flash(spec, q, k, v)

    def loss_and_grads(q, k, v, ids, sinks, w):
        def loss(q, k, v, sinks):
            res = attend(q, k, v, ids, sinks)
            return jnp.sum(res.out * w), res
        (_, res), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v,
                                                                                    sinks)
        return res.out, res.lse, g

    # The sinks are replicated along "data": with the varying-axes check their
    # gradient is summed over it (by JAX, as for any replicated input).
    check = impl != "pallas"

    def on_device(q, k, v, ids, sinks, w):
        out, lse, (dq, dk, dv, dsinks) = loss_and_grads(q, k, v, ids, sinks, w)
        if not check:  # then each device holds its batch rows' share only
            dsinks = jax.lax.psum(dsinks, "data")
        return out, lse, (dq, dk, dv, dsinks)

    heads = P("data", None, "model", None)
    sharded = jax.shard_map(
        on_device, mesh=mesh,
        in_specs=(heads, heads, heads, P("data", None), P("model"), heads),
        out_specs=(heads, P("data", "model", None), (heads, heads, heads, P("model"))),
        # JAX's Pallas interpreter (impl="pallas" on a CPU) cannot run under the
        # varying-axes check; compiled kernels and the XLA lowering can.
        check_vma=check)
    out, lse, grads = jax.jit(sharded)(q, k, v, ids, sinks, w)
    r_out, r_lse, r_grads = jax.jit(loss_and_grads)(q, k, v, ids, sinks, w)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads),
                          (r_out, r_lse, *r_grads)):
        _close(f"flash[{impl}] {name}", x, y, 1e-4)


def check_decode(mesh):
    rs = np.random.default_rng(1)
    B, S, Hq, Hkv, D = 4, 40, 4, 2, 8
    q = jnp.asarray(rs.standard_normal((B, 1, Hq, D)), F32)
    kc = jnp.asarray(rs.standard_normal((B, S, Hkv, D)), F32)
    vc = jnp.asarray(rs.standard_normal((B, S, Hkv, D)), F32)
    lengths = jnp.array([40, 7, 0, 23], jnp.int32)
    sinks = jnp.asarray(rs.standard_normal((Hq,)), F32)
    w = jnp.asarray(rs.standard_normal((B, 1, Hq, D)), F32)

    def run(q, kc, vc, sinks, lengths, w):
        def loss(q, kc, vc, sinks):
            res = fnattn.decode(AttentionSpec(mask=masks.causal(), sinks=sinks), q, kc, vc,
                                kv_lengths=lengths)
            return jnp.sum(res.out * w), res
        (_, res), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, kc, vc,
                                                                                    sinks)
        return res.out, res.lse, g

    heads = P("data", None, "model", None)
    sharded = jax.shard_map(run, mesh=mesh,
                            in_specs=(heads, heads, heads, P("model"), P("data"), heads),
                            out_specs=(heads, P("data", "model", None),
                                       (heads, heads, heads, P("model"))))
    out, lse, grads = jax.jit(sharded)(q, kc, vc, sinks, lengths, w)
    r_out, r_lse, r_grads = jax.jit(run)(q, kc, vc, sinks, lengths, w)
    finite = lambda x: jnp.where(jnp.isfinite(x), x, 0)  # noqa: E731
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "dsinks"),
                          (out, finite(lse), *grads), (r_out, finite(r_lse), *r_grads)):
        _close(f"decode {name}", x, y, 1e-4)


def check_ragged_paged(mesh):
    # kv heads split over "model" (the pools' leading axis, the packed queries'
    # head axis); the batch metadata is replicated.
    prob = problems.make([(9, 9), (13, 1), (6, 2)], Hq=4, Hkv=2, page_size=4, pad_tokens=3)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.array([0.5, -1.0, 0.0, 2.0], F32))

    def run(q, kp, vp, sinks, table, ctx, qsl, n):
        res = fnattn.ragged_paged_attention(
            spec.replace(sinks=sinks), q, kp, vp, page_table=table, context_lengths=ctx,
            query_start_loc=qsl, num_seqs=n)
        return res.out, res.lse

    heads, pool = P(None, "model", None), P("model", None, None, None)
    sharded = jax.shard_map(run, mesh=mesh,
                            in_specs=(heads, pool, pool, P("model"), P(), P(), P(), P()),
                            out_specs=(heads, P("model", None)))
    args = (prob.q, prob.k_pages, prob.v_pages, spec.sinks, prob.page_table,
            prob.context_lengths, prob.query_start_loc, prob.num_seqs)
    out, lse = jax.jit(sharded)(*args)
    r_out, r_lse = jax.jit(run)(*args)
    live = int(prob.query_start_loc[len(prob.seqs)])
    _close("ragged paged out", out[:live], r_out[:live])
    _close("ragged paged lse", lse[..., :live], r_lse[..., :live])


def check_kernels_lower(mesh):
    """The Triton and Mosaic kernels inside shard_map (with the varying-axes
    check) lower for GPU and TPU: flash with gradients, decode, ragged paged."""
    bf16, i32 = jnp.bfloat16, jnp.int32
    B, T, Hq, Hkv, D = 4, 256, 4, 2, 128
    pages, page = 64, 16
    heads = P("data", None, "model", None)

    def flash_grads(q, k, v, ids, sinks):
        spec = AttentionSpec(mask=masks.causal() & masks.segments(ids))

        def loss(q, k, v, sinks):
            return fnattn.flash(spec.replace(sinks=sinks), q, k, v).out.astype(F32).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

    def decode(q, kc, vc, lengths):
        return fnattn.decode(AttentionSpec(mask=masks.causal()), q, kc, vc,
                             kv_lengths=lengths).out

    def ragged(q, kp, vp, table, ctx, qsl, n):
        return fnattn.ragged_paged_attention(
            AttentionSpec(mask=masks.causal()), q, kp, vp, page_table=table,
            context_lengths=ctx, query_start_loc=qsl, num_seqs=n).out

    pool = ((Hkv, pages, page, D), bf16, P("model"))
    calls = [  # (function, [(shape, dtype, in_spec)], out_specs)
        (flash_grads, [((B, T, Hq, D), bf16, heads), ((B, T, Hkv, D), bf16, heads),
                       ((B, T, Hkv, D), bf16, heads), ((B, T), i32, P("data")),
                       ((Hq,), F32, P("model"))], (heads, heads, heads, P("model"))),
        (decode, [((B, 1, Hq, D), bf16, heads), ((B, T, Hkv, D), bf16, heads),
                  ((B, T, Hkv, D), bf16, heads), ((B,), i32, P("data"))], heads),
        (ragged, [((64, Hq, D), bf16, P(None, "model")), pool, pool, ((4, 8), i32, P()),
                  ((4,), i32, P()), ((5,), i32, P()), ((), i32, P())], P(None, "model")),
    ]
    for platform in ("cuda", "tpu"):
        # a mesh of abstract GPUs or TPUs of the same shape, where this JAX has them
        amesh = abstract_mesh(platform, mesh.devices.shape, mesh.axis_names) or mesh
        for fn, inputs, out_specs in calls:
            args = [jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(amesh, spec))
                    for shape, dt, spec in inputs]
            sharded = jax.jit(jax.shard_map(fn, mesh=amesh, in_specs=tuple(
                spec for *_, spec in inputs), out_specs=out_specs))
            with target(platform, amesh if amesh is not mesh else None):
                text = sharded.trace(*args).lower(lowering_platforms=(platform,)).as_text()
            kernel = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
            assert kernel in text, (fn.__name__, platform)


def check_dropout(mesh):
    """Dropout with one replicated key under data and head parallelism: with
    ``dropout.shard_offsets`` every shard draws its rows of the unsharded mask
    (forward and gradients equal the unsharded call). Without offsets the shards
    draw independent masks: on four shards holding the same q/k/v, shard i
    (row-major over ("data", "model")) equals the call with
    ``dropout.shard_key(key, i)`` (forward and gradients), and no two shards agree
    (one repeated mask would make them all equal)."""
    rs = np.random.default_rng(1)
    B, T, Hq, Hkv, D = 4, 24, 4, 2, 8
    q = jnp.asarray(rs.standard_normal((B, T, Hq, D)), F32)
    k = jnp.asarray(rs.standard_normal((B, T, Hkv, D)), F32)
    v = jnp.asarray(rs.standard_normal((B, T, Hkv, D)), F32)
    # One shard's block, tiled over the batch (2 "data" shards) and heads (2 "model").
    tile = lambda x: jnp.tile(x[:B // 2, :, :x.shape[2] // 2], (2, 1, 2, 1))  # noqa: E731
    qt, kt, vt = tile(q), tile(k), tile(v)
    key = jax.random.key(7)
    qs = kvs = P("data", None, "model")
    for impl in ("auto", "xla"):
        spec = AttentionSpec(mask=masks.causal(), dropout_rate=0.4, dropout_key=key, impl=impl,
                             block_sizes=fnattn.XlaBlockSizes(8, 8))

        def run(spec, q, k, v, offsets):
            def loss(q, k, v):
                return jnp.sum(fnattn.attention(spec.replace(dropout_offsets=offsets(q)),
                                                q, k, v).out ** 2)
            return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

        def sharded(offsets):
            return jax.jit(jax.shard_map(
                lambda q, k, v: (fnattn.attention(spec.replace(dropout_offsets=offsets(q)),
                                                  q, k, v).out, run(spec, q, k, v, offsets)[1]),
                mesh=mesh, in_specs=(qs, kvs, kvs), out_specs=(qs, (qs, kvs, kvs))))

        whole = jax.jit(lambda q, k, v: fnattn.attention(spec, q, k, v).out)(q, k, v)
        g_whole = jax.jit(lambda q, k, v: run(spec, q, k, v, lambda q: None)[1])(q, k, v)
        out, grads = sharded(lambda q: fnattn.dropout.shard_offsets(
            q, batch_axis="data", head_axis="model"))(q, k, v)
        _close(f"dropout {impl} out", out, whole, 1e-5)
        for name, a, b in zip("qkv", grads, g_whole):
            _close(f"dropout {impl} d{name}", a, b, 1e-4)

        out, grads = sharded(lambda q: None)(qt, kt, vt)
        block = lambda x, d, m: x[d * (B // 2):(d + 1) * (B // 2), :,  # noqa: E731
                                  m * (x.shape[2] // 2):(m + 1) * (x.shape[2] // 2)]
        one = tuple(block(x, 0, 0) for x in (qt, kt, vt))
        per_shard = jax.jit(lambda key, q, k, v: (
            fnattn.attention(spec.replace(dropout_key=key), q, k, v).out,
            run(spec.replace(dropout_key=key), q, k, v, lambda q: None)[1]))
        outs = []
        for d in range(2):
            for m in range(2):
                want, g_want = per_shard(fnattn.dropout.shard_key(key, 2 * d + m), *one)
                _close(f"dropout {impl} shard {d},{m} out", block(out, d, m), want, 1e-5)
                for name, a, b in zip("qkv", grads, g_want):
                    _close(f"dropout {impl} shard {d},{m} d{name}", block(a, d, m), b, 1e-4)
                outs.append(np.asarray(want))
        for i in range(4):
            for j in range(i):
                assert not np.allclose(outs[i], outs[j], atol=1e-3), (impl, i, j)


def _timed(name, check, *args):
    start = time.perf_counter()
    check(*args)
    print(f"passed {name} ({time.perf_counter() - start:.0f} s)", flush=True)


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    global problems, abstract_mesh, target
    from lowering import abstract_mesh, target
    from paged import problems
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("data", "model"))
    _timed("check_flash[xla]", check_flash, mesh, "xla")
    _timed("check_flash[pallas]", check_flash, mesh, "pallas")
    for check in (check_decode, check_ragged_paged, check_dropout, check_kernels_lower):
        _timed(check.__name__, check, mesh)
    # Every tests/multi_device/*_checks.py module's CHECKS, on all 8 devices.
    import importlib
    import pkgutil
    import multi_device
    for info in sorted(pkgutil.iter_modules(multi_device.__path__), key=lambda m: m.name):
        if info.name.endswith("_checks"):
            for check in importlib.import_module(f"multi_device.{info.name}").CHECKS:
                _timed(f"{info.name}.{check.__name__}", check)
    print("shard_map checks passed")


_RUN = None  # the subprocess, once started


def launch():
    """Start the 8-device subprocess, once per process. Called by tests/conftest.py
    as soon as collection has picked this file's test, so that the subprocess
    runs beside the rest of the suite (on the machine's other core) instead of
    after it; the test then waits for its result."""
    global _RUN
    if _RUN is None:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=8").strip()
        env["JAX_PLATFORMS"] = "cpu"
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        _RUN = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _RUN


# A guard against a hung subprocess, not a speed check: the subprocess shares the
# machine with the rest of the suite (it starts at collection), and on two cores
# loaded by other work (load average 7) its checks took 950 s alone under jax
# 0.12 (past 900 s beside the suite before). The whole CI run has 40 minutes.
BUDGET_S = 1800


def test_shard_map_on_eight_host_devices():
    proc = launch()
    try:
        stdout, stderr = proc.communicate(timeout=BUDGET_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the 8-device checks ran past {BUDGET_S} s:\n" + stdout[-3000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    assert "shard_map checks passed" in stdout
    # The figures the checks measured (collective counts, work balance) in the log.
    print(stdout)


if __name__ == "__main__":
    main()
