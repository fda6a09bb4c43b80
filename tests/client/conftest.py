"""Client-test fixtures. The real cache and model services (`cache_service`, `model_service`)
are the session-wide ones from tests/conftest.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.skip("node is not on PATH")
    if not (REPO / "client" / "node" / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("client/node/node_modules is missing: run `make node` (make test does)", pytrace=False)
    return path
