"""Triton compressor (DeepSeek-V4 CSA/HCA layers and the CSA indexer) for
decode rows: the ops `compress_windows` and `write_and_compress`, whose
meaning and paged layout are kernels/compressor/reference.py's; same
signatures, so models never know which runs.

Why a kernel. A decode step's compressor is ~25 tiny torch ops per layer and
per indexer (gather the window's state rows, split the halves, bias, mask,
softmax, weighted sum, RMS norm, RoPE, scatter), each a launch reading a few
KB: batch-1 decode is launch bound. `_compress_kernel` does the lot in one
launch, and `write_and_compress` folds the state-row write (write_rows) into
it too, so one compressor step is one launch after its two projections.

Shape. One program per decode row (p = seq_len - 1), all of D (512 for
CSA/HCA entries, 128 for the indexer) in one program, because the RMS norm
reduces over D: splitting D across programs would need a second pass. The
row computes only when its token completes window w = (p + 1) / ratio - 1;
a row that completes none exits at once and writes no entry (the
reference writes those to the reserved dummy block, which only padding rows
read, because torch cannot choose per row; a kernel can). HCA's 128-token
window is therefore read once per 128 steps, not every step. The window's
slots (2 * ratio with overlap: window w - 1's Ca halves, then w's Cb halves;
ratio without) are gathered BLOCK_J at a time through the sliding table
as [BLOCK_J, D / 2, 2] tiles (channel pairs on the last axis, so the
interleaved RoPE pairs sit in one thread without a shuffle), with an online
softmax per channel across tiles; positions before 0 (window 0's missing
predecessor) are masked out of the load and weigh nothing, as the
reference's -inf gate. Then the RMS norm with its weight, RoPE on the last
rope_dim channels at position w * ratio from the [cos | sin] table, and the
store through the entry table to the block of the window's last token.

Fused write: each program first stores its own token's [kv | gate] row at
slot_mapping[row] (skipped for negative slots, as write_rows does eagerly),
then a CTA barrier makes it visible to the program's own gathers: a window
reads only its own sequence's rows, so no other program's write matters.

Graph safety: no host reads of device tensors, grid = (rows,) and tile
sizes from host ints, no allocation. An eager step's sequences with a
longer chunk go through the reference's loop (reference.compress_longer);
an eager step with any such sequence writes its state rows with
reference.write_rows first.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tinyengine.kernels.compressor.reference import (
    check_ratio,
    compress_longer,
    split_rows,
    write_rows,
)

# Slots x channels per gathered tile: 4096 fp32 values (e.g. CSA's whole
# 8-slot window at D 512, or HCA's 128-slot window in 16 steps), ~32 values
# per thread per tile at 4 warps, enough in flight for a gather.
_TILE_VALUES = 4096
_NUM_WARPS = 4
_WRITE_BLOCK = 1024  # channels of the state row stored per step (fused write)


@triton.jit
def _compress_kernel(
    state_ptr, entry_ptr, seq_lens_ptr, seqs_ptr, table_ptr, entry_table_ptr,
    bias_ptr, weight_ptr, cos_sin_ptr, kv_ptr, gate_ptr, slots_ptr, eps,
    stride_sb, stride_ss, stride_eb, stride_er, stride_tb, stride_etb,
    stride_bias, stride_cs, stride_kv, stride_gate,
    RATIO: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DIM: tl.constexpr, C: tl.constexpr, SPAN: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr, WRITE: tl.constexpr, WRITE_BLOCK: tl.constexpr,
    HAS_SEQS: tl.constexpr,
):  # fmt: skip
    """Grid (rows,): row b's entry, if its token completes a window. With
    WRITE, first its token's state row [kv[b] | gate[b]] at slots[b]. A
    state row is [kv | gate], C channels each (2 * DIM with overlap); a
    window SPAN slots (2 * RATIO with overlap). Row b reads table rows
    seqs[b] (HAS_SEQS) or b."""
    row = tl.program_id(0)
    seq = row.to(tl.int64)
    if HAS_SEQS:
        seq = tl.load(seqs_ptr + row).to(tl.int64)
    if WRITE:
        slot = tl.load(slots_ptr + row)
        if slot >= 0:
            own = state_ptr + (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_ss
            offs = tl.arange(0, WRITE_BLOCK)
            for c0 in range(0, C, WRITE_BLOCK):
                c = c0 + offs
                new_kv = tl.load(kv_ptr + row.to(tl.int64) * stride_kv + c, mask=c < C)
                new_gate = tl.load(gate_ptr + row.to(tl.int64) * stride_gate + c, mask=c < C)
                tl.store(own + c, new_kv, mask=c < C)
                tl.store(own + C + c, new_gate, mask=c < C)
        # The row just stored is the window's last slot, read back below by
        # other threads of this program.
        tl.debug_barrier()
    p = tl.load(seq_lens_ptr + row) - 1
    # A row of length 0 (padding in the row model) closes no window.
    if (p >= 0) & ((p + 1) % RATIO == 0):
        w = (p + 1) // RATIO - 1
        first = (w - 1) * RATIO if OVERLAP else w * RATIO
        table_row = table_ptr + seq * stride_tb
        offs_p = tl.arange(0, BLOCK_P)
        offs_k = tl.arange(0, 2)
        chan = offs_p[:, None] * 2 + offs_k[None, :]  # [BLOCK_P, 2]
        chan_ok = chan < DIM
        m_i = tl.full([BLOCK_P, 2], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_P, 2], tl.float32)
        acc = tl.zeros([BLOCK_P, 2], tl.float32)
        for j0 in range(0, SPAN, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            pos = first + j
            ok = (j < SPAN) & (pos >= 0)
            safe = tl.maximum(pos, 0)
            block = tl.load(table_row + safe // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
            base = state_ptr + block * stride_sb + (safe % BLOCK_SIZE) * stride_ss
            if OVERLAP:  # window w - 1's slots through Ca, w's through Cb
                half = tl.where(j < RATIO, 0, DIM)
            else:
                half = j * 0
            col = half[:, None, None] + chan[None, :, :]  # [BLOCK_J, BLOCK_P, 2]
            mask = ok[:, None, None] & chan_ok[None, :, :]
            ptrs = base[:, None, None] + col
            kv = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(ptrs + C, mask=mask, other=0.0).to(tl.float32)
            bias_ptrs = bias_ptr + (j % RATIO)[:, None, None] * stride_bias + col
            gate += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
            gate = tl.where(mask, gate, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(gate, axis=0))
            # A tile with every slot masked (window 0's Ca half) leaves -inf:
            # shift by 0 then, so exp gives 0 rather than NaN.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - shift)
            weights = tl.exp(gate - shift[None, :, :])
            l_i = l_i * alpha + tl.sum(weights, axis=0)
            acc = acc * alpha + tl.sum(weights * kv, axis=0)
            m_i = m_new
        pooled = tl.where(chan_ok, acc / l_i, 0.0)
        mean_sq = tl.sum(tl.sum(pooled * pooled, axis=1), axis=0) / DIM
        norm_w = tl.load(weight_ptr + chan, mask=chan_ok, other=0.0).to(tl.float32)
        pooled = pooled * tl.rsqrt(mean_sq + eps) * norm_w
        # RoPE at w * ratio on the pairs of the last ROPE_DIM channels; the
        # others get cos 1, sin 0, which leaves them exactly as they are.
        i = offs_p - (DIM - ROPE_DIM) // 2
        rope = (i >= 0) & (offs_p < DIM // 2)
        cs_row = cos_sin_ptr + (w * RATIO).to(tl.int64) * stride_cs
        cos = tl.load(cs_row + i, mask=rope, other=1.0).to(tl.float32)
        sin = tl.load(cs_row + ROPE_DIM // 2 + i, mask=rope, other=0.0).to(tl.float32)
        even = tl.sum(tl.where(offs_k[None, :] == 0, pooled, 0.0), axis=1)
        odd = tl.sum(tl.where(offs_k[None, :] == 1, pooled, 0.0), axis=1)
        out = tl.where(
            offs_k[None, :] == 0,
            (even * cos - odd * sin)[:, None],
            (odd * cos + even * sin)[:, None],
        )
        last = (w + 1) * RATIO - 1
        entry_row = entry_table_ptr + seq * stride_etb
        entry_block = tl.load(entry_row + last // BLOCK_SIZE).to(tl.int64)
        dst = entry_ptr + entry_block * stride_eb + ((last % BLOCK_SIZE) // RATIO) * stride_er
        tl.store(dst + chan, out.to(entry_ptr.dtype.element_ty), mask=chan_ok)


def compress_windows(
    state_cache: torch.Tensor,
    entry_cache: torch.Tensor,
    attn: Any,
    *,
    ratio: int,
    overlap: bool,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
) -> None:
    """Same contract as reference.compress_windows, except that decode rows
    completing no window leave the dummy block alone."""
    check_ratio(ratio, state_cache.shape[1])
    kwargs = dict(ratio=ratio, overlap=overlap, position_bias=position_bias,
                  norm_weight=norm_weight, eps=eps, cos_sin=cos_sin)  # fmt: skip
    split = split_rows(attn)
    if split.num_decode:
        compress_decode(state_cache, entry_cache, split.seq_lens, split.tables,
                        split.entry_tables, **kwargs)  # fmt: skip
    if split.longer:
        compress_longer(state_cache, entry_cache, attn, split.longer, **kwargs)


def write_and_compress(
    state_cache: torch.Tensor,
    entry_cache: torch.Tensor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    attn: Any,
    *,
    ratio: int,
    overlap: bool,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
) -> None:
    """Same contract as reference.write_and_compress: one launch when every
    row is a decode row (a graph-shaped step, or an eager one of decode rows
    only); else write_rows, then compress_windows."""
    check_ratio(ratio, state_cache.shape[1])
    kwargs = dict(ratio=ratio, overlap=overlap, position_bias=position_bias,
                  norm_weight=norm_weight, eps=eps, cos_sin=cos_sin)  # fmt: skip
    split = split_rows(attn)
    if split.rows is None and not split.longer and kv.shape[0] == split.num_decode:
        compress_decode(state_cache, entry_cache, split.seq_lens, split.tables,
                        split.entry_tables, write=(kv, gate, attn.slot_mapping),
                        **kwargs)  # fmt: skip
        return
    write_rows(state_cache, torch.cat([kv, gate], dim=-1), attn.slot_mapping)
    compress_windows(state_cache, entry_cache, attn, **kwargs)


def compress_decode(
    state_cache: torch.Tensor,
    entry_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    entry_tables: torch.Tensor,
    *,
    ratio: int,
    overlap: bool,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    seqs: torch.Tensor | None = None,
    block_j: int | None = None,
) -> None:
    """The entries of n decode rows (row i: token at seq_lens[i] - 1, state
    through tables[j], entries through entry_tables[j], j = seqs[i], or i
    without seqs), each written only if the row completes its window.
    write=(kv, gate, slot_mapping), [n, C] [n, C] [n]: first store each
    row's state there. block_j overrides the slots per tile (tests)."""
    n = seq_lens.shape[0]
    dim = entry_cache.shape[-1]
    width = 2 * dim if overlap else dim
    rope_dim = cos_sin.shape[-1]
    if state_cache.shape[-1] != 2 * width or position_bias.shape != (ratio, width):
        raise ValueError(
            f"compressor: state rows of {state_cache.shape[-1]} and position_bias "
            f"{tuple(position_bias.shape)} do not fit D={dim}, ratio={ratio}, overlap={overlap}"
        )
    if rope_dim % 2 or rope_dim > dim or (dim - rope_dim) % 2:
        raise ValueError(f"compressor: rope_dim {rope_dim} does not fit D={dim}")
    tensors = (state_cache, entry_cache, position_bias, norm_weight, cos_sin)
    if write is not None:
        tensors += write[:2]
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("compressor: the last dim of every cache and parameter must be contiguous")
    if n == 0:
        return
    kv, gate, slots = write if write is not None else (state_cache, state_cache, seq_lens)
    block_p = triton.next_power_of_2(max(dim, 2)) // 2
    span = 2 * ratio if overlap else ratio
    block_j = block_j or max(1, min(triton.next_power_of_2(span), _TILE_VALUES // (2 * block_p)))
    _compress_kernel[(n,)](
        state_cache, entry_cache, seq_lens, seq_lens if seqs is None else seqs, tables,
        entry_tables,
        position_bias, norm_weight, cos_sin, kv, gate, slots, eps,
        state_cache.stride(0), state_cache.stride(1), entry_cache.stride(0),
        entry_cache.stride(1), tables.stride(0), entry_tables.stride(0),
        position_bias.stride(0), cos_sin.stride(0), kv.stride(0), gate.stride(0),
        RATIO=ratio, OVERLAP=overlap, BLOCK_SIZE=state_cache.shape[1], DIM=dim, C=width,
        SPAN=span, ROPE_DIM=rope_dim, BLOCK_J=block_j, BLOCK_P=block_p, WRITE=write is not None,
        WRITE_BLOCK=min(_WRITE_BLOCK, triton.next_power_of_2(width)), HAS_SEQS=seqs is not None,
        num_warps=_NUM_WARPS,
    )  # fmt: skip
