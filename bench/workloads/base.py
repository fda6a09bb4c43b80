"""What a workload is and what the suite hands it (bench/suite.py builds the Context)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.harness import (
    ContinuousReference,
    Json,
    LoadMonitor,
    Progress,
    Prompts,
    Reference,
    Services,
    scrape,
)
from model_service.model_loader import LoadedModel


@dataclass
class Context:
    """One suite run: its options, the shared model service (when a workload needs it) and the
    transformers reference on the same weights and dtype."""

    quick: bool
    dtype: str
    threads: int
    all_baselines: bool
    prompts: Prompts
    progress: Progress
    monitor: LoadMonitor
    loaded: LoadedModel | None
    ref: Reference | None
    services: Services | None = None
    addr: str = ""
    extra_pids: set[int] = field(default_factory=set)  # children the load monitor counts as ours (vLLM)
    _cb: ContinuousReference | None = None

    def deadline(self, seconds: float) -> float:
        """perf_counter `seconds` from now (caps: a workload stops repeating past it)."""
        return time.perf_counter() + seconds

    def cb_ref(self) -> ContinuousReference:
        """transformers' continuous batching on a copy of the weights (made on first use)."""
        if self._cb is None:
            self._cb = ContinuousReference(self.loaded)
        return self._cb

    def drop_cb_ref(self) -> None:
        self._cb = None

    def scrape(self) -> Json:
        return scrape(self.services.metrics_url) if self.services is not None else {}

    def clear_cache(self) -> None:
        """Every workload starts with an empty prefix cache."""
        if self.services is not None:
            self.services.clear_pool()


@dataclass(frozen=True)
class Workload:
    """A named measurement. `run` returns its detail (stored under results["workloads"][name]);
    `flat` picks the top-level keys of results.json from it; `report` renders it for stdout."""

    name: str
    help: str
    run: Callable[[Context, float], Json]  # (context, deadline) -> detail
    flat: Callable[[Json], Json]
    report: Callable[[Json], str]
    cap_s: float  # full-mode time cap (quick mode: a fraction of it); baselines stop repeating past it
    runs: Callable[[Context], int]  # roughly how many runs it makes (progress bar length)
    needs_services: bool = True  # the shared cache_service + model_service
    needs_model: bool = True  # the transformers reference loaded in this process
    available: Callable[[], str | None] = lambda: None  # a reason to skip it, or None


def num(value: Any) -> float | None:
    """JSON-safe float: None for missing / NaN."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if value != value else value
