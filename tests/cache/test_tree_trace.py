"""testing/tree_trace.py: the trace is deterministic and shaped as issue 12 says; on a small pool
every tree evicts, and all agree on hits and evictions (run_trace checks that) and integrity."""

from __future__ import annotations

from testing.tree_trace import make_trace, run_trace


def test_trace_is_deterministic_and_shaped() -> None:
    trace = make_trace(200)
    assert trace == make_trace(200) and trace != make_trace(200, seed=1)
    assert len(trace) == 200 and all(len(t) == 1024 for t in trace)
    assert len({t[:512] for t in trace}) <= 100 and len({t[512:] for t in trace}) == 200


def test_trees_agree_on_a_small_pool() -> None:
    trace = make_trace(120, num_prefixes=10)
    for page_size in (16, 1):
        row = run_trace(page_size, trace, 20_000, check=lambda tree: tree.check_integrity())
        assert row["new"]["evict_calls"] > 0 and row["new"]["hit_rate"] > 0.4
        assert row["new_over_old"] > 0 and row["new_hashed"]["evicted_pages"] == row["old"]["evicted_pages"]
