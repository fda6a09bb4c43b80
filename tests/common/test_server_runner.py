"""common/server_runner.run_server, on a tiny real gRPC server in its own process
(tests/common/runner_app.py): the order of its hooks, the graceful stop on SIGTERM (health
NOT_SERVING, in-flight calls finish, new ones refused, exit 0), SIGHUP rereading the token file,
and the start errors (gRPC port, bound hook, metrics port) with their exit codes and lines."""

from __future__ import annotations

import collections
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scripts.service_process import ServiceProcess
from tests.common.runner_app import FAIL_BOUND_EXIT_CODE, SERVICE_NAME

REPO = Path(__file__).resolve().parents[2]
APP = "tests.common.runner_app"
START_TIMEOUT_S = 30.0


class App:
    """A started runner_app: its process, address and output lines."""

    def __init__(self, *args: str) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=500)
        self.process = ServiceProcess(APP, list(args), self.lines.append, cwd=str(REPO))
        self.addr = self.process.wait_listening(START_TIMEOUT_S)
        self.process.wait_serving(START_TIMEOUT_S)
        self.channel = grpc.insecure_channel(self.addr)

    def sleep(self, seconds: float, token: str | None = None, timeout: float = 30.0) -> bytes:
        metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
        call = self.channel.unary_unary(f"/{SERVICE_NAME}/Sleep")
        return call(str(seconds).encode(), timeout=timeout, metadata=metadata)

    def health(self) -> int:
        reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        return reply.status

    def wait_line(self, text: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in list(self.lines)):
            assert time.monotonic() < deadline, f"no {text!r} line in:\n" + "\n".join(self.lines)
            time.sleep(0.02)

    def close(self) -> None:
        self.channel.close()
        if self.process.running():
            self.process.stop(5.0)


@pytest.fixture
def start() -> Iterator:
    apps: list[App] = []

    def start_app(*args: str) -> App:
        app = App(*args)
        apps.append(app)
        return app

    yield start_app
    for app in apps:
        app.close()


def run_app(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", APP, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_sigterm_drains_in_flight_calls_then_exits_0(start) -> None:
    app = start("--grace-seconds", "10", "--stopping-pause", "1.0", "--drain-pause", "1.0")
    assert app.health() == health_pb2.HealthCheckResponse.SERVING
    result: dict[str, object] = {}

    def slow_call() -> None:
        try:
            result["reply"] = app.sleep(3.0)
        except grpc.RpcError as error:
            result["error"] = error

    caller = threading.Thread(target=slow_call)
    caller.start()
    time.sleep(0.5)  # the call is in flight
    app.process.proc.send_signal(signal.SIGTERM)
    app.wait_line("hook stopping")
    assert app.health() == health_pb2.HealthCheckResponse.SERVING  # the stopping hook runs before the drain
    app.wait_line("hook stop_server")
    # draining: health says NOT_SERVING while the port is still open
    assert app.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    caller.join(15)
    assert result.get("reply") == b"slept", result  # the in-flight call got its grace period
    assert app.process.proc.wait(15) == 0
    app.process._pump.join(2)
    events = []
    for line in app.lines:
        if line.startswith("hook "):
            events.append(line.split()[1])
        elif "listening on" in line or "shutting down" in line:
            events.append("listening" if "listening on" in line else "shutting down")
    assert events == ["bound", "starting", "started", "listening", "shutting down", "stopping", "stop_server",
                      "stopped"], "\n".join(app.lines)

def test_new_calls_are_refused_once_stopping(start) -> None:
    app = start("--grace-seconds", "5")
    caller = threading.Thread(target=lambda: app.sleep(1.5))  # holds the stop in its grace period
    caller.start()
    time.sleep(0.3)
    app.process.proc.send_signal(signal.SIGTERM)
    app.wait_line("hook stop_server")
    time.sleep(0.3)
    with pytest.raises(grpc.RpcError) as refused:
        app.sleep(0.0, timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    caller.join(10)
    assert app.process.proc.wait(10) == 0


def test_sigint_stops_like_sigterm(start) -> None:
    app = start()
    app.process.proc.send_signal(signal.SIGINT)
    assert app.process.proc.wait(10) == 0
    app.wait_line("hook stopped")


def test_sighup_rereads_the_token_file(start, tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("old-token client\n")
    app = start("--auth-token-file", str(tokens))
    assert app.sleep(0.0, token="old-token") == b"slept"
    with pytest.raises(grpc.RpcError) as before:
        app.sleep(0.0, token="new-token")
    assert before.value.code() == grpc.StatusCode.UNAUTHENTICATED
    tokens.write_text("new-token client\n")
    assert app.sleep(0.0, token="old-token") == b"slept"  # nothing rereads it without SIGHUP
    app.process.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        try:
            assert app.sleep(0.0, token="new-token") == b"slept"
            break
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() < deadline, "SIGHUP did not reload the token file"
            time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as after:
        app.sleep(0.0, token="old-token")
    assert after.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert app.process.running()  # SIGHUP is not a stop


def run_on_busy_port(flag: str) -> tuple[int, subprocess.CompletedProcess]:
    """Runs the app with `flag` set to a port a plain listening socket holds; (port, result)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        return port, run_app(flag, str(port))


def test_busy_port_exits_1_with_a_clear_line() -> None:
    port, out = run_on_busy_port("--port")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"runner_app: cannot listen on 127.0.0.1:{port} (port in use?)" in out.stderr, out.stderr
    assert "listening on" not in out.stdout
    assert "hook" not in out.stdout  # nothing ran past the failed bind


def test_a_startup_error_of_the_bound_hook_ends_with_its_exit_code() -> None:
    out = run_app("--fail-bound")
    assert out.returncode == FAIL_BOUND_EXIT_CODE, out.stdout + out.stderr
    assert "runner_app: the bound hook refused to go on" in out.stderr, out.stderr
    assert "hook starting" not in out.stdout and "listening on" not in out.stdout


def test_metrics_port_that_cannot_be_bound_exits_1() -> None:
    port, out = run_on_busy_port("--metrics-port")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"runner_app: cannot serve metrics on 127.0.0.1:{port}: " in out.stderr, out.stderr
    assert "hook starting" not in out.stdout and "listening on" not in out.stdout


def test_metrics_are_served_and_logged(start) -> None:
    app = start("--metrics-port", "0")
    app.wait_line("metrics on http://127.0.0.1:")
    url = next(line.split(" on ", 1)[1] for line in app.lines if "metrics on http://" in line)
    assert urllib.request.urlopen(url, timeout=5).status == 200
