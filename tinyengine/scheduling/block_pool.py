"""BlockPool: one cache group's physical blocks — reference counts, the free
queue and the prefix-cache index (content hash -> block). Pure Python.

Free queue. A block with ref_count 0 sits in the free queue, ordered for
eviction: blocks without a cached hash come first (they are worth nothing), then
cached blocks in least-recently-freed order. A cached free block is still
findable by its hash; a prefix hit takes it back out of the queue ("touch").
Allocating a new block evicts the queue's head and drops its hash.

Which of a request's blocks a pool holds, and when they are released, is the
block manager's rule (block_manager.py); a pool only counts.

A pool keeps each block's reference count and hash in two plain lists,
not an object per block: a large card holds millions of blocks (about 2 M
for the V4-Flash proxy on an 80 GB card), and building a Python object for
each took seconds of every startup. `blocks[i]` makes a read-only view of
block i on access, for tests and debugging.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import overload


class Block:
    """A read-only view of one block's bookkeeping in its pool."""

    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: BlockPool, block_id: int) -> None:
        self._pool = pool
        self.block_id = block_id

    @property
    def ref_count(self) -> int:
        return self._pool.ref_counts[self.block_id]

    @property
    def block_hash(self) -> bytes | None:
        return self._pool.hashes[self.block_id]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Block)
            and other._pool is self._pool
            and other.block_id == self.block_id
        )

    def __hash__(self) -> int:
        return hash((id(self._pool), self.block_id))

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockViews(Sequence[Block]):
    """The pool's blocks as a sequence of views, made on access (indexes and
    slices as a list's)."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_blocks

    @overload
    def __getitem__(self, index: int) -> Block: ...
    @overload
    def __getitem__(self, index: slice) -> list[Block]: ...
    def __getitem__(self, index: int | slice) -> Block | list[Block]:
        ids = range(self._pool.num_blocks)[index]
        if isinstance(ids, range):
            return [Block(self._pool, i) for i in ids]
        return Block(self._pool, ids)

    def __iter__(self) -> Iterator[Block]:
        return (Block(self._pool, i) for i in range(self._pool.num_blocks))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.blocks = BlockViews(self)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def num_touched_free(self, block_ids: list[int]) -> int:
        """How many of these (prefix-hit) blocks a touch takes out of the free queue."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def touch(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block_hash = self.hashes[block_id]
        if block_hash is not None:  # evict: its content is about to be overwritten
            del self.cached[block_hash]
            self.hashes[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def release(self, block_id: int) -> None:
        ref_count = self.ref_counts[block_id] - 1
        assert ref_count >= 0, f"double free of block {block_id}"
        self.ref_counts[block_id] = ref_count
        if ref_count == 0:
            self.free_queue[block_id] = None
            if self.hashes[block_id] is None:
                self.free_queue.move_to_end(block_id, last=False)  # evict first

    def index(self, block_id: int, block_hash: bytes) -> None:
        """Make a full, computed block findable by its content hash. Another
        block may already hold the same content (two requests computed the
        same prefix in one step); the first indexed stays."""
        if self.hashes[block_id] is None and block_hash not in self.cached:
            self.hashes[block_id] = block_hash
            self.cached[block_hash] = block_id

    def forget(self, block_id: int) -> None:
        """Drop a block's hash from the index (its content cannot be trusted);
        a later release puts it first in the free queue, like any uncached block."""
        block_hash = self.hashes[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.hashes[block_id] = None

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
        assert len(self.cached) == sum(h is not None for h in self.hashes)
