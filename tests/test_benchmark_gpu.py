"""benchmarks/gpu.py's per-kernel breakdown (``--kernel-times``), on a trace laid
out as a GPU's: the script itself runs on GPU machines only."""

import importlib.util
import os

import pytest
from jax.profiler import ProfileData

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def gpu_bench():
    path = os.path.join(HERE, "..", "benchmarks", "gpu.py")
    spec = importlib.util.spec_from_file_location("fnattn_gpu_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
