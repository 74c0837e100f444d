"""Triton MLA (multi-head latent attention) decode over the paged latent cache:
a split-KV kernel that shares every loaded latent tile among a block of heads,
plus the reduce that merges the splits, and the launcher `mla_decode`, which
takes its tile and split count from `mla_config` (kernels/mla_tiles.py) and,
on Hopper, runs DeepSeek-V3's tile with the Gluon split kernel
(kernels/mla_gluon.py) instead of this file's.

Owns the GPU implementation of `mla_decode`, whose numerical definition (and
layout) lives in kernels/mla.py, the torch reference; the signature is the
same, so models/mla.py never knows which backend runs.

Must never (each one breaks CUDA-graph capture or replay):
  - read a device tensor on the host (.item(), .tolist(), boolean indexing);
  - size a grid or pick a kernel from tensor *contents*: the configuration
    comes only from host ints (B, H, L, max_seq_len, the SM count, the
    cache's block size);
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

Loads. With a cache block size that is a multiple of BLOCK_N (64 for
DeepSeek models on CUDA: EngineConfig's block-size default), a whole tile
lies in one cache block, so each tile is one TMA copy per operand (latent,
rope) from a descriptor over the cache viewed as [rows, L] / [rows, R],
issued by one thread and completing on an mbarrier; only a split's last,
partial tile goes through pointers (masked rows read 0, so nothing past the
context is ever loaded). Otherwise every tile is gathered row by row through
pointers (cp.async), each row looking up its own block id. The pointer path
costs registers: its per-row addresses push the kernel (64 heads, 8 warps)
past 255 registers per thread into spills (sm_90). Measured on the H200,
B=64, H=128, ctx 4096 (benchmarks/sweep_mla.py, 2026-12-03): 251 us with TMA
pages vs 383 us through pointers.

Why the QK product runs twice here, and the Gluon kernel. With 64 heads and
8 warps (two warpgroups), Triton lays out a dot whose result feeds another
dot in the same iteration (QK -> softmax -> PV) with all warps along M; at
M = 64 that replicates the QK product (and the softmax) on both warpgroups,
~1.5x the MMA work, while the PV product splits its 512 columns between
them. The ways out cost more than they save in Triton 3.6: 128 heads per
program need a [128, 512] fp32 accumulator (256 registers per thread at 8
warps); a deferred PV (tile i's PV in iteration i + 1, its rows re-read from
L2) measured 450 us against the chained loop's 383 (pointer tiles,
2026-12-02, since removed). So on Hopper the 64-head, 64-row TMA tile runs
kernels/mla_gluon.py instead, written in Gluon with explicit layouts: the
warpgroups split the QK columns and hand the softmax weights over through
shared memory (180 us vs this kernel's 252 at B=64, H=128, ctx 4096). This
kernel serves every other shape, dtype and GPU, and the CPU tests.

Tunables (defaults set from that sweep, which times a grid of them per shape
and prints the heuristic's pick next to the best), in kernels/mla_tiles.py:
_HEADS_PER_PROGRAM (BLOCK_H per head count), _BLOCK_N, _NUM_STAGES(_TMA),
num_warps (_warps_for: 8 for a [64, 512] tile), the rescale variant (lazy:
rescale the accumulator only when a row's running max grows by more than
_RESCALE_THRESHOLD here, in log2 units; eager: every tile), and the split
cost model (_ASSUMED_TFLOPS, _ASSUMED_HBM_TBS, _SPLIT_LAUNCH_US,
_RESIDENT_PROGRAMS, _MIN_SPLIT_TOKENS, MAX_SPLITS).

Compiled variants. The tile shape depends only on (num_heads, latent_dim,
the cache's dtype and block size), constant for a model, and num_splits is a
runtime argument (do_not_specialize), so across every batch size and context
a model compiles exactly two split kernels (DIRECT: num_splits == 1 writes
`out` itself, or not) plus one reduce kernel: warmup over the capture sizes
compiles them all before any CUDA graph is captured.

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

from kernels import mla_gluon
from kernels.device_fn import device_fn
from kernels.mla_tiles import (  # noqa: F401  (MAX_SPLITS, _MIN_SPLIT_TOKENS: tests read them here)
    _MIN_SPLIT_TOKENS,
    MAX_SPLITS,
    _block_h_for,
    _num_splits_for,
    _warps_for,
    mla_config,
)
from kernels.tma import descriptor, tma_ok
from kernels.triton_attention import LOG2E, _interpreting, _num_sms, dot_precision

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


@device_fn
def _attend_tile(
    q_lat, q_rope, lat, rope, pos_ok, acc, m_i, l_i, qk_scale,
    MASKED: tl.constexpr, LAZY_RESCALE: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a [BLOCK_N] tile for all BLOCK_H heads:
    scores = (q_lat @ lat^T + q_rope @ rope^T) * qk_scale (log2 units), then
    acc += 2^(scores - m) @ lat. MASKED: rows where pos_ok is False get weight
    0 (a tile past the context's end); the tile has >= 1 live row."""
    if UPCAST:
        lat = lat.to(tl.float32)
        rope = rope.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
    s = tl.dot(q_rope, tl.trans(rope), s, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:  # rows past `end` may hold another sequence's data
        s = tl.where(pos_ok[None, :], s, float("-inf"))
    m_tile = tl.max(s, 1)
    if LAZY_RESCALE:
        # Rebase (all rows at once) only when some row's max outgrew the
        # running one by > RESCALE_THRESHOLD; the first tile always does
        # (m_i = -inf). Otherwise weights are taken against the stale max.
        if tl.max(m_tile - m_i, 0) > RESCALE_THRESHOLD:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
    else:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    l_i += tl.sum(p, 1)
    acc = tl.dot(p.to(lat.dtype), lat, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@device_fn
def _attend_gathered_tile(
    cache_ptr, bt_row, n, end, stride_cb, stride_cs, q_lat, q_rope, acc, m_i, l_i, qk_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """_attend_tile over rows n .. n + BLOCK_N of a sequence gathered through
    pointers ([BLOCK_N, BLOCK_L] latent, [BLOCK_N, BLOCK_R] rope). The tile may
    straddle cache blocks, so each row looks up its own block id; rows at or
    past `end` read 0 (their block id is not loaded either) and weigh 0."""
    pos = n + tl.arange(0, BLOCK_N)
    pos_ok = pos < end
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    row = cache_ptr + blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
    lat = _load_rows(row, pos_ok, tl.arange(0, BLOCK_L), LATENT, BLOCK_L)
    rope = _load_rows(row + LATENT, pos_ok, tl.arange(0, BLOCK_R), ROPE, BLOCK_R)
    return _attend_tile(
        q_lat, q_rope, lat, rope, pos_ok, acc, m_i, l_i, qk_scale,
        True, LAZY_RESCALE, RESCALE_THRESHOLD, UPCAST, DOT_PRECISION,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])  # one compile for any split count
def _mla_split_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, lat_desc, rope_desc, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits, num_heads,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_cb, stride_cs, stride_bt,
    stride_ob, stride_oh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DIRECT: tl.constexpr, PAGED_TMA: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(H, BLOCK_H), B, num_splits): the head blocks of one
    sequence are adjacent program ids, so they run together and the second
    one finds the latent tiles in L2.

    PAGED_TMA (BLOCK_SIZE a multiple of BLOCK_N): every whole tile lies in one
    cache block, so it is one TMA copy per operand through lat_desc /
    rope_desc (descriptors over the cache viewed as [rows, L] and [rows, R]);
    a split's last, partial tile goes through pointers, masked. Otherwise
    every tile goes through pointers (lat_desc / rope_desc are unused).

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
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    if PAGED_TMA:
        whole_end = start + (end - start) // BLOCK_N * BLOCK_N
        for n in range(start, whole_end, BLOCK_N):
            row = tl.load(bt_row + n // BLOCK_SIZE) * BLOCK_SIZE + n % BLOCK_SIZE
            lat = lat_desc.load([row, 0])
            rope = rope_desc.load([row, 0])
            acc, m_i, l_i = _attend_tile(
                q_lat, q_rope, lat, rope, None, acc, m_i, l_i, qk_scale,
                False, LAZY_RESCALE, RESCALE_THRESHOLD, UPCAST, DOT_PRECISION,
            )  # fmt: skip
        # An `if`, not a loop: a second pipelined loop would claim its own
        # shared-memory ring, which the TMA loop's ring leaves no room for.
        if whole_end < end:
            acc, m_i, l_i = _attend_gathered_tile(
                cache_ptr, bt_row, whole_end, end, stride_cb, stride_cs, q_lat, q_rope,
                acc, m_i, l_i, qk_scale, LATENT, ROPE, BLOCK_L, BLOCK_R, BLOCK_N, BLOCK_SIZE,
                LAZY_RESCALE, RESCALE_THRESHOLD, UPCAST, DOT_PRECISION,
            )  # fmt: skip
    else:
        for n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_gathered_tile(
                cache_ptr, bt_row, n, end, stride_cb, stride_cs, q_lat, q_rope,
                acc, m_i, l_i, qk_scale, LATENT, ROPE, BLOCK_L, BLOCK_R, BLOCK_N, BLOCK_SIZE,
                LAZY_RESCALE, RESCALE_THRESHOLD, UPCAST, DOT_PRECISION,
            )  # fmt: skip

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


def pages_by_tma(latent_cache: torch.Tensor, latent_dim: int, block_n: int) -> bool:
    """Whether BLOCK_N-row tiles of this cache can each be one TMA copy per
    operand: no tile straddles two cache blocks, consecutive blocks abut (the
    cache is [rows, width] with one row stride), and both the latent and the
    rope columns start 16-byte aligned with a 16-byte-multiple row stride."""
    block_size, row_stride = latent_cache.shape[1], latent_cache.stride(1)
    rows = latent_cache.shape[0] * block_size
    return (
        block_size % block_n == 0
        and latent_cache.stride(0) == block_size * row_stride
        and tma_ok(latent_cache[..., :latent_dim], rows, row_stride)
        and tma_ok(latent_cache[..., latent_dim:], rows, row_stride)
    )


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
    paged_tma: bool | None = None,
    gluon: bool | None = None,
) -> torch.Tensor:
    """Same contract as kernels.mla.mla_decode; returns [B, H, L] in q_latent.dtype.

    num_splits / block_h / block_n / num_warps / num_stages / lazy_rescale /
    paged_tma override mla_config's choices (tests and benchmarks/sweep_mla.py);
    a block_h override also re-derives the split count and warps unless those
    are given too. paged_tma=True where the cache's block size or alignment
    rules TMA out still loads through pointers. On Hopper the split kernel of
    the 64-head, 64-row TMA tile is the Gluon one (kernels/mla_gluon.py;
    gluon=False forces the Triton kernel, and gluon=True where it does not
    apply changes nothing). Every override is a host value, so the overridden
    call is exactly as graph-safe as the default one."""
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
    cfg = mla_config(
        num_seqs, num_heads, latent_dim, max_seq_len, num_sms, latent_cache.element_size(),
        block_size,
    )  # fmt: skip
    if block_h is not None and block_h != cfg.block_h:
        cfg = cfg._replace(
            num_warps=_warps_for(block_h, latent_dim),
            num_splits=_num_splits_for(
                num_seqs, num_heads, block_h, latent_dim, max_seq_len, num_sms,
                block_n or cfg.block_n,
            ),
        )  # fmt: skip
    block_h = block_h or cfg.block_h
    block_n = block_n or cfg.block_n
    num_warps = num_warps or cfg.num_warps
    num_stages = num_stages if num_stages is not None else cfg.num_stages
    num_splits = num_splits or cfg.num_splits
    tma = cfg.paged_tma if paged_tma is None else paged_tma
    lazy = cfg.lazy_rescale if lazy_rescale is None else lazy_rescale
    block_l = max(16, triton.next_power_of_2(latent_dim))
    block_r = max(16, triton.next_power_of_2(rope_dim))
    rows = latent_cache.shape[0] * block_size
    row_stride = latent_cache.stride(1)
    tma = tma and pages_by_tma(latent_cache, latent_dim, block_n)
    use_gluon = gluon is not False and mla_gluon.supports(
        q_latent, latent_cache, block_h, block_n, tma
    )
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
    if use_gluon:
        try:
            mla_gluon.launch_split(
                q_latent, q_rope, latent_cache, block_tables, seq_lens, scale * LOG2E,
                num_splits, out, part_out, part_lse,
            )  # fmt: skip
        except mla_gluon.GluonUnavailable:
            use_gluon = False
    if not use_gluon:
        lat_desc = rope_desc = latent_cache  # placeholders where pointers load instead
        if tma:
            lat_desc = descriptor(latent_cache[..., :latent_dim], rows, row_stride,
                                  [block_n, block_l])  # fmt: skip
            rope_desc = descriptor(latent_cache[..., latent_dim:], rows, row_stride,
                                   [block_n, block_r])  # fmt: skip
        _mla_split_kernel[(triton.cdiv(num_heads, block_h), num_seqs, num_splits)](
            q_latent, q_rope, latent_cache, lat_desc, rope_desc, block_tables, seq_lens,
            out, part_out, part_lse, scale * LOG2E, num_splits, num_heads,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            latent_cache.stride(0), row_stride, block_tables.stride(0),
            out.stride(0), out.stride(1),
            LATENT=latent_dim, ROPE=rope_dim, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_H=block_h,
            BLOCK_N=block_n, BLOCK_SIZE=block_size, DIRECT=direct, PAGED_TMA=tma,
            LAZY_RESCALE=lazy, RESCALE_THRESHOLD=_RESCALE_THRESHOLD, UPCAST=_interpreting(),
            DOT_PRECISION=dot_precision(latent_cache.dtype), num_warps=num_warps,
            num_stages=num_stages,
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
