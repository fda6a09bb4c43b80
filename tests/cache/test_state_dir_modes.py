"""The durable cache manager's state dir holds tenants' token ids (journal and snapshot.bin): a
real `python -m cache_service --state-dir DIR` keeps the directory 0700 and every file in it 0600
whatever the umask, and tightens a directory and files an older version (or an operator) left
readable by others."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from protos import cache_pb2
from tests.cache.conftest import REPO, ServerProcess, spawn_server, stop_server

PROMPT = list(range(1, 40))


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """The test process's umask (a spawned child inherits it) set to `mask` meanwhile."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def start(tmp_path: Path, state_dir: Path) -> ServerProcess:
    # A tiny --snapshot-mb: the Steps below trigger background snapshots (temp file + rename) too.
    with umask(0o022):
        return spawn_server(tmp_path / f"cache-{time.monotonic_ns()}.stderr", "--state-dir", str(state_dir),
                            "--snapshot-mb", "0.0005")


def write_some_state(server: ServerProcess) -> None:
    """A pool, a finished request whose prompt is cached, enough Steps for a snapshot."""
    reg = server.stub.RegisterPool(cache_pb2.RegisterPoolRequest(
        worker_id="w", num_blocks=64, block_size=4, model_fingerprint="fp", incarnation="inc-1"), timeout=10)
    for i in range(6):
        rid = f"r{i}"
        admit = server.stub.Step(cache_pb2.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=[
            cache_pb2.Admit(request_id=rid, token_ids=PROMPT + [100 + i], num_lookahead_tokens=1)]), timeout=10)
        table = list(admit.admits[0].block_table)
        server.stub.Step(cache_pb2.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, finishes=[
            cache_pb2.Finish(request_id=rid, num_computed_tokens=len(PROMPT) + 1, block_table=table)]), timeout=10)


def modes(state_dir: Path) -> tuple[int, dict[str, int]]:
    files = {}
    for path in state_dir.iterdir():
        try:
            files[path.name] = stat.S_IMODE(path.lstat().st_mode)
        except FileNotFoundError:  # a background snapshot rotated the journal between the two calls
            continue
    return stat.S_IMODE(state_dir.stat().st_mode), files


def assert_private(state_dir: Path) -> None:
    dir_mode, files = modes(state_dir)
    assert dir_mode == 0o700, oct(dir_mode)
    assert "snapshot.bin" in files and any(n.startswith("journal-") for n in files), files
    loose = {name: oct(mode) for name, mode in files.items() if mode != 0o600}
    assert not loose, loose


def test_state_dir_is_0700_and_every_file_0600_under_umask_022(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    server = start(tmp_path, state_dir)
    try:
        write_some_state(server)
        assert_private(state_dir)
    finally:
        stop_server(server)
    assert_private(state_dir)


def test_loose_modes_left_by_an_older_version_are_tightened_on_start(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    server = start(tmp_path, state_dir)
    try:
        write_some_state(server)
    finally:
        stop_server(server)
    # What an older build (or a careless copy) leaves: a world-readable directory and files, and a
    # temp file of a snapshot that a crash interrupted.
    (state_dir / "snapshot.bin.tmp").write_bytes(b"partial")
    for path in state_dir.iterdir():
        path.chmod(0o644)
    state_dir.chmod(0o755)

    server = start(tmp_path, state_dir)
    try:
        dir_mode, files = modes(state_dir)
        assert dir_mode == 0o700, oct(dir_mode)
        assert {n: oct(m) for n, m in files.items() if m != 0o600} == {}
        # the state came back (modes are not bought with the data)
        (pool,) = server.stub.Stats(cache_pb2.StatsRequest(pool_id="w"), timeout=10).pools
        assert pool.restored and pool.num_cached_blocks > 0
    finally:
        stop_server(server)


def test_a_directory_holding_other_files_is_refused_untouched(tmp_path: Path) -> None:
    """A mistyped --state-dir (a shared directory) is not made private: the server says why and stops."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("someone's")
    shared.chmod(0o755)
    (shared / "notes.txt").chmod(0o644)
    with umask(0o022):
        done = subprocess.run([sys.executable, "-m", "cache_service", "--port", "0", "--state-dir", str(shared)],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "cannot use state dir" in done.stderr and "notes.txt" in done.stderr, done.stderr
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert stat.S_IMODE((shared / "notes.txt").stat().st_mode) == 0o644
    assert sorted(p.name for p in shared.iterdir()) == ["notes.txt"]
