"""The pipelined engine step: the cache `Step` for the next step is in flight while this step's
forward pass runs, so the cache manager's latency is off the critical path.

At most one Step is in flight, so the cache manager applies them in order. Each engine step:
  1. collects the reply in flight if it has arrived, or waits for it when a running request has no
     block for its next token (or there is nothing else to run); then, when requests are waiting
     and either the step computes a long prompt or the waiting requests are one (SYNC_ADMIT_TOKENS
     each), sends a Step and waits for it, so that what it admits joins this step;
  2. builds the batch from the blocks at hand;
  3. when nothing is in flight, plans the Step for the step after this batch (finishes, releases and
     commits known now, extensions with lookahead, admissions) and sends it;
  4. runs the forward pass.
Nothing the forward pass reads or writes depends on a reply not yet applied: blocks the cache
hands out or frees in a Step are ones this side does not use until that reply is applied (see
DESIGN.md "Off the critical path").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from model_service.cache_client import CacheClient, StepCall
from model_service.metrics import ModelMetrics
from model_service.scheduler import CachePlan, CacheReply, ScheduledBatch, Scheduler

# A step that computes at least this many prompt tokens is long next to a cache round trip: if
# requests are waiting, a Step is sent and awaited before its batch is built, so those it admits
# (say, a prefix group's followers, once their leader's pages are committed) join this step
# instead of the next one, a whole long step later. Waiting requests of this many tokens are such
# work themselves: a short step (decodes) waits for their admission too, rather than running
# without them (otherwise, with prefix groups sent at once, whole decode steps ran before
# followers that could have joined them).
SYNC_ADMIT_TOKENS = 256

ApplyReply = Callable[[CachePlan, CacheReply], None]
Execute = Callable[[ScheduledBatch], None]


class _InFlight(NamedTuple):
    plan: CachePlan
    call: StepCall
    generation: int  # the scheduler's generation it was planned in (a reset voids it)
    sent_at: float


def step_and_wait(cache: CacheClient, plan: CachePlan, metrics: ModelMetrics) -> CacheReply:
    """Sends `plan` as a Step and blocks for its reply (the engine waits: counted as a wait).
    Raises CachePoolLost."""
    started = time.perf_counter()
    reply = cache.step(plan)
    waited = time.perf_counter() - started
    metrics.cache_rpc.observe(waited)
    metrics.observe_cache_wait(waited)
    return reply


class CachePipeline:
    """Runs engine steps with the cache Step one step ahead (engine thread only)."""

    def __init__(self, cache: CacheClient, scheduler: Scheduler, metrics: ModelMetrics,
                 before_wait: Callable[[], None] = lambda: None) -> None:
        """`before_wait`: called before the engine thread blocks on a Step's reply (the engine
        hands its queued outputs over then, rather than holding them through the wait)."""
        self.cache = cache
        self.scheduler = scheduler
        self.metrics = metrics
        self.before_wait = before_wait
        self._flight: _InFlight | None = None

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def step(self, apply: ApplyReply, execute: Execute) -> None:
        """One engine step. Raises CachePoolLost when the Step in flight failed (its plan is void)."""
        scheduler = self.scheduler
        if self._flight is not None and self._flight.generation != scheduler.generation:
            self._flight = None  # the pool was lost since it was sent: its reply means nothing now
        worth_waiting = self._admissions_worth_waiting()
        if self._flight is not None and (self._flight.call.done() or scheduler.needs_reply() or worth_waiting):
            self.collect(apply)
            worth_waiting = self._admissions_worth_waiting()
        if self._flight is None and self.cache.registered and worth_waiting:
            self._step_now(apply)
        batch = scheduler.build_batch()
        if not batch.chunks and self._flight is not None:
            self.collect(apply, idle=not scheduler.has_work())
            batch = scheduler.build_batch()
        if self._flight is None and self.cache.registered:
            plan = scheduler.plan_cache_step(ahead=batch)
            if not plan.is_empty:
                self._flight = _InFlight(plan, self.cache.step_async(plan), scheduler.generation,
                                         time.perf_counter())
        if batch.chunks:
            execute(batch)

    def _admissions_worth_waiting(self) -> bool:
        """Whether requests wait that a Step now should admit into this step (see SYNC_ADMIT_TOKENS)."""
        scheduler = self.scheduler
        return bool(scheduler.waiting) and (
            scheduler.num_prefill_tokens() >= SYNC_ADMIT_TOKENS
            or scheduler.admissible_waiting_tokens(SYNC_ADMIT_TOKENS) >= SYNC_ADMIT_TOKENS)

    def _step_now(self, apply: ApplyReply) -> None:
        """A synchronous Step for the batch about to be built (nothing is in flight)."""
        plan = self.scheduler.plan_cache_step()
        if not plan.is_empty:
            self.before_wait()
            apply(plan, step_and_wait(self.cache, plan, self.metrics))

    def collect(self, apply: ApplyReply, idle: bool = False) -> None:
        """Waits for the Step in flight, if any, and applies its reply. Raises CachePoolLost.
        `idle`: nothing waits for it (say, the last finishes), so it is not counted as a wait."""
        flight, self._flight = self._flight, None
        if flight is None or flight.generation != self.scheduler.generation:
            return
        if idle or flight.call.done():
            reply = flight.call.result()
        else:
            self.before_wait()
            started = time.perf_counter()
            reply = flight.call.result()
            self.metrics.observe_cache_wait(time.perf_counter() - started)
        self.metrics.cache_rpc.observe(flight.call.elapsed if flight.call.elapsed is not None
                                       else time.perf_counter() - flight.sent_at)
        apply(flight.plan, reply)
