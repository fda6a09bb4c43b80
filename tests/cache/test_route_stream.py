"""RouteStream through a real cache manager process: each reply is what a unary Route answers for
the same request (a recorded decision counts for the next one as it does for calls); a Route that
Route refuses is answered in its reply with the code and message and the stream goes on; roles and
namespaces are checked per message and a revoked token ends the stream; bytes that are not a
RouteRequest end it with INVALID_ARGUMENT."""

from __future__ import annotations

import signal
from array import array
from pathlib import Path

import grpc
import pytest

from protos import cache_pb2 as pb
from tests.cache.conftest import ServerProcess
from tests.cache.streams import Stream, md, wait_for_log

BS = 4
DOC = list(range(100, 124))  # 6 pages
TOKENS = "admin-tok\nreplica-tok replica\nrouter-tok reader,router\nreader-tok reader\ntenant-tok reader ns=tenant\n"


def fleet(start_server, *extra: str, metadata=None) -> ServerProcess:
    """A cache manager with two pools of one model; "a" holds DOC's first 4 pages."""
    server = start_server(*extra)
    regs = {name: server.stub.RegisterPool(pb.RegisterPoolRequest(
        worker_id=name, num_blocks=32, block_size=BS, model_fingerprint="fp", serving_addr=f"{name}:1"),
        timeout=10, metadata=metadata) for name in ("a", "b")}
    a = regs["a"]
    server.stub.Step(pb.StepRequest(pool_id=a.pool_id, epoch=a.epoch, admits=[
        pb.Admit(request_id="r", token_ids=DOC[:17])]), timeout=10, metadata=metadata)
    server.stub.Step(pb.StepRequest(pool_id=a.pool_id, epoch=a.epoch, finishes=[
        pb.Finish(request_id="r", num_computed_tokens=17)]), timeout=10, metadata=metadata)
    return server


def route(**fields) -> pb.RouteRequest:
    return pb.RouteRequest(token_ids=DOC, model_fingerprint="fp", **fields)


def test_replies_are_routes_answers_and_a_recorded_decision_counts_for_the_next(start_server) -> None:
    server = fleet(start_server)
    stream = Stream(server, method="RouteStream")
    try:
        streamed = stream.ask(route(dry_run=True))
        assert streamed.code == 0 and streamed.response == server.stub.Route(route(dry_run=True), timeout=10)
        best = streamed.response.candidates[0]
        assert (best.worker_id, best.matched_tokens) == ("a", 16)
        # A recorded decision (request id, not dry): the pool's routed load counts it from then on.
        recorded = stream.ask(route(request_id="q1")).response.candidates[0]
        assert recorded.worker_id == "a" and recorded.routed_tokens == len(DOC) - 16
        after = server.stub.Route(route(dry_run=True), timeout=10).candidates
        assert {c.worker_id: c.routed_tokens for c in after} == {"a": len(DOC) - 16, "b": 0}
        assert stream.ask(route(dry_run=True)).response.candidates == after
    finally:
        stream.close()


def test_a_refused_route_is_answered_in_its_reply_and_the_stream_goes_on(start_server) -> None:
    server = fleet(start_server)
    stream = Stream(server, method="RouteStream")
    try:
        both = stream.ask(pb.RouteRequest(token_ids=DOC, page_hashes=[1, 2], model_fingerprint="fp"))
        assert both.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "exactly one" in both.message
        assert not both.HasField("response")
        oversized = stream.ask(pb.RouteRequest(token_ids=[5] * (32 * BS + 1), model_fingerprint="fp"))
        assert oversized.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "at most 128" in oversized.message
        good = stream.ask(route(dry_run=True))
        assert good.code == 0 and good.response.candidates[0].worker_id == "a"
    finally:
        stream.close()


def test_roles_and_namespaces_per_message_and_a_revoked_token_ends_the_stream(start_server, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    server = fleet(start_server, "--auth-token-file", str(tokens), "--log-level", "INFO",
                   metadata=md("admin-tok"))
    refused = Stream(server, md("replica-tok"), method="RouteStream")
    try:
        refused.send(route(dry_run=True))
        assert refused.error().code() == grpc.StatusCode.PERMISSION_DENIED  # no reader role: no stream
    finally:
        refused.close()
    reader, tenant = Stream(server, md("reader-tok"), method="RouteStream"), Stream(server, md("tenant-tok"),
                                                                                  method="RouteStream")
    try:
        denied = reader.ask(route(request_id="q"))  # recording needs the router role
        assert denied.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "'router' role" in denied.message
        assert reader.ask(route(dry_run=True)).code == 0
        other = tenant.ask(route(dry_run=True))  # the default namespace is not the tenant token's
        assert other.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        own = tenant.ask(route(dry_run=True, namespace="tenant"))
        assert own.code == 0 and own.response.candidates[0].matched_tokens == 0  # DOC is cached in "" only
        tokens.write_text(TOKENS.replace("reader-tok reader\n", ""))
        server.proc.send_signal(signal.SIGHUP)
        wait_for_log(server, "reloaded")
        reader.send(route(dry_run=True))
        err = reader.error()
        assert tenant.ask(route(dry_run=True, namespace="tenant")).code == 0
    finally:
        reader.close()
        tenant.close()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in err.details()


def test_bytes_that_are_not_a_route_request_end_the_stream(start_server) -> None:
    server = fleet(start_server)
    stream = Stream(server, raw=True, method="RouteStream")
    try:
        good = pb.RouteStreamReply.FromString(stream.ask(route(dry_run=True).SerializeToString()))
        assert good.code == 0 and good.response.candidates
        stream.send(b"\xff\xff\xff")
        err = stream.error()
    finally:
        stream.close()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "RouteRequest" in err.details()


def test_a_packed_prompt_routes_as_its_token_ids_do(start_server) -> None:
    server = fleet(start_server)
    packed = array("I", DOC).tobytes()
    as_ids = server.stub.Route(route(dry_run=True), timeout=10)
    assert server.stub.Route(pb.RouteRequest(packed_token_ids=packed, model_fingerprint="fp", dry_run=True),
                             timeout=10) == as_ids
    assert as_ids.candidates[0].matched_tokens == 16
    for bad, why in ((pb.RouteRequest(packed_token_ids=packed, token_ids=DOC), "not both"),
                     (pb.RouteRequest(packed_token_ids=packed[:-1]), "whole number"),
                     (pb.RouteRequest(packed_token_ids=array("I", [5] * (32 * BS + 1)).tobytes()), "at most 128")):
        bad.model_fingerprint, bad.dry_run = "fp", True
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Route(bad, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
