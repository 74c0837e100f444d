"""Torch reference ops for paged attention: writing K/V into the paged cache and
attending over it with varlen ("ragged") batches.

Owns the numerical definition of the two attention ops that every backend must
match (the Triton kernels are tested against these). Pure tensor code: it must
never import `models/` or `tinyengine/`. Its varlen path loops over sequences
in Python with host-side lengths (eager only); its dense decode path needs no
host lengths and can be captured in a CUDA graph.

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
    slots = slot_mapping.to(torch.long)
    if k.is_cuda and torch.cuda.is_current_stream_capturing():
        # Inside a CUDA graph nothing may sync with the host, so no boolean
        # mask: the runner guarantees graph batches carry no negative slots
        # (padding rows go to its reserved dummy block instead).
        block_ids, offsets = slots // block_size, slots % block_size
        k_cache[block_ids, offsets] = k.to(k_cache.dtype)
        v_cache[block_ids, offsets] = v.to(v_cache.dtype)
        return
    keep = slots >= 0
    # Boolean-mask indexing syncs with the device; acceptable on the eager path.
    rows = torch.arange(slots.shape[0], device=slots.device)[keep]
    slots = slots[keep]
    block_ids = slots // block_size
    offsets = slots % block_size
    # 2-D advanced indexing instead of a flat view: works for caches that are
    # slices of a larger (non-contiguous) allocation too.
    k_cache[block_ids, offsets] = k[rows].to(k_cache.dtype)
    v_cache[block_ids, offsets] = v[rows].to(v_cache.dtype)


def _gather_context(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, scratch: torch.Tensor | None
) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence, as [seq_len, H, D].

    With `scratch` (a workspace view of at least that many blocks) the gather
    lands there instead of in a fresh allocation."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].to(torch.long)
    if scratch is None:
        return cache[blocks].flatten(0, 1)[:seq_len]
    dest = scratch[:num_blocks]
    torch.index_select(cache, 0, blocks, out=dest)
    return dest.flatten(0, 1)[:seq_len]


def _gather_scratch(
    workspace: Any, k_cache: torch.Tensor, v_cache: torch.Tensor, num_rows: int, max_seq_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Workspace views big enough to gather `num_rows` contexts of up to
    max_seq_len tokens each (K and V). The demand depends on the batch shape,
    which is why profile must run the worst shape before the arena is locked."""
    if workspace is None:
        return None, None
    block_size = k_cache.shape[1]
    blocks = num_rows * ((max_seq_len + block_size - 1) // block_size)
    k_buf, v_buf = workspace.get(
        ((blocks, *k_cache.shape[1:]), k_cache.dtype), ((blocks, *v_cache.shape[1:]), v_cache.dtype)
    )
    return k_buf, v_buf


def _decode_dense(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    workspace: Any,
) -> torch.Tensor:
    """Decode (one query per sequence) without any host-side lengths: gather
    every sequence's first cdiv(max_seq_len, block_size) blocks and mask past
    seq_lens on the device. Shapes depend only on (batch, max_seq_len), so this
    path can be captured in a CUDA graph; it reads more than it needs, which is
    why the Triton kernel replaces it on the GPU."""
    num_seqs, num_q_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    table = block_tables[:num_seqs, :num_blocks].reshape(-1).to(torch.long)
    k_buf, v_buf = _gather_scratch(workspace, k_cache, v_cache, num_seqs, max_seq_len)
    if k_buf is None:
        keys, values = k_cache[table], v_cache[table]
    else:
        keys = torch.index_select(k_cache, 0, table, out=k_buf)
        values = torch.index_select(v_cache, 0, table, out=v_buf)
    ctx_len = num_blocks * block_size
    keys = keys.view(num_seqs, ctx_len, num_kv_heads, -1).float()
    values = values.view(num_seqs, ctx_len, num_kv_heads, -1).float()
    group = num_q_heads // num_kv_heads
    qg = q.float().view(num_seqs, num_kv_heads, group, -1)
    scores = torch.einsum("bhgd,bkhd->bhgk", qg, keys) * scale
    beyond = torch.arange(ctx_len, device=q.device)[None, :] >= seq_lens[:, None].to(torch.long)
    scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgk,bkhd->bhgd", probs, values)
    return out.reshape(num_seqs, num_q_heads, -1).to(q.dtype)


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

    Two paths. With host copies of the lengths (`*_cpu`), a per-sequence loop
    gathers exactly each context (eager steps). Without them — a decode batch
    inside a CUDA graph, where nothing may be read on the host — a dense,
    masked decode over max_seq_len. Gathers go to `workspace` scratch when an
    arena is given.
    """
    if query_start_loc_cpu is None or seq_lens_cpu is None:
        if max_query_len != 1:
            raise ValueError(
                "paged_attention (torch reference): without host copies of the lengths only "
                "decode batches (max_query_len == 1) are supported"
            )
        return _decode_dense(
            q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, workspace
        )
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"paged_attention: {num_q_heads} query heads is not a multiple of "
            f"{num_kv_heads} KV heads (GQA needs Hq % Hkv == 0)"
        )
    group = num_q_heads // num_kv_heads
    head_dim_v = v_cache.shape[-1]

    starts, lens = query_start_loc_cpu, seq_lens_cpu
    k_buf, v_buf = _gather_scratch(workspace, k_cache, v_cache, 1, max(lens, default=0))

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
        keys = _gather_context(k_cache, block_tables[i], seq_len, k_buf).float()
        values = _gather_context(v_cache, block_tables[i], seq_len, v_buf).float()
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
