"""What every radixkv gRPC server sets up the same way: its printed address, and the standard
grpc.health.v1 and reflection services next to its own."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def format_address(host: str, port: int) -> str:
    """host:port, bracketing IPv6 literals."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def add_health_and_reflection(
    server: grpc.aio.Server, service_name: str, health_servicer: health.aio.HealthServicer | None = None
) -> health.aio.HealthServicer:
    """Registers grpc.health.v1 Health (a new servicer unless one is given) and reflection
    listing `service_name`, Health and reflection itself; returns the health servicer."""
    health_servicer = health_servicer if health_servicer is not None else health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([service_name, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


async def set_health(health_servicer: health.aio.HealthServicer, service_names: Iterable[str],
                     status: health_pb2.HealthCheckResponse.ServingStatus = SERVING) -> None:
    """Sets the status of the whole server ("") and of each named service."""
    for name in ("", *service_names):
        await health_servicer.set(name, status)
