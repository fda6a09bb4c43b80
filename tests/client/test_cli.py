"""``python -m client`` end to end, as a subprocess, against the real services."""

from __future__ import annotations

import json
import time

import pytest

from client import GenerateResult, RadixKVClient
from tests.client.helpers import PROMPT, free_port, run_cli
from tests.services import SHARED_NUM_BLOCKS as MODEL_NUM_BLOCKS
from tests.services import Running


@pytest.fixture(scope="module")
def greedy(model_service: Running) -> GenerateResult:
    with RadixKVClient(model_service.addr, timeout=120) as client:
        return client.generate(PROMPT, max_tokens=8, temperature=0)


def gen(model_service: Running, *extra: str) -> list[str]:
    return [
        "generate",
        PROMPT,
        "--addr",
        model_service.addr,
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        *extra,
    ]


def test_generate_prints_only_the_completion(model_service: Running, greedy: GenerateResult):
    result = run_cli(*gen(model_service))
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy.text + "\n"
    assert greedy.text.strip()


def test_generate_json_has_text_tokens_finish_reason_and_usage(
    model_service: Running, greedy: GenerateResult
):
    result = run_cli(*gen(model_service, "--json"))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["text"] == greedy.text
    assert out["token_ids"] == greedy.token_ids
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] == len(out["token_ids"]) <= 8
    assert out["usage"]["prompt_tokens"] > 0
    assert out["usage"]["time_to_first_token"] > 0


def test_stream_prints_the_same_text_as_generate(model_service: Running, greedy: GenerateResult):
    result = run_cli(*gen(model_service, "--stream"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy.text + "\n"


def test_stream_json_prints_one_object_per_chunk(model_service: Running, greedy: GenerateResult):
    result = run_cli(*gen(model_service, "--stream", "--json"))
    assert result.returncode == 0, result.stderr
    chunks = [json.loads(line) for line in result.stdout.splitlines()]
    assert "".join(c["text"] for c in chunks) == greedy.text
    assert chunks[-1]["finish_reason"] in ("stop", "length") and chunks[-1]["usage"] is not None
    assert all(c["finish_reason"] is None for c in chunks[:-1])


def test_chat_and_stdin_prompt(model_service: Running):
    result = run_cli("generate", "-", "--chat", "--json", "--addr", model_service.addr,
                     "--temperature", "0", "--max-tokens", "4", stdin="Say hello.")  # fmt: skip
    assert result.returncode == 0, result.stderr
    chat = json.loads(result.stdout)
    plain = run_cli(*gen(model_service, "--json"))
    # The chat template wraps the message, so the prompt is longer than the bare text.
    assert chat["usage"]["prompt_tokens"] > len("Say hello.".split())
    assert json.loads(plain.stdout)["usage"]["prompt_tokens"] > 0


def test_stop_string_ends_the_completion_before_it(model_service: Running, greedy: GenerateResult):
    words = greedy.text.split()
    if len(words) < 2:
        pytest.skip(f"greedy completion too short to pick a stop string: {greedy.text!r}")
    stop = words[1]
    result = run_cli(*gen(model_service, "--json", "--stop", stop))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["finish_reason"] == "stop"
    assert out["matched_stop"] == stop
    assert out["text"] == greedy.text[: greedy.text.index(stop)]


def test_invalid_argument_exits_nonzero_with_the_status_name(model_service: Running):
    result = run_cli("generate", PROMPT, "--addr", model_service.addr, "--max-tokens", "0")
    assert result.returncode != 0
    assert "INVALID_ARGUMENT" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_unreachable_address_exits_with_unavailable_within_the_timeout():
    start = time.monotonic()
    result = run_cli("generate", PROMPT, "--addr", f"127.0.0.1:{free_port()}", "--timeout", "5", timeout=30)
    assert time.monotonic() - start < 15
    assert result.returncode != 0
    assert "UNAVAILABLE" in result.stderr
    assert "Traceback" not in result.stderr


def test_stats_prints_a_table_with_the_pool(model_service: Running, cache_service: Running, greedy):
    with RadixKVClient(model_service.addr, timeout=30) as client:
        pool_id = client.model_info().pool_id
    result = run_cli("stats", "--cache-addr", cache_service.addr)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    for column in ("POOL", "BLOCKS", "FREE", "CACHED", "LOCKED", "HIT RATE", "EVICTED"):
        assert column in header
    (row,) = [r for r in rows if r.split()[0] == pool_id]
    assert row.split()[1] == str(MODEL_NUM_BLOCKS)
    assert "%" in row

    as_json = json.loads(run_cli("stats", "--cache-addr", cache_service.addr, "--json").stdout)
    (pool,) = [p for p in as_json["pools"] if p["pool_id"] == pool_id]
    assert (
        pool["num_free_blocks"] + pool["num_cached_blocks"] + pool["num_private_blocks"] == pool["num_blocks"]
    )


def test_tokenize_prints_ids_and_json_tokens(model_service: Running):
    with RadixKVClient(model_service.addr, timeout=30) as client:
        expected = client.tokenize(PROMPT)
    result = run_cli("tokenize", PROMPT, "--addr", model_service.addr)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(t) for t in expected.token_ids]
    out = json.loads(run_cli("tokenize", PROMPT, "--addr", model_service.addr, "--json").stdout)
    assert out["token_ids"] == expected.token_ids
    assert len(out["tokens"]) == len(out["token_ids"])


def test_info_prints_the_model(model_service: Running):
    result = run_cli("info", "--addr", model_service.addr)
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(None, 1) for line in result.stdout.splitlines() if len(line.split(None, 1)) == 2)
    assert fields["block_size"] == "16"
    assert fields["num_blocks"] == str(MODEL_NUM_BLOCKS)
    assert fields["model_name"]
    assert fields["serving_addr"] == model_service.addr


def test_load_prints_the_replica_load(model_service: Running):
    result = run_cli("load", "--addr", model_service.addr)
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(None, 1) for line in result.stdout.splitlines() if len(line.split(None, 1)) == 2)
    assert fields["num_blocks"] == str(MODEL_NUM_BLOCKS) and fields["serving_addr"] == model_service.addr
    as_json = json.loads(run_cli("load", "--addr", model_service.addr, "--json").stdout)
    assert as_json["num_blocks"] == MODEL_NUM_BLOCKS and 0.0 <= as_json["kv_usage"] <= 1.0


def test_abort_of_an_unknown_request_is_not_found(model_service: Running):
    result = run_cli("abort", "no-such-request", "--addr", model_service.addr)
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr and "no-such-request" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_with_a_request_id_echoes_it(model_service: Running):
    result = run_cli(*gen(model_service, "--json", "--request-id", "cli-chosen-id"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["request_id"] == "cli-chosen-id"


def test_stats_shows_the_tiers_of_a_pool_that_has_them(tmp_path):
    """A pool with host and disk tiers: a POOL/TIER row per tier under the pool table, and the
    TierStats in --json (absent tiers are null); a pool without tiers gets no tier row."""
    from protos import cache_pb2 as pb
    from tests.cache.conftest import register, spawn_server, stop_server

    srv = spawn_server(tmp_path / "cache.stderr")
    try:
        register(srv.stub, "plain", num_blocks=8)
        reg = srv.stub.RegisterPool(pb.RegisterPoolRequest(
            worker_id="tiered", num_blocks=4, block_size=4, model_fingerprint="fp",
            tiers=pb.TierConfig(num_host_slots=8, num_disk_slots=6,
                                offload_policy=pb.OFFLOAD_POLICY_WRITE_THROUGH)), timeout=5)
        tokens = list(range(100, 113))
        srv.stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch,
                                     admits=[pb.Admit(request_id="a", token_ids=tokens)]), timeout=5)
        done = srv.stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, finishes=[
            pb.Finish(request_id="a", num_computed_tokens=len(tokens))]), timeout=5)
        (copy,) = done.offloads  # write-through: the 3 pages go down at once
        srv.stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, copy_outcomes=[
            pb.CopyOutcome(copy_id=copy.copy_id, num_pages_copied=len(copy.src))]), timeout=5)
        address = f"{srv.host}:{srv.port}"
        result = run_cli("stats", "--cache-addr", address)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        (tier_header,) = [line for line in lines if line.startswith("TIER ")]
        for column in ("SLOTS", "CACHED", "PENDING", "HIT TOKENS", "LOADED", "OFFLOADED", "FAILED", "EVICTED"):
            assert column in tier_header
        rows = {line.split()[0]: line.split() for line in lines[lines.index(tier_header) + 1:]}
        assert set(rows) == {"tiered/host", "tiered/disk"}
        assert rows["tiered/host"][1:4] == ["8", "3", "0"] and rows["tiered/disk"][1:4] == ["6", "0", "0"]
        assert "write-through" in result.stdout

        pools = {p["pool_id"]: p for p in json.loads(run_cli("stats", "--cache-addr", address, "--json").stdout)["pools"]}
        assert pools["plain"]["host_tier"] is None and pools["plain"]["disk_tier"] is None
        assert pools["tiered"]["host_tier"]["num_cached_pages"] == 3
        assert pools["tiered"]["host_tier"]["num_offloaded_pages"] == 3
        assert pools["tiered"]["disk_tier"]["num_slots"] == 6
        assert pools["tiered"]["offload_policy"] == "write-through"
    finally:
        stop_server(srv)
