"""Hypothesis stateful test: random Step batches, evictions, clears, matches, heartbeats and lease
expiry over two pools and two namespaces, against a brute-force reference model.

The model keeps, per pool, a dict of cached page-prefixes -> (block id, last access tick) and
the live requests' block tables. Its eviction is the obvious O(n^2) LRU over unlocked leaf
pages; the tree must evict exactly the same pages and hand out only blocks the model
considers free. check_integrity() runs after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cache_service.errors import FailedPrecondition, InvalidArgument, NotFound
from cache_service.pool import Pool
from cache_service.pool_registry import PoolRegistry
from cache_service.schema import Admit, Commit, Extend, Finish, StepInput
from common.token_bytes import encode_tokens, unpack_tokens

BS = 2
NUM_BLOCKS = 12
LEASE = 20.0
VOCAB = 3
WORKERS = ("w0", "w1")
NAMESPACES = ("", "t")

# Prompts often continue one of two shared stems, so prefixes are shared and pages duplicated.
STEMS = ((0, 1, 2, 0, 1, 2, 0, 1, 2), (2, 2, 1, 1, 0, 0, 2, 2, 1))
stem_prompts = st.builds(
    lambda stem, n, tail: list(stem[:n]) + tail,
    st.sampled_from(STEMS),
    st.integers(1, 9),
    st.lists(st.integers(0, VOCAB - 1), max_size=2),
)
tokens_st = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7), stem_prompts, stem_prompts)
Key = tuple[str, tuple[int, ...]]


def pages(n_tokens: int) -> int:
    return -(-n_tokens // BS)


@dataclass
class ModelRequest:
    namespace: str
    prompt: tuple[int, ...]
    num_cached_pages: int
    table: list[int]
    outputs: tuple[int, ...] = ()  # output tokens sent by commits so far

    def key(self, num_pages: int) -> tuple[int, ...]:
        return (self.prompt + self.outputs)[: num_pages * BS]


@dataclass
class ModelPool:
    epoch: int
    deadline: float
    cached: dict[Key, list[int]] = field(default_factory=dict)  # key -> [block, tick]
    live: dict[str, ModelRequest] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    tick: int = 0

    def locked(self) -> set[Key]:
        return {
            (r.namespace, r.key(i)) for r in self.live.values() for i in range(1, r.num_cached_pages + 1)
        }

    def private(self) -> list[int]:
        return [b for r in self.live.values() for b in r.table[r.num_cached_pages :]]

    def free_blocks(self) -> set[int]:
        used = {v[0] for v in self.cached.values()} | set(self.private())
        return set(range(NUM_BLOCKS)) - used

    def evictable(self) -> list[Key]:
        locked = self.locked()
        return [k for k in self.cached if k not in locked]

    def evict(self, n: int) -> int:
        for _ in range(n):
            parents = {(ns, key[:-BS]) for ns, key in self.cached}
            leaves = [k for k in self.evictable() if k not in parents]
            del self.cached[min(leaves, key=lambda k: self.cached[k][1])]
        return n

    def make_free(self, n: int) -> tuple[bool, int]:
        short = n - len(self.free_blocks())
        if short <= 0:
            return True, 0
        if short > len(self.evictable()):
            return False, 0
        return True, self.evict(short)

    def longest(self, ns: str, tokens: tuple[int, ...]) -> int:
        k = 0
        while (k + 1) * BS <= len(tokens) and (ns, tokens[: (k + 1) * BS]) in self.cached:
            k += 1
        return k


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.registry = PoolRegistry(lease_seconds=LEASE, clock=lambda: self.now)
        self.model: dict[str, ModelPool | None] = {}
        self.next_id = 0
        for w in WORKERS:
            self._register(w)

    def _register(self, w: str) -> None:
        pool = self.registry.register(w, NUM_BLOCKS, BS, vocab_size=VOCAB)
        self.model[w] = ModelPool(pool.epoch, self.now + LEASE)

    def _get(self, w: str) -> tuple[Pool, ModelPool] | None:
        """The pool for a pool RPC; an expired one must refuse, then gets re-registered."""
        m = self.model[w]
        if m is None or self.now >= m.deadline:
            epoch = m.epoch if m is not None else 0
            with pytest.raises(FailedPrecondition):
                self.registry.get(w, epoch)
            self._register(w)
            return None
        pool = self.registry.get(w, m.epoch)
        m.deadline = self.now + LEASE
        return pool, m

    # ------------------------------------------------------------------ rules

    # Step is what is under test: two identical rules make it twice as likely as the others.
    @rule(data=st.data(), w=st.sampled_from(WORKERS))
    def step(self, data: st.DataObject, w: str) -> None:
        self._step(data, w)

    @rule(data=st.data(), w=st.sampled_from(WORKERS))
    def another_step(self, data: st.DataObject, w: str) -> None:
        self._step(data, w)

    def _step(self, data: st.DataObject, w: str) -> None:
        got = self._get(w)
        if got is None:
            return
        pool, m = got
        live = sorted(m.live)
        enders = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=3)) if live else []
        releases, finishes = [], []
        for rid in enders:
            req = m.live[rid]
            out = list(req.outputs) + data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
            limit = min(len(req.prompt) + len(out), len(req.table) * BS)
            computed = data.draw(st.one_of(st.just(limit), st.integers(0, limit)))
            item = Finish(rid, out, computed)
            (releases if data.draw(st.booleans()) else finishes).append(item)
        rest = [r for r in live if r not in enders]
        extends = [
            Extend(rid, min(NUM_BLOCKS * BS, len(m.live[rid].table) * BS + data.draw(st.integers(-BS, 2 * BS))))
            for rid in (data.draw(st.lists(st.sampled_from(rest), unique=True, max_size=2)) if rest else [])
        ]
        commits = []
        for rid in (data.draw(st.lists(st.sampled_from(rest), unique=True, max_size=2)) if rest else []):
            req = m.live[rid]
            out = list(req.outputs) + data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
            limit = min(len(req.prompt) + len(out), len(req.table) * BS)
            commits.append(Commit(rid, data.draw(st.one_of(st.just(limit), st.integers(0, limit))), out))
        admits = []
        for _ in range(data.draw(st.integers(0, 3))):
            self.next_id += 1
            tokens = data.draw(tokens_st)
            if data.draw(st.booleans()):  # as convert.step_input hands Admit.packed_token_ids over
                tokens = unpack_tokens(encode_tokens(tokens))
            admits.append(
                Admit(f"r{self.next_id}", tokens, data.draw(st.sampled_from(NAMESPACES)), data.draw(st.integers(0, 2)))
            )
        result = pool.step(StepInput(releases, finishes, extends, admits, commits))

        evicted = 0
        for item in releases + finishes:
            self._model_finish(m, item)
        assert len(result.commits) == len(commits)
        for item, got_commit in zip(commits, result.commits, strict=True):
            self._model_commit(m, item)
            req = m.live[item.request_id]
            assert got_commit.cached_tokens == req.num_cached_pages * BS
            assert got_commit.cached_block_ids == req.table[: req.num_cached_pages]
        assert len(result.extends) == len(extends)
        if len(extends) > 1:  # the pool evicts for all of a step's extends at once, if they all fit
            _, n = m.make_free(sum(max(0, pages(e.num_tokens) - len(m.live[e.request_id].table)) for e in extends))
            evicted += n
        for item, got_ext in zip(extends, result.extends, strict=True):
            req = m.live[item.request_id]
            need = pages(item.num_tokens) - len(req.table)
            if need <= 0:
                assert got_ext.ok and got_ext.new_block_ids == []
                continue
            ok, n = m.make_free(need)
            evicted += n
            assert got_ext.ok == ok
            event(f"extend: {'ok' if ok else 'no space'}{' + evict' if n else ''}")
            if ok:
                self._check_fresh(m, got_ext.new_block_ids, need)
                req.table.extend(got_ext.new_block_ids)
        full = False
        for item, got_adm in zip(admits, result.admits, strict=True):
            if full:
                assert not got_adm.admitted
                continue
            prompt = tuple(item.token_ids)
            k = m.longest(item.namespace, prompt[: (len(prompt) - 1) // BS * BS])
            m.tick += 1
            for i in range(1, k + 1):
                m.cached[(item.namespace, prompt[: i * BS])][1] = m.tick
            shared = [m.cached[(item.namespace, prompt[: i * BS])][0] for i in range(1, k + 1)]
            req = ModelRequest(item.namespace, prompt, k, list(shared))
            m.live[item.request_id] = req  # its lock counts while making room
            need = pages(len(prompt) + item.num_lookahead_tokens) - k
            ok, n = m.make_free(need)
            evicted += n
            assert got_adm.admitted == ok
            event(f"admit: {'no space' if not ok else 'hit' if k else 'miss'}{' + evict' if n else ''}")
            if not ok:
                del m.live[item.request_id]
                full = True
                continue
            assert got_adm.cached_tokens == k * BS and got_adm.block_table[:k] == shared
            self._check_fresh(m, got_adm.block_table[k:], need)
            req.table = list(got_adm.block_table)
            m.done.discard(item.request_id)
        assert result.num_evicted_blocks == evicted
        assert result.num_free_blocks == len(m.free_blocks())

    def _check_fresh(self, m: ModelPool, fresh: list[int], need: int) -> None:
        assert len(fresh) == need and len(set(fresh)) == need
        assert set(fresh) <= m.free_blocks()

    def _model_finish(self, m: ModelPool, item: Finish) -> None:
        req = m.live.pop(item.request_id)
        tokens = req.prompt + tuple(item.output_token_ids)
        full = item.num_computed_tokens // BS
        if full <= req.num_cached_pages and req.num_cached_pages:  # the finish refreshes its path
            m.tick += 1
            for i in range(1, req.num_cached_pages + 1):
                m.cached[(req.namespace, req.key(i))][1] = m.tick
        if full > req.num_cached_pages:
            m.tick += 1
            for i in range(full):
                key = (req.namespace, tokens[: (i + 1) * BS])
                if key in m.cached:
                    m.cached[key][1] = m.tick
                    if i < req.num_cached_pages:
                        assert m.cached[key][0] == req.table[i]
                else:
                    m.cached[key] = [req.table[i], m.tick]
        m.done.add(item.request_id)

    def _model_commit(self, m: ModelPool, item: Commit) -> None:
        req = m.live[item.request_id]
        full = item.num_computed_tokens // BS
        if full <= req.num_cached_pages:
            event("commit: nothing new")
            return
        m.tick += 1
        dups = 0
        tokens = req.prompt + tuple(item.output_token_ids)
        for i in range(full):
            key = (req.namespace, tokens[: (i + 1) * BS])
            if key in m.cached:
                m.cached[key][1] = m.tick
                if i >= req.num_cached_pages:  # cached by another request first: share its copy
                    req.table[i] = m.cached[key][0]
                    dups += 1
                else:
                    assert m.cached[key][0] == req.table[i]
            else:
                m.cached[key] = [req.table[i], m.tick]
        req.num_cached_pages = full
        if full * BS > len(req.prompt):
            req.outputs = tokens[len(req.prompt) : full * BS]
            event("commit: decode pages")
        event(f"commit: {'duplicates swapped' if dups else 'new pages'}")

    @rule(w=st.sampled_from(WORKERS), data=st.data())
    def bad_step(self, w: str, data: st.DataObject) -> None:
        got = self._get(w)
        if got is None:
            return
        pool, m = got
        choices = [
            (InvalidArgument, StepInput(admits=[Admit("dup", [1]), Admit("dup", [2])])),
            (InvalidArgument, StepInput(admits=[Admit("x", [])])),
            (InvalidArgument, StepInput(admits=[Admit("x", [VOCAB])])),
            (NotFound, StepInput(finishes=[Finish("never-seen")])),
        ]
        if m.done - set(m.live):
            choices.append((FailedPrecondition, StepInput(finishes=[Finish(sorted(m.done - set(m.live))[0])])))
        if m.live:
            rid = sorted(m.live)[0]
            wrong = [b + 1 for b in m.live[rid].table]
            choices.append((FailedPrecondition, StepInput(finishes=[Finish(rid, [], 0, wrong)])))
        error, step = data.draw(st.sampled_from(choices))
        step.admits.insert(0, Admit("innocent", [0, 1, 2]))  # must not be applied
        with pytest.raises(error):
            pool.step(step)

    @rule(w=st.sampled_from(WORKERS), n=st.one_of(st.none(), st.integers(0, NUM_BLOCKS)))
    def evict_or_clear(self, w: str, n: int | None) -> None:
        got = self._get(w)
        if got is None:
            return
        pool, m = got
        if n is None:
            result = pool.clear()
            assert result.num_evicted_blocks == m.evict(len(m.evictable()))
            assert result.num_locked_blocks == len(m.cached)
        else:
            expected = min(n, len(m.evictable()))
            assert pool.evict(n) == expected
            m.evict(expected)

    @rule(w=st.sampled_from(WORKERS), tokens=tokens_st, ns=st.sampled_from(NAMESPACES))
    def match(self, w: str, tokens: list[int], ns: str) -> None:
        m = self.model[w]
        pool = self.registry.pools.get(w)
        if m is None or pool is None:
            return
        k = m.longest(ns, tuple(tokens))
        found = pool.match(tokens, ns)
        assert found.matched_tokens == k * BS
        assert found.block_ids == [m.cached[(ns, tuple(tokens[: i * BS]))][0] for i in range(1, k + 1)]

    @rule(dt=st.sampled_from([1.0, 2.0, 3.0, 21.0]), w=st.sampled_from((None, *WORKERS)))
    def time_passes(self, dt: float, w: str | None) -> None:
        if w is not None:
            self._get(w)  # a heartbeat
        self.now += dt
        expected = sorted(w for w, m in self.model.items() if m is not None and self.now >= m.deadline)
        assert sorted(self.registry.expire_leases()) == expected
        for w in expected:
            event("lease expired")
            self.model[w] = None

    @rule(w=st.sampled_from(WORKERS))
    def reregister(self, w: str) -> None:
        old = self.model[w]
        self._register(w)
        if old is not None:
            with pytest.raises(FailedPrecondition):
                self.registry.get(w, old.epoch)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def matches_model(self) -> None:
        self.registry.check_integrity()
        for w, m in self.model.items():
            if m is None:
                assert w not in self.registry.pools
                continue
            pool = self.registry.pools[w]
            assert {(ns, key): b for ns, key, b in pool.tree.iter_pages()} == {
                k: v[0] for k, v in m.cached.items()
            }
            assert set(pool.requests) == set(m.live)
            for rid, req in m.live.items():
                assert pool.requests[rid].block_table == req.table
            stats = pool.stats()
            locked = m.locked()
            assert stats.num_free_blocks == len(m.free_blocks())
            assert stats.num_locked_blocks == len(locked)
            assert stats.num_evictable_blocks == len(m.cached) - len(locked)
            assert stats.num_private_blocks == len(m.private())
            assert stats.num_free_blocks + stats.num_cached_blocks + stats.num_private_blocks == NUM_BLOCKS


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
