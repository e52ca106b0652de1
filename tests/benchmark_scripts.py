"""The benchmark scripts (``benchmarks/*.py``, no package) loaded as modules, for
the tests of their pieces that need no GPU."""

import importlib.util
import os


def benchmark_module(name):
    """``benchmarks/<name>.py`` loaded as a module."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"fnattn_benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
