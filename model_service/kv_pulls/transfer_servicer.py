"""KvTransfer (kv_transfer.proto): this replica's cached pages, read for a replica that pulls them.

Only with a ticket the cache manager signed for this replica (HMAC-SHA256 with the key this
process sent in RegisterPool; a new key per process) naming this worker id and incarnation,
before the ticket runs out. The ticket names the blocks: nothing else of the pool is read. The
cache manager pins those pages (no eviction, so no reuse of their blocks) for longer than the
ticket lasts, and the expiry is checked again after every read, so every byte sent was read
while the pin held. With --auth-token-file the call also needs the 'replica' role.

At most MAX_CONCURRENT_READS pulls are served at once (more: RESOURCE_EXHAUSTED, and the puller
recomputes); messages are produced one at a time as the stream drains (gRPC flow control), so a
pull holds at most a message or two in memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

import grpc
from google.protobuf.message import DecodeError

from common.auth import one_role
from common.grpc_server import end_call
from model_service.kv_cache import KVCache
from model_service.kv_pulls.page_data import encode, group_pages, read_host_layer, read_layer
from model_service.metrics import ModelMetrics
from model_service.tiers.host_tier import HostTier
from protos import cache_pb2, kv_transfer_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "radixkv.v1.KvTransfer"
METHOD_ROLES: dict[str, str] = one_role(kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"], "replica")
MAX_CONCURRENT_READS = 4


class TicketError(Exception):
    pass


def verify_ticket(raw: bytes, mac: bytes, key: bytes, worker_id: str, incarnation: str,
                  num_blocks: int, num_host_slots: int, now: float) -> kv_transfer_pb2.PullTicket:
    """The ticket, or TicketError saying why it is refused."""
    if not hmac.compare_digest(hmac.new(key, raw, hashlib.sha256).digest(), mac):
        raise TicketError("the pull ticket's signature does not verify for this replica")
    try:
        ticket = kv_transfer_pb2.PullTicket.FromString(raw)
    except DecodeError as e:  # signed, so only a cache manager bug gets here
        raise TicketError(f"the pull ticket does not parse: {e}") from None
    if ticket.worker_id != worker_id or ticket.incarnation != incarnation:
        raise TicketError("the pull ticket is for another replica or an earlier run of this one")
    if ticket.expires_at <= now:
        raise TicketError("the pull ticket has run out")
    limit = {cache_pb2.TIER_DEVICE: num_blocks, cache_pb2.TIER_HOST: num_host_slots}.get(ticket.src_tier, 0)
    if not limit:
        raise TicketError("the pull ticket names a tier this replica does not serve from")
    if not ticket.src or len(ticket.src) > limit or max(ticket.src) >= limit:
        raise TicketError("the pull ticket names pages outside this replica's tier")
    return ticket


class KvTransferServicer:
    """Serves ReadPages from `kv` (the engine's KV pool) and `host` (its host tier, if any)."""

    def __init__(self, kv: KVCache, key: bytes, identity: Callable[[], tuple[str, str]],
                 metrics: ModelMetrics | None = None, clock: Callable[[], float] = time.time,
                 host: HostTier | None = None) -> None:
        """`identity`: (worker id, incarnation) of the pool as registered now."""
        self.kv = kv
        self.host = host
        self.key = key
        self.identity = identity
        self.metrics = metrics
        self.clock = clock
        self._reads = asyncio.Semaphore(MAX_CONCURRENT_READS)
        self._group = group_pages(kv)

    async def ReadPages(self, request: kv_transfer_pb2.ReadPagesRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Yields serialized PageData messages (page_data.encode: the payload is not copied by protobuf)."""
        worker_id, incarnation = self.identity()
        try:
            ticket = verify_ticket(request.ticket, request.ticket_mac, self.key, worker_id, incarnation,
                                   self.kv.num_blocks, self.host.num_slots if self.host is not None else 0,
                                   self.clock())
        except TicketError as e:
            log.warning("KvTransfer refused a pull (%s; peer %s)", e, context.peer())
            end_call(context, grpc.StatusCode.PERMISSION_DENIED, str(e))
            return
        if self._reads.locked():
            end_call(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                     f"this replica serves at most {MAX_CONCURRENT_READS} pulls at once")
            return
        async with self._reads:
            src = list(ticket.src)
            pages_of = (partial(read_host_layer, self.host) if ticket.src_tier == cache_pb2.TIER_HOST
                        else partial(read_layer, self.kv))

            def read(first: int, layer: int, pages: list[int]) -> bytes:
                return encode(first, len(pages), layer, *pages_of(layer, pages))

            sent = 0
            for first in range(0, len(src), self._group):
                blocks = src[first:first + self._group]
                for layer in range(len(self.kv.k)):
                    message = await asyncio.to_thread(read, first, layer, blocks)
                    if ticket.expires_at <= self.clock():  # read after the pin may have ended: not sent
                        end_call(context, grpc.StatusCode.DEADLINE_EXCEEDED, "the pull ticket ran out mid-pull")
                        return
                    sent += len(message)
                    yield message
            if self.metrics is not None:
                self.metrics.pull_served_pages.inc(len(src))
                self.metrics.pull_served_bytes.inc(sent)
