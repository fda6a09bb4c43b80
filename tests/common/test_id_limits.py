"""common.limits.id_error: its per-type plans find an over-long id wherever a request can hold
one, as a walk of every set field does (the reference below), and nothing else."""

from __future__ import annotations

import pytest
from google.protobuf import message as pb_message

from common.limits import ID_FIELDS, MAX_ID_BYTES, id_error
from protos import cache_pb2, model_pb2

LONG = "r" * (MAX_ID_BYTES + 1)
WIDE = "\U0001f600" * (MAX_ID_BYTES // 4 + 1)  # few characters, over the limit in UTF-8
FITS = "\U0001f600" * (MAX_ID_BYTES // 4)  # exactly the limit


def reference(message: pb_message.Message) -> str | None:
    for field, value in message.ListFields():
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                continue
            for item in (value if field.is_repeated else (value,)):
                why = reference(item)
                if why is not None:
                    return why
        elif field.name in ID_FIELDS and field.type == field.TYPE_STRING and not field.is_repeated:
            size = len(value.encode())
            if size > MAX_ID_BYTES:
                return f"{field.name} has {size} bytes; the limit is {MAX_ID_BYTES} bytes (max_id_bytes)"
    return None


def step(**fields) -> cache_pb2.StepRequest:
    return cache_pb2.StepRequest(pool_id="p", load=cache_pb2.ReplicaLoad(num_running_requests=1), **fields)


CASES = {
    "step fits": step(extends=[cache_pb2.Extend(request_id=FITS)], admits=[cache_pb2.Admit(request_id="a",
                                                                                          namespace=FITS)]),
    "step pool id": cache_pb2.StepRequest(pool_id=LONG),
    "step extend": step(extends=[cache_pb2.Extend(request_id="ok"), cache_pb2.Extend(request_id=LONG)]),
    "step admit namespace": step(admits=[cache_pb2.Admit(request_id="a", namespace=WIDE)]),
    "step finish": step(finishes=[cache_pb2.Finish(request_id=WIDE)]),
    "step release and commit": step(releases=[cache_pb2.Finish(request_id=LONG)],
                                    commits=[cache_pb2.Commit(request_id=LONG)]),
    "register": cache_pb2.RegisterPoolRequest(worker_id=LONG, num_blocks=4, block_size=4),
    "route": cache_pb2.RouteRequest(token_ids=[1], namespace=WIDE, request_id="x"),
    "route fits": cache_pb2.RouteRequest(token_ids=[1], namespace=FITS, request_id=FITS),
    "watch": cache_pb2.WatchEventsRequest(pool_id=LONG),
    "generate": model_pb2.GenerateRequest(prompt="hi", request_id=LONG),
    "generate namespace": model_pb2.GenerateRequest(prompt="hi", namespace=WIDE),
    "generate fits": model_pb2.GenerateRequest(prompt=LONG, request_id=FITS, namespace=FITS),
    "abort": model_pb2.AbortRequest(request_id=LONG),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_id_error_agrees_with_a_walk_of_every_set_field(name: str) -> None:
    message = CASES[name]
    assert id_error(message) == reference(message)
    assert (id_error(message) is None) == name.endswith("fits")
