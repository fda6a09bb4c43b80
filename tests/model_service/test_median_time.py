"""The start-up timing helpers (model_service/median_time.py)."""

from __future__ import annotations

import time

from model_service.median_time import best_seconds, median_seconds


def test_best_seconds_takes_turns_and_leaves_a_slow_spell_out():
    calls: list[str] = []
    spell = iter([0.0, 0.03, 0.03, 0.03] + [0.0] * 20)  # b's first timed calls overlap a busy neighbour

    def a() -> None:
        calls.append("a")
        time.sleep(0.004)

    def b() -> None:
        calls.append("b")
        time.sleep(0.002 + next(spell))

    best_a, best_b = best_seconds([a, b], repeats=6)
    assert calls == ["a", "b"] + ["a", "b"] * 6  # one untimed call each, then in turns
    assert best_b < best_a  # b is the faster one, though its median over its first calls was not
    assert 0.002 <= best_b < 0.02 and 0.004 <= best_a


def test_median_seconds_skips_its_first_call():
    delays = iter([0.05, 0.001, 0.001, 0.001])
    assert median_seconds(lambda: time.sleep(next(delays)), repeats=3) < 0.02
