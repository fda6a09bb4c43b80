"""Cache-manager shards (common/shards.py): every replica computes the same owner, pools spread
evenly, and a new shard takes pools only for itself."""

from __future__ import annotations

import collections

import pytest

from common.shards import parse_shards, shard_for

SHARDS = [f"cache-{i}.cache:50051" for i in range(4)]
WORKERS = [f"replica-{i}" for i in range(2000)]


def test_parse_shards_keeps_order_and_refuses_empty_or_repeated() -> None:
    assert parse_shards("a:1, b:2") == ["a:1", "b:2"]
    assert parse_shards("a:1") == ["a:1"]
    for bad in ("", "a:1,", "a:1,,b:2", "a:1,a:1"):
        with pytest.raises(ValueError):
            parse_shards(bad)


def test_the_owner_depends_on_the_worker_and_the_shard_set_not_their_order() -> None:
    for worker in WORKERS[:50]:
        assert shard_for(worker, SHARDS) == shard_for(worker, list(reversed(SHARDS)))
    with pytest.raises(ValueError):
        shard_for("w", [])


def test_pools_spread_evenly_over_the_shards() -> None:
    counts = collections.Counter(shard_for(w, SHARDS) for w in WORKERS)
    assert set(counts) == set(SHARDS)
    assert all(abs(n - len(WORKERS) / 4) < 0.15 * len(WORKERS) / 4 for n in counts.values()), counts


def test_a_new_shard_takes_about_its_share_and_moves_nothing_else() -> None:
    before = {w: shard_for(w, SHARDS) for w in WORKERS}
    grown = SHARDS + ["cache-4.cache:50051"]
    after = {w: shard_for(w, grown) for w in WORKERS}
    moved = [w for w in WORKERS if before[w] != after[w]]
    assert all(after[w] == grown[-1] for w in moved)
    assert abs(len(moved) - len(WORKERS) / 5) < 0.2 * len(WORKERS) / 5
