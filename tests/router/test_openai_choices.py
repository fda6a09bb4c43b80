"""Several prompts, n choices, best_of, echo, prompt_logprobs and usage through the OpenAI door
(issue 30), with the `openai` SDK against a real router and tiny-model replicas (processes on
loopback). Every response and stream chunk is validated with the openai package's types."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.router.conftest import Fleet, http_url
from tests.router.test_openai_choices_reply import validated_completion

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["Hello there", "The sky is", "One two three four"]
MESSAGES = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def sdk(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_url(fleet.router) + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(sdk: openai.OpenAI) -> str:
    return sdk.models.list().data[0].id


def post(fleet: Fleet, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(http_url(fleet.router) + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(sdk: openai.OpenAI, model: str, **kwargs) -> Completion:
    reply = sdk.completions.create(model=model, **kwargs)
    validated_completion(reply.model_dump())
    return reply


def chat(sdk: openai.OpenAI, model: str, **kwargs) -> ChatCompletion:
    reply = sdk.chat.completions.create(model=model, **kwargs)
    ChatCompletion.model_validate(reply.model_dump())
    return reply


def chunks_of(stream) -> list:
    """Every chunk, validated: completions' finish_reason is null until a choice's last chunk,
    which openai.types.Completion does not allow (checked, then validated as "stop")."""
    out = []
    for chunk in stream:
        data = chunk.model_dump()
        if data["object"] == "chat.completion.chunk":
            ChatCompletionChunk.model_validate(data)
        else:
            validated_completion(data)
        out.append(chunk)
    return out


# ---------------------------------------------------------------------- several prompts


def test_several_text_and_token_id_prompts(sdk, model, fleet) -> None:
    singles = [complete(sdk, model, prompt=p, max_tokens=4, temperature=0) for p in PROMPTS]
    batch = complete(sdk, model, prompt=PROMPTS, max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    ids = [post(fleet, "/tokenize", {"prompt": p})[1]["tokens"] for p in PROMPTS]
    by_ids = complete(sdk, model, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    one = complete(sdk, model, prompt=ids[1], max_tokens=4, temperature=0)  # one list of ids: one prompt
    assert [c.text for c in one.choices] == [batch.choices[1].text]


def test_several_prompts_stream_interleaved_with_their_index(sdk, model) -> None:
    chunks = chunks_of(sdk.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=5, temperature=0, n=2,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    finished = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert choice.index not in finished  # nothing after a choice's finish
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}
    whole = complete(sdk, model, prompt=PROMPTS[:2], max_tokens=5, temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 4 * 5
    assert usage.prompt_tokens == whole.usage.prompt_tokens


# ---------------------------------------------------------------------- n


def test_n_greedy_choices_equal_one_and_share_the_prompt(sdk, model) -> None:
    one = complete(sdk, model, prompt=PROMPTS[2], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    three = complete(sdk, model, prompt=PROMPTS[2], max_tokens=6, temperature=0, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 3 * 6
    chat_one = chat(sdk, model, messages=MESSAGES, max_tokens=5, temperature=0)
    chat_three = chat(sdk, model, messages=MESSAGES, max_tokens=5, temperature=0, n=3)
    assert [c.message.content for c in chat_three.choices] == [chat_one.choices[0].message.content] * 3
    assert chat_three.usage.prompt_tokens == chat_one.usage.prompt_tokens


def test_n_seeded_choice_i_is_the_single_request_with_seed_plus_i(sdk, model) -> None:
    three = complete(sdk, model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=40, n=3)
    singles = [complete(sdk, model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=40 + i).choices[0].text
               for i in range(3)]
    assert [c.text for c in three.choices] == singles
    assert len(set(singles)) > 1  # sampled: the seeds differ, so do the choices
    two = chat(sdk, model, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7, n=2)
    for i, choice in enumerate(two.choices):
        single = chat(sdk, model, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7 + i)
        assert choice.message.content == single.choices[0].message.content


def test_n_chat_stream(sdk, model) -> None:
    chunks = chunks_of(sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=1.0,
                                                   seed=11, n=3, stream=True, stream_options={"include_usage": True}))
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3  # one opening per choice
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in chunks[3:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.add(choice.index)
    assert finished == {0, 1, 2}
    whole = chat(sdk, model, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=11, n=3)
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_best_of_returns_the_most_likely(sdk, model) -> None:
    ranked = complete(sdk, model, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=3, n=4, logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in ranked.choices]
    best = complete(sdk, model, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=3, n=2, best_of=4)
    order = sorted(range(4), key=lambda i: scores[i], reverse=True)
    assert [c.text for c in best.choices] == [ranked.choices[i].text for i in order[:2]]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)


# ---------------------------------------------------------------------- echo, prompt_logprobs


def test_echo_text_and_token_prompts(sdk, model, fleet) -> None:
    plain = complete(sdk, model, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    echoed = complete(sdk, model, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    only = complete(sdk, model, prompt=PROMPTS[0], max_tokens=0, echo=True)
    assert only.choices[0].text == PROMPTS[0] and only.usage.completion_tokens == 0
    assert only.usage.prompt_tokens == plain.usage.prompt_tokens
    ids = post(fleet, "/tokenize", {"prompt": PROMPTS[0]})[1]["tokens"]
    text = post(fleet, "/detokenize", {"tokens": ids})[1]["prompt"]
    by_ids = complete(sdk, model, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert by_ids.choices[0].text == text + plain.choices[0].text
    streamed = chunks_of(sdk.completions.create(model=model, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                                echo=True, stream=True))
    assert streamed[0].choices[0].text.startswith(PROMPTS[0])
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(sdk, model, fleet) -> None:
    """The prompt's tokens come first, the first scoring nothing; a prompt position's scores are
    the ones a generation from the tokens before it sees."""
    plain = complete(sdk, model, prompt=PROMPTS[2], max_tokens=1, temperature=0, logprobs=2)
    echoed = complete(sdk, model, prompt=PROMPTS[2], max_tokens=1, temperature=0, logprobs=2, echo=True)
    logprobs = echoed.choices[0].logprobs
    prompt_tokens = echoed.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_tokens + 1 and logprobs.tokens[-1] == plain.choices[0].logprobs.tokens[0]
    assert logprobs.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])  # the token and 2 alternatives
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    ids = post(fleet, "/tokenize", {"prompt": PROMPTS[2]})[1]["tokens"]
    scored = complete(sdk, model, prompt=ids, max_tokens=0, echo=True, logprobs=5)
    assert scored.usage.completion_tokens == 0 and len(scored.choices[0].logprobs.tokens) == len(ids)
    last = scored.choices[0].logprobs.top_logprobs[-1]
    step = complete(sdk, model, prompt=ids[:-1], max_tokens=1, temperature=0, logprobs=5).choices[0].logprobs
    assert sorted(last.values(), reverse=True)[:5] == pytest.approx(sorted(step.top_logprobs[0].values(),
                                                                           reverse=True)[:5], abs=1e-4)
    streamed = chunks_of(sdk.completions.create(model=model, prompt=PROMPTS[2], max_tokens=1, temperature=0,
                                                logprobs=2, echo=True, stream=True, n=2))
    assert sorted(c.choices[0].index for c in streamed) == [0, 1]
    for chunk in streamed:
        assert chunk.choices[0].logprobs.tokens == logprobs.tokens


def test_prompt_logprobs_in_vllms_format(fleet, model) -> None:
    status, body = post(fleet, "/v1/completions", {"model": model, "prompt": PROMPTS[1], "max_tokens": 2,
                                                   "prompt_logprobs": 2, "n": 2})
    assert status == 200, body
    validated_completion(body)
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == body["usage"]["prompt_tokens"] and entries[0] is None
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 3 and all(k.isdigit() for k in entry)
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0 for v in entry.values())
    assert body["choices"][1]["prompt_logprobs"] == entries  # each choice of the prompt has them
    status, chat = post(fleet, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 2,
                                                        "prompt_logprobs": 0})
    assert status == 200, chat
    ChatCompletion.model_validate(chat)
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # the prompt's own token


# ---------------------------------------------------------------------- usage in streams


def test_continuous_usage_stats(sdk, model) -> None:
    chunks = chunks_of(sdk.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    *token_chunks, last = chunks
    assert [c.usage.completion_tokens for c in token_chunks] == [1, 2, 3, 4]
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    assert last.choices == [] and last.usage.completion_tokens == 4
    chat = chunks_of(sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=3, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in chat] == [0, 1, 2, 3, 3]
    assert len({c.usage.prompt_tokens for c in chat}) == 1


# ---------------------------------------------------------------------- bad values


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
])
def test_bad_values_are_400_naming_the_param(sdk, model, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model=model, **{"prompt": "x", "max_tokens": 2, **kwargs})
    assert caught.value.body["param"] == param, caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=model, messages=MESSAGES, n=0)
    assert caught.value.body["param"] == "n"


def test_one_bad_prompt_fails_the_request_and_frees_the_others(fleet, model) -> None:
    """A prompt the replica refuses (a token outside the vocabulary) is the request's 400; the
    other prompts' Generate calls are closed, so their request ids are free again at once."""
    body = {"model": model, "prompt": [[1, 2, 3], [2**31]], "max_tokens": 200, "extra": None}
    request = urllib.request.Request(http_url(fleet.router) + "/v1/completions", data=json.dumps(body).encode(),
                                     method="POST", headers={"content-type": "application/json",
                                                             "x-request-id": "door-fanout"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=120)
    error = json.loads(caught.value.read())["error"]
    assert caught.value.code == 400 and "vocabulary" in error["message"], error
    body["prompt"] = [[1, 2, 3], [4, 5]]
    body["max_tokens"] = 2
    request = urllib.request.Request(http_url(fleet.router) + "/v1/completions", data=json.dumps(body).encode(),
                                     method="POST", headers={"content-type": "application/json",
                                                             "x-request-id": "door-fanout"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200 and reply.headers["x-request-id"] == "door-fanout"
        validated_completion(json.loads(reply.read()))
