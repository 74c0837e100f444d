"""BlockManager property: a hypothesis state machine of random admissions
(with prefix hits), forward passes, decodes and frees. A shadow dict records
the token written into each (block, offset), so every prefix hit is checked to
return blocks holding exactly the request's own tokens; after every operation
the reference counts, free queue and cache index are consistent, and when all
requests are freed every block is free again."""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests.scheduling.sim import make_request, snapshot
from tinyengine.scheduling.block_manager import BlockManager
from tinyengine.scheduling.request import Request


def req(request_id: str, tokens: list[int]) -> Request:
    return make_request(request_id, tokens, max_tokens=4)


class BlockManagerMachine(RuleBasedStateMachine):
    """Prompts over a 2-letter alphabet (3 for decoded tokens) so that prefixes
    collide often. A shadow dict holds the token ids written into each (block,
    offset); every prefix hit must return blocks whose shadow content is the
    request's own."""

    requests = Bundle("requests")

    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.live: dict[str, Request] = {}
        self.scheduled: dict[str, int] = {}  # id -> positions allocated (to compute)
        self.shadow: dict[tuple[int, int], int] = {}
        self.next_id = 0

    def _slot(self, request: Request, p: int) -> tuple[int, int]:
        bs = self.bm.block_size
        return (request.block_ids[p // bs], p % bs)

    @rule(
        target=requests, tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14), data=st.data()
    )
    def admit(self, tokens: list[int], data: st.DataObject) -> Request:
        bm = self.bm
        request = req(f"r{self.next_id}", tokens)
        self.next_id += 1
        hits = bm.get_computed_blocks(request)
        bs = bm.block_size
        assert len(hits) <= (len(tokens) - 1) // bs
        assert len(set(hits)) == len(hits)
        for j, block_id in enumerate(hits):
            content = [self.shadow.get((block_id, k)) for k in range(bs)]
            assert content == tokens[j * bs : (j + 1) * bs], "hit on a block of other tokens"
            assert bm.blocks[block_id].block_hash is not None
        event(f"admit: {'prefix hit' if hits else 'no hit'}")
        cached = len(hits) * bs
        n = data.draw(st.integers(1, len(tokens) - cached), label="n")
        before = snapshot(bm, request)
        if bm.allocate_slots(request, n, hits):
            if any(bm.blocks[b].ref_count > 1 for b in hits):
                event("admit: hit shared with a live request")
            request.num_computed_tokens = cached
            self.live[request.request_id] = request
            self.scheduled[request.request_id] = cached + n
            assert len(request.block_ids) == bm.blocks_needed(cached + n)
        else:
            event("admit: short of blocks")
            assert snapshot(bm, request) == before  # not live: the other rules skip it
        return request

    @rule(request=requests)
    def compute(self, request: Request) -> None:
        """The forward pass: write the scheduled tokens, then index full blocks."""
        if request.request_id not in self.live:
            return
        upto = self.scheduled[request.request_id]
        for p in range(request.num_computed_tokens, upto):
            block = self.bm.blocks[self._slot(request, p)[0]]
            assert block.ref_count == 1, f"writing into shared {block}"
            assert block.block_hash is None, f"overwriting cached {block}"
            self.shadow[self._slot(request, p)] = request.all_token_ids[p]
        request.num_computed_tokens = upto
        self.bm.cache_full_blocks(request)

    @rule(request=requests, new_tokens=st.lists(st.integers(0, 2), max_size=5), data=st.data())
    def extend(self, request: Request, new_tokens: list[int], data: st.DataObject) -> None:
        """Decode (append sampled tokens) and/or schedule the next chunk."""
        rid = request.request_id
        if rid not in self.live or self.scheduled[rid] != request.num_computed_tokens:
            return
        for t in new_tokens:
            request.append_output_token(t)
        left = request.num_tokens - request.num_computed_tokens
        if left == 0:
            return
        n = data.draw(st.integers(1, left), label="n")
        before = snapshot(self.bm, *self.live.values())
        if self.bm.allocate_slots(request, n):
            self.scheduled[rid] = request.num_computed_tokens + n
        else:
            assert snapshot(self.bm, *self.live.values()) == before

    @rule(request=consumes(requests))
    def free(self, request: Request) -> None:
        if self.live.pop(request.request_id, None) is not None:
            self.bm.free(request)
            assert request.block_ids == []

    @precondition(lambda self: not self.live)
    @rule()
    def reset(self) -> None:
        self.bm.reset()

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        live = list(self.live.values())
        bm.check_invariants(live)
        users: dict[int, list[tuple[Request, int]]] = {}
        for r in live:
            assert len(r.block_ids) == bm.blocks_needed(self.scheduled[r.request_id])
            for j, block_id in enumerate(r.block_ids):
                users.setdefault(block_id, []).append((r, j))
            # What the request believes computed is really in its blocks.
            for p in range(r.num_computed_tokens):
                assert self.shadow.get(self._slot(r, p)) == r.all_token_ids[p]
        for block_id, where in users.items():
            if len(where) > 1:
                block = bm.blocks[block_id]
                assert block.block_hash is not None, f"{block} shared but not a cached prefix"
                assert block.ref_count == len(where)
                assert len({j for _, j in where}) == 1, "shared block at different positions"
        # Every cached block holds the full content its hash chain names.
        for block_id in bm.cached.values():
            assert all((block_id, k) in self.shadow for k in range(bm.block_size))
        if not live:
            assert bm.num_free_blocks == bm.num_blocks

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for request in self.live.values():
            self.bm.free(request)
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
