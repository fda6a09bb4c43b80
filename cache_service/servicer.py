"""gRPC servicer of radixkv.v1.CacheManager: validate, translate, call the core.

Core calls are short and synchronous; they run on the event loop thread, so the core needs no
locks and no call interleaves with another.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from cache_service import convert
from cache_service.durable import DurableState
from cache_service.errors import CacheError, InvalidArgument, PermissionDenied
from cache_service.metrics import Metrics
from cache_service.open_streams import OpenStreams
from cache_service.pool_registry import PoolRegistry
from cache_service.replica_identity import certificate_names, owner_key
from cache_service.stream_slots import DEFAULT_MAX_WATCH_STREAMS, StreamSlots
from cache_service.watch import Watch, WatchRequest
from common.auth import current_principal
from common.grpc_server import end_call, request_bytes
from common.limits import quote_id
from protos import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheManager"].full_name

# The role a bearer token needs for each method when the server runs with --auth-token-file
# (common/auth.py). A method missing here is refused to every token.
METHOD_ROLES: dict[str, str] = {
    "RegisterPool": "replica",
    "Step": "replica",
    "StepStream": "replica",
    "Heartbeat": "replica",
    "Match": "reader",
    "Stats": "reader",
    "WatchEvents": "reader",
    "Route": "reader",
    "RouteStream": "reader",
    "Evict": "admin",
    "Clear": "admin",
}

# RouteStream: replies answered ahead of their writes, at most this many waiting (see RouteStream).
ROUTE_REPLIES_AHEAD = 64

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


def _sees_all_namespaces() -> bool:
    """Whether the caller's token may see every namespace (no token file, or a line without ns=)."""
    principal = current_principal()
    return principal is None or principal.namespaces is None


def _check_route_records(request: cache_pb2.RouteRequest) -> None:
    """A Route that records its decision or pins a prefix changes the pool (routed load, pinned
    blocks): it needs the router role; a dry run is a read."""
    if request.dry_run or not (request.request_id or request.reserve_ms):
        return
    principal = current_principal()
    if principal is not None and not principal.has_role("router"):
        raise PermissionDenied("a Route that records its decision (request_id without dry_run) or pins a prefix "
                               "(reserve_ms) needs a token with the 'router' role; without it, set dry_run")


def _registering_owner(worker_id: str, auth_context, worker_san_check: bool) -> str:
    """Who registers `worker_id` (the pool's owner key), after checking that they may: the token's
    worker= patterns, and under mutual TLS with `worker_san_check` a DNS or URI subject
    alternative name of the client certificate equal to the worker id. Never the serving_addr a
    replica reports: that is not an identity."""
    principal = current_principal()
    if worker_id and principal is not None and not principal.may_register(worker_id):
        raise PermissionDenied(f"this token may not register worker id {quote_id(worker_id)} "
                               "(not matched by the worker= of its line in the token file)")
    if worker_id and worker_san_check and worker_id not in certificate_names(auth_context):
        raise PermissionDenied(f"worker id {quote_id(worker_id)} is not a DNS or URI subject alternative name "
                               "of this client's certificate")
    return owner_key(principal, auth_context)


def _refusal(name: str, err: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a call ends with for `err` raised while serving it: a core error's
    own code and message; anything else (a bug) INTERNAL, logged, its message not leaked."""
    if isinstance(err, CacheError):
        code = _status(err)
        if code != grpc.StatusCode.INTERNAL:
            log.info("%s rejected code=%s %s", name, code.name, err)
            return code, str(err)
        log.error("%s failed with an internal error", name, exc_info=err)
    else:
        log.error("%s failed unexpectedly", name, exc_info=err)
    return grpc.StatusCode.INTERNAL, "internal error"


def _rpc(method: Handler) -> Handler:
    """Map core errors to status codes; hide unexpected exceptions behind INTERNAL."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: CacheManagerServicer, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except Exception as err:
            code, message = _refusal(name, err)
        self._count_error(name, code)
        return end_call(context, code, message)

    return wrapper


class CacheManagerServicer(cache_pb2_grpc.CacheManagerServicer):
    def __init__(self, registry: PoolRegistry, metrics: Metrics | None = None, watch_queue_size: int = 65536,
                 durable: DurableState | None = None, worker_san_check: bool = False,
                 max_watch_streams: int = DEFAULT_MAX_WATCH_STREAMS, streams: OpenStreams | None = None):
        self.registry = registry
        # StepStream and RouteStream calls, ended at once when the server stops (open_streams.py).
        self.streams = streams if streams is not None else OpenStreams()
        self.metrics = metrics
        self.watch_queue_size = watch_queue_size
        self.watch_slots = StreamSlots(max_watch_streams)  # per principal (--max-watch-streams)
        self.durable = durable  # --state-dir: every applied change is journaled before the reply
        # Mutual TLS (--worker-san-check): a worker id must be a DNS / URI SAN of the client's certificate.
        self.worker_san_check = worker_san_check

    def _count_error(self, method: str, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.rpc_errors.labels(method, code.name).inc()

    @_rpc
    async def RegisterPool(self, request: cache_pb2.RegisterPoolRequest, context) -> cache_pb2.RegisterPoolResponse:
        owner = _registering_owner(request.worker_id, context.auth_context(), self.worker_san_check)
        try:
            reg = self.registry.register_replica(
                request.worker_id, request.num_blocks, request.block_size, request.model_fingerprint,
                request.vocab_size, request.serving_addr, request.incarnation,
                num_steps_acknowledged=request.num_steps_acknowledged, owner=owner,
                tiers=convert.tier_spec(request.tiers),
                kv_transfer_addr=request.kv_transfer_addr, kv_transfer_key=request.kv_transfer_key,
            )
        except PermissionDenied:
            # The caller is told nothing about the holder; the operator learns who tried (never a key).
            principal = current_principal()
            log.warning("RegisterPool of live pool %s by another principal refused (caller: %s, peer %s)",
                        quote_id(request.worker_id), principal.label if principal is not None else "no token",
                        context.peer())
            raise
        return convert.register_response(reg.pool, reg.reattached, self.registry.lease_seconds)

    @_rpc
    async def Step(self, request: cache_pb2.StepRequest, context) -> cache_pb2.StepResponse:
        return self._step(request, "unary")

    async def StepStream(self, requests: AsyncIterator[cache_pb2.StepRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[cache_pb2.StepResponse]:
        """Step for each request of the stream, in order, one reply each; the first refused one
        ends the stream with Step's status for it."""
        with self.streams.hold(context):
            while True:
                try:
                    request = await self.streams.wait(requests.__anext__)
                except StopAsyncIteration:
                    return
                try:
                    reply = self._step(request, "stream")
                except Exception as err:
                    code, message = _refusal("StepStream", err)
                    self._count_error("StepStream", code)
                    end_call(context, code, message)
                    return
                yield reply

    def _step(self, request: cache_pb2.StepRequest, transport: str) -> cache_pb2.StepResponse:
        start = time.perf_counter()
        if self.metrics is not None:
            self.metrics.steps.labels(transport).inc()
        try:
            pool = self.registry.get(request.pool_id, request.epoch)
            result = pool.step(convert.step_input(request))
            if self.durable is not None:
                self.durable.step(request_bytes.get() or request, result, pool)
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
        all_namespaces = _sees_all_namespaces()
        for pool in pools:
            matches.append(convert.pool_match(pool, pool.match(request.token_ids, request.namespace), all_namespaces))
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
        return self._route(request, "unary")

    async def RouteStream(self, requests: AsyncIterator[cache_pb2.RouteRequest],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[cache_pb2.RouteStreamReply]:
        """Route for each request of the stream, in order, one reply each; a refused one is
        answered with its status code and message, and the stream goes on.

        Requests are read and answered ahead of the writes: a router's concurrent Routes share
        one stream, and waiting for each reply's write to complete before reading the next
        request would queue them behind one another. At most ROUTE_REPLIES_AHEAD replies wait
        to be written (then reading pauses: flow control holds the client back)."""
        replies: asyncio.Queue = asyncio.Queue(ROUTE_REPLIES_AHEAD)

        async def answer() -> None:
            try:
                async for request in requests:
                    await replies.put(self._route_reply(request))
            except Exception:  # noqa: BLE001 (the client went away mid-read: the call is over)
                log.debug("RouteStream reader ended", exc_info=True)
            # The end, after the replies before it. Not when cancelled: the handler is not
            # reading then, and with the queue full this put would never return.
            await replies.put(None)

        reader = asyncio.get_running_loop().create_task(answer())
        with self.streams.hold(context):
            try:
                while (reply := await self.streams.wait(replies.get)) is not None:
                    yield reply
            finally:
                reader.cancel()  # and waited for: it may be inside `requests`, which is closed next
                with contextlib.suppress(asyncio.CancelledError):
                    await reader

    def _route_reply(self, request: cache_pb2.RouteRequest) -> cache_pb2.RouteStreamReply:
        reply = cache_pb2.RouteStreamReply()
        try:
            self._route(request, "stream", reply.response)
            return reply
        except Exception as err:
            code, message = _refusal("RouteStream", err)
            self._count_error("RouteStream", code)
            return cache_pb2.RouteStreamReply(code=code.value[0], message=message)

    def _route(self, request: cache_pb2.RouteRequest, transport: str,
               out: cache_pb2.RouteResponse | None = None) -> cache_pb2.RouteResponse:
        if self.metrics is not None:
            self.metrics.routes.labels(transport).inc()
        _check_namespace(request.namespace)
        _check_route_records(request)
        # Before the prompt is copied out of the message: an oversized one costs nothing more.
        self.registry.check_route_size(request.model_fingerprint, *convert.route_size(request))
        return convert.route_response(self.registry.route(convert.route_query(request, _sees_all_namespaces())), out)

    @_rpc
    async def Stats(self, request: cache_pb2.StatsRequest, context) -> cache_pb2.StatsResponse:
        if not _sees_all_namespaces():  # before the pool lookup: not even which pools exist
            raise PermissionDenied("Stats counts every namespace's activity: it needs a reader token without ns= "
                                   "(this token is limited to namespaces)")
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
        """Backlog (snapshot or replay) then live events, with no gap and no duplicate
        (cache_service/watch.py: cursors on the replay buffer, lazy snapshots, view numbers).

        At most `watch_slots.limit` streams per principal; a watcher more than `watch_queue_size`
        events of its own behind, or whose next event left the replay buffer, is cut off with
        RESOURCE_EXHAUSTED (reconnect with snapshot or start_sequence). A namespace-limited
        reader token gets the events of its namespaces (and AllCleared), numbered in its view.
        """
        principal = current_principal()
        key = principal.key if principal is not None else ""  # anonymous callers: one principal
        pool_id = request.pool_id
        try:
            self.watch_slots.acquire(key)
        except CacheError as err:
            self._end_watch(context, err)
            return
        watch: Watch | None = None
        try:
            if request.snapshot and request.start_sequence:
                raise InvalidArgument("ask for either a snapshot or a start_sequence, not both")
            pools = [self.registry.peek(pool_id)] if pool_id else list(self.registry.pools.values())
            view = principal.namespaces if principal is not None else None
            watch = Watch(self.registry.events, pools, WatchRequest(
                pool_id, request.snapshot, request.start_sequence, request.publisher_epoch, view),
                self.watch_queue_size)
            log.info("watcher subscribed pool=%s snapshot=%s from=%d", pool_id or "*", request.snapshot,
                     request.start_sequence)
            async for event in watch.stream():
                yield convert.cache_event(event)
        except CacheError as err:
            self._end_watch(context, err)
        finally:
            if watch is not None:
                watch.close()
                log.info("watcher unsubscribed pool=%s", pool_id or "*")
            self.watch_slots.release(key)

    def _end_watch(self, context: grpc.aio.ServicerContext, err: CacheError) -> None:
        code = _status(err)
        self._count_error("WatchEvents", code)
        log.info("WatchEvents ended code=%s %s", code.name, err)
        end_call(context, code, str(err))
