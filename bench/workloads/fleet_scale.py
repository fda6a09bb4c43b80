"""One cache-manager process under a simulated fleet of GPU-class replicas (bench.fleet_scale):
Step and Route latency as the fleet grows, and the knee (Step p99 under 10 ms)."""

from __future__ import annotations

from bench import fleet_scale
from bench.harness import Json
from bench.workloads.base import Context, Workload
from bench.workloads.components import run_component


def run_fleet_scale(ctx: Context, deadline: float) -> Json:
    return run_component(ctx, "fleet_scale (simulated GPU replicas against one cache manager)", fleet_scale.run)


def flat_fleet_scale(d: Json) -> Json:
    r = d["results"]
    out: Json = {"fleet_scale_knee_replicas": r["knee_replicas"]}
    for row in r["rows"]:
        n = row["replicas"]
        for key in ("steps_served_per_s", "step_p99_ms", "step_p999_ms", "route_p99_ms", "server_cpu"):
            out[f"fleet_scale_{n}_{key}"] = row[key]
    handlers = r.get("handlers")
    if handlers:
        for key in ("step_us", "route_us", "handler_cpu"):
            out[f"fleet_scale_handlers_{handlers['replicas']}_{key}"] = handlers[key]
    unary = r.get("unary_steps")
    if unary:
        out["fleet_scale_unary_knee_replicas"] = unary["knee_replicas"]
        for row in unary["rows"]:
            out[f"fleet_scale_unary_{row['replicas']}_steps_served_per_s"] = row["steps_served_per_s"]
            out[f"fleet_scale_unary_{row['replicas']}_step_p99_ms"] = row["step_p99_ms"]
    return out


def report_fleet_scale(d: Json) -> str:
    return "fleet scale (bench.fleet_scale)\n" + d["report"]


FLEET_SCALE = Workload(name="fleet_scale", help="one cache manager under 8-64 simulated GPU replicas: Step/Route latency, knee",
                       run=run_fleet_scale, flat=flat_fleet_scale, report=report_fleet_scale, cap_s=420.0,
                       runs=lambda ctx: 1, needs_services=False, needs_model=False)
