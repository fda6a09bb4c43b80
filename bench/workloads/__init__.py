"""The suite's workloads, in the order a full run makes them (`python -m bench --list`)."""

from bench.workloads.base import Context, Workload
from bench.workloads.cache_link import CACHE_LINK
from bench.workloads.components import CACHE, STEP
from bench.workloads.concurrency import CONCURRENCY
from bench.workloads.fleet import FLEET
from bench.workloads.fleet_scale import FLEET_SCALE
from bench.workloads.journal import JOURNAL
from bench.workloads.latency import LATENCY
from bench.workloads.multiturn import MULTITURN
from bench.workloads.no_share import NO_SHARE
from bench.workloads.parallel_sampling import PARALLEL_SAMPLING
from bench.workloads.pulls import PULLS
from bench.workloads.serve import SERVE
from bench.workloads.shared_prefix import SHARED_PREFIX, SHARED_PREFIX_LARGE
from bench.workloads.structured import STRUCTURED
from bench.workloads.tiered import TIERED

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    SHARED_PREFIX, SHARED_PREFIX_LARGE, MULTITURN, NO_SHARE, CONCURRENCY, LATENCY, CACHE_LINK, CACHE, JOURNAL, STEP, FLEET,
    FLEET_SCALE, TIERED, PULLS, STRUCTURED, PARALLEL_SAMPLING, SERVE)}

__all__ = ["WORKLOADS", "Context", "Workload"]
