"""The engine loop: scheduler + one cache Step + model forward + sampling, in its own thread.
With the cache pipeline on (default), that Step is the next step's, in flight while this step's
forward runs (model_service/cache_pipeline.py); off, it is waited for before the forward.

The gRPC servicer submits requests and receives `GenerationOutput`s through a sink callback
(called from the engine thread); it may abort a caller's live request by the caller's id (ids
are scoped to the caller, model_service/request_ids.py) and read the engine's load from any
thread. A step's outputs go to their sinks together, inside `output_batch()`,
when the next forward begins (or before the engine thread waits on anything, or at once when no
forward follows): one wake-up of the event loop that streams them, which then runs while the
forward's threads are in torch ops rather than while the engine thread needs the GIL for its own
Python. Failures of the cache manager never fail a client:
the engine re-registers its pool and recomputes in-flight requests.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from model_service.cache_client import CacheClient, CachePoolLost
from model_service.cache_pipeline import CachePipeline, step_and_wait
from model_service.copy_costs import PEER, CopyCosts
from model_service.forks import copy_prompt_tails, sampling_rows, unforked
from model_service.kv_pulls.puller import PeerPuller
from model_service.logits_processors import LogitsProcessors
from model_service.logprobs import Position, positions, record_prompt_scores, take_prompt_logprobs
from model_service.metrics import ModelMetrics
from model_service.model_runner import ModelRunner
from model_service.reattach import reconcile
from model_service.request import FinishReason, MissBreakdown, Request, RequestStatus
from model_service.request_ids import LiveRequests
from model_service.sampler import Sampler
from model_service.scheduler import CachePlan, CacheReply, QueueFullError, ScheduledBatch, Scheduler
from model_service.structured.decoding import GuidedDecoding
from model_service.tiers.copier import TierCopier
from protos import cache_pb2

log = logging.getLogger(__name__)


def _first_admission(request: Request) -> bool:
    """Whether its admission counts in the hit rate: a prompt's first (not a preempted one's, not a fork's)."""
    return request.num_preemptions == 0 and request.index == 0


class Usage(NamedTuple):
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float
    total_time: float
    num_preemptions: int
    # Why the uncached prompt tokens missed, at first admission (zeros when never admitted).
    miss_evicted_tokens: int = 0
    miss_other_replica_tokens: int = 0
    miss_new_tokens: int = 0
    # Of cached_prompt_tokens, those loaded from the host / disk tier (the rest: the KV pool's).
    cached_host_tokens: int = 0
    cached_disk_tokens: int = 0
    cached_peer_tokens: int = 0  # pulled from another replica


class EngineLoad(NamedTuple):
    """The engine's load, as of its last step (a snapshot any thread may read)."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_waiting_tokens: int = 0  # tokens still to prefill, of waiting and running requests
    num_blocks: int = 0
    num_free_blocks: int = 0  # as the cache manager's last Step reply said
    prompt_tokens: int = 0  # prompt tokens of first admissions since start
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache

    @property
    def kv_usage(self) -> float:
        """Share of the pool not free (cached or held by requests), in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class GenerationOutput(NamedTuple):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    usage: Usage | None = None
    error: str = ""
    logprobs: list[Position] | None = None  # one per token id, when the request asked for them
    index: int = 0  # the choice (SamplingParams.n)
    prompt_logprobs: list[Position] | None = None  # choice 0's first output, when asked for


OutputSink = Callable[[GenerationOutput], None]


@dataclass(slots=True)
class EngineConfig:
    eos_token_ids: frozenset[int]
    max_context_tokens: int
    idle_poll_seconds: float = 0.5
    register_retry_seconds: float = 0.5
    # Overlap each cache Step with the previous step's forward pass (model_service/cache_pipeline.py);
    # False: one Step, waited for, before each forward (the synchronous path).
    cache_pipeline: bool = True


class Engine:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 cache: CacheClient, metrics: ModelMetrics, tiers: TierCopier | None = None,
                 puller: PeerPuller | None = None) -> None:
        """`tiers`: the replica's host / disk tiers (model_service/tiers/), None without. `puller`:
        pulls pages from other replicas (model_service/kv_pulls/), None when this replica does not."""
        self.config = config
        self.tiers = tiers
        self.puller = puller
        # What copying a token costs next to computing it (shared with the tiers and the puller).
        self.costs = tiers.costs if tiers is not None else puller.costs if puller is not None else CopyCosts()
        if tiers is not None:  # disk writes finish on their own thread: their outcomes go in a later Step
            scheduler.finished_copy_outcomes = tiers.finished_outcomes
            tiers.on_write_done = lambda: self._inbox.put(("wake",))
        # Pulls run on the puller's threads while the engine runs other requests (Request.pull).
        scheduler.before_release = self._settle_pull
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        # logit_bias, penalties and min_tokens, applied to the logits before the sampler picks
        self.processors = LogitsProcessors(config.eos_token_ids, scheduler.config.max_num_seqs)
        # structured outputs: token masks computed while the forward runs (model_service/structured/)
        self.guided = GuidedDecoding()
        self.cache = cache
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, OutputSink] = {}
        self._outbox: list[tuple[OutputSink, GenerationOutput]] = []  # outputs not handed to sinks yet
        # Entered around each hand-over of outputs (the servicer sets its LoopRelay's batch).
        self.output_batch: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
        self._requests: dict[str, Request] = {}
        self._last_token_time: dict[str, float] = {}
        self._stopping = threading.Event()
        self._count_lock = threading.Lock()
        self._num_in_flight = 0  # submitted, not finished
        self._num_running = 0  # len(scheduler.running), kept in sync by the engine thread
        self._live = LiveRequests()  # submitted, not finished, by caller (guarded by _count_lock)
        self._num_free_blocks = cache.num_blocks
        self._prompt_tokens = 0
        self._cached_prompt_tokens = 0
        # Replaced whole by the engine thread after every change, read by any thread.
        self.load = EngineLoad(num_blocks=cache.num_blocks, num_free_blocks=cache.num_blocks)
        self._pipeline = (CachePipeline(cache, scheduler, metrics, before_wait=self._flush_outputs)
                          if config.cache_pipeline else None)
        self._thread = threading.Thread(target=self._run, name="radixkv-engine", daemon=True)

    # ------------------------------------------------------------------ API (any thread)

    def start(self) -> None:
        self._thread.start()
        self.cache.keep_lease_alive(self._stopping)  # covers steps longer than the lease

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)
        if self.tiers is not None and not self._thread.is_alive():
            self.tiers.close()  # the disk tier's file flushed (its pages survive a restart)
        if self.puller is not None and not self._thread.is_alive():
            self.puller.close()
        self.guided.close()

    def submit(self, request: Request, sink: OutputSink) -> None:
        """Queues a request (never blocks) and sets its `request_id` to the unique id it runs
        under (its client id unless another caller's live request holds that). Raises
        DuplicateRequestError when its owner has a live request with its client id,
        QueueFullError when the waiting queue is full; either way nothing is kept."""
        with self._count_lock:
            self._live.check_free(request)
            if self._num_in_flight - self._num_running >= self.scheduler.config.max_waiting:
                raise QueueFullError(f"waiting queue is full ({self.scheduler.config.max_waiting} requests)")
            self._live.add(request)
            self._num_in_flight += len(request.group)
            self.metrics.live_request_ids.set(len(self._live))
            self._inbox.put(("add", request, sink))  # under the lock: an abort() for it comes after

    def cancel(self, request: Request) -> None:
        """Ends `request` (its client went away) without a final output; no-op once it finished."""
        self._inbox.put(("cancel", request))

    def is_live(self, owner: str, client_request_id: str) -> bool:
        """True while `owner` has a submitted, unfinished request with this client id."""
        with self._count_lock:
            return self._live.get(owner, client_request_id) is not None

    def abort(self, owner: str, client_request_id: str) -> bool:
        """Ends `owner`'s live request with this client id: its sink gets a final output with
        FinishReason.ABORT and usage (no error), its blocks go back to the cache. Returns False
        when `owner` has no live request with this id (another owner's request is never
        touched)."""
        with self._count_lock:
            request = self._live.get(owner, client_request_id)
            if request is None:
                return False
            self._inbox.put(("abort", request))  # the object: never a later request with its id
        return True

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self._has_work())
                if self._stopping.is_set():
                    break
                if not self.cache.registered:
                    self._flush_outputs()  # not held through registration attempts
                    self._try_register()
                else:
                    # Renew the lease when due, busy or not: decode steps make no cache RPC until a
                    # request needs a new block or finishes, which can take longer than the lease.
                    self._heartbeat()
                    if self.cache.registered and self._has_work():
                        self._step()
                        self._publish_load()
                if self._outbox and not self._forward_next():
                    self._flush_outputs()
        except Exception:
            log.exception("engine loop crashed")
            raise
        finally:
            self._abort_all("server shutting down")
            self._flush_outputs()

    def _forward_next(self) -> bool:
        """Whether the next loop turn likely runs a forward (which hands over the outputs first)."""
        return self.cache.registered and bool(self.scheduler.running)

    def _has_work(self) -> bool:
        """Something to do now: a step to run or a reply to collect (requests that only wait for
        their pulls are not: a finished pull wakes the loop)."""
        scheduler = self.scheduler
        pulls = [r.pull for r in scheduler.running if r.pull is not None]
        if pulls and len(pulls) == len(scheduler.running) and not (
                scheduler.waiting or scheduler.pending_finishes or scheduler.pending_releases
                or scheduler.pending_pull_outcomes or scheduler.pending_copy_outcomes
                or (self._pipeline is not None and self._pipeline.in_flight)
                or any(pull.done() for pull in pulls)):
            return False
        return (scheduler.has_work() or (self._pipeline is not None and self._pipeline.in_flight)
                or (self.tiers is not None and self.tiers.has_finished()))

    def _step(self) -> None:
        self._collect_pulls()
        if self._pipeline is not None:
            try:
                self._pipeline.step(self._apply_reply, self._execute)
            except CachePoolLost as e:
                self._on_pool_lost(str(e))
            return
        plan = self.scheduler.plan_cache_step()
        reply = CacheReply([], [])
        if not plan.is_empty:
            self._flush_outputs()  # not held through the wait
            try:
                reply = step_and_wait(self.cache, plan, self.metrics)  # the synchronous path waits for every Step
            except CachePoolLost as e:
                self._on_pool_lost(str(e))
                return
        self._apply_reply(plan, reply)
        batch = self.scheduler.build_batch()
        if batch.chunks:
            self._execute(batch)

    def _apply_reply(self, plan: CachePlan, reply: CacheReply) -> None:
        if reply.offloads or any(a.loads or a.pulls for a in reply.admits):
            reply = self._run_copies(plan, reply)
        preemptions_before = self.scheduler.num_preemptions
        self.scheduler.apply_reply(plan, reply)
        copy_prompt_tails([r for r, a in zip(plan.admits, reply.admits, strict=False)
                           if a.admitted and r.fork_source is not None], plan, self.runner.kv_cache)
        self.metrics.preemptions.inc(self.scheduler.num_preemptions - preemptions_before)
        if reply.num_free_blocks is not None:
            self._num_free_blocks = reply.num_free_blocks
        for request, admit in zip(plan.admits, reply.admits, strict=False):
            if admit.admitted and _first_admission(request):
                cached = admit.cached_tokens + admit.loaded_host_tokens + admit.loaded_disk_tokens
                self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
                self.metrics.cached_prompt_tokens.inc(cached)
                self._prompt_tokens += len(request.prompt_token_ids)
                self._cached_prompt_tokens += cached
                if admit.loaded_host_tokens:
                    self.metrics.tier_cached_tokens.labels("host").inc(admit.loaded_host_tokens)
                if admit.loaded_disk_tokens:
                    self.metrics.tier_cached_tokens.labels("disk").inc(admit.loaded_disk_tokens)
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.running.set(len(self.scheduler.running))
        self._sync_counts()

    def _run_copies(self, plan: CachePlan, reply: CacheReply) -> CacheReply:
        """Performs the reply's tier copies (offloads, then each admission's loads) before anything
        writes a block it handed out, and starts its pulls from other replicas (they run while
        other requests do: the request waits for them, `_collect_pulls`); the copies' outcomes go
        with the next Step, a pull's with the one after it ends. Copies this replica cannot make
        are reported failed (nothing loaded)."""
        tiers, puller = self.tiers, self.puller
        outcomes = self.scheduler.pending_copy_outcomes
        if tiers is not None:
            outcomes.extend(tiers.run_offloads(reply.offloads))
        admits = []
        for admit in reply.admits:
            whole = True
            if admit.loads:
                if tiers is not None:
                    done, host, disk = tiers.run_loads(admit.loads)
                else:
                    done, host, disk = [cache_pb2.CopyOutcome(copy_id=c.copy_id) for c in admit.loads], 0, 0
                outcomes.extend(done)
                admit = admit._replace(loaded_host_tokens=host, loaded_disk_tokens=disk)
                whole = all(o.num_pages_copied == len(c.src) for o, c in zip(done, admit.loads, strict=True))
            if admit.pulls:
                if puller is not None and whole:  # pulled pages follow the loaded ones: only after all of them
                    pulling = puller.start(admit.pulls)
                    pulling.add_done_callback(lambda _: self._inbox.put(("wake",)))
                    admit = admit._replace(pulling=pulling)
                else:
                    self.scheduler.pending_pull_outcomes.extend(
                        cache_pb2.CopyOutcome(copy_id=p.pull_id) for p in admit.pulls)
            admits.append(admit)
        return reply._replace(admits=admits)

    def _collect_pulls(self) -> None:
        """Requests whose pull ended: their pulled pages count as computed from now on."""
        for request in [r for r in self.scheduler.running if r.pull is not None and r.pull.done()]:
            self._pull_done(request)

    def _settle_pull(self, request: Request) -> None:
        """Waits for the pull still writing into `request`'s blocks (they are about to be given back)."""
        if request.pull is not None:
            self._pull_done(request)

    def _pull_done(self, request: Request) -> None:
        future, request.pull = request.pull, None
        outcomes, pulled = future.result()  # PeerPuller.run never raises: a failure is 0 pages
        self.scheduler.pending_pull_outcomes.extend(outcomes)
        if not pulled or request.is_finished:
            return
        request.num_computed_tokens += pulled
        if _first_admission(request) and request.cached_prompt_tokens is not None:
            request.cached_prompt_tokens += pulled  # a first admission's hit, as _apply_reply counts them
            host, disk, _ = request.cached_tier_tokens
            request.cached_tier_tokens = (host, disk, pulled)
            self.metrics.cached_prompt_tokens.inc(pulled)
            self.metrics.pull_cached_tokens.inc(pulled)
            self._cached_prompt_tokens += pulled

    def _execute(self, batch: ScheduledBatch) -> None:
        self._flush_outputs()  # the last step's: streamed while this forward runs
        # The rows sampled: with choices that fork now (n > 1), each samples choice 0's logits row.
        rows, sources = sampling_rows(batch.requests, batch.chunks)
        masks = self.guided.start(rows)  # the guided rows' allowed tokens, computed meanwhile
        started = time.perf_counter()
        try:
            step = self.runner.execute(batch.chunks)
        except Exception as e:  # a bug or OOM must not take the server down; fail this batch only
            log.exception("model forward failed")
            for request in batch.requests:
                self._finish(request, FinishReason.ERROR, "", error=f"model forward failed: {e}")
            return
        elapsed = time.perf_counter() - started
        self.metrics.step_time.observe(elapsed)
        if self.tiers is not None or self.puller is not None:  # what computing a token costs (copy_costs.py)
            self.costs.observe_forward(elapsed, sum(len(c.token_ids) for c in batch.chunks))
            host, disk = self.tiers.load_costs() if self.tiers is not None else (0.0, 0.0)
            self.cache.load_costs = (host, disk, self.costs.cost(PEER))
        self.metrics.steps.inc()
        self.scheduler.on_executed(batch)
        if step.scored is not None:
            try:
                record_prompt_scores(batch.requests, batch.chunks, step.scored)
            except Exception as e:  # as a failed forward: fail these requests, not the server
                log.exception("scoring the prompt failed")
                for request in batch.requests:
                    self._finish(request, FinishReason.ERROR, "", error=f"scoring the prompt failed: {e}")
                return
        if not rows:
            return
        logits = step.sampled
        try:
            if sources is not None:
                logits = logits.index_select(0, torch.tensor(sources, device=logits.device))
            wanted = [i for i, r in enumerate(rows) if r.logprobs is not None]
            # The model's own distribution: the raw logits, before any control changes them.
            raw = logits.index_select(0, torch.tensor(wanted, device=logits.device)) if wanted else None
            logits = self.processors.apply(logits, rows)
            with torch.inference_mode():
                GuidedDecoding.apply(logits, rows, masks)
            tokens = self.sampler.sample(logits, [r.sampling for r in rows], [r.generator for r in rows])
            self.processors.record(rows, tokens)
            token_list = tokens.tolist()
            complete = GuidedDecoding.advance(rows, token_list)
            per_row: list[Position | None] = [None] * len(rows)
            if raw is not None:
                picked = [token_list[i] for i in wanted]
                ks = [rows[i].logprobs or 0 for i in wanted]
                for i, position in zip(wanted, positions(raw, picked, ks), strict=True):
                    per_row[i] = position
        except Exception as e:  # as a failed forward: fail these requests, not the server
            log.exception("sampling failed")
            for request in rows:
                self._finish(request, FinishReason.ERROR, "", error=f"sampling failed: {e}")
            return
        if sources is not None:  # before any choice can finish: they are requests of their own now
            self.scheduler.add_forks([r for r in rows if r.status is RequestStatus.FORKING])
        for request, token, done, position in zip(rows, token_list, complete, per_row, strict=True):
            self._append_token(request, token, done, position)

    def _append_token(self, request: Request, token: int, format_complete: bool = False,
                      position: Position | None = None) -> None:
        """The request's next token. `format_complete`: its structured output is complete (or its
        grammar failed): it ends here. `position`: the token's log probabilities, when asked."""
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.ttft.observe(now - request.arrival_time)
        else:
            self.metrics.inter_token.observe(now - self._last_token_time.get(request.request_id, now))
        self._last_token_time[request.request_id] = now
        request.output_token_ids.append(token)
        self.metrics.generated_tokens.inc()
        extra = {"logprobs": [position] if position is not None else None,
                 "prompt_logprobs": take_prompt_logprobs(request)}
        if token in request.stop_token_ids:
            self._finish(request, FinishReason.STOP, request.detokenizer.finish(), [token], matched_stop=str(token),
                         **extra)
            return
        if token in self.config.eos_token_ids and (not request.ignore_eos or format_complete):
            self._finish(request, FinishReason.STOP, request.detokenizer.finish(), [token], **extra)
            return
        step = request.detokenizer.add(token)
        if step.stopped:
            self._finish(request, FinishReason.STOP, step.text, [token], matched_stop=step.matched_stop or "", **extra)
        elif format_complete:
            self._finish(request, FinishReason.STOP, step.text + request.detokenizer.finish(), [token], **extra)
        elif (len(request.output_token_ids) >= request.max_tokens
              or request.num_tokens >= self.config.max_context_tokens):
            self._finish(request, FinishReason.LENGTH, step.text + request.detokenizer.finish(), [token], **extra)
        else:
            self._emit(GenerationOutput(request.request_id, step.text, [token], index=request.index, **extra))

    def _finish(self, request: Request, reason: FinishReason, text: str, token_ids: list[int] | None = None,
                matched_stop: str = "", error: str = "", logprobs: list[Position] | None = None,
                prompt_logprobs: list[Position] | None = None) -> None:
        self.scheduler.finish(request, reason)
        self.metrics.requests.labels(reason.value).inc()
        now = time.monotonic()
        miss = request.miss or MissBreakdown()
        usage = Usage(
            prompt_tokens=len(request.prompt_token_ids),
            cached_prompt_tokens=request.cached_prompt_tokens or 0,
            completion_tokens=len(request.output_token_ids),
            time_to_first_token=(request.first_token_time or now) - request.arrival_time,
            total_time=now - request.arrival_time,
            num_preemptions=request.num_preemptions,
            miss_evicted_tokens=miss.evicted_tokens,
            miss_other_replica_tokens=miss.other_replica_tokens,
            miss_new_tokens=miss.new_tokens,
            cached_host_tokens=request.cached_tier_tokens[0],
            cached_disk_tokens=request.cached_tier_tokens[1],
            cached_peer_tokens=request.cached_tier_tokens[2],
        )
        # The id is free before the final output goes out: a client that reuses it as soon as it
        # sees the end of its stream must not be refused as a duplicate.
        sink = self._sinks.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self._sync_counts(finished=request)
        self._last_token_time.pop(request.request_id, None)
        self.processors.release(request)
        if sink is not None:
            self._outbox.append((sink, GenerationOutput(request.request_id, text, token_ids or [], reason,
                                                        matched_stop, usage, error, logprobs, request.index,
                                                        prompt_logprobs)))
        for choice in unforked(request):  # choice 0 ended before its first token: so do the others
            self._finish(choice, reason, "", error=error)

    def _sync_counts(self, finished: Request | None = None) -> None:
        """Keeps the counts `submit()` bounds the waiting queue with exact (engine thread only):
        call after every change to the running set, with a request that finished (its ids are
        freed here, on every way a request ends: they all go through `_finish`)."""
        with self._count_lock:
            if finished is not None:
                self._num_in_flight -= 1
                self._live.remove(finished)
                self.metrics.live_request_ids.set(len(self._live))
            self._num_running = len(self.scheduler.running)

    def _publish_load(self) -> None:
        """Replaces the load snapshot other threads read (the servicer, the heartbeat thread)."""
        queues = self.scheduler.load()
        self.cache.load = queues
        self.load = EngineLoad(queues.num_running_requests, queues.num_waiting_requests, queues.num_waiting_tokens,
                               self.cache.num_blocks, self._num_free_blocks, self._prompt_tokens,
                               self._cached_prompt_tokens)

    def _emit(self, output: GenerationOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is not None:
            self._outbox.append((sink, output))

    def _flush_outputs(self) -> None:
        """Hands the outputs queued so far to their sinks, in order, as one batch."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        with self.output_batch():
            for sink, output in outbox:
                sink(output)

    # ------------------------------------------------------------------ inbox, cache life

    def _drain_inbox(self, block: bool) -> None:
        timeout = self.config.idle_poll_seconds if block else None
        while True:
            try:
                item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            except queue.Empty:
                self._publish_load()
                return
            block = False
            kind = item[0]
            if kind == "add":
                _, request, sink = item
                self.scheduler.add(request)  # its other choices (n > 1) fork from it (forks.py)
                for choice in request.group:
                    self._requests[choice.request_id] = choice
                    self._sinks[choice.request_id] = sink
            elif kind in ("cancel", "abort"):
                for choice in item[1].group:
                    if self._requests.get(choice.request_id) is not choice:
                        continue  # finished already (a later request may hold its id)
                    if kind == "cancel":
                        log.info("request %s cancelled by the client", choice.log_id)
                        self._sinks.pop(choice.request_id, None)
                        self._finish(choice, FinishReason.CANCELLED, "")
                    else:
                        log.info("request %s aborted", choice.log_id)
                        self._finish(choice, FinishReason.ABORT, choice.detokenizer.finish())

    def _try_register(self) -> None:
        try:
            registration = self.cache.register()
        except CachePoolLost as e:
            # Down, or refusing this replica (PERMISSION_DENIED, RESOURCE_EXHAUSTED): the status says which.
            log.warning("registering with the cache manager at %s failed (%s); retrying", self.cache.address, e)
            self._stopping.wait(self.config.register_retry_seconds)
            return
        if registration.restored:  # the pool was kept: continue what still agrees (model_service/reattach.py)
            done = reconcile(self.scheduler, registration.held, self.cache.block_size)
            log.info("re-attached to the kept pool: %d requests continue without recompute, %d recomputed, "
                     "%d released", done.kept, done.recomputed, done.released)
        else:  # a fresh, empty pool: everything running is recomputed
            if self.scheduler.running:
                log.warning("new cache pool: recomputing %d running requests", len(self.scheduler.running))
            self.scheduler.reset()
            self._num_free_blocks = self.cache.num_blocks
        self._sync_counts()

    def _heartbeat(self) -> None:
        try:
            self.cache.heartbeat_if_due()
        except CachePoolLost as e:
            self._on_pool_lost(str(e))

    def _on_pool_lost(self, why: str) -> None:
        # Nothing runs until the next registration, which decides: a kept pool (same KV
        # incarnation) is reconciled, a new one means recomputing every running request.
        log.warning("cache pool lost (%s): re-registering; %d running requests wait for it",
                    why, len(self.scheduler.running))
        self.metrics.cache_reconnects.inc()
        self.cache.pool_id = ""  # re-register before any further Step
        # Pulls end first: their sources' pages stay pinned until this pool re-registers.
        for request in self.scheduler.running:
            self._settle_pull(request)
        # Copies the cache manager may not have seen reported: it stops waiting for them at the
        # re-registration (a kept pool drops its pending copies; a new pool never had them).
        self.scheduler.pending_copy_outcomes.clear()
        self.scheduler.pending_pull_outcomes.clear()
        if self.tiers is not None:
            self.tiers.reset()
        self._sync_counts()

    def _abort_all(self, why: str) -> None:
        if self._pipeline is not None and self.cache.registered:
            try:  # apply the Step in flight first, so the finishes below give back all its blocks
                self._pipeline.collect(self._apply_reply)
            except CachePoolLost:
                pass
        for request in list(self._requests.values()):
            self._finish(request, FinishReason.ABORT, request.detokenizer.finish(), error=why)
        if self.cache.registered and self.scheduler.has_work():
            try:  # best effort: give the blocks back now instead of at lease expiry
                plan = self.scheduler.plan_cache_step()
                plan.admits.clear()
                plan.extends.clear()
                plan.commits.clear()
                self.cache.step(plan)
            except CachePoolLost:
                pass
