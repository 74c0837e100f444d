"""Torch reference for MLA (multi-head latent attention, DeepSeek-V2/V3) decode
over the paged *latent* cache: the op whose numbers every MLA backend must match
(kernels/mla/triton.py implements the same signature on the GPU).

The latent cache keeps ONE vector per token and layer instead of per-head K
and V: row j of a sequence is [c_j | r_j], where c_j (width L = kv_lora_rank)
is the RMS-normed KV latent and r_j (width R = qk_rope_head_dim) the roped key
part shared by all heads. With the "absorbed" weights (kv_b_proj's K half
folded into the query, its V half applied after attention, see
models/mla.py), decode attends directly over these rows:

    score_j = scale * (q_latent . c_j + q_rope . r_j)      for j < seq_len
    out     = sum_j softmax(score)_j * c_j                  (width L)

Layout:
    q_latent      [B, H, L]      one query row per sequence (decode)
    q_rope        [B, H, R]
    latent_cache  [num_blocks, block_size, 1, L + R]
    block_tables  [B, >= cdiv(max_seq_len, block_size)] int32
    seq_lens      [B] int32, each >= 1

Pure tensor code: never imports `models/` or `tinyengine/`. The decode op
reads no host copies of the lengths and sizes everything from
(B, max_seq_len), so it can be captured in a CUDA graph; it reads every
sequence's first cdiv(max_seq_len, block_size) blocks and masks on the device,
which is why a Triton kernel replaces it on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    workspace: Any = None,
) -> torch.Tensor:
    """Absorbed MLA decode; returns out_latent [B, H, L] in q_latent.dtype.

    Math in fp32 whatever the storage dtype. The gathered latent blocks land in
    `workspace` scratch when an arena is given (sized by B and max_seq_len
    only, so profile's worst decode step sizes it once)."""
    num_seqs, _, latent_dim = q_latent.shape
    block_size, width = latent_cache.shape[1], latent_cache.shape[3]
    if q_rope.shape[:2] != q_latent.shape[:2] or latent_dim + q_rope.shape[2] != width:
        raise ValueError(
            f"mla_decode: q_latent {tuple(q_latent.shape)} and q_rope {tuple(q_rope.shape)} "
            f"do not fit a latent cache of width {width} (expected L + R == width)"
        )
    num_blocks = -(-max_seq_len // block_size)
    if block_tables.shape[1] < num_blocks:
        raise ValueError(
            f"mla_decode: block_tables has {block_tables.shape[1]} columns but max_seq_len="
            f"{max_seq_len} needs {num_blocks} blocks of {block_size}"
        )
    table = block_tables[:num_seqs, :num_blocks].reshape(-1).to(torch.long)
    if workspace is None:
        rows = latent_cache[table]
    else:
        (scratch,) = workspace.get(
            ((num_seqs * num_blocks, *latent_cache.shape[1:]), latent_cache.dtype)
        )
        rows = torch.index_select(latent_cache, 0, table, out=scratch)
    ctx_len = num_blocks * block_size
    rows = rows.view(num_seqs, ctx_len, width).float()
    latent, rope = rows[..., :latent_dim], rows[..., latent_dim:]

    scores = torch.einsum("bhl,bkl->bhk", q_latent.float(), latent)
    scores += torch.einsum("bhr,bkr->bhk", q_rope.float(), rope)
    scores *= scale
    # Positions past a sequence's length hold stale or other sequences' data
    # (the table's tail may point anywhere); they must get zero weight.
    beyond = torch.arange(ctx_len, device=scores.device)[None, :] >= seq_lens[:, None].long()
    scores.masked_fill_(beyond[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhk,bkl->bhl", probs, latent).to(q_latent.dtype)


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head projection: x [T, H, a] @ w [H, a, b] -> [T, H, b] (MLA's
    absorbed weights: the query into latent space, the latent output back)."""
    return torch.einsum("tha,hab->thb", x, w)
