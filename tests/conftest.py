"""Session-wide real services shared by every test package: one cache service and one model
service with the bundled model (model loads dominate the suite's runtime)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.services import SHARED_NUM_BLOCKS, SHARED_POOL_ID, Running, start_cache, start_model


@pytest.fixture(scope="session")
def cache_service() -> Iterator[Running]:
    running = start_cache()
    try:
        yield running
    finally:
        running.process.stop(5.0)


@pytest.fixture(scope="session")
def model_service(cache_service: Running) -> Iterator[Running]:
    running = start_model(cache_service.addr, "--num-blocks", str(SHARED_NUM_BLOCKS), "--worker-id", SHARED_POOL_ID)
    try:
        yield running
    finally:
        running.process.stop(10.0)
