"""BlockManager unit tests: reference counts, prefix hits (and the cap that
keeps the last prompt token computed), eviction order, failed allocations and
reset. The random-operation property lives in test_block_manager_machine.py."""

from __future__ import annotations

import pytest

from tests.scheduling.sim import make_request, snapshot
from tinyengine.scheduling.block_manager import BlockManager, hash_block
from tinyengine.scheduling.request import Request


def req(request_id: str, tokens: list[int]) -> Request:
    return make_request(request_id, tokens, max_tokens=4)


def compute(bm: BlockManager, request: Request, num_tokens: int | None = None) -> None:
    """Pretend a forward pass computed the request's tokens, then index them."""
    request.num_computed_tokens = request.num_tokens if num_tokens is None else num_tokens
    bm.cache_full_blocks(request)


def admit(bm: BlockManager, request: Request) -> list[int]:
    """Admit like the scheduler: take the prefix hits, allocate the rest."""
    hits = bm.get_computed_blocks(request)
    cached = len(hits) * bm.block_size
    assert bm.allocate_slots(request, request.num_tokens - cached, hits)
    request.num_computed_tokens = cached
    return hits


# --- allocation and reference counts ---


def test_block_views_read_the_pool() -> None:
    """`blocks[i]` views block i's count and hash in the pool's lists: read
    only, every id in order, negative ids from the end, none past it."""
    from tinyengine.scheduling.block_pool import BlockPool

    pool = BlockPool(4)
    block_id = pool.pop_free()
    pool.index(block_id, b"h")
    view = pool.blocks[block_id]
    assert (view.ref_count, view.block_hash) == (1, b"h")
    pool.release(block_id)
    assert (view.ref_count, view.block_hash) == (0, b"h")  # a view, not a copy
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3] and len(pool.blocks) == 4
    assert pool.blocks[-1].block_id == 3 and pool.blocks[-1] == pool.blocks[3]
    assert [b.block_id for b in pool.blocks[1:3]] == [1, 2]
    with pytest.raises(IndexError):
        pool.blocks[4]
    with pytest.raises(AttributeError):
        view.ref_count = 5  # the pool's bookkeeping changes only through the pool


def test_allocate_and_free_ref_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))
    assert bm.allocate_slots(a, 10)
    assert len(a.block_ids) == 3 and len(set(a.block_ids)) == 3
    assert all(bm.blocks[b].ref_count == 1 for b in a.block_ids)
    assert bm.num_free_blocks == 5
    bm.check_invariants([a])

    # Growing by tokens that fit the last block allocates nothing.
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 2)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 5
    # One more token spills into a 4th block.
    assert bm.allocate_slots(a, 3)
    assert len(a.block_ids) == 4 and bm.num_free_blocks == 4
    bm.check_invariants([a])

    held = list(a.block_ids)
    bm.free(a)
    assert a.block_ids == []
    assert all(bm.blocks[b].ref_count == 0 for b in held)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_shared_prefix_block_ref_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    compute(bm, a)
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    hits = admit(bm, b)
    assert hits == a.block_ids[:2]
    assert [bm.blocks[x].ref_count for x in hits] == [2, 2]
    assert b.block_ids[2] != a.block_ids[2]
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in hits] == [1, 1]
    assert all(x not in bm.free_queue for x in hits)
    bm.check_invariants([b])
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8


def test_double_free_is_caught() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    assert bm.allocate_slots(a, 3)
    stale = list(a.block_ids)
    bm.free(a)
    a.block_ids = stale
    with pytest.raises(AssertionError, match="double free"):
        bm.free(a)


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=0, block_size=4)


# --- prefix hits ---


def test_prefix_hit_identical_prefix_and_miss_for_different_one() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req("a", list(range(1, 14)))  # 3 full blocks + 1 token
    admit(bm, a)
    compute(bm, a)
    assert bm.get_computed_blocks(req("same", list(range(1, 14)))) == a.block_ids[:3]
    assert bm.get_computed_blocks(req("longer", list(range(1, 20)))) == a.block_ids[:3]
    # Differs in the very first token: nothing.
    assert bm.get_computed_blocks(req("diff", [0] + list(range(2, 14)))) == []
    # Differs only in the third block: the first two blocks hit.
    late = list(range(1, 14))
    late[9] = 99
    assert bm.get_computed_blocks(req("late", late)) == a.block_ids[:2]
    # Differs in the last token of the first block: nothing.
    edge = list(range(1, 14))
    edge[3] = 99
    assert bm.get_computed_blocks(req("edge", edge)) == []


def test_same_block_content_different_parent_is_no_hit() -> None:
    assert hash_block(None, [5, 6]) != hash_block(hash_block(None, [1, 2]), [5, 6])
    assert hash_block(hash_block(None, [1, 2]), [5, 6]) != hash_block(
        hash_block(None, [3, 4]), [5, 6]
    )
    bm = BlockManager(num_blocks=16, block_size=2)
    a = req("a", [1, 2, 5, 6, 7])
    admit(bm, a)
    compute(bm, a)
    c = req("c", [3, 4, 5, 6, 7])
    assert bm.get_computed_blocks(c) == []
    # The second block's content is identical, but its chained hash is not.
    assert a.block_hashes[1] in bm.cached
    assert c.block_hashes[1] not in bm.cached
    # And a block moved to another position does not hit either.
    d = req("d", [5, 6, 1, 2, 7])
    assert bm.get_computed_blocks(d) == []


def test_prompt_is_never_served_entirely_from_cache() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req("a", list(range(8)))  # exactly 2 full blocks
    admit(bm, a)
    compute(bm, a)
    assert len(bm.cached) == 2
    # Identical prompt: at most (8 - 1) // 4 = 1 block, so the last token runs.
    assert bm.get_computed_blocks(req("same", list(range(8)))) == a.block_ids[:1]
    assert bm.get_computed_blocks(req("plus1", list(range(9)))) == a.block_ids[:2]
    assert bm.get_computed_blocks(req("short", list(range(4)))) == []
    assert bm.get_computed_blocks(req("one", [0])) == []
    for n in range(1, 13):
        hits = bm.get_computed_blocks(req(f"n{n}", list(range(n))))
        assert len(hits) <= (n - 1) // 4


def test_only_full_computed_blocks_are_cached() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req("a", list(range(10)))
    admit(bm, a)
    compute(bm, a, 3)
    assert bm.cached == {}
    compute(bm, a, 7)
    assert list(bm.cached.values()) == a.block_ids[:1]
    compute(bm, a, 10)
    assert list(bm.cached.values()) == a.block_ids[:2]
    bm.check_invariants([a])


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    assert bm.cached == {}
    assert bm.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == []


def test_duplicate_content_keeps_first_indexed_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3])
    b = req("b", [1, 2, 4])
    admit(bm, a)
    admit(bm, b)  # prefilled in the same step: no hit yet
    assert set(a.block_ids).isdisjoint(b.block_ids)
    compute(bm, a)
    compute(bm, b)
    assert bm.cached == {a.block_hashes[0]: a.block_ids[0]}
    assert bm.blocks[b.block_ids[0]].block_hash is None
    bm.check_invariants([a, b])


# --- the free queue and eviction ---


def test_freed_cached_blocks_stay_findable_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    admit(bm, a)  # blocks 0, 1, 2
    compute(bm, a)  # caches blocks 0 and 1
    b0, b1, b2 = a.block_ids
    bm.free(a)
    assert bm.num_free_blocks == 4
    # Uncached blocks first (the one just freed at the very front), then the
    # cached ones in least-recently-freed order: a's tail before its head.
    assert list(bm.free_queue) == [b2, 3, b1, b0]
    assert bm.get_computed_blocks(req("again", [1, 2, 3, 4, 9])) == [b0, b1]

    # A new request needing 3 blocks evicts the two uncached ones and b1.
    c = req("c", [7, 7, 7, 7, 7, 7])
    assert bm.allocate_slots(c, 6)
    assert c.block_ids == [b2, 3, b1]
    assert bm.blocks[b1].block_hash is None
    assert list(bm.cached.values()) == [b0]
    # b0 is still findable; b1 was evicted so the hit stops there.
    assert bm.get_computed_blocks(req("again", [1, 2, 3, 4, 9])) == [b0]
    bm.check_invariants([c])


def test_eviction_is_lru_among_cached_blocks() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    old = req("old", [1, 1, 0])
    new = req("new", [2, 2, 0])
    admit(bm, old)
    admit(bm, new)
    compute(bm, old)
    compute(bm, new)
    bm.free(old)  # old's cached block is freed first: least recently used
    bm.free(new)
    old_block, new_block = old.block_hashes[0], new.block_hashes[0]
    assert bm.cached[old_block] != bm.cached[new_block]
    # 4 uncached free blocks go first, then old's block, then new's.
    x = req("x", [9] * 10)
    assert bm.allocate_slots(x, 8)
    assert old_block in bm.cached and new_block in bm.cached
    assert bm.allocate_slots(x, 10)  # x has 0 computed: 10 tokens = 5 blocks
    assert old_block not in bm.cached and new_block in bm.cached
    bm.check_invariants([x])


def test_prefix_hit_touch_refreshes_lru_position() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 1, 0])
    b = req("b", [2, 2, 0])
    admit(bm, a)
    compute(bm, a)
    bm.free(a)
    admit(bm, b)
    compute(bm, b)
    bm.free(b)
    ha, hb = a.block_hashes[0], b.block_hashes[0]
    # Touch a's block (a prefix hit), then free it again: now b's is older.
    c = req("c", [1, 1, 5])
    assert admit(bm, c) == [bm.cached[ha]]
    bm.free(c)
    x = req("x", [9] * 6)
    assert bm.allocate_slots(x, 6)  # 2 uncached free + the LRU cached block
    assert ha in bm.cached and hb not in bm.cached
    bm.check_invariants([x])


def test_allocate_slots_short_of_blocks_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    b = req("b", [8, 8, 8, 8, 8, 8, 8, 8, 8])  # needs 5 blocks
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(b, 9)
    assert snapshot(bm, a, b) == before
    # A running request that would need one more block than is free.
    assert bm.allocate_slots(b, 2)
    a.num_computed_tokens = 5
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(a, 4)  # 9 tokens -> 5 blocks, holds 3, 0 free
    assert snapshot(bm, a, b) == before
    bm.check_invariants([a, b])


def test_allocate_slots_counts_free_prefix_hits_against_the_free_queue() -> None:
    """A hit on a *free* cached block takes that block out of the free queue,
    so it cannot also be handed out as a new block."""
    bm = BlockManager(num_blocks=3, block_size=2)
    a = req("a", [1, 2, 3])
    admit(bm, a)
    compute(bm, a)
    bm.free(a)  # all 3 free; one of them is cached [1, 2]
    b = req("b", [1, 2, 3, 4, 5, 6, 7])  # hit 1 block, needs 3 new: 4 > 3
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 1
    before = snapshot(bm, b)
    assert not bm.allocate_slots(b, 5, hits)
    assert snapshot(bm, b) == before
    # With one token fewer it fits exactly: 1 hit + 2 new.
    c = req("c", [1, 2, 3, 4, 5, 6])
    hits = bm.get_computed_blocks(c)
    assert bm.allocate_slots(c, 4, hits)
    assert c.block_ids[0] == hits[0] and len(set(c.block_ids)) == 3
    assert bm.num_free_blocks == 0
    bm.check_invariants([c])


def test_reset_forgets_everything() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    with pytest.raises(AssertionError, match="in use"):
        bm.reset()
    bm.free(a)
    bm.reset()
    assert bm.cached == {}
    assert bm.num_free_blocks == 4
    assert list(bm.free_queue) == [0, 1, 2, 3]
    assert all(b.block_hash is None and b.ref_count == 0 for b in bm.blocks)
    assert bm.get_computed_blocks(req("again", [1, 2, 3, 4, 5])) == []
    bm.check_invariants([])
