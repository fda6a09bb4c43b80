"""Reconciling the scheduler with a kept pool's view after a cache-manager restart
(model_service/reattach.py): who continues without recompute, who is recomputed, what is released."""

from __future__ import annotations

from model_service.reattach import HeldRequest, agrees, reconcile
from model_service.request import FinishReason, RequestStatus
from model_service.scheduler import AdmitReply, CacheReply, Scheduler, SchedulerConfig
from tests.model_service.test_scheduler import make_request

BS = 16


def running_scheduler(tables: dict[str, list[int]]) -> Scheduler:
    """A scheduler whose requests (40-token prompts) run on the given block tables."""
    scheduler = Scheduler(SchedulerConfig(block_size=BS, max_batch_tokens=10_000, max_num_seqs=8,
                                          defer_shared_prefix_tokens=0))
    for rid in tables:
        scheduler.add(make_request(rid, 40))
    plan = scheduler.plan_cache_step()
    scheduler.apply_cache_reply(plan, CacheReply(
        admits=[AdmitReply(r.request_id, True, 0, tables[r.request_id]) for r in plan.admits], extends=[],
        commits=[]))
    assert [r.request_id for r in scheduler.running] == list(tables)
    return scheduler


def test_agreement_rules() -> None:
    assert agrees([1, 2, 3], HeldRequest("a", [1, 2, 3], 0), BS)
    assert agrees([1, 2, 3], HeldRequest("a", [1, 2, 3, 9], 16), BS)  # an extension the replica missed
    assert agrees([1, 2, 3], HeldRequest("a", [7, 2, 3], 16), BS)  # page 0 swapped for the tree's copy
    assert not agrees([1, 2, 3], HeldRequest("a", [1, 8, 3], 16), BS)  # a private block differs
    assert not agrees([1, 2, 3], HeldRequest("a", [1, 2], 0), BS)  # fewer blocks than written


def test_requests_that_agree_continue_and_the_rest_is_recomputed_or_released() -> None:
    scheduler = running_scheduler({"same": [0, 1, 2], "extended": [3, 4, 5], "swapped": [6, 7, 8],
                                   "differs": [9, 10, 11], "unknown": [12, 13, 14]})
    held = {
        "same": HeldRequest("same", [0, 1, 2], 0),
        "extended": HeldRequest("extended", [3, 4, 5, 20], 0),
        "swapped": HeldRequest("swapped", [30, 31, 8], 32),  # a commit the replica never heard of
        "differs": HeldRequest("differs", [9, 40, 11], 0),
        "ghost": HeldRequest("ghost", [50, 51], 0),  # admitted by the Step whose reply was lost
    }
    done = reconcile(scheduler, held, BS)
    assert done == (3, 2, 2)
    running = {r.request_id: r for r in scheduler.running}
    assert set(running) == {"same", "extended", "swapped"}
    assert running["extended"].block_table == [3, 4, 5, 20]
    assert running["swapped"].block_table == [30, 31, 8] and running["swapped"].num_shared_tokens == 32
    assert all(r.num_preemptions == 0 and r.status is RequestStatus.RUNNING for r in running.values())
    waiting = {r.request_id: r for r in scheduler.waiting}
    assert set(waiting) == {"differs", "unknown"}
    assert all(r.num_preemptions == 1 and r.block_table == [] and r.status is RequestStatus.WAITING
               for r in waiting.values())
    plan = scheduler.plan_cache_step()
    assert sorted(r.request_id for r in plan.releases) == ["differs", "ghost"]
    assert all(r.num_computed_tokens == 0 and r.block_table == [] for r in plan.releases)
    assert not plan.extends, "an adopted table already covers the tokens"


def test_pending_finishes_are_sent_only_for_requests_the_cache_manager_holds() -> None:
    scheduler = running_scheduler({"held": [0, 1, 2], "gone": [3, 4, 5]})
    requests = {r.request_id: r for r in scheduler.running}
    for request in requests.values():
        scheduler.finish(request, FinishReason.LENGTH)
    done = reconcile(scheduler, {"held": HeldRequest("held", [0, 1, 2, 9], 0)}, BS)
    assert done.released == 0
    plan = scheduler.plan_cache_step()
    assert [f.request_id for f in plan.finishes] == ["held"]
    assert plan.finishes[0].block_table == [0, 1, 2, 9]
    assert not plan.releases
