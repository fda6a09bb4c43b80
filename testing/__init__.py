"""What both the tests and the benchmarks use, so that neither imports the other (dev-only: not
in the installed package; pytest and `python -m bench` import it from the repo root).

- `fault_proxy`: a TCP proxy in front of a real server that adds latency and breaks connections
  on command (tests/client, tests/model_service; bench/workloads/cache_link.py).
- `baseline_radix_tree`: the frozen previous radix tree (tests/cache/test_tree_differential.py,
  the `_old_` rows of the tree-trace bench).
- `tree_trace`: issue 12's fixed trace and the lockstep driver of the current and frozen trees
  (tests/cache/test_tree_trace.py; bench/cache_bench.py).
"""
