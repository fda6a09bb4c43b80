"""radixkv Python client: ``RadixKVClient`` (blocking), ``AsyncRadixKVClient`` (asyncio) and
the ``python -m client`` command line."""

from .aio import AsyncRadixKVClient
from .channel import RetryPolicy
from .errors import RadixKVError
from .messages import ChatMessage, GenerateOptions
from .results import (
    GenerateChunk,
    GenerateResult,
    Load,
    ModelInfo,
    PoolStats,
    PositionLogprobs,
    PullStats,
    TierStats,
    TokenizeResult,
    TokenLogprob,
    Usage,
)
from .sync import DEFAULT_CACHE_ADDR, DEFAULT_MODEL_ADDR, RadixKVClient

__all__ = [
    "DEFAULT_CACHE_ADDR",
    "DEFAULT_MODEL_ADDR",
    "AsyncRadixKVClient",
    "ChatMessage",
    "GenerateChunk",
    "GenerateOptions",
    "GenerateResult",
    "Load",
    "ModelInfo",
    "PoolStats",
    "PositionLogprobs",
    "RadixKVClient",
    "RadixKVError",
    "RetryPolicy",
    "PullStats",
    "TierStats",
    "TokenLogprob",
    "TokenizeResult",
    "Usage",
]
