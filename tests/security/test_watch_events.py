"""WatchEvents as a tenant sees it, through a real cache manager process with --auth-token-file:

- a namespace-limited watcher's stream reveals nothing of other namespaces: its sequence numbers
  are its own view's (consecutive, 1 for its first event), and every field of every event is the
  same whether or not another tenant was busy in the same pool meanwhile (live, resumed and
  snapshot streams; an admin Clear while the other tenant holds locked pages included);
- those numbers resume: within one process and, with --state-dir, across kill -9 restarts;
- streams are bounded per principal: --max-watch-streams, then RESOURCE_EXHAUSTED; and 40
  never-read snapshot streams of one principal on a pool with many cached pages do not grow the
  server's memory (snapshots are sent lazily, under flow control, not materialised per stream).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from protos import cache_pb2 as pb
from protos import cache_pb2_grpc
from tests.cache.conftest import ServerProcess, spawn_server, stop_server

TOKENS = """\
admin-tok admin,reader
replica-tok replica
reader-tok reader
tenant-b-tok reader ns=tenant-b
tenant-ab-tok reader ns=tenant-a|tenant-b
"""
BS = 4
B1 = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # 3 full pages
B2 = B1[:4] + [40, 41, 42, 43, 44]  # shares B1's first page: splits B1's node
B3 = [50, 51, 52, 53, 54]
A1 = [11, 12, 13, 14, 15, 16, 17, 18, 60]  # the same tokens as B1's, in tenant-a
A2 = [70, 71, 72, 73, 74, 75, 76, 77, 78]
A3 = [80, 81, 82, 83, 84]


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Cache managers with the token file above (and `extra` flags); killed at teardown."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    started: list[ServerProcess] = []

    def run(*extra: str) -> ServerProcess:
        server = spawn_server(tmp_path / f"cache-{len(started)}.stderr", "--auth-token-file", str(tokens), *extra)
        started.append(server)
        return server

    try:
        yield run
    finally:
        for server in started:
            stop_server(server)


class Replica:
    """RegisterPool / Step / Clear calls of one pool, with the replica and admin tokens."""

    def __init__(self, stub: cache_pb2_grpc.CacheManagerStub, num_blocks: int = 256, block_size: int = BS) -> None:
        self.stub = stub
        self.reg = stub.RegisterPool(pb.RegisterPoolRequest(
            worker_id="w", num_blocks=num_blocks, block_size=block_size, incarnation="inc-1"),
            metadata=md("replica-tok"), timeout=10)

    def step(self, **items) -> pb.StepResponse:
        return self.stub.Step(pb.StepRequest(pool_id=self.reg.pool_id, epoch=self.reg.epoch, **items),
                              metadata=md("replica-tok"), timeout=10)

    def admit(self, rid: str, tokens: list[int], namespace: str) -> None:
        reply = self.step(admits=[pb.Admit(request_id=rid, token_ids=tokens, namespace=namespace)])
        assert reply.admits[0].status == pb.ADMIT_STATUS_ADMITTED

    def store(self, rid: str, tokens: list[int], namespace: str) -> None:
        """A request admitted and finished: its full pages are cached."""
        self.admit(rid, tokens, namespace)
        self.step(finishes=[pb.Finish(request_id=rid, num_computed_tokens=len(tokens))])

    def clear(self) -> None:
        self.stub.Clear(pb.ClearRequest(pool_id=self.reg.pool_id, epoch=self.reg.epoch), metadata=md("admin-tok"),
                        timeout=10)


def take(call, n: int) -> list[pb.CacheEvent]:
    """The next `n` events of a stream (each wait bounded by the call's deadline)."""
    return [next(call) for _ in range(n)]


def watch(stub: cache_pb2_grpc.CacheManagerStub, token: str, **request) -> grpc.Call:
    return stub.WatchEvents(pb.WatchEventsRequest(**request), metadata=md(token), timeout=30)


def first(stub: cache_pb2_grpc.CacheManagerStub, token: str, n: int, **request) -> list[pb.CacheEvent]:
    """The first `n` events of a new stream, which is then closed."""
    call = watch(stub, token, **request)
    try:
        return take(call, n)
    finally:
        call.cancel()


def seen_by_tenant(event: pb.CacheEvent) -> tuple:
    """Every field of an event but its wall-clock time and the process's publisher_epoch."""
    copy = pb.CacheEvent()
    copy.CopyFrom(event)
    copy.ClearField("timestamp")
    copy.ClearField("publisher_epoch")
    return copy.SerializeToString(deterministic=True), event.WhichOneof("event"), event.sequence


def tenant_b_streams(server: ServerProcess, with_a: bool) -> dict[str, list[tuple]]:
    """Tenant-b's traffic with (or without) tenant-a's interleaved, and what tenant-b's watchers get."""
    stub = server.stub
    replica = Replica(stub)
    if with_a:
        replica.store("a1", A1, "tenant-a")
    replica.store("b1", B1, "tenant-b")
    live = watch(stub, "tenant-b-tok", start_sequence=1)
    try:
        events = take(live, 1)
        if with_a:
            replica.store("a2", A2, "tenant-a")
            replica.admit("a-running", A1 + [61, 62, 63], "tenant-a")  # locks tenant-a's cached prefix
        replica.store("b2", B2, "tenant-b")
        replica.clear()  # with tenant-a's locked pages the tree does not empty
        if with_a:
            replica.store("a3", A3, "tenant-a")
        replica.store("b3", B3, "tenant-b")
        events += take(live, 3)
    finally:
        live.cancel()
    again = first(stub, "tenant-b-tok", 3, start_sequence=2)
    snapshot = first(stub, "tenant-b-tok", 1, snapshot=True)  # the tree holds B3's page only
    if with_a:  # an unlimited reader still gets every event, numbered server-wide
        kinds = [(e.sequence, e.WhichOneof("event")) for e in first(stub, "reader-tok", 8, start_sequence=1)]
        assert [k for _, k in kinds] == ["stored"] * 4 + ["removed"] * 2 + ["stored"] * 2, kinds
        assert [s for s, _ in kinds] == list(range(1, 9))
    return {"live": [seen_by_tenant(e) for e in events], "resumed": [seen_by_tenant(e) for e in again],
            "snapshot": [seen_by_tenant(e) for e in snapshot], "raw": events + again + snapshot}


def test_a_namespace_limited_stream_is_the_same_whatever_other_tenants_do(start) -> None:
    quiet = tenant_b_streams(start(), with_a=False)
    busy = tenant_b_streams(start(), with_a=True)
    live = busy["live"]
    assert [(kind, seq) for _, kind, seq in live] == [("stored", 1), ("stored", 2), ("removed", 3), ("stored", 4)]
    assert busy["resumed"] == live[1:]
    assert [(kind, seq) for _, kind, seq in busy["snapshot"]] == [("stored", 4)]  # the view's last number
    for event in busy["raw"]:
        payload = getattr(event, event.WhichOneof("event"))
        assert payload.namespace == "tenant-b"
        assert not payload.block_ids, "physical block ids depend on every tenant's allocations"
    for name in ("live", "resumed", "snapshot"):
        assert busy[name] == quiet[name], f"tenant-b's {name} stream differs when tenant-a is busy"


def test_a_namespace_limited_resume_is_checked_against_its_own_numbers(start) -> None:
    server = start()
    stub = server.stub
    replica = Replica(stub)
    for i in range(3):
        replica.store(f"a{i}", [100 + i] * 8, "tenant-a")
    replica.store("b1", B1, "tenant-b")
    # tenant-b's view has one event (number 1); server-wide it is the 4th.
    (only,) = first(stub, "tenant-b-tok", 1, start_sequence=1)
    assert only.sequence == 1 and only.stored.namespace == "tenant-b"
    code, details = code_of(lambda: first(stub, "tenant-b-tok", 1, start_sequence=3))
    assert code == grpc.StatusCode.OUT_OF_RANGE and "ahead" in details
    # A view of two namespaces counts the events of both.
    both = first(stub, "tenant-ab-tok", 4, start_sequence=1)
    assert [(e.sequence, e.stored.namespace) for e in both] == \
        [(1, "tenant-a"), (2, "tenant-a"), (3, "tenant-a"), (4, "tenant-b")]
    live = watch(stub, "tenant-b-tok", start_sequence=2)  # next number: live only
    try:
        replica.store("b2", B3, "tenant-b")
        (second,) = take(live, 1)
    finally:
        live.cancel()
    assert second.sequence == 2 and list(second.stored.token_ids) == B3[:4]


def test_a_namespace_named_by_a_reloaded_token_file_is_counted_from_then_on(start, tmp_path: Path) -> None:
    server = start()
    replica = Replica(server.stub)
    replica.store("c0", B3, "tenant-c")  # nobody's view yet
    with open(tmp_path / "tokens", "a") as tokens:
        tokens.write("tenant-c-tok reader ns=tenant-c\n")
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while code_of(lambda: first(server.stub, "tenant-c-tok", 1, snapshot=True))[0] != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "the reloaded token is not accepted"
        time.sleep(0.1)
    replica.store("c1", B1, "tenant-c")
    (event,) = first(server.stub, "tenant-c-tok", 1, start_sequence=1)
    assert event.sequence == 1 and list(event.stored.token_ids) == B1[:12]


def test_a_namespace_limited_consumer_resumes_across_durable_restarts(start, tmp_path: Path) -> None:
    state = ["--state-dir", str(tmp_path / "state")]
    server = start(*state)
    replica = Replica(server.stub)
    replica.store("a1", A1, "tenant-a")
    replica.store("b1", B1, "tenant-b")
    replica.store("a2", A2, "tenant-a")
    replica.store("b2", B2, "tenant-b")
    seen = first(server.stub, "tenant-b-tok", 2, start_sequence=1)
    assert [e.sequence for e in seen] == [1, 2]
    epoch = seen[0].publisher_epoch

    # The consumer saw every event but the last one; it resumes there after a kill -9 (the events
    # since the last snapshot are rebuilt from the journal). The second restart starts from the
    # first one's snapshot, where the counts were saved.
    for restart in range(2):
        server.proc.kill()
        server.proc.wait(10)
        server = start(*state)
        resumed = first(server.stub, "tenant-b-tok", 1, start_sequence=seen[-1].sequence, publisher_epoch=epoch)
        assert [seen_by_tenant(e)[0] for e in resumed] == [seen_by_tenant(seen[-1])[0]], restart
        replica = Replica(server.stub)  # the same incarnation: re-attached, the tree kept
        live = watch(server.stub, "tenant-b-tok", start_sequence=len(seen) + 1, publisher_epoch=epoch)
        try:
            replica.store(f"a-after-{restart}", [90 + restart] * 5, "tenant-a")
            replica.store(f"b-after-{restart}", [95 + restart] * 5, "tenant-b")
            (new,) = take(live, 1)
        finally:
            live.cancel()
        assert new.sequence == len(seen) + 1 and new.stored.token_ids[0] == 95 + restart
        seen.append(new)
        epoch = new.publisher_epoch
    (snapshot_event,) = first(server.stub, "tenant-b-tok", 1, snapshot=True)
    assert snapshot_event.is_snapshot and snapshot_event.sequence == len(seen)


def test_watch_streams_are_capped_per_principal(start) -> None:
    server = start("--max-watch-streams", "2")
    stub = server.stub
    replica = Replica(stub)
    replica.store("b1", B1, "tenant-b")
    open_calls = [watch(stub, "reader-tok", snapshot=True) for _ in range(2)]
    for call in open_calls:
        assert take(call, 1)[0].is_snapshot  # accepted and streaming
    code, details = code_of(lambda: first(stub, "reader-tok", 1, snapshot=True))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 WatchEvents streams" in details and "--max-watch-streams" in details
    assert first(stub, "tenant-b-tok", 1, snapshot=True)[0].is_snapshot  # another principal: its own streams
    open_calls.pop().cancel()
    deadline = time.monotonic() + 10
    while True:  # the server notices the cancel asynchronously
        code, _ = code_of(lambda: first(stub, "reader-tok", 1, snapshot=True))
        if code == grpc.StatusCode.OK:
            break
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
        time.sleep(0.1)
    for call in open_calls:
        call.cancel()


def test_never_read_snapshot_streams_do_not_grow_the_server(start) -> None:
    server = start("--max-watch-streams", "64")
    stub = server.stub
    page_tokens, prompt_pages, num_prompts = 16, 64, 1100
    replica = Replica(stub, num_blocks=prompt_pages * num_prompts + 64, block_size=page_tokens)
    for batch in range(0, num_prompts, 100):  # distinct first pages: one tree node per prompt
        rids = [f"p{i}" for i in range(batch, min(batch + 100, num_prompts))]
        replica.step(admits=[pb.Admit(request_id=rid, token_ids=[int(rid[1:]) + 1] * (page_tokens * prompt_pages),
                                      namespace="tenant-b") for rid in rids])
        replica.step(finishes=[pb.Finish(request_id=rid, num_computed_tokens=page_tokens * prompt_pages)
                               for rid in rids])
    # One whole snapshot read first: page hashes are computed and kept by the tree from then on.
    assert len(first(stub, "reader-tok", num_prompts, snapshot=True)) == num_prompts
    process = psutil.Process(server.proc.pid)
    time.sleep(0.5)
    before = process.memory_info().rss
    calls = [watch(stub, "reader-tok", snapshot=True) for _ in range(40)]  # never read
    try:
        peak = before
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            stub.Stats(pb.StatsRequest(), metadata=md("reader-tok"), timeout=10)  # served meanwhile
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.25)
        grown = (peak - before) / 2**20
        assert grown < 40, f"40 unread snapshot streams grew the server by {grown:.0f} MiB"
        for call in calls[:3]:  # they are live streams nonetheless
            assert take(call, 1)[0].is_snapshot
    finally:
        for call in calls:
            call.cancel()
