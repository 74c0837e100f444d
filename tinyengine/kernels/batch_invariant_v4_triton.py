"""DeepSeek-V4's ops in the batch-invariant op set on the GPU
(kernels/batch_invariant_triton.py): the Triton V4 kernels, kept to the
forms whose bits for one query row cannot depend on the rest of the step.

Every V4 kernel already runs each query row, a decode row or a token of a
prefill chunk alike, as the decode row it is (kernels/sparse_attention/
rows.py, the row model), one program per row with tiles fixed by the
model's widths. What is left to fix is where a step's shape still reaches
a row's arithmetic:

  - Sparse attention (`sparse_attention`): one split per row. The split
    count follows the step (enough programs to fill the SMs) and cuts a
    row's key list [window | entries or picks] into that many sums, so it
    is fixed at 1: each row walks its keys in 64-key tiles from the first,
    one online-softmax update a tile, and applies the sink itself.
  - The compressor (`write_and_compress`): an entry must have the same bits
    whether its window closes at a decode row or inside a prefill chunk.
    The Triton set computes a chunk's windows with the torch reference's
    loop; here every row of a chunk goes through the decode rows' kernel:
    the step's state rows first (a copy), then one launch over every row,
    each reading its own sequence's table rows through the row -> sequence
    map (no per-row copy of the tables). Rows that close no window write
    nothing, as at decode.
  - The indexer (`indexer_topk`, unchanged): an entry's score is its key's
    product with the row's query in a tile of fixed shape (each output of a
    tensor-core product is reduced over the head dim in one order whatever
    the other rows of the tile hold), summed over the heads in one order,
    and the select is exact with ties to the lower entry id. So neither the
    step's width (max_seq_len // ratio) nor an eager step's row blocks
    change a pick.
  - Hyper-connections (`mhc_pre`, `mhc_head`, `mhc_post`, unchanged): one
    program per token on a GPU.

Per-token torch code a V4 layer runs outside the ops (projections, norms,
routing) goes through OpSet.per_token on fixed row blocks, as in the torch
set (kernels/batch_invariant.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tinyengine.kernels.compressor import triton as compressor
from tinyengine.kernels.compressor.reference import entry_tables, write_rows
from tinyengine.kernels.sparse_attention.rows import query_rows
from tinyengine.kernels.sparse_attention.triton import launch_sparse_attention


def sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn: Any, **kw: Any) -> torch.Tensor:
    """sparse_attention/triton.py's, one split per row (module docstring)."""
    return launch_sparse_attention(q, kv_cache, attn, num_splits=1, **kw)


def write_and_compress(
    state_cache: torch.Tensor, entry_cache: torch.Tensor, kv: torch.Tensor,
    gate: torch.Tensor, attn: Any, **kw: Any,
) -> None:  # fmt: skip
    """compressor/triton.py's write_and_compress with a chunk's windows closed
    by the decode rows' kernel too (module docstring)."""
    rows = query_rows(attn)
    if rows.seqs is None:  # decode rows only: the Triton set's one fused launch
        compressor.write_and_compress(state_cache, entry_cache, kv, gate, attn, **kw)
        return
    if kv.shape[0] != rows.num_rows:
        raise ValueError(f"compressor: {rows.num_rows} query rows, kv has {kv.shape[0]}")
    write_rows(state_cache, torch.cat([kv, gate], dim=-1), attn.slot_mapping)
    compressor.compress_decode(
        state_cache, entry_cache, rows.seq_lens, attn.block_tables, entry_tables(attn),
        seqs=rows.seqs, **kw,
    )  # fmt: skip


def with_v4_triton_ops(ops: Any) -> Any:
    """The batch-invariant Triton set `ops` with DeepSeek-V4's ops made invariant."""
    return dataclasses.replace(
        ops, sparse_attention=sparse_attention, write_and_compress=write_and_compress
    )
