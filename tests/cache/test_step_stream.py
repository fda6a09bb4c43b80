"""StepStream through a real cache manager process: the replies of a stream are those unary Steps
give for the same steps; the first refused message ends the stream with Step's status and nothing
after it is applied; bytes that are not a StepRequest end it with INVALID_ARGUMENT; the replica
role is needed and a token revoked by a reload ends an open stream at its next message; a
stream's steps are journaled like Step's (kill -9, restart, the cached prefix is still there)."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest

from protos import cache_pb2 as pb
from tests.cache.conftest import ServerProcess
from tests.cache.streams import Stream, md, wait_for_log

BS = 4
PROMPT = list(range(1, 23))  # 22 tokens: 5 full pages
OTHER = PROMPT[:12] + [90, 91, 92, 93, 94, 95]  # shares 3 pages with PROMPT


def register(server: ServerProcess, worker: str, metadata=None, incarnation: str = "inc") -> pb.RegisterPoolResponse:
    return server.stub.RegisterPool(pb.RegisterPoolRequest(
        worker_id=worker, num_blocks=64, block_size=BS, model_fingerprint="fp", incarnation=incarnation),
        timeout=10, metadata=metadata)


def script(reg: pb.RegisterPoolResponse, namespace: str) -> list[pb.StepRequest]:
    """Admit, commit, extend, finish and re-admit over shared pages: every kind of Step item."""
    def step(**items) -> pb.StepRequest:
        return pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, **items)
    return [
        step(admits=[pb.Admit(request_id="a", token_ids=PROMPT, namespace=namespace, num_lookahead_tokens=1)]),
        step(commits=[pb.Commit(request_id="a", num_computed_tokens=len(PROMPT))],
             extends=[pb.Extend(request_id="a", num_tokens=len(PROMPT) + 3, num_lookahead_tokens=2)]),
        step(admits=[pb.Admit(request_id="b", token_ids=OTHER, namespace=namespace, num_lookahead_tokens=1)]),
        step(finishes=[pb.Finish(request_id="a", num_computed_tokens=len(PROMPT) + 2, output_token_ids=[7, 8, 9])],
             releases=[pb.Finish(request_id="b", num_computed_tokens=len(OTHER))]),
        step(admits=[pb.Admit(request_id="c", token_ids=PROMPT + [7, 8, 9, 5], namespace=namespace)]),
    ]


def test_a_stream_answers_as_unary_steps_do(start_server) -> None:
    server = start_server()
    # Two pools of one server, a namespace each (neither sees the other's pages): the same script.
    unary_reg, stream_reg = register(server, "unary"), register(server, "streamed")
    unary = [server.stub.Step(request, timeout=10) for request in script(unary_reg, "u")]
    stream = Stream(server)
    try:
        streamed = [stream.ask(request) for request in script(stream_reg, "s")]
    finally:
        stream.close()
    assert streamed == unary
    assert [len(r.admits[0].block_table) for r in streamed if r.admits] == [6, 5, 7]
    assert streamed[4].admits[0].cached_tokens == 24  # a's prompt and decode pages, committed at finish
    stats = {p.pool_id: p for p in server.stub.Stats(pb.StatsRequest(), timeout=10).pools}
    for pool_id in ("unary", "streamed"):
        p = stats[pool_id]
        assert p.num_free_blocks + p.num_cached_blocks + p.num_private_blocks == p.num_blocks


def test_the_first_refused_step_ends_the_stream_and_nothing_after_it_is_applied(start_server) -> None:
    server = start_server()
    reg = register(server, "w")
    stream = Stream(server)
    try:
        first = stream.ask(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=[
            pb.Admit(request_id="ok", token_ids=PROMPT)]))
        assert first.admits[0].status == pb.ADMIT_STATUS_ADMITTED
        stream.send(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch + 1, admits=[  # a stale epoch
            pb.Admit(request_id="stale", token_ids=OTHER)]))
        stream.send(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=[
            pb.Admit(request_id="after", token_ids=OTHER)]))
        err = stream.error()
    finally:
        stream.close()
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale epoch" in err.details()
    (pool,) = server.stub.Stats(pb.StatsRequest(pool_id="w"), timeout=10).pools
    assert pool.num_private_blocks == len(PROMPT) // BS + 1  # "ok" alone holds blocks: neither later admit ran
    # The same client goes on with a new stream.
    again = Stream(server)
    try:
        reply = again.ask(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=[
            pb.Admit(request_id="after", token_ids=OTHER)]))
    finally:
        again.close()
    assert reply.admits[0].status == pb.ADMIT_STATUS_ADMITTED


@pytest.mark.parametrize("bad, why", [
    (b"\xff\xff\xff", "not a valid radixkv.v1.StepRequest"),
    (pb.StepRequest(pool_id="p" * 5000).SerializeToString(), "pool_id"),
])
def test_bytes_that_are_not_a_step_end_the_stream_with_invalid_argument(start_server, bad, why) -> None:
    server = start_server()
    reg = register(server, "w")
    stream = Stream(server, raw=True)
    try:
        good = pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch).SerializeToString()
        assert pb.StepResponse.FromString(stream.ask(good)).num_free_blocks == 64
        stream.send(bad)
        err = stream.error()
    finally:
        stream.close()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.details()


TOKENS = "replica-tok replica\nreader-tok reader\nother-replica-tok replica\n"


def test_the_replica_role_is_needed_and_a_revoked_token_ends_an_open_stream(start_server, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    server = start_server("--auth-token-file", str(tokens), "--log-level", "INFO")
    reg = register(server, "w", md("replica-tok"))
    step = pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch)
    for metadata, code in ((md("reader-tok"), grpc.StatusCode.PERMISSION_DENIED),
                           (None, grpc.StatusCode.UNAUTHENTICATED)):
        refused = Stream(server, metadata)
        try:
            refused.send(step)
            assert refused.error().code() == code
        finally:
            refused.close()
    stream, other = Stream(server, md("replica-tok")), Stream(server, md("other-replica-tok"))
    try:
        assert stream.ask(step).num_free_blocks == 64
        assert other.ask(step).num_free_blocks == 64
        tokens.write_text(TOKENS.replace("replica-tok replica\n", "", 1))  # replica-tok revoked
        server.proc.send_signal(signal.SIGHUP)
        wait_for_log(server, "reloaded")
        stream.send(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=[
            pb.Admit(request_id="late", token_ids=PROMPT)]))
        err = stream.error()
        assert other.ask(step).num_free_blocks == 64  # a token still in the file keeps its stream
    finally:
        stream.close()
        other.close()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in err.details()
    (pool,) = server.stub.Stats(pb.StatsRequest(pool_id="w"), timeout=10, metadata=md("reader-tok")).pools
    assert pool.num_private_blocks == 0  # the revoked token's message was not applied


def test_a_streams_steps_are_journaled(start_server, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    server = start_server("--state-dir", str(state_dir))
    reg = register(server, "w", incarnation="inc-1")
    stream = Stream(server)
    try:
        admit = stream.ask(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=[
            pb.Admit(request_id="a", token_ids=PROMPT)]))
        stream.ask(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, finishes=[
            pb.Finish(request_id="a", num_computed_tokens=len(PROMPT), block_table=admit.admits[0].block_table)]))
    finally:
        stream.close()
    server.proc.kill()  # SIGKILL: what the journal holds is all that survives
    server.proc.wait(timeout=10)
    restarted = start_server("--port", str(server.port), "--state-dir", str(state_dir))
    again = register(restarted, "w", incarnation="inc-1")
    assert again.restored and again.num_cached_blocks == len(PROMPT) // BS


def test_a_stop_ends_open_streams_at_once_with_unavailable(start_server) -> None:
    server = start_server("--grace-seconds", "30")
    reg = register(server, "w")
    steps, routes = Stream(server), Stream(server, method="RouteStream")
    try:
        assert steps.ask(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch)).num_free_blocks == 64
        assert routes.ask(pb.RouteRequest(token_ids=PROMPT, dry_run=True)).code == 0
        server.proc.send_signal(signal.SIGTERM)
        # Neither stream holds the stop for its 30 s grace period: both end now, as UNAVAILABLE.
        assert server.proc.wait(timeout=10) == 0
        for stream in (steps, routes):
            err = stream.error()
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()
    finally:
        steps.close()
        routes.close()
