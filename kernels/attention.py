"""Torch reference ops for paged attention: writing K/V into the paged cache and
attending over it with varlen ("ragged") batches.

Owns the numerical definition of the two attention ops that every backend must
match (the Triton kernels are tested against these). Pure tensor code: it must
never import `models/` or `tinyengine/`, and it is not meant for CUDA graphs
(it loops over sequences in Python and indexes with host-side lengths).

Layout shared by every backend:
    q            [T, Hq, Dk]       T rows = the new tokens of all sequences, concatenated
    k, v         [T, Hkv, Dk|Dv]
    k_cache      [num_blocks, block_size, Hkv, Dk]
    v_cache      [num_blocks, block_size, Hkv, Dv]
    slot_mapping [T] int64         block_id * block_size + offset; < 0 means "do not write"
    block_tables [num_seqs, max_blocks_per_seq] int32
Sequence i owns q rows [query_start_loc[i], query_start_loc[i+1]); those rows are
the LAST q_len_i tokens of its context of seq_lens[i] tokens (see
models/context.py: AttentionMetadata).
"""

from __future__ import annotations

from typing import Any

import torch


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys/values into their cache slots, in place.

    Rows whose slot is negative are padding (e.g. a batch padded up to a
    captured size) and are skipped, so they can never clobber a live block.
    """
    block_size = k_cache.shape[1]
    num_rows = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    # Boolean-mask indexing syncs with the device; acceptable on the reference path.
    rows = torch.arange(num_rows, device=slots.device)[keep]
    slots = slots[keep]
    block_ids = slots // block_size
    offsets = slots % block_size
    # 2-D advanced indexing instead of a flat view: works for caches that are
    # slices of a larger (non-contiguous) allocation too.
    k_cache[block_ids, offsets] = k[rows].to(k_cache.dtype)
    v_cache[block_ids, offsets] = v[rows].to(v_cache.dtype)


def _gather_context(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence, as [seq_len, H, D]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].to(torch.long)
    # TODO(workspace): this gather allocates scratch per call; a later issue
    # routes it through the workspace arena (kernels/workspace.py) so that no
    # hot-path op allocates on its own.
    return cache[blocks].flatten(0, 1)[:seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    query_start_loc_cpu: list[int] | None = None,
    seq_lens_cpu: list[int] | None = None,
    workspace: Any = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context.

    Returns out [T, Hq, Dv] in q.dtype; rows past query_start_loc[-1] (padding)
    are zeros. Math is done in fp32 whatever the storage dtype.

    max_query_len / max_seq_len size the grids of real kernels; the reference
    only uses them to check the batch. `workspace` is accepted for signature
    parity with the Triton ops and ignored here (see _gather_context).
    """
    del workspace  # reference path: see the TODO in _gather_context
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"paged_attention: {num_q_heads} query heads is not a multiple of "
            f"{num_kv_heads} KV heads (GQA needs Hq % Hkv == 0)"
        )
    group = num_q_heads // num_kv_heads
    head_dim_v = v_cache.shape[-1]

    # Host copies avoid one device sync per sequence.
    starts = query_start_loc_cpu if query_start_loc_cpu else query_start_loc.tolist()
    lens = seq_lens_cpu if seq_lens_cpu else seq_lens.tolist()

    out = torch.zeros(num_tokens, num_q_heads, head_dim_v, dtype=q.dtype, device=q.device)
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if q_len > max_query_len or seq_len > max_seq_len or q_len > seq_len:
            raise ValueError(
                f"paged_attention: sequence {i} has q_len={q_len}, seq_len={seq_len} but "
                f"max_query_len={max_query_len}, max_seq_len={max_seq_len} "
                "(the attention metadata is inconsistent)"
            )
        keys = _gather_context(k_cache, block_tables[i], seq_len).float()
        values = _gather_context(v_cache, block_tables[i], seq_len).float()
        # GQA: query head h reads KV head h // group (HF's repeat_kv order).
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)

        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        # Query row j sits at absolute position seq_len - q_len + j and may see
        # keys 0..that position; everything later is the future.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        future = k_pos[None, :] > q_pos[:, None]
        scores.masked_fill_(future[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
