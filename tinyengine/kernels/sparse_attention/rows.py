"""The query rows of DeepSeek-V4's Triton kernels (sparse attention in
kernels/sparse_attention/triton.py, the indexer in kernels/indexer/triton.py):
which context each query token sees and which block table row it reads, as
device tensors, plus the scratch rules of steps that are never captured.

The row model. Every query token is a row of its own. Token j of sequence
i's chunk of q_len_i tokens sits at position p = seq_lens[i] - q_len_i + j,
and what it attends to or scores (its window (p - window, p], the entries
w < (p + 1) // ratio, its own top-k picks) depends on p and on sequence i's
tables only: it is exactly a decode row whose seq_len is p + 1 and whose
table row is sequence i's. So prefill chunks, mixed batches and decode
steps all run through the same decode-row kernels in one launch, with two
per-row tensors: seq_lens (p + 1) and seqs (the row -> sequence indirection
the kernels follow to a table row, instead of a [T, width] copy of the
tables). A decode step needs neither: row b is sequence b at seq_lens[b],
so a graph-shaped step passes attn's own tensors and reads nothing new.

Built with device ops only (no host read of a device tensor, no Python loop
over sequences): the row -> sequence map is a searchsorted over
query_start_loc. Rows past the last sequence's chunk (padding) get
seq_len 0, which sees nothing: attention writes 0 there, the indexer -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tinyengine.kernels.workspace import ALIGNMENT


@dataclass
class QueryRows:
    """A step's query rows as the kernels take them."""

    seq_lens: torch.Tensor  # int32 [n]: p + 1 of each row (0: a padding row)
    seqs: torch.Tensor | None  # int32 [n]: each row's sequence (its table row); None: row b's is b
    num_rows: int  # n, a host int (grid sizes)
    eager: bool  # host lengths exist: the step is never captured

    def block(self, start: int, stop: int) -> QueryRows:
        """Rows [start, stop) (views: the kernels take them as they are)."""
        seqs = None if self.seqs is None else self.seqs[start:stop]
        return QueryRows(self.seq_lens[start:stop], seqs, stop - start, self.eager)


def query_rows(attn: Any) -> QueryRows:
    """Every query row of the step. A graph-shaped step (no host lengths;
    padding rows are one-token sequences) and an eager step of decode rows
    only are one row per sequence: attn's tensors as they are. Otherwise
    each of attn.num_tokens rows gets its own seq_len and sequence."""
    if attn.seq_lens_cpu is None:
        return QueryRows(attn.seq_lens, None, attn.seq_lens.shape[0], False)
    n, num_tokens = attn.num_seqs, attn.num_tokens
    if num_tokens == n and list(attn.query_start_loc_cpu[: n + 1]) == list(range(n + 1)):
        return QueryRows(attn.seq_lens, None, n, True)
    starts = attn.query_start_loc[: n + 1]
    ends = starts[1:].contiguous()
    t = torch.arange(num_tokens, dtype=ends.dtype, device=ends.device)
    seq = torch.searchsorted(ends, t, right=True)  # n for padding rows
    own = seq.clamp(max=max(n - 1, 0))
    # p + 1 = seq_len - (rows of the chunk after this one).
    lens = attn.seq_lens.long()[own] - (ends.long()[own] - t) + 1
    lens = torch.where(seq < n, lens, 0).to(torch.int32)
    return QueryRows(lens, own.to(torch.int32), num_tokens, True)


def _request_bytes(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """What Workspace.get takes for `specs` (each view 256-byte aligned)."""
    total = 0
    for shape, dtype in specs:
        numel = 1
        for s in shape:
            numel *= s
        total += -(-numel * dtype.itemsize // ALIGNMENT) * ALIGNMENT
    return total


def scratch(
    workspace: Any,
    specs: Sequence[tuple[Sequence[int], torch.dtype]],
    device: torch.device,
    eager: bool,
) -> list[torch.Tensor]:
    """One op's scratch: views of the arena when there is one. An eager step
    (never captured) whose request outgrows a locked arena allocates its own
    instead: the lock guards the addresses captured graphs hold, which a
    plain allocation cannot touch, and the profile warms up decode steps
    and one worst prefill, not every chunk length a later step may have.
    A graph-shaped step still raises (WorkspaceLockedError): a shape that was
    not warmed up."""
    if workspace is not None and not (
        eager and workspace.locked and _request_bytes(specs) > workspace.size
    ):
        return workspace.get(*specs)
    return [torch.empty(tuple(shape), dtype=dtype, device=device) for shape, dtype in specs]


def rows_per_block(num_rows: int, row_bytes: int, budget: int, workspace: Any) -> int:
    """How many rows of an eager step to run at once when each takes
    `row_bytes` of scratch: as many as `budget` holds, or the arena if it
    already holds more; a locked arena only as many as it holds, so a long
    prefill chunk runs in row blocks inside it. At least one row; a
    multiple of 16 when more, so every block's per-row tensors start as
    aligned as the first's (Triton compiles a kernel again for a pointer
    that is not a multiple of 16 bytes)."""
    if workspace is not None:
        budget = workspace.size if workspace.locked else max(budget, workspace.size)
    # Slack for the alignment of each scratch view.
    rows = (budget - 4 * ALIGNMENT) // max(1, row_bytes)
    if rows > 16:
        rows -= rows % 16
    return max(1, min(num_rows, rows))
