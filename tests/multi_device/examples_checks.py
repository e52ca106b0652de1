"""examples/context_parallel.py on the 8 CPU devices: the sharded training step's
loss and gradients equal one device's, with both context-parallel strategies;
and the examples of docs/context_parallel.md on them (a mesh over all 8)."""

import doctest
import importlib.util
import os

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "context_parallel.py")


def _example():
    spec = importlib.util.spec_from_file_location("context_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_context_parallel_example():
    example = _example()
    for strategy in ("ring", "all_gather"):
        loss, ref_loss, err = example.main(["--seq", "128", "--strategy", strategy])
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and err < 1e-4, (strategy, err)


def check_context_parallel_doc():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "context_parallel.md")
    res = doctest.testfile(path, module_relative=False,
                           optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0 and res.attempted > 0, res


CHECKS = [check_context_parallel_example, check_context_parallel_doc]
