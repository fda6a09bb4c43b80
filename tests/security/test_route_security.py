"""Route, Match and Stats against a real cache manager process with --auth-token-file: what a
namespace-limited token can learn of other namespaces (nothing), who may record and pin, and
the size limits that keep Route from growing the server's memory.

The attacker model: a token limited to ns=tenant-b that knows the documented page hash
(cache.proto: XXH3-64 chained with the namespace's seed, which is public) and so can compute
the hash chain of any prompt in any namespace."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from cache_service.__main__ import main as cache_main
from cache_service.page_hash import page_hashes
from protos import cache_pb2 as pb
from tests.cache.conftest import ServerProcess, spawn_server, stop_server

BS = 4
TOKENS = """\
admin-tok
replica-tok replica
router-tok reader,router
reader-tok reader
tenant-b-tok reader ns=tenant-b
tenant-b-router reader,router ns=tenant-b
"""


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("route-security")
    (tmp / "tokens").write_text(TOKENS)
    server = spawn_server(tmp / "stderr", "--auth-token-file", str(tmp / "tokens"))
    try:
        yield server
    finally:
        stop_server(server)


def register(cache: ServerProcess, worker: str, num_blocks: int = 32) -> pb.RegisterPoolResponse:
    return cache.stub.RegisterPool(pb.RegisterPoolRequest(
        worker_id=worker, num_blocks=num_blocks, block_size=BS, model_fingerprint=worker,
        serving_addr=f"127.0.0.1:{7000 + len(worker)}"), metadata=md("replica-tok"), timeout=5)


def step(cache: ServerProcess, reg: pb.RegisterPoolResponse, **items) -> pb.StepResponse:
    return cache.stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, **items),
                           metadata=md("replica-tok"), timeout=10)


def cache_prompt(cache: ServerProcess, reg: pb.RegisterPoolResponse, tokens: list[int], namespace: str,
                 rid: str) -> None:
    (adm,) = step(cache, reg, admits=[pb.Admit(request_id=rid, token_ids=tokens + [1], namespace=namespace)]).admits
    assert adm.status == pb.ADMIT_STATUS_ADMITTED
    step(cache, reg, finishes=[pb.Finish(request_id=rid, num_computed_tokens=len(tokens))])


def route(cache: ServerProcess, token: str, reg: pb.RegisterPoolResponse, **fields) -> pb.RouteResponse:
    return cache.stub.Route(pb.RouteRequest(model_fingerprint=reg.pool_id, **fields), metadata=md(token), timeout=30)


def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""


def test_a_namespace_limited_reader_learns_nothing_of_other_namespaces(cache: ServerProcess) -> None:
    reg = register(cache, "iso")
    secret = list(range(300, 332))  # 8 pages
    probes = {
        "hashes of tenant-a": dict(page_hashes=page_hashes(0, "tenant-a", secret, BS)),
        "hashes of the default namespace": dict(page_hashes=page_hashes(0, "", secret, BS)),
        "tokens": dict(token_ids=secret + [1]),
    }

    def look() -> dict[str, bytes]:
        seen = {name: route(cache, "tenant-b-tok", reg, namespace="tenant-b", dry_run=True, **probe)
                for name, probe in probes.items()}
        match = cache.stub.Match(pb.MatchRequest(token_ids=secret + [1], namespace="tenant-b", model_fingerprint=reg.pool_id),
                                 metadata=md("tenant-b-tok"), timeout=5)
        return {**{k: v.SerializeToString(deterministic=True) for k, v in seen.items()},
                "match": match.SerializeToString(deterministic=True)}

    before = look()
    cache_prompt(cache, reg, secret, "tenant-a", "a1")
    cache_prompt(cache, reg, secret[:16], "", "d1")
    # The owner sees it cached (so the probe below is not vacuous) ...
    own = route(cache, "admin-tok", reg, namespace="tenant-a", dry_run=True, **probes["hashes of tenant-a"])
    assert own.candidates[0].matched_tokens == 32
    # ... tenant-b gets exactly the answers it got when nobody held those tokens.
    after = look()
    for name in before:
        assert after[name] == before[name], f"{name}: the answer changed when another namespace cached the prompt"
    assert all(c.matched_tokens == 0 for c in pb.RouteResponse.FromString(after["hashes of tenant-a"]).candidates)


def test_routed_prompts_of_another_namespace_are_not_promised_to_a_limited_token(cache: ServerProcess) -> None:
    reg = register(cache, "promise")
    prompt = list(range(400, 432))
    route(cache, "router-tok", reg, token_ids=prompt + [1], namespace="tenant-a", request_id="ra")
    probe = dict(page_hashes=page_hashes(0, "tenant-a", prompt, BS), dry_run=True)
    (seen,) = route(cache, "tenant-b-tok", reg, namespace="tenant-b", **probe).candidates
    assert (seen.matched_tokens, seen.routed_prefix_tokens, seen.prefill_tokens) == (0, 0, 32)
    (owner,) = route(cache, "admin-tok", reg, namespace="tenant-a", **probe).candidates
    assert owner.routed_prefix_tokens == 32


def test_stats_needs_a_token_without_a_namespace_limit(cache: ServerProcess) -> None:
    register(cache, "stats")
    code, details = refused(lambda: cache.stub.Stats(pb.StatsRequest(), metadata=md("tenant-b-tok"), timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "without ns=" in details
    code, _ = refused(lambda: cache.stub.Stats(pb.StatsRequest(pool_id="stats"), metadata=md("tenant-b-tok"),
                                               timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "stats" in {p.pool_id for p in cache.stub.Stats(pb.StatsRequest(), metadata=md("reader-tok"),
                                                           timeout=5).pools}


def test_recording_or_pinning_needs_the_router_role(cache: ServerProcess) -> None:
    reg = register(cache, "roles")
    prompt = list(range(500, 516))
    cache_prompt(cache, reg, prompt, "", "seed")
    for fields in (dict(request_id="x", reserve_ms=1000), dict(request_id="x")):
        code, details = refused(lambda f=fields: route(cache, "reader-tok", reg, token_ids=prompt + [1], **f))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "'router' role" in details
    (stats,) = cache.stub.Stats(pb.StatsRequest(pool_id="roles"), metadata=md("admin-tok"), timeout=5).pools
    assert stats.num_reservations == 0 and stats.num_locked_blocks == 0
    assert route(cache, "reader-tok", reg, token_ids=prompt + [1], request_id="x", dry_run=True).candidates
    (best,) = route(cache, "router-tok", reg, token_ids=prompt + [1], request_id="x", reserve_ms=1000).candidates
    assert best.reserved


def test_pins_are_capped_so_admissions_still_fit(cache: ServerProcess) -> None:
    reg = register(cache, "pins", num_blocks=64)
    prompts = [list(range(1000 * (i + 1), 1000 * (i + 1) + 16)) for i in range(12)]  # 4 pages each
    for i, tokens in enumerate(prompts):
        cache_prompt(cache, reg, tokens, "", f"seed{i}")
    reserved = [route(cache, "router-tok", reg, token_ids=tokens + [1], request_id=f"r{i}",
                      reserve_ms=60_000).candidates[0].reserved for i, tokens in enumerate(prompts)]
    assert reserved == [True] * 4 + [False] * 8  # --max-pinned-fraction 0.25 of 64 blocks: 16
    (stats,) = cache.stub.Stats(pb.StatsRequest(pool_id="pins"), metadata=md("admin-tok"), timeout=5).pools
    assert stats.num_reservations == 4 and stats.num_locked_blocks == 16
    (adm,) = step(cache, reg, admits=[pb.Admit(request_id="big", token_ids=list(range(5000, 5161)))]).admits
    assert adm.status == pb.ADMIT_STATUS_ADMITTED  # 41 blocks: 16 free + 32 evictable


def test_an_oversized_route_is_refused_before_it_costs_memory(cache: ServerProcess) -> None:
    reg = register(cache, "size")  # 32 blocks x 4 tokens: Route takes at most 128 token ids
    assert route(cache, "router-tok", reg, token_ids=list(range(128)), dry_run=True).candidates
    code, details = refused(lambda: route(cache, "router-tok", reg, token_ids=list(range(129))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 128 token ids" in details
    code, details = refused(lambda: route(cache, "router-tok", reg, page_hashes=list(range(33))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 32 page hashes" in details
    process = psutil.Process(cache.proc.pid)
    rss_before = process.memory_info().rss
    huge = [i % 100_000 + 1 for i in range(1_000_000)]
    # Each is ~3 MB on the wire and ~4 MB parsed: one kept alive per refusal (a refused call's
    # frames in a reference cycle, waiting for the rare full collection) would add 12 MiB each.
    for i in range(6):
        code, _ = refused(lambda i=i: route(cache, "router-tok", reg, token_ids=huge, request_id=f"huge{i}"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    grown = process.memory_info().rss - rss_before
    assert grown < 32 << 20, f"the server grew {grown >> 20} MiB"
    start = time.monotonic()
    cache_prompt(cache, reg, list(range(16)), "", "after")
    assert time.monotonic() - start < 1.0
    (stats,) = cache.stub.Stats(pb.StatsRequest(pool_id="size"), metadata=md("admin-tok"), timeout=5).pools
    assert stats.num_cached_blocks == 4 and stats.num_free_blocks == 28


def test_max_pinned_fraction_flag_must_be_a_fraction(capsys) -> None:
    for bad in ("-0.1", "1.5", "nan"):
        with pytest.raises(SystemExit) as err:
            cache_main(["--max-pinned-fraction", bad])
        assert err.value.code == 2
        assert "--max-pinned-fraction must be in [0, 1]" in capsys.readouterr().err


def test_the_server_takes_the_pin_fraction(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(TOKENS)
    server = spawn_server(tmp_path / "stderr", "--auth-token-file", str(tmp_path / "tokens"),
                          "--max-pinned-fraction", "0")
    try:
        reg = register(server, "nopin")
        prompt = list(range(16))
        cache_prompt(server, reg, prompt, "", "seed")
        (best,) = route(server, "router-tok", reg, token_ids=prompt + [1], request_id="x", reserve_ms=1000).candidates
        assert best.matched_tokens == 16 and not best.reserved
    finally:
        stop_server(server)
