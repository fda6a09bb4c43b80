"""One radixkv server (``python -m cache_service`` / ``python -m model_service``) run as a
child process: started in its own process group, its output passed line by line to a sink,
its address read from its ``... listening on HOST:PORT`` line, its readiness from the
standard gRPC health service, and stopped with SIGTERM, then SIGKILL after a grace period.

Used by ``scripts/serve.py`` (``make run``) and by the client tests' fixtures.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.parent_death import ENV_VAR as DIE_WITH_PARENT

LISTENING = re.compile(r"\blistening on (\S+):(\d+)\s*$")

Sink = Callable[[str], None]


class ServiceError(RuntimeError):
    """A service did not start, or died."""


def port_in_use(host: str, port: int) -> bool:
    """True if ``host:port`` cannot be bound because something already uses it.

    SO_REUSEADDR makes a socket in TIME_WAIT (a server that just stopped) not count.
    gRPC servers bind with SO_REUSEPORT, so without this check a second server would share
    the port silently instead of failing.
    """
    if port == 0:
        return False
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return True
                raise
    return False


class ServiceProcess:
    """A started service. ``name`` is its module (``"cache_service"``). ``health_credentials``:
    the channel credentials of its health checks, for a service serving TLS."""

    def __init__(self, name: str, args: Sequence[str], sink: Sink, *, cwd: str | None = None,
                 health_credentials: grpc.ChannelCredentials | None = None) -> None:
        self.name = name
        self.health_credentials = health_credentials
        self.argv = [sys.executable, "-u", "-m", name, *args]
        self._sink = sink
        self._listening = threading.Event()
        self.addr: str | None = None
        # The child makes itself die with us (common/parent_death.py): no preexec_fn, which would
        # run Python between fork and exec and crash the child while we have gRPC threads.
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{DIE_WITH_PARENT: str(os.getpid())})
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            errors="replace",
            cwd=cwd,
            env=env,
            process_group=0,  # Ctrl-C at the terminal reaches the launcher only; it stops us in order
        )
        self._pump = threading.Thread(target=self._read_output, name=f"{name}-output", daemon=True)
        self._pump.start()

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            if not line:
                continue  # progress bars redraw with "\r": their blank remains are noise
            match = LISTENING.search(line)
            if match and not self._listening.is_set():
                self.addr = f"{match.group(1)}:{match.group(2)}"
                self._listening.set()
            self._sink(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_listening(
        self, timeout_s: float, stop: threading.Event | None = None, watch: Sequence[ServiceProcess] = ()
    ) -> str:
        """Waits for the ``listening on HOST:PORT`` line; returns ``HOST:PORT``.

        Gives up (ServiceError) when this process or one in ``watch`` exits, or ``stop`` is set.
        """
        deadline = time.monotonic() + timeout_s
        while not self._listening.wait(0.1):
            self._check_alive(stop, watch)
            if time.monotonic() > deadline:
                raise ServiceError(f"{self.name} printed no 'listening on' line within {timeout_s:g} s")
        assert self.addr is not None
        return self.addr

    def wait_serving(
        self,
        timeout_s: float,
        *,
        stop: threading.Event | None = None,
        progress: Callable[[float], None] | None = None,
        progress_every_s: float = 10.0,
        watch: Sequence[ServiceProcess] = (),
    ) -> None:
        """Waits for the ``listening on`` line, then polls grpc.health.v1 ``Check("")`` until
        SERVING; calls ``progress(elapsed_s)`` every ``progress_every_s`` meanwhile.

        Gives up (ServiceError) when this process or one in ``watch`` exits, or ``stop`` is set.
        """
        start = time.monotonic()
        next_progress = start + progress_every_s
        channel: grpc.Channel | None = None
        try:
            while True:
                self._check_alive(stop, watch)
                if channel is None and self._listening.is_set():
                    assert self.addr is not None
                    channel = (grpc.insecure_channel(self.addr) if self.health_credentials is None
                               else grpc.secure_channel(self.addr, self.health_credentials))
                if channel is not None and _is_serving(channel):
                    return
                now = time.monotonic()
                if now - start > timeout_s:
                    state = "was not SERVING" if channel is not None else "printed no 'listening on' line"
                    raise ServiceError(f"{self.name} {state} within {timeout_s:g} s")
                if progress is not None and now >= next_progress:
                    progress(now - start)
                    next_progress = now + progress_every_s
                if channel is None:
                    self._listening.wait(0.25)
                else:
                    time.sleep(0.25)
        finally:
            if channel is not None:
                channel.close()

    def _check_alive(self, stop: threading.Event | None, watch: Sequence[ServiceProcess]) -> None:
        if stop is not None and stop.is_set():
            raise ServiceError(f"stopped while waiting for {self.name}")
        for process in (self, *watch):
            code = process.proc.poll()
            if code is not None:
                raise ServiceError(f"{process.name} exited with code {code} while {self.name} was starting")

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL it. Returns the exit
        code (negative: killed by that signal)."""
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._sink(f"did not stop within {grace_s:g} s after SIGTERM; sending SIGKILL")
            self._signal_group(signal.SIGKILL)
            self.proc.wait(10.0)
        self._signal_group(signal.SIGKILL)  # anything the service itself started
        self._pump.join(2.0)
        return self.proc.returncode

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _is_serving(channel: grpc.Channel) -> bool:
    """One grpc.health.v1 Check of the whole server (service "")."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2.0
        )
    except grpc.RpcError:
        return False  # not up yet (UNAVAILABLE) or health not registered yet
    return reply.status == health_pb2.HealthCheckResponse.SERVING
