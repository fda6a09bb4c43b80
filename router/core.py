"""The router's logic, shared by the gRPC servicer and the OpenAI-compatible HTTP door.

It speaks to the replicas and the cache manager through two small ports (`ReplicaPort`,
`CachePort`; router/upstream.py implements them over gRPC, tests with fakes) and raises
`RouterError` with a gRPC status name, so nothing here depends on gRPC.

Generate: the prompt is tokenized once (a live replica's Tokenize; token ids pass through), the
policy orders the candidate replicas (router/policy.py), and the stream is proxied from the first
candidate that produces a first message, the request sent as token ids under the request's id
(the client's, or a fresh one) so the cache manager's reservation and a later Abort match it.
A candidate failing before its first message with a status of RETRYABLE_BEFORE_FIRST_MESSAGE is
skipped for the next one; any other status is the client's answer as it is. A failure once
output has been streamed ends the stream with UNAVAILABLE saying so: it is never replayed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from common.limits import quote_id
from protos import cache_pb2, model_pb2
from router import errors
from router.errors import RETRYABLE_BEFORE_FIRST_MESSAGE, RouterError, UpstreamError
from router.metrics import RouterMetrics
from router.policy import (
    FALLBACK_NO_CACHE_MANAGER,
    LEAST_LOADED,
    POLICIES,
    RETRY,
    ROUND_ROBIN,
    Rotation,
    RoutePlan,
    kv_plan,
    least_loaded,
)
from router.replicas import Load, ReplicaSet

log = logging.getLogger(__name__)

T = TypeVar("T")


class ReplicaPort(Protocol):
    """Calls to one model replica by address. Failures raise UpstreamError."""

    def generate(self, addr: str, request: model_pb2.GenerateRequest,
                 timeout: float | None) -> AsyncIterator[model_pb2.GenerateResponse]: ...
    async def tokenize(self, addr: str, request: model_pb2.TokenizeRequest,
                       timeout: float | None) -> model_pb2.TokenizeResponse: ...
    async def model_info(self, addr: str, timeout: float | None) -> model_pb2.ModelInfoResponse: ...
    async def abort(self, addr: str, request: model_pb2.AbortRequest, timeout: float | None) -> model_pb2.AbortResponse: ...
    async def get_load(self, addr: str, timeout: float | None) -> model_pb2.GetLoadResponse: ...
    async def check(self, addr: str, timeout: float | None) -> bool:
        """grpc.health.v1 Check of the whole server: SERVING or not (never raises)."""
        ...


class CachePort(Protocol):
    async def route(self, request: cache_pb2.RouteRequest, timeout: float | None) -> cache_pb2.RouteResponse: ...
    async def stats(self, timeout: float | None) -> cache_pb2.StatsResponse: ...


@dataclass(slots=True)
class CoreConfig:
    policy: str = "kv"
    # Route reservation of the chosen pool's cached prefix, until the replica admits the request.
    reserve_ms: int = 2000
    # Deadline of each Route / Stats call; the cache manager counts as unreachable past it.
    route_timeout_s: float = 1.0
    # After the cache manager failed, requests skip it for this long (the background check
    # brings routing back as soon as it answers again).
    cache_retry_s: float = 2.0
    # Deadline of each unary call to a replica (Tokenize, ModelInfo, Abort, GetLoad, health).
    call_timeout_s: float = 5.0
    # The router's own address (ModelInfo.serving_addr, GetLoad.serving_addr).
    serving_addr: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r} (one of {', '.join(POLICIES)})")


class RouterCore:
    def __init__(self, config: CoreConfig, replicas: ReplicaSet, upstream: ReplicaPort, cache: CachePort,
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.replicas = replicas
        self.upstream = upstream
        self.cache = cache
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self._clock = clock
        self._rotation = Rotation()  # round-robin and least-loaded ties
        self._unary_rotation = Rotation()  # Tokenize, ModelInfo
        self._cache_skip_until = 0.0
        self.cache_up: bool | None = None
        # request id -> (replica address, owner token) of every stream this router has open.
        self._inflight: dict[str, tuple[str, object]] = {}

    # ------------------------------------------------------------------ helpers

    def _timeout(self, deadline: float | None, cap: float | None = None) -> float | None:
        """Seconds left before `deadline` (absolute, on the core's clock), at most `cap`."""
        if deadline is None:
            return cap
        left = deadline - self._clock()
        if left <= 0:
            raise RouterError(errors.DEADLINE_EXCEEDED, "deadline exceeded at the router")
        return left if cap is None else min(left, cap)

    def _mark_cache(self, up: bool, why: str = "") -> None:
        if up:
            self._cache_skip_until = 0.0
            if self.cache_up is False:
                log.info("cache manager is back: routing by KV prefix again")
        else:
            self._cache_skip_until = self._clock() + self.config.cache_retry_s
            if self.cache_up is not False:
                log.warning("cache manager unreachable (%s): routing by load until it is back", why)
        self.cache_up = up
        self.metrics.cache_manager_up.set(1 if up else 0)

    def inflight(self, request_id: str) -> str | None:
        """The replica serving `request_id` through this router now, if any."""
        entry = self._inflight.get(request_id)
        return entry[0] if entry else None

    def _failed_before_first_message(self, addr: str, error: UpstreamError, failures: list[str]) -> str:
        """A replica failed before answering: raise the client's error unless the next replica may
        be tried (then mark an UNAVAILABLE one down and record why); returns the status name."""
        if error.code not in RETRYABLE_BEFORE_FIRST_MESSAGE:
            raise RouterError(error.code, error.message) from None
        if error.code == errors.UNAVAILABLE:
            self.replicas.mark(addr, False)
        failures.append(f"{addr}: {error.code} {error.message}")
        return error.code

    async def _any_replica(self, call: Callable[[str, float | None], Awaitable[T]], deadline: float | None,
                           what: str) -> T:
        """`call` on live replicas in rotation until one answers; statuses that say the replica
        could not take it move on, any other is raised as it is."""
        order = self._unary_rotation.order(self.replicas.live())
        if not order:
            raise RouterError(errors.UNAVAILABLE, "no model replica is reachable")
        failures: list[str] = []
        code = errors.UNAVAILABLE
        for addr in order:
            try:
                result = await call(addr, self._timeout(deadline, self.config.call_timeout_s))
            except UpstreamError as e:
                code = self._failed_before_first_message(addr, e, failures)
                continue
            self.replicas.mark(addr, True)
            return result
        raise RouterError(code, f"no replica answered {what}: " + "; ".join(failures))

    # ------------------------------------------------------------------ routing

    async def plan(self, token_ids: list[int], namespace: str, request_id: str,
                   deadline: float | None = None) -> RoutePlan:
        """The replicas to try for a prompt, best first, per the configured policy."""
        live = self.replicas.live()
        policy = self.config.policy
        if policy == "round-robin":
            return RoutePlan(self._rotation.order(live), ROUND_ROBIN)
        if policy == "least-loaded" or not token_ids:
            return RoutePlan(least_loaded(live, self._rotation), LEAST_LOADED)
        if self._clock() >= self._cache_skip_until:
            request = cache_pb2.RouteRequest(
                token_ids=token_ids, namespace=namespace, model_fingerprint=self.replicas.fingerprint,
                reserve_ms=self.config.reserve_ms, request_id=request_id)
            try:
                response = await self.cache.route(request, self._timeout(deadline, self.config.route_timeout_s))
            except UpstreamError as e:
                if e.code == errors.INVALID_ARGUMENT:  # the replica will say what is wrong with the prompt
                    return RoutePlan(least_loaded(live, self._rotation), LEAST_LOADED)
                self._mark_cache(False, f"Route: {e.code} {e.message}")
            else:
                self._mark_cache(True)
                now = self._clock()
                for c in response.candidates:
                    if c.serving_addr:
                        self.replicas.learn(c.serving_addr, pool_id=c.pool_id, load=Load(
                            c.load.num_running_requests, c.load.num_waiting_requests,
                            c.load.num_waiting_tokens + c.routed_tokens, now))
                live = self.replicas.live()
                plan = kv_plan(response.candidates, self.replicas, least_loaded(live, self._rotation))
                if plan.addrs:
                    return plan
                return RoutePlan(least_loaded(live, self._rotation), LEAST_LOADED)
        if any(r.load is not None for r in live):
            return RoutePlan(least_loaded(live, self._rotation), FALLBACK_NO_CACHE_MANAGER)
        return RoutePlan(self._rotation.order(live), FALLBACK_NO_CACHE_MANAGER)

    # ------------------------------------------------------------------ Generate

    async def _prompt_ids(self, request: model_pb2.GenerateRequest, deadline: float | None) -> list[int] | None:
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "prompt":
            tokenize = model_pb2.TokenizeRequest(text=request.prompt)
        elif kind == "chat":
            tokenize = model_pb2.TokenizeRequest(chat=request.chat)
        else:
            return None  # no input: the replica answers INVALID_ARGUMENT
        response = await self._any_replica(
            lambda addr, timeout: self.upstream.tokenize(addr, tokenize, timeout), deadline, "Tokenize")
        return list(response.token_ids)

    async def generate(self, request: model_pb2.GenerateRequest,
                       deadline: float | None = None) -> AsyncIterator[model_pb2.GenerateResponse]:
        """Proxies one Generate stream (see the module docstring). Raises RouterError."""
        arrival = self._clock()
        upstream = model_pb2.GenerateRequest()
        upstream.CopyFrom(request)
        request_id = upstream.request_id = request.request_id or uuid.uuid4().hex
        token_ids = await self._prompt_ids(request, deadline)
        if token_ids is not None and request.WhichOneof("input") != "token_ids":
            upstream.token_ids.CopyFrom(model_pb2.TokenIds(ids=token_ids))  # clears prompt / chat
        plan = await self.plan(token_ids or [], request.namespace, request_id, deadline)
        if not plan.addrs:
            raise RouterError(errors.UNAVAILABLE, "no model replica is reachable")
        self.metrics.decisions.labels(plan.reason).inc()
        self.metrics.routing_seconds.observe(self._clock() - arrival)
        failures: list[str] = []
        code = errors.UNAVAILABLE
        for attempt, addr in enumerate(plan.addrs):
            if attempt:
                self.metrics.decisions.labels(RETRY).inc()
                log.info("request %s: retrying on %s after %s", request_id, addr, failures[-1])
            stream = self.upstream.generate(addr, upstream, self._timeout(deadline))
            owner = object()
            self._inflight[request_id] = (addr, owner)
            replica = self.replicas.get(addr)
            if replica is not None:
                replica.inflight += 1
                replica.requests += 1
            outcome = errors.UNKNOWN
            try:
                try:
                    message = await anext(stream)
                except StopAsyncIteration:
                    message = None
                    error = UpstreamError(errors.UNAVAILABLE, "the stream ended without a message")
                except UpstreamError as e:
                    message, error = None, e
                if message is None:
                    outcome = error.code
                    code = self._failed_before_first_message(addr, error, failures)
                    continue
                self.metrics.first_message_seconds.observe(self._clock() - arrival)
                async for forwarded in self._forward(addr, message, stream):
                    yield forwarded
                outcome = errors.OK
                return
            except RouterError as e:
                outcome = e.code
                raise
            except (asyncio.CancelledError, GeneratorExit):
                outcome = errors.CANCELLED
                raise
            finally:
                await stream.aclose()
                if replica is not None:
                    replica.inflight -= 1
                if self._inflight.get(request_id, (None, None))[1] is owner:
                    del self._inflight[request_id]
                self.metrics.requests.labels(addr, outcome).inc()
        raise RouterError(code, f"no replica could take the request ({len(plan.addrs)} tried): "
                          + "; ".join(failures))

    async def _forward(self, addr: str, first: model_pb2.GenerateResponse,
                       stream: AsyncIterator[model_pb2.GenerateResponse]) -> AsyncIterator[model_pb2.GenerateResponse]:
        """The replica's messages from `first` on, Usage.served_by filled in; a failure after output
        was streamed becomes UNAVAILABLE (DEADLINE_EXCEEDED stays itself)."""
        message: model_pb2.GenerateResponse | None = first
        sent_tokens = 0
        finished = False
        while message is not None:
            if message.HasField("usage") and not message.usage.served_by:
                message.usage.served_by = addr
            finished = message.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED
            sent_tokens += len(message.token_ids)
            received = self._clock()
            yield message
            self.metrics.forward_seconds.observe(self._clock() - received)
            if finished:
                return
            try:
                message = await anext(stream)
            except StopAsyncIteration:
                message = None
            except UpstreamError as e:
                if e.code == errors.DEADLINE_EXCEEDED:
                    raise RouterError(e.code, e.message) from None
                if e.code == errors.UNAVAILABLE:
                    self.replicas.mark(addr, False)
                raise RouterError(errors.UNAVAILABLE,
                                  f"replica {addr} failed mid-stream ({e.code}: {e.message}); partial output "
                                  f"was sent ({sent_tokens} tokens), the request was not retried") from None
        if not finished:
            raise RouterError(errors.UNAVAILABLE, f"replica {addr} ended the stream before its last message; "
                              f"partial output was sent ({sent_tokens} tokens), the request was not retried")

    # ------------------------------------------------------------------ unary calls

    async def tokenize(self, request: model_pb2.TokenizeRequest,
                       deadline: float | None = None) -> model_pb2.TokenizeResponse:
        return await self._any_replica(
            lambda addr, timeout: self.upstream.tokenize(addr, request, timeout), deadline, "Tokenize")

    async def model_info(self, deadline: float | None = None) -> model_pb2.ModelInfoResponse:
        """A live replica's ModelInfo, with the router's own serving_addr (and no pool: there are
        several behind it)."""
        info = await self._any_replica(
            lambda addr, timeout: self.upstream.model_info(addr, timeout), deadline, "ModelInfo")
        answer = model_pb2.ModelInfoResponse()
        answer.CopyFrom(info)
        answer.serving_addr = self.config.serving_addr
        answer.pool_id = ""
        return answer

    async def served_model(self, deadline: float | None = None) -> model_pb2.ModelInfoResponse:
        """The served model's info, from the last check when known (no call)."""
        info = self.replicas.model_info()
        if isinstance(info, model_pb2.ModelInfoResponse):
            return info
        return await self.model_info(deadline)

    async def abort(self, request_id: str, deadline: float | None = None) -> model_pb2.AbortResponse:
        """Forwards Abort to the replica serving `request_id`; NOT_FOUND when none is."""
        addr = self.inflight(request_id)
        if addr is None:
            raise RouterError(errors.NOT_FOUND, f"no request {quote_id(request_id)} is in flight at this router")
        try:
            return await self.upstream.abort(addr, model_pb2.AbortRequest(request_id=request_id),
                                             self._timeout(deadline, self.config.call_timeout_s))
        except UpstreamError as e:
            raise RouterError(e.code, e.message) from None

    async def get_load(self, deadline: float | None = None) -> model_pb2.GetLoadResponse:
        """The sum of every live replica's GetLoad (those that answer)."""
        live = self.replicas.live()
        timeout = self._timeout(deadline, self.config.call_timeout_s)
        answers = await asyncio.gather(*(self.upstream.get_load(r.addr, timeout) for r in live),
                                       return_exceptions=True)
        total = model_pb2.GetLoadResponse(serving_addr=self.config.serving_addr)
        answered = 0
        failures: list[str] = []
        for replica, answer in zip(live, answers, strict=True):
            if isinstance(answer, UpstreamError):
                failures.append(f"{replica.addr}: {answer.code} {answer.message}")
                continue
            if isinstance(answer, BaseException):
                raise answer
            answered += 1
            self.replicas.set_load(replica.addr, _load(answer, self._clock()))
            for name in ("num_running_requests", "num_waiting_requests", "num_waiting_tokens", "num_blocks",
                         "num_free_blocks", "prompt_tokens", "cached_prompt_tokens"):
                setattr(total, name, getattr(total, name) + getattr(answer, name))
        if not answered:
            raise RouterError(errors.UNAVAILABLE, "no replica answered GetLoad"
                              + (": " + "; ".join(failures) if failures else " (none is reachable)"))
        if total.num_blocks:
            total.kv_usage = 1.0 - total.num_free_blocks / total.num_blocks
        if total.prompt_tokens:
            total.prefix_hit_rate = total.cached_prompt_tokens / total.prompt_tokens
        return total

    # ------------------------------------------------------------------ background checks

    async def refresh(self) -> bool:
        """One round of background checks: the cache manager's pools (replicas and their load),
        then every known replica's health, load and (once) ModelInfo. Returns whether some
        replica is reachable."""
        try:
            stats = await self.cache.stats(self.config.route_timeout_s)
        except UpstreamError as e:
            self._mark_cache(False, f"Stats: {e.code} {e.message}")
        else:
            self._mark_cache(True)
            now = self._clock()
            for pool in stats.pools:
                if pool.serving_addr:
                    self.replicas.learn(pool.serving_addr, pool_id=pool.pool_id, fingerprint=pool.model_fingerprint,
                                        load=Load(pool.load.num_running_requests, pool.load.num_waiting_requests,
                                                  pool.load.num_waiting_tokens, now))
        await asyncio.gather(*(self._check(r.addr) for r in self.replicas.all()))
        for addr in self.replicas.forget_stale():
            log.info("forgot replica %s (unreachable and no longer listed by the cache manager)", addr)
        reachable = sum(1 for r in self.replicas.all() if r.reachable)
        self.metrics.replicas_reachable.set(reachable)
        return reachable > 0

    async def _check(self, addr: str) -> None:
        timeout = self.config.call_timeout_s
        was = self.replicas.get(addr)
        ok = await self.upstream.check(addr, timeout)
        if was is not None and was.reachable is not ok:
            log.log(logging.INFO if ok else logging.WARNING, "replica %s is %s", addr, "up" if ok else "down")
        self.replicas.mark(addr, ok)
        if not ok:
            return
        try:
            self.replicas.set_load(addr, _load(await self.upstream.get_load(addr, timeout), self._clock()))
        except UpstreamError:
            pass  # a replica without GetLoad: Route's load (or none) is used
        replica = self.replicas.get(addr)
        if replica is not None and replica.info is None:
            try:
                info = await self.upstream.model_info(addr, timeout)
            except UpstreamError as e:
                log.warning("replica %s: ModelInfo failed: %s %s", addr, e.code, e.message)
            else:
                self.replicas.set_info(addr, info, info.model_fingerprint)
                if self.replicas.fingerprint and info.model_fingerprint != self.replicas.fingerprint:
                    log.warning("replica %s serves another model (%s, fingerprint %s): not routed to",
                                addr, info.model_name, info.model_fingerprint)

    async def run_checks(self, interval_s: float, on_change: Callable[[bool], Awaitable[None]]) -> None:
        """Background task: refresh() every `interval_s`, `on_change(reachable)` when some replica
        becomes reachable or none is any more."""
        reachable: bool | None = None
        while True:
            try:
                now_reachable = await self.refresh()
            except Exception:  # never let the health loop die
                log.exception("background check failed")
                now_reachable = self.replicas.any_reachable()
            if now_reachable is not reachable:
                reachable = now_reachable
                await on_change(reachable)
            await asyncio.sleep(interval_s)


def _load(answer: model_pb2.GetLoadResponse, now: float) -> Load:
    return Load(answer.num_running_requests, answer.num_waiting_requests, answer.num_waiting_tokens, now)
