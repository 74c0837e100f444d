"""Request: one generation request's token state as the scheduler sees it.

Owns the bookkeeping of which tokens exist, which are in the KV cache, which
blocks hold them, and why the request finished. Pure Python: no torch.

Invariants over a request's token positions (all_token_ids = prompt + output):
  [0, num_computed_tokens)           have their K/V written in the cache
  [num_computed_tokens, num_tokens)  exist but still need a forward pass
  block_ids[j] holds positions [j * block_size, (j + 1) * block_size)
  (and window_block_ids[j] in a sliding cache group, see block_manager.py)
A running request always has at least one uncomputed token: the prompt's tail
before its first sample, then the last sampled token afterwards.

In flight (asynchronous scheduling): a step that will sample a token for the
request has been launched but its token is not on the host yet. The scheduler
counts such tokens in `num_inflight` and treats them as existing: it may
schedule the position of an in-flight token (the runner takes its id from the
device) and advances num_computed_tokens past it, so num_computed_tokens may
exceed len(all_token_ids) by at most num_inflight.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable

from tinyengine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # By value: hashing an Enum member runs Python code, and this is asked
        # several times per request per step.
        return self._value_ in _FINISHED


_FINISHED = frozenset(s.value for s in RequestStatus if s.name.startswith("FINISHED_"))


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        group: Hashable = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty (0 tokens)")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # already clipped to max_model_len by the engine
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Requests submitted together (one HTTP request's prompts x n) share a
        # group; admission is fair across groups (waiting_queue.py).
        self.group = group

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_inflight = 0  # tokens sampled by launched steps, not yet appended
        self.block_ids: list[int] = []
        # The sliding cache group's blocks (block_manager.py), when the model
        # has one: same logical blocks, the first num_released_blocks NULL.
        self.window_block_ids: list[int] = []
        self.num_released_blocks = 0
        # Content hashes of the full blocks of all_token_ids, extended lazily by
        # the block manager (a block's hash chains its parent's).
        self.block_hashes: list[bytes] = []
        # block_ids[:num_indexed_blocks] were offered to the prefix cache
        # already: each step looks only at blocks that filled since.
        self.num_indexed_blocks = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not yet
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_inflight(self) -> int:
        return len(self.all_token_ids) + self.num_inflight

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status._value_ in _FINISHED  # status.finished, one call fewer (hot)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_token_stop(self) -> RequestStatus | None:
        """Stop conditions that depend on token ids only (stop *strings* need
        text and are checked by the engine's detokenizer)."""
        params = self.sampling_params
        num_output = len(self.output_token_ids)
        # A stop token wins over the length limit it may also reach (vLLM's
        # order): the sequence did end there.
        if num_output >= params.min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None  # eos: OpenAI's plain "stop", no reason string
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
