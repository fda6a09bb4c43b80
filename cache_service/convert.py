"""Translation between cache.proto messages and the core's plain data."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from cache_service.errors import InvalidArgument
from cache_service.events import AllCleared, BlockRemoved, BlockStored, CacheEvent
from cache_service.miss_reasons import MissBreakdown
from cache_service.pool import Pool
from cache_service.routing import RouteQuery, RouteResult, RouteWeights, visible_blocks
from cache_service.schema import (
    Admit,
    Commit,
    CopyOutcome,
    DiskRun,
    DurableStats,
    Extend,
    Finish,
    MatchInfo,
    PeerPull,
    PoolStats,
    PullStats,
    ReplicaLoad,
    StepInput,
    StepResult,
    TierCopy,
    TierSpec,
    TierStats,
)
from cache_service.tiers.pool_tiers import POLICY_EVICT, POLICY_WRITE_THROUGH
from common.limits import quote_id
from common.token_bytes import TOKEN_BYTES, unpack_tokens
from protos import cache_pb2, kv_transfer_pb2


def _finish(msg: cache_pb2.Finish) -> Finish:
    # [:] copies a repeated field in one call (about twice as fast as iterating it)
    return Finish(msg.request_id, tuple(msg.output_token_ids[:]), msg.num_computed_tokens, msg.block_table[:])


_INF = float("inf")


def replica_load(msg: cache_pb2.ReplicaLoad) -> ReplicaLoad:
    host, disk, peer = msg.host_load_cost, msg.disk_load_cost, msg.peer_load_cost
    for name, value in (("host_load_cost", host), ("disk_load_cost", disk), ("peer_load_cost", peer)):
        if not 0.0 <= value < _INF:  # NaN fails this too
            raise InvalidArgument(f"load.{name} must be a finite number >= 0")
    return ReplicaLoad(msg.num_waiting_requests, msg.num_waiting_tokens, msg.num_running_requests, host, disk, peer)


def replica_load_proto(load: ReplicaLoad, out: cache_pb2.ReplicaLoad | None = None) -> cache_pb2.ReplicaLoad:
    """`load` as a message: `out` (a field of a message being built) filled in place, or a new one."""
    out = cache_pb2.ReplicaLoad() if out is None else out
    out.num_waiting_requests = load.num_waiting_requests
    out.num_waiting_tokens = load.num_waiting_tokens
    out.num_running_requests = load.num_running_requests
    out.host_load_cost = load.host_load_cost
    out.disk_load_cost = load.disk_load_cost
    out.peer_load_cost = load.peer_load_cost
    return out


def _prompt_tokens(msg: cache_pb2.Admit | cache_pb2.RouteRequest, where: str = "") -> Sequence[int]:
    """The prompt of an Admit or a Route: packed_token_ids as an array('I') (one copy), else
    token_ids as a tuple. Raises InvalidArgument (its message after `where`) when both are set or
    the packed length is not whole ids."""
    packed = msg.packed_token_ids
    if not packed:
        return tuple(msg.token_ids[:])
    if msg.token_ids:
        raise InvalidArgument(f"{where}set token_ids or packed_token_ids, not both")
    try:
        return unpack_tokens(packed)
    except ValueError as err:
        raise InvalidArgument(f"{where}packed_token_ids: {err} (each a little-endian uint32)") from None


def _admit_tokens(msg: cache_pb2.Admit) -> Sequence[int]:
    """The prompt of an Admit (`_prompt_tokens`, errors naming the request)."""
    return _prompt_tokens(msg, f"request {quote_id(msg.request_id)}: ")


def step_input(msg: cache_pb2.StepRequest) -> StepInput:
    """The core's StepInput; raises InvalidArgument for an Admit with both prompt forms or a bad
    packed length (see `_admit_tokens`)."""
    # Token lists become tuples (or arrays) once here: the core scans them several times
    # (validation, matching, hashing), and native sequences are much faster to scan than
    # repeated fields.
    # A Step of a busy replica is mostly a few extends: an empty repeated field is tested (a
    # length) rather than iterated, which costs a container object each.
    return StepInput(
        [_finish(f) for f in msg.releases] if msg.releases else [],
        [_finish(f) for f in msg.finishes] if msg.finishes else [],
        [Extend(e.request_id, e.num_tokens, e.num_lookahead_tokens) for e in msg.extends] if msg.extends else [],
        [Admit(a.request_id, _admit_tokens(a), a.namespace, a.num_lookahead_tokens, a.resumed)
         for a in msg.admits] if msg.admits else [],
        [Commit(c.request_id, c.num_computed_tokens, tuple(c.output_token_ids[:]))
         for c in msg.commits] if msg.commits else [],
        replica_load(msg.load) if msg.HasField("load") else None,
        [CopyOutcome(o.copy_id, o.num_pages_copied) for o in msg.copy_outcomes] if msg.copy_outcomes else [],
        [CopyOutcome(o.copy_id, o.num_pages_copied) for o in msg.pull_outcomes] if msg.pull_outcomes else [],
    )


_POLICIES = {cache_pb2.OFFLOAD_POLICY_UNSPECIFIED: POLICY_EVICT, cache_pb2.OFFLOAD_POLICY_EVICT: POLICY_EVICT,
             cache_pb2.OFFLOAD_POLICY_WRITE_THROUGH: POLICY_WRITE_THROUGH}
_POLICY_PROTOS = {POLICY_EVICT: cache_pb2.OFFLOAD_POLICY_EVICT, POLICY_WRITE_THROUGH: cache_pb2.OFFLOAD_POLICY_WRITE_THROUGH}


def tier_spec(msg: cache_pb2.TierConfig) -> TierSpec:
    """The replica's tiers; InvalidArgument for an unknown policy or a malformed disk run."""
    policy = _POLICIES.get(msg.offload_policy)
    if policy is None:
        raise InvalidArgument(f"unknown offload_policy {msg.offload_policy}")
    runs = []
    for run in msg.disk_runs:
        if len(run.packed_token_ids) % 4:
            raise InvalidArgument("disk run packed_token_ids must be whole uint32 ids")
        runs.append(DiskRun(run.namespace, run.packed_token_ids, list(run.slots)))
    return TierSpec(msg.num_host_slots, msg.num_disk_slots, policy, runs)


def tier_copy(copy: TierCopy) -> cache_pb2.TierCopy:
    return cache_pb2.TierCopy(copy_id=copy.copy_id, src_tier=copy.src_tier, dst_tier=copy.dst_tier, src=copy.src,
                              dst=copy.dst, namespace=copy.namespace, parent_hash=copy.parent_hash,
                              page_hashes=copy.page_hashes, packed_token_ids=copy.token_bytes)


def peer_pull(pull: PeerPull) -> cache_pb2.PeerPull:
    """The PeerPull message, its ticket signed with the source's key (kv_transfer.proto PullTicket)."""
    ticket = kv_transfer_pb2.PullTicket(
        worker_id=pull.source_worker_id, incarnation=pull.source_incarnation, puller_worker_id=pull.puller_worker_id,
        pull_id=pull.pull_id, src_tier=pull.src_tier, src=pull.src, namespace=pull.namespace,
        page_hashes=pull.page_hashes, expires_at=pull.expires_at).SerializeToString()
    return cache_pb2.PeerPull(pull_id=pull.pull_id, source_worker_id=pull.source_worker_id,
                              source_addr=pull.source_addr, ticket=ticket,
                              ticket_mac=hmac.new(pull.source_key, ticket, hashlib.sha256).digest(),
                              dst=pull.dst, pin_seconds=pull.pin_seconds)


def _pull_stats(stats: PullStats | None) -> cache_pb2.PullStats | None:
    return None if stats is None else cache_pb2.PullStats(**stats._asdict())


def _tier_stats(stats: TierStats | None) -> cache_pb2.TierStats | None:
    if stats is None:
        return None
    return cache_pb2.TierStats(
        num_slots=stats.num_slots, num_cached_pages=stats.num_cached_pages, num_pending_pages=stats.num_pending_pages,
        hit_tokens=stats.hit_tokens, num_loaded_pages=stats.num_loaded_pages,
        num_offloaded_pages=stats.num_offloaded_pages, num_failed_pages=stats.num_failed_pages,
        num_evicted_pages=stats.num_evicted_pages)


def _miss(miss: MissBreakdown | None) -> cache_pb2.MissBreakdown | None:
    if miss is None:
        return None
    # other_namespace_tokens stays 0 (deprecated): other namespaces' pages are new to the caller.
    return cache_pb2.MissBreakdown(evicted_tokens=miss.evicted_tokens, other_replica_tokens=miss.other_replica_tokens,
                                   new_tokens=miss.new_tokens)


def step_response(result: StepResult) -> cache_pb2.StepResponse:
    # Fields set only when there is something in them (most Steps: a few extends), as step_input.
    reply = cache_pb2.StepResponse(num_evicted_blocks=result.num_evicted_blocks,
                                   num_free_blocks=result.num_free_blocks)
    if result.admits:
        admitted, no_space = cache_pb2.ADMIT_STATUS_ADMITTED, cache_pb2.ADMIT_STATUS_NO_SPACE
        add = reply.admits.add
        for a in result.admits:
            add(request_id=a.request_id, status=admitted if a.admitted else no_space, cached_tokens=a.cached_tokens,
                block_table=a.block_table, miss=_miss(a.miss),
                loads=[tier_copy(c) for c in a.loads] if a.loads else None,
                pulls=[peer_pull(p) for p in a.pulls] if a.pulls else None)
    if result.extends:  # add(): built in place, where extend() would copy each message in
        add = reply.extends.add
        for e in result.extends:
            add(request_id=e.request_id, ok=e.ok, new_block_ids=e.new_block_ids)
    if result.commits:
        add = reply.commits.add
        for c in result.commits:
            add(request_id=c.request_id, cached_tokens=c.cached_tokens, cached_block_ids=c.cached_block_ids)
    if result.offloads:
        reply.offloads.extend(tier_copy(c) for c in result.offloads)
    return reply


def pool_stats(s: PoolStats) -> cache_pb2.PoolStats:
    return cache_pb2.PoolStats(
        pool_id=s.pool_id,
        worker_id=s.worker_id,
        epoch=s.epoch,
        model_fingerprint=s.model_fingerprint,
        block_size=s.block_size,
        num_blocks=s.num_blocks,
        num_free_blocks=s.num_free_blocks,
        num_cached_blocks=s.num_cached_blocks,
        num_locked_blocks=s.num_locked_blocks,
        num_evictable_blocks=s.num_evictable_blocks,
        num_private_blocks=s.num_private_blocks,
        num_running_requests=s.num_running_requests,
        queried_tokens=s.queried_tokens,
        hit_tokens=s.hit_tokens,
        hit_rate=s.hit_rate,
        num_evicted_blocks=s.num_evicted_blocks,
        num_admitted=s.num_admitted,
        num_finished=s.num_finished,
        num_released=s.num_released,
        lease_remaining_seconds=s.lease_remaining_seconds,
        serving_addr=s.serving_addr,
        load=replica_load_proto(s.load),
        num_reservations=s.num_reservations,
        num_remembered_evicted_pages=s.num_remembered_evicted_pages,
        restored=s.restored,
        num_restored_cached_blocks=s.num_restored_cached_blocks,
        num_lookahead_blocks=s.num_lookahead_blocks,
        host_tier=_tier_stats(s.host_tier),
        disk_tier=_tier_stats(s.disk_tier),
        offload_policy=_POLICY_PROTOS.get(s.offload_policy, cache_pb2.OFFLOAD_POLICY_UNSPECIFIED),
        pulls=_pull_stats(s.pulls),
    )


def route_query(msg: cache_pb2.RouteRequest, all_namespaces: bool) -> RouteQuery:
    """`all_namespaces`: the caller's token is not limited to namespaces (RouteQuery)."""
    defaults = RouteWeights()
    weights = RouteWeights(msg.prefill_weight or defaults.prefill_weight, msg.queue_weight or defaults.queue_weight,
                           msg.running_weight or defaults.running_weight)
    return RouteQuery(_prompt_tokens(msg), tuple(msg.page_hashes[:]), msg.namespace, msg.model_fingerprint,
                      msg.request_id, msg.reserve_ms, msg.max_candidates, msg.dry_run, weights, all_namespaces)


def route_size(msg: cache_pb2.RouteRequest) -> tuple[int, int]:
    """(token ids, page hashes) a Route carries, read without copying the prompt out."""
    return len(msg.token_ids) or len(msg.packed_token_ids) // TOKEN_BYTES, len(msg.page_hashes)


def route_response(result: RouteResult, out: cache_pb2.RouteResponse | None = None) -> cache_pb2.RouteResponse:
    """The RouteResponse of `result`; `out`: an empty message to fill in place (a RouteStreamReply's
    `response`: no copy of the candidates)."""
    reply = cache_pb2.RouteResponse() if out is None else out
    reply.num_prompt_pages = result.num_prompt_pages
    add = reply.candidates.add  # built in place (see step_response)
    for c in result.candidates:
        candidate = add(pool_id=c.pool_id, worker_id=c.worker_id, serving_addr=c.serving_addr,
                        matched_tokens=c.matched_tokens, routed_prefix_tokens=c.routed_prefix_tokens,
                        prefill_tokens=c.prefill_tokens, routed_tokens=c.routed_tokens,
                        num_free_blocks=c.num_free_blocks, num_evictable_blocks=c.num_evictable_blocks,
                        num_blocks=c.num_blocks, score=c.score, reserved=c.reserved,
                        matched_host_tokens=c.matched_host_tokens, matched_disk_tokens=c.matched_disk_tokens,
                        matched_peer_tokens=c.matched_peer_tokens, pull_from_worker_id=c.pull_from_worker_id)
        replica_load_proto(c.load, candidate.load)
    return reply


def pool_match(pool: Pool, found: MatchInfo, all_namespaces: bool) -> cache_pb2.PoolMatch:
    """`all_namespaces`: free blocks as such; else cached blocks nobody holds count as free
    (routing.visible_blocks: a namespace-limited caller)."""
    return cache_pb2.PoolMatch(
        pool_id=pool.pool_id,
        worker_id=pool.worker_id,
        matched_tokens=found.matched_tokens,
        block_ids=found.block_ids,
        num_private_blocks=pool.num_private_blocks,
        num_free_blocks=visible_blocks(pool, all_namespaces)[0],
        matched_host_tokens=found.host_tokens,
        matched_disk_tokens=found.disk_tokens,
    )


def cache_event(ev: CacheEvent) -> cache_pb2.CacheEvent:
    msg = cache_pb2.CacheEvent(
        sequence=ev.sequence, pool_id=ev.pool_id, timestamp=ev.timestamp, is_snapshot=ev.is_snapshot,
        publisher_epoch=ev.publisher_epoch,
    )
    p = ev.payload
    if isinstance(p, BlockStored):
        msg.stored.CopyFrom(
            cache_pb2.BlockStored(
                block_hashes=p.block_hashes,
                parent_block_hash=p.parent_block_hash,
                token_ids=p.token_ids,
                block_size=p.block_size,
                namespace=p.namespace,
                block_ids=p.block_ids,
                tier=p.tier,
            )
        )
    elif isinstance(p, BlockRemoved):
        msg.removed.CopyFrom(cache_pb2.BlockRemoved(block_hashes=p.block_hashes, block_ids=p.block_ids,
                                                      namespace=p.namespace, tier=p.tier))
    elif isinstance(p, AllCleared):
        msg.cleared.SetInParent()
    return msg


def register_response(pool: Pool, reattached: bool, lease_seconds: float) -> cache_pb2.RegisterPoolResponse:
    """The RegisterPool reply; a re-attach carries the pool's running requests as held here."""
    reply = cache_pb2.RegisterPoolResponse(pool_id=pool.pool_id, epoch=pool.epoch, lease_seconds=lease_seconds)
    if reattached:
        reply.restored = True
        reply.num_cached_blocks = pool.tree.total_size
        bs = pool.block_size
        reply.running_requests.extend(
            cache_pb2.RegisterPoolResponse.RunningRequest(
                request_id=r.request_id, block_table=r.block_table, cached_tokens=r.num_cached_pages * bs)
            for r in pool.requests.values()
        )
    return reply


def durability(stats: DurableStats, state_dir: str) -> cache_pb2.StatsResponse.Durability:
    return cache_pb2.StatsResponse.Durability(
        state_dir=state_dir, journal_bytes=stats.journal_bytes, journal_records=stats.journal_records,
        last_fsync_seconds=stats.last_fsync_seconds, max_fsync_seconds=stats.max_fsync_seconds,
        num_snapshots=stats.num_snapshots, last_snapshot_seconds=stats.last_snapshot_seconds,
        recovery_seconds=stats.recovery_seconds, num_restored_pools=stats.num_restored_pools,
        num_restored_cached_blocks=stats.num_restored_cached_blocks,
        num_replayed_records=stats.num_replayed_records, num_dropped_pools=stats.num_dropped_pools,
    )
