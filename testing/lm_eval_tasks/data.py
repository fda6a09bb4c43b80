"""Loads this folder's jsonl files as lm-eval datasets (the YAML configs' `custom_dataset`), so the
tasks read only files in the repo: no hub, no `datasets` cache, whatever the working directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> dict[str, datasets.Dataset]:
    with open(HERE / f"{name}.jsonl", encoding="utf-8") as file:
        rows = [json.loads(line) for line in file if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def multiple_choice(**_: Any) -> dict[str, datasets.Dataset]:
    """radixkv_mc.jsonl: {question, choices, answer (index)}."""
    return _load("radixkv_mc")


def generate(**_: Any) -> dict[str, datasets.Dataset]:
    """radixkv_gen.jsonl: {prompt, answer}."""
    return _load("radixkv_gen")
