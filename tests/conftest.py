"""Session-wide real services shared by every test package: one cache service and one model
service with the bundled model (model loads dominate the suite's runtime), and the test tiers.

Test tiers. `make test` runs everything; `make test-fast` runs
`-m "not model and not replica and not soak"`: no bundled model, no model service process, no soak.
These markers are not applied by hand: `pytest_collection_modifyitems` below adds them from the
fixtures a test uses (`item.fixturenames` is the whole closure, so a fixture built on
`model_service` counts too), from the registries below:
- `BUNDLED_MODEL_FIXTURES` -> `model`: fixtures that load or serve the bundled model
  (start_model/launch_model without `--model DIR`, load_model(None, ...)).
- `REPLICA_FIXTURES` -> `replica`: fixtures that start model service processes on the tiny model.
- `SOAK_FIXTURES` -> `soak`: long runs under load.
Names are matched, not definitions: a same-named fixture elsewhere only moves its tests to the
slower tier, never into the fast one. A test that starts a model service in its own body can't be
seen from its fixtures: it (or its module, `pytestmark`) carries the marker by hand.
Safety net: under `make test-fast` (RADIXKV_TESTS_NO_MODEL_SERVICE=1) tests/services.launch_model
refuses to start any model service, so a test that slipped through fails there with a message
naming this file. tests/test_tiers.py checks the tiering itself (source and collection).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.native_required import pytest_runtest_makereport  # noqa: F401  (RADIXKV_REQUIRE_NATIVE=1: skips fail)
from tests.services import SHARED_NUM_BLOCKS, SHARED_POOL_ID, Running, start_cache, start_model

# Fixtures that load or serve the bundled SmolLM2 model: a test using any of them is `model`.
BUNDLED_MODEL_FIXTURES = frozenset({
    "model_service",      # tests/conftest.py: the session model service
    "reference_model",    # tests/model_service/conftest.py: transformers' fp32 model in this process
    "tiny_pool_service",  # tests/model_service/test_greedy_correctness.py: a 42-block model service
    "small_stub",         # tests/model_service/test_bad_input.py: a 16-block model service
    "pair",               # tests/model_service/test_failures.py: its own cache + model service
    "short_lease",        # tests/model_service/test_failures.py: its own cache + model service
})
# Fixtures that start model service processes of their own on the tiny model: `replica`.
REPLICA_FIXTURES = frozenset({
    "bf16_stub",           # tests/model_service/test_bfloat16.py
    "chunked_service",     # tests/model_service/test_scheduling_tiny.py
    "small_pool_service",  # tests/model_service/test_scheduling_tiny.py
    "services",            # tests/model_service/test_metrics.py, test_pipeline_tiny.py
    "replica",             # tests/model_service/test_replica_api.py
    "sampling_replica",    # tests/model_service/test_sampling_controls.py
    "parallel_replica",    # tests/model_service/test_parallel_sampling.py
    "parallel_small_pool",  # tests/model_service/test_parallel_sampling.py
    "scoring_replica",     # tests/model_service/test_prompt_logprobs.py
    "tool_template_replica",  # tests/model_service/test_chat_tool_turns.py
    "fleet",               # tests/router/conftest.py, tests/security/test_secure_fleet.py
    "door",                # tests/router/test_http_door.py
    "setup",               # tests/router/test_router_tenants.py, test_router_trust.py (security_setup.py)
    "servers",             # tests/security/test_metrics_host.py
    "replicas",            # tests/security/test_tenant_scoping.py
    "soak_services",       # tests/security/test_soak.py
    "pull_fleet",          # tests/model_service/test_kv_pulls.py
    "sharded_fleet",       # tests/router/test_sharded_fleet.py
})
# Fixtures of long load runs: a test using any of them is `soak`.
SOAK_FIXTURES = frozenset({
    "soak_services",      # tests/security/test_soak.py: 400 requests at concurrency 32
})
TIER_MARKERS = {"model": BUNDLED_MODEL_FIXTURES, "replica": REPLICA_FIXTURES, "soak": SOAK_FIXTURES}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Adds the `model` / `replica` / `soak` markers from the fixtures each test uses (see the module docstring)."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in TIER_MARKERS.items():
            if used & fixtures and item.get_closest_marker(marker) is None:
                item.add_marker(marker)


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
