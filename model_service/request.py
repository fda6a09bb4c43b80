"""One generation request as the scheduler and engine see it."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from model_service.detokenizer import IncrementalDetokenizer
from model_service.sampler import SamplingOptions

if TYPE_CHECKING:
    from model_service.logits_processors import ProcessorState
    from model_service.logprobs import Position
    from model_service.structured.guide import Guide


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    FORKING = "forking"  # a choice > 0 waiting for choice 0's first token (model_service/forks.py)
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ABORT = "abort"  # server shutting down (with an error) or an Abort call (without)
    ERROR = "error"  # the model step failed


class MissBreakdown(NamedTuple):
    """Why a prompt's uncached tokens missed at first admission (cache.proto MissBreakdown; each
    figure is of the request's own namespace)."""

    evicted_tokens: int = 0
    other_replica_tokens: int = 0
    new_tokens: int = 0


@dataclass(slots=True)
class Request:
    """Token state plus the cache state the cache manager handed out.

    The request computes tokens [num_computed_tokens, num_tokens): a prefill (or a chunk of it)
    when several are left, a decode when one is. KV for position p sits in
    block_table[p // block_size].

    `request_id` is the id the engine, the scheduler and the cache manager know it by, unique
    among live requests (model_service/request_ids.py); the caller's own id is
    `client_request_id`, unique per `owner` (the caller's principal key, "" when anonymous).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    max_tokens: int
    stop_token_ids: frozenset[int]
    namespace: str
    ignore_eos: bool
    arrival_time: float
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_admitted_tokens: int = 0  # tokens sent to the cache manager at the last admission
    num_shared_tokens: int = 0  # leading tokens whose pages the cache's tree holds (hit + commits)
    cached_prompt_tokens: int | None = None  # cache hit at first admission (None: never admitted)
    cached_tier_tokens: tuple[int, int, int] = (0, 0, 0)  # of those, loaded from the host / disk tier, pulled
    miss: MissBreakdown | None = None  # why the rest missed, at first admission
    # Pages being pulled into its blocks from another replica (model_service/kv_pulls/): a future
    # of (outcomes, tokens pulled); it is not scheduled until they arrived, nor its blocks released.
    pull: Future | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    client_request_id: str = ""  # the caller's id (echoed, logged, aborted by); "" = request_id
    owner: str = ""  # principal key of the caller (common.auth.Principal.key); "" when anonymous
    # Its logits processors' state (logit_bias, penalties, min_tokens), from its first sampled step
    # until it finishes; None when it uses none (model_service/logits_processors.py).
    processors: ProcessorState | None = None
    # Its structured output's matcher (model_service/structured/); None: free text.
    guide: Guide | None = None
    # SamplingParams.logprobs: alternatives to return with each token's log probability; None: none.
    logprobs: int | None = None
    # SamplingParams.prompt_logprobs: alternatives to return with each prompt token's log
    # probability; None: none. Prompt positions [0, num_scored_tokens) have been scored (row q
    # scores token q + 1); their Positions wait in prompt_positions for the first output.
    prompt_logprobs: int | None = None
    num_scored_tokens: int = 0
    prompt_positions: list[Position] = field(default_factory=list)
    # Parallel sampling (SamplingParams.n > 1): every choice holds the same list of all of them,
    # choice 0 first, and its own `index`. The others wait (FORKING) for choice 0's first token,
    # then fork from it (model_service/forks.py); `fork_source` is the request whose KV holds a
    # forked choice's prompt tail, until its first admission.
    index: int = 0
    choices: list[Request] = field(default_factory=list)
    fork_source: Request | None = None
    # The cache plan whose Step gave this finished request's blocks back (None: not yet).
    returned_by: object | None = None

    def __post_init__(self) -> None:
        if not self.client_request_id:
            self.client_request_id = self.request_id

    @property
    def log_id(self) -> str:
        """The caller's id for logs, with the internal id when they differ."""
        if self.client_request_id == self.request_id:
            return self.client_request_id
        return f"{self.client_request_id} (as {self.request_id})"

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def scoring_prompt(self) -> bool:
        """True while prompt positions are left to score for prompt_logprobs (the last one's
        logits are the first token's, sampled as any request's)."""
        return self.prompt_logprobs is not None and self.num_scored_tokens < len(self.prompt_token_ids) - 1

    @property
    def next_position(self) -> int:
        """The first position the request's next chunk runs through the model: where its KV ends,
        or, while its prompt is being scored, the first position not scored (the KV of positions
        before num_computed_tokens is kept, not rewritten)."""
        if self.scoring_prompt:
            return min(self.num_computed_tokens, self.num_scored_tokens)
        return self.num_computed_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the request still runs through the model (see `next_position`)."""
        return self.num_tokens - self.next_position

    @property
    def group(self) -> list[Request]:
        """All choices of the request's prompt (itself alone when n == 1)."""
        return self.choices or [self]

    @property
    def was_admitted(self) -> bool:
        """True once the cache manager admitted the request (a later admission is a resumption)."""
        return self.cached_prompt_tokens is not None

    def tokens_after_admitted(self, end: int | None = None) -> list[int]:
        """The request's tokens after those sent at its last admission, up to position `end`
        (default: all): the output_token_ids the cache manager needs in a Commit or Finish."""
        end = self.num_tokens if end is None else end
        if end <= self.num_admitted_tokens:
            return []
        n = len(self.prompt_token_ids)
        if self.num_admitted_tokens >= n:
            return self.output_token_ids[self.num_admitted_tokens - n:end - n]
        return self.all_token_ids[self.num_admitted_tokens:end]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def reset_cache_state(self) -> None:
        """Forget blocks and computed KV (preemption or a lost cache pool): recompute on re-admission."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_shared_tokens = 0
        self.pull = None  # settled before (Scheduler.before_release)
        self.status = RequestStatus.WAITING
