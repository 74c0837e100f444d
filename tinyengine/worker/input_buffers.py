"""The runner's persistent input buffers: worst-case-sized device tensors that
every step writes in place.

Owns their shapes and the one way to fill them. Why persistent: a CUDA graph
replays against the addresses it captured, so a step's inputs must land in
the same tensors every time; allocating fresh input tensors per step would
leave graphs reading stale memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class InputBuffers:
    input_ids: torch.Tensor  # int64 [max_num_batched_tokens]
    positions: torch.Tensor  # int64 [max_num_batched_tokens]
    slot_mapping: torch.Tensor  # int64 [max_num_batched_tokens]
    query_start_loc: torch.Tensor  # int32 [max_num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [max_num_seqs]
    block_tables: torch.Tensor  # int32 [max_num_seqs, max_blocks_per_seq]
    logits_indices: torch.Tensor  # int64 [max_num_seqs]
    # The sampler's draw inside a decode graph reads these (Sampler.stage_graph_draw).
    inv_temperature: torch.Tensor  # fp32 [max_num_seqs]
    seeds: torch.Tensor  # int64 [max_num_seqs]
    # 0, 1, ..., max_num_seqs, never written: a decode graph's rows are one
    # token each, so its query_start_loc is a prefix of this (no per-step copy).
    decode_query_start_loc: torch.Tensor  # int32 [max_num_seqs + 1]
    # The full-history group's table when the model has two cache groups
    # (HybridCacheSpec.keep); block_tables is then the sliding group's.
    entry_block_tables: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int, device) -> InputBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        # A decode graph of max_num_seqs rows reads max_num_seqs token slots,
        # even when max_num_batched_tokens is smaller.
        max_tokens = max(max_tokens, max_seqs)
        return cls(
            input_ids=zeros(max_tokens, dtype=torch.int64),
            positions=zeros(max_tokens, dtype=torch.int64),
            slot_mapping=zeros(max_tokens, dtype=torch.int64),
            query_start_loc=zeros(max_seqs + 1, dtype=torch.int32),
            seq_lens=zeros(max_seqs, dtype=torch.int32),
            block_tables=zeros(max_seqs, max_blocks, dtype=torch.int32),
            logits_indices=zeros(max_seqs, dtype=torch.int64),
            inv_temperature=zeros(max_seqs, dtype=torch.float32),
            seeds=zeros(max_seqs, dtype=torch.int64),
            decode_query_start_loc=torch.arange(max_seqs + 1, dtype=torch.int32, device=device),
        )

    def write_step(self, inputs: Any, pad_slot: int) -> None:
        """A step's StepInputs (worker/step_inputs.py) into the buffers. A
        graph-shaped step is padded to its graph's size with one-token
        sequences whose K/V go to `pad_slot` (in the reserved dummy block):
        they compute garbage that nobody reads and never touch a live block."""
        tables = [self.block_tables]
        if self.entry_block_tables is not None:
            tables.append(self.entry_block_tables)
        for buffer, table in zip(tables, inputs.tables, strict=True):
            rows, width = table.shape
            buffer[:rows, :width].copy_(torch.from_numpy(table), non_blocking=True)
        size = inputs.graph_size
        if size is None:
            # A piecewise-graph step's padding tokens: K/V to pad_slot, and
            # no sequence of the step's metadata owns them.
            tokens = inputs.piecewise_size or 0
            write(self.input_ids, inputs.input_ids, pad_to=tokens)
            write(self.positions, inputs.positions, pad_to=tokens)
            write(self.slot_mapping, inputs.slots, pad_to=tokens, pad=pad_slot)
            write(self.query_start_loc, inputs.query_start_loc)
            write(self.seq_lens, inputs.seq_lens)
            return
        if len(inputs.inflight) < len(inputs.input_ids):
            # (When every row's id is in flight, the runner copies them all
            # on the device; padding rows may read any earlier, valid ids.)
            write(self.input_ids, inputs.input_ids, pad_to=size)
        write(self.positions, inputs.positions, pad_to=size)
        write(self.slot_mapping, inputs.slots, pad_to=size, pad=pad_slot)
        write(self.seq_lens, inputs.seq_lens, pad_to=size, pad=1)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def write(buffer: torch.Tensor, values, pad_to: int = 0, pad: int = 0) -> None:
    """Copy host values (a list, range or int array) into the front of a
    persistent buffer, followed by `pad` up to `pad_to` entries. One numpy
    staging array and one copy: torch.tensor(list) costs twice as much."""
    n = len(values)
    total = max(n, pad_to)
    if total:
        host = np.empty(total, dtype=_NUMPY[buffer.dtype])
        host[:n] = values
        host[n:] = pad
        buffer[:total].copy_(torch.from_numpy(host), non_blocking=True)
