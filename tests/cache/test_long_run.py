"""Long seeded runs of the tree and the pool, past many heap compactions.

Short hypothesis runs never push the eviction heap past its compaction threshold, so these
drive a chat-like workload (conversations that grow turn by turn, shared system prompts, fresh
one-off prompts) for tens of thousands of operations and check after every eviction that it
freed min(asked, evictable) pages in LRU order, and after every pool Step that the accounting
is whole and no lock outlives its requests.
"""

from __future__ import annotations

import random

from cache_service.pool import Pool
from cache_service.radix_tree import RadixTree, TreeNode
from cache_service.schema import Admit, Commit, Extend, Finish, StepInput

BS = 4


def unlocked_leaf_stamps(tree: RadixTree) -> dict[int, int]:
    """id(node) -> last_access of every unlocked leaf."""
    return {id(n): n.last_access for n in tree.iter_nodes() if not n.children and n.lock_ref == 0}


def block_stamps(tree: RadixTree) -> dict[int, int]:
    return {b: n.last_access for n in tree.iter_nodes() for b in n.value}


def checked_evict(tree: RadixTree, num_pages: int) -> int:
    """evict() plus the checks the issue asks for; returns the pages freed."""
    before = block_stamps(tree)
    evictable = tree.evictable_size
    evicted = tree.evict(num_pages)
    freed = [b for e in evicted for b in e.block_ids]
    assert len(freed) == min(num_pages, evictable), "evict freed fewer pages than were evictable"
    kept = unlocked_leaf_stamps(tree)
    if freed and kept:
        newest_freed = max(before[b] for b in freed)
        assert newest_freed <= min(kept.values()), "LRU violated: a newer page went before an older leaf"
    tree.check_integrity(check_hashes=False)
    return len(freed)


def chat_prompts(rng: random.Random, num_conversations: int):
    """Yields (conversation id, prompt tokens) forever: growing chats over a few system prompts."""
    systems = [[rng.randrange(1000) for _ in range(rng.choice((8, 16, 24)))] for _ in range(4)]
    chats = [list(rng.choice(systems)) for _ in range(num_conversations)]
    while True:
        c = rng.randrange(num_conversations)
        if rng.random() < 0.1:  # a fresh one-off prompt
            yield -1, [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
            continue
        chats[c] += [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
        if len(chats[c]) > 200:  # the conversation ends, a new one starts
            chats[c] = list(rng.choice(systems))
        yield c, list(chats[c])


def test_tree_long_run_evicts_exactly_and_in_lru_order_across_compactions() -> None:
    rng = random.Random(8)
    tree = RadixTree(BS, heap_slack=16)  # compact often: the defect lived in a compaction mid-evict
    capacity = 1500  # pages the "pool" holds; when over, evictions trim it to half in one call
    next_block = 0
    locked: list[TreeNode] = []
    compactions = compactions_in_evict = 0
    evicting = False
    original = tree._compact_heap

    def counting_compact() -> None:
        nonlocal compactions, compactions_in_evict
        compactions += 1
        compactions_in_evict += evicting
        original()

    tree._compact_heap = counting_compact
    prompts = chat_prompts(rng, 24)
    for _ in range(50_000):
        _, prompt = next(prompts)
        r = rng.random()
        if r < 0.8:
            match = tree.match_prefix(prompt)
            if rng.random() < 0.3:
                tree.inc_lock_ref(match.last_node)
                locked.append(match.last_node)
        elif r < 0.95:
            n = len(prompt) // BS * BS
            tree.insert(prompt[:n], list(range(next_block, next_block + n // BS)))
            next_block += n // BS
        elif locked:
            tree.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        if len(locked) > 12:
            tree.dec_lock_ref(locked.pop(0))
        if tree.total_size > capacity:
            evicting = True
            checked_evict(tree, tree.total_size - capacity // 2 + rng.randint(0, 8))
            evicting = False
    tree.check_integrity()
    for node in locked:
        tree.dec_lock_ref(node)
    assert tree.protected_size == 0
    checked_evict(tree, tree.total_size + 1)
    assert tree.total_size == 0 and tree.num_nodes == 0
    assert compactions_in_evict >= 10, f"the run must compact the heap inside evict(), saw {compactions_in_evict}"


def test_pool_long_run_through_step_keeps_accounting_and_locks_whole() -> None:
    rng = random.Random(80)
    pool = Pool("p", 1, num_blocks=96, block_size=BS, vocab_size=1000)
    pool.tree.heap_slack = 16
    prompts = chat_prompts(rng, 16)
    running: dict[str, tuple[list[int], list[int], int]] = {}  # id -> (prompt, outputs, capacity tokens)
    next_id = 0
    no_space = 0
    for _ in range(6_000):
        step = StepInput()
        for rid in list(running):
            prompt, outputs, _cap = running[rid]
            if rng.random() < 0.15:
                del running[rid]
                computed = len(prompt) + len(outputs) - rng.choice((0, 0, 1))
                (step.releases if rng.random() < 0.2 else step.finishes).append(Finish(rid, outputs, computed))
        for rid, (prompt, outputs, cap) in running.items():
            outputs.append(rng.randrange(1000))
            total = len(prompt) + len(outputs)
            if total > cap:
                step.extends.append(Extend(rid, total))
                computed = total - 1  # the newest token's KV is written by the coming forward pass
                step.commits.append(Commit(rid, computed, list(outputs)))
        for _ in range(rng.choice((0, 1, 1, 2))):
            next_id += 1
            _, prompt = next(prompts)
            step.admits.append(Admit(f"r{next_id}", prompt, "", 1))
        result = pool.step(step)
        for ext in result.extends:
            prompt, outputs, cap = running[ext.request_id]
            if ext.ok:
                running[ext.request_id] = (prompt, outputs, cap + len(ext.new_block_ids) * BS)
            else:  # preempted: release it, keeping what it computed
                del running[ext.request_id]
                pool.step(StepInput(releases=[Finish(ext.request_id, outputs[:-1], len(prompt) + len(outputs) - 2)]))
                pool.check_integrity()
        for item, adm in zip(step.admits, result.admits, strict=True):
            if adm.admitted:
                running[item.request_id] = (list(item.token_ids), [], len(adm.block_table) * BS)
            else:
                no_space += 1
        pool.check_integrity()
        stats = pool.stats()
        assert stats.num_free_blocks + stats.num_cached_blocks + stats.num_private_blocks == stats.num_blocks
        assert stats.num_running_requests == len(running)
    pool.step(StepInput(finishes=[Finish(rid, out, len(p) + len(out) - 1) for rid, (p, out, _c) in running.items()]))
    pool.check_integrity()
    stats = pool.stats()
    assert stats.num_locked_blocks == 0 and stats.num_private_blocks == 0 and stats.num_running_requests == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
    assert stats.num_evicted_blocks > 1000 and no_space > 0, "the run must evict a lot and fill the pool"
