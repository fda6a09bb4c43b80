"""The cache manager's C core: the block allocator's bulk operations (block_ops.c), the page
index's loops (page_ops.c) and the chained page hash (hash_ops.c).

Built by `make install` (`python -m cache_service.native.build`) and loaded here on first use;
`block_ops()`, `page_ops()` and `hash_ops()` are the extension modules, or None where they are not
built or do not load (`unavailable_reason()` says why), and the allocator, the page index and the
page hash then run their Python code, which gives the same answers (tests/cache/
test_block_allocator.py, test_page_index.py and test_page_hash.py run both).
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType


@functools.cache
def _load(name: str) -> tuple[ModuleType | None, str | None]:
    from cache_service.native.build import library_path  # importing build here would shadow `-m ...build`

    path = library_path(name)
    if not path.exists():
        return None, f"not built ({path.name} missing: run `make install` or `python -m cache_service.native.build`)"
    try:
        spec = importlib.util.spec_from_file_location(f"_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError) as error:
        return None, f"could not load {path.name}: {error}"
    return module, None


def block_ops() -> ModuleType | None:
    return _load("block_ops")[0]


def page_ops() -> ModuleType | None:
    return _load("page_ops")[0]


def hash_ops() -> ModuleType | None:
    return _load("hash_ops")[0]


def unavailable_reason() -> str | None:
    """None when the C core is loaded, else why it is not."""
    from cache_service.native.build import EXTENSIONS

    for name in EXTENSIONS:
        why = _load(name)[1]
        if why is not None:
            return why
    return None
