"""BlockManager: the paged cache's bookkeeping — which physical blocks hold
which request's tokens, in each cache group, and which full blocks can be
shared as a prefix cache.

Owns the rule of each cache group (which of a request's logical blocks it
holds, and when they go back) and the prefix-cache lookups across groups;
the counting of each group's blocks is a BlockPool's (block_pool.py). Pure
Python; it never touches the cache tensors themselves.

Cache groups. Logical block j of a request covers its positions [j *
block_size, (j + 1) * block_size) in every group; each group has its own
pool of physical blocks:
  - the full-history group (`Request.block_ids`): every logical block, from
    admission to the end — the K/V of ordinary attention, or DeepSeek-V4's
    compressed entries;
  - an optional sliding group (`Request.window_block_ids`, DeepSeek-V4's raw
    KV rows and compressor state): only the blocks that reach the last
    `keep` positions before the next one to compute. Older ones are released
    as the request advances (their entry becomes NULL_BLOCK), so what a
    sliding layer costs is bounded by its window, not by the context.

Prefix caching. A *full* block's identity is a hash chain over content:
hash(parent block's hash || this block's token ids), so equal hashes mean equal
whole prefixes, not just equal blocks. The hash is a 128-bit BLAKE2b digest, so
a collision (which would silently serve another prompt's K/V) is not a
practical concern — the reason we do not use Python's 64-bit `hash`. A block
is indexed, in every group under the same hash, once the step that fills it
is scheduled (`cache_scheduled_blocks`), so a request admitted later in the
same step already hits it: that step computes it before anything reads it
(within each layer every cache write comes before the attention that reads
the cache), and every later step runs after it. If that step fails, the
engine drops its requests and `uncache`s their blocks first. With a sliding
group (DeepSeek-V4) blocks are indexed only after their step ran: its
compressor pools windows that straddle the boundary from state rows written
in the same launch, an order the same-step rule does not cover. A prefix of
k blocks is a hit when the full-history group has all k and the sliding
group has those among them that reach the last `keep` positions of the
prefix: exactly what the next chunk reads.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from tinyengine.scheduling.block_pool import Block, BlockPool, BlockViews
from tinyengine.scheduling.request import Request

__all__ = ["NULL_BLOCK", "Block", "BlockManager", "SlidingGroup", "hash_block"]

# A released sliding-group entry of Request.window_block_ids (the runner
# points it at a reserved block that holds finite numbers).
NULL_BLOCK = -1


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(frozen=True)
class SlidingGroup:
    """A sliding cache group: `num_blocks` physical blocks, and a request
    keeps the blocks that reach its last `keep` positions before the next
    one it computes."""

    num_blocks: int
    keep: int

    @staticmethod
    def blocks_needed(keep: int, block_size: int, max_num_seqs: int, max_batched: int) -> int:
        """Blocks that make the group never the one that runs out: a running
        request holds the blocks of its kept span plus its chunks not yet
        released — the step in flight and the one being scheduled — so each
        row holds at most ceil(keep / block_size) + 3 beside its share of two
        steps' token budgets."""
        per_seq = -(-keep // block_size) + 3
        return max_num_seqs * per_seq + 2 * -(-max_batched // block_size)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding: SlidingGroup | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding = sliding
        self.pool = BlockPool(num_blocks)
        self.window_pool = None if sliding is None else BlockPool(sliding.num_blocks)

    # --- queries ---

    @property
    def blocks(self) -> BlockViews:
        """The full-history group's blocks (views made on access)."""
        return self.pool.blocks

    @property
    def free_queue(self):
        return self.pool.free_queue

    @property
    def cached(self) -> dict[bytes, int]:
        return self.pool.cached

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the full-history group: the one that fills up (the
        sliding group is sized never to, SlidingGroup.blocks_needed)."""
        return self.pool.num_free

    def group_usage(self) -> dict[str, tuple[int, int]]:
        """Per cache group: (free blocks, total blocks)."""
        usage = {"full": (self.pool.num_free, self.pool.num_blocks)}
        if self.window_pool is not None:
            usage["sliding"] = (self.window_pool.num_free, self.window_pool.num_blocks)
        return usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest cached prefix of `request`, as full-history block ids
        (not yet referenced); allocate_slots finds its sliding blocks. Capped
        so at least the last token is computed: the model must run on it to
        produce the next token's logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.window_pool is not None:
            k = len(hits)
            while k and not all(hashes[j] in self.window_pool.cached for j in self._kept(k)):
                k -= 1
            del hits[k:]
        return hits

    # --- allocation ---

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make request.block_ids (and window_block_ids) cover its computed
        tokens plus `num_new_tokens`.

        `computed_blocks` (only for a request not yet holding blocks) are prefix
        hits from get_computed_blocks: they are referenced, not allocated.
        Returns False, allocating nothing, when a pool cannot supply the
        blocks; the sliding blocks the request no longer needs are released
        either way.
        """
        if not computed_blocks and self.window_pool is None:
            # The common case, every running request every step: its blocks
            # already cover the new tokens.
            have = len(request.block_ids) * self.block_size
            if request.num_computed_tokens + num_new_tokens <= have:
                return True
        computed_blocks = computed_blocks or []
        assert not computed_blocks or not request.block_ids, "prefix hits only at admission"
        num_computed = max(request.num_computed_tokens, len(computed_blocks) * self.block_size)
        if self.window_pool is not None and request.block_ids:
            self._release_window(request, num_computed)
        total_needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = total_needed - len(request.block_ids) - len(computed_blocks)
        if num_new_blocks <= 0 and not computed_blocks:
            return True  # the common case, every running request every step: room left
        num_new_blocks = max(num_new_blocks, 0)
        window_hits: list[int] = []
        if computed_blocks and self.window_pool is not None:
            hashes = request.block_hashes
            window_hits = [
                self.window_pool.cached[hashes[j]] for j in self._kept(len(computed_blocks))
            ]
        if num_new_blocks + self.pool.num_touched_free(computed_blocks) > self.pool.num_free:
            return False
        if self.window_pool is not None:
            window_need = num_new_blocks + self.window_pool.num_touched_free(window_hits)
            if window_need > self.window_pool.num_free:
                return False
        for block_id in computed_blocks:
            self.pool.touch(block_id)
        request.block_ids.extend(computed_blocks)
        request.block_ids.extend(self.pool.pop_free() for _ in range(num_new_blocks))
        if self.window_pool is not None:
            if computed_blocks:
                skipped = len(computed_blocks) - len(window_hits)
                request.window_block_ids = [NULL_BLOCK] * skipped + window_hits
                request.num_released_blocks = skipped
                for block_id in window_hits:
                    self.window_pool.touch(block_id)
            window = request.window_block_ids
            window.extend(self.window_pool.pop_free() for _ in range(num_new_blocks))
        return True

    def advance(self, request: Request) -> None:
        """After a step ran the request: index its newly full blocks and
        release the sliding blocks no later step reads."""
        self.cache_full_blocks(request)
        if self.window_pool is not None and request.block_ids:
            self._release_window(request, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release all of the request's blocks. Tail blocks are released first so
        that, among equally old cached blocks, a prefix outlives its suffixes."""
        for block_id in reversed(request.block_ids):
            self.pool.release(block_id)
        for block_id in reversed(request.window_block_ids):
            if block_id != NULL_BLOCK:
                self.window_pool.release(block_id)
        request.block_ids = []
        request.window_block_ids = []
        request.num_released_blocks = 0
        request.num_indexed_blocks = 0

    def cache_scheduled_blocks(self, request: Request) -> None:
        """After `request`'s chunk was put in the step being planned (its
        tokens already count as computed): index the blocks that chunk fills,
        for same-step prefix hits (module docstring). Not with a sliding
        group, whose blocks advance() indexes after the step."""
        if self.window_pool is None:
            self.cache_full_blocks(request)

    def uncache(self, request: Request) -> None:
        """Drop the request's blocks from the prefix index: the step that was to
        compute them failed, so their K/V may never have been written. Blocks
        other live requests hold stay theirs; only the index forgets them."""
        for block_id in request.block_ids:
            self.pool.forget(block_id)
        for block_id in request.window_block_ids:
            if block_id != NULL_BLOCK:
                self.window_pool.forget(block_id)
        request.num_indexed_blocks = 0

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that are full and fully computed."""
        if request.num_computed_tokens // self.block_size <= request.num_indexed_blocks:
            return  # most decode steps: no block filled (this runs for every row)
        if not self.enable_prefix_caching:
            return
        # Only blocks whose tokens are all known: positions of in-flight tokens
        # count as computed but have no id to hash yet.
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= request.num_indexed_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        window = request.window_block_ids
        for j in range(request.num_indexed_blocks, num_full):
            self.pool.index(request.block_ids[j], hashes[j])
            if self.window_pool is not None and window[j] != NULL_BLOCK:
                self.window_pool.index(window[j], hashes[j])
        request.num_indexed_blocks = num_full

    def reset(self) -> None:
        """Forget everything (after warmup: no warmup block may ever serve a hit)."""
        assert not any(self.pool.ref_counts), "reset with blocks in use"
        self.__init__(self.num_blocks, self.block_size, self.enable_prefix_caching, self.sliding)

    # --- internals ---

    def _kept(self, num_blocks: int) -> range:
        """The logical blocks the sliding group holds after `num_blocks`
        computed blocks: those reaching the last `keep` positions."""
        return range(max(0, num_blocks * self.block_size - self.sliding.keep) // self.block_size,
                     num_blocks)  # fmt: skip

    def _release_window(self, request: Request, num_computed: int) -> None:
        """Release the sliding blocks wholly before the last `keep` positions
        of the first `num_computed` (indexed first, so they stay findable
        while free). The list is replaced, not edited: the runner's host
        block table notices a new list and rewrites the row."""
        live_from = min(max(0, num_computed - self.sliding.keep) // self.block_size,
                        len(request.window_block_ids))  # fmt: skip
        if live_from <= request.num_released_blocks:
            return
        self.cache_full_blocks(request)
        window = list(request.window_block_ids)
        for j in range(request.num_released_blocks, live_from):
            self.window_pool.release(window[j])
            window[j] = NULL_BLOCK
        request.window_block_ids = window
        request.num_released_blocks = live_from

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            j = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.all_token_ids[j * bs : (j + 1) * bs]))
        return hashes

    def check_invariants(self, live_requests: list[Request]) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        refs = [0] * self.num_blocks
        for request in live_requests:
            for block_id in request.block_ids:
                refs[block_id] += 1
        self.pool.check(refs)
        if self.window_pool is None:
            assert all(not r.window_block_ids for r in live_requests)
            return
        refs = [0] * self.window_pool.num_blocks
        for request in live_requests:
            window = request.window_block_ids
            assert len(window) == len(request.block_ids), request
            released = request.num_released_blocks
            assert all(b == NULL_BLOCK for b in window[:released]), request
            assert all(b != NULL_BLOCK for b in window[released:]), request
            for block_id in window[released:]:
                refs[block_id] += 1
        self.window_pool.check(refs)
