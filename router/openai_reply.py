"""Response translation of the OpenAI door (router/openai_api.py), pure: GenerateResponse
messages of one or several Generate calls (one per prompt, each with one or more choices) ->
OpenAI's JSON bodies and stream chunks, with tool calls (router/tool_calls.py), log
probabilities, echo and vLLM's prompt_logprobs, in vLLM's formats.

Choices are numbered prompt-major, as vLLM does: choice i of prompt p is index p * n + i. With
best_of, each prompt's best_of choices are ranked by cumulative log probability and the n best
are returned, renumbered (never streamed)."""

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
_LOWEST_LOGPROB = -9999.0  # what -inf is sent as (vLLM's and OpenAI's convention: JSON has no -inf)


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


@dataclass(slots=True)
class _Choice:
    """One choice's output so far."""

    prompt: int
    text: list[str] = field(default_factory=list)
    logprobs: list[model_pb2.PositionLogprobs] = field(default_factory=list)
    tokens: int = 0  # completion tokens so far
    cumulative_logprob: float = 0.0  # best_of's ranking
    finish_reason: str | None = None
    usage: model_pb2.Usage | None = None
    echoed: bool = False  # the prompt went out (echo, streams)
    text_offset: int = 0  # of the next token (completions' logprobs, streams)
    streaming_call: bool = False  # a named call's first arguments went out


@dataclass(slots=True)
class Reply:
    """What one request produced, built from its GenerateResponse messages in order (per prompt).

    `choices` is what each prompt's Generate asked for (best_of or n), `n` what is returned;
    `prompt_texts` the prompts' texts (echo); `prompt_tokens` their lengths where known before
    the end (continuous usage); `top_logprobs` the alternatives asked for (echoed prompt tokens
    keep that many)."""

    chat: bool
    model: str
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None  # chat with tools: the output may come back as tool calls
    logprobs: bool = False  # the request asked for log probabilities
    top_logprobs: int = 0
    prompts: int = 1
    n: int = 1
    choices: int = 1
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the one token asked for is dropped
    prompt_texts: list[str] = field(default_factory=list)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, as asked
    continuous_usage: bool = False
    prompt_tokens: list[int] = field(default_factory=list)
    _choices: dict[int, _Choice] = field(default_factory=dict)
    _prompt_positions: dict[int, list[model_pb2.PositionLogprobs]] = field(default_factory=dict)
    _held: dict[int, list[model_pb2.GenerateResponse]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # ------------------------------------------------------------------ messages in

    def add(self, message: model_pb2.GenerateResponse, prompt: int = 0) -> list[dict[str, Any]]:
        """Records one message of prompt `prompt`'s Generate; returns the stream chunks it makes
        (usage chunk not included).

        As vLLM does: one chunk per message that carries tokens, with the text complete so far
        ("" while a multi-byte character or a possible stop string is incomplete), so that a
        client counts one event per token step; the finish reason rides on the last one (a
        separate chunk only when the last message carries neither tokens nor text, e.g. an abort).
        With echo and logprobs, a choice's first chunk carries the prompt's log probabilities,
        which come on choice 0's first message: another choice's messages wait for them."""
        if message.prompt_logprobs:
            self._prompt_positions[prompt] = list(message.prompt_logprobs)
        if self.echo and self.logprobs and prompt not in self._prompt_positions:
            self._held.setdefault(prompt, []).append(message)
            return []
        chunks = []
        for held in self._held.pop(prompt, []):
            chunks += self._add(held, prompt)
        return chunks + self._add(message, prompt)

    def flush(self) -> list[dict[str, Any]]:
        """The chunks of messages still waiting for prompt log probabilities that never came."""
        chunks = []
        for prompt in sorted(self._held):
            self._prompt_positions.setdefault(prompt, [])
            for held in self._held.pop(prompt):
                chunks += self._add(held, prompt)
        return chunks

    def _add(self, message: model_pb2.GenerateResponse, prompt: int) -> list[dict[str, Any]]:
        index = prompt * self.choices + message.index
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice(prompt)
        has_tokens = bool(message.token_ids or message.text)
        text, positions = message.text, list(message.logprobs)
        if self.echo_only:  # the token generated only to run the prompt is not part of the answer
            text, positions = "", []
        else:
            choice.tokens += len(message.token_ids)
        if text:
            choice.text.append(text)
        choice.logprobs.extend(positions)
        choice.cumulative_logprob += sum(p.chosen.logprob for p in positions)
        finish_reason = None
        if message.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED:
            finish_reason = choice.finish_reason = _FINISH_REASONS.get(message.finish_reason, "stop")
            choice.usage = message.usage
        echo_now = self.echo and not choice.echoed
        if not (has_tokens or finish_reason or echo_now):
            return []
        choice.echoed = True
        if self.chat:
            chunk_text = text if has_tokens else None
            if self._calls_tools:
                return self._tool_chunks(index, choice, chunk_text, finish_reason)
            delta = {} if chunk_text is None else {"content": chunk_text}
            logprobs = self._chat_logprobs(positions) if self.logprobs else None
            return [self._chunk(choice, {"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason})]
        entries = _entries(positions)
        if echo_now:
            text = self.prompt_texts[prompt] + text
            entries = self._prompt_entries(prompt) + entries
        logprobs = None
        if self.logprobs:
            logprobs, choice.text_offset = _completion_logprobs(entries, choice.text_offset)
        return [self._chunk(choice, {"index": index, "text": text, "logprobs": logprobs,
                                     "finish_reason": finish_reason})]

    def _chunk(self, choice: _Choice, choice_json: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._envelope(True), "choices": [choice_json]}
        if self.continuous_usage:
            prompt_tokens = choice.usage.prompt_tokens if choice.usage is not None else \
                self.prompt_tokens[choice.prompt]
            chunk["usage"] = usage_json(prompt_tokens, choice.tokens)
        return chunk

    # ------------------------------------------------------------------ tool calls

    @property
    def _calls_tools(self) -> bool:
        return self.chat and self.tools is not None and self.tools.mode != "none"

    def _message(self, choice: _Choice) -> dict[str, Any]:
        """The assistant message of a whole choice: content, or tool calls parsed from it."""
        text = "".join(choice.text)
        if not self._calls_tools:
            return {"role": "assistant", "content": text}
        assert self.tools is not None
        calls, content = calls_from_output(self.tools, text)
        if calls and choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"
        return {"role": "assistant", "content": content, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": text}

    def _tool_chunks(self, index: int, choice: _Choice, text: str | None,
                     finish_reason: str | None) -> list[dict[str, Any]]:
        """Stream chunks with tools: a named call's arguments stream as they come; the other
        modes are decided on the whole output, so it is held back until the finish."""
        assert self.tools is not None
        chunks = []
        if self.tools.mode == "named" and text:
            first = not choice.streaming_call
            choice.streaming_call = True
            delta = {"index": 0, **call(self.tools.name, text)} if first else \
                {"index": 0, "function": {"arguments": text}}
            chunks.append(self._delta_chunk(index, {"tool_calls": [delta]}, None, choice))
        if finish_reason is not None:
            if self.tools.mode == "named":
                reason = "tool_calls" if choice.streaming_call and finish_reason == "stop" else finish_reason
                chunks.append(self._delta_chunk(index, {}, reason, choice))
            else:
                message = self._message(choice)
                delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]} \
                    if "tool_calls" in message else {"content": message["content"]}
                chunks.append(self._delta_chunk(index, delta, choice.finish_reason, choice))
        return chunks

    def _delta_chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None,
                     choice: _Choice | None = None) -> dict[str, Any]:
        choice_json = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if choice is not None:
            return self._chunk(choice, choice_json)
        return {**self._envelope(True), "choices": [choice_json]}

    # ------------------------------------------------------------------ log probabilities

    def _chat_logprobs(self, positions: list[model_pb2.PositionLogprobs]) -> dict[str, Any]:
        return {"content": [{**_token_json(p.chosen), "top_logprobs": [_token_json(t) for t in p.top]}
                            for p in positions]}

    def _prompt_entries(self, prompt: int) -> list[tuple[str, float | None, dict[str, float] | None]]:
        """The echoed prompt's tokens as completions' logprobs entries: the first scores nothing
        (None, as vLLM and OpenAI send), each other with its `top_logprobs` alternatives."""
        positions = self._prompt_positions.get(prompt, [])
        if not self.logprobs:
            return []
        entries: list[tuple[str, float | None, dict[str, float] | None]] = []
        for i, p in enumerate(positions):
            if i == 0:
                entries.append((p.chosen.token, None, None))
            else:
                entries.append(_entry(p, self.top_logprobs))
        return entries

    def _vllm_prompt_logprobs(self, prompt: int) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs of a prompt: None for the first token, then per token a map from
        token id to {logprob, rank, decoded_token}: the prompt's token and its alternatives."""
        if self.prompt_logprobs is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = []
        for i, p in enumerate(self._prompt_positions.get(prompt, [])):
            if i == 0:
                out.append(None)
                continue
            entry = {str(p.chosen.token_id): _vllm_logprob(p.chosen)}
            for t in p.top[:self.prompt_logprobs]:
                entry.setdefault(str(t.token_id), _vllm_logprob(t))
            out.append(entry)
        return out

    # ------------------------------------------------------------------ answers

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role, one chunk per choice (as vLLM)."""
        if not self.chat:
            return []
        chunks = []
        for index in range(self.n):
            chunk = self._delta_chunk(index, {"role": "assistant", "content": ""}, None)
            if self.continuous_usage:
                chunk["usage"] = usage_json(self.prompt_tokens[0], 0)
            chunks.append(chunk)
        return chunks

    def usage(self) -> dict[str, Any]:
        """The request's usage: each prompt counted once (from its first choice's), the completion
        tokens of every choice generated (best_of's too), the cached tokens of each prompt's
        first choice (the others fork from it)."""
        per_prompt: dict[int, model_pb2.Usage] = {}
        completion = 0
        for index in sorted(self._choices):
            choice = self._choices[index]
            if choice.usage is not None:
                per_prompt.setdefault(choice.prompt, choice.usage)
            completion += choice.tokens
        return usage_json(sum(u.prompt_tokens for u in per_prompt.values()), completion,
                          sum(u.cached_prompt_tokens for u in per_prompt.values()))

    def served_by(self) -> str:
        """The replica that served the first prompt ("" when unknown)."""
        return next((c.usage.served_by for c in self._choices.values() if c.usage is not None), "")

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return {**self._envelope(True), "choices": [], "usage": self.usage()}

    def response(self) -> dict[str, Any]:
        """The non-streamed response body."""
        self.flush()
        choices = []
        for prompt in range(self.prompts):
            group = [self._choices[i] for i in sorted(self._choices) if self._choices[i].prompt == prompt]
            if self.choices > self.n:  # best_of
                group = sorted(group, key=lambda c: c.cumulative_logprob, reverse=True)[:self.n]
            for choice in group:
                choices.append(self._choice_json(len(choices), choice))
        body = {**self._envelope(False), "choices": choices, "usage": self.usage()}
        if self.chat and self.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(0)
        return body

    def _choice_json(self, index: int, choice: _Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index}
        if self.chat:
            out["message"] = self._message(choice)  # tool calls may make the reason "tool_calls"
            out["logprobs"] = self._chat_logprobs(choice.logprobs) if self.logprobs else None
        else:
            text = "".join(choice.text)
            entries = _entries(choice.logprobs)
            if self.echo:
                text = self.prompt_texts[choice.prompt] + text
                entries = self._prompt_entries(choice.prompt) + entries
            out["text"] = text
            out["logprobs"] = _completion_logprobs(entries, 0)[0] if self.logprobs else None
            if self.prompt_logprobs is not None:
                out["prompt_logprobs"] = self._vllm_prompt_logprobs(choice.prompt)
        out["finish_reason"] = choice.finish_reason
        return out


def _logprob(value: float) -> float:
    return max(value, _LOWEST_LOGPROB)


def _token_json(t: model_pb2.TokenLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": _logprob(t.logprob), "bytes": list(t.token_bytes)}


def _vllm_logprob(t: model_pb2.TokenLogprob) -> dict[str, Any]:
    return {"logprob": _logprob(t.logprob), "rank": t.rank, "decoded_token": t.token}


def _entry(p: model_pb2.PositionLogprobs, k: int | None = None) -> tuple[str, float, dict[str, float]]:
    """(token, logprob, alternatives) of a position: the alternatives include the token itself
    (vLLM's and OpenAI's completions: logprobs 0 still names the chosen token)."""
    top = {p.chosen.token: _logprob(p.chosen.logprob)}
    for t in p.top if k is None else p.top[:k]:
        top.setdefault(t.token, _logprob(t.logprob))
    return p.chosen.token, _logprob(p.chosen.logprob), top


def _entries(positions: list[model_pb2.PositionLogprobs]) -> list[tuple[str, float | None, dict[str, float] | None]]:
    return [_entry(p) for p in positions]


def _completion_logprobs(entries: list[tuple[str, float | None, dict[str, float] | None]],
                         offset: int) -> tuple[dict[str, Any], int]:
    """Completions' four parallel lists, and the text offset after them: offsets advance by the
    tokens reported (as vLLM: text held back for a possible stop string lags the tokens)."""
    offsets = []
    for token, _, _ in entries:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries], "text_offset": offsets}, offset


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
