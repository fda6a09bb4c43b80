"""A TCP fault proxy for tests: forwards ``127.0.0.1:<free port>`` to a real server and breaks
the network on command, so client behaviour under failures (retries, deadlines, streams cut
short) is tested against our real services instead of a fake of them.

It never changes a byte it forwards. It does read the client's HTTP/2 frames, to count gRPC
call attempts (a HEADERS frame opening a new stream is one attempt), to decode their headers
(``:path``, metadata) and to cut a connection the moment a request arrives, before the server
sees it. Server-to-client bytes are forwarded unread.

Switches:
    ``cut_next_requests(n)``   the next n requests reset the connection carrying them instead of
                               reaching the server: the client sees UNAVAILABLE, no response
    ``reset_connections()``    resets every open connection now (to cut a stream mid-way)
    ``pause()`` / ``resume()`` stop / restart forwarding bytes in both directions
    ``latency_s``              fixed one-way latency (``FaultProxy(target, latency_s=0.025)``, or
                               set it any time): every chunk read is forwarded that long after
                               it arrived, in order, in each direction; throughput is not capped
                               (chunks in transit overlap, each waits only for its own due time)

Every socket wait is bounded; ``close()`` stops the proxy and joins its threads.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_SIZE = 9
HEADERS, CONTINUATION = 0x1, 0x9
FLAG_END_HEADERS, FLAG_PADDED, FLAG_PRIORITY = 0x4, 0x8, 0x20
POLL_S = 0.02  # how often the loops look at the switches
IO_TIMEOUT_S = 5.0  # connecting upstream; sending to a peer that stopped reading


@dataclass
class Request:
    """One gRPC call attempt the client sent."""

    connection: int  # which accepted TCP connection (1, 2, ...) carried it
    stream_id: int
    cut: bool = False  # the proxy reset the connection instead of forwarding it
    header_block: bytearray = field(default_factory=bytearray, repr=False)
    # Decoded once the block is complete; a Huffman-coded string decodes to None.
    headers: list[tuple[str | None, str | None]] | None = None

    @property
    def method(self) -> str | None:
        """The RPC's method name (``"Tokenize"``), from ``:path``."""
        path = self.header(":path")
        return path.rsplit("/", 1)[-1] if path else None

    def header(self, name: str) -> str | None:
        if self.headers is None:
            raise ValueError(f"headers of stream {self.stream_id} were not decoded")
        values = [v for n, v in self.headers if n == name]
        return values[-1] if values else None


# ---------------------------------------------------------------------------- HPACK (RFC 7541)

# RFC 7541 Appendix A.
_STATIC_TABLE: tuple[tuple[str, str], ...] = (
    (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"),
    (":path", "/index.html"), (":scheme", "http"), (":scheme", "https"), (":status", "200"),
    (":status", "204"), (":status", "206"), (":status", "304"), (":status", "400"),
    (":status", "404"), (":status", "500"), ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"), ("accept-language", ""), ("accept-ranges", ""),
    ("accept", ""), ("access-control-allow-origin", ""), ("age", ""), ("allow", ""),
    ("authorization", ""), ("cache-control", ""), ("content-disposition", ""),
    ("content-encoding", ""), ("content-language", ""), ("content-length", ""),
    ("content-location", ""), ("content-range", ""), ("content-type", ""), ("cookie", ""),
    ("date", ""), ("etag", ""), ("expect", ""), ("expires", ""), ("from", ""), ("host", ""),
    ("if-match", ""), ("if-modified-since", ""), ("if-none-match", ""), ("if-range", ""),
    ("if-unmodified-since", ""), ("last-modified", ""), ("link", ""), ("location", ""),
    ("max-forwards", ""), ("proxy-authenticate", ""), ("proxy-authorization", ""), ("range", ""),
    ("referer", ""), ("refresh", ""), ("retry-after", ""), ("server", ""), ("set-cookie", ""),
    ("strict-transport-security", ""), ("transfer-encoding", ""), ("user-agent", ""),
    ("vary", ""), ("via", ""), ("www-authenticate", ""),
)  # fmt: skip

Header = tuple[str | None, str | None]


class _HeaderDecoder:
    """HPACK decoding of one connection's request headers, without Huffman: a Huffman-coded
    string decodes to None (gRPC's encoder writes plain strings)."""

    def __init__(self) -> None:
        self._dynamic: list[Header] = []  # newest first
        self._max_size = 4096

    def decode(self, block: bytes) -> list[Header]:
        headers: list[Header] = []
        pos = 0
        while pos < len(block):
            first = block[pos]
            if first & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                headers.append(self._entry(index))
            elif first & 0xC0 == 0x40:  # literal, added to the dynamic table
                header, pos = self._literal(block, pos, 6)
                headers.append(header)
                self._dynamic.insert(0, header)
                self._evict()
            elif first & 0xE0 == 0x20:  # dynamic table size update
                self._max_size, pos = _integer(block, pos, 5)
                self._evict()
            else:  # literal without indexing / never indexed
                header, pos = self._literal(block, pos, 4)
                headers.append(header)
        return headers

    def _literal(self, block: bytes, pos: int, prefix: int) -> tuple[Header, int]:
        index, pos = _integer(block, pos, prefix)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = _string(block, pos)
        value, pos = _string(block, pos)
        return (name, value), pos

    def _entry(self, index: int) -> Header:
        if 1 <= index <= len(_STATIC_TABLE):
            return _STATIC_TABLE[index - 1]
        dynamic = index - len(_STATIC_TABLE) - 1
        if not 0 <= dynamic < len(self._dynamic):
            raise ValueError(f"HPACK index {index} out of range")
        return self._dynamic[dynamic]

    def _evict(self) -> None:
        def size(header: Header) -> int:
            return 32 + sum(len((s or "").encode()) for s in header)

        while self._dynamic and sum(size(h) for h in self._dynamic) > self._max_size:
            self._dynamic.pop()


def _integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    mask = (1 << prefix) - 1
    value = block[pos] & mask
    pos += 1
    if value == mask:
        shift = 0
        while True:
            byte = block[pos]
            pos += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
    return value, pos


def _string(block: bytes, pos: int) -> tuple[str | None, int]:
    huffman = bool(block[pos] & 0x80)
    length, pos = _integer(block, pos, 7)
    raw = block[pos : pos + length]
    if len(raw) != length:
        raise ValueError("truncated HPACK string")
    return (None if huffman else raw.decode("latin-1")), pos + length


# ---------------------------------------------------------------------------- forwarding


class _ClientFrames:
    """Splits the client->server byte stream into whole HTTP/2 frames (after the preface)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._preface_seen = False

    def feed(self, data: bytes) -> list[tuple[bytes, int, int, int, bytes]]:
        """Returns the frames now complete: (raw bytes, type, flags, stream id, payload)."""
        self._buffer += data
        frames: list[tuple[bytes, int, int, int, bytes]] = []
        if not self._preface_seen:
            if len(self._buffer) < len(PREFACE):
                return frames
            if bytes(self._buffer[: len(PREFACE)]) != PREFACE:
                raise ValueError("not an HTTP/2 client")
            frames.append((PREFACE, -1, 0, 0, b""))
            del self._buffer[: len(PREFACE)]
            self._preface_seen = True
        while len(self._buffer) >= FRAME_HEADER_SIZE:
            end = FRAME_HEADER_SIZE + int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < end:
                break
            kind, flags = self._buffer[3], self._buffer[4]
            stream_id = int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF
            raw = bytes(self._buffer[:end])
            frames.append((raw, kind, flags, stream_id, raw[FRAME_HEADER_SIZE:]))
            del self._buffer[:end]
        return frames


def _header_fragment(flags: int, payload: bytes) -> bytes:
    """The header block fragment of a HEADERS frame's payload (padding and priority removed)."""
    start, pad = 0, 0
    if flags & FLAG_PADDED:
        pad = payload[0]
        start = 1
    if flags & FLAG_PRIORITY:
        start += 5
    return payload[start : len(payload) - pad]


def _reset(sock: socket.socket) -> None:
    """Closes ``sock`` with a TCP RST (SO_LINGER 0) rather than an orderly FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Connection:
    """One proxied TCP connection, served by its own thread that owns both sockets."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, number: int) -> None:
        self.proxy = proxy
        self.client = client
        self.number = number
        self.decoder = _HeaderDecoder()
        self.streams: set[int] = set()  # stream ids the client opened on it
        self.block = bytearray()  # the header block being received
        self.block_request: Request | None = None  # the request it opens, if any
        self.kill = threading.Event()
        self.done = threading.Event()
        self.parked = threading.Event()  # set while it forwards nothing because of pause()
        self.thread = threading.Thread(target=self._run, name=f"fault-proxy-{number}", daemon=True)

    def _run(self) -> None:
        upstream: socket.socket | None = None
        reset = True
        try:
            upstream = socket.create_connection(self.proxy.target_address, timeout=IO_TIMEOUT_S)
            self.client.settimeout(IO_TIMEOUT_S)
            reset = self._pump(self.client, upstream)
        except (OSError, ValueError):
            reset = True
        finally:
            for sock in (self.client, upstream):
                if sock is None:
                    continue
                if reset:
                    _reset(sock)
                else:
                    sock.close()
            self.done.set()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> bool:
        """Forwards until a side closes (returns False) or the connection is cut (True)."""
        frames = _ClientFrames()
        proxy = self.proxy
        # Chunks in transit: (due time, destination, bytes), in arrival order. One queue for both
        # directions keeps each direction's order (latency is the same for both).
        transit: deque[tuple[float, socket.socket, bytes]] = deque()
        closing = False
        while True:
            if self.kill.is_set() or proxy.closed:
                return True
            if proxy.paused:
                self.parked.set()
                time.sleep(POLL_S)
                continue
            self.parked.clear()
            now = time.monotonic()
            while transit and transit[0][0] <= now:
                _, sock, data = transit.popleft()
                sock.sendall(data)
            if closing:
                if not transit:
                    return False
                time.sleep(max(0.0, transit[0][0] - now))
                continue
            wait = POLL_S if not transit else min(POLL_S, max(0.0, transit[0][0] - now))
            readable, _, _ = select.select([client, upstream], [], [], wait)
            latency = proxy.latency_s
            arrived = time.monotonic()
            for sock in readable:
                data = sock.recv(65536)
                if not data:
                    closing = True  # deliver what is in transit, then close
                    break
                if sock is upstream:
                    out: list[bytes] = [data]
                    destination = client
                else:
                    out = []
                    destination = upstream
                    for raw, kind, flags, stream_id, payload in frames.feed(data):
                        if kind in (HEADERS, CONTINUATION) and proxy._on_headers(
                            self, kind, flags, stream_id, payload
                        ):
                            return True  # cut: this request never reaches the server
                        out.append(raw)
                for chunk in out:
                    if latency > 0 or transit:
                        transit.append((arrived + latency, destination, chunk))
                    else:
                        destination.sendall(chunk)


class FaultProxy:
    """A TCP forwarder in front of ``target`` (``host:port``); see the module docstring."""

    def __init__(self, target: str, latency_s: float = 0.0) -> None:
        host, port = target.rsplit(":", 1)
        self.target_address = (host, int(port))
        self.latency_s = latency_s  # one-way, each direction (see the module docstring)
        self.paused = False
        self.closed = False
        self._lock = threading.Condition()
        self._cut = 0
        self._accepted = 0
        self._requests: list[Request] = []
        self._connections: list[_Connection] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL_S)
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept, name="fault-proxy-accept", daemon=True)
        self._acceptor.start()

    # ------------------------------------------------------------------ switches

    def cut_next_requests(self, n: int = 1) -> None:
        """Makes the next ``n`` requests reset the connection that carries them, unforwarded."""
        with self._lock:
            self._cut += n

    def reset_connections(self, timeout_s: float = IO_TIMEOUT_S) -> int:
        """Resets every open connection and waits until they are closed; returns how many."""
        with self._lock:
            live = [c for c in self._connections if not c.done.is_set()]
        for connection in live:
            connection.kill.set()
        for connection in live:
            if not connection.done.wait(timeout_s):
                raise TimeoutError("a proxied connection did not close")
        return len(live)

    def pause(self, timeout_s: float = IO_TIMEOUT_S) -> None:
        """Stops forwarding: once it returns, no byte passes in either direction until
        ``resume()`` (they wait in the sockets). New connections are still accepted."""
        self.paused = True
        deadline = time.monotonic() + timeout_s
        with self._lock:
            live = list(self._connections)
        for connection in live:
            while not (connection.parked.is_set() or connection.done.is_set()):
                if time.monotonic() > deadline:
                    raise TimeoutError("a proxied connection did not pause")
                time.sleep(POLL_S / 4)

    def resume(self) -> None:
        self.paused = False

    # ------------------------------------------------------------------ what it saw

    @property
    def connections(self) -> int:
        """TCP connections accepted so far."""
        with self._lock:
            return self._accepted

    @property
    def requests(self) -> list[Request]:
        """Every call attempt the client sent, in order (cut ones included)."""
        with self._lock:
            return list(self._requests)

    def methods(self) -> list[str | None]:
        """The method of every call attempt, in order: ``["Tokenize", "Tokenize"]``."""
        return [r.method for r in self.requests]

    def wait_for(self, predicate: Callable[[FaultProxy], bool], timeout_s: float) -> None:
        """Waits until ``predicate(self)`` holds; TimeoutError if it does not in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("fault proxy: condition not reached in time")
                self._lock.wait(min(left, POLL_S))

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout_s: float = IO_TIMEOUT_S) -> None:
        """Stops accepting, resets every connection and joins the threads (bounded)."""
        self.closed = True
        self._acceptor.join(timeout_s)
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.thread.join(timeout_s)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._accepted += 1
                connection = _Connection(self, client, self._accepted)
                self._connections.append(connection)
            connection.thread.start()

    def _on_headers(
        self, connection: _Connection, kind: int, flags: int, stream_id: int, payload: bytes
    ) -> bool:
        """Records a request's headers; True when its connection must be cut instead."""
        with self._lock:
            new = kind == HEADERS and stream_id not in connection.streams
            if kind == HEADERS:  # a header block starts; CONTINUATION frames follow it directly
                connection.block = bytearray(_header_fragment(flags, payload))
                connection.block_request = None
            else:
                connection.block += payload
            if new:  # a new stream: one call attempt
                connection.streams.add(stream_id)
                request = Request(connection.number, stream_id)
                if self._cut > 0:
                    self._cut -= 1
                    request.cut = True
                self._requests.append(request)
                connection.block_request = request
            if flags & FLAG_END_HEADERS:
                try:  # every block is decoded, in order: they share the HPACK dynamic table
                    headers: list[Header] | None = connection.decoder.decode(bytes(connection.block))
                except (ValueError, IndexError):
                    headers = None
                if connection.block_request is not None:
                    connection.block_request.header_block = connection.block
                    connection.block_request.headers = headers
            self._lock.notify_all()
            return new and self._requests[-1].cut
