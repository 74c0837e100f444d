"""StepInputs: one step as plain host data — everything a rank needs to run
the step's forward, built once from the scheduler's plan (by rank 0 when
there are several tensor-parallel ranks, which receive it as is).

Owns that data's shape and the prompt-logprob work list. Nothing here holds
a tensor or a Request: the object is pickled to the other ranks
(worker/worker_group.py), which hold no scheduler state at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyengine.scheduling.scheduler import SchedulerOutput


@dataclass
class PromptRows:
    """One request's prompt positions in this step whose logprobs it asked
    for: hidden rows [offset, offset + len(targets)) predict `targets`, the
    prompt tokens from index `first` on."""

    request_id: str
    first: int
    offset: int
    targets: list[int]
    num_top: int


@dataclass
class StepInputs:
    # Replay the decode graph of this many rows; None: run the step eagerly.
    graph_size: int | None
    input_ids: list[int]
    positions: Any  # list or int array, one per token
    slots: Any
    seq_lens: Any  # one per sequence
    query_start_loc: list[int] | None  # eager steps only (graphs read 0..size)
    # The step's block tables, gathered on the host ([rows, width] int32):
    # the per-token group's, then the full-history group's when there are two.
    tables: list[np.ndarray]
    # (input row, index into the previous launch's sampled ids) for each row
    # whose token was still in flight when the step was planned.
    inflight: list[tuple[int, int]] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # the hidden rows that sample
    # An eager-shaped step that replays the piecewise graphs of this many
    # tokens (worker/piecewise_graphs.py); its token rows are padded to it.
    piecewise_size: int | None = None
    prompt_rows: list[PromptRows] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) if self.graph_size is None else self.graph_size


def prompt_rows(plan: SchedulerOutput) -> list[PromptRows]:
    """The prompt-logprob work of a step (worker/prompt_logprobs.py): prompt
    position p's hidden state predicts token p + 1, so a chunk computing
    positions [start, end) covers prompt tokens start + 1 .. min(end, P - 1)."""
    out: list[PromptRows] = []
    offset = 0  # the first hidden row of each scheduled request
    for sched in plan.scheduled:
        request, n = sched.request, sched.num_new_tokens
        num_top = request.sampling_params.prompt_logprobs
        stop = min(sched.start + n, len(request.prompt_token_ids) - 1)
        if num_top is not None and stop > sched.start:
            targets = request.prompt_token_ids[sched.start + 1 : stop + 1]
            out.append(PromptRows(request.request_id, sched.start + 1, offset, targets, num_top))
        offset += n
    return out
