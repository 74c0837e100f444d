"""Experiment: grouped-GEMM variants for the fused MoE at large T (prints figures).

    python benchmarks/exp_moe_variants.py                 # H200, DeepSeek-V3 dims
    TRITON_INTERPRET=1 python benchmarks/exp_moe_variants.py --smoke   # CPU self-check

Times, at T tokens (default 4096) with the random routing of sweep_moe.py and
with a balanced one (every expert exactly T*K/E rows: no partial blocks), the
production gate_up / down GEMMs (kernels/triton_moe.py, heuristic tiles)
against variants written here:

  - persistent: a grid of one program per SM looping over the tiles
    (tl.range(flatten=...): with flatten the K loop and the tile loop are one
    software-pipelined loop, so the next tile's loads overlap this one's
    epilogue);
  - fused_n (gate_up): w13 re-laid so gate row j and up row j are adjacent
    (rows 2j, 2j+1), one [2*BLOCK_N, BLOCK_K] weight tile and one dot per K
    step, the accumulator split into gate/up columns in registers.

Each variant's output is checked against the production kernel's.
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
from kernels.triton_attention import _interpreting  # noqa: E402


@triton.jit
def _tile_of(tile, total_m, group_m, NUM_N: tl.constexpr):
    per_group = group_m * NUM_N
    first_m = (tile // per_group) * group_m
    group_rows = tl.minimum(total_m - first_m, group_m)
    local = tile % per_group
    return first_m + local % group_rows, local // group_rows


@triton.jit
def _gate_up_var(
    x_desc, w_desc, act_ptr, counts_ptr, stride_am, group_m,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr, FUSED_N: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    e_idx = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < NUM_EXPERTS, other=0)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, 0)
    total_m = tl.sum(nblk, 0)
    NUM_N: tl.constexpr = (INTER + BLOCK_N - 1) // BLOCK_N
    num_tiles = total_m * NUM_N
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLATTEN):
        pid_m, pid_n = _tile_of(tile, total_m, group_m, NUM_N)
        expert = tl.sum((blk_end <= pid_m).to(tl.int32), 0)
        before = e_idx < expert
        seg_start = tl.sum(tl.where(before, counts, 0), 0)
        first_blk = tl.sum(tl.where(before, nblk, 0), 0)
        count = tl.sum(tl.where(e_idx == expert, counts, 0), 0)
        first_in_seg = (pid_m - first_blk) * BLOCK_M
        row0 = seg_start + first_in_seg
        if FUSED_N:
            w_row = expert * (2 * INTER) + pid_n * (2 * BLOCK_N)
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            for k0 in range(0, HIDDEN, BLOCK_K):
                a = x_desc.load([row0, k0])
                w = w_desc.load([w_row, k0])
                if UPCAST:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(a, w.T, acc)
            acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        else:
            w_row = expert * (2 * INTER) + pid_n * BLOCK_N
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, HIDDEN, BLOCK_K):
                a = x_desc.load([row0, k0])
                wg = w_desc.load([w_row, k0])
                wu = w_desc.load([w_row + INTER, k0])
                if UPCAST:
                    a = a.to(tl.float32)
                    wg = wg.to(tl.float32)
                    wu = wu.to(tl.float32)
                acc_g = tl.dot(a, wg.T, acc_g)
                acc_u = tl.dot(a, wu.T, acc_u)
        gate = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)
        up = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = first_in_seg + tl.arange(0, BLOCK_M) < count
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
        tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_n < INTER)[None, :])  # fmt: skip


@triton.jit
def _down_var(
    a_desc, w_desc, y_ptr, order_ptr, counts_ptr, stride_ym, group_m,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    e_idx = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < NUM_EXPERTS, other=0)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, 0)
    total_m = tl.sum(nblk, 0)
    NUM_N: tl.constexpr = (HIDDEN + BLOCK_N - 1) // BLOCK_N
    num_tiles = total_m * NUM_N
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLATTEN):
        pid_m, pid_n = _tile_of(tile, total_m, group_m, NUM_N)
        expert = tl.sum((blk_end <= pid_m).to(tl.int32), 0)
        before = e_idx < expert
        seg_start = tl.sum(tl.where(before, counts, 0), 0)
        first_blk = tl.sum(tl.where(before, nblk, 0), 0)
        count = tl.sum(tl.where(e_idx == expert, counts, 0), 0)
        first_in_seg = (pid_m - first_blk) * BLOCK_M
        row0 = seg_start + first_in_seg
        w_row = expert * HIDDEN + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            a = a_desc.load([row0, k0])
            w = w_desc.load([w_row, k0])
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w.T, acc)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = first_in_seg + tl.arange(0, BLOCK_M) < count
        pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_n < HIDDEN)[None, :])  # fmt: skip


@triton.jit
def _tail_block(pid_m, counts_ptr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
                BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr):  # fmt: skip
    """Blocks of BLOCK_M rows; an expert's last block also covers up to TAIL_M
    rows past it (n_e = max(1, cdiv(c - TAIL_M, BLOCK_M)) blocks, 0 if c == 0).
    Returns (expert, first sorted row, first row in segment, count)."""
    e_idx = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < NUM_EXPERTS, other=0)
    nblk = tl.where(counts > 0, tl.maximum((counts - TAIL_M + BLOCK_M - 1) // BLOCK_M, 1), 0)
    blk_end = tl.cumsum(nblk, 0)
    expert = tl.sum((blk_end <= pid_m).to(tl.int32), 0)
    before = e_idx < expert
    seg_start = tl.sum(tl.where(before, counts, 0), 0)
    first_blk = tl.sum(tl.where(before, nblk, 0), 0)
    count = tl.sum(tl.where(e_idx == expert, counts, 0), 0)
    first_in_seg = (pid_m - first_blk) * BLOCK_M
    return expert, seg_start + first_in_seg, first_in_seg, count


@triton.jit
def _gu_loop(x_desc, xt_desc, w_desc, row0, w_row, INTER: tl.constexpr, HIDDEN: tl.constexpr,
             BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, WITH_TAIL: tl.constexpr, FUSED: tl.constexpr,
             UPCAST: tl.constexpr):  # fmt: skip
    """(gate, up, gate_tail, up_tail) accumulators; fused: gate/up interleaved columns."""
    W: tl.constexpr = 2 * BLOCK_N if FUSED else BLOCK_N
    g = tl.zeros([BLOCK_M, W], dtype=tl.float32)
    u = tl.zeros([BLOCK_M, W], dtype=tl.float32)
    gt = tl.zeros([TAIL_M, W], dtype=tl.float32)
    ut = tl.zeros([TAIL_M, W], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        a = x_desc.load([row0, k0])
        wg = w_desc.load([w_row, k0])
        if not FUSED:
            wu = w_desc.load([w_row + INTER, k0])
        if WITH_TAIL:
            at = xt_desc.load([row0 + BLOCK_M, k0])
        if UPCAST:
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            if not FUSED:
                wu = wu.to(tl.float32)
            if WITH_TAIL:
                at = at.to(tl.float32)
        g = tl.dot(a, wg.T, g)
        if not FUSED:
            u = tl.dot(a, wu.T, u)
        if WITH_TAIL:
            gt = tl.dot(at, wg.T, gt)
            if not FUSED:
                ut = tl.dot(at, wu.T, ut)
    return g, u, gt, ut


@triton.jit
def _swiglu_store(g, u, act_ptr, rows, ok, offs_n, n_ok, stride_am, ROWS: tl.constexpr,
                  BLOCK_N: tl.constexpr, FUSED: tl.constexpr):  # fmt: skip
    if FUSED:
        g, u = tl.split(tl.reshape(g, [ROWS, BLOCK_N, 2]))
    g = g.to(act_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(act_ptr.dtype.element_ty).to(tl.float32)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :],
             (g / (1.0 + tl.exp(-g)) * u).to(act_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _gate_up_tail(
    x_desc, xt_desc, w_desc, act_ptr, counts_ptr, stride_am, group_m,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FUSED: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One weight tile per K step feeds the main [BLOCK_M] rows and, on an
    expert's last block, up to TAIL_M more rows (second accumulators); two
    copies of the K loop (with and without the tail) so neither branches
    inside. FUSED: w13 interleaved (gate j, up j adjacent rows), one dot."""
    NUM_N: tl.constexpr = (INTER + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.num_programs(0) // NUM_N, group_m, NUM_N)
    expert, row0, first_in_seg, count = _tail_block(
        pid_m, counts_ptr, NUM_EXPERTS, E_POW2, BLOCK_M, TAIL_M)
    if expert >= NUM_EXPERTS:
        return
    left = count - first_in_seg - BLOCK_M  # rows past the main tile
    has_tail = (left > 0) & (left <= TAIL_M)  # only the expert's last block
    if FUSED:
        w_row = expert * (2 * INTER) + pid_n * (2 * BLOCK_N)
    else:
        w_row = expert * (2 * INTER) + pid_n * BLOCK_N
    if has_tail:
        g, u, gt, ut = _gu_loop(x_desc, xt_desc, w_desc, row0, w_row, INTER, HIDDEN, BLOCK_M,
                                TAIL_M, BLOCK_N, BLOCK_K, True, FUSED, UPCAST)
    else:
        g, u, gt, ut = _gu_loop(x_desc, xt_desc, w_desc, row0, w_row, INTER, HIDDEN, BLOCK_M,
                                TAIL_M, BLOCK_N, BLOCK_K, False, FUSED, UPCAST)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    _swiglu_store(g, u, act_ptr, row0 + tl.arange(0, BLOCK_M),
                  first_in_seg + tl.arange(0, BLOCK_M) < count, offs_n, n_ok, stride_am,
                  BLOCK_M, BLOCK_N, FUSED)  # fmt: skip
    if has_tail:
        _swiglu_store(gt, ut, act_ptr, row0 + BLOCK_M + tl.arange(0, TAIL_M),
                      first_in_seg + BLOCK_M + tl.arange(0, TAIL_M) < count, offs_n, n_ok,
                      stride_am, TAIL_M, BLOCK_N, FUSED)  # fmt: skip


@triton.jit
def _down_tail(
    a_desc, at_desc, w_desc, y_ptr, order_ptr, counts_ptr, stride_ym, group_m,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TWO_LOOPS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    NUM_N: tl.constexpr = (HIDDEN + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.num_programs(0) // NUM_N, group_m, NUM_N)
    expert, row0, first_in_seg, count = _tail_block(
        pid_m, counts_ptr, NUM_EXPERTS, E_POW2, BLOCK_M, TAIL_M)
    if expert >= NUM_EXPERTS:
        return
    left = count - first_in_seg - BLOCK_M
    has_tail = (left > 0) & (left <= TAIL_M)
    w_row = expert * HIDDEN + pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([TAIL_M, BLOCK_N], dtype=tl.float32)
    if TWO_LOOPS:
        if has_tail:
            for k0 in range(0, INTER, BLOCK_K):
                a = a_desc.load([row0, k0])
                at = at_desc.load([row0 + BLOCK_M, k0])
                w = w_desc.load([w_row, k0])
                if UPCAST:
                    a = a.to(tl.float32)
                    at = at.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(a, w.T, acc)
                acc_t = tl.dot(at, w.T, acc_t)
        else:
            for k0 in range(0, INTER, BLOCK_K):
                a = a_desc.load([row0, k0])
                w = w_desc.load([w_row, k0])
                if UPCAST:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(a, w.T, acc)
    else:
        for k0 in range(0, INTER, BLOCK_K):
            a = a_desc.load([row0, k0])
            w = w_desc.load([w_row, k0])
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w.T, acc)
            if has_tail:
                at = at_desc.load([row0 + BLOCK_M, k0])
                if UPCAST:
                    at = at.to(tl.float32)
                acc_t = tl.dot(at, w.T, acc_t)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    rows = row0 + tl.arange(0, BLOCK_M)
    ok = first_in_seg + tl.arange(0, BLOCK_M) < count
    pair = tl.load(order_ptr + rows, mask=ok, other=0)
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])
    if has_tail:
        rows_t = row0 + BLOCK_M + tl.arange(0, TAIL_M)
        ok_t = first_in_seg + BLOCK_M + tl.arange(0, TAIL_M) < count
        pair_t = tl.load(order_ptr + rows_t, mask=ok_t, other=0)
        tl.store(y_ptr + pair_t.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
                 acc_t.to(y_ptr.dtype.element_ty), mask=ok_t[:, None] & n_ok[None, :])


def tail_variants(cfg, smoke):
    """(gemm, block_n, two_loops, tail_m, group_m, stages) packed into the variant tuple."""
    out = []
    bn = cfg["gate_up"]["block_n"]
    for fused in (False, True):
        for st in ((2,) if smoke else (4, 3)):
            out.append(("gate_up_tail", bn, fused, 64, 8, st))
    for st in ((2,) if smoke else (4, 3)):
        out.append(("down_tail", cfg["down"]["block_n"], True, 64, 16, st))
    return out


def run_tail(gemm, s, w13, w13i, w2, E, I, D, m, bn, two, tail_m, gm, stages, cfg, bench):
    if gemm == "gate_up_tail":
        c = cfg["gate_up"]
        bm, bk = c["block_m"], c["block_k"]
        xd = tm._desc(s.xs, m, s.xs.stride(0), [bm, bk])
        xtd = tm._desc(s.xs, m, s.xs.stride(0), [tail_m, bk])
        w = w13i if two else w13
        wd = tm._desc(w, E * 2 * I, w.stride(1), [2 * bn if two else bn, bk])
        grid = (tm.max_m_blocks(m, E, bm) * triton.cdiv(I, bn),)
        s.act.zero_()

        def fn():
            _gate_up_tail[grid](
                xd, xtd, wd, s.act, s.counts, s.act.stride(0), gm,
                INTER=I, HIDDEN=D, NUM_EXPERTS=E, E_POW2=triton.next_power_of_2(E),
                BLOCK_M=bm, TAIL_M=tail_m, BLOCK_N=bn, BLOCK_K=bk, FUSED=two,
                UPCAST=_interpreting(), num_warps=c["num_warps"], num_stages=stages,
            )  # fmt: skip
    else:
        c = cfg["down"]
        bm, bk = c["block_m"], c["block_k"]
        ad = tm._desc(s.act, m, s.act.stride(0), [bm, bk])
        atd = tm._desc(s.act, m, s.act.stride(0), [tail_m, bk])
        wd = tm._desc(w2, E * D, w2.stride(1), [bn, bk])
        grid = (tm.max_m_blocks(m, E, bm) * triton.cdiv(D, bn),)
        s.y.zero_()

        def fn():
            _down_tail[grid](
                ad, atd, wd, s.y, s.order, s.counts, s.y.stride(0), gm,
                INTER=I, HIDDEN=D, NUM_EXPERTS=E, E_POW2=triton.next_power_of_2(E),
                BLOCK_M=bm, TAIL_M=tail_m, BLOCK_N=bn, BLOCK_K=bk, TWO_LOOPS=two,
                UPCAST=_interpreting(), num_warps=c["num_warps"], num_stages=stages,
            )  # fmt: skip
    fn()
    return bench(fn), None


def interleave(w13: torch.Tensor) -> torch.Tensor:
    """[E, 2I, D] (gate rows then up rows) -> rows 2j = gate j, 2j+1 = up j."""
    e, two_i, d = w13.shape
    return w13.view(e, 2, two_i // 2, d).transpose(1, 2).reshape(e, two_i, d).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--rep", type=int, default=40)
    ap.add_argument("--only", default="", help="e.g. 'tail': only the tail variants")
    a = ap.parse_args()
    if a.smoke:
        dev, E, K, D, I = "cpu", 8, 2, 64, 32
        num_progs = 3
    else:
        dev, E, K, D, I = "cuda", 256, 8, 7168, 2048
        num_progs = torch.cuda.get_device_properties(0).multi_processor_count
    dt = torch.float32 if a.smoke else torch.bfloat16
    torch.manual_seed(0)
    w13 = torch.empty(E, 2 * I, D, device=dev, dtype=dt).normal_(0, 0.02)
    w2 = torch.empty(E, D, I, device=dev, dtype=dt).normal_(0, 0.02)
    w13i = interleave(w13)
    if a.smoke:
        def bench(fn):
            fn()
            return float("nan")
    else:
        from triton.testing import do_bench_cudagraph

        def bench(fn):
            return do_bench_cudagraph(fn, rep=a.rep, return_mode="median")

    for t in [int(v) for v in a.tokens.split(",")]:
        for routing in ("random", "balanced"):
            g = torch.Generator(device=dev).manual_seed(t)
            x = torch.randn(t, D, device=dev, generator=g).to(dt)
            if routing == "random":
                _, ids = torch.rand(t, E, device=dev, generator=g).topk(K, dim=-1)
            else:
                ids = (torch.arange(t * K, device=dev) % E).view(t, K)
            cfg = tm.moe_config(t, K, E, D, I, w13.element_size())
            s = tm._scratch(x, w13, w2, ids, None, sorted_x=True)
            tm._group(ids, s)
            m = t * K
            gu = tm._gate_up_launch(x, w13, s, K, cfg["gate_up"])
            dn = tm._down_launch(w2, s, cfg["down"])
            tm._run(gu)
            act_ref = s.act.clone()
            tm._run(dn)
            y_ref = s.y.clone()
            fl_gu, fl_dn = 2 * m * 2 * I * D, 2 * m * D * I
            print(f"\n## T={t} {routing}: counts min {s.counts.min().item()} max "
                  f"{s.counts.max().item()}", flush=True)  # fmt: skip

            def line(label, ms, fl):
                print(f"  {label:58s} {ms * 1e3:8.1f} us {fl / ms / 1e9:6.1f} TFLOP/s", flush=True)

            line("gate_up production (with gather)", bench(lambda: tm._run(gu)), fl_gu)
            line("  gather alone", bench(lambda: tm._run(gu[:1])), fl_gu)
            line("gate_up production GEMM alone", bench(lambda: tm._run(gu[1:])), fl_gu)
            line("down production", bench(lambda: tm._run(dn)), fl_dn)

            c = cfg["gate_up"]
            bm, bn, bk = c["block_m"], c["block_n"], c["block_k"]
            xd = tm._desc(s.xs, m, s.xs.stride(0), [bm, bk])
            variants = []
            for fused in (False, True):
                for progs, flatten in ((None, False), (num_progs, False), (num_progs, True)):
                    for gm in (8, 16):
                        variants.append(("gate_up", fused, progs, flatten, gm, c["num_stages"]))
            cd = cfg["down"]
            for progs, flatten in ((None, False), (num_progs, False), (num_progs, True)):
                for gm in (16, 32):
                    for st in (cd["num_stages"], cd["num_stages"] - 1):
                        variants.append(("down", False, progs, flatten, gm, st))
            if a.only:
                variants = [v for v in variants if any(o in v[0] + " " + str(v) for o in ["#"])]
            for tv in tail_variants(cfg, a.smoke):
                if not a.only or "tail" in a.only:
                    variants.append(tv)
            for gemm, fused, progs, flatten, gm, stages in variants:
                label = (f"{gemm} {'fused_n ' if fused else ''}"
                         f"{'persistent' if progs else 'grid'}{' flatten' if flatten else ''} "
                         f"group_m={gm} stages={stages}")  # fmt: skip
                try:
                    if gemm.endswith("_tail"):
                        bn_, two, tail_m = fused, progs, flatten
                        label = (f"{gemm} block_n={bn_} tail={tail_m} "
                                 f"{'fused_n/two_loops' if two else 'two_loops'} group_m={gm} stages={stages}")
                        s.act.copy_(act_ref) if gemm == "down_tail" else None
                        ms, err = run_tail(gemm, s, w13, w13i, w2, E, I, D, m,
                                           bn_, two, tail_m, gm, stages, cfg, bench)
                        ref = act_ref if gemm == "gate_up_tail" else y_ref
                        got = s.act if gemm == "gate_up_tail" else s.y
                        err = (got.float() - ref.float()).abs().max().item()
                        line(f"{label}  maxdiff {err:.1e}", ms, fl_gu if gemm == "gate_up_tail" else fl_dn)
                        if gemm == "down_tail":
                            pass
                        continue
                    if gemm == "gate_up":
                        w = w13i if fused else w13
                        wd = tm._desc(w, E * 2 * I, w.stride(1), [2 * bn if fused else bn, bk])
                        n_tiles = tm.max_m_blocks(m, E, bm) * triton.cdiv(I, bn)
                        grid = (progs or n_tiles,)
                        s.act.zero_()

                        def fn(wd=wd, grid=grid, fused=fused, flatten=flatten, gm=gm, st=stages):
                            tm._run(gu[:1])
                            _gate_up_var[grid](
                                xd, wd, s.act, s.counts, s.act.stride(0), gm,
                                INTER=I, HIDDEN=D, NUM_EXPERTS=E,
                                E_POW2=triton.next_power_of_2(E), BLOCK_M=bm, BLOCK_N=bn,
                                BLOCK_K=bk, NUM_PROGS=grid[0], FLATTEN=flatten, FUSED_N=fused,
                                UPCAST=_interpreting(), num_warps=c["num_warps"],
                                num_stages=st,
                            )  # fmt: skip

                        fn()
                        err = (s.act.float() - act_ref.float()).abs().max().item()
                        line(f"{label}  maxdiff {err:.1e}", bench(fn), fl_gu)
                    else:
                        dbm, dbn, dbk = cd["block_m"], cd["block_n"], cd["block_k"]
                        ad = tm._desc(s.act, m, s.act.stride(0), [dbm, dbk])
                        wd = tm._desc(w2, E * D, w2.stride(1), [dbn, dbk])
                        n_tiles = tm.max_m_blocks(m, E, dbm) * triton.cdiv(D, dbn)
                        grid = (progs or n_tiles,)
                        s.act.copy_(act_ref)
                        s.y.zero_()

                        def fn(ad=ad, wd=wd, grid=grid, flatten=flatten, gm=gm, st=stages):
                            _down_var[grid](
                                ad, wd, s.y, s.order, s.counts, s.y.stride(0), gm,
                                INTER=I, HIDDEN=D, NUM_EXPERTS=E,
                                E_POW2=triton.next_power_of_2(E), BLOCK_M=dbm, BLOCK_N=dbn,
                                BLOCK_K=dbk, NUM_PROGS=grid[0], FLATTEN=flatten,
                                UPCAST=_interpreting(), num_warps=cd["num_warps"], num_stages=st,
                            )  # fmt: skip

                        fn()
                        err = (s.y.float() - y_ref.float()).abs().max().item()
                        line(f"{label}  maxdiff {err:.1e}", bench(fn), fl_dn)
                except Exception as exc:  # noqa: BLE001
                    msg = str(exc).splitlines()[0][:150] if str(exc) else ""
                    print(f"  {label} FAILED {type(exc).__name__}: {msg}", flush=True)


if __name__ == "__main__":
    main()
