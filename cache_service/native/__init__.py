"""The cache manager's C core: the block allocator's bulk operations (block_ops.c).

Built by `make install` (`python -m cache_service.native.build`) and loaded here on first use;
`block_ops()` is the extension module, or None where it is not built or does not load
(`unavailable_reason()` says why), and the allocator then runs its Python code, which gives
the same answers (tests/cache/test_block_allocator.py runs both).
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    from cache_service.native.build import library_path  # importing build here would shadow `-m ...build`

    path = library_path()
    if not path.exists():
        return None, f"not built ({path.name} missing: run `make install` or `python -m cache_service.native.build`)"
    try:
        spec = importlib.util.spec_from_file_location("_block_ops", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError) as error:
        return None, f"could not load {path.name}: {error}"
    return module, None


def block_ops() -> ModuleType | None:
    return _load()[0]


def unavailable_reason() -> str | None:
    """None when the C core is loaded, else why it is not."""
    return _load()[1]
