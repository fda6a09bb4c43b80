"""Fixtures for third-party client tests: the OpenAI HTTP door of a real router in front of the
session's bundled-model service (tests/conftest.py), so clients nobody here wrote (LangChain,
lm-evaluation-harness) talk to the real stack over loopback."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from model_service.model_loader import _convert_gguf, bundled_model_path
from tests.router.conftest import http_url
from tests.services import Running, start_router


@dataclass(frozen=True, slots=True)
class Door:
    """The router's OpenAI door: `base_url` ends in /v1; `model` is the id /v1/models lists."""

    base_url: str
    model: str


@pytest.fixture(scope="session")
def bundled_door(cache_service: Running, model_service: Running) -> Iterator[Door]:
    """A router (HTTP door on a free port) whose only replica is the session's bundled-model service.
    Uses `model_service`, so its tests get the `model` marker (tests/conftest.py)."""
    router = start_router(cache_service.addr, "--http-port", "0", "--check-interval", "0.5",
                          "--replica", model_service.addr)
    try:
        base_url = http_url(router) + "/v1"
        with urllib.request.urlopen(base_url + "/models", timeout=10) as reply:
            model = json.load(reply)["data"][0]["id"]
        yield Door(base_url, model)
    finally:
        router.process.stop(10.0)


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    """The bundled model as the local HF folder (float32 safetensors + tokenizer) the model service
    itself loads: the GGUF converted once and cached (model_service/model_loader.py)."""
    return _convert_gguf(bundled_model_path())
