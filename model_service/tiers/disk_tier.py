"""The disk tier: pages of KV in one preallocated file of fixed-size slots, `DIR/kv-<fp16>.slots`.

`fp16` is the first 16 hex digits of the sha256 of the model fingerprint, the KV dtype, the page
shape (layers, KV heads, head dim, block size) and the format version, so a file written for
another model, dtype, shape or format is never opened; every slot header carries the whole
digest too. DIR is made 0700 and the file 0600 (common/private_files.py): slots hold tenants'
token ids and KV. The file is locked (flock) while open: two replicas never share one.

Slot i lives at offset i * slot_size: a header region (4096-byte aligned) then the payload region
(4096-byte aligned). Header, little-endian:
    magic 8s "RKVSLOT\\0" | version u32 | block_size u32 | digest 32s (sha256, as above)
    | parent_hash u64 | page_hash u64 | payload xxh3_64 u64 | namespace length u16
    | namespace UTF-8, 256 bytes | block_size token ids, u32 each | xxh3_64 of all of the above
Payload: the page's KV, [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim], raw bytes
of the dtype (the host tier's slot, byte for byte).

A write zeroes the slot's header region first, then writes the payload, then the header (each
region whole), so a write cut short by a crash leaves a slot that reads as empty, never as valid.
I/O is direct (O_DIRECT, from 4096-aligned buffers) where the file system takes it, buffered
where it does not (tmpfs on older kernels): a KV page is written once and read rarely, so the
page cache would only hold a second copy of it, cost a copy and page allocations on every write
and a writeback later, on the cores the forward passes use. fsync policy: none per
write. The tier is a cache: a page lost at power failure is a miss, and a page whose header
reached the disk without its payload (the kernel may write back pages in any order) fails its
payload checksum, which `load_to_device` verifies before copying anything: a torn or corrupt
slot is a miss, never wrong KV. `flush()` fsyncs; `close()` calls it.

At open the headers (not the payloads) are read and checked (`scan`); the valid pages are
chained by their hashes into `DiskRun`s (protos/cache.proto DiskRun) that the replica announces,
so a replica restarted on the same directory serves hits from disk at once. An in-memory index,
kept up to date by every write, answers `runs()` without reading the file again.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import torch
from xxhash import xxh3_64_intdigest

from cache_service.page_hash import page_hashes
from common.private_files import make_private_dir, open_private
from common.token_bytes import TOKEN_BYTES
from model_service.kv_cache import KVCache, KVCacheSpec
from model_service.tiers.host_tier import HostTier
from model_service.tiers.page_copy import PageCopier, check_unique, index_tensor, page_shape

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"RKVSLOT\x00"
ALIGN = 4096
MAX_NAMESPACE_BYTES = 256
FILE_PREFIX = "kv-"
FILE_SUFFIX = ".slots"
# magic, version, block_size, digest, parent_hash, page_hash, payload checksum, namespace length
_FIXED = struct.Struct("<8sII32sQQQH")
_CHECKSUM = struct.Struct("<Q")
_U64 = 1 << 64
_T = TypeVar("_T")
# Pages read per batch, and at most per batch of a write: bounds the loads' staging rows.
_STAGING_BYTES = 32 << 20
# Async writes staged and not yet on file: the size of their ring of page rows (a write that
# finds it full waits for the oldest).
_BACKLOG_BYTES = 128 << 20


class PageInfo(NamedTuple):
    """One page written to the disk tier: its namespace, the hash of the page before it (0: the
    page starts its sequence), its own chained hash (cache_service/page_hash.py) and its
    block_size token ids packed as common.token_bytes.encode_tokens."""
    namespace: str
    parent_hash: int
    page_hash: int
    token_bytes: bytes


@dataclass(slots=True)
class DiskRun:
    """A prefix the disk tier holds (protos/cache.proto DiskRun): the pages of one sequence from
    its first page on, their tokens packed, and each page's slot in order."""
    namespace: str
    token_bytes: bytes
    slots: list[int]


@dataclass(slots=True)
class _Page:
    namespace: str
    parent_hash: int
    page_hash: int
    token_bytes: bytes


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _header_size(spec: KVCacheSpec) -> int:
    return _FIXED.size + MAX_NAMESPACE_BYTES + TOKEN_BYTES * spec.block_size + _CHECKSUM.size


def layout_digest(spec: KVCacheSpec, model_fingerprint: str) -> bytes:
    """sha256 of what makes slots interchangeable: model, dtype, page shape, format version."""
    text = (f"{model_fingerprint}\n{spec.dtype}\n{spec.num_layers},{spec.num_kv_heads},{spec.head_dim},"
            f"{spec.block_size}\nv{FORMAT_VERSION}")
    return hashlib.sha256(text.encode()).digest()


def file_name(spec: KVCacheSpec, model_fingerprint: str) -> str:
    """`kv-<first 16 hex digits of layout_digest>.slots`."""
    return f"{FILE_PREFIX}{layout_digest(spec, model_fingerprint).hex()[:16]}{FILE_SUFFIX}"


def _owns(name: str) -> bool:
    return name.startswith(FILE_PREFIX) and name.endswith(FILE_SUFFIX)


class DiskTier:
    """Pages of KV in a slot file (see the module docstring). One caller thread; the `*_async`
    writes run on the tier's own writer thread (the index of held pages is locked for it)."""

    def __init__(self, path: str, fd: int, spec: KVCacheSpec, digest: bytes, num_slots: int) -> None:
        self.path = path
        self.spec = spec
        self.num_slots = num_slots
        self._fd = fd
        self._digest = digest
        self.payload_size = spec.bytes_per_block
        self.header_size = _header_size(spec)
        self.header_region = _round_up(self.header_size, ALIGN)
        self.slot_size = self.slot_size_for(spec)
        self.direct = False  # O_DIRECT (set by `open` where the file system takes it)
        self._header = _aligned_bytes(self.header_region)  # reused by every read
        self._write_header = _aligned_bytes(self.header_region)  # the writer thread's
        self._empty_header = _aligned_bytes(self.header_region)  # zeros: invalidates a slot
        self._staging_rows = max(1, _STAGING_BYTES // self.payload_size)
        self._staging: torch.Tensor | None = None
        self._copier: PageCopier | None = None
        self._pages: dict[int, _Page] = {}
        self._index_lock = threading.Lock()  # _pages, against the writer thread
        self._writer: ThreadPoolExecutor | None = None  # started by the first async write
        self._ring: _StagingRing | None = None  # the async writes' staged pages (made by the first)

    @staticmethod
    def slot_size_for(spec: KVCacheSpec) -> int:
        """Bytes one slot takes in the file (header and payload regions, each 4096-aligned)."""
        return _round_up(_header_size(spec), ALIGN) + _round_up(spec.bytes_per_block, ALIGN)

    @classmethod
    def open(cls, directory: str, spec: KVCacheSpec, model_fingerprint: str, num_bytes: int,
             pin_memory: bool = False) -> DiskTier:
        """Open (creating or resizing) the slot file for this model and KV layout in `directory`,
        with num_bytes // slot_size slots, and scan it; its ring of staging rows is allocated and
        touched now, pinned if `pin_memory` (the pool is on CUDA). Raises ValueError when that is not one
        slot, OSError when the directory holds files that are not slot files, can't be made
        private, the file can't be preallocated or another process has it open."""
        num_slots = num_bytes // cls.slot_size_for(spec)
        if num_slots <= 0:
            raise ValueError(f"--disk-cache-gib gives {num_bytes} bytes, less than one slot "
                             f"({cls.slot_size_for(spec)} bytes)")
        make_private_dir(directory, owns=_owns)
        path = os.path.join(directory, file_name(spec, model_fingerprint))
        fd = open_private(path, os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OSError(errno.EBUSY, f"{path} is in use by another process") from None
            tier = cls(path, fd, spec, layout_digest(spec, model_fingerprint), num_slots)
            tier._size_file()
            tier._set_direct(tier.payload_size % ALIGN == 0)
            tier.scan()
            tier._ring = tier._new_ring(pin_memory)
            tier._staging = _aligned_rows(min(tier._staging_rows, num_slots), spec, pin_memory)
            tier._staging.view(torch.uint8).zero_()  # touched now, not by the first load
        except BaseException:
            os.close(fd)
            raise
        return tier

    def _size_file(self) -> None:
        size = self.num_slots * self.slot_size
        current = os.fstat(self._fd).st_size
        if current > size:  # a smaller tier than last time: the slots past the end are dropped
            os.ftruncate(self._fd, size)
        elif current < size:
            # Reserve the blocks now, so a full disk fails the start, not a write later.
            try:
                os.posix_fallocate(self._fd, current, size - current)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(self._fd, size)

    def _set_direct(self, on: bool) -> None:
        """O_DIRECT on the file, if asked and the file system takes it."""
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            on = False
        if self.direct and not on:
            log.warning("disk tier %s: direct I/O refused, buffered I/O from now on", self.path)
        self.direct = on

    def _io(self, call: Callable[[], _T]) -> _T:
        """`call()` (a pread / pwrite on the file); a device with stricter alignment than direct
        I/O here refuses it (EINVAL): the tier goes buffered from then on and calls it again."""
        try:
            return call()
        except OSError as e:
            if not (self.direct and e.errno == errno.EINVAL):
                raise
        self._set_direct(False)
        return call()

    # ------------------------------------------------------------------ lifecycle

    def flush(self) -> None:
        """fsync the slot file: every write before it survives a power failure."""
        os.fsync(self._fd)

    def close(self) -> None:
        """Finish the async writes, flush() and close the file (idempotent)."""
        if self._fd < 0:
            return
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
            self._ring = None
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writes

    def write_from_device(self, kv: KVCache, blocks: Sequence[int], slots: Sequence[int],
                          pages: Sequence[PageInfo]) -> int:
        """Write device block blocks[i] to slot slots[i] as page pages[i]. Returns how many
        leading pages were written (an OSError stops its batch of writes and is logged). ValueError,
        nothing written, on ids out of range, unequal lengths, a repeated slot or a bad page."""
        return self.write_from_device_async(kv, blocks, slots, pages).result()

    def write_from_host(self, host: HostTier, src_slots: Sequence[int], slots: Sequence[int],
                        pages: Sequence[PageInfo]) -> int:
        """Write host slot src_slots[i] to disk slot slots[i] as page pages[i]. Returns and
        raises as `write_from_device`."""
        return self.write_from_host_async(host, src_slots, slots, pages).result()

    def _check_writes(self, slots: Sequence[int], pages: Sequence[PageInfo]) -> None:
        if len(slots) != len(pages):
            raise ValueError(f"{len(slots)} disk slots but {len(pages)} pages")
        check_unique(index_tensor(slots, self.num_slots, "disk slots"), "disk slots")
        step = TOKEN_BYTES * self.spec.block_size
        for page in pages:
            if len(page.namespace.encode()) > MAX_NAMESPACE_BYTES:
                raise ValueError(f"namespace longer than {MAX_NAMESPACE_BYTES} bytes")
            if len(page.token_bytes) != step:
                raise ValueError(f"a page is {step} bytes of tokens, got {len(page.token_bytes)}")
            if not (0 <= page.parent_hash < _U64 and 0 <= page.page_hash < _U64):
                raise ValueError("page hashes are uint64")
            if page_hashes(page.parent_hash, page.namespace, page.token_bytes, self.spec.block_size)[0] \
                    != page.page_hash:
                raise ValueError(f"page hash {page.page_hash:#x} is not the hash of its tokens "
                                 f"after {page.parent_hash:#x} in its namespace")

    def write_from_device_async(self, kv: KVCache, blocks: Sequence[int], slots: Sequence[int],
                                pages: Sequence[PageInfo]) -> Future[int]:
        """`write_from_device` with the file writes on the writer thread: the blocks are read into
        buffers of this write's own before this returns (so they may be written again at once);
        the future gives the leading pages written. Raises as `write_from_device`."""
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} blocks but {len(slots)} disk slots")
        blk = index_tensor(blocks, kv.num_blocks, "blocks")
        self._check_writes(slots, pages)
        copier = self._copier_for(kv)

        def stage(lo: int, hi: int, rows: torch.Tensor) -> None:
            copier.to_rows(blk[lo:hi], torch.arange(hi - lo), rows)

        return self._submit(slots, pages, stage, copier.pin)

    def write_from_host_async(self, host: HostTier, src_slots: Sequence[int], slots: Sequence[int],
                              pages: Sequence[PageInfo]) -> Future[int]:
        """`write_from_host` on the writer thread; the host slots are copied before this returns."""
        if host.spec != self.spec:
            raise ValueError(f"the host tier's layout {host.spec} is not the disk tier's {self.spec}")
        if len(src_slots) != len(slots):
            raise ValueError(f"{len(src_slots)} host slots but {len(slots)} disk slots")
        src = index_tensor(src_slots, host.num_slots, "host slots")
        self._check_writes(slots, pages)

        def stage(lo: int, hi: int, rows: torch.Tensor) -> None:
            torch.index_select(host.data, 0, src[lo:hi], out=rows)

        return self._submit(slots, pages, stage, False)

    def _submit(self, slots: Sequence[int], pages: Sequence[PageInfo],
                stage: Callable[[int, int, torch.Tensor], None], pin: bool) -> Future[int]:
        """Queue the writes of pages [0, n), staged (`stage(lo, hi, rows)` fills their rows) into
        the ring a batch of at most `_staging_rows` pages at a time. The future gives the leading
        pages written."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="radixkv-disk-tier")
        if self._ring is None or self._ring.pin != pin:
            self.drain()
            self._ring = self._new_ring(pin)
        ring = self._ring
        batches: list[tuple[Future[int], int]] = []
        step = min(self._staging_rows, ring.num_rows)
        for lo in range(0, len(slots), step):
            hi = min(lo + step, len(slots))
            start, rows = ring.take(hi - lo)
            stage(lo, hi, rows)
            future = self._writer.submit(self._write_rows, list(slots[lo:hi]), list(pages[lo:hi]), rows)
            ring.hold(start, hi - lo, future)
            batches.append((future, hi - lo))
        # The single writer thread runs in order: by the time this runs, every batch is done.
        return self._writer.submit(_leading_written, batches)

    def _new_ring(self, pin: bool) -> _StagingRing:
        # No more rows than slots: a slot is written once until its write is reported.
        return _StagingRing(max(1, min(_BACKLOG_BYTES // self.payload_size, self.num_slots)), self.spec, pin)

    def drain(self) -> None:
        """Wait for every async write."""
        if self._ring is not None:
            self._ring.drain()

    def _write_rows(self, slots: list[int], pages: list[PageInfo], rows: torch.Tensor) -> int:
        data = _byte_rows(rows)
        for i, slot in enumerate(slots):
            if not self._write_slot(slot, pages[i], data[i]):
                return i
        return len(slots)

    def _write_slot(self, slot: int, page: PageInfo, payload: np.ndarray) -> bool:
        """Invalidate, payload, header (see the module docstring), on the writer thread. False
        (logged) on OSError. `payload`: a row of the ring (4096-aligned, as direct I/O needs)."""
        offset = slot * self.slot_size
        with self._index_lock:
            self._pages.pop(slot, None)
        header = self._pack_header(page, xxh3_64_intdigest(memoryview(payload)), self._write_header)
        try:
            for data, at in ((self._empty_header, offset), (payload, offset + self.header_region), (header, offset)):
                self._io(lambda data=data, at=at: _pwrite_all(self._fd, memoryview(data), at))
        except OSError as e:
            log.warning("disk tier %s: writing slot %d failed: %s", self.path, slot, e)
            return False
        with self._index_lock:
            self._pages[slot] = _Page(page.namespace, page.parent_hash, page.page_hash, bytes(page.token_bytes))
        return True

    def _pack_header(self, page: PageInfo, payload_checksum: int, region: np.ndarray) -> np.ndarray:
        """The header of `page` packed into `region` (a header region: the bytes after the header
        stay zero); returns `region`."""
        buf = memoryview(region)
        ns = page.namespace.encode()
        _FIXED.pack_into(buf, 0, MAGIC, FORMAT_VERSION, self.spec.block_size, self._digest,
                         page.parent_hash, page.page_hash, payload_checksum, len(ns))
        at = _FIXED.size
        buf[at:at + MAX_NAMESPACE_BYTES] = ns.ljust(MAX_NAMESPACE_BYTES, b"\x00")
        at += MAX_NAMESPACE_BYTES
        buf[at:at + len(page.token_bytes)] = page.token_bytes
        at += len(page.token_bytes)
        _CHECKSUM.pack_into(buf, at, xxh3_64_intdigest(buf[:at]))
        return region

    # ------------------------------------------------------------------ reads

    def load_to_device(self, kv: KVCache, slots: Sequence[int], blocks: Sequence[int],
                       expected: Sequence[tuple[str, int]]) -> int:
        """Copy slot slots[i]'s page into device block blocks[i] if the slot holds a valid page
        (magic, version, layout digest, header and payload checksums) that is exactly expected[i]
        = (namespace, page_hash). Returns the number of leading pages loaded: the first bad,
        unreadable or different slot ends the load (it is a miss: its block is never written).
        ValueError, nothing loaded, on ids out of range, unequal lengths or a repeated block."""
        if not (len(slots) == len(blocks) == len(expected)):
            raise ValueError(f"{len(slots)} disk slots, {len(blocks)} blocks and {len(expected)} expected pages")
        blk = index_tensor(blocks, kv.num_blocks, "blocks")
        check_unique(blk, "device blocks")
        index_tensor(slots, self.num_slots, "disk slots")
        copier = self._copier_for(kv)
        staging, rows = self._staging_for(copier, len(slots))
        done = 0
        for start in range(0, len(slots), staging.shape[0]):
            end = min(start + staging.shape[0], len(slots))
            good = 0
            for i in range(start, end):
                if not self._read_slot(slots[i], rows[i - start], expected[i]):
                    break
                good += 1
            copier.from_rows(staging, torch.arange(good), blk[start:start + good])
            done += good
            if good < end - start:
                break
        return done

    def _read_slot(self, slot: int, row: np.ndarray, expected: tuple[str, int]) -> bool:
        header = memoryview(self._header)
        try:
            n = self._io(lambda: os.preadv(self._fd, [header, memoryview(row)], slot * self.slot_size))
        except OSError as e:
            log.warning("disk tier %s: reading slot %d failed: %s", self.path, slot, e)
            return False
        if n != self.header_region + self.payload_size:
            return False
        page, payload_checksum = self._parse_header(header)
        if page is None:
            with self._index_lock:
                self._pages.pop(slot, None)
            return False
        if (page.namespace, page.page_hash) != tuple(expected):
            return False
        if xxh3_64_intdigest(memoryview(row)) != payload_checksum:
            log.warning("disk tier %s: slot %d fails its payload checksum (torn or corrupt): a miss",
                        self.path, slot)
            with self._index_lock:
                self._pages.pop(slot, None)
            return False
        return True

    def _parse_header(self, header: memoryview) -> tuple[_Page | None, int]:
        """The page a header describes and its payload checksum; (None, 0) unless the header is
        a valid one of this file's layout."""
        magic, version, block_size, digest, parent, page_hash, payload_checksum, ns_len = \
            _FIXED.unpack_from(header, 0)
        if magic != MAGIC or version != FORMAT_VERSION or block_size != self.spec.block_size \
                or digest != self._digest or ns_len > MAX_NAMESPACE_BYTES:
            return None, 0
        end = self.header_size - _CHECKSUM.size
        if _CHECKSUM.unpack_from(header, end)[0] != xxh3_64_intdigest(header[:end]):
            return None, 0
        try:
            namespace = bytes(header[_FIXED.size:_FIXED.size + ns_len]).decode()
        except UnicodeDecodeError:
            return None, 0
        tokens_at = _FIXED.size + MAX_NAMESPACE_BYTES
        token_bytes = bytes(header[tokens_at:end])
        return _Page(namespace, parent, page_hash, token_bytes), payload_checksum

    # ------------------------------------------------------------------ index

    def scan(self) -> list[DiskRun]:
        """Read and check every slot header (payload checksums are checked on load), rebuild the
        index from the valid pages whose hash is the hash of their tokens, and return `runs()`."""
        self._pages.clear()
        header = memoryview(self._header)
        bs = self.spec.block_size
        for slot in range(self.num_slots):
            try:
                n = os.preadv(self._fd, [header], slot * self.slot_size)
            except OSError as e:
                log.warning("disk tier %s: reading slot %d's header failed: %s", self.path, slot, e)
                continue
            if n != self.header_region:
                continue
            page, _ = self._parse_header(header)
            if page is None:
                continue
            if page_hashes(page.parent_hash, page.namespace, page.token_bytes, bs)[0] != page.page_hash:
                continue
            self._pages[slot] = page
        return self.runs()

    def runs(self) -> list[DiskRun]:
        """What the disk holds as prefixes: one DiskRun per chain from a sequence's first page
        (parent hash 0) to a page no held page continues, following parent_hash -> page_hash within
        a namespace. Pages whose chain does not reach a first page are left out; of two slots
        holding the same page, the lower one is used. A shared prefix appears in each run that
        continues it."""
        with self._index_lock:
            held = dict(self._pages)
        kept: dict[tuple[str, int], int] = {}
        for slot in sorted(held):
            page = held[slot]
            kept.setdefault((page.namespace, page.page_hash), slot)
        children: dict[tuple[str, int], list[int]] = {}
        roots: list[int] = []
        for (namespace, _), slot in kept.items():  # slot order (dicts keep insertion order)
            parent = held[slot].parent_hash
            if parent == 0:
                roots.append(slot)
            elif (namespace, parent) in kept:
                children.setdefault((namespace, parent), []).append(slot)
        runs: list[DiskRun] = []
        path: list[int] = []
        seen: set[int] = set()
        stack = [(slot, 0) for slot in reversed(roots)]
        while stack:
            slot, depth = stack.pop()
            if slot in seen:  # a hash cycle: impossible short of a collision, but never loop
                continue
            seen.add(slot)
            del path[depth:]
            path.append(slot)
            page = held[slot]
            below = children.get((page.namespace, page.page_hash))
            if below:
                stack.extend((child, depth + 1) for child in reversed(below))
            else:
                runs.append(DiskRun(page.namespace, b"".join(held[s].token_bytes for s in path), list(path)))
        return runs

    @property
    def num_pages(self) -> int:
        """Slots holding a valid page (as far as the headers tell)."""
        return len(self._pages)

    # ------------------------------------------------------------------ staging

    def _copier_for(self, kv: KVCache) -> PageCopier:
        if kv.spec != self.spec:
            raise ValueError(f"the KV pool's layout {kv.spec} is not the disk tier's {self.spec}")
        if self._copier is None or self._copier.kv is not kv:
            self._copier = PageCopier(kv)
            if self._staging is not None and self._staging.is_pinned() != self._copier.pin:
                self._staging = None
        return self._copier

    def _staging_for(self, copier: PageCopier, num_pages: int) -> tuple[torch.Tensor, np.ndarray]:
        """Page rows to read into / gather into (pinned when the pool is on CUDA), and their
        bytes: room for min(num_pages, a batch) pages, grown on demand and kept."""
        rows = min(max(num_pages, 1), self._staging_rows)
        if self._staging is None or self._staging.shape[0] < rows:
            self._staging = _aligned_rows(rows, self.spec, copier.pin)
        return self._staging, _byte_rows(self._staging)


class _StagingRing:
    """Page rows the async writes are staged in, reused in ring order (no allocation, page fault
    or unmap per write; memory bounded by its size). The writer thread finishes batches in the
    order they were taken, so a batch waits only for the oldest ones whose rows it needs."""

    def __init__(self, num_rows: int, spec: KVCacheSpec, pin: bool) -> None:
        self.num_rows = num_rows
        self.pin = pin
        self._rows = _aligned_rows(num_rows, spec, pin)
        self._rows.view(torch.uint8).zero_()  # touched now, not page by page while serving
        self._head = 0
        self._held: deque[tuple[int, int, Future[int]]] = deque()  # (first row, rows, write), oldest first

    def take(self, n: int) -> tuple[int, torch.Tensor]:
        """n contiguous free rows (n <= num_rows), waiting for the writes that hold them."""
        start = self._head if self._head + n <= self.num_rows else 0
        # Oldest first: done ones go, and any whose rows these are is waited for (with all before it).
        while self._held and (self._held[0][2].done() or any(_overlaps(h, start, n) for h in self._held)):
            self._held.popleft()[2].exception()  # waits; a failure is the write's future's to report
        self._head = start + n
        return start, self._rows[start:start + n]

    def hold(self, start: int, n: int, write: Future[int]) -> None:
        """Rows [start, start + n) are in use until `write` is done."""
        self._held.append((start, n, write))

    def drain(self) -> None:
        while self._held:
            self._held.popleft()[2].exception()


def _overlaps(held: tuple[int, int, Future[int]], start: int, n: int) -> bool:
    return held[0] < start + n and start < held[0] + held[1]


def _leading_written(batches: list[tuple[Future[int], int]]) -> int:
    """Pages written before the first batch that stopped short."""
    written = 0
    for future, pages in batches:
        done = future.result()
        written += done
        if done < pages:
            break
    return written


def _aligned_bytes(n: int) -> np.ndarray:
    """n zero bytes starting at a 4096-aligned address (direct I/O buffers)."""
    raw = np.zeros(n + ALIGN, dtype=np.uint8)
    at = (-raw.ctypes.data) % ALIGN
    return raw[at:at + n]


def _aligned_rows(n: int, spec: KVCacheSpec, pin: bool) -> torch.Tensor:
    """[n, *page_shape] page rows starting at a 4096-aligned address (pinned if `pin`)."""
    nbytes = n * spec.bytes_per_block
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    at = (-raw.data_ptr()) % ALIGN
    return raw[at:at + nbytes].view(spec.dtype).view(n, *page_shape(spec))


def _byte_rows(rows: torch.Tensor) -> np.ndarray:
    """A contiguous [n, ...] tensor as an [n, bytes_per_row] uint8 array over the same memory."""
    return rows.view(torch.uint8).reshape(rows.shape[0], -1).numpy()


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]
        offset += n
