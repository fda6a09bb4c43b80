"""Builds the native CPU kernels (attention.cpp, tile_attention.cpp, linear.cpp, dot_linear.cpp,
prompt_attention.cpp, kv_write.cpp, argmax.cpp, rms_norm.cpp, rope.cpp, silu_mul.cpp) into a shared
library next to this file.

`make install` runs `python -m model_service.native.build`; the library's name carries a hash of
the sources and headers, the compiler flags and the torch version, so a stale build is never
loaded. A build needs an x86-64 CPU with AVX-512 (else it is skipped with a warning; `--any-cpu`
builds for another machine, e.g. a container image), g++ and torch's headers (in the torch wheel);
a fresh build takes about 95 seconds on 2 cores, one compiler per source at a time per CPU (an edit
recompiles only the sources it touches: objects are kept under a hash of their inputs). Without it
the model service runs on torch's kernels (`python -m model_service.native.check` says which
kernels are active and why the others are not).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "attention.cpp", HERE / "linear.cpp", HERE / "dot_linear.cpp", HERE / "prompt_attention.cpp",
           HERE / "kv_write.cpp", HERE / "argmax.cpp", HERE / "rms_norm.cpp", HERE / "rope.cpp", HERE / "silu_mul.cpp",
           HERE / "tile_attention.cpp"]
HEADERS = sorted(HERE.glob("*.h"))  # simd.h: in the hash (and the Makefile's NATIVE_SRC) so edits rebuild
# The kernels use AVX-512 F/BW/VL/DQ (the set torch calls "AVX512"); the library is only loaded
# where torch reports that capability. AVX512-BF16 code is compiled only inside functions marked
# RADIXKV_BF16 (simd.h) and runs only where the CPU has the instructions (checked at run time,
# attention.cpp), so a CPU with AVX-512 and without BF16 runs the rest.
ISA_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mbmi2"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
# -ffp-contract=off: a product and the add after it stay two roundings, as in torch's separate ops
# (g++'s default for C++ fuses them into an FMA); only the explicit FMA intrinsics fuse.
CXX_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-ffp-contract=off",
             "-Wno-c++20-extensions", "-DNDEBUG", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
             *ISA_FLAGS]
NO_BF16_FLAG = "-DRADIXKV_NO_BF16"  # added where the compiler cannot target AVX512-BF16
NO_AMX_FLAG = "-DRADIXKV_NO_AMX"  # added where it cannot target AMX (dot_linear then has no tile path)
X86_MACHINES = ("x86_64", "amd64", "x64")
OBJECTS = HERE / "_build" / "objects"


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux reports them (/proc/cpuinfo), empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def unsupported_reason() -> str | None:
    """Why this machine cannot run the library (None: it can): not x86-64, or no AVX-512."""
    machine = platform.machine().lower()
    if machine not in X86_MACHINES:
        return f"not an x86-64 CPU ({platform.machine() or 'unknown'})"
    flags = cpu_flags()
    if flags:
        missing = [f for f in REQUIRED_CPU_FLAGS if f not in flags]
        return f"this CPU has no AVX-512 ({', '.join(missing)} missing)" if missing else None
    capability = torch.backends.cpu.get_cpu_capability()  # no /proc/cpuinfo: ask torch
    return None if capability in ("AVX512", "AMX") else f"this CPU has no AVX-512 (torch reports {capability})"


def library_path() -> Path:
    """Where the library for these sources and headers, these flags and this torch lives."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    digest.update(" ".join(CXX_FLAGS).encode())
    digest.update(torch.__version__.encode())
    return HERE / "_build" / f"radixkv_native_{digest.hexdigest()[:16]}.so"


def object_path(source: Path, command: list[str]) -> Path:
    """Where the object of `source` compiled by `command` is kept (named by a hash of the source,
    the headers, the command and the torch version)."""
    digest = hashlib.sha256()
    for part in (source, *HEADERS):
        digest.update(part.read_bytes())
    digest.update(" ".join(command).encode())
    digest.update(torch.__version__.encode())
    return OBJECTS / f"{source.stem}_{digest.hexdigest()[:16]}.o"


def _compiles(cxx: str, directory: Path, name: str, source: str) -> bool:
    probe = directory / f"{name}_probe.cpp"
    probe.write_text(source)
    result = subprocess.run([cxx, *ISA_FLAGS, "-c", str(probe), "-o", str(directory / f"{name}_probe.o")],
                            capture_output=True)
    return result.returncode == 0


def compiler_targets_bf16(cxx: str, directory: Path) -> bool:
    """Whether `cxx` compiles a function with AVX512-BF16's target attribute and intrinsics."""
    return _compiles(cxx, directory, "bf16", '#include <immintrin.h>\n__attribute__((target("avx512bf16"))) '
                     '__m512 dot(__m512 a, __m512i b, __m512i c) { return _mm512_dpbf16_ps(a, (__m512bh)b, (__m512bh)c); }\n')


def compiler_targets_amx(cxx: str, directory: Path) -> bool:
    """Whether `cxx` compiles a function with AMX's target attributes and tile intrinsics."""
    return _compiles(cxx, directory, "amx", '#include <immintrin.h>\n__attribute__((target("amx-tile,amx-bf16"))) '
                     'void dot(const void* a, void* c) { _tile_loadd(1, a, 64); _tile_loadd(2, a, 64); '
                     '_tile_dpbf16ps(0, 1, 2); _tile_stored(0, c, 64); _tile_release(); }\n')


def include_flags() -> list[str]:
    """-I flags: this folder (simd.h), torch's headers and Python's."""
    torch_dir = Path(torch.__file__).resolve().parent
    includes = [HERE, torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include",
                Path(sysconfig.get_paths()["include"])]
    return [f"-I{p}" for p in includes]


def build(force: bool = False, quiet: bool = False) -> Path:
    """Compiles the library unless it is there already; returns its path (raises on failure)."""
    target = library_path()
    if target.exists() and not force:
        return target
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    OBJECTS.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        bf16 = [] if compiler_targets_bf16(cxx, Path(tmp)) else [NO_BF16_FLAG]
        if bf16 and not quiet:
            print(f"warning: {cxx} cannot target AVX512-BF16; bfloat16 attention uses float32 FMAs", file=sys.stderr)
        if not bf16 and not compiler_targets_amx(cxx, Path(tmp)):
            bf16.append(NO_AMX_FLAG)
            if not quiet:
                print(f"warning: {cxx} cannot target AMX; bfloat16 linears use dot products only", file=sys.stderr)
        if not quiet:
            print(f"==> building native kernels: {target.relative_to(HERE.parent.parent)}", flush=True)
        # One compiler per source, as many at once as there are CPUs, then one link. Objects are
        # kept by a hash of their inputs, so an edit recompiles only the sources it touches.
        compile_flags = [*CXX_FLAGS, *bf16, *include_flags(), "-c"]
        objects = [object_path(source, [cxx, *compile_flags]) for source in SOURCES]
        todo = [(source, obj) for source, obj in zip(SOURCES, objects, strict=True) if not obj.exists()]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            runs = [pool.submit(subprocess.run, [cxx, *compile_flags, str(source), "-o", str(Path(tmp) / obj.name)])
                    for source, obj in todo]
            failed = [source.name for (source, _), run in zip(todo, runs, strict=True) if run.result().returncode != 0]
        if failed:
            raise RuntimeError(f"compiling {', '.join(failed)} failed (the compiler's messages are above)")
        for _, obj in todo:
            (Path(tmp) / obj.name).replace(obj)
        for stale in OBJECTS.glob("*.o"):
            if stale not in objects:
                stale.unlink(missing_ok=True)
        # libgomp from torch's lib folder (same soname), so the kernels share torch's OpenMP pool.
        subprocess.run([cxx, *CXX_FLAGS, *map(str, objects), "-o", str(partial), f"-L{lib_dir}",
                        f"-Wl,-rpath,{lib_dir}", "-ltorch_cpu", "-lc10"], check=True)
        partial.replace(target)
    for stale in target.parent.glob("radixkv_native_*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
    (target.parent / "probes.json").unlink(missing_ok=True)  # registry.py's results for the old library
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even if the library exists")
    parser.add_argument("--optional", action="store_true",
                        help="a failed build only warns (the model service then runs on torch's kernels)")
    parser.add_argument("--any-cpu", action="store_true",
                        help="build on an x86-64 CPU without AVX-512 too (for another machine, e.g. an image)")
    args = parser.parse_args()
    reason = unsupported_reason()
    if reason is not None and not (args.any_cpu and reason.startswith("this CPU")):
        print(f"warning: native kernels not built ({reason}); torch's kernels will be used", file=sys.stderr)
        return
    try:
        print(build(force=args.force))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        if not args.optional:
            raise
        print(f"warning: native kernels not built ({error}); torch's kernels will be used", file=sys.stderr)


if __name__ == "__main__":
    main()
