"""Skips for tests of the native kernels, and RADIXKV_REQUIRE_NATIVE=1, which makes them failures.

A test of a native kernel skips where the kernel is not active here (not built, not loaded, or its
probe in model_service/native/registry.py found it differs from torch): `needs_native(kernel)` as
a mark, `skip_unless_native(kernel)` in a body, `needs_library()` for tests that compare a
kernel with torch themselves. Every such skip's reason starts with SKIP_PREFIX.
On a machine that must run them (.ci/run sets RADIXKV_REQUIRE_NATIVE=1 where the CPU has
AVX-512), `pytest_runtest_makereport` (imported by tests/conftest.py) turns those skips into
failures, so a dead fast path cannot leave the suite green.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from model_service import native
from model_service.native import registry

SKIP_PREFIX = "native kernels"
REQUIRE_ENV = "RADIXKV_REQUIRE_NATIVE"


def required() -> bool:
    """Whether this run must not skip native-kernel tests."""
    return os.environ.get(REQUIRE_ENV, "") == "1"


def why_inactive(kernel: str, **shape: object) -> str | None:
    """None when `kernel` is active here for this shape, else the skip reason (one that does not
    fail a required run where the kernel is inactive as expected on this CPU)."""
    status = registry.status(kernel, **shape)
    if status.active:
        return None
    if status.expected:
        return f"{kernel} inactive on this CPU, as expected: {status.expected} ({status.reason})"
    return f"{SKIP_PREFIX}: {kernel} inactive ({status.reason})"


def needs_native(kernel: str = "attention", **shape: object) -> pytest.MarkDecorator:
    """A skipif mark for tests of `kernel` (evaluated at import: the registry caches its answer)."""
    reason = why_inactive(kernel, **shape)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def needs_library() -> pytest.MarkDecorator:
    """A skipif mark for tests that check kernels against torch themselves (the library is loaded)."""
    reason = native.unavailable_reason()
    return pytest.mark.skipif(reason is not None, reason=f"{SKIP_PREFIX}: library not loaded ({reason})")


def skip_unless_native(kernel: str, **shape: object) -> None:
    """Skips the running test (a failure under RADIXKV_REQUIRE_NATIVE=1) unless `kernel` is active."""
    reason = why_inactive(kernel, **shape)
    if reason is not None:
        pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Under RADIXKV_REQUIRE_NATIVE=1 a skip whose reason starts with SKIP_PREFIX is a failure."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and required() and isinstance(report.longrepr, tuple)):
        return
    reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    if reason.startswith(SKIP_PREFIX):
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_ENV}=1 and this test skipped: {reason}"
