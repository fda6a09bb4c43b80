"""Pulls the pages a cache Step reply names (cache.proto PeerPull) from other replicas' KvTransfer.

Started by the engine thread with the reply's tier copies, run on the puller's threads while the
engine runs the other requests: the pulled pages land in the admitted request's own blocks, which
nothing else writes, and the request is scheduled once they arrived, its prompt computed from the
first page that did not. The engine waits for a pull before it gives the request's blocks back.
A pull that fails (the source died, refused the ticket, sent data that does not check) or misses
its deadline costs only the time spent: its missing pages are computed, with the same output.
The deadline is what computing the pages would take (measured, model_service/copy_costs.py), so a
slow pull never costs much more than not pulling, and at most half of the pin's time, so the
source's pages stay pinned throughout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from common.auth import ClientToken
from common.security import open_channel
from model_service.copy_costs import PEER, CopyCosts
from model_service.kv_cache import KVCache
from model_service.kv_pulls.page_data import (
    MAX_MESSAGE_BYTES,
    BadMessage,
    checksum,
    decode,
    page_layer_bytes,
    write_layer,
)
from model_service.metrics import ModelMetrics
from protos import cache_pb2, kv_transfer_pb2

log = logging.getLogger(__name__)

READ_PAGES = "/radixkv.v1.KvTransfer/ReadPages"

MAX_CONCURRENT_PULLS = 2
MIN_DEADLINE_SECONDS = 0.5
DEADLINE_SLACK_SECONDS = 0.25  # on top of the recompute estimate: a pull has a connection to make


class PullFailed(Exception):
    """A pull that came up short: why (a metrics label), and what it did get."""

    def __init__(self, reason: str, message: str, done: int = 0, received: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.done = done  # leading pages written whole
        self.received = received  # bytes


class PeerPuller:
    """Performs PeerPulls into `kv` (engine thread only)."""

    def __init__(self, kv: KVCache, costs: CopyCosts, credentials: grpc.ChannelCredentials | None = None,
                 token: ClientToken | None = None, metrics: ModelMetrics | None = None) -> None:
        self.kv = kv
        self.costs = costs
        self.credentials = credentials
        self.token = token if token is not None else ClientToken(None)
        self.metrics = metrics
        self._calls: dict[str, tuple[grpc.Channel, grpc.UnaryStreamMultiCallable]] = {}
        self._lock = threading.Lock()  # the channels: pulls run on several threads
        self._threads = ThreadPoolExecutor(MAX_CONCURRENT_PULLS, thread_name_prefix="radixkv-pull")

    def start(self, pulls: Sequence[cache_pb2.PeerPull]) -> Future[tuple[list[cache_pb2.CopyOutcome], int]]:
        """`run(pulls)` on a puller thread."""
        return self._threads.submit(self.run, pulls)

    def deadline(self, pull: cache_pb2.PeerPull) -> float:
        """Seconds the pull may take: about what computing its pages would, within half its pin."""
        limit = max(MIN_DEADLINE_SECONDS, pull.pin_seconds / 2)
        per_token = self.costs.prefill_seconds_per_token
        if not per_token:
            return limit
        estimate = len(pull.dst) * self.kv.block_size * per_token + DEADLINE_SLACK_SECONDS
        return min(limit, max(MIN_DEADLINE_SECONDS, estimate))

    def run(self, pulls: Sequence[cache_pb2.PeerPull]) -> tuple[list[cache_pb2.CopyOutcome], int]:
        """One admission's pulls, in order: (outcomes, tokens pulled). Pulls after one that came
        up short are not made (the prefix must be whole)."""
        outcomes, pulled, whole = [], 0, True
        for pull in pulls:
            done = self._pull(pull) if whole else 0
            outcomes.append(cache_pb2.CopyOutcome(copy_id=pull.pull_id, num_pages_copied=done))
            pulled += done * self.kv.block_size
            whole = whole and done == len(pull.dst)
        return outcomes, pulled

    def _pull(self, pull: cache_pb2.PeerPull) -> int:
        started = time.perf_counter()
        n, received, reason = len(pull.dst), 0, "ok"
        try:
            done, received = self._read(pull, self.deadline(pull))
        except PullFailed as e:
            done, received, reason = e.done, e.received, e.reason
            log.warning("pull %d of %d pages from %s failed (%s): %s; computing them instead", pull.pull_id, n,
                        pull.source_worker_id, e.reason, e)
        elapsed = time.perf_counter() - started
        self.costs.observe_copy(PEER, elapsed, n * self.kv.block_size)
        if self.metrics is not None:
            m = self.metrics
            m.pull_seconds.observe(elapsed)
            m.pull_bytes.inc(received)
            if done:
                m.pull_pages.labels("ok").inc(done)
            if done < n:
                m.pull_pages.labels("failed").inc(n - done)
                m.pull_fallbacks.labels(reason).inc()
            cost = self.costs.cost(PEER)
            if cost:
                m.peer_load_cost.set(cost)
        return done

    def _read_pages(self, addr: str) -> grpc.UnaryStreamMultiCallable:
        """KvTransfer.ReadPages on `addr`, its messages as bytes (page_data.decode reads them in place)."""
        with self._lock:
            entry = self._calls.get(addr)
            if entry is None:
                channel = open_channel(addr, self.credentials,
                                       options=[("grpc.max_receive_message_length", 4 * MAX_MESSAGE_BYTES)])
                call = channel.unary_stream(READ_PAGES,
                                            request_serializer=kv_transfer_pb2.ReadPagesRequest.SerializeToString,
                                            response_deserializer=None)
                entry = self._calls[addr] = (channel, call)
            return entry[1]

    def _read(self, pull: cache_pb2.PeerPull, timeout: float) -> tuple[int, int]:
        """(leading pages written whole, bytes received); PullFailed, carrying both, when it came up short."""
        kv = self.kv
        num_layers, n = len(kv.k), len(pull.dst)
        dst = torch.tensor(list(pull.dst), dtype=torch.int64, device=kv.k[0].device)
        layers: dict[int, set[int]] = {}  # first page of a group -> layers written
        ends: dict[int, int] = {}  # first page of a group -> its end
        done = received = 0
        request = kv_transfer_pb2.ReadPagesRequest(ticket=pull.ticket, ticket_mac=pull.ticket_mac)
        try:
            for raw in self._read_pages(pull.source_addr)(request, timeout=timeout, metadata=self.token.metadata):
                received += len(raw)
                try:
                    first, count, layer, digest, data = decode(raw)
                except BadMessage as e:
                    raise PullFailed("corrupt", f"a message that is not a PageData: {e}") from None
                if not (count and first + count <= n and layer < num_layers
                        and len(data) == count * page_layer_bytes(kv)):
                    raise PullFailed("corrupt", f"a message for pages [{first}, {first + count}) layer {layer} "
                                                "does not fit the pull")
                if checksum(data) != digest:
                    raise PullFailed("corrupt", f"pages [{first}, {first + count}) layer {layer}: checksum mismatch")
                write_layer(kv, layer, dst[first:first + count], data)
                layers.setdefault(first, set()).add(layer)
                ends[first] = first + count
                while done in ends and len(layers[done]) == num_layers:
                    done = ends[done]
        except PullFailed as e:
            raise PullFailed(e.reason, str(e), done, received) from None
        except grpc.RpcError as e:
            code = e.code()
            reason = {grpc.StatusCode.DEADLINE_EXCEEDED: "deadline", grpc.StatusCode.UNAVAILABLE: "unavailable",
                      grpc.StatusCode.PERMISSION_DENIED: "refused", grpc.StatusCode.UNAUTHENTICATED: "refused",
                      grpc.StatusCode.RESOURCE_EXHAUSTED: "busy"}.get(code, "error")
            raise PullFailed(reason, f"{code.name}: {e.details()}", done, received) from None
        if done < n:
            raise PullFailed("short", f"the source sent {done} of {n} pages", done, received)
        return done, received

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)  # a pull ends by its deadline
        with self._lock:
            for channel, _ in self._calls.values():
                channel.close()
            self._calls.clear()
