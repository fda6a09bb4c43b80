"""Peer engines run in their own virtual environments: vLLM's CPU backend from .venv-vllm
(`make bench-peers` installs it; nothing here needs it, and `make test` never does).

vLLM runs in a subprocess (bench/vllm_worker.py) with VLLM_CPU_KVCACHE_SPACE=4 and
VLLM_CPU_OMP_THREADS_BIND=0-(threads-1), on the same weights the services load: the float32
safetensors folder model_service/model_loader.py converts the bundled GGUF into (~/.cache/radixkv).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.harness import REPO, Json

VLLM_VENV = Path(os.environ.get("RADIXKV_VLLM_VENV") or REPO / ".venv-vllm")
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
VLLM_DTYPES = ("float32", "bfloat16")


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


@functools.cache
def vllm_absent_reason() -> str | None:
    """Why vLLM cannot run here (None when .venv-vllm has it)."""
    if not VLLM_PYTHON.is_file():
        return f"{_shown(VLLM_VENV)} is absent (run `make bench-peers` to install vllm-cpu there)"
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        tail = (probe.stderr or probe.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return f"`import vllm` fails in {_shown(VLLM_VENV)}: {tail[0]}"
    return None


def model_folder() -> Path:
    """The float32 safetensors copy of the bundled GGUF (converted once by the model loader)."""
    from model_service.model_loader import _convert_gguf, bundled_model_path

    return _convert_gguf(bundled_model_path())


def run_vllm(runs: Sequence[Json], dtype: str, threads: int, *, timeout_s: float, warmup: list[list[int]],
             max_model_len: int, register_pid: Callable[[int | None], object] = lambda pid: None) -> Json:
    """One vLLM engine (`dtype`) over `runs` ([{"name", "prompts", "max_tokens"}]): the worker's
    output, or {"error": why} (timeout, crash: the log's last lines)."""
    spec = {"model": str(model_folder()), "dtype": dtype, "max_model_len": max_model_len,
            "max_num_seqs": max(len(r["prompts"]) for r in runs), "max_num_batched_tokens": 2048,
            "warmup": warmup, "runs": list(runs)}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{max(threads, 1) - 1}",
               VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")
    env.pop("OMP_NUM_THREADS", None)  # vLLM binds its own OpenMP threads
    with tempfile.TemporaryDirectory(prefix="radixkv-vllm-") as tmp:
        spec_path, out_path, log_path = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        spec_path.write_text(json.dumps(spec))
        started = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen([str(VLLM_PYTHON), str(WORKER), str(spec_path), str(out_path)], cwd=tmp,
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            register_pid(proc.pid)
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                code = None
            finally:
                register_pid(None)
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        if code is None:
            return {"error": f"vLLM ({dtype}) did not finish within {timeout_s:g} s", "log_tail": tail}
        if code != 0 or not out_path.is_file():
            return {"error": f"vLLM ({dtype}) exited with code {code}", "log_tail": tail}
        result = json.loads(out_path.read_text())
        result["process_s"] = time.perf_counter() - started
        return result
