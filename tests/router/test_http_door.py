"""The router's HTTP door against hostile and sloppy input, through real router processes on
loopback (a cache manager, one replica of the tiny random Llama, routers with the OpenAI door)
and raw HTTP: body size limit (Content-Length, chunked, lying lengths) with the router's memory
watched, deep and odd JSON, /health without a token, and ignored request fields
(``X-Ignored-Fields``), also through the official ``openai`` package."""

from __future__ import annotations

import json
import os
import selectors
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import psutil
import pytest

from tests.router.conftest import free_port, http_url, metric, replica_args
from tests.services import (
    ROUTER_START_TIMEOUT_S,
    Running,
    launch_model,
    launch_service,
    start_cache,
    start_router,
)

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
DEFAULT_LIMIT = 16 * MiB  # router/openai_api.py's documented default of --max-http-body-mb
TOKENS = "client-tok client\nreader-tok reader\n"


@dataclass
class Router:
    running: Running
    url: str  # http://HOST:PORT (read once: the output deque forgets old lines)

    @property
    def log(self) -> list[str]:
        return list(self.running.log)

    @classmethod
    def of(cls, running: Running) -> Router:
        return cls(running, http_url(running))


@dataclass
class Door:
    replica: Running
    open: Router  # no token file, default body limit
    small: Router  # no token file, --max-http-body-mb 1
    secured: Router  # --auth-token-file, default body limit


@pytest.fixture(scope="module")
def door(tiny_model: Path, tmp_path_factory) -> Iterator[Door]:
    tokens = tmp_path_factory.mktemp("door") / "tokens"
    tokens.write_text(TOKENS)
    os.chmod(tokens, 0o600)
    cache = start_cache()
    started = [cache]
    try:
        replica = launch_model(cache.addr, *replica_args(tiny_model, "door-replica")).wait()
        started.append(replica)
        common = ["--http-port", "0", "--check-interval", "0.3", "--replica", replica.addr]
        opened = start_router(cache.addr, *common)
        started.append(opened)
        small = start_router(cache.addr, *common, "--max-http-body-mb", "1")
        started.append(small)
        secured = start_router(cache.addr, *common, "--auth-token-file", str(tokens))
        started.append(secured)
        yield Door(replica, Router.of(opened), Router.of(small), Router.of(secured))
    finally:
        for service in reversed(started):
            service.process.stop(10.0)


@pytest.fixture(scope="module")
def model_name(door: Door) -> str:
    with urllib.request.urlopen(door.open.url + "/v1/models", timeout=10) as reply:
        return json.loads(reply.read())["data"][0]["id"]


# ---------------------------------------------------------------------- raw HTTP


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def request(router: Router, method: str, path: str, body: bytes | dict | None = None,
            headers: dict[str, str] | None = None, timeout: float = 30.0) -> Reply:
    """One request with urllib (whole body, Content-Length); HTTP errors are replies too."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    sent = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(router.url + path, data=data, headers=sent, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            return Reply(reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def _complete(received: bytes) -> bool:
    """Whether `received` holds a whole answer with a Content-Length body."""
    head, found, body = received.partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def exchange(router: Router, head: bytes, chunks: Iterable[bytes] = (), timeout: float = 60.0) -> bytes:
    """Writes `head` then `chunks` on a raw socket while reading: stops sending as soon as the
    router answers (or resets); returns the bytes the router sent, once an answer is complete
    or the router closed the connection."""
    host, _, port = router.url.removeprefix("http://").rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.setblocking(False)
    selector = selectors.DefaultSelector()
    pending = memoryview(head)
    chunks = iter(chunks)
    received = bytearray()
    sending = True
    deadline = time.monotonic() + timeout
    try:
        selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        while time.monotonic() < deadline and not _complete(received):
            if sending and not pending:
                nxt = next(chunks, None)
                if nxt is None:
                    sending = False
                    selector.modify(sock, selectors.EVENT_READ)
                else:
                    pending = memoryview(nxt)
            for _, mask in selector.select(timeout=0.5):
                if mask & selectors.EVENT_READ:
                    try:
                        data = sock.recv(65536)
                    except ConnectionResetError:
                        return bytes(received)
                    if not data:
                        return bytes(received)
                    received += data
                    if sending:
                        sending = False  # the router answered: stop uploading
                        selector.modify(sock, selectors.EVENT_READ)
                elif mask & selectors.EVENT_WRITE and sending and pending:
                    try:
                        pending = pending[sock.send(pending):]
                    except (BrokenPipeError, ConnectionResetError):
                        sending = False
                        selector.modify(sock, selectors.EVENT_READ)
        return bytes(received)
    finally:
        selector.close()
        sock.close()


def parse(raw: bytes) -> Reply:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), f"not an HTTP answer: {raw[:200]!r}"
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return Reply(int(lines[0].split()[1]), headers, body)


def post_head(path: str, extra: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{extra}\r\n".encode()


def rss(router: Router) -> int:
    return psutil.Process(router.running.process.pid).memory_info().rss


def assert_grew_little(router: Router, before: int) -> None:
    after = rss(router)
    assert after - before < 64 * MiB, f"the router's RSS grew from {before / MiB:.0f} to {after / MiB:.0f} MiB"


def assert_healthy(router: Router) -> None:
    reply = request(router, "GET", "/health")
    assert reply.status == 200, reply


def assert_413(reply: Reply, limit: int) -> None:
    assert reply.status == 413, reply
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "request_too_large" and f"{limit // MiB} MiB" in error["message"]
    assert reply.headers.get("connection") == "close"


# ---------------------------------------------------------------------- body size


def test_a_content_length_over_the_limit_is_413_before_any_body_is_read(door: Door) -> None:
    raw = exchange(door.open, post_head("/v1/completions", f"Content-Length: {200 * MiB}\r\n"))
    assert raw, "no answer to a 200 MiB Content-Length before the body"
    assert_413(parse(raw), DEFAULT_LIMIT)
    raw = exchange(door.small, post_head("/v1/chat/completions", f"Content-Length: {MiB + 1}\r\n"))
    assert_413(parse(raw), MiB)
    assert_healthy(door.open)


def test_every_answer_is_counted_once_by_path_and_status(door: Door, model_name: str) -> None:
    """The door's gate (router/door_gate.py) counts a streamed answer when it ends and a refusal
    it answers itself; the stream passes through it whole."""
    name = "radixkv_router_http_requests_total"

    def counted(router: Router, status: str, want: float) -> None:
        deadline = time.monotonic() + 5
        while (got := metric(router.running, name, path="/v1/completions", status=status)) != want:
            assert got < want and time.monotonic() < deadline, (got, want)
            time.sleep(0.05)

    ok = metric(door.open.running, name, path="/v1/completions", status="200")
    reply = request(door.open, "POST", "/v1/completions",
                    {"model": model_name, "prompt": "Hello", "max_tokens": 3, "stream": True})
    assert reply.status == 200 and reply.body.rstrip().endswith(b"data: [DONE]")
    assert reply.body.count(b"data: ") >= 4  # the tokens' events and [DONE]
    counted(door.open, "200", ok + 1)
    refused = metric(door.small.running, name, path="/v1/completions", status="413")
    assert_413(parse(exchange(door.small, post_head("/v1/completions", f"Content-Length: {MiB + 1}\r\n"))), MiB)
    counted(door.small, "413", refused + 1)


def test_a_200_mib_body_is_413_and_the_router_stays_small(door: Door) -> None:
    before = rss(door.open)
    body = (b" " * MiB for _ in range(200))  # whitespace: would even parse, were it read
    raw = exchange(door.open, post_head("/v1/completions", f"Content-Length: {200 * MiB}\r\n"), body)
    assert_413(parse(raw), DEFAULT_LIMIT)
    assert_grew_little(door.open, before)
    assert_healthy(door.open)


def test_a_client_that_sends_its_whole_refused_body_before_reading_still_gets_the_413(door: Door) -> None:
    # A plain close with the body's bytes still arriving resets the connection, and the reset can
    # discard the 413 before the client reads it: the door shuts its write side and drops the
    # rest of the body instead (router/http_linger.py).
    host, _, port = door.small.url.removeprefix("http://").rpartition(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(post_head("/v1/completions", f"Content-Length: {8 * MiB}\r\n"))
            time.sleep(0.2)  # the 413 is sent and the door closes while the body is on its way
            sock.sendall(b" " * (8 * MiB))
            received = bytearray()
            while data := sock.recv(65536):
                received += data
        assert_413(parse(bytes(received)), MiB)
    assert_healthy(door.small)


def chunked(total: int, piece: bytes) -> Iterator[bytes]:
    """`total` bytes of `piece` repeated, as HTTP/1.1 chunks (no terminating chunk: a body still
    coming is enough)."""
    block = piece * (MiB // len(piece))
    for _ in range(total // len(block)):
        yield b"%x\r\n%s\r\n" % (len(block), block)


def test_a_chunked_body_is_cut_at_the_limit_and_the_router_stays_small(door: Door) -> None:
    before = rss(door.open)
    raw = exchange(door.open, post_head("/v1/completions", "Transfer-Encoding: chunked\r\n"),
                   chunked(200 * MiB, b'"ab", '))
    assert_413(parse(raw), DEFAULT_LIMIT)
    assert_grew_little(door.open, before)
    # Under the limit a chunked body is fine (the small door: 1 MiB).
    body = json.dumps({"model": "nope", "prompt": "x" * (MiB // 2)}).encode()
    raw = exchange(door.small, post_head("/v1/completions", "Transfer-Encoding: chunked\r\n"),
                   [b"%x\r\n%s\r\n" % (len(body), body), b"0\r\n\r\n"])
    assert parse(raw).status == 404  # read, parsed, translated: only the model is unknown
    raw = exchange(door.small, post_head("/v1/completions", "Transfer-Encoding: chunked\r\n"),
                   chunked(3 * MiB, b" "))
    assert_413(parse(raw), MiB)
    assert_healthy(door.open)


def test_a_content_length_that_lies(door: Door) -> None:
    before = rss(door.open)
    # Shorter than the body: the rest is read as the next request, which is not HTTP: 400, closed.
    raw = exchange(door.open, post_head("/v1/completions", "Content-Length: 2\r\n") + b"{}",
                   (b"x" * MiB for _ in range(200)))
    assert parse(raw).status == 400
    assert_grew_little(door.open, before)
    # Longer than the body, then the client gives up: the router answers nothing, logs no crash.
    host, _, port = door.open.url.removeprefix("http://").rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(post_head("/v1/completions", "Content-Length: 1000\r\n") + b'{"model": ')
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        while sock.recv(65536):
            pass
    assert_healthy(door.open)
    assert not any("Exception in ASGI application" in line for line in door.open.log), door.open.running.output()


# ---------------------------------------------------------------------- hostile JSON


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("body, fragment", [
    ('{"model": "m", "prompt": ' + deep(100_000) + "}", "nested deeper than"),
    (deep(100_000), "nested deeper than"),
    ('{"model": "m", "prompt": "x", "junk": ' + deep(200) + "}", "nested deeper than"),
    ('{"model": "m", "prompt": "x", "junk": [' + "{}," * 200_000 + "{}]}", "arrays and objects"),
    ('{"model": "m", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "not valid JSON"),
    ('{"model": "m", "prompt": "x", "temperature": NaN}', "not valid JSON"),
    ('{"model": "m", "prompt": "x", "temperature": -Infinity}', "not valid JSON"),
    ('{"model": "m", "prompt": "x", "temperature": 1e400}', "temperature"),
    ('{"model": "m", "prompt": "x", "max_tokens": 1099511627776}', "max_tokens"),
    ('{"model": "m", "prompt": "x", "top_k": -1099511627776}', "top_k"),
    ('{"model": "m", "prompt": "\\ud800"}', "surrogate"),
    ('{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate"),
    ('{"model": "m", "prompt": "x", "temperature": [' + deep(60) + ', "' + "y" * 100_000 + '"]}', "temperature"),
    ('["a list"]', "JSON object"),
    ('"a string"', "JSON object"),
    ("", "not valid JSON"),
    ('{"model": "\xff"}', "not valid JSON"),
])
def test_hostile_json_is_a_400_with_a_clear_message(door: Door, body: str, fragment: str) -> None:
    path = "/v1/chat/completions" if '"messages"' in body else "/v1/completions"
    reply = request(door.open, "POST", path, body.encode("latin-1") if "\xff" in body else body.encode())
    assert reply.status == 400, reply
    error = reply.json()["error"]
    assert fragment in error["message"] or fragment == error["param"], error
    assert len(reply.body) < 2000  # the error never echoes a huge value back


def test_brackets_inside_strings_are_not_nesting(door: Door, model_name: str) -> None:
    prompt = "[" * 100 + '{"\\"[' + "{" * 100  # a prompt full of brackets and escapes is fine
    reply = request(door.open, "POST", "/v1/completions",
                    {"model": model_name, "prompt": prompt, "max_tokens": 1, "junk": [[["ok"]]] * 1000})
    assert reply.status == 200, reply


def test_a_lone_surrogate_in_the_model_name_is_a_404_not_a_500(door: Door) -> None:
    reply = request(door.open, "POST", "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}')
    assert reply.status == 404 and reply.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------------- /health


def test_health_without_a_token_is_status_only(door: Door) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer reader-tok"}):
        reply = request(door.secured, "GET", "/health", headers=headers)
        assert reply.status == 200 and reply.json() == {"status": "ok"}, reply
        assert door.replica.addr.encode() not in reply.body
    reply = request(door.secured, "GET", "/health", headers={"authorization": "Bearer client-tok"})
    assert reply.status == 200 and reply.json()["replicas"] == [door.replica.addr]
    assert reply.json()["cache_manager_up"] is True
    # Without a token file the whole door is open, details included (documented).
    assert request(door.open, "GET", "/health").json()["replicas"] == [door.replica.addr]


def test_unhealthy_without_a_token_is_status_only_503(door: Door, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    os.chmod(tokens, 0o600)
    dead = f"127.0.0.1:{free_port()}"
    launched = launch_service("router", ["--host", "127.0.0.1", "--port", "0", "--cache-addr", dead,
                                         "--replica", dead, "--http-port", "0", "--check-interval", "0.3",
                                         "--auth-token-file", str(tokens)], ROUTER_START_TIMEOUT_S)
    try:
        launched.process.wait_listening(ROUTER_START_TIMEOUT_S)
        router = Router.of(Running(launched.process.addr or "", launched.process, launched.log))
        reply = request(router, "GET", "/health")
        assert reply.status == 503 and reply.json() == {"status": "no replica reachable"}
        reply = request(router, "GET", "/health", headers={"authorization": "Bearer client-tok"})
        assert reply.status == 503 and reply.json()["replicas"] == []
    finally:
        launched.process.stop(10.0)


# ---------------------------------------------------------------------- ignored fields


def test_a_misspelled_parameter_is_accepted_listed_and_logged(door: Door, model_name: str) -> None:
    reply = request(door.open, "POST", "/v1/completions",
                    {"model": model_name, "prompt": "Hello", "max_tokens": 2, "temprature": 0.2})
    assert reply.status == 200 and reply.headers["x-ignored-fields"] == "temprature"
    deadline = time.monotonic() + 5
    while not any("temprature" in line and "WARNING" in line for line in door.open.log):
        assert time.monotonic() < deadline, door.open.running.output()
        time.sleep(0.05)
    # Streamed: the same header.
    reply = request(door.open, "POST", "/v1/completions", {"model": model_name, "prompt": "Hello", "max_tokens": 2,
                                                          "stream": True, "temprature": 0.2, "zeta": 1})
    assert reply.status == 200 and reply.headers["x-ignored-fields"] == "temprature,zeta"
    assert reply.body.rstrip().endswith(b"data: [DONE]")
    # Nothing ignored: no header.
    reply = request(door.open, "POST", "/v1/completions", {"model": model_name, "prompt": "Hello", "max_tokens": 2,
                                                          "temperature": 0, "user": None})
    assert reply.status == 200 and "x-ignored-fields" not in reply.headers


def test_known_fields_that_are_not_acted_on_are_listed(door: Door, model_name: str) -> None:
    reply = request(door.open, "POST", "/v1/chat/completions", {
        "model": model_name, "max_tokens": 2, "user": "u", "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}], "name": "x"}],
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stream": True,
    })
    assert reply.status == 200, reply
    # min_p, min_tokens and repetition_penalty are acted on (SamplingParams): never listed.
    # stream_options.continuous_usage_stats is acted on too (vLLM's per-chunk usage).
    assert reply.headers["x-ignored-fields"] == "messages[].content[].cache_control,messages[].name,user"


def test_odd_field_names_cannot_break_the_header(door: Door, model_name: str) -> None:
    body = {"model": model_name, "prompt": "Hello", "max_tokens": 1, "a,b": 1, "x\r\nSet-Cookie: y": 1,
            "ü": 1, "\ud800": 1, "k" * 10_000: 1, **{f"f{i:03}": i for i in range(100)}}
    reply = request(door.open, "POST", "/v1/completions", json.dumps(body).encode())
    assert reply.status == 200, reply
    listed = reply.headers["x-ignored-fields"]
    assert "set-cookie" not in reply.headers and len(listed) < 4000 and listed.isascii()
    names = listed.split(",")
    assert "a%2Cb" in names and "%C3%BC" in names and names[-1] == "..."


def test_the_openai_package_sees_the_header(door: Door, model_name: str) -> None:
    client = openai.OpenAI(base_url=door.secured.url + "/v1", api_key="client-tok", max_retries=0, timeout=30)
    raw = client.completions.with_raw_response.create(model=model_name, prompt="Hello", max_tokens=2,
                                                      extra_body={"temprature": 0.5})
    assert raw.headers["x-ignored-fields"] == "temprature" and raw.parse().choices[0].finish_reason
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=2, stream=True,
        user="someone")
    assert raw.headers["x-ignored-fields"] == "user"
    chunks = list(raw.parse())
    assert chunks[-1].choices[0].finish_reason
    completion = client.completions.create(model=model_name, prompt="Hello", max_tokens=2, temperature=0)
    assert completion.choices[0].text is not None
