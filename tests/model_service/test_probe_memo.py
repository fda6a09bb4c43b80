"""The linear plan's probe answers kept on disk between starts (model_service/linear/probe_memo.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from model_service.linear import blocked, plan_model, probe_memo, tuning, verify


@pytest.fixture
def fresh_memos(tmp_path, monkeypatch):
    """Empty process memos and a cache dir of the test's own; the process's memos come back after."""
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(probe_memo.ENV_SWITCH, raising=False)
    saved = _snapshot()
    _clear()
    yield tmp_path
    _clear()
    for name, table in probe_memo._tables().items():
        table.update(saved[name])


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(96, 160, bias=False), nn.Linear(160, 96, bias=False), nn.Linear(96, 64))


def _clear() -> None:
    for table in probe_memo._tables().values():
        table.clear()


def _snapshot() -> dict[str, dict]:
    """A copy of every process memo the probe memo keeps."""
    return {name: dict(table) for name, table in probe_memo._tables().items()}


def _plan_table(seed: int = 0) -> str:
    """A start's plan; the bit check of the transposed path asked too (whether the plan asks
    depends on the timing run's answer)."""
    with probe_memo.kept():
        model = _model(seed)
        verify.shared.transposed(model[2].weight, model[2].bias, (16, 17))
        return plan_model(model).table()


def _no_probe(*args, **kwargs):
    raise AssertionError("probed although the answer was kept")


def test_a_second_start_restores_every_answer_and_plans_alike(fresh_memos, monkeypatch):
    first = _plan_table()
    found = _snapshot()
    assert found["timed"] and found["verified"]  # the timing run and the bit checks ran
    files = list((fresh_memos / "probes").glob("linear-*.json"))
    assert len(files) == 1

    _clear()  # a new process: nothing probed yet
    for module, name in ((tuning, "_pass_s"), (blocked, "find_block"), (blocked, "find_short_splits"),
                         (verify.Verifier, "_equals_f_linear")):
        monkeypatch.setattr(module, name, _no_probe)
    with probe_memo.kept():
        assert _snapshot() == found
        second = plan_model(_model(seed=1)).table()  # other values, same shapes: the answers hold
    assert second == first
    assert _snapshot() == found  # nothing probed again


def test_the_answers_restored_are_the_ones_probed(fresh_memos):
    _plan_table()
    kept = _snapshot()
    _clear()
    with probe_memo.kept():
        restored = _snapshot()
    assert restored == kept
    if blocked.probed:
        assert all(v is None or (type(v[0]) is int and isinstance(v[1], tuple)) for v in blocked.probed.values())
    assert all(type(v) is bool for v in verify.shared.answers.values())
    assert any(isinstance(v, tuning.Timing) for v in tuning.timed.values())


def test_a_malformed_memo_is_ignored_and_rewritten(fresh_memos):
    path = probe_memo.memo_path()
    path.parent.mkdir(parents=True)
    for text in ("{not json", "[" * 100_000 + "]" * 100_000,
                 json.dumps({"version": 1, "tables": {"verified": [[["x", {"dtype": "os"}], True]]}}),
                 json.dumps({"version": 1, "tables": {"timed": [[["paths"], {"timing": [1]}]]}}),
                 json.dumps({"version": 1, "tables": {"blocked": [[[96, 160, 2], 192]]}}),  # not (block, splits)
                 json.dumps({"version": 1, "tables": {"verified": [[["transposed", [64, 96], {"dtype": "float32"},
                                                                     True, [16, 17], 2], "no"]]}})):
        path.write_text(text)
        _clear()
        _plan_table()
        assert tuning.timed and verify.shared.answers  # probed again
        rewritten = json.loads(path.read_text())
        assert rewritten["version"] == probe_memo.VERSION and rewritten["tables"]["timed"]


def test_another_version_of_the_file_is_not_read(fresh_memos):
    _plan_table()
    path = probe_memo.memo_path()
    body = json.loads(path.read_text())
    body["version"] = probe_memo.VERSION + 1
    path.write_text(json.dumps(body))
    _clear()
    with probe_memo.kept():
        assert not tuning.timed and not verify.shared.answers


def test_a_memo_that_cannot_be_found_never_fails_a_start(fresh_memos, monkeypatch):
    def no_home(name: str):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(probe_memo, "local_cache_dir", no_home)
    assert _plan_table()  # planned, probing as without a memo
    assert tuning.timed
    (fresh_memos / "probes").mkdir()
    (fresh_memos / "probes").chmod(0o500)  # unwritable (as root this still writes: the call must not fail either way)
    monkeypatch.undo()
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(fresh_memos))
    _clear()
    assert _plan_table()


def test_switched_off_nothing_is_read_or_written(fresh_memos, monkeypatch):
    monkeypatch.setenv(probe_memo.ENV_SWITCH, "off")
    _plan_table()
    assert tuning.timed  # probed as always
    assert not (fresh_memos / "probes").exists()


def test_the_fingerprint_follows_what_the_answers_depend_on(monkeypatch):
    base = probe_memo.fingerprint()
    assert probe_memo.fingerprint() == base
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")  # MKL's kernels, and so its summation order
    assert probe_memo.fingerprint() != base
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert probe_memo.fingerprint() != base
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(probe_memo, "_cpu", lambda: "vendor_id: another CPU")
    assert probe_memo.fingerprint() != base
