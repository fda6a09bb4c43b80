"""The native build's contract: where it skips, its flags (no FMA contraction, no global
AVX512-BF16), one shared SIMD header that is part of the build hash and of make's inputs, and
AVX512-BF16 instructions only in the functions compiled for them."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from model_service.native import build
from tests.native_required import skip_unless_native

ROOT = Path(__file__).resolve().parents[2]
BF16_INSTRUCTIONS = re.compile(r"\bv(dpbf16ps|cvtne2ps2bf16|cvtneps2bf16)\b")
AMX_INSTRUCTIONS = re.compile(r"\b(tdpbf16ps|tileloadd|tileloaddt1|tilestored|ldtilecfg|tilezero|tilerelease)\b")


def test_flags_keep_products_apart_and_leave_bf16_to_target_attributes():
    assert "-ffp-contract=off" in build.CXX_FLAGS
    assert not any("bf16" in flag for flag in build.CXX_FLAGS)
    for source in build.SOURCES:
        text = source.read_text()
        assert 'asm("" :' not in text, f"{source.name}: an empty-asm rounding barrier (-ffp-contract=off does it)"
        assert not re.search(r"constexpr\s+\w+\s+LANES\s*=", text), f"{source.name} defines LANES (simd.h does)"
        assert re.search(r'#include "(simd|amx)\.h"', text) or "LANES" not in text, source.name  # amx.h includes simd.h
    attention = (build.HERE / "attention.cpp").read_text()
    for tile in ("qk_tile_dp", "pv_tile_dp", "pair_probabilities"):
        assert re.search(rf"RADIXKV_BF16 inline void {tile}\(", attention), tile


def test_headers_are_in_the_hash_and_in_makes_inputs(tmp_path, monkeypatch):
    assert build.HERE / "simd.h" in build.HEADERS
    before = build.library_path()
    changed = tmp_path / "simd.h"
    changed.write_text((build.HERE / "simd.h").read_text() + "\n// changed\n")
    monkeypatch.setattr(build, "HEADERS", [changed])
    assert build.library_path() != before
    makefile = (ROOT / "Makefile").read_text()
    (native_src,) = re.findall(r"^NATIVE_SRC := (.*)$", makefile, flags=re.M)
    assert "model_service/native/*.h" in native_src


@pytest.mark.parametrize("machine, flags, reason", [
    ("aarch64", set(), "not an x86-64 CPU"),
    ("x86_64", {"avx2", "fma", "avx512f"}, "no AVX-512 (avx512bw, avx512vl, avx512dq missing)"),
    ("x86_64", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, None),
])
def test_unsupported_machines_skip_the_build_with_a_warning(machine, flags, reason, monkeypatch, capsys):
    monkeypatch.setattr(build.platform, "machine", lambda: machine)
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    found = build.unsupported_reason()
    assert (found is None) if reason is None else reason in found
    if reason is None:
        return
    monkeypatch.setattr(build, "build", lambda **_: pytest.fail("built on a machine that cannot run it"))
    monkeypatch.setattr("sys.argv", ["build", "--optional"])
    build.main()  # returns: no exception, nothing built
    assert f"native kernels not built ({found}); torch's kernels will be used" in capsys.readouterr().err


def test_any_cpu_builds_for_another_x86_machine_but_not_for_another_architecture(monkeypatch):
    built = []
    monkeypatch.setattr(build, "build", lambda **_: built.append(1) or Path("x.so"))
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr("sys.argv", ["build", "--any-cpu"])
    build.main()
    assert built == [1]
    monkeypatch.setattr(build.platform, "machine", lambda: "arm64")
    build.main()
    assert built == [1]


@pytest.mark.skipif(shutil.which(build.os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_dot_product_kernels_compile_without_avx512_bf16_or_amx():
    """What a compiler that cannot target AVX512-BF16 (or AMX) builds (build.py adds RADIXKV_NO_BF16,
    RADIXKV_NO_AMX). The five checks run side by side (each parses torch's headers for seconds)."""
    cxx = build.os.environ.get("CXX", "g++")
    cases = [("attention.cpp", build.NO_BF16_FLAG), ("dot_linear.cpp", build.NO_BF16_FLAG),
             ("dot_linear.cpp", build.NO_AMX_FLAG), ("tile_attention.cpp", build.NO_BF16_FLAG),
             ("tile_attention.cpp", build.NO_AMX_FLAG)]

    def compile_one(source: str, flag: str) -> subprocess.CompletedProcess:
        return subprocess.run([cxx, "-fsyntax-only", *[f for f in build.CXX_FLAGS if f not in ("-shared", "-fPIC")],
                               flag, *build.include_flags(), str(build.HERE / source)],
                              capture_output=True, text=True, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(lambda case: compile_one(*case), cases))
    failed = [f"{source} {flag}:\n{r.stderr[-2000:]}" for (source, flag), r in zip(cases, results, strict=True)
              if r.returncode != 0]
    assert not failed, "\n".join(failed)


def _functions_using(instructions: re.Pattern) -> set[str]:
    """The names of the built library's functions whose code holds any of `instructions`."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(build.library_path())],
                             capture_output=True, text=True, check=True).stdout
    holders = set()
    for function in listing.split("\n\n"):
        if instructions.search(function):
            header = function.split(">:", 1)[0].replace("(anonymous namespace)::", "")
            holders.add(header.split("<", 1)[1].split("(", 1)[0].split("::")[-1])
    return holders


# tile_attention.cpp's functions compiled for AMX (RADIXKV_AMX): the row loops and the items.
TILE_ATTENTION = {"tile_rows", "tile_rows_on", "tile_block", "attend_item", "extend_item"}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_bf16_instructions_only_in_the_dot_product_entry_points():
    """A CPU with AVX-512 and no AVX512-BF16 never runs them: they sit only in attend_rows_dp,
    attend_small_dp, cascade_rows_dp, dot_linear's stripes and tile_stripes and the tile attention's
    row loops and items (compiled with the target attribute), which run where the CPU has them."""
    skip_unless_native("attention")
    holders = _functions_using(BF16_INSTRUCTIONS)
    # the tile paths are absent where the compiler cannot target AMX (RADIXKV_NO_AMX)
    assert holders - TILE_ATTENTION - {"tile_stripes"} == {"attend_rows_dp", "attend_small_dp", "cascade_rows_dp",
                                                           "stripes"}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_amx_instructions_only_in_the_tile_entry_points():
    """A CPU without AMX never runs them: they sit only in dot_linear's tile_stripes and the tile
    attention's row loops and items (compiled with the AMX target attributes; an item where the
    compiler inlines a loop into it), which run only where has_amx_tiles() found the tiles usable."""
    skip_unless_native("attention")
    tile_code = {"tile_stripes", "configure_tiles", "release_tiles"} | TILE_ATTENTION
    assert _functions_using(AMX_INSTRUCTIONS) <= tile_code  # none where the compiler has no AMX
