"""The pipelined engine (--cache-pipeline on, lookahead blocks) against the synchronous one, on
the tiny random Llama through real services: random arrivals, lengths, shared prefixes, client
cancels and request ids reused as soon as they are free, in a pool small enough to preempt and
evict. Both modes must give every request transformers' greedy tokens and leave the cache's
block accounting whole; lookahead blocks show in Stats while requests run, and only then."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_service.model_loader import LoadedModel, load_model
from protos import model_pb2, model_pb2_grpc
from tests.model_service.checks import pool_stats, wait_for, wait_until_idle
from tests.model_service.generation import reference_greedy
from tests.services import start_model

BLOCK_SIZE = 4
MODES = ("on", "off")


class Job(NamedTuple):
    family: int  # which shared prefix its prompt starts with
    prefix_len: int
    tail: tuple[int, ...]  # its own tokens after the prefix
    max_tokens: int
    delay_s: float  # after the previous job was sent
    cancel_after: int | None  # cancel the stream after this many tokens (None: run to the end)


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> LoadedModel:
    return load_model(str(tiny_dir), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def services(cache_service, tiny_dir) -> Iterator[dict[str, model_pb2_grpc.ModelServiceStub]]:
    """One model service per mode: 40 blocks of 4 tokens (a few requests at once, then preemption
    and eviction), 16 tokens per step (long prompts are chunked)."""
    running = [start_model(cache_service.addr, "--model", str(tiny_dir), "--worker-id", f"tiny-pipe-{mode}",
                           "--block-size", str(BLOCK_SIZE), "--num-blocks", "40", "--max-batch-tokens", "16",
                           "--cache-pipeline", mode) for mode in MODES]
    channels = [grpc.insecure_channel(r.addr) for r in running]
    try:
        yield {mode: model_pb2_grpc.ModelServiceStub(c) for mode, c in zip(MODES, channels, strict=True)}
    finally:
        for channel in channels:
            channel.close()
        for r in running:
            r.process.stop(10.0)


PREFIXES = [[random.Random(seed).randrange(3, 49152) for _ in range(24)] for seed in range(3)]

jobs_strategy = st.lists(
    st.builds(
        Job,
        family=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(0, 24),
        tail=st.lists(st.integers(3, 49151), min_size=1, max_size=12).map(tuple),
        max_tokens=st.integers(1, 24),
        delay_s=st.sampled_from([0.0, 0.0, 0.005, 0.02, 0.05]),
        cancel_after=st.one_of(st.none(), st.none(), st.integers(1, 4)),
    ),
    min_size=1, max_size=7,
)


def _prompt(job: Job) -> list[int]:
    return PREFIXES[job.family][:job.prefix_len] + list(job.tail)


def _run_one(stub, job: Job, request_id: str) -> list[int] | None:
    """Streams one job; its tokens, or None when it was cancelled before its end."""
    request = model_pb2.GenerateRequest(request_id=request_id, token_ids=model_pb2.TokenIds(ids=_prompt(job)),
                                        sampling=model_pb2.SamplingParams(temperature=0.0,
                                                                          max_tokens=job.max_tokens))
    deadline = time.monotonic() + 60
    while True:  # the id may still be held by the job before it with the same id
        call = stub.Generate(request, timeout=120)
        tokens: list[int] = []
        try:
            for message in call:
                tokens.extend(message.token_ids)
                if job.cancel_after is not None and len(tokens) >= job.cancel_after and not message.HasField("usage"):
                    call.cancel()
                    return None
            return tokens
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and job.cancel_after is not None:
                return None
            if e.code() != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _run_jobs(stub, jobs: list[Job]) -> list[list[int] | None]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = []
        for i, job in enumerate(jobs):
            time.sleep(job.delay_s)
            futures.append(pool.submit(_run_one, stub, job, f"job-{i % 2}"))  # ids reused
        return [f.result() for f in futures]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(jobs=jobs_strategy)
def test_pipelined_engine_matches_the_synchronous_one(services, cache_stub, tiny, jobs):
    results = {}
    with ThreadPoolExecutor(len(MODES)) as pool:  # both modes at once: random interleavings
        futures = {mode: pool.submit(_run_jobs, services[mode], jobs) for mode in MODES}
        results = {mode: f.result() for mode, f in futures.items()}
    for i, job in enumerate(jobs):
        expected = reference_greedy(tiny, _prompt(job), job.max_tokens)
        for mode in MODES:
            got = results[mode][i]
            if got is not None:
                assert got == expected, (mode, i, job)
    for mode in MODES:
        stats = wait_until_idle(cache_stub, f"tiny-pipe-{mode}")
        assert stats.num_lookahead_blocks == 0, stats


def test_lookahead_blocks_are_held_while_running_and_counted(services, cache_stub, tiny):
    """A long decode with the pipeline on holds 1-2 spare blocks (the default 2; one while a
    crossing's ask is in flight); off, none."""
    prompt = PREFIXES[0][:10]
    max_tokens = 60
    seen: dict[str, set[int]] = {mode: set() for mode in MODES}
    for mode in MODES:
        done = threading.Event()
        out: list[list[int]] = []

        def run(stub=services[mode], out=out, done=done) -> None:
            request = model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=prompt), sampling=model_pb2.SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            out.append([t for m in stub.Generate(request, timeout=120) for t in m.token_ids])
            done.set()

        thread = threading.Thread(target=run)
        thread.start()
        pool = f"tiny-pipe-{mode}"
        wait_for(lambda pool=pool, done=done: pool_stats(cache_stub, pool).num_running_requests == 1 or done.is_set(),
                 60, "the request running")
        while not done.is_set():
            stats = pool_stats(cache_stub, pool)
            if stats.num_running_requests:
                seen[mode].add(stats.num_lookahead_blocks)
            time.sleep(0.002)
        thread.join(60)
        assert out[0] == reference_greedy(tiny, prompt, max_tokens, ignore_eos=True)
        assert wait_until_idle(cache_stub, pool).num_lookahead_blocks == 0
    assert seen["off"] <= {0}
    assert seen["on"] and seen["on"] <= {0, 1, 2} and 2 in seen["on"], seen
