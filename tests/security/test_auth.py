"""common/auth.py on its own: the token file syntax, the store, the role tables, the interceptor
(in-process on the cache manager's create_server) and the HTTP door's check."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cache_service.events import AllCleared, BlockRemoved, BlockStored, CacheEvent, event_in_view
from cache_service.pool_registry import PoolRegistry
from cache_service.server import create_server
from cache_service.servicer import METHOD_ROLES, SERVICE_NAME
from common.auth import (
    PERMISSION_DENIED,
    ROLES,
    UNAUTHENTICATED,
    AuthError,
    AuthInterceptor,
    ClientToken,
    Principal,
    TokenStore,
    bearer_token,
    first_token,
    metadata_token,
    parse_tokens,
    principal_key,
)
from protos import cache_pb2 as pb
from protos import cache_pb2_grpc, model_pb2
from router.openai_api import auth_error
from router.servicer import METHOD_ROLES as ROUTER_ROLES

TOKENS = """
# a comment, then a blank line

all-roles
the-replica replica
the-reader reader ns=tenant-a|tenant-b
the-admin admin,reader
default-ns reader ns=
"""


def store() -> TokenStore:
    return TokenStore(tokens=parse_tokens(TOKENS, "tokens"))


def test_token_file_syntax():
    tokens = parse_tokens(TOKENS, "tokens")
    assert list(tokens) == ["all-roles", "the-replica", "the-reader", "the-admin", "default-ns"]
    assert tokens["all-roles"] == Principal("tokens:4", None, None, None, principal_key("all-roles"))
    assert tokens["the-replica"].roles == {"replica"} and tokens["the-replica"].namespaces is None
    assert tokens["the-reader"].namespaces == {"tenant-a", "tenant-b"}
    assert tokens["the-admin"].roles == {"admin", "reader"}
    assert tokens["default-ns"].namespaces == {""}  # an empty item is the default namespace
    assert tokens["all-roles"].has_role("admin") and tokens["all-roles"].may_read("anything")
    assert not tokens["the-reader"].may_read("") and tokens["default-ns"].may_read("")


@pytest.mark.parametrize("text, fragment", [
    ("tok readr", "unknown role readr"),
    ("tok reader admin", "roles given twice"),
    ("tok ns=a ns=b", "ns= given twice"),
    ("tok\ntok admin", "tokens:2: the same token"),
    ("t\u00f6k", "printable ASCII"),
])
def test_token_file_errors_name_the_line(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_tokens(text, "tokens")


def test_store_authenticates_and_authorizes():
    s = store()
    assert s.authenticate("the-reader").label == "tokens:6"
    for token, message in ((None, "missing bearer token"), ("", "missing bearer token"),
                           ("the-reade", "invalid bearer token"), ("the-reader2", "invalid bearer token")):
        with pytest.raises(AuthError, match=message) as err:
            s.authenticate(token)
        assert err.value.code == UNAUTHENTICATED
    with pytest.raises(AuthError, match="'replica' role") as err:
        s.authorize("the-reader", "replica", "Step")
    assert err.value.code == PERMISSION_DENIED
    assert s.authorize("all-roles", "admin").roles is None
    assert s.authorize("the-replica", None).roles == {"replica"}  # None: any valid token


def test_reload_replaces_tokens_and_keeps_them_on_a_bad_file(tmp_path, caplog):
    path = tmp_path / "tokens"
    path.write_text("one\ntwo reader\n")
    s = TokenStore(path)
    path.write_text("two reader\n")
    assert s.reload()
    with pytest.raises(AuthError):
        s.authenticate("one")
    path.write_text("two reeder\n")
    with caplog.at_level(logging.ERROR):
        assert not s.reload()
    assert "keeping the previous 1 tokens" in caplog.text and "unknown role reeder" in caplog.text
    assert s.authenticate("two").roles == {"reader"}
    path.write_text("")
    with pytest.raises(ValueError, match="no tokens"):
        TokenStore(path)


def test_bearer_parsing_and_client_tokens(tmp_path):
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token(None) is None
    assert metadata_token([("x", "y"), ("authorization", b"Bearer z")]) == "z"
    assert metadata_token(None) is None
    path = tmp_path / "mine"
    path.write_text("# mine\nfirst replica\nsecond\n")
    assert first_token(path) == "first"
    token = ClientToken(path)
    assert token.metadata == (("authorization", "Bearer first"),)
    path.write_text("rotated\n")
    token.reload()
    assert token.metadata == (("authorization", "Bearer rotated"),)
    assert ClientToken(None).metadata is None


def test_role_tables_cover_every_method():
    cache_methods = {m.name for m in pb.DESCRIPTOR.services_by_name["CacheManager"].methods}
    assert set(METHOD_ROLES) == cache_methods
    assert set(METHOD_ROLES.values()) <= ROLES
    assert {m for m, r in METHOD_ROLES.items() if r == "replica"} == {"RegisterPool", "Step", "StepStream",
                                                                             "Heartbeat"}
    assert {m for m, r in METHOD_ROLES.items() if r == "reader"} == {"Match", "Stats", "WatchEvents", "Route",
                                                                            "RouteStream"}
    assert {m for m, r in METHOD_ROLES.items() if r == "admin"} == {"Evict", "Clear"}
    model_methods = {m.name for m in model_pb2.DESCRIPTOR.services_by_name["ModelService"].methods}
    assert ROUTER_ROLES == dict.fromkeys(model_methods, "client")
    interceptor = AuthInterceptor(store(), {SERVICE_NAME: {"Step": "replica"}})
    assert interceptor.required_role(f"/{SERVICE_NAME}/Step") == (True, "replica")
    assert interceptor.required_role(f"/{SERVICE_NAME}/Clear") == (False, None)  # not listed: closed
    assert interceptor.required_role("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") == (True, None)


def test_watch_visibility_by_namespace():
    """What a watcher limited to namespace "a" gets (cache_service/watch.py): the events of "a"
    counted in views (its namespace was tracked when published), and AllCleared."""
    view = frozenset({"a"})

    def event(payload, in_views: bool = True) -> CacheEvent:
        return CacheEvent(1, "p", 0.0, payload, in_views=in_views)

    assert event_in_view(event(BlockStored([1], 0, [1], 1, "a", [0])), view)
    assert not event_in_view(event(BlockStored([1], 0, [1], 1, "b", [0])), view)
    assert event_in_view(event(BlockRemoved([1], [0], "a")), view)
    assert not event_in_view(event(BlockRemoved([1], [0], "")), view)
    assert not event_in_view(event(BlockRemoved([1], [0], "a"), in_views=False), view)
    assert event_in_view(event(AllCleared()), view)


def test_http_door_check():
    s = store()
    assert auth_error(s, "Bearer all-roles") is None
    missing = auth_error(s, None)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert json.loads(missing.body)["error"]["code"] == "invalid_api_key"
    assert auth_error(s, "Bearer wrong").status_code == 401
    denied = auth_error(s, "Bearer the-reader")  # no "client" role
    assert denied.status_code == 403 and "'client' role" in json.loads(denied.body)["error"]["message"]


# ---------------------------------------------------------------------- the interceptor, in-process


def _md(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def test_interceptor_on_the_cache_manager():
    async def scenario():
        server, port = await create_server("127.0.0.1:0", PoolRegistry(), tokens=store())
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = cache_pb2_grpc.CacheManagerStub(channel)

                async def code(call):
                    try:
                        await call
                    except grpc.aio.AioRpcError as e:
                        return e.code(), e.details()
                    return grpc.StatusCode.OK, ""

                register = pb.RegisterPoolRequest(worker_id="w", num_blocks=8, block_size=4)
                assert (await code(stub.RegisterPool(register)))[0] == grpc.StatusCode.UNAUTHENTICATED
                assert (await code(stub.RegisterPool(register, metadata=_md("nope"))))[0] == \
                    grpc.StatusCode.UNAUTHENTICATED
                status, details = await code(stub.RegisterPool(register, metadata=_md("the-reader")))
                assert status == grpc.StatusCode.PERMISSION_DENIED and "'replica' role" in details
                reg = await stub.RegisterPool(register, metadata=_md("the-replica"))
                admits = [pb.Admit(request_id=ns or "default", token_ids=[1, 2, 3, 4, 5], namespace=ns)
                          for ns in ("tenant-a", "tenant-c", "")]
                await stub.Step(pb.StepRequest(pool_id="w", epoch=reg.epoch, admits=admits), metadata=_md("the-replica"))
                finishes = [pb.Finish(request_id=a.request_id, num_computed_tokens=5) for a in admits]
                await stub.Step(pb.StepRequest(pool_id="w", epoch=reg.epoch, finishes=finishes),
                                metadata=_md("the-replica"))
                clear = pb.ClearRequest(pool_id="w", epoch=reg.epoch)
                assert (await code(stub.Clear(clear, metadata=_md("the-reader"))))[0] == grpc.StatusCode.PERMISSION_DENIED

                match = pb.MatchRequest(token_ids=[1, 2, 3, 4, 5], namespace="tenant-a")
                (found,) = (await stub.Match(match, metadata=_md("the-reader"))).matches
                assert found.matched_tokens == 4
                for ns, token in (("tenant-c", "the-reader"), ("", "the-reader"), ("tenant-a", "default-ns")):
                    status, details = await code(stub.Match(pb.MatchRequest(token_ids=[1], namespace=ns),
                                                            metadata=_md(token)))
                    assert status == grpc.StatusCode.PERMISSION_DENIED and f"namespace {ns!r}" in details
                route = pb.RouteRequest(token_ids=[1, 2, 3, 4, 5], namespace="tenant-c", dry_run=True)
                assert (await code(stub.Route(route, metadata=_md("the-reader"))))[0] == \
                    grpc.StatusCode.PERMISSION_DENIED

                watch = stub.WatchEvents(pb.WatchEventsRequest(snapshot=True), metadata=_md("the-reader"), timeout=1)
                seen = []
                with pytest.raises(grpc.aio.AioRpcError):  # ends at its deadline
                    async for event in watch:
                        seen.append(event.stored.namespace)
                assert seen == ["tenant-a"]

                health = health_pb2_grpc.HealthStub(channel)  # open without a token
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
                    health_pb2.HealthCheckResponse.SERVING

                reflection = reflection_pb2_grpc.ServerReflectionStub(channel)  # needs a token, any role
                ask = reflection_pb2.ServerReflectionRequest(list_services="")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in reflection.ServerReflectionInfo(iter([ask])):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                replies = [r async for r in reflection.ServerReflectionInfo(iter([ask]), metadata=_md("the-replica"))]
                assert SERVICE_NAME in {s.name for s in replies[0].list_services_response.service}
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
