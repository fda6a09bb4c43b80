"""Bearer-token authentication and roles for every radixkv server (``--auth-token-file PATH``).

Token file: one token per line, then optionally its roles and a namespace limit::

    # comment lines and blank lines are ignored
    s3cr3t-admin                        every role, every namespace
    s3cr3t-replica-0 replica worker=model-0   only RegisterPool, Step, Heartbeat, as worker model-0
    s3cr3t-router reader,router         Route that records decisions and pins prefixes
    s3cr3t-tenant-a reader ns=tenant-a|tenant-b
    s3cr3t-default reader ns=           reader of the default ("") namespace only

Roles are comma separated (``reader,admin``); a line without roles has all of them. At the cache
manager, ``reader`` reads (Match, Stats, WatchEvents, and Route with ``dry_run``); a Route that
records its decision (``request_id`` without ``dry_run``) or pins a prefix (``reserve_ms``) also
needs ``router`` (what a fleet router's token has: ``reader,router``). ``ns=`` takes
``|``-separated namespaces (an empty item is the default namespace ``""``) and limits what the
token's cache-manager reads (Match, Route, WatchEvents) see; Stats, which counts every namespace,
is refused to such a token. A line without ``ns=`` sees every namespace. ``worker=`` takes ``|``-separated worker ids or fnmatch patterns (``model-*``) that the
token may register pools as; a line without it may register any worker id not held by another
principal. A token is printable ASCII without spaces. The file is read at start and again on
SIGHUP (a file that no longer parses keeps the previous tokens, and says why in the log).

The check is a grpc.aio server interceptor: every RPC but those of grpc.health.v1.Health needs
``authorization: Bearer TOKEN`` metadata (missing or unknown: UNAUTHENTICATED) whose line has the
role the method needs (else PERMISSION_DENIED naming it). Each servicer declares its method ->
role table next to itself; a method of a declared service missing from its table is refused
(fail closed); other services (reflection) need a valid token and no particular role. Tokens are
compared in constant time (hmac.compare_digest of SHA-256 digests, against every token).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import fnmatch
import hashlib
import hmac
import inspect
import logging
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.grpc_server import HEALTH_SERVICE_NAME, end_call

log = logging.getLogger(__name__)

# Cache manager: replica (RegisterPool, Step, Heartbeat), reader (Match, Stats, WatchEvents,
# Route), router (Route that records its decision or pins a prefix), admin (Evict, Clear).
# Model service and router: client (ModelService, the HTTP door); model service: replica (KvTransfer).
ROLES = frozenset({"replica", "reader", "router", "admin", "client"})
UNAUTHENTICATED = "UNAUTHENTICATED"
PERMISSION_DENIED = "PERMISSION_DENIED"


class AuthError(Exception):
    """A refused call: `code` is UNAUTHENTICATED or PERMISSION_DENIED."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a valid token is: `label` (file:line, for logs), its roles, readable namespaces and
    worker ids it may register (None: all), and `key`, a stable identity (a digest of the token,
    the same across reloads and line moves) that request ids and pools are scoped by. Never log
    `key`."""

    label: str
    roles: frozenset[str] | None = None
    namespaces: frozenset[str] | None = None
    workers: tuple[str, ...] | None = None
    key: str = ""

    def has_role(self, role: str) -> bool:
        return self.roles is None or role in self.roles

    def may_read(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces

    def may_register(self, worker_id: str) -> bool:
        """Whether this principal may register a pool as `worker_id` (its worker= patterns)."""
        if self.workers is None:
            return True
        return any(fnmatch.fnmatchcase(worker_id, pattern) for pattern in self.workers)


def parse_tokens(text: str, source: str = "token file") -> dict[str, Principal]:
    """token -> Principal, in file order. Raises ValueError naming the line of a bad entry."""
    tokens: dict[str, Principal] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        token, *fields = line.split()
        if not (token.isascii() and token.isprintable()):
            raise ValueError(f"{where}: a token must be printable ASCII")
        if token in tokens:
            raise ValueError(f"{where}: the same token is on an earlier line")
        roles: frozenset[str] | None = None
        namespaces: frozenset[str] | None = None
        workers: tuple[str, ...] | None = None
        for field in fields:
            if field.startswith("ns="):
                if namespaces is not None:
                    raise ValueError(f"{where}: ns= given twice")
                namespaces = frozenset(field[3:].split("|"))
            elif field.startswith("worker="):
                if workers is not None:
                    raise ValueError(f"{where}: worker= given twice")
                workers = tuple(w for w in field[7:].split("|") if w)
                if not workers:
                    raise ValueError(f"{where}: worker= needs at least one worker id or pattern")
            else:
                if roles is not None:
                    raise ValueError(f"{where}: roles given twice (write them comma separated: a,b)")
                roles = frozenset(r for r in field.split(",") if r)
                unknown = ", ".join(sorted(roles - ROLES)) or (field if not roles else "")
                if unknown:
                    raise ValueError(f"{where}: unknown role {unknown} (roles: {', '.join(sorted(ROLES))})")
        tokens[token] = Principal(where, roles, namespaces, workers, principal_key(token))
    return tokens


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def principal_key(token: str) -> str:
    """A token's stable identity: a keyed digest, so the key reveals nothing of the token."""
    return hashlib.sha256(b"radixkv-principal\0" + token.encode()).hexdigest()[:32]


class TokenStore:
    """The valid tokens of a server: loaded from `path` (or given), reloadable."""

    def __init__(self, path: Path | str | None = None, tokens: Mapping[str, Principal] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._entries: list[tuple[bytes, Principal]] = []
        self._limited_namespaces: frozenset[str] = frozenset()
        self.generation = 0  # how many times the tokens were set (load and reloads)
        # Called after every reload that replaced the tokens (before any call can use a new one).
        self.on_reload: list[Callable[[], None]] = []
        if tokens is not None:
            self._set(tokens)
        elif self.path is not None:
            self._set(self._read())
            if not self._entries:
                raise ValueError(f"{self.path}: no tokens (every call would be refused)")
        else:
            raise ValueError("TokenStore needs a path or tokens")

    def __len__(self) -> int:
        return len(self._entries)

    def _read(self) -> dict[str, Principal]:
        assert self.path is not None
        return parse_tokens(self.path.read_text(), str(self.path))

    def _set(self, tokens: Mapping[str, Principal]) -> None:
        self._entries = [(_digest(t), p) for t, p in tokens.items()]
        self.generation += 1  # a stream authorized before a reload checks its token again
        self._limited_namespaces = frozenset(ns for p in tokens.values() if p.namespaces is not None
                                             for ns in p.namespaces)

    def limited_namespaces(self) -> frozenset[str]:
        """Every namespace some ns= line names (the cache manager numbers their views)."""
        return self._limited_namespaces

    def reload(self) -> bool:
        """Rereads the file; on any error keeps the tokens it had (logged). True when replaced."""
        try:
            tokens = self._read()
        except (OSError, ValueError, UnicodeDecodeError) as e:
            log.error("token file not reloaded, keeping the previous %d tokens: %s", len(self._entries), e)
            return False
        if not tokens:
            log.warning("token file %s has no tokens now: every authenticated call is refused", self.path)
        self._set(tokens)
        log.info("token file %s reloaded: %d tokens", self.path, len(tokens))
        for callback in self.on_reload:
            callback()
        return True

    def authenticate(self, token: str | None) -> Principal:
        """The Principal of `token`; AuthError(UNAUTHENTICATED) when missing or unknown."""
        if not token:
            raise AuthError(UNAUTHENTICATED, "missing bearer token: send 'authorization: Bearer <token>'")
        digest = _digest(token)
        found: Principal | None = None
        for known, principal in self._entries:  # every entry, no early exit: constant time
            if hmac.compare_digest(known, digest) and found is None:
                found = principal
        if found is None:
            raise AuthError(UNAUTHENTICATED, "invalid bearer token")
        return found

    def authorize(self, token: str | None, role: str | None, what: str = "this call") -> Principal:
        """authenticate(), then AuthError(PERMISSION_DENIED) unless the token has `role`
        (None: any valid token will do)."""
        principal = self.authenticate(token)
        if role is not None and not principal.has_role(role):
            raise AuthError(PERMISSION_DENIED, f"{what} needs a token with the '{role}' role")
        return principal

    def reauthorize(self, principal: Principal, role: str | None, what: str = "this call") -> Principal:
        """The principal as the tokens now stand (found by its key: a reload may have changed its
        line), for a stream authorized before a reload; AuthError as authorize() would raise it
        when the token was removed or lost `role`."""
        found = next((p for _, p in self._entries if p.key == principal.key), None)
        if found is None:
            raise AuthError(UNAUTHENTICATED, "the bearer token was revoked (the server's token file was reloaded)")
        if role is not None and not found.has_role(role):
            raise AuthError(PERMISSION_DENIED, f"{what} needs a token with the '{role}' role")
        return found


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` value (None when absent or not Bearer)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def metadata_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return bearer_token(value.decode(errors="replace") if isinstance(value, bytes) else value)
    return None


def first_token(path: Path | str) -> str:
    """The first token of a token file (what a server sends to its upstream)."""
    tokens = parse_tokens(Path(path).read_text(), str(path))
    if not tokens:
        raise ValueError(f"{path}: no token in it")
    return next(iter(tokens))


class ClientToken:
    """The bearer token a server sends upstream, as call metadata; rereads its file on reload()."""

    def __init__(self, path: Path | str | None) -> None:
        self.path = Path(path) if path is not None else None
        self.metadata: tuple[tuple[str, str], ...] | None = None
        if self.path is not None:
            self.metadata = (("authorization", f"Bearer {first_token(self.path)}"),)

    def reload(self) -> None:
        if self.path is None:
            return
        try:
            self.metadata = (("authorization", f"Bearer {first_token(self.path)}"),)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            log.error("upstream token not reloaded, keeping the previous one: %s", e)


# ---------------------------------------------------------------------- gRPC interceptor

_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("radixkv_principal", default=None)


def current_principal() -> Principal | None:
    """The caller of the RPC being served (None: the server runs without tokens)."""
    return _PRINCIPAL.get()


def one_role(service: object, role: str) -> dict[str, str]:
    """method -> `role` for every method of a protobuf ServiceDescriptor."""
    return {method.name: role for method in service.methods}  # type: ignore[attr-defined]


_HANDLER_FACTORIES = {
    (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
    (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
}


def _rebuild(handler: grpc.RpcMethodHandler, behavior: Callable) -> grpc.RpcMethodHandler:
    factory, _ = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(behavior, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


def _denied(handler: grpc.RpcMethodHandler, error: AuthError) -> grpc.RpcMethodHandler:
    async def deny(_request, context: grpc.aio.ServicerContext) -> None:
        end_call(context, grpc.StatusCode[error.code], error.message)

    return _rebuild(handler, deny)


def _as(handler: grpc.RpcMethodHandler, principal: Principal,
        recheck: Callable[[Principal], Principal]) -> grpc.RpcMethodHandler:
    """The handler, run with current_principal() = principal (each RPC runs in its own task). A
    stream of requests passes each of them through `recheck` (the token as the token file now
    stands): one that fails ends the call with its AuthError, the requests before it served."""
    _, attr = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    behavior = getattr(handler, attr)

    async def checked(requests, context):
        async for request in requests:
            try:
                _PRINCIPAL.set(recheck(_PRINCIPAL.get() or principal))
            except AuthError as e:
                log.info("refused a stream's next message: %s %s", e.code, e.message)
                end_call(context, grpc.StatusCode[e.code], e.message)
                return
            yield request

    def inputs(request, context):
        if handler.request_streaming:
            return contextlib.aclosing(checked(request, context))
        return contextlib.nullcontext(request)

    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            _PRINCIPAL.set(principal)
            async with inputs(request, context) as given, \
                    contextlib.aclosing(behavior(given, context)) as messages:  # its finally runs here
                async for message in messages:
                    yield message

        return _rebuild(handler, stream)

    async def call(request, context):
        _PRINCIPAL.set(principal)
        async with inputs(request, context) as given:
            result = behavior(given, context)
            return await result if inspect.isawaitable(result) else result

    return _rebuild(handler, call)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token and role of every call (see the module docstring).

    `roles`: full service name -> {method name -> role}.
    """

    def __init__(self, store: TokenStore, roles: Mapping[str, Mapping[str, str]],
                 open_services: Sequence[str] = (HEALTH_SERVICE_NAME,)) -> None:
        self.store = store
        self.roles = roles
        self.open_services = frozenset(open_services)

    def required_role(self, method: str) -> tuple[bool, str | None]:
        """(allowed at all, role) of a full method name '/pkg.Service/Method'."""
        service, _, name = method.lstrip("/").partition("/")
        table = self.roles.get(service)
        if table is None:
            return True, None
        role = table.get(name)
        return role is not None, role

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.lstrip("/").partition("/")[0] in self.open_services:
            return handler
        try:
            allowed, role = self.required_role(method)
            principal = self.store.authorize(metadata_token(handler_call_details.invocation_metadata), role,
                                             method)
            if not allowed:
                raise AuthError(PERMISSION_DENIED, f"{method} is not open to any role")
        except AuthError as e:
            log.info("refused %s: %s %s", method, e.code, e.message)
            return _denied(handler, e)
        generation = self.store.generation

        def recheck(current: Principal) -> Principal:
            if self.store.generation == generation:
                return current
            return self.store.reauthorize(current, role, method)

        return _as(handler, principal, recheck)


def add_auth_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auth-token-file", type=Path, metavar="PATH",
                        help="require 'authorization: Bearer TOKEN' on every RPC but health; one token per "
                             "line, optionally followed by its roles (see docs/security.md); reread on SIGHUP")


def token_store_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TokenStore | None:
    if args.auth_token_file is None:
        return None
    try:
        return TokenStore(args.auth_token_file)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        parser.error(f"--auth-token-file: {e}")


def client_token_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser, prefix: str) -> ClientToken:
    """The token of ``--PREFIX-token-file`` (no token when the flag is not given)."""
    try:
        return ClientToken(getattr(args, f"{prefix.replace('-', '_')}_token_file"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        parser.error(f"--{prefix}-token-file: {e}")


def server_interceptors(store: TokenStore | None, roles: Mapping[str, Mapping[str, str]]) -> list:
    """The interceptors of a server: [] without a token file."""
    return [] if store is None else [AuthInterceptor(store, roles)]


def reload_on_sighup(loop, store: TokenStore | None, *client_tokens: ClientToken) -> None:
    """SIGHUP rereads the server's token file and the upstream token files (when any is given)."""
    if store is None and not any(t.path for t in client_tokens):
        return

    def reload() -> None:
        log.info("SIGHUP: reloading token files")
        if store is not None:
            store.reload()
        for token in client_tokens:
            token.reload()

    loop.add_signal_handler(signal.SIGHUP, reload)
