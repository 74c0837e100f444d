"""Experiment (to be removed or folded in): does the expert weights' layout
bound the class-2 fused-MoE GEMMs at DeepSeek-V3 dims?

    python benchmarks/exp_moe_layout.py             # on the GPU
    TRITON_INTERPRET=1 python benchmarks/exp_moe_layout.py --smoke   # CPU check

The GEMMs stream each expert's weights once at T=4096 (~128 rows an expert,
below the ridge), as [BN, BK] TMA boxes of a row-major [E*N, K] matrix: each
box is BN separate 128-byte row pieces. The same boxes stored tile by tile
([E*N/BN, K/BK, BN, BK]) are one contiguous 16-32 KB copy each. Prints:

  1. pure streaming of w13 in gate_up's order (no MMA), row-major BK=64 /
     BK=128 and tiled: TB/s;
  2. gate_up and down alone, row-major vs tiled weights: us, TFLOP/s;
  3. the aux ops of the production op (sort + count, gather, reduction): us;
  4. the whole op, production vs both GEMMs on tiled weights.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import moe as moe_ref  # noqa: E402
from kernels import triton_moe as tm  # noqa: E402
from kernels.tma import descriptor  # noqa: E402


@triton.jit
def _stream(w_desc, out_ptr, INTER: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, TILED: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    nb_per_e: tl.constexpr = INTER // BN
    e = pid // nb_per_e
    w_row = e * 2 * INTER + (pid % nb_per_e) * BN
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if TILED:
            g = w_desc.load([w_row * (K // BK) + (k0 // BK) * BN, 0])
            u = w_desc.load([(w_row + INTER) * (K // BK) + (k0 // BK) * BN, 0])
        else:
            g = w_desc.load([w_row, k0])
            u = w_desc.load([w_row + INTER, k0])
        acc += g.to(tl.float32) + u.to(tl.float32)
    offs = tl.arange(0, BN)[:, None] * BK + tl.arange(0, BK)[None, :]
    tl.store(out_ptr + pid * BN * BK + offs, acc)


def tiled(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[E, N, K] -> [E*N/BN, K/BK, BN, BK] (contiguous), viewed 2-D [E*N*K/BK, BK]."""
    e, n, k = w.shape
    out = torch.empty(e * n // bn, k // bk, bn, bk, dtype=w.dtype, device=w.device)
    for i in range(e):  # per expert: the permuted copy of all 256 at once needs 15 GB more
        rows = n // bn
        out[i * rows:(i + 1) * rows] = w[i].view(rows, bn, k // bk, bk).permute(0, 2, 1, 3)
    return out.view(-1, bk)


def bench(fn, smoke: bool) -> float:
    fn()
    if smoke:
        return float("nan")
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    if args.smoke:
        E, K, D, I, dev, T = 4, 2, 128, 128, "cpu", 64
        dt = torch.float32
    else:
        E, K, D, I, dev, T = 256, 8, 7168, 2048, "cuda", args.tokens
        dt = torch.bfloat16
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * I, D, device=dev) * 0.02).to(dt)
    w2 = (torch.randn(E, D, I, device=dev) * 0.02).to(dt)
    x = torch.randn(T, D, device=dev).to(dt)
    weights, ids = torch.rand(T, E, device=dev).topk(K, dim=-1)
    flops_gu = 2 * T * K * 2 * I * D
    flops_dn = 2 * T * K * I * D

    # 1. streaming
    w13_bytes = w13.numel() * w13.element_size()
    for bn, bk, is_tiled in ((128, 64, 0), (128, 128, 0), (128, 64, 1), (64, 128, 0)):
        bn_, bk_ = min(bn, I), min(bk, D)
        src = tiled(w13, bn_, bk_) if is_tiled else w13.view(-1, D)
        desc = descriptor(src, src.shape[0], src.stride(0), [bn_, bk_])
        out = torch.empty(E * I // bn_, bn_, bk_, device=dev)
        grid = (E * I // bn_,)
        us = bench(lambda: _stream[grid](desc, out, INTER=I, K=D, BN=bn_, BK=bk_, TILED=is_tiled,
                                         num_warps=4, num_stages=4), args.smoke)  # fmt: skip
        print(f"stream w13 bn{bn_} bk{bk_} tiled={is_tiled}: {us:8.1f} us "
              f"{w13_bytes / us / 1e6:5.2f} TB/s", flush=True)  # fmt: skip
        del src

    # 2. GEMMs alone
    cfg = tm._resolve(tm.moe_config(T, K, E, D, I, w13.element_size()), None)
    if args.smoke:
        for g in tm.GEMMS:
            cfg[g].update(block_m=32, block_n=64, block_k=64, tail_m=16, num_stages=1, tma=2)
    s = tm._scratch(x, w13, w2, ids, None, sorted_x=cfg["gate_up"]["tma"] >= tm.TMA_AW)
    tm._group(ids, s)
    gu = tm._gate_up_launch(x, w13, s, K, cfg["gate_up"])
    dn = tm._down_launch(w2, s, cfg["down"])
    c_gu, c_dn = cfg["gate_up"], cfg["down"]
    w13_t = tiled(w13, c_gu["block_n"], c_gu["block_k"])
    w2_t = tiled(w2, c_dn["block_n"], c_dn["block_k"])

    def with_tiled(launch, w_t, c):
        kernel, grid, a, kw = launch
        a = list(a)
        a[2] = descriptor(w_t, w_t.shape[0], w_t.stride(0), [c["block_n"], c["block_k"]])
        return kernel, grid, tuple(a), dict(kw, W_TILED=1)

    gu_t = gu[:-1] + [with_tiled(gu[-1], w13_t, c_gu)]
    dn_t = [with_tiled(dn[0], w2_t, c_dn)]
    tm._run(gu)
    act_ref = s.act.clone()
    tm._run(gu_t)
    print("gate_up tiled == row-major:", torch.equal(act_ref, s.act))
    tm._run(dn)
    y_ref = s.y.clone()
    tm._run(dn_t)
    print("down tiled == row-major:", torch.equal(y_ref, s.y))
    gather = gu[:-1]
    for name, launches, flops in (("gate_up", gu[-1:], flops_gu), ("gate_up tiled", gu_t[-1:], flops_gu),
                                  ("down", dn, flops_dn), ("down tiled", dn_t, flops_dn)):  # fmt: skip
        us = bench(lambda launches=launches: tm._run(launches), args.smoke)
        print(f"{name:14s}: {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s", flush=True)

    # 3. aux ops
    out = torch.empty(T, D, dtype=dt, device=dev)
    print(f"group (sort+count): {bench(lambda: tm._group(ids, s), args.smoke):8.1f} us")

    def group_int64() -> None:  # the grouping before narrowed keys: sort the router's ids
        flat = ids.reshape(-1)
        torch.sort(flat, stable=True, out=(sorted64, s.order))
        s.counts.zero_()
        tm._count_kernel[(triton.cdiv(flat.numel(), tm._COUNT_BLOCK),)](
            flat, s.counts, flat.numel(), flat.stride(0), NUM_EXPERTS=E,
            E_POW2=triton.next_power_of_2(E), BLOCK=tm._COUNT_BLOCK)  # fmt: skip

    sorted64 = torch.empty_like(ids.reshape(-1))
    print(f"group, int64 keys : {bench(group_int64, args.smoke):8.1f} us")
    print(f"gather            : {bench(lambda: tm._run(gather), args.smoke):8.1f} us")
    print(f"sum_topk          : {bench(lambda: tm._sum_topk(s.y, weights, out), args.smoke):8.1f} us")

    # 4. whole op
    flops = flops_gu + flops_dn

    def whole(tiles: bool) -> torch.Tensor:
        tm._group(ids, s)
        tm._run(gu_t if tiles else gu)
        tm._run(dn_t if tiles else dn)
        tm._sum_topk(s.y, weights, out)
        return out

    for rnd in range(3):
        for tiles in (False, True):
            us = bench(lambda tiles=tiles: whole(tiles), args.smoke)
            print(f"round {rnd} whole op tiled={tiles}: {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s",
                  flush=True)  # fmt: skip
    us = bench(lambda: tm.fused_moe(x, w13, w2, weights, ids), args.smoke)
    print(f"fused_moe (production, own scratch): {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s")
    if args.smoke:
        ref = moe_ref.fused_moe(x, w13, w2, weights, ids)
        print("whole tiled vs reference max err:", (whole(True) - ref).abs().max().item())


if __name__ == "__main__":
    main()
