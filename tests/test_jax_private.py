"""fnattn/_jax_private.py: every JAX internal fnattn and its tests use resolves
under the installed jax (a release that moves one fails here, naming the jax
version and the symbol), nothing else in the project reaches into ``jax._src``,
and a jax newer than the newest tested gives one warning at import."""

import ast
import os
import subprocess
import sys

import jax
import pytest

from fnattn import _jax_private

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_set(x):
    return isinstance(x, set)


def _callable(attr):
    return lambda x: callable(getattr(x, attr, None))


# What each use must be, beyond resolving: what fnattn relies on.
EXPECTED = {
    "no_axis_name": lambda x: x is not None and not isinstance(x, str),
    "prim_requires_devices_during_lowering": _is_set,
    "cudnn_fused_attention": lambda x: all(callable(getattr(x, n, None)) for n in (
        "dot_product_attention", "check_cudnn_version", "_dot_product_attention_bwd_rule",
        "_normalize_layout")) and hasattr(x, "MaskType") and hasattr(x, "cuda_versions"),
    "mosaic_gpu_interpret_params": lambda x: isinstance(x, type),
    "backend_compile_event": lambda x: isinstance(x, str) and "compile" in x,
    "event_duration_listeners": lambda x: isinstance(x, list),
    "backends_started": callable,
    "interpret_thread_map": _callable("_run_jaxpr"),
    "gpu_interpret_pallas_call": _callable("reset_gpu_interpret_mode_state"),
}


def test_every_use_has_its_check():
    assert set(EXPECTED) == set(_jax_private.USES)


@pytest.mark.parametrize("name", sorted(_jax_private.USES))
def test_use_resolves_under_the_installed_jax(name):
    try:
        found = _jax_private.get(name)
    except _jax_private.JaxInternalMoved as e:
        pytest.fail(str(e))
    use = _jax_private.USES[name]
    assert EXPECTED[name](found), (
        f"jax {jax.__version__}: jax._src.{use.module}.{use.attr} is not what fnattn uses "
        f"({use.used_for}): {found!r}")
    assert use.used_for and use.public_checked


def test_a_moved_symbol_is_named_with_the_jax_version(monkeypatch):
    gone = _jax_private.Use("core", "no_such_symbol_anywhere", "a test", "none exists")
    monkeypatch.setitem(_jax_private.USES, "gone", gone)
    with pytest.raises(_jax_private.JaxInternalMoved) as e:
        _jax_private.get("gone")
    msg = str(e.value)
    assert f"jax {jax.__version__}" in msg and "jax._src.core.no_such_symbol_anywhere" in msg
    assert "'gone'" in msg and "none exists" in msg
    assert _jax_private.get("gone", default=None) is None


def test_a_public_equivalent_comes_first(monkeypatch):
    both = _jax_private.Use("core", "Primitive", "a test", "jax.extend.core.Primitive",
                            public=(("jax.extend.core", "Primitive"),))
    monkeypatch.setitem(_jax_private.USES, "both", both)
    monkeypatch.delitem(_jax_private._found, "both", raising=False)
    import jax.extend.core
    assert _jax_private.get("both") is jax.extend.core.Primitive


def _private_uses(path):
    """(line, text) of each ``jax._src`` import or attribute in a Python file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.startswith("jax._src")]
        elif (isinstance(node, ast.Attribute) and node.attr == "_src"
              and isinstance(node.value, ast.Name) and node.value.id == "jax"):
            found.append((node.lineno, "jax._src"))
    return found


def test_nothing_else_reaches_into_jax_src():
    seam = os.path.join(ROOT, "fnattn", "_jax_private.py")
    uses = []
    for top in ("fnattn", "tests", "property_tests", "benchmarks", "conftest.py"):
        base = os.path.join(ROOT, top)
        files = [base] if base.endswith(".py") else [
            os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs if f.endswith(".py")]
        for path in files:
            if os.path.exists(path) and path != seam:
                uses += [f"{os.path.relpath(path, ROOT)}:{n}: {t}"
                         for n, t in _private_uses(path)]
    assert uses == [], "go through fnattn/_jax_private.py:\n" + "\n".join(uses)


# ----------------------------------------------------------------------------------
# The tested range
# ----------------------------------------------------------------------------------

def test_tested_versions_end_with_the_installed_jax_or_later():
    newest = _jax_private._minor(_jax_private.TESTED_JAX[-1])
    assert _jax_private._minor(jax.__version__) <= newest, (
        f"jax {jax.__version__} is newer than fnattn's tested range {_jax_private.TESTED_JAX}")


@pytest.mark.parametrize("version, warns", [
    ("0.10.2", False), ("0.11.2", False), ("0.12.0.1", False), ("0.12.7", False),
    ("0.13.0", True), ("0.13.0.dev20270101", True), ("1.0.0", True)])
def test_a_newer_jax_warns_naming_the_tested_range(version, warns):
    if warns:
        with pytest.warns(UserWarning, match=r"tested with jax 0\.10\.2 to 0\.12\.0\.1 "
                          rf"\(0\.10\.2, 0\.11\.2, 0\.12\.0\.1\); jax {version} is newer"):
            assert version in _jax_private.check_version(version)
    else:
        assert _jax_private.check_version(version) is None


def test_importing_fnattn_under_a_newer_jax_warns_once():
    """In a fresh process (``import fnattn`` runs the check once per process),
    with jax's version set past the tested range before fnattn is imported."""
    code = ("import warnings; warnings.simplefilter('always'); import jax; "
            "jax.__version__ = '0.13.0'; "
            "import fnattn, fnattn.flash, fnattn.paged, fnattn.context")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             filter(None, [ROOT, os.environ.get("PYTHONPATH")]))))
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if "fnattn was tested with jax" in ln]
    assert len(lines) == 1, res.stderr[-2000:]
    assert "0.10.2 to 0.12.0.1" in lines[0] and "jax 0.13.0 is newer" in lines[0]
    assert "UserWarning" in lines[0]


def test_the_tested_range_is_stated_where_users_read_it():
    for doc in ("README.md", "pyproject.toml"):
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for version in _jax_private.TESTED_JAX:
            assert version in text, f"{doc} does not name jax {version}"



def test_ci_runs_the_readme_command_then_the_newest_jax():
    """.ci/run: the README's test command, then .ci/newest-jax, whose test files
    all exist (a renamed file would leave the newest jax untested)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme_test = [ln for ln in f.read().split("```bash\n", 1)[1].splitlines()
                       if "pytest" in ln][0]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        run = [ln for ln in f.read().splitlines() if ln and not ln.startswith("#")]
    assert run[-2:] == [readme_test, ".ci/newest-jax"]
    script = os.path.join(ROOT, ".ci", "newest-jax")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    with open(script) as f:
        text = f.read()
    listed = text.split('files="', 1)[1].split('"', 1)[0].split()
    assert "tests/test_jax_private.py" in listed and "tests/test_shard_map.py" in listed
    assert [p for p in listed if not os.path.exists(os.path.join(ROOT, p))] == []
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert ".venv-jax-newest/" in f.read().split()
