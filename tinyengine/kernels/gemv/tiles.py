"""Tile choice for the skinny GEMM kernel (gemv/triton.py): the default
configs per row count, per-shape overrides, and `pick_config`, which picks from
host ints only (shapes and the SM count), so it is safe inside graph capture.

Owns the tuning constants; edit them after benchmarks/bench_gemv.py's sweep.
Must never import triton's kernels or launch anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows (output columns) per program
    block_k: int  # K elements per loop step
    num_warps: int
    num_stages: int  # 1: no software pipelining (FMA: plain register loads)
    use_dot: bool  # DOT inner loop (any M) vs FMA (M == 1 only)
    reduce_each_step: bool = False  # FMA only: [BLOCK_N] accumulator, reduced every step
    split_k: int = 1  # DOT only: programs per output tile, each over a slice of K

    def __str__(self) -> str:
        kind = "dot" if self.use_dot else ("fma-r" if self.reduce_each_step else "fma")
        text = f"{kind} BN={self.block_n} BK={self.block_k} w={self.num_warps} s={self.num_stages}"
        return text + (f" split={self.split_k}" if self.split_k > 1 else "")


# ---- Tuning constants (edit these after benchmarks/bench_gemv.py's sweep) ----
# Default for M == 1 (batch-1 decode).
M1_CONFIG = GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3, use_dot=False)
# Default for 2 <= M <= 64 (tl.dot needs BLOCK_N >= 16); its split over K
# comes from SPLIT_K_* below.
MN_CONFIG = GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=4, use_dot=True)
# DOT tiles: a matrix with fewer output tiles than SMs / SPLIT_K_BELOW (the
# 1024-row o_proj and down of a small model: 32 tiles) splits K until its
# programs cover the SMs, at most SPLIT_K_MAX ways, each slice >= 2 K steps.
SPLIT_K_BELOW = 2
SPLIT_K_MAX = 8
# Per-shape overrides, keyed (m_bucket, N, K) with m_bucket 1 for M == 1 and 8
# for 2 <= M <= 64 (those must have use_dot=True); e.g.
# {(1, 4096, 14336): GemvConfig(4, 1024, 4, 3, False)}. Overrides are used as-is.
SHAPE_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {}
# M == 1 with K up to this: one K step per program (BLOCK_K = next power of
# two >= K) of ONE_STEP_ELEMS weight elements, so a program's whole weight
# slice is requested at once; under programmatic dependent launch those loads
# go out before the kernel waits for the one before it (gemv/triton.py).
ONE_STEP_MAX_K = 4096
ONE_STEP_ELEMS = 8192
# 2 <= M <= FMA_MAX_M with K up to ONE_STEP_MAX_K: the same one-step FMA
# tiles (`fma_config`), each program multiplying its weight slice by every
# row in turn, so the slice is requested at once (before the PDL wait) as at
# one row, and each row's sum is the one-row kernel's. Each row costs the
# program two cross-warp reductions (its norm, its products): on an H100
# the qwen3-0.6b decode step at 2 rows took 21% less time than with the DOT
# loop, at 4 rows the same, at 6-8 rows 60% more (docs/benchmarks.md), so
# 2 rows take it and more rows the DOT loop. The kernel serves any M up to
# MAX_M with such a tile (tests and sweeps pass it as `config=`).
FMA_MAX_M = 2
# Halve BLOCK_N (down to the minimum below) until there are at least this many
# programs per SM, so small-N shapes still fill the GPU.
MIN_PROGRAMS_PER_SM = 2
MIN_BLOCK_N_FMA = 2
MIN_BLOCK_N_DOT = 16


def pick_config(m: int, n: int, k: int, num_sms: int, *, tensor_cores: bool = False) -> GemvConfig:
    """The config for one problem, from host ints only (graph-capture safe).
    `tensor_cores`: the DOT loop for every M > 1 (the batch-invariant op
    set, whose rows must not depend on how many there are)."""
    cfg = SHAPE_CONFIGS.get((1 if m == 1 else 8, n, k))
    if cfg is not None:
        return cfg
    if m == 1 or (k <= ONE_STEP_MAX_K and m <= FMA_MAX_M and not tensor_cores):
        return fma_config(m, n, k, num_sms)
    return dataclasses.replace(MN_CONFIG, split_k=_split_k(n, k, MN_CONFIG, num_sms))


def fma_config(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """The FMA tile for m rows: one K step of ONE_STEP_ELEMS weight elements
    where K <= ONE_STEP_MAX_K (the only form that serves m > 1), else
    M1_CONFIG's loop; BLOCK_N halved while the programs are too few to fill
    the SMs, but never below the rows of x each program also reads."""
    cfg = M1_CONFIG
    if k <= ONE_STEP_MAX_K:
        bk = triton.next_power_of_2(k)
        cfg = dataclasses.replace(
            cfg, block_n=max(MIN_BLOCK_N_FMA, ONE_STEP_ELEMS // bk), block_k=bk, num_stages=1
        )
    floor = max(MIN_BLOCK_N_FMA, triton.next_power_of_2(m))
    bn = max(cfg.block_n, floor)
    while bn > floor and triton.cdiv(n, bn) < MIN_PROGRAMS_PER_SM * num_sms:
        bn //= 2
    return cfg if bn == cfg.block_n else dataclasses.replace(cfg, block_n=bn)


def _split_k(n: int, k: int, cfg: GemvConfig, num_sms: int) -> int:
    """K slices per output tile for a DOT config (see SPLIT_K_BELOW)."""
    tiles = triton.cdiv(n, max(MIN_BLOCK_N_DOT, cfg.block_n))
    if tiles * SPLIT_K_BELOW > num_sms:
        return 1
    most = max(1, k // (2 * cfg.block_k))
    return max(1, min(SPLIT_K_MAX, triton.cdiv(num_sms, tiles), most))
