"""The ``make run`` launcher (python -m scripts.serve) as a real process tree."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from client import RadixKVClient
from tests.client.helpers import PROMPT, REPO

UP_LINE = re.compile(r"radixkv is up: model service (\S+), cache service (\S+)")
# replica: the launcher starts a model service (the bundled model) in the tests' own bodies.
pytestmark = pytest.mark.replica


class Launcher:
    """``python -m scripts.serve ARGS`` in a new session, its output collected line by line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.serve", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.output.append(line)
            if match := pattern.search(line):
                return match
        pytest.fail(
            f"no line matching {pattern.pattern!r}; output:\n" + "\n".join(self.output), pytrace=False
        )

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def wait_for_children(self, count: int, timeout_s: float = 30.0) -> list[psutil.Process]:
        """The launcher's child processes, once there are ``count`` of them."""
        deadline = time.monotonic() + timeout_s
        while len(children := self.descendants()) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(children) == count, children
        return children

    def kill(self) -> None:
        for process in self.descendants():
            process.kill()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def assert_all_gone(processes: list[psutil.Process], timeout_s: float = 10.0) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    assert not alive, f"left running: {[(p.pid, p.cmdline()) for p in alive]}"


def test_port_in_use_is_a_clear_error():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "scripts.serve", "--cache-port", str(port), "--model-port", "0"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode != 0
    assert f"port {port} is already in use" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_dying_child_stops_the_other_and_fails():
    launcher = Launcher("--cache-port", "0", "--model-port", "0")
    try:
        launcher.wait_for(re.compile(r"starting model_service"), 60)
        children = launcher.wait_for_children(2)
        (cache,) = [p for p in children if "cache_service" in p.cmdline()]
        cache.kill()
        assert launcher.proc.wait(60) == 1
        launcher.wait_for(re.compile(r"cache_service exited with code -9"), 5)
        assert_all_gone(children)
    finally:
        if launcher.proc.poll() is None:
            launcher.kill()


def test_killing_the_launcher_leaves_no_orphans():
    launcher = Launcher("--cache-port", "0", "--model-port", "0")
    try:
        launcher.wait_for(re.compile(r"starting model_service"), 60)
        children = launcher.wait_for_children(2)
        launcher.proc.kill()  # no chance to clean up: the children's parent-death signal must
        launcher.proc.wait(10)
        assert_all_gone(children, timeout_s=30)
    finally:
        if launcher.proc.poll() is None:
            launcher.kill()


@pytest.mark.model
def test_make_run_serves_and_stops_cleanly_on_sigterm():
    launcher = Launcher("--cache-port", "0", "--model-port", "0", "--num-blocks", "128")
    try:
        up = launcher.wait_for(UP_LINE, 300)
        model_addr, cache_addr = up.group(1), up.group(2)
        children = launcher.descendants()
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert "cache_service" in names and "model_service" in names

        with RadixKVClient(model_addr, cache_addr=cache_addr, timeout=120) as client:
            result = client.generate(PROMPT, max_tokens=4, temperature=0)
            assert result.usage.completion_tokens > 0
            assert client.stats()[0].num_blocks == 128

        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.proc.wait(60) == 0
        assert_all_gone(children)
    finally:
        if launcher.proc.poll() is None:
            launcher.kill()
