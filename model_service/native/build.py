"""Builds the native CPU kernels (attention.cpp, linear.cpp, prompt_attention.cpp, kv_write.cpp,
argmax.cpp, rms_norm.cpp, rope.cpp) into a shared library next to this file.

`make install` runs `python -m model_service.native.build`; the library's name carries a hash of
the source, the compiler flags and the torch version, so a stale build is never loaded. A build
needs g++ and torch's headers (in the torch wheel); it takes about 40 seconds on 2 cores. Without it the
model service runs on torch's kernels (model_service/native/__init__.py says why at start-up).
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

import torch

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "attention.cpp", HERE / "linear.cpp", HERE / "prompt_attention.cpp", HERE / "kv_write.cpp",
           HERE / "argmax.cpp", HERE / "rms_norm.cpp", HERE / "rope.cpp"]
# The kernels use AVX-512 F/BW/VL/DQ (the set torch calls "AVX512"); the library is only loaded
# where torch reports that capability. AVX512-BF16 instructions run only where the CPU has them
# (checked at run time, attention.cpp).
ISA_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mbmi2"]
CXX_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-Wno-c++20-extensions",
             "-DNDEBUG", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", *ISA_FLAGS]


def library_path() -> Path:
    """Where the library for this source, these flags and this torch lives."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(" ".join(CXX_FLAGS).encode())
    digest.update(torch.__version__.encode())
    return HERE / "_build" / f"radixkv_native_{digest.hexdigest()[:16]}.so"


def build(force: bool = False, quiet: bool = False) -> Path:
    """Compiles the library unless it is there already; returns its path (raises on failure)."""
    target = library_path()
    if target.exists() and not force:
        return target
    torch_dir = Path(torch.__file__).resolve().parent
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include",
                Path(sysconfig.get_paths()["include"])]
    lib_dir = torch_dir / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        # libgomp from torch's lib folder (same soname), so the kernels share torch's OpenMP pool.
        command = [cxx, *CXX_FLAGS, *(f"-I{p}" for p in includes), *map(str, SOURCES), "-o", str(partial),
                   f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-ltorch_cpu", "-lc10"]
        if not quiet:
            print(f"==> building native kernels: {target.relative_to(HERE.parent.parent)}", flush=True)
        subprocess.run(command, check=True)
        partial.replace(target)
    for stale in target.parent.glob("radixkv_native_*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even if the library exists")
    parser.add_argument("--optional", action="store_true",
                        help="a failed build only warns (the model service then runs on torch's kernels)")
    args = parser.parse_args()
    try:
        print(build(force=args.force))
    except (OSError, subprocess.CalledProcessError) as error:
        if not args.optional:
            raise
        print(f"warning: native kernels not built ({error}); torch's kernels will be used", file=sys.stderr)


if __name__ == "__main__":
    main()
