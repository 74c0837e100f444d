"""Triton MLA (multi-head latent attention) decode over the paged latent cache:
the launcher `mla_decode` and how its kernels work. A split-KV kernel shares
every loaded latent tile among a block of heads, and a reduce merges the
splits (both in kernels/mla/split.py); the tile and split count come from
`mla_config` (kernels/mla/tiles.py), and on Hopper DeepSeek-V3's tile runs
the Gluon split kernel (kernels/mla/gluon.py) instead.

Owns the GPU implementation of `mla_decode`, whose numerical definition (and
layout) lives in kernels/mla/reference.py, the torch reference; the signature is the
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
past 255 registers per thread into spills (sm_90), so at 128 heads whole-page
TMA loads beat the row gather by about 1.5x (benchmarks/sweep_mla.py;
docs/benchmarks.md has the figures).

Why the QK product runs twice here, and the Gluon kernel. With 64 heads and
8 warps (two warpgroups), Triton lays out a dot whose result feeds another
dot in the same iteration (QK -> softmax -> PV) with all warps along M; at
M = 64 that replicates the QK product (and the softmax) on both warpgroups,
~1.5x the MMA work, while the PV product splits its 512 columns between
them. The ways out cost more than they save in Triton 3.6: 128 heads per
program need a [128, 512] fp32 accumulator (256 registers per thread at 8
warps); a deferred PV (tile i's PV in iteration i + 1, its rows re-read from
L2) is slower than the chained loop (docs/benchmarks.md). So on Hopper the
64-head, 64-row TMA tile runs kernels/mla/gluon.py instead, written in Gluon
with explicit layouts and warp roles: one warpgroup scores whole tiles and
hands the softmax weights to both warpgroups' PV products through shared
memory, so the MMA work is done once (docs/kernels.md). This kernel serves
every other shape, dtype and GPU, and the CPU tests.

Tunables (defaults set from that sweep, which times a grid of them per shape
and prints the heuristic's pick next to the best), in kernels/mla/tiles.py:
_HEADS_PER_PROGRAM (BLOCK_H per head count), _BLOCK_N, _NUM_STAGES(_TMA),
num_warps (_warps_for: 8 for a [64, 512] tile), the rescale variant (lazy:
rescale the accumulator only when a row's running max grows by more than
RESCALE_THRESHOLD in kernels/mla/split.py, in log2 units; eager: every tile), and the
split cost model (_ASSUMED_TFLOPS, _ASSUMED_HBM_TBS, _SPLIT_LAUNCH_US,
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
launch.dot_precision) and accumulate in fp32. Under
TRITON_INTERPRET=1 tiles are upcast to fp32 right after tl.load because the
interpreter computes bf16 math wrongly.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

import tinyengine.kernels.mla.gluon as mla_gluon
from tinyengine.kernels.gluon_support import GluonUnavailable
from tinyengine.kernels.launch import LOG2E, dot_precision, interpreting, num_sms
from tinyengine.kernels.mla.split import RESCALE_THRESHOLD, _mla_split_kernel
from tinyengine.kernels.mla.tiles import (  # noqa: F401  (MAX_SPLITS, _MIN_SPLIT_TOKENS: tests read them here)
    _MIN_SPLIT_TOKENS,
    MAX_SPLITS,
    _num_splits_for,
    _warps_for,
    mla_config,
)
from tinyengine.kernels.split_reduce import merge_splits
from tinyengine.kernels.tma import descriptor, tma_ok

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
) -> torch.Tensor:
    """Same contract as mla/reference.py's mla_decode; returns [B, H, L] in
    q_latent.dtype, with mla_config's tiles."""
    return launch_mla_decode(
        q_latent, q_rope, latent_cache, block_tables, seq_lens, scale,
        max_seq_len=max_seq_len, workspace=workspace,
    )  # fmt: skip


def launch_mla_decode(
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
    """mla_decode with tile overrides (tests and benchmarks/sweep_mla.py).

    num_splits / block_h / block_n / num_warps / num_stages / lazy_rescale /
    paged_tma override mla_config's choices (tests and benchmarks/sweep_mla.py);
    a block_h override also re-derives the split count and warps unless those
    are given too. paged_tma=True where the cache's block size or alignment
    rules TMA out still loads through pointers. On Hopper the split kernel of
    the 64-head, 64-row TMA tile is the Gluon one (kernels/mla/gluon.py;
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
    # Off the GPU, 132 SMs (an H200's count): the interpreter takes the GPU's split choices.
    sms = num_sms(q_latent.device, off_gpu=132)
    cfg = mla_config(
        num_seqs, num_heads, latent_dim, max_seq_len, sms, latent_cache.element_size(),
        block_size,
    )  # fmt: skip
    if block_h is not None and block_h != cfg.block_h:
        cfg = cfg._replace(
            num_warps=_warps_for(block_h, latent_dim),
            num_splits=_num_splits_for(
                num_seqs, num_heads, block_h, latent_dim, max_seq_len, sms,
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
        except GluonUnavailable:
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
            LAZY_RESCALE=lazy, RESCALE_THRESHOLD=RESCALE_THRESHOLD, UPCAST=interpreting(),
            DOT_PRECISION=dot_precision(latent_cache.dtype), num_warps=num_warps,
            num_stages=num_stages,
        )  # fmt: skip
    if not direct:
        merge_splits(out, part_out, part_lse, num_splits, MAX_SPLITS)
    return out
