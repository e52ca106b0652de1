"""Settings for every test process (tests/, property_tests/, the doctests in fnattn/).

The suite compiles thousands of small XLA programs on the CPU and runs each
once or twice, so compiling dominates its time. LLVM's optimisations of the
generated CPU code are switched off (``--xla_backend_optimization_level=0``,
``--xla_llvm_disable_expensive_passes``): about a quarter less wall time, with
the same results up to float rounding, which every comparison's tolerance
covers. Flags already in ``XLA_FLAGS`` are kept (a flag given there wins), and
set ``FNATTN_TEST_XLA_OPT=1`` to test with the optimised code users run.
Subprocesses (tests/test_shard_map.py) inherit them.

``PJRT_NPROC`` gives XLA:CPU's thread pool 8 threads however few cores the
machine has: the Mosaic GPU interpreter runs a program's warpgroups on their own
threads, waiting for one another at barriers, and with one thread per core
(two on the CI machine) a warpgroup can wait for a thread forever
(tests/mosaic_gpu_interpreter.py). A value already set is kept.
"""

import os

_FAST_COMPILE = ("--xla_backend_optimization_level=0",
                 "--xla_llvm_disable_expensive_passes=true")

if os.environ.get("FNATTN_TEST_XLA_OPT") != "1":
    _given = os.environ.get("XLA_FLAGS", "")
    _names = {f.split("=")[0] for f in _given.split()}
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in _FAST_COMPILE if f.split("=")[0] not in _names] + [_given]).strip()

os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))
