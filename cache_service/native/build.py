"""Builds the cache manager's C core (block_ops.c: the block allocator's bulk operations) into a
CPython extension next to this file.

`make install` runs `python -m cache_service.native.build --optional`. The file's name carries a
hash of the source, the flags and the Python version, so a stale build is never loaded. It needs
a C compiler and Python's headers, nothing of torch, and takes about a second; without it the
allocator runs its Python and numpy code (`cache_service.native.unavailable_reason()` says why).
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
SOURCE = HERE / "block_ops.c"
CFLAGS = ["-O2", "-shared", "-fPIC", "-std=c11", "-Wall", "-Werror=implicit-function-declaration"]


def library_path() -> Path:
    """Where the extension for this source, these flags and this Python lives."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(sys.version.encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return HERE / "_build" / f"block_ops_{digest.hexdigest()[:16]}{suffix}"


def build(force: bool = False) -> Path:
    """Compiles the extension unless it is there already; returns its path (raises on failure)."""
    target = library_path()
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    include = sysconfig.get_paths()["include"]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run([cc, *CFLAGS, f"-I{include}", str(SOURCE), "-o", str(partial)], check=True)
        partial.replace(target)
    for stale in target.parent.glob("block_ops_*"):
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
        print(build(force=args.force))
    except (OSError, subprocess.CalledProcessError) as error:
        if not args.optional:
            raise
        print(f"warning: the cache manager's C core was not built ({error}); its Python code will be used",
              file=sys.stderr)


if __name__ == "__main__":
    main()
