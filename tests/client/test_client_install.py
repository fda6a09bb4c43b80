"""The Python client installs and runs on its own: `pip install radixkv` (the base install) pulls
gRPC and protobuf only, never torch or transformers. Checked in a fresh venv that holds the built
wheel, grpcio and protobuf, and nothing else, against the real cache service."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import Running

REPO = Path(__file__).resolve().parents[2]
SITE = Path(next(p for p in sys.path if p.endswith("site-packages")))
CLIENT_DEPENDENCIES = ("grpcio", "protobuf")
SERVER_ONLY = ("torch", "transformers", "tokenizers", "accelerate", "numpy", "fastapi", "uvicorn")


def _closure(names: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `names` need, their own requirements included (no extras)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.split(r"[ <>=!~;\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        dist = seen[name] = importlib.metadata.distribution(name)
        todo += [r for r in dist.requires or () if "extra ==" not in r]
    return list(seen.values())


def _top_level_entries(dist: importlib.metadata.Distribution) -> set[str]:
    return {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=180, **kwargs)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the radixkv wheel (built from client/, protos/, common/ and pyproject.toml) and
    grpcio and protobuf with what they require linked in from this venv, and no other package."""
    root = tmp_path_factory.mktemp("client-install")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("client", "protos", "common"):
        shutil.copytree(REPO / package, source / package,
                        ignore=shutil.ignore_patterns("node", "__pycache__", "*.proto"))
    wheels = root / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-w", str(wheels), str(source)])
    assert built.returncode == 0, built.stdout + built.stderr
    venv = root / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    (wheel,) = wheels.glob("radixkv-*.whl")
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                      str(wheel)])
    assert installed.returncode == 0, installed.stdout + installed.stderr
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                .stdout.strip())
    for dist in _closure(CLIENT_DEPENDENCIES):
        for entry in _top_level_entries(dist):
            if (SITE / entry).exists() and not (site / entry).exists():
                (site / entry).symlink_to(SITE / entry)
    return python


def test_the_base_install_requires_no_server_package(client_venv: Path) -> None:
    probe = ("import importlib.metadata as m, json; "
             "print(json.dumps([r for r in m.requires('radixkv') or [] if 'extra ==' not in r]))")
    result = _run([str(client_venv), "-c", probe], cwd=client_venv.parent)
    assert result.returncode == 0, result.stderr
    base = json.loads(result.stdout)
    assert {re.split(r"[ <>=!~;]", r, maxsplit=1)[0] for r in base} == set(CLIENT_DEPENDENCIES)
    for name in SERVER_ONLY:
        missing = _run([str(client_venv), "-c", f"import {name}"], cwd=client_venv.parent)
        assert missing.returncode != 0, f"{name} is importable in the client-only venv"


def test_the_client_runs_without_torch_against_a_real_cache_service(client_venv: Path,
                                                                     cache_service: Running) -> None:
    script = (
        "import json, sys, client\n"
        "from client import RadixKVClient\n"
        f"with RadixKVClient(cache_addr={cache_service.addr!r}) as c:\n"
        "    pools = c.stats()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{SERVER_ONLY!r})\n"
        "print(json.dumps({'pools': len(pools), 'heavy': heavy}))\n"
    )
    result = _run([str(client_venv), "-c", script], cwd=client_venv.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["heavy"] == [] and answer["pools"] >= 0
    cli = _run([str(client_venv), "-m", "client", "stats", "--cache-addr", cache_service.addr, "--json"],
               cwd=client_venv.parent)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "pools" in json.loads(cli.stdout)
