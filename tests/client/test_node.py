"""The Node.js client (client/node/radixkv.js), run with `node` against the real services."""

from __future__ import annotations

import json
import subprocess

import grpc

from client import RadixKVClient
from protos import cache_pb2, cache_pb2_grpc
from tests.client.helpers import PROMPT, REPO, free_port
from tests.services import Running, start_cache

SCRIPT = "client/node/radixkv.js"


def run_node(node: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([node, SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_node_generate_streams_the_python_clients_greedy_text(node: str, model_service: Running):
    with RadixKVClient(model_service.addr, timeout=120) as client:
        expected = client.generate(PROMPT, max_tokens=8, temperature=0)
    result = run_node(
        node, "generate", "--addr", model_service.addr, PROMPT, "--max-tokens", "8", "--temperature", "0"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"


def test_node_stats_prints_json_with_the_pool(node: str, model_service: Running, cache_service: Running):
    with RadixKVClient(model_service.addr, timeout=30) as client:
        pool_id = client.model_info().pool_id
    result = run_node(node, "stats", "--addr", cache_service.addr)
    assert result.returncode == 0, result.stderr
    pools = {p["pool_id"]: p for p in json.loads(result.stdout)["pools"]}
    assert pools[pool_id]["num_blocks"] > 0
    assert pools[pool_id]["queried_tokens"].isdigit()  # uint64 as a string (lossless), as in proto3 JSON


def test_node_errors_name_the_status(node: str):
    result = run_node(node, "stats", "--addr", f"127.0.0.1:{free_port()}", "--timeout", "5")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr


def test_node_stats_spans_cache_manager_shards(node: str):
    shards = [start_cache(), start_cache()]
    try:
        pool_ids = []
        for i, shard in enumerate(shards):
            with grpc.insecure_channel(shard.addr) as channel:
                reply = cache_pb2_grpc.CacheManagerStub(channel).RegisterPool(cache_pb2.RegisterPoolRequest(
                    worker_id=f"node-shard-{i}", num_blocks=8, block_size=4), timeout=10)
                pool_ids.append(reply.pool_id)
        addrs = ",".join(s.addr for s in shards)
        result = run_node(node, "stats", "--addr", addrs)
        assert result.returncode == 0, result.stderr
        assert sorted(p["pool_id"] for p in json.loads(result.stdout)["pools"]) == sorted(pool_ids)
        one = run_node(node, "stats", "--addr", addrs, "--pool", pool_ids[1])
        assert one.returncode == 0, one.stderr
        assert [p["pool_id"] for p in json.loads(one.stdout)["pools"]] == [pool_ids[1]]
        missing = run_node(node, "stats", "--addr", addrs, "--pool", "no-such-pool")
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    finally:
        for shard in shards:
            shard.process.stop(5.0)
