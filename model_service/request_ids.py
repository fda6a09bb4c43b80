"""Live requests by caller: client request ids are scoped to the caller's principal, the ids the
engine and the cache manager see are unique across callers.

Two callers may use the same id at once (a tenant cannot learn that another tenant's id is live
by being refused, nor reach another tenant's request by its id), so the replica runs each request
under an internal id: the client's own when no live request holds it (the common case, and what
a router's Route reservation keyed by that id expects at admission), else a fresh unique one.
"""

from __future__ import annotations

import uuid

from common.limits import quote_id
from model_service.request import Request


class DuplicateRequestError(Exception):
    """The caller already has a live request (submitted and not finished) with this id."""


class LiveRequests:
    """Live requests keyed by (owner, client request id), and the internal ids they hold.

    Not thread-safe: the engine guards it with its lock. Every `add` must be matched by one
    `remove` of the same request when it finishes, however it ends.
    """

    def __init__(self) -> None:
        self._by_client: dict[tuple[str, str], Request] = {}
        self._internal: set[str] = set()

    def __len__(self) -> int:
        return len(self._by_client)

    @property
    def num_internal_ids(self) -> int:
        """Internal ids held: one per live choice (len() counts callers' ids, one per request
        whatever its n)."""
        return len(self._internal)

    def check_free(self, request: Request) -> None:
        """Raises DuplicateRequestError when `request`'s owner already has a live request with its
        client id (the message names only that id)."""
        if (request.owner, request.client_request_id) in self._by_client:
            raise DuplicateRequestError(
                f"request id {quote_id(request.client_request_id)} is already in use by a live request")

    def add(self, request: Request) -> None:
        """Records `request` as live and sets its `request_id` to a unique internal id. Raises
        DuplicateRequestError as `check_free` does."""
        self.check_free(request)
        key = (request.owner, request.client_request_id)
        internal = request.client_request_id
        if internal in self._internal:  # held by another caller's request: run under a fresh id
            internal = self._fresh_id()  # 32 characters, well within the 256-byte id limit
        request.request_id = internal
        self._by_client[key] = request
        self._internal.add(internal)
        for choice in request.choices[1:]:  # parallel sampling: the other choices run under fresh ids
            choice.request_id = self._fresh_id()
            self._internal.add(choice.request_id)

    def _fresh_id(self) -> str:
        internal = uuid.uuid4().hex
        while internal in self._internal:
            internal = uuid.uuid4().hex
        return internal

    def get(self, owner: str, client_request_id: str) -> Request | None:
        """The owner's live request with this client id (None: unknown, finished or another's)."""
        return self._by_client.get((owner, client_request_id))

    def remove(self, request: Request) -> None:
        """Forgets finished `request` (one of its choices, with n > 1): its internal id is free
        now, the caller's id once every choice has finished. A no-op when its request is not the
        live one of its key."""
        key = (request.owner, request.client_request_id)
        group = request.group
        if self._by_client.get(key) is not group[0]:
            return
        self._internal.discard(request.request_id)
        if all(choice.is_finished for choice in group if choice is not request):
            del self._by_client[key]
