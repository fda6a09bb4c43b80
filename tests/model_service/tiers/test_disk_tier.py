"""DiskTier: a preallocated private slot file; bit-exact round trips, torn or corrupt slots are
misses (their block is never written), restart from the directory re-announces the runs."""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.token_bytes import encode_tokens
from model_service.kv_cache import KVCache, KVCacheSpec
from model_service.tiers import disk_tier
from model_service.tiers.disk_tier import MAGIC, DiskRun, DiskTier, PageInfo, file_name
from model_service.tiers.host_tier import HostTier
from tests.model_service.tiers.kv_fixtures import (
    block_bytes,
    pool_bytes,
    random_kv,
    sequence_pages,
    small_spec,
)

DTYPES = [torch.float32, torch.bfloat16]
FP = "model-a"
SpecFor = Callable[[torch.dtype], KVCacheSpec]


def aligned_spec(dtype: torch.dtype) -> KVCacheSpec:
    """Pages of a 4096-byte multiple (float32 and bfloat16): the tier uses direct I/O."""
    return KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=4, dtype=dtype)


def takes_direct_io(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    probe.unlink()
    return True


@pytest.fixture(params=["buffered", "direct"])
def spec_for(request: pytest.FixtureRequest, tmp_path: Path) -> SpecFor:
    """Every test runs on pages the tier writes with buffered I/O (their size is not a multiple
    of 4096 bytes) and on pages it writes with direct I/O."""
    if request.param == "direct" and not takes_direct_io(tmp_path):
        pytest.skip("the temporary directory's file system refuses O_DIRECT")
    return small_spec if request.param == "buffered" else aligned_spec


def open_tier(directory: Path, spec: KVCacheSpec, num_slots: int = 8, fingerprint: str = FP) -> DiskTier:
    tier = DiskTier.open(str(directory), spec, fingerprint, num_slots * DiskTier.slot_size_for(spec))
    assert tier.direct == (spec.bytes_per_block % 4096 == 0), "direct I/O exactly where pages align"
    return tier


def expected(pages: list[PageInfo]) -> list[tuple[str, int]]:
    return [(p.namespace, p.page_hash) for p in pages]


def payload_offset(tier: DiskTier, slot: int) -> int:
    return slot * tier.slot_size + tier.header_region


def poke(tier: DiskTier, offset: int, data: bytes) -> None:
    """Write into the slot file behind the tier's back (another descriptor), as a crash or bit rot would."""
    fd = os.open(tier.path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_disk_device_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype, spec_for: SpecFor) -> None:
    spec = spec_for(dtype)
    src = random_kv(spec, 8, seed=1)
    pages = sequence_pages("ns", list(range(100, 112)))  # 3 pages
    with open_tier(tmp_path / "d", spec) as tier:
        assert tier.write_from_device(src, [5, 0, 7], [3, 6, 1], pages) == 3
        dst = random_kv(spec, 8, seed=2)
        before = pool_bytes(dst)
        assert tier.load_to_device(dst, [3, 6, 1], [2, 4, 6], expected(pages)) == 3
        for s, d in [(5, 2), (0, 4), (7, 6)]:
            assert block_bytes(dst, d) == block_bytes(src, s)
        after = pool_bytes(dst)
        assert [after[b] for b in (0, 1, 3, 5, 7)] == [before[b] for b in (0, 1, 3, 5, 7)]
        assert tier.runs() == [DiskRun("ns", encode_tokens(list(range(100, 112))), [3, 6, 1])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_disk_device_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype, spec_for: SpecFor) -> None:
    spec = spec_for(dtype)
    src = random_kv(spec, 6, seed=3)
    host = HostTier(spec, 4, pin_memory=False)
    host.store(src, [4, 1], [2, 0])
    pages = sequence_pages("ns", list(range(8)))
    with open_tier(tmp_path / "d", spec) as tier:
        assert tier.write_from_host(host, [2, 0], [0, 5], pages) == 2
        dst = random_kv(spec, 6, seed=4)
        assert tier.load_to_device(dst, [0, 5], [3, 0], expected(pages)) == 2
        assert block_bytes(dst, 3) == block_bytes(src, 4)
        assert block_bytes(dst, 0) == block_bytes(src, 1)


def test_file_is_0600_in_a_0700_directory_named_by_the_layout(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    directory = tmp_path / "d"
    directory.mkdir(mode=0o755)
    old = os.umask(0o022)
    try:
        tier = open_tier(directory, spec, num_slots=5)
    finally:
        os.umask(old)
    with tier:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tier.path).st_mode) == 0o600
        assert os.path.basename(tier.path) == file_name(spec, FP)
        assert len(file_name(spec, FP)) == len("kv-") + 16 + len(".slots")
        assert os.path.getsize(tier.path) == 5 * tier.slot_size
        assert tier.slot_size % 4096 == 0 and tier.header_region % 4096 == 0
        assert file_name(spec, FP) != file_name(spec_for(torch.bfloat16), FP) != file_name(spec, "model-b")


def test_a_corrupt_payload_byte_is_a_miss_and_its_block_is_never_written(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=5)
    pages = sequence_pages("ns", list(range(12)))
    with open_tier(tmp_path / "d", spec) as tier:
        assert tier.write_from_device(src, [0, 1, 2], [0, 1, 2], pages) == 3
        offset = payload_offset(tier, 1) + 17
        with open(tier.path, "rb") as f:
            f.seek(offset)
            byte = f.read(1)[0]
        poke(tier, offset, bytes([byte ^ 0x01]))
        dst = random_kv(spec, 4, seed=6)
        before = pool_bytes(dst)
        assert tier.load_to_device(dst, [0, 1, 2], [3, 2, 1], expected(pages)) == 1
        assert block_bytes(dst, 3) == block_bytes(src, 0)
        after = pool_bytes(dst)
        assert after[:3] == before[:3]  # neither the corrupt page's block nor the one after it
        assert tier.load_to_device(dst, [1], [2], expected(pages[1:2])) == 0
        assert pool_bytes(dst)[:3] == before[:3]
        # the corrupt slot left the index: only the first page is still a run
        assert tier.runs() == [DiskRun("ns", pages[0].token_bytes, [0])]


def test_a_corrupt_header_is_dropped_by_scan(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=7)
    pages = sequence_pages("ns", list(range(8)))
    with open_tier(tmp_path / "d", spec) as tier:
        tier.write_from_device(src, [0, 1], [0, 1], pages)
        poke(tier, 1 * tier.slot_size + 100, b"\xff")  # a namespace/token byte: header checksum fails
        assert tier.scan() == [DiskRun("ns", pages[0].token_bytes, [0])]
        assert tier.load_to_device(random_kv(spec, 4, seed=8), [1], [0], expected(pages[1:])) == 0


def test_torn_writes_are_misses(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.bfloat16)
    src = random_kv(spec, 4, seed=9)
    pages = sequence_pages("ns", list(range(8)))
    half = spec.bytes_per_block // 2
    with open_tier(tmp_path / "d", spec) as tier:
        assert tier.write_from_device(src, [0, 1], [0, 1], pages) == 2
        # a crash after the header was invalidated and half the new payload written
        poke(tier, 0, bytes(len(MAGIC)))
        poke(tier, payload_offset(tier, 0), b"\x5a" * half)
        # power failure: the old header reached the disk, half of a new payload too
        poke(tier, payload_offset(tier, 1), b"\xa5" * half)
        dst = random_kv(spec, 4, seed=10)
        before = pool_bytes(dst)
        assert tier.load_to_device(dst, [0], [2], expected(pages[:1])) == 0
        assert tier.load_to_device(dst, [1], [3], expected(pages[1:])) == 0
        assert pool_bytes(dst) == before
        assert tier.scan() == []  # slot 0 invalid; slot 1 (header intact) is an orphan now
        # the slots are reusable: a rewrite makes them valid again
        assert tier.write_from_device(src, [0, 1], [0, 1], pages) == 2
        assert tier.load_to_device(dst, [0, 1], [2, 3], expected(pages)) == 2
        assert block_bytes(dst, 2) == block_bytes(src, 0) and block_bytes(dst, 3) == block_bytes(src, 1)


def test_a_different_expected_page_is_a_miss(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=11)
    pages = sequence_pages("ns", list(range(8)))
    other = sequence_pages("ns", list(range(1, 9)))
    with open_tier(tmp_path / "d", spec) as tier:
        tier.write_from_device(src, [0, 1], [4, 5], pages)
        dst = random_kv(spec, 4, seed=12)
        before = pool_bytes(dst)
        assert tier.load_to_device(dst, [4, 5], [0, 1], [expected(pages)[0], expected(other)[1]]) == 1
        assert pool_bytes(dst)[1:] == before[1:]
        assert tier.load_to_device(dst, [4], [2], [("other-ns", pages[0].page_hash)]) == 0
        assert tier.load_to_device(dst, [3], [2], expected(pages[:1])) == 0  # a never-written slot
        assert pool_bytes(dst)[1:] == before[1:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reopen_announces_the_runs_and_loads_bit_exact(tmp_path: Path, dtype: torch.dtype, spec_for: SpecFor) -> None:
    spec = spec_for(dtype)
    src = random_kv(spec, 8, seed=13)
    shared = list(range(50, 54))
    a = sequence_pages("ns", shared + list(range(10, 18)))          # 3 pages
    b = sequence_pages("ns", shared + list(range(20, 24)))          # shares a's first page
    c = sequence_pages("other", list(range(30, 34)))
    with open_tier(tmp_path / "d", spec, num_slots=10) as tier:
        assert tier.write_from_device(src, [0, 1, 2], [7, 2, 9], a) == 3
        assert tier.write_from_device(src, [3], [4], b[1:]) == 1
        assert tier.write_from_device(src, [4], [0], c) == 1
        written = tier.runs()
    want = [DiskRun("other", c[0].token_bytes, [0]),
            DiskRun("ns", encode_tokens(shared + list(range(10, 18))), [7, 2, 9]),
            DiskRun("ns", encode_tokens(shared + list(range(20, 24))), [7, 4])]
    key = lambda r: (r.namespace, r.token_bytes)  # noqa: E731
    assert sorted(written, key=key) == sorted(want, key=key)
    with open_tier(tmp_path / "d", spec, num_slots=10) as tier:
        assert sorted(tier.runs(), key=key) == sorted(want, key=key)
        dst = KVCache(spec, 8, torch.device("cpu"))
        assert tier.load_to_device(dst, [7, 4], [5, 6], expected(b)) == 2
        assert tier.load_to_device(dst, [0], [7], expected(c)) == 1
        assert block_bytes(dst, 5) == block_bytes(src, 0)
        assert block_bytes(dst, 6) == block_bytes(src, 3)
        assert block_bytes(dst, 7) == block_bytes(src, 4)


def test_namespaces_never_mix(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=14)
    tokens = list(range(8))
    a, b = sequence_pages("tenant-a", tokens), sequence_pages("tenant-b", tokens)
    with open_tier(tmp_path / "d", spec) as tier:
        tier.write_from_device(src, [0, 1], [0, 1], a)
        tier.write_from_device(src, [2, 3], [2, 3], b)
        assert tier.runs() == [DiskRun("tenant-a", encode_tokens(tokens), [0, 1]),
                               DiskRun("tenant-b", encode_tokens(tokens), [2, 3])]
        # b's chain can't continue a's pages even when the slots are handed over mixed
        mixed = [a[0], b[1]._replace(parent_hash=a[0].page_hash)]
        with pytest.raises(ValueError):
            tier.write_from_device(src, [0, 1], [4, 5], mixed)
        dst = random_kv(spec, 4, seed=15)
        before = pool_bytes(dst)
        assert tier.load_to_device(dst, [0], [0], expected(b[:1])) == 0
        assert pool_bytes(dst) == before
        assert tier.scan() == tier.runs()


def test_orphans_are_dropped_until_their_chain_is_whole(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=16)
    pages = sequence_pages("ns", list(range(12)))
    with open_tier(tmp_path / "d", spec) as tier:
        tier.write_from_device(src, [1, 2], [1, 2], pages[1:])
        assert tier.runs() == [] and tier.scan() == [] and tier.num_pages == 2
        tier.write_from_device(src, [0], [5], pages[:1])
        assert tier.runs() == [DiskRun("ns", encode_tokens(list(range(12))), [5, 1, 2])]
        # overwriting the middle page's slot with another page orphans the tail
        other = sequence_pages("ns", list(range(100, 104)))
        tier.write_from_device(src, [3], [1], other)
        assert sorted(tier.runs(), key=lambda r: r.slots) == [
            DiskRun("ns", encode_tokens(list(range(100, 104))), [1]),
            DiskRun("ns", pages[0].token_bytes, [5])]
        assert tier.scan() == tier.runs()


def test_a_page_held_twice_is_announced_once(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=17)
    pages = sequence_pages("ns", list(range(8)))
    with open_tier(tmp_path / "d", spec) as tier:
        tier.write_from_device(src, [0, 1], [3, 4], pages)
        tier.write_from_device(src, [0], [1], pages[:1])
        assert tier.runs() == [DiskRun("ns", encode_tokens(list(range(8))), [1, 4])]


def test_another_fingerprint_or_layout_sees_nothing(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    pages = sequence_pages("ns", list(range(8)))
    with open_tier(tmp_path / "d", spec) as tier:
        tier.write_from_device(random_kv(spec, 2, seed=18), [0, 1], [0, 1], pages)
        path_a = tier.path
    with open_tier(tmp_path / "d", spec, fingerprint="model-b") as tier:
        assert tier.path != path_a and tier.runs() == []
        path_b = tier.path
    with open_tier(tmp_path / "d", spec_for(torch.bfloat16)) as tier:
        assert tier.runs() == []
    # the file itself under the other model's name: every header names model-a's layout
    os.replace(path_a, path_b)
    with open_tier(tmp_path / "d", spec, fingerprint="model-b") as tier:
        assert tier.runs() == [] and tier.num_pages == 0
        assert tier.load_to_device(random_kv(spec, 2, seed=19), [0], [0], expected(pages[:1])) == 0


def test_the_directory_and_file_are_refused_when_not_ours(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / "notes.txt").write_text("someone else's")
    with pytest.raises(OSError, match="not this server's"):
        open_tier(directory, spec)
    os.unlink(directory / "notes.txt")
    with open_tier(directory, spec):
        with pytest.raises(OSError, match="in use"):
            open_tier(directory, spec)
    with pytest.raises(ValueError, match="less than one slot"):
        DiskTier.open(str(directory), spec, FP, DiskTier.slot_size_for(spec) - 1)


def test_resize_keeps_the_slots_that_still_fit(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    pages = sequence_pages("ns", list(range(8)))
    with open_tier(tmp_path / "d", spec, num_slots=8) as tier:
        tier.write_from_device(random_kv(spec, 2, seed=20), [0, 1], [1, 6], pages)
    with open_tier(tmp_path / "d", spec, num_slots=4) as tier:
        assert os.path.getsize(tier.path) == 4 * tier.slot_size
        assert tier.runs() == [DiskRun("ns", pages[0].token_bytes, [1])]
    with open_tier(tmp_path / "d", spec, num_slots=16) as tier:
        assert tier.num_slots == 16 and tier.runs() == [DiskRun("ns", pages[0].token_bytes, [1])]


def test_bad_writes_are_refused_whole(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=21)
    pages = sequence_pages("ns", list(range(8)))
    bad_hash = [pages[0], pages[1]._replace(page_hash=pages[1].page_hash ^ 1)]
    short_tokens = [pages[0]._replace(token_bytes=pages[0].token_bytes[:-4])]
    long_ns = [pages[0]._replace(namespace="n" * 257)]
    with open_tier(tmp_path / "d", spec) as tier:
        for blocks, slots, ps in [([0, 1], [0, 1], bad_hash), ([0], [0], short_tokens), ([0], [0], long_ns),
                                  ([0, 1], [0, 0], pages), ([0, 1], [0, 8], pages), ([0], [0, 1], pages),
                                  ([0, 9], [0, 1], pages)]:
            with pytest.raises(ValueError):
                tier.write_from_device(src, blocks, slots, ps)
        assert tier.num_pages == 0 and tier.scan() == []
        with pytest.raises(ValueError):
            tier.load_to_device(src, [0, 1], [2, 2], expected(pages))


def test_a_failing_write_returns_the_pages_written_before_it(tmp_path: Path, caplog: pytest.LogCaptureFixture, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=22)
    pages = sequence_pages("ns", list(range(8)))
    with open_tier(tmp_path / "d", spec) as tier:
        good_fd = tier._fd
        tier._fd = os.open(tier.path, os.O_RDONLY)  # every pwrite now fails (EBADF)
        try:
            with caplog.at_level(logging.WARNING):
                assert tier.write_from_device(src, [0, 1], [0, 1], pages) == 0
            assert "writing slot 0 failed" in caplog.text
        finally:
            os.close(tier._fd)
            tier._fd = good_fd
        assert tier.runs() == []


def test_a_write_cut_short_leaves_the_slot_empty_not_the_old_page(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=23)
    old, new = sequence_pages("ns", list(range(4))), sequence_pages("ns", list(range(4, 8)))
    real = disk_tier._pwrite_all

    def tearing(fd: int, data: bytes | memoryview, offset: int) -> None:
        if len(data) == spec.bytes_per_block:  # the payload: half of it reaches the file
            real(fd, memoryview(data)[:len(data) // 2], offset)
            raise OSError(28, "No space left on device")
        real(fd, data, offset)

    with open_tier(tmp_path / "d", spec) as tier:
        assert tier.write_from_device(src, [0], [2], old) == 1
        monkeypatch.setattr(disk_tier, "_pwrite_all", tearing)
        assert tier.write_from_device(src, [1], [2], new) == 0
        monkeypatch.undo()
        assert tier.runs() == [] and tier.scan() == []  # neither page is announced
        assert tier.load_to_device(random_kv(spec, 4, seed=24), [2], [0], expected(old)) == 0


def test_scan_drops_a_page_whose_hash_is_not_its_tokens(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 4, seed=25)
    pages = sequence_pages("ns", list(range(8)))
    with open_tier(tmp_path / "d", spec) as tier:
        tier.write_from_device(src, [0, 1], [0, 1], pages)
        # a well-formed header (checksums fine) whose page hash lies about its tokens
        liar = pages[1]._replace(token_bytes=encode_tokens([9, 9, 9, 9]))
        staging, rows = tier._staging_for(tier._copier_for(src), 1)
        tier._write_slot(1, liar, rows[0])  # (any payload: scan reads headers only)
        assert tier.scan() == [DiskRun("ns", pages[0].token_bytes, [0])]



def test_batches_larger_than_the_staging_buffer(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.bfloat16)
    src = random_kv(spec, 8, seed=26)
    pages = sequence_pages("ns", list(range(20)))  # 5 pages through a 2-page staging buffer
    with open_tier(tmp_path / "d", spec) as tier:
        tier._staging_rows = 2
        assert tier.write_from_device(src, [7, 6, 5, 4, 3], [0, 1, 2, 3, 4], pages) == 5
        dst = random_kv(spec, 8, seed=27)
        assert tier.load_to_device(dst, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], expected(pages)) == 5
        assert [block_bytes(dst, b) for b in range(5)] == [block_bytes(src, 7 - b) for b in range(5)]
        poke(tier, payload_offset(tier, 3), b"\x00\x01")  # the second page of the second batch
        dst2 = random_kv(spec, 8, seed=28)
        before = pool_bytes(dst2)
        assert tier.load_to_device(dst2, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], expected(pages)) == 3
        assert [block_bytes(dst2, b) for b in range(3)] == [block_bytes(src, 7 - b) for b in range(3)]
        assert pool_bytes(dst2)[3:] == before[3:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_async_writes_read_their_source_at_once_and_land_bit_exact(tmp_path: Path, dtype: torch.dtype, spec_for: SpecFor) -> None:
    """The blocks (and host slots) are read before the async write returns: overwriting them right
    after does not change what reaches the file."""
    spec = spec_for(dtype)
    src = random_kv(spec, 8, seed=1)
    want = [block_bytes(src, b) for b in (5, 0, 7)]
    host = HostTier(spec, 4, pin_memory=False)
    host.store(src, [2, 3], [0, 1])
    host_want = [block_bytes(src, b) for b in (2, 3)]
    pages = sequence_pages("ns", list(range(100, 120)))  # 5 pages
    with open_tier(tmp_path / "d", spec) as tier:
        device_write = tier.write_from_device_async(src, [5, 0, 7], [3, 6, 1], pages[:3])
        host_write = tier.write_from_host_async(host, [0, 1], [2, 4], pages[3:])
        for layer in range(spec.num_layers):  # the pool and the host tier are written again at once
            src.k[layer].zero_()
            src.v[layer].zero_()
        host.data.zero_()
        assert device_write.result() == 3 and host_write.result() == 2
        assert [r.slots for r in tier.runs()] == [[3, 6, 1, 2, 4]]
        dst = random_kv(spec, 8, seed=2)
        assert tier.load_to_device(dst, [3, 6, 1, 2, 4], [0, 1, 2, 3, 4], expected(pages)) == 5
        assert [block_bytes(dst, b) for b in range(5)] == want + host_want


def test_a_write_larger_than_a_staging_batch_is_staged_batch_by_batch(tmp_path: Path, spec_for: SpecFor) -> None:
    spec = spec_for(torch.float32)
    src = random_kv(spec, 8, seed=3)
    pages = sequence_pages("ns", list(range(100, 120)))  # 5 pages
    with open_tier(tmp_path / "d", spec) as tier:
        tier._staging_rows = 2  # 3 batches: 2 + 2 + 1
        assert tier.write_from_device(src, [4, 3, 2, 1, 0], [0, 1, 2, 3, 4], pages) == 5
        dst = random_kv(spec, 8, seed=4)
        assert tier.load_to_device(dst, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], expected(pages)) == 5
        assert [block_bytes(dst, b) for b in range(5)] == [block_bytes(src, b) for b in (4, 3, 2, 1, 0)]


@pytest.mark.parametrize("refused", ["write", "read"])
def test_a_device_refusing_direct_io_turns_the_tier_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             refused: str) -> None:
    """An aligned direct transfer the device still refuses (EINVAL) is done again buffered, and the
    tier stays buffered: nothing is lost, pages round-trip bit-exact."""
    if not takes_direct_io(tmp_path):
        pytest.skip("the temporary directory's file system refuses O_DIRECT")
    spec = aligned_spec(torch.float32)
    src = random_kv(spec, 4, seed=40)
    pages = sequence_pages("ns", list(range(8)))
    calls = {"n": 0}

    def refusing(real):
        def call(*args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(*args)
        return call

    with open_tier(tmp_path / "d", spec) as tier:
        if refused == "write":
            monkeypatch.setattr(disk_tier, "_pwrite_all", refusing(disk_tier._pwrite_all))
        else:
            assert tier.write_from_device(src, [0, 1], [0, 1], pages) == 2
            monkeypatch.setattr(disk_tier.os, "preadv", refusing(os.preadv))
        assert tier.write_from_device(src, [0, 1], [0, 1], pages) == 2
        dst = random_kv(spec, 4, seed=41)
        assert tier.load_to_device(dst, [0, 1], [2, 3], expected(pages)) == 2
        assert not tier.direct and calls["n"] >= 2
        assert block_bytes(dst, 2) == block_bytes(src, 0) and block_bytes(dst, 3) == block_bytes(src, 1)
