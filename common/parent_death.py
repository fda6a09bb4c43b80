"""Die with the launcher: a server started by scripts/service_process.py asks Linux to SIGTERM
it when the launching process dies (even by SIGKILL), so a killed launcher or test run leaves no
orphan servers.

The launcher only sets an environment variable; the server makes the prctl call itself, first
thing in its `main()`. Doing it in a `preexec_fn` instead would run Python code in the child
between fork and exec, which crashes the child when the launcher has gRPC threads running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

ENV_VAR = "RADIXKV_DIE_WITH_PARENT"  # the launcher's pid
_PR_SET_PDEATHSIG = 1


def die_with_parent_if_asked() -> None:
    """Applies ENV_VAR when set (Linux only; elsewhere a no-op)."""
    parent = os.environ.pop(ENV_VAR, "")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)
