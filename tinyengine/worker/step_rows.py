"""One scheduler step as the rows the runner writes into its persistent
input buffers (worker/runner.py): each scheduled token's id, position, KV
slot, each sequence's length, and which block-table rows the step reads.

Owns only that host-side arithmetic; the runner owns the buffers and the
device copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinyengine.scheduling.scheduler import SchedulerOutput
from tinyengine.worker.block_table import HostBlockTable

# One step's rows: input ids, positions, slots and seq_lens (lists or int
# arrays), and the block table's rows [rows, width] as the HostBlockTable
# slots of the scheduled requests with the widest row's length.
StepRows = tuple[list[int], Any, Any, Any, tuple[np.ndarray, int]]
NO_ROWS: StepRows = ([], [], [], [], (np.empty(0, dtype=np.int64), 1))


def step_rows(
    plan: SchedulerOutput, block_table: HostBlockTable, bs: int
) -> tuple[StepRows, list[tuple[int, str]]]:
    """The step's rows, and the (row, request id) of each row whose token is
    still in flight (sampled by the step launched last, not yet on the
    host): such a row gets a 0 here, and the runner puts the real id in on
    the device."""
    scheduled = plan.scheduled
    table_rows = block_table.slots([s.request for s in scheduled])
    input_ids: list[int] = []
    inflight: list[tuple[int, str]] = []
    if plan.is_decode:
        # Decode: one position per row, so positions, slots and lengths are
        # array maths over the host block table (no per-row Python lists:
        # this runs for every row of every step).
        starts: list[int] = []
        for i, sched in enumerate(scheduled):
            start = sched.start
            starts.append(start)
            tokens = sched.request.all_token_ids
            if start < len(tokens):
                input_ids.append(tokens[start])
            else:
                inflight.append((i, sched.request.request_id))
                input_ids.append(0)
        positions = np.array(starts, dtype=np.int64)
        blocks = block_table.table[table_rows[0], positions // bs]
        slots = blocks.astype(np.int64) * bs + positions % bs
        return (input_ids, positions, slots, positions + 1, table_rows), inflight

    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    for sched in scheduled:
        request, start, end = sched.request, sched.start, sched.start + sched.num_new_tokens
        known = request.all_token_ids[start:end]
        if len(known) < end - start:  # only the last position can be in flight
            assert len(known) == end - start - 1, f"{request} has >1 token in flight"
            inflight.append((len(input_ids) + len(known), request.request_id))
            known = [*known, 0]
        input_ids.extend(known)
        positions.extend(range(start, end))
        block_ids = block_table.token_block_ids(request)
        slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
        seq_lens.append(end)
    return (input_ids, positions, slots, seq_lens, table_rows), inflight
