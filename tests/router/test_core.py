"""Unit tests of the router's core (router/core.py, policy.py, replicas.py) with fake replicas and
a fake cache manager: no process, no gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from common.auth import Principal
from common.token_bytes import unpack_tokens
from protos import cache_pb2, model_pb2
from router import errors
from router.core import CoreConfig, RouterCore
from router.errors import RouterError, UpstreamError
from router.policy import Rotation, kv_plan, least_loaded
from router.replicas import Load, Replica, ReplicaSet
from router.trust import DEFAULT_ALLOW, ReplicaTrust

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
    max_context: int = 1 << 20

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
                                           serving_addr=addr, max_context_tokens=self.max_context)

    async def abort(self, addr, request, timeout):
        self.calls.append(("Abort", addr, request))
        return model_pb2.AbortResponse()

    async def get_load(self, addr, timeout):
        self.calls.append(("GetLoad", addr, None))
        if not self.healthy.get(addr, True):
            raise UpstreamError(errors.UNAVAILABLE, "down")
        return model_pb2.GetLoadResponse(num_running_requests=self.loads.get(addr, 0), num_blocks=10,
                                         num_free_blocks=4, prompt_tokens=10, cached_prompt_tokens=5)

    async def check(self, addr, timeout) -> bool:
        self.calls.append(("Check", addr, None))
        return self.healthy.get(addr, True)

    def generate_addrs(self) -> list[str]:
        return [addr for kind, addr, _ in self.calls if kind == "Generate"]

    def addrs_called(self) -> set[str]:
        return {addr for _, addr, _ in self.calls}


@dataclass
class FakeCache:
    candidates: list[cache_pb2.RouteCandidate] = field(default_factory=list)
    error: UpstreamError | None = None
    pools: list[cache_pb2.PoolStats] = field(default_factory=list)
    routes: list[cache_pb2.RouteRequest] = field(default_factory=list)
    gate: asyncio.Event | None = None  # Route waits for it when set

    async def route(self, request, timeout):
        self.routes.append(request)
        if self.gate is not None:
            await self.gate.wait()
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
              cache: FakeCache | None = None, clock: Clock | None = None, trust: ReplicaTrust | None = None,
              resolver=None) -> tuple[RouterCore, FakeReplicas, FakeCache]:
    fakes = fakes or FakeReplicas()
    cache = cache or FakeCache()
    clock = clock or Clock()
    trust = trust if trust is not None else ReplicaTrust(replicas)
    core = RouterCore(CoreConfig(policy=policy, serving_addr="router:1"),
                      ReplicaSet(replicas, clock=clock, trust=trust), fakes, cache, clock=clock, resolver=resolver)
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


def test_kv_plan_names_a_pull_when_the_best_candidate_pulls_the_prompt_from_another_replica() -> None:
    replicas = ReplicaSet([A, B])
    pulling = cache_pb2.RouteCandidate(pool_id="pool-b", serving_addr=B, matched_tokens=16, matched_peer_tokens=64,
                                       pull_from_worker_id="pool-a")
    plan = kv_plan([pulling, candidate(A, matched=80)], replicas)
    assert (plan.addrs, plan.reason) == ([B, A], "kv_pull")


def test_replica_set_serves_one_model_and_forgets_stale_learnt_replicas() -> None:
    clock = Clock()
    replicas = ReplicaSet([A], forget_after_s=10, clock=clock, trust=ReplicaTrust([A], allow=["10.0.0.0/24"]))
    assert replicas.learn("10.0.1.1:1") is None and "10.0.1.1:1" not in replicas  # not trusted: never held
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


def test_usage_split_by_tier_passes_through_unchanged() -> None:
    split = dict(prompt_tokens=40, cached_prompt_tokens=28, cached_device_tokens=16, cached_host_tokens=8,
                 cached_disk_tokens=4, completion_tokens=2)
    fakes = FakeReplicas(streams={A: [message("a", [5]), message("b", [6], model_pb2.FINISH_REASON_LENGTH, **split)]})
    core, fakes, _ = make_core(cache=FakeCache(candidates=[candidate(A)]), fakes=fakes)
    usage = run(collect(core, prompt_request("hey")))[-1].usage
    assert {name: getattr(usage, name) for name in split} == split and usage.served_by == A


def test_kv_policy_routes_by_route_and_forwards_token_ids_and_id() -> None:
    cache = FakeCache(candidates=[candidate(B, matched=16), candidate(A)])
    core, fakes, cache = make_core(cache=cache)
    out = run(collect(core, prompt_request("hey", request_id="r1")))
    assert [m.text for m in out] == ["a", "b"]
    assert out[-1].usage.served_by == B
    assert all(m.request_id == "r1" for m in out)  # the client's id, whatever the upstream one
    route = cache.routes[0]
    assert list(unpack_tokens(route.packed_token_ids)) == [ord(c) for c in "hey"] and not route.token_ids
    assert (route.namespace, route.reserve_ms) == ("ns", 2000)
    kind, addr, sent = fakes.calls[-1]
    assert (kind, addr) == ("Generate", B)
    assert sent.WhichOneof("input") == "token_ids" and list(sent.token_ids.ids) == list(unpack_tokens(route.packed_token_ids))
    # Upstream, a fresh id of the router's (shared by Route and the replica), never the client's.
    assert sent.request_id == route.request_id and sent.request_id != "r1" and len(sent.request_id) == 32
    assert sent.namespace == "ns" and sent.sampling.max_tokens == 2
    assert decisions(core, "kv_hit") == 1


def test_a_request_without_id_gets_one_shared_by_route_and_replica() -> None:
    core, fakes, cache = make_core(cache=FakeCache(candidates=[candidate(A)]))
    out = run(collect(core, model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=[1, 2, 3]))))
    sent = fakes.calls[-1][2]
    assert out[0].request_id and all(m.request_id == out[0].request_id for m in out)
    assert cache.routes[0].request_id == sent.request_id
    assert [c[0] for c in fakes.calls] == ["ModelInfo", "Generate"]  # token ids: no Tokenize
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
    core, _, _ = make_core(replicas=(A,), cache=FakeCache(pools=pools),
                           trust=ReplicaTrust([A], allow=["10.0.0.0/24"]))
    assert run(core.refresh()) is True
    replica = core.replicas.get(C)
    assert replica is not None and replica.reachable and replica.pool_id == "p3"
    assert replica.info is not None and core.replicas.fingerprint == FINGERPRINT


# ---------------------------------------------------------------------- trust (router/trust.py)


ROGUE = "10.6.6.6:1"


def test_trust_default_is_loopback_and_static_only() -> None:
    trust = ReplicaTrust(["10.0.0.1:1"])
    assert DEFAULT_ALLOW == ("127.0.0.0/8", "::1", "localhost")
    for addr in ("127.0.0.1:5", "127.9.9.9:5", "[::1]:5", "localhost:5", "LOCALHOST:5", "10.0.0.1:1"):
        assert trust.trusted(addr), addr
    for addr in ("10.0.0.1:2", "10.0.0.2:1", "evil.example:5", "localhost.evil.example:5", "[::2]:5",
                 "dns:///localhost:5", "dns://8.8.8.8/localhost:5", "unix:/tmp/sock", "ipv4:127.0.0.1:5",
                 "127.0.0.1", "127.0.0.1:", "127.0.0.1:99999", "localhost:5/x", "", ":5", "[127.0.0.1]:5"):
        assert not trust.trusted(addr), addr


def test_trust_allowlist_of_networks_and_name_globs() -> None:
    trust = ReplicaTrust(allow=["10.0.0.0/8", "fd00::/8", "*.model.ns.svc.cluster.local"])
    for addr in ("10.1.2.3:1", "[fd00::7]:1", "r-0.model.ns.svc.cluster.local:50052",
                 "R-0.Model.NS.svc.cluster.local:1"):
        assert trust.trusted(addr), addr
    # The allowlist replaces the loopback default; names never match networks, nor IPs globs.
    for addr in ("127.0.0.1:1", "localhost:1", "11.0.0.1:1", "model.ns.svc.cluster.local.evil.example:1",
                 "model.ns.svc.cluster.local:1", "[fe80::1]:1"):
        assert not trust.trusted(addr), addr
    for bad in ("10.0.0.0/33", "not a host", "", "http://x", "a..b", "*.model:80"):
        with pytest.raises(ValueError):
            ReplicaTrust(allow=[bad])
    for bad in ("no-port", "x:0", "[::1]", "dns:///x:1", "h:abc"):
        with pytest.raises(ValueError):
            ReplicaTrust(dns=[bad])


def test_untrusted_stats_and_route_addresses_are_never_called(caplog) -> None:
    pools = [cache_pb2.PoolStats(pool_id="rogue", serving_addr=ROGUE, model_fingerprint=FINGERPRINT,
                                 num_blocks=1 << 24)]
    cache = FakeCache(pools=pools, candidates=[candidate(ROGUE, matched=64), candidate(A)])
    core, fakes, cache = make_core(cache=cache)
    for _ in range(2):
        assert run(core.refresh()) is True
    assert ROGUE not in core.replicas
    out = run(collect(core, prompt_request(request_id="r1")))
    assert out[-1].usage.served_by == A
    assert ROGUE not in fakes.addrs_called()  # no health check, no ModelInfo, no Generate: no token sent
    assert ROGUE not in core.replicas and decisions(core, "kv_load") == 1  # dropped from the plan
    assert core.metrics.untrusted_addrs.labels("stats")._value.get() == 2
    assert core.metrics.untrusted_addrs.labels("route")._value.get() == 1
    assert sum(ROGUE in r.getMessage() for r in caplog.records) == 1  # logged once per address


def test_route_offering_only_untrusted_addresses_falls_back_to_the_trusted_replicas() -> None:
    core, fakes, _ = make_core(cache=FakeCache(candidates=[candidate(ROGUE, matched=64)]))
    out = run(collect(core, prompt_request()))
    assert out[-1].usage.served_by in (A, B) and ROGUE not in fakes.addrs_called()


def test_dns_names_are_resolved_in_the_background_and_every_address_is_trusted() -> None:
    answers: dict[tuple[str, int], list[str] | Exception] = {("model.svc", 7): ["10.9.0.5:7", "10.9.0.6:7"]}

    async def resolver(host: str, port: int) -> list[str]:
        answer = answers[(host, port)]
        if isinstance(answer, Exception):
            raise answer
        return answer

    trust = ReplicaTrust(dns=["model.svc:7"])
    pools = [cache_pb2.PoolStats(pool_id="p5", serving_addr="10.9.0.5:7", model_fingerprint=FINGERPRINT)]
    core, fakes, _ = make_core(replicas=(), cache=FakeCache(pools=pools), trust=trust, resolver=resolver)
    assert run(core.refresh()) is True
    assert {r.addr for r in core.replicas.all()} == {"10.9.0.5:7", "10.9.0.6:7"}
    assert core.replicas.get("10.9.0.5:7").pool_id == "p5"
    # With TLS the certificate is checked against the name the address came from.
    assert trust.tls_name("10.9.0.6:7") == "model.svc" and trust.tls_name(A) is None
    answers[("model.svc", 7)] = OSError("temporary failure in name resolution")
    run(core.refresh())  # a failed lookup keeps what the name resolved to
    assert {r.addr for r in core.replicas.all()} == {"10.9.0.5:7", "10.9.0.6:7"}
    answers[("model.svc", 7)] = ["10.9.0.6:7"]
    run(core.refresh())  # 10.9.0.5 left the name: no longer trusted, dropped, never called again
    assert {r.addr for r in core.replicas.all()} == {"10.9.0.6:7"}
    assert not trust.trusted("10.9.0.5:7")
    fakes.calls.clear()
    run(core.refresh())
    assert fakes.addrs_called() == {"10.9.0.6:7"}


# ---------------------------------------------------------------------- request ids per principal


ALICE = Principal("tokens:1", frozenset({"client"}), key="alice-key")
BOB = Principal("tokens:2", frozenset({"client"}), key="bob-key")


def test_request_ids_are_per_principal_and_a_duplicate_leaves_the_first_alone() -> None:
    core, fakes, cache = make_core(cache=FakeCache(candidates=[candidate(B)]))

    async def go() -> None:
        first = core.generate(prompt_request(request_id="r1"), principal=ALICE)
        assert (await anext(first)).request_id == "r1"
        calls, routes = len(fakes.calls), len(cache.routes)
        with pytest.raises(RouterError) as info:
            await anext(core.generate(prompt_request(request_id="r1"), principal=ALICE))
        assert info.value.code == errors.ALREADY_EXISTS and "'r1'" in info.value.message
        assert (len(fakes.calls), len(cache.routes)) == (calls, routes)  # refused before anything else
        assert core.inflight("r1", ALICE.key) == B
        # Another principal's id is as if it did not exist: Abort is NOT_FOUND, reuse is fine.
        with pytest.raises(RouterError) as info:
            await core.abort("r1", principal=BOB)
        assert info.value.code == errors.NOT_FOUND
        assert core.inflight("r1") is None  # nor is it the anonymous caller's
        second = core.generate(prompt_request(request_id="r1"), principal=BOB)
        assert (await anext(second)).request_id == "r1"
        sent = [request for kind, _, request in fakes.calls if kind == "Generate"]
        assert len(sent) == 2 and sent[0].request_id != sent[1].request_id
        await core.abort("r1", principal=ALICE)
        aborts = [request for kind, _, request in fakes.calls if kind == "Abort"]
        assert [a.request_id for a in aborts] == [sent[0].request_id]  # Alice's upstream id only
        await first.aclose()
        assert core.inflight("r1", ALICE.key) is None and core.inflight("r1", BOB.key) == B
        await second.aclose()

    run(go())


def test_abort_while_routing_ends_the_request_without_calling_a_replica() -> None:
    cache = FakeCache(candidates=[candidate(A)], gate=asyncio.Event())
    core, fakes, cache = make_core(cache=cache)

    async def go() -> list[model_pb2.GenerateResponse]:
        stream = core.generate(prompt_request(request_id="r2"), principal=ALICE)
        pending = asyncio.ensure_future(anext(stream))
        while not cache.routes:
            await asyncio.sleep(0)
        await core.abort("r2", principal=ALICE)
        cache.gate.set()
        out = [await pending] + [m async for m in stream]
        return out

    out = run(go())
    assert [m.finish_reason for m in out] == [model_pb2.FINISH_REASON_ABORT]
    assert out[0].request_id == "r2" and fakes.generate_addrs() == []


def test_abort_while_routing_ends_every_choice() -> None:
    cache = FakeCache(candidates=[candidate(A)], gate=asyncio.Event())
    core, fakes, cache = make_core(cache=cache)
    request = prompt_request(request_id="r3")
    request.sampling.n = 3

    async def go() -> list[model_pb2.GenerateResponse]:
        stream = core.generate(request, principal=ALICE)
        pending = asyncio.ensure_future(anext(stream))
        while not cache.routes:
            await asyncio.sleep(0)
        await core.abort("r3", principal=ALICE)
        cache.gate.set()
        return [await pending] + [m async for m in stream]

    out = run(go())
    assert [(m.index, m.finish_reason) for m in out] == [(i, model_pb2.FINISH_REASON_ABORT) for i in range(3)]


def test_a_namespace_limited_principal_generates_only_in_its_namespaces() -> None:
    core, fakes, cache = make_core(cache=FakeCache(candidates=[candidate(A)]))
    tenant = Principal("tokens:3", frozenset({"client"}), frozenset({"tenant-a"}), key="tenant-key")
    request = prompt_request()
    request.namespace = "tenant-b"
    with pytest.raises(RouterError) as info:
        run(_collect_as(core, request, tenant))
    assert info.value.code == errors.PERMISSION_DENIED and "'tenant-b'" in info.value.message
    assert fakes.calls == [] and cache.routes == []
    request.namespace = "tenant-a"
    assert run(_collect_as(core, request, tenant))[-1].usage.served_by == A


async def _collect_as(core: RouterCore, request, principal) -> list[model_pb2.GenerateResponse]:
    return [m async for m in core.generate(request, principal=principal)]


# ---------------------------------------------------------------------- the model's context first


@pytest.mark.parametrize("num_prompt, max_tokens, message", [
    (100, None, "prompt has 100 tokens; the model's context is 100 tokens"),
    (4_000_000, None, "prompt has 4000000 tokens; the model's context is 100 tokens"),
    (90, 11, "prompt (90 tokens) + max_tokens (11) exceeds the model's context of 100 tokens"),
])
def test_a_prompt_over_the_context_is_refused_before_route(num_prompt: int, max_tokens: int | None,
                                                            message: str) -> None:
    core, fakes, cache = make_core(fakes=FakeReplicas(max_context=100), cache=FakeCache(candidates=[candidate(A)]))
    request = model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=[1] * num_prompt))
    if max_tokens is not None:
        request.sampling.max_tokens = max_tokens
    with pytest.raises(RouterError) as info:
        run(collect(core, request))
    assert (info.value.code, info.value.message) == (errors.INVALID_ARGUMENT, message)
    assert cache.routes == [] and fakes.generate_addrs() == []
    request = model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=[1] * 90),
                                        sampling=model_pb2.SamplingParams(max_tokens=10))
    assert run(collect(core, request))[-1].usage.served_by == A  # exactly the context is fine
