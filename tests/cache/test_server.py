"""Integration tests against the real server process over a real gRPC channel."""

from __future__ import annotations

import itertools
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import cache_pb2 as pb
from tests.cache.conftest import REPO, assert_accounting, register

ADMITTED, NO_SPACE = pb.ADMIT_STATUS_ADMITTED, pb.ADMIT_STATUS_NO_SPACE
_ids = itertools.count()


def worker(name: str) -> str:
    """A worker id unique within the shared server."""
    return f"{name}-{next(_ids)}"


def step(stub, reg, **items) -> pb.StepResponse:
    return stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, **items), timeout=5)


def admit(rid: str, tokens, namespace: str = "", lookahead: int = 0) -> pb.Admit:
    return pb.Admit(request_id=rid, token_ids=list(tokens), namespace=namespace, num_lookahead_tokens=lookahead)


def fin(rid: str, computed: int, output=(), table=()) -> pb.Finish:
    return pb.Finish(request_id=rid, output_token_ids=list(output), num_computed_tokens=computed, block_table=list(table))


def packed(tokens) -> bytes:
    """Admit.packed_token_ids of `tokens`, as the proto documents it (4 bytes little-endian each)."""
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def test_health_serving(server) -> None:
    health = health_pb2_grpc.HealthStub(server.channel)
    for name in ("", "radixkv.v1.CacheManager"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_service(server) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"radixkv.v1.CacheManager", "grpc.health.v1.Health"} <= names


def test_three_requests_sharing_a_prefix(server) -> None:
    stub = server.stub
    reg = register(stub, worker("share"), num_blocks=32, block_size=4)
    system = list(range(100, 112))  # a 3-page shared "system prompt"
    first = step(stub, reg, admits=[admit("r1", system + [1, 2])]).admits[0]
    assert first.status == ADMITTED and first.cached_tokens == 0
    step(stub, reg, finishes=[fin("r1", 14)])
    second, third = step(stub, reg, admits=[admit("r2", system + [5, 6, 7]), admit("r3", system + [8])]).admits
    assert second.cached_tokens == 12 and third.cached_tokens == 12
    assert second.block_table[:3] == third.block_table[:3] == first.block_table[:3]
    stats = assert_accounting(stub, reg.pool_id)
    assert stats.hit_tokens == 24 and stats.num_locked_blocks == 3 and stats.num_running_requests == 2
    assert stats.hit_rate == pytest.approx(24 / (14 + 15 + 13))


def test_a_running_request_commits_its_prompt_for_others(server) -> None:
    stub = server.stub
    reg = register(stub, worker("commit"), num_blocks=32, block_size=4)
    system = list(range(100, 112))
    first = step(stub, reg, admits=[admit("r1", system + [1, 2], lookahead=1)]).admits[0]
    reply = step(stub, reg, commits=[pb.Commit(request_id="r1", num_computed_tokens=14)],
                 admits=[admit("r2", system + [5])])
    assert reply.commits[0].cached_tokens == 12
    assert list(reply.commits[0].cached_block_ids) == list(first.block_table[:3])
    assert reply.admits[0].cached_tokens == 12  # r1 is still running
    stats = assert_accounting(stub, reg.pool_id)
    assert stats.num_locked_blocks == 3 and stats.num_running_requests == 2


def test_eviction_under_pressure(server) -> None:
    stub = server.stub
    reg = register(stub, worker("evict"), num_blocks=8, block_size=4)
    for i in range(3):  # three cached 2-page prefixes fill 6 of 8 blocks
        step(stub, reg, admits=[admit(f"old{i}", [i * 10 + j for j in range(9)])])
        step(stub, reg, finishes=[fin(f"old{i}", 9)])
    assert assert_accounting(stub, reg.pool_id).num_cached_blocks == 6
    reply = step(stub, reg, admits=[admit("big", range(500, 520))])  # 5 blocks: 2 free + 3 evicted
    assert reply.admits[0].status == ADMITTED and reply.num_evicted_blocks == 3 and reply.num_free_blocks == 0
    stats = assert_accounting(stub, reg.pool_id)
    assert stats.num_evicted_blocks == 3 and stats.num_cached_blocks == 3
    # Least recently used went first: old0 entirely, then the tail page of old1.
    matches = stub.Match(pb.MatchRequest(pool_id=reg.pool_id, token_ids=list(range(8))), timeout=5).matches
    assert matches[0].matched_tokens == 0
    matches = stub.Match(pb.MatchRequest(pool_id=reg.pool_id, token_ids=[20 + j for j in range(8)]), timeout=5)
    assert matches.matches[0].matched_tokens == 8
    # Now nothing fits that needs more than the 3 evictable blocks: FCFS NO_SPACE for the rest.
    reply = step(stub, reg, admits=[admit("huge", range(600, 616)), admit("tiny", [1])])
    assert [a.status for a in reply.admits] == [NO_SPACE, NO_SPACE] and reply.num_evicted_blocks == 0
    reply = step(stub, reg, extends=[pb.Extend(request_id="big", num_tokens=32)])
    assert reply.extends[0].ok and len(reply.extends[0].new_block_ids) == 3
    assert_accounting(stub, reg.pool_id)


def test_match_is_read_only_and_ranks_pools(server) -> None:
    stub = server.stub
    fingerprint = worker("model")
    a = register(stub, worker("ma"), fingerprint=fingerprint)
    b = register(stub, worker("mb"), fingerprint=fingerprint)
    register(stub, worker("other"), fingerprint="other-model")
    for reg, length in ((a, 9), (b, 17)):
        step(stub, reg, admits=[admit("r", range(length))])
        step(stub, reg, finishes=[fin("r", length)])
    before = stub.Stats(pb.StatsRequest(pool_id=b.pool_id), timeout=5).pools[0]
    reply = stub.Match(pb.MatchRequest(token_ids=list(range(20)), model_fingerprint=fingerprint), timeout=5)
    assert [(m.pool_id, m.matched_tokens) for m in reply.matches] == [(b.pool_id, 16), (a.pool_id, 8)]
    after = stub.Stats(pb.StatsRequest(pool_id=b.pool_id), timeout=5).pools[0]
    assert after.num_locked_blocks == before.num_locked_blocks == 0
    assert after.queried_tokens == before.queried_tokens


def test_route_ranks_live_replicas_with_load_reservation_and_miss_reasons(server) -> None:
    stub = server.stub
    fingerprint = worker("route-model")
    a = register(stub, worker("ra"), fingerprint=fingerprint, serving_addr="127.0.0.1:7001")
    b = register(stub, worker("rb"), fingerprint=fingerprint, serving_addr="127.0.0.1:7002")
    prefix = list(range(200, 216))
    step(stub, b, admits=[admit("seed", prefix + [1])])
    step(stub, b, finishes=[fin("seed", 17)], load=pb.ReplicaLoad(num_waiting_requests=1, num_waiting_tokens=3))
    reply = stub.Route(pb.RouteRequest(token_ids=prefix + [5], model_fingerprint=fingerprint,
                                       request_id="q", reserve_ms=5000), timeout=5)
    best, second = reply.candidates
    assert (best.pool_id, best.serving_addr, best.matched_tokens, best.prefill_tokens) == (
        b.pool_id, "127.0.0.1:7002", 16, 1)
    assert best.reserved and best.load.num_waiting_tokens == 3 and best.score == 2 * 1 + 3
    assert second.pool_id == a.pool_id and second.prefill_tokens == 17 and not second.reserved
    (stats,) = stub.Stats(pb.StatsRequest(pool_id=b.pool_id), timeout=5).pools
    assert stats.serving_addr == "127.0.0.1:7002" and stats.num_reservations == 1 and stats.num_locked_blocks == 4
    (adm,) = step(stub, b, admits=[admit("q", prefix + [5])]).admits
    assert adm.cached_tokens == 16 and adm.miss.new_tokens == 1
    (other,) = step(stub, a, admits=[admit("q2", prefix + [5, 6])]).admits
    assert (other.miss.other_replica_tokens, other.miss.new_tokens) == (16, 2)
    stub.Heartbeat(pb.HeartbeatRequest(pool_id=a.pool_id, epoch=a.epoch,
                                       load=pb.ReplicaLoad(num_running_requests=1)), timeout=5)
    step(stub, b, finishes=[fin("q", 17)])
    step(stub, a, finishes=[fin("q2", 18)])
    assert assert_accounting(stub, b.pool_id).num_locked_blocks == 0
    (stats,) = stub.Stats(pb.StatsRequest(pool_id=a.pool_id), timeout=5).pools
    assert stats.load.num_running_requests == 1 and stats.num_reservations == 0
    with pytest.raises(grpc.RpcError) as err:
        stub.Route(pb.RouteRequest(model_fingerprint=fingerprint), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _next_events(call, n: int) -> list[pb.CacheEvent]:
    return [next(call) for _ in range(n)]


def test_watch_events_replay_live_and_snapshot(server) -> None:
    stub = server.stub
    reg = register(stub, worker("watch"), num_blocks=16, block_size=4)
    step(stub, reg, admits=[admit("a", range(9))])
    step(stub, reg, finishes=[fin("a", 9)])
    call = stub.WatchEvents(pb.WatchEventsRequest(pool_id=reg.pool_id, start_sequence=1), timeout=20)
    try:
        (stored,) = _next_events(call, 1)  # replayed; the watcher is subscribed from here on
        assert stored.WhichOneof("event") == "stored" and not stored.is_snapshot
        assert list(stored.stored.token_ids) == list(range(8)) and stored.stored.parent_block_hash == 0
        assert stub.Evict(pb.EvictRequest(pool_id=reg.pool_id, epoch=reg.epoch, num_blocks=1), timeout=5).num_evicted_blocks == 1
        step(stub, reg, admits=[admit("b", range(9))])
        step(stub, reg, finishes=[fin("b", 9, output=[9, 10, 11, 12], table=())])
        stub.Clear(pb.ClearRequest(pool_id=reg.pool_id, epoch=reg.epoch), timeout=5)
        removed, stored2, cleared = _next_events(call, 3)
    finally:
        call.cancel()
    assert removed.WhichOneof("event") == "removed"
    assert list(removed.removed.block_hashes) == [stored.stored.block_hashes[1]]
    assert stored2.WhichOneof("event") == "stored"
    assert stored2.stored.parent_block_hash == stored.stored.block_hashes[0]
    assert list(stored2.stored.block_hashes)[0] == stored.stored.block_hashes[1]  # same prefix, same hash
    # A Clear that empties the tree still says which pages left, per namespace (AllCleared: the
    # pool itself went): here both pages of the prompt, cached again.
    assert cleared.WhichOneof("event") == "removed"
    assert sorted(cleared.removed.block_hashes) == sorted(stored.stored.block_hashes)
    sequences = [e.sequence for e in (stored, removed, stored2, cleared)]
    assert sequences == sorted(set(sequences))
    assert all(e.pool_id == reg.pool_id for e in (stored, removed, stored2, cleared))

    # Snapshot: a new watcher learns the current tree, then live events follow.
    step(stub, reg, admits=[admit("c", range(13))])
    step(stub, reg, finishes=[fin("c", 13)])
    other = register(stub, worker("watch-twin"), num_blocks=16, block_size=4)
    step(stub, other, admits=[admit("c", range(13))])
    step(stub, other, finishes=[fin("c", 13)])
    hashes = {}
    for reg_ in (reg, other):
        call = stub.WatchEvents(pb.WatchEventsRequest(pool_id=reg_.pool_id, snapshot=True), timeout=20)
        try:
            (snap,) = _next_events(call, 1)
            step(stub, reg_, admits=[admit("d", [7] * 5)])
            step(stub, reg_, finishes=[fin("d", 5)])
            (live,) = _next_events(call, 1)
        finally:
            call.cancel()
        assert snap.is_snapshot and snap.WhichOneof("event") == "stored"
        assert list(snap.stored.token_ids) == list(range(12)) and snap.stored.parent_block_hash == 0
        assert not live.is_snapshot and live.sequence > snap.sequence
        hashes[reg_.pool_id] = list(snap.stored.block_hashes)
    assert hashes[reg.pool_id] == hashes[other.pool_id]  # equal prefixes hash equally across pools


@pytest.mark.parametrize(
    "request_,code",
    [
        (pb.WatchEventsRequest(start_sequence=10**12), grpc.StatusCode.OUT_OF_RANGE),
        (pb.WatchEventsRequest(snapshot=True, start_sequence=1), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.WatchEventsRequest(pool_id="no-such-pool"), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_watch_events_errors(server, request_, code) -> None:
    call = server.stub.WatchEvents(request_, timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == code


# ---------------------------------------------------------------------- bad input


def _bad_pool(stub):
    reg = register(stub, worker("bad"), num_blocks=8, block_size=4, vocab_size=100)
    step(stub, reg, admits=[admit("done", range(6))])
    step(stub, reg, finishes=[fin("done", 6)])
    live = step(stub, reg, admits=[admit("live", range(10))]).admits[0]
    return reg, list(live.block_table)


def _register(**fields):
    return lambda stub, reg, table: stub.RegisterPool(pb.RegisterPoolRequest(**fields), timeout=5)


def _step(**items):
    return lambda stub, reg, table: step(stub, reg, **items)


BAD_CALLS = {
    "register empty worker_id": (_register(worker_id="", num_blocks=8, block_size=4), "INVALID_ARGUMENT"),
    "register zero blocks": (_register(worker_id="z", num_blocks=0, block_size=4), "INVALID_ARGUMENT"),
    "register zero block_size": (_register(worker_id="z", num_blocks=8, block_size=0), "INVALID_ARGUMENT"),
    "empty token list": (_step(admits=[admit("x", [])]), "INVALID_ARGUMENT"),
    "both prompt forms": (_step(admits=[pb.Admit(request_id="x", token_ids=[1, 2], packed_token_ids=packed([1, 2]))]),
                          "INVALID_ARGUMENT"),
    "packed prompt of partial ids": (_step(admits=[pb.Admit(request_id="x", packed_token_ids=packed([1, 2])[:-1])]),
                                     "INVALID_ARGUMENT"),
    "packed token id out of vocab": (_step(admits=[pb.Admit(request_id="x", packed_token_ids=packed([1, 100]))]),
                                     "INVALID_ARGUMENT"),
    "token id out of vocab": (_step(admits=[admit("x", [1, 100])]), "INVALID_ARGUMENT"),
    "duplicate ids in a step": (_step(admits=[admit("x", [1]), admit("x", [2])]), "INVALID_ARGUMENT"),
    "admit of a live id": (_step(admits=[admit("live", [1])]), "INVALID_ARGUMENT"),
    "computed beyond tokens": (_step(finishes=[fin("live", 11)]), "INVALID_ARGUMENT"),
    "commit beyond admitted tokens": (_step(commits=[pb.Commit(request_id="live", num_computed_tokens=11)]),
                                      "INVALID_ARGUMENT"),
    "commit of a finished request": (_step(commits=[pb.Commit(request_id="done", num_computed_tokens=4)]),
                                     "FAILED_PRECONDITION"),
    "unknown request": (_step(finishes=[fin("ghost", 0)]), "NOT_FOUND"),
    "extend unknown request": (_step(extends=[pb.Extend(request_id="ghost", num_tokens=4)]), "NOT_FOUND"),
    "finishing twice": (_step(finishes=[fin("done", 6)]), "FAILED_PRECONDITION"),
    "foreign block ids": (lambda stub, reg, table: step(stub, reg, finishes=[fin("live", 10, table=[7, 6, 5])]),
                          "FAILED_PRECONDITION"),
    "request larger than the pool": (_step(admits=[admit("x", [1] * 33)]), "RESOURCE_EXHAUSTED"),
    "unknown pool": (lambda stub, reg, table: stub.Step(pb.StepRequest(pool_id="nobody", epoch=1), timeout=5),
                     "NOT_FOUND"),
    "stale epoch": (lambda stub, reg, table: stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch - 1),
                                                       timeout=5), "FAILED_PRECONDITION"),
    "stale epoch evict": (lambda stub, reg, table: stub.Evict(pb.EvictRequest(pool_id=reg.pool_id, epoch=1),
                                                              timeout=5), "FAILED_PRECONDITION"),
    "stale epoch clear": (lambda stub, reg, table: stub.Clear(pb.ClearRequest(pool_id=reg.pool_id, epoch=1),
                                                              timeout=5), "FAILED_PRECONDITION"),
    "heartbeat unknown pool": (lambda stub, reg, table: stub.Heartbeat(pb.HeartbeatRequest(pool_id="nobody"),
                                                                       timeout=5), "NOT_FOUND"),
    "stats unknown pool": (lambda stub, reg, table: stub.Stats(pb.StatsRequest(pool_id="nobody"), timeout=5),
                           "NOT_FOUND"),
    "match empty tokens": (lambda stub, reg, table: stub.Match(pb.MatchRequest(pool_id=reg.pool_id), timeout=5),
                           "INVALID_ARGUMENT"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_gets_its_status_and_changes_nothing(server, name) -> None:
    stub = server.stub
    reg, table = _bad_pool(stub)
    before = assert_accounting(stub, reg.pool_id)
    call, code = BAD_CALLS[name]
    with pytest.raises(grpc.RpcError) as info:
        call(stub, reg, table)
    assert info.value.code() == getattr(grpc.StatusCode, code)
    assert info.value.details()  # a clear message, every time
    after = assert_accounting(stub, reg.pool_id)
    assert after.num_free_blocks == before.num_free_blocks
    assert after.num_running_requests == before.num_running_requests == 1
    assert after.num_admitted == before.num_admitted


@pytest.mark.parametrize(("admit_", "says"), [
    (pb.Admit(request_id="x", token_ids=[1, 2], packed_token_ids=packed([1, 2])), "not both"),
    (pb.Admit(request_id="x", packed_token_ids=bytes(7)), "7 bytes is not a whole number of 4-byte token ids"),
])
def test_bad_packed_prompt_says_what_is_wrong(server, admit_, says) -> None:
    reg = register(server.stub, worker("packed-bad"), num_blocks=8, block_size=4)
    with pytest.raises(grpc.RpcError) as info:
        step(server.stub, reg, admits=[admit_])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "packed_token_ids" in info.value.details() and says in info.value.details()


def test_packed_prompts_behave_exactly_as_token_ids(server) -> None:
    """Two pools get the same traffic, one with prompts as token_ids, one as packed_token_ids:
    every reply (cache hits, block tables, miss reasons, evictions) and the stats are equal."""
    stub = server.stub
    rng = random.Random(12)
    stems = [[rng.randrange(50_000) for _ in range(rng.choice((3, 8, 13)))] for _ in range(3)]
    # Models of their own: no other pool is a peer (other_replica_tokens would see the other form).
    pools = {form: register(stub, worker(f"form-{form}"), num_blocks=24, block_size=4, vocab_size=50_000,
                            fingerprint=worker(f"model-{form}")) for form in ("token_ids", "packed")}
    running: list[tuple[str, int]] = []
    for n in range(40):
        finishes = [fin(rid, size) for rid, size in running if rng.random() < 0.5]
        done = {f.request_id for f in finishes}
        running = [r for r in running if r[0] not in done]
        prompts = {f"r{n}-{i}": rng.choice(stems) + [rng.randrange(50_000) for _ in range(rng.randrange(1, 6))]
                   for i in range(rng.randrange(0, 3))}
        resumed = {rid: rng.random() < 0.1 for rid in prompts}
        replies = {}
        for form, reg in pools.items():
            admits = [pb.Admit(request_id=rid, resumed=resumed[rid], num_lookahead_tokens=1,
                               **({"token_ids": p} if form == "token_ids" else {"packed_token_ids": packed(p)}))
                      for rid, p in prompts.items()]
            replies[form] = step(stub, reg, finishes=finishes, admits=admits)
        assert replies["token_ids"] == replies["packed"], n
        running += [(a.request_id, len(prompts[a.request_id])) for a in replies["packed"].admits
                    if a.status == ADMITTED]
    stats = {form: assert_accounting(stub, reg.pool_id) for form, reg in pools.items()}
    for field_ in ("num_cached_blocks", "num_free_blocks", "hit_tokens", "queried_tokens", "num_evicted_blocks",
                   "num_admitted", "num_finished", "num_running_requests"):
        assert getattr(stats["token_ids"], field_) == getattr(stats["packed"], field_), field_
    assert stats["packed"].num_evicted_blocks > 0 and stats["packed"].hit_tokens > 0  # both paths were exercised


def test_rejected_step_applies_nothing(server) -> None:
    stub = server.stub
    reg, table = _bad_pool(stub)
    with pytest.raises(grpc.RpcError) as info:
        step(stub, reg, finishes=[fin("live", 10)], admits=[admit("ok", [1, 2]), admit("bad", [])])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad" in info.value.details()
    stats = assert_accounting(stub, reg.pool_id)
    assert stats.num_running_requests == 1 and stats.num_finished == 1
    # The same step without the bad item goes through.
    reply = step(stub, reg, finishes=[fin("live", 10, table=table)], admits=[admit("ok", [1, 2])])
    assert reply.admits[0].status == ADMITTED


# ---------------------------------------------------------------------- process behaviour


def test_lease_expiry_reclaims_a_dead_pool(start_server) -> None:
    srv = start_server("--lease-seconds", "1.5")
    stub = srv.stub
    dead = register(stub, "dead", num_blocks=16)
    alive = register(stub, "alive", num_blocks=16)
    for reg in (dead, alive):
        step(stub, reg, admits=[admit("a", range(9))])
        step(stub, reg, finishes=[fin("a", 9)])
        step(stub, reg, admits=[admit("b", range(13))])
    watch = stub.WatchEvents(pb.WatchEventsRequest(pool_id="", start_sequence=1), timeout=20)
    deadline = time.monotonic() + 10.0
    pools = {"dead", "alive"}
    try:
        while "dead" in pools and time.monotonic() < deadline:
            stub.Heartbeat(pb.HeartbeatRequest(pool_id="alive", epoch=alive.epoch), timeout=5)
            time.sleep(0.2)
            pools = {p.pool_id for p in stub.Stats(pb.StatsRequest(), timeout=5).pools}
        assert pools == {"alive"}, "the dead pool's lease did not expire"
        events = [next(watch) for _ in range(3)]  # stored (dead), stored (alive), cleared (dead)
    finally:
        watch.cancel()
    assert [(e.pool_id, e.WhichOneof("event")) for e in events] == [
        ("dead", "stored"), ("alive", "stored"), ("dead", "cleared")]
    with pytest.raises(grpc.RpcError) as info:
        step(stub, dead, finishes=[fin("b", 13)])
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stats = assert_accounting(stub, "alive")
    assert stats.num_running_requests == 1 and stats.num_cached_blocks == 2
    again = register(stub, "dead", num_blocks=16)
    assert again.epoch != dead.epoch
    assert assert_accounting(stub, "dead").num_free_blocks == 16


def test_sigterm_exits_cleanly(start_server) -> None:
    srv = start_server()
    reg = register(srv.stub, "w")
    step(srv.stub, reg, admits=[admit("r", range(5))])
    watch = srv.stub.WatchEvents(pb.WatchEventsRequest(), timeout=30)  # an open stream must not hold it up
    try:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=10) == 0
    finally:
        watch.cancel()
    assert "shutting down" in srv.stderr()


def test_port_in_use_fails_clearly(start_server) -> None:
    srv = start_server()
    proc = subprocess.run(
        [sys.executable, "-m", "cache_service", "--port", str(srv.port), "--host", "127.0.0.1"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{srv.port}" in proc.stderr
    assert "listening on" not in proc.stdout


def test_metrics_endpoint(start_server) -> None:
    srv = start_server("--metrics-port", "0")  # logged before the listening line is printed
    port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", srv.stderr()).group(1))
    reg = register(srv.stub, "m", num_blocks=8)
    step(srv.stub, reg, admits=[admit("r", range(9))])
    step(srv.stub, reg, finishes=[fin("r", 9)])
    with pytest.raises(grpc.RpcError):
        step(srv.stub, reg, finishes=[fin("r", 9)])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'radixkv_cache_blocks{pool="m",state="free"} 6.0' in text
    assert 'radixkv_cache_blocks{pool="m",state="cached"} 2.0' in text
    assert 'radixkv_cache_requests_finished_total{pool="m"} 1.0' in text
    assert 'radixkv_cache_queried_tokens_total{pool="m"} 9.0' in text
    assert "radixkv_cache_step_seconds_count 3.0" in text
    assert 'radixkv_cache_steps_total{transport="unary"} 3.0' in text
    assert 'radixkv_cache_rpc_errors_total{code="FAILED_PRECONDITION",method="Step"} 1.0' in text


def test_metrics_of_the_lower_tiers(start_server) -> None:
    """Per-pool, per-tier series from the pools' TierStats (none for a pool without tiers)."""
    srv = start_server("--metrics-port", "0")
    port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", srv.stderr()).group(1))
    register(srv.stub, "plain", num_blocks=8)
    reg = srv.stub.RegisterPool(pb.RegisterPoolRequest(
        worker_id="t", num_blocks=4, block_size=4, model_fingerprint="fp",
        tiers=pb.TierConfig(num_host_slots=8, num_disk_slots=6)), timeout=5)
    a, b = list(range(100, 113)), list(range(200, 215))  # 3 and 3 whole pages (+ the next token)
    step(srv.stub, reg, admits=[admit("a", a)])
    step(srv.stub, reg, finishes=[fin("a", len(a))])
    evicting = step(srv.stub, reg, admits=[admit("b", b)])  # a's pages go down to the host tier
    (copy,) = evicting.offloads
    assert len(copy.src) == 3
    # two of the three pages copied, the third failed
    step(srv.stub, reg, finishes=[fin("b", len(b))],
         copy_outcomes=[pb.CopyOutcome(copy_id=copy.copy_id, num_pages_copied=2)])
    again = step(srv.stub, reg, admits=[admit("a2", a)])  # loads the two pages the host tier holds
    (load,) = again.admits[0].loads  # ... into blocks of b's, whose 3 pages go down
    (down,) = again.offloads
    assert len(load.src) == 2 and len(down.src) == 3
    pending = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'radixkv_cache_tier_pages{pool="t",state="pending",tier="host"} 3.0' in pending
    step(srv.stub, reg, copy_outcomes=[pb.CopyOutcome(copy_id=load.copy_id, num_pages_copied=2),
                                       pb.CopyOutcome(copy_id=down.copy_id, num_pages_copied=3)])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in [
        'radixkv_cache_tier_slots{pool="t",tier="host"} 8.0',
        'radixkv_cache_tier_slots{pool="t",tier="disk"} 6.0',
        'radixkv_cache_tier_pages{pool="t",state="cached",tier="host"} 5.0',
        'radixkv_cache_tier_pages{pool="t",state="pending",tier="host"} 0.0',
        'radixkv_cache_tier_pages{pool="t",state="free",tier="host"} 3.0',
        'radixkv_cache_tier_pages{pool="t",state="free",tier="disk"} 6.0',
        'radixkv_cache_tier_hit_tokens_total{pool="t",tier="host"} 8.0',
        'radixkv_cache_tier_loaded_pages_total{pool="t",tier="host"} 2.0',
        'radixkv_cache_tier_offloaded_pages_total{pool="t",tier="host"} 5.0',
        'radixkv_cache_tier_failed_pages_total{pool="t",tier="host"} 1.0',
        'radixkv_cache_tier_evicted_pages_total{pool="t",tier="host"} 0.0',
        'radixkv_cache_tier_hit_tokens_total{pool="t",tier="disk"} 0.0',
    ]:
        assert line in text, line
    assert 'pool="plain",tier=' not in text  # a pool without tiers has no tier series
