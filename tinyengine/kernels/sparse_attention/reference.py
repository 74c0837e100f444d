"""Torch reference for DeepSeek-V4 attention over its paged caches.

One KV head shared by all query heads, K = V (the roped, normed kv row). A
query at position p attends to
  - raw rows of the last `window` positions, (p - window, p], from kv_cache
    [num_blocks, block_size, D] (paged per token, the engine's block table);
  - with `ratio` (CSA / HCA layers), compressed entries from entry_cache
    (paged as in compressor/reference.py): every entry whose window is
    complete, w < (p + 1) // ratio (HCA), or only those of its indexer's top
    k (CSA: `topk_indices` [T, k], -1 = none);
  - and a per-head learned sink: one more logit in the softmax with no value.
As Hugging Face's eager_attention_forward for DeepseekV4 (the sink logit
joins the max and the normalisation, then is dropped).

Pure tensor code. Decode rows (one new token) go together through device
ops only, at fixed sizes (window rows; the top-k picks, or every entry
max_seq_len allows); a sequence with a longer chunk goes alone with host
lengths (compressor/reference.py's split_rows), in tiles of 256 queries that
each read only the raw rows their windows reach.
"""

from __future__ import annotations

from typing import Any

import torch

from tinyengine.kernels.compressor.reference import (
    entry_slots,
    entry_tables,
    split_rows,
    token_slots,
)


def sparse_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: Any,
    *,
    window: int,
    sinks: torch.Tensor,
    scale: float,
    entry_cache: torch.Tensor | None = None,
    ratio: int = 0,
    topk_indices: torch.Tensor | None = None,
    workspace: Any = None,
) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D] in q.dtype (rows of padding stay 0).
    `workspace` is unused (the Triton op's scratch arena; same signature)."""
    block_size = kv_cache.shape[1]
    flat_kv = kv_cache.view(-1, kv_cache.shape[-1])
    flat_entries = None if entry_cache is None else entry_cache.view(-1, entry_cache.shape[-1])
    rows = 0 if entry_cache is None else entry_cache.shape[1]
    split = split_rows(attn)
    if split.rows is not None or split.longer:
        out = torch.zeros_like(q)  # padding rows stay 0
    if split.num_decode:
        # Decode rows: one query per row at p = seq_len - 1; the window's
        # `window` positions and the entries are gathered at fixed sizes,
        # what a row may not see masked.
        tables = split.tables
        pos = split.seq_lens.long() - 1
        k_pos = pos[:, None] - torch.arange(window - 1, -1, -1, device=q.device)  # [n, W]
        keys = flat_kv[token_slots(tables, k_pos.clamp(min=0), block_size)]
        allowed = k_pos >= 0
        if flat_entries is not None:
            if topk_indices is not None:
                chosen = split.take(topk_indices)
                picks, seen = chosen.clamp(min=0), chosen >= 0
            else:
                picks = torch.arange(attn.max_seq_len // ratio, device=q.device)
                picks = picks.expand(split.num_decode, -1)
                seen = picks < ((pos + 1) // ratio)[:, None]
            slots = entry_slots(split.entry_tables, picks, ratio, block_size, rows)
            entry_keys = flat_entries[slots]
            keys, allowed = torch.cat([keys, entry_keys], 1), torch.cat([allowed, seen], 1)
        attended = _attend(split.take(q), [(keys, allowed)], sinks, scale)
        if split.rows is None:
            return attended
        out.index_copy_(0, split.rows, attended)
    attend_longer(
        out, q, kv_cache, attn, split.longer, window=window, sinks=sinks, scale=scale,
        entry_cache=entry_cache, ratio=ratio, topk_indices=topk_indices,
    )  # fmt: skip
    return out


def attend_longer(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: Any,
    seqs: list[int],
    *,
    window: int,
    sinks: torch.Tensor,
    scale: float,
    entry_cache: torch.Tensor | None = None,
    ratio: int = 0,
    topk_indices: torch.Tensor | None = None,
) -> None:
    """The rows of sequences `seqs` (each with a longer chunk; host lengths
    from attn) into out [T, H, D], one sequence at a time."""
    block_size = kv_cache.shape[1]
    flat_kv = kv_cache.view(-1, kv_cache.shape[-1])
    flat_entries = None if entry_cache is None else entry_cache.view(-1, entry_cache.shape[-1])
    rows = 0 if entry_cache is None else entry_cache.shape[1]
    starts = attn.query_start_loc_cpu
    for i in seqs:
        end = attn.seq_lens_cpu[i]
        lo, hi = starts[i], starts[i + 1]
        table = attn.block_tables[i]
        entries = entry_keys = None
        if flat_entries is not None and end >= ratio:  # some window complete
            entries = torch.arange(end // ratio, device=q.device)
            slots = entry_slots(entry_tables(attn)[i], entries, ratio, block_size, rows)
            entry_keys = flat_entries[slots]
        # Query tiles: each reads the raw rows its window can reach, so the
        # work is q_len x (tile + window), not q_len squared.
        for t0 in range(lo, hi, _QUERY_TILE):
            t1 = min(t0 + _QUERY_TILE, hi)
            q_pos = torch.arange(end - (hi - t0), end - (hi - t1), device=q.device)
            first = max(0, end - (hi - t0) - window + 1)
            k_pos = torch.arange(first, end - (hi - t1), device=q.device)
            distance = q_pos[:, None] - k_pos[None, :]
            parts = [(flat_kv[token_slots(table, k_pos, block_size)],
                      (distance >= 0) & (distance < window))]  # fmt: skip
            if entry_keys is not None:
                visible = entries[None, :] < ((q_pos + 1) // ratio)[:, None]
                if topk_indices is None:
                    parts.append((entry_keys, visible))
                else:  # only the indexer's picks, gathered per query
                    picks = topk_indices[t0:t1]
                    parts.append((entry_keys[picks.clamp(min=0)], picks >= 0))
            out[t0:t1] = _attend(q[t0:t1], parts, sinks, scale)


_QUERY_TILE = 256


def _attend(
    q: torch.Tensor,
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [n, H, D] over one softmax across several key sets (keys = values):
    each (keys, allowed [n, K]) with keys [K, D] shared by the rows or
    [n, K, D] per row; plus a sink logit per head. -> [n, H, D] in q.dtype."""
    qf = q.float()
    logits = []
    for keys, allowed in parts:
        spec = "thd,kd->thk" if keys.dim() == 2 else "thd,tkd->thk"
        part = torch.einsum(spec, qf, keys.float()) * scale
        logits.append(part.masked_fill(~allowed[:, None, :], float("-inf")))
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat([*logits, sink], dim=-1).softmax(dim=-1)
    out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
    start = 0
    for (keys, _), part in zip(parts, logits, strict=True):
        width = part.shape[-1]
        spec = "thk,kd->thd" if keys.dim() == 2 else "thk,tkd->thd"
        out += torch.einsum(spec, probs[..., start : start + width], keys.float())
        start += width
    return out.to(q.dtype)
