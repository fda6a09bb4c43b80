"""Where the model service keeps what it derives once per machine: $RADIXKV_CACHE_DIR, else
~/.cache/radixkv (converted GGUF models, the linear plan's probe answers)."""

from __future__ import annotations

import os
from pathlib import Path


def local_cache_dir(name: str) -> Path:
    """The folder `name` under the cache root (not created here)."""
    root = os.environ.get("RADIXKV_CACHE_DIR") or Path.home() / ".cache" / "radixkv"
    return Path(root) / name
