"""Peer pulls brokered by the cache core (cache_service/peer_pulls.py): which admissions pull what
from whom, the pins on the source and when they end, namespaces, Route's pricing, durability.
In-process registry with a manual clock; every pool's integrity is checked after each step."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from cache_service import convert
from cache_service.errors import InvalidArgument
from cache_service.peer_pulls import DEFAULT_PIN_SECONDS, MAX_PINNED_SHARE
from cache_service.pool import Pool
from cache_service.pool_registry import PoolRegistry
from cache_service.routing import RouteQuery
from cache_service.schema import Admit, CopyOutcome, Finish, ReplicaLoad, StepInput, StepResult, TierSpec
from cache_service.tiers.lower_tier import TIER_DEVICE, TIER_HOST
from protos import cache_pb2, kv_transfer_pb2

BS = 4
KEY_A, KEY_B = b"a" * 32, b"b" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet(pulls: tuple[bool, ...] = (True, True), num_blocks: int = 32,
          host_slots: int = 0) -> tuple[PoolRegistry, Clock, list[Pool]]:
    clock = Clock()
    registry = PoolRegistry(lease_seconds=60, clock=clock)
    pools = []
    for i, on in enumerate(pulls):
        name = "ab"[i] if i < 2 else f"p{i}"
        addr, key = (f"127.0.0.1:{7000 + i}", bytes([65 + i]) * 32) if on else ("", b"")
        pools.append(registry.register_replica(name, num_blocks, BS, "fp", 100_000, f"127.0.0.1:{6000 + i}",
                                               f"inc-{name}", kv_transfer_addr=addr, kv_transfer_key=key,
                                               tiers=TierSpec(num_host_slots=host_slots)).pool)
    return registry, clock, pools


def step(pool: Pool, admits=(), finishes=(), pulls=()) -> StepResult:
    result = pool.step(StepInput(admits=list(admits), finishes=list(finishes), pull_outcomes=list(pulls)))
    pool.check_integrity()
    return result


def cache(pool: Pool, rid: str, tokens: list[int], namespace: str = "") -> None:
    """Admit and finish `tokens`, fully computed: their whole pages end up cached in `pool`."""
    (adm,) = step(pool, [Admit(rid, tokens, namespace)]).admits
    assert adm.admitted
    step(pool, finishes=[Finish(rid, [], len(tokens))], pulls=done(adm.pulls))


def done(pulls, pages=None) -> list[CopyOutcome]:
    return [CopyOutcome(p.pull_id, len(p.src) if pages is None else pages) for p in pulls]


def prompt(seed: int, n: int = 17) -> list[int]:
    return [seed * 100 + i for i in range(n)]


def test_an_admission_pulls_the_pages_another_replica_holds_and_pins_them_until_its_next_step() -> None:
    _, _, (a, b) = fleet()
    tokens = prompt(1)  # 4 whole pages cacheable (at least the last token is computed)
    cache(a, "x", tokens)
    (adm,) = step(b, [Admit("y", tokens)]).admits
    assert adm.cached_tokens == 0 and adm.miss.other_replica_tokens == 0  # pulled, not missed
    (pull,) = adm.pulls
    assert pull.source_worker_id == "a" and pull.source_addr == "127.0.0.1:7000"
    assert pull.src == a.tree.peek_prefix(tokens[:16]).block_ids and pull.dst == adm.block_table[:4]
    assert pull.page_hashes == [n for n in a.tree.match_prefix(tokens[:16]).last_node.hashes][-4:]
    assert a.tree.protected_size == 4 and a.pulls.pinned_pages == 4  # pinned: not evictable
    assert a.evict(32) == 0
    step(b, pulls=done([pull]))
    assert a.tree.protected_size == 0 and a.pulls.pinned_pages == 0
    stats_b, stats_a = b.stats().pulls, a.stats().pulls
    assert (stats_b.num_pulls, stats_b.num_pulled_pages, stats_b.num_failed_pages, stats_b.peer_hit_tokens) == (1, 4, 0,
                                                                                                               16)
    assert stats_a.num_served_pulls == 1 and stats_a.num_pinned_pages == 0


def test_the_ticket_is_signed_with_the_sources_key_and_names_its_pages() -> None:
    _, clock, (a, b) = fleet()
    tokens = prompt(2)
    cache(a, "x", tokens, "tenant")
    (adm,) = step(b, [Admit("y", tokens, "tenant")]).admits
    msg = convert.peer_pull(adm.pulls[0])
    assert hmac.compare_digest(hmac.new(b"A" * 32, msg.ticket, hashlib.sha256).digest(), msg.ticket_mac)
    ticket = kv_transfer_pb2.PullTicket.FromString(msg.ticket)
    assert (ticket.worker_id, ticket.incarnation, ticket.puller_worker_id) == ("a", "inc-a", "b")
    assert list(ticket.src) == adm.pulls[0].src and ticket.namespace == "tenant"
    assert ticket.src_tier == cache_pb2.TIER_DEVICE and ticket.expires_at > 0
    assert msg.pin_seconds == DEFAULT_PIN_SECONDS and list(msg.dst) == adm.pulls[0].dst
    assert b"A" * 32 not in msg.SerializeToString()  # the key never leaves the cache manager


def test_a_failed_pull_releases_its_pin_and_counts_its_pages_failed() -> None:
    _, _, (a, b) = fleet()
    tokens = prompt(3)
    cache(a, "x", tokens)
    (adm,) = step(b, [Admit("y", tokens)]).admits
    step(b, pulls=done(adm.pulls, pages=1))  # one page arrived
    assert a.pulls.pinned_pages == 0 and a.tree.protected_size == 0
    assert b.stats().pulls.num_failed_pages == 3


def test_a_pull_not_reported_yet_keeps_its_pin_until_a_later_step_reports_it() -> None:
    _, _, (a, b) = fleet()
    tokens = prompt(16)
    cache(a, "x", tokens)
    (adm,) = step(b, [Admit("y", tokens)]).admits
    step(b)  # the puller is still reading (it pulls while it runs other requests)
    step(b)
    assert a.pulls.pinned_pages == 4 and a.tree.protected_size == 4
    step(b, pulls=done(adm.pulls))
    assert a.pulls.pinned_pages == 0 and b.stats().pulls.num_failed_pages == 0
    step(b, pulls=done(adm.pulls))  # reported twice across Steps: the second changes nothing


def test_a_puller_that_re_registers_ends_its_pins() -> None:
    registry, _, (a, b) = fleet()
    tokens = prompt(17)
    cache(a, "x", tokens)
    step(b, [Admit("y", tokens)])
    registry.register_replica("b", 32, BS, "fp", 100_000, "127.0.0.1:6001", "inc-b",
                              kv_transfer_addr="127.0.0.1:7001", kv_transfer_key=b"B" * 32)  # re-attach
    assert a.pulls.pinned_pages == 0 and a.tree.protected_size == 0


def test_a_pin_whose_puller_never_steps_again_expires() -> None:
    registry, clock, (a, b) = fleet()
    tokens = prompt(4)
    cache(a, "x", tokens)
    (adm,) = step(b, [Admit("y", tokens)]).admits
    assert adm.pulls
    clock.now += DEFAULT_PIN_SECONDS - 0.1
    registry.expire_routed()
    assert a.pulls.pinned_pages == 4
    clock.now += 0.2
    registry.expire_routed()
    assert a.pulls.pinned_pages == 0 and a.tree.protected_size == 0
    assert a.stats().pulls.num_expired_pins == 1 and b.stats().pulls.num_failed_pages == 4
    step(b, pulls=done(adm.pulls))  # a late report changes nothing
    assert a.pulls.pinned_pages == 0


def test_retiring_either_side_ends_the_pin() -> None:
    registry, _, (a, b) = fleet()
    tokens = prompt(5)
    cache(a, "x", tokens)
    step(b, [Admit("y", tokens)])
    registry.retire("b", "test")
    assert a.pulls.pinned_pages == 0 and a.tree.protected_size == 0
    a.check_integrity()
    registry2, _, (a2, b2) = fleet()
    cache(a2, "x", tokens)
    (adm,) = step(b2, [Admit("y", tokens)]).admits
    registry2.retire("a", "test")  # the source's tree is gone with it: the report is harmless
    step(b2, pulls=done(adm.pulls))
    b2.check_integrity()


def test_no_pull_across_namespaces_or_without_transfer_or_when_the_puller_holds_as_much() -> None:
    _, _, (a, b, c) = fleet((True, True, False))
    tokens = prompt(6)
    cache(a, "x", tokens, "t1")
    (adm,) = step(b, [Admit("y", tokens, "t2")]).admits
    assert adm.pulls == [] and adm.miss.other_replica_tokens == 0  # t1's pages say nothing to t2
    (adm,) = step(c, [Admit("y", tokens, "t1")]).admits  # c serves no transfer: it pulls nothing
    assert adm.pulls == [] and adm.miss.other_replica_tokens == 16
    cache(b, "z", tokens, "t1")  # b now holds as much as a
    (adm,) = step(b, [Admit("w", tokens + [1, 2, 3, 4], "t1")]).admits
    assert adm.pulls == [] and adm.cached_tokens == 16


def test_only_the_pages_after_the_pullers_own_hit_are_pulled() -> None:
    _, _, (a, b) = fleet()
    tokens = prompt(7, 33)  # 8 pages cacheable
    cache(a, "x", tokens)
    cache(b, "y", tokens[:9])  # b holds the first 2 pages
    (adm,) = step(b, [Admit("z", tokens)]).admits
    assert adm.cached_tokens == 8
    (pull,) = adm.pulls
    assert len(pull.src) == 6 and pull.dst == adm.block_table[2:8]
    step(b, pulls=done(adm.pulls))


def test_pulls_stop_where_they_would_cost_as_much_as_computing() -> None:
    _, _, (a, b) = fleet()
    tokens = prompt(8)
    cache(a, "x", tokens)
    b.load = ReplicaLoad(peer_load_cost=1.2)  # measured: pulling is slower than computing here
    (adm,) = step(b, [Admit("y", tokens)]).admits
    assert adm.pulls == [] and adm.miss.other_replica_tokens == 16


def test_a_sources_pins_are_capped() -> None:
    _, _, (a, b) = fleet(num_blocks=40)
    tokens, other = prompt(9, 41), prompt(10, 41)  # 10 pages each: the cap is a quarter of 40 blocks
    cache(a, "x", tokens)
    cache(a, "o", other)
    adm, adm2 = step(b, [Admit("y", tokens), Admit("w", other)]).admits
    assert len(adm.pulls[0].src) == 10 == int(MAX_PINNED_SHARE * 40)
    assert adm2.admitted and adm2.pulls == []  # a holds 10 pinned pages already: no room for 10 more
    assert adm2.miss.other_replica_tokens == 40
    step(b, pulls=done(adm.pulls))
    assert a.pulls.pinned_pages == 0


def test_bad_pull_outcomes_are_refused_whole() -> None:
    _, _, (a, b) = fleet()
    tokens = prompt(11)
    cache(a, "x", tokens)
    (adm,) = step(b, [Admit("y", tokens)]).admits
    with pytest.raises(InvalidArgument, match="exceeds"):
        step(b, pulls=[CopyOutcome(adm.pulls[0].pull_id, 5)])
    with pytest.raises(InvalidArgument, match="twice"):
        step(b, pulls=done(adm.pulls) * 2)
    assert a.pulls.pinned_pages == 4  # nothing applied
    step(b, pulls=done(adm.pulls))


def test_registration_refuses_half_an_endpoint_or_a_bad_key() -> None:
    registry = PoolRegistry()
    with pytest.raises(InvalidArgument, match="together"):
        registry.register_replica("a", 8, BS, kv_transfer_addr="h:1")
    with pytest.raises(InvalidArgument, match="16-64 bytes"):
        registry.register_replica("a", 8, BS, kv_transfer_addr="h:1", kv_transfer_key=b"short")
    assert registry.pools == {}


def test_peer_pulls_off_brokers_none() -> None:
    registry, _, (a, b) = fleet()
    registry.peer_pulls = False
    tokens = prompt(12)
    cache(a, "x", tokens)
    (adm,) = step(b, [Admit("y", tokens)]).admits
    assert adm.pulls == []


def test_route_prices_a_peer_hit_at_the_pull_cost_and_names_the_source() -> None:
    registry, _, (a, b) = fleet()
    tokens = prompt(13, 65)  # 16 pages
    cache(a, "x", tokens)
    a.load = ReplicaLoad(num_waiting_tokens=5000)  # a is busy
    ranked = registry.route(RouteQuery(token_ids=tuple(tokens), model_fingerprint="fp")).candidates
    assert [c.pool_id for c in ranked] == ["b", "a"]  # the idle replica, pulling, wins
    best = ranked[0]
    assert best.matched_tokens == 0 and best.matched_peer_tokens == 64 and best.pull_from_worker_id == "a"
    assert best.prefill_tokens == 1
    assert ranked[1].matched_tokens == 64 and ranked[1].matched_peer_tokens == 0
    # Another namespace sees nothing of it.
    other = registry.route(RouteQuery(token_ids=tuple(tokens), namespace="t", model_fingerprint="fp")).candidates
    assert all(c.matched_peer_tokens == 0 and c.pull_from_worker_id == "" for c in other)


def test_pages_the_source_holds_in_its_host_tier_are_pulled_from_there() -> None:
    _, _, (a, b) = fleet(host_slots=16)
    tokens = prompt(14)
    cache(a, "x", tokens)
    assert a.evict(32) == 4  # its pages go down to the host tier ...
    copies = a.step(StepInput()).offloads
    a.step(StepInput(copy_outcomes=[CopyOutcome(c.copy_id, len(c.src)) for c in copies]))  # ... and arrive
    assert a.tree.total_size == 0 and a.tiers.host.tree.total_size == 4
    (adm,) = step(b, [Admit("y", tokens)]).admits
    (pull,) = adm.pulls
    assert pull.src_tier == TIER_HOST and pull.src == a.tiers.host.tree.peek_prefix(tokens[:16]).block_ids
    assert a.tiers.host.tree.protected_size == 4  # pinned in the host tier: its slots are not reused
    ticket = kv_transfer_pb2.PullTicket.FromString(convert.peer_pull(pull).ticket)
    assert ticket.src_tier == cache_pb2.TIER_HOST
    step(b, pulls=done([pull]))
    assert a.tiers.host.tree.protected_size == 0 and a.pulls.pinned_pages == 0
    a.check_integrity()


def test_a_device_source_is_preferred_when_it_holds_as_much() -> None:
    _, _, (a, b) = fleet(host_slots=16)
    tokens = prompt(15)
    cache(a, "x", tokens)
    (adm,) = step(b, [Admit("y", tokens)]).admits
    assert adm.pulls[0].src_tier == TIER_DEVICE
    step(b, pulls=done(adm.pulls))
