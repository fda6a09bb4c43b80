"""Peer KV pulls (cache_service/peer_pulls.py, model_service/kv_pulls/): a replica admitting a prompt
whose prefix another replica holds pulls those pages from it (KvTransfer) instead of computing
them. The fleet of the `fleet` workload (bench/workloads/fleet.py: a cache manager, two replicas of
the bundled model with `--num-threads 1`, the suite's dtype, and `python -m router --policy kv`),
every replica with `--kv-pulls on`; random token ids in [100, 40000) from the suite's seeded
generator.

1. forced pull, TTFT (`pulls_forced_ttft`): a fleet with pulls on (cache manager `--peer-pulls on`),
   each replica warmed up (fleet.warm_up), then per turn, straight to the replicas' ModelService
   (gRPC Generate, 4 tokens, greedy): a fresh 1040-token prompt on replica B (cold), a second
   fresh 1040-token prompt on replica A (its 1024 cacheable tokens, 64 pages, now cached there),
   the same prompt on B (pulled from A). B's TTFT as the replica reports it
   (Usage.time_to_first_token), pulled / cold, per turn and the median (target <= 0.2x). Checks:
   B's output tokens equal A's, and B's Usage.cached_peer_tokens is the 1024 cacheable tokens.
2. hot prefix (`pulls_hot_prefix`): one 2048-token system prompt shared by 64 requests (the prefix
   + 32 unique tokens each, 16 tokens out, ignore_eos, greedy) sent through the router at an
   arrival rate above one replica's capacity (see `sizes`). Run twice, pulls on (`--peer-pulls
   on`) and pulls off (`--peer-pulls off`), every process started afresh for each (a fresh fleet,
   warmed up with fleet.warm_up, then a router); before the measured requests the prefix is
   computed once on replica A (a warm-up request sent to it directly), so in both runs A holds it
   and B does not. The same prompts and arrival times in both. Throughput (completion tokens /
   wall) on / off (target >= 1.5x), client TTFT p90 on / off (target <= 0.5x), requests each
   replica served (Usage.served_by), Usage.cached_peer_tokens summed, and each pool's PullStats
   from the cache manager after the run. Where the requests go is the router's (Route's)
   decision alone: the workload reports it, it does not steer it.
"""

from __future__ import annotations

import statistics
import time

import grpc

from bench.harness import (
    Json,
    machine_info,
    repetitions,
    stream_record,
    stream_sync,
    summary,
    table,
)
from bench.workloads.base import Context, Workload
from bench.workloads.fleet import Fleet, group_prompts, policy_run, routed_run, router_missing, warm_up
from bench.workloads.fleet import sizes as fleet_sizes
from protos import cache_pb2, cache_pb2_grpc, model_pb2_grpc

LOW_ID = 100  # token ids in [LOW_ID, 40000), as the reference script
SIDES = ("on", "off")  # cache manager --peer-pulls
REPLICA_NAMES = ("A", "B")  # the fleet's replicas 0 and 1
# After a request finishes, before the next that is to find its pages (cached on another replica):
# a finish reaches the cache manager with the replica's next Step (as bench/workloads/tiered.py).
SETTLE_S = 0.1


def sizes(ctx: Context) -> Json:
    # Arrivals: the hot-prefix requests are sent evenly over `window_s` (64 in 3 s: 21 requests/s
    # offered), far above one replica's capacity: in the pulls-off run, where the kv router keeps
    # every request on the replica that holds the prefix, that replica (1 thread) served the 64 at
    # 4.6 requests/s (13.8 s wall, a decode step of its 64-request batch ~0.32 s) in the first full
    # run on the 2-core Intel Xeon. Every run reports `offered_req_s` and each side's
    # `served_req_s`, so the margin is on record. Evenly spaced rather than Poisson: both sides get
    # the same arrival times, and one run per side leaves no room for a random process's variance.
    if ctx.quick:
        return {"replicas": 2, "num_blocks": 1024, "forced_turns": 1, "forced_prefix": 1024, "forced_tail": 16,
                "forced_answer": 4, "hot_prefix": 1024, "hot_requests": 16, "question": 32, "new_tokens": 16,
                "window_s": 1.0, "warm_group": 2, "hot_turns": 1, "fleet_turns": 1}
    # 2048 blocks: a source's pages pinned for pulls may be at most a quarter of its pool
    # (cache_service/peer_pulls.py MAX_PINNED_SHARE): 512 pages, four pulls of the 128-page prefix at once.
    return {"replicas": 2, "num_blocks": 2048, "forced_turns": 3, "forced_prefix": 1024, "forced_tail": 16,
            "forced_answer": 4, "hot_prefix": 2048, "hot_requests": 64, "question": 32, "new_tokens": 16,
            "window_s": 3.0, "warm_group": 4, "hot_turns": 2, "fleet_turns": 3}


def fleet_for(ctx: Context, cfg: Json, side: str) -> Fleet:
    return Fleet(ctx, cfg, cache_args=["--peer-pulls", side], replica_args=["--kv-pulls", "on"])


def replica_names(fleet: Fleet) -> dict[str, str]:
    """Serving address -> A / B."""
    return dict(zip(fleet.replica_addrs, REPLICA_NAMES, strict=True))


def pull_stats(fleet: Fleet) -> Json:
    """Each replica's PullStats (cache.proto) by its name here (A, B)."""
    names = replica_names(fleet)
    with grpc.insecure_channel(fleet.cache_addr) as channel:
        pools = cache_pb2_grpc.CacheManagerStub(channel).Stats(cache_pb2.StatsRequest(), timeout=30).pools
    return {names.get(p.serving_addr, p.worker_id): {f.name: getattr(p.pulls, f.name)
                                                     for f in p.pulls.DESCRIPTOR.fields} for p in pools}


# ---------------------------------------------------------------------- 1. forced pull


def forced(ctx: Context, cfg: Json, deadline: float) -> Json:
    n, answer = cfg["forced_prefix"] + cfg["forced_tail"], cfg["forced_answer"]
    turns: list[Json] = []
    with fleet_for(ctx, cfg, "on").running() as fleet:
        with ctx.progress.run("forced pull: warming up the replicas", 0):
            warm_up(ctx, fleet, {"prefix": n, "question": cfg["forced_tail"], "per_group": cfg["warm_group"]})
        a_addr, b_addr = fleet.replica_addrs[:2]
        with grpc.insecure_channel(a_addr) as ca, grpc.insecure_channel(b_addr) as cb:
            for channel in (ca, cb):  # connected before the clock: a new connection would add to TTFT
                grpc.channel_ready_future(channel).result(timeout=30)
            a, b = model_pb2_grpc.ModelServiceStub(ca), model_pb2_grpc.ModelServiceStub(cb)
            for turn in repetitions(cfg["forced_turns"], deadline):
                with ctx.progress.run(f"forced pull, turn {turn + 1}", 0):
                    cold = stream_sync(b, ctx.prompts.ids(n, LOW_ID), answer)
                    prompt = ctx.prompts.ids(n, LOW_ID)
                    on_a = stream_sync(a, prompt, answer)
                    time.sleep(SETTLE_S)
                    pulled = stream_sync(b, prompt, answer)
                turns.append({"cold_b": stream_record(cold), "a": stream_record(on_a),
                              "pulled_b": stream_record(pulled),
                              "ratio": pulled.usage.time_to_first_token / cold.usage.time_to_first_token,
                              "identical": pulled.token_ids == on_a.token_ids})
        stats = pull_stats(fleet)
    ratios = [t["ratio"] for t in turns]
    peer = [t["pulled_b"]["cached_peer_tokens"] for t in turns]
    return {"turns": turns, "ratio": summary(ratios), "ratio_median": statistics.median(ratios),
            "cold_ttft_s": statistics.median(t["cold_b"]["server_ttft_s"] for t in turns),
            "pulled_ttft_s": statistics.median(t["pulled_b"]["server_ttft_s"] for t in turns),
            "identical": all(t["identical"] for t in turns), "cached_peer_tokens": peer,
            "expected_peer_tokens": cfg["forced_prefix"],
            "peer_tokens_ok": all(p == cfg["forced_prefix"] for p in peer),
            "pull_stats": stats}


# ---------------------------------------------------------------------- 2. hot prefix


def hot_side(ctx: Context, cfg: Json, side: str, prefix: list[int], prompts: list[list[int]],
             arrivals: list[float]) -> Json:
    with fleet_for(ctx, cfg, side).running() as fleet:
        with ctx.progress.run(f"hot prefix, pulls {side}: warming up the replicas", 0):
            warm_up(ctx, fleet, {"prefix": cfg["hot_prefix"], "question": cfg["question"],
                                 "per_group": cfg["warm_group"]})
        names = replica_names(fleet)
        addr = fleet.start_router("kv")
        try:
            with ctx.progress.run(f"hot prefix, pulls {side}: the prefix on replica A", 0):
                with grpc.insecure_channel(addr) as channel:  # the router's first call, not measured
                    stream_sync(model_pb2_grpc.ModelServiceStub(channel), ctx.prompts.ids(16, LOW_ID), 2)
                with grpc.insecure_channel(fleet.replica_addrs[0]) as channel:
                    warm = stream_sync(model_pb2_grpc.ModelServiceStub(channel),
                                       prefix + ctx.prompts.ids(cfg["question"], LOW_ID), 2)
                time.sleep(SETTLE_S)
            out = routed_run(ctx, addr, prompts, cfg["new_tokens"], arrivals, f"hot prefix, pulls {side}")
        finally:
            fleet.stop_router()
        out["prefix_warm_up"] = stream_record(warm)
        out["pull_stats"] = pull_stats(fleet)
    out["requests_per_replica"] = {names.get(a, a): k for a, k in sorted(out["requests_per_replica"].items())}
    out["served_req_s"] = len(prompts) / out["wall_s"]
    return out


def turn_order(turn: int) -> tuple[str, str]:
    """Sides take turns: on, off, then off, on, ... (neither always goes first on a warmer machine)."""
    return SIDES if turn % 2 == 0 else SIDES[::-1]


def hot(ctx: Context, cfg: Json) -> Json:
    k = cfg["hot_requests"]
    prefix = ctx.prompts.ids(cfg["hot_prefix"], LOW_ID)
    prompts = [prefix + ctx.prompts.ids(cfg["question"], LOW_ID) for _ in range(k)]
    arrivals = [i * cfg["window_s"] / k for i in range(k)]
    out: Json = {"offered_req_s": k / cfg["window_s"], "turns": []}
    for turn in range(cfg["hot_turns"]):
        sides = {side: hot_side(ctx, cfg, side, prefix, prompts, arrivals) for side in turn_order(turn)}
        sides["tok_s_ratio"] = sides["on"]["tok_s"] / sides["off"]["tok_s"]
        sides["ttft_p90_ratio"] = sides["on"]["ttft_s"]["p90"] / sides["off"]["ttft_s"]["p90"]
        out["turns"].append(sides)
    out.update(out["turns"][0])  # the tables show the first turn; the ratios are medians over turns
    out["tok_s_ratio"] = statistics.median(t["tok_s_ratio"] for t in out["turns"])
    out["ttft_p90_ratio"] = statistics.median(t["ttft_p90_ratio"] for t in out["turns"])
    return out


# ---------------------------------------------------------------------- 3. the fleet workload, pulls on / off


def fleet_turns(ctx: Context, cfg: Json) -> Json:
    """The `fleet` workload's traffic (groups of requests sharing a prefix, shuffled, through the kv
    router) with pulls on and off, turns alternating: pulls must cost it nothing."""
    fcfg = fleet_sizes(ctx)
    prompts = group_prompts(ctx, fcfg)
    runs: dict[str, list[Json]] = {side: [] for side in SIDES}
    for turn in range(cfg["fleet_turns"]):
        for side in turn_order(turn):
            with fleet_for(ctx, fcfg, side).running() as fleet:
                with ctx.progress.run(f"fleet workload, pulls {side}: warming up the replicas", 0):
                    warm_up(ctx, fleet, fcfg)
                run = policy_run(ctx, fleet, "kv", prompts, fcfg)
            runs[side].append({"tok_s": run["tok_s"], "ttft_p50_s": run["ttft_s"]["p50"],
                               "ttft_p99_s": run["ttft_s"]["p99"], "hit_rate": run["hit_rate"],
                               "cached_peer_tokens": run["cached_peer_tokens"],
                               "requests_per_replica": sorted(run["requests_per_replica"].values())})
    ratios = [on["tok_s"] / off["tok_s"] for on, off in zip(runs["on"], runs["off"], strict=True)]
    return {"config": {k: fcfg[k] for k in ("groups", "per_group", "prefix", "question", "new_tokens", "gap_s")},
            "runs": runs, "tok_s_ratios": ratios, "tok_s_ratio": statistics.median(ratios)}


# ---------------------------------------------------------------------- the workload


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    info = machine_info(ctx.threads)
    ctx.progress.write(f"pulls: {info['cpu_label']}; 2 replicas x 1 thread, {ctx.dtype}, --kv-pulls on")
    began = time.perf_counter()
    detail: Json = {"config": {**cfg, "dtype": ctx.dtype, "replica_threads": 1, "token_ids": [LOW_ID, 40000]},
                    "machine": {"cpu_model": info["cpu_label"], "cpu_isa": info["cpu_isa"],
                                "logical_cores": info["logical_cores"]}}
    # the forced turns stop repeating (after 2) past a third of the cap: the hot-prefix runs need the rest
    detail["forced"] = forced(ctx, cfg, began + (deadline - began) / 3)
    forced_s = time.perf_counter() - began
    detail["hot_prefix"] = hot(ctx, cfg)
    hot_s = time.perf_counter() - began - forced_s
    detail["fleet"] = fleet_turns(ctx, cfg)
    detail["wall_s"] = time.perf_counter() - began
    detail["phase_s"] = {"forced": forced_s, "hot_prefix": hot_s,  # fleet starts included
                         "fleet": detail["wall_s"] - forced_s - hot_s}
    return detail


def flat(d: Json) -> Json:
    f, h = d["forced"], d["hot_prefix"]
    out: Json = {"pulls_forced_ttft": f["ratio_median"], "pulls_forced_cold_ttft_s": f["cold_ttft_s"],
                 "pulls_forced_pulled_ttft_s": f["pulled_ttft_s"], "pulls_forced_identical": f["identical"],
                 "pulls_forced_peer_tokens": min(f["cached_peer_tokens"]),
                 "pulls_hot_prefix_tok_s_ratio": h["tok_s_ratio"],
                 "pulls_hot_prefix_ttft_p90_ratio": h["ttft_p90_ratio"],
                 "pulls_hot_prefix_offered_req_s": h["offered_req_s"],
                 "pulls_fleet_tok_s_ratio": d["fleet"]["tok_s_ratio"]}
    for side in SIDES:
        s = h[side]
        out.update({f"pulls_hot_prefix_{side}_tok_s": s["tok_s"],
                    f"pulls_hot_prefix_{side}_ttft_p90_s": s["ttft_s"]["p90"],
                    f"pulls_hot_prefix_{side}_cached_peer_tokens": s["cached_peer_tokens"]})
        for name in REPLICA_NAMES:
            out[f"pulls_hot_prefix_{side}_requests_{name.lower()}"] = s["requests_per_replica"].get(name, 0)
    return out


def report(d: Json) -> str:
    c, f, h = d["config"], d["forced"], d["hot_prefix"]
    lines = [f"peer KV pulls: {d['machine']['cpu_model']}; 2 replicas x 1 thread, {c['dtype']}, --kv-pulls on"]
    rows = [[str(i + 1), f"{1e3 * t['cold_b']['server_ttft_s']:.1f}", f"{1e3 * t['a']['server_ttft_s']:.1f}",
             f"{1e3 * t['pulled_b']['server_ttft_s']:.1f}", f"{t['ratio']:.3f}",
             str(t["pulled_b"]["cached_peer_tokens"]),
             "yes" if t["identical"] else "NO"] for i, t in enumerate(f["turns"])]
    lines.append(f"forced pull: {c['forced_prefix'] + c['forced_tail']}-token prompt computed on A, then sent to B "
                 f"(Usage.time_to_first_token; cold = a fresh prompt on B)")
    lines.append(table(rows, ["turn", "B cold TTFT ms", "A TTFT ms", "B pulled TTFT ms", "pulled / cold",
                              "cached_peer_tokens", "B tokens = A's"]))
    lines.append(f"pulls_forced_ttft {f['ratio_median']:.3f}x (median of {len(f['turns'])}; target <= 0.2x); "
                 f"identical {'yes' if f['identical'] else 'NO'}; peer tokens "
                 f"{'ok' if f['peer_tokens_ok'] else 'NOT'} {f['expected_peer_tokens']} every turn")
    rows = []
    for turn, sides in enumerate(h["turns"]):
        for side in turn_order(turn):
            s = sides[side]
            b = s["pull_stats"].get("B", {})
            rows.append([str(turn + 1), side, f"{s['tok_s']:.1f}", f"{s['ttft_s']['p50']:.2f} / {s['ttft_s']['p90']:.2f}",
                         f"{s['wall_s']:.1f}", f"{s['served_req_s']:.1f}",
                         " / ".join(str(s["requests_per_replica"].get(n, 0)) for n in REPLICA_NAMES),
                         str(s["cached_peer_tokens"]),
                         f"{b.get('num_pulls', 0)} / {b.get('num_failed_pages', 0)}", f"{100 * s['hit_rate']:.0f}%"])
    lines.append(f"hot prefix: {c['hot_requests']} requests = one {c['hot_prefix']}-token prefix (computed on A "
                 f"first) + {c['question']} unique, {c['new_tokens']} out, through the kv router, evenly over "
                 f"{c['window_s']:g} s ({h['offered_req_s']:.1f} requests/s offered)")
    lines.append(table(rows, ["turn", "peer pulls", "tok/s", "TTFT p50/p90 s", "wall s", "served req/s",
                              "requests A / B", "cached_peer_tokens", "B pulls / failed pages", "hit"]))
    per_turn = ", ".join(f"{t['tok_s_ratio']:.2f}x / {t['ttft_p90_ratio']:.2f}x" for t in h["turns"])
    lines.append(f"pulls on / off (median of {len(h['turns'])} turns): throughput {h['tok_s_ratio']:.2f}x "
                 f"(target >= 1.5x), TTFT p90 {h['ttft_p90_ratio']:.2f}x (target <= 0.5x); per turn {per_turn}")
    fl = d["fleet"]
    fc = fl["config"]
    rows = [[str(i + 1), side, f"{r['tok_s']:.1f}", f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}",
             f"{100 * r['hit_rate']:.0f}%", str(r["cached_peer_tokens"]),
             " ".join(str(k) for k in r["requests_per_replica"])]
            for i in range(len(fl["runs"]["on"])) for side in turn_order(i) for r in [fl["runs"][side][i]]]
    lines.append(f"fleet workload ({fc['groups']} groups x {fc['per_group']}, {fc['prefix']}-token prefix + "
                 f"{fc['question']}, {fc['new_tokens']} out, one every {fc['gap_s']} s) through the kv router:")
    lines.append(table(rows, ["turn", "peer pulls", "tok/s", "TTFT p50/p99 s", "hit", "cached_peer_tokens",
                              "requests per replica"]))
    lines.append(f"fleet pulls on / off: throughput {fl['tok_s_ratio']:.2f}x (median; target: no worse, within "
                 f"noise), per turn " + ", ".join(f"{r:.2f}x" for r in fl["tok_s_ratios"]))
    lines.append("phases (fleet starts included): " + ", ".join(f"{k} {v:.0f} s" for k, v in d["phase_s"].items()))
    return "\n".join(lines)


PULLS = Workload(
    name="pulls", help="peer KV pulls: TTFT of a pulled 1024-token prefix; a hot prefix via the router, on vs off",
    run=run, flat=flat, report=report, cap_s=900.0,
    runs=lambda ctx: 2 + sizes(ctx)["forced_turns"] + (4 * sizes(ctx)["hot_turns"] + 2 * sizes(ctx)["fleet_turns"])
    * len(SIDES),
    needs_services=False, needs_model=False, available=router_missing)
