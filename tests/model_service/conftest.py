"""Fixtures for model-service tests: gRPC stubs to the shared real services (tests/conftest.py),
the reference transformers model in this process, and the tiny random Llama (tests/tiny_model.py)
with its transformers reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from model_service.model_loader import LoadedModel, load_model
from protos import cache_pb2_grpc, model_pb2_grpc
from tests.services import Running
from tests.tiny_model import save_tiny_llama


@pytest.fixture(scope="session")
def reference_model() -> LoadedModel:
    """The bundled model loaded by transformers alone (sdpa attention, fp32): the ground truth."""
    return load_model(None, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny random Llama with the bundled tokenizer as a local HF folder (seeded: the same
    weights every time), for tests where any weights do."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_reference(tiny_dir: Path) -> LoadedModel:
    """The tiny model loaded by transformers (fp32): its ground truth."""
    return load_model(str(tiny_dir), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def model_stub(model_service: Running) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    with grpc.insecure_channel(model_service.addr) as channel:
        yield model_pb2_grpc.ModelServiceStub(channel)


@pytest.fixture(scope="session")
def cache_stub(cache_service: Running) -> Iterator[cache_pb2_grpc.CacheManagerStub]:
    with grpc.insecure_channel(cache_service.addr) as channel:
        yield cache_pb2_grpc.CacheManagerStub(channel)
