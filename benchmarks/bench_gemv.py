"""Skinny GEMM benchmark: cuBLAS (F.linear) vs the Triton skinny kernel
(tinyengine/kernels/gemv/triton.py) on a model's decode shapes (Llama-3-8B at
M in {1, 2, 4, 8}; qwen3-0.6b at M in {1, 8, 16, 32, 64, 256}, past the
kernel's 64 rows cuBLAS alone), plus a config sweep (M == 1, a smaller
one for M == 8, and for qwen3-0.6b DOT tiles split over K at 16 / 32 / 64
rows) printing the best config per shape and a SHAPE_CONFIGS snippet to
paste into tinyengine/kernels/gemv/tiles.py.

    python benchmarks/bench_gemv.py              # everything (under two minutes)
    python benchmarks/bench_gemv.py --no-sweep   # comparison only
    python benchmarks/bench_gemv.py --model qwen3-0.6b --no-sweep
    python benchmarks/bench_gemv.py --dry-run    # list shapes and configs (CPU ok)

The kernel runs as the engine runs it, with a workspace (so the config's
split over K happens).

Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph).
Each timed call walks over several copies of the weight (>= 256 MiB in all)
so every call streams its weight from HBM, not from the 50 MB L2; the time per
call is the replay time over the number of copies. TB/s counts the weight
bytes only (2*N*K; x and y are < 0.2% of it). A script: asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyengine.kernels.gemv.tiles import GemvConfig, pick_config  # noqa: E402
from tinyengine.kernels.gemv.triton import (  # noqa: E402
    DISPATCH_MAX_BYTES_MULTI_ROW,
    MAX_M,
    skinny_linear,
)
from tinyengine.kernels.workspace import Workspace  # noqa: E402

SHAPES = [  # (name, N, K): Llama-3-8B, tp=1
    ("qkv", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
]
LAYERS = 32  # per-token linear time = 32 x (qkv + o + gate_up + down) + lm_head
MS = [1, 2, 4, 8]
MODELS = {  # --model: (shapes, layers, row counts)
    "llama3-8b": (SHAPES, LAYERS, MS),
    "qwen3-0.6b": (
        [("qkv", 4096, 1024), ("o_proj", 1024, 2048), ("gate_up", 6144, 1024),
         ("down", 1024, 3072), ("lm_head", 151936, 1024)],
        28, [1, 8, 16, 32, 64, 256],
    ),
}  # fmt: skip
READ_TBS = 4.42  # HBM read bandwidth of the roofline, as the latency runs measure it
ROTATE_BYTES = 256 * 2**20


def fma(bn: int, bk: int, w: int, s: int) -> GemvConfig:
    return GemvConfig(bn, bk, w, s, use_dot=False)


def fma_r(bn: int, bk: int, w: int, s: int) -> GemvConfig:
    return GemvConfig(bn, bk, w, s, use_dot=False, reduce_each_step=True)


def dot(bn: int, bk: int, w: int, s: int) -> GemvConfig:
    return GemvConfig(bn, bk, w, s, use_dot=True)


# fma s=1: register loads; s>=2: cp.async pipelined (see tinyengine/kernels/gemv/triton.py)
SWEEP_M1 = [
    fma(2, 1024, 4, 3),
    fma(4, 512, 4, 3),
    fma(4, 1024, 4, 3),
    fma(4, 1024, 4, 1),
    fma(8, 256, 4, 3),
    fma(8, 512, 4, 1),
    fma(8, 512, 4, 3),
    fma(8, 512, 4, 4),
    fma(8, 512, 8, 3),
    fma(8, 1024, 8, 3),
    fma(16, 256, 4, 3),
    fma(16, 512, 8, 3),
    fma_r(8, 1024, 4, 1),
    fma_r(8, 1024, 4, 3),
    fma_r(4, 2048, 4, 3),
    dot(16, 256, 4, 4),
    dot(16, 512, 4, 3),
    dot(32, 256, 4, 4),
]
SWEEP_M8 = [
    dot(16, 128, 4, 4),
    dot(16, 256, 4, 4),
    dot(16, 512, 4, 3),
    dot(16, 256, 8, 4),
    dot(32, 256, 4, 4),
    dot(16, 512, 4, 4),
]
# 16-64 rows (--model qwen3-0.6b, whose matrices the DOT loop serves up to
# MAX_M): tile width, K step and stages, each unsplit and split over K in
# 2 / 4 / 8 slices of whole K steps (the engine's split runs with a workspace).
SWEEP_MANY_ROWS = [16, 32, 64]
SWEEP_MANY = [
    dataclasses.replace(dot(bn, bk, 4, st), split_k=sp)
    for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4) for sp in (1, 2, 4, 8)
]  # fmt: skip


def _whole_steps(configs: list[GemvConfig], k: int) -> list[GemvConfig]:
    """The configs whose K slices are whole K steps of at least two (as the
    engine's split rule makes them)."""

    def whole(c: GemvConfig) -> bool:
        return k % (c.split_k * c.block_k) == 0 and k // c.split_k >= 2 * c.block_k

    return [c for c in configs if c.split_k == 1 or whole(c)]


def bench_ms(fn, rep: int) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep, return_mode="median")


def per_call_us(op, x: torch.Tensor, ws: list[torch.Tensor], rep: int) -> float:
    def fn() -> None:
        for w in ws:
            op(x, w)

    return bench_ms(fn, rep) * 1e3 / len(ws)


def tbs(n: int, k: int, us: float) -> float:
    return 2 * n * k / (us * 1e-6) / 1e12


def dry_run(num_sms: int) -> None:
    print(f"shapes (N, K): {[(s, n, k) for s, n, k in SHAPES]}; M in {MS}")
    print(f"default configs with {num_sms} SMs (tinyengine.kernels.gemv.tiles.pick_config):")
    for name, n, k in SHAPES:
        for m in (m for m in MS if m <= MAX_M):  # past MAX_M: cuBLAS
            cfg = pick_config(m, n, k, num_sms)
            progs = -(-n // max(cfg.block_n, 16 if cfg.use_dot else 1))
            print(f"  {name:<8} M={m}: {cfg}  ({progs} programs)")
    print("M=1 sweep:", *[f"  {c}" for c in SWEEP_M1], sep="\n")
    print("M=8 sweep:", *[f"  {c}" for c in SWEEP_M8], sep="\n")
    if max(MS) > 8:
        print(
            f"M in {SWEEP_MANY_ROWS} sweep: {len(SWEEP_MANY)} DOT tiles (those whose split "
            "slices are not whole K steps skipped per shape)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list configs, no GPU needed")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--rep", type=int, default=20, help="ms per do_bench_cudagraph replay")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    args = ap.parse_args()
    global SHAPES, LAYERS, MS
    SHAPES, LAYERS, MS = MODELS[args.model]
    if args.dry_run or not torch.cuda.is_available():
        if not args.dry_run:
            print("no CUDA device: showing the dry run")
        dry_run(132)
        return

    t0 = time.time()
    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}, {num_sms} SMs; roofline {READ_TBS} TB/s read")
    print(
        f"{'shape':<8} {'M':>3} {'cuBLAS us':>10} {'TB/s':>6} {'skinny us':>10} {'TB/s':>6}"
        f" {'speedup':>7} {'%roof':>6} {'err vs cuBLAS':>13} {'err vs fp32':>11}  config"
    )
    totals = {m: [0.0, 0.0] for m in MS}  # per-token linear time (cuBLAS, skinny)
    arena = Workspace(dev)  # the engine's linears take the runner's: the split's scratch

    def skinny(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return skinny_linear(a, b, workspace=arena)

    best_many: dict[int, dict[str, tuple[float, GemvConfig]]] = {}
    best1: dict[str, tuple[float, GemvConfig]] = {}
    best8: dict[str, tuple[float, GemvConfig]] = {}
    default_us: dict[tuple[str, int], float] = {}
    for name, n, k in SHAPES:
        nbytes = 2 * n * k
        copies = max(1, -(-ROTATE_BYTES // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        mult = 1 if name == "lm_head" else LAYERS
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            us_cb = per_call_us(F.linear, x, ws, args.rep)
            if m > MAX_M:  # past the kernel's rows the dispatcher runs cuBLAS
                totals[m][0] += mult * us_cb
                totals[m][1] += mult * us_cb
                print(f"{name:<8} {m:>3} {us_cb:>10.1f} {tbs(n, k, us_cb):>6.2f}  (cuBLAS only)")
                continue
            ref32 = x.float() @ ws[0].float().T
            y_cb = F.linear(x, ws[0])
            y_sk = skinny(x, ws[0])
            err_cb = (y_sk.float() - y_cb.float()).abs().max().item()
            err_32 = (y_sk.float() - ref32).abs().max().item()
            us_sk = per_call_us(skinny, x, ws, args.rep)
            default_us[(name, m)] = us_sk
            totals[m][0] += mult * us_cb
            totals[m][1] += mult * us_sk
            print(
                f"{name:<8} {m:>3} {us_cb:>10.1f} {tbs(n, k, us_cb):>6.2f} {us_sk:>10.1f}"
                f" {tbs(n, k, us_sk):>6.2f} {us_cb / us_sk:>6.2f}x"
                f" {100 * tbs(n, k, us_sk) / READ_TBS:>5.0f}% {err_cb:>13.2e} {err_32:>11.2e}"
                f"  {pick_config(m, n, k, num_sms)}",
                flush=True,
            )
        if not args.no_sweep:
            sweeps = [(1, SWEEP_M1, best1), (8, SWEEP_M8, best8)]
            if max(MS) > 8 and 2 * n * k <= DISPATCH_MAX_BYTES_MULTI_ROW:  # the DOT loop's rows
                sweeps += [(m, _whole_steps(SWEEP_MANY, k), best_many.setdefault(m, {}))
                           for m in SWEEP_MANY_ROWS]  # fmt: skip
            for m, sweep, best in sweeps:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref32 = x.float() @ ws[0].float().T
                rep = max(5, args.rep // 2)
                line = []
                for cfg in sweep:
                    try:
                        y = skinny_linear(x, ws[0], config=cfg, workspace=arena)
                        err = (y.float() - ref32).abs().max().item()

                        def op(a, b, c=cfg):
                            return skinny_linear(a, b, config=c, workspace=arena)

                        us = per_call_us(op, x, ws, rep)
                    except Exception as e:  # out of resources etc.: skip the config
                        print(f"    sweep {name} M={m} {cfg}: failed ({type(e).__name__})")
                        continue
                    flag = "  BAD" if err > 0.1 else ""
                    line.append(f"{cfg}: {us:.1f}us {tbs(n, k, us):.2f}TB/s{flag}")
                    if not flag and (name not in best or us < best[name][0]):
                        best[name] = (us, cfg)
                print(f"  sweep M={m} {name}:", *[f"    {s}" for s in line], sep="\n", flush=True)
        del ws
        torch.cuda.empty_cache()

    print("\nper-token linear time (32 layers x qkv/o/gate_up/down + lm_head), ms:")
    for m in MS:
        cb, sk = totals[m]
        print(f"  M={m}: cuBLAS {cb / 1e3:.3f}  skinny {sk / 1e3:.3f}  saves {(cb - sk) / 1e3:.3f}")
    floor = LAYERS * sum(2 * n * k for s, n, k in SHAPES[:4]) + 2 * SHAPES[4][1] * SHAPES[4][2]
    print(f"  weight-read floor at {READ_TBS} TB/s: {floor / READ_TBS / 1e9:.3f} ms")
    for m, best in ((1, best1), (8, best8), *sorted(best_many.items())):
        if not best:
            continue
        print(f"\nbest M={m} config per shape (vs the default pick):")
        total_best = 0.0
        for name, n, k in SHAPES:
            if name in best:
                us, cfg = best[name]
                d = default_us[(name, m)]
                total_best += (1 if name == "lm_head" else LAYERS) * us
                print(
                    f"  {name:<8} {cfg}: {us:.1f} us ({tbs(n, k, us):.2f} TB/s), default {d:.1f} us"
                )
        print(f"  per-token linear time with the best configs: {total_best / 1e3:.3f} ms")
        bucket = 1 if m == 1 else 8  # SHAPE_CONFIGS keys 2-64 rows as one bucket
        print(f"  paste into tinyengine/kernels/gemv/tiles.py SHAPE_CONFIGS (m_bucket {bucket}"
              f"{'' if m in (1, 8) else f', measured at {m} rows'}):")  # fmt: skip
        for name, n, k in SHAPES:
            if name in best:
                c = best[name][1]
                print(
                    f"    ({bucket}, {n}, {k}): GemvConfig({c.block_n}, {c.block_k}, "
                    f"{c.num_warps}, {c.num_stages}, {c.use_dot}, {c.reduce_each_step}, "
                    f"{c.split_k}),"
                )
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
