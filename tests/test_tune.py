"""fnattn.tune: the search each device gets, what autotune measures and keeps,
the cache, and the errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks, tune
from fnattn._checks import Dims
from fnattn.flash import cudnn, mosaic_gpu, mosaic_gpu_bwd
from fnattn.tune import Target

ON_GPU = jax.devices()[0].platform == "gpu"
H100 = Target("cuda", "NVIDIA H100 80GB HBM3", hopper=True)
A100 = Target("cuda", "NVIDIA A100-SXM4-80GB", hopper=False)
TPU = Target("tpu", "TPU v5 lite")


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch):
    """Every test starts with an empty in-process cache."""
    monkeypatch.setattr(tune, "_MEMORY", {})


def qkv(T=128, B=1, Hq=2, Hkv=1, D=16, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, T, Hq, D), dtype),
            jax.random.normal(ks[1], (B, T, Hkv, D), dtype),
            jax.random.normal(ks[2], (B, T, Hkv, D), dtype))


def documents(T, B=1):
    ids = jnp.asarray(np.repeat(np.arange(4), -(-T // 4))[:T][None].repeat(B, 0), jnp.int32)
    return masks.causal() & masks.segments(ids)


# ----------------------------------------------------------------------------------
# autotune on this CPU
# ----------------------------------------------------------------------------------


def test_flash_search_times_the_xla_tiles_and_returns_a_spec_that_agrees():
    T = 256
    q, k, v = qkv(T)
    spec = AttentionSpec(mask=documents(T))
    tuned = tune.autotune(fnattn.flash, spec, q, k, v, reps=1)
    assert tuned.lowering == "flash: blockwise XLA" and not tuned.cached
    assert tuned.trials[0].stage == "given" and tuned.trials[0].block_sizes == ()
    p = tune.plan(fnattn.flash, spec, q, k, v)
    proposed = p.candidates()
    # (bq, bk) in {64, 128, 256} x {128, 256}: nothing past the padded sequence
    assert {(c[0].block_q, c[0].block_k) for c in proposed} == {
        (a, b) for a in (64, 128, 256) for b in (128, 256)}
    # the defaults spelled out are the spec as given: timed once, as "given"
    assert p.given == (fnattn.XlaBlockSizes.default(Dims(1, T, T, 2, 1, 16, 16)),)
    assert [t.block_sizes for t in tuned.trials if t.stage == "forward"] == [
        c for c in proposed if c != p.given]
    assert all(t.seconds is not None and t.seconds > 0 for t in tuned.trials)
    confirm = {t.block_sizes: t.seconds for t in tuned.trials if t.stage == "confirm"}
    if confirm:   # the search's winner against the spec as given, alternating
        assert tuned.trials[-2].stage == "confirm" and len(confirm) == 2
        assert tuned.seconds == confirm[tuned.block_sizes] == min(confirm.values())
        assert tuned.baseline_seconds == confirm[()]
    else:         # the spec as given won the search
        assert tuned.block_sizes == () and tuned.baseline_seconds == tuned.seconds
    if tuned.block_sizes:
        assert tuned.block_sizes in proposed
        assert tuned.spec.block_sizes == tuned.block_sizes
    assert tuned.spec.mask is spec.mask
    ref = fnattn.reference(spec, q, k, v)
    got = jax.jit(fnattn.flash)(tuned.spec, q, k, v)
    np.testing.assert_allclose(got.out, ref.out, atol=2e-5)
    np.testing.assert_allclose(got.lse, ref.lse, atol=2e-5)
    assert "| given | (as given) |" in tuned.report()


def test_backward_tunes_the_backward_tiles_after_the_forward_ones():
    q, k, v = qkv(128)
    spec = AttentionSpec(mask=masks.causal())
    tuned = tune.autotune(fnattn.attention, spec, q, k, v, reps=1, backward=True)
    stages = [t.stage for t in tuned.trials]
    assert stages[0] == "given" and set(stages[1:]) <= {"forward", "backward", "confirm"}
    assert {"forward", "backward"} <= set(stages)
    # (the spec as given, when it won the forward stage, is timed again in the
    # backward stage as its incumbent: block sizes ())
    fwd = [t.block_sizes[0] for t in tuned.trials if t.stage == "forward"]
    bwd = [t.block_sizes[0] for t in tuned.trials if t.stage == "backward" and t.block_sizes]
    # forward candidates keep the default backward tiles; the backward stage keeps
    # the best forward tiles and varies only its own
    default = fnattn.XlaBlockSizes.default(Dims(1, 128, 128, 2, 1, 16, 16))
    assert {(b.block_q_bwd, b.block_k_bwd) for b in fwd} == {
        (default.block_q_bwd, default.block_k_bwd)}
    assert len({(b.block_q, b.block_k) for b in bwd}) == 1
    assert {(b.block_q_bwd, b.block_k_bwd) for b in bwd} >= {(64, 256), (128, 256)}

    def loss(spec, q, k, v):
        return jnp.sum(fnattn.attention(spec, q, k, v).out * jnp.cos(q))

    want = jax.grad(loss, argnums=(1, 2, 3))(spec.replace(impl="reference"), q, k, v)
    got = jax.jit(jax.grad(loss, argnums=(1, 2, 3)))(tuned.spec, q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_candidates_that_fail_are_recorded_and_skipped():
    B, S = 2, 64
    q = jax.random.normal(jax.random.key(0), (B, 1, 4, 16))
    kc = jax.random.normal(jax.random.key(1), (B, S, 2, 16))
    lengths = jnp.array([64, 9])
    spec = AttentionSpec(mask=masks.causal())
    tuned = tune.autotune(fnattn.decode, spec, q, kc, kc, kwargs={"kv_lengths": lengths},
                          candidates=[fnattn.DecodeBlockSizes(num_splits=3),
                                      fnattn.DecodeBlockSizes(num_splits=2)], reps=1)
    bad = [t for t in tuned.trials if t.block_sizes == (fnattn.DecodeBlockSizes(num_splits=3),)]
    assert bad[0].seconds is None and "must divide the cache length S=64" in bad[0].error
    assert tuned.block_sizes in ((), (fnattn.DecodeBlockSizes(num_splits=2),))
    assert "must divide" in tuned.report().splitlines()[-1]
    ref = fnattn.decode(spec.replace(impl="reference"), q, kc, kc, kv_lengths=lengths)
    got = jax.jit(fnattn.decode)(tuned.spec, q, kc, kc, kv_lengths=lengths)
    np.testing.assert_allclose(got.out, ref.out, atol=1e-5)


def test_every_candidate_failing_is_an_error_naming_them(monkeypatch):
    q, k, v = qkv(64)

    def refuse(program, spec, arrays, kwarrays):
        raise NotImplementedError(f"no tiles {spec.block_sizes}")

    monkeypatch.setattr(tune, "_lower", refuse)
    with pytest.raises(RuntimeError, match=r"every candidate failed[\s\S]*no tiles None"
                                           r"[\s\S]*XlaBlockSizes\(block_q=32"):
        tune.autotune(fnattn.flash, AttentionSpec(), q, k, v, reps=1,
                      candidates=[fnattn.XlaBlockSizes(32, 32)])


def test_the_search_builds_on_the_best_so_far(monkeypatch):
    """A fake clock that makes one tile fastest: the forward stage picks it, the
    backward stage varies it, and the incumbent is timed again in that stage."""
    q, k, v = qkv(256)
    fast = (128, 256)

    def clock(compiled, spec, arrays, kwarrays, reps):
        b = spec.block_sizes[0] if spec.block_sizes else fnattn.XlaBlockSizes(512, 256)
        bwd = (b.block_q_bwd, b.block_k_bwd) == (64, 256)
        return (1.0 if (b.block_q, b.block_k) == fast else 2.0) - 0.5 * bwd

    monkeypatch.setattr(tune, "_time", clock)
    tuned = tune.autotune(fnattn.flash, AttentionSpec(), q, k, v, backward=True, reps=1)
    b = tuned.block_sizes[0]
    assert (b.block_q, b.block_k) == fast
    assert (b.block_q_bwd, b.block_k_bwd) == (64, 256)
    assert tuned.seconds == 0.5 and tuned.baseline_seconds == 2.0
    bwd = [t for t in tuned.trials if t.stage == "backward"]
    assert (bwd[0].block_sizes[0].block_q, bwd[0].block_sizes[0].block_k) == fast
    assert all((t.block_sizes[0].block_q, t.block_sizes[0].block_k) == fast for t in bwd)
    # T = 256: no backward tile past the sequence (block_k_bwd 512, 1024)
    assert {t.block_sizes[0].block_k_bwd for t in bwd[1:]} == {256}
    assert tuned.speedup == 4.0


def test_a_winner_that_loses_the_confirmation_leaves_the_spec_as_given(monkeypatch):
    """The search's fastest is timed again against the spec as given, calls
    alternating; a lucky first timing does not replace the user's block sizes."""
    q, k, v = qkv(64)
    seen = []

    def clock(compiled, spec, arrays, kwarrays, reps):
        seen.append(spec.block_sizes)
        if spec.block_sizes is None:
            return 1.0
        return 0.5 if seen.count(spec.block_sizes) == 1 else 1.5   # fast only once

    monkeypatch.setattr(tune, "_time", clock)
    tuned = tune.autotune(fnattn.flash, AttentionSpec(), q, k, v, reps=2,
                          candidates=[fnattn.XlaBlockSizes(32, 32)])
    assert [t.stage for t in tuned.trials] == ["given", "candidates", "confirm", "confirm"]
    assert tuned.block_sizes == () and tuned.spec.block_sizes is None
    assert tuned.seconds == tuned.baseline_seconds == 1.0
    assert len(seen) == 2 + 2 * 2 * 2   # given, candidate, then 2 x reps rounds of both


def test_a_spent_budget_stops_the_search_and_is_not_cached(tmp_path):
    q, k, v = qkv(128)
    path = tmp_path / "cache.json"
    cands = [fnattn.XlaBlockSizes(32, 32), fnattn.XlaBlockSizes(64, 64)]
    tuned = tune.autotune(fnattn.flash, AttentionSpec(), q, k, v, reps=1, candidates=cands,
                          max_seconds=0.0, cache=path)
    assert not tuned.complete and [t.stage for t in tuned.trials] == ["given"]
    assert tuned.spec == AttentionSpec() and "stopped early" in tuned.report()
    assert not path.exists()
    again = tune.autotune(fnattn.flash, AttentionSpec(), q, k, v, reps=1, candidates=cands,
                          cache=path, compile_threads=1)
    assert not again.cached and again.complete and len(again.trials) >= 3
    assert path.exists()


def test_short_calls_are_timed_in_batches():
    """A batch issues calls back to back and waits once: a short call is timed
    many to a batch, a long one (over 10 ms) alone."""
    import time
    calls = []

    def quick(spec, arrays, kwarrays):
        calls.append(1)
        return np.zeros(())

    def slow(spec, arrays, kwarrays):
        calls.append(1)
        time.sleep(0.02)
        return np.zeros(())

    tune._time(quick, None, [], {}, 3)
    assert len(calls) > 1 + 3 and (len(calls) - 1) % 3 == 0
    calls.clear()
    assert tune._time(slow, None, [], {}, 3) >= 0.02
    assert len(calls) == 1 + 3


def test_other_platforms_entries_are_kept():
    q, k, v = qkv(64)
    tpu, gpu = fnattn.MosaicBlockSizes(block_q=256), fnattn.TritonBlockSizes(block_q=64)
    spec = AttentionSpec(block_sizes=(tpu, fnattn.XlaBlockSizes(16, 16), gpu))
    tuned = tune.autotune(fnattn.flash, spec, q, k, v, reps=1,
                          candidates=[fnattn.XlaBlockSizes(32, 32)])
    assert tpu in tuned.spec.block_sizes and gpu in tuned.spec.block_sizes
    xla = [b for b in tuned.spec.block_sizes if isinstance(b, fnattn.XlaBlockSizes)]
    assert xla in ([fnattn.XlaBlockSizes(16, 16)], [fnattn.XlaBlockSizes(32, 32)])


# ----------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------


def test_results_are_kept_in_memory_and_in_the_file(tmp_path, monkeypatch):
    path = tmp_path / "tune" / "cache.json"
    q, k, v = qkv(64)
    spec = AttentionSpec(mask=masks.causal())
    cands = [fnattn.XlaBlockSizes(32, 32), fnattn.XlaBlockSizes(64, 64)]
    first = tune.autotune(fnattn.flash, spec, q, k, v, reps=1, candidates=cands, cache=path)
    assert not first.cached and len(first.trials) >= 3

    again = tune.autotune(fnattn.flash, spec, q, k, v, reps=1, candidates=cands, cache=path)
    assert again.cached and again.trials == () and again.block_sizes == first.block_sizes
    assert again.seconds == first.seconds

    # a new process: only the file
    monkeypatch.setattr(tune, "_MEMORY", {})
    data = json.loads(path.read_text())
    (entry,) = data["entries"].values()
    assert entry["description"]["variant"] == "flash"
    assert entry["description"]["arrays"][-3:] == ["float32[1, 64, 2, 16]",
                                                   "float32[1, 64, 1, 16]",
                                                   "float32[1, 64, 1, 16]"]
    from_file = tune.autotune(fnattn.flash, spec, q, k, v, reps=1, candidates=cands, cache=path)
    assert from_file.cached and from_file.block_sizes == first.block_sizes

    # another shape, another direction, other candidates, retune: measured again
    q2, k2, v2 = qkv(96)
    assert not tune.autotune(fnattn.flash, spec, q2, k2, v2, reps=1, candidates=cands,
                             cache=path).cached
    assert not tune.autotune(fnattn.flash, spec, q, k, v, reps=1, candidates=cands,
                             backward=True, cache=path).cached
    assert not tune.autotune(fnattn.flash, spec, q, k, v, reps=1, candidates=cands[:1],
                             cache=path).cached
    assert not tune.autotune(fnattn.flash, spec, q, k, v, reps=1, candidates=cands,
                             cache=path, retune=True).cached
    assert len(json.loads(path.read_text())["entries"]) == 4


def test_every_block_size_type_survives_the_file():
    objs = (fnattn.XlaBlockSizes(64, 128, 32, 256), fnattn.TritonBlockSizes(block_q=64),
            fnattn.MosaicBlockSizes(block_q=256), fnattn.MosaicGpuBlockSizes(persistent=True),
            fnattn.MosaicGpuBwdBlockSizes(max_concurrent_steps=3),
            fnattn.DecodeBlockSizes(num_splits=4), fnattn.PagedBlockSizes(block_k=64))
    assert tune._decode(json.loads(json.dumps(tune._encode(objs)))) == objs


def test_an_unreadable_cache_file_is_a_clear_error(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text("{not json")
    q, k, v = qkv(64)
    with pytest.raises(ValueError, match="cannot read the cache file"):
        tune.autotune(fnattn.flash, AttentionSpec(), q, k, v, reps=1, cache=path,
                      candidates=[fnattn.XlaBlockSizes(32, 32)])


# ----------------------------------------------------------------------------------
# The search each device gets (plan), without running anything
# ----------------------------------------------------------------------------------


def test_hopper_gets_triton_and_mosaic_gpu_candidates_that_fit_shared_memory():
    q = jnp.zeros((1, 4096, 8, 128), jnp.bfloat16)
    spec = AttentionSpec(mask=documents(4096))
    p = tune.plan(fnattn.flash, spec, q, q, q, target=H100, backward=True)
    assert [s.name for s in p.stages] == ["forward", "dq", "dkdv", "mosaic backward"]
    fwd = p.stages[0].propose(())
    kinds = {type(c[0]) for c in fwd}
    assert kinds == {fnattn.TritonBlockSizes, fnattn.MosaicGpuBlockSizes}
    # the documents' segment ids take shared memory too (one per-row, one per-key
    # array): 64 x 128 tiles with a ring of 3 would not fit, so are not proposed
    mg = [b for (b,) in fwd if isinstance(b, fnattn.MosaicGpuBlockSizes)]
    assert all(b.smem_bytes(128, row_arrays=1, key_arrays=1) <= mosaic_gpu.SMEM_BYTES
               for b in mg)
    assert not any((b.block_q, b.block_k, b.max_concurrent_steps) == (64, 128, 3) for b in mg)
    assert any(isinstance(b, fnattn.MosaicGpuBlockSizes) and b.persistent for (b,) in fwd)

    triton = next(c for c in fwd if isinstance(c[0], fnattn.TritonBlockSizes))
    dq = p.stages[1].propose(triton)
    changed = {f.name for c in dq for f in dataclasses.fields(c[0])
               if getattr(c[0], f.name) != getattr(triton[0], f.name)}
    assert changed == {"block_q_dq", "block_k_dq", "num_warps_dq", "num_stages_dq"}
    assert p.stages[3].propose(triton) == []     # a Triton forward: no Mosaic backward

    mgpu = next(c for c in fwd if isinstance(c[0], fnattn.MosaicGpuBlockSizes))
    assert p.stages[1].propose(mgpu) == []       # and the other way round
    mbwd = p.stages[3].propose(mgpu)
    assert mbwd and all(c[0] == mgpu[0] for c in mbwd)
    assert all(c[1].smem_bytes(128, row_arrays=1, key_arrays=1) <= mosaic_gpu.SMEM_BYTES
               for c in mbwd)
    assert set(p.family) == {fnattn.TritonBlockSizes, fnattn.MosaicGpuBlockSizes,
                             mosaic_gpu_bwd.MosaicGpuBwdBlockSizes}


def test_mosaic_gpu_candidates_fit_at_the_padded_head_dim():
    """D = 96 runs on the Mosaic GPU kernels at 128 (mosaic_gpu.kernel_dim): the
    tiles proposed fit shared memory there, so 64 x 128 with a ring of 3 (which
    would fit at 96) is not among them."""
    q = jnp.zeros((1, 4096, 8, 96), jnp.bfloat16)
    p = tune.plan(fnattn.flash, AttentionSpec(mask=documents(4096)), q, q, q, target=H100)
    mg = [b for (b,) in p.stages[0].propose(()) if isinstance(b, fnattn.MosaicGpuBlockSizes)]
    assert mg and all(b.smem_bytes(128, row_arrays=1, key_arrays=1) <= mosaic_gpu.SMEM_BYTES
                      for b in mg)
    assert not any((b.block_q, b.block_k, b.max_concurrent_steps) == (64, 128, 3) for b in mg)


def test_older_gpus_and_pallas_get_the_triton_kernels_only():
    q = jnp.zeros((1, 64, 4, 64), jnp.bfloat16)
    spec = AttentionSpec(mask=masks.causal())
    for target, s in ((A100, spec), (H100, spec.replace(impl="pallas"))):
        p = tune.plan(fnattn.flash, s, q, q, q, target=target)
        assert p.lowering == "flash: Pallas Triton kernels"
        fwd = p.stages[0].propose(())
        assert {type(c[0]) for c in fwd} == {fnattn.TritonBlockSizes}
        # T = 64: no tile past the sequence
        assert max(c[0].block_q for c in fwd) == 64


def test_where_cudnn_runs_the_spec_there_is_nothing_to_tune(monkeypatch):
    q = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
    monkeypatch.setattr(cudnn, "route", lambda *a: True)
    with pytest.raises(ValueError, match="runs this spec on cuDNN.*impl='pallas'"):
        tune.plan(fnattn.flash, AttentionSpec(), q, q, q, target=H100)
    assert tune.plan(fnattn.flash, AttentionSpec(impl="pallas"), q, q, q, target=H100).stages


def test_tpu_gets_lane_multiple_tiles_for_each_kernel():
    q = jnp.zeros((1, 1000, 4, 128), jnp.bfloat16)
    p = tune.plan(fnattn.flash, AttentionSpec(), q, q, q, target=TPU, backward=True)
    assert p.lowering == "flash: Pallas Mosaic (TPU) kernels"
    assert [s.name for s in p.stages] == ["forward", "dq", "dkv"]
    fwd = p.stages[0].propose(())
    assert {(c[0].block_q, c[0].block_k) for c in fwd} == {
        (a, b) for a in (128, 256, 512, 1024) for b in (128, 256, 512, 1024)}
    dkv = p.stages[2].propose(fwd[0])
    assert {c[0].block_q for c in dkv} == {fwd[0][0].block_q}
    assert {(c[0].block_q_dkv, c[0].block_k_dkv) for c in dkv} == {
        (a, b) for a in (128, 256, 512, 1024) for b in (128, 256, 512, 1024)}


def test_decode_and_paged_plans():
    q = jnp.zeros((2, 1, 8, 64))
    kc = jnp.zeros((2, 96, 2, 64))
    p = tune.plan(fnattn.decode, AttentionSpec(), q, kc, kc, target=A100)
    assert [s.name for s in p.stages] == ["splits", "launch"]
    # splits that divide S = 96 and leave at least 16 keys each
    assert [c[0].num_splits for c in p.stages[0].propose(())] == [1, 2, 4]
    cpu = tune.plan(fnattn.decode, AttentionSpec(), q, kc, kc)
    assert [s.name for s in cpu.stages] == ["splits"]

    pages = jnp.zeros((2, 8, 16, 64))
    for fn, first in ((fnattn.paged_attention, "block_k"),
                      (fnattn.ragged_paged_attention, "block_q")):
        p = tune.plan(fn, AttentionSpec(), q, pages, pages, target=A100)
        assert p.stages[0].name == first and p.stages[-1].name == "launch"
        assert p.family == (fnattn.PagedBlockSizes,)


def test_hopper_times_the_mosaic_gpu_decode_kernels_too():
    """On a Hopper GPU the decode and paged plans end with the Mosaic GPU
    kernel at every block and ring that fits, beside the best split count;
    not for calls it refuses (float32 caches, D = 80)."""
    M = fnattn.MosaicGpuDecodeBlockSizes
    q = jnp.zeros((2, 1, 8, 128), jnp.bfloat16)
    kc = jnp.zeros((2, 1024, 2, 128), jnp.bfloat16)
    p = tune.plan(fnattn.decode, AttentionSpec(), q, kc, kc, target=H100)
    assert [s.name for s in p.stages] == ["splits", "launch", "mosaic gpu"]
    assert p.family == (fnattn.DecodeBlockSizes, M)
    best = (fnattn.DecodeBlockSizes(num_splits=4, block_k=64),)
    cands = p.stages[-1].propose(best)
    assert {c[0] for c in cands} == {fnattn.DecodeBlockSizes(num_splits=4)}
    assert {(c[1].block_k, c[1].max_concurrent_steps) for c in cands} == {
        (64, 2), (64, 3), (64, 4), (128, 2)}   # (128 x 3 steps is past shared memory)
    for bad in (kc.astype(jnp.float32), kc[..., :80]):
        assert "mosaic gpu" not in [s.name for s in tune.plan(
            fnattn.decode, AttentionSpec(), q.astype(bad.dtype)[..., :bad.shape[-1]], bad, bad,
            target=H100).stages]
    pages = jnp.zeros((2, 64, 16, 128), jnp.bfloat16)
    for fn in (fnattn.paged_attention, fnattn.ragged_paged_attention):
        p = tune.plan(fn, AttentionSpec(), q, pages, pages, target=H100)
        assert p.stages[-1].name == "mosaic gpu" and p.family == (fnattn.PagedBlockSizes, M)
        assert p.stages[-1].propose(())[0][0] == fnattn.PagedBlockSizes()
    assert "mosaic gpu" not in [s.name for s in tune.plan(
        fnattn.paged_attention, AttentionSpec(), q, pages, pages, target=A100).stages]


# ----------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("call, error, match", [
    (lambda q: tune.autotune(jax.nn.dot_product_attention, AttentionSpec(), q, q, q),
     TypeError, "fn must be one of fnattn's variants"),
    (lambda q: tune.autotune(fnattn.flash, AttentionSpec(), q, q, q, reps=0),
     ValueError, "reps must be a positive int"),
    (lambda q: tune.autotune(fnattn.flash, None, q, q, q),
     TypeError, "spec must be an AttentionSpec"),
    (lambda q: tune.autotune(fnattn.flash, AttentionSpec(impl="reference"), q, q, q),
     ValueError, "impl='reference' has no block sizes"),
    (lambda q: tune.autotune(fnattn.attention, AttentionSpec(impl="xla"), q, q, q),
     ValueError, "impl='xla' has no block sizes"),
    (lambda q: tune.autotune(fnattn.flash, AttentionSpec(impl="pallas"), q, q, q),
     ValueError, "interpret mode"),
    (lambda q: tune.autotune(fnattn.flash, AttentionSpec(), q, q, q, candidates=[]),
     ValueError, "candidates is empty"),
    (lambda q: tune.autotune(fnattn.flash, AttentionSpec(), q, q, q, candidates=[(64, 64)]),
     TypeError, "every candidate must be a block-size object"),
    (lambda q: tune.autotune(fnattn.flash, AttentionSpec(), q, q),
     TypeError, r"takes \(spec, q, k, v\)"),
    (lambda q: tune.autotune(fnattn.flash, AttentionSpec(), q, q[..., :8], q),
     ValueError, "flash"),
])
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(jnp.zeros((1, 32, 2, 16)))


def test_inside_jit_is_a_clear_error():
    q = jnp.zeros((1, 32, 2, 16))
    with pytest.raises(TypeError, match="runs outside jax.jit"):
        jax.jit(lambda q: tune.autotune(fnattn.flash, AttentionSpec(), q, q, q).seconds)(q)


def test_target_of_a_cpu_array():
    assert Target.of(jnp.zeros(3)) == Target("cpu", jax.devices("cpu")[0].device_kind, False)


def test_the_triton_candidates_lower_for_cuda():
    """Every tile the GPU search proposes to the Triton kernels (forward, dq, dk/dv)
    is one the kernels lower for cuda: a search does not spend its time on
    candidates that cannot compile anywhere."""
    from lowering import gpu_target
    q, k, v = qkv(300, Hq=4, Hkv=2, D=64, dtype=jnp.bfloat16)
    spec = AttentionSpec(mask=documents(300))
    p = tune.plan(fnattn.flash, spec, q, k, v, target=H100, backward=True)
    fwd = [c for c in p.stages[0].propose(()) if isinstance(c[0], fnattn.TritonBlockSizes)]
    tiles = {(c[0].block_q, c[0].block_k): c for c in fwd}   # one per tile
    dq = {(c[0].block_q_dq, c[0].block_k_dq): c for c in p.stages[1].propose(fwd[0])}
    dkdv = {(c[0].block_q_dkdv, c[0].block_k_dkdv): c for c in p.stages[2].propose(fwd[0])}
    assert len(tiles) == len(dq) == len(dkdv) == 5

    def loss(spec, q, k, v):
        return jnp.sum(fnattn.flash(spec, q, k, v).out.astype(jnp.float32))

    for cand in [*tiles.values(), *dq.values(), *dkdv.values()]:
        s = tune._with(spec, p.family, cand)
        with gpu_target():
            text = jax.jit(jax.grad(loss, argnums=(1, 2, 3))).trace(s, q, k, v).lower(
                lowering_platforms=("cuda",)).as_text()
        assert all(f"fnattn_flash_{n}" in text for n in ("fwd", "dq", "dkdv")), cand


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
def test_gpu_autotune_picks_kernels_that_agree_with_xla():
    """On a GPU: the device is told apart (cuda; Hopper or not), kernel candidates
    run (those a kernel refuses are recorded), and the tuned spec's forward and
    gradients match the XLA lowering's."""
    T = 2048
    q, k, v = qkv(T, Hq=8, Hkv=2, D=128, dtype=jnp.bfloat16)
    spec = AttentionSpec(mask=documents(T))
    target = Target.of(q)
    assert target.platform == "cuda"
    tuned = tune.autotune(fnattn.flash, spec, q, k, v, backward=True, reps=2, max_seconds=60)
    assert any(t.seconds for t in tuned.trials if t.block_sizes), tuned.report()
    kinds = {type(b) for t in tuned.trials for b in t.block_sizes}
    assert fnattn.TritonBlockSizes in kinds
    assert (fnattn.MosaicGpuBlockSizes in kinds) == target.hopper
    print(tuned.report())

    def loss(spec, q, k, v):
        return jnp.sum(fnattn.flash(spec, q, k, v).out.astype(jnp.float32) * jnp.cos(
            q.astype(jnp.float32)))

    f = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3)))
    got, want = f(tuned.spec, q, k, v), f(spec.replace(impl="xla"), q, k, v)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=5e-2, rtol=2e-2)
