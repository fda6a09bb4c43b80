"""The router's logic, shared by the gRPC servicer and the OpenAI-compatible HTTP door.

It speaks to the replicas and the cache manager through two small ports (`ReplicaPort`,
`CachePort`; router/upstream.py implements them over gRPC, tests with fakes) and raises
`RouterError` with a gRPC status name, so nothing here depends on gRPC.

Generate: the prompt is tokenized once (a live replica's Tokenize; token ids pass through) and
checked against the model's context (before Route: a prompt the model cannot take never adds
queued load anywhere), the policy orders the candidate replicas (router/policy.py), and the
stream is proxied from the first candidate that produces a first message, the request sent as
token ids. A candidate failing before its first message with a status of
RETRYABLE_BEFORE_FIRST_MESSAGE is skipped for the next one; any other status is the client's
answer as it is. A failure once output has been streamed ends the stream with UNAVAILABLE
saying so: it is never replayed.

Request ids belong to the caller (the principal of its token; "" without tokens): the router
keys its in-flight requests by (principal key, client id), refuses a second live request of the
same pair with ALREADY_EXISTS before doing anything else, and treats another principal's id as
unknown (Abort: NOT_FOUND; the same id is free for reuse). Upstream, every request carries a
fresh id of the router's own (Route's request_id and the replica's), so ids of different
callers never meet at a replica; the client's id is put back on every message.

Replicas are only ever the operator's (router/trust.py): addresses the cache manager reports
(Stats, Route candidates) outside the trust are skipped, logged once, counted, never called.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from common.limits import quote_id
from common.token_bytes import encode_tokens
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
from router.trust import resolve

if TYPE_CHECKING:
    from common.auth import Principal

log = logging.getLogger(__name__)

T = TypeVar("T")

# Untrusted addresses remembered so that each is logged once (bounded: the set is cleared when
# full, an address may then be logged again).
MAX_LOGGED_UNTRUSTED = 4096

Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(slots=True)
class InFlight:
    """One Generate this router is serving: its upstream id, the replica it is at now (None
    while tokenizing / routing, between attempts), and whether the client aborted it."""

    upstream_id: str
    addr: str | None = None
    aborted: bool = False


def _owner(principal: Principal | None) -> str:
    return principal.key if principal is not None else ""


class ReplicaPort(Protocol):
    """Calls to one model replica by address. Failures raise UpstreamError."""

    def generate(self, addr: str, request: model_pb2.GenerateRequest,
                 timeout: float | None) -> AsyncIterator[model_pb2.GenerateResponse]: ...
    async def tokenize(self, addr: str, request: model_pb2.TokenizeRequest,
                       timeout: float | None) -> model_pb2.TokenizeResponse: ...
    async def detokenize(self, addr: str, request: model_pb2.DetokenizeRequest,
                         timeout: float | None) -> model_pb2.DetokenizeResponse: ...
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
    # The best candidates a Route answers with (RouteRequest.max_candidates): replicas after
    # them are tried least loaded first, so a large fleet's answer stays small.
    route_candidates: int = 8
    # After the cache manager failed, requests skip it for this long (the background check
    # brings routing back as soon as it answers again).
    cache_retry_s: float = 2.0
    # Deadline of each unary call to a replica (Tokenize, Detokenize, ModelInfo, Abort, GetLoad,
    # health).
    call_timeout_s: float = 5.0
    # The router's own address (ModelInfo.serving_addr, GetLoad.serving_addr).
    serving_addr: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r} (one of {', '.join(POLICIES)})")


class RouterCore:
    def __init__(self, config: CoreConfig, replicas: ReplicaSet, upstream: ReplicaPort, cache: CachePort,
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 resolver: Resolver | None = None) -> None:
        self.config = config
        self.replicas = replicas
        self.upstream = upstream
        self.cache = cache
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self._clock = clock
        self._rotation = Rotation()  # round-robin and least-loaded ties
        self._unary_rotation = Rotation()  # Tokenize, Detokenize, ModelInfo
        self._cache_skip_until = 0.0
        self.cache_up: bool | None = None
        # (principal key, client request id) -> every Generate this router is serving.
        self._inflight: dict[tuple[str, str], InFlight] = {}
        self._resolver: Resolver = resolver if resolver is not None else resolve
        self._untrusted_logged: set[str] = set()
        self._dns_failing: set[tuple[str, int]] = set()

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

    def inflight(self, request_id: str, principal_key: str = "") -> str | None:
        """The replica serving the principal's `request_id` through this router now, if any."""
        entry = self._inflight.get((principal_key, request_id))
        return entry.addr if entry is not None else None

    def _trusted(self, addr: str, source: str) -> bool:
        """Whether the router may call `addr`, which the cache manager's `source` (stats, route)
        reported; an untrusted one is counted, and logged once."""
        if self.replicas.trust.trusted(addr):
            return True
        self.metrics.untrusted_addrs.labels(source).inc()
        if addr not in self._untrusted_logged:
            if len(self._untrusted_logged) >= MAX_LOGGED_UNTRUSTED:
                self._untrusted_logged.clear()
            self._untrusted_logged.add(addr)
            log.warning("replica address %s (the cache manager's %s) is not trusted: never called (trust it with "
                        "--replica, --replica-dns or --replica-allow)", quote_id(addr), source)
        return False

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
                packed_token_ids=encode_tokens(token_ids), namespace=namespace,
                model_fingerprint=self.replicas.fingerprint, reserve_ms=self.config.reserve_ms, request_id=request_id,
                max_candidates=self.config.route_candidates)
            try:
                response = await self.cache.route(request, self._timeout(deadline, self.config.route_timeout_s))
            except UpstreamError as e:
                if e.code == errors.INVALID_ARGUMENT:  # the replica will say what is wrong with the prompt
                    return RoutePlan(least_loaded(live, self._rotation), LEAST_LOADED)
                self._mark_cache(False, f"Route: {e.code} {e.message}")
            else:
                self._mark_cache(True)
                now = self._clock()
                # Untrusted candidates are dropped from the plan (never called, whatever their rank).
                candidates = [c for c in response.candidates
                              if c.serving_addr and self._trusted(c.serving_addr, "route")]
                for c in candidates:
                    self.replicas.learn(c.serving_addr, pool_id=c.pool_id, load=Load(
                        c.load.num_running_requests, c.load.num_waiting_requests,
                        c.load.num_waiting_tokens + c.routed_tokens, now))
                live = self.replicas.live()
                plan = kv_plan(candidates, self.replicas, least_loaded(live, self._rotation))
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

    async def _check_context(self, num_prompt: int, sampling: model_pb2.SamplingParams,
                             deadline: float | None) -> None:
        """INVALID_ARGUMENT, with the replica's own message, for a prompt the model's context
        cannot take (alone, or with its max_tokens)."""
        context = (await self.served_model(deadline)).max_context_tokens
        if not context:
            return
        if num_prompt >= context:
            raise RouterError(errors.INVALID_ARGUMENT,
                              f"prompt has {num_prompt} tokens; the model's context is {context} tokens")
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 0
        if max_tokens > 0 and num_prompt + max_tokens > context:
            raise RouterError(errors.INVALID_ARGUMENT,
                              f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                              f"context of {context} tokens")

    async def generate(self, request: model_pb2.GenerateRequest, deadline: float | None = None,
                       principal: Principal | None = None) -> AsyncIterator[model_pb2.GenerateResponse]:
        """Proxies one Generate stream of `principal` (None: the router runs without tokens; see
        the module docstring). Raises RouterError."""
        arrival = self._clock()
        client_id = request.request_id or uuid.uuid4().hex
        slot = (_owner(principal), client_id)
        if slot in self._inflight:  # refused before anything else: the live one is left as it is
            raise RouterError(errors.ALREADY_EXISTS, f"request {quote_id(client_id)} is already in flight at this "
                              "router")
        if principal is not None and not principal.may_read(request.namespace):
            raise RouterError(errors.PERMISSION_DENIED,
                              f"this token may not use namespace {quote_id(request.namespace)}")
        entry = self._inflight[slot] = InFlight(uuid.uuid4().hex)
        try:
            token_ids = await self._prompt_ids(request, deadline)
            if token_ids is not None:
                await self._check_context(len(token_ids), request.sampling, deadline)
            upstream = model_pb2.GenerateRequest()
            upstream.CopyFrom(request)
            upstream.request_id = entry.upstream_id
            if token_ids is not None and request.WhichOneof("input") != "token_ids":
                upstream.token_ids.CopyFrom(model_pb2.TokenIds(ids=token_ids))  # clears prompt / chat
            plan = RoutePlan([], LEAST_LOADED)
            if not entry.aborted:
                plan = await self.plan(token_ids or [], request.namespace, entry.upstream_id, deadline)
                if not plan.addrs:
                    raise RouterError(errors.UNAVAILABLE, "no model replica is reachable")
                self.metrics.decisions.labels(plan.reason).inc()
                self.metrics.routing_seconds.observe(self._clock() - arrival)
            failures: list[str] = []
            code = errors.UNAVAILABLE
            for attempt, addr in enumerate(plan.addrs):
                if entry.aborted:
                    break
                if attempt:
                    self.metrics.decisions.labels(RETRY).inc()
                    log.info("request %s: retrying on %s after %s", entry.upstream_id, addr, failures[-1])
                stream = self.upstream.generate(addr, upstream, self._timeout(deadline))
                entry.addr = addr
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
                    async for forwarded in self._forward(addr, client_id, message, stream,
                                                         max(request.sampling.n, 1)):
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
                    entry.addr = None
                    await stream.aclose()
                    if replica is not None:
                        replica.inflight -= 1
                    self.metrics.requests.labels(addr, outcome).inc()
            if entry.aborted:  # aborted before a replica had it: it ends here, as the replica's would
                for index in range(max(request.sampling.n, 1)):  # every choice's last message
                    yield model_pb2.GenerateResponse(
                        request_id=client_id, finish_reason=model_pb2.FINISH_REASON_ABORT, index=index,
                        usage=model_pb2.Usage(prompt_tokens=len(token_ids or ())))
                return
            raise RouterError(code, f"no replica could take the request ({len(plan.addrs)} tried): "
                              + "; ".join(failures))
        finally:
            if self._inflight.get(slot) is entry:
                del self._inflight[slot]

    async def _forward(self, addr: str, client_id: str, first: model_pb2.GenerateResponse,
                       stream: AsyncIterator[model_pb2.GenerateResponse],
                       choices: int = 1) -> AsyncIterator[model_pb2.GenerateResponse]:
        """The replica's messages from `first` on, under the client's request id, Usage.served_by
        filled in, until each of the request's `choices` (SamplingParams.n) sent its last
        message; a failure after output was streamed becomes UNAVAILABLE (DEADLINE_EXCEEDED
        stays itself)."""
        message: model_pb2.GenerateResponse | None = first
        sent_tokens = 0
        finished = False
        unfinished = set(range(choices))
        while message is not None:
            message.request_id = client_id
            if message.HasField("usage") and not message.usage.served_by:
                message.usage.served_by = addr
            if message.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED:
                unfinished.discard(message.index)
            finished = not unfinished
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

    async def detokenize(self, request: model_pb2.DetokenizeRequest,
                         deadline: float | None = None) -> model_pb2.DetokenizeResponse:
        """A live replica's Detokenize (any replica: they serve the same tokenizer)."""
        return await self._any_replica(
            lambda addr, timeout: self.upstream.detokenize(addr, request, timeout), deadline, "Detokenize")

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
        """The served model's info (a replica's ModelInfo): from the last check when known, else
        asked of a live replica and kept."""
        info = self.replicas.model_info()
        if isinstance(info, model_pb2.ModelInfoResponse):
            return info
        answered: list[str] = []

        async def ask(addr: str, timeout: float | None) -> model_pb2.ModelInfoResponse:
            answer = await self.upstream.model_info(addr, timeout)
            answered.append(addr)
            return answer

        info = await self._any_replica(ask, deadline, "ModelInfo")
        self.replicas.set_info(answered[-1], info, info.model_fingerprint)
        return info

    async def abort(self, request_id: str, deadline: float | None = None,
                    principal: Principal | None = None) -> model_pb2.AbortResponse:
        """Aborts the principal's `request_id`: forwarded to the replica serving it (under its
        upstream id), or, before a replica has it, ended by the router. NOT_FOUND when the
        principal has no such request in flight here (another principal's id included)."""
        entry = self._inflight.get((_owner(principal), request_id))
        if entry is None:
            raise RouterError(errors.NOT_FOUND, f"no request {quote_id(request_id)} is in flight at this router")
        entry.aborted = True  # no further replica is tried, and one not called yet never is
        if entry.addr is None:
            return model_pb2.AbortResponse()
        try:
            return await self.upstream.abort(entry.addr, model_pb2.AbortRequest(request_id=entry.upstream_id),
                                             self._timeout(deadline, self.config.call_timeout_s))
        except UpstreamError as e:
            if e.code == errors.NOT_FOUND:  # it just ended there; the replica's message names the upstream id
                raise RouterError(errors.NOT_FOUND,
                                  f"no request {quote_id(request_id)} is in flight at this router") from None
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
        await self._discover()
        try:
            stats = await self.cache.stats(self.config.route_timeout_s)
        except UpstreamError as e:
            self._mark_cache(False, f"Stats: {e.code} {e.message}")
        else:
            self._mark_cache(True)
            now = self._clock()
            for pool in stats.pools:
                if pool.serving_addr and self._trusted(pool.serving_addr, "stats"):
                    self.replicas.learn(pool.serving_addr, pool_id=pool.pool_id, fingerprint=pool.model_fingerprint,
                                        load=Load(pool.load.num_running_requests, pool.load.num_waiting_requests,
                                                  pool.load.num_waiting_tokens, now))
        await asyncio.gather(*(self._check(r.addr) for r in self.replicas.all()))
        for addr in self.replicas.forget_stale():
            log.info("forgot replica %s (unreachable and no longer listed by the cache manager)", addr)
        reachable = sum(1 for r in self.replicas.all() if r.reachable)
        self.metrics.replicas_reachable.set(reachable)
        return reachable > 0

    async def _discover(self) -> None:
        """Resolves every --replica-dns name: its addresses are trusted and held as replicas;
        addresses a name no longer gives are dropped (unless trusted otherwise). A failed lookup
        keeps the name's previous addresses (a DNS hiccup must not empty the fleet)."""
        trust = self.replicas.trust
        if not trust.dns_names:
            return
        timeout = self.config.call_timeout_s
        answers = await asyncio.gather(*(asyncio.wait_for(self._resolver(host, port), timeout)
                                         for host, port in trust.dns_names), return_exceptions=True)
        for (host, port), answer in zip(trust.dns_names, answers, strict=True):
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer
            if isinstance(answer, Exception) or not answer:
                if (host, port) not in self._dns_failing:
                    self._dns_failing.add((host, port))
                    log.warning("--replica-dns %s:%d: lookup failed (%s); keeping its previous addresses",
                                host, port, answer or "no address")
                continue
            if (host, port) in self._dns_failing:
                self._dns_failing.discard((host, port))
                log.info("--replica-dns %s:%d resolves again", host, port)
            trust.set_resolved(host, port, answer)
        self.replicas.sync_dns(trust.resolved())
        for addr in self.replicas.retain_trusted():
            log.info("dropped replica %s: no --replica-dns name resolves to it any more", addr)

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
