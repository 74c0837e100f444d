"""BlockPool: one cache group's physical blocks — reference counts, the free
queue and the prefix-cache index (content hash -> block). Pure Python.

Free queue. A block with ref_count 0 sits in the free queue, ordered for
eviction: blocks without a cached hash come first (they are worth nothing), then
cached blocks in least-recently-freed order. A cached free block is still
findable by its hash; a prefix hit takes it back out of the queue ("touch").
Allocating a new block evicts the queue's head and drops its hash.

Which of a request's blocks a pool holds, and when they are released, is the
block manager's rule (block_manager.py); a pool only counts.
"""

from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def num_touched_free(self, block_ids: list[int]) -> int:
        """How many of these (prefix-hit) blocks a touch takes out of the free queue."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its content is about to be overwritten
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"double free of block {block_id}"
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)  # evict first

    def index(self, block_id: int, block_hash: bytes) -> None:
        """Make a full, computed block findable by its content hash. Another
        block may already hold the same content (two requests computed the
        same prefix in one step); the first indexed stays."""
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id

    def forget(self, block_id: int) -> None:
        """Drop a block's hash from the index (its content cannot be trusted);
        a later release puts it first in the free queue, like any uncached block."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def check(self, refs: list[int]) -> None:
        """Raise AssertionError unless the bookkeeping matches `refs` (the
        live requests' references per block)."""
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"{block} but {refs[block.block_id]} users"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), block
            if block.block_hash is not None:
                assert self.cached[block.block_hash] == block.block_id, block
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
