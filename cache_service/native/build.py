"""Builds the cache manager's C core into CPython extensions next to this file: block_ops.c (the
block allocator's bulk operations), page_ops.c (the page index's loops) and hash_ops.c (the
chained page hash, on the vendored xxHash header in third_party/).

`make install` runs `python -m cache_service.native.build --optional`. Each file's name carries a
hash of its source, the flags and the Python version, so a stale build is never loaded. It needs
a C compiler and Python's headers, nothing of torch, and takes about a second; without it the
allocator and the page index run their Python code (`cache_service.native.unavailable_reason()`
says why).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXTENSIONS = ("block_ops", "page_ops", "hash_ops")  # each NAME.c builds the module _NAME
HEADERS = {"hash_ops": ("third_party/xxhash.h",)}  # what a source includes besides Python's headers
CFLAGS = ["-O2", "-shared", "-fPIC", "-std=c11", "-Wall", "-Werror=implicit-function-declaration"]


def library_path(name: str = "block_ops") -> Path:
    """Where the extension `name` for its source, these flags and this Python lives."""
    digest = hashlib.sha256((HERE / f"{name}.c").read_bytes())
    for header in HEADERS.get(name, ()):
        digest.update((HERE / header).read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(sys.version.encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return HERE / "_build" / f"{name}_{digest.hexdigest()[:16]}{suffix}"


def build(force: bool = False) -> list[Path]:
    """Compiles the extensions not there already; returns their paths (raises on failure)."""
    return [build_one(name, force) for name in EXTENSIONS]


def build_one(name: str, force: bool = False) -> Path:
    target = library_path(name)
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    include = sysconfig.get_paths()["include"]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run([cc, *CFLAGS, f"-I{include}", str(HERE / f"{name}.c"), "-o", str(partial)], check=True)
        partial.replace(target)
    for stale in target.parent.glob(f"{name}_*"):
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even if the extension exists")
    parser.add_argument("--optional", action="store_true",
                        help="a failed build only warns (the allocator then runs its Python code)")
    args = parser.parse_args()
    try:
        print("\n".join(str(path) for path in build(force=args.force)))
    except (OSError, subprocess.CalledProcessError) as error:
        if not args.optional:
            raise
        print(f"warning: the cache manager's C core was not built ({error}); its Python code will be used",
              file=sys.stderr)


if __name__ == "__main__":
    main()
