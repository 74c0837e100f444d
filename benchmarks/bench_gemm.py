"""Tensor-core GEMM benchmark: cuBLAS (F.linear) vs kernels/gemm/triton.py, the
batch-invariant mode's linear above 8 rows, on Llama-3-8B's linears (qkv, o,
gate_up, down) at 16 to 4096 rows (prints figures; not a test).

    python benchmarks/bench_gemm.py [--sweep]

Times are medians of CUDA-graph replays. Each row prints the per-call time
of cuBLAS and of the Triton GEMM with its default tiles (gemm/triton.py
`tiles`), and their sum over the four linears; --sweep also times a set of
tile candidates and prints the fastest per row count (the defaults' source).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from triton.testing import do_bench_cudagraph  # noqa: E402

import tinyengine.kernels.gemm.triton as gemm  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336)]  # fmt: skip
ROWS = (16, 64, 256, 1024, 4096)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) candidates of --sweep
SWEEP = [
    (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 64, 4, 4), (128, 64, 64, 4, 4),
]  # fmt: skip


def us(fn) -> float:
    return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def with_tiles(cfg, fn) -> float:
    """us of fn with gemm.tiles forced to cfg (inf where it does not compile)."""
    default = gemm.tiles
    gemm.tiles = lambda m, elem_bytes: cfg
    try:
        return us(fn)
    except Exception:  # noqa: BLE001 - a tile that does not fit
        return float("inf")
    finally:
        gemm.tiles = default


def main() -> None:
    sweep = "--sweep" in sys.argv
    print(f"{torch.cuda.get_device_name()}: per-call us, bf16; Triton tiles = gemm.tiles(M)")
    for m in ROWS:
        totals = {"cublas": 0.0, "triton": 0.0} | {cfg: 0.0 for cfg in (SWEEP if sweep else [])}
        for name, n, k in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            cublas = us(lambda x=x, w=w: F.linear(x, w))
            triton_us = us(lambda x=x, w=w: gemm.matmul(x, w))
            totals["cublas"] += cublas
            totals["triton"] += triton_us
            print(f"M={m:<5} {name:<8} cuBLAS {cublas:8.1f}  Triton {triton_us:8.1f}  "
                  f"({gemm.tiles(m, 2)})")  # fmt: skip
            for cfg in SWEEP if sweep else []:
                totals[cfg] += with_tiles(cfg, lambda x=x, w=w: gemm.matmul(x, w))
        print(f"M={m:<5} sum      cuBLAS {totals['cublas']:8.1f}  Triton {totals['triton']:8.1f}")
        if sweep:
            best = sorted((v, c) for c, v in totals.items() if isinstance(c, tuple))[:3]
            print(f"         fastest tiles: {[(c, round(v, 1)) for v, c in best]}")


if __name__ == "__main__":
    main()
