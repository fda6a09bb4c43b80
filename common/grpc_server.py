"""What every radixkv gRPC server sets up the same way: its printed address, and the standard
grpc.health.v1 and reflection services next to its own."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Iterable

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


DEFAULT_GRACE_SECONDS = 2.0


def add_grace_arg(parser) -> None:
    """--grace-seconds: how long in-flight calls may run on after SIGTERM (new ones are refused)."""
    parser.add_argument("--grace-seconds", type=float, default=DEFAULT_GRACE_SECONDS,
                        help="after SIGTERM, in-flight calls get this long to finish; new calls are refused "
                             f"with UNAVAILABLE (default {DEFAULT_GRACE_SECONDS:g})")


def grace_from_args(args, parser) -> float:
    if args.grace_seconds < 0:
        parser.error("--grace-seconds must be >= 0")
    return args.grace_seconds


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


def end_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """Ends the call with `code` and `message` once the handler returns (a unary one returns
    None, a streaming one stops yielding). Instead of context.abort, which raises: the raised
    error's traceback holds the handler's frames (the request among them) in a reference cycle
    with gRPC's own, so every refused request's memory would wait for a full cycle collection,
    which the cache manager runs rarely (cache_service/collector.py)."""
    context.set_code(code)
    context.set_details(message)


# ---------------------------------------------------------------------- servers and servicers


def new_server(limits, interceptors=()) -> grpc.aio.Server:
    """A grpc.aio server with the transport limits of `limits` (common/limits.ServerLimits)."""
    return grpc.aio.server(options=limits.options(), interceptors=list(interceptors))


def _parser(message_class, check):
    """request bytes -> message, or (None, why) when they do not parse or break an id limit."""

    def parse(data: bytes):
        try:
            message = message_class.FromString(data)
        except (DecodeError, ValueError) as e:
            return None, f"request is not a valid {message_class.DESCRIPTOR.full_name}: {e}"[:512]
        why = check(message) if check is not None else None
        return (None, why) if why is not None else (message, None)

    return parse


def servicer_handler(servicer: object, service, check=None) -> grpc.GenericRpcHandler:
    """The generic handler of a generated servicer (protobuf ServiceDescriptor `service`) whose
    requests arrive as raw bytes and are parsed in the handler: bytes that are not the request
    message (invalid UTF-8 in a string, corrupt varint, garbage), or that `check(message)`
    names a reason against (e.g. common.limits.id_error), end with INVALID_ARGUMENT instead of
    grpc's UNKNOWN plus a logged traceback (in a stream of requests: at the first such message,
    the ones before it served). A servicer may return (or yield) a response already
    serialized, as bytes. Method names and kinds are those of the descriptor,
    so interceptors (common/auth.py) see the usual '/pkg.Service/Method'."""
    handlers = {}
    for method in service.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        parse = _parser(request_class, check)
        serialize = _serializer(response_class)
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _bidi(behavior, parse), request_deserializer=None, response_serializer=serialize)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _streaming(behavior, parse), request_deserializer=None, response_serializer=serialize)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(behavior, parse), request_deserializer=None, response_serializer=serialize)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _serializer(message_class):
    """Serializes a response message; bytes a servicer serialized itself (a large payload written
    without protobuf's copy: model_service/kv_pulls/page_data.py) pass as they are."""
    serialize = message_class.SerializeToString

    def to_bytes(message) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return to_bytes


# The raw bytes of the unary request being handled (each call runs in a task of its own, so
# this is per call): a servicer that records requests (the durable cache manager's journal) uses
# them as they arrived instead of serializing the parsed message again.
request_bytes: contextvars.ContextVar[bytes] = contextvars.ContextVar("request_bytes", default=b"")


def _unary(behavior, parse):
    async def call(data: bytes, context: grpc.aio.ServicerContext):
        request, why = parse(data)
        if request is None:
            return end_call(context, grpc.StatusCode.INVALID_ARGUMENT, why)
        request_bytes.set(data)
        return await behavior(request, context)

    return call


def _streaming(behavior, parse):
    async def stream(data: bytes, context: grpc.aio.ServicerContext):
        request, why = parse(data)
        if request is None:
            end_call(context, grpc.StatusCode.INVALID_ARGUMENT, why)
            return
        async with contextlib.aclosing(behavior(request, context)) as messages:
            async for message in messages:
                yield message

    return stream


def _bidi(behavior, parse):
    """A stream of requests: each parsed as it arrives, `request_bytes` set to its bytes while the
    servicer handles it (the servicer reads the next one only after answering this one)."""
    async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        async def parsed():
            async for data in requests:
                request, why = parse(data)
                if request is None:
                    end_call(context, grpc.StatusCode.INVALID_ARGUMENT, why)
                    return
                request_bytes.set(data)  # generators run in their caller's context: the handler's
                yield request

        async with contextlib.aclosing(parsed()) as inputs, \
                contextlib.aclosing(behavior(inputs, context)) as messages:
            async for message in messages:
                yield message

    return stream


def add_servicer(server: grpc.aio.Server, servicer: object, service, check=None) -> None:
    """Registers `servicer` for `service` with servicer_handler (raw bytes parsed inside)."""
    server.add_generic_rpc_handlers((servicer_handler(servicer, service, check),))
