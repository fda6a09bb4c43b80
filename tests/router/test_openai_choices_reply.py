"""Unit tests of the OpenAI door's answers with several prompts and choices, echo, best_of,
prompt_logprobs and continuous usage (router/openai_reply.py, router/openai_protocol.py), from
scripted GenerateResponse messages, no server. Bodies and chunks are validated with the openai
package's types (None where vLLM and OpenAI send null for the first echoed prompt token, which
the package's types do not allow, is checked and then left out of the validation)."""

from __future__ import annotations

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from protos import model_pb2
from router.openai_protocol import OpenAIError, chat_request, completion_request
from router.openai_reply import Reply

STOP, LENGTH = model_pb2.FINISH_REASON_STOP, model_pb2.FINISH_REASON_LENGTH


def lp(token_id: int, token: str, logprob: float, rank: int = 1,
       top: list[tuple[int, str, float]] = ()) -> model_pb2.PositionLogprobs:
    chosen = model_pb2.TokenLogprob(token_id=token_id, token=token, logprob=logprob, rank=rank,
                                    token_bytes=token.encode())
    return model_pb2.PositionLogprobs(chosen=chosen, top=[
        model_pb2.TokenLogprob(token_id=i, token=t, logprob=v, rank=r + 1, token_bytes=t.encode())
        for r, (i, t, v) in enumerate(top)])


def message(index: int, text: str, ids: list[int], finish: int = 0, prompt_tokens: int = 4, cached: int = 0,
            completion_tokens: int = 0, logprobs: list[model_pb2.PositionLogprobs] = (),
            prompt_logprobs: list[model_pb2.PositionLogprobs] = ()) -> model_pb2.GenerateResponse:
    m = model_pb2.GenerateResponse(index=index, text=text, token_ids=ids, logprobs=logprobs,
                                   prompt_logprobs=prompt_logprobs)
    if finish:
        m.finish_reason = finish
        m.usage.CopyFrom(model_pb2.Usage(prompt_tokens=prompt_tokens, cached_prompt_tokens=cached,
                                         completion_tokens=completion_tokens))
    return m


def validated_completion(body: dict) -> Completion:
    """`body` as openai.types.Completion, after checking that only the first echoed prompt token
    has null logprobs (as vLLM and OpenAI send them; the package's types say float)."""
    choices = []
    for choice in body["choices"]:
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            nulls = [i for i, v in enumerate(logprobs["token_logprobs"]) if v is None]
            assert nulls in ([], [0]) and [i for i, v in enumerate(logprobs["top_logprobs"]) if v is None] == nulls
            logprobs = {**logprobs, "token_logprobs": [0.0 if v is None else v for v in logprobs["token_logprobs"]],
                        "top_logprobs": [{} if v is None else v for v in logprobs["top_logprobs"]]}
        choices.append({**choice, "logprobs": logprobs, "finish_reason": choice["finish_reason"] or "stop"})
    return Completion.model_validate({**body, "choices": choices})


def test_choices_of_several_prompts_are_prompt_major_and_usage_counts_prompts_once() -> None:
    door = completion_request({"model": "m", "prompt": ["a b", "c"], "n": 2, "max_tokens": 2})
    assert [r.prompt for r in door.generate] == ["a b", "c"] and all(r.sampling.n == 2 for r in door.generate)
    reply = Reply(False, "m", "r", prompts=2, n=2, choices=2)
    # The replica's choices and the two prompts interleave as they come.
    reply.add(message(1, "x", [5]), 1)
    reply.add(message(0, "p", [6]), 0)
    reply.add(message(0, "q", [7], LENGTH, prompt_tokens=3, cached=2, completion_tokens=1), 1)
    reply.add(message(1, "r", [8], LENGTH, prompt_tokens=4, cached=4, completion_tokens=1), 0)
    reply.add(message(0, "", [], STOP, prompt_tokens=4, cached=1, completion_tokens=1), 0)
    reply.add(message(1, "y", [9], STOP, prompt_tokens=3, cached=3, completion_tokens=2), 1)
    body = reply.response()
    validated_completion(body)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "p", "stop"), (1, "r", "length"), (2, "q", "length"), (3, "xy", "stop")]
    # Prompts once each (4 + 3), every choice's tokens (1 + 1 + 1 + 2), each prompt's first choice's cache.
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 1 + 2}}


def test_stream_chunks_carry_their_choice_index() -> None:
    reply = Reply(True, "m", "r", n=3, choices=3)
    first = reply.first_chunks()
    assert [c["choices"][0]["index"] for c in first] == [0, 1, 2]
    chunks = [*first]
    for m in (message(0, "a", [1]), message(2, "b", [2]), message(1, "c", [3], STOP, completion_tokens=1),
              message(0, "d", [4], STOP, completion_tokens=2), message(2, "e", [5], LENGTH, completion_tokens=2)):
        chunks += reply.add(m)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"].get("content")) for c in chunks[3:]] == [
        (0, "a"), (2, "b"), (1, "c"), (0, "d"), (2, "e")]
    body = reply.response()
    ChatCompletion.model_validate(body)
    assert [c["message"]["content"] for c in body["choices"]] == ["ad", "c", "be"]
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == 4


def test_best_of_returns_the_n_most_likely_renumbered_and_strips_logprobs() -> None:
    door = completion_request({"model": "m", "prompt": "x", "n": 2, "best_of": 3})
    (request,) = door.generate
    assert request.sampling.n == 3 and request.sampling.logprobs == 0 and (door.n, door.choices) == (2, 3)
    assert not door.logprobs
    reply = Reply(False, "m", "r", n=2, choices=3)
    for index, (text, logprob) in enumerate((("low", -5.0), ("high", -0.5), ("mid", -1.0))):
        reply.add(message(index, text, [index], STOP, completion_tokens=1, logprobs=[lp(index, text, logprob)]))
    body = reply.response()
    validated_completion(body)
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [(0, "high", None), (1, "mid", None)]
    assert body["usage"]["completion_tokens"] == 3  # every choice generated counts (as OpenAI bills best_of)
    asked = completion_request({"model": "m", "prompt": "x", "best_of": 2, "logprobs": 1})
    assert asked.generate[0].sampling.logprobs == 1 and asked.logprobs


PROMPT_LOGPROBS = [lp(1, "<s>", 0.0, rank=0), lp(7, "Hi", -2.0, rank=3, top=[(8, "Yo", -0.5), (9, "Oh", -1.0)])]


def test_echo_with_logprobs_puts_the_prompt_first() -> None:
    door = completion_request({"model": "m", "prompt": "Hi", "echo": True, "logprobs": 1, "max_tokens": 2})
    (request,) = door.generate
    assert request.sampling.prompt_logprobs == 1 and request.sampling.logprobs == 1 and door.echo
    reply = Reply(False, "m", "r", logprobs=True, top_logprobs=1, echo=True, prompt_texts=["<s>Hi"], n=2, choices=2)
    # Choice 1 arrives before choice 0's first message (which carries the prompt's log probabilities): it waits.
    assert reply.add(message(1, " b", [11], logprobs=[lp(11, " b", -0.75)])) == []
    chunks = reply.add(message(0, " a", [10], logprobs=[lp(10, " a", -0.125)], prompt_logprobs=PROMPT_LOGPROBS))
    chunks += reply.add(message(0, "!", [12], STOP, completion_tokens=2, logprobs=[lp(12, "!", -0.25)]))
    chunks += reply.add(message(1, "", [], LENGTH, completion_tokens=1))
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == [
        (1, "<s>Hi b"), (0, "<s>Hi a"), (0, "!"), (1, "")]
    opening = chunks[1]["choices"][0]["logprobs"]
    assert opening == {"tokens": ["<s>", "Hi", " a"], "token_logprobs": [None, -2.0, -0.125],
                       "top_logprobs": [None, {"Hi": -2.0, "Yo": -0.5}, {" a": -0.125}], "text_offset": [0, 3, 5]}
    assert chunks[2]["choices"][0]["logprobs"]["text_offset"] == [7]  # counted on from the echoed prompt
    body = reply.response()
    validated_completion(body)
    first = body["choices"][0]
    assert first["text"] == "<s>Hi a!" and first["logprobs"]["tokens"] == ["<s>", "Hi", " a", "!"]
    assert body["choices"][1]["text"] == "<s>Hi b" and body["choices"][1]["logprobs"]["token_logprobs"][0] is None


def test_echo_with_max_tokens_0_returns_the_prompt_only() -> None:
    door = completion_request({"model": "m", "prompt": [1, 7], "echo": True, "max_tokens": 0, "min_tokens": 0})
    (request,) = door.generate
    assert request.sampling.max_tokens == 1 and door.echo_only and list(request.token_ids.ids) == [1, 7]
    reply = Reply(False, "m", "r", echo=True, echo_only=True, prompt_texts=["<s>Hi"])
    chunks = reply.add(message(0, " a", [10], LENGTH, prompt_tokens=2, completion_tokens=1))
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [("<s>Hi", "length")]
    body = reply.response()
    validated_completion(body)
    assert body["choices"][0]["text"] == "<s>Hi"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 2
    with pytest.raises(OpenAIError) as info:
        completion_request({"model": "m", "prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 1})
    assert info.value.param == "min_tokens"


def test_vllm_prompt_logprobs_format() -> None:
    door = completion_request({"model": "m", "prompt": "Hi", "prompt_logprobs": 2})
    assert door.generate[0].sampling.prompt_logprobs == 2 and not door.generate[0].sampling.HasField("logprobs")
    reply = Reply(False, "m", "r", prompt_logprobs=1)
    reply.add(message(0, "a", [3], STOP, completion_tokens=1, prompt_logprobs=PROMPT_LOGPROBS))
    body = reply.response()
    validated_completion(body)
    assert body["choices"][0]["prompt_logprobs"] == [
        None, {"7": {"logprob": -2.0, "rank": 3, "decoded_token": "Hi"},
               "8": {"logprob": -0.5, "rank": 1, "decoded_token": "Yo"}}]
    door = chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0, "n": 2})
    assert door.generate[0].sampling.prompt_logprobs == 0 and door.generate[0].sampling.n == 2
    reply = Reply(True, "m", "r", prompt_logprobs=0, n=2, choices=2)
    reply.add(message(0, "a", [3], STOP, completion_tokens=1, prompt_logprobs=PROMPT_LOGPROBS))
    reply.add(message(1, "b", [4], STOP, completion_tokens=1))
    body = reply.response()
    ChatCompletion.model_validate(body)
    assert body["prompt_logprobs"] == [None, {"7": {"logprob": -2.0, "rank": 3, "decoded_token": "Hi"}}]


def test_continuous_usage_on_every_chunk() -> None:
    door = completion_request({"model": "m", "prompt": "x", "stream": True,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert door.continuous_usage and door.include_usage
    door = completion_request({"model": "m", "prompt": "x", "stream": True,
                               "stream_options": {"continuous_usage_stats": True}})
    assert not door.continuous_usage  # as vLLM: only with include_usage
    reply = Reply(True, "m", "r", continuous_usage=True, prompt_tokens=[5])
    chunks = reply.first_chunks()
    chunks += reply.add(message(0, "a", [1]))
    chunks += reply.add(message(0, "b", [2, 3], STOP, prompt_tokens=5, completion_tokens=3))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 3]
    assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks)
