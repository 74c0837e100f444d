"""A fake model and an engine-shaped driver for the scheduler tests.

The driver runs the scheduler exactly as the engine does (schedule -> forward ->
update_from_output -> stop checks -> finish) with a "model" whose next token is
a pure function of the token ids it *reads back from a shadow KV cache*. The
shadow cache maps (block_id, offset) -> the token id written there, so every
step checks that what the scheduler claims is computed (a prefix hit, an earlier
chunk, a resumed request's recompute) really sits in that request's blocks.
With `sliding_keep` the block manager also has a sliding cache group (as
for DeepSeek-V4), sized as the engine sizes it (SlidingGroup.blocks_needed):
the fake model then reads the last `sliding_keep` positions of its context
from a second shadow cache, through the request's sliding blocks, and the rest
from the full-history blocks.
Pure Python: no torch.
"""

from __future__ import annotations

import zlib
from array import array
from collections import Counter
from dataclasses import dataclass, field

from tinyengine.sampling_params import SamplingParams
from tinyengine.scheduling.block_manager import NULL_BLOCK, BlockManager, SlidingGroup
from tinyengine.scheduling.request import Request, RequestStatus
from tinyengine.scheduling.scheduler import Scheduler, SchedulerOutput

VOCAB = 7


def next_token(token_ids: list[int], vocab: int = VOCAB) -> int:
    """The fake model: a deterministic function of the whole context."""
    return zlib.crc32(array("q", token_ids).tobytes()) % vocab


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    *,
    ignore_eos: bool = True,
    eos: frozenset[int] = frozenset(),
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
    group: str | None = None,
) -> Request:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        min_tokens=min(min_tokens, max_tokens),
        stop_token_ids=stop_token_ids,
    )
    return Request(request_id, prompt, params, max_tokens, eos, group=group)


def snapshot(bm: BlockManager, *requests: Request) -> tuple:
    """Everything a failed allocation must leave unchanged."""
    return (
        list(bm.free_queue),
        dict(bm.cached),
        [(b.ref_count, b.block_hash) for b in bm.blocks],
        [list(r.block_ids) for r in requests],
    )


def reference_output(request: Request, vocab: int = VOCAB) -> tuple[list[int], RequestStatus]:
    """What `request` must generate: the fake model run alone, no scheduler."""
    tokens = list(request.prompt_token_ids)
    probe = Request(
        "ref", tokens, request.sampling_params, request.max_tokens, request.eos_token_ids
    )
    while True:
        probe.append_output_token(next_token(probe.all_token_ids, vocab))
        status = probe.check_token_stop()
        if status is not None:
            return probe.output_token_ids, status


@dataclass
class Sim:
    """One engine-shaped driver around a Scheduler + BlockManager."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True
    vocab: int = VOCAB
    sliding_keep: int | None = None
    shadow: dict[tuple[int, int], int] = field(default_factory=dict)
    window_shadow: dict[tuple[int, int], int] = field(default_factory=dict)
    finished: dict[str, Request] = field(default_factory=dict)
    history: list[SchedulerOutput] = field(default_factory=list)
    # Per step, the sampled token per scheduled row (None: a prefill chunk that
    # did not reach the end). Recorded because ScheduledRequest.samples is
    # computed from the live request and reads False once the token is appended.
    sampled_history: list[list[int | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        sliding = None
        if self.sliding_keep is not None:
            needed = SlidingGroup.blocks_needed(
                self.sliding_keep, self.block_size, self.max_num_seqs, self.max_num_batched_tokens
            )
            sliding = SlidingGroup(needed, self.sliding_keep)
        self.bm = BlockManager(
            self.num_blocks, self.block_size, self.enable_prefix_caching, sliding
        )
        self.sched = Scheduler(self.bm, self.max_num_seqs, self.max_num_batched_tokens)

    # --- checks ---

    def live(self) -> list[Request]:
        return list(self.sched.requests.values())

    def check(self, exact_blocks: bool = True) -> None:
        """Scheduler-wide invariants. `exact_blocks`: between steps a running
        request holds exactly the blocks its computed tokens need (mid-step a
        scheduled one also holds those for its chunk)."""
        sched, bm = self.sched, self.bm
        assert len(sched.running) <= sched.max_num_seqs
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)
        assert all(r.status == RequestStatus.WAITING for r in sched.waiting)
        assert all(not r.block_ids for r in sched.waiting), "a waiting request holds blocks"
        assert all(not r.window_block_ids for r in sched.waiting)
        assert all(r.num_computed_tokens == 0 for r in sched.waiting)
        ids = [r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]
        assert sorted(ids) == sorted(sched.requests), "running + waiting != requests"
        assert len(sched.waiting) == len(list(sched.waiting))
        per_group = Counter(r.group for r in sched.running)
        assert sched.running_per_group == per_group, (sched.running_per_group, per_group)
        assert all(n > 0 for n in sched.running_per_group.values())
        for r in sched.running:
            assert 0 <= r.num_computed_tokens < r.num_tokens_with_inflight, r
            if exact_blocks:
                assert len(r.block_ids) == bm.blocks_needed(r.num_computed_tokens), r
        bm.check_invariants(self.live())
        # A block shared by several live requests is a cached prefix block at
        # the same position in each of them.
        where: dict[int, set[int]] = {}
        for r in self.live():
            for j, b in enumerate(r.block_ids):
                where.setdefault(b, set()).add(j)
        for b, positions in where.items():
            if bm.blocks[b].ref_count > 1:
                assert bm.blocks[b].block_hash is not None, f"block {b} shared but not cached"
                assert len(positions) == 1, f"block {b} shared at positions {positions}"
        if not sched.has_unfinished_requests():
            assert bm.num_free_blocks == bm.num_blocks, "idle with blocks in use (leak)"
            for free, total in bm.group_usage().values():
                assert free == total, "idle with blocks in use (leak)"

    def check_plan(self, out: SchedulerOutput) -> None:
        bm = self.bm
        assert out.num_batched_tokens <= self.max_num_batched_tokens
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), f"scheduled twice in one step: {ids}"
        for s in out.scheduled:
            r = s.request
            assert r.status == RequestStatus.RUNNING and r in self.sched.running
            assert s.num_new_tokens >= 1
            # Scheduled tokens count as computed at once (vLLM V1); the
            # engine's asynchronous mode relies on it.
            assert s.start + s.num_new_tokens == r.num_computed_tokens
            assert s.start + s.num_new_tokens <= r.num_tokens
            assert len(r.block_ids) * bm.block_size >= s.start + s.num_new_tokens
            assert len(r.block_ids) == bm.blocks_needed(s.start + s.num_new_tokens), r
        for r in out.preempted:
            assert r.status == RequestStatus.WAITING and r in self.sched.waiting
            assert r.request_id not in ids
        scheduled = {id(s.request) for s in out.scheduled}
        for r in self.sched.running:
            if id(r) not in scheduled:
                assert len(r.block_ids) == bm.blocks_needed(r.num_computed_tokens), r
        self.check(exact_blocks=False)

    # --- the fake forward pass ---

    def forward(self, out: SchedulerOutput, cached_before: set[int], fresh: set[int]) -> list:
        """The step as a model runs it: every scheduled token is written to the
        cache first (within a layer all cache writes precede attention), then
        each row reads its context back. `cached_before`: the blocks indexed
        before the step was planned; none may be written unless the plan
        allocated it afresh (`fresh`: evicting its old content). A block the
        plan's own chunks fill is indexed when planned, so a row admitted
        after its writer may already share it (a same-step prefix hit)."""
        bs = self.block_size
        for s in out.scheduled:
            r, table = s.request, s.request.block_ids
            for p in range(s.start, s.start + s.num_new_tokens):
                block = self.bm.blocks[table[p // bs]]
                assert block.block_id in fresh or block.block_id not in cached_before, (
                    f"{r.request_id} overwrites cached {block}"
                )
                assert block.ref_count == 1 or block.block_hash is not None, (
                    f"{r.request_id} writes into shared {block}"
                )
                self.shadow[(block.block_id, p % bs)] = r.all_token_ids[p]
            if self.sliding_keep is not None:
                self._window_forward(s)
        sampled: list[int | None] = []
        for s in out.scheduled:
            r, table = s.request, s.request.block_ids
            # Everything before `start` must already be in this request's blocks.
            for p in range(s.start):
                slot = (table[p // bs], p % bs)
                assert self.shadow.get(slot) == r.all_token_ids[p], (
                    f"{r.request_id}: position {p} claimed computed but slot {slot} holds "
                    f"{self.shadow.get(slot)}, want {r.all_token_ids[p]}"
                )
            if s.samples:
                context = [self.shadow[(table[p // bs], p % bs)] for p in range(r.num_tokens)]
                if self.sliding_keep is not None:  # the tail comes from the sliding group
                    window = r.window_block_ids
                    for p in range(max(0, r.num_tokens - self.sliding_keep - 1), r.num_tokens):
                        context[p] = self.window_shadow[(window[p // bs], p % bs)]
                sampled.append(next_token(context, self.vocab))
            else:
                sampled.append(None)
        return sampled

    def _window_forward(self, s) -> None:
        """The sliding group's side of a chunk: the kept span before it is in
        the request's (live) sliding blocks, and its tokens are written to
        private ones."""
        bs, r, window = self.block_size, s.request, s.request.window_block_ids
        for p in range(max(0, s.start - self.sliding_keep), s.start):
            slot = (window[p // bs], p % bs)
            assert window[p // bs] != NULL_BLOCK, f"{r.request_id}: kept position {p} released"
            assert self.window_shadow.get(slot) == r.all_token_ids[p], (r.request_id, p)
        for p in range(s.start, s.start + s.num_new_tokens):
            block = self.bm.window_pool.blocks[window[p // bs]]
            assert block.ref_count == 1 and block.block_hash is None, f"writes into {block}"
            self.window_shadow[(block.block_id, p % bs)] = r.all_token_ids[p]

    # --- driving ---

    def add(self, request: Request) -> None:
        self.sched.add_request(request)
        self.check()

    def abort(self, request_id: str) -> None:
        request = self.sched.abort(request_id)
        if request is not None:
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert request.block_ids == []
            self.finished[request_id] = request
        self.check()

    def step(self, abort_mid_step: str | None = None) -> SchedulerOutput:
        cached_before = set(self.bm.cached.values())
        fresh: set[int] = set()  # blocks the plan takes from the free queue
        pool, pop_free = self.bm.pool, self.bm.pool.pop_free
        pool.pop_free = lambda: fresh.add(block := pop_free()) or block
        try:
            out = self.sched.schedule()
        finally:
            del pool.pop_free  # the method again
        self.history.append(out)
        self.check_plan(out)
        if out.is_empty:
            assert not self.sched.has_unfinished_requests(), "stalled with work left"
            self.sampled_history.append([])
            return out
        sampled = self.forward(out, cached_before, fresh)
        self.sampled_history.append(sampled)
        if abort_mid_step is not None:
            # The async engine may abort while a step runs.
            request = self.sched.abort(abort_mid_step)
            if request is not None:
                self.finished[abort_mid_step] = request
                assert request.block_ids == []
                self.check(exact_blocks=False)
        advanced = self.sched.update_from_output(out, sampled)
        expect = [
            s.request
            for s, t in zip(out.scheduled, sampled, strict=True)
            if t is not None and not s.request.is_finished
        ]
        assert advanced == expect
        for request in advanced:
            status = request.check_token_stop()
            if status is not None:
                self.sched.finish(request, status)
                self.finished[request.request_id] = request
        self.check()
        return out

    def last_samples(self) -> list[bool]:
        return [t is not None for t in self.sampled_history[-1]]

    def ever_chunked(self) -> bool:
        return any(t is None for step in self.sampled_history for t in step)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.live()}")
