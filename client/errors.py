"""The one exception the client raises for a failed RPC."""

from __future__ import annotations

import grpc


class RadixKVError(Exception):
    """A radixkv RPC failed.

    ``code`` is the gRPC status code (``grpc.StatusCode.UNAVAILABLE`` ...), ``message`` the
    server's (or gRPC's) explanation and ``method`` the RPC that failed (``"Generate"``).
    ``str(error)`` reads ``"CODE_NAME: message"``.
    """

    def __init__(self, code: grpc.StatusCode, message: str, method: str = "") -> None:
        self.code = code
        self.message = message
        self.method = method
        super().__init__(f"{code.name}: {message}")

    @property
    def code_name(self) -> str:
        """The status code's name, e.g. ``"DEADLINE_EXCEEDED"``."""
        return self.code.name

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, method: str, timeout: float | None) -> RadixKVError:
        """Wraps a ``grpc.RpcError`` (sync or aio), adding the timeout to a deadline message."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else None) or ""
        if code is None:
            code = grpc.StatusCode.UNKNOWN
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
            details = (
                f"{method} did not finish within the {timeout:g} s timeout ({details or 'deadline exceeded'})"
            )
        return cls(code, details or code.name.lower().replace("_", " "), method)
