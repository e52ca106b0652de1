"""The examples in docs/*.md run and print what the pages say."""

import doctest
import glob
import os

import pytest

# docs/context_parallel.md runs on 8 devices, with the other multi-device checks
# (tests/multi_device/examples_checks.py, in tests/test_shard_map.py's subprocess).
MULTI_DEVICE = ("context_parallel.md",)
DOCS = sorted(p for p in glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "*.md"))
              if os.path.basename(p) not in MULTI_DEVICE)


@pytest.mark.parametrize("path", DOCS, ids=os.path.basename)
def test_doc_examples(path):
    res = doctest.testfile(path, module_relative=False,
                           optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0


def test_readme_example_runs():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("T = 2, 1024", "T = 2, 256")
    env = {}
    exec(compile(code, "README.md", "exec"), env)
    assert env["res"].out.shape == (2, env["T"], 8, 64)
    assert env["dq"].shape == env["q"].shape
