"""`python -m model_service.native.check` and RADIXKV_REQUIRE_NATIVE: what runs here is said, and
a dead fast path can fail the run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_service.native import check, registry
from tests.native_required import REQUIRE_ENV, needs_native

ROOT = Path(__file__).resolve().parents[2]


def _check(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != REQUIRE_ENV} | env
    return subprocess.run([sys.executable, "-m", "model_service.native.check", *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=300)


@needs_native("attention")
def test_every_kernel_is_active_on_an_avx512_machine():
    """Every kernel active, or inactive only where its probe's mismatch is expected on this CPU
    (prompt_attention on Intel, where MKL sums in its own order)."""
    result = _check("--require")
    assert result.returncode == 0, result.stdout + result.stderr
    for name in registry.KERNELS:
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"  {name} "))
        expected = registry.KERNELS[name].expected_mismatch
        assert " active" in line or (expected is not None and expected() and "(expected on this CPU: " in line), line
    assert "cpu flags: " in result.stdout and "torch " in result.stdout and " threads" in result.stdout


def test_without_avx512_every_kernel_says_why_and_require_fails():
    """torch told to use AVX2 kernels: the library is not loaded, which the tool says per kernel;
    with --require (or RADIXKV_REQUIRE_NATIVE=1) that is exit status 1, without it 0."""
    required = _check(ATEN_CPU_CAPABILITY="avx2", **{REQUIRE_ENV: "1"})
    assert required.returncode == 1
    assert "error: native kernels required, inactive: " + ", ".join(registry.KERNELS) in required.stderr
    for name in registry.KERNELS:
        assert f"{name}" in required.stdout
    assert required.stdout.count("inactive: not loaded: ") == len(registry.KERNELS)
    if "avx512f" in required.stdout:  # an AVX-512 CPU told to use AVX2: that is the reason given
        assert "inactive: not loaded: this CPU has no AVX-512 (torch reports AVX2)" in required.stdout
    assert _check(ATEN_CPU_CAPABILITY="avx2").returncode == 0


@needs_native("attention")
def test_a_probe_mismatch_makes_its_kernel_inactive(monkeypatch, capsys):
    monkeypatch.setitem(registry.KERNELS, "rope", dataclasses.replace(
        registry.KERNELS["rope"], probe=lambda **_: "3 of 64 values differ from torch's"))
    monkeypatch.setattr(registry, "_answers", {})
    monkeypatch.setattr(registry, "_memory", {})
    monkeypatch.setattr(registry, "_read_disk", dict)
    monkeypatch.setattr(registry, "_write_disk", lambda *_: None)
    assert check.main(["--require"]) == 1
    out = capsys.readouterr()
    assert "rope              inactive: probe mismatch: 3 of 64 values differ from torch's" in out.out
    assert "inactive: rope" in out.err
    assert not registry.active("rope", head_dim=64)
    # The same mismatch where the kernel says it is expected on this CPU: reported, not required.
    monkeypatch.setitem(registry.KERNELS, "rope", dataclasses.replace(
        registry.KERNELS["rope"], expected_mismatch=lambda: "its reference sums in another order here"))
    monkeypatch.setattr(registry, "_answers", {})
    monkeypatch.setitem(registry.KERNELS, "prompt_attention", dataclasses.replace(
        registry.KERNELS["prompt_attention"], probe=lambda **_: None))
    assert check.main(["--require"]) == 0
    out = capsys.readouterr()
    assert ("rope              inactive: probe mismatch: 3 of 64 values differ from torch's "
            "(expected on this CPU: its reference sums in another order here)") in out.out
    assert registry.status("rope", head_dim=64).expected and not registry.active("rope", head_dim=64)


@pytest.mark.parametrize("required, outcome", [("1", "1 failed, 1 skipped"), ("", "2 skipped")])
def test_require_native_turns_a_native_skip_into_a_failure(tmp_path, required, outcome):
    (tmp_path / "conftest.py").write_text("from tests.native_required import pytest_runtest_makereport  # noqa\n")
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n"
        "def test_native():\n"
        "    pytest.skip('native kernels: rope inactive (not loaded: stand-in)')\n"
        "def test_other():\n"
        "    pytest.skip('needs objdump')\n")
    environ = os.environ | {REQUIRE_ENV: required, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", str(tmp_path)],
                            cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
    assert outcome in result.stdout, result.stdout  # other skips stay skips
    if required:
        assert result.returncode == 1
        assert f"{REQUIRE_ENV}=1 and this test skipped: native kernels: rope inactive" in result.stdout
