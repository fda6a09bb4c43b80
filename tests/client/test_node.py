"""The Node.js client (client/node/radixkv.js), run with `node` against the real services."""

from __future__ import annotations

import json
import subprocess

from client import RadixKVClient
from tests.client.helpers import PROMPT, REPO, free_port
from tests.services import Running

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
