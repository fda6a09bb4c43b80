"""What the pool registry may be made to hold: pools in total, pools per principal, and memory.

Every registration asks for memory the cache manager then keeps for the pool's life: its
allocator (8 bytes a block, at once) and, as the replica fills it, a tree node, page hashes,
evicted-page hashes and running-request state for every block. `block_cost_bytes` is the most
one block can make it hold, measured (tests/cache/test_registry_identity.py checks the bound):

- every block cached in the tree as a node of its own (one-page prompts) with its hashes, its
  entry in the model's page index (fleet_pages.py; the same with 1 or 200 pools registered), and
  as many evicted pages remembered: about 1,065 bytes a block plus 4 per token;
- every block held by a running request of one page (prompt ids as Python ints, a 256-byte
  request id): about 650 bytes a block plus 40 per token.

So 1,152 + 40 x block_size bytes a block, counted when the pool registers (its worst case, not
what it uses now: a replica fills its pool within minutes). Not counted: the per-pool memory
of finished request ids (at most 65,536 ids, about 24 MiB with 256-byte ids), bounded by the
pool count caps, and the WatchEvents buffer (its own `--event-buffer-mb`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from cache_service.attach import AttachState
from cache_service.errors import ResourceExhausted

BLOCK_BASE_BYTES = 1152
BLOCK_TOKEN_BYTES = 40

DEFAULT_MAX_POOLS = 256
DEFAULT_MAX_POOLS_PER_OWNER = 16
# 4 GiB: 2.40 M blocks of 16 tokens (16 replicas of 150k blocks each); one pool of the largest
# size RegisterPool takes (2^24 blocks) is charged 28 GiB at 16 tokens a block, 18.6 GiB at 1.
DEFAULT_MAX_MEMORY_BYTES = 4 << 30

MIB = 1 << 20


def block_cost_bytes(block_size: int) -> int:
    """The most memory one block of a pool can make the registry hold (see the module docstring)."""
    return BLOCK_BASE_BYTES + BLOCK_TOKEN_BYTES * block_size


def pool_memory_bytes(num_blocks: int, block_size: int) -> int:
    """What a pool of this shape is charged against the memory budget."""
    return num_blocks * block_cost_bytes(block_size)


class PoolShape(Protocol):
    """What the caps read of a registered pool."""

    attach: AttachState  # its owner
    block_size: int

    @property
    def num_charged_pages(self) -> int:
        """Its blocks and lower-tier slots (each slot may hold a page in a tier's tree)."""
        ...


@dataclass(frozen=True, slots=True)
class RegistryLimits:
    """Caps on what registrations may make the registry hold; 0 turns a cap off.

    `max_pools_per_owner` does not apply to the anonymous owner "" (no token, no client
    certificate: every replica is that one principal, so only `max_pools` can bound it).
    """

    max_pools: int = DEFAULT_MAX_POOLS
    max_pools_per_owner: int = DEFAULT_MAX_POOLS_PER_OWNER
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES

    def __post_init__(self) -> None:
        for name in ("max_pools", "max_pools_per_owner", "max_memory_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit)")

    @classmethod
    def unlimited(cls) -> RegistryLimits:
        """No cap at all (benchmarks and tests that build huge registries in-process)."""
        return cls(0, 0, 0)

    def check(self, others: Iterable[PoolShape], owner: str, num_blocks: int, block_size: int) -> None:
        """ResourceExhausted unless a new pool of `owner` fits next to `others` (every pool that
        stays: a pool the registration replaces is not among them). `num_blocks`: its blocks and
        lower-tier slots (a slot costs the registry what a block does, less the request state)."""
        total = mine = 0
        memory = 0
        for pool in others:
            total += 1
            mine += pool.attach.owner == owner
            memory += pool_memory_bytes(pool.num_charged_pages, pool.block_size)
        if self.max_pools and total >= self.max_pools:
            raise ResourceExhausted(
                f"the cache manager holds {total} pools, its limit (max_pools {self.max_pools}); "
                "a pool must go (lease expiry) before another registers")
        if self.max_pools_per_owner and owner and mine >= self.max_pools_per_owner:
            raise ResourceExhausted(
                f"this principal holds {mine} pools, its limit (max_pools_per_principal "
                f"{self.max_pools_per_owner})")
        wanted = pool_memory_bytes(num_blocks, block_size)
        if self.max_memory_bytes and memory + wanted > self.max_memory_bytes:
            left = max(0, self.max_memory_bytes - memory)
            raise ResourceExhausted(
                f"a pool of {num_blocks} blocks of {block_size} tokens may take {wanted / MIB:.1f} MiB of the "
                f"cache manager's memory; {left / MIB:.1f} MiB of its budget are left "
                f"(max_cache_memory_mib {self.max_memory_bytes // MIB})")
