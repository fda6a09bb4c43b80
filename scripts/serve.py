"""``make run``: serve the bundled model on this machine, in the foreground.

Starts the cache service, then the model service pointing at it, as child processes whose
output is passed through with a ``[cache]`` / ``[model]`` prefix; waits until both report
SERVING over gRPC health; prints how to query them; then serves until Ctrl-C or SIGTERM, which
stops both (SIGTERM, then SIGKILL after a grace period). If one of them dies, the other is
stopped and the launcher exits non-zero.

    python -m scripts.serve [--host H] [--cache-port P] [--model-port P] [--model PATH]
                            [--cache-args "..."] [MODEL SERVICE FLAGS ...]

Flags the launcher does not know go to the model service (``make run RUN_ARGS="--num-blocks
512"``); ``--cache-args`` holds the cache service's (``--cache-args "--lease-seconds 60"``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from scripts.service_process import ServiceError, ServiceProcess, Sink, port_in_use

EXIT_OK = 0
EXIT_FAILED = 1


class Console:
    """Thread-safe line printer shared by the launcher and the children's output pumps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            print(text, flush=True)

    def error(self, text: str) -> None:
        with self._lock:
            print(f"error: {text}", file=sys.stderr, flush=True)

    def sink(self, prefix: str) -> Sink:
        return lambda text: self.line(f"[{prefix}] {text}")


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.serve",
        description="Run the radixkv cache service and model service in the foreground.",
        epilog="Unknown flags are passed to the model service (see python -m model_service --help).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address both services bind (default 127.0.0.1)")
    parser.add_argument("--cache-port", type=int, default=50051, help="cache service port (0: any free port)")
    parser.add_argument("--model-port", type=int, default=50052, help="model service port (0: any free port)")
    parser.add_argument("--model", help="local HF folder or GGUF file (default: the bundled SmolLM2-135M)")
    parser.add_argument(
        "--cache-args", default="", help='extra cache service flags, e.g. "--lease-seconds 60"'
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for both services to be SERVING (default 600)",
    )
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping (default 10)",
    )
    return parser.parse_known_args(argv)


def ports_free(console: Console, host: str, ports: Sequence[int], hint: str) -> bool:
    """False (after saying why) when one of the ports is taken or two of them are the same."""
    for port in ports:
        if port_in_use(host, port):
            console.error(
                f"port {port} is already in use on {host} (is radixkv already running?). "
                f"Stop whatever holds it, or pick other ports: {hint}"
            )
            return False
    fixed = [p for p in ports if p != 0]
    if len(set(fixed)) != len(fixed):
        duplicate = next(p for p in fixed if fixed.count(p) > 1)
        console.error(f"two services cannot share port {duplicate}")
        return False
    return True


Starter = Callable[[threading.Event, list[ServiceProcess]], None]


def run_in_foreground(console: Console, grace_seconds: float, start: Starter) -> int:
    """Runs ``start(stop, children)`` (it starts the services, appending each to ``children``, and
    waits until they serve), then serves until Ctrl-C / SIGTERM or until a child dies; always
    stops the children, last started first. Returns the exit code."""
    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        if not stop.is_set():
            console.line(f"==> {signal.Signals(signum).name} received, stopping radixkv")
        stop.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    children: list[ServiceProcess] = []
    try:
        start(stop, children)
        while not stop.wait(0.5):
            for child in children:
                if not child.running():
                    console.error(f"{child.name} exited unexpectedly with code {child.proc.returncode}")
                    return EXIT_FAILED
        return EXIT_OK
    except ServiceError as error:
        if stop.is_set():
            return EXIT_OK
        console.error(str(error))
        return EXIT_FAILED
    finally:
        for child in reversed(children):  # clients of the cache service first
            if child.running():
                console.line(f"==> stopping {child.name} (pid {child.pid})")
            code = child.stop(grace_seconds)
            console.line(f"==> {child.name} exited with code {code}")


def start_cache(host: str, port: int, cache_args: str, console: Console, stop: threading.Event,
                children: list[ServiceProcess], prefix: str = "cache") -> ServiceProcess:
    """Starts the cache service; returns once it prints its address (not yet SERVING)."""
    console.line(f"==> starting cache_service on {host}:{port}")
    cache_argv = ["--host", host, "--port", str(port), *shlex.split(cache_args)]
    cache = ServiceProcess("cache_service", cache_argv, console.sink(prefix))
    children.append(cache)
    cache.wait_listening(60.0, stop)
    return cache


def start_model(argv: list[str], console: Console, children: list[ServiceProcess],
                prefix: str = "model") -> ServiceProcess:
    """Starts a model service (loading takes a while: wait with wait_model)."""
    model = ServiceProcess("model_service", argv, console.sink(prefix))
    children.append(model)
    return model


def wait_model(model: ServiceProcess, timeout_s: float, console: Console, stop: threading.Event,
               watch: Sequence[ServiceProcess]) -> None:
    model.wait_serving(
        timeout_s,
        stop=stop,
        watch=watch,
        progress=lambda s: console.line(f"==> still loading the model ... {s:.0f} s"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args, model_args = parse_args(argv)
    console = Console()
    if not ports_free(console, args.host, (args.cache_port, args.model_port),
                      "make run CACHE_PORT=... MODEL_PORT=..."):
        return EXIT_FAILED
    return run_in_foreground(console, args.grace_seconds,
                             lambda stop, children: serve(args, model_args, console, stop, children))


def serve(
    args: argparse.Namespace,
    model_args: list[str],
    console: Console,
    stop: threading.Event,
    children: list[ServiceProcess],
) -> None:
    host = args.host
    cache = start_cache(host, args.cache_port, args.cache_args, console, stop, children)
    assert cache.addr is not None
    cache_addr = cache.addr

    console.line(f"==> starting model_service on {host}:{args.model_port} (cache service at {cache_addr})")
    model_argv = ["--host", host, "--port", str(args.model_port), "--cache-addr", cache_addr]
    if args.model:
        model_argv += ["--model", args.model]
    model = start_model([*model_argv, *model_args], console, children)

    cache.wait_serving(60.0, stop=stop)
    console.line(f"==> cache_service is SERVING at {cache_addr}")
    console.line("==> waiting for model_service: loading the model (the first start can take a minute)")
    wait_model(model, args.startup_timeout, console, stop, [cache])
    assert model.addr is not None
    console.line(how_to_query(model.addr, cache_addr))


def how_to_query(model_addr: str, cache_addr: str) -> str:
    python = sys.executable
    relative = os.path.relpath(python)
    if not relative.startswith(".."):
        python = relative
    model_flag = "" if model_addr == "127.0.0.1:50052" else f" --addr {model_addr}"
    cache_flag = "" if cache_addr == "127.0.0.1:50051" else f" --cache-addr {cache_addr}"
    client = f"{python} -m client"
    return "\n".join(
        [
            f"==> radixkv is up: model service {model_addr}, cache service {cache_addr}",
            "    Try, from another terminal:",
            f'      {client} generate "The capital of France is" --max-tokens 16 --temperature 0{model_flag}',
            f'      {client} generate "Write a haiku about caches." --chat --stream --max-tokens 64{model_flag}',
            f"      {client} stats{cache_flag}",
            f"      {client} info{model_flag}",
            f"      grpcurl -plaintext {model_addr} list",
            "    Ctrl-C stops both services.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
