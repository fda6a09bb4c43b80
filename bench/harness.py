"""What every benchmark here shares: our real services as child processes, gRPC streaming clients
that time every token, transformers' own generate() as the reference, noise accounting, Prometheus
scrapes, progress bars and text tables.

Used by `bench.model_bench` (the original model-service benchmark) and by the suite
(`python -m bench`, bench/workloads/).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
import transformers
from transformers.generation.streamers import BaseStreamer

from model_service.model_loader import LoadedModel
from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc
from scripts.service_process import ServiceProcess

try:
    import psutil
except ImportError:  # a dev dependency; without it the foreign-CPU figure is left out
    psutil = None

try:
    from tqdm import tqdm
except ImportError:  # a dev dependency (and one of transformers'); without it no progress bars
    tqdm = None

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
NUM_BLOCKS = 2048  # 32k tokens: model_bench's whole run fits, no eviction during measurements
TOKEN_RANGE = (1000, 40000)  # plain vocabulary tokens, away from special ids
START_TIMEOUT_S = 300.0
RPC_TIMEOUT_S = 900.0
WARMUP_TOKENS = 8  # decode warm-ups exercise every code path; their length does not matter
MIN_REPS = 2  # a phase past its share of the time budget stops repeating after this many
CONTENDED_CORES = 0.25  # other processes using more than this on average: numbers are not clean

Json = dict[str, Any]
OnTokens = Callable[[int], object] | None  # progress callback: n tokens just arrived


# ---------------------------------------------------------------------- small helpers


def summary(samples: Sequence[float]) -> Json:
    """Median (the reported figure), min, max and all samples."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "n": len(samples), "samples": list(samples)}


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation (numpy's default); nan for no values."""
    return float(np.quantile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def dist(values: Sequence[float]) -> Json:
    """p50 / p90 / p99 / mean / max of a latency sample (seconds or ms, as given)."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": pct(values, 0.5), "p90": pct(values, 0.9), "p99": pct(values, 0.99),
            "mean": statistics.fmean(values), "min": min(values), "max": max(values)}


class Prompts:
    """Fresh random token ids from one seeded generator (the same sequence on every run)."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def ids(self, n: int, low: int = TOKEN_RANGE[0]) -> list[int]:
        """n ids in [low, TOKEN_RANGE's end)."""
        return self._rng.integers(low, TOKEN_RANGE[1], n).tolist()

    def lengths(self, count: int, low: int, high: int) -> list[int]:
        return self._rng.integers(low, high + 1, count).tolist()

    def permutation(self, n: int) -> list[int]:
        return self._rng.permutation(n).tolist()


def repetitions(reps: int, deadline: float) -> Iterator[int]:
    """0..reps-1, stopping early (after MIN_REPS) once `deadline` (perf_counter) has passed."""
    for rep in range(reps):
        if rep >= MIN_REPS and time.perf_counter() > deadline:
            return
        yield rep


def alternate(rep: int, ours: Callable[[], None], theirs: Callable[[], None]) -> None:
    """Runs both sides of one repetition, swapping which goes first every other repetition."""
    for fn in ((ours, theirs) if rep % 2 == 0 else (theirs, ours)):
        fn()


def rotate(rep: int, runs: Sequence[Callable[[], None]]) -> None:
    """`alternate` for more than two sides: who goes first moves by one every repetition."""
    for i in range(len(runs)):
        runs[(rep + i) % len(runs)]()


def identical_fraction(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> float:
    """Share of sequences whose tokens equal the reference's (greedy agreement)."""
    pairs = list(zip(ours, theirs, strict=True))
    return sum(list(a) == list(b) for a, b in pairs) / len(pairs) if pairs else float("nan")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (for servers that cannot report the one they bound, e.g. metrics)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LoadMonitor:
    """Load average and CPU used by processes other than ours during a phase."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._pids = pids
        self.phases: dict[str, Json] = {}

    def _ours_cpu(self) -> float:
        total = 0.0
        for pid in self._pids():
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
                if pid == os.getpid():
                    # Children that ran and exited within the phase (vLLM, a second pair of
                    # services): the kernel adds a waited-for child's CPU time to its parent's.
                    total += t.children_user + t.children_system
            except psutil.Error:
                pass
        return total

    @staticmethod
    def _busy_cpu() -> tuple[float, float]:
        """(busy CPU seconds incl. time stolen by the hypervisor, stolen seconds)."""
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0), getattr(t, "steal", 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        busy0 = steal0 = ours0 = 0.0
        if psutil is not None:
            (busy0, steal0), ours0 = self._busy_cpu(), self._ours_cpu()
        try:
            yield
        finally:
            wall = time.perf_counter() - start
            record: Json = {"wall_s": wall, "load1_before": load_before, "load1_after": os.getloadavg()[0]}
            if psutil is not None and wall > 0:
                (busy1, steal1), ours1 = self._busy_cpu(), self._ours_cpu()
                # average cores used by other processes or stolen by the hypervisor
                record["foreign_cpu_cores"] = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall
                record["steal_cpu_cores"] = (steal1 - steal0) / wall
            self.phases[name] = record


def contended(phases: dict[str, Json]) -> bool:
    """True when other processes used more than CONTENDED_CORES on average in some phase."""
    return any(p.get("foreign_cpu_cores", 0.0) > CONTENDED_CORES for name, p in phases.items()
               if name != "startup")


# ---------------------------------------------------------------------- our services over gRPC


class Services:
    """cache_service + model_service as child processes (see scripts/service_process.py)."""

    def __init__(self, *, num_blocks: int = NUM_BLOCKS, dtype: str = "float32", metrics: bool = False,
                 worker_id: str = "model-bench", extra_args: Sequence[str] = ()) -> None:
        self.log: collections.deque[str] = collections.deque(maxlen=200)
        self.cache: ServiceProcess | None = None
        self.model: ServiceProcess | None = None
        self.model_addr = ""
        self.cache_addr = ""
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.worker_id = worker_id
        self.extra_args = list(extra_args)
        self.metrics_port = free_port() if metrics else None

    def start(self) -> None:
        """Starts both; returns once the model service is loading (call `wait` later)."""
        self.cache = ServiceProcess("cache_service", ["--host", "127.0.0.1", "--port", "0"],
                                    self.log.append, cwd=str(REPO))
        self.cache_addr = self.cache.wait_listening(60.0)
        self.cache.wait_serving(60.0)
        args = ["--host", "127.0.0.1", "--port", "0", "--cache-addr", self.cache_addr, "--num-blocks",
                str(self.num_blocks), "--block-size", str(BLOCK_SIZE), "--dtype", self.dtype, "--device", "cpu",
                "--attention", "torch", "--log-level", "WARNING", "--worker-id", self.worker_id, *self.extra_args]
        if self.metrics_port is not None:
            args += ["--metrics-port", str(self.metrics_port)]
        self.model = ServiceProcess("model_service", args, self.log.append, cwd=str(REPO))

    def wait(self) -> str:
        assert self.model is not None and self.cache is not None
        self.model_addr = self.model.wait_listening(START_TIMEOUT_S, watch=[self.cache])
        self.model.wait_serving(START_TIMEOUT_S, watch=[self.cache])
        return self.model_addr

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port is None else f"http://127.0.0.1:{self.metrics_port}/metrics"

    def clear_pool(self) -> int:
        """Drops every unlocked cached block of our pool (between workloads: each starts cold)."""
        return clear_pools(self.cache_addr, [self.worker_id])

    def pids(self) -> list[int]:
        return [p.pid for p in (self.cache, self.model) if p is not None and p.running()]

    def stop(self) -> None:
        for process in (self.model, self.cache):
            if process is not None:
                process.stop(10.0)
        self.model = self.cache = None


def clear_pools(cache_addr: str, worker_ids: Sequence[str] | None = None) -> int:
    """Clear (cache.proto) every pool of the cache manager at `cache_addr`, or only those of
    `worker_ids`; returns the number of blocks evicted."""
    evicted = 0
    with grpc.insecure_channel(cache_addr) as channel:
        stub = cache_pb2_grpc.CacheManagerStub(channel)
        for pool in stub.Stats(cache_pb2.StatsRequest(), timeout=30).pools:
            if worker_ids is None or pool.worker_id in worker_ids:
                reply = stub.Clear(cache_pb2.ClearRequest(pool_id=pool.pool_id, epoch=pool.epoch), timeout=30)
                evicted += reply.num_evicted_blocks
    return evicted


def generate_request(ids: list[int], max_tokens: int, namespace: str = "") -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(
        token_ids=model_pb2.TokenIds(ids=ids), namespace=namespace,
        sampling=model_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


@dataclass(slots=True)
class Streamed:
    """One Generate call seen from the client."""

    sent: float  # perf_counter at the call
    times: list[float] = field(default_factory=list)  # arrival time of every generated token
    token_ids: list[int] = field(default_factory=list)
    usage: model_pb2.Usage = field(default_factory=model_pb2.Usage)

    def add(self, message: model_pb2.GenerateResponse) -> None:
        """Records one streamed message as it arrives."""
        self.times.extend([time.perf_counter()] * len(message.token_ids))
        self.token_ids.extend(message.token_ids)
        if message.HasField("usage"):
            self.usage = message.usage

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    @property
    def decode_s(self) -> float:
        """First token to last token."""
        return self.times[-1] - self.times[0]

    def gaps(self) -> list[float]:
        """Inter-token gaps in seconds (0 between tokens that came in one message)."""
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    def decode_tok_s(self) -> float:
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])

    def e2e_tok_s(self) -> float:
        return len(self.times) / (self.times[-1] - self.sent)


def stream_sync(stub: model_pb2_grpc.ModelServiceStub, ids: list[int], max_tokens: int,
                namespace: str = "") -> Streamed:
    streamed = Streamed(time.perf_counter())
    for message in stub.Generate(generate_request(ids, max_tokens, namespace), timeout=RPC_TIMEOUT_S):
        streamed.add(message)
    return streamed


async def stream_async(stub: model_pb2_grpc.ModelServiceStub, ids: list[int], max_tokens: int,
                       namespace: str = "", on_tokens: OnTokens = None) -> Streamed:
    streamed = Streamed(time.perf_counter())
    async for message in stub.Generate(generate_request(ids, max_tokens, namespace), timeout=RPC_TIMEOUT_S):
        streamed.add(message)
        if on_tokens is not None and message.token_ids:
            on_tokens(len(message.token_ids))
    return streamed


def stream_concurrent(addr: str, prompts: list[list[int]], max_tokens: int, *,
                      namespaces: Sequence[str] | None = None, arrivals_s: Sequence[float] | None = None,
                      on_tokens: OnTokens = None) -> tuple[float, list[Streamed]]:
    """All prompts at once (or request i sent `arrivals_s[i]` seconds after the start) over one
    grpc.aio channel; returns (wall seconds from the start to the last token, per-request results)."""

    async def one(stub: model_pb2_grpc.ModelServiceStub, start: float, i: int) -> Streamed:
        if arrivals_s is not None:
            await asyncio.sleep(max(0.0, start + arrivals_s[i] - time.perf_counter()))
        return await stream_async(stub, prompts[i], max_tokens, namespaces[i] if namespaces else "", on_tokens)

    async def run() -> tuple[float, list[Streamed]]:
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            await channel.channel_ready()
            start = time.perf_counter()
            results = await asyncio.gather(*(one(stub, start, i) for i in range(len(prompts))))
            return time.perf_counter() - start, list(results)

    return asyncio.run(run())


def stream_stats(start: float, results: Sequence[Streamed]) -> Json:
    """What a concurrent run's streams say: TTFT from each request's send (and from the run's
    start), decode time per request (first to last token), inter-token gaps, prompt cache hits."""
    gaps = [g for r in results for g in r.gaps()]
    prompt = sum(r.usage.prompt_tokens for r in results)
    cached = sum(r.usage.cached_prompt_tokens for r in results)
    return {
        "ttft_s": dist([r.ttft for r in results]),
        "ttft_from_start_s": dist([r.times[0] - start for r in results]),
        "decode_s": dist([r.decode_s for r in results]),
        "inter_token_ms": dist([1e3 * g for g in gaps]),
        "prompt_tokens": prompt, "cached_prompt_tokens": cached,
        "hit_rate": cached / prompt if prompt else float("nan"),
        "completion_tokens": sum(len(r.times) for r in results),
        "preemptions": sum(r.usage.num_preemptions for r in results),
    }


def stream_record(s: Streamed) -> Json:
    """One request's TTFT (from the client's send, and Usage.time_to_first_token as the replica
    measured it), its prompt's cached tokens by where they came from, and its output tokens."""
    u = s.usage
    return {"ttft_s": s.ttft, "server_ttft_s": u.time_to_first_token, "prompt_tokens": u.prompt_tokens,
            "cached_tokens": u.cached_prompt_tokens, "cached_device_tokens": u.cached_device_tokens,
            "cached_host_tokens": u.cached_host_tokens, "cached_disk_tokens": u.cached_disk_tokens,
            "cached_peer_tokens": u.cached_peer_tokens, "token_ids": s.token_ids}


def time_split(start: float, end: float, results: Sequence[Streamed]) -> Json:
    """A concurrent run's wall time split at the moment every request has its first token:
    `prefill_s` = start until then (decode of early requests overlaps it), `decode_s` = the rest."""
    all_first = max(r.times[0] for r in results)
    return {"prefill_s": all_first - start, "decode_s": end - all_first}


# ---------------------------------------------------------------------- Prometheus scrapes


def scrape(url: str | None) -> Json:
    """{name: value} for counters and gauges, {name: {"buckets": [(le, cumulative)], "sum", "count"}}
    for histograms, from a Prometheus text endpoint ({} when there is none)."""
    if url is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: Json = {}
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            hist: Json = {"buckets": [], "sum": 0.0, "count": 0.0}
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    hist["buckets"].append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_sum"):
                    hist["sum"] = s.value
                elif s.name.endswith("_count"):
                    hist["count"] = s.value
            out[family.name] = hist
        else:
            out[family.name] = sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= rank:
            if le == float("inf"):
                return lower  # past the last finite bound: its value is all we know
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = le, cumulative
    return lower


def metrics_delta(before: Json, after: Json) -> Json:
    """The model service's cache RPCs per scheduler step and Step RPC latency over a workload."""
    if not before or not after:
        return {}

    def hist(name: str) -> Json:
        a, b = after.get(name), before.get(name, {"buckets": [], "sum": 0.0, "count": 0.0})
        if a is None:
            return {"buckets": [], "sum": 0.0, "count": 0.0}
        prior = dict(b["buckets"])
        return {"buckets": [(le, c - prior.get(le, 0.0)) for le, c in a["buckets"]],
                "sum": a["sum"] - b["sum"], "count": a["count"] - b["count"]}

    rpc, step = hist("radixkv_model_cache_rpc_seconds"), hist("radixkv_model_step_seconds")
    counter = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (
        "radixkv_model_prompt_tokens", "radixkv_model_prefix_cache_hit_tokens", "radixkv_model_generated_tokens",
        "radixkv_model_preemptions")}
    return {
        "cache_rpcs": rpc["count"], "steps": step["count"],
        "cache_rpcs_per_step": rpc["count"] / step["count"] if step["count"] else float("nan"),
        "cache_rpc_p50_ms": 1e3 * histogram_quantile(0.5, rpc["buckets"]),
        "cache_rpc_p99_ms": 1e3 * histogram_quantile(0.99, rpc["buckets"]),
        "cache_rpc_mean_ms": 1e3 * rpc["sum"] / rpc["count"] if rpc["count"] else float("nan"),
        "cache_rpc_total_s": rpc["sum"], "step_total_s": step["sum"],
        "step_mean_ms": 1e3 * step["sum"] / step["count"] if step["count"] else float("nan"),
        "prompt_tokens": counter["radixkv_model_prompt_tokens"],
        "cached_prompt_tokens": counter["radixkv_model_prefix_cache_hit_tokens"],
        "generated_tokens": counter["radixkv_model_generated_tokens"],
        "preemptions": counter["radixkv_model_preemptions"],
    }


# ---------------------------------------------------------------------- transformers in-process


class TimingStreamer(BaseStreamer):
    """Records the time of every generated token (generate() first puts the prompt: skipped);
    `on_tokens(batch)` is called at every step (progress bars)."""

    def __init__(self, on_tokens: OnTokens = None) -> None:
        self.times: list[float] = []
        self._prompt_seen = False
        self._on_tokens = on_tokens

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        if self._on_tokens is not None:
            self._on_tokens(int(value.shape[0]) if value.dim() else 1)

    def end(self) -> None:
        pass


def greedy_config(model: transformers.PreTrainedModel, pad_id: int, max_new_tokens: int) -> transformers.GenerationConfig:
    """Greedy, exactly `max_new_tokens` (ignore_eos, as our requests)."""
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = None
    config.do_sample = False
    # None would be filled in from the model's defaults by generate(); an id outside the
    # vocabulary is never produced, so it never stops.
    config.eos_token_id = model.config.vocab_size
    config.pad_token_id = pad_id
    return config


class Reference:
    """transformers' own generate() on the same weights (sdpa attention, its DynamicCache)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.model = loaded.model
        self.pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0

    def _config(self, max_new_tokens: int) -> transformers.GenerationConfig:
        return greedy_config(self.model, self.pad_id, max_new_tokens)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 streamer: BaseStreamer | None = None) -> tuple[float, list[list[int]]]:
        """Left-padded batch generate; returns (wall seconds, generated ids per prompt)."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, generation_config=self._config(max_new_tokens),
                                  streamer=streamer)
        wall = time.perf_counter() - start
        generated = out[:, width:].tolist()
        if any(len(g) != max_new_tokens for g in generated):
            raise RuntimeError("transformers stopped early: EOS was not ignored")
        return wall, generated

    def static_batches(self, batches: Sequence[list[list[int]]], max_new_tokens: int, *,
                       deadline: float | None = None, on_tokens: OnTokens = None) -> Json:
        """Static batching, one batch after another (all submitted at the start): per batch the
        prefill (start to first token) and decode (first to last token) times, and per request
        its time to first token from the start. Stops (after at least one batch) at `deadline`."""
        start = time.perf_counter()
        tokens: list[list[int]] = []
        prefill = decode = 0.0
        ttft: list[float] = []
        done = 0
        for batch in batches:
            if done and deadline is not None and time.perf_counter() > deadline:
                break
            streamer = TimingStreamer(on_tokens)
            began = time.perf_counter()
            wall, generated = self.generate(batch, max_new_tokens, streamer)
            first = streamer.times[0]
            prefill += first - began
            decode += began + wall - first
            ttft += [first - start] * len(batch)
            tokens += generated
            done += 1
        wall = time.perf_counter() - start
        return {"wall_s": wall, "batches_run": done, "batches_total": len(batches), "tokens": tokens,
                "completion_tokens": sum(len(t) for t in tokens), "tok_s": sum(len(t) for t in tokens) / wall,
                "prefill_s": prefill, "decode_s": decode, "ttft_from_start_s": dist(ttft)}


class ContinuousReference:
    """transformers' own continuous batching (paged attention, block sharing = its prefix cache)
    on a copy of the same weights: the manager behind `model.generate_batch(...)`, started before
    the clock (its KV allocation and background thread), then every request added at once."""

    PAGE_SIZE = 256  # transformers' default page (block) size
    MAX_KV_BYTES = 3 << 30  # as much KV as our model service gets (4096 blocks of 16 tokens in fp32)

    def __init__(self, loaded: LoadedModel, max_batch_tokens: int = 2048) -> None:
        self.model = copy.deepcopy(loaded.model)  # it switches attention to a paged variant
        self.pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
        self.max_batch_tokens = max_batch_tokens

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new_tokens: int, *, on_tokens: OnTokens = None,
            timeout_s: float = 1800.0) -> Json:
        from transformers import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        # enough pages for every request without sharing, but at most MAX_KV_BYTES of KV (its
        # scheduler waits for free pages when shared prefixes do not cover the rest)
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        page_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * self.PAGE_SIZE
                      * self.model.dtype.itemsize)
        needed = sum(-(-(len(p) + max_new_tokens) // self.PAGE_SIZE) for p in prompts) + 8
        pages = max(min(needed, self.MAX_KV_BYTES // page_bytes), -(-(max(len(p) for p in prompts) + max_new_tokens)
                                                                   // self.PAGE_SIZE) + 8)
        cb_config = ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=self.max_batch_tokens,
                                             allow_block_sharing=True)
        hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max_new_tokens,
                              num_requests=len(prompts))
        config = greedy_config(self.model, self.pad_id, max_new_tokens)
        results: dict[str, Any] = {}
        with self.model.continuous_batching_context_manager(
                generation_config=config, continuous_batching_config=cb_config, block=True, timeout=10,
                warmup=False, workload_hints=hints) as manager:
            start = time.perf_counter()
            ids = manager.add_requests(inputs=prompts, max_new_tokens=max_new_tokens, record_timestamps=True)
            while len(results) < len(ids):
                if time.perf_counter() - start > timeout_s:
                    raise TimeoutError(f"continuous batching took over {timeout_s:g} s")
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped")
                    continue
                if result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers' continuous batching failed: {result.error}")
                    results[result.request_id] = result
                    if on_tokens is not None:
                        on_tokens(len(result.generated_tokens))
            end = max(r.timestamps[-1] for r in results.values())
            attn = self.model.config._attn_implementation  # the paged variant it ran with
        ordered = [results[i] for i in ids]
        tokens = [list(r.generated_tokens) for r in ordered]
        firsts = [r.timestamps[0] for r in ordered]
        all_first = max(firsts)
        wall = end - start
        return {"wall_s": wall, "tokens": tokens, "completion_tokens": sum(len(t) for t in tokens),
                "tok_s": sum(len(t) for t in tokens) / wall, "ttft_from_start_s": dist([f - start for f in firsts]),
                "decode_s": dist([r.timestamps[-1] - r.timestamps[0] for r in ordered]),
                "split": {"prefill_s": all_first - start, "decode_s": end - all_first},
                "config": {"page_size": self.PAGE_SIZE, "num_blocks": pages, "max_batch_tokens": self.max_batch_tokens,
                           "allow_block_sharing": True, "attn_implementation": attn}}


# ---------------------------------------------------------------------- report helpers


def table(rows: list[list[str]], header: list[str]) -> str:
    """Text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths,
                                                                                               strict=True)))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
              for r in rows]
    return "\n".join(lines)


class Progress:
    """tqdm bars on stderr: one per workload (its runs), one per run (its tokens, then gone)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and tqdm is not None
        self._bar: Any = None

    def write(self, text: str) -> None:
        if self.enabled:
            tqdm.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    @contextmanager
    def workload(self, name: str, runs: int) -> Iterator[None]:
        if self.enabled:
            self._bar = tqdm(total=runs, desc=name, unit="run", file=sys.stderr, dynamic_ncols=True)
        try:
            yield
        finally:
            if self._bar is not None:
                self._bar.close()
            self._bar = None

    @contextmanager
    def run(self, label: str, tokens: int) -> Iterator[Callable[[int], object]]:
        """A run expected to produce `tokens` tokens; yields the callback that advances its bar."""
        if not self.enabled:
            yield lambda n: None
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label)
        bar = tqdm(total=tokens, desc=f"  {label}", unit="tok", leave=False, file=sys.stderr, dynamic_ncols=True)
        try:
            yield bar.update
        finally:
            bar.close()
            if self._bar is not None:
                self._bar.update(1)


# ---------------------------------------------------------------------- machine description


def kernels_line(log: Iterable[str]) -> str:
    """A model service's start-up lines about what runs: model, dtype, attention backend and its
    kernels, pool; the linear products' mode (for printing beside every number)."""
    found = []
    for line in log:
        match = re.search(r"(model \S+ on .*KV pool.*)$", line) or re.search(r"(linear products, .*mode(?:, bf16 \S+ rows on radixkv's [^:(]*)?)", line)
        if match:
            found.append(match.group(1))
    return "; ".join(found[:2])


def machine_info(threads: int) -> Json:
    """CPU model, cores, memory, versions and the git revision: what a number needs next to it."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    family = model_number = None  # with the model name (often just "AMD EPYC" on VMs): which generation
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "cpu family" and family is None:
                family = int(value)
            elif key.strip() == "model" and model_number is None:
                model_number = int(value)
    except (OSError, ValueError):
        pass
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f" {f}" in flags]
    except (OSError, StopIteration):
        isa = []
    info: Json = {
        "cpu_model": cpu, "cpu_family": family, "cpu_model_number": model_number,
        "cpu_label": cpu if family is None else f"{cpu} (family {family}, model {model_number})",
        "cpu_isa": isa, "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False) if psutil else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1) if psutil else None,
        "torch_threads": threads, "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "grpcio": grpc.__version__,
        "numpy": np.__version__, "load1_at_start": os.getloadavg()[0],
    }
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
        info["git_commit"] = rev.stdout.strip()
        info["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info
