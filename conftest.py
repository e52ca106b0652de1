"""Settings for every test process (tests/, property_tests/, the doctests in fnattn/).

The suite compiles thousands of small XLA programs on the CPU and runs each
once or twice, so compiling dominates its time. Four flags make XLA:CPU
compile faster, with the same results up to float rounding, which every
comparison's tolerance covers (the fourth changes nothing in the results):

* ``--xla_backend_optimization_level=0`` and
  ``--xla_llvm_disable_expensive_passes``: no LLVM optimisation of the
  generated code (about a quarter less wall time);
* ``--xla_cpu_use_fusion_emitters=false``: fusions emitted straight to LLVM IR
  instead of through XLA's MLIR fusion emitters, which halves compile time
  (``tests/test_merging.py`` and ``tests/flash/test_xla.py``: 91 s -> 60 s);
* ``--xla_cpu_parallel_codegen_split_count=1``: each program's machine code
  generated as one LLVM module instead of split for parallel code generation,
  which on this suite's small programs costs more CPU time than it saves
  (``tests/flash/test_xla.py`` and ``tests/test_decoding.py`` in one process:
  42.7 s -> 35.5 s of CPU time).

Each flag is checked first in a short subprocess (an XLA that does not know a
flag aborts the process that reads it), and one this jaxlib refuses is left out.
Flags already in ``XLA_FLAGS`` are kept (a flag given there wins), and set
``FNATTN_TEST_XLA_OPT=1`` to test with the optimised code users run.
Subprocesses (tests/test_shard_map.py) inherit them.

The command in the README and ``.ci/run`` runs the suite in worker processes
(pytest-xdist, ``-n auto --dist worksteal``): one per core, at most four
(:func:`pytest_xdist_auto_num_workers`; a worker holds 3 to 5 GB by the end),
beside the 8-device subprocess of ``tests/test_shard_map.py``, whose test
``tests/conftest.py`` hands out first. ``-n 0`` runs it in one process.

Python's cyclic garbage collector runs less often here (thresholds (50 000, 20,
1 000) instead of (700, 10, 10)): the processes hold millions of objects
(traced jaxprs, compiled programs) that every full collection walks again. On
the 2-core machine, whole suite with ``-n auto --dist worksteal``: 1080 s with
the default thresholds, 969 s with these.

``PJRT_NPROC`` gives XLA:CPU's thread pool 8 threads however few cores the
machine has: the Mosaic GPU interpreter runs a program's warpgroups on their own
threads, waiting for one another at barriers, and with one thread per core
(two on the CI machine) a warpgroup can wait for a thread forever
(tests/mosaic_gpu_interpreter.py). A value already set is kept.
"""

import gc
import os
import subprocess
import sys

import pytest

_FAST_COMPILE = ("--xla_backend_optimization_level=0",
                 "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false",
                 "--xla_cpu_parallel_codegen_split_count=1")


def _accepted(flags):
    """The subset of ``flags`` this jaxlib's XLA:CPU takes: all of them when a
    process compiling with them all exits cleanly, else each tried alone."""
    def runs(fs):
        env = dict(os.environ, XLA_FLAGS=" ".join(fs), JAX_PLATFORMS="cpu")
        code = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              timeout=300).returncode == 0
    if not flags or runs(flags):
        return list(flags)
    return [f for f in flags if runs([f])]


if os.environ.get("FNATTN_TEST_XLA_OPT") != "1":
    _given = os.environ.get("XLA_FLAGS", "")
    _names = {f.split("=")[0] for f in _given.split()}
    _wanted = [f for f in _FAST_COMPILE if f.split("=")[0] not in _names]
    os.environ["XLA_FLAGS"] = " ".join(_accepted(_wanted) + [_given]).strip()

gc.set_threshold(50_000, 20, 1_000)

os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))

# The package first, so that collecting a module's doctests finds it (and every
# module its __init__ imports) in sys.modules: otherwise pytest's importlib mode
# executes that file a second time under the same name, and a test that
# monkeypatches the second copy (tests/flash/test_mosaic_gpu.py's ``hopper``)
# misses the first, which the package's functions call.
import fnattn  # noqa: E402,F401


# Every compiled program keeps a few memory mappings (its machine code) for as
# long as JAX's caches hold it. A process that compiles tens of thousands of
# programs (the suite in one process; the "dev" Hypothesis profile, whose tests
# compile a program per example) reaches the kernel's vm.max_map_count (65 530
# by default), past which no new code can be mapped and XLA aborts inside a
# compile: a dev-profile run of property_tests/ did, 30 s after holding 64 072
# mappings, all added by one Hypothesis test. So after every 32nd compile
# (counted by a JAX monitoring listener, which runs between the examples of a
# Hypothesis test too), past 60 % of that limit, the caches are cleared and the
# programs' mappings go with them (tests/test_conftest.py).
_MAPS_EVERY, _MAPS_SHARE = 32, 0.6


def _max_map_count():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None  # (not Linux: no such limit to watch)


def memory_maps():
    """How many memory mappings this process holds (Linux), else 0."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


_MAP_LIMIT = _max_map_count()


def release_programs_past(limit, every=_MAPS_EVERY):
    """A JAX monitoring listener (``jax.monitoring.register_event_duration_secs_
    listener``): on every ``every``-th backend compile it sees, when this process
    holds more than ``limit`` memory mappings, it clears JAX's caches
    (``jax.clear_caches``; the program just compiled still reaches its caller)
    and collects the programs they held."""
    from fnattn import _jax_private

    compile_event = _jax_private.get("backend_compile_event")
    compiles = [0]

    def listener(event, duration_secs, **kwargs):
        if event != compile_event:
            return
        compiles[0] += 1
        if compiles[0] % every == 0 and memory_maps() > limit:
            import jax
            jax.clear_caches()
            gc.collect()
    return listener


if _MAP_LIMIT:
    import jax  # noqa: E402

    jax.monitoring.register_event_duration_secs_listener(
        release_programs_past(_MAPS_SHARE * _MAP_LIMIT))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most four (each holds 3 to 5 GB)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))
