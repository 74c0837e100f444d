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

Pure tensor code; loops over sequences with host lengths (eager only).
"""

from __future__ import annotations

from typing import Any

import torch

from tinyengine.kernels.compressor.reference import entry_slots, token_slots


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
) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D] in q.dtype (rows of padding stay 0)."""
    block_size = kv_cache.shape[1]
    flat_kv = kv_cache.view(-1, kv_cache.shape[-1])
    out = torch.zeros_like(q)
    starts = attn.query_start_loc_cpu
    for i, end in enumerate(attn.seq_lens_cpu):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        table = attn.block_tables[i]
        q_pos = torch.arange(end - (hi - lo), end, device=q.device)  # [q_len]
        first = max(0, end - (hi - lo) - window + 1)
        k_pos = torch.arange(first, end, device=q.device)
        keys = flat_kv[token_slots(table, k_pos, block_size)]
        distance = q_pos[:, None] - k_pos[None, :]
        allowed = (distance >= 0) & (distance < window)  # [q_len, n_raw]
        if entry_cache is not None:
            num_entries = end // ratio
            entries = torch.arange(num_entries, device=q.device)
            flat_entries = entry_cache.view(-1, entry_cache.shape[-1])
            keys = torch.cat(
                [keys, flat_entries[entry_slots(table, entries, ratio, block_size)]], dim=0
            )
            visible = entries[None, :] < ((q_pos + 1) // ratio)[:, None]
            if topk_indices is not None:
                chosen = torch.zeros_like(visible)
                picks = topk_indices[lo:hi]
                rows = torch.arange(hi - lo, device=q.device)[:, None].expand_as(picks)
                valid = picks >= 0
                chosen[rows[valid], picks[valid]] = True
                visible &= chosen
            allowed = torch.cat([allowed, visible], dim=1)
        keys = keys.float()
        logits = torch.einsum("thd,nd->thn", q[lo:hi].float(), keys) * scale
        logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
        sink = sinks.float()[None, :, None].expand(hi - lo, -1, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out[lo:hi] = torch.einsum("thn,nd->thd", probs, keys).to(q.dtype)
    return out
