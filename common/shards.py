"""Cache-manager shards: which shard owns a replica's pool.

Pools are independent, so the cache manager scales by pools: N cache-manager processes, each
owning the pools of the replicas that hash to it. A replica given several cache addresses
(`--cache-addr a,b,c`) registers with `shard_for(worker_id, shards)`: rendezvous (highest random
weight) hashing, so every replica computes the same owner without asking anyone, and adding or
removing a shard moves only the pools that hash to it (about 1/N of them). The router and the
clients that read across the fleet ask every shard (router/cache_shards.py).
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence


def parse_shards(spec: str) -> list[str]:
    """The shard addresses of a comma-separated `--cache-addr` value, in order. ValueError when
    one is empty or given twice."""
    shards = [part.strip() for part in spec.split(",")]
    if any(not s for s in shards):
        raise ValueError(f"empty cache manager address in {spec!r}")
    if len(set(shards)) != len(shards):
        raise ValueError(f"a cache manager address is listed twice in {spec!r}")
    return shards


def cache_addr_arg(value: str) -> str:
    """argparse `type` of a `--cache-addr` flag: the value as given, once `parse_shards` takes it."""
    try:
        parse_shards(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _weight(worker_id: str, shard: str) -> bytes:
    # The standard library's BLAKE2b (the client package installs without the server's xxhash).
    return hashlib.blake2b(worker_id.encode() + b"\0" + shard.encode(), digest_size=8).digest()


def shard_for(worker_id: str, shards: Sequence[str]) -> str:
    """The shard that owns `worker_id`'s pool: the highest hash of (worker id, shard address)."""
    if not shards:
        raise ValueError("no cache manager shard given")
    return max(shards, key=lambda shard: (_weight(worker_id, shard), shard))
