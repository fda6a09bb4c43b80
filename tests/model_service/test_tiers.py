"""KV tiers through real processes (issue 29): a cache manager and tiny-model replicas with a host
tier (--host-cache-gib) and / or a disk tier (--disk-cache-dir), block size 4, pools small enough
that pages leave the device pool.

What each test checks (every output is also compared with transformers' greedy output):
- a page loaded back from the host tier, and from the disk tier, gives the miss run's output, and
  Usage says where every cached token came from (cached_prompt_tokens == device + host + disk);
- many interleaved prompts in a tiny pool with both tiers, under both offload policies, at once:
  a block reused before its page was copied down would load wrong KV later (outputs differ);
  afterwards the pool is whole and no copy failed;
- a replica restarted on its disk directory serves hits from it at once (namespaced);
- a corrupt slot (payload or header) is a miss for that page on, never wrong KV;
- tiers never share a page across namespaces; the disk directory is 0700 and its file 0600;
- a replica SIGKILLed while copies flow: a fresh one on the same directory serves only good pages;
- a durable cache manager (--state-dir) restarted (SIGTERM, then SIGKILL) while the host tier
  holds pages: the replica re-attaches and the next repeat is a host-tier hit.

Pages are pushed down deterministically with the admin Clear RPC (evict policy: the cleared
pages are copied down in the replica's next Step, so one more small request flushes them).
`--max-batch-tokens 32` keeps every forward under the replica's prefill-cost sampling threshold
(model_service/tiers/copier.py), so the cache manager uses its default load costs and always
prefers a tier hit to recomputing: the token counts asserted here are exact.
"""

from __future__ import annotations

import os
import random
import re
import stat
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from model_service.model_loader import LoadedModel
from protos import cache_pb2, cache_pb2_grpc, model_pb2_grpc
from tests.model_service.checks import (
    assert_pool_whole,
    count_lines,
    pool_stats,
    port_of,
    start_cache_on,
    wait_for,
    wait_until_idle,
)
from tests.model_service.generation import Generated, generate, reference_greedy
from tests.services import Running, launch_model, start_model

pytestmark = pytest.mark.replica

BS = 4
MAX_TOKENS = 4
# The tiny Llama's page: 2 layers x (K, V) x 4 tokens x 2 KV heads x head dim 16 x float32.
PAGE_BYTES = 2 * 2 * BS * 2 * 16 * 4
# A disk slot: a 4096-aligned header region, then a 4096-aligned payload (disk_tier.py docstring).
SLOT_BYTES = 4096 + 4096
HEADER_REGION = 4096
# Slot header (disk_tier.py): magic 8s | version u32 | block_size u32 | digest 32s | parent u64 |
# page hash u64 | payload xxh3 u64 | namespace length u16 | namespace 256 bytes | tokens u32 x BS | ...
_FIXED = struct.Struct("<8sII32sQQQH")
TOKENS_AT = _FIXED.size + 256
MAGIC = b"RKVSLOT\x00"
REPLICA_FLAGS = ("--block-size", str(BS), "--num-threads", "1", "--linear-kernels", "torch",
                 "--max-batch-tokens", "32")


class Replica(NamedTuple):
    running: Running
    stub: model_pb2_grpc.ModelServiceStub


def _gib(num_bytes: int) -> str:
    return repr(num_bytes / 2**30)  # exact: a power-of-two divisor


def host_flags(pages: int) -> list[str]:
    return ["--host-cache-gib", _gib(pages * PAGE_BYTES + PAGE_BYTES // 2)]


def disk_flags(directory: Path, slots: int) -> list[str]:
    return ["--disk-cache-dir", str(directory), "--disk-cache-gib", _gib(slots * SLOT_BYTES + SLOT_BYTES // 2)]


@pytest.fixture(scope="module")
def reference(tiny_reference: LoadedModel) -> LoadedModel:
    return tiny_reference


def make_prompt(seed: int, n: int = 41) -> list[int]:
    """Random ids: no two prompts share a page. 41 tokens: 10 whole pages cacheable at admission."""
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(n)]


def cacheable(prompt: list[int]) -> int:
    """Prompt tokens an admission can find cached: whole pages, leaving the last token to compute."""
    return (len(prompt) - 1) // BS * BS


def run(stub: model_pb2_grpc.ModelServiceStub, prompt: list[int], namespace: str = "") -> Generated:
    return generate(stub, prompt, namespace=namespace, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                    timeout=60.0)


def expected(reference: LoadedModel, prompt: list[int]) -> list[int]:
    return reference_greedy(reference, prompt, MAX_TOKENS, ignore_eos=True)


def usage_split(result: Generated) -> tuple[int, int, int]:
    """(device, host, disk) cached tokens; asserts they add up to cached_prompt_tokens."""
    u = result.final.usage
    assert u.cached_prompt_tokens == u.cached_device_tokens + u.cached_host_tokens + u.cached_disk_tokens, u
    return u.cached_device_tokens, u.cached_host_tokens, u.cached_disk_tokens


@contextmanager
def replica(cache_addr: str, tiny_dir: Path, worker: str, *flags: str) -> Iterator[Replica]:
    """A tiny-model replica; stopped with SIGTERM at the end (its disk tier flushed and closed)."""
    running = start_model(cache_addr, "--model", str(tiny_dir), "--worker-id", worker, *REPLICA_FLAGS, *flags)
    try:
        with grpc.insecure_channel(running.addr) as channel:
            yield Replica(running, model_pb2_grpc.ModelServiceStub(channel))
    finally:
        running.process.stop(10.0)


@contextmanager
def cache_stub(addr: str) -> Iterator[cache_pb2_grpc.CacheManagerStub]:
    with grpc.insecure_channel(addr) as channel:
        yield cache_pb2_grpc.CacheManagerStub(channel)


def push_down(cstub: cache_pb2_grpc.CacheManagerStub, worker: str, stub: model_pb2_grpc.ModelServiceStub,
              flush_seed: int) -> cache_pb2.PoolStats:
    """Clear the device pool (evict policy: its pages are copied to the first lower tier), then
    one small request so the copies go out in a Step reply and their outcomes come back in the
    next ones. Returns the pool's stats once idle, the device pool empty of the cleared pages."""
    epoch = wait_until_idle(cstub, worker).epoch
    cleared = cstub.Clear(cache_pb2.ClearRequest(pool_id=worker, epoch=epoch), timeout=10)
    assert cleared.num_evicted_blocks > 0 and cleared.num_locked_blocks == 0, cleared
    # One prompt token and two generated: under a page (caches nothing, evicts nothing), two Steps.
    generate(stub, make_prompt(flush_seed, 1), temperature=0.0, max_tokens=2, ignore_eos=True, timeout=60.0)
    wait_until_idle(cstub, worker)
    # Disk writes finish on the tier's thread, after the Step that ordered them: the replica
    # reports them in a Step of its own once idle.
    wait_for(lambda: _pending_pages(wait_until_idle(cstub, worker)) == 0, 30.0, "the copies down to be reported")
    return wait_until_idle(cstub, worker)


def _pending_pages(stats: cache_pb2.PoolStats) -> int:
    return sum(getattr(stats, t).num_pending_pages for t in ("host_tier", "disk_tier") if stats.HasField(t))


# ---------------------------------------------------------------- round trips


def test_host_tier_round_trip_is_bit_exact(cache_service, tiny_dir, reference) -> None:
    """A prompt's pages go down to the host tier and come back: the same output as the miss run
    and as transformers, every cacheable token from the host tier. (The disk round trip:
    test_disk_round_trip_and_restart_on_the_disk_dir.)"""
    worker = "tiers-round-trip-host"
    prompt = make_prompt(1)
    with replica(cache_service.addr, tiny_dir, worker, "--num-blocks", "24", *host_flags(64)) as r, \
            cache_stub(cache_service.addr) as cstub:
        first = run(r.stub, prompt)
        assert usage_split(first) == (0, 0, 0) and first.final.usage.cached_prompt_tokens == 0
        stats = push_down(cstub, worker, r.stub, 100)
        assert stats.num_cached_blocks == 0, stats
        held = stats.host_tier
        assert held.num_cached_pages >= cacheable(prompt) // BS and held.num_failed_pages == 0, held
        again = run(r.stub, prompt)
        assert usage_split(again) == (0, cacheable(prompt), 0), again.final.usage
        assert again.token_ids == first.token_ids == expected(reference, prompt)
        stats = wait_until_idle(cstub, worker)
        held = stats.host_tier
        assert held.num_loaded_pages == cacheable(prompt) // BS and held.hit_tokens == cacheable(prompt), held
        assert held.num_failed_pages == 0 and not stats.disk_tier.num_slots, stats


# ---------------------------------------------------------------- eviction ordering


def _families() -> list[list[int]]:
    """18 prompts: 6 stems of 4 pages, each with 3 tails of 1-3 pages (shared prefixes)."""
    prompts = []
    for stem_seed in range(6):
        stem = make_prompt(1000 + stem_seed, 16)
        for tail in range(3):
            prompts.append(stem + make_prompt(2000 + stem_seed * 10 + tail, 5 + 4 * tail))
    return prompts


def _drive(stub: model_pb2_grpc.ModelServiceStub, order: list[int], prompts: list[list[int]],
           results: dict[int, list[list[int]]], errors: list[BaseException], threads: int = 4) -> None:
    """Runs prompts[i] for i in `order` from `threads` threads at once; records outputs per index."""
    lock = threading.Lock()
    work = list(order)

    def worker() -> None:
        while True:
            with lock:
                if not work:
                    return
                i = work.pop()
            try:
                out = run(stub, prompts[i]).token_ids
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)
                return
            with lock:
                results.setdefault(i, []).append(out)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)


def test_eviction_ordering_under_concurrent_traffic(cache_service, tiny_dir, reference, tmp_path) -> None:
    """Both policies side by side: a 16-block pool, a 12-page host tier, a 24-slot disk tier, and a
    working set of ~140 pages, four requests at a time, each prompt twice in shuffled order.
    A block handed out again before its page was copied down would put another prompt's KV into
    the tier, and a later load of that page would change the output."""
    prompts = _families()
    want = [expected(reference, p) for p in prompts]
    order = [i for _ in range(2) for i in range(len(prompts))]
    random.Random(5).shuffle(order)
    launched = {policy: launch_model(cache_service.addr, "--model", str(tiny_dir), "--worker-id",
                                     f"tiers-order-{policy}", *REPLICA_FLAGS, "--num-blocks", "16",
                                     "--offload-policy", policy, *host_flags(12),
                                     *disk_flags(tmp_path / f"disk-{policy}", 24))
                for policy in ("evict", "write-through")}
    running: dict[str, Running] = {}
    try:
        running = {policy: launch.wait() for policy, launch in launched.items()}
        results: dict[str, dict[int, list[list[int]]]] = {p: {} for p in running}
        errors: list[BaseException] = []
        with grpc.insecure_channel(running["evict"].addr) as a, \
                grpc.insecure_channel(running["write-through"].addr) as b:
            drivers = [threading.Thread(target=_drive, args=(model_pb2_grpc.ModelServiceStub(ch), order, prompts,
                                                             results[p], errors))
                       for p, ch in (("evict", a), ("write-through", b))]
            for d in drivers:
                d.start()
            for d in drivers:
                d.join(180)
        assert not errors, errors
        with cache_stub(cache_service.addr) as cstub:
            for policy in running:
                for i, outs in results[policy].items():
                    assert outs == [want[i]] * 2, f"{policy}: prompt {i}"
                assert sum(len(v) for v in results[policy].values()) == len(order)
                stats = wait_until_idle(cstub, f"tiers-order-{policy}")
                for tier in (stats.host_tier, stats.disk_tier):
                    assert tier.num_failed_pages == 0, (policy, tier)
                    assert tier.num_offloaded_pages > 0, (policy, tier)
                    assert tier.num_cached_pages + tier.num_pending_pages <= tier.num_slots, (policy, tier)
                assert stats.host_tier.num_evicted_pages > 0, stats.host_tier  # host pages went on to disk
                assert stats.host_tier.hit_tokens + stats.disk_tier.hit_tokens > 0, (policy, stats)
    finally:
        for r in running.values():
            r.process.stop(10.0)
        for policy, launch in launched.items():
            if policy not in running:
                launch.process.stop(5.0)


# ---------------------------------------------------------------- disk: restart, corruption


def test_disk_round_trip_and_restart_on_the_disk_dir(cache_service, tiny_dir, reference, tmp_path) -> None:
    """A disk-only replica: a prompt's pages go down to disk and load back bit-exact. Stopped
    (SIGTERM) and started again on its directory, the replica's first request of that prompt is
    a disk hit with the same output; the same tokens in another namespace are not."""
    worker, disk = "tiers-restart", tmp_path / "disk"
    flags = ("--num-blocks", "24", *disk_flags(disk, 32))
    prompt = make_prompt(2)
    with replica(cache_service.addr, tiny_dir, worker, *flags) as r, cache_stub(cache_service.addr) as cstub:
        first = run(r.stub, prompt)
        assert usage_split(first) == (0, 0, 0)
        stats = push_down(cstub, worker, r.stub, 101)
        assert stats.num_cached_blocks == 0 and stats.disk_tier.num_cached_pages >= cacheable(prompt) // BS, stats
        loaded = run(r.stub, prompt)
        assert usage_split(loaded) == (0, 0, cacheable(prompt)), loaded.final.usage
        assert loaded.token_ids == first.token_ids == expected(reference, prompt)
        stats = wait_until_idle(cstub, worker).disk_tier
        assert stats.num_loaded_pages == cacheable(prompt) // BS and stats.hit_tokens == cacheable(prompt), stats
        assert stats.num_failed_pages == 0, stats
    with replica(cache_service.addr, tiny_dir, worker, *flags) as r, cache_stub(cache_service.addr) as cstub:
        (held,) = [int(m.group(1)) for line in r.running.log
                   if (m := re.search(r"\((\d+) held from an earlier run", line))]
        assert held >= cacheable(prompt) // BS, r.running.output()  # the file's valid pages, scanned
        intruder = run(r.stub, prompt, namespace="intruder")
        assert usage_split(intruder) == (0, 0, 0)  # a disk page is its namespace's only
        stats = wait_until_idle(cstub, worker)
        assert stats.disk_tier.num_cached_pages >= cacheable(prompt) // BS, stats.disk_tier  # announced
        again = run(r.stub, prompt)
        assert usage_split(again) == (0, 0, cacheable(prompt)), again.final.usage
        assert again.token_ids == intruder.token_ids == first.token_ids
        assert wait_until_idle(cstub, worker).disk_tier.num_failed_pages == 0


def _slots_of(path: Path, prompt: list[int]) -> list[int]:
    """The slot holding each whole page of `prompt` in a disk tier file (read from the headers)."""
    data = path.read_bytes()
    by_tokens: dict[bytes, int] = {}
    for slot in range(len(data) // SLOT_BYTES):
        at = slot * SLOT_BYTES
        if data[at:at + 8] != MAGIC:
            continue
        tokens = data[at + TOKENS_AT: at + TOKENS_AT + 4 * BS]
        by_tokens.setdefault(tokens, slot)
    pages = [struct.pack(f"<{BS}I", *prompt[i:i + BS]) for i in range(0, cacheable(prompt), BS)]
    return [by_tokens[p] for p in pages if p in by_tokens]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_disk_slot_is_a_miss(cache_service, tiny_dir, reference, tmp_path) -> None:
    """After a stop, one page's payload is flipped (found at load: the payload checksum) and
    another prompt's first header (found at start: the header checksum). Restarted, the first
    prompt loads only the pages before the bad one and computes the rest; the second is a miss;
    both outputs are the reference."""
    worker, disk = "tiers-corrupt", tmp_path / "disk"
    flags = ("--num-blocks", "24", *disk_flags(disk, 32))
    p, q = make_prompt(3), make_prompt(4)
    with replica(cache_service.addr, tiny_dir, worker, *flags) as r, cache_stub(cache_service.addr) as cstub:
        first = [run(r.stub, p).token_ids, run(r.stub, q).token_ids]
        assert push_down(cstub, worker, r.stub, 102).disk_tier.num_cached_pages >= 2 * cacheable(p) // BS
    (path,) = disk.glob("kv-*.slots")
    p_slots, q_slots = _slots_of(path, p), _slots_of(path, q)
    assert len(p_slots) == len(q_slots) == cacheable(p) // BS, (p_slots, q_slots)
    bad_page = 2
    _flip(path, p_slots[bad_page] * SLOT_BYTES + HEADER_REGION + 100)  # K of layer 0
    _flip(path, q_slots[0] * SLOT_BYTES + TOKENS_AT)  # a token id in the header
    with replica(cache_service.addr, tiny_dir, worker, *flags) as r, cache_stub(cache_service.addr) as cstub:
        again_p, again_q = run(r.stub, p), run(r.stub, q)
        assert usage_split(again_p) == (0, 0, bad_page * BS), again_p.final.usage
        assert usage_split(again_q) == (0, 0, 0), again_q.final.usage
        assert [again_p.token_ids, again_q.token_ids] == first == [expected(reference, p), expected(reference, q)]
        stats = wait_until_idle(cstub, worker)
        # p's load was ordered for every page the file announced and stopped at the bad one.
        assert stats.disk_tier.num_failed_pages == cacheable(p) // BS - bad_page, stats.disk_tier
        assert count_lines(r.running, "fails its payload checksum") == 1


# ---------------------------------------------------------------- namespaces and files


def test_tiers_never_share_a_page_across_namespaces(cache_service, tiny_dir, reference, tmp_path) -> None:
    worker, disk = "tiers-namespaces", tmp_path / "disk"
    prompt = make_prompt(5)
    with replica(cache_service.addr, tiny_dir, worker, "--num-blocks", "24", *host_flags(64),
                 *disk_flags(disk, 32)) as r, cache_stub(cache_service.addr) as cstub:
        a = run(r.stub, prompt, namespace="tenant-a")
        assert push_down(cstub, worker, r.stub, 103).host_tier.num_cached_pages >= cacheable(prompt) // BS
        b = run(r.stub, prompt, namespace="tenant-b")
        assert usage_split(b) == (0, 0, 0), b.final.usage
        a_again = run(r.stub, prompt, namespace="tenant-a")
        assert usage_split(a_again) == (0, cacheable(prompt), 0), a_again.final.usage
        assert a.token_ids == b.token_ids == a_again.token_ids == expected(reference, prompt)
        (path,) = disk.glob("kv-*.slots")
        assert stat.S_IMODE(os.stat(disk).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


# ---------------------------------------------------------------- failures


def test_replica_sigkilled_mid_offload(cache_service, tiny_dir, reference, tmp_path) -> None:
    """Write-through to a disk-only tier keeps copies flowing; kill -9 with requests in flight. A
    fresh replica on the same directory serves what the file holds and nothing torn."""
    worker, disk = "tiers-sigkill", tmp_path / "disk"
    flags = ("--num-blocks", "16", "--offload-policy", "write-through", *disk_flags(disk, 48))
    prompts = _families()
    want = [expected(reference, p) for p in prompts]
    order = list(range(len(prompts))) * 3
    random.Random(6).shuffle(order)
    first = start_model(cache_service.addr, "--model", str(tiny_dir), "--worker-id", worker, *REPLICA_FLAGS, *flags)
    try:
        results: dict[int, list[list[int]]] = {}
        errors: list[BaseException] = []
        with grpc.insecure_channel(first.addr) as channel:
            driver = threading.Thread(target=_drive, args=(model_pb2_grpc.ModelServiceStub(channel), order, prompts,
                                                           results, errors))
            driver.start()
            wait_for(lambda: sum(len(v) for v in results.values()) >= 12, 60, "12 requests done")
            first.process.proc.kill()  # SIGKILL, copies in flight
            driver.join(60)
        assert errors, "the kill came after the last request"
        for i, outs in results.items():
            assert all(out == want[i] for out in outs)
    finally:
        first.process.stop(5.0)
    with replica(cache_service.addr, tiny_dir, worker, *flags) as r, cache_stub(cache_service.addr) as cstub:
        disk_tokens = 0
        for i, p in enumerate(prompts):
            out = run(r.stub, p)
            assert out.token_ids == want[i], f"prompt {i}"
            disk_tokens += usage_split(out)[2]
        assert disk_tokens > 0, "nothing the killed replica wrote was served"
        stats = wait_until_idle(cstub, worker)
        assert_pool_whole(stats)
        assert stats.disk_tier.num_cached_pages + stats.disk_tier.num_pending_pages <= stats.disk_tier.num_slots


def test_durable_cache_manager_restart_keeps_tier_residency(tiny_dir, reference, tmp_path) -> None:
    """Pages in the host tier, the cache manager (--state-dir) restarted, first with SIGTERM, then
    with SIGKILL: each time the replica re-attaches to its kept pool (same incarnation) and a
    repeat prompt loads from the host tier."""
    state_dir = str(tmp_path / "state")
    worker = "tiers-durable"
    cache = start_cache_on(0, "--state-dir", state_dir)
    port = port_of(cache.addr)
    prompt = make_prompt(7)
    try:
        with replica(cache.addr, tiny_dir, worker, "--num-blocks", "24", *host_flags(64)) as r:
            first = run(r.stub, prompt)
            for n, kill in enumerate((False, True), start=1):
                with cache_stub(cache.addr) as cstub:
                    before = push_down(cstub, worker, r.stub, 104 + n)
                assert before.host_tier.num_cached_pages >= cacheable(prompt) // BS, before.host_tier
                assert before.num_cached_blocks == 0, before
                if kill:
                    cache.process.proc.kill()
                cache.process.stop(5.0)
                cache = start_cache_on(port, "--state-dir", state_dir)
                with cache_stub(cache.addr) as cstub:
                    restored = pool_stats(cstub, worker)
                    assert restored.restored
                    assert restored.host_tier == before.host_tier, restored.host_tier
                    again = run(r.stub, prompt)
                    assert usage_split(again) == (0, cacheable(prompt), 0), again.final.usage
                    assert again.token_ids == first.token_ids == expected(reference, prompt)
                    assert count_lines(r.running, "re-attached to the kept pool") == n, r.running.output()
                    assert count_lines(r.running, "new cache pool") == 0
                    stats = wait_until_idle(cstub, worker)
                    assert stats.host_tier.num_failed_pages == 0
                    assert stats.host_tier.num_loaded_pages == before.host_tier.num_loaded_pages + cacheable(prompt) // BS
    finally:
        cache.process.stop(5.0)
