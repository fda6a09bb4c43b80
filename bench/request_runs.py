"""Concurrent Generate calls with whole GenerateRequests (chat prompts, structured outputs, n > 1
choices), all sent at once over one grpc.aio channel and tracked per choice: the runner of the
`structured` and `parallel_sampling` workloads (bench.harness.stream_concurrent only sends greedy
token-id prompts with one choice each)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from bench.harness import RPC_TIMEOUT_S, OnTokens, Services, kernels_line, machine_info
from protos import model_pb2, model_pb2_grpc

if TYPE_CHECKING:
    from bench.workloads.base import Context


@dataclass(slots=True)
class Choice:
    """One choice of one Generate call as the client saw it."""

    index: int
    times: list[float] = field(default_factory=list)  # arrival time (perf_counter) of every token
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = model_pb2.FINISH_REASON_UNSPECIFIED
    usage: model_pb2.Usage = field(default_factory=model_pb2.Usage)


@dataclass(slots=True)
class Call:
    """One Generate call: when it was sent and its choices by index."""

    sent: float
    choices: dict[int, Choice] = field(default_factory=dict)

    def add(self, message: model_pb2.GenerateResponse) -> None:
        choice = self.choices.get(message.index)
        if choice is None:
            choice = self.choices[message.index] = Choice(message.index)
        choice.times.extend([time.perf_counter()] * len(message.token_ids))
        choice.token_ids.extend(message.token_ids)
        choice.text += message.text
        if message.finish_reason:
            choice.finish_reason = message.finish_reason
        if message.HasField("usage"):
            choice.usage = message.usage

    def ordered(self) -> list[Choice]:
        return [self.choices[i] for i in sorted(self.choices)]


@dataclass(slots=True)
class RunResult:
    """A batch of concurrent calls: wall seconds from the first send to the last token, and the calls."""

    wall_s: float
    calls: list[Call]

    def choices(self) -> list[Choice]:
        return [c for call in self.calls for c in call.ordered()]

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices())

    def prompt_tokens_computed(self) -> int:
        """Prompt tokens the replica computed: usage prompt_tokens - cached_prompt_tokens, summed
        over every choice (a fork's choices report the prompt's pages they shared as cached)."""
        return sum(c.usage.prompt_tokens - c.usage.cached_prompt_tokens for c in self.choices())

    def tok_s(self) -> float:
        return self.completion_tokens() / self.wall_s

    def ttfts(self) -> list[float]:
        return [c.times[0] - call.sent for call in self.calls for c in call.ordered() if c.times]

    def inter_token_ms(self) -> list[float]:
        return [1e3 * (b - a) for c in self.choices() for a, b in zip(c.times, c.times[1:], strict=False)]


async def _one(stub: model_pb2_grpc.ModelServiceStub, request: model_pb2.GenerateRequest, on_tokens: OnTokens) -> Call:
    call = Call(time.perf_counter())
    async for message in stub.Generate(request, timeout=RPC_TIMEOUT_S):
        call.add(message)
        if on_tokens is not None and message.token_ids:
            on_tokens(len(message.token_ids))
    return call


def run_concurrent(addr: str, requests: Sequence[model_pb2.GenerateRequest], on_tokens: OnTokens = None) -> RunResult:
    """Sends every request at once; returns when the last stream ends."""

    async def run() -> RunResult:
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            await channel.channel_ready()
            start = time.perf_counter()
            calls = await asyncio.gather(*(_one(stub, r, on_tokens) for r in requests))
            return RunResult(time.perf_counter() - start, list(calls))

    return asyncio.run(run())


def start_replica(ctx: Context, name: str, num_blocks: int) -> tuple[Services, str, str]:
    """A workload's own cache manager and replica (INFO logs, for the kernels line printed beside
    its numbers): (services, the replica's address, the kernels line). The caller stops them."""
    services = Services(num_blocks=num_blocks, dtype=ctx.dtype, worker_id=f"bench-{name.replace('_', '-')}",
                        extra_args=["--log-level", "INFO", "--num-threads", str(ctx.threads)])
    try:
        with ctx.progress.run(f"{name}: starting its cache manager and replica", 0):
            services.start()
            addr = services.wait()
    except BaseException:
        services.stop()
        raise
    ctx.extra_pids.update(services.pids())
    kernels = kernels_line(services.log)
    ctx.progress.write(f"{name}: {machine_info(ctx.threads)['cpu_label']}; {kernels or '(no kernels line)'}")
    return services, addr, kernels
