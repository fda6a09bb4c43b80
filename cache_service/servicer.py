"""gRPC servicer of radixkv.v1.CacheManager: validate, translate, call the core.

Core calls are short and synchronous; they run on the event loop thread, so the core needs no
locks and no call interleaves with another.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from cache_service import convert
from cache_service.durable import DurableState
from cache_service.errors import CacheError, InvalidArgument, PermissionDenied, ResourceExhausted
from cache_service.events import BlockRemoved, BlockStored, CacheEvent, tree_snapshot
from cache_service.metrics import Metrics
from cache_service.pool_registry import PoolRegistry
from common.auth import Principal, current_principal
from common.grpc_server import request_bytes
from common.limits import quote_id
from protos import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheManager"].full_name

# The role a bearer token needs for each method when the server runs with --auth-token-file
# (common/auth.py). A method missing here is refused to every token.
METHOD_ROLES: dict[str, str] = {
    "RegisterPool": "replica",
    "Step": "replica",
    "Heartbeat": "replica",
    "Match": "reader",
    "Stats": "reader",
    "WatchEvents": "reader",
    "Route": "reader",
    "Evict": "admin",
    "Clear": "admin",
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[["CacheManagerServicer", Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def _status(err: CacheError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.code, grpc.StatusCode.INTERNAL)


def _check_namespace(namespace: str) -> None:
    """A namespace-limited reader token may ask only about its namespaces."""
    principal = current_principal()
    if principal is not None and not principal.may_read(namespace):
        raise PermissionDenied(f"this token may not read namespace {quote_id(namespace)}")


def visible(event: CacheEvent, principal: Principal | None) -> bool:
    """Whether a watcher with this token sees the event (AllCleared: always)."""
    if principal is None or principal.namespaces is None:
        return True
    payload = event.payload
    if isinstance(payload, BlockStored | BlockRemoved):
        return principal.may_read(payload.namespace)
    return True


def _rpc(method: Handler) -> Handler:
    """Map core errors to status codes; hide unexpected exceptions behind INTERNAL."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: CacheManagerServicer, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except CacheError as err:
            code = _status(err)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed with an internal error", name)
                message = "internal error"
            else:
                log.info("%s rejected code=%s %s", name, code.name, err)
                message = str(err)
            self._count_error(name, code)
            await context.abort(code, message)
        except Exception:  # a bug: log it, do not leak its message
            log.exception("%s failed unexpectedly", name)
            self._count_error(name, grpc.StatusCode.INTERNAL)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    return wrapper


class CacheManagerServicer(cache_pb2_grpc.CacheManagerServicer):
    def __init__(self, registry: PoolRegistry, metrics: Metrics | None = None, watch_queue_size: int = 65536,
                 durable: DurableState | None = None):
        self.registry = registry
        self.metrics = metrics
        self.watch_queue_size = watch_queue_size
        self.durable = durable  # --state-dir: every applied change is journaled before the reply

    def _count_error(self, method: str, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.rpc_errors.labels(method, code.name).inc()

    @_rpc
    async def RegisterPool(self, request: cache_pb2.RegisterPoolRequest, context) -> cache_pb2.RegisterPoolResponse:
        reg = self.registry.register_replica(
            request.worker_id, request.num_blocks, request.block_size, request.model_fingerprint, request.vocab_size,
            request.serving_addr, request.incarnation, num_steps_acknowledged=request.num_steps_acknowledged,
        )
        return convert.register_response(reg.pool, reg.reattached, self.registry.lease_seconds)

    @_rpc
    async def Step(self, request: cache_pb2.StepRequest, context) -> cache_pb2.StepResponse:
        start = time.perf_counter()
        try:
            pool = self.registry.get(request.pool_id, request.epoch)
            result = pool.step(convert.step_input(request))
            if self.durable is not None:
                self.durable.step(request_bytes.get() or request, result)
            return convert.step_response(result)
        finally:
            if self.metrics is not None:
                self.metrics.step_latency.observe(time.perf_counter() - start)

    @_rpc
    async def Match(self, request: cache_pb2.MatchRequest, context) -> cache_pb2.MatchResponse:
        if not request.token_ids:
            raise InvalidArgument("token_ids must be non-empty")
        _check_namespace(request.namespace)
        if request.pool_id:
            pools = [self.registry.peek(request.pool_id)]
        else:
            fingerprint = request.model_fingerprint
            pools = [p for p in self.registry.pools.values() if not fingerprint or p.model_fingerprint == fingerprint]
        matches = []
        for pool in pools:
            matches.append(convert.pool_match(pool, pool.match(request.token_ids, request.namespace)))
        matches.sort(key=lambda m: (-m.matched_tokens, m.num_private_blocks, m.pool_id))
        return cache_pb2.MatchResponse(matches=matches)

    @_rpc
    async def Heartbeat(self, request: cache_pb2.HeartbeatRequest, context) -> cache_pb2.HeartbeatResponse:
        load = convert.replica_load(request.load) if request.HasField("load") else None
        return cache_pb2.HeartbeatResponse(
            lease_seconds=self.registry.heartbeat(request.pool_id, request.epoch, load)
        )

    @_rpc
    async def Route(self, request: cache_pb2.RouteRequest, context) -> cache_pb2.RouteResponse:
        _check_namespace(request.namespace)
        return convert.route_response(self.registry.route(convert.route_query(request)))

    @_rpc
    async def Stats(self, request: cache_pb2.StatsRequest, context) -> cache_pb2.StatsResponse:
        pools = [self.registry.peek(request.pool_id)] if request.pool_id else list(self.registry.pools.values())
        reply = cache_pb2.StatsResponse(
            pools=[convert.pool_stats(p.stats(self.registry.lease_remaining(p))) for p in pools]
        )
        if self.durable is not None:
            reply.durability.CopyFrom(convert.durability(self.durable.current_stats(), self.durable.state_dir))
        return reply

    @_rpc
    async def Evict(self, request: cache_pb2.EvictRequest, context) -> cache_pb2.EvictResponse:
        pool = self.registry.get(request.pool_id, request.epoch)
        evicted = pool.evict(request.num_blocks)
        if self.durable is not None:
            self.durable.evicted(pool.pool_id, request.num_blocks)
        return cache_pb2.EvictResponse(num_evicted_blocks=evicted)

    @_rpc
    async def Clear(self, request: cache_pb2.ClearRequest, context) -> cache_pb2.ClearResponse:
        pool = self.registry.get(request.pool_id, request.epoch)
        result = pool.clear()
        if self.durable is not None:
            self.durable.cleared(pool.pool_id)
        return cache_pb2.ClearResponse(
            num_evicted_blocks=result.num_evicted_blocks, num_locked_blocks=result.num_locked_blocks
        )

    async def WatchEvents(
        self, request: cache_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cache_pb2.CacheEvent]:
        """Backlog (snapshot or replay) then live events, with no gap and no duplicate.

        The backlog is taken and the subscription made without yielding to the event loop in
        between, so no event can slip past. A watcher more than `watch_queue_size` events
        behind is cut off with RESOURCE_EXHAUSTED (reconnect with snapshot or start_sequence).
        A namespace-limited reader token sees the BlockStored / BlockRemoved events of its
        namespaces only.
        """
        events = self.registry.events
        pool_id = request.pool_id
        principal = current_principal()
        queue: asyncio.Queue[CacheEvent | None] = asyncio.Queue()
        unsubscribe: Callable[[], object] | None = None

        def on_event(event: CacheEvent) -> None:
            if (pool_id and event.pool_id != pool_id) or not visible(event, principal):
                return
            if queue.qsize() >= self.watch_queue_size:
                if unsubscribe is not None:
                    unsubscribe()
                queue.put_nowait(None)
                return
            queue.put_nowait(event)

        try:
            if request.snapshot and request.start_sequence:
                raise InvalidArgument("ask for either a snapshot or a start_sequence, not both")
            pools = [self.registry.peek(pool_id)] if pool_id else list(self.registry.pools.values())
            backlog: list[CacheEvent] = []
            if request.snapshot:
                seq, now = events.last_sequence, events.now()
                for pool in pools:
                    backlog.extend(tree_snapshot(pool.pool_id, pool.tree, seq, now, events.epoch))
            elif request.start_sequence:
                backlog = events.replay(request.start_sequence, pool_id, request.publisher_epoch)
            backlog = [event for event in backlog if visible(event, principal)]
            unsubscribe = events.subscribe(on_event)
        except CacheError as err:
            self._count_error("WatchEvents", _status(err))
            log.info("WatchEvents rejected code=%s %s", err.code, err)
            await context.abort(_status(err), str(err))
            return
        log.info("watcher subscribed pool=%s snapshot=%s backlog=%d", pool_id or "*", request.snapshot, len(backlog))
        try:
            for event in backlog:
                yield convert.cache_event(event)
            while True:
                event = await queue.get()
                if event is None:
                    err = ResourceExhausted("watcher fell too far behind; reconnect with snapshot")
                    self._count_error("WatchEvents", _status(err))
                    await context.abort(_status(err), str(err))
                    return
                yield convert.cache_event(event)
        finally:
            unsubscribe()
            log.info("watcher unsubscribed pool=%s", pool_id or "*")
