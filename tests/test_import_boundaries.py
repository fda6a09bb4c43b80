"""No module under tests/ imports one under bench/ or the other way round, and testing/ (what
both use: the fault proxy, the frozen baseline tree, the tree trace) imports neither.

Read from the source (ast), so an import inside a function or under `TYPE_CHECKING` counts too:
it still makes the one depend on the other the day it runs. Relative imports stay inside their
own top-level folder, so absolute ones are all that can cross.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# top-level folder -> the top-level packages its modules must not import
FORBIDDEN = {"tests": {"bench"}, "bench": {"tests"}, "testing": {"tests", "bench"}}


def crossings(root: Path, forbidden: dict[str, set[str]]) -> list[str]:
    """'path:line imports name' for every absolute import from a folder of a package it must not use."""
    found = []
    for folder, banned in forbidden.items():
        for path in sorted((root / folder).rglob("*.py")):
            if "node_modules" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] in banned:
                        found.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    return found


def test_tests_and_bench_never_import_each_other() -> None:
    assert crossings(ROOT, FORBIDDEN) == []


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "bench").mkdir()
    b = "bench"  # spelled apart so that a grep for such imports in tests/ stays empty
    (tmp_path / "tests" / "test_x.py").write_text(
        f"import {b}\nimport {b}.harness as h\nfrom {b}.tree import T\n"
        f"def f():\n    from {b} import suite\nfrom . import ok\nimport {b}marks\n")
    (tmp_path / "bench" / "x.py").write_text("from tests.services import start_model\n")
    assert crossings(tmp_path, {"tests": {"bench"}, "bench": {"tests"}}) == [
        "tests/test_x.py:1 imports bench", "tests/test_x.py:2 imports bench.harness",
        "tests/test_x.py:3 imports bench.tree", "tests/test_x.py:5 imports bench",
        "bench/x.py:1 imports tests.services"]
