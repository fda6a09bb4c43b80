"""Builds the model service (model, KV pool, backend, scheduler, engine) and serves it over grpc.aio."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field

import grpc
import torch

from common.auth import ClientToken, TokenStore, server_interceptors
from common.grpc_server import add_health_and_reflection, add_servicer, format_address, new_server, set_health
from common.limits import RequestLimits, ServerLimits, id_error
from common.metrics_server import DEFAULT_METRICS_HOST
from common.security import ClientTLS, ServerTLS, add_port
from common.server_runner import ServerHooks, run_server
from common.shards import parse_shards, shard_for
from model_service import native
from model_service.attention import AttentionBackend, TorchAttentionBackend, create_attention_backend
from model_service.cache_client import CacheClient
from model_service.copy_costs import CopyCosts
from model_service.engine import Engine, EngineConfig
from model_service.kv_cache import KVCache, KVCacheSpec
from model_service.kv_pulls import transfer_servicer as transfer
from model_service.kv_pulls.puller import PeerPuller
from model_service.linear import ModelLinears, dot
from model_service.linear.packed import warm_up
from model_service.metrics import ModelMetrics
from model_service.model_loader import load_model
from model_service.model_runner import ModelRunner
from model_service.sampler import Sampler
from model_service.scheduler import DEFAULT_MAX_NUM_SEQS, Scheduler, SchedulerConfig
from model_service.servicer import METHOD_ROLES, ModelServicer, ServingInfo
from model_service.tiers.copier import TierCopier
from model_service.tiers.disk_tier import DiskTier
from model_service.tiers.host_tier import HostTier
from model_service.torch_threads import run_in_passing_thread
from protos import kv_transfer_pb2, model_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name
# Spare blocks per running request in pipelined mode: with 16-token blocks, two give an extension
# at least 17 steps to come back before it is needed (bench/README.md, cache_link).
DEFAULT_LOOKAHEAD_BLOCKS = 2
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class ModelServiceConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    cache_addr: str = "127.0.0.1:50051"
    model: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    device: str = "auto"
    dtype: str = "auto"
    attention: str = "auto"
    attention_kernels: str = "auto"  # the torch backend's kernels: "auto" (native where built) or "torch"
    linear_kernels: str = "auto"  # float32 products: "auto" (native where bitwise F.linear) or "torch"
    # "exact": only paths verified bit-identical to F.linear per weight shape; "fast": any, marked
    # in the plan; "auto": exact for float32 with fp32_gemm "mkl", else fast (linear/planner.py).
    linear_mode: str = "auto"
    # float32 products on CPU: "mkl" (F.linear, bitwise transformers) or "onednn" (packed, faster
    # where MKL is slow, e.g. AMD; greedy output may part from transformers' at near ties).
    fp32_gemm: str = "mkl"
    max_batch_tokens: int = 2048
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_waiting: int = 1024
    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST  # not `host`: the token-less metrics stay private by default
    worker_id: str | None = None
    cache_timeout: float = 10.0
    # Overlap each cache Step with the previous forward pass; lookahead blocks per request then.
    cache_pipeline: bool = True
    cache_step_stream: bool = True  # Steps over one StepStream (--cache-steps stream), not a call each
    lookahead_blocks: int = DEFAULT_LOOKAHEAD_BLOCKS
    # Address clients dial to reach this replica (reported to the cache manager and in
    # ModelInfo). None: host:port, with the port actually bound when port is 0.
    advertise_addr: str | None = None
    grace_seconds: float = 2.0
    # TLS of the gRPC port, its bearer tokens (role "client"), and how to reach the cache manager.
    tls: ServerTLS | None = None
    tokens: TokenStore | None = None
    cache_tls: ClientTLS | None = None
    cache_token: ClientToken = field(default_factory=lambda: ClientToken(None))
    # Transport limits of the gRPC port and per-request limits (common/limits.py).
    limits: ServerLimits = field(default_factory=ServerLimits)
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    # Lower KV tiers (model_service/tiers/, docs/tiers.md): host memory and a disk directory, in
    # bytes (0: none), and when pages are copied down ("evict" or "write-through").
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    offload_policy: str = "evict"
    # Peer KV pulls (model_service/kv_pulls/, docs/kv-pulls.md): serve KvTransfer and pull.
    kv_pulls: bool = False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _kernels_note(backend: AttentionBackend, kernels: str) -> str:
    """What the start-up log says of the torch backend's kernels."""
    if not isinstance(backend, TorchAttentionBackend) or backend.device.type != "cpu":
        return ""
    if backend.native:
        on_sdpa = [kind for kind, on in (("prompts", backend.bf16_prompts_on_sdpa),
                                         ("chunks after a cached prefix", backend.bf16_extends_on_sdpa)) if on]
        tiles = (f"; bf16 calls of {backend.bf16_tiles_from}+ queries per head on AMX tiles"
                 if backend.bf16_tiles_from is not None else "")
        fewer = "other " if tiles else ""
        return (" (radixkv AVX-512 kernels" + tiles
                + (f"; {fewer}bf16 {' and '.join(on_sdpa)} on torch SDPA, timed faster here" if on_sdpa else "") + ")")
    if kernels == "torch":
        return " (torch kernels: --attention-kernels torch)"
    return f" (torch kernels: native ones {native.unavailable_reason() or 'do not take this model or dtype'})"


def _linear_plan_note(linears: ModelLinears, kernels: str) -> str:
    """Why no product takes the native kernel, when none does and it could have."""
    if kernels == "torch" or any(plan.uses("blocked") for plan in linears.plans):
        return ""
    if not any(plan.dtype == "float32" for plan in linears.plans):
        return ""
    return f" (native kernel: {native.unavailable_reason() or 'no shape summed by MKL in an order it reproduces'})"


def _dot_note(linears: ModelLinears) -> str:
    """The row counts the bf16 kernel of linear/dot.py takes, where the timing run gave it any."""
    dot_rows = linears.timing.dot_rows if linears.timing is not None else 0
    if not dot_rows or not any(plan.uses("dot") for plan in linears.plans):
        return ""
    return f", bf16 1-{dot_rows} rows on radixkv's {dot.engine()}"


def build_engine(config: ModelServiceConfig, worker_id: str) -> tuple[Engine, ModelServicer]:
    """Loads the model and wires every part of the service (slow: loads weights)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    loaded = load_model(config.model, dtype, device)
    model_config = loaded.model.config
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    spec = KVCacheSpec(model_config.num_hidden_layers, model_config.num_key_value_heads, head_dim,
                       config.block_size, dtype)
    num_blocks = config.num_blocks or spec.num_blocks_for_memory(config.kv_cache_memory)
    kv_cache = KVCache(spec, num_blocks, device)
    backend = create_attention_backend(config.attention, model_config.num_attention_heads,
                                       model_config.num_key_value_heads, head_dim, config.block_size, dtype, device,
                                       kernels=config.attention_kernels)
    log.info("model %s on %s (%s), attention %s%s, KV pool %d blocks x %d tokens (%.1f MiB)%s", loaded.name, device,
             dtype, backend.name, _kernels_note(backend, config.attention_kernels), num_blocks, config.block_size, kv_cache.num_bytes / 2**20,
             ", float32 products through oneDNN" if config.fp32_gemm == "onednn" and dtype == torch.float32 else "")
    runner = ModelRunner(loaded.model, kv_cache, backend, device, config.fp32_gemm, config.linear_kernels,
                         config.linear_mode)
    log.info("linear products, %s mode%s%s:\n%s", runner.linears.mode, _dot_note(runner.linears),
             _linear_plan_note(runner.linears, config.linear_kernels), runner.linears.table())
    if device.type == "cpu":
        started = time.perf_counter()
        calls = warm_up(runner.linears.packed_weights(), config.max_num_seqs)
        if calls:
            log.info("oneDNN kernels for 1-%d rows built in %.1f s", config.max_num_seqs, time.perf_counter() - started)
    scheduler = Scheduler(SchedulerConfig(config.block_size, config.max_batch_tokens, config.max_num_seqs,
                                          config.max_waiting, lookahead_blocks=config.lookahead_blocks))
    shards = parse_shards(config.cache_addr)
    cache_addr = shard_for(worker_id, shards)  # common/shards.py: this replica's pool lives there
    if len(shards) > 1:
        log.info("cache manager shard %s (of %d) owns worker %s", cache_addr, len(shards), worker_id)
    cache = CacheClient(cache_addr, worker_id, num_blocks, config.block_size, loaded.fingerprint,
                        loaded.vocab_size, timeout=config.cache_timeout,
                        credentials=config.cache_tls.credentials() if config.cache_tls is not None else None,
                        token=config.cache_token, step_stream=config.cache_step_stream)
    metrics = ModelMetrics()
    metrics.set_linear_plan(runner.linears.plans)
    tiers = build_tiers(config, kv_cache, loaded.fingerprint, metrics)
    if tiers is not None:
        cache.tier_config = tiers.tier_config
    puller = None
    if config.kv_pulls:
        cache.kv_transfer_key = secrets.token_bytes(32)  # new per process: tickets of an earlier run fail
        puller = PeerPuller(kv_cache, tiers.costs if tiers is not None else CopyCosts(),
                            config.cache_tls.credentials() if config.cache_tls is not None else None,
                            config.cache_token, metrics)
    engine = Engine(EngineConfig(frozenset(loaded.eos_token_ids), loaded.max_context_tokens,
                                 cache_pipeline=config.cache_pipeline), scheduler, runner,
                    Sampler(), cache, metrics, tiers, puller)
    info = ServingInfo(config.block_size, num_blocks, str(dtype).removeprefix("torch."), str(device), backend.name,
                       cache_addr, worker_id)
    return engine, ModelServicer(engine, loaded, info, config.request_limits)


def build_tiers(config: ModelServiceConfig, kv_cache: KVCache, fingerprint: str,
                metrics: ModelMetrics) -> TierCopier | None:
    """The host / disk tiers the config asks for (None: neither). ValueError when one holds no page."""
    if not config.host_cache_bytes and not config.disk_cache_dir:
        return None
    spec, device = kv_cache.spec, kv_cache.k[0].device
    host = disk = None
    if config.host_cache_bytes:
        host = HostTier.for_bytes(spec, config.host_cache_bytes, device)
        if host.num_slots == 0:
            raise ValueError(f"--host-cache-gib holds no page (a page is {spec.bytes_per_block} bytes)")
    if config.disk_cache_dir:
        if config.disk_cache_bytes < DiskTier.slot_size_for(spec):
            raise ValueError(f"--disk-cache-gib holds no page (a page takes {DiskTier.slot_size_for(spec)} bytes)")
        disk = DiskTier.open(config.disk_cache_dir, spec, fingerprint, config.disk_cache_bytes,
                             pin_memory=device.type == "cuda")
    log.info("KV tiers: host %s, disk %s, offload policy %s",
             f"{host.num_slots} pages ({host.num_bytes / 2**30:.2f} GiB)" if host is not None else "off",
             f"{disk.num_slots} pages in {disk.path} ({disk.num_pages} held from an earlier run; "
             f"{'direct' if disk.direct else 'buffered'} I/O)"
             if disk is not None else "off", config.offload_policy)
    return TierCopier(kv_cache, host, disk, config.offload_policy, metrics)


def _check_port_free(host: str, port: int) -> None:
    """Fail fast (before the slow model load) when the port is taken."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, port))


async def serve(config: ModelServiceConfig) -> int:
    """Runs until SIGTERM/SIGINT; returns the process exit code."""
    address = format_address(config.host, config.port)
    try:
        _check_port_free(config.host, config.port)
    except OSError as e:
        print(f"model_service: cannot listen on {address}: {e.strerror} (port in use?)", file=sys.stderr, flush=True)
        return 1
    worker_id = config.worker_id or f"model-{socket.gethostname()}-{config.port}"
    # Not asyncio.to_thread: its thread would live on with an idle OpenMP pool (see torch_threads).
    engine, servicer = await run_in_passing_thread(build_engine, config, worker_id)
    roles = {SERVICE_NAME: METHOD_ROLES}
    if config.kv_pulls:
        roles[transfer.SERVICE_NAME] = transfer.METHOD_ROLES
    server = new_server(config.limits, server_interceptors(config.tokens, roles))
    add_servicer(server, servicer, model_pb2.DESCRIPTOR.services_by_name["ModelService"], id_error)
    if config.kv_pulls:
        cache = engine.cache
        host = engine.tiers.host if engine.tiers is not None else None
        add_servicer(server, transfer.KvTransferServicer(engine.runner.kv_cache, cache.kv_transfer_key,
                                                         lambda: (cache.worker_id, cache.incarnation), engine.metrics,
                                                         host=host),
                     kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"])
    health_servicer = add_health_and_reflection(server, SERVICE_NAME)

    async def create() -> tuple[grpc.aio.Server, int]:
        return server, add_port(server, address, config.tls.credentials() if config.tls is not None else None)

    def bound(port: int) -> None:
        serving_addr = config.advertise_addr or format_address(config.host, port)
        servicer.info.serving_addr = serving_addr
        engine.cache.serving_addr = serving_addr  # before engine.start(): the pool registers with it
        if config.kv_pulls:  # KvTransfer is served on the same port
            engine.cache.kv_transfer_addr = serving_addr

    async def starting() -> None:
        engine.start()

    async def started() -> None:
        await set_health(health_servicer, [SERVICE_NAME])
        log.info("serving address %s", servicer.info.serving_addr)

    async def stop_server(server: grpc.aio.Server, grace_seconds: float) -> None:
        # New calls are refused at once; in-flight ones get most of the grace period to finish.
        # Then the engine aborts the rest, so their clients read UNAVAILABLE "server shutting
        # down" before gRPC cancels whatever is left with a bare "Cancelling all calls".
        stopping = asyncio.ensure_future(server.stop(grace_seconds))
        await asyncio.wait({stopping}, timeout=grace_seconds * 0.75)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(engine.stop)
        await stopping

    async def stopped() -> None:
        engine.cache.close()

    return await run_server(
        "model_service", log, address, create, health_servicer,
        lambda port: f"model_service listening on {format_address(config.host, port)}",
        hooks=ServerHooks(bound=bound, starting=starting, started=started, stop_server=stop_server,
                          stopped=stopped),
        grace_seconds=config.grace_seconds, metrics=engine.metrics, metrics_port=config.metrics_port,
        metrics_host=config.metrics_host, tokens=config.tokens, client_tokens=(config.cache_token,))
