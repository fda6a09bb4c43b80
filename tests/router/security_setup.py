"""Shared by the router's security tests (test_router_tenants.py, test_router_trust.py): a
cache manager and one replica of the tiny random Llama as real processes on loopback, client
tokens for the routers, and small helpers. Each test module gets its own processes (module scope):
the trust tests register a rogue pool, which a router of the default (loopback) allowlist would
take as one of its own."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.router.conftest import CHECK_INTERVAL, http_url, replica_args
from tests.services import Running, launch_model, start_cache, start_router

CLIENT_TOKENS = """\
alice-tok client
bob-tok client
tenant-tok client ns=tenant-a
"""
ROUTER_TO_REPLICA = "router-secret-tok\n"


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def greedy(max_tokens: int, **extra) -> model_pb2.SamplingParams:
    return model_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **extra)


def metric(router: Running, name: str, **labels: str) -> float:
    """One sample of the router's /metrics (0 when absent), read with a client token."""
    request = urllib.request.Request(http_url(router) + "/metrics", headers={"authorization": "Bearer alice-tok"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        text = reply.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        metric_name, _, rest = sample.partition("{")
        if not line.startswith("#") and metric_name == name and ",".join(sorted(rest.rstrip("}").split(","))) == want:
            total += float(value)
    return total


@dataclass
class Setup:
    """The running cache manager and replica, the replica's ModelInfo, the token files' folder."""

    cache: Running
    replica: Running
    info: model_pb2.ModelInfoResponse
    tmp: Path

    def cache_stub(self) -> cache_pb2_grpc.CacheManagerStub:
        return cache_pb2_grpc.CacheManagerStub(self._channel(self.cache.addr))

    def model_stub(self, addr: str) -> model_pb2_grpc.ModelServiceStub:
        return model_pb2_grpc.ModelServiceStub(self._channel(addr))

    def _channel(self, addr: str) -> grpc.Channel:
        channel = grpc.insecure_channel(addr)
        self.channels.append(channel)
        return channel

    def __post_init__(self) -> None:
        self.channels: list[grpc.Channel] = []


def run_setup(tiny_model: Path, tmp_path_factory) -> Iterator[Setup]:
    """The body of a test module's `setup` fixture (module scope): started, yielded, stopped."""
    tmp = tmp_path_factory.mktemp("router-security")
    (tmp / "client-tokens").write_text(CLIENT_TOKENS)
    (tmp / "router-to-replica").write_text(ROUTER_TO_REPLICA)
    cache = start_cache()
    launched = launch_model(cache.addr, *replica_args(tiny_model, "secure-a"))
    try:
        replica = launched.wait()
        with grpc.insecure_channel(replica.addr) as channel:
            info = model_pb2_grpc.ModelServiceStub(channel).ModelInfo(model_pb2.ModelInfoRequest(), timeout=30)
        running = Setup(cache, replica, info, tmp)
        yield running
        for channel in running.channels:
            channel.close()
    finally:
        launched.process.stop(10.0)
        cache.process.stop(5.0)


def router_with_tokens(setup: Setup, *extra: str) -> Running:
    """A router with the HTTP door and CLIENT_TOKENS (--auth-token-file), plus `extra` flags."""
    return start_router(setup.cache.addr, "--http-port", "0", "--check-interval", CHECK_INTERVAL,
                        "--auth-token-file", str(setup.tmp / "client-tokens"), *extra)


def code(call) -> grpc.StatusCode:
    """The status `call()` ends with (OK when it returns)."""
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def post(router: Running, path: str, body: dict, token: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a POST to the router's HTTP door with `token`."""
    request = urllib.request.Request(http_url(router) + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json",
                                              "authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def route_candidates(setup: Setup, token_ids: list[int]) -> list[cache_pb2.RouteCandidate]:
    """The cache manager's Route ranking for a prompt (a dry run: nothing recorded)."""
    request = cache_pb2.RouteRequest(token_ids=token_ids, model_fingerprint=setup.info.model_fingerprint,
                                     dry_run=True)
    return list(setup.cache_stub().Route(request, timeout=10).candidates)
