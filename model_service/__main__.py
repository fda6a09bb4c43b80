"""`python -m model_service --port N --cache-addr HOST:PORT`: serve a model with radixkv."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys

import torch

from common.auth import add_auth_args, client_token_from_args, token_store_from_args
from common.grpc_server import add_grace_arg, grace_from_args
from common.limits import (
    add_request_limit_args,
    add_server_limit_args,
    request_limits_from_args,
    server_limits_from_args,
)
from common.metrics_server import add_metrics_args
from common.parent_death import die_with_parent_if_asked
from common.security import (
    add_client_tls_args,
    add_server_tls_args,
    client_tls_from_args,
    server_tls_from_args,
)
from common.shards import cache_addr_arg
from model_service.attention import KERNEL_MODES
from model_service.linear import MODES as LINEAR_MODES
from model_service.linear.packed import FP32_GEMMS
from model_service.malloc_tuning import keep_freed_memory
from model_service.scheduler import DEFAULT_MAX_NUM_SEQS
from model_service.server import DEFAULT_LOOKAHEAD_BLOCKS, DTYPES, ModelServiceConfig, serve

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '2GiB', '1.5G' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 1073741824, 512MiB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def host_port(text: str) -> str:
    """'HOST:PORT' (IPv6 as '[::1]:50052') with a port in [1, 65535]."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model_service", description="radixkv model service (gRPC)")
    p.add_argument("--port", type=int, default=50052, help="gRPC port (0: pick a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--cache-addr", default="127.0.0.1:50051", type=cache_addr_arg,
                   help="cache manager address HOST:PORT, or the shards' addresses comma-separated: the pool "
                        "registers with the shard its worker id hashes to (common/shards.py)")
    p.add_argument("--advertise-addr", type=host_port, default=None, metavar="HOST:PORT",
                   help="address clients and routers dial to reach this replica, sent to the cache manager "
                        "and reported by ModelInfo (default: --host:--port, the bound port when --port is 0)")
    p.add_argument("--model", default=None,
                   help="local HF model folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=positive_int, default=None, help="KV pool size in blocks")
    size.add_argument("--kv-cache-memory", type=parse_bytes, default=1 << 30,
                      help="KV pool size in bytes when --num-blocks is not given (default 1GiB)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="weights and KV dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--fp32-gemm", choices=list(FP32_GEMMS), default="mkl",
                   help="float32 linear layers on CPU: mkl (F.linear, greedy output bitwise transformers', the "
                        "default) or onednn (weights packed for oneDNN once, 2-2.6x faster where MKL is slow, "
                        "e.g. AMD; outputs differ from transformers' in the last bits; more weight memory)")
    p.add_argument("--attention", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="attention backend (auto: flashinfer on CUDA when installed)")
    p.add_argument("--attention-kernels", choices=list(KERNEL_MODES), default="auto",
                   help="torch backend on CPU: auto (radixkv's AVX-512 kernels where built and supported, "
                        "model_service/native) or torch (torch's kernels only)")
    p.add_argument("--linear-kernels", choices=list(KERNEL_MODES), default="auto",
                   help="float32 linear layers on CPU with --fp32-gemm mkl: auto (radixkv's AVX-512 kernel for "
                        "inputs of 2+ rows where a probe at start shows it bitwise F.linear; more weight memory) "
                        "or torch (F.linear only)")
    p.add_argument("--linear-mode", choices=list(LINEAR_MODES), default="auto",
                   help="linear layers on CPU: exact (every weight shape and row count takes only a path verified "
                        "bit-identical to F.linear at start, else F.linear; greedy output stays transformers') or "
                        "fast (also paths that were not, marked NO in the plan table logged at start); auto: exact "
                        "for float32 with --fp32-gemm mkl, fast otherwise (bf16, --fp32-gemm onednn)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=2048,
                   help="token budget per scheduler step (longer prompts are prefilled in chunks)")
    p.add_argument("--max-num-seqs", type=positive_int, default=DEFAULT_MAX_NUM_SEQS,
                   help=f"most requests running at once (default {DEFAULT_MAX_NUM_SEQS}, vLLM's on CPU)")
    p.add_argument("--max-waiting", type=positive_int, default=1024,
                   help="waiting queue bound; beyond it Generate fails with RESOURCE_EXHAUSTED")
    p.add_argument("--worker-id", default=None, help="pool name at the cache manager (default model-HOST-PORT)")
    p.add_argument("--cache-timeout", type=float, default=10.0, help="deadline of each cache manager RPC (s)")
    p.add_argument("--cache-pipeline", choices=["on", "off"], default="on",
                   help="on: each cache Step is in flight while the previous forward pass runs (the cache "
                        "manager's latency is off the critical path); off: wait for it before each step")
    p.add_argument("--cache-steps", choices=["stream", "unary"], default="stream",
                   help="stream: the cache Steps go over one long-lived StepStream (a message each; unary "
                        "calls from the first UNIMPLEMENTED on, for an older cache manager); unary: a call each")
    p.add_argument("--lookahead-blocks", type=non_negative_int, default=DEFAULT_LOOKAHEAD_BLOCKS,
                   help="with the pipeline on: spare blocks a running request may hold beyond its need, so "
                        "extensions are asked for well before they are needed "
                        f"(default {DEFAULT_LOOKAHEAD_BLOCKS})")
    p.add_argument("--host-cache-gib", type=non_negative_float, default=0.0,
                   help="host-memory KV tier below the pool, in GiB (0: none): pages the pool evicts (or, with "
                        "--offload-policy write-through, caches) are kept there and loaded back on a hit "
                        "instead of recomputed (docs/tiers.md)")
    p.add_argument("--disk-cache-dir", default=None,
                   help="disk KV tier: a directory of its own (created 0700); pages the host tier (or the pool, "
                        "without one) evicts go there, and a replica restarted on it serves hits from it at once")
    p.add_argument("--disk-cache-gib", type=non_negative_float, default=None,
                   help="size of the disk tier's file in GiB (default 4 with --disk-cache-dir)")
    p.add_argument("--offload-policy", choices=["evict", "write-through"], default="evict",
                   help="when pages go down to the first lower tier: evict (when the pool evicts them, the "
                        "default) or write-through (as soon as they are cached)")
    p.add_argument("--kv-pulls", choices=["on", "off"], default="off",
                   help="peer KV pulls (docs/kv-pulls.md): serve this replica's cached pages to other replicas "
                        "of the model (KvTransfer, on the gRPC port, 'replica' role) and pull theirs instead of "
                        "computing them, as the cache manager brokers it; pulls use the --cache-tls-* "
                        "credentials and --cache-token-file token (default off)")
    p.add_argument("--num-threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's choice, one per core); use fewer when the "
                        "cores are shared with other busy processes")
    add_metrics_args(p)
    add_grace_arg(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_server_tls_args(p)
    add_auth_args(p)
    add_server_limit_args(p)
    add_request_limit_args(p)
    add_client_tls_args(p, "cache", "the cache manager")
    return p


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.linear_mode == "exact" and args.fp32_gemm == "onednn" and args.dtype in ("auto", "float32"):
        parser.error("--linear-mode exact refuses --fp32-gemm onednn (its float32 products are not bit-identical "
                     "to F.linear): use --linear-mode fast or --fp32-gemm mkl")
    tls = server_tls_from_args(args, parser)
    tokens = token_store_from_args(args, parser)
    limits = server_limits_from_args(args, parser)
    request_limits = request_limits_from_args(args, parser)
    cache_tls = client_tls_from_args(args, parser, "cache")
    cache_token = client_token_from_args(args, parser, "cache")
    if args.disk_cache_gib is not None and args.disk_cache_dir is None:
        parser.error("--disk-cache-gib needs --disk-cache-dir")
    disk_gib = 4.0 if args.disk_cache_gib is None else args.disk_cache_gib
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_memory()
    config = ModelServiceConfig(
        host=args.host, port=args.port, cache_addr=args.cache_addr, model=args.model, block_size=args.block_size,
        num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory, device=args.device, dtype=args.dtype,
        attention=args.attention, attention_kernels=args.attention_kernels, fp32_gemm=args.fp32_gemm,
        linear_kernels=args.linear_kernels, linear_mode=args.linear_mode, max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, worker_id=args.worker_id,
        cache_timeout=args.cache_timeout, cache_pipeline=args.cache_pipeline == "on",
        cache_step_stream=args.cache_steps == "stream",
        lookahead_blocks=args.lookahead_blocks, advertise_addr=args.advertise_addr, tls=tls, tokens=tokens,
        cache_tls=cache_tls, cache_token=cache_token, limits=limits, request_limits=request_limits,
        grace_seconds=grace_from_args(args, parser), host_cache_bytes=int(args.host_cache_gib * 2**30),
        disk_cache_dir=args.disk_cache_dir, disk_cache_bytes=int(disk_gib * 2**30) if args.disk_cache_dir else 0,
        offload_policy=args.offload_policy, kv_pulls=args.kv_pulls == "on")
    try:
        return asyncio.run(serve(config))
    except (OSError, ValueError) as e:  # a missing model, a disk tier in use by another replica ...
        print(f"model_service: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
