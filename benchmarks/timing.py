"""Timing one compiled call, shared by the benchmark scripts (benchmarks/decode.py,
benchmarks/quant.py).

:func:`measure` compiles ``fn`` for ``args`` once, reads XLA's memory figures
for the compiled call, runs it once to warm up, then times ``reps`` calls. The
machines are shared and noisy: report the median with the min and max beside
it, and compare rows timed in the same run.

>>> import jax.numpy as jnp
>>> m = measure(lambda x: x * 2, (jnp.ones(8),), reps=3)
>>> m.min <= m.median <= m.max, m.out.tolist()[:2]
(True, [2.0, 2.0])
"""

import time
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["Measurement", "measure"]


class Measurement(NamedTuple):
    median: float      # seconds per call
    min: float
    max: float
    temp_mib: float    # XLA's temporary buffers of the compiled call (NaN: not reported)
    output_mib: float  # its output buffers (NaN: not reported)
    out: Any           # the call's result


def measure(fn, args, reps: int) -> Measurement:
    """Times ``jax.jit(fn)(*args)`` after compilation and one warm-up call."""
    compiled = jax.jit(fn).lower(*args).compile()
    try:
        ma = compiled.memory_analysis()
        temp, output = ma.temp_size_in_bytes / 2 ** 20, ma.output_size_in_bytes / 2 ** 20
    except Exception:  # noqa: BLE001  (not every backend reports it)
        temp = output = float("nan")
    out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return Measurement(float(np.median(times)), min(times), max(times), temp, output, out)
