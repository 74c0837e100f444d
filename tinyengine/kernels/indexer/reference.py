"""Torch reference for DeepSeek-V4's lightning indexer (CSA layers).

For a query at position p, the visible compressed entries are w < (p + 1) //
ratio (their windows are complete). Each gets the score

    score[w] = scale * sum_h weight[h] * relu(q[h] . key[w])

(q: the indexer's rotated query heads; key: its compressed keys, paged as in
compressor/reference.py; weight: weights_proj(x) / sqrt(heads)) and the query
keeps the `topk` best, ties to the lower entry id. As Hugging Face's
DeepseekV4Indexer (whose torch.topk leaves ties unspecified): at most
min(topk, entries after this step) per query, future entries never, slots
beyond what a query may see filled with -1.

Pure tensor code. Decode rows (one new token) go together through device
ops only; a sequence with a longer chunk goes alone with host lengths
(compressor/reference.py's split_rows).
"""

from __future__ import annotations

from typing import Any

import torch

from tinyengine.kernels.compressor.reference import entry_slots, entry_tables, split_rows


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    attn: Any,
    *,
    ratio: int,
    topk: int,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """q [T, H, Di], weights [T, H] fp32, key_cache [num_blocks, rows, Di]
    -> int64 [T, topk] entry indices per query, -1 where none."""
    flat = key_cache.view(-1, key_cache.shape[-1])
    rows = key_cache.shape[1]
    split = split_rows(attn)
    num_entries = attn.max_seq_len // ratio
    if split.rows is not None or split.longer or not num_entries:
        out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    if split.num_decode and num_entries:
        # Decode rows: each scores the max_seq_len // ratio entries a sequence
        # of the step can have, those it cannot see yet masked.
        entries = torch.arange(num_entries, device=q.device)
        n = split.num_decode
        slots = entry_slots(split.entry_tables, entries.expand(n, -1), ratio, block_size, rows)
        keys = flat[slots]
        visible = entries[None, :] < (split.seq_lens.long() // ratio)[:, None]
        picked = torch.full((n, topk), -1, dtype=torch.long, device=q.device)
        _choose(picked, split.take(q), split.take(weights), keys, visible, topk, scale)
        if split.rows is None:
            out = picked
        else:
            out.index_copy_(0, split.rows, picked)
    starts = attn.query_start_loc_cpu
    for i in split.longer:
        end = attn.seq_lens_cpu[i]
        lo, hi = starts[i], starts[i + 1]
        if end // ratio == 0:
            continue
        entries = torch.arange(end // ratio, device=q.device)
        keys = flat[entry_slots(entry_tables(attn)[i], entries, ratio, block_size, rows)]
        positions = torch.arange(end - (hi - lo), end, device=q.device)
        visible = entries[None, :] < ((positions + 1) // ratio)[:, None]
        _choose(out[lo:hi], q[lo:hi], weights[lo:hi], keys, visible, topk, scale)
    return out


def _choose(
    out: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
    scale: float,
) -> None:
    """out [n, topk] <- the best visible of keys ([E, Di] shared by the rows,
    or [n, E, Di] per row) for queries q [n, H, Di]."""
    spec = "thd,ed->the" if keys.dim() == 2 else "thd,ted->the"
    scores = torch.relu(torch.einsum(spec, q.float(), keys.float())) * scale
    scores = (scores * weights[:, :, None].float()).sum(dim=1)  # [n, E]
    scores = scores.masked_fill(~visible, float("-inf"))
    k = min(topk, visible.shape[1])
    # Equal scores (all heads' ReLUs at 0 give exact zeros) go to the lower
    # entry id: a stable sort, so the choice never depends on how many
    # entries the row happens to hold.
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    out[:, :k] = torch.where(values[:, :k] == float("-inf"), -1, order[:, :k])
