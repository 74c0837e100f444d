"""The sliding cache group's bookkeeping (block_manager.py, DeepSeek-V4's raw
KV and compressor state), without torch: blocks released as a request
advances past them, indexed first so a later prefix hit finds them; a hit
needs the full-history blocks of the prefix and the sliding ones of its kept
tail only, and shrinks when that tail was evicted; failed allocations in
either pool; everything back on free. The random workloads of
test_scheduler_property.py cover the group under the scheduler."""

from __future__ import annotations

from tests.scheduling.sim import make_request
from tinyengine.scheduling.block_manager import NULL_BLOCK, BlockManager, SlidingGroup
from tinyengine.scheduling.request import Request

BS, KEEP = 4, 5


def manager(num_blocks: int = 16, num_sliding: int = 8) -> BlockManager:
    return BlockManager(num_blocks, BS, sliding=SlidingGroup(num_sliding, KEEP))


def run_prefill(bm: BlockManager, request: Request) -> list[int]:
    """Admit with prefix hits, compute the whole prompt, advance."""
    hits = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, request.num_tokens - len(hits) * BS, hits)
    request.num_computed_tokens = request.num_tokens
    bm.advance(request)
    bm.check_invariants([request])
    return hits


def test_blocks_before_the_kept_span_are_released_as_the_request_advances() -> None:
    bm = manager()
    r = make_request("a", list(range(20)), max_tokens=8)
    run_prefill(bm, r)
    # 20 computed, keep 5: positions 15.. are read again; blocks 0-2 (0..11) are not.
    assert len(r.block_ids) == len(r.window_block_ids) == 5
    assert r.window_block_ids[:3] == [NULL_BLOCK] * 3
    assert NULL_BLOCK not in r.window_block_ids[3:]
    assert bm.group_usage() == {"full": (11, 16), "sliding": (6, 8)}
    # Decoding on: the sliding group holds a bounded number of blocks while
    # the full-history one grows with the context.
    for token in range(8):
        assert bm.allocate_slots(r, 1)
        r.append_output_token(token)
        r.num_computed_tokens += 1
        bm.advance(r)
        bm.check_invariants([r])
        live = [b for b in r.window_block_ids if b != NULL_BLOCK]
        assert len(live) <= -(-KEEP // BS) + 1
    assert len(r.block_ids) == 7  # 28 tokens
    bm.free(r)
    bm.check_invariants([])
    assert bm.group_usage() == {"full": (16, 16), "sliding": (8, 8)}


def test_a_prefix_hit_takes_the_full_history_and_the_kept_tail() -> None:
    bm = manager()
    prompt = list(range(16))
    a = make_request("a", prompt + [99], max_tokens=1)
    assert bm.allocate_slots(a, a.num_tokens)
    full_a, sliding_a = list(a.block_ids), list(a.window_block_ids)
    a.num_computed_tokens = a.num_tokens
    bm.advance(a)  # 17 computed - keep 5 = 12: sliding blocks 0-2 released (indexed first)
    assert a.window_block_ids[:3] == [NULL_BLOCK] * 3
    bm.free(a)
    b = make_request("b", prompt + [7, 7], max_tokens=1)
    hits = bm.get_computed_blocks(b)
    # Four full blocks cached; the hit at 16 tokens needs the sliding blocks
    # reaching positions 11..15 (logical blocks 2 and 3), not 0 and 1.
    assert hits == full_a[:4]
    assert bm.allocate_slots(b, 2, hits)
    assert b.block_ids[:4] == full_a[:4]
    assert b.window_block_ids[:4] == [NULL_BLOCK, NULL_BLOCK, *sliding_a[2:4]]
    assert b.num_released_blocks == 2
    bm.check_invariants([b])
    bm.free(b)
    bm.check_invariants([])


def test_a_hit_shrinks_to_where_the_sliding_tail_is_still_cached() -> None:
    bm = manager(num_sliding=6)
    prompt = list(range(20))
    a = make_request("a", prompt + [99], max_tokens=1)
    run_prefill(bm, a)
    bm.free(a)
    # Another request takes every free sliding block, evicting a's.
    filler = make_request("f", [50 + i for i in range(24)], max_tokens=1)
    assert bm.allocate_slots(filler, 24)
    filler.num_computed_tokens = 4  # the first chunk only: nothing released yet
    bm.check_invariants([filler])
    assert bm.window_pool.num_free == 0
    b = make_request("b", prompt + [1], max_tokens=1)
    assert bm.get_computed_blocks(b) == []  # full blocks cached, sliding tail gone
    bm.free(filler)
    # With the sliding pool empty again but a's sliding blocks evicted, the
    # full-history group alone is not a hit either.
    assert bm.get_computed_blocks(b) == []
    bm.check_invariants([])


def test_a_short_sliding_pool_fails_the_allocation_and_changes_nothing_else() -> None:
    bm = manager(num_blocks=16, num_sliding=2)
    r = make_request("a", list(range(12)), max_tokens=1)
    full_free = bm.num_free_blocks
    assert not bm.allocate_slots(r, 12)  # 3 sliding blocks wanted, 2 exist
    assert r.block_ids == [] and r.window_block_ids == []
    assert bm.num_free_blocks == full_free and bm.window_pool.num_free == 2
    assert bm.allocate_slots(r, 8)
    bm.check_invariants([r])
    bm.free(r)
    bm.check_invariants([])


def test_blocks_needed_covers_the_worst_case_per_row() -> None:
    # keep 127, 64-token blocks: 2 kept blocks + 3 per row, and two steps'
    # budgets of 8192 tokens.
    assert SlidingGroup.blocks_needed(127, 64, 256, 8192) == 256 * 5 + 2 * 128
    assert SlidingGroup.blocks_needed(0, 4, 1, 1) == 1 * 3 + 2
