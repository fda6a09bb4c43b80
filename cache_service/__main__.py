"""`python -m cache_service --port N`: run the radixkv cache manager."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from cache_service.peer_pulls import DEFAULT_PIN_SECONDS, TICKET_MARGIN_SECONDS
from cache_service.pool_registry import DEFAULT_MAX_PINNED_FRACTION
from cache_service.registry_limits import (
    DEFAULT_MAX_MEMORY_BYTES,
    DEFAULT_MAX_POOLS,
    DEFAULT_MAX_POOLS_PER_OWNER,
    RegistryLimits,
)
from cache_service.server import serve
from cache_service.stream_slots import DEFAULT_MAX_WATCH_STREAMS
from common.auth import add_auth_args, token_store_from_args
from common.grpc_server import add_grace_arg, grace_from_args
from common.limits import add_server_limit_args, server_limits_from_args
from common.metrics_server import add_metrics_args
from common.parent_death import die_with_parent_if_asked
from common.security import add_server_tls_args, server_tls_from_args


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="python -m cache_service", description="radixkv cache manager (gRPC)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--lease-seconds", type=float, default=30.0, help="pool lease length")
    add_metrics_args(parser)
    parser.add_argument("--event-buffer-mb", type=float, default=64.0,
                        help="replay buffer of WatchEvents, in MiB (oldest events dropped first; default 64)")
    parser.add_argument("--state-dir", default=None,
                        help="durable mode: journal every change and snapshot the pools in this directory, and "
                             "rebuild them from it on start (replicas re-attach without recompute)")
    parser.add_argument("--snapshot-mb", type=float, default=16.0,
                        help="with --state-dir: compact the journal into a snapshot when it passes this size")
    parser.add_argument("--fsync-ms", type=float, default=50.0,
                        help="with --state-dir: fsync the journal this often (the power-loss window; a "
                             "kill -9 loses nothing acknowledged either way)")
    parser.add_argument("--max-pinned-fraction", type=float, default=DEFAULT_MAX_PINNED_FRACTION,
                        help="share of each pool's blocks that Route reservations (reserve_ms) may pin at once; a "
                             "Route beyond it answers without pinning (default 0.25; 0: no pins)")
    parser.add_argument("--peer-pulls", choices=["on", "off"], default="on",
                        help="let an admission pull the pages another replica of the model holds instead of "
                             "computing them (between replicas started with --kv-pulls on; docs/kv-pulls.md)")
    parser.add_argument("--pull-pin-seconds", type=float, default=DEFAULT_PIN_SECONDS,
                        help="how long a source replica's pages stay pinned for a pull whose puller does not report "
                             f"it (default {DEFAULT_PIN_SECONDS:g}; pulls give up after half of it)")
    caps = parser.add_argument_group("replica identity and caps")
    caps.add_argument("--max-pools", type=int, default=DEFAULT_MAX_POOLS, metavar="N",
                      help=f"most pools registered at once; more: RESOURCE_EXHAUSTED (default {DEFAULT_MAX_POOLS}; "
                           "0: no limit)")
    caps.add_argument("--max-pools-per-principal", type=int, default=DEFAULT_MAX_POOLS_PER_OWNER, metavar="N",
                      help="most pools one token (or, without tokens, one client certificate) holds at once "
                           f"(default {DEFAULT_MAX_POOLS_PER_OWNER}; 0: no limit; without tokens or mutual TLS "
                           "only --max-pools applies)")
    caps.add_argument("--max-cache-memory-mib", type=int, default=DEFAULT_MAX_MEMORY_BYTES >> 20, metavar="MIB",
                      help="memory all pools may make the cache manager hold, each pool charged its worst case "
                           "(1152 + 40 x block_size bytes a block) when it registers; more: RESOURCE_EXHAUSTED "
                           f"(default {DEFAULT_MAX_MEMORY_BYTES >> 20}; 0: no limit)")
    caps.add_argument("--worker-san-check", choices=["on", "off"], default="on",
                      help="with --tls-client-ca: RegisterPool's worker_id must be a DNS or URI subject alternative "
                           "name of the client's certificate (default on; off: any certificate of the CA may "
                           "register any worker id not held by another principal)")
    parser.add_argument("--max-watch-streams", type=int, default=DEFAULT_MAX_WATCH_STREAMS, metavar="N",
                        help="most WatchEvents streams one token (without tokens: all callers together) holds "
                             f"open at once; more: RESOURCE_EXHAUSTED (default {DEFAULT_MAX_WATCH_STREAMS})")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_server_tls_args(parser)
    add_auth_args(parser)
    add_server_limit_args(parser)
    add_grace_arg(parser)
    args = parser.parse_args(argv)
    if args.lease_seconds <= 0:
        parser.error("--lease-seconds must be > 0")
    if args.event_buffer_mb <= 0:
        parser.error("--event-buffer-mb must be > 0")
    if args.max_watch_streams < 1:
        parser.error("--max-watch-streams must be >= 1")
    if args.snapshot_mb <= 0 or args.fsync_ms <= 0:
        parser.error("--snapshot-mb and --fsync-ms must be > 0")
    if not 0 <= args.max_pinned_fraction <= 1:  # also refuses nan
        parser.error("--max-pinned-fraction must be in [0, 1]")
    if not 2 * TICKET_MARGIN_SECONDS < args.pull_pin_seconds <= 600:  # also refuses nan
        parser.error(f"--pull-pin-seconds must be in ({2 * TICKET_MARGIN_SECONDS:g}, 600]")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in [0, 65535]")
    for flag in ("max_pools", "max_pools_per_principal", "max_cache_memory_mib"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0 (0: no limit)")
    registry_limits = RegistryLimits(args.max_pools, args.max_pools_per_principal, args.max_cache_memory_mib << 20)
    tls = server_tls_from_args(args, parser)
    tokens = token_store_from_args(args, parser)
    limits = server_limits_from_args(args, parser)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(serve(args.host, args.port, args.lease_seconds, args.metrics_port,
                             event_buffer_bytes=int(args.event_buffer_mb * 1024 * 1024), tls=tls, tokens=tokens,
                             limits=limits, grace_seconds=grace_from_args(args, parser),
                             state_dir=args.state_dir, snapshot_bytes=int(args.snapshot_mb * 1024 * 1024),
                             fsync_seconds=args.fsync_ms / 1000, metrics_host=args.metrics_host,
                             max_pinned_fraction=args.max_pinned_fraction, registry_limits=registry_limits,
                             worker_san_check=args.worker_san_check == "on",
                             max_watch_streams=args.max_watch_streams, peer_pulls=args.peer_pulls == "on",
                             pull_pin_seconds=args.pull_pin_seconds))


if __name__ == "__main__":
    sys.exit(main())
