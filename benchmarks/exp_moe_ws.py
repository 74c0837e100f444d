# ruff: noqa: B023, E501  (a throwaway experiment script)
"""EXPERIMENT (not for landing as is): fused-MoE class-2 GEMMs with Triton's
automatic warp specialization on Hopper (tl.range(warp_specialize=True),
num_warps=4: one producer warpgroup issuing TMA, two consumer warpgroups).

Triton 3.6's Hopper pass fails on the production kernels' in-kernel block
lookup (vector loads + cumsum before the loop) and on early returns, so the
M-block -> (expert, first row, first index in segment, count) table is built
by a tiny kernel first, and dead blocks run a zero-trip K loop.

    python benchmarks/exp_moe_ws.py [--tokens 4096,8192] [--compile-only]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import triton_moe as tm  # noqa: E402
from kernels.moe_gemm import _block_rows, _program_tile, _store_rows, _store_swiglu  # noqa: E402
from kernels.tma import descriptor  # noqa: E402

E, K, D, I = 256, 8, 7168, 2048
DT = torch.bfloat16


@triton.jit
def _table_kernel(counts_ptr, table_ptr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
                  BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    expert, row0, first_in_seg, count = _block_rows(
        b, counts_ptr, NUM_EXPERTS, E_POW2, BLOCK_M, TAIL_M
    )
    dead = expert >= NUM_EXPERTS
    tl.store(table_ptr + 4 * b, tl.where(dead, -1, expert))
    tl.store(table_ptr + 4 * b + 1, tl.where(dead, 0, row0))
    tl.store(table_ptr + 4 * b + 2, first_in_seg)
    tl.store(table_ptr + 4 * b + 3, tl.where(dead, 0, count))


@triton.jit(do_not_specialize=["group_m"])
def _gate_up_ws(x_desc, w_desc, act_ptr, table_ptr, stride_am, group_m,
                INTER: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid_m, pid_n = _program_tile(tl.cdiv(INTER, BLOCK_N), group_m)
    expert = tl.load(table_ptr + 4 * pid_m)
    row0 = tl.load(table_ptr + 4 * pid_m + 1)
    first_in_seg = tl.load(table_ptr + 4 * pid_m + 2)
    count = tl.load(table_ptr + 4 * pid_m + 3)
    k_end = tl.where(
        expert < 0, BLOCK_K, HIDDEN
    )  # a zero-trip WS loop may hang: dead blocks run one step
    expert = tl.maximum(expert, 0)
    w_row = expert * (2 * INTER) + pid_n * BLOCK_N
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, k_end, BLOCK_K, warp_specialize=True):
        xt = x_desc.load([row0, k0])
        wg = w_desc.load([w_row, k0])
        wu = w_desc.load([w_row + INTER, k0])
        acc_g = tl.dot(xt, wg.T, acc_g)
        acc_u = tl.dot(xt, wu.T, acc_u)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = first_in_seg + tl.arange(0, BLOCK_M) < count
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _store_swiglu(acc_g, acc_u, act_ptr, rows, row_ok, offs_n, stride_am, INTER)


@triton.jit(do_not_specialize=["group_m"])
def _down_ws_tail(a_desc, at_desc, w_desc, y_ptr, order_ptr, table_ptr, stride_ym, group_m,
                  INTER: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL_M: tl.constexpr):  # fmt: skip
    pid_m, pid_n = _program_tile(tl.cdiv(HIDDEN, BLOCK_N), group_m)
    expert = tl.load(table_ptr + 4 * pid_m)
    row0 = tl.load(table_ptr + 4 * pid_m + 1)
    first_in_seg = tl.load(table_ptr + 4 * pid_m + 2)
    count = tl.load(table_ptr + 4 * pid_m + 3)
    left = count - first_in_seg - BLOCK_M
    tail = (left > 0) & (left <= TAIL_M)
    k_end = tl.where(
        expert < 0, BLOCK_K, INTER
    )  # a zero-trip WS loop may hang: dead blocks run one step
    k_main = tl.where(tail, 0, k_end)
    k_tail = tl.where(tail, k_end, 0)
    expert = tl.maximum(expert, 0)
    w_row = expert * HIDDEN + pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([TAIL_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, k_main, BLOCK_K, warp_specialize=True):
        a = a_desc.load([row0, k0])
        w = w_desc.load([w_row, k0])
        acc = tl.dot(a, w.T, acc)
    for k0 in tl.range(0, k_tail, BLOCK_K, warp_specialize=True):
        a = a_desc.load([row0, k0])
        at = at_desc.load([row0 + BLOCK_M, k0])
        w = w_desc.load([w_row, k0])
        acc = tl.dot(a, w.T, acc)
        acc_t = tl.dot(at, w.T, acc_t)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = first_in_seg + tl.arange(0, BLOCK_M) < count
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _store_rows(acc, y_ptr, order_ptr, rows, row_ok, offs_n, stride_ym, HIDDEN)
    t_rows = row0 + BLOCK_M + tl.arange(0, TAIL_M)
    t_ok = first_in_seg + BLOCK_M + tl.arange(0, TAIL_M) < count
    _store_rows(acc_t, y_ptr, order_ptr, t_rows, t_ok, offs_n, stride_ym, HIDDEN)


@triton.jit(do_not_specialize=["group_m"])
def _down_ws(a_desc, w_desc, y_ptr, order_ptr, table_ptr, stride_ym, group_m,
             INTER: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid_m, pid_n = _program_tile(tl.cdiv(HIDDEN, BLOCK_N), group_m)
    expert = tl.load(table_ptr + 4 * pid_m)
    row0 = tl.load(table_ptr + 4 * pid_m + 1)
    first_in_seg = tl.load(table_ptr + 4 * pid_m + 2)
    count = tl.load(table_ptr + 4 * pid_m + 3)
    k_end = tl.where(
        expert < 0, BLOCK_K, INTER
    )  # a zero-trip WS loop may hang: dead blocks run one step
    expert = tl.maximum(expert, 0)
    w_row = expert * HIDDEN + pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, k_end, BLOCK_K, warp_specialize=True):
        a = a_desc.load([row0, k0])
        w = w_desc.load([w_row, k0])
        acc = tl.dot(a, w.T, acc)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = first_in_seg + tl.arange(0, BLOCK_M) < count
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _store_rows(acc, y_ptr, order_ptr, rows, row_ok, offs_n, stride_ym, HIDDEN)


@triton.jit
def _dense_probe(a_desc, b_desc, c_ptr, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    """A plain C = A @ B^T tile loop: does automatic WS run at all here?"""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=WS):
        acc = tl.dot(a_desc.load([pm * BM, k0]), b_desc.load([pn * BN, k0]).T, acc)
    offs_m = pm * BM + tl.arange(0, BM)
    offs_n = pn * BN + tl.arange(0, BN)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16))


def probe(ws: bool) -> None:
    from triton.testing import do_bench

    m = n = 4096
    k = 7168
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bm, bn, bk = 128, 128, 64
    ad = descriptor(a, m, a.stride(0), [bm, bk])
    bd = descriptor(b, n, b.stride(0), [bn, bk])

    def run():
        _dense_probe[(m // bm, n // bn)](
            ad, bd, c, N=n, K=k, BM=bm, BN=bn, BK=bk, WS=ws, num_warps=4 if ws else 8, num_stages=3
        )

    run()
    torch.cuda.synchronize()
    err = (c.float() - a.float() @ b.float().T).abs().max().item()
    ms = do_bench(run, rep=100, return_mode="median")
    print(
        f"dense probe ws={ws}: {ms * 1e3:.1f} us {2 * m * n * k / ms / 1e9:.1f} TFLOP/s max|err| {err:.3g}",
        flush=True,
    )


def ws_moe(x, w13, w2, topk_weights, topk_ids, cfg):
    """The whole op with the WS GEMMs; cfg = dict(bm, bn_gu, bn_dn, st_gu, st_dn, gm_gu, gm_dn)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    s = tm._scratch(x, w13, w2, topk_ids, None, sorted_x=True)
    bm, bk = cfg["bm"], 64
    m_blocks = tm.max_m_blocks(num_pairs, E, bm)
    table = torch.empty(m_blocks, 4, dtype=torch.int32, device=x.device)
    gather = tm._gate_up_launch(
        x,
        w13,
        s,
        top_k,
        dict(
            block_m=bm,
            block_n=128,
            block_k=bk,
            num_warps=8,
            num_stages=3,
            group_m=2,
            tma=2,
            tail_m=0,
        ),
    )[0]
    x_desc = descriptor(s.xs, num_pairs, s.xs.stride(0), [bm, bk])
    wg_desc = descriptor(w13, E * 2 * I, w13.stride(1), [cfg["bn_gu"], bk])
    a_desc = descriptor(s.act, num_pairs, s.act.stride(0), [bm, bk])
    wd_desc = descriptor(w2, E * D, w2.stride(1), [cfg["bn_dn"], bk])
    out = torch.empty(num_tokens, D, dtype=x.dtype, device=x.device)

    def gm(g):
        return g if 0 < g < m_blocks else m_blocks

    def run_gate_up():
        _gate_up_ws[(m_blocks * triton.cdiv(I, cfg["bn_gu"]),)](
            x_desc,
            wg_desc,
            s.act,
            table,
            s.act.stride(0),
            gm(cfg["gm_gu"]),
            INTER=I,
            HIDDEN=D,
            BLOCK_M=bm,
            BLOCK_N=cfg["bn_gu"],
            BLOCK_K=bk,
            num_warps=4,
            num_stages=cfg["st_gu"],
        )

    def run_down():
        _down_ws[(m_blocks * triton.cdiv(D, cfg["bn_dn"]),)](
            a_desc,
            wd_desc,
            s.y,
            s.order,
            table,
            s.y.stride(0),
            gm(cfg["gm_dn"]),
            INTER=I,
            HIDDEN=D,
            BLOCK_M=bm,
            BLOCK_N=cfg["bn_dn"],
            BLOCK_K=bk,
            num_warps=4,
            num_stages=cfg["st_dn"],
        )

    def run():
        tm._group(topk_ids, s)
        _table_kernel[(m_blocks,)](
            s.counts, table, NUM_EXPERTS=E, E_POW2=triton.next_power_of_2(E), BLOCK_M=bm, TAIL_M=0
        )
        tm._run([gather])
        run_gate_up()
        run_down()
        tm._sum_topk(s.y, topk_weights, out)
        return out

    return run, run_gate_up, run_down


def compile_only():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name, kern, bn, extra in (
        ("gate_up", _gate_up_ws, 128, {}),
        ("down", _down_ws, 256, {}),
        ("down128", _down_ws, 128, {}),
        ("down_tail", _down_ws_tail, 256, {"TAIL_M": 64}),
        ("down_tail128", _down_ws_tail, 128, {"TAIL_M": 64}),
    ):
        for st in (3, 4):
            sig = {n: "i32" for n in kern.arg_names}
            bm, bk = 128, 64
            sig.update(
                {
                    kern.arg_names[0]: f"tensordesc<bf16[{bm}, {bk}]>",
                    kern.arg_names[1]: f"tensordesc<bf16[{bn}, {bk}]>",
                }
            )
            if extra:
                sig.update(
                    {
                        "at_desc": "tensordesc<bf16[64, 64]>",
                        "w_desc": f"tensordesc<bf16[{bn}, {bk}]>",
                    }
                )
            for n in kern.arg_names:
                if n.endswith("_ptr"):
                    sig[n] = (
                        "*i64" if n == "order_ptr" else ("*i32" if n == "table_ptr" else "*bf16")
                    )
                if n.isupper():
                    sig[n] = "constexpr"
            const = dict(INTER=I, HIDDEN=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **extra)
            attrs = {
                (i,): [["tt.divisibility", 16]]
                for i, n in enumerate(kern.arg_names)
                if n.endswith("_ptr") or n.startswith("stride")
            }
            c = triton.compile(
                ASTSource(fn=kern, signature=sig, constexprs=const, attrs=attrs),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 4, "num_stages": st},
            )
            ptx = c.asm["ptx"]
            print(
                name,
                "stages",
                st,
                "setmaxnreg",
                ptx.count("setmaxnreg"),
                "wgmma",
                ptx.count("wgmma.mma_async"),
                "shared",
                c.metadata.shared,
            )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="4096,8192")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--probe", type=int, default=None, help="1/0: the dense WS probe on/off")
    p.add_argument("--only", default="")
    p.add_argument("--skip-prod", action="store_true")
    args = p.parse_args()
    if args.probe is not None:
        probe(bool(args.probe))
        return
    if args.compile_only:
        compile_only()
        return
    from triton.testing import do_bench_cudagraph

    global E, K, D, I, DT
    dev = "cuda"
    if args.tiny:  # CPU check of the host logic under TRITON_INTERPRET=1
        E, K, D, I, dev, DT = 8, 2, 256, 128, "cpu", torch.float32
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, device=dev, dtype=DT) * 0.02
    w2 = torch.randn(E, D, I, device=dev, dtype=DT) * 0.02
    configs = [
        dict(bm=128, bn_gu=128, bn_dn=256, st_gu=3, st_dn=3, gm_gu=2, gm_dn=4),
        dict(bm=128, bn_gu=128, bn_dn=256, st_gu=4, st_dn=3, gm_gu=2, gm_dn=4),
        dict(bm=128, bn_gu=128, bn_dn=128, st_gu=3, st_dn=4, gm_gu=2, gm_dn=4),
        dict(bm=128, bn_gu=128, bn_dn=256, st_gu=3, st_dn=3, gm_gu=8, gm_dn=16),
        dict(bm=128, bn_gu=64, bn_dn=256, st_gu=4, st_dn=3, gm_gu=2, gm_dn=4),
    ]
    for t in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(t, D, device=dev, dtype=DT)
        scores = torch.randn(t, E, device=dev).softmax(-1)
        weights, ids = scores.topk(K, dim=-1)
        flops = 2 * t * K * 3 * I * D
        ref = tm.fused_moe(x, w13, w2, weights, ids)
        if args.tiny:
            for cfg in configs:
                run, gu, dn = ws_moe(x, w13, w2, weights, ids, cfg)
                print(cfg, (run().float() - ref.float()).abs().max().item())
            continue
        if not args.skip_prod:
            cfg_p = tm.moe_config(t, K, E, D, I)
            s = tm._scratch(x, w13, w2, ids, None, sorted_x=True)
            tm._group(ids, s)
            gu_l = tm._gate_up_launch(x, w13, s, K, cfg_p["gate_up"])
            dn_l = tm._down_launch(w2, s, cfg_p["down"])
            tm._run(gu_l)
            ms_gu = do_bench_cudagraph(lambda: tm._run(gu_l[1:]), rep=100, return_mode="median")
            ms_dn = do_bench_cudagraph(lambda: tm._run(dn_l), rep=100, return_mode="median")
            print(
                f"T={t} production gate_up {ms_gu * 1e3:.1f} us, down {ms_dn * 1e3:.1f} us",
                flush=True,
            )
            ms = do_bench_cudagraph(
                lambda: tm.fused_moe(x, w13, w2, weights, ids), rep=200, return_mode="median"
            )
            print(f"T={t} production: {ms * 1e3:.1f} us {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
        for ci, cfg in enumerate(configs):
            if args.only and str(ci) not in args.only.split(","):
                continue
            try:
                run, gu, dn = ws_moe(x, w13, w2, weights, ids, cfg)
                out = run().clone()
                err = (out.float() - ref.float()).abs().max().item()
                ms = do_bench_cudagraph(run, rep=200, return_mode="median")
                ms_gu = do_bench_cudagraph(gu, rep=100, return_mode="median")
                ms_dn = do_bench_cudagraph(dn, rep=100, return_mode="median")
                print(
                    f"T={t} ws {cfg}: {ms * 1e3:.1f} us {flops / ms / 1e9:.1f} TFLOP/s "
                    f"(gate_up {ms_gu * 1e3:.1f}, down {ms_dn * 1e3:.1f}) max|diff| {err:.3g}",
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001
                print(f"T={t} ws {cfg}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
