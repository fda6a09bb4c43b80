"""Event log: sequence numbers, bounded replay, subscribers, tree snapshots."""

from __future__ import annotations

import pytest

from cache_service.errors import OutOfRange
from cache_service.events import AllCleared, BlockRemoved, EventLog, tree_snapshot
from cache_service.radix_tree import RadixTree


def test_sequences_and_bounded_replay() -> None:
    log = EventLog(capacity=3)
    for i in range(5):
        log.publish(f"p{i % 2}", BlockRemoved([i], [i]))
    assert log.last_sequence == 5 and log.oldest_sequence == 3
    assert [e.sequence for e in log.replay(3)] == [3, 4, 5]
    assert [e.sequence for e in log.replay(4, pool_id="p1")] == [4]
    assert log.replay(6) == []  # the next sequence: nothing yet, not an error
    with pytest.raises(OutOfRange):
        log.replay(2)  # dropped from the buffer
    with pytest.raises(OutOfRange):
        log.replay(7)  # never produced (e.g. a consumer of a previous server)


def test_subscribers_get_events_in_order_until_unsubscribed() -> None:
    log = EventLog()
    got = []
    unsubscribe = log.subscribe(got.append)
    log.publish("p", AllCleared())
    log.publish("p", AllCleared())
    unsubscribe()
    log.publish("p", AllCleared())
    assert [e.sequence for e in got] == [1, 2] and log.num_subscribers == 0


def test_failing_subscriber_is_dropped_without_breaking_publish() -> None:
    log = EventLog()

    def broken(event):
        raise RuntimeError("boom")

    log.subscribe(broken)
    log.publish("p", AllCleared())
    assert log.num_subscribers == 0 and log.last_sequence == 1


def test_tree_snapshot_lists_parents_first() -> None:
    tree = RadixTree(2)
    tree.insert([1, 1, 2, 2], [10, 11])
    tree.insert([1, 1, 3, 3], [10, 12], namespace="")
    tree.insert([5, 5], [20], namespace="t")
    events = tree_snapshot("p", tree, sequence=7, timestamp=1.0)
    assert all(e.is_snapshot and e.sequence == 7 for e in events)
    known = {0}
    for e in events:
        assert e.payload.parent_block_hash in known  # parent already described
        known.update(e.payload.block_hashes)
    ids = sorted(b for e in events for b in e.payload.block_ids)
    assert ids == [10, 11, 12, 20]


def test_replay_buffer_is_bounded_in_bytes_not_only_in_events() -> None:
    """8,192 requests of 1,024 fresh tokens once left 340 MiB of buffered events; the buffer is
    now bounded by bytes, and the bound holds for the memory it really keeps alive."""
    import gc
    import random
    import tracemalloc

    from cache_service.events import BlockStored

    rng = random.Random(5)
    limit = 1024 * 1024
    log = EventLog(max_bytes=limit)
    gc.collect()
    tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    for _ in range(600):  # ~600 * 45 KiB = 27 MiB without the bound
        tokens = [rng.randrange(1000, 50000) for _ in range(1024)]
        log.publish("p", BlockStored([rng.getrandbits(63) for _ in range(64)], 0, tokens, 16, "", list(range(64))))
    gc.collect()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert log.buffered_bytes <= limit
    assert held - start <= 1.5 * limit, f"buffer keeps {(held - start) / 2**20:.1f} MiB alive"
    assert log.num_buffered < 600 and log.oldest_sequence == log.last_sequence - log.num_buffered + 1
    with pytest.raises(OutOfRange):
        log.replay(1)
    assert [e.sequence for e in log.replay(log.oldest_sequence)][-1] == 600


def test_buffered_events_leave_the_collector_nothing_to_walk_and_replay_whole() -> None:
    """The replay buffer holds events as flat tuples of atoms, which the cyclic collector stops
    tracking: 2,000 buffered events add no tracked object once collected, where events kept as
    objects with lists of ids added several each (a full collection walked them all, in the middle
    of a Step). Replay gives back every field."""
    import gc

    from cache_service.events import BlockStored, stored_from_node

    tree = RadixTree(4)
    tree.insert(list(range(12)), [7, 8, 9])
    (node,) = tree.iter_nodes()
    log = EventLog(clock=lambda: 1.5)
    published = [
        log.publish("p", stored_from_node(node, 4)),
        log.publish("q", BlockStored([5, 2**64 - 1], 3, [1, 2], 2, "ns", [4, 0])),  # lists from a caller
        log.publish("p", BlockRemoved((1, 2), (3, 4), "ns")),
        log.publish("p", AllCleared()),
    ]
    gc.collect()
    before = len(gc.get_objects())
    for i in range(2000):
        log.publish("p", stored_from_node(node, 4) if i % 2 else BlockRemoved((i, i + 1), (i, 3), "ns"))
    gc.collect()
    gc.collect()  # a row's inner tuples may be untracked one collection before the row itself
    assert len(gc.get_objects()) - before < 40
    replayed = log.replay(1)[:4]
    assert [e.sequence for e in replayed] == [1, 2, 3, 4]
    for got, sent in zip(replayed, published, strict=True):
        assert (got.pool_id, got.timestamp, got.publisher_epoch, got.is_snapshot) == \
            (sent.pool_id, 1.5, log.epoch, False)
        assert type(got.payload) is type(sent.payload)
        if not isinstance(sent.payload, AllCleared):
            for name in ("block_hashes", "block_ids", "namespace"):
                value, expected = getattr(got.payload, name), getattr(sent.payload, name)
                assert (value == expected) if name == "namespace" else (list(value) == list(expected))
    stored, sent = replayed[0].payload, published[0].payload
    assert list(stored.token_ids) == list(range(12)) and stored.parent_block_hash == sent.parent_block_hash == 0
    other = replayed[1].payload
    assert (list(other.token_ids), other.parent_block_hash, other.block_size) == ([1, 2], 3, 2)
