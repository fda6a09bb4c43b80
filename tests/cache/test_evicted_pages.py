"""EvictedPages: the bounded memory of evicted page hashes behind MissBreakdown.evicted_tokens."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cache_service.miss_reasons import EvictedPages

hash_batches = st.lists(st.lists(st.integers(0, 60), max_size=9), max_size=30)  # small range: repeats


def add_all(pages: EvictedPages, batches: list[list[int]]) -> EvictedPages:
    for batch in batches:
        pages.add(batch)
    return pages


@given(hash_batches, st.integers(2, 24))
def test_bounded_and_keeps_the_most_recent_half(batches: list[list[int]], capacity: int) -> None:
    pages = add_all(EvictedPages(capacity), batches)
    assert len(pages) <= capacity
    recent: list[int] = []  # distinct hashes, most recently evicted last
    for h in (h for batch in batches for h in batch):
        if h in recent:
            recent.remove(h)
        recent.append(h)
    assert all(h in pages for h in recent[-(capacity // 2):])
    assert set(pages.hashes()) <= set(recent)


@given(hash_batches, st.integers(2, 24), st.data())
def test_content_depends_on_the_hashes_not_on_how_calls_cut_them(batches, capacity, data) -> None:
    """So a snapshot (hashes()) restored with one add() behaves as the live state from then on."""
    flat = [h for batch in batches for h in batch]
    one_call = add_all(EvictedPages(capacity), [flat])
    live = add_all(EvictedPages(capacity), batches)
    assert live.hashes() == one_call.hashes()
    restored = add_all(EvictedPages(capacity), [live.hashes()])
    assert restored.hashes() == live.hashes() and len(restored) == len(live)
    more = data.draw(hash_batches)
    assert add_all(restored, more).hashes() == add_all(live, more).hashes()


def test_a_page_older_than_capacity_is_forgotten() -> None:
    pages = EvictedPages(8)
    pages.add([1, 2, 3])
    pages.add(range(100, 110))
    assert 1 not in pages and 109 in pages and len(pages) <= 8
    pages.clear()
    assert len(pages) == 0 and 109 not in pages
