"""Tenants of one replica cannot learn about, or interfere with, each other's requests, through
real processes on loopback (cache manager + model service of the tiny random Llama, the model
service with --auth-token-file):

- the prefix oracle: tenant B's Usage (every field but timings and served_by), tokens and text
  for a memo tenant A sent under its own namespace are exactly what B gets from a fresh fleet
  where A sent nothing; the cross-namespace figure only reaches the cache manager's aggregated
  operator metric;
- request ids are scoped to the caller's token: another token's Abort of A's id is NOT_FOUND as
  for an unknown id (A's stream runs to its end), reusing A's live id is accepted, the same
  token's duplicate is ALREADY_EXISTS, and every path (finish, abort, cancel, deadline, refusal)
  frees the id (the live-id gauge returns to 0 and the id is reusable at once);
- a token limited by ns= may only Generate in those namespaces.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.model_service.checks import expect_status, wait_for, wait_until_idle
from tests.services import Launched, Running, launch_model, start_cache
from tests.tiny_model import save_tiny_llama

TOKENS = """\
tenant-a-tok client ns=memo-salt-7f3a
tenant-b-tok client ns=tenant-b
ops-tok client
"""
SALT_A = "memo-salt-7f3a"  # A's secret cache salt
NAMESPACE_B = "tenant-b"
MEMO = ("CONFIDENTIAL memo from Dana Whitfield to the board of directors, 14 March: Acme Corp will acquire "
        "{company} for {amount} billion dollars, announced on Friday after the close. Do not trade before then; "
        "the wire instructions follow in a separate letter.")
SECRET = MEMO.format(company="Globex Industries", amount="4.2")
# B's guesses: the exact text, one figure changed, another name (the three probes).
GUESSES = [SECRET, MEMO.format(company="Globex Industries", amount="3.9"),
           MEMO.format(company="Initech Systems", amount="4.2")]
LONG = 900  # max_tokens of a stream that must still run while another tenant acts on its id
METRICS_LINE = re.compile(r"metrics on (http://\S+/metrics)")


@dataclass
class Replica:
    cache: Running
    model: Running
    pool_id: str
    channel: grpc.Channel
    cache_channel: grpc.Channel

    @property
    def stub(self) -> model_pb2_grpc.ModelServiceStub:
        return model_pb2_grpc.ModelServiceStub(self.channel)

    @property
    def cache_stub(self) -> cache_pb2_grpc.CacheManagerStub:
        return cache_pb2_grpc.CacheManagerStub(self.cache_channel)


def metrics(service: Running) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    url = next(m.group(1) for line in service.log if (m := METRICS_LINE.search(line)))
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def start_pair(tiny: Path, tokens: Path, pool_id: str) -> tuple[Running, Launched]:
    """A cache manager of its own (metrics on) and a launched (not yet waited for) replica."""
    cache = start_cache(["--metrics-port", "0"])
    launched = launch_model(cache.addr, "--model", str(tiny), "--worker-id", pool_id, "--num-threads", "1",
                            "--num-blocks", "256", "--metrics-port", "0", "--auth-token-file", str(tokens))
    return cache, launched


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Iterator[tuple[Replica, Replica]]:
    """Two independent fleets of one cache manager and one replica each: the one under test and
    a control that stays fresh for the oracle comparison."""
    tmp = tmp_path_factory.mktemp("tenant-scoping")
    tiny = save_tiny_llama(tmp / "tiny-llama")
    tokens = tmp / "tokens"
    tokens.write_text(TOKENS)
    stop: list[Running] = []
    try:
        pairs = []
        for pool_id in ("scoped", "control"):
            cache, launched = start_pair(tiny, tokens, pool_id)
            stop.append(cache)
            pairs.append((cache, launched, pool_id))
        built = []
        for cache, launched, pool_id in pairs:
            model = launched.wait()
            stop.append(model)
            built.append(Replica(cache, model, pool_id, grpc.insecure_channel(model.addr),
                                 grpc.insecure_channel(cache.addr)))
        yield built[0], built[1]
        for replica in built:
            replica.channel.close()
            replica.cache_channel.close()
    finally:
        for service in reversed(stop):
            service.process.stop(10.0)


@pytest.fixture
def replica(replicas) -> Replica:
    return replicas[0]


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def request(text: str, namespace: str, request_id: str = "", max_tokens: int = 4) -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(request_id=request_id, prompt=text, namespace=namespace,
                                     sampling=model_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                       ignore_eos=True))


def generate(stub, token: str, req: model_pb2.GenerateRequest, timeout: float = 120) -> list[model_pb2.GenerateResponse]:
    return list(stub.Generate(req, metadata=md(token), timeout=timeout))


def caller_view(messages: list[model_pb2.GenerateResponse], served_by: str) -> dict:
    """Everything a Generate caller sees but timings: each message but the usage, and every
    Usage field but the two timings (served_by checked against the replica, then dropped)."""
    *body, last = messages
    usage = model_pb2.Usage()
    usage.CopyFrom(last.usage)
    assert usage.served_by == served_by
    usage.ClearField("time_to_first_token")
    usage.ClearField("total_time")
    usage.ClearField("served_by")
    stripped = model_pb2.GenerateResponse()
    stripped.CopyFrom(last)
    stripped.ClearField("usage")
    return {"messages": [m.SerializeToString(deterministic=True) for m in [*body, stripped]],
            "usage": {f.name: v for f, v in usage.ListFields()}}


# ---------------------------------------------------------------------- the prefix oracle


def test_another_namespace_holding_the_prompt_changes_nothing_the_caller_sees(replicas) -> None:
    scoped, control = replicas
    # Tenant A sends its memo under its secret salt, on the replica under test only.
    a = generate(scoped.stub, "tenant-a-tok", request(SECRET, SALT_A))
    assert a[-1].usage.prompt_tokens >= 49  # three whole pages of 16 tokens, as in the issue
    before = metrics(scoped.cache)
    views = {}
    for replica in (scoped, control):  # the same sequence of B's guesses on each
        views[replica.pool_id] = [
            caller_view(generate(replica.stub, "tenant-b-tok", request(text, NAMESPACE_B, f"guess-{i}")),
                        replica.model.addr)
            for i, text in enumerate(GUESSES)]
    for i, (seen, fresh) in enumerate(zip(views["scoped"], views["control"], strict=True)):
        assert seen == fresh, f"guess {i}: B sees {seen['usage']} where A's memo is held, {fresh['usage']} without it"
    first = views["scoped"][0]["usage"]
    assert first["miss_new_tokens"] == first["prompt_tokens"] and "miss_other_namespace_tokens" not in first
    # The cross-namespace figure exists only as the cache manager's aggregated operator metric.
    name = "radixkv_cache_miss_other_namespace_tokens_total"
    pool = (("pool", "scoped"),)
    grown = metrics(scoped.cache).get((name, pool), 0.0) - before.get((name, pool), 0.0)
    assert grown >= 48  # the exact guess alone: the memo's three whole pages
    assert metrics(control.cache).get((name, (("pool", "control"),)), 0.0) == 0.0


# ---------------------------------------------------------------------- request ids


def open_stream(stub, token: str, text: str, namespace: str, request_id: str, max_tokens: int = LONG):
    return stub.Generate(request(text, namespace, request_id, max_tokens), metadata=md(token), timeout=120)


def abort(stub, token: str, request_id: str) -> None:
    stub.Abort(model_pb2.AbortRequest(request_id=request_id), metadata=md(token), timeout=30)


def abort_error(stub, token: str, request_id: str) -> tuple[grpc.StatusCode, str]:
    try:
        abort(stub, token, request_id)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def live_ids(replica: Replica) -> float:
    return metrics(replica.model).get(("radixkv_model_live_request_ids", ()), -1.0)


def test_another_token_cannot_abort_a_request_and_may_reuse_its_live_id(replica) -> None:
    stub = replica.stub
    a_stream = open_stream(stub, "tenant-a-tok", SECRET, SALT_A, "memo-job")
    first = next(a_stream)
    assert first.request_id == "memo-job"
    # B's Abort of A's live id is exactly the answer for an id that never existed.
    code, details = abort_error(stub, "tenant-b-tok", "memo-job")
    unknown_code, unknown_details = abort_error(stub, "tenant-b-tok", "memo-jox")
    assert (code, details) == (unknown_code, unknown_details.replace("memo-jox", "memo-job"))
    assert code == grpc.StatusCode.NOT_FOUND
    # B may use the same id while A's request runs; its own Abort ends only its own request.
    b_done = generate(stub, "tenant-b-tok", request("Something else entirely", NAMESPACE_B, "memo-job"))
    assert {m.request_id for m in b_done} == {"memo-job"}
    assert b_done[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
    b_stream = open_stream(stub, "tenant-b-tok", "Another long story", NAMESPACE_B, "memo-job")
    next(b_stream)
    expect_status(lambda: generate(stub, "tenant-b-tok", request("dup", NAMESPACE_B, "memo-job", 2)),
                  grpc.StatusCode.ALREADY_EXISTS, "'memo-job'")
    abort(stub, "tenant-b-tok", "memo-job")
    b_rest = list(b_stream)
    assert b_rest[-1].finish_reason == model_pb2.FINISH_REASON_ABORT and b_rest[-1].request_id == "memo-job"
    # A's own duplicate is still refused; A's stream runs to its last token.
    expect_status(lambda: generate(stub, "tenant-a-tok", request("dup", SALT_A, "memo-job", 2)),
                  grpc.StatusCode.ALREADY_EXISTS, "'memo-job'", "live request")
    a_rest = list(a_stream)
    last = a_rest[-1]
    assert last.finish_reason == model_pb2.FINISH_REASON_LENGTH and last.request_id == "memo-job"
    assert last.usage.completion_tokens == LONG == sum(len(m.token_ids) for m in [first, *a_rest])
    # Each token aborts its own: A's id is free again, and A's Abort of a finished id is NOT_FOUND.
    assert abort_error(stub, "tenant-a-tok", "memo-job")[0] == grpc.StatusCode.NOT_FOUND
    wait_until_idle(replica.cache_stub, replica.pool_id)
    wait_for(lambda: live_ids(replica) == 0, 10, "no live request id")


def test_every_way_a_request_ends_frees_its_id(replica) -> None:
    stub = replica.stub
    rid = "ends"
    reuse = lambda: generate(stub, "ops-tok", request("reuse", "", rid, 2))  # noqa: E731
    # Aborted by its owner.
    stream = open_stream(stub, "ops-tok", "a long one", "", rid)
    next(stream)
    abort(stub, "ops-tok", rid)
    assert list(stream)[-1].finish_reason == model_pb2.FINISH_REASON_ABORT
    assert reuse()[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
    # Cancelled by its client mid-stream.
    stream = open_stream(stub, "ops-tok", "a long one", "", rid)
    next(stream)
    stream.cancel()
    wait_for(lambda: live_ids(replica) == 0, 10, "the cancelled request's id to be freed")
    assert reuse()[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
    # Its deadline passed.
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(request("a long one", "", rid, LONG), metadata=md("ops-tok"), timeout=0.5))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: live_ids(replica) == 0, 10, "the expired request's id to be freed")
    assert reuse()[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
    # Refused before it ran: a duplicate, a namespace it may not use, bad input.
    stream = open_stream(stub, "tenant-a-tok", "a long one", SALT_A, rid)
    next(stream)
    expect_status(lambda: generate(stub, "tenant-a-tok", request("x", SALT_A, rid, 2)), grpc.StatusCode.ALREADY_EXISTS)
    expect_status(lambda: generate(stub, "tenant-a-tok", request("x", NAMESPACE_B, rid, 2)),
                  grpc.StatusCode.PERMISSION_DENIED)
    abort(stub, "tenant-a-tok", rid)
    list(stream)
    expect_status(lambda: generate(stub, "tenant-a-tok", request("x", SALT_A, rid, -1)),
                  grpc.StatusCode.INVALID_ARGUMENT)
    assert generate(stub, "tenant-a-tok", request("x", SALT_A, rid, 2))[-1].finish_reason == \
        model_pb2.FINISH_REASON_LENGTH
    wait_until_idle(replica.cache_stub, replica.pool_id)
    wait_for(lambda: live_ids(replica) == 0, 10, "no live request id")


def test_many_tokens_one_id_at_once(replica) -> None:
    """Three tokens run the same id concurrently; each stream is whole and echoes the id."""
    stub = replica.stub
    callers = (("tenant-a-tok", SALT_A), ("tenant-b-tok", NAMESPACE_B), ("ops-tok", ""))
    with ThreadPoolExecutor(len(callers)) as pool:
        futures = [pool.submit(generate, stub, token, request(f"shared id of {token}", namespace, "same", 40))
                   for token, namespace in callers]
        results = [f.result(timeout=120) for f in futures]
    for messages in results:
        assert {m.request_id for m in messages} == {"same"}
        assert messages[-1].usage.completion_tokens == 40 == sum(len(m.token_ids) for m in messages)
    wait_until_idle(replica.cache_stub, replica.pool_id)
    wait_for(lambda: live_ids(replica) == 0, 10, "no live request id")


# ---------------------------------------------------------------------- namespaces of a token


def test_a_namespace_limited_token_may_generate_only_in_its_namespaces(replica) -> None:
    stub = replica.stub
    for namespace in (SALT_A, "", "tenant-c"):
        error = expect_status(lambda ns=namespace: generate(stub, "tenant-b-tok", request("hi", ns)),
                              grpc.StatusCode.PERMISSION_DENIED, "may not use namespace")
        assert "tenant-b" not in (error.details() or "")  # nothing about what the token may use
    assert generate(stub, "tenant-b-tok", request("hi", NAMESPACE_B))[-1].usage.completion_tokens == 4
    for namespace in (SALT_A, NAMESPACE_B, "", "anything"):  # a token without ns= may use any
        assert generate(stub, "ops-tok", request("hi", namespace))[-1].usage.completion_tokens == 4
