"""The router scopes request ids, Abort and namespaces to the caller's token, and checks the
model's context before the cache manager's Route, with real processes on loopback (a cache
manager, one tiny-Llama replica, a router with client tokens; tests/router/security_setup.py).

- A duplicate live id of the same token is refused without touching the first request; another
  token's id behaves as if it did not exist (Abort: NOT_FOUND; reuse: its own request).
- A prompt over the model's context (4M tokens through the HTTP door) is a 400 / INVALID_ARGUMENT
  before Route: no phantom queued load at the cache manager, no replica call.
- A namespace-limited client token (ns=) generates only in its namespaces (403 over HTTP).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from protos import model_pb2
from tests.router.security_setup import (
    Running,
    Setup,
    code,
    greedy,
    md,
    metric,
    post,
    route_candidates,
    router_with_tokens,
    run_setup,
)

pytestmark = pytest.mark.timeout(180)

LONG = 1000  # tokens: a generation still running while a test aborts it (context: 1024)


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory) -> Iterator[Setup]:
    yield from run_setup(tiny_model, tmp_path_factory)


@pytest.fixture(scope="module")
def tenants(setup: Setup) -> Iterator[Running]:
    """A router with client tokens in front of the real replica (flags every version has)."""
    router = router_with_tokens(setup, "--replica", setup.replica.addr)
    try:
        yield router
    finally:
        router.process.stop(10.0)


# ---------------------------------------------------------------------- request ids and Abort


def _long(stub, request_id: str, token: str):
    return stub.Generate(model_pb2.GenerateRequest(prompt="Count to a thousand:", request_id=request_id,
                                                   sampling=greedy(LONG - 16, ignore_eos=True)),
                         metadata=md(token), timeout=120)




def _abort(stub, request_id: str, token: str) -> grpc.StatusCode:
    return code(lambda: stub.Abort(model_pb2.AbortRequest(request_id=request_id), metadata=md(token), timeout=10))


def test_request_ids_and_abort_are_per_token(setup: Setup, tenants: Running) -> None:
    router = setup.model_stub(tenants.addr)
    streams = []
    try:
        alice = _long(router, "shared-id", "alice-tok")
        streams.append(alice)
        first = next(alice)
        assert first.request_id == "shared-id"
        # Alice's own duplicate is refused and leaves her request alone; Bob cannot abort it.
        assert code(lambda: list(_long(router, "shared-id", "alice-tok"))) == grpc.StatusCode.ALREADY_EXISTS
        assert _abort(router, "shared-id", "bob-tok") == grpc.StatusCode.NOT_FOUND
        assert _abort(router, "shared-id", "alice-tok") == grpc.StatusCode.OK
        rest = list(alice)
        assert rest[-1].finish_reason == model_pb2.FINISH_REASON_ABORT and rest[-1].request_id == "shared-id"
        assert len([t for m in [first, *rest] for t in m.token_ids]) < LONG - 16
        assert _abort(router, "shared-id", "alice-tok") == grpc.StatusCode.NOT_FOUND  # it is over
        # The same id live for both at once: two requests; Bob's Abort ends his only.
        alice, bob = _long(router, "shared-id", "alice-tok"), _long(router, "shared-id", "bob-tok")
        streams += [alice, bob]
        assert next(alice).request_id == next(bob).request_id == "shared-id"
        assert _abort(router, "shared-id", "bob-tok") == grpc.StatusCode.OK
        assert list(bob)[-1].finish_reason == model_pb2.FINISH_REASON_ABORT
        assert list(alice)[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH  # never aborted
    finally:  # a failed check leaves no generation running for the next tests
        for stream in streams:
            stream.cancel()


# ---------------------------------------------------------------------- namespaces




def test_a_namespace_limited_token_generates_only_in_its_namespaces(setup: Setup, tenants: Running) -> None:
    router = setup.model_stub(tenants.addr)

    def generate(namespace: str) -> grpc.StatusCode:
        return code(lambda: list(router.Generate(model_pb2.GenerateRequest(
            token_ids=model_pb2.TokenIds(ids=[5, 6, 7]), namespace=namespace, sampling=greedy(2)),
            metadata=md("tenant-tok"), timeout=60)))

    assert generate("tenant-b") == grpc.StatusCode.PERMISSION_DENIED
    assert generate("") == grpc.StatusCode.PERMISSION_DENIED
    assert generate("tenant-a") == grpc.StatusCode.OK
    body = {"model": setup.info.model_name, "prompt": [5, 6, 7], "max_tokens": 2}
    status, answer = post(tenants, "/v1/completions", {**body, "cache_salt": "tenant-b"}, "tenant-tok")
    assert status == 403 and "tenant-b" in answer["error"]["message"]
    assert post(tenants, "/v1/completions", {**body, "cache_salt": "tenant-a"}, "tenant-tok")[0] == 200


# ---------------------------------------------------------------------- the model's context before Route


def _max_routed_tokens(setup: Setup) -> int:
    return max(c.routed_tokens for c in route_candidates(setup, [5, 6, 7] * 8))


def _decisions(router: Running) -> float:
    return sum(metric(router, "radixkv_router_route_decisions_total", reason=reason)
               for reason in ("kv_hit", "kv_load", "least_loaded", "fallback_no_cache_manager", "retry"))


def test_a_prompt_over_the_context_never_reaches_route(setup: Setup, tenants: Running) -> None:
    context = setup.info.max_context_tokens
    huge = [5] * 4_000_000
    decisions = _decisions(tenants)
    status, answer = post(tenants, "/v1/completions", {"model": setup.info.model_name, "prompt": huge,
                                                        "max_tokens": 1}, "alice-tok")
    assert status in (400, 413), answer  # 413: the HTTP door's own body limit, sooner still
    if status == 400:
        assert answer["error"]["message"] == f"prompt has {len(huge)} tokens; the model's context is {context} tokens"
    router = setup.model_stub(tenants.addr)
    direct = setup.model_stub(setup.replica.addr)
    for ids, max_tokens in ((huge, 1), ([5] * context, 1), ([5] * (context - 10), 11)):
        request = model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=ids), sampling=greedy(max_tokens))
        with pytest.raises(grpc.RpcError) as via_router:
            list(router.Generate(request, metadata=md("alice-tok"), timeout=60))
        with pytest.raises(grpc.RpcError) as at_replica:
            list(direct.Generate(request, timeout=60))
        assert via_router.value.code() == at_replica.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert via_router.value.details() == at_replica.value.details()
    # Neither Route nor a replica saw any of them: no phantom queued load, no routing decision.
    assert _max_routed_tokens(setup) < context
    assert _decisions(tenants) == decisions
    assert metric(tenants, "radixkv_router_requests_total", replica=setup.replica.addr, code="INVALID_ARGUMENT") == 0
