"""MLA decode tile choice for kernels/mla/triton.py: heads per program
(BLOCK_H), rows per tile, warps, stages, whole pages through TMA or rows
through pointers, the rescale variant, and the split count from a small cost
model. Host ints only (no device reads), so a CUDA graph captured for a batch
size stays valid for any context; the tile shape depends on (num_heads,
latent_dim, the cache's element size and block size) alone, so a model
compiles one split kernel (two: S = 1 writes the output directly). Values set
from benchmarks/sweep_mla.py (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import triton

# --- tile shape (per model: depends on num_heads and latent_dim only)
# (min heads, BLOCK_H): the first row whose min the head count reaches.
_HEADS_PER_PROGRAM = ((64, 64), (32, 32), (0, 16))
# BLOCK_N per BLOCK_H (the sweep's best: 64 heads x 64 rows for 128 heads; 16 x 32 for 16).
_BLOCK_N = {64: 64, 32: 32, 16: 32}
_NUM_STAGES = 2  # pointer (cp.async) tiles
# Tiles that load whole pages through TMA when the cache's block size allows,
# with their stage count (from the sweep, 64-token blocks): bf16 at
# 64 heads (two stages of [64, L + R] plus the [64, L + R] query fill 216 of
# 227 KB of shared memory) and at 16 heads (a TP-8 shard); both beat pointer
# loads. 32-head tiles have no TMA variant (their sm_90 build spills ~1 KB
# per thread).
_NUM_STAGES_TMA = {64: 2, 16: 3}

# --- split count: a small cost model over host ints (per-GPU constants, set for an H200)
_ASSUMED_TFLOPS = 400.0  # achieved bf16 MMA rate of the split kernel, whole GPU
_ASSUMED_HBM_TBS = 4.0  # achieved HBM bandwidth
_SPLIT_LAUNCH_US = 3.0  # the reduce launch and its tail
# Programs one SM holds at once, per BLOCK_H (shared memory / registers bound).
_RESIDENT_PROGRAMS = {16: 2, 32: 2, 64: 1}
_MIN_SPLIT_TOKENS = 64  # never cut a context into splits shorter than this
MAX_SPLITS = 64


def _block_h_for(num_heads: int) -> int:
    return next(bh for least, bh in _HEADS_PER_PROGRAM if num_heads >= least)


def _warps_for(block_h: int, latent_dim: int) -> int:
    """4 warps, 8 once the fp32 accumulator passes [32, 512] (128 regs/thread)."""
    return 8 if block_h * max(16, triton.next_power_of_2(latent_dim)) > 32 * 512 else 4


def _split_cost_us(
    splits: int, num_seqs: int, num_heads: int, block_h: int, latent_dim: int,
    max_seq_len: int, slots: int, block_n: int,
) -> float:  # fmt: skip
    """Modelled microseconds for the split kernel plus the partials' round trip:
    waves of programs, each program bound by its share of the GPU's MMA rate or
    of its HBM bandwidth, whichever is slower (the rope width is taken as L/8).
    A split covers whole tiles (the kernels round its share up to BLOCK_N
    rows), so some split counts leave trailing splits empty: at ctx 4096 and
    64-row tiles, 29 splits are 22 of 3 tiles where 32 are 32 of 2, and the
    latter is faster at B=1 (docs/benchmarks.md)."""
    width = latent_dim + max(1, latent_dim // 8)
    tokens = triton.cdiv(triton.cdiv(max_seq_len, splits), block_n) * block_n
    live = triton.cdiv(max_seq_len, tokens)  # splits with any rows
    flops = tokens * block_h * (latent_dim + width) * 2
    cache_bytes = tokens * width * 2
    prog_us = max(
        flops / (_ASSUMED_TFLOPS * 1e6 / slots), cache_bytes / (_ASSUMED_HBM_TBS * 1e6 / slots)
    )
    programs = num_seqs * triton.cdiv(num_heads, block_h) * live
    cost = math.ceil(programs / slots) * prog_us
    if splits > 1:  # fp32 partials written, then read by the reduce
        part_bytes = num_seqs * num_heads * live * (latent_dim + 1) * 4 * 2
        cost += part_bytes / (_ASSUMED_HBM_TBS * 1e6) + _SPLIT_LAUNCH_US
    return cost


def _num_splits_for(
    num_seqs: int,
    num_heads: int,
    block_h: int,
    latent_dim: int,
    max_seq_len: int,
    num_sms: int,
    block_n: int,
) -> int:
    most = max(1, min(MAX_SPLITS, max_seq_len // _MIN_SPLIT_TOKENS))
    slots = num_sms * _RESIDENT_PROGRAMS.get(block_h, 1)
    costs = [
        _split_cost_us(s, num_seqs, num_heads, block_h, latent_dim, max_seq_len, slots, block_n)
        for s in range(1, most + 1)
    ]
    best = min(costs)
    # The fewest splits within 3% of the best: fewer partials, same time.
    return next(s for s, c in enumerate(costs, start=1) if c <= best * 1.03)


class MLAConfig(NamedTuple):
    block_h: int  # heads per program
    block_n: int  # latent rows per tile
    num_warps: int
    num_stages: int
    num_splits: int  # runtime argument: any value shares one compiled kernel
    # Whole tiles as one TMA copy per operand: possible when a tile never
    # straddles cache blocks (block_size a multiple of block_n). Faster than
    # pointers (docs/benchmarks.md), whose per-row address math pushes the
    # kernel past 255 registers into spills.
    paged_tma: bool
    # Rescale the accumulator only when a row's max grows by more than the
    # kernel's threshold (an `if` per tile) instead of every tile. Pays with
    # pointer tiles (sweep); with TMA tiles the branch's extra live registers
    # spill (sm_90: 104 bytes of stack) and eager is faster (docs/benchmarks.md).
    lazy_rescale: bool


@functools.lru_cache(maxsize=4096)
def mla_config(
    num_seqs: int, num_heads: int, latent_dim: int, max_seq_len: int, num_sms: int,
    elem_bytes: int = 2, block_size: int = 16,
) -> MLAConfig:  # fmt: skip
    """The kernel configuration from host ints only, so a CUDA graph captured
    for a batch size stays valid for any seq_lens up to max_seq_len. The tile
    depends on (num_heads, latent_dim, the element size, the cache's
    block_size) alone; only num_splits (a runtime argument) follows the batch
    and the context."""
    block_h = _block_h_for(num_heads)
    block_n = _BLOCK_N[block_h]
    if elem_bytes > 2:
        # fp32 (tests, references): half the heads and half the rows keep the
        # tiles' shared memory at the bf16 tiles' (which fit); the bf16 tile
        # in fp32 would not at DeepSeek-V3's widths (64 heads x 576 + 2
        # stages of 64 rows x 576, in 4-byte elements: > 227 KB).
        block_h, block_n = max(16, block_h // 2), max(16, block_n // 2)
    paged_tma = elem_bytes <= 2 and block_h in _NUM_STAGES_TMA and block_size % block_n == 0
    stages = _NUM_STAGES_TMA[block_h] if paged_tma else _NUM_STAGES
    num_splits = _num_splits_for(
        num_seqs, num_heads, block_h, latent_dim, max_seq_len, num_sms, block_n
    )
    return MLAConfig(
        block_h, block_n, _warps_for(block_h, latent_dim), stages, num_splits, paged_tma,
        lazy_rescale=not paged_tma,
    )  # fmt: skip
