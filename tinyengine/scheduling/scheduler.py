"""Scheduler: decides, each step, which requests run and how many of their
tokens are computed. Continuous batching with chunked prefill, prefix caching
and preemption by recompute, in the style of vLLM's V1 scheduler.

Owns the waiting queue, the running list and the per-step token budget. Pure
Python: it never imports torch and never looks at logits or text.

One step's plan. There is no separate "prefill" and "decode" phase: every
request simply has `num_tokens - num_computed_tokens` tokens left to compute
(a whole prompt, the rest of a chunked prompt, or the one token sampled last
step), and the scheduler hands out at most `max_num_batched_tokens` of them:
  1. running requests first, oldest first — decode rows cost one token each, a
     chunked prefill takes what budget remains;
  2. then waiting requests, while the budget, `max_num_seqs` and the free
     blocks allow, in the fair order of the WaitingQueue (waiting_queue.py):
     first-come-first-served within a group of requests submitted together,
     the group running the fewest requests first across groups. Their cached
     prefix (full blocks found in the prefix cache) is skipped, not recomputed,
     including blocks a request planned earlier in the same step fills.
When a running request cannot get a block, the newest running request is
preempted: its blocks are freed and it goes back to the head of its group's
queue, to be recomputed from its tokens later. Greedy and seeded sampling make
the resumed request produce exactly what it would have.

Fair share: before anything else, a group with requests waiting and nothing
running gets room — a slot and the blocks for its head's first chunk — taken
from the newest running request of the group that runs the most, if that
group runs at least two. So a small request's first token waits about one
step, not until a request that fanned out to thousands of sequences is done;
a group never loses its last running request this way, so nobody starves.

Tokens are counted as computed when they are scheduled (as vLLM's V1 does), and
a chunk that reaches the request's end adds one in-flight token
(`Request.num_inflight`) until `update_from_output` appends it. That is what
lets the engine schedule step N+1 while step N still runs (asynchronous
scheduling): a request whose token is in flight is simply scheduled for that
token's position. A request whose last allowed token is in flight is not
scheduled again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import cached_property

from tinyengine.scheduling.block_manager import BlockManager
from tinyengine.scheduling.request import Request, RequestStatus
from tinyengine.scheduling.waiting_queue import WaitingQueue


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # computes positions [start, start + num_new_tokens)
    start: int  # == request.num_computed_tokens when scheduled
    # True when this chunk reaches the request's last token, so the step yields
    # the logits for its next token. Fixed at scheduling time: once the sampled
    # token is appended, the request's own counts no longer tell.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.start + self.num_new_tokens
        self.samples = end == self.request.num_tokens_with_inflight


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @cached_property
    def is_decode(self) -> bool:
        """Every scheduled request computes one token (asked once the plan is
        complete, by several readers: computed once)."""
        return all(s.num_new_tokens == 1 for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    num_steps: int = 0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # admission order: oldest first
        self.running_per_group: Counter[Hashable] = Counter()
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # --- requests in and out ---

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        needed = self.block_manager.blocks_needed(request.num_prompt_tokens + request.max_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs up to {needed} KV blocks "
                f"({request.num_prompt_tokens} prompt + {request.max_tokens} output tokens) but "
                f"the cache has {self.block_manager.num_blocks}; lower max_tokens or raise "
                "num_kv_blocks / gpu_memory_utilization"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request now and free its blocks; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self._remove_running(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the step plan ---

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.waiting and self.running_per_group:
            self._make_room_for_idle_groups(out)
        fair_victims = list(out.preempted)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(self._tokens_to_run(request), budget)
            if n == 0:
                i += 1  # its last token is in flight: it finishes when that lands
                continue
            if self._allocate_or_preempt(request, n, out):
                self._schedule(out, request, n)
                budget -= n
                i += 1
            # else `request` preempted itself; it was the last one running.

        # No admissions in a step that ran out of blocks: the freed blocks are
        # owed to the preempted requests, now at the heads of their groups.
        if len(out.preempted) > len(fair_victims) or not self.waiting:
            return self._done(out)
        admission = self.waiting.admission(self.running_per_group)
        while budget > 0 and len(self.running) < self.max_num_seqs:
            request = admission.peek()
            if request is None:
                break
            if request.num_inflight or request in fair_victims:
                # Preempted while its token was in flight: its group waits
                # until that token lands. Or preempted for fair share this
                # step: its group is over its share.
                admission.skip_group()
                continue
            # prompt_logprobs needs the logits of every prompt position, which
            # a cached block does not have: such a request computes it all.
            if request.sampling_params.prompt_logprobs is None:
                hits = self.block_manager.get_computed_blocks(request)
            else:
                hits = []
            num_cached = len(hits) * self.block_manager.block_size
            n = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(request, n, hits):
                break  # nobody overtakes the next in line
            admission.admit()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            self.stats.prefix_cache_query_tokens += request.num_tokens
            self.stats.prefix_cache_hit_tokens += num_cached
            self.running.append(request)
            self._schedule(out, request, n)
            budget -= n
        return self._done(out)

    def _done(self, out: SchedulerOutput) -> SchedulerOutput:
        if out.scheduled:
            self.stats.num_steps += 1
        return out

    def _make_room_for_idle_groups(self, out: SchedulerOutput) -> None:
        """Fair share (see the module docstring): for each group that waits
        with nothing running (oldest first), preempt the newest request of the
        group running the most until that group's head has a slot and the
        blocks for its first chunk, beside what the running requests will take
        this step. Prefix hits are counted as misses: it may free a little
        more than needed, never less."""
        bm = self.block_manager
        reserved_slots = reserved_blocks = 0
        for head in self.waiting.idle_group_heads(self.running_per_group):
            if head.num_inflight:
                continue  # not admissible until its token lands
            need = bm.blocks_needed(min(head.num_tokens, self.max_num_batched_tokens))
            while (
                len(self.running) + reserved_slots >= self.max_num_seqs
                or bm.num_free_blocks - self._blocks_to_grow() - reserved_blocks < need
            ):
                victim = self._fair_share_victim()
                if victim is None:
                    return
                self._remove_running(victim)
                self._preempt(victim)
                out.preempted.append(victim)
            reserved_slots += 1
            reserved_blocks += need

    def _blocks_to_grow(self) -> int:
        """The new blocks the running requests take this step (the running
        phase of schedule(), counted, not done)."""
        budget, blocks = self.max_num_batched_tokens, 0
        for request in self.running:
            n = min(self._tokens_to_run(request), budget)
            budget -= n
            needed = self.block_manager.blocks_needed(request.num_computed_tokens + n)
            blocks += max(0, needed - len(request.block_ids))
        return blocks

    def _tokens_to_run(self, request: Request) -> int:
        """How many of a running request's tokens are left to compute; 0 when
        its last allowed token is in flight (it finishes when that lands)."""
        if request.num_output_tokens + request.num_inflight >= request.max_tokens:
            return 0
        return request.num_tokens_with_inflight - request.num_computed_tokens

    def _fair_share_victim(self) -> Request | None:
        """The newest running request of the group running the most, if that
        group runs at least two."""
        group, count = max(self.running_per_group.items(), key=lambda kv: kv[1], default=(None, 0))
        if count < 2:
            return None
        return next(r for r in reversed(self.running) if r.group == group)

    def _schedule(self, out: SchedulerOutput, request: Request, n: int) -> None:
        """Put n tokens of `request` in the plan and count them as computed;
        the blocks they fill become prefix hits for requests admitted after
        it, this step included (BlockManager.cache_scheduled_blocks)."""
        sched = ScheduledRequest(request, n, request.num_computed_tokens)
        out.scheduled.append(sched)
        request.num_computed_tokens += n
        if sched.samples:
            request.num_inflight += 1
        self.block_manager.cache_scheduled_blocks(request)

    def _allocate_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate_slots(request, n):
            victim = self.running[-1]  # the newest running request
            self._remove_running(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)
        self.running_per_group[request.group] -= 1
        if not self.running_per_group[request.group]:
            del self.running_per_group[request.group]

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    # --- after the forward pass ---

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: list[int | None]
    ) -> list[Request]:
        """Append the token sampled for each scheduled request (None where the
        chunk did not reach its end) and index its newly full blocks.
        Returns the requests that received a token, for the engine's stop checks.

        A request preempted while the step ran still gets its token (it was
        sampled from the right context); one that finished meanwhile does not."""
        advanced: list[Request] = []
        advance = self.block_manager.advance
        running = RequestStatus.RUNNING
        for sched, token_id in zip(out.scheduled, sampled_token_ids, strict=True):
            request = sched.request
            if sched.samples:
                request.num_inflight -= 1
            if request.is_finished:
                continue  # aborted or stopped while the step ran: drop its token
            if token_id is not None:
                request.append_output_token(token_id)
                advanced.append(request)
            if request.status is running:
                advance(request)
        return advanced
