"""RadixKVClient and AsyncRadixKVClient against the real services."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from client import AsyncRadixKVClient, RadixKVClient, RadixKVError
from tests.client.helpers import LONG_PROMPT, PROMPT
from tests.services import SHARED_NUM_BLOCKS as MODEL_NUM_BLOCKS
from tests.services import Running


@pytest.fixture
def client(model_service: Running, cache_service: Running):
    with RadixKVClient(model_service.addr, cache_addr=cache_service.addr, timeout=120) as client:
        yield client


def test_generate_equals_the_joined_stream(client: RadixKVClient):
    result = client.generate(PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.stream(PROMPT, max_tokens=8, temperature=0))
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == result.finish_reason in ("stop", "length")
    assert result.usage.completion_tokens == len(result.token_ids) <= 8
    assert result.usage.prompt_tokens == len(client.tokenize(PROMPT).token_ids)
    assert result.request_id


def test_token_id_prompt_gives_the_same_completion(client: RadixKVClient):
    ids = client.tokenize(PROMPT).token_ids
    by_text = client.generate(PROMPT, max_tokens=8, temperature=0)
    by_ids = client.generate(token_ids=ids, max_tokens=8, temperature=0)
    assert by_ids.token_ids == by_text.token_ids


def test_repeated_prompt_hits_the_prefix_cache(client: RadixKVClient):
    first = client.generate(LONG_PROMPT, max_tokens=2, temperature=0)
    second = client.generate(LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 32
    assert second.usage.cached_prompt_tokens >= 16
    assert second.token_ids == first.token_ids


def test_timeout_raises_deadline_exceeded(client: RadixKVClient):
    with pytest.raises(RadixKVError) as raised:
        client.generate(PROMPT, max_tokens=100, ignore_eos=True, temperature=0, timeout=0.2)
    assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "Generate did not finish within the 0.2 s timeout" in str(raised.value)


def test_breaking_out_of_a_stream_cancels_the_request(client: RadixKVClient):
    pool_id = client.model_info().pool_id
    stream = client.stream(PROMPT, max_tokens=100, ignore_eos=True, temperature=0)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        (pool,) = client.stats(pool_id)
        if pool.num_running_requests == 0:
            break
        time.sleep(0.2)
    assert pool.num_running_requests == 0


def test_stats_and_model_info(client: RadixKVClient):
    info = client.model_info()
    assert info.block_size == 16 and info.num_blocks == MODEL_NUM_BLOCKS
    assert info.vocab_size > 0 and info.max_context_tokens > 0
    pools = {p.pool_id: p for p in client.stats()}
    pool = pools[info.pool_id]
    assert pool.num_blocks == MODEL_NUM_BLOCKS
    assert pool.num_free_blocks + pool.num_cached_blocks + pool.num_private_blocks == pool.num_blocks
    assert 0.0 <= pool.hit_rate <= 1.0


def test_abort_from_another_client_and_get_load(client: RadixKVClient, model_service: Running):
    stream = client.stream(PROMPT, max_tokens=200, ignore_eos=True, temperature=0, request_id="lib-abort")
    first = next(stream)
    assert first.request_id == "lib-abort"
    with RadixKVClient(model_service.addr, timeout=30) as other:
        other.abort("lib-abort")
        last = list(stream)[-1]
        assert last.finish_reason == "abort" and last.usage is not None
        assert last.usage.completion_tokens < 200 and last.usage.served_by == model_service.addr
        usage = last.usage
        assert (usage.miss_evicted_tokens + usage.miss_other_replica_tokens + usage.miss_other_namespace_tokens
                + usage.miss_new_tokens) in (0, usage.prompt_tokens - usage.cached_prompt_tokens)
        with pytest.raises(RadixKVError) as raised:
            other.abort("lib-abort")
        assert raised.value.code == grpc.StatusCode.NOT_FOUND and raised.value.method == "Abort"
    info = client.model_info()
    load = client.get_load()
    assert (load.serving_addr, load.pool_id) == (info.serving_addr, info.pool_id) == (model_service.addr, info.pool_id)
    assert load.num_blocks == MODEL_NUM_BLOCKS and 0.0 <= load.kv_usage <= 1.0
    assert load.prompt_tokens >= usage.prompt_tokens and 0.0 <= load.prefix_hit_rate <= 1.0


def test_stats_finds_the_cache_through_model_info(model_service: Running, cache_service: Running):
    with RadixKVClient(model_service.addr, timeout=30) as client:  # no cache_addr given
        assert client.model_info().cache_addr == cache_service.addr
        assert client.stats()


def test_async_client(model_service: Running, cache_service: Running):
    with RadixKVClient(model_service.addr, timeout=120) as sync_client:
        expected = sync_client.generate(PROMPT, max_tokens=8, temperature=0)

    async def run() -> None:
        async with AsyncRadixKVClient(
            model_service.addr, cache_addr=cache_service.addr, timeout=120
        ) as client:
            result = await client.generate(PROMPT, max_tokens=8, temperature=0)
            assert result.token_ids == expected.token_ids and result.text == expected.text
            chunks = [c async for c in client.stream(PROMPT, max_tokens=8, temperature=0)]
            assert "".join(c.text for c in chunks) == expected.text
            assert (await client.tokenize(PROMPT)).token_ids
            info = await client.model_info()
            assert info.pool_id in {p.pool_id for p in await client.stats()}
            load = await client.get_load()
            assert load.pool_id == info.pool_id and load.num_blocks == info.num_blocks
            with pytest.raises(RadixKVError) as raised:
                await client.abort("no-such-request")
            assert raised.value.code_name == "NOT_FOUND"
            many = await asyncio.gather(
                *(client.generate(f"{PROMPT} {i}", max_tokens=4, temperature=0) for i in range(3))
            )
            assert all(r.finish_reason in ("stop", "length") for r in many)
            with pytest.raises(RadixKVError) as raised:
                await client.generate(PROMPT, max_tokens=100, ignore_eos=True, timeout=0.2)
            assert raised.value.code_name == "DEADLINE_EXCEEDED"

    asyncio.run(asyncio.wait_for(run(), 180))
