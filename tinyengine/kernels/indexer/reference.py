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

Ties. torch.topk on float scores leaves the order of equal scores open, and a
stable sort of every score costs far more than a top-k. So each score and its
entry id are packed into one int64 (`pack_scores`) that orders by score
descending, then id ascending: every key is distinct, torch.topk on the keys
picks exactly what the stable sort would, and `unpack_picks` recovers the ids.
The Triton kernel (indexer/triton.py) writes the same keys.

Pure tensor code. Decode rows (one new token) go together through device
ops only; a sequence with a longer chunk goes alone with host lengths
(compressor/reference.py's split_rows) through `choose_longer`.
"""

from __future__ import annotations

from typing import Any

import torch

from tinyengine.kernels.compressor.reference import entry_slots, entry_tables, split_rows

_LOW = (1 << 32) - 1  # the id field of a packed key
# The high half of the key of a -inf score: fp32 bits 0xFF800000 as int32,
# negative, so their magnitude bits are flipped (see pack_scores).
NEG_INF_HI = (0xFF800000 - (1 << 32)) ^ 0x7FFFFFFF


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
    workspace: Any = None,
) -> torch.Tensor:
    """q [T, H, Di], weights [T, H] fp32, key_cache [num_blocks, rows, Di]
    -> int64 [T, topk] entry indices per query, -1 where none. `workspace`
    is the Triton op's scratch arena, unused here."""
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
    choose_longer(out, q, weights, key_cache, attn, split.longer, ratio=ratio, topk=topk,
                  scale=scale, block_size=block_size)  # fmt: skip
    return out


def choose_longer(
    out: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    attn: Any,
    seqs: list[int],
    *,
    ratio: int,
    topk: int,
    scale: float,
    block_size: int,
) -> None:
    """out[rows of sequence i] <- the picks of its queries, for each i in
    `seqs` (sequences with a longer chunk, split_rows' `longer`), one by one
    with host lengths. `out` must hold -1 in those rows beforehand."""
    flat = key_cache.view(-1, key_cache.shape[-1])
    rows = key_cache.shape[1]
    starts = attn.query_start_loc_cpu
    for i in seqs:
        end = attn.seq_lens_cpu[i]
        lo, hi = starts[i], starts[i + 1]
        if end // ratio == 0:
            continue
        entries = torch.arange(end // ratio, device=q.device)
        keys = flat[entry_slots(entry_tables(attn)[i], entries, ratio, block_size, rows)]
        positions = torch.arange(end - (hi - lo), end, device=q.device)
        visible = entries[None, :] < ((positions + 1) // ratio)[:, None]
        _choose(out[lo:hi], q[lo:hi], weights[lo:hi], keys, visible, topk, scale)


def pack_scores(scores: torch.Tensor) -> torch.Tensor:
    """fp32 [..., E] -> int64 [..., E] keys whose order is (score descending,
    then entry id ascending) under plain signed comparison.

    High 32 bits: the score's bits as an int32 made order-preserving (a
    positive float's bits already grow with it; a negative one's grow with
    its magnitude, so its 31 magnitude bits are flipped). -0.0 becomes +0.0
    first: the two are equal scores, and must tie. Low 32 bits: 2^32 - 1 -
    id, so among equal scores the lower id has the larger key."""
    bits = scores.float().contiguous().view(torch.int32)
    # On the bits, so that no flush of denormals to zero can change a key.
    bits = torch.where((bits & 0x7FFFFFFF) == 0, 0, bits)
    high = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    ids = torch.arange(scores.shape[-1], device=scores.device)
    return (high << 32) | (_LOW - ids)


def unpack_picks(keys: torch.Tensor) -> torch.Tensor:
    """Entry ids of packed keys, -1 where the score was -inf (not visible)."""
    ids = _LOW - (keys & _LOW)
    return torch.where((keys >> 32) == NEG_INF_HI, -1, ids)


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
    # entry id, so the choice never depends on how many entries the row
    # happens to hold: the packed keys are distinct and encode that order.
    out[:, :k] = unpack_picks(pack_scores(scores).topk(k, dim=-1).values)
