"""Triton MLA (multi-head latent attention) decode over the paged latent cache:
a split-KV kernel that shares every loaded latent tile among a block of heads,
plus the reduce that merges the splits.

Owns the GPU implementation of `mla_decode`, whose numerical definition (and
layout) lives in kernels/mla.py, the torch reference; the signature is the
same, so models/mla.py never knows which backend runs.

Must never (each one breaks CUDA-graph capture or replay):
  - read a device tensor on the host (.item(), .tolist(), boolean indexing);
  - size a grid or pick a kernel from tensor *contents*: the split count comes
    only from host ints (B, H, max_seq_len, the SM count);
  - allocate scratch outside the workspace arena when one is given (the output
    is allocated with torch.empty; that is the caller's tensor, not scratch).

Indexing. Row j of sequence b sits at
    latent_cache[block_tables[b, j // block_size], j % block_size, 0, :]
and holds [c_j (L) | r_j (R)]. One program owns (sequence b, BLOCK_H heads,
split s): it walks its chunk of the context BLOCK_N rows at a time, loading a
[BLOCK_N, L] latent tile and a [BLOCK_N, R] rope tile once for all BLOCK_H
heads (MLA has a single "KV head", so this is GQA with group = H):

    scores [BLOCK_H, BLOCK_N] = q_latent [BLOCK_H, L] @ c^T + q_rope [BLOCK_H, R] @ r^T
    acc    [BLOCK_H, L]      += softmax-weights [BLOCK_H, BLOCK_N] @ c

Numerics: softmax bookkeeping in fp32 in the log2 domain (scale * log2(e)
folded into one multiplier, exp2 instead of exp); on the GPU the dots take the
storage dtype (bf16 tensor cores) and accumulate in fp32. Under
TRITON_INTERPRET=1 tiles are upcast to fp32 right after tl.load because the
interpreter computes bf16 math wrongly.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.triton_attention import LOG2E, _interpreting, _num_sms

# Split heuristic, same shape as the GQA decode one in kernels/triton_attention.py
# (not yet swept for MLA on the H200): no split once the batch alone gives >= 2
# (seq, head-block) programs per SM, else aim for ~4 programs per SM, never a
# split shorter than _MIN_SPLIT_TOKENS of max_seq_len.
_NO_SPLIT_PROGRAMS_PER_SM = 2
_TARGET_PROGRAMS_PER_SM = 4
_MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# 16 heads share a tile: the smallest tl.dot M, and a [16, 512] fp32
# accumulator is 64 registers per thread at 4 warps. Larger head blocks would
# re-read less from L2 but spill at L = 512.
_BLOCK_H = 16
_BLOCK_N = 32


# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["num_splits"])  # one compile for any split count
def _mla_split_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits, num_heads,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_cb, stride_cs, stride_bt,
    stride_ob, stride_oh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DIRECT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid (B, cdiv(H, BLOCK_H), num_splits).

    DIRECT (num_splits == 1): write the normalized output straight to `out`.
    Otherwise write the chunk's normalized partial output and its log2-sum-exp
    to part_out[b, h, s, :] / part_lse[b, h, s] (contiguous [B, H, S, (L)]);
    a split past the sequence's end writes lse = -inf and nothing else.
    """
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Split boundaries come from the *device* seq_len (rounded to whole tiles),
    # so one grid sized from max_seq_len spreads any actual length over the
    # splits; trailing splits of a short sequence are empty.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    head = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = head < num_heads
    part_idx = (seq * num_heads + head).to(tl.int64) * num_splits + split
    if not DIRECT:
        if start >= end:
            tl.store(
                part_lse_ptr + part_idx, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_ok
            )
            return

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < LATENT  # L need not be a power of two: pad columns read 0
    r_ok = offs_r < ROPE
    ql_ptrs = q_lat_ptr + seq.to(tl.int64) * stride_qlb + head[:, None] * stride_qlh
    q_lat = tl.load(ql_ptrs + offs_l[None, :], mask=h_ok[:, None] & l_ok[None, :], other=0.0)
    qr_ptrs = q_rope_ptr + seq.to(tl.int64) * stride_qrb + head[:, None] * stride_qrh
    q_rope = tl.load(qr_ptrs + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        # Paged gather: a tile may straddle cache blocks, so each row looks up
        # its own block id. Masked rows read block 0 but load nothing.
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        lat = tl.load(
            row[:, None] + offs_l[None, :], mask=pos_ok[:, None] & l_ok[None, :], other=0.0
        )
        rope = tl.load(
            row[:, None] + LATENT + offs_r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0
        )
        if UPCAST:
            lat = lat.to(tl.float32)
            rope = rope.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(lat))
        s = tl.dot(q_rope, tl.trans(rope), s)
        s = s * qk_scale
        # Rows past `end` may hold another sequence's data: zero weight.
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        # Every tile has >= 1 live row (start < end), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(lat.dtype), lat, acc)
        m_i = m_new

    # l_i == 0 only for an empty context (seq_len 0, a padding row): output 0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_mask = h_ok[:, None] & l_ok[None, :]
    if DIRECT:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh
        tl.store(o_ptrs + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(part_lse_ptr + part_idx, m_i + tl.log2(l_i), mask=h_ok)
        p_ptrs = part_out_ptr + (part_idx * LATENT)[:, None] + offs_l[None, :]
        tl.store(p_ptrs, out, mask=o_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, num_splits, stride_ob, stride_oh,
    LATENT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Grid (B, H): out = sum_s w_s * part_s / sum_s w_s, w_s = 2^(lse_s - max lse).

    The weights come from one [BLOCK_S] load; the [L]-wide partials are then
    summed one split at a time (a [BLOCK_S, 512] fp32 tile would not fit in
    registers). Dead splits (lse = -inf) get weight 0 and their unwritten
    partials are never loaded."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + base + s, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
    denom = tl.sum(tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0), 0)
    offs_l = tl.arange(0, BLOCK_L)
    l_ok = offs_l < LATENT
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for i in range(0, num_splits):
        lse_i = tl.load(part_lse_ptr + base + i)
        w = tl.where(lse_i > float("-inf"), tl.exp2(lse_i - m), 0.0)
        # Broadcast the scalar liveness to a vector mask (the interpreter
        # cannot `&` a scalar bool with a tensor).
        live = (tl.zeros([BLOCK_L], dtype=tl.float32) + lse_i) > float("-inf")
        part = tl.load(part_out_ptr + (base + i) * LATENT + offs_l, mask=l_ok & live, other=0.0)
        acc += w * part
    out = acc / tl.where(denom == 0.0, 1.0, denom)
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_l
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=l_ok)


# ----------------------------------------------------------------------------- launchers


def mla_num_splits(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split count from host ints only, so a CUDA graph captured for a batch
    size stays valid for any seq_lens up to max_seq_len."""
    programs = num_seqs * triton.cdiv(num_heads, _BLOCK_H)
    if programs >= _NO_SPLIT_PROGRAMS_PER_SM * num_sms:
        return 1
    target = _TARGET_PROGRAMS_PER_SM * num_sms
    most = max(1, max_seq_len // _MIN_SPLIT_TOKENS)
    return max(1, min(triton.cdiv(target, programs), most, MAX_SPLITS))


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
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Same contract as kernels.mla.mla_decode; returns [B, H, L] in q_latent.dtype.

    num_splits / block_h / block_n override the heuristics (tests and tuning)."""
    num_seqs, num_heads, latent_dim = q_latent.shape
    block_size, width = latent_cache.shape[1], latent_cache.shape[3]
    rope_dim = q_rope.shape[2]
    if q_rope.shape[:2] != q_latent.shape[:2] or latent_dim + rope_dim != width:
        raise ValueError(
            f"mla_decode: q_latent {tuple(q_latent.shape)} and q_rope {tuple(q_rope.shape)} "
            f"do not fit a latent cache of width {width} (expected L + R == width)"
        )
    if block_tables.shape[1] < triton.cdiv(max_seq_len, block_size):
        raise ValueError(
            f"mla_decode: block_tables has {block_tables.shape[1]} columns but max_seq_len="
            f"{max_seq_len} needs {triton.cdiv(max_seq_len, block_size)} blocks of {block_size}"
        )
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1 or latent_cache.stride(-1) != 1:
        raise ValueError(
            "mla_decode: the last dim of q_latent, q_rope and the cache must be contiguous"
        )
    if block_tables.stride(1) != 1 or seq_lens.stride(0) != 1:
        raise ValueError("mla_decode: block_tables rows and seq_lens must be contiguous")
    out = torch.empty(num_seqs, num_heads, latent_dim, dtype=q_latent.dtype, device=q_latent.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = mla_num_splits(num_seqs, num_heads, max_seq_len, _num_sms(q_latent.device))
    block_h = block_h or _BLOCK_H
    block_n = block_n or _BLOCK_N
    direct = num_splits == 1
    if direct:  # no partials: the split kernel writes `out` itself
        part_out = part_lse = out
    elif workspace is not None:
        part_out, part_lse = workspace.get(
            ((num_seqs, num_heads, num_splits, latent_dim), torch.float32),
            ((num_seqs, num_heads, num_splits), torch.float32),
        )
    else:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, latent_dim, dtype=torch.float32, device=out.device
        )
        part_lse = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=out.device
        )
    block_l = max(16, triton.next_power_of_2(latent_dim))
    _mla_split_kernel[(num_seqs, triton.cdiv(num_heads, block_h), num_splits)](
        q_latent, q_rope, latent_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E, num_splits, num_heads,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        LATENT=latent_dim, ROPE=rope_dim, BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, DIRECT=direct, UPCAST=_interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if not direct:
        _mla_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, num_splits, out.stride(0), out.stride(1),
            LATENT=latent_dim, BLOCK_L=block_l,
            # Fixed, not next_power_of_2(num_splits): every distinct BLOCK_S
            # would be a new compile after startup.
            BLOCK_S=triton.next_power_of_2(max(num_splits, MAX_SPLITS)), num_warps=4,
        )  # fmt: skip
    return out
