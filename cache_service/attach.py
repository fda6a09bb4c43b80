"""Whose a pool is and how its replica attaches to it (one `Pool.attach` per pool).

A registration with the same incarnation (the id of a replica process's KV tensors) re-attaches
to the replica's live pool instead of creating a fresh one (cache_service/pool_registry.py); a
durable cache manager rebuilds pools from its state dir that wait for exactly that
(cache_service/durable/). Only the owner may register a live pool's worker id again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class AttachState:
    """A pool's registration identity and re-attach status."""

    incarnation: str = ""  # the replica's KV incarnation id ("" never re-attaches)
    # Who registered it (the registry's owner key; "" anonymous): only they may register its
    # worker id again while it is live.
    owner: str = ""
    restored: bool = False  # rebuilt from the state dir
    awaiting_reattach: bool = False  # restored, and its replica has not re-registered yet: no Steps
    num_restored_cached_blocks: int = 0  # cached blocks it had when it was restored
