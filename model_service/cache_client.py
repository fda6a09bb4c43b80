"""The model service's side of the cache-manager protocol: register, one Step per scheduler step,
heartbeat (both carry the replica's load). Translates scheduler objects <-> protos; raises
`CachePoolLost` on any failure after which the pool's state can no longer be trusted (cache
down, restarted, lease expired)."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import NamedTuple

import grpc

from common.auth import ClientToken
from common.security import open_channel
from common.token_bytes import encode_tokens
from model_service.reattach import HeldRequest
from model_service.request import MissBreakdown
from model_service.scheduler import (
    AdmitReply,
    CachePlan,
    CacheReply,
    CommitReply,
    ExtendReply,
    FinishRecord,
    ReplicaLoad,
)
from model_service.step_stream import StepStream, StepStreamError
from protos import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

# gRPC's own retry for transient UNAVAILABLE on the idempotent calls (register, heartbeat).
_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": "radixkv.v1.CacheManager", "method": "RegisterPool"},
                 {"service": "radixkv.v1.CacheManager", "method": "Heartbeat"}],
        "retryPolicy": {
            "maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s",
            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
})


class Registration(NamedTuple):
    """What RegisterPool said: whether the pool was kept, and its running requests as held there."""

    restored: bool
    held: dict[str, HeldRequest]


class CachePoolLost(Exception):
    """The cache manager is unreachable or no longer knows this pool/epoch: re-register and recompute."""


class CacheClient:
    def __init__(self, address: str, worker_id: str, num_blocks: int, block_size: int,
                 model_fingerprint: str, vocab_size: int, timeout: float = 10.0, serving_addr: str = "",
                 credentials: grpc.ChannelCredentials | None = None, token: ClientToken | None = None,
                 step_stream: bool = True) -> None:
        """`step_stream`: send Steps over one StepStream (model_service/step_stream.py) rather than
        a unary call each; a cache manager without StepStream gets unary calls from its first
        UNIMPLEMENTED on."""
        self.address = address
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.vocab_size = vocab_size
        self.timeout = timeout
        self.serving_addr = serving_addr  # where clients reach this replica (set before register())
        # The replica's load for heartbeats: replaced whole (never mutated) by the engine thread,
        # so the background heartbeat thread reads a consistent snapshot.
        self.load = ReplicaLoad()
        # The replica's lower tiers as RegisterPool describes them (None: none), re-read at every
        # registration (what the disk tier holds changes); and their measured load costs.
        self.tier_config: Callable[[], cache_pb2.TierConfig] | None = None
        self.load_costs: tuple[float, float, float] = (0.0, 0.0, 0.0)  # host, disk, peer (copy_costs.py)
        # Where this replica serves KvTransfer and its ticket key (peer pulls; empty: none).
        self.kv_transfer_addr = ""
        self.kv_transfer_key = b""
        self.pool_id = ""
        self.epoch = 0
        self.incarnation = ""  # of this process's KV tensors (RegisterPoolRequest.incarnation)
        self.num_steps_acknowledged = 0  # Step replies received from the current pool
        self.lease_seconds = 0.0
        self.last_call = 0.0
        # TLS when credentials are given; the bearer token (reloadable) goes with every call.
        self.token = token if token is not None else ClientToken(None)
        self._channel = open_channel(address, credentials, options=[
            ("grpc.service_config", _SERVICE_CONFIG), ("grpc.enable_retries", 1)])
        self._stub = cache_pb2_grpc.CacheManagerStub(self._channel)
        self.step_stream = step_stream
        self._stream: StepStream | None = None

    @property
    def registered(self) -> bool:
        return bool(self.pool_id)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._channel.close()

    def register(self) -> Registration:
        """Registers the pool (a new epoch), re-attaching to the one the cache manager kept for this
        incarnation if any. Raises CachePoolLost when the cache manager is down."""
        if not self.incarnation:  # once per process: the KV tensors live as long as it does
            self.incarnation = uuid.uuid4().hex
        try:
            reply = self._stub.RegisterPool(cache_pb2.RegisterPoolRequest(
                worker_id=self.worker_id, num_blocks=self.num_blocks, block_size=self.block_size,
                model_fingerprint=self.model_fingerprint, vocab_size=self.vocab_size,
                serving_addr=self.serving_addr, incarnation=self.incarnation,
                num_steps_acknowledged=self.num_steps_acknowledged,
                tiers=self.tier_config() if self.tier_config is not None else None,
                kv_transfer_addr=self.kv_transfer_addr, kv_transfer_key=self.kv_transfer_key),
                timeout=self.timeout, metadata=self.token.metadata)
        except grpc.RpcError as e:
            self.pool_id = ""
            raise CachePoolLost(f"RegisterPool failed: {e.code().name}: {e.details()}") from e
        self.pool_id, self.epoch, self.lease_seconds = reply.pool_id, reply.epoch, reply.lease_seconds
        if not reply.restored:
            self.num_steps_acknowledged = 0
        self.last_call = time.monotonic()
        held = {r.request_id: HeldRequest(r.request_id, list(r.block_table), r.cached_tokens)
                for r in reply.running_requests}
        log.info("registered pool %s epoch %d at %s (%d blocks of %d tokens, lease %.1fs)%s",
                 self.pool_id, self.epoch, self.address, self.num_blocks, self.block_size, self.lease_seconds,
                 f": re-attached, {reply.num_cached_blocks} cached blocks and {len(held)} running requests kept"
                 if reply.restored else "")
        return Registration(reply.restored, held)

    def step(self, plan: CachePlan) -> CacheReply:
        """One Step, waited for. Raises CachePoolLost on failure."""
        return self.step_async(plan).result()

    def step_async(self, plan: CachePlan) -> StepCall:
        """Sends one Step and returns at once; `StepCall.result()` waits for its reply."""
        request = self._step_request(plan)
        if self.step_stream:
            return StepCall(self, self._open_stream().send(request), request, streamed=True)
        future = self._stub.Step.future(request, timeout=self.timeout, metadata=self.token.metadata)
        return StepCall(self, future, request, streamed=False)

    def _open_stream(self) -> StepStream:
        """The Step stream, opened anew when there is none, it failed, or the token was reloaded."""
        metadata = self.token.metadata
        stream = self._stream
        if stream is None or stream.failed or stream.metadata is not metadata:
            if stream is not None:
                stream.close()
            stream = self._stream = StepStream(
                lambda requests, md: self._stub.StepStream(requests, metadata=md), metadata)
        return stream

    def drop_stream(self) -> None:
        """Closes the Step stream (whatever waits on it fails); the next Step opens a new one."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _step_request(self, plan: CachePlan) -> cache_pb2.StepRequest:
        return cache_pb2.StepRequest(
            pool_id=self.pool_id, epoch=self.epoch,
            releases=[_finish_proto(r) for r in plan.releases],
            finishes=[_finish_proto(r) for r in plan.finishes],
            extends=[cache_pb2.Extend(request_id=e.request.request_id, num_tokens=e.num_tokens,
                                      num_lookahead_tokens=e.num_lookahead_tokens) for e in plan.extends],
            # The prompt packed (4 bytes per id): the cache manager reads it without per-token work.
            admits=[cache_pb2.Admit(request_id=r.request_id, packed_token_ids=encode_tokens(r.all_token_ids),
                                    namespace=r.namespace, num_lookahead_tokens=1, resumed=r.was_admitted)
                    for r in plan.admits],
            commits=[cache_pb2.Commit(request_id=c.request.request_id, num_computed_tokens=c.num_computed_tokens,
                                      output_token_ids=c.output_token_ids) for c in plan.commits],
            load=_load_proto(plan.load, self.load_costs),
            copy_outcomes=plan.copy_outcomes,
            pull_outcomes=plan.pull_outcomes,
        )

    def heartbeat_if_due(self) -> None:
        """Renews the lease when a third of it passed without a call."""
        if self.registered and time.monotonic() - self.last_call > self.lease_seconds / 3:
            self.heartbeat()

    def heartbeat(self) -> None:
        """Renews the lease now, reporting `self.load`. Raises CachePoolLost on failure."""
        self._call(self._stub.Heartbeat, self._heartbeat_request())

    def _heartbeat_request(self) -> cache_pb2.HeartbeatRequest:
        return cache_pb2.HeartbeatRequest(pool_id=self.pool_id, epoch=self.epoch,
                                          load=_load_proto(self.load, self.load_costs))

    def keep_lease_alive(self, stop: threading.Event) -> threading.Thread:
        """Starts a daemon thread that renews the lease whenever a third of it passes without a
        call, so that one engine step longer than the lease (a huge prefill on a slow machine)
        does not cost the pool. It never changes this client's state: a failure here is noticed,
        and handled, by the engine thread's next call."""
        def run() -> None:
            while not stop.wait(min(1.0, self.lease_seconds / 6) if self.lease_seconds > 0 else 1.0):
                if not self.registered or time.monotonic() - self.last_call <= self.lease_seconds / 3:
                    continue
                try:
                    self._stub.Heartbeat(self._heartbeat_request(), timeout=self.timeout,
                                         metadata=self.token.metadata)
                    self.last_call = time.monotonic()
                except grpc.RpcError as e:
                    log.debug("background heartbeat failed: %s", e.code().name)

        thread = threading.Thread(target=run, name="radixkv-lease", daemon=True)
        thread.start()
        return thread

    def _call(self, method, request):
        try:
            reply = method(request, timeout=self.timeout, metadata=self.token.metadata)
        except grpc.RpcError as e:
            self.pool_id = ""
            raise CachePoolLost(f"{e.code().name}: {e.details()}") from e
        self.last_call = time.monotonic()
        return reply


class StepCall:
    """A Step in flight (`CacheClient.step_async`): a message on the Step stream, or a unary call."""

    __slots__ = ("_client", "_future", "_request", "_streamed", "_sent", "elapsed")

    def __init__(self, client: CacheClient, future: grpc.Future | Future, request: cache_pb2.StepRequest,
                 streamed: bool) -> None:
        self._client = client
        self._future = future
        self._request = request
        self._streamed = streamed
        self._sent = time.perf_counter()
        self.elapsed: float | None = None  # seconds from send to reply, once it arrived
        future.add_done_callback(self._on_done)

    def _on_done(self, _future) -> None:
        self.elapsed = time.perf_counter() - self._sent

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        self._future.cancel()

    def result(self) -> CacheReply:
        """Waits for the reply. Raises CachePoolLost on failure (the client is then unregistered)."""
        client = self._client
        try:
            # A unary call carries its own deadline; a stream message's wait has this one.
            reply = self._future.result(timeout=client.timeout if self._streamed else None)
        except StepStreamError as e:
            if e.code != grpc.StatusCode.UNIMPLEMENTED:
                client.pool_id = ""
                raise CachePoolLost(f"Step: {e}") from e
            # A cache manager without StepStream: unary Steps from now on, this one too (unapplied).
            log.warning("the cache manager at %s has no StepStream: unary Step calls from now on", client.address)
            client.step_stream = False
            client.drop_stream()
            reply = client._call(client._stub.Step, self._request)
        except TimeoutError as e:
            client.drop_stream()
            client.pool_id = ""
            raise CachePoolLost(f"no Step reply within {client.timeout:g}s") from e
        except grpc.RpcError as e:  # the future raises the call itself, an RpcError
            client.pool_id = ""
            raise CachePoolLost(f"{e.code().name}: {e.details()}") from e
        except (grpc.FutureCancelledError, CancelledError) as e:
            client.pool_id = ""
            raise CachePoolLost("Step cancelled") from e
        client.last_call = time.monotonic()
        client.num_steps_acknowledged += 1
        return _step_reply(reply)


def _step_reply(reply: cache_pb2.StepResponse) -> CacheReply:
    return CacheReply(
        admits=[AdmitReply(a.request_id, a.status == cache_pb2.ADMIT_STATUS_ADMITTED, a.cached_tokens,
                           list(a.block_table), _miss(a), a.loads, pulls=a.pulls) for a in reply.admits],
        extends=[ExtendReply(e.request_id, e.ok, list(e.new_block_ids)) for e in reply.extends],
        commits=[CommitReply(c.request_id, c.cached_tokens, list(c.cached_block_ids)) for c in reply.commits],
        num_free_blocks=reply.num_free_blocks,
        offloads=reply.offloads,
    )


def _finish_proto(record: FinishRecord) -> cache_pb2.Finish:
    return cache_pb2.Finish(request_id=record.request_id, output_token_ids=record.output_token_ids,
                            num_computed_tokens=record.num_computed_tokens, block_table=record.block_table)


def _load_proto(load: ReplicaLoad, costs: tuple[float, float, float]) -> cache_pb2.ReplicaLoad:
    return cache_pb2.ReplicaLoad(num_waiting_requests=load.num_waiting_requests,
                                 num_waiting_tokens=load.num_waiting_tokens,
                                 num_running_requests=load.num_running_requests,
                                 host_load_cost=costs[0], disk_load_cost=costs[1], peer_load_cost=costs[2])


def _miss(result: cache_pb2.AdmitResult) -> MissBreakdown | None:
    if not result.HasField("miss"):
        return None
    m = result.miss
    # other_namespace_tokens is deprecated (0 from this cache manager); an older one's figure is
    # folded into new_tokens, so no caller learns what other namespaces hold.
    return MissBreakdown(m.evicted_tokens, m.other_replica_tokens, m.new_tokens + m.other_namespace_tokens)
