"""The Prometheus /metrics HTTP endpoint every radixkv server runs on --metrics-port.

The endpoint is plain HTTP without tokens, so it binds `--metrics-host` (default loopback), not the
gRPC `--host`: a server listening on every interface for its clients (`--host 0.0.0.0`, as in a
container) still keeps its metrics private unless told where scrapers reach it (a pod IP, or
0.0.0.0 behind a NetworkPolicy that admits only the monitoring namespace).
"""

from __future__ import annotations

import argparse

from prometheus_client import CollectorRegistry, start_http_server

DEFAULT_METRICS_HOST = "127.0.0.1"


def add_metrics_args(parser: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-host, the same on every server."""
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="Prometheus /metrics port, plain HTTP without tokens (off when not given)")
    parser.add_argument("--metrics-host", default=DEFAULT_METRICS_HOST, metavar="ADDR",
                        help=f"address the metrics port binds (default {DEFAULT_METRICS_HOST}, whatever --host "
                             "is); a pod IP or 0.0.0.0 only for scrapers inside the cluster, behind a "
                             "NetworkPolicy")


class MetricsServer:
    """Serves one registry; port 0 picks a free port."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._http = None

    def serve(self, port: int, host: str = DEFAULT_METRICS_HOST) -> int:
        """Starts the endpoint on host:port (raises OSError when it cannot be bound: the port is
        taken, the address is not this machine's or does not resolve); returns the bound port."""
        self._http, _thread = start_http_server(port, addr=host.strip("[]"), registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
