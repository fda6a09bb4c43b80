"""SGLang's Rust radix tree as the peer of cache_bench's tree trace (issue 32).

SGLang 0.5.23's UnifiedRadixCache keeps its tree in a Rust TreeCore, a PyO3 extension
(`sglang/srt/mem_cache/rust_tree_core/mem_cache*.so`) that needs torch and nothing else of
sglang. The wheel is downloaded once without its dependencies into the bench's own cache
(~/.cache/radixkv/peers, or $RADIXKV_PEERS_DIR), and only that extension is loaded: sglang is
never a dependency of radixkv.

The driver calls the extension as UnifiedRadixCache calls it for a full-attention model
(rust_tree_core/adapter.py, unified_radix_cache.py): match_prefix and the matched path's device
indices, inc_lock_ref, the eviction walk (evict_device_start / next_node / leaf / end) when the
allocator is short, insert, freeing the indices the tree already held, dec_lock_ref with the lock's
receipt. The allocator is SGLang's paged one in miniature (PagedTokenToKVPoolAllocator: a tensor
of free page ids, token indices page * page_size + offset). Without UnifiedRadixCache's Python
layer (its actions, components and events) the peer only gets faster, so a ratio against it is a
lower bound on the ratio against SGLang's cache.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import zipfile
from array import array
from pathlib import Path
from types import ModuleType

from testing.tree_trace import summarize

SGLANG_VERSION = "0.5.23"
PEERS_DIR = Path(os.environ.get("RADIXKV_PEERS_DIR") or Path.home() / ".cache" / "radixkv" / "peers")
_MEMBER = "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-311-x86_64-linux-gnu.so"
FULL = 0  # sglang ComponentType.FULL: the full-attention KV


def _extension_path() -> Path:
    """The extension's file, downloading and unpacking the wheel on first use."""
    folder = PEERS_DIR / f"sglang-{SGLANG_VERSION}"
    target = folder / "mem_cache.cpython-311-x86_64-linux-gnu.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                    "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
                    f"sglang=={SGLANG_VERSION}", "-d", str(folder), "-q"],
                   check=True, timeout=900, capture_output=True)
    (wheel,) = folder.glob(f"sglang-{SGLANG_VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        target.write_bytes(archive.read(_MEMBER))
    wheel.unlink()  # ~the whole of sglang; only the extension is kept
    return target


def load_sglang_tree() -> ModuleType | str:
    """The extension module, or why it cannot be had here (no network, another platform)."""
    if sys.version_info[:2] != (3, 11) or sys.platform != "linux":
        return f"the sglang {SGLANG_VERSION} extension is built for CPython 3.11 on x86-64 Linux only"
    try:
        import torch  # noqa: F401 - its libraries must be resident before the extension loads
        path = _extension_path()
        spec = importlib.util.spec_from_file_location("mem_cache", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, subprocess.SubprocessError, ImportError, ValueError, KeyError) as e:
        detail = getattr(e, "stderr", b"") or b""
        return f"sglang {SGLANG_VERSION}'s tree extension is unavailable: {e} {detail.decode(errors='replace')[-300:]}"
    return module


class PagedAllocator:
    """SGLang's paged token-slot allocator in miniature: free page ids in a tensor; a page's
    token indices are page * page_size + 0..page_size-1; frees go back by page id."""

    def __init__(self, num_pages: int, page_size: int):
        import torch
        self.torch = torch
        self.page_size = page_size
        self.free_pages = torch.arange(1, num_pages + 1, dtype=torch.int64)  # page 0 is SGLang's padding
        self.offsets = torch.arange(page_size, dtype=torch.int64)

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def alloc(self, num_pages: int):
        pages, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        return (pages[:, None] * self.page_size + self.offsets).reshape(-1)

    def free(self, indices) -> None:
        if len(indices):
            pages = indices[:: self.page_size] // self.page_size
            self.free_pages = self.torch.cat((self.free_pages, pages))


class SglangTreeDriver:
    """Runs a trace request (tokens) through SGLang's tree as testing.tree_trace.Driver runs it
    through radixkv's, timing the same calls."""

    def __init__(self, module: ModuleType, page_size: int, pool_tokens: int):
        self.name = "sglang"
        self.m = module
        self.page_size = page_size
        self.tree = module.RustUnifiedTreeCoreBinding(
            module.TreeCoreInitParamsBinding(eviction_policy="lru", page_size=page_size, device="cpu"), [FULL])
        self.root = self.tree.root_node_handle(None)
        self.allocator = PagedAllocator(pool_tokens // page_size, page_size)
        self.times = {"match": 0.0, "insert": 0.0, "evict": 0.0}
        self.calls = {"match": 0, "insert": 0, "evict": 0}
        self.total_s = 0.0
        self.requests = 0
        self.hit_tokens = 0
        self.evicted_pages = 0

    def _evict(self, num_tokens: int) -> None:
        tree, tracker = self.tree, {FULL: 0}
        tree.evict_device_start(FULL, num_tokens)
        try:
            while tracker[FULL] < num_tokens:
                step = tree.evict_device_next_node(FULL, tracker)
                self._freed(step, tracker)
                if step.node_id is None:
                    if not step.made_progress:
                        break
                    continue
                self._freed(tree.evict_device_leaf(step.node_id), tracker)
        finally:
            tree.evict_device_end(FULL)

    def _freed(self, step, tracker: dict[int, int]) -> None:
        for tensors in step.new_device_frees.values():
            for indices in tensors:
                self.allocator.free(indices)
                self.evicted_pages += len(indices) // self.page_size
        for component, delta in step.tracker.items():
            tracker[component] = tracker.get(component, 0) + delta

    def request(self, tokens: tuple[int, ...]) -> None:
        m, tree, alloc, ps, times, calls = self.m, self.tree, self.allocator, self.page_size, self.times, self.calls
        clock = time.perf_counter
        start = clock()
        max_cached = (len(tokens) - 1) // ps * ps  # at least one prompt token is computed
        full = len(tokens) // ps * ps
        key = array("q", tokens)
        t0 = clock()
        match = tree.match_prefix(m.MatchParamsBinding(key=key[:max_cached]))
        cached = match.device_prefix_len
        node = match.last_device_node_id
        prefix = tree.collect_full_device_indices(node, self.root)[:cached]
        t1 = clock()
        times["match"] += t1 - t0
        calls["match"] += 1
        lock = tree.inc_lock_ref(node, [])
        fresh_pages = -(-len(tokens) // ps) - cached // ps
        short = fresh_pages - alloc.num_free_pages
        if short > 0:
            t0 = clock()
            self._evict(short * ps)
            times["evict"] += clock() - t0
            calls["evict"] += 1
        fresh = alloc.alloc(fresh_pages)
        value = alloc.torch.cat((prefix, fresh))
        t0 = clock()
        result = tree.insert(m.InsertParamsBinding(key=key[:full], value=value[:full], prev_prefix_len=cached))
        t1 = clock()
        times["insert"] += t1 - t0
        calls["insert"] += 1
        if result.cache_actions:
            raise AssertionError(f"an insert asked for actions this driver does not apply: {result.cache_actions}")
        alloc.free(value[cached:result.prefix_len])  # pages another request inserted meanwhile
        alloc.free(value[full:])  # the partial last page is not cached
        tree.dec_lock_ref(node, m.DecLockRefParamsBinding(
            node_id=node, skipped_lock_components=[], component_lock_uuids=lock.component_lock_uuids,
            component_host_lock_uuids=lock.component_host_lock_uuids))
        self.total_s += clock() - start
        self.requests += 1
        self.hit_tokens += cached

    def summary(self) -> dict[str, float]:
        return summarize(self, self.tree.total_size()[0] // self.page_size)
