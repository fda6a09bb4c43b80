"""`python -m cache_service --port N`: run the radixkv cache manager."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from cache_service.server import serve
from common.auth import add_auth_args, token_store_from_args
from common.grpc_server import add_grace_arg, grace_from_args
from common.limits import add_server_limit_args, server_limits_from_args
from common.parent_death import die_with_parent_if_asked
from common.security import add_server_tls_args, server_tls_from_args


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="python -m cache_service", description="radixkv cache manager (gRPC)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--lease-seconds", type=float, default=30.0, help="pool lease length")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (off when not given)")
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
    if args.snapshot_mb <= 0 or args.fsync_ms <= 0:
        parser.error("--snapshot-mb and --fsync-ms must be > 0")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in [0, 65535]")
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
                             fsync_seconds=args.fsync_ms / 1000))


if __name__ == "__main__":
    sys.exit(main())
