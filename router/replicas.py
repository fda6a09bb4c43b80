"""What the router knows about the model replicas: where they are, whether they answer, their
load, their model. Plain state, updated by the background checks and by every call's outcome;
no gRPC here.

Replicas come from four places: ``--replica`` (static, never forgotten), the addresses of the
``--replica-dns`` names (kept while a name resolves to them), the cache manager's Stats (each
live pool's serving_addr) and Route answers. Only addresses the operator trusts are ever held
(router/trust.py): a learnt address outside the trust is refused by `learn`. A learnt replica
that has been neither reachable nor listed by the cache manager for ``forget_after_s`` is
dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from router.trust import ReplicaTrust


@dataclass(slots=True)
class Load:
    """A replica's load sample (GetLoad, or the ReplicaLoad the cache manager relays)."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_waiting_tokens: int = 0
    sampled_at: float = 0.0

    @property
    def num_requests(self) -> int:
        return self.num_running_requests + self.num_waiting_requests


@dataclass(slots=True)
class Replica:
    addr: str
    static: bool = False
    # One of the addresses a --replica-dns name resolves to now (not forgotten while it does).
    dns: bool = False
    pool_id: str = ""
    # Model fingerprint (ModelInfo, or the pool's registration).
    fingerprint: str = ""
    # None: not checked yet (assumed reachable), then the last health check's or call's outcome.
    reachable: bool | None = None
    load: Load | None = None
    # Streams this router has open to the replica now.
    inflight: int = 0
    # The replica's ModelInfoResponse (a protobuf message; opaque here).
    info: object | None = None
    # Last time the replica answered or the cache manager listed it.
    last_seen: float = field(default=0.0)
    requests: int = 0

    @property
    def live(self) -> bool:
        return self.reachable is not False

    def load_score(self) -> int:
        """Requests standing at the replica: what it last reported, or what this router has open
        there when that is more (a sample lags behind the requests just sent)."""
        reported = self.load.num_requests if self.load is not None else 0
        return max(reported, self.inflight)


class ReplicaSet:
    """The replicas this router may call. `trust` (default: the static addresses and loopback)
    decides which learnt addresses are held at all."""

    def __init__(self, static: Iterable[str] = (), forget_after_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, trust: ReplicaTrust | None = None) -> None:
        static = list(static)
        self.trust = trust if trust is not None else ReplicaTrust(static)
        self._clock = clock
        self.forget_after_s = forget_after_s
        self._replicas: dict[str, Replica] = {}
        for addr in static:
            self._replicas.setdefault(addr, Replica(addr, static=True, last_seen=clock()))

    def __len__(self) -> int:
        return len(self._replicas)

    def __contains__(self, addr: str) -> bool:
        return addr in self._replicas

    def get(self, addr: str) -> Replica | None:
        return self._replicas.get(addr)

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    def learn(self, addr: str, *, pool_id: str = "", fingerprint: str = "",
              load: Load | None = None) -> Replica | None:
        """A replica the cache manager listed (Stats, Route): added if new, its facts refreshed.
        None, and nothing held, when the address is not trusted."""
        replica = self._replicas.get(addr)
        if replica is None:
            if not self.trust.trusted(addr):
                return None
            replica = self._replicas[addr] = Replica(addr)
        replica.last_seen = self._clock()
        if pool_id:
            replica.pool_id = pool_id
        if fingerprint and replica.info is None:
            replica.fingerprint = fingerprint
        if load is not None and (replica.load is None or load.sampled_at >= replica.load.sampled_at):
            replica.load = load
        return replica

    def mark(self, addr: str, reachable: bool) -> None:
        replica = self._replicas.get(addr)
        if replica is None:
            return
        replica.reachable = reachable
        if reachable:
            replica.last_seen = self._clock()

    def set_load(self, addr: str, load: Load) -> None:
        replica = self._replicas.get(addr)
        if replica is not None:
            replica.load = load

    def set_info(self, addr: str, info: object, fingerprint: str) -> None:
        replica = self._replicas.get(addr)
        if replica is not None:
            replica.info = info
            replica.fingerprint = fingerprint

    def sync_dns(self, addrs: Iterable[str]) -> None:
        """The addresses the --replica-dns names resolve to now: added if new; those no longer
        among them become learnt ones (forgotten when stale, dropped by `retain_trusted` when
        nothing else trusts them)."""
        current = set(addrs)
        for replica in self._replicas.values():
            replica.dns = replica.addr in current
        for addr in current - self._replicas.keys():
            self._replicas[addr] = Replica(addr, dns=True, last_seen=self._clock())

    def retain_trusted(self) -> list[str]:
        """Drops replicas the trust no longer covers (an address gone from a DNS name); returns
        their addresses."""
        gone = [a for a, r in self._replicas.items() if not r.static and not self.trust.trusted(a)]
        for addr in gone:
            del self._replicas[addr]
        return gone

    def forget_stale(self) -> list[str]:
        """Drops learnt replicas unseen for forget_after_s; returns their addresses."""
        now = self._clock()
        gone = [a for a, r in self._replicas.items()
                if not r.static and not r.dns and not r.reachable and now - r.last_seen > self.forget_after_s]
        for addr in gone:
            del self._replicas[addr]
        return gone

    @property
    def fingerprint(self) -> str:
        """The model this router serves: that of the first reachable replica whose ModelInfo is
        known ("" while none is)."""
        for replica in self._replicas.values():
            if replica.info is not None and replica.reachable:
                return replica.fingerprint
        for replica in self._replicas.values():
            if replica.info is not None and replica.live:
                return replica.fingerprint
        return ""

    def live(self) -> list[Replica]:
        """Replicas not known to be down, serving the router's model (or of unknown model)."""
        fingerprint = self.fingerprint
        return [r for r in self._replicas.values()
                if r.live and (not fingerprint or not r.fingerprint or r.fingerprint == fingerprint)]

    def any_reachable(self) -> bool:
        return any(r.reachable for r in self._replicas.values())

    def model_info(self) -> object | None:
        """ModelInfo of a reachable replica of the served model, if any."""
        fingerprint = self.fingerprint
        for replica in self._replicas.values():
            if replica.info is not None and replica.reachable and replica.fingerprint == fingerprint:
                return replica.info
        return None
