"""The test tiers (tests/conftest.py): `make test-fast` (`-m "not model and not replica and not
soak"`) must leave out every test that loads or serves the bundled model, starts a model service
process, or soaks.

Two checks. (1) The source: every fixture or test whose body starts a model service or loads the
bundled model is registered or marked (the bundled model: only `model` will do), so a new one
can't slip into the fast tier unseen. (2) Collection: pytest itself, run with the fast tier's
`-m`, selects none of the known slow tests and still selects the known fast ones.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import BUNDLED_MODEL_FIXTURES, REPLICA_FIXTURES, SOAK_FIXTURES

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
FAST = "not model and not replica and not soak"
STARTERS = {"start_model", "launch_model"}
# Where the starters are defined: not a call site to check.
EXEMPT = {TESTS / "services.py"}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def starts_bundled_model(call: ast.Call) -> bool:
    """start_model/launch_model with no `--model` argument, or load_model(None, ...)."""
    name = _name(call.func)
    if name in STARTERS:
        # A starred argument (e.g. *replica_args(tiny_model, ...)) is trusted to carry --model.
        return not any(isinstance(a, ast.Starred) or (isinstance(a, ast.Constant) and a.value == "--model")
                       for a in call.args)
    if name == "load_model" and call.args:
        return isinstance(call.args[0], ast.Constant) and call.args[0].value is None
    return False


def _marks(decorators: list[ast.expr]) -> set[str]:
    return {_name(d.func if isinstance(d, ast.Call) else d) for d in decorators}


def _module_marks(tree: ast.Module) -> set[str]:
    """The marker names in a module's `pytestmark = ...` (one mark or a list of them)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(_name(t) == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            return _marks(values)
    return set()


def unmarked_starters(root: Path, bundled: frozenset[str], replica: frozenset[str]) -> list[str]:
    """'path:function' for every function under `root` that starts a model service or loads the
    bundled model in its own body, yet isn't seen as slow: a fixture must be registered (the
    bundled model: in `bundled`), a test marked (itself or its module; the bundled model: `model`)
    or take a registered fixture. A helper starting the bundled model is reported too (who calls it
    can't be told from here: make it a fixture); one starting the tiny model is left to the
    runtime check (tests/services.launch_model under `make test-fast`)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path in EXEMPT:
            continue
        tree = ast.parse(path.read_text(), str(path))
        module_marks = _module_marks(tree)
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            calls = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
            uses_bundled = any(starts_bundled_model(n) for n in calls)
            if not uses_bundled and not any(_name(n.func) in STARTERS for n in calls):
                continue
            enough = {"model"} if uses_bundled else {"model", "replica"}
            registered = bundled if uses_bundled else bundled | replica
            marks = _marks(func.decorator_list)
            if "fixture" in marks:
                ok = func.name in registered
            elif func.name.startswith("test_"):
                params = {a.arg for a in func.args.args}
                ok = bool(enough & (marks | module_marks)) or bool(params & registered)
            else:
                ok = not uses_bundled
            if not ok:
                found.append(f"{path.relative_to(root)}:{func.name}")
    return found


def test_every_model_service_starter_is_registered_or_marked() -> None:
    assert unmarked_starters(TESTS, BUNDLED_MODEL_FIXTURES, REPLICA_FIXTURES) == []


def test_the_source_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "@pytest.fixture\ndef served(cache):\n    return start_model(cache.addr, '--num-blocks', '8')\n"
        "@pytest.fixture\ndef tiny(cache, d):\n    return start_model(cache.addr, '--model', str(d))\n"
        "@pytest.fixture\ndef fleet(cache, d):\n    return launch_model(cache.addr, *replica_args(d, 'a'))\n"
        "def test_body(cache):\n    start_model(cache.addr)\n"
        "@pytest.mark.model\ndef test_marked(cache):\n    start_model(cache.addr)\n"
        "@pytest.mark.replica\ndef test_marked_replica_only(cache):\n    start_model(cache.addr)\n"
        "def test_tiny_body(cache, d):\n    start_model(cache.addr, '--model', str(d))\n"
        "def test_on_a_tiny_fixture(tiny, d):\n    start_model(cache.addr, '--model', str(d))\n"
        "def reference():\n    return load_model(None, 1, 2)\n"
        "def helper(d):\n    return load_model(str(d), 1, 2), start_model('a', '--model', str(d))\n")
    assert unmarked_starters(tmp_path, frozenset(), frozenset()) == [
        "test_x.py:served", "test_x.py:tiny", "test_x.py:fleet", "test_x.py:test_body",
        "test_x.py:test_marked_replica_only", "test_x.py:test_tiny_body", "test_x.py:test_on_a_tiny_fixture",
        "test_x.py:reference"]
    assert unmarked_starters(tmp_path, frozenset({"served"}), frozenset({"tiny", "fleet"})) == [
        "test_x.py:test_body", "test_x.py:test_marked_replica_only", "test_x.py:test_tiny_body",
        "test_x.py:reference"]


# Runs pytest's own collection with the fast tier's `-m` (the real hook, the real deselection) and
# reports what it selected and what it deselected, with each test's markers.
RECORDER = """
import json, sys
import pytest

class Recorder:
    def __init__(self):
        self.selected, self.deselected = {}, {}

    def pytest_deselected(self, items):
        self.deselected.update({i.nodeid: sorted({m.name for m in i.iter_markers()}) for i in items})

    @pytest.hookimpl(trylast=True)  # after `-m` has deselected
    def pytest_collection_modifyitems(self, items):
        self.selected.update({i.nodeid: sorted({m.name for m in i.iter_markers()}) for i in items})

recorder = Recorder()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[recorder])
print("TIERS " + json.dumps({"code": int(code), "selected": recorder.selected, "deselected": recorder.deselected}))
"""


def collect(*args: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(selected, deselected): node id -> marker names."""
    result = subprocess.run([sys.executable, "-c", RECORDER, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("TIERS ")]
    assert lines, result.stdout + result.stderr
    report = json.loads(lines[-1].removeprefix("TIERS "))
    assert report["code"] == 0, result.stdout + result.stderr
    return report["selected"], report["deselected"]


# Known to load or serve the bundled model (none carries a hand-written mark), to start model
# services of their own, and a soak.
BUNDLED = {
    "tests/model_service/test_greedy_correctness.py::test_one_at_a_time_then_cached",
    "tests/model_service/test_greedy_correctness.py::test_tiny_pool_preempts_and_evicts_yet_identical",
    "tests/model_service/test_tenant_isolation.py::test_another_tenant_gets_no_hit_and_no_timing_signal",
    "tests/security/test_server_limits.py::test_info_logs_hold_no_prompt_text_or_token_ids",
}
REPLICAS = {
    "tests/model_service/test_bfloat16.py::test_model_info_reports_bfloat16",
    "tests/router/test_router_trust.py::test_a_rogue_pool_outside_the_allowlist_never_gets_a_request_or_the_token",
}
SOAKS = {"tests/security/test_soak.py::test_soak_leaves_nothing_behind_and_memory_flat"}
# Cache manager processes and in-process tests: these stay in the fast tier.
FAST_ONES = {
    "tests/security/test_server_limits.py::test_a_message_just_over_the_receive_limit_is_resource_exhausted",
    "tests/router/test_core.py::test_rotation_and_least_loaded_spread_equal_loads",
}


def test_the_fast_tier_leaves_out_the_bundled_model_replicas_and_soaks() -> None:
    slow = BUNDLED | REPLICAS | SOAKS
    files = sorted({node.split("::")[0] for node in slow | FAST_ONES})
    selected, deselected = collect("-m", FAST, *files)
    assert FAST_ONES <= selected.keys()
    assert not selected.keys() & slow
    assert slow <= deselected.keys()  # so the names above still exist
    assert all("model" in deselected[node] for node in BUNDLED)
    assert all("replica" in deselected[node] for node in REPLICAS)
    assert all("soak" in deselected[node] for node in SOAKS)


def test_the_registries_name_fixtures_that_exist() -> None:
    """A renamed fixture would silently drop its tests into the fast tier."""
    defined = set()
    for path in TESTS.rglob("*.py"):
        for func in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(func, ast.FunctionDef) and "fixture" in _marks(func.decorator_list):
                defined.add(func.name)
    assert BUNDLED_MODEL_FIXTURES | REPLICA_FIXTURES | SOAK_FIXTURES <= defined
