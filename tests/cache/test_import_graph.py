"""cache_service's modules import each other without a cycle.

The graph is read from the source (ast), so it also sees imports that run only under
`TYPE_CHECKING` or inside a function: a cycle hidden there still ties the modules together and
turns into an ImportError (or a half-initialized module) the day someone moves the import up.
An import of `a.b.c` is an edge to `a.b.c` (and `from a.b import c` to `a.b.c` when c is a
module, else to `a.b`); the implicit import of a parent package is not an edge, as usual.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "cache_service"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def _resolve_from(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(path) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph() -> dict[str, set[str]]:
    """module -> the cache_service modules it imports (anywhere in its source)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_from(name, path, node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else base)
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, three colours)."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    for start in sorted(graph):
        if colour[start] != white:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path = [start]
        colour[start] = grey
        while stack:
            node, todo = stack[-1]
            if not todo:
                colour[node] = black
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop()
            if colour[nxt] == grey:
                return [*path[path.index(nxt):], nxt]
            if colour[nxt] == white:
                colour[nxt] = grey
                path.append(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return None


def test_finder_sees_a_cycle() -> None:
    # The check itself must be able to fail.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_reads_type_checking_imports() -> None:
    graph = import_graph()
    assert "cache_service.pool" in graph["cache_service.pool_registry"]
    assert any(m.startswith("cache_service.durable") for m in graph["cache_service.watch"])  # TYPE_CHECKING


def test_cache_service_imports_are_acyclic() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    # Whatever is imported first must work (a runtime cycle fails for some entry order).
    names = [n for n in _modules() if not n.endswith("__main__")]
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n" \
             "    for m in [m for m in sys.modules if m.startswith('cache_service')]:\n" \
             "        del sys.modules[m]\n" \
             "    importlib.import_module(name)\n"
    subprocess.run([sys.executable, "-c", script, *names], cwd=ROOT, check=True, timeout=120)
