"""DeepSeek kernel benchmark (prints figures; not a test).

    python benchmarks/bench_deepseek_kernels.py

MLA decode over the paged latent cache (128 heads, latent 512 + rope 64,
bf16; 64-token cache blocks, the engine's default for DeepSeek on CUDA, whose
whole pages the kernel loads through TMA, and 16-token blocks, gathered row
by row): latent bytes read / time. Fused MoE at V3 dims (256 experts,
top-8, hidden 7168, expert width 2048, bf16): expert-weight bytes touched /
time for few tokens, TFLOP/s for many. Timed as CUDA-graph replays (medians).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from tinyengine.kernels.mla.triton import mla_decode  # noqa: E402
from tinyengine.kernels.moe.triton import fused_moe  # noqa: E402
from tinyengine.kernels.workspace import Workspace  # noqa: E402

DEV = "cuda"


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), rep=100, return_mode="median")
    return 2 * x.numel() / ms / 1e9


def bench_mla(batch: int, ctx: int, heads: int, copy_tbs: float, bs: int = 64) -> None:
    L, R = 512, 64
    blocks = batch * ctx // bs
    cache = torch.randn(blocks, bs, 1, L + R, device=DEV, dtype=torch.bfloat16)
    table = torch.randperm(blocks, device=DEV, dtype=torch.int32).view(batch, ctx // bs)
    seq_lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    q_lat = torch.randn(batch, heads, L, device=DEV, dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, R, device=DEV, dtype=torch.bfloat16)
    ws = Workspace(DEV)

    def run() -> torch.Tensor:
        return mla_decode(q_lat, q_rope, cache, table, seq_lens, 0.1, max_seq_len=ctx, workspace=ws)

    run()
    ms = do_bench_cudagraph(run, rep=100, return_mode="median")
    tbs = cache.numel() * 2 / ms / 1e9
    print(f"mla_decode  B={batch:<4} H={heads:<4} ctx={ctx:<6} bs={bs:<3} {ms * 1e3:9.1f} us "
          f"{tbs:6.2f} TB/s  {100 * tbs / copy_tbs:5.1f}% of copy")  # fmt: skip


def bench_moe(tokens: int, copy_tbs: float, experts: int = 256) -> None:
    D, I, K = 7168, 2048, 8
    w13 = torch.randn(experts, 2 * I, D, device=DEV, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, D, I, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, D, device=DEV, dtype=torch.bfloat16)
    scores = torch.rand(tokens, experts, device=DEV)
    weights, ids = scores.topk(K, dim=-1)
    ws = Workspace(DEV)

    def run() -> torch.Tensor:
        return fused_moe(x, w13, w2, weights, ids, workspace=ws)

    run()
    ms = do_bench_cudagraph(run, rep=100, return_mode="median")
    touched = ids.unique().numel()
    bytes_ = touched * 3 * I * D * 2
    flops = 2 * tokens * K * 3 * I * D
    print(f"fused_moe   T={tokens:<5} experts touched={touched:<4} {ms * 1e3:9.1f} us "
          f"{bytes_ / ms / 1e9:6.2f} TB/s weights  {flops / ms / 1e9:7.1f} TFLOP/s")  # fmt: skip


def main() -> None:
    copy_tbs = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: copy {copy_tbs:.2f} TB/s (read+write)")
    for batch, heads, bs in ((64, 128, 64), (64, 128, 16), (1, 128, 64), (64, 16, 64)):
        bench_mla(batch, 4096, heads, copy_tbs, bs)
    for tokens in (1, 16, 4096):
        bench_moe(tokens, copy_tbs)


if __name__ == "__main__":
    main()
