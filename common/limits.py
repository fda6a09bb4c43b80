"""Limits every radixkv gRPC server enforces, in one place (docs/security.md#limits).

Transport (all three servers, `ServerLimits`, flags `--max-receive-message-mb` and
`--max-concurrent-streams`): the largest request message a server reads, the most concurrent
streams per HTTP/2 connection, and keepalive enforcement (a client pinging more often than
every `MIN_PING_INTERVAL_MS` without data gets GOAWAY after `MAX_PING_STRIKES` strikes; the
server pings idle connections every `KEEPALIVE_TIME_MS` and drops those that do not answer in
`KEEPALIVE_TIMEOUT_MS`).

Per request: ids and namespaces (request_id, pool_id, worker_id, namespace) are at most
`MAX_ID_BYTES` UTF-8 bytes, checked for every message of every radixkv RPC before its handler
runs (INVALID_ARGUMENT naming the limit). The model service's own request limits (stop strings,
prompt bytes) are `RequestLimits`.

Status messages quote client-supplied ids through `quote_id`, which shortens them, so a message
never grows with what the caller sent.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from google.protobuf import message as pb_message

# Longest request_id / pool_id / worker_id / namespace, in UTF-8 bytes.
MAX_ID_BYTES = 256
ID_FIELDS = frozenset({"request_id", "pool_id", "worker_id", "namespace"})
# How many characters of an id a status message quotes.
QUOTE_CHARS = 64

DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_CONCURRENT_STREAMS = 4096
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000
MIN_PING_INTERVAL_MS = 10_000
MAX_PING_STRIKES = 2

DEFAULT_MAX_STOP_STRINGS = 64
# SamplingParams' ranges both servers check (the router's OpenAI door before it forwards):
MAX_LOGPROBS = 20  # alternatives per token, logprobs and prompt_logprobs (vLLM's default cap)
MAX_CHOICES = 64  # SamplingParams.n
DEFAULT_MAX_STOP_BYTES = 16 * 1024
DEFAULT_MAX_PROMPT_BYTES = 4 * 1024 * 1024


def quote_id(value: object, limit: int = QUOTE_CHARS) -> str:
    """repr() of a client-supplied id, cut to `limit` characters with an ellipsis and its length."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Transport limits of a gRPC server (see the module docstring)."""

    max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS

    def options(self) -> list[tuple[str, int]]:
        """grpc.aio.server options: the limits, keepalive enforcement, and so_reuseport off (a
        second server on a busy port must fail, not silently share it)."""
        return [
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request limits of a ModelService (the model service and the router)."""

    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_bytes: int = DEFAULT_MAX_STOP_BYTES
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES


def add_server_limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-receive-message-mb", type=float, default=DEFAULT_MAX_RECEIVE_MESSAGE_BYTES / 2**20,
                        help="largest request message read, in MiB (larger: RESOURCE_EXHAUSTED; default 64)")
    parser.add_argument("--max-concurrent-streams", type=int, default=DEFAULT_MAX_CONCURRENT_STREAMS,
                        help=f"most concurrent RPCs per client connection (default {DEFAULT_MAX_CONCURRENT_STREAMS})")


def server_limits_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerLimits:
    if args.max_receive_message_mb <= 0:
        parser.error("--max-receive-message-mb must be > 0")
    if args.max_concurrent_streams < 1:
        parser.error("--max-concurrent-streams must be >= 1")
    return ServerLimits(int(args.max_receive_message_mb * 2**20), args.max_concurrent_streams)


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                        help=f"most stop strings per request (default {DEFAULT_MAX_STOP_STRINGS})")
    parser.add_argument("--max-stop-bytes", type=int, default=DEFAULT_MAX_STOP_BYTES,
                        help=f"most UTF-8 bytes of all stop strings of a request (default {DEFAULT_MAX_STOP_BYTES})")
    parser.add_argument("--max-prompt-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES,
                        help=f"most UTF-8 bytes of a text prompt or of all chat contents (default "
                             f"{DEFAULT_MAX_PROMPT_BYTES})")


def request_limits_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RequestLimits:
    for flag in ("max_stop_strings", "max_stop_bytes", "max_prompt_bytes"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    return RequestLimits(args.max_stop_strings, args.max_stop_bytes, args.max_prompt_bytes)


def request_limit_error(request: object, limits: RequestLimits) -> str | None:
    """Why a GenerateRequest / TokenizeRequest breaks `limits` (None: it does not)."""
    sampling = getattr(request, "sampling", None)
    if sampling is not None:
        stop = sampling.stop
        if len(stop) > limits.max_stop_strings:
            return f"{len(stop)} stop strings; the limit is {limits.max_stop_strings} (max_stop_strings)"
        total = sum(len(s.encode()) for s in stop)
        if total > limits.max_stop_bytes:
            return f"stop strings total {total} bytes; the limit is {limits.max_stop_bytes} bytes (max_stop_bytes)"
    kind = request.WhichOneof("input")  # type: ignore[attr-defined]
    if kind in ("prompt", "text"):
        size = len(getattr(request, kind).encode())
    elif kind == "chat":
        size = sum(len(m.content.encode()) + len(m.role.encode()) + len(m.tool_calls_json.encode())
                   + len(m.tool_call_id.encode()) + len(m.name.encode()) for m in request.chat.messages)  # type: ignore
    else:
        size = 0
    if size > limits.max_prompt_bytes:
        return f"prompt has {size} bytes; the limit is {limits.max_prompt_bytes} bytes (max_prompt_bytes)"
    return None


# Per message type: its id fields and the message fields that can lead to one, in field-number
# order: ("id", name) or ("message", name, repeated). Types with no id anywhere below are left out.
_IdPlan = tuple[tuple, ...]
_ID_PLANS: dict[object, _IdPlan] = {}
_PLANNING: _IdPlan = (("planning",),)  # a type whose plan is being made (recursive types): walked


def _id_plan(descriptor) -> _IdPlan:
    plan = _ID_PLANS.get(descriptor)
    if plan is not None:
        return plan
    _ID_PLANS[descriptor] = _PLANNING
    steps = []
    for field in sorted(descriptor.fields, key=lambda f: f.number):
        if field.message_type is not None:
            if not field.message_type.GetOptions().map_entry and _id_plan(field.message_type):
                steps.append(("message", field.name, field.is_repeated))
        elif field.name in ID_FIELDS and field.type == field.TYPE_STRING and not field.is_repeated:
            steps.append(("id", field.name))
    plan = _ID_PLANS[descriptor] = tuple(steps)
    return plan


def id_error(message: pb_message.Message) -> str | None:
    """Why a request message breaks MAX_ID_BYTES (None: it does not). Walks its id fields and the
    nested messages that can hold one (a plan per message type, made once); only the id fields'
    lengths are measured."""
    for step in _id_plan(message.DESCRIPTOR):
        if step[0] == "id":
            value = getattr(message, step[1])
            if len(value) * 4 > MAX_ID_BYTES:  # else even 4-byte characters fit
                size = len(value.encode())
                if size > MAX_ID_BYTES:
                    return f"{step[1]} has {size} bytes; the limit is {MAX_ID_BYTES} bytes (max_id_bytes)"
        elif step[2]:
            for item in getattr(message, step[1]):
                why = id_error(item)
                if why is not None:
                    return why
        elif message.HasField(step[1]):
            why = id_error(getattr(message, step[1]))
            if why is not None:
                return why
    return None
