"""The cache manager over a slow link (issue 12): 16 concurrent requests with ragged prompt lengths
(so block crossings are spread over steps), 64 tokens out, the model service's link to the cache
manager direct vs through the fault proxy (testing/fault_proxy.py) with 2, 10 and 25 ms one-way
latency; `--cache-pipeline on` (with its default lookahead blocks) vs `off` (the synchronous path).

Four model services of their own (pipeline on/off x direct/proxied) share one cache manager; the
proxied ones share one proxy whose latency is set per case. Each case runs in a namespace of its
own (a cold cache for the same prompts), then measures the TTFT of a cache hit alone (one of its
prompts + 16 new tokens, max_tokens 1). From the model service's metrics: the share of steps that
blocked waiting for a cache Step reply and the mean wait (radixkv_cache_wait_seconds).
Targets: pipeline on, 25 ms throughput >= 0.97x direct; a hit's TTFT at most one step more than
the synchronous path's on the same link.
"""

from __future__ import annotations

import collections
import statistics
import uuid
from contextlib import ExitStack

from bench.harness import REPO, Json, free_port, repetitions, rotate, scrape, stream_concurrent, table
from bench.workloads.base import Context, Workload
from scripts.service_process import ServiceProcess
from testing.fault_proxy import FaultProxy

MODES = ("on", "off")
HIT_NEW_TOKENS = 16
HIT_TRIES = 3


def sizes(ctx: Context) -> Json:
    if ctx.quick:
        return {"concurrency": 8, "prompt_min": 40, "prompt_max": 120, "new_tokens": 24, "reps": 1,
                "latencies_ms": [0, 2, 10, 25]}
    return {"concurrency": 16, "prompt_min": 100, "prompt_max": 300, "new_tokens": 64, "reps": 3,
            "latencies_ms": [0, 2, 10, 25]}


def _link(latency_ms: int) -> str:
    return "direct" if latency_ms == 0 else f"{latency_ms}ms"


class _Model:
    """One model service process with its metrics endpoint."""

    def __init__(self, cache_addr: str, mode: str, log: collections.deque[str]) -> None:
        port = free_port()
        args = ["--host", "127.0.0.1", "--port", "0", "--cache-addr", cache_addr, "--num-blocks", "4096",
                "--block-size", "16", "--device", "cpu", "--attention", "torch", "--log-level", "WARNING",
                "--worker-id", f"cache-link-{mode}-{uuid.uuid4().hex[:6]}", "--cache-pipeline", mode,
                "--metrics-port", str(port)]
        self.process = ServiceProcess("model_service", args, log.append, cwd=str(REPO))
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self.addr = ""

    def wait(self) -> None:
        self.addr = self.process.wait_listening(300.0)
        self.process.wait_serving(300.0)


def _waits(before: Json, after: Json) -> Json:
    """Steps, steps that blocked on a cache reply and their mean wait, between two scrapes."""
    def hist(name: str) -> tuple[float, float]:
        a, b = after.get(name), before.get(name)
        if a is None:
            return 0.0, 0.0
        return a["count"] - (b["count"] if b else 0.0), a["sum"] - (b["sum"] if b else 0.0)

    steps = after.get("radixkv_model_steps", 0.0) - before.get("radixkv_model_steps", 0.0)
    waits_count, waits_sum = hist("radixkv_cache_wait_seconds")
    step_count, step_sum = hist("radixkv_model_step_seconds")
    return {"steps": steps, "waited_steps": waits_count,
            "wait_share": waits_count / steps if steps else float("nan"),
            "wait_mean_ms": 1e3 * waits_sum / waits_count if waits_count else 0.0,
            "step_mean_ms": 1e3 * step_sum / step_count if step_count else float("nan")}


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    c, new = cfg["concurrency"], cfg["new_tokens"]
    log: collections.deque[str] = collections.deque(maxlen=200)
    cases = [(mode, lat) for mode in MODES for lat in cfg["latencies_ms"]]
    samples: Json = {f"{_link(lat)}_{mode}": {"tok_s": [], "ttft_hit_s": [], "waits": []} for mode, lat in cases}
    with ExitStack() as stack:
        cache = ServiceProcess("cache_service", ["--host", "127.0.0.1", "--port", "0"], log.append, cwd=str(REPO))
        stack.callback(cache.stop, 5.0)
        cache_addr = cache.wait_listening(60.0)
        cache.wait_serving(60.0)
        proxy = stack.enter_context(FaultProxy(cache_addr))
        models = {(mode, proxied): _Model(proxy.addr if proxied else cache_addr, mode, log)
                  for mode in MODES for proxied in (False, True)}
        for m in models.values():
            stack.callback(m.process.stop, 10.0)
        with ctx.progress.run("starting 4 model services", 0):
            for m in models.values():
                m.wait()
            for m in models.values():  # warm-up: every code path once
                stream_concurrent(m.addr, [ctx.prompts.ids(32) for _ in range(2)], 4)

        def case(mode: str, lat: int, prompts: list[list[int]]) -> None:
            model = models[(mode, lat > 0)]
            proxy.latency_s = lat / 1e3
            namespace = f"cl-{uuid.uuid4().hex[:8]}"
            before = scrape(model.metrics_url)
            with ctx.progress.run(f"pipeline {mode}, {_link(lat)}", c * new) as tick:
                wall, results = stream_concurrent(model.addr, prompts, new, namespaces=[namespace] * c, on_tokens=tick)
            waits = _waits(before, scrape(model.metrics_url))
            hits = [stream_concurrent(model.addr, [prompts[i] + ctx.prompts.ids(HIT_NEW_TOKENS)], 1,
                                      namespaces=[namespace])[1][0] for i in range(HIT_TRIES)]
            s = samples[f"{_link(lat)}_{mode}"]
            s["tok_s"].append(sum(len(r.token_ids) for r in results) / wall)
            s["ttft_hit_s"].append(statistics.median(h.ttft for h in hits))
            s["waits"].append(waits)

        for rep in repetitions(cfg["reps"], deadline):
            prompts = [ctx.prompts.ids(n) for n in ctx.prompts.lengths(c, cfg["prompt_min"], cfg["prompt_max"])]
            rotate(rep, [lambda m=m, lat=lat, p=prompts: case(m, lat, p) for m, lat in cases])
    out: Json = {"config": cfg, "cases": {}}
    for key, s in samples.items():
        w = s["waits"]
        out["cases"][key] = {
            "tok_s": statistics.median(s["tok_s"]), "tok_s_samples": s["tok_s"],
            "ttft_hit_s": statistics.median(s["ttft_hit_s"]),
            "wait_share": statistics.median(x["wait_share"] for x in w),
            "wait_mean_ms": statistics.median(x["wait_mean_ms"] for x in w),
            "step_mean_ms": statistics.median(x["step_mean_ms"] for x in w),
        }
    return out


def flat(d: Json) -> Json:
    cases = d["cases"]
    out: Json = {}
    for key, r in cases.items():
        link, mode = key.rsplit("_", 1)
        direct = cases[f"direct_{mode}"]
        out[f"cache_link_tok_s_{key}"] = r["tok_s"]
        out[f"cache_link_ratio_to_direct_{key}"] = r["tok_s"] / direct["tok_s"]
        out[f"cache_link_ttft_hit_s_{key}"] = r["ttft_hit_s"]
        out[f"cache_link_wait_share_{key}"] = r["wait_share"]
        out[f"cache_link_wait_mean_ms_{key}"] = r["wait_mean_ms"]
        out[f"cache_link_step_mean_ms_{key}"] = r["step_mean_ms"]
        if mode == "on":  # a hit's TTFT, pipelined minus synchronous on the same link, in steps
            off = cases[f"{link}_off"]
            out[f"cache_link_ttft_hit_growth_steps_{link}"] = (
                (r["ttft_hit_s"] - off["ttft_hit_s"]) / (r["step_mean_ms"] / 1e3))
    return out


def report(d: Json) -> str:
    f = flat(d)
    rows = []
    for key, r in d["cases"].items():
        link, mode = key.rsplit("_", 1)
        growth = f.get(f"cache_link_ttft_hit_growth_steps_{link}") if mode == "on" else None
        rows.append([f"{link}, pipeline {mode}", f"{r['tok_s']:.1f}", f"{f[f'cache_link_ratio_to_direct_{key}']:.3f}",
                     f"{1e3 * r['ttft_hit_s']:.0f}" + (f" ({growth:+.2f} steps)" if growth is not None else ""),
                     f"{100 * r['wait_share']:.1f}%", f"{r['wait_mean_ms']:.1f}", f"{r['step_mean_ms']:.1f}"])
    cfg = d["config"]
    return (f"cache link latency: {cfg['concurrency']} ragged requests x {cfg['new_tokens']} tokens "
            f"(median of {cfg['reps']} reps; target: 25ms pipeline on >= 0.97x direct)\n"
            + table(rows, ["case", "tok/s", "vs direct", "hit TTFT ms (vs off)", "steps waited", "mean wait ms",
                           "step ms"]))


CACHE_LINK = Workload(name="cache_link", help="cache manager link direct vs 2/10/25 ms one-way, pipeline on vs off",
                      run=run, flat=flat, report=report, cap_s=600.0, runs=lambda ctx: 8 * sizes(ctx)["reps"],
                      needs_services=False, needs_model=False)
