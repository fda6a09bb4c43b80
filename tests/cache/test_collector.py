"""The server's collector policy (cache_service/collector.py): young garbage is never frozen,
survivors are, and a full collection still frees what became garbage after it was frozen."""

from __future__ import annotations

import gc
import weakref

import pytest

from cache_service import collector


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def gc_state():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_freezing_survivors_frees_young_cycles_first_and_freezes_the_living(gc_state) -> None:
    dead = cycle()  # garbage, not collected yet
    alive = Node()
    alive.other = alive
    before = gc.get_freeze_count()
    collector.freeze_survivors()
    assert dead() is None  # collected, not frozen
    assert gc.get_freeze_count() > before
    assert id(alive) in {id(o) for o in gc.get_referrers(alive) if o is alive} or gc.is_tracked(alive)


def test_a_full_collection_frees_cycles_that_died_frozen(gc_state) -> None:
    holder = [Node()]
    holder[0].other = holder[0]
    probe = weakref.ref(holder[0])
    collector.freeze_survivors()  # frozen while alive
    holder.clear()
    gc.collect()
    assert probe() is not None  # frozen objects are not collected...
    collector.full_collection()
    assert probe() is None  # ...until a full collection


def test_automatic_full_collections_are_off_young_ones_kept(gc_state) -> None:
    young, middle, _ = gc.get_threshold()
    collector.no_automatic_full_collections()
    assert gc.get_threshold()[:2] == (young, middle) and gc.get_threshold()[2] >= 1 << 30
