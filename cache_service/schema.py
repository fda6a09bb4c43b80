"""Plain data in and out of the cache core (the domain side of cache.proto's messages)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cache_service.miss_reasons import MissBreakdown


@dataclass(slots=True)
class ReplicaLoad:
    """What a replica reports with every Step and Heartbeat."""

    num_waiting_requests: int = 0
    num_waiting_tokens: int = 0
    num_running_requests: int = 0
    host_load_cost: float = 0.0  # a loaded token's cost as a share of a computed one (0: not measured)
    disk_load_cost: float = 0.0
    peer_load_cost: float = 0.0  # a token pulled from another replica, the same way


@dataclass(slots=True)
class Admit:
    request_id: str
    token_ids: Sequence[int]
    namespace: str = ""
    num_lookahead_tokens: int = 0
    resumed: bool = False  # admitted before (preempted / pool lost): not counted in the hit rate


@dataclass(slots=True)
class Extend:
    request_id: str
    num_tokens: int  # total tokens the request must be able to hold
    num_lookahead_tokens: int = 0  # extra capacity beyond num_tokens (lookahead blocks)


@dataclass(slots=True)
class Finish:
    request_id: str
    output_token_ids: Sequence[int] = ()
    num_computed_tokens: int = 0
    block_table: Sequence[int] = ()  # empty: no consistency check


@dataclass(slots=True)
class Commit:
    request_id: str
    num_computed_tokens: int  # of the tokens sent at admission, then output_token_ids
    output_token_ids: Sequence[int] = ()  # tokens after those sent at admission (decode pages)


class CopyOutcome(NamedTuple):
    """A replica's report of a TierCopy: its first `num_pages_copied` pages completed."""

    copy_id: int
    num_pages_copied: int


class TierCopy(NamedTuple):
    """Copy pages src[i] -> dst[i] between two tiers of a replica (cache.proto TierCopy)."""

    copy_id: int
    src_tier: int
    dst_tier: int
    src: list[int]
    dst: list[int]
    # Set on copies to or from the disk tier (what a disk slot records and a load checks).
    namespace: str = ""
    parent_hash: int = 0
    page_hashes: list[int] = []
    token_bytes: bytes = b""


class DiskRun(NamedTuple):
    """A prefix a replica's disk tier holds from an earlier run (cache.proto DiskRun)."""

    namespace: str
    token_bytes: bytes  # whole pages, encoded (common.token_bytes)
    slots: list[int]


@dataclass(slots=True)
class TierSpec:
    """A replica's lower tiers (cache.proto TierConfig)."""

    num_host_slots: int = 0
    num_disk_slots: int = 0
    offload_policy: str = "evict"
    disk_runs: list[DiskRun] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.num_host_slots or self.num_disk_slots)

    def same_shape(self, other: TierSpec) -> bool:
        return (self.num_host_slots, self.num_disk_slots, self.offload_policy) == (
            other.num_host_slots, other.num_disk_slots, other.offload_policy)


@dataclass(slots=True)
class StepInput:
    releases: list[Finish] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)
    extends: list[Extend] = field(default_factory=list)
    admits: list[Admit] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    load: ReplicaLoad | None = None  # None: keep the last reported load
    copy_outcomes: list[CopyOutcome] = field(default_factory=list)
    pull_outcomes: list[CopyOutcome] = field(default_factory=list)  # of the last reply's PeerPulls


class PeerPull(NamedTuple):
    """Pages an admission pulls from another replica (cache.proto PeerPull; convert.py signs the
    ticket with `source_key`, which never leaves the cache manager otherwise)."""

    pull_id: int
    source_worker_id: str
    source_addr: str
    source_incarnation: str
    source_key: bytes
    src_tier: int  # TIER_DEVICE or TIER_HOST
    src: list[int]  # the source's blocks (or host slots)
    dst: list[int]  # the puller's
    namespace: str
    page_hashes: list[int]
    pin_seconds: float
    expires_at: float  # unix time the ticket runs out
    puller_worker_id: str


class AdmitResult(NamedTuple):
    request_id: str
    admitted: bool
    cached_tokens: int
    block_table: list[int]
    miss: MissBreakdown | None = None  # first admissions only
    loads: list[TierCopy] = []  # lower-tier pages copied into block_table after the cached ones
    pulls: list[PeerPull] = []  # then pages pulled from another replica


class ExtendResult(NamedTuple):
    request_id: str
    ok: bool
    new_block_ids: list[int]


class CommitResult(NamedTuple):
    request_id: str
    cached_tokens: int
    cached_block_ids: list[int]  # the request's block_table[:cached_tokens // block_size]


class StepResult(NamedTuple):
    admits: list[AdmitResult]
    extends: list[ExtendResult]
    commits: list[CommitResult]
    num_evicted_blocks: int
    num_free_blocks: int
    offloads: list[TierCopy] = []


class MatchInfo(NamedTuple):
    matched_tokens: int
    block_ids: list[int]
    host_tokens: int = 0  # after matched_tokens, held by the host tier, then the disk tier
    disk_tokens: int = 0


class ClearResult(NamedTuple):
    num_evicted_blocks: int
    num_locked_blocks: int


@dataclass(slots=True)
class TierStats:
    """One lower tier of a pool (cache.proto TierStats)."""

    num_slots: int
    num_cached_pages: int
    num_pending_pages: int
    hit_tokens: int
    num_loaded_pages: int
    num_offloaded_pages: int
    num_failed_pages: int
    num_evicted_pages: int


class PullStats(NamedTuple):
    """Peer pulls of a pool (cache.proto PullStats)."""

    num_pulls: int
    num_pulled_pages: int
    num_failed_pages: int
    peer_hit_tokens: int
    num_served_pulls: int
    num_pinned_pages: int
    num_expired_pins: int


@dataclass(slots=True)
class PoolStats:
    pool_id: str
    worker_id: str
    epoch: int
    model_fingerprint: str
    block_size: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_locked_blocks: int
    num_evictable_blocks: int
    num_private_blocks: int
    num_running_requests: int
    queried_tokens: int
    hit_tokens: int
    num_evicted_blocks: int
    num_admitted: int
    num_finished: int
    num_released: int
    lease_remaining_seconds: float
    serving_addr: str = ""
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    num_reservations: int = 0
    num_remembered_evicted_pages: int = 0
    restored: bool = False  # rebuilt from the state dir (cache_service/durable/)
    num_restored_cached_blocks: int = 0
    num_lookahead_blocks: int = 0
    host_tier: TierStats | None = None
    disk_tier: TierStats | None = None
    offload_policy: str = ""
    pulls: PullStats | None = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class DurableStats:
    """What Stats and metrics report about durability (cache_service/durable/)."""

    journal_bytes: int = 0
    journal_records: int = 0
    last_fsync_seconds: float = 0.0
    max_fsync_seconds: float = 0.0
    num_snapshots: int = 0
    last_snapshot_seconds: float = 0.0
    recovery_seconds: float = 0.0
    num_restored_pools: int = 0
    num_restored_cached_blocks: int = 0
    num_replayed_records: int = 0
    num_dropped_pools: int = 0  # pools whose replay did not verify
