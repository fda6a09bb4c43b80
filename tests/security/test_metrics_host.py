"""`--metrics-host`: the plain-HTTP, token-less /metrics endpoints bind loopback unless told
otherwise, even when the gRPC port listens on every interface (`--host 0.0.0.0`, as in a
container). Real processes: a cache manager, a model replica of the tiny random Llama and a router,
each asked for `--host 0.0.0.0 --metrics-port P`; the listening sockets of each process are read
from the kernel (psutil)."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import psutil
import pytest

from tests.services import REPO, Running, launch_model, start_cache, start_router
from tests.tiny_model import save_tiny_llama


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return sock.getsockname()[1]


def listening(process: Running, port: int) -> set[str]:
    """The local addresses the process listens on at `port`."""
    conns = psutil.Process(process.process.proc.pid).net_connections(kind="inet")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback (None when there is none)."""
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return addr.address
    return None


def scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, tuple[Running, int]]]:
    """name -> (process, metrics port), all three started with --host 0.0.0.0 and no --metrics-host."""
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("metrics-host-tiny"))
    ports = {name: free_port() for name in ("cache", "model", "router")}
    cache = start_cache(["--host", "0.0.0.0", "--metrics-port", str(ports["cache"])])
    cache_addr = f"127.0.0.1:{cache.addr.rsplit(':', 1)[1]}"
    model_port = free_port()
    started: list[Running] = [cache]
    try:
        model = launch_model(cache_addr, "--model", str(model_dir), "--num-threads", "1", "--num-blocks", "64",
                             "--host", "0.0.0.0", "--port", str(model_port),
                             "--advertise-addr", f"127.0.0.1:{model_port}",
                             "--metrics-port", str(ports["model"])).wait()
        started.append(model)
        router = start_router(cache_addr, "--host", "0.0.0.0", "--replica", f"127.0.0.1:{model_port}",
                              "--metrics-port", str(ports["router"]))
        started.append(router)
        yield {"cache": (cache, ports["cache"]), "model": (model, ports["model"]), "router": (router, ports["router"])}
    finally:
        for running in reversed(started):
            running.process.stop(10.0)


@pytest.mark.parametrize("name", ["cache", "model", "router"])
def test_metrics_bind_loopback_by_default_even_with_host_0000(servers, name) -> None:
    process, port = servers[name]
    assert listening(process, port) == {"127.0.0.1"}, process.output()
    # the gRPC port itself does listen everywhere, as asked
    grpc_port = int(process.addr.rsplit(":", 1)[1])
    assert listening(process, grpc_port) & {"0.0.0.0", "::"}  # gRPC binds 0.0.0.0 dual-stack, as "::"
    assert "# TYPE" in scrape("127.0.0.1", port)
    other = non_loopback_ipv4()
    if other is not None:  # from another interface nothing answers on the metrics port
        with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
            pass


def test_metrics_host_binds_where_told() -> None:
    """`--metrics-host 0.0.0.0` (for a scraper inside the cluster, behind a NetworkPolicy) is honoured,
    and so is a specific address."""
    port = free_port()
    cache = start_cache(["--metrics-port", str(port), "--metrics-host", "0.0.0.0"])
    try:
        assert listening(cache, port) == {"0.0.0.0"}
        other = non_loopback_ipv4()
        if other is not None:
            assert "# TYPE" in scrape(other, port)
    finally:
        cache.process.stop(5.0)
    other = non_loopback_ipv4()
    if other is None:
        return
    port = free_port()
    cache = start_cache(["--host", "0.0.0.0", "--metrics-port", str(port), "--metrics-host", other])
    try:
        assert listening(cache, port) == {other}
        assert "# TYPE" in scrape(other, port)
    finally:
        cache.process.stop(5.0)


@pytest.mark.parametrize("module", ["cache_service", "router"])
def test_a_metrics_host_that_cannot_be_bound_is_a_clear_start_error(module) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--port", "0", "--metrics-port", "0",
                          "--metrics-host", "192.0.2.254"],  # TEST-NET-1: not an address of this machine
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "cannot serve metrics on 192.0.2.254:0" in out.stderr, out.stderr
