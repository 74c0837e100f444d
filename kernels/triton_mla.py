"""Triton MLA (multi-head latent attention) decode over the paged latent cache:
a split-KV kernel that shares every loaded latent tile among a block of heads,
plus the reduce that merges the splits, and `mla_config`, the host-side
heuristic that picks the tile shape and the split count.

Owns the GPU implementation of `mla_decode`, whose numerical definition (and
layout) lives in kernels/mla.py, the torch reference; the signature is the
same, so models/mla.py never knows which backend runs.

Must never (each one breaks CUDA-graph capture or replay):
  - read a device tensor on the host (.item(), .tolist(), boolean indexing);
  - size a grid or pick a kernel from tensor *contents*: the configuration
    comes only from host ints (B, H, L, max_seq_len, the SM count);
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

Why it is shaped this way (DeepSeek-V3: H=128, L=512, R=64). With one query
row per sequence and 128 heads sharing each latent row, decode does
~2*H*(2L+R)/((L+R)*2) ~ 240 FLOP per cache byte: past the H200's ridge, so the
kernel is tensor-core bound, not HBM bound. What matters is how much MMA work
each loaded tile feeds: BLOCK_H = 64 heads per program (the M of a Hopper
warpgroup MMA; a [64, 512] fp32 accumulator is 128 registers per thread at 8
warps), BLOCK_N latent rows per step, num_stages to pipeline the paged loads,
and as few splits as keep the SMs busy (every split writes a [BLOCK_H, L] fp32
partial that the reduce reads back: at H=128 that traffic rivals the cache's).
The grid puts the head blocks of a sequence next to each other, so the second
block finds the latent tiles in L2.

Deferred PV (DEFER_PV). With 64 heads and 8 warps (two warpgroups), Triton
lays out a dot whose result feeds another dot in the same iteration (QK ->
softmax -> PV) with all warps along M; at M = 64 that replicates the whole QK
product on both warpgroups (~1.5x the MMA work). The deferred loop computes
tile i's PV product in iteration i + 1 from carried weights and the tile's
rows re-read (an L2 hit), so no value flows from an iteration's QK to its PV
and the warpgroups split the QK columns instead. Costs: one extra tile read
from L2 per step and a second shared-memory ring (217 KB in all at BLOCK_N=32,
2 stages). Measured on the H200 (benchmarks/sweep_mla.py, 2026-12-02), the
chained loop with 64-row tiles (BLOCK_N=64) beats every deferred config
(B=64, H=128, ctx 4096: 383 us vs 450 us for the best deferred one), so the
default is the chained loop and the deferred one stays an override.

Tunables (defaults set from that sweep, which times a grid of them per shape
and prints the heuristic's pick next to the best):
  - in kernels/mla_tiles.py: _HEADS_PER_PROGRAM (BLOCK_H per head count),
    _BLOCK_N, _NUM_STAGES, num_warps (_warps_for: 8 for a [64, 512] tile), and
    the split cost model (_ASSUMED_TFLOPS, _ASSUMED_HBM_TBS, _SPLIT_LAUNCH_US,
    _RESIDENT_PROGRAMS, _MIN_SPLIT_TOKENS, MAX_SPLITS);
  - here: defer_pv, the deferred loop (off by default; see above), and
    _LAZY_RESCALE: rescale the accumulator only when a row's running max grows
    by more than _RESCALE_THRESHOLD (log2 units), instead of every tile.

Compiled variants. The tile shape depends only on (num_heads, latent_dim),
constant for a model, and num_splits is a runtime argument
(do_not_specialize), so across every batch size and context a model compiles
exactly two split kernels (DIRECT: num_splits == 1 writes `out` itself, or
not) plus one reduce kernel: warmup over the capture sizes compiles them all
before any CUDA graph is captured.

Numerics: softmax bookkeeping in fp32 in the log2 domain (scale * log2(e)
folded into one multiplier, exp2 instead of exp); on the GPU the dots take the
storage dtype (bf16 tensor cores; fp32 tiles in 3xTF32, see
triton_attention.dot_precision) and accumulate in fp32. Under
TRITON_INTERPRET=1 tiles are upcast to fp32 right after tl.load because the
interpreter computes bf16 math wrongly.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.device_fn import device_fn
from kernels.mla_tiles import (  # noqa: F401  (MAX_SPLITS, _MIN_SPLIT_TOKENS: tests read them here)
    _MIN_SPLIT_TOKENS,
    MAX_SPLITS,
    _block_h_for,
    _num_splits_for,
    _warps_for,
    mla_config,
)
from kernels.triton_attention import LOG2E, _interpreting, _num_sms, dot_precision

_LAZY_RESCALE = True
# A running max may lag the true one by up to this much (log2 units) before the
# accumulator is rescaled: softmax weights then reach 2^8, harmless in fp32 and
# in bf16 (whose relative precision does not depend on magnitude).
_RESCALE_THRESHOLD = 8.0
_REDUCE_CHUNK = 4  # splits the reduce merges per step ([4, 512] fp32 per program)


# ----------------------------------------------------------------------------- kernels


@device_fn
def _load_rows(row_ptrs, row_ok, offs, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """[rows, BLOCK] tile of `WIDTH` columns from row_ptrs; masked rows and
    pad columns read 0. The column mask only exists where the tile is wider
    than the data, so a power-of-two width gets row-uniform masks (full-width
    vector loads)."""
    if BLOCK == WIDTH:
        return tl.load(row_ptrs[:, None] + offs[None, :], mask=row_ok[:, None], other=0.0)
    else:
        return tl.load(
            row_ptrs[:, None] + offs[None, :], mask=row_ok[:, None] & (offs < WIDTH)[None, :],
            other=0.0,
        )  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])  # one compile for any split count
def _mla_split_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits, num_heads,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_cb, stride_cs, stride_bt,
    stride_ob, stride_oh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DIRECT: tl.constexpr, LAZY_RESCALE: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr,
    DEFER_PV: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(H, BLOCK_H), B, num_splits): the head blocks of one
    sequence are adjacent program ids, so they run together and the second
    one finds the latent tiles in L2.

    DIRECT (num_splits == 1): write the normalized output straight to `out`.
    Otherwise write the chunk's normalized partial output and its log2-sum-exp
    to part_out[b, h, s, :] / part_lse[b, h, s] (contiguous [B, H, S, (L)]);
    a split past the sequence's end writes lse = -inf and nothing else.
    """
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
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
    if UPCAST:
        mma_ty = tl.float32
    else:
        mma_ty = cache_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    # DEFER_PV state: the previous tile's weights, row pointers, live rows and
    # rescale factor. Initially an empty tile (no live rows, weights 0).
    p_prev = tl.zeros([BLOCK_H, BLOCK_N], dtype=mma_ty)
    row_prev = cache_ptr + tl.zeros([BLOCK_N], dtype=tl.int64)
    ok_prev = tl.arange(0, BLOCK_N) < 0
    alpha_prev = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    rescale_prev = start < 0  # False, as a loop-carried scalar
    for n in range(start, end, BLOCK_N):
        if DEFER_PV:
            # The previous tile's PV product, from its rows re-read (an L2
            # hit): nothing this iteration's QK product computes flows into
            # it, so Triton lays the QK MMA out by columns across the two
            # warpgroups instead of replicating it on both (what it does for
            # a QK -> softmax -> PV chain with BLOCK_H = 64 < 16 * warps).
            lat_prev = _load_rows(row_prev, ok_prev, offs_l, LATENT, BLOCK_L)
            if UPCAST:
                lat_prev = lat_prev.to(tl.float32)
            if LAZY_RESCALE:
                if rescale_prev:
                    acc = acc * alpha_prev[:, None]
            else:
                acc = acc * alpha_prev[:, None]
            acc = tl.dot(p_prev, lat_prev, acc, input_precision=DOT_PRECISION)

        pos = n + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        # Paged gather: a tile may straddle cache blocks (BLOCK_N / BLOCK_SIZE
        # table entries), so each row looks up its own block id. Masked rows
        # read block 0 but load nothing.
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        lat = _load_rows(row, pos_ok, offs_l, LATENT, BLOCK_L)
        rope = _load_rows(row + LATENT, pos_ok, offs_r, ROPE, BLOCK_R)
        if UPCAST:
            lat = lat.to(tl.float32)
            rope = rope.to(tl.float32)
        if DEFER_PV:
            # Two independent dots: scaling each before the sum stops Triton
            # folding the add into a dot -> dot accumulator chain (which would
            # again lay the latent QK out as a chain head).
            s = (
                tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION) * qk_scale
                + tl.dot(q_rope, tl.trans(rope), input_precision=DOT_PRECISION) * qk_scale
            )
        else:
            s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
            s = tl.dot(q_rope, tl.trans(rope), s, input_precision=DOT_PRECISION) * qk_scale
        # Rows past `end` may hold another sequence's data: zero weight.
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        # Every tile has >= 1 live row (start < end), so m_tile is finite.
        m_tile = tl.max(s, 1)
        if LAZY_RESCALE:
            # Rebase (all rows at once) only when some row's max outgrew the
            # running one by > RESCALE_THRESHOLD; the first tile always does
            # (m_i = -inf). Otherwise weights are taken against the stale max.
            rescale = tl.max(m_tile - m_i, 0) > RESCALE_THRESHOLD
            if rescale:
                m_new = tl.maximum(m_i, m_tile)
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha
                m_i = m_new
                if not DEFER_PV:
                    acc = acc * alpha[:, None]
            else:
                alpha = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
        else:
            rescale = start >= 0  # always
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            m_i = m_new
            if not DEFER_PV:
                acc = acc * alpha[:, None]
        p = tl.exp2(s - m_i[:, None])
        l_i += tl.sum(p, 1)
        if DEFER_PV:
            p_prev = p.to(mma_ty)
            row_prev = row
            ok_prev = pos_ok
            alpha_prev = alpha
            rescale_prev = rescale
        else:
            acc = tl.dot(p.to(mma_ty), lat, acc, input_precision=DOT_PRECISION)
    if DEFER_PV:  # the last tile's PV (adds 0 when the loop never ran)
        lat_prev = _load_rows(row_prev, ok_prev, offs_l, LATENT, BLOCK_L)
        if UPCAST:
            lat_prev = lat_prev.to(tl.float32)
        acc = acc * alpha_prev[:, None]
        acc = tl.dot(p_prev, lat_prev, acc, input_precision=DOT_PRECISION)

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
    LATENT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
):  # fmt: skip
    """Grid (B, H): out = sum_s w_s * part_s / sum_s w_s, w_s = 2^(lse_s - max lse).

    The max comes from one [BLOCK_S] load; the [L]-wide partials are then
    summed CHUNK_S splits at a time (a [BLOCK_S, 512] fp32 tile would not fit
    in registers). Dead splits (lse = -inf) get weight 0 and their unwritten
    partials are never loaded."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + base + s, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
    offs_l = tl.arange(0, BLOCK_L)
    l_ok = offs_l < LATENT
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    denom = tl.zeros([CHUNK_S], dtype=tl.float32)
    for i in range(0, num_splits, CHUNK_S):
        si = i + tl.arange(0, CHUNK_S)
        lse_i = tl.load(part_lse_ptr + base + si, mask=si < num_splits, other=float("-inf"))
        live = lse_i > float("-inf")
        w = tl.where(live, tl.exp2(lse_i - m), 0.0)
        denom += w
        part = tl.load(
            part_out_ptr + (base + si)[:, None] * LATENT + offs_l[None, :],
            mask=live[:, None] & l_ok[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.sum(w[:, None] * part, 0)
    total = tl.sum(denom, 0)
    out = acc / tl.where(total == 0.0, 1.0, total)
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_l
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=l_ok)


# ----------------------------------------------------------------------------- launchers


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
    num_warps: int | None = None,
    num_stages: int | None = None,
    lazy_rescale: bool | None = None,
    defer_pv: bool | None = None,
) -> torch.Tensor:
    """Same contract as kernels.mla.mla_decode; returns [B, H, L] in q_latent.dtype.

    num_splits / block_h / block_n / num_warps / num_stages override
    mla_config's choices, lazy_rescale / defer_pv the loop variant (tests and
    benchmarks/sweep_mla.py); a block_h override also re-derives the split
    count and warps unless those are given too. Every override is a host value,
    so the overridden call is exactly as graph-safe as the default one."""
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
    num_sms = _num_sms(q_latent.device)
    cfg_h, cfg_n, cfg_warps, cfg_stages, cfg_splits = mla_config(
        num_seqs, num_heads, latent_dim, max_seq_len, num_sms, latent_cache.element_size()
    )
    if block_h is not None and block_h != cfg_h:
        cfg_warps = _warps_for(block_h, latent_dim)
        cfg_splits = _num_splits_for(num_seqs, num_heads, block_h, latent_dim, max_seq_len, num_sms)
    block_h = block_h or cfg_h
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_warps
    num_stages = num_stages if num_stages is not None else cfg_stages
    num_splits = num_splits or cfg_splits
    lazy = _LAZY_RESCALE if lazy_rescale is None else lazy_rescale
    defer = bool(defer_pv)
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
    _mla_split_kernel[(triton.cdiv(num_heads, block_h), num_seqs, num_splits)](
        q_latent, q_rope, latent_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E, num_splits, num_heads,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        LATENT=latent_dim, ROPE=rope_dim, BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, DIRECT=direct, LAZY_RESCALE=lazy,
        RESCALE_THRESHOLD=_RESCALE_THRESHOLD, DEFER_PV=defer, UPCAST=_interpreting(),
        DOT_PRECISION=dot_precision(latent_cache.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if not direct:
        _mla_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, num_splits, out.stride(0), out.stride(1),
            LATENT=latent_dim, BLOCK_L=block_l,
            # Fixed, not next_power_of_2(num_splits): every distinct BLOCK_S
            # would be a new compile after startup.
            BLOCK_S=triton.next_power_of_2(max(num_splits, MAX_SPLITS)), CHUNK_S=_REDUCE_CHUNK,
            num_warps=4,
        )  # fmt: skip
    return out
