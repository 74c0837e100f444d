"""Temporary A/B: fused_moe with and without down's tail tiles, same weights, interleaved."""
import torch
from triton.testing import do_bench_cudagraph
from kernels.triton_moe import fused_moe, moe_config
from kernels.workspace import Workspace

E, K, D, I = 256, 8, 7168, 2048
g = torch.Generator(device="cuda").manual_seed(0)
w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16, generator=g) * D**-0.5
w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16, generator=g) * I**-0.5
for t in (2048, 4096, 8192):
    x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16, generator=g)
    weights, ids = torch.rand(t, E, device="cuda", generator=g).topk(K, dim=-1)
    flops = 2 * t * K * 3 * I * D
    res = {}
    for rnd in range(3):
        for name, cfg in (("tail64", None), ("none", {"down": {"tail_m": 0}}),
                          ("both64", {"gate_up": {"tail_m": 64}})):
            ws = Workspace("cuda")
            run = lambda: fused_moe(x, w13, w2, weights, ids, workspace=ws, config=cfg)  # noqa
            run()
            ms = do_bench_cudagraph(run, rep=60, return_mode="median")
            res.setdefault(name, []).append(ms * 1e3)
    for name, v in res.items():
        best = min(v)
        print(f"T={t:5d} {name:7s} us {[round(u) for u in v]}  best {best:.0f}  {flops / best / 1e6:.1f} TFLOP/s")
