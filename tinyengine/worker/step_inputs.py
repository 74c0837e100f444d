"""StepInputs: one step as plain host data — everything a rank needs to run
the step's forward, built once from the scheduler's plan (by rank 0 when
there are several tensor-parallel ranks, which receive it as is).

Owns that data's shape, building it from a plan (`build_step_inputs`) and the
prompt-logprob work list. Nothing in a StepInputs holds a tensor or a
Request: the object is pickled to the other ranks (worker/worker_group.py),
which hold no scheduler state at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyengine.scheduling.scheduler import SchedulerOutput
from tinyengine.worker.step_rows import step_rows


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


def build_step_inputs(runner: Any, plan: SchedulerOutput) -> tuple[StepInputs, list[int]]:
    """The host half of a step on `runner` (a ModelRunner): its rows, block
    tables and which rows sample, as a StepInputs; and the indices (into
    plan.scheduled) of the requests that sample. A decode batch a captured
    graph fits is padded to that graph's size."""
    rows, waiting = step_rows(plan, runner.block_table, runner.block_size)
    # Rows whose token the last launch sampled read it on the device.
    inflight = runner.inflight.rows(waiting)
    scheduled = plan.scheduled
    sampling = [i for i, s in enumerate(scheduled) if s.samples]
    graphs = runner.graphs
    size = graphs.padded_size(len(scheduled)) if graphs and plan.is_decode else None
    if size is not None:
        inputs = decode_inputs(runner, size, rows)
        logits_rows = sampling  # one row per request
    else:
        input_ids, positions, slots, seq_lens, table = rows
        q_lens = [s.num_new_tokens for s in scheduled]
        query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
        seq_lens = [int(n) for n in seq_lens]  # host lengths for the kernels' launch sizes
        inputs = StepInputs(None, input_ids, positions, slots, seq_lens, query_start_loc,
                            gather_tables(runner, *table))  # fmt: skip
        if runner.piecewise is not None:
            inputs.piecewise_size = runner.piecewise.padded_size(len(input_ids))
        logits_rows = [query_start_loc[i + 1] - 1 for i in sampling]  # each one's last
    inputs.inflight, inputs.logits_rows = inflight, logits_rows
    if any(s.request.sampling_params.prompt_logprobs is not None for s in scheduled):
        inputs.prompt_rows = prompt_rows(plan)
    return inputs, sampling


def decode_inputs(runner: Any, size: int, rows: Any) -> StepInputs:
    """A decode step's StepRows as the StepInputs of the `size`-row graph."""
    input_ids, positions, slots, seq_lens, (table_rows, width) = rows
    return StepInputs(size, input_ids, positions, slots, seq_lens, None,
                      gather_tables(runner, table_rows, width, size))  # fmt: skip


def gather_tables(
    runner: Any, table_rows: np.ndarray, width: int, pad_to: int = 0
) -> list[np.ndarray]:
    """The scheduled rows' block tables from the runner's HostBlockTable
    (padded with rows that read only the dummy blocks), and only the columns
    some row uses: kernels read a row's entries below its seq_len alone, so
    stale columns further right are never looked at (and a full-width table
    is megabytes per step at long max_model_len)."""
    table = runner.block_table
    tables = [table.gather(table_rows, width, pad_to, runner.dummy_block)]
    if runner.keep is not None:
        tables.append(table.gather_entries(table_rows, width, pad_to, runner.entry_dummy_block))
    return tables
