"""benchmarks/kernel_profile.py's summary on a trace written by Mosaic GPU's own
profiler (``ProfilerSpec.dump``) from a buffer laid out as a kernel fills it,
and the switch that turns the profiler on in the Mosaic GPU forward. The
script itself runs on a Hopper GPU only."""

import doctest
import io
import json

import numpy as np
import pytest

from benchmark_scripts import benchmark_module
from fnattn.flash import mosaic_gpu


@pytest.fixture(scope="module")
def kernel_profile():
    return benchmark_module("kernel_profile")


def test_doctests(kernel_profile):
    assert doctest.testmod(kernel_profile).failed == 0


def _buffer(spec, traces, entries):
    """A profiler buffer of one ``(start, sm, [(name, enter, exit), ...])`` per
    trace, regions listed in the order they open (nested ones after their
    parent), as a kernel writes it: a header, then (tag, clock) pairs."""
    out = np.zeros((len(traces), entries), np.uint32)
    for n, (start, sm, spans) in enumerate(traces):
        events = []
        for name, t0, t1 in spans:
            tag = spec.intern_name(name)
            events += [(t0, tag), (t1, tag | spec.EXIT)]
        words = [w for t, tag in sorted(events) for w in (tag, t)]
        out[n, :3] = (start, sm, len(words))
        out[n, 3:3 + len(words)] = words
    return out.reshape(-1)


def test_summary_of_a_trace_the_profiler_wrote(kernel_profile):
    profiler = pytest.importorskip("jax.experimental.mosaic.gpu.profiler")
    spec = profiler.ProfilerSpec(32)

    def consumer(tiles, total):
        spans = [("consumer", 0, total), ("wait_q", 1, 3)]  # (a 2-cycle gap: the overhead)
        return spans + [("full_qk", 100 + 150 * t, 200 + 150 * t) for t in range(tiles)]

    producer = [("producer", 0, 900), ("wait_free", 10, 60)]
    # program 0: 2 tiles in 1000 cycles per consumer; program 1: 4 in 1400
    traces = [(5000, 0, consumer(2, 1000)), (5000, 0, consumer(2, 1000)), (5000, 0, producer),
              (9000, 1, consumer(4, 1400)), (9000, 1, consumer(4, 1400)), (9000, 1, producer)]
    fh = io.StringIO()
    spec.dump(_buffer(spec, traces, 32), fh, grid=(2,), block=(384,))
    events = json.loads(fh.getvalue())["traceEvents"]
    s = kernel_profile.summarize(kernel_profile.regions(events))
    # the dump takes the smallest gap less one (1 cycle) per event before each
    # as the profiler's own cost: a region's length shifts by the events inside
    assert s["fit"]["traces"] == 4
    assert s["fit"]["tile"] == pytest.approx(200, abs=10)
    assert s["fit"]["item"] == pytest.approx(600, abs=20)
    qk = s["consumer"]["full_qk"]
    assert qk["per_program"] == 3.0 and qk["each"] == pytest.approx(100, abs=2)
    assert s["producer"]["wait_free"]["each"] == pytest.approx(50, abs=2)
    assert "full_qk" not in s["producer"]
    lines = kernel_profile.table("documents", s)
    assert any(line.startswith("| consumer | full_qk | 3.0 |") for line in lines)


def test_the_profiler_is_off_unless_asked(monkeypatch):
    assert mosaic_gpu.PROFILE is None and mosaic_gpu._profiler_params() == {}
    monkeypatch.setattr(mosaic_gpu, "PROFILE", (512, "/tmp/traces"))
    assert mosaic_gpu._profiler_params() == dict(profile_space=512, profile_dir="/tmp/traces",
                                                 profile_bounds_check=True)
