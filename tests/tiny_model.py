"""A tiny random Llama (2 layers, hidden size 64) with the bundled model's tokenizer, saved as a
local HF folder: fast to load and to run, for tests of scheduling and routing where any weights do."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from model_service.model_loader import _convert_gguf, bundled_model_path


def save_tiny_llama(path: Path) -> Path:
    """Writes the model to `path` (same weights every time: seeded) and returns `path`."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(_convert_gguf(bundled_model_path())).save_pretrained(path)
    return path
