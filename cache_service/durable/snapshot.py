"""Pool state <-> plain data (lists, dicts, ints, strings) for durable snapshots.

Only public interfaces of the tree are used (`iter_nodes`, a node's `token_ids`, `value`,
`parent`, `namespace`, `last_access`, `insert`, `inc_lock_ref`), never its private
representation: a node's key encoding may change without breaking a snapshot. The tree is
rebuilt by inserting every node's whole path in least-recently-used order, so node boundaries,
page -> block mapping and the relative LRU order come back as they were; lock refs are re-taken
for every running request.

Routed requests and Route reservations (pins) are included, so that the journal after the
snapshot replays exactly (a pin can change what an eviction takes); a recovered pool drops them
at the end of recovery (cache_service/durable/state.py).
"""

from __future__ import annotations

import base64
import dataclasses
import sys
from array import array
from collections.abc import Iterable
from typing import Any

from cache_service.block_allocator import BlockAllocator
from cache_service.errors import IntegrityError
from cache_service.events import EventLog
from cache_service.page_hash import page_hashes
from cache_service.pool import Pool, RequestState
from cache_service.radix_tree import RadixTree, TreeNode, path_tokens
from cache_service.routed import RoutedRequest
from cache_service.schema import ReplicaLoad, TierCopy, TierSpec
from cache_service.tiers.lower_tier import TIER_DISK, TIER_HOST, TierCounters
from cache_service.tiers.pool_tiers import PendingCopy, PendingLoad, PoolTiers

FORMAT_VERSION = 1

_COUNTERS = ("num_private_blocks", "queried_tokens", "hit_tokens", "num_evicted_blocks", "num_admitted",
             "num_finished", "num_released", "num_steps")


# RequestState fields kept as tuples; every field but the tree node and derived encodings travels by
# name, so a field added to RequestState is carried along.
_TUPLE_FIELDS = ("prompt", "cached_outputs")
# Not stored: the tree node (re-found from the block table) and the prompt as tree key (rebuilt
# on demand from `prompt`).
_DERIVED_FIELDS = ("last_node", "prompt_bytes")


def _request_row(request: RequestState) -> dict[str, Any]:
    row = {}
    for f in dataclasses.fields(request):
        if f.name not in _DERIVED_FIELDS:
            value = getattr(request, f.name)
            row[f.name] = list(value) if isinstance(value, tuple | list | array) else value
    return row


def _pack(ints: Iterable[int], code: str = "I") -> str:
    """A list of ints as base64 of its little-endian array (JSON encodes one string fast)."""
    data = array(code, ints)
    if sys.byteorder == "big":
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode()


def _unpack(text: str, code: str = "I") -> list[int]:
    data = array(code)
    data.frombytes(base64.b64decode(text))
    if sys.byteorder == "big":
        data.byteswap()
    return data.tolist()


def dump_tree(tree: RadixTree) -> list[list[Any]]:
    """A tree's nodes as rows [parent index, namespace, tokens, values, LRU rank], parents first."""
    nodes = list(tree.iter_nodes())  # parents before children
    index = {id(node): i for i, node in enumerate(nodes)}
    # LRU rank instead of the tree's own stamps; deeper first on ties (see restore_pool)
    depth: dict[int, int] = {}
    for node in nodes:
        parent = node.parent
        depth[id(node)] = depth.get(id(parent), 0) + 1 if parent is not None and not parent.is_root else 1
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i].last_access, -depth[id(nodes[i])]))
    rank = [0] * len(nodes)
    for r, i in enumerate(order):
        rank[i] = r
    node_rows = []
    for i, node in enumerate(nodes):
        parent = node.parent
        parent_index = index[id(parent)] if parent is not None and not parent.is_root else -1
        node_rows.append([parent_index, node.namespace, _pack(node.token_ids), _pack(node.value), rank[i]])
    return node_rows


def restore_tree(tree: RadixTree, node_rows: list[list[Any]]) -> list[list[Any]]:
    """Insert `dump_tree` rows into an empty tree (whole paths in LRU order); returns the rows
    unpacked. Raises IntegrityError when they do not rebuild to the same nodes."""
    bs = tree.page_size
    rows = [[parent, ns, _unpack(tokens), _unpack(blocks), rank] for parent, ns, tokens, blocks, rank in node_rows]
    paths: list[tuple[list[int], list[int]]] = []  # whole path tokens and blocks per node
    depth: list[int] = []
    for parent_index, _, tokens, blocks, _ in rows:
        if len(tokens) != len(blocks) * bs or not blocks:
            raise IntegrityError("snapshot node is not whole pages")
        if parent_index >= 0:
            if parent_index >= len(paths):
                raise IntegrityError("snapshot node listed before its parent")
            ptoks, pblocks = paths[parent_index]
            paths.append((ptoks + tokens, pblocks + blocks))
            depth.append(depth[parent_index] + 1)
        else:
            paths.append((list(tokens), list(blocks)))
            depth.append(1)
    for i in sorted(range(len(rows)), key=lambda i: (rows[i][4], -depth[i])):
        tokens, blocks = paths[i]
        tree.insert(tokens, blocks, rows[i][1])
    if sorted(list(n.value) for n in tree.iter_nodes()) != sorted(row[3] for row in rows):
        raise IntegrityError("snapshot tree does not rebuild to the same nodes")
    return rows


def dump_pool(pool: Pool) -> dict[str, Any]:
    """The pool's whole state as plain data (see `restore_pool`)."""
    node_rows = dump_tree(pool.tree)
    requests = [_request_row(r) for r in pool.requests.values()]
    load = pool.load
    return {
        "pool_id": pool.pool_id,
        "epoch": pool.epoch,
        "num_blocks": pool.num_blocks,
        "block_size": pool.block_size,
        "model_fingerprint": pool.model_fingerprint,
        "vocab_size": pool.vocab_size,
        "serving_addr": pool.serving_addr,
        "incarnation": pool.attach.incarnation,
        "owner": pool.attach.owner,
        "evict_batch": pool.evict_batch,
        "counters": {name: getattr(pool, name) for name in _COUNTERS},
        "load": [load.num_waiting_requests, load.num_waiting_tokens, load.num_running_requests,
                 load.host_load_cost, load.disk_load_cost],
        "free": _pack(pool.allocator.free_block_ids()),
        "nodes": node_rows,
        "requests": requests,
        "routed": [[e.request_id, _pack(e.page_hashes, "Q"), e.prefill_tokens, e.expires_at,
                    e.pin.value[-1] if e.pin is not None else -1, e.pin_expires_at, e.admitted, e.namespace]
                   for e in pool.routing.routed.entries()],  # oldest first: restored in that order
        "finished_ids": pool.finished_ids(),
        "evicted_pages": _pack(pool.evicted_pages.hashes(), "Q"),
        "tiers": dump_tiers(pool.tiers) if pool.tiers is not None else None,
        # Pins of this pool's pulls on their sources (cache_service/peer_pulls.py), by the tokens
        # of the pinned prefix (restore_pulls: once every pool is back).
        "pulls": {"next": pool.pulls.next_pull_id,
                  "pending": [[pull_id, source.pool_id, tier, _pack(path_tokens(node)), node.namespace, pages]
                              for pull_id, source, tier, node, pages in pool.pulls.pinned()]},
    }


def restore_pulls(pool: Pool, data: dict[str, Any] | None, pools: dict[str, Pool]) -> None:
    """Pin again what `pool`'s pulls pinned when the snapshot was taken (`dump_pool`'s "pulls"; None:
    a snapshot of an older version, which had none); IntegrityError when a source lacks the pages."""
    if not data:
        return
    pool.pulls.next_pull_id = max(pool.pulls.next_pull_id, int(data["next"]))
    for pull_id, source_id, tier, tokens, namespace, pages in data["pending"]:
        source = pools.get(source_id)
        if source is not None:  # a source that did not restore took its pins with it
            pool.pulls.restore(source, int(pull_id), int(tier), _unpack(tokens), namespace, int(pages), replayed=False)


def restore_pool(data: dict[str, Any], events: EventLog | None) -> Pool:
    """Rebuild a pool from `dump_pool` data; raises IntegrityError when the data is inconsistent."""
    try:
        return _restore(data, events)
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise IntegrityError(f"snapshot of pool {data.get('pool_id')!r} is malformed: {err!r}") from err


def _restore(data: dict[str, Any], events: EventLog | None) -> Pool:
    tiers = data.get("tiers")  # absent from the snapshots of older versions: no tiers
    pool = Pool(data["pool_id"], int(data["epoch"]), int(data["num_blocks"]), int(data["block_size"]),
                data["model_fingerprint"], int(data["vocab_size"]), events, serving_addr=data["serving_addr"],
                tiers=tier_spec_of(tiers) if tiers else None)
    pool.attach.incarnation = data["incarnation"]
    pool.attach.owner = data.get("owner", "")  # absent from the snapshots of older versions: anonymous
    pool.evict_batch = int(data.get("evict_batch", 1))  # older versions evicted exactly what was needed
    tree = pool.tree
    rows = restore_tree(tree, data["nodes"])
    by_last_block: dict[int, TreeNode] = {node.value[-1]: node for node in tree.iter_nodes()}
    refcounts = [0] * pool.num_blocks
    for _, _, _, blocks, _ in rows:
        for b in blocks:
            refcounts[b] += 1
    private = 0
    for row in data["requests"]:
        fields = {name: tuple(v) if name in _TUPLE_FIELDS else v for name, v in row.items()}
        num_cached, table = fields["num_cached_pages"], fields["block_table"]
        last_node = None
        if num_cached:
            last_node = by_last_block.get(table[num_cached - 1])
            if last_node is None:
                raise IntegrityError(f"snapshot request {fields['request_id']!r}: its cached prefix is not a node")
            tree.inc_lock_ref(last_node)
        for b in table:
            refcounts[b] += 1
        private += len(table) - num_cached
        pool.requests[fields["request_id"]] = RequestState(last_node=last_node, **fields)
    for rid, hashes, prefill, expires_at, pin_block, pin_expires_at, admitted, *rest in data["routed"]:
        namespace = rest[0] if rest else ""  # older snapshots: no namespace (the default one)
        pin = None
        if pin_block >= 0:
            pin = by_last_block.get(pin_block)
            if pin is None:
                raise IntegrityError(f"snapshot reservation {rid!r}: its pinned prefix is not a node")
            tree.inc_lock_ref(pin)
        entry = RoutedRequest(rid, namespace, _unpack(hashes, "Q"), prefill, expires_at, pin, pin_expires_at)
        pool.routing.routed.add(entry)
        if admitted:  # as RoutedRequests.on_admit left it (its pin already ended then)
            entry.admitted = True
            pool.routing.routed.queued_tokens -= prefill
    pool.allocator = BlockAllocator.restore(pool.num_blocks, _unpack(data["free"]), refcounts)
    for name in _COUNTERS:
        setattr(pool, name, int(data["counters"][name]))
    if pool.num_private_blocks != private:
        raise IntegrityError("snapshot private block counter differs from its requests")
    pool.load = ReplicaLoad(*data["load"])
    pool.restore_finished_ids(data["finished_ids"])
    pool.evicted_pages.add(_unpack(data["evicted_pages"], "Q"))
    if tiers:
        restore_tiers(pool.tiers, tiers)
    pool.check_integrity()
    return pool


def canonical(pool: Pool) -> dict[str, Any]:
    """A comparable view of a pool's state: equal for a live pool and its snapshot + replay."""
    data = dump_pool(pool)
    # Node order and the tree's LRU stamps are representation: compare nodes by content, and the
    # LRU order of the evictable leaves (what eviction acts on) by rank.
    nodes = data.pop("nodes")
    keyed = sorted((row[1], row[2], row[3]) for row in nodes)
    data["nodes"] = keyed
    leaves = [n for n in pool.tree.iter_nodes() if not n.children and n.lock_ref == 0]
    data["lru_leaves"] = [list(n.value) for n in sorted(leaves, key=lambda n: n.last_access)]
    data["locks"] = sorted((list(n.value), n.lock_ref) for n in pool.tree.iter_nodes())
    data["requests"] = sorted(data["requests"], key=lambda row: row["request_id"])
    data["finished_ids"] = sorted(data["finished_ids"])
    data["routed"] = sorted(data["routed"])
    routed = pool.routing.routed
    data["routed_totals"] = [routed.queued_tokens, routed.num_pins, len(routed), routed.pinned_pages,
                             routed.num_pages]
    data["evicted_pages"] = sorted(_unpack(data["evicted_pages"], "Q"))
    if data["tiers"] is not None:
        for tier, live in zip(data["tiers"]["tiers"], pool.tiers.tiers, strict=True):
            tier["nodes"] = sorted((row[1], row[2], row[3]) for row in tier["nodes"])
            # What the tier evicts next, as for the device tree.
            tier_leaves = [n for n in live.tree.iter_nodes() if not n.children and n.lock_ref == 0]
            tier["lru_leaves"] = [list(n.value) for n in sorted(tier_leaves, key=lambda n: n.last_access)]
    data.pop("epoch")
    return data


# ---------------------------------------------------------------- lower tiers (cache_service/tiers/)

def tier_spec_of(data: dict[str, Any]) -> TierSpec:
    host, disk, policy = data["spec"]
    return TierSpec(int(host), int(disk), policy)


def _copy_row(copy: TierCopy) -> list[Any]:
    return [copy.copy_id, copy.src_tier, copy.dst_tier, _pack(copy.src), _pack(copy.dst), copy.namespace,
            copy.parent_hash, _pack(copy.page_hashes, "Q"), base64.b64encode(copy.token_bytes).decode()]


def _copy_of(row: list[Any]) -> TierCopy:
    copy_id, src_tier, dst_tier, src, dst, namespace, parent_hash, hashes, token_bytes = row
    return TierCopy(copy_id, src_tier, dst_tier, _unpack(src), _unpack(dst), namespace, parent_hash,
                    _unpack(hashes, "Q"), base64.b64decode(token_bytes))


def dump_tiers(tiers: PoolTiers) -> dict[str, Any]:
    """A pool's lower tiers: each tier's tree, free slots and counters, the copies not reported
    yet and those not handed out yet (see `restore_tiers`)."""
    spec = tiers.spec
    return {
        "spec": [spec.num_host_slots, spec.num_disk_slots, spec.offload_policy],
        "tiers": [{"tier": t.tier, "nodes": dump_tree(t.tree), "free": _pack(t.allocator.free_block_ids()),
                   "counters": dataclasses.astuple(t.counters)} for t in tiers.tiers],
        "next_copy_id": tiers.next_copy_id,
        # The replica's last reported load costs: whether an admission loads from a tier (`match`).
        "load_costs": [tiers.load_costs[TIER_HOST], tiers.load_costs[TIER_DISK]],
        "pending": [[copy_id, p.tier.tier, p.namespace, base64.b64encode(p.key).decode(), p.first_page,
                     _pack(p.slots)] for copy_id, p in tiers.pending.items()],
        "load_pages": [[copy_id, p.tier.tier, p.namespace, base64.b64encode(p.key).decode(), p.first_page,
                        p.num_pages] for copy_id, p in tiers.load_pages.items()],
        "queue": [[_copy_row(c) for c in tiers.queue.from_host], [_copy_row(c) for c in tiers.queue.from_device]],
    }


def restore_tiers(tiers: PoolTiers, data: dict[str, Any]) -> None:
    """Rebuild `dump_tiers` data into a pool's (empty) tiers; IntegrityError when inconsistent."""
    by_tier = {t.tier: t for t in tiers.tiers}
    if sorted(by_tier) != sorted(row["tier"] for row in data["tiers"]):
        raise IntegrityError("snapshot tiers differ from the pool's")
    pending = [[copy_id, by_tier[tier], ns, base64.b64decode(key), first, _unpack(slots)]
               for copy_id, tier, ns, key, first, slots in data["pending"]]
    for row in data["tiers"]:
        tier = by_tier[row["tier"]]
        rows = restore_tree(tier.tree, row["nodes"])
        refcounts = [0] * tier.num_slots
        for _, _, _, slots, _ in rows:
            for s in slots:
                refcounts[s] += 1
        for _, t, _, _, _, slots in pending:
            if t is tier:
                for s in slots:
                    refcounts[s] += 1
                tier.num_pending += len(slots)
        tier.allocator = BlockAllocator.restore(tier.num_slots, _unpack(row["free"]), refcounts)
        tier.counters = TierCounters(*row["counters"])
    for copy_id, tier, ns, key, first, slots in pending:
        hashes = page_hashes(0, ns, key, tiers.block_size)[first:first + len(slots)]
        tiers.add_pending(copy_id, PendingCopy(tier, ns, key, first, slots, hashes))
    for copy_id, tier, ns, key, first, n in data["load_pages"]:
        tiers.load_pages[copy_id] = PendingLoad(by_tier[tier], ns, base64.b64decode(key), first, n)
    tiers.queue.from_host = [_copy_of(r) for r in data["queue"][0]]
    tiers.queue.from_device = [_copy_of(r) for r in data["queue"][1]]
    tiers.next_copy_id = int(data["next_copy_id"])
    host_cost, disk_cost = data.get("load_costs", (0.0, 0.0))  # absent from the first tier snapshots
    tiers.load_costs = {TIER_HOST: float(host_cost), TIER_DISK: float(disk_cost)}
