"""The fault proxy's fixed one-way latency: each direction is delayed by it, bytes keep their
order, and chunks in transit overlap (throughput is not one chunk per latency). The client side
speaks HTTP/2 framing (the proxy parses it); the server is a plain TCP echo."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from testing.fault_proxy import PREFACE, FaultProxy

LATENCY_S = 0.05


@pytest.fixture
def echo_addr() -> Iterator[str]:
    """A plain TCP echo server (bytes back as they come) on a free port."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                try:
                    while data := conn.recv(65536):
                        conn.sendall(data)
                except ConnectionError:  # the proxy reset its side (a test's end): serve the next one
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5.0)
    listener.close()


def _frame(payload: bytes) -> bytes:
    """An HTTP/2 DATA frame on stream 1."""
    return len(payload).to_bytes(3, "big") + b"\x00\x00" + (1).to_bytes(4, "big") + payload


def _connect(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10.0)
    sock.sendall(PREFACE)
    assert _recv_exactly(sock, len(PREFACE)) == PREFACE
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "connection closed early"
        out += chunk
    return bytes(out)


def _round_trip(addr: str, payload: bytes) -> float:
    with _connect(addr) as sock:
        started = time.monotonic()
        sock.sendall(_frame(payload))
        assert _recv_exactly(sock, len(payload) + 9) == _frame(payload)
        return time.monotonic() - started


def test_round_trip_takes_twice_the_one_way_latency(echo_addr):
    with FaultProxy(echo_addr, latency_s=LATENCY_S) as proxy:
        elapsed = [_round_trip(proxy.addr, b"ping") for _ in range(3)]
    assert min(elapsed) >= 2 * LATENCY_S
    assert min(elapsed) < 2 * LATENCY_S + 0.1


def test_no_latency_by_default_and_it_can_be_set_later(echo_addr):
    with FaultProxy(echo_addr) as proxy:
        assert min(_round_trip(proxy.addr, b"x") for _ in range(3)) < LATENCY_S
        proxy.latency_s = LATENCY_S
        assert _round_trip(proxy.addr, b"y") >= 2 * LATENCY_S


def test_many_chunks_keep_order_and_overlap_in_transit(echo_addr):
    """200 writes spread over ~0.2 s: serialised per chunk they would take 200 x 2 x latency
    (20 s); overlapped they arrive about one round trip after the last one was sent."""
    chunks = [_frame(bytes([i % 251]) * 1000) for i in range(200)]
    expected = b"".join(chunks)
    with FaultProxy(echo_addr, latency_s=LATENCY_S) as proxy:
        with _connect(proxy.addr) as sock:
            received = bytearray()
            reader = threading.Thread(target=lambda: received.extend(_recv_exactly(sock, len(expected))))
            started = time.monotonic()
            reader.start()
            for chunk in chunks:
                sock.sendall(chunk)
                time.sleep(0.001)
            sent = time.monotonic() - started
            reader.join(10.0)
            elapsed = time.monotonic() - started
    assert bytes(received) == expected
    assert elapsed >= 2 * LATENCY_S
    assert elapsed < sent + 2 * LATENCY_S + 0.5
