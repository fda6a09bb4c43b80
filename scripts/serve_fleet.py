"""``make run-fleet``: a small fleet on this machine, in the foreground: the cache service (or
``--shards N`` cache-manager shards, ``make run-fleet SHARDS=2``), two (``--replicas N``) model
replicas of the bundled model, and the router in front of them with its OpenAI-compatible HTTP
API. Output is passed through with ``[cache]`` (``[cache-0]`` ...) / ``[model-0]`` ... /
``[router]`` prefixes; Ctrl-C or SIGTERM stops them all (router first, cache service last), and
if one dies the rest are stopped and the launcher exits non-zero (as ``make run``, whose code
this reuses: scripts/serve.py).

    python -m scripts.serve_fleet [--host H] [--cache-port P] [--shards N] [--model-port P] [--replicas N]
        [--router-port P] [--http-port P] [--policy kv|least-loaded|round-robin] [--model PATH]
        [--num-threads T] [--kv-pulls on|off] [--cache-args "..."] [--router-args "..."]
        [MODEL SERVICE FLAGS ...]

Replica i listens on --model-port + i, shard i on --cache-port + 100 i (free ports when the first
is 0). Every replica and the router get all shard addresses: a replica registers with the shard its
worker id hashes to (common/shards.py), the router asks every shard. Flags the launcher does not
know go to every model service.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import threading
from collections.abc import Sequence

import grpc

from protos import model_pb2, model_pb2_grpc
from scripts.serve import (
    EXIT_FAILED,
    Console,
    ports_free,
    run_in_foreground,
    start_cache,
    start_model,
    wait_model,
)
from scripts.service_process import ServiceProcess


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.serve_fleet",
        description="Run the radixkv cache service, several model replicas and the router in the foreground.",
        epilog="Unknown flags are passed to every model service (see python -m model_service --help).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address every service binds (default 127.0.0.1)")
    parser.add_argument("--cache-port", type=int, default=50051, help="cache service port (0: any free port)")
    parser.add_argument("--shards", type=int, default=1,
                        help="cache-manager shards, each owning the pools of the replicas that hash to it "
                             "(default 1)")
    parser.add_argument("--model-port", type=int, default=50052,
                        help="first replica's port, the next ones follow (0: any free ports)")
    parser.add_argument("--replicas", type=int, default=2, help="number of model replicas (default 2)")
    parser.add_argument("--router-port", type=int, default=50050, help="router gRPC port (0: any free port)")
    parser.add_argument("--http-port", type=int, default=8000, help="router OpenAI HTTP port (0: any free port)")
    parser.add_argument("--policy", default="kv", help="router policy: kv, least-loaded or round-robin")
    parser.add_argument("--model", help="local HF folder or GGUF file (default: the bundled SmolLM2-135M)")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="torch CPU threads per replica (default 1: the replicas share the cores)")
    parser.add_argument("--kv-pulls", choices=["on", "off"], default="on",
                        help="replicas pull the KV another replica holds instead of computing it (default on; "
                             "docs/kv-pulls.md)")
    parser.add_argument("--cache-args", default="", help='extra cache service flags, e.g. "--lease-seconds 60"')
    parser.add_argument("--router-args", default="", help='extra router flags, e.g. "--metrics-port 9102"')
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds to wait for the services to be SERVING (default 600)")
    parser.add_argument("--grace-seconds", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping (default 10)")
    args, model_args = parser.parse_known_args(argv)
    if args.replicas < 1 or args.shards < 1:
        parser.error("--replicas and --shards must be >= 1")
    return args, model_args


def model_ports(args: argparse.Namespace) -> list[int]:
    return [0 if args.model_port == 0 else args.model_port + i for i in range(args.replicas)]


def cache_ports(args: argparse.Namespace) -> list[int]:
    """Shard i on --cache-port + 100 i: clear of the replicas' ports, which follow 50052."""
    return [0 if args.cache_port == 0 else args.cache_port + 100 * i for i in range(args.shards)]


def main(argv: Sequence[str] | None = None) -> int:
    args, model_args = parse_args(argv)
    console = Console()
    ports = [*cache_ports(args), *model_ports(args), args.router_port, args.http_port]
    if not ports_free(console, args.host, ports,
                      "make run-fleet CACHE_PORT=... MODEL_PORT=... ROUTER_PORT=... HTTP_PORT=..."):
        return EXIT_FAILED
    return run_in_foreground(console, args.grace_seconds,
                             lambda stop, children: serve(args, model_args, console, stop, children))


def serve(args: argparse.Namespace, model_args: list[str], console: Console, stop: threading.Event,
          children: list[ServiceProcess]) -> None:
    host = args.host
    shards = [start_cache(host, port, args.cache_args, console, stop, children,
                          prefix="cache" if args.shards == 1 else f"cache-{i}")
              for i, port in enumerate(cache_ports(args))]
    cache_addr = ",".join(str(shard.addr) for shard in shards)
    replicas = []
    for i, port in enumerate(model_ports(args)):
        console.line(f"==> starting model_service {i} on {host}:{port} (cache service at {cache_addr})")
        argv = ["--host", host, "--port", str(port), "--cache-addr", cache_addr, "--worker-id", f"replica-{i}",
                "--num-threads", str(args.num_threads), "--kv-pulls", args.kv_pulls]
        if args.model:
            argv += ["--model", args.model]
        replicas.append(start_model([*argv, *model_args], console, children, prefix=f"model-{i}"))
    for shard in shards:
        shard.wait_serving(60.0, stop=stop)
    console.line(f"==> cache_service is SERVING at {cache_addr}")
    console.line(f"==> waiting for {len(replicas)} model replicas: loading the model")
    for replica in replicas:
        wait_model(replica, args.startup_timeout, console, stop, [*shards, *replicas])
    replica_addrs = [r.addr for r in replicas if r.addr is not None]

    console.line(f"==> starting router on {host}:{args.router_port} (HTTP on port {args.http_port})")
    router_argv = ["--host", host, "--port", str(args.router_port), "--cache-addr", cache_addr,
                   "--http-port", str(args.http_port), "--policy", args.policy,
                   *(flag for addr in replica_addrs for flag in ("--replica", addr)), *shlex.split(args.router_args)]
    http_urls: list[str] = []
    router_sink = console.sink("router")

    def sink(text: str) -> None:
        if "OpenAI HTTP API on " in text:
            http_urls.append(text.split("OpenAI HTTP API on ", 1)[1].strip())
        router_sink(text)

    router = ServiceProcess("router", router_argv, sink)
    children.append(router)
    router.wait_serving(60.0, stop=stop, watch=[*shards, *replicas])
    assert router.addr is not None
    http_url = http_urls[0] if http_urls else f"http://{host}:{args.http_port}/v1"
    console.line(how_to_query(router.addr, http_url, cache_addr, replica_addrs, model_name(router.addr)))


def model_name(addr: str) -> str:
    """The served model's name (the OpenAI "model" field), asked of the router."""
    try:
        with grpc.insecure_channel(addr) as channel:
            return model_pb2_grpc.ModelServiceStub(channel).ModelInfo(model_pb2.ModelInfoRequest(),
                                                                       timeout=10).model_name
    except grpc.RpcError:
        return "MODEL"


def how_to_query(router_addr: str, http_url: str, cache_addr: str, replica_addrs: list[str], model: str) -> str:
    client = f"{sys.executable} -m client"
    return "\n".join([
        f"==> radixkv fleet is up: router {router_addr} (OpenAI API {http_url}), replicas "
        f"{', '.join(replica_addrs)}, cache service {cache_addr}",
        "    Try, from another terminal:",
        f'      {client} generate "The capital of France is" --max-tokens 16 --temperature 0 --addr {router_addr}',
        f"      {client} stats --cache-addr {cache_addr}",
        f"      curl -s {http_url}/models",
        f"      curl -s {http_url}/chat/completions -H 'content-type: application/json' -d "
        f"'{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}], "
        "\"max_tokens\": 32}'",
        "    Ctrl-C stops them all.",
    ])


if __name__ == "__main__":
    sys.exit(main())
