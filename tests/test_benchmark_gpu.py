"""benchmarks/gpu.py's pieces that need no GPU (the script itself runs on GPU
machines only): the per-kernel breakdown (``--kernel-times``) on a trace laid out
as a GPU's, and the documents rows' masks and tile counts."""

import doctest

import jax.numpy as jnp
import numpy as np
import pytest
from jax.profiler import ProfileData

from benchmark_scripts import benchmark_module
from fnattn import masks


@pytest.fixture(scope="module")
def gpu_bench():
    return benchmark_module("gpu")


GPU_TRACE = """
planes { id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)"
    events { metadata_id: 1 duration_ps: 400000000 }
    events { metadata_id: 2 offset_ps: 500000000 duration_ps: 30000000 }
    events { metadata_id: 1 offset_ps: 600000000 duration_ps: 420000000 } }
  lines { id: 2 name: "XLA Ops"
    events { metadata_id: 2 duration_ps: 999000000 } }
  event_metadata { key: 1 value { id: 1 name: "mosaic_gpu_kernel" } }
  event_metadata { key: 2 value { id: 2 name: "loop_fusion" } } }
planes { id: 2 name: "/host:CPU"
  lines { id: 1 name: "python" events { metadata_id: 1 duration_ps: 5000000000 } }
  event_metadata { key: 1 value { id: 1 name: "trace" } } }
"""


def test_kernel_times_sum_the_device_streams_per_call(gpu_bench):
    """Kernels on the device's stream lines, summed by name and divided by the
    calls; XLA's summary lines and host planes are not counted twice."""
    totals = gpu_bench.device_kernel_totals(ProfileData.from_text_proto(GPU_TRACE), calls=2)
    assert totals == pytest.approx({"mosaic_gpu_kernel": 410.0, "loop_fusion": 15.0})
    line = gpu_bench._kernels_line(totals, top=1)
    assert line.startswith("kernels (µs/call, 2 kinds, 425.0 in all): mosaic_gpu_kernel 410.0")
    assert line.endswith("1 more 15.0")


def test_kernel_times_without_a_device_plane(gpu_bench):
    assert gpu_bench.device_kernel_totals(ProfileData.from_text_proto(
        'planes { id: 2 name: "/host:CPU" }'), calls=1) is None
    assert gpu_bench._kernels_line(None) == "kernels: no device plane in the trace"


def test_doctests(gpu_bench):
    assert doctest.testmod(gpu_bench, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


@pytest.mark.parametrize("align", [0, 64, 128, 1000])
def test_document_ids_cut_where_asked(gpu_bench, align):
    ids = gpu_bench.document_ids(4096, align)
    steps = np.flatnonzero(np.diff(ids)) + 1
    assert ids[0] == 0 and set(np.diff(ids)) <= {0, 1}
    assert 1 <= len(steps) <= 7
    if align:
        assert (steps % align == 0).all()
    else:
        assert len(steps) == 7


@pytest.mark.parametrize("D", [64, 128, 256])
def test_tile_mix_counts_the_tiles_of_the_dense_mask(gpu_bench, D):
    """Visited share, PARTIAL share and visited tiles per q tile against a count
    over the materialized mask, tile by tile, at the Mosaic GPU forward's tiles."""
    T, B, H = 1024, 2, 1
    ids = jnp.asarray(np.stack([gpu_bench.document_ids(T), gpu_bench.document_ids(T, 128)]))
    m = masks.causal() & masks.segments(ids, ids)
    dense = np.broadcast_to(np.asarray(masks.materialize(m, B, H, T, T)), (B, H, T, T))
    rows, cols = gpu_bench._program_tile(D)
    tiles = dense.reshape(B, H, T // rows, rows, T // cols, cols)
    seen, full = tiles.any((3, 5)), tiles.all((3, 5))
    n = seen.sum()
    assert gpu_bench.tile_mix(m, B, H, T, D) == pytest.approx(
        (n / seen.size, (n - full.sum()) / n, n / (B * H * (T // rows))))


def test_visited_rates_name_the_partial_share(gpu_bench):
    base = dict(status="ok", impl="fnattn:mosaic_gpu", T=8192, D=128, mode="fwd")
    rows = [dict(base, mask="none", tflops=600.0, tiles_per_row=64.0),
            dict(base, mask="documents", tflops_visited=390.0, partial=0.39,
                 tiles_per_row=6.9),
            dict(base, mask="documents@128", tflops_visited=480.0, partial=0.17,
                 tiles_per_row=5.7),
            dict(base, mask="documents", impl="jax.nn:cudnn", tflops_visited=100.0)]
    assert gpu_bench._visited_rates(rows) == [
        "- documents, fwd, fnattn:mosaic_gpu: 390 TFLOP/s per visited tile = 65% of its dense "
        "rate (600); 39% of its visited tiles PARTIAL, 6.9 per q tile (dense: 64)",
        "- documents@128, fwd, fnattn:mosaic_gpu: 480 TFLOP/s per visited tile = 80% of its "
        "dense rate (600); 17% of its visited tiles PARTIAL, 5.7 per q tile (dense: 64)"]


def test_the_tuned_row_runs_the_tuned_spec_and_says_what_it_chose(gpu_bench, monkeypatch):
    import jax

    import fnattn
    from fnattn import AttentionSpec, tune
    monkeypatch.setattr(tune, "_MEMORY", {})
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 128, 2, 16)) for i in range(3))
    seg = jnp.asarray(gpu_bench.document_ids(128)[None])
    f, facts = gpu_bench.tuned_peer(True, seg, None, 0.0, (q, k, v), "fwd+bwd", 1)
    assert facts["tune_trials"] >= 3 and facts["tune_failed"] == 0 and facts["tune_s"] > 0
    assert facts["tuned"] == "(as given)" or facts["tuned"].startswith("XlaBlockSizes(")
    ref = fnattn.reference(AttentionSpec(mask=masks.causal() & masks.segments(seg)), q, k, v)
    np.testing.assert_allclose(jax.jit(f)(q, k, v), ref.out, atol=2e-5)
    row = dict(impl="fnattn:tuned", T=128, D=16, mask="documents", mode="fwd+bwd",
               status="ok", time_ms=1.0, min_ms=1.0, max_ms=1.0, tflops=1.0, xla_mb=1.0,
               **facts)
    assert "trials, 0 failed" in gpu_bench._flash_line(row)
