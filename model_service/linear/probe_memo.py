"""This machine's answers to the linear plan's probes, kept on disk from one start to the next.

A plan probes at load: the timing runs (tuning.py), the blocked kernel's summation-order probe
(blocked.py) and the bit-for-bit checks of the other paths (verify.py) take about 3 s of a
model service's start for the bundled model. Their answers depend on the machine and the code,
not on the weights' values: the CPU (model, stepping, flags), torch and the libraries it was
built with, the native library (its name is a digest of its sources, flags and torch version),
this package's source, the environment variables that steer MKL and oneDNN, and the thread
count and shapes (in each answer's key). So `kept()` restores what earlier starts found from one
file named by a fingerprint of all of that, and writes back what this start added; on another
machine, or after any of those changes, the fingerprint differs and everything is probed afresh.

The file lives in `$RADIXKV_CACHE_DIR/probes` (default `~/.cache/radixkv/probes`); an unreadable
or malformed file is ignored (probed again and rewritten). `RADIXKV_PROBE_MEMO=off` probes at
every start (the bench sets it, so that its timing runs are its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from model_service.linear import blocked, tuning, verify
from model_service.local_cache import local_cache_dir

log = logging.getLogger(__name__)

ENV_SWITCH = "RADIXKV_PROBE_MEMO"
VERSION = 1
# MKL's and oneDNN's dispatch, the OpenMP runtime, and libraries preloaded in front of them.
_ENV_PREFIXES = ("MKL_", "DNNL_", "ONEDNN_", "OMP_", "KMP_", "GOMP_", "ATEN_CPU_CAPABILITY", "LD_PRELOAD",
                 "LD_LIBRARY_PATH")
_CPUINFO_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "cpu cores", "siblings",
                   "cache size")


def _tables() -> dict[str, dict]:
    """The process-wide memos this file keeps, by name."""
    return {"blocked": blocked.probed, "verified": verify.shared.answers, "timed": tuning.timed}


def _cpu() -> str:
    """The first processor's identity lines of /proc/cpuinfo (platform's answer elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    first = text.split("\n\n", 1)[0]
    lines = [line for line in first.splitlines() if line.partition(":")[0].strip() in _CPUINFO_FIELDS]
    return "\n".join(lines)


def _native() -> str:
    """The native library's content digest (its name digests sources, flags and torch, not the
    compiler or the build-time ISA fallbacks), or why it is not loaded."""
    from model_service import native  # loading the library is the probes' business anyway
    from model_service.linear import dot
    from model_service.native.build import library_path

    if not native.available():
        return f"none: {native.unavailable_reason()}"
    digest = hashlib.sha256(library_path().read_bytes()).hexdigest()
    return f"{digest} dot engine {dot.engine() if dot.available() else 'none'}"


def fingerprint() -> str:
    """A digest of everything the probes' answers depend on but their keys do not say."""
    digest = hashlib.sha256()
    sources = sorted(Path(__file__).parent.glob("*.py"))
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = -1
    parts = [str(VERSION), _cpu(), torch.__version__, torch.__config__.show(), _native(),
             torch.backends.cpu.get_cpu_capability(), str(torch.get_num_threads()), str(torch.get_num_interop_threads()),
             f"cpus {os.cpu_count()} affinity {affinity}",
             *sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    for source in sources:
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:20]


def memo_path() -> Path:
    return local_cache_dir("probes") / f"linear-{fingerprint()}.json"


def _encode(value: object) -> object:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, tuning.Timing):
        return {"timing": [value.transposed, value.split_one_row, value.dot_rows]}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    raise TypeError(f"cannot keep a probe answer of type {type(value).__name__}")


def _decode(value: object) -> object:
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict) and set(value) == {"dtype"}:
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {value['dtype']!r}")
        return dtype
    if isinstance(value, dict) and set(value) == {"timing"}:
        transposed, split_one_row, dot_rows = value["timing"]
        if not (isinstance(transposed, bool) and isinstance(split_one_row, bool) and type(dot_rows) is int):
            raise ValueError(f"not a timing: {value['timing']!r}")
        return tuning.Timing(transposed, split_one_row, dot_rows)
    if value is None or isinstance(value, bool | int | str):
        return value
    raise ValueError(f"not a probe answer: {value!r}")


def _is_block_answer(value: object) -> bool:
    """blocked.probed's value: None, or (block, short splits)."""
    return value is None or (isinstance(value, tuple) and len(value) == 2 and type(value[0]) is int
                             and isinstance(value[1], tuple) and all(type(v) is int for v in value[1]))


# What each table's keys and values must be (a file that parses but says otherwise is not used).
_VALID = {
    "blocked": (lambda k: isinstance(k, tuple) and len(k) == 3 and all(type(v) is int for v in k), _is_block_answer),
    "verified": (lambda k: isinstance(k, tuple) and len(k) == 6, lambda v: type(v) is bool),
    "timed": (lambda k: isinstance(k, tuple) and len(k) == 5,
              lambda v: isinstance(v, tuning.Timing) or type(v) is int),
}


def _read(path: Path) -> dict[str, dict]:
    """The tables in `path` ({} when there is none or it cannot be read as one)."""
    try:
        raw = json.loads(path.read_text())
        if raw.get("version") != VERSION:
            return {}
        tables = {}
        for name, (key_ok, value_ok) in _VALID.items():
            table = tables[name] = {_decode(k): _decode(v) for k, v in raw["tables"].get(name, [])}
            if not all(key_ok(k) and value_ok(v) for k, v in table.items()):
                raise ValueError(f"a {name} entry of the wrong shape")
        return tables
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as error:
        log.warning("ignoring the probe memo %s (%s); probing again", path, error)
        return {}


def _write(path: Path, tables: dict[str, dict]) -> None:
    """Writes `tables` atomically (a concurrent start reads the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"version": VERSION,
            "tables": {name: [[_encode(k), _encode(v)] for k, v in table.items()] for name, table in tables.items()}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".probes-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "on").lower() not in ("off", "0", "false", "no")


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Around a plan: restores the answers earlier starts on this machine found, and writes back
    (merged with the file as it is then) what the plan added. The memo never fails a start: where
    it cannot be found, read or written (no home directory, an unwritable folder), that is logged
    and the plan probes as without it."""
    if not enabled():
        yield
        return
    tables = _tables()
    try:
        path = memo_path()
        restored = _read(path)
    except Exception as error:  # noqa: BLE001 - whatever it is, the probes still run
        log.warning("no probe memo this start (%s); probing", error)
        yield
        return
    for name, table in tables.items():
        for key, value in restored.get(name, {}).items():
            table.setdefault(key, value)
    before = {name: len(table) for name, table in tables.items()}
    count = sum(len(t) for t in restored.values())
    if count:
        log.info("linear plan: %d probe answers of earlier starts on this machine from %s (%s=off probes afresh)",
                 count, path, ENV_SWITCH)
    yield
    if all(len(table) == before[name] for name, table in tables.items()):
        return
    try:
        merged = _read(path)
        for name, table in tables.items():
            merged.setdefault(name, {}).update(table)
        _write(path, merged)
    except (OSError, TypeError) as error:
        log.warning("could not keep the probe answers in %s: %s", path, error)
