"""Pool: committing a running request's computed pages (SGLang's cache_unfinished_req).

Every pool here is a CheckedPool: check_integrity() runs after every call, failed or not.
"""

from __future__ import annotations

from cache_service.events import BlockStored, EventLog
from cache_service.schema import Admit, Commit, Extend, Finish, StepInput


def admit(pool, rid, tokens):
    (result,) = pool.step(StepInput(admits=[Admit(rid, tokens)])).admits
    assert result.admitted
    return result


def commit(pool, rid, computed):
    (result,) = pool.step(StepInput(commits=[Commit(rid, computed)])).commits
    return result


PROMPT = list(range(100, 114))  # 14 tokens, block size 4: 3 full pages + 2 tokens


def test_committed_pages_are_hits_while_the_request_runs(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    a = admit(pool, "a", PROMPT)
    result = commit(pool, "a", computed=14)
    assert result.cached_tokens == 12 and result.cached_block_ids == a.block_table[:3]
    stats = pool.stats()
    assert stats.num_cached_blocks == 3 and stats.num_locked_blocks == 3 and stats.num_private_blocks == 1
    b = admit(pool, "b", PROMPT + [7])  # a is still running
    assert b.cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]


def test_commits_in_the_same_step_as_the_admit_that_hits_them(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    admit(pool, "a", PROMPT)
    result = pool.step(StepInput(commits=[Commit("a", 8)], admits=[Admit("b", PROMPT)]))
    assert result.commits[0].cached_tokens == 8 and result.admits[0].cached_tokens == 8


def test_duplicate_pages_are_swapped_for_the_tree_copy(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    a = admit(pool, "a", PROMPT)
    b = admit(pool, "b", PROMPT)  # admitted before a committed: its own private copies
    assert b.cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    commit(pool, "a", computed=14)
    free_before = pool.stats().num_free_blocks
    result = commit(pool, "b", computed=14)
    assert result.cached_block_ids == a.block_table[:3]  # the tree's (a's) pages
    assert pool.stats().num_free_blocks == free_before + 3  # b's three duplicates went back
    assert pool.requests["b"].block_table == a.block_table[:3] + b.block_table[3:]


def test_commit_then_finish_caches_the_rest_and_frees_nothing_twice(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    a = admit(pool, "a", PROMPT)
    commit(pool, "a", computed=8)
    commit(pool, "a", computed=12)
    assert commit(pool, "a", computed=13).cached_tokens == 12  # no new full page: nothing changes
    pool.step(StepInput(extends=[Extend("a", 17)]))
    table = pool.requests["a"].block_table
    pool.step(StepInput(finishes=[Finish("a", [1, 2, 3], 17, table)]))
    stats = pool.stats()
    assert stats.num_cached_blocks == 4 and stats.num_locked_blocks == 0 and stats.num_private_blocks == 0
    assert stats.num_free_blocks == 12
    again = admit(pool, "c", PROMPT + [1, 2, 3, 9])
    assert again.cached_tokens == 16 and again.block_table[:3] == a.block_table[:3]


def test_release_after_commit_keeps_pages_cached(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    admit(pool, "a", PROMPT)
    commit(pool, "a", computed=12)
    pool.step(StepInput(releases=[Finish("a", [], 12)]))
    stats = pool.stats()
    assert stats.num_cached_blocks == 3 and stats.num_evictable_blocks == 3 and stats.num_free_blocks == 13


def test_committed_pages_are_locked_against_eviction(make_pool) -> None:
    pool = make_pool(num_blocks=6, block_size=4)
    admit(pool, "a", PROMPT)  # 4 blocks
    commit(pool, "a", computed=12)
    (c,) = pool.step(StepInput(admits=[Admit("c", list(range(500, 512)))])).admits
    assert not c.admitted  # 2 free blocks, 3 needed, a's committed pages may not be evicted
    assert pool.stats().num_cached_blocks == 3


def test_commit_publishes_a_stored_event(make_pool) -> None:
    events = EventLog()
    seen = []
    events.subscribe(seen.append)
    pool = make_pool(num_blocks=8, block_size=4, events=events)
    a = admit(pool, "a", PROMPT)
    commit(pool, "a", computed=12)
    assert [type(e.payload) for e in seen] == [BlockStored]
    assert list(seen[0].payload.block_ids) == a.block_table[:3] and list(seen[0].payload.token_ids) == PROMPT[:12]


def test_a_request_may_commit_and_extend_in_one_step(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    a = admit(pool, "a", PROMPT)
    result = pool.step(StepInput(commits=[Commit("a", 12)], extends=[Extend("a", 20)]))
    assert result.commits[0].cached_block_ids == a.block_table[:3]
    assert result.extends[0].ok and len(result.extends[0].new_block_ids) == 1
    assert pool.requests["a"].block_table == a.block_table + result.extends[0].new_block_ids


def test_decode_pages_are_committed_with_their_output_tokens(make_pool) -> None:
    pool = make_pool(num_blocks=16, block_size=4)
    prompt = list(range(100, 106))  # 6 tokens: one full page + 2
    a = admit(pool, "a", prompt)
    outputs = [7, 8, 9, 10]  # positions 6..9; KV written for 6, 7 (and the prompt)
    (ext,) = pool.step(StepInput(extends=[Extend("a", 10)], commits=[Commit("a", 8, outputs[:2])])).extends
    assert ext.ok
    b = admit(pool, "b", prompt + outputs[:2] + [1])  # another request continuing the same text
    assert b.cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    pool.step(StepInput(finishes=[Finish("a", outputs, 10), Finish("b", [], 9)]))
    assert pool.stats().num_locked_blocks == 0


def test_commit_beyond_the_sent_tokens_is_invalid(make_pool) -> None:
    import pytest

    from cache_service.errors import InvalidArgument

    pool = make_pool(num_blocks=16, block_size=4)
    admit(pool, "a", list(range(100, 106)))
    with pytest.raises(InvalidArgument, match="commit of 8 tokens"):
        pool.step(StepInput(commits=[Commit("a", 8, [1])]))  # only 7 tokens known


def test_outputs_that_contradict_committed_decode_pages_are_rejected(make_pool) -> None:
    import pytest

    from cache_service.errors import FailedPrecondition

    pool = make_pool(num_blocks=16, block_size=4)
    admit(pool, "a", list(range(100, 106)))
    pool.step(StepInput(extends=[Extend("a", 9)], commits=[Commit("a", 8, [7, 8])]))
    with pytest.raises(FailedPrecondition, match="differ from the 2 output tokens"):
        pool.step(StepInput(finishes=[Finish("a", [7, 9, 1], 9)]))
    with pytest.raises(FailedPrecondition):
        pool.step(StepInput(commits=[Commit("a", 8, [8, 8])]))
    pool.step(StepInput(finishes=[Finish("a", [7, 8, 1], 9)]))  # consistent: accepted
