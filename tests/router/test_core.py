"""Unit tests of the router's core (router/core.py, policy.py, replicas.py) with fake replicas and
a fake cache manager: no process, no gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from protos import cache_pb2, model_pb2
from router import errors
from router.core import CoreConfig, RouterCore
from router.errors import RouterError, UpstreamError
from router.policy import Rotation, kv_plan, least_loaded
from router.replicas import Load, Replica, ReplicaSet

A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
FINGERPRINT = "fp"


def message(text: str, ids: list[int], finish: int = 0, **usage) -> model_pb2.GenerateResponse:
    m = model_pb2.GenerateResponse(text=text, token_ids=ids, finish_reason=finish)
    if finish:
        m.usage.CopyFrom(model_pb2.Usage(**usage))
    return m


OK_STREAM = [message("a", [5]), message("b", [6], model_pb2.FINISH_REASON_LENGTH, prompt_tokens=3, completion_tokens=2)]


@dataclass
class FakeReplicas:
    """ReplicaPort: per address, a Generate script (a list of messages, optionally ending in an
    UpstreamError), health, load; records every call."""

    streams: dict[str, list] = field(default_factory=dict)
    healthy: dict[str, bool] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    calls: list[tuple[str, str, object]] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    tokenize_error: UpstreamError | None = None

    async def generate(self, addr: str, request, timeout) -> AsyncIterator[model_pb2.GenerateResponse]:
        self.calls.append(("Generate", addr, request))
        try:
            for item in self.streams.get(addr, OK_STREAM):
                if isinstance(item, UpstreamError):
                    raise item
                out = model_pb2.GenerateResponse()
                out.CopyFrom(item)
                out.request_id = request.request_id
                yield out
                await asyncio.sleep(0)
        finally:
            self.closed.append(addr)

    async def tokenize(self, addr, request, timeout):
        self.calls.append(("Tokenize", addr, request))
        if self.tokenize_error is not None:
            raise self.tokenize_error
        text = request.text if request.WhichOneof("input") == "text" else "".join(m.content for m in request.chat.messages)
        return model_pb2.TokenizeResponse(token_ids=[ord(c) for c in text])

    async def model_info(self, addr, timeout):
        self.calls.append(("ModelInfo", addr, None))
        return model_pb2.ModelInfoResponse(model_name="m", model_fingerprint=FINGERPRINT, pool_id=f"pool-{addr}",
                                           serving_addr=addr)

    async def abort(self, addr, request, timeout):
        self.calls.append(("Abort", addr, request))
        return model_pb2.AbortResponse()

    async def get_load(self, addr, timeout):
        if not self.healthy.get(addr, True):
            raise UpstreamError(errors.UNAVAILABLE, "down")
        return model_pb2.GetLoadResponse(num_running_requests=self.loads.get(addr, 0), num_blocks=10,
                                         num_free_blocks=4, prompt_tokens=10, cached_prompt_tokens=5)

    async def check(self, addr, timeout) -> bool:
        return self.healthy.get(addr, True)

    def generate_addrs(self) -> list[str]:
        return [addr for kind, addr, _ in self.calls if kind == "Generate"]


@dataclass
class FakeCache:
    candidates: list[cache_pb2.RouteCandidate] = field(default_factory=list)
    error: UpstreamError | None = None
    pools: list[cache_pb2.PoolStats] = field(default_factory=list)
    routes: list[cache_pb2.RouteRequest] = field(default_factory=list)

    async def route(self, request, timeout):
        self.routes.append(request)
        if self.error is not None:
            raise self.error
        return cache_pb2.RouteResponse(candidates=self.candidates)

    async def stats(self, timeout):
        if self.error is not None:
            raise self.error
        return cache_pb2.StatsResponse(pools=self.pools)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def candidate(addr: str, matched: int = 0, score: float = 0.0) -> cache_pb2.RouteCandidate:
    return cache_pb2.RouteCandidate(pool_id=f"pool-{addr}", serving_addr=addr, matched_tokens=matched, score=score)


def make_core(policy: str = "kv", replicas=(A, B), fakes: FakeReplicas | None = None,
              cache: FakeCache | None = None, clock: Clock | None = None) -> tuple[RouterCore, FakeReplicas, FakeCache]:
    fakes = fakes or FakeReplicas()
    cache = cache or FakeCache()
    clock = clock or Clock()
    core = RouterCore(CoreConfig(policy=policy, serving_addr="router:1"), ReplicaSet(replicas, clock=clock), fakes,
                      cache, clock=clock)
    return core, fakes, cache


def run(coro):
    return asyncio.run(coro)


async def collect(core: RouterCore, request: model_pb2.GenerateRequest) -> list[model_pb2.GenerateResponse]:
    return [m async for m in core.generate(request)]


def decisions(core: RouterCore, reason: str) -> float:
    return core.metrics.decisions.labels(reason)._value.get()


def prompt_request(text: str = "hello", request_id: str = "") -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(prompt=text, request_id=request_id, namespace="ns",
                                     sampling=model_pb2.SamplingParams(max_tokens=2, temperature=0))


# ---------------------------------------------------------------------- policies


def test_rotation_and_least_loaded_spread_equal_loads() -> None:
    replicas = [Replica(A), Replica(B), Replica(C)]
    rotation = Rotation()
    assert [rotation.order(replicas)[0] for _ in range(4)] == [A, B, C, A]
    replicas[0].load = Load(num_running_requests=3)
    replicas[2].inflight = 1
    assert least_loaded(replicas, Rotation()) == [B, C, A]
    # A stale sample below what this router has open there counts as the open streams.
    replicas[1].inflight = 5
    assert least_loaded(replicas, Rotation()) == [C, A, B]


def test_kv_plan_follows_route_ranking_and_moves_known_down_last() -> None:
    replicas = ReplicaSet([A, B, C])
    plan = kv_plan([candidate(B, matched=32), candidate(A)], replicas, others=[C, A])
    assert (plan.addrs, plan.reason) == ([B, A, C], "kv_hit")
    replicas.mark(B, False)
    plan = kv_plan([candidate(B, matched=32), candidate(A)], replicas)
    assert (plan.addrs, plan.reason) == ([A, B], "kv_load")
    assert kv_plan([], replicas).addrs == []


def test_replica_set_serves_one_model_and_forgets_stale_learnt_replicas() -> None:
    clock = Clock()
    replicas = ReplicaSet([A], forget_after_s=10, clock=clock)
    replicas.learn(B, pool_id="pb")
    replicas.learn(C)
    for addr in (A, B, C):
        replicas.mark(addr, True)
    replicas.set_info(A, object(), "fp-1")
    replicas.set_info(C, object(), "fp-2")
    assert replicas.fingerprint == "fp-1"
    assert [r.addr for r in replicas.live()] == [A, B]  # C serves another model, B's is unknown
    replicas.mark(A, False)
    replicas.mark(B, False)
    clock.now += 11
    assert replicas.forget_stale() == [B]  # static A stays; C is reachable
    assert A in replicas and B not in replicas


# ---------------------------------------------------------------------- routing


def test_kv_policy_routes_by_route_and_forwards_token_ids_and_id() -> None:
    cache = FakeCache(candidates=[candidate(B, matched=16), candidate(A)])
    core, fakes, cache = make_core(cache=cache)
    out = run(collect(core, prompt_request("hey", request_id="r1")))
    assert [m.text for m in out] == ["a", "b"]
    assert out[-1].usage.served_by == B
    assert all(m.request_id == "r1" for m in out)
    route = cache.routes[0]
    assert list(route.token_ids) == [ord(c) for c in "hey"]
    assert (route.namespace, route.request_id, route.reserve_ms) == ("ns", "r1", 2000)
    kind, addr, sent = fakes.calls[-1]
    assert (kind, addr) == ("Generate", B)
    assert sent.WhichOneof("input") == "token_ids" and list(sent.token_ids.ids) == list(route.token_ids)
    assert sent.request_id == "r1" and sent.namespace == "ns" and sent.sampling.max_tokens == 2
    assert decisions(core, "kv_hit") == 1


def test_a_request_without_id_gets_one_shared_by_route_and_replica() -> None:
    core, fakes, cache = make_core(cache=FakeCache(candidates=[candidate(A)]))
    out = run(collect(core, model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=[1, 2, 3]))))
    assert out[0].request_id and cache.routes[0].request_id == out[0].request_id
    assert [c[0] for c in fakes.calls] == ["Generate"]  # token ids: no Tokenize
    assert decisions(core, "kv_load") == 1


def test_cache_manager_down_falls_back_then_routing_resumes() -> None:
    clock = Clock()
    cache = FakeCache(error=UpstreamError(errors.UNAVAILABLE, "connection refused"))
    core, fakes, cache = make_core(cache=cache, clock=clock)
    run(collect(core, prompt_request()))
    run(collect(core, prompt_request()))
    assert decisions(core, "fallback_no_cache_manager") == 2
    assert len(cache.routes) == 1  # the second request did not wait on the dead cache manager
    assert core.cache_up is False
    assert sorted(fakes.generate_addrs()) == [A, B]  # round-robin without load samples
    cache.error = None
    cache.candidates = [candidate(A, matched=8)]
    run(core.refresh())  # the background check sees it back
    assert core.cache_up is True
    run(collect(core, prompt_request()))
    assert decisions(core, "kv_hit") == 1


def test_fallback_is_least_loaded_once_loads_are_known() -> None:
    fakes = FakeReplicas(loads={A: 4, B: 1})
    core, fakes, _ = make_core(fakes=fakes, cache=FakeCache(error=UpstreamError(errors.UNAVAILABLE, "down")))
    run(core.refresh())
    for _ in range(2):
        run(collect(core, prompt_request()))
    assert fakes.generate_addrs() == [B, B]


@pytest.mark.parametrize("policy, reason", [("round-robin", "round_robin"), ("least-loaded", "least_loaded")])
def test_other_policies_never_call_route(policy: str, reason: str) -> None:
    core, fakes, cache = make_core(policy)
    for _ in range(2):
        run(collect(core, prompt_request()))
    assert cache.routes == []
    assert sorted(fakes.generate_addrs()) == [A, B]
    assert decisions(core, reason) == 2


def test_route_without_candidates_is_least_loaded_over_known_replicas() -> None:
    core, fakes, _ = make_core(cache=FakeCache(candidates=[]))
    run(collect(core, prompt_request()))
    assert decisions(core, "least_loaded") == 1 and len(fakes.generate_addrs()) == 1


# ---------------------------------------------------------------------- retries


@pytest.mark.parametrize("code", [errors.UNAVAILABLE, errors.RESOURCE_EXHAUSTED])
def test_failure_before_the_first_message_is_retried_on_the_next_candidate(code: str) -> None:
    fakes = FakeReplicas(streams={A: [UpstreamError(code, "nope")]})
    core, fakes, _ = make_core(fakes=fakes, cache=FakeCache(candidates=[candidate(A), candidate(B)]))
    out = run(collect(core, prompt_request()))
    assert out[-1].usage.served_by == B
    assert fakes.generate_addrs() == [A, B]
    assert decisions(core, "retry") == 1
    # UNAVAILABLE marks the replica down until the next health check; a full queue does not.
    assert (core.replicas.get(A).reachable is False) == (code == errors.UNAVAILABLE)
    assert core.metrics.requests.labels(A, code)._value.get() == 1
    assert core.metrics.requests.labels(B, "OK")._value.get() == 1


def test_invalid_argument_passes_through_without_retry() -> None:
    fakes = FakeReplicas(streams={A: [UpstreamError(errors.INVALID_ARGUMENT, "token_ids contains 99999")]})
    core, fakes, _ = make_core(fakes=fakes, cache=FakeCache(candidates=[candidate(A), candidate(B)]))
    with pytest.raises(RouterError) as info:
        run(collect(core, prompt_request()))
    assert (info.value.code, info.value.message) == (errors.INVALID_ARGUMENT, "token_ids contains 99999")
    assert fakes.generate_addrs() == [A]
    assert decisions(core, "retry") == 0


def test_every_candidate_failing_reports_each() -> None:
    fakes = FakeReplicas(streams={A: [UpstreamError(errors.UNAVAILABLE, "refused")],
                                  B: [UpstreamError(errors.RESOURCE_EXHAUSTED, "waiting queue is full")]})
    core, _, _ = make_core(fakes=fakes, cache=FakeCache(candidates=[candidate(A), candidate(B)]))
    with pytest.raises(RouterError) as info:
        run(collect(core, prompt_request()))
    assert info.value.code == errors.RESOURCE_EXHAUSTED
    assert A in info.value.message and "queue is full" in info.value.message


def test_mid_stream_failure_ends_with_unavailable_never_replayed() -> None:
    fakes = FakeReplicas(streams={A: [message("x", [1]), UpstreamError(errors.UNAVAILABLE, "reset")]})
    core, fakes, _ = make_core(fakes=fakes, cache=FakeCache(candidates=[candidate(A), candidate(B)]))
    got: list[model_pb2.GenerateResponse] = []

    async def consume() -> None:
        async for m in core.generate(prompt_request()):
            got.append(m)

    with pytest.raises(RouterError) as info:
        run(consume())
    assert [m.text for m in got] == ["x"]
    assert info.value.code == errors.UNAVAILABLE and "partial output was sent" in info.value.message
    assert fakes.generate_addrs() == [A]


def test_stream_ending_without_its_last_message_is_a_mid_stream_failure() -> None:
    fakes = FakeReplicas(streams={A: [message("x", [1])]})
    core, _, _ = make_core("round-robin", replicas=(A,), fakes=fakes)
    with pytest.raises(RouterError, match="partial output"):
        run(collect(core, prompt_request()))


def test_tokenize_invalid_argument_is_the_answer() -> None:
    fakes = FakeReplicas(tokenize_error=UpstreamError(errors.INVALID_ARGUMENT, "prompt is empty"))
    core, fakes, _ = make_core(fakes=fakes)
    with pytest.raises(RouterError) as info:
        run(collect(core, prompt_request("")))
    assert info.value.code == errors.INVALID_ARGUMENT
    assert fakes.generate_addrs() == []


def test_no_live_replica_is_unavailable() -> None:
    fakes = FakeReplicas(healthy={A: False, B: False})
    core, _, _ = make_core(fakes=fakes)
    assert run(core.refresh()) is False
    with pytest.raises(RouterError) as info:
        run(collect(core, model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=[1]))))
    assert info.value.code == errors.UNAVAILABLE


def test_deadline_already_past_is_deadline_exceeded() -> None:
    clock = Clock()
    core, _, _ = make_core(clock=clock)

    async def go() -> None:
        async for _ in core.generate(prompt_request(), deadline=clock.now - 1):
            pass

    with pytest.raises(RouterError) as info:
        run(go())
    assert info.value.code == errors.DEADLINE_EXCEEDED


# ---------------------------------------------------------------------- in-flight map, unary calls


def test_abort_goes_to_the_replica_serving_the_id_and_is_not_found_after() -> None:
    core, fakes, _ = make_core(cache=FakeCache(candidates=[candidate(B)]))

    async def go() -> None:
        stream = core.generate(prompt_request(request_id="r9"))
        first = await anext(stream)
        assert first.text == "a" and core.inflight("r9") == B
        await core.abort("r9")
        await stream.aclose()  # the client goes away: the upstream stream is closed
        assert core.inflight("r9") is None and fakes.closed == [B]
        assert core.replicas.get(B).inflight == 0
        with pytest.raises(RouterError) as info:
            await core.abort("r9")
        assert info.value.code == errors.NOT_FOUND

    run(go())
    assert ("Abort", B) in [(k, a) for k, a, _ in fakes.calls]


def test_model_info_reports_the_router_and_get_load_sums() -> None:
    fakes = FakeReplicas(loads={A: 2, B: 3})
    core, _, _ = make_core(fakes=fakes)
    info = run(core.model_info())
    assert (info.serving_addr, info.pool_id, info.model_fingerprint) == ("router:1", "", FINGERPRINT)
    load = run(core.get_load())
    assert (load.num_running_requests, load.num_blocks, load.num_free_blocks) == (5, 20, 8)
    assert load.kv_usage == pytest.approx(0.6) and load.prefix_hit_rate == pytest.approx(0.5)
    assert load.serving_addr == "router:1"


def test_refresh_learns_replicas_from_stats_and_their_model() -> None:
    pools = [cache_pb2.PoolStats(pool_id="p3", serving_addr=C, model_fingerprint=FINGERPRINT,
                                 load=cache_pb2.ReplicaLoad(num_running_requests=2))]
    core, _, _ = make_core(replicas=(A,), cache=FakeCache(pools=pools))
    assert run(core.refresh()) is True
    replica = core.replicas.get(C)
    assert replica is not None and replica.reachable and replica.pool_id == "p3"
    assert replica.info is not None and core.replicas.fingerprint == FINGERPRINT
