"""Response translation of the OpenAI door (router/openai_api.py), pure: GenerateResponse
messages -> OpenAI's JSON bodies and stream chunks, with tool calls (router/tool_calls.py) and
log probabilities."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from protos import model_pb2
from router.tool_calls import ToolPlan, call, calls_from_output

_FINISH_REASONS = {
    model_pb2.FINISH_REASON_STOP: "stop",
    model_pb2.FINISH_REASON_LENGTH: "length",
    model_pb2.FINISH_REASON_ABORT: "abort",
}


def usage_json(usage: model_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


@dataclass(slots=True)
class Reply:
    """What one request produced, built from its GenerateResponse messages in order."""

    chat: bool
    model: str
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: model_pb2.Usage | None = None
    tools: ToolPlan | None = None  # chat with tools: the output may come back as tool calls
    logprobs: bool = False  # the request asked for log probabilities
    _logprobs: list[model_pb2.PositionLogprobs] = field(default_factory=list)
    _streaming_call: bool = False  # a named call's first arguments went out

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish_reason: str | None, chunk: bool,
                logprobs: list[model_pb2.PositionLogprobs] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            if chunk:
                choice["delta"] = {} if text is None else {"content": text}
            else:
                choice["message"] = self._message(text or "")
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self._logprobs_json(logprobs) if self.logprobs else None
        choice["finish_reason"] = finish_reason
        return choice

    def add(self, message: model_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """Records one message; returns the stream chunks it makes (usage chunk not included).

        As vLLM does: one chunk per message that carries tokens, with the text complete so far
        ("" while a multi-byte character or a possible stop string is incomplete), so that a
        client counts one event per token step; the finish reason rides on the last one (a
        separate chunk only when the last message carries neither tokens nor text, e.g. an abort)."""
        if message.text:
            self.text.append(message.text)
        self._logprobs.extend(message.logprobs)
        finish_reason = None
        if message.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED:
            finish_reason = self.finish_reason = _FINISH_REASONS.get(message.finish_reason, "stop")
            self.usage = message.usage
        if not (message.token_ids or message.text or finish_reason):
            return []
        text = message.text if (message.token_ids or message.text) else None
        if self._calls_tools:
            return self._tool_chunks(text, finish_reason)
        return [{**self._envelope(True), "choices": [self._choice(text, finish_reason, True, list(message.logprobs))]}]

    @property
    def _calls_tools(self) -> bool:
        return self.chat and self.tools is not None and self.tools.mode != "none"

    def _message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole reply: content, or tool calls parsed from it."""
        if not self._calls_tools:
            return {"role": "assistant", "content": text}
        assert self.tools is not None
        calls, content = calls_from_output(self.tools, text)
        if calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return {"role": "assistant", "content": content, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": text}

    def _tool_chunks(self, text: str | None, finish_reason: str | None) -> list[dict[str, Any]]:
        """Stream chunks with tools: a named call's arguments stream as they come; the other
        modes are decided on the whole output, so it is held back until the finish."""
        assert self.tools is not None
        chunks = []
        if self.tools.mode == "named" and text:
            first = not self._streaming_call
            self._streaming_call = True
            delta = {"index": 0, **call(self.tools.name, text)} if first else \
                {"index": 0, "function": {"arguments": text}}
            chunks.append(self._delta_chunk({"tool_calls": [delta]}, None))
        if finish_reason is not None:
            if self.tools.mode == "named":
                reason = "tool_calls" if self._streaming_call and finish_reason == "stop" else finish_reason
                chunks.append(self._delta_chunk({}, reason))
            else:
                message = self._message("".join(self.text))
                delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]} \
                    if "tool_calls" in message else {"content": message["content"]}
                chunks.append(self._delta_chunk(delta, self.finish_reason))
        return chunks

    def _delta_chunk(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                     "finish_reason": finish_reason}]}

    def _logprobs_json(self, positions: list[model_pb2.PositionLogprobs] | None) -> dict[str, Any]:
        """OpenAI's logprobs object of `positions`: chat's `content` list, or completions' four
        parallel lists (text offsets counted from this chunk's first token in a stream)."""
        positions = positions or []
        if self.chat:
            return {"content": [{**_token_json(p.chosen), "top_logprobs": [_token_json(t) for t in p.top]}
                                for p in positions]}
        offsets, at = [], len("".join(self.text)) - sum(len(p.chosen.token) for p in positions)
        for p in positions:
            offsets.append(max(at, 0))
            at += len(p.chosen.token)
        return {"tokens": [p.chosen.token for p in positions],
                "token_logprobs": [p.chosen.logprob for p in positions],
                "top_logprobs": [{t.token: t.logprob for t in p.top} for p in positions],
                "text_offset": offsets}

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role."""
        if not self.chat:
            return None
        return self._delta_chunk({"role": "assistant", "content": ""}, None)

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return {**self._envelope(True), "choices": [],
                "usage": usage_json(self.usage if self.usage is not None else model_pb2.Usage())}

    def response(self) -> dict[str, Any]:
        """The non-streamed response body."""
        choice = self._choice("".join(self.text), None, False, self._logprobs)  # tool calls may make it "tool_calls"
        choice["finish_reason"] = self.finish_reason
        return {**self._envelope(False), "choices": [choice],
                "usage": usage_json(self.usage if self.usage is not None else model_pb2.Usage())}


def _token_json(t: model_pb2.TokenLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
