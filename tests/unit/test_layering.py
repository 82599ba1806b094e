"""The layers of the source tree, checked statically with `ast` (nothing is imported):

    ftrun/    the runtime: imports none of harness/, mocks/, shadow/
    shadow/   the shadow loader: may import ftrun/
    mocks/    fake subsystems for emulation: may import ftrun/ and shadow/, never harness/
    harness/  the emulator and offline analysis: may import everything below it
    ftrun_bench/  benchmarks, their workers and synthetic inputs: may import ftrun/ only, and ftrun/ never
              imports it (`ftrun bench` loads its modules by name)

and no import cycles between modules inside these packages. Every import statement counts: at module
level, inside a function (a lazy import still closes a cycle once it runs) and under TYPE_CHECKING.
`ftrun.cli` dispatching a subcommand to a module named in a string (`"harness.cli"`) is not an import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ftrun", "harness", "mocks", "shadow", "ftrun_bench")

# Cycles that exist today in code other engineers own, each named by its modules. The test tolerates a
# cycle whose modules are all inside one entry; delete an entry once its cycle is broken.
ALLOWED_CYCLES: tuple[frozenset[str], ...] = ()


def module_names(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under the packages."""
    found = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` is or lies inside; None for modules outside the tree."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def imported_names(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything a module imports; `from a import b` gives "a.b" (which
    resolves to module a.b if it exists, else to a). Relative imports are made absolute."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names]
    return names


def import_graph(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module inside the tree: first line that imports it}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges = graph.setdefault(module, {})
        for line, name in imported_names(module, path):
            target = _resolve(name, known)
            if target is not None and target != module:
                edges.setdefault(target, line)
    return graph


def layer_violations(graph: dict[str, dict[str, int]], known: dict[str, Path]) -> list[str]:
    """Imports that go up a layer: ftrun -> harness/mocks/shadow/ftrun_bench, mocks -> harness, ftrun_bench ->
    anything but ftrun."""
    forbidden = {"ftrun": ("harness", "mocks", "shadow", "ftrun_bench"), "mocks": ("harness", "ftrun_bench"),
                 "shadow": ("harness", "mocks", "ftrun_bench"), "ftrun_bench": ("harness", "mocks", "shadow")}
    found = []
    for module, edges in graph.items():
        top = module.split(".")[0]
        for target, line in edges.items():
            if target.split(".")[0] in forbidden.get(top, ()):
                found.append(f"{known[module].relative_to(ROOT)}:{line} imports {target}")
    return sorted(found)


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return sorted(found, key=sorted)


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    known = module_names(ROOT)
    return known, import_graph(known)


def test_ftrun_imports_no_emulator_layer_and_mocks_do_not_import_harness(tree):
    known, graph = tree
    assert {"ftrun.cli", "harness.cli", "mocks.compute", "shadow.loader"} <= set(known)
    assert layer_violations(graph, known) == []


def test_no_import_cycles_beyond_the_allowlist(tree):
    found = cycles(tree[1])
    new = [sorted(c) for c in found if not any(c <= allowed for allowed in ALLOWED_CYCLES)]
    assert new == [], "import cycles (break them; do not add to ALLOWED_CYCLES)"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checks_catch_upward_imports_and_cycles_of_every_kind(tmp_path):
    _write(tmp_path, {
        "ftrun/__init__.py": "",
        "ftrun/a.py": "from . import b\n",  # relative import, cycle a -> b -> a
        "ftrun/b.py": "def f():\n    import ftrun.a\n",  # lazy import still counts
        "ftrun/c.py": "import harness.x\n",
        "ftrun/cli.py": 'COMMANDS = {"emulate": "harness.x"}\n',  # a string, not an import
        "mocks/__init__.py": "",
        "mocks/m.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.x import Y\n",
        "harness/__init__.py": "",
        "harness/x.py": "from mocks.m import Z\nfrom harness import y\n",
        "harness/y.py": "import harness.x\nimport numpy\n",
        "ftrun/d.py": "def f():\n    from ftrun_bench import w\n",  # the runtime importing a benchmark
        "ftrun_bench/__init__.py": "",
        "ftrun_bench/w.py": "import ftrun.a\nimport mocks.m\n",
    })
    known = module_names(tmp_path)
    graph = import_graph(known)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert layer_violations(graph, known) == ["ftrun/c.py:1 imports harness.x", "ftrun/d.py:2 imports ftrun_bench.w",
                                                  "ftrun_bench/w.py:2 imports mocks.m", "mocks/m.py:3 imports harness.x"]
    finally:
        ROOT = saved
    assert sorted(sorted(c) for c in cycles(graph)) == [["ftrun.a", "ftrun.b"],
                                                         ["harness.x", "harness.y", "mocks.m"]]
