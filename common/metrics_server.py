"""The Prometheus /metrics HTTP endpoint every radixkv server runs on --metrics-port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    """Serves one registry; port 0 picks a free port."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._http = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts the endpoint (raises OSError when the port is taken); returns the bound port."""
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
