"""Append-only, checksummed record log of the durable cache manager (`--state-dir`).

A record is `[u32 payload length][u32 crc32 of kind + payload][u8 kind][payload]`, little
endian. The writer appends each record with one `os.write` straight into the OS page cache
before the RPC that caused it is answered, so a `kill -9` of the process loses nothing that was
acknowledged; `fsync` runs periodically (group commit, see `Journal.sync`), so a power loss
loses at most the last sync interval. A crash in the middle of a write leaves a torn tail
record: `read_records` stops at the first record whose length runs past the end of the file or
whose checksum does not match, and `Journal.open` truncates the file there before appending.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Iterator
from typing import NamedTuple

from common.private_files import open_private

HEADER = struct.Struct("<IIB")
MAX_RECORD_BYTES = 1 << 30


class Record(NamedTuple):
    kind: int
    payload: bytes
    end: int  # file offset just after this record


def encode(kind: int, payload: bytes) -> bytes:
    """One framed record."""
    crc = zlib.crc32(payload, zlib.crc32(bytes((kind,))))
    return HEADER.pack(len(payload), crc, kind) + payload


def read_records(data: bytes) -> Iterator[Record]:
    """Every intact record of a log image, in order; stops silently at a torn or corrupt tail."""
    pos, size = 0, len(data)
    while pos + HEADER.size <= size:
        length, crc, kind = HEADER.unpack_from(data, pos)
        start = pos + HEADER.size
        end = start + length
        if length > MAX_RECORD_BYTES or end > size:
            return
        payload = data[start:end]
        if zlib.crc32(payload, zlib.crc32(bytes((kind,)))) != crc:
            return
        yield Record(kind, payload, end)
        pos = end


class Journal:
    """One log file open for appending (see the module docstring for the format)."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path = path
        self._fd = fd
        self.size = size  # bytes of intact records in the file
        self.num_records = 0
        self.unsynced_bytes = 0
        self.last_sync_seconds = 0.0  # duration of the last fsync
        self.max_sync_seconds = 0.0

    @classmethod
    def open(cls, path: str) -> tuple[Journal, list[Record]]:
        """Open (creating) `path`, drop a torn tail; returns the journal and the intact records."""
        fd = open_private(path, os.O_RDWR | os.O_APPEND)  # 0600: Steps hold tenants' token ids
        with open(path, "rb") as f:
            data = f.read()
        records = list(read_records(data))
        good = records[-1].end if records else 0
        if good != len(data):
            os.ftruncate(fd, good)
            os.fsync(fd)
        journal = cls(path, fd, good)
        journal.num_records = len(records)
        return journal, records

    def append(self, kind: int, *parts: bytes) -> None:
        """Write one record (its payload: `parts` joined) to the OS; survives kill -9 once this returns."""
        crc = zlib.crc32(bytes((kind,)))
        length = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
            length += len(part)
        header = HEADER.pack(length, crc, kind)
        total = len(header) + length
        written = os.writev(self._fd, (header, *parts))  # one system call, no joined copy
        if written < total:  # a short write (rare: signals, odd file systems)
            rest = b"".join((header, *parts))[written:]
            while rest:
                rest = rest[os.write(self._fd, rest):]
        self.size += total
        self.unsynced_bytes += total
        self.num_records += 1

    def sync(self) -> None:
        """fsync what was appended (call it from a worker thread: it may block)."""
        if not self.unsynced_bytes:
            return
        self.unsynced_bytes = 0
        started = time.perf_counter()
        os.fsync(self._fd)
        self.last_sync_seconds = time.perf_counter() - started
        self.max_sync_seconds = max(self.max_sync_seconds, self.last_sync_seconds)

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
