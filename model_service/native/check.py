"""`python -m model_service.native.check`: which native kernels are active on this machine, and why
the others are not.

Prints the CPU (model, AVX-512/AMX flags), torch's version, capability and thread count, the
library, and per kernel (model_service/native/registry.py) `active` or `inactive` with the reason:
not built / not loaded, or what its probe found different from torch (and, where that is expected
on this CPU, why). Probe results come from the registry's cache unless `--fresh`. Exit status 1
when a kernel is inactive, not as expected, and `--require` (or RADIXKV_REQUIRE_NATIVE=1) asks for
all of them, else 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from model_service import native
from model_service.native import registry


def report(fresh: bool = False) -> tuple[list[str], list[registry.Status]]:
    """The lines to print and every kernel's status (probing where the cache has no answer)."""
    from model_service.native.build import library_path, unsupported_reason

    if fresh:
        registry.clear_cache()
    model, flags = registry.cpu_description()
    path = library_path()
    lines = [
        f"cpu: {model}",
        f"cpu flags: {' '.join(flags) or '(no AVX-512 or AMX flags)'}",
        f"torch {torch.__version__}: capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads",
        f"build: {unsupported_reason() or 'supported here'}; library {path.name}"
        f" ({'built' if path.exists() else 'missing'})",
        f"library: {native.unavailable_reason() or 'loaded'}",
        f"bfloat16 attention and few-row linears on AVX512-BF16 dot products: {registry.bf16_dot_products()}",
        f"bfloat16 attention of prompts and chunks on AMX tiles: {registry.attention_tiles()}",
    ]
    statuses = [registry.status(name) for name in registry.KERNELS]
    width = max(len(name) for name in registry.KERNELS)
    for s in statuses:
        state = "active" if s.active else "inactive"
        why = "" if s.active else f": {s.reason}" + (f" (expected on this CPU: {s.expected})" if s.expected else "")
        contract = s.kernel.contract if s.active else ""
        lines.append(f"  {s.kernel.name:<{width}}  {state}{why}"
                     + (f"  ({contract}; reproduces {s.kernel.reference})" if contract else ""))
    return lines, statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fresh", action="store_true", help="forget cached probe results and probe again")
    parser.add_argument("--require", action="store_true",
                        help="exit 1 unless every kernel is active (also RADIXKV_REQUIRE_NATIVE=1)")
    args = parser.parse_args(argv)
    lines, statuses = report(fresh=args.fresh)
    print("\n".join(lines))
    inactive = [s.kernel.name for s in statuses if not s.active and not s.expected]
    if inactive and (args.require or os.environ.get("RADIXKV_REQUIRE_NATIVE") == "1"):
        print(f"error: native kernels required, inactive: {', '.join(inactive)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
