"""Which fields of an OpenAI request body the door does not act on, for the ``X-Ignored-Fields``
response header and a log warning.

As vLLM does, unknown fields are accepted, not refused: clients (SDKs, proxies) send fields of
newer API versions and of other servers. Unlike vLLM, whose server only writes a log line, the
client is told too: every field present with a non-null value that the door neither acts on
nor validates to a no-op is listed, sorted, in the response header, on streamed responses too.
That covers misspellings (``temprature``), fields of other servers (``guided_decoding_backend``,
``chat_template_kwargs``), OpenAI fields without effect here (``user``), keys of
chat messages and content parts other than role / content / type / text
(``messages[].name``), of ``stream_options`` other than include_usage and
continuous_usage_stats, and, in chat,
``max_tokens`` when ``max_completion_tokens`` is given (it wins). A null value asks for the
default, which is what happens: never listed.

Names come from the client: listed as they are when plain (letters, digits, ``_.-``, at most 64
characters), else percent-encoded (UTF-8), cut at 64 bytes and marked ``...``; at most
MAX_LISTED names, then a last ``...`` entry. So the header is ASCII, holds no comma or line
break of a name, and stays a few KiB at most.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any
from urllib.parse import quote

log = logging.getLogger(__name__)

HEADER = "x-ignored-fields"
MAX_LISTED = 32
MAX_NAME_BYTES = 64

# Fields each endpoint acts on: mapped to the request, or validated (a value other than the
# no-op one is a 400: suffix, functions ...).
_COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "stop_token_ids", "ignore_eos", "cache_salt", "n", "presence_penalty", "frequency_penalty", "logit_bias",
    "repetition_penalty", "min_tokens", "min_p", "prompt_logprobs",
    # output formats (router/structured_formats.py)
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "logprobs", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "functions",
                         "tool_choice", "function_call"}
MESSAGE_FIELDS = frozenset({"role", "content"})
PART_FIELDS = frozenset({"type", "text"})
STREAM_OPTION_FIELDS = frozenset({"include_usage", "continuous_usage_stats"})

_PLAIN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def label(name: str) -> str:
    """`name` fit for a header and a log line (see the module docstring)."""
    if _PLAIN.fullmatch(name):
        return name
    raw = name.encode("utf-8", "surrogatepass")
    return quote(raw[:MAX_NAME_BYTES], safe="") + ("..." if len(raw) > MAX_NAME_BYTES else "")


def _extra(obj: dict[str, Any], known: frozenset[str], prefix: str, into: set[str]) -> None:
    into.update(prefix + label(k) for k, v in obj.items() if v is not None and k not in known)


def ignored_fields(body: dict[str, Any], chat: bool) -> list[str]:
    """The labels of the fields of `body` (a /v1/chat/completions body when `chat`, else
    /v1/completions) that the door ignores, sorted."""
    found: set[str] = set()
    _extra(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, "", found)
    options = body.get("stream_options")
    if isinstance(options, dict):
        _extra(options, STREAM_OPTION_FIELDS, "stream_options.", found)
    if chat:
        if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
            found.add("max_tokens")
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if not isinstance(message, dict):
                continue
            _extra(message, MESSAGE_FIELDS, "messages[].", found)
            content = message.get("content")
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict):
                    _extra(part, PART_FIELDS, "messages[].content[].", found)
    return sorted(found)


def header_value(labels: list[str]) -> str:
    """The X-Ignored-Fields value: comma separated, at most MAX_LISTED names, then '...'."""
    return ",".join(labels[:MAX_LISTED] + (["..."] if len(labels) > MAX_LISTED else []))


class IgnoredFieldsLog:
    """Logs a warning per distinct set of ignored fields of a path, at most once per
    `interval_s` each: a client sending the same stray field on every request gets a line a
    minute, not a line a request."""

    def __init__(self, interval_s: float = 60.0, max_keys: int = 1024) -> None:
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._last: dict[tuple[str, str], float] = {}

    def warn(self, path: str, labels: list[str]) -> None:
        value = header_value(labels)
        key = (path, value)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            return
        if len(self._last) >= self._max_keys:
            self._last.clear()  # bounded: a client inventing names cannot grow this
        self._last[key] = now
        log.warning("%s: the following fields were present in the request but ignored: %s", path, value)
