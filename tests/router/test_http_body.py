"""Unit tests of router/http_body.py (bounded body reads, JSON the parser cannot be hurt by) and
router/ignored_fields.py (what X-Ignored-Fields lists), no server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from router.http_body import BodyError, MiB, check_content_length, check_structure, parse_object, read_limited
from router.ignored_fields import MAX_LISTED, IgnoredFieldsLog, header_value, ignored_fields, label


async def _chunks(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def test_read_limited_keeps_at_most_the_limit() -> None:
    assert asyncio.run(read_limited(_chunks(b"ab", b"cd"), 4)) == b"abcd"
    with pytest.raises(BodyError) as info:
        asyncio.run(read_limited(_chunks(b"ab", b"cd", b"e"), 4))
    assert info.value.status == 413 and info.value.code == "request_too_large" and "4 bytes" in info.value.message


def test_content_length_check() -> None:
    check_content_length(None, MiB)
    check_content_length(str(MiB), MiB)
    with pytest.raises(BodyError) as info:
        check_content_length(str(MiB + 1), MiB)
    assert info.value.status == 413 and "1 MiB" in info.value.message


def nested(depth: int) -> object:
    value: object = []
    for i in range(depth - 1):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth, ok", [(64, True), (65, False), (100_000, False)])
def test_depth_limit(depth: int, ok: bool) -> None:
    raw = ("[" * depth + "]" * depth).encode() if depth > 1000 else json.dumps(nested(depth)).encode()
    if ok:
        check_structure(raw)
    else:
        with pytest.raises(BodyError, match="nested deeper than 64"):
            check_structure(raw)


def test_brackets_in_strings_and_escapes_do_not_count() -> None:
    text = '[[[[ \\" {{{ \\\\'
    body = {"prompt": text * 1000, "keys": {("[" * 100): 1}, "x": [["a\\\"[", "]"]] * 10}
    raw = json.dumps(body).encode()
    check_structure(raw)
    assert parse_object(raw) == body
    # An escaped backslash before a closing quote ends the string: the brackets after it count.
    with pytest.raises(BodyError, match="nested deeper"):
        check_structure(b'{"a": "\\\\", "b": ' + b"[" * 70 + b"]" * 70 + b"}")


def test_container_limit() -> None:
    check_structure(b"[" + b"{}," * 99_998 + b"{}]")  # 100,000 with the outer list
    with pytest.raises(BodyError, match="more than 100000 JSON arrays and objects"):
        check_structure(b"[" + b"{}," * 99_999 + b"{}]")
    check_structure(b'["' + b"{}," * 200_000 + b'"]')  # in a string: text


@pytest.mark.parametrize("raw, fragment", [
    (b"[1]", "JSON object"),
    (b"", "not valid JSON"),
    (b'{"a": NaN}', "NaN is not a JSON value"),
    (b'{"a": Infinity}', "Infinity is not a JSON value"),
    (b'{"a": ' + b"1" * 5000 + b"}", "not valid JSON"),
    (b'{"a": "\xff"}', "not UTF-8"),
    ('{"a": 1}'.encode("utf-16"), "not UTF-8"),
    (b"[" * 2000, "nested"),
])
def test_parse_object_refusals(raw: bytes, fragment: str) -> None:
    with pytest.raises(BodyError) as info:
        parse_object(raw)
    assert info.value.status == 400 and fragment in info.value.message


# ---------------------------------------------------------------------- ignored fields


def test_acted_on_fields_are_never_listed() -> None:
    completion = {"model": "m", "prompt": "x", "max_tokens": 1, "temperature": 0, "top_p": 1, "top_k": 1, "seed": 1,
                  "stop": "s", "stop_token_ids": [1], "ignore_eos": False, "cache_salt": "t", "n": 1, "best_of": 1,
                  "echo": False, "logprobs": None, "suffix": "", "presence_penalty": 0, "frequency_penalty": 0,
                  "logit_bias": {}, "stream": True, "stream_options": {"include_usage": True}}
    assert ignored_fields(completion, chat=False) == []
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "max_completion_tokens": 1, "logprobs": False, "tools": [], "functions": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "user": None, "temprature": None}  # null: the default, as asked
    assert ignored_fields(chat, chat=True) == []


def test_ignored_fields_per_endpoint() -> None:
    body = {"model": "m", "prompt": "x", "temprature": 1, "user": "u", "min_p": 0.1, "repetition_penalty": 1.2,
            "min_tokens": 2, "max_completion_tokens": 3, "messages": []}
    # min_p, min_tokens, repetition_penalty are acted on (SamplingParams): not listed.
    assert ignored_fields(body, chat=False) == ["max_completion_tokens", "messages", "temprature", "user"]
    chat = {"model": "m", "max_tokens": 5, "max_completion_tokens": 3, "best_of": 1, "echo": False,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "messages": [{"role": "user", "content": "x", "name": "n"},
                         {"role": "assistant", "content": [{"type": "text", "text": "y", "cache_control": {}}],
                          "tool_calls": []}]}
    assert ignored_fields(chat, chat=True) == [
        "best_of", "echo", "max_tokens", "messages[].content[].cache_control", "messages[].name",
        "messages[].tool_calls"]  # stream_options.continuous_usage_stats is acted on (vLLM's per-chunk usage)


def test_labels_and_header_are_safe() -> None:
    assert label("temprature") == "temprature"
    assert label("a,b") == "a%2Cb" and label("x\r\ny: z") == "x%0D%0Ay%3A%20z"
    assert label("ü") == "%C3%BC" and label("\ud800") == "%ED%A0%80"
    assert label("k" * 65) == "k" * 64 + "..."
    names = sorted(label(f"f{i:03}") for i in range(MAX_LISTED + 5))
    value = header_value(names)
    assert value.split(",")[-1] == "..." and len(value.split(",")) == MAX_LISTED + 1
    assert header_value(["a", "b"]) == "a,b"


def test_ignored_fields_log_is_rate_limited(caplog) -> None:
    log = IgnoredFieldsLog(interval_s=60.0)
    with caplog.at_level("WARNING", logger="router.ignored_fields"):
        log.warn("/v1/completions", ["temprature"])
        log.warn("/v1/completions", ["temprature"])
        log.warn("/v1/completions", ["other"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "ignored: temprature" in lines[0] and "ignored: other" in lines[1]
