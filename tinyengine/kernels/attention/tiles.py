"""Tile choice for kernels/attention/triton.py: the prefill/mixed kernel's tiles
(`prefill_config`), the split-KV decode kernel's tiles (`decode_config`) and
split count (`decode_num_splits`). Host ints only (no device reads), so a CUDA
graph captured for a batch size keeps its configuration for any context
length. Values set from sweeps (benchmarks/bench_kernels.py --sweep,
benchmarks/sweep_decode.py); docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import triton

# Decode split heuristic: a batch giving >= 2 (seq, kv_head) programs per SM
# already streams K/V near the copy bandwidth unsplit; below that, too few
# programs leave SMs idle, and splitting up to ~4 programs per SM wins
# (docs/benchmarks.md, Kernels: decode tiles and splits).
_DECODE_NO_SPLIT_PROGRAMS_PER_SM = 2
_DECODE_TARGET_PROGRAMS_PER_SM = 4
# The shortest split: at batch 1 with 8 KV heads, 32-token splits of a
# 512-token context (16 splits) took 6.4 us where 256-token ones (2) took 9.4 on an H100
# (docs/benchmarks.md, issue 23); with PDL the reduce kernel starts while
# the splits still run, so more of them cost little.
_DECODE_MIN_SPLIT_TOKENS = 32
DECODE_MAX_SPLITS = 64


def prefill_config(
    head_dim_k: int, max_query_len: int, group: int, elem_bytes: int = 2
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill/mixed kernel.

    256 rows x 64 keys with 8 warps (two warpgroups of 128 rows each, whose
    softmax and MMAs interleave) beat 128-row tiles at 8k causal, d128
    (benchmarks/bench_kernels.py --sweep; docs/benchmarks.md). BLOCK_M shrinks
    with max_query_len * group so mostly-decode mixed batches don't pay for
    256-row tiles, but not below 64: 16- and 32-row tiles measured no faster
    than 64 on any short-query batch (mostly-decode, 16-token chunks over a
    long context, short prompts; docs/benchmarks.md), and each tile class
    is one more compile of this kernel on an empty Triton cache. 256-wide
    heads (Dk 192 padded) get 64-row tiles to fit.
    """
    rows = max(64, min(256, triton.next_power_of_2(max_query_len * group)))
    least = triton.next_power_of_2(group)  # a tile holds >= 1 token's heads
    rows = max(rows, least)
    if triton.next_power_of_2(head_dim_k) > 128:
        m, n, warps, stages = min(rows, 64), 32, 4, 2
    elif rows >= 256:
        m, n, warps, stages = rows, 64, 8, 2
    else:
        m, n, warps, stages = rows, 64, 4, 3
    if elem_bytes > 2:
        # fp32 (tests, references): half the rows and keys keep the tiles'
        # shared memory at or below the bf16 tiles' (which fit); the bf16
        # tiles in fp32 overflow it at 128-wide heads (256 KB > 227 KB).
        m, n = max(m // 2, least, 16), max(n // 2, 16)
    return m, n, warps, stages


def decode_config(
    num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim_k: int
) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the split-KV decode kernel, from
    host ints only (a captured graph keeps its config for any context length).
    Chosen by benchmarks/sweep_decode.py (d128; docs/benchmarks.md has the
    K/V TB/s per group size): a program holds only a [max(16, group),
    BLOCK_N] score tile, so small programs with 2 stages keep more of them
    resident per SM, which is what short contexts (a few tiles a program:
    latency-bound) need."""
    group = num_q_heads // num_kv_heads
    if triton.next_power_of_2(head_dim_k) > 128:
        return 32, 4, 2
    if group <= 4:
        return 32, 1, 2
    if group <= 8:
        return 64, 2, 2
    return 64, 4, 2


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split count S for a decode batch: enough (seq, kv_head, split) programs
    to fill the GPU when the batch alone does not, never splits shorter than
    _DECODE_MIN_SPLIT_TOKENS of max_seq_len. Depends only on host ints, so a
    CUDA graph captured for a batch size stays valid for any seq_lens."""
    programs = num_seqs * num_kv_heads
    if programs >= _DECODE_NO_SPLIT_PROGRAMS_PER_SM * num_sms:
        return 1
    target = _DECODE_TARGET_PROGRAMS_PER_SM * num_sms
    most = max(1, max_seq_len // _DECODE_MIN_SPLIT_TOKENS)
    return max(1, min(triton.cdiv(target, programs), most, DECODE_MAX_SPLITS))
