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

__all__ = ["Measurement", "interleaved", "measure"]


class Measurement(NamedTuple):
    median: float      # seconds per call
    min: float
    max: float
    temp_mib: float    # XLA's temporary buffers of the compiled call (NaN: not reported)
    output_mib: float  # its output buffers (NaN: not reported)
    out: Any           # the call's result


def _compile(fn, args):
    compiled = jax.jit(fn).lower(*args).compile()
    try:
        ma = compiled.memory_analysis()
        mem = ma.temp_size_in_bytes / 2 ** 20, ma.output_size_in_bytes / 2 ** 20
    except Exception:  # noqa: BLE001  (not every backend reports it)
        mem = float("nan"), float("nan")
    return compiled, mem


def _timed(compiled, args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    return time.perf_counter() - t0, out


def measure(fn, args, reps: int) -> Measurement:
    """Times ``jax.jit(fn)(*args)`` after compilation and one warm-up call."""
    return interleaved([(fn, args)], reps)[0]


def interleaved(calls, reps: int):
    """:func:`measure` of every ``(fn, args)`` in ``calls``, timed in ``reps``
    rounds that call each once in turn (a load that comes and goes on a shared
    machine then falls on every call alike): one :class:`Measurement` each.

    >>> import jax.numpy as jnp
    >>> a, b = interleaved([(jnp.sin, (jnp.ones(4),)), (jnp.cos, (jnp.ones(4),))], reps=2)
    >>> a.out.shape, b.min <= b.max
    ((4,), True)
    """
    compiled = [_compile(fn, args) for fn, args in calls]
    outs = [jax.block_until_ready(c(*args)) for (c, _), (_, args) in zip(compiled, calls)]
    times = [[] for _ in calls]
    for _ in range(reps):
        for i, ((c, _), (_, args)) in enumerate(zip(compiled, calls)):
            t, outs[i] = _timed(c, args)
            times[i].append(t)
    return [Measurement(float(np.median(ts)), min(ts), max(ts), mem[0], mem[1], out)
            for ts, (_, mem), out in zip(times, compiled, outs)]
