"""Small shared helpers for the client tests."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
# Longer than two 16-token blocks, so a repeat of it hits the prefix cache.
LONG_PROMPT = (
    "A radix tree stores token prefixes so that requests sharing a system prompt reuse the "
    "key and value tensors computed for it. Explain in one sentence why that makes serving faster:"
)


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(*args: str, timeout: float = 120.0, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m client ARGS`` from the repo root."""
    return subprocess.run(
        [sys.executable, "-m", "client", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
    )
