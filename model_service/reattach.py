"""Re-attach to a kept pool after a cache-manager restart (or a transient loss of the pool).

The replica's KV tensors never went away; when RegisterPool says the pool was kept
(`restored`), the cache manager still holds the blocks of this replica's running requests as it
last applied them. The Step in flight when the cache manager died may or may not have been
applied there, so the two views can differ by that one Step; they are reconciled here:

- a running request the cache manager holds with a block table that agrees with the replica's
  keeps running without recompute. "Agrees": every block the replica has written is at the same
  position in the cache manager's table, except positions the cache manager made tree-shared (a
  commit swapped a private duplicate for the tree's copy of the very same prefix, so its KV is
  the same); the cache manager's table may be longer (an extension the replica never heard of).
  The replica adopts the cache manager's table and shared-token count, as the lost reply would have
  told it.
- a running request the cache manager does not hold, or holds differently, is recomputed (back to
  the waiting queue, as a preemption); a held one is released first.
- a request the cache manager holds that the replica does not run (an admission applied whose
  reply was lost, a finish not applied) is released in the next Step.
- finishes and releases still to be sent are kept for requests the cache manager holds (with its
  table) and dropped for those it does not.

Pure logic over the scheduler's queues: no gRPC (unit-testable).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from model_service.request import Request
from model_service.scheduler import FinishRecord, Scheduler


class HeldRequest(NamedTuple):
    """A running request as the cache manager holds it (RegisterPoolResponse.running_requests)."""

    request_id: str
    block_table: list[int]
    cached_tokens: int  # block_table[:cached_tokens // block_size] is tree-shared


class Reconciled(NamedTuple):
    kept: int
    recomputed: int
    released: int


def agrees(replica_table: Sequence[int], held: HeldRequest, block_size: int) -> bool:
    """Whether the replica may continue on the cache manager's table without recompute."""
    table = held.block_table
    if len(table) < len(replica_table):
        return False
    shared = held.cached_tokens // block_size
    return all(i < shared or table[i] == b for i, b in enumerate(replica_table))


def reconcile(scheduler: Scheduler, held: Mapping[str, HeldRequest], block_size: int) -> Reconciled:
    """Bring the scheduler in line with the cache manager's view of a kept pool (see module doc)."""
    keep: set[str] = set()
    recompute: list[Request] = []
    for request in scheduler.running:
        view = held.get(request.request_id)
        if view is not None and agrees(request.block_table, view, block_size):
            _adopt(request, view)
            keep.add(request.request_id)
        else:
            recompute.append(request)
    # Finishes not sent yet: their KV goes to the tree when the cache manager holds them as the
    # replica does; otherwise there is nothing to finish.
    pending = []
    for item in scheduler.pending_finishes:
        view = held.get(item.request_id)
        if view is None:
            continue
        if not agrees(item.block_table, view, block_size):
            continue  # released below
        _adopt(item, view)
        pending.append(item)
        keep.add(item.request_id)
    scheduler.pending_finishes[:] = pending
    releases = [r for r in scheduler.pending_releases if r.request_id in held and r.request_id not in keep
                and agrees(r.block_table, held[r.request_id], block_size)]
    keep.update(r.request_id for r in releases)
    releases = [r._replace(block_table=list(held[r.request_id].block_table)) for r in releases]
    released = 0
    for request_id in held:
        if request_id not in keep:
            releases.append(FinishRecord(request_id, [], 0, []))
            released += 1
    scheduler.pending_releases[:] = releases
    for request in reversed(recompute):
        scheduler.running.remove(request)
        scheduler.requeue(request)
        scheduler.num_preemptions += 1
    scheduler.generation += 1  # replies to plans sent before the loss are void
    return Reconciled(len(keep), len(recompute), released)


def _adopt(request: Request, view: HeldRequest) -> None:
    request.block_table = list(view.block_table)
    request.num_shared_tokens = view.cached_tokens
