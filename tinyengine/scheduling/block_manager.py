"""BlockManager: the paged KV cache's bookkeeping — which physical block holds
which request's tokens, and which full blocks can be shared as a prefix cache.

Owns: the free queue, reference counts, and the prefix-cache index (content
hash -> block). Pure Python; it never touches the KV tensors themselves.

Prefix caching. A *full* block's identity is a hash chain over content:
hash(parent block's hash || this block's token ids), so equal hashes mean equal
whole prefixes, not just equal blocks. The hash is a 128-bit BLAKE2b digest, so
a collision (which would silently serve another prompt's K/V) is not a
practical concern — the reason we do not use Python's 64-bit `hash`.
Only blocks whose every token has been *computed* are indexed.

Free queue. A block with ref_count 0 sits in the free queue, ordered for
eviction: blocks without a cached hash come first (they are worth nothing), then
cached blocks in least-recently-freed order. A cached free block is still
findable by its hash; a prefix hit takes it back out of the queue ("touch").
Allocating a new block evicts the queue's head and drops its hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from tinyengine.scheduling.request import Request


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id

    # --- queries ---

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest cached prefix of `request`, as block ids (not yet
        referenced). Capped so at least the last token is computed: the model
        must run on it to produce the next token's logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # --- allocation ---

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make request.block_ids cover its computed tokens plus `num_new_tokens`.

        `computed_blocks` (only for a request not yet holding blocks) are prefix
        hits from get_computed_blocks: they are referenced, not allocated.
        Returns False, changing nothing, when the free queue cannot supply the
        blocks.
        """
        computed_blocks = computed_blocks or []
        assert not computed_blocks or not request.block_ids, "prefix hits only at admission"
        num_computed = max(request.num_computed_tokens, len(computed_blocks) * self.block_size)
        total_needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = total_needed - len(request.block_ids) - len(computed_blocks)
        if num_new_blocks <= 0 and not computed_blocks:
            return True  # the common case, every running request every step: room left
        # Hits that are currently free leave the free queue when touched.
        num_touched_free = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_touched_free > self.num_free_blocks:
            return False
        for block_id in computed_blocks:
            self._touch(block_id)
        request.block_ids.extend(computed_blocks)
        for _ in range(max(num_new_blocks, 0)):
            request.block_ids.append(self._pop_free())
        return True

    def free(self, request: Request) -> None:
        """Release all of the request's blocks. Tail blocks are released first so
        that, among equally old cached blocks, a prefix outlives its suffixes."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"double free of block {block_id}"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)  # evict first
        request.block_ids = []
        request.num_indexed_blocks = 0

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that are full and fully computed."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose tokens are all known: positions of in-flight tokens
        # count as computed but have no id to hash yet.
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= request.num_indexed_blocks:
            return  # most decode steps: no block filled (this runs for every row)
        hashes = self._block_hashes(request, num_full)
        for j in range(request.num_indexed_blocks, num_full):
            block = self.blocks[request.block_ids[j]]
            if block.block_hash is not None:
                continue
            # Another block may already hold the same content (two requests
            # prefilled the same prefix in one step); keep the first indexed.
            if hashes[j] not in self.cached:
                block.block_hash = hashes[j]
                self.cached[hashes[j]] = block.block_id
        request.num_indexed_blocks = num_full

    def reset(self) -> None:
        """Forget everything (after warmup: no warmup block may ever serve a hit)."""
        assert all(b.ref_count == 0 for b in self.blocks), "reset with blocks in use"
        self.__init__(self.num_blocks, self.block_size, self.enable_prefix_caching)

    # --- internals ---

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            j = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.all_token_ids[j * bs : (j + 1) * bs]))
        return hashes

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its content is about to be overwritten
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def check_invariants(self, live_requests: list[Request]) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        refs = [0] * self.num_blocks
        for request in live_requests:
            for block_id in request.block_ids:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"{block} but {refs[block.block_id]} users"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), block
            if block.block_hash is not None:
                assert self.cached[block.block_hash] == block.block_id, block
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
