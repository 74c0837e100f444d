"""Experiment (to be removed): class-2 fused MoE at DeepSeek-V3 dims, T=4096,
with narrower K steps and deeper rings (BK=32, 6-8 stages: more weight bytes
in flight per SM for the same shared memory) against the default BK=64 x 4.

    python benchmarks/exp_moe_bk.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from kernels.triton_moe import fused_moe  # noqa: E402
from kernels.workspace import Workspace  # noqa: E402

E, K, D, I = 256, 8, 7168, 2048
VARIANTS = {
    "default bk64 x4": None,
    "gu bk32 x8": {"gate_up": {"block_k": 32, "num_stages": 8}},
    "gu bk32 x7": {"gate_up": {"block_k": 32, "num_stages": 7}},
    "dn bk32 x8": {"down": {"block_k": 32, "num_stages": 8}},
    "dn bk32 x6": {"down": {"block_k": 32, "num_stages": 6}},
    "both bk32 x8": {"gate_up": {"block_k": 32, "num_stages": 8},
                     "down": {"block_k": 32, "num_stages": 8}},  # fmt: skip
}


def main() -> None:
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02
    for T in (4096, 8192):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.rand(T, E, device="cuda").topk(K, dim=-1)
        flops = 2 * T * K * 3 * I * D
        ref = fused_moe(x, w13, w2, weights, ids, workspace=Workspace("cuda"))
        runs = {}
        for name, cfg in VARIANTS.items():
            ws = Workspace("cuda")
            try:
                out = fused_moe(x, w13, w2, weights, ids, workspace=ws, config=cfg)
            except Exception as err:  # noqa: BLE001 - an experiment: report and go on
                print(f"T={T} {name}: failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            err = (out.float() - ref.float()).abs().max().item()
            print(f"T={T} {name}: max |diff| vs default {err:.3g}", flush=True)
            runs[name] = (cfg, ws)
        for rnd in range(3):
            for name, (cfg, ws) in runs.items():
                ms = do_bench_cudagraph(
                    lambda cfg=cfg, ws=ws, x=x, tw=weights, ti=ids: fused_moe(
                        x, w13, w2, tw, ti, workspace=ws, config=cfg),  # fmt: skip
                    rep=100, return_mode="median",
                )  # fmt: skip
                print(f"T={T} round {rnd} {name:16s} {ms * 1e3:8.1f} us "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
