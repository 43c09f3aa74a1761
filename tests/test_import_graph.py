"""The modules of runtime/ import each other without cycles.

Every module under runtime/ is parsed with `ast` (nothing is imported) and each import of another runtime module
is an edge: relative imports (`from .x import y`, `from .. import x`) and absolute ones of `specoffload.runtime...`.

    counted       imports at module level and inside functions or methods (a function-level import only defers
                  the cycle to the first call; it does not remove it)
    not counted   imports under `if TYPE_CHECKING:` (never executed), `importlib.import_module` by name (the lazy
                  exports of runtime/__init__.py), and the implicit import of a module's parent packages
    target        `from .pkg import name` points at the submodule pkg/name.py when one exists, else at pkg itself
                  (its __init__.py); `import a.b` and `from a import b` of a plain module point at that module

A cycle fails the test with the modules of the cycle in order. `KNOWN_EDGES` lists the edges of cycles that are
known and scheduled for removal; they are left out of the graph, and each must still be an import of its module
(counting `TYPE_CHECKING` ones too), so that an edge that is gone is also taken off the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "runtime"
PACKAGE = "specoffload.runtime"

#: known cycle edges, left out of the graph; each must still be in the code (none: the graph is acyclic as it is)
KNOWN_EDGES: set[tuple[str, str]] = set()


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree`; those in the body of an `if TYPE_CHECKING:` only with `type_checking`
    (its else branch always runs)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = RUNTIME, package: str = PACKAGE, type_checking: bool = False) -> dict[str, set[str]]:
    """Module name -> the modules of `package` (the folder `root`) it imports (rules in the module docstring;
    `type_checking`: count the imports under `if TYPE_CHECKING:` too)."""
    files = {_module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}

    def resolve(module: str, name: str | None) -> str | None:
        if name is not None and f"{module}.{name}" in files:
            return f"{module}.{name}"
        return module if module in files else None

    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name, None) for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [resolve(module, alias.name) for alias in node.names]
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [m0, m1, ..., m0], or None (iterative depth-first search, modules in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_sees_relative_absolute_and_function_level_imports(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "a.py": "from . import b\nfrom .sub import c\n",
        "b.py": "import pkg.sub.c\nimport json\n",
        "sub/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n",
        "sub/c.py": "def f():\n    from ..a import name\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_graph(tmp_path, "pkg") == {
        "pkg": set(), "pkg.a": {"pkg.b", "pkg.sub.c"}, "pkg.b": {"pkg.sub.c"}, "pkg.sub": set(), "pkg.sub.c": {"pkg.a"},
    }
    assert import_graph(tmp_path, "pkg", type_checking=True)["pkg.sub"] == {"pkg.a"}
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    graph = import_graph()  # and on runtime/ itself
    assert "specoffload.runtime.offload.profiler" in graph["specoffload.runtime.engine"]


def test_find_cycle_reports_the_cycle_in_order() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_runtime_has_no_import_cycles() -> None:
    graph, every = import_graph(), import_graph(type_checking=True)
    for src, dst in sorted(KNOWN_EDGES):
        assert dst in every.get(src, set()), f"known cycle edge {src} -> {dst} is gone: take it off KNOWN_EDGES"
        graph[src].discard(dst)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in runtime/: " + " -> ".join(cycle or [])


def test_planner_imports_neither_torch_nor_the_runtime_anywhere() -> None:
    """planner/ at every level, functions included (test_planner.py checks what importing it loads; a function's
    import shows only when the function runs)."""
    banned = ("torch", "ray", "safetensors", "transformers", "specoffload.runtime", "specoffload.actors")
    found = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        for node in _imports(ast.parse(path.read_text(), str(path)), type_checking=True):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: inside planner/
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in banned[:4]
                      or n.startswith(banned[4:])]
    assert found == []
