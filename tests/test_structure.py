"""The import graph of the serving packages: :mod:`fnattn.paged` may build on
:mod:`fnattn.decoding`, never the other way round, and no module of either
imports another that imports it back, lazily or not (the pieces both use live
in :mod:`fnattn._serving` and :mod:`fnattn.quant`)."""

import ast
import pathlib

import fnattn

ROOT = pathlib.Path(fnattn.__file__).parent


def _modules(root=ROOT):
    mods = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _imports(mods):
    """Module -> the fnattn modules it imports anywhere in its source (function
    bodies included: a lazy import is still an arrow)."""
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in node.names} & mods.keys()
                out |= subs
                if len(subs) < len(node.names):
                    out.add(base)
        graph[name] = {m for m in out if m in mods and m not in (name, "fnattn")}
    return graph


def _reaches(graph, start, goal):
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for n in graph[m]:
            if n == goal:
                return True
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return False


def test_decoding_never_imports_paged():
    graph = _imports(_modules())
    wrong = sorted((m, n) for m, ns in graph.items() if m.startswith("fnattn.decoding")
                   for n in ns if n.startswith("fnattn.paged"))
    assert not wrong, f"fnattn.decoding imports fnattn.paged: {wrong}"


def test_no_import_cycle_in_the_serving_packages():
    graph = _imports(_modules())
    serving = [m for m in graph if m.startswith(("fnattn.decoding", "fnattn.paged",
                                                 "fnattn._serving"))]
    cycles = sorted((m, n) for m in serving for n in graph[m] if _reaches(graph, n, m))
    assert not cycles, f"import cycles through the serving packages: {cycles}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "fnattn"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from . import y\n")
    (pkg / "a" / "y.py").write_text("from fnattn.a import x\n")
    graph = _imports(_modules(pkg))
    assert graph["fnattn.a.x"] == {"fnattn.a.y"} and graph["fnattn.a.y"] == {"fnattn.a.x"}
    assert _reaches(graph, "fnattn.a.x", "fnattn.a.x")


def test_no_benchmark_code_inside_the_package():
    """Benchmark problems and timing live under benchmarks/, not in fnattn."""
    assert not [m for m in _modules() if m.rsplit(".", 1)[-1] in ("bench", "benchmarks")]
