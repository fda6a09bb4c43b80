"""One model replica's KV pool: allocator + radix tree + live requests + counters.

A request's block table has two parts: the first `num_cached_pages` blocks came from the tree
(tree-owned; the request holds a lock on their path and one refcount on each block), the rest
are private to the request until it finishes. On finish/release the computed full pages are
inserted into the tree: private pages that another request cached meanwhile are freed as
duplicates, the others change owner to the tree; the partial tail page and unused blocks are
freed. A commit (SGLang's `cache_unfinished_req`) inserts a running request's computed full
pages the same way, but the request keeps them: they join its tree-owned, locked prefix, and
its duplicates are swapped for the tree's copies.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

from cache_service.attach import AttachState
from cache_service.block_allocator import BlockAllocator
from cache_service.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from cache_service.events import AllCleared, EventLog, EventPayload, removed_by_namespace, stored_from_node
from cache_service.miss_reasons import EvictedPages, classify_miss
from cache_service.peer_pulls import PeerPulls, TransferEndpoint
from cache_service.radix_tree import RadixTree, TreeNode
from cache_service.routed import MIN_MAX_ROUTED_PAGES, RoutedRequest, RoutedRequests, RoutingState
from cache_service.schema import (
    Admit,
    AdmitResult,
    ClearResult,
    Commit,
    CommitResult,
    Extend,
    ExtendResult,
    Finish,
    MatchInfo,
    PoolStats,
    ReplicaLoad,
    StepInput,
    StepResult,
    TierSpec,
)
from cache_service.tiers.lower_tier import TIER_DISK, TIER_HOST
from cache_service.tiers.pool_tiers import PoolTiers
from common.limits import quote_id
from common.token_bytes import TOKEN_BYTES, encode_tokens, max_token

log = logging.getLogger(__name__)

# Eviction on demand frees at least 1/EVICT_BATCH_FRACTION of the pool (at most MAX_EVICT_BATCH
# blocks) at a time. In a full pool every new block is an eviction; one block at a time costs a
# tree split, an event and an evicted-pages record per decode step, while a batch serves the next
# dozens of extends from the free list. What goes early is the LRU end of the cache, <= 0.4% of
# it; pools of under 2 * EVICT_BATCH_FRACTION blocks evict exactly what they need.
EVICT_BATCH_FRACTION = 256
MAX_EVICT_BATCH = 64


def evict_batch(num_blocks: int) -> int:
    """The fewest blocks an on-demand eviction frees in a pool of `num_blocks` blocks."""
    return max(1, min(MAX_EVICT_BATCH, num_blocks // EVICT_BATCH_FRACTION))


@dataclass(slots=True)
class RequestState:
    request_id: str
    namespace: str
    # The tokens sent at admission: a tuple, or an array('I') for Admit.packed_token_ids.
    prompt: Sequence[int]
    last_node: TreeNode | None  # deepest locked tree node (None or a root: nothing locked)
    num_cached_pages: int  # block_table[:num_cached_pages] is tree-owned, the rest private
    block_table: list[int]
    # Output tokens (after the prompt) inside the cached pages, from commits of decode pages.
    cached_outputs: tuple[int, ...] = ()
    # Tokens it asked capacity for (Admit: prompt + next token; Extend.num_tokens); blocks
    # beyond them are lookahead (spare, private, never cached).
    num_needed_tokens: int = 0
    prompt_bytes: bytes | None = None  # the prompt as the tree's keys are (encoded_prompt)

    def num_lookahead_blocks(self, block_size: int) -> int:
        needed = max(self.num_cached_pages, -(-self.num_needed_tokens // block_size))
        return max(0, len(self.block_table) - needed)

    def encoded_prompt(self) -> bytes:
        """`prompt` encoded for the tree (common.token_bytes.encode_tokens), once per request."""
        if self.prompt_bytes is None:
            self.prompt_bytes = encode_tokens(self.prompt)
        return self.prompt_bytes

    def cached_key(self, block_size: int) -> tuple[int, ...]:
        """The tokens of the request's tree-owned pages."""
        n = self.num_cached_pages * block_size
        return (tuple(self.prompt) + self.cached_outputs)[:n] if n > len(self.prompt) else tuple(self.prompt[:n])


class Pool:
    """Allocator, tree and request table of one pool; implements `Step` semantics.

    All methods are synchronous and not thread-safe: call them from one thread (the server's
    event loop). A `step` is validated whole first; on error nothing is applied.
    """

    def __init__(
        self,
        pool_id: str,
        epoch: int,
        num_blocks: int,
        block_size: int,
        model_fingerprint: str = "",
        vocab_size: int = 0,
        events: EventLog | None = None,
        max_finished_ids: int = 65536,
        serving_addr: str = "",
        tiers: TierSpec | None = None,
        transfer: TransferEndpoint | None = None,
    ) -> None:
        self.pool_id = pool_id
        self.worker_id = pool_id
        self.epoch = epoch
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.vocab_size = vocab_size
        self.lease_deadline = float("inf")  # managed by the registry
        self.allocator = BlockAllocator(num_blocks)
        self.evict_batch = evict_batch(num_blocks)  # kept in the journal and snapshots: replay evicts alike
        self.tree = RadixTree(block_size)
        self.requests: dict[str, RequestState] = {}
        self.num_private_blocks = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.num_evicted_blocks = 0
        self.num_admitted = 0
        self.num_finished = 0
        self.num_released = 0
        # First-admission tokens counted as new for their caller that this pool held under another
        # namespace (metrics.py; not in Stats or snapshots: a tenant must not read it per request).
        self.miss_other_namespace_tokens = 0
        # Steps applied (restored ones included): re-attach checks it against the replica's
        # num_steps_acknowledged; a counter like those above (snapshots keep it with them).
        self.num_steps = 0
        self._events = events
        self._finished_ids: OrderedDict[str, None] = OrderedDict()
        self._max_finished_ids = max_finished_ids
        self.serving_addr = serving_addr
        # Told when `load` or the routed tokens change (its model group's load order; the registry wires it).
        self.on_load_change: Callable[[Pool], None] | None = None
        self._load = ReplicaLoad()
        self.evicted_pages = EvictedPages(2 * num_blocks)
        # Routed requests, reservations and what the registry wires in (cache_service/routed.py).
        self.routing = RoutingState(RoutedRequests(max_pages=max(2 * num_blocks, MIN_MAX_ROUTED_PAGES)),
                                    max_pinned_blocks=num_blocks // 4)
        # Owner, incarnation, restored / awaiting re-attach (cache_service/attach.py).
        self.attach = AttachState()
        # The replica's host / disk tiers (cache_service/tiers/); None: it has none.
        self.tier_spec = tiers if tiers is not None else TierSpec()
        self.tiers = PoolTiers(self.tier_spec, block_size, self._publish) if self.tier_spec.enabled else None
        # Peer pulls: as a puller and as a source (cache_service/peer_pulls.py); the registry wires it.
        self.pulls = PeerPulls(transfer, pool_id)

    @property
    def load(self) -> ReplicaLoad:
        """The replica's last reported load."""
        return self._load

    @load.setter
    def load(self, load: ReplicaLoad) -> None:
        self._load = load
        if self.on_load_change is not None:
            self.on_load_change(self)

    @property
    def num_charged_pages(self) -> int:
        """Blocks and lower-tier slots: what the registry's memory cap counts (registry_limits.py)."""
        spec = self.tier_spec
        return self.num_blocks + spec.num_host_slots + spec.num_disk_slots

    def _publish(self, payload: EventPayload) -> None:
        if self._events is not None:
            self._events.publish(self.pool_id, payload)

    # ------------------------------------------------------------------ step

    def step(self, step: StepInput) -> StepResult:
        """Validate the whole step, then apply releases+finishes, commits, extends, admits (FCFS)."""
        self._validate(step)
        tiers = self.tiers
        if step.load is not None:
            self.load = step.load
            if tiers is not None:
                tiers.load_costs = {TIER_HOST: step.load.host_load_cost, TIER_DISK: step.load.disk_load_cost}
        if tiers is not None:
            tiers.apply_outcomes(step.copy_outcomes)
        self.pulls.apply_outcomes(step.pull_outcomes)
        evicted_before = self.num_evicted_blocks
        for item in step.releases:
            self._finish(item, released=True)
        for item in step.finishes:
            self._finish(item, released=False)
        commits = [self._commit(item) for item in step.commits]
        if len(step.extends) > 1:
            # In a full pool every extend evicts: evict for all of them at once (the same LRU
            # pages, in one tree pass, one event and one evicted-pages record per step). When
            # they cannot all fit, nothing is evicted here and each tries on its own, in order.
            self._make_free(sum(max(0, self._extend_need(item)) for item in step.extends))
        extends = [self._extend(item) for item in step.extends]
        admits: list[AdmitResult] = []
        full = False
        for item in step.admits:
            result = AdmitResult(item.request_id, False, 0, []) if full else self._admit(item)
            full = not result.admitted
            admits.append(result)
        self.num_steps += 1
        return StepResult(
            admits, extends, commits, self.num_evicted_blocks - evicted_before, self.allocator.num_free_blocks,
            tiers.end_step() if tiers is not None else [],
        )

    def _validate(self, step: StepInput) -> None:
        if step.copy_outcomes:
            if self.tiers is None:
                raise InvalidArgument("copy_outcomes given for a pool without lower tiers")
            self.tiers.validate_outcomes(step.copy_outcomes)
        self.pulls.validate_outcomes(step.pull_outcomes)
        seen: set[str] = set()
        for item in chain(step.releases, step.finishes, step.extends, step.admits):
            rid = item.request_id
            if not rid:
                raise InvalidArgument("request_id must be non-empty")
            if rid in seen:
                raise InvalidArgument(f"request {quote_id(rid)} appears more than once in the step")
            seen.add(rid)
        # A running request may commit and extend in the same step; nothing else may repeat.
        extending = {item.request_id for item in step.extends}
        committing: set[str] = set()
        for item in step.commits:
            rid = item.request_id
            if rid in committing or (rid in seen and rid not in extending):
                raise InvalidArgument(f"request {quote_id(rid)} appears more than once in the step")
            committing.add(rid)
        bs = self.block_size
        for item in chain(step.releases, step.finishes):
            req = self._live_request(item.request_id)
            self._check_token_ids(item.output_token_ids, item.request_id)
            self._check_outputs(req, item.output_token_ids)
            total = len(req.prompt) + len(item.output_token_ids)
            if item.num_computed_tokens < 0 or item.num_computed_tokens > total:
                raise InvalidArgument(
                    f"request {quote_id(item.request_id)}: num_computed_tokens {item.num_computed_tokens} "
                    f"outside [0, {total}] (prompt + output tokens)"
                )
            if item.num_computed_tokens > len(req.block_table) * bs:
                raise InvalidArgument(
                    f"request {quote_id(item.request_id)}: num_computed_tokens {item.num_computed_tokens} "
                    f"exceeds its {len(req.block_table)} blocks"
                )
            if item.block_table and list(item.block_table) != req.block_table:
                raise FailedPrecondition(
                    f"request {quote_id(item.request_id)}: block_table does not match the blocks the cache "
                    "gave this request"
                )
        for item in step.commits:
            req = self._live_request(item.request_id)
            self._check_token_ids(item.output_token_ids, item.request_id)
            self._check_outputs(req, item.output_token_ids)
            limit = min(len(req.prompt) + len(item.output_token_ids), len(req.block_table) * bs)
            if item.num_computed_tokens < 0 or item.num_computed_tokens > limit:
                raise InvalidArgument(
                    f"request {quote_id(item.request_id)}: commit of {item.num_computed_tokens} tokens outside "
                    f"[0, {limit}] (tokens sent at admission + output_token_ids, within its blocks)"
                )
        for item in step.extends:
            self._live_request(item.request_id)
            if item.num_tokens < 0 or item.num_lookahead_tokens < 0:
                raise InvalidArgument(
                    f"request {quote_id(item.request_id)}: num_tokens and num_lookahead_tokens must be >= 0")
            self._check_fits(item.request_id, item.num_tokens)  # lookahead is capped at the pool instead
        for item in step.admits:
            rid = item.request_id
            if rid in self.requests:
                raise InvalidArgument(f"request {quote_id(rid)} is already running in pool {quote_id(self.pool_id)}")
            if not item.token_ids:
                raise InvalidArgument(f"request {quote_id(rid)}: token_ids must be non-empty")
            if item.num_lookahead_tokens < 0:
                raise InvalidArgument(f"request {quote_id(rid)}: num_lookahead_tokens must be >= 0")
            self._check_token_ids(item.token_ids, rid)
            self._check_fits(rid, len(item.token_ids) + item.num_lookahead_tokens)

    def _live_request(self, request_id: str) -> RequestState:
        req = self.requests.get(request_id)
        if req is not None:
            return req
        if request_id in self._finished_ids:
            raise FailedPrecondition(f"request {quote_id(request_id)} was already finished or released")
        raise NotFound(f"request {quote_id(request_id)} is not running in pool {quote_id(self.pool_id)}")

    def _check_outputs(self, req: RequestState, output_token_ids: Sequence[int]) -> None:
        """Output tokens must agree with those already cached by a commit of decode pages."""
        # The length of cached_key() minus the prompt, without building that tuple on every finish.
        known = min(req.num_cached_pages * self.block_size, len(req.prompt) + len(req.cached_outputs)) - len(req.prompt)
        if known > 0 and tuple(output_token_ids[:known]) != req.cached_outputs[:known]:
            raise FailedPrecondition(
                f"request {quote_id(req.request_id)}: output_token_ids differ from the {known} output tokens "
                "an earlier commit cached"
            )

    def _check_token_ids(self, token_ids: Sequence[int], request_id: str) -> None:
        if not token_ids:
            return
        if not isinstance(token_ids, array) and min(token_ids) < 0:  # array('I'): unsigned already
            raise InvalidArgument(f"request {quote_id(request_id)}: negative token id")
        if self.vocab_size:
            top = max_token(token_ids)
            if top >= self.vocab_size:
                raise InvalidArgument(f"request {quote_id(request_id)}: token id {top} >= vocab_size {self.vocab_size}")

    def _check_fits(self, request_id: str, num_tokens: int) -> None:
        pages = -(-num_tokens // self.block_size)
        if pages > self.num_blocks:
            raise ResourceExhausted(
                f"request {quote_id(request_id)} needs {pages} blocks ({num_tokens} tokens); the pool has "
                f"{self.num_blocks} in all"
            )

    # ------------------------------------------------------------------ items

    def _admit(self, item: Admit) -> AdmitResult:
        bs = self.block_size
        tokens = item.token_ids if isinstance(item.token_ids, array) else tuple(item.token_ids)
        max_cached = (len(tokens) - 1) // bs * bs  # at least one prompt token is computed
        key = encode_tokens(tokens)
        match = self.tree.match_prefix(key[: max_cached * TOKEN_BYTES], item.namespace)
        num_cached = len(match.block_ids)
        num_fresh = -(-(len(tokens) + item.num_lookahead_tokens) // bs) - num_cached
        self.tree.inc_lock_ref(match.last_node)  # before evicting, so our own prefix stays
        tiers = self.tiers  # lower-tier pages after the device hit: locked before evicting, as ours
        hit = tiers.match(key[: max_cached * TOKEN_BYTES], item.namespace, num_cached) if tiers is not None else None
        if not self._make_free(num_fresh):
            self.tree.dec_lock_ref(match.last_node)
            if tiers is not None:
                tiers.unmatch(hit)
            log.debug("admit no_space pool=%s request=%s need=%d", self.pool_id, item.request_id, num_fresh)
            return AdmitResult(item.request_id, False, 0, [])
        self.allocator.incref(match.block_ids)
        table = match.block_ids + self.allocator.allocate(num_fresh)
        loaded = tiers.loads(hit, item.namespace, table, num_cached, not item.resumed) if tiers is not None else None
        num_loaded = loaded.host_pages + loaded.disk_pages if loaded is not None else 0
        pulled = self.pulls.plan(self, key[: max_cached * TOKEN_BYTES], item.namespace, num_cached + num_loaded,
                                 max_cached // bs, table) if self.pulls.enabled else None
        self.requests[item.request_id] = RequestState(
            item.request_id, item.namespace, tokens, match.last_node, num_cached, table,
            num_needed_tokens=len(tokens) + min(item.num_lookahead_tokens, 1), prompt_bytes=key,
        )
        # Our own lock holds the prefix now.
        self._unlock(self.routing.routed.on_admit(item.namespace, item.request_id))
        miss = None
        if not item.resumed:
            parent_hash = match.last_node.last_hash if match.last_node is not None else 0
            if num_loaded:
                parent_hash = loaded.last_hash
            if pulled is not None:
                parent_hash = pulled.last_hash
                num_loaded += pulled.num_pages
                self.pulls.counters.peer_hit_tokens += pulled.num_pages * bs
            miss, other_namespace = classify_miss(self.tree, self.evicted_pages, self.routing.peer_pages, tokens,
                                                  item.namespace, num_cached + num_loaded, parent_hash, key)
            self.miss_other_namespace_tokens += other_namespace  # operator metric only, never per request
        self._finished_ids.pop(item.request_id, None)
        self.num_private_blocks += num_fresh
        self.num_admitted += 1
        if not item.resumed:  # the hit rate is that of first admissions (what clients see)
            self.queried_tokens += len(tokens)
            self.hit_tokens += num_cached * bs
        log.debug(
            "admit pool=%s request=%s tokens=%d cached=%d fresh=%d",
            self.pool_id, item.request_id, len(tokens), num_cached * bs, num_fresh,
        )
        return AdmitResult(item.request_id, True, num_cached * bs, list(table), miss,
                           loaded.loads if loaded is not None else [], [pulled.pull] if pulled is not None else [])

    def _extend_need(self, item: Extend) -> int:
        """Blocks an extend asks for beyond those its request holds."""
        want = min(item.num_tokens + item.num_lookahead_tokens, self.num_blocks * self.block_size)
        return -(-want // self.block_size) - len(self.requests[item.request_id].block_table)

    def _extend(self, item: Extend) -> ExtendResult:
        req = self.requests[item.request_id]
        req.num_needed_tokens = max(req.num_needed_tokens, item.num_tokens)
        need = self._extend_need(item)
        if need <= 0:
            return ExtendResult(item.request_id, True, [])
        if not self._make_free(need):
            return ExtendResult(item.request_id, False, [])
        fresh = self.allocator.allocate(need)
        req.block_table.extend(fresh)
        self.num_private_blocks += need
        return ExtendResult(item.request_id, True, fresh)

    def _commit(self, item: Commit) -> CommitResult:
        req = self.requests[item.request_id]
        bs = self.block_size
        cached = req.num_cached_pages
        full_pages = item.num_computed_tokens // bs
        if full_pages <= cached:
            return CommitResult(item.request_id, cached * bs, req.block_table[:cached])
        n = full_pages * bs
        num_prompt = len(req.prompt)
        outputs = tuple(item.output_token_ids[: n - num_prompt]) if n > num_prompt else ()
        table = req.block_table
        key = req.encoded_prompt()
        key = key[: n * TOKEN_BYTES] if n <= num_prompt else key + encode_tokens(outputs)
        result = self.tree.insert(key, table[:full_pages], req.namespace)
        existing = result.num_existing_pages
        if existing < cached:  # the request's own prefix is locked, so it must still be there
            raise IntegrityError(f"request {quote_id(req.request_id)}: locked prefix vanished from the tree")
        if result.new_node is not None:
            self._publish(stored_from_node(result.new_node, bs))
            if self.tiers is not None:
                self.tiers.on_device_cached(result.new_node)
        # Its prompt is cached: no longer a promise.
        self._unlock(self.routing.routed.drop(req.namespace, req.request_id))
        shared = self.tree.path_blocks(result.last_node, full_pages - cached)
        # Pages [existing, full_pages) now belong to the tree and the request keeps a reference;
        # pages [cached, existing) were cached by another request first: share the tree's copy.
        self.allocator.incref(shared)
        self.allocator.free(table[cached:existing])
        self.tree.inc_lock_ref(result.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = result.last_node
        table[cached:full_pages] = shared
        req.num_cached_pages = full_pages
        if n > num_prompt:
            req.cached_outputs = outputs
        self.num_private_blocks -= full_pages - cached
        log.debug("commit pool=%s request=%s cached_pages=%d -> %d (duplicates %d)",
                  self.pool_id, req.request_id, cached, full_pages, existing - cached)
        return CommitResult(item.request_id, full_pages * bs, table[:full_pages])

    def _finish(self, item: Finish, released: bool) -> None:
        req = self.requests.pop(item.request_id)
        self._unlock(self.routing.routed.drop(req.namespace, req.request_id))
        bs = self.block_size
        table = req.block_table
        cached = req.num_cached_pages
        full_pages = item.num_computed_tokens // bs
        existing = cached
        if full_pages > cached:
            key = req.encoded_prompt() + encode_tokens(item.output_token_ids)
            result = self.tree.insert(key[: full_pages * bs * TOKEN_BYTES], table[:full_pages], req.namespace)
            existing = result.num_existing_pages
            if existing < cached:  # the request's own prefix is locked, so it must still be there
                raise IntegrityError(f"request {quote_id(req.request_id)}: locked prefix vanished from the tree")
            if result.new_node is not None:
                self._publish(stored_from_node(result.new_node, bs))
                if self.tiers is not None:
                    self.tiers.on_device_cached(result.new_node)
        else:
            # Nothing new to insert: still refresh the path's LRU place, as an insert would
            # (SGLang re-inserts in cache_finished_req; vLLM frees to the LRU queue's tail).
            self.tree.touch(req.last_node)
        # This request's reference on its shared pages, its pages another request cached first,
        # and its uncomputed / partial tail blocks. Pages [existing, full_pages) now belong to
        # the tree with the request's reference.
        self.allocator.free(chain(table[:existing], table[max(full_pages, cached) :]))
        self.tree.dec_lock_ref(req.last_node)
        self.num_private_blocks -= len(table) - cached
        self._finished_ids[req.request_id] = None
        if len(self._finished_ids) > self._max_finished_ids:
            self._finished_ids.popitem(last=False)
        if released:
            self.num_released += 1
        else:
            self.num_finished += 1
        log.debug(
            "%s pool=%s request=%s computed=%d cached_pages=%d inserted_pages=%d",
            "release" if released else "finish", self.pool_id, req.request_id,
            item.num_computed_tokens, cached, max(0, full_pages - existing),
        )

    # ------------------------------------------------------------------ eviction

    def _make_free(self, n: int) -> bool:
        """Ensure `n` free blocks, evicting LRU unlocked pages (at least `evict_batch` when any);
        False (and no eviction) if impossible."""
        short = n - self.allocator.num_free_blocks
        if short <= 0:
            return True
        if short > self.tree.evictable_size:
            return False
        self._evict(min(max(short, self.evict_batch), self.tree.evictable_size))
        if self.allocator.num_free_blocks < n:  # never trust the counter: fail the item, not the Step
            log.error("pool %s: eviction freed fewer blocks than evictable_size promised (need %d, free %d)",
                      self.pool_id, n, self.allocator.num_free_blocks)
            return False
        return True

    def _evict(self, num_blocks: int) -> int:
        evicted = self.tree.evict(num_blocks)
        if not evicted:
            return 0
        blocks = list(chain.from_iterable(node.block_ids for node in evicted))
        self.allocator.free(blocks)
        self.num_evicted_blocks += len(blocks)
        self.evicted_pages.add([h for node in evicted for h in node.hashes])
        if self.tiers is not None:  # copied down before the blocks are written again
            self.tiers.on_device_evicted(evicted)
        if self._events is not None:
            for event in removed_by_namespace(evicted):
                self._events.publish(self.pool_id, event)
        log.debug("evict pool=%s blocks=%d", self.pool_id, len(blocks))
        return len(blocks)

    def evict(self, num_blocks: int) -> int:
        """Admin: evict up to `num_blocks` unlocked cached blocks, LRU first."""
        if num_blocks < 0:
            raise InvalidArgument("num_blocks must be >= 0")
        return self._evict(min(num_blocks, self.tree.evictable_size))

    def clear(self) -> ClearResult:
        """Admin: evict every unlocked cached block."""
        evicted = self._evict(self.tree.evictable_size)
        return ClearResult(evicted, self.tree.protected_size)

    def retire(self) -> None:
        """Drop every request (locks and private blocks) and the whole tree (lease expiry)."""
        self._unlock(self.routing.routed.drop_all())
        self.pulls.retire()
        for rid in list(self.requests):
            req = self.requests.pop(rid)
            self.allocator.free(req.block_table)
            self.tree.dec_lock_ref(req.last_node)
            self.num_private_blocks -= len(req.block_table) - req.num_cached_pages
            self._finished_ids[rid] = None
        evicted = self.tree.evict_all()
        blocks = list(chain.from_iterable(node.block_ids for node in evicted))
        self.allocator.free(blocks)
        self.num_evicted_blocks += len(blocks)
        if self._events is not None:
            self._events.publish(self.pool_id, AllCleared())

    # ------------------------------------------------------------------ routing

    def _unlock(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            if node.in_tree:
                self.tree.dec_lock_ref(node)

    def may_pin(self, num_pages: int) -> bool:
        """Whether a reservation of `num_pages` more pages stays within `max_pinned_blocks`."""
        return self.routing.may_pin(num_pages)

    def pin_prefix(self, tokens: Sequence[int], namespace: str) -> TreeNode | None:
        """Lock the cached prefix of `tokens` (a Route reservation); None when nothing is cached.
        The caller checks `may_pin` first (a journal replay does not: it repeats a decision)."""
        match = self.tree.match_prefix(tokens, namespace)
        if not match.num_tokens:
            return None
        self.tree.inc_lock_ref(match.last_node)
        return match.last_node

    def add_routed(self, entry: RoutedRequest) -> None:
        """Remember a request routed here (its pin, if any, is already locked)."""
        routing = self.routing
        self._unlock(routing.routed.add(entry))
        if routing.journal is not None:
            routing.journal.routed(self.pool_id, entry)

    def expire_routed(self, now: float) -> None:
        """End routed requests and reservations whose time has come."""
        routed, journal = self.routing.routed, self.routing.journal
        before = (len(routed), routed.num_pins)
        self._unlock(routed.expire(now))
        if journal is not None and (len(routed), routed.num_pins) != before:
            journal.routed_expired(self.pool_id, now)

    def drop_routed(self) -> None:
        """Forget every routed request and reservation (their pins unlocked)."""
        self._unlock(self.routing.routed.drop_all())

    # ------------------------------------------------------------------ durability

    def finished_ids(self) -> list[str]:
        """Ids of recently finished or released requests, oldest first (for snapshots)."""
        return list(self._finished_ids)

    def restore_finished_ids(self, request_ids: Iterable[str]) -> None:
        """Set the recently-finished ids (snapshot restore)."""
        self._finished_ids = OrderedDict.fromkeys(request_ids)

    # ------------------------------------------------------------------ queries

    def match(self, token_ids: Sequence[int], namespace: str = "") -> MatchInfo:
        """Read-only longest cached page-aligned prefix: no lock, no split, no LRU touch; and the
        pages after it the lower tiers hold."""
        result = self.tree.peek_prefix(token_ids, namespace)
        host = disk = 0
        if self.tiers is not None:
            host, disk = self.tiers.peek(encode_tokens(token_ids), namespace, result.num_tokens // self.block_size)
        return MatchInfo(result.num_tokens, result.block_ids, host * self.block_size, disk * self.block_size)

    def stats(self, lease_remaining_seconds: float = 0.0) -> PoolStats:
        tree = self.tree
        return PoolStats(
            pool_id=self.pool_id,
            worker_id=self.worker_id,
            epoch=self.epoch,
            model_fingerprint=self.model_fingerprint,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            num_free_blocks=self.allocator.num_free_blocks,
            num_cached_blocks=tree.total_size,
            num_locked_blocks=tree.protected_size,
            num_evictable_blocks=tree.evictable_size,
            num_private_blocks=self.num_private_blocks,
            num_running_requests=len(self.requests),
            queried_tokens=self.queried_tokens,
            hit_tokens=self.hit_tokens,
            num_evicted_blocks=self.num_evicted_blocks,
            num_admitted=self.num_admitted,
            num_finished=self.num_finished,
            num_released=self.num_released,
            lease_remaining_seconds=lease_remaining_seconds,
            serving_addr=self.serving_addr,
            load=self.load,
            num_reservations=self.routing.routed.num_pins,
            num_remembered_evicted_pages=len(self.evicted_pages),
            restored=self.attach.restored,
            num_restored_cached_blocks=self.attach.num_restored_cached_blocks,
            num_lookahead_blocks=sum(r.num_lookahead_blocks(self.block_size) for r in self.requests.values()),
            host_tier=self.tiers.host.stats() if self.tiers is not None and self.tiers.host is not None else None,
            disk_tier=self.tiers.disk.stats() if self.tiers is not None and self.tiers.disk is not None else None,
            offload_policy=self.tier_spec.offload_policy if self.tiers is not None else "",
            pulls=self.pulls.stats(),
        )

    def check_integrity(self) -> None:
        """Assert every accounting invariant; raises IntegrityError on the first violation."""
        if self.tiers is not None:
            self.tiers.check_integrity()
        self.allocator.check_integrity()
        tree_blocks = self.tree.check_integrity()
        free = set(self.allocator.free_block_ids())
        private: list[int] = []
        sharers: dict[int, int] = {}
        for req in self.requests.values():
            cached = req.num_cached_pages
            shared = req.block_table[:cached]
            private.extend(req.block_table[cached:])
            for b in shared:
                sharers[b] = sharers.get(b, 0) + 1
            if cached:
                node = req.last_node
                if node is None or not node.in_tree or node.lock_ref <= 0:
                    raise IntegrityError(f"request {quote_id(req.request_id)}: its cached path is not locked")
                peek = self.tree.peek_prefix(req.cached_key(self.block_size), req.namespace)
                if peek.block_ids != shared:
                    raise IntegrityError(f"request {quote_id(req.request_id)}: cached pages differ from the tree")
        tree_set, private_set = set(tree_blocks), set(private)
        if len(private_set) != len(private):
            raise IntegrityError("a private block is held twice")
        if tree_set & private_set or free & tree_set or free & private_set:
            raise IntegrityError("a block is in two places (free / tree / private)")
        if len(free) + len(tree_set) + len(private_set) != self.num_blocks:
            raise IntegrityError(
                f"free {len(free)} + tree {len(tree_set)} + private {len(private_set)} != {self.num_blocks}"
            )
        if len(private) != self.num_private_blocks:
            raise IntegrityError(f"private counter {self.num_private_blocks} != {len(private)}")
        if not set(sharers) <= tree_set:
            raise IntegrityError("a request shares a block the tree does not own")
        refcount = self.allocator.refcount
        for b in private:
            if refcount(b) != 1:
                raise IntegrityError(f"private block {b} has refcount {refcount(b)}")
        for b in tree_blocks:
            if refcount(b) != 1 + sharers.get(b, 0):
                raise IntegrityError(f"cached block {b} has refcount {refcount(b)}")
