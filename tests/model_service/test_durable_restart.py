"""The durable cache manager end to end: `kill -9` of the cache manager (`--state-dir`) while 8
streams run, restart on the same port and directory — every stream completes with the greedy
text of an undisturbed run and nothing is recomputed; a prompt cached before the crash is a hit
after it. A replica restarted while the cache manager was down gets a fresh pool."""

from __future__ import annotations

import re
import time
from pathlib import Path

import grpc
import pytest

from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.model_service.checks import (
    count_lines,
    pool_stats,
    port_of,
    start_cache_on,
    wait_for,
    wait_until_idle,
)
from tests.model_service.generation import LONG_DOCUMENT, generate
from tests.model_service.test_failures import start_stream
from tests.services import start_model

pytestmark = pytest.mark.model

MAX_TOKENS = 48
WORDS = LONG_DOCUMENT.split()
# Eight prompts of ~80 tokens, distinct from their first page on (no two share a cached prefix).
PROMPTS = [f"Note {i}: " + " ".join(WORDS[i * 7: i * 7 + 60]) for i in range(8)]


def _tokens(stub: model_pb2_grpc.ModelServiceStub, text: str) -> list[int]:
    return list(stub.Tokenize(model_pb2.TokenizeRequest(text=text), timeout=30).token_ids)


def _generate_all(stub: model_pb2_grpc.ModelServiceStub, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of every prompt, all sent at once (as the crashed streams were)."""
    streams = [start_stream(stub, p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) for p in prompts]
    return [[t for m in s.result(180) for t in m.token_ids] for s in streams]


@pytest.mark.parametrize("pipeline", ["on", "off"])
def test_kill_9_of_the_cache_manager_mid_stream_loses_nothing(tmp_path: Path, pipeline: str) -> None:
    """With the cache Step pipelined (one in flight during each forward) and without."""
    state_dir = str(tmp_path / "state")
    cache = start_cache_on(0, "--state-dir", state_dir)
    model = start_model(cache.addr, "--num-blocks", "512", "--worker-id", "durable-pool", "--cache-pipeline", pipeline)
    try:
        with grpc.insecure_channel(model.addr) as model_channel:
            stub = model_pb2_grpc.ModelServiceStub(model_channel)
            prompts = [_tokens(stub, p) for p in PROMPTS]
            # Undisturbed run: the reference text, and it caches every prompt.
            reference = _generate_all(stub, prompts)
            with grpc.insecure_channel(cache.addr) as channel:
                before = wait_until_idle(cache_pb2_grpc.CacheManagerStub(channel), "durable-pool")
            assert before.num_cached_blocks > 0
            # The same prompts again, with a new tail so each must compute and extend, and a crash midway.
            streams = [start_stream(stub, p + [13], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
                       for p in prompts]
            for s in streams:
                s.wait_tokens(2, 120)
            assert not any(s.done.is_set() for s in streams), "a stream ended before the crash"
            port = port_of(cache.addr)
            cache.process.proc.kill()  # SIGKILL
            cache.process.stop(5.0)
            time.sleep(0.5)  # the model service notices meanwhile (or at its next Step)
            cache = start_cache_on(port, "--state-dir", state_dir)
            results = [s.result(180) for s in streams]
            undisturbed = _generate_all(stub, [p + [13] for p in prompts])
            for got, expected in zip(results, undisturbed, strict=True):
                assert [t for m in got for t in m.token_ids] == expected
                assert got[-1].usage.num_preemptions == 0, "a request was recomputed after the restart"
            assert count_lines(model, "cache pool lost") >= 1, "the crash went unnoticed"
            assert count_lines(model, "re-attached to the kept pool") >= 1, model.output()
            assert count_lines(model, "new cache pool: recomputing") == 0
            assert all(re.search(r"(\d+) recomputed", line).group(1) == "0"
                       for line in model.log if "re-attached to the kept pool" in line)
            # A prompt cached before the crash is a hit after it.
            hit = generate(stub, prompts[0], temperature=0.0, max_tokens=4, ignore_eos=True)
            assert hit.token_ids == reference[0][:4]
            assert hit.final.usage.cached_prompt_tokens > 0
        with grpc.insecure_channel(cache.addr) as channel:
            cache_stub = cache_pb2_grpc.CacheManagerStub(channel)
            stats = wait_until_idle(cache_stub, "durable-pool")
            assert stats.restored and stats.num_restored_cached_blocks >= before.num_cached_blocks
            durability = cache_stub.Stats(cache_pb2.StatsRequest(), timeout=10).durability
            assert durability.num_restored_pools == 1 and durability.num_dropped_pools == 0
    finally:
        model.process.stop(10.0)
        cache.process.stop(5.0)


def test_a_replica_restarted_while_the_cache_manager_was_down_gets_a_fresh_pool(tmp_path: Path) -> None:
    state_dir = str(tmp_path / "state")
    cache = start_cache_on(0, "--state-dir", state_dir)
    port = port_of(cache.addr)
    model = start_model(cache.addr, "--num-blocks", "128", "--worker-id", "reborn-pool")
    try:
        with grpc.insecure_channel(model.addr) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            prompt = _tokens(stub, PROMPTS[0])
            first = generate(stub, prompt, temperature=0.0, max_tokens=4)
        with grpc.insecure_channel(cache.addr) as channel:
            assert wait_until_idle(cache_pb2_grpc.CacheManagerStub(channel), "reborn-pool").num_cached_blocks > 0
        cache.process.proc.kill()
        cache.process.stop(5.0)
        model.process.proc.kill()  # the replica dies too: its KV tensors are gone
        model.process.stop(5.0)
        model = start_model(f"127.0.0.1:{port}", "--num-blocks", "128", "--worker-id", "reborn-pool")
        cache = start_cache_on(port, "--state-dir", state_dir)
        with grpc.insecure_channel(cache.addr) as channel:
            cache_stub = cache_pb2_grpc.CacheManagerStub(channel)
            wait_for(lambda: not pool_stats(cache_stub, "reborn-pool").restored, 60,
                     "the new replica to register a fresh pool")
            fresh = wait_until_idle(cache_stub, "reborn-pool")
            assert fresh.num_cached_blocks == 0 and fresh.num_free_blocks == 128
        with grpc.insecure_channel(model.addr) as channel:
            again = generate(model_pb2_grpc.ModelServiceStub(channel), prompt, temperature=0.0, max_tokens=4)
        assert again.token_ids == first.token_ids
        assert again.final.usage.cached_prompt_tokens == 0, "a block of the old incarnation was reused"
        assert count_lines(model, "re-attached") == 0
    finally:
        model.process.stop(10.0)
        cache.process.stop(5.0)
