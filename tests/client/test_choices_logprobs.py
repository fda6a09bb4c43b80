"""The Python client and CLI with issue 30's logprobs, prompt_logprobs and n (choices), against a
real model service on the tiny random Llama (what is checked does not depend on the weights)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator

import pytest

from client import AsyncRadixKVClient, GenerateResult, RadixKVClient
from client.messages import generate_request
from tests.client.helpers import run_cli
from tests.services import Running, start_model
from tests.tiny_model import save_tiny_llama

PROMPT_IDS = [504, 3575, 282, 4649, 314, 1000, 2000, 3000]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def replica(cache_service: Running, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """A model service on the tiny model (the fixture name marks these tests `replica`)."""
    tiny = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    running = start_model(cache_service.addr, "--model", str(tiny), "--worker-id", "tiny-client-choices",
                          "--block-size", "4", "--num-blocks", "256")
    try:
        yield running
    finally:
        running.process.stop(10.0)


@pytest.fixture
def client(replica: Running) -> Iterator[RadixKVClient]:
    with RadixKVClient(replica.addr, timeout=120) as client:
        yield client


def test_request_carries_logprobs_prompt_logprobs_and_n() -> None:
    sampling = generate_request("hi", {"logprobs": 3, "prompt_logprobs": 0, "n": 4}).sampling
    assert sampling.HasField("logprobs") and sampling.logprobs == 3
    assert sampling.HasField("prompt_logprobs") and sampling.prompt_logprobs == 0
    assert sampling.n == 4
    plain = generate_request("hi", {}).sampling
    assert not plain.HasField("logprobs") and not plain.HasField("prompt_logprobs") and plain.n == 0
    with pytest.raises(ValueError, match="n must be >= 1"):
        generate_request("hi", {"n": -1})


def test_generate_refuses_several_choices(client: RadixKVClient) -> None:
    with pytest.raises(ValueError, match="generate_choices"):
        client.generate(PROMPT, n=2, max_tokens=2)


def test_logprobs_per_generated_token(client: RadixKVClient) -> None:
    result = client.generate(token_ids=PROMPT_IDS, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    assert len(result.logprobs) == len(result.token_ids) == 6
    for token, position in zip(result.token_ids, result.logprobs, strict=True):
        assert position.chosen.token_id == token
        assert len(position.top) == 3
        assert [t.rank for t in position.top] == [1, 2, 3]
        assert position.top[0].token_id == token and position.chosen.rank == 1  # greedy: the top token
        assert position.top[0].logprob >= position.top[1].logprob >= position.top[2].logprob
        assert position.chosen.logprob <= 0.0 and position.chosen.token_bytes
    plain = client.generate(token_ids=PROMPT_IDS, max_tokens=6, temperature=0, ignore_eos=True)
    assert plain.logprobs == [] and plain.token_ids == result.token_ids
    # the stream carries each chunk's tokens' entries with them
    chunks = list(client.stream(token_ids=PROMPT_IDS, max_tokens=6, temperature=0, ignore_eos=True, logprobs=1))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)


def test_prompt_logprobs(client: RadixKVClient) -> None:
    result = client.generate(token_ids=PROMPT_IDS, max_tokens=2, temperature=0, prompt_logprobs=2)
    positions = result.prompt_logprobs
    assert [p.chosen.token_id for p in positions] == PROMPT_IDS
    first = positions[0]
    assert (first.chosen.logprob, first.chosen.rank, first.top) == (0.0, 0, [])
    for p in positions[1:]:
        assert len(p.top) == 2 and p.chosen.logprob <= 0.0 and p.chosen.rank >= 1
        assert p.top[0].logprob >= p.chosen.logprob
    assert result.logprobs == []


def test_choices_equal_single_requests_with_consecutive_seeds(client: RadixKVClient) -> None:
    options = {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True, "logprobs": 1}
    choices = client.generate_choices(token_ids=PROMPT_IDS, n=3, seed=11, **options)
    assert [c.index for c in choices] == [0, 1, 2]
    singles = [client.generate(token_ids=PROMPT_IDS, seed=11 + i, **options) for i in range(3)]
    for choice, single in zip(choices, singles, strict=True):
        assert choice.token_ids == single.token_ids and choice.text == single.text
        assert choice.finish_reason == "length" and choice.usage.completion_tokens == 8
        assert choice.usage.prompt_tokens == len(PROMPT_IDS)
        assert len(choice.logprobs) == 8
        assert all(math.isclose(a.chosen.logprob, b.chosen.logprob, abs_tol=1e-5)
                   for a, b in zip(choice.logprobs, single.logprobs, strict=True))
    assert len({tuple(c.token_ids) for c in choices}) > 1  # different seeds: different samples


def test_async_choices(replica: Running) -> None:
    async def main() -> list[GenerateResult]:
        async with AsyncRadixKVClient(replica.addr, timeout=120) as client:
            return await client.generate_choices(token_ids=PROMPT_IDS, n=2, seed=3, max_tokens=4,
                                                 temperature=1.0, ignore_eos=True, prompt_logprobs=1)

    choices = asyncio.run(main())
    assert [c.index for c in choices] == [0, 1] and all(len(c.token_ids) == 4 for c in choices)
    assert len(choices[0].prompt_logprobs) == len(PROMPT_IDS) and choices[1].prompt_logprobs == []


def test_cli_logprobs_and_choices(replica: Running) -> None:
    done = run_cli("generate", PROMPT, "--addr", replica.addr, "--max-tokens", "3", "--temperature", "0",
                   "--ignore-eos", "--logprobs", "2", "--prompt-logprobs", "1", "--json")
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert len(body["logprobs"]) == 3 and len(body["logprobs"][0]["top"]) == 2
    assert isinstance(body["logprobs"][0]["chosen"]["token_bytes"], list)  # bytes as ints, JSON-safe
    assert body["prompt_logprobs"][0]["chosen"]["rank"] == 0

    done = run_cli("generate", PROMPT, "--addr", replica.addr, "--max-tokens", "3", "--temperature", "1",
                   "--seed", "5", "--ignore-eos", "-n", "2", "--json")
    assert done.returncode == 0, done.stderr
    choices = json.loads(done.stdout)["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(len(c["token_ids"]) == 3 for c in choices)

    done = run_cli("generate", PROMPT, "--addr", replica.addr, "--max-tokens", "3", "--temperature", "0",
                   "--logprobs", "1")
    assert done.returncode == 0, done.stderr
    assert "logprobs:" in done.stdout and "rank 1" in done.stdout

    done = run_cli("generate", PROMPT, "--addr", replica.addr, "--max-tokens", "3", "-n", "2", "--stream")
    assert done.returncode == 2 and "needs --json" in done.stderr

    done = run_cli("generate", PROMPT, "--addr", replica.addr, "--max-tokens", "3", "--logprobs", "21")
    assert done.returncode == 1 and "INVALID_ARGUMENT" in done.stderr and "logprobs" in done.stderr


def test_stream_chunks_name_their_choice(replica: Running) -> None:
    done = run_cli("generate", PROMPT, "--addr", replica.addr, "--max-tokens", "4", "--temperature", "1",
                   "--ignore-eos", "-n", "3", "--stream", "--json")
    assert done.returncode == 0, done.stderr
    chunks = [json.loads(line) for line in done.stdout.splitlines()]
    assert {c["index"] for c in chunks} == {0, 1, 2}
    for i in range(3):
        mine = [c for c in chunks if c["index"] == i]
        assert sum(len(c["token_ids"]) for c in mine) == 4 and mine[-1]["finish_reason"] == "length"
