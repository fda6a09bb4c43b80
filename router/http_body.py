"""Reading an HTTP request body safely: bounded size, and JSON that cannot hurt the parser.

The door's bodies are small (a full 8k-token context of text is ~30-200 KiB of JSON), so a body
over the limit is refused with 413: at once when Content-Length says so (nothing read), else
when the bytes received (chunked) pass the limit; never more than the limit is held.

JSON is checked before Python parses it, in C-speed passes over the bytes (strings' contents do
not count): nesting deeper than MAX_JSON_DEPTH, or more than MAX_JSON_CONTAINERS arrays and
objects (``[{},{},...]`` costs ~30 bytes of Python objects per input byte) is refused. The parser
itself refuses NaN/Infinity (not JSON), integers over Python's 4300-digit limit and invalid
UTF-8; every refusal is a BodyError with a message for a 400.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

MiB = 1 << 20
DEFAULT_MAX_BODY_BYTES = 16 * MiB
MAX_JSON_DEPTH = 64  # OpenAI requests nest ~4 deep (messages[i].content[j]); JSON schemas ~20
MAX_JSON_CONTAINERS = 100_000  # ~3 per chat message: far above any context's worth of messages


class BodyError(Exception):
    """A body the door refuses: `status` 413 (too large) or 400 (not acceptable JSON)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def describe_limit(limit: int) -> str:
    return f"{limit / MiB:g} MiB" if limit >= MiB else f"{limit} bytes"


def too_large(limit: int) -> BodyError:
    return BodyError(413, f"the request body is larger than this server's limit of {describe_limit(limit)} "
                          "(--max-http-body-mb)", "request_too_large")


def check_content_length(value: str | None, limit: int) -> None:
    """BodyError(413) when a Content-Length header announces more than `limit` bytes (the HTTP
    server has already refused malformed ones)."""
    if value is not None and value.strip().isdigit() and int(value) > limit:
        raise too_large(limit)


async def read_limited(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The body from `chunks`, or BodyError(413) as soon as it passes `limit` bytes: the chunk
    that would pass it is not kept, so at most `limit` bytes are ever held here."""
    body = bytearray()
    async for chunk in chunks:
        if len(body) + len(chunk) > limit:
            raise too_large(limit)
        body += chunk
    return bytes(body)


# Bytes kept by the structure scan: quotes and brackets (everything else is dropped).
_DROP = bytes(b for b in range(256) if b not in b'"[]{}')


def check_structure(raw: bytes, max_depth: int = MAX_JSON_DEPTH, max_containers: int = MAX_JSON_CONTAINERS) -> None:
    """BodyError(400) when `raw` nests arrays/objects deeper than `max_depth` or holds more than
    `max_containers` of them, brackets inside strings not counted. Linear passes in C (bytes
    methods, numpy), no recursion; a body with at most `max_depth` brackets anywhere (most
    requests) costs two `bytes.count` calls."""
    if raw.count(b"[") + raw.count(b"{") <= min(max_depth, max_containers):
        return
    import numpy as np  # here only: most bodies never get this far

    # Escapes first (backslashes only occur inside strings): after dropping "\\" pairs, then
    # '\"', every quote left delimits a string. Keep quotes and brackets only and drop empty
    # strings: what is left is brackets, and strings made of brackets.
    skeleton = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP).replace(b'""', b"")
    marks = np.frombuffer(skeleton, np.uint8)
    if b'"' in skeleton:
        quotes = marks == ord('"')
        outside = (np.cumsum(quotes, dtype=np.uint8) & 1) == 0  # parity survives uint8 wrap-around
        marks = marks[outside & ~quotes]
    opens = (marks == ord("[")) | (marks == ord("{"))
    # Depth over a bounded prefix (memory): within a valid body of at most `max_containers`
    # containers, that prefix is the whole skeleton; past it, the count below refuses anyway.
    depth = np.cumsum(opens[: 2 * max_containers].astype(np.int32) * 2 - 1)
    if int(depth.max(initial=0)) > max_depth:
        raise BodyError(400, f"the request body's JSON is nested deeper than {max_depth} levels", "json_too_deep")
    if int(np.count_nonzero(opens)) > max_containers:
        raise BodyError(400, f"the request body has more than {max_containers} JSON arrays and objects",
                        "json_too_complex")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_object(raw: bytes) -> dict[str, Any]:
    """The JSON object in `raw`; BodyError(400) for anything else (see the module docstring)."""
    check_structure(raw)
    try:
        text = raw.decode("utf-8")  # JSON on the wire is UTF-8 (RFC 8259), and the scan assumes it
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the request body is not valid JSON: not UTF-8 ({e.reason} at byte {e.start})") from None
    del raw
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:  # only for bodies check_structure leaves to the parser (not JSON)
        raise BodyError(400, "the request body's JSON is nested too deeply", "json_too_deep") from None
    except ValueError as e:  # JSONDecodeError, the 4300-digit int limit, NaN / Infinity
        raise BodyError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BodyError(400, "the request body must be a JSON object")
    return body
