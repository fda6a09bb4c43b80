"""The durable cache manager alone (bench.journal_bench): Step latency with and without
`--state-dir`, restart-to-serving with ~100k cached blocks, hit rate across a restart."""

from __future__ import annotations

from bench import journal_bench
from bench.harness import Json
from bench.workloads.base import Context, Workload
from bench.workloads.components import run_component


def run_journal(ctx: Context, deadline: float) -> Json:
    return run_component(ctx, "journal_bench (Step with/without --state-dir, restart, hit rate)", journal_bench.run)


def flat_journal(d: Json) -> Json:
    r = d["results"]
    step, restart, hits = r["step"], r["restart"], r["hit_rate"]
    return {
        "journal_step_p50_us": step["with"]["p50_us"], "journal_step_p99_us": step["with"]["p99_us"],
        "journal_off_step_p50_us": step["without"]["p50_us"], "journal_off_step_p99_us": step["without"]["p99_us"],
        "journal_step_p50_ratio": step["p50_ratio"], "journal_step_p99_ratio": step["p99_ratio"],
        "journal_bytes_per_step": step["journal_bytes_per_step"],
        "journal_restart_cached_blocks": restart["cached_blocks"],
        "journal_restart_replay_s": restart["replay"]["restart_to_serving_s"],
        "journal_restart_snapshot_s": restart["snapshot"]["restart_to_serving_s"],
        "journal_recovery_snapshot_s": restart["snapshot"]["recovery_s"],
        "journal_snapshot_bytes": restart["snapshot_bytes"],
        "journal_hit_rate_before": hits["with_state_dir"]["hit_rate_before"],
        "journal_hit_rate_after": hits["with_state_dir"]["hit_rate_after"],
        "journal_off_hit_rate_after": hits["without_state_dir"]["hit_rate_after"],
    }


def report_journal(d: Json) -> str:
    return "durable cache manager (bench.journal_bench)\n" + d["report"]


JOURNAL = Workload(name="journal", help="the durable cache manager: Step with/without --state-dir, restart, hit rate",
                   run=run_journal, flat=flat_journal, report=report_journal, cap_s=240.0, runs=lambda ctx: 1,
                   needs_services=False, needs_model=False)
