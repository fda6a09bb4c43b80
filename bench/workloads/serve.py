"""Serve: vLLM's own benchmark client (`vllm bench serve --backend openai --endpoint /v1/completions`,
run from .venv-vllm by bench/vllm_bench_client.py) against two OpenAI-compatible servers on the
same weights: radixkv's router HTTP door (`python -m router --http-port`, one model replica with
the suite's threads, its cache manager) and vLLM's own OpenAI server (`python -m
vllm.entrypoints.openai.api_server`, CPU backend, prefix caching on, the VLLM_CPU_* settings of
bench/peers.py). Issue 33: the comparison a user would make, through HTTP, reproducible here.

Per dtype (float32 and bfloat16; a --quick run only the suite's --dtype): both servers start with
that dtype, each side serves an unmeasured warm-up of every dataset's shape, then the sides take
turns (ours, vLLM, then vLLM, ours, ...; who goes first alternates per turn) on two datasets:
  shared   vLLM's `prefix_repetition`: 4 prefixes x 8 prompts, 1024-token prefix + 32, 64 out
  random   vLLM's `random`: 512 tokens in, 64 out, no sharing
each 32 prompts, --max-concurrency 16, --ignore-eos, --temperature 0. Turn k uses seed SEED + k on
both sides: the two see the same prompts in a turn, and every turn's prompts are new to both
prefix caches (no clearing needed; the client's ready-check request, which would warm the first
prompt's prefix, is off). Then both servers stop.

The client runs both as users call it: the warm-ups without `--model` (the client then takes the
model from the server's /v1/models: its first entry's `id` names the requests' model and its `root`
is the model id the client reports; `--tokenizer` stays the local weights folder), the measured
turns with `--model` and `--served-model-name`.

Per run: output tok/s, TTFT / TPOT / ITL p50 (vLLM's figures); per turn radixkv / vLLM ratios and
their median. Checks, every run, warm-ups included: completed == asked and output tokens ==
prompts x output length (greedy with ignore_eos: every request runs to its length), on both sides;
on radixkv's side also one streamed event per token for every request (vLLM's client appends an
inter-token gap per SSE event with a choice after the first, so a request of output_len tokens
must have exactly output_len - 1 gaps in its saved detailed result: more means an extra event,
e.g. the finish reason sent apart from the last token; fewer, tokens merged into one event). A
failed check fails the workload (`CheckFailed`, naming the run and requests), both dtypes'
measurements lost with it: a comparison where our side did not do what was asked, or where the
client timed several tokens as one, means nothing. vLLM's own share of one-event-per-token
requests is recorded. Each run also records the CPU
other processes used meanwhile (`foreign_cpu_cores`): on 2 shared cores OpenMP decode slows several-
fold when another process takes a core, for either server, so a turn with a busy neighbour says
little about the engines.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import peers
from bench.harness import (
    BLOCK_SIZE,
    REPO,
    START_TIMEOUT_S,
    Json,
    alternate,
    free_port,
    kernels_line,
    machine_info,
    repetitions,
    table,
)
from bench.workloads.base import Context, Workload, num
from bench.workloads.fleet import router_missing
from bench.workloads.shared_prefix import SETTLE_S
from scripts.service_process import ServiceError, ServiceProcess

CLIENT = REPO / "bench" / "vllm_bench_client.py"
SEED = 20240611
WARMUP_SEED = 7  # the warm-up's prompts: none of the measured turns' (SEED + k)
DATASETS = ("shared", "random")
DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16"}
SIDES = ("radixkv", "vllm")
VLLM_START_TIMEOUT_S = 900.0
CLIENT_TIMEOUT_S = 900.0


class CheckFailed(RuntimeError):
    """A run's output broke a check (token counts, one event per token): fails the workload."""


def sizes(ctx: Context) -> Json:
    if ctx.quick:
        return {"prompts": 8, "concurrency": 4, "prefixes": 2, "prefix": 256, "suffix": 16, "random_in": 128,
                "new_tokens": 16, "turns": 1, "num_blocks": 1024, "dtypes": [ctx.dtype]}
    return {"prompts": 32, "concurrency": 16, "prefixes": 4, "prefix": 1024, "suffix": 32, "random_in": 512,
            "new_tokens": 64, "turns": 3, "num_blocks": 4096, "dtypes": list(peers.VLLM_DTYPES)}


def unavailable() -> str | None:
    """Why the workload cannot run here: no .venv-vllm (or vllm fails to import), or no router."""
    return peers.vllm_absent_reason() or router_missing()


# ---------------------------------------------------------------------- the servers


def _get_json(url: str, timeout_s: float = 5.0) -> tuple[int, Json]:
    """(status, body) of a GET; (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, {}
    except (OSError, ValueError):
        return 0, {}


def _wait_healthy(base_url: str, timeout_s: float, alive: Callable[[], str | None]) -> None:
    """Polls GET /health until 200; ServiceError when `alive` names a dead process or time runs out."""
    deadline = time.monotonic() + timeout_s
    while _get_json(f"{base_url}/health")[0] != 200:
        dead = alive()
        if dead:
            raise ServiceError(dead)
        if time.monotonic() > deadline:
            raise ServiceError(f"{base_url}/health did not answer 200 within {timeout_s:g} s")
        time.sleep(0.5)


class RadixkvServer:
    """Cache manager + one model replica + the router with its HTTP door, real processes."""

    def __init__(self, ctx: Context, dtype: str, num_blocks: int) -> None:
        self.ctx, self.dtype, self.num_blocks = ctx, dtype, num_blocks
        self.log: collections.deque[str] = collections.deque(maxlen=400)
        self.procs: list[ServiceProcess] = []
        self.base_url = ""

    def start(self) -> None:
        cache = ServiceProcess("cache_service", ["--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING"],
                               self.log.append, cwd=str(REPO))
        self.procs.append(cache)
        cache_addr = cache.wait_listening(60.0)
        cache.wait_serving(60.0)
        model = ServiceProcess("model_service", [
            "--host", "127.0.0.1", "--port", "0", "--cache-addr", cache_addr, "--worker-id", f"serve-{self.dtype}",
            "--num-threads", str(self.ctx.threads), "--num-blocks", str(self.num_blocks),
            "--block-size", str(BLOCK_SIZE), "--dtype", self.dtype,  # --max-num-seqs: the default, as users run it
            "--device", "cpu", "--log-level", "INFO"], self.log.append, cwd=str(REPO))
        self.procs.append(model)
        replica = model.wait_listening(START_TIMEOUT_S, watch=[cache])
        model.wait_serving(START_TIMEOUT_S, watch=[cache])
        port = free_port()
        router = ServiceProcess("router", [
            "--host", "127.0.0.1", "--port", "0", "--http-port", str(port), "--cache-addr", cache_addr,
            "--replica", replica, "--log-level", "WARNING"], self.log.append, cwd=str(REPO))
        self.procs.append(router)
        router.wait_serving(60.0, watch=[cache, model])
        self.base_url = f"http://127.0.0.1:{port}"
        _wait_healthy(self.base_url, 60.0, self._dead)

    def _dead(self) -> str | None:
        for p in self.procs:
            if not p.running():
                return f"{p.name} exited with code {p.proc.poll()}"
        return None

    def model_id(self) -> str:
        """The id the door's /v1/models lists: what requests' `model` must name."""
        status, body = _get_json(f"{self.base_url}/v1/models")
        try:
            return body["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise ServiceError(f"the router's /v1/models answered {status} without a model id: {body}") from None

    def kernels(self) -> str:
        return kernels_line(self.log)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.running()]

    def stop(self) -> None:
        for p in reversed(self.procs):  # router first: no request reaches a replica going away
            p.stop(15.0)
        self.procs = []


class VllmServer:
    """vLLM's OpenAI server (.venv-vllm) on the converted weights, prefix caching on."""

    def __init__(self, ctx: Context, dtype: str, served_name: str, max_num_seqs: int) -> None:
        self.ctx, self.dtype = ctx, dtype
        self.dir = Path(tempfile.mkdtemp(prefix="radixkv-vllm-serve-"))
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = [str(peers.VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                     "--port", str(self.port), "--model", str(peers.model_folder()), "--served-model-name",
                     served_name, "--dtype", dtype, "--enable-prefix-caching", "--max-model-len", "2048",
                     "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", "2048", "--seed", "0"]
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Starts the server and waits for /health; returns the seconds it took."""
        began = time.perf_counter()
        with open(self.dir / "log.txt", "w") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=vllm_env(self.ctx.threads),
                                         start_new_session=True)
        _wait_healthy(self.base_url, VLLM_START_TIMEOUT_S,
                      lambda: None if self.proc.poll() is None else
                      f"vLLM's server exited with code {self.proc.poll()}\n{self.log_tail()}")
        return time.perf_counter() - began

    def version(self) -> str | None:
        return _get_json(f"{self.base_url}/version")[1].get("version")

    def log_tail(self, lines: int = 20) -> str:
        path = self.dir / "log.txt"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def vllm_env(threads: int) -> dict[str, str]:
    """bench/peers.py's settings for vLLM's CPU backend (4 GiB of KV, OpenMP bound to our cores)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{max(threads, 1) - 1}",
               VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("OMP_NUM_THREADS", None)  # vLLM binds its own OpenMP threads
    return env


# ---------------------------------------------------------------------- the client


@dataclass(slots=True)
class Target:
    """Where the client sends its requests and what it names."""

    side: str
    base_url: str
    model_id: str


def dataset_args(cfg: Json, dataset: str) -> list[str]:
    """The client's dataset arguments of `dataset` ("shared" or "random")."""
    if dataset == "shared":
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(cfg["prefix"]),
                "--prefix-repetition-suffix-len", str(cfg["suffix"]), "--prefix-repetition-num-prefixes",
                str(cfg["prefixes"]), "--prefix-repetition-output-len", str(cfg["new_tokens"])]
    return ["--dataset-name", "random", "--random-input-len", str(cfg["random_in"]), "--random-output-len",
            str(cfg["new_tokens"]), "--random-range-ratio", "0"]


def client_run(ctx: Context, cfg: Json, target: Target, dataset: str, seed: int, prompts: int, label: str,
               name_model: bool = True) -> Json:
    """One `vllm bench serve` run (`name_model` False: without --model, the client asks the server's
    /v1/models); its result, checked (CheckFailed)."""
    work = Path(tempfile.mkdtemp(prefix="radixkv-bench-serve-"))
    try:
        out = work / "result.json"
        model_args = ["--model", target.model_id, "--served-model-name", target.model_id] if name_model else []
        argv = [str(peers.VLLM_PYTHON), str(CLIENT), str(out), "--backend", "openai", "--endpoint", "/v1/completions",
                "--base-url", target.base_url, *model_args,
                "--tokenizer", str(peers.model_folder()), *dataset_args(cfg, dataset),
                "--num-prompts", str(prompts), "--max-concurrency", str(cfg["concurrency"]), "--ignore-eos",
                "--temperature", "0", "--seed", str(seed), "--ready-check-timeout-sec", "0", "--disable-tqdm",
                "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
        time.sleep(SETTLE_S)  # neither side's turn starts while the other's workers still spin
        phase = f"serve run {label}"
        with ctx.progress.run(label, 0), ctx.monitor.phase(phase), open(work / "log.txt", "w") as log:
            proc = subprocess.Popen(argv, cwd=work, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=vllm_env(ctx.threads), start_new_session=True)
            ctx.extra_pids.add(proc.pid)  # the client's CPU is part of the measurement, not foreign load
            try:
                code = proc.wait(CLIENT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
            finally:
                ctx.extra_pids.discard(proc.pid)
        if code != 0 or not out.is_file():
            tail = "\n".join((work / "log.txt").read_text(errors="replace").splitlines()[-25:])
            raise RuntimeError(f"vLLM's bench client ({label}) exited with code {code}\n{tail}")
        load = ctx.monitor.phases.pop(phase, {})  # this run's own record, not a phase of the suite's
        result = {**summarize(json.loads(out.read_text()), prompts, cfg["new_tokens"]), "named_model": name_model,
                  "foreign_cpu_cores": load.get("foreign_cpu_cores"), "load1_after": load.get("load1_after")}
        check(result, target.side, label)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check(result: Json, side: str, label: str) -> None:
    """CheckFailed unless every request completed with the asked number of tokens (both sides) and,
    on radixkv's side, each token arrived in an event of its own."""
    problems = []
    if result["completed"] != result["asked"]:
        problems.append(f"completed {result['completed']} of {result['asked']} requests; errors: "
                        f"{result['errors'][:2]}")
    if result["output_tokens"] != result["expected_output_tokens"]:
        problems.append(f"output tokens {result['output_tokens']}, asked {result['expected_output_tokens']} "
                        f"(per request: {result['output_lens']})")
    if side == "radixkv" and result["per_token_mismatches"]:
        shown = ", ".join(f"request {i}: {n} tokens, {c} gaps" for i, n, c in result["per_token_mismatches"][:5])
        problems.append(f"{len(result['per_token_mismatches'])} requests without one event per token "
                        f"(gaps != tokens - 1): {shown}")
    if problems:
        raise CheckFailed(f"{label}: " + "; ".join(problems))


def summarize(r: Json, asked: int, new_tokens: int) -> Json:
    """The reported figures of one client result, and what the checks need."""
    lens, counts = r.get("output_lens") or [], r.get("itl_counts") or []
    per_token = [n > 0 and c == n - 1 for n, c in zip(lens, counts, strict=False)]
    mismatches = [(i, n, c) for i, (n, c) in enumerate(zip(lens, counts, strict=False)) if not (n > 0 and c == n - 1)]
    if len(lens) != len(counts):  # the client's lists must pair up; if not, nothing was checked
        mismatches.append((-1, len(lens), len(counts)))
    return {"tok_s": num(r.get("output_throughput")), "ttft_p50_ms": num(r.get("median_ttft_ms")),
            "ttft_p99_ms": num(r.get("p99_ttft_ms")), "tpot_p50_ms": num(r.get("median_tpot_ms")),
            "itl_p50_ms": num(r.get("median_itl_ms")), "duration_s": num(r.get("duration")),
            "completed": r.get("completed"), "asked": asked, "output_tokens": r.get("total_output_tokens"),
            "expected_output_tokens": asked * new_tokens, "input_tokens": r.get("total_input_tokens"),
            "per_token_events_share": sum(per_token) / asked if asked else None,
            "per_token_mismatches": mismatches, "output_lens": lens,
            "checks_ok": r.get("completed") == asked and r.get("total_output_tokens") == asked * new_tokens,
            "model_id": r.get("model_id"), "errors": r.get("errors") or []}


# ---------------------------------------------------------------------- the workload


def _ratios(ours: list[Json], theirs: list[Json]) -> Json:
    """radixkv / vLLM per turn (tok/s: higher is better for us; latencies: lower) and the medians."""
    out: Json = {}
    for key in ("tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms"):
        per_turn = [a[key] / b[key] for a, b in zip(ours, theirs, strict=False) if a.get(key) and b.get(key)]
        out[key] = {"per_turn": per_turn, "median": statistics.median(per_turn) if per_turn else None}
    return out


def _one_dtype(ctx: Context, cfg: Json, dtype: str, deadline: float) -> Json:
    ours = RadixkvServer(ctx, dtype, cfg["num_blocks"])
    theirs: VllmServer | None = None
    entry: Json = {"runs": {d: {s: [] for s in SIDES} for d in DATASETS}}
    try:
        with ctx.progress.run(f"serve {dtype}: starting radixkv (cache manager, replica, router)", 0):
            ours.start()
        ctx.extra_pids.update(ours.pids())
        model_id = ours.model_id()
        entry["model_id"], entry["kernels"] = model_id, ours.kernels()
        ctx.progress.write(f"serve {dtype}: radixkv {entry['kernels'] or '(no start-up line with the kernels)'}")
        theirs = VllmServer(ctx, dtype, model_id, cfg["prompts"])  # as bench/peers.py sizes its engine
        with ctx.progress.run(f"serve {dtype}: starting vLLM's server", 0):
            entry["vllm_startup_s"] = theirs.start()
        ctx.extra_pids.add(theirs.proc.pid)
        entry["vllm_version"] = theirs.version()
        targets = {"radixkv": Target("radixkv", ours.base_url, model_id),
                   "vllm": Target("vllm", theirs.base_url, model_id)}
        entry["warmups"] = {}
        for dataset in DATASETS:  # warm-up: each dataset's shape once per side, other prompts, no --model
            for side in SIDES:
                warm = client_run(ctx, cfg, targets[side], dataset, WARMUP_SEED, cfg["concurrency"],
                                  f"serve {dtype} warm-up {dataset} {side} (no --model)", name_model=False)
                entry["warmups"][f"{dataset} {side}"] = {k: warm[k] for k in ("model_id", "completed", "output_tokens",
                                                                              "per_token_events_share")}
        for turn in repetitions(cfg["turns"], deadline):
            for dataset in DATASETS:
                def side_run(side: str, dataset: str = dataset, turn: int = turn) -> None:
                    entry["runs"][dataset][side].append(client_run(
                        ctx, cfg, targets[side], dataset, SEED + turn, cfg["prompts"],
                        f"serve {dtype} {dataset} turn {turn + 1} {side}"))
                alternate(turn, lambda: side_run("radixkv"), lambda: side_run("vllm"))
    except Exception as error:
        error.add_note("--- radixkv services output (last lines) ---\n" + "\n".join(list(ours.log)[-40:])
                       + ("\n--- vLLM server log (last lines) ---\n" + theirs.log_tail(40) if theirs else ""))
        raise
    finally:
        ours.stop()
        if theirs is not None:
            theirs.stop()
        ctx.extra_pids.clear()
    entry["vs_vllm"] = {d: _ratios(entry["runs"][d]["radixkv"], entry["runs"][d]["vllm"]) for d in DATASETS}
    return entry


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    info = machine_info(ctx.threads)
    detail: Json = {"config": {**cfg, "replica_threads": ctx.threads, "client": "vllm bench serve --backend openai "
                               "--endpoint /v1/completions (bench/vllm_bench_client.py)", "seeds": f"{SEED} + turn"},
                    "machine": {"cpu_model": info["cpu_label"], "cpu_isa": info["cpu_isa"],
                                "logical_cores": info["logical_cores"]}, "dtypes": {}}
    ctx.progress.write(f"serve: {info['cpu_label']} ({', '.join(info['cpu_isa']) or 'no AVX flags'})")
    ctx.extra_pids.clear()
    failures = 0
    for i, dtype in enumerate(cfg["dtypes"]):
        share = (deadline - time.perf_counter()) / (len(cfg["dtypes"]) - i)  # each dtype its part of what is left
        try:
            detail["dtypes"][dtype] = _one_dtype(ctx, cfg, dtype, time.perf_counter() + share)
        except CheckFailed:
            raise  # loudly: a run that did not do what was asked
        except Exception as error:  # recorded: the other dtype still runs
            failures += 1
            notes = "\n".join(getattr(error, "__notes__", []))
            detail["dtypes"][dtype] = {"error": f"{type(error).__name__}: {error}\n{notes}"}
            ctx.progress.write(f"serve {dtype} failed: {type(error).__name__}: {str(error).splitlines()[0]}")
    if failures == len(cfg["dtypes"]):
        raise RuntimeError("every dtype failed:\n" + "\n".join(d["error"] for d in detail["dtypes"].values()))
    return detail


def _median(runs: list[Json], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def flat(d: Json) -> Json:
    out: Json = {}
    for dtype, e in d["dtypes"].items():
        if "runs" not in e:
            continue
        tag = DTYPE_TAGS.get(dtype, dtype)
        for dataset in DATASETS:
            runs, versus = e["runs"][dataset], e["vs_vllm"][dataset]
            prefix = f"serve_{dataset}_{tag}"
            out[f"{prefix}_tok_s"] = _median(runs["radixkv"], "tok_s")
            out[f"vllm_{prefix}_tok_s"] = _median(runs["vllm"], "tok_s")
            out[f"{prefix}_vs_vllm"] = versus["tok_s"]["median"]
            out[f"{prefix}_ttft_vs_vllm"] = versus["ttft_p50_ms"]["median"]
            out[f"{prefix}_tpot_vs_vllm"] = versus["tpot_p50_ms"]["median"]
            out[f"{prefix}_checks_ok"] = all(r["checks_ok"] for side in SIDES for r in runs[side])
            shares = [r["per_token_events_share"] for r in runs["radixkv"] if r["per_token_events_share"] is not None]
            out[f"{prefix}_per_token_events_share"] = min(shares) if shares else None
    return out


def _f(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def report(d: Json) -> str:
    c = d["config"]
    lines = [f"serve: vllm bench serve (openai, /v1/completions), {c['prompts']} prompts, concurrency "
             f"{c['concurrency']}, {c['new_tokens']} out, greedy, ignore_eos; shared = {c['prefixes']} prefixes x "
             f"{c['prompts'] // c['prefixes']}, {c['prefix']} + {c['suffix']} tokens; random = {c['random_in']} in; "
             f"radixkv: router HTTP door + 1 replica x {c['replica_threads']} threads",
             f"CPU: {d['machine']['cpu_model']} ({', '.join(d['machine']['cpu_isa'])})"]
    for dtype, e in d["dtypes"].items():
        if "runs" not in e:
            lines.append(f"{dtype}: FAILED {e.get('error', '').splitlines()[0] if e.get('error') else ''}")
            continue
        lines.append(f"\n{dtype}: vLLM {e.get('vllm_version')}; radixkv kernels: {e.get('kernels') or '?'}")
        if e.get("warmups"):
            lines.append("warm-ups without --model (model id the client took from /v1/models' root): " + ", ".join(
                f"{k} {w['model_id']}" for k, w in e["warmups"].items()))
        rows = []
        for dataset in DATASETS:
            runs = e["runs"][dataset]
            for turn, pair in enumerate(zip(runs["radixkv"], runs["vllm"], strict=False)):
                for side, r in zip(SIDES, pair, strict=True):
                    rows.append([f"{dataset} t{turn + 1} {side}", _f(r["tok_s"], ".1f"), _f(r["ttft_p50_ms"], ".0f"),
                                 _f(r["tpot_p50_ms"], ".1f"), _f(r["itl_p50_ms"], ".1f"),
                                 f"{r['completed']}/{r['asked']}", f"{r['output_tokens']}/{r['expected_output_tokens']}",
                                 _f(None if r["per_token_events_share"] is None else 100 * r["per_token_events_share"],
                                    ".0f") + "%", _f(r.get("foreign_cpu_cores"), ".2f")])
        lines.append(table(rows, ["run", "out tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms", "completed",
                                  "out tokens", "1 event/token", "other procs' cores"]))
        for dataset in DATASETS:
            v = e["vs_vllm"][dataset]
            turns = ", ".join(f"{x:.2f}x" for x in v["tok_s"]["per_turn"])
            lines.append(f"{dataset}: radixkv / vLLM tok/s per turn {turns or '-'}; median {_f(v['tok_s']['median'], '.2f')}x"
                         f" (TTFT {_f(v['ttft_p50_ms']['median'], '.2f')}x, TPOT {_f(v['tpot_p50_ms']['median'], '.2f')}x,"
                         f" ITL {_f(v['itl_p50_ms']['median'], '.2f')}x; latencies: lower is better)")
        lines.append("checks passed in every run (a failed one fails the workload): completed == asked, output "
                     "tokens == asked, radixkv one event per token")
    return "\n".join(lines)


SERVE = Workload(name="serve", help="vllm bench serve (HTTP) vs radixkv's router door and vLLM's server, fp32 + bf16",
                 run=run, flat=flat, report=report, cap_s=2400.0,
                 runs=lambda ctx: len(sizes(ctx)["dtypes"]) * (2 + 2 * len(DATASETS) * (1 + sizes(ctx)["turns"])),
                 needs_services=False, needs_model=False, available=unavailable)
