"""`python -m router --port P --cache-addr HOST:PORT`: one radixkv ModelService endpoint in front of
the model replicas, routing each request by KV prefix (see router/core.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from common.auth import add_auth_args, client_token_from_args, token_store_from_args
from common.grpc_server import add_grace_arg, grace_from_args
from common.limits import add_server_limit_args, server_limits_from_args
from common.metrics_server import add_metrics_args
from common.parent_death import die_with_parent_if_asked
from common.security import (
    add_client_tls_args,
    add_server_tls_args,
    client_tls_from_args,
    server_tls_from_args,
)
from common.shards import cache_addr_arg
from router.policy import POLICIES
from router.server import RouterConfig, serve
from router.trust import ReplicaTrust


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router", description="radixkv router (gRPC ModelService + "
                                "OpenAI-compatible HTTP) in front of model replicas")
    p.add_argument("--port", type=int, default=50050, help="gRPC port (0: pick a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--cache-addr", default="127.0.0.1:50051", type=cache_addr_arg,
                   help="cache manager address HOST:PORT, or the shards' addresses comma-separated: Route and "
                        "Stats ask every shard and merge the answers")
    p.add_argument("--policy", choices=POLICIES, default="kv",
                   help="kv: the cache manager's Route (cached prefix + load); least-loaded; round-robin")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP API port (0: pick a free one; off when not given)")
    p.add_argument("--max-http-body-mb", type=float, default=16.0, metavar="MiB",
                   help="largest HTTP request body in MiB (default 16): larger ones are refused with 413 "
                        "before more is read (a full 8k-token context is ~30-200 KiB of JSON)")
    add_metrics_args(p)
    add_grace_arg(p)
    p.add_argument("--replica", action="append", default=[], metavar="HOST:PORT",
                   help="a model replica to route to besides those the cache manager lists (repeatable); "
                        "always trusted")
    p.add_argument("--replica-dns", action="append", default=[], metavar="HOST:PORT",
                   help="a DNS name (e.g. a Kubernetes headless Service) resolved at every background check: "
                        "each address it resolves to is a trusted replica (repeatable); with TLS their "
                        "certificates are checked against HOST")
    p.add_argument("--replica-allow", action="append", default=None, metavar="CIDR|GLOB,...",
                   help="comma-separated networks (10.0.0.0/8: match IP-literal replica addresses) and host name "
                        "globs (*.model.ns.svc.cluster.local) that replica addresses the cache manager reports may "
                        "be in; others are never called (default: 127.0.0.0/8,::1,localhost)")
    p.add_argument("--advertise-addr", default=None,
                   help="address clients dial to reach this router (ModelInfo.serving_addr; default HOST:PORT)")
    p.add_argument("--check-interval", type=float, default=1.0,
                   help="seconds between background checks of the replicas and the cache manager")
    p.add_argument("--reserve-ms", type=int, default=2000,
                   help="how long Route pins the chosen replica's cached prefix for the request")
    p.add_argument("--route-timeout", type=float, default=1.0,
                   help="deadline of each cache manager call (s); past it routing falls back to load")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_server_tls_args(p, "the gRPC port and the HTTP door")
    add_auth_args(p)
    add_server_limit_args(p)
    add_client_tls_args(p, "cache", "the cache manager")
    add_client_tls_args(p, "replica", "the replicas")
    return p


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("port", "http_port", "metrics_port"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 65535:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 65535]")
    if args.check_interval <= 0 or args.route_timeout <= 0 or args.reserve_ms < 0:
        parser.error("--check-interval and --route-timeout must be > 0, --reserve-ms >= 0")
    if not 0 < args.max_http_body_mb <= 4096:
        parser.error("--max-http-body-mb must be in (0, 4096]")
    replica_allow = None
    if args.replica_allow is not None:
        replica_allow = [item.strip() for value in args.replica_allow for item in value.split(",") if item.strip()]
    try:
        ReplicaTrust(args.replica, replica_allow, args.replica_dns)
    except ValueError as e:
        parser.error(f"--replica-allow / --replica-dns: {e}")
    tls = server_tls_from_args(args, parser)
    tokens = token_store_from_args(args, parser)
    limits = server_limits_from_args(args, parser)
    cache_tls = client_tls_from_args(args, parser, "cache")
    cache_token = client_token_from_args(args, parser, "cache")
    replica_tls = client_tls_from_args(args, parser, "replica")
    replica_token = client_token_from_args(args, parser, "replica")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = RouterConfig(host=args.host, port=args.port, cache_addr=args.cache_addr, policy=args.policy,
                          http_port=args.http_port, metrics_port=args.metrics_port,
                          metrics_host=args.metrics_host, replicas=args.replica,
                          replica_dns=args.replica_dns, replica_allow=replica_allow,
                          advertise_addr=args.advertise_addr, check_interval_s=args.check_interval,
                          reserve_ms=args.reserve_ms, route_timeout_s=args.route_timeout, log_level=args.log_level,
                          tls=tls, tokens=tokens, cache_tls=cache_tls, cache_token=cache_token,
                          replica_tls=replica_tls, replica_token=replica_token, limits=limits,
                          max_http_body_bytes=round(args.max_http_body_mb * 2**20),
                          grace_seconds=grace_from_args(args, parser))
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
