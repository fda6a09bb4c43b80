"""What moves between a pool's device blocks and its replica's lower tiers, decided per Step.

- Copy down: with the `evict` policy, pages the device tree evicts are copied to the first lower
  tier (host, or disk without a host tier) before their blocks are reused; with `write-through`,
  pages are copied down as soon as the device tree caches them (and on eviction if still missing).
  Pages the host tier evicts go to the disk tier (or are dropped); the disk tier drops its LRU pages.
  Every copy extends a prefix the tier already holds (pages [h, end) of a prefix of which the tier
  holds [0, h)), so tiers hold whole prefixes.
- Load: an admission whose device hit ends before what the host (then disk) tier holds loads those
  pages into the fresh blocks it was given; the tier's pages stay locked until the Step ends.
- Outcomes: a copy down reserves its slots (pending); they join the tier only when a later Step
  reports the copy complete (cache.proto CopyOutcome), so a page is never held before its data is.

Copies of one reply are ordered so that no copy reads a slot or block an earlier one of the same
reply wrote: host -> disk copies first (they read host slots the host tier just freed), then copies
from device blocks (they read blocks the step may hand out again), then the admissions' loads (they
write fresh blocks and read locked slots). Copies queued between Steps (an admin Evict / Clear) go
out with the next reply, ahead of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cache_service.block_allocator import BlockAllocator
from cache_service.errors import IntegrityError, InvalidArgument
from cache_service.events import EventPayload, removed_by_namespace, stored_from_node
from cache_service.radix_tree import EvictedNode, RadixTree, TreeNode, path_hashes, path_key, path_values
from cache_service.schema import CopyOutcome, DiskRun, TierCopy, TierSpec
from cache_service.tiers.lower_tier import TIER_DEVICE, TIER_DISK, TIER_HOST, LowerTier
from common.limits import MAX_ID_BYTES
from common.token_bytes import TOKEN_BYTES, max_token, unpack_tokens

log = logging.getLogger(__name__)

# A tier whose reported load cost is unknown (0) is assumed this cheap next to prefill.
DEFAULT_LOAD_COST = {TIER_HOST: 0.02, TIER_DISK: 0.05}
POLICY_EVICT = "evict"
POLICY_WRITE_THROUGH = "write-through"
POLICIES = (POLICY_EVICT, POLICY_WRITE_THROUGH)


@dataclass(slots=True)
class PendingCopy:
    """A copy down ordered and not reported yet: `slots` will hold pages [first_page, ...) of `key`."""

    tier: LowerTier
    namespace: str
    key: bytes  # the whole prefix through the copy's last page (encoded tokens)
    first_page: int
    slots: list[int]
    hashes: list[int]  # of its pages (a later copy of the same pages skips them)


@dataclass(slots=True)
class PendingLoad:
    """A load ordered in the last reply: pages [first_page, first_page + num_pages) of `key`."""

    tier: LowerTier
    namespace: str
    key: bytes  # the prefix through the load's last page (encoded tokens)
    first_page: int
    num_pages: int


class TierHit(NamedTuple):
    """Lower-tier pages an admission can load after its device hit (locked until the Step ends)."""

    host_node: TreeNode | None
    host_pages: int  # the host tier holds pages [0, host_pages) of the prompt
    disk_node: TreeNode | None
    disk_pages: int


class TierLoads(NamedTuple):
    loads: list[TierCopy]
    host_pages: int
    disk_pages: int
    last_hash: int  # hash of the last loaded page (0: none loaded)


@dataclass(slots=True)
class _Queue:
    """Copies down not yet handed to the replica, in the order it must perform them."""

    from_host: list[TierCopy] = field(default_factory=list)
    from_device: list[TierCopy] = field(default_factory=list)

    def take(self) -> list[TierCopy]:
        copies = self.from_host + self.from_device
        self.from_host, self.from_device = [], []
        return copies


class PoolTiers:
    """The lower tiers of one pool and the copies between them (see the module docstring)."""

    def __init__(self, spec: TierSpec, block_size: int,
                 publish: Callable[[EventPayload], None] | None = None) -> None:
        if spec.offload_policy not in POLICIES:
            raise InvalidArgument(f"offload policy must be one of {', '.join(POLICIES)}")
        self.spec = spec
        self.block_size = block_size
        self.policy = spec.offload_policy
        self.host = LowerTier(TIER_HOST, spec.num_host_slots, block_size) if spec.num_host_slots else None
        self.disk = LowerTier(TIER_DISK, spec.num_disk_slots, block_size) if spec.num_disk_slots else None
        self.first = self.host or self.disk
        self.publish = publish
        # Reported by the replica (ReplicaLoad.host_load_cost / disk_load_cost); 0: not measured.
        self.load_costs = {TIER_HOST: 0.0, TIER_DISK: 0.0}
        self.next_copy_id = 1
        self.pending: dict[int, PendingCopy] = {}
        # (tier, page hash) of every page a pending copy writes, and how many copies write it.
        self.pending_pages: dict[tuple[int, int], int] = {}
        self.loading: list[tuple[LowerTier, TreeNode]] = []  # locked for the current Step
        # Loads of the last reply: their outcome comes in the next Step (and only then).
        self.load_pages: dict[int, PendingLoad] = {}
        self.queue = _Queue()

    @property
    def tiers(self) -> list[LowerTier]:
        return [t for t in (self.host, self.disk) if t is not None]

    def load_cost(self, tier: int) -> float:
        """A loaded token's cost as a share of a computed one (measured, or the default)."""
        return self.load_costs[tier] or DEFAULT_LOAD_COST[tier]

    # ------------------------------------------------------------------ step

    def validate_outcomes(self, outcomes: Sequence[CopyOutcome]) -> None:
        """InvalidArgument for a copy reported twice or with more pages than it had."""
        seen: set[int] = set()
        for o in outcomes:
            if o.copy_id in seen:
                raise InvalidArgument(f"copy {o.copy_id} is reported more than once in the step")
            seen.add(o.copy_id)
            pending = self.pending.get(o.copy_id)
            load = self.load_pages.get(o.copy_id)
            pages = len(pending.slots) if pending is not None else load.num_pages if load is not None else None
            if pages is not None and o.num_pages_copied > pages:
                raise InvalidArgument(f"copy {o.copy_id}: num_pages_copied {o.num_pages_copied} exceeds its "
                                      f"{pages} pages")

    def apply_outcomes(self, outcomes: Sequence[CopyOutcome]) -> None:
        """Copies reported complete join their tier; failed pages free their slots. A load that
        failed drops the page it failed on, and what follows it, from its tier (they are bad: the
        next hit would fail again, and the recomputed pages could never be copied down again).
        Outcomes of copies not waited for (already reported, of an older reply's loads, or dropped
        at a re-attach) change nothing."""
        loads, self.load_pages = self.load_pages, {}
        for o in outcomes:
            load = loads.get(o.copy_id)
            if load is not None:
                if o.num_pages_copied < load.num_pages:
                    load.tier.counters.num_failed_pages += load.num_pages - o.num_pages_copied
                    removed = load.tier.drop_from(load.key, load.first_page + o.num_pages_copied, load.namespace)
                    self._published_removed(load.tier, removed)
                continue
            pending = self._pop_pending(o.copy_id)
            if pending is None:
                continue
            tier, done = pending.tier, o.num_pages_copied
            tier.counters.num_offloaded_pages += done
            tier.counters.num_failed_pages += len(pending.slots) - done
            tier.release(pending.slots[done:])
            node = tier.commit(pending.key, pending.first_page, pending.slots[:done], pending.namespace)
            if node is not None and self.publish is not None:
                self.publish(stored_from_node(node, self.block_size, tier.tier))

    def end_step(self) -> list[TierCopy]:
        """Unlock this Step's loads and hand out its copies down, in order."""
        for tier, node in self.loading:
            tier.tree.dec_lock_ref(node)
        self.loading = []
        return self.queue.take()

    # ------------------------------------------------------------------ copies down

    def on_device_evicted(self, nodes: Sequence[EvictedNode]) -> None:
        """Pages the device tree evicted (their blocks free now, reused only after this reply's copies)."""
        if self.first is None:
            return
        for node in _batch_leaves(nodes):
            self._copy_down(node, TIER_DEVICE)

    def on_device_cached(self, node: TreeNode | None) -> None:
        """A device tree node was just created (a commit or finish): copied down under write-through."""
        if node is not None and self.first is not None and self.policy == POLICY_WRITE_THROUGH:
            self._copy_down(node, TIER_DEVICE)

    def _copy_down(self, node: TreeNode, src_tier: int) -> None:
        """Copy the prefix through `node` (a node of the `src_tier` tree) into the next tier down."""
        dst = self.first if src_tier == TIER_DEVICE else self.disk
        if dst is None:
            return
        ps = self.block_size
        key = path_key(node)
        end = len(key) // (ps * TOKEN_BYTES)
        namespace = node.namespace
        match = dst.tree.match_prefix(key, namespace)
        held = match.num_tokens // ps
        if held >= end:
            return
        # Pages an earlier copy is still writing are not copied again (a leaf's copy takes the
        # pages before it that the tier lacks; evicting those next must not write them twice):
        # this copy extends that one, and commits after it (outcomes come in copy order).
        hashes = path_hashes(node, end - held)
        writing = 0
        while writing < len(hashes) and (dst.tier, hashes[writing]) in self.pending_pages:
            writing += 1
        if writing == len(hashes):
            return
        held += writing
        hashes = hashes[writing:]
        slots, evicted = dst.reserve(end - held, keep=match.last_node)
        if evicted:
            self._left_tier(dst, evicted)
        if not slots:
            return
        n = len(slots)
        src = path_values(node, end - held)[:n]
        hashes = hashes[:n]
        copy = TierCopy(self.next_copy_id, src_tier, dst.tier, src, slots)
        if dst.tier == TIER_DISK:  # a disk slot records its page (docs/tiers.md, disk format)
            parent = path_hashes(node, end - held + 1)[0] if held else 0
            lo = held * ps * TOKEN_BYTES
            copy = copy._replace(namespace=namespace, parent_hash=parent, page_hashes=hashes,
                                 token_bytes=key[lo : lo + n * ps * TOKEN_BYTES])
        self.add_pending(copy.copy_id, PendingCopy(dst, namespace, key[: (held + n) * ps * TOKEN_BYTES], held,
                                                   slots, hashes))
        self.next_copy_id += 1
        (self.queue.from_device if src_tier == TIER_DEVICE else self.queue.from_host).append(copy)

    def add_pending(self, copy_id: int, pending: PendingCopy) -> None:
        """A copy down ordered: its slots wait for its outcome."""
        self.pending[copy_id] = pending
        for h in pending.hashes:
            at = (pending.tier.tier, h)
            self.pending_pages[at] = self.pending_pages.get(at, 0) + 1

    def _pop_pending(self, copy_id: int) -> PendingCopy | None:
        pending = self.pending.pop(copy_id, None)
        if pending is not None:
            for h in pending.hashes:
                at = (pending.tier.tier, h)
                left = self.pending_pages.pop(at) - 1
                if left:
                    self.pending_pages[at] = left
        return pending

    def _left_tier(self, tier: LowerTier, evicted: list[EvictedNode]) -> None:
        """Pages evicted from `tier`: host pages go down to the disk tier; events either way."""
        if tier.tier == TIER_HOST and self.disk is not None:
            for node in _batch_leaves(evicted):
                self._copy_down(node, TIER_HOST)
        self._published_removed(tier, evicted)

    def _published_removed(self, tier: LowerTier, removed: list[EvictedNode]) -> None:
        if self.publish is not None:
            for event in removed_by_namespace(removed, tier.tier):
                self.publish(event)

    # ------------------------------------------------------------------ loads

    def match(self, key: bytes, namespace: str, device_pages: int) -> TierHit | None:
        """Lock the lower-tier pages that extend a device hit of `device_pages` pages of `key`
        (the cacheable prompt, encoded); None when no tier adds a page. Tiers whose load costs as
        much as computing are skipped. Undo with `unmatch`, or use with `loads`."""
        covered = device_pages
        found: list[tuple[TreeNode | None, int]] = []
        for tier in (self.host, self.disk):
            node, pages = None, 0
            if tier is not None and self.load_cost(tier.tier) < 1.0 and len(key) > covered * self.block_size * TOKEN_BYTES:
                match = tier.tree.match_prefix(key, namespace)
                if match.num_tokens // self.block_size > covered:
                    node, pages = match.last_node, match.num_tokens // self.block_size
                    tier.tree.inc_lock_ref(node)
                    covered = pages
            found.append((node, pages))
        if covered == device_pages:
            return None
        return TierHit(found[0][0], found[0][1], found[1][0], found[1][1])

    def unmatch(self, hit: TierHit | None) -> None:
        """Release a `match` whose admission did not happen."""
        if hit is None:
            return
        for tier, node in ((self.host, hit.host_node), (self.disk, hit.disk_node)):
            if tier is not None and node is not None:
                tier.tree.dec_lock_ref(node)

    def loads(self, hit: TierHit | None, namespace: str, table: Sequence[int], device_pages: int,
              first_admission: bool) -> TierLoads:
        """The loads of an admitted request whose `table` starts with its `device_pages` cached blocks."""
        if hit is None:
            return TierLoads([], 0, 0, 0)
        copies: list[TierCopy] = []
        counts = {TIER_HOST: 0, TIER_DISK: 0}
        start, last_hash = device_pages, 0
        for tier, node, pages in ((self.host, hit.host_node, hit.host_pages),
                                  (self.disk, hit.disk_node, hit.disk_pages)):
            if tier is None or node is None:
                continue
            n = pages - start
            self.loading.append((tier, node))
            if n <= 0:  # the host tier already covers what this (disk) tier holds
                continue
            copy = TierCopy(self.next_copy_id, tier.tier, TIER_DEVICE, path_values(node, n),
                            list(table[start:pages]))
            if tier.tier == TIER_DISK:  # a disk load checks that each slot still holds this page
                copy = copy._replace(namespace=namespace, page_hashes=path_hashes(node, n))
            self.next_copy_id += 1
            copies.append(copy)
            self.load_pages[copy.copy_id] = PendingLoad(tier, namespace, path_key(node), start, n)
            tier.counters.num_loaded_pages += n
            if first_admission:
                tier.counters.hit_tokens += n * self.block_size
            counts[tier.tier] = n
            start, last_hash = pages, node.last_hash
        return TierLoads(copies, counts[TIER_HOST], counts[TIER_DISK], last_hash)

    def peek(self, key: bytes, namespace: str, device_pages: int) -> tuple[int, int]:
        """Pages after a device hit of `device_pages` the host, then the disk tier would load: read-only."""
        return self._peek(lambda tier: tier.peek_pages(key, namespace), device_pages)

    def peek_hashes(self, hashes: Sequence[int], namespace: str, device_pages: int) -> tuple[int, int]:
        """`peek` for a prompt given as its page hash chain."""
        return self._peek(lambda tier: tier.tree.peek_hashes(hashes, namespace), device_pages)

    def holds_first_page(self, page: bytes, page_hash: Sequence[int], namespace: str) -> bool:
        """Whether a tier holds a prompt's first page, given encoded (`page`) or as its hash
        (`page_hash`: a one-hash chain) when the prompt came as a hash chain."""
        for tier in (self.host, self.disk):
            if tier is not None and (tier.tree.holds_first_page(page, namespace) if page else
                                     tier.tree.peek_hashes(page_hash, namespace) > 0):
                return True
        return False

    def _peek(self, held: Callable[[LowerTier], int], device_pages: int) -> tuple[int, int]:
        covered, found = device_pages, []
        for tier in (self.host, self.disk):
            pages = held(tier) if tier is not None and self.load_cost(tier.tier) < 1.0 else 0
            found.append(max(0, pages - covered))
            covered = max(covered, pages)
        return found[0], found[1]

    # ------------------------------------------------------------------ lifecycle

    def drop_pending(self) -> None:
        """Forget every copy not reported (a re-attach: the replica's view of them is lost)."""
        for pending in self.pending.values():
            pending.tier.release(pending.slots)
        self.pending.clear()
        self.pending_pages.clear()
        self.load_pages.clear()
        self.queue = _Queue()

    def restore_disk(self, runs: Sequence[DiskRun], vocab_size: int) -> int:
        """Fill the (empty) disk tier with what the replica's disk holds; returns the pages kept."""
        disk = self.disk
        if not runs:
            return 0
        if disk is None:
            raise InvalidArgument("disk_runs given without a disk tier (num_disk_slots 0)")
        page_bytes = self.block_size * TOKEN_BYTES
        for run in runs:
            if len(run.namespace.encode()) > MAX_ID_BYTES:
                raise InvalidArgument(f"disk run namespace longer than {MAX_ID_BYTES} bytes")
            if not run.slots or len(run.token_bytes) != page_bytes * len(run.slots):
                raise InvalidArgument("a disk run needs one slot per whole page of its packed_token_ids")
            if max(run.slots) >= disk.num_slots:
                raise InvalidArgument(f"disk run slot {max(run.slots)} is out of range ({disk.num_slots} slots)")
            if vocab_size and max_token(unpack_tokens(run.token_bytes)) >= vocab_size:
                raise InvalidArgument(f"a disk run holds a token id >= vocab_size {vocab_size}")
        for run in runs:
            disk.tree.insert(run.token_bytes, run.slots, run.namespace)
        try:  # runs share leading pages; a slot may stand for one page only
            owned_list = disk.tree.check_integrity(check_hashes=False)
        except IntegrityError:
            owned_list = []
        if (not owned_list or any(disk.tree.peek_prefix(run.token_bytes, run.namespace).block_ids != run.slots
                                  for run in runs)):
            disk.tree = RadixTree(self.block_size)
            raise InvalidArgument("disk runs name one slot for two different pages")
        owned = set(owned_list)
        disk.allocator = BlockAllocator.restore(
            disk.num_slots, [s for s in range(disk.num_slots - 1, -1, -1) if s not in owned],
            [1 if s in owned else 0 for s in range(disk.num_slots)])
        return len(owned)

    def check_integrity(self) -> None:
        pending = {t.name: 0 for t in self.tiers}
        pages: dict[tuple[int, int], int] = {}
        for p in self.pending.values():
            pending[p.tier.name] += len(p.slots)
            if len(p.hashes) != len(p.slots):
                raise IntegrityError(f"a pending copy to the {p.tier.name} tier has {len(p.slots)} slots "
                                     f"but {len(p.hashes)} page hashes")
            for h in p.hashes:
                pages[(p.tier.tier, h)] = pages.get((p.tier.tier, h), 0) + 1
        if pages != self.pending_pages:
            raise IntegrityError("the index of pages being copied down differs from the pending copies")
        for tier in self.tiers:
            if pending[tier.name] != tier.num_pending:
                raise IntegrityError(f"{tier.name} tier: pending counter {tier.num_pending} != {pending[tier.name]}")
            tier.check_integrity()


def _batch_leaves(evicted: Sequence[EvictedNode]) -> list[TreeNode]:
    """The evicted nodes no other node of the batch hangs below (a copy of a node's prefix covers
    its evicted ancestors: copying them again would only make duplicates)."""
    parents = {id(e.node.parent) for e in evicted}
    return [e.node for e in evicted if id(e.node) not in parents]
