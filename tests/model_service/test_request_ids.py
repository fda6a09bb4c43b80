"""LiveRequests: client request ids scoped to the caller, internal ids unique across callers, and
nothing kept once every request is removed (the engine removes each on every way it ends; the
real-process side is tests/security/test_tenant_scoping.py)."""

from __future__ import annotations

import pytest

from model_service.request import Request
from model_service.request_ids import DuplicateRequestError, LiveRequests
from model_service.sampler import SamplingOptions


def make(client_id: str, owner: str) -> Request:
    return Request(request_id=client_id, prompt_token_ids=[1, 2, 3], sampling=SamplingOptions.from_params(),
                   max_tokens=4, stop_token_ids=frozenset(), namespace="", ignore_eos=True, arrival_time=0.0,
                   detokenizer=None, owner=owner)  # type: ignore[arg-type]


def test_the_first_request_runs_under_its_client_id_others_under_fresh_unique_ids() -> None:
    live = LiveRequests()
    a, b, c = make("job", "tenant-a"), make("job", "tenant-b"), make("job", "")
    for r in (a, b, c):
        live.add(r)
    assert a.request_id == "job"  # the common case: what a router's Route reservation is keyed by
    assert len({a.request_id, b.request_id, c.request_id}) == 3
    assert all(r.client_request_id == "job" for r in (a, b, c))
    assert live.get("tenant-a", "job") is a and live.get("tenant-b", "job") is b and live.get("", "job") is c
    assert live.get("tenant-c", "job") is None
    assert b.log_id == f"job (as {b.request_id})" and a.log_id == "job"


def test_the_same_owner_cannot_hold_one_id_twice_and_a_refusal_keeps_nothing() -> None:
    live = LiveRequests()
    first = make("dup", "tenant-a")
    live.add(first)
    with pytest.raises(DuplicateRequestError, match="'dup'"):
        live.add(make("dup", "tenant-a"))
    assert len(live) == live.num_internal_ids == 1
    live.remove(first)
    assert len(live) == live.num_internal_ids == 0
    again = make("dup", "tenant-a")
    live.add(again)
    assert again.request_id == "dup"


def test_a_fresh_id_is_never_one_that_a_live_request_holds() -> None:
    live = LiveRequests()
    a = make("x", "tenant-a")
    live.add(a)
    b = make("x", "tenant-b")
    live.add(b)
    c = make(b.request_id, "tenant-c")  # a client id equal to b's internal one
    live.add(c)
    assert len({a.request_id, b.request_id, c.request_id}) == 3
    assert len(live) == live.num_internal_ids == 3
    long_id = "é" * 128  # 256 UTF-8 bytes, the id limit
    d, e = make(long_id, "tenant-a"), make(long_id, "tenant-b")
    live.add(d)
    live.add(e)
    assert d.request_id == long_id and len(e.request_id.encode()) <= 256


def test_removing_in_any_order_leaves_nothing_and_a_stale_remove_is_harmless() -> None:
    live = LiveRequests()
    requests = [make(f"r{i % 3}", f"owner-{i % 4}") for i in range(12)]
    for r in requests:
        live.add(r)
    assert len(live) == live.num_internal_ids == 12
    for r in requests[::2] + requests[1::2]:
        live.remove(r)
        live.remove(r)  # twice: the engine may see a cancel after the request ended
    assert len(live) == live.num_internal_ids == 0
    newer = make("r0", "owner-0")
    live.add(newer)
    live.remove(requests[0])  # an ended request with the same key must not free the newer one
    assert live.get("owner-0", "r0") is newer and live.num_internal_ids == 1


def test_choices_run_under_unique_ids_and_the_client_id_stays_held_until_the_last_ends() -> None:
    from model_service.request import RequestStatus

    live = LiveRequests()
    choices = [make("fan", "tenant-a") for _ in range(3)]
    for index, choice in enumerate(choices):
        choice.index, choice.choices = index, choices
    live.add(choices[0])
    assert choices[0].request_id == "fan" and len({c.request_id for c in choices}) == 3
    assert len(live) == 1 and live.num_internal_ids == 3
    for choice in choices[:2]:  # choice 0 and 1 end; choice 2 still runs: the id is still held
        choice.status = RequestStatus.FINISHED
        live.remove(choice)
        assert live.get("tenant-a", "fan") is choices[0]
        with pytest.raises(DuplicateRequestError):
            live.check_free(make("fan", "tenant-a"))
    assert live.num_internal_ids == 1
    choices[2].status = RequestStatus.FINISHED
    live.remove(choices[2])
    assert len(live) == live.num_internal_ids == 0
