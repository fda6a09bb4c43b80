"""Plain dataclasses for what the servers answer, built from the protobuf messages."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from protos import cache_pb2, model_pb2

from .errors import RadixKVError

T = TypeVar("T")


def from_proto(cls: type[T], message: Message) -> T:
    """Builds dataclass ``cls`` from the same-named fields of ``message`` (repeated -> list)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(message, f.name)
        values[f.name] = list(value) if not isinstance(value, (str, bytes, int, float, bool)) else value
    return cls(**values)


def finish_reason_name(reason: int) -> str | None:
    """``FINISH_REASON_STOP`` -> ``"stop"``; unspecified (not the last message) -> None."""
    if reason == model_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return model_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts and timings of one Generate call (sent with its last message)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    num_preemptions: int = 0
    # Why the uncached prompt tokens missed, at first admission (they add up to
    # prompt_tokens - cached_prompt_tokens): pages of the request's namespace this replica
    # evicted, pages of its namespace cached on another replica, new to the namespace.
    miss_evicted_tokens: int = 0
    miss_other_replica_tokens: int = 0
    miss_other_namespace_tokens: int = 0  # deprecated: always 0 (other namespaces never show)
    miss_new_tokens: int = 0
    served_by: str = ""  # the serving address of the replica that ran the request
    # cached_prompt_tokens by where their KV came from (docs/tiers.md, docs/kv-pulls.md): the
    # replica's KV pool, its host tier, its disk tier, another replica; 0 from servers without them.
    cached_device_tokens: int = 0
    cached_host_tokens: int = 0
    cached_disk_tokens: int = 0
    cached_peer_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token and its log probability at one position (the model's own: log_softmax of its
    logits, before penalties, temperature and other sampling controls)."""

    token_id: int
    logprob: float
    token: str  # the token decoded alone (ends in U+FFFD when it holds part of a UTF-8 character)
    token_bytes: bytes  # its exact bytes
    rank: int  # 1 for the most likely token at the position (0: entry 0 of prompt_logprobs)

    @classmethod
    def from_proto(cls, message: model_pb2.TokenLogprob) -> TokenLogprob:
        return cls(message.token_id, message.logprob, message.token, bytes(message.token_bytes), message.rank)


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """One position's log probabilities: the token there (``chosen``) and the most likely
    alternatives (``top``, most likely first; as many as the request's ``logprobs`` /
    ``prompt_logprobs`` asked)."""

    chosen: TokenLogprob
    top: list[TokenLogprob]

    @classmethod
    def from_proto(cls, message: model_pb2.PositionLogprobs) -> PositionLogprobs:
        return cls(TokenLogprob.from_proto(message.chosen), [TokenLogprob.from_proto(t) for t in message.top])


def _positions(messages: Any) -> list[PositionLogprobs]:
    return [PositionLogprobs.from_proto(m) for m in messages]


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """One streamed Generate message: the text and token ids new since the previous chunk.

    ``finish_reason`` ("stop", "length", "abort"), ``matched_stop`` and ``usage`` are set on
    the last chunk of each choice only. ``index`` is the choice the chunk belongs to (0 to
    ``n - 1``; with ``n`` > 1 the choices' chunks interleave). ``logprobs``: one entry per token
    in ``token_ids`` (with the ``logprobs`` option); ``prompt_logprobs``: one entry per prompt
    token, on choice 0's first chunk only (with the ``prompt_logprobs`` option).
    """

    text: str
    token_ids: list[int]
    request_id: str = ""
    finish_reason: str | None = None
    matched_stop: str = ""
    usage: Usage | None = None
    index: int = 0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)

    @classmethod
    def from_proto(cls, message: model_pb2.GenerateResponse) -> GenerateChunk:
        reason = finish_reason_name(message.finish_reason)
        return cls(
            text=message.text,
            token_ids=list(message.token_ids),
            request_id=message.request_id,
            finish_reason=reason,
            matched_stop=message.matched_stop,
            usage=from_proto(Usage, message.usage) if message.HasField("usage") else None,
            index=message.index,
            logprobs=_positions(message.logprobs),
            prompt_logprobs=_positions(message.prompt_logprobs),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``token_bytes`` as lists of ints, as OpenAI's ``bytes``)."""
        return jsonable(dataclasses.asdict(self))


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A whole completion (one choice): the chunks of a Generate stream joined.

    ``logprobs`` has one entry per token in ``token_ids`` when the ``logprobs`` option was given;
    ``prompt_logprobs`` one per prompt token when ``prompt_logprobs`` was (entry 0 scores
    nothing: rank 0, logprob 0, no alternatives), on choice 0.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    matched_stop: str = ""
    usage: Usage = field(default_factory=Usage)
    request_id: str = ""
    index: int = 0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)

    @classmethod
    def from_chunks(cls, chunks: list[GenerateChunk]) -> GenerateResult:
        """Joins one choice's chunks (all of the same ``index``; see ``choices_from_chunks``)."""
        last = chunks[-1] if chunks else GenerateChunk(text="", token_ids=[])
        return cls(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            finish_reason=last.finish_reason,
            matched_stop=last.matched_stop,
            usage=last.usage or Usage(),
            request_id=next((c.request_id for c in chunks if c.request_id), ""),
            index=last.index,
            logprobs=[p for c in chunks for p in c.logprobs],
            prompt_logprobs=[p for c in chunks for p in c.prompt_logprobs],
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``token_bytes`` as lists of ints, as OpenAI's ``bytes``)."""
        return jsonable(dataclasses.asdict(self))


def choices_from_chunks(chunks: list[GenerateChunk]) -> list[GenerateResult]:
    """The chunks of one Generate stream (choices interleaved) joined per choice, by ``index``."""
    by_index: dict[int, list[GenerateChunk]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).append(chunk)
    return [GenerateResult.from_chunks(by_index[i]) for i in sorted(by_index)]


def jsonable(value: Any) -> Any:
    """``value`` with bytes turned into lists of ints (json.dumps takes the rest as is)."""
    if isinstance(value, bytes):
        return list(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    """Token ids of a text (or chat), and the token strings, one per id."""

    token_ids: list[int]
    tokens: list[str]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model and its KV pool (ModelService.ModelInfo)."""

    model_name: str
    model_fingerprint: str
    vocab_size: int
    max_context_tokens: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int
    pool_id: str
    cache_addr: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    serving_addr: str = ""


@dataclass(frozen=True, slots=True)
class Load:
    """A replica's load now (ModelService.GetLoad)."""

    num_running_requests: int
    num_waiting_requests: int
    num_waiting_tokens: int  # prompt tokens not computed yet, of waiting and running requests
    kv_usage: float  # share of the KV pool not free, in [0, 1]
    num_blocks: int
    num_free_blocks: int
    prefix_hit_rate: float  # over first admissions since the replica started
    prompt_tokens: int
    cached_prompt_tokens: int
    serving_addr: str
    pool_id: str


@dataclass(frozen=True, slots=True)
class TierStats:
    """One lower tier (host or disk) of a pool (cache.proto TierStats, docs/tiers.md)."""

    num_slots: int
    num_cached_pages: int
    num_pending_pages: int  # reserved for copies not reported complete yet
    hit_tokens: int
    num_loaded_pages: int
    num_offloaded_pages: int
    num_failed_pages: int
    num_evicted_pages: int


@dataclass(frozen=True, slots=True)
class PullStats:
    """Peer pulls of a pool (cache.proto PullStats, docs/kv-pulls.md)."""

    num_pulls: int
    num_pulled_pages: int
    num_failed_pages: int  # computed instead
    peer_hit_tokens: int
    num_served_pulls: int  # of this pool's pages, by other replicas
    num_pinned_pages: int
    num_expired_pins: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One KV pool as the cache service sees it (CacheManager.Stats)."""

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
    hit_rate: float
    num_evicted_blocks: int
    num_admitted: int
    num_finished: int
    num_released: int
    lease_remaining_seconds: float
    serving_addr: str = ""
    # The replica's lower tiers (None: it has none, or the server predates tiers).
    host_tier: TierStats | None = None
    disk_tier: TierStats | None = None
    offload_policy: str = ""  # "evict" or "write-through"; "" without tiers
    pulls: PullStats | None = None  # peer pulls (None: the replica makes and serves none)


_TIER_FIELDS = ("host_tier", "disk_tier", "offload_policy", "pulls")


def _pool_stats(message: cache_pb2.PoolStats) -> PoolStats:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(PoolStats):
        if f.name not in _TIER_FIELDS:
            value = getattr(message, f.name)
            values[f.name] = list(value) if not isinstance(value, (str, bytes, int, float, bool)) else value
    for name in ("host_tier", "disk_tier"):
        if message.HasField(name):
            values[name] = from_proto(TierStats, getattr(message, name))
    if message.HasField("pulls"):
        values["pulls"] = from_proto(PullStats, message.pulls)
    if message.host_tier.num_slots or message.disk_tier.num_slots:
        policy = message.offload_policy or cache_pb2.OFFLOAD_POLICY_EVICT  # unspecified: the default
        try:
            values["offload_policy"] = (cache_pb2.OffloadPolicy.Name(policy).removeprefix("OFFLOAD_POLICY_")
                                        .lower().replace("_", "-"))
        except ValueError:  # a policy newer than this client
            values["offload_policy"] = str(policy)
    return PoolStats(**values)


def pool_stats_list(response: cache_pb2.StatsResponse) -> list[PoolStats]:
    return [_pool_stats(pool) for pool in response.pools]


def shard_pool_stats(answers: list[cache_pb2.StatsResponse | RadixKVError], pool_id: str) -> list[PoolStats]:
    """Every cache-manager shard's pools, from each shard's Stats reply or error in shard order: an
    error is raised, except a shard's NOT_FOUND for `pool_id` (another shard may hold it), which is
    raised only when no shard has the pool."""
    pools: list[PoolStats] = []
    not_found: RadixKVError | None = None
    for answer in answers:
        if not isinstance(answer, RadixKVError):
            pools.extend(pool_stats_list(answer))
        elif pool_id and answer.code == grpc.StatusCode.NOT_FOUND:
            not_found = answer
        else:
            raise answer
    if not pools and not_found is not None:
        raise not_found
    return pools
