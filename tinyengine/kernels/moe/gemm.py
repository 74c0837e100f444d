"""The two grouped GEMMs of the fused MoE (kernels/moe/triton.py launches
them): gate_up, x . [gate; up] with SiLU-and-mul fused, writing the
activations in sorted-row order, and down, act . w2, writing each row at its
pair's unsorted index for the per-token reduction.

Owns which M-block of the sorted rows belongs to which expert, tails, the
program order and the load modes. The inputs (order, counts, the sorted copy
of x) come from the grouping in kernels/moe/triton.py; nothing here reads the device on the
host, and every shape is a host int, so both kernels are CUDA-graph safe.

The M = T*K (token, slot) pairs, grouped by expert (kernels/moe/triton.py):
    order      = stable argsort of the expert ids;  counts[e] = pairs routed to e
Each GEMM program derives the rest from the E counts it loads (one vector
load, scans and sums in registers; no binary search of dependent loads):
    nblk[e]    = cdiv(counts[e], BLOCK_M);  blk_end = cumsum(nblk)
M-block b belongs to the expert e with blk_end[e-1] <= b < blk_end[e] and
covers sorted rows seg_start[e] + (b - blk_end[e] + nblk[e]) * BLOCK_M +
[0, BLOCK_M), masked to the expert's segment: each expert's rows are padded
to whole blocks without materializing the padding, and the two GEMMs may use
different BLOCK_M. The worst case over any routing is sum_e cdiv(c_e, BLOCK_M)
<= (M + min(E, M) * (BLOCK_M - 1)) // BLOCK_M M-blocks (`max_m_blocks`);
blocks past blk_end[E-1] exit.

Tails (the config's tail_m = TAIL_M > 0; class 2, TMA activations only). At
~128 rows per expert (DeepSeek-V3 at T=4096) half the experts overflow one
128-row block by a few rows, and a second 128-row block for those rows
costs a whole tile of MMAs. With tails an expert gets
    nblk[e] = max(1, cdiv(counts[e] - TAIL_M, BLOCK_M))   (0 if empty)
blocks, and its last block also computes the up to TAIL_M rows after its
BLOCK_M main rows, in a second [TAIL_M, BLOCK_N] accumulator fed by the same
weight tile each K step (one more activation tile per step; no weight
reloads). Blocks with a tail run their own copy of the K loop, so neither
loop branches per step. Tails speed up both GEMMs at T=4096 with random
routing, down the most (docs/benchmarks.md, MoE tails).

Program order. A GEMM's grid is 1-D over (M-block, N-block) tiles. With
group_m = G, runs of G consecutive M-blocks sweep all N-blocks together
(M-block fastest inside a run): the G blocks' activation rows stay in L2
across the N sweep, and an expert's consecutive M-blocks read each weight
tile at nearly the same time (one HBM read, the rest L2 hits). group_m = 0
means one run of all M-blocks (M-block fastest), the order of a plain 2-D
grid, which suits decode (one block per expert, weights read once anyway).

Inner loops carry no masks in the common case: padded rows of a block read
row 0 (pair 0 / sorted row 0, always valid memory) and are dropped at the
store; N tails wrap (n % N) instead of masking; only a K that is not a
multiple of BLOCK_K masks its loads.

Loads: pointers (cp.async) or TMA, per GEMM (the config's "tma"; TMA_MODES).
TMA_W loads the weight tiles through a tensor descriptor built on the host
over w viewed as [E*N, K] (block [BLOCK_N, BLOCK_K] at row e*N + n0); TMA_AW
also the activation tiles, which must then be contiguous row blocks: down's
A (act) is stored in sorted-row order already; gate_up's A rows are gathered
tokens, so kernels/moe/triton.py's _gather_kernel first copies x into sorted order (xs [M, D], a
workspace view, weights' dtype). A block's A tile then starts at its first
sorted row: rows past its expert's segment are the next expert's (dropped at
the store) or, past M, TMA's zero fill; K tails are zero-filled too, so TMA
loads never mask. Descriptors hold only fixed addresses and host ints, so a
CUDA graph records them by value (no device reads, no allocation). Where a
tensor's alignment or layout rules TMA out (16-byte base and row stride,
w's experts contiguous) that operand silently uses pointers. The Triton
interpreter runs descriptor loads itself, so CPU tests cover the TMA path.

Numerics (dtypes, rounding, the interpreter's fp32 upcast): kernels/moe/triton.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyengine.kernels.device_fn import device_fn


@device_fn
def _program_tile(NUM_N_BLOCKS: tl.constexpr, group_m):
    """(M-block, N-block) of this program; see "Program order" above."""
    pid = tl.program_id(0)
    num_m_blocks = tl.num_programs(0) // NUM_N_BLOCKS
    per_group = group_m * NUM_N_BLOCKS
    first_m = (pid // per_group) * group_m
    group_rows = tl.minimum(num_m_blocks - first_m, group_m)
    local = pid % per_group
    return first_m + local % group_rows, local // group_rows


@device_fn
def _block_rows(b, counts_ptr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
                BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr):  # fmt: skip
    """(expert, first sorted row, that row's index in the expert's segment, the
    expert's row count) of M-block b, whose main rows are first + [0, BLOCK_M)
    (and, with tails, its last block's tail rows the TAIL_M after them); see
    the module docstring. expert >= NUM_EXPERTS means "no work"."""
    e_idx = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < NUM_EXPERTS, other=0)
    if TAIL_M > 0:
        # The fewest blocks whose main rows plus one tail cover the segment.
        nblk = tl.where(counts > 0, tl.maximum((counts - TAIL_M + BLOCK_M - 1) // BLOCK_M, 1), 0)
    else:
        nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, 0)
    # blk_end is non-decreasing: the lanes with blk_end <= b are exactly the
    # experts before b's (all E_POW2 lanes once b is past the last block).
    expert = tl.sum((blk_end <= b).to(tl.int32), 0)
    before = e_idx < expert
    seg_start = tl.sum(tl.where(before, counts, 0), 0)
    first_blk = tl.sum(tl.where(before, nblk, 0), 0)
    count = tl.sum(tl.where(e_idx == expert, counts, 0), 0)
    first_in_seg = (b - first_blk) * BLOCK_M
    return expert, seg_start + first_in_seg, first_in_seg, count


@device_fn
def _has_tail(first_in_seg, count, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr):
    """Whether this block has tail rows: only an expert's last block can (an
    earlier block has more than TAIL_M rows after its main ones)."""
    left = count - first_in_seg - BLOCK_M
    return (left > 0) & (left <= TAIL_M)


@device_fn
def _act_tile(a_desc, a_ptrs, row0, k0, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr,
              TMA_A: tl.constexpr):  # fmt: skip
    """The [BLOCK_M, BLOCK_K] activation tile at column k0: by TMA (rows from
    row0; a K tail past K is zero-filled) or through a_ptrs (masked only when
    K is not a multiple of BLOCK_K)."""
    if TMA_A:
        tile = a_desc.load([row0, k0])
    elif K % BLOCK_K == 0:
        tile = tl.load(a_ptrs)
    else:
        tile = tl.load(a_ptrs, mask=(offs_k < K - k0)[None, :], other=0.0)
    return tile


@device_fn
def _weight_tile(w_desc, w_ptrs, w_row, k0, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 TMA_W: tl.constexpr):  # fmt: skip
    """The weight tile at column k0 as [BLOCK_K, BLOCK_N] (x @ w needs no
    transpose): by TMA from row w_row of the [E*N, K] view, or through w_ptrs."""
    if TMA_W:
        tile = w_desc.load([w_row, k0]).T
    elif K % BLOCK_K == 0:
        tile = tl.load(w_ptrs)
    else:
        tile = tl.load(w_ptrs, mask=(offs_k < K - k0)[:, None], other=0.0)
    return tile


@device_fn
def _gate_up_mma(x_ptr, xt_desc, w13, x_ptrs, g_ptrs, u_ptrs, row0, w_row, offs_k,
                 INTER: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL_ROWS: tl.constexpr,
                 WITH_TAIL: tl.constexpr, UPCAST: tl.constexpr, TMA_A: tl.constexpr,
                 TMA_W: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """gate_up's K loop: the fp32 (gate, up) accumulators of the block's main
    rows and, WITH_TAIL (TMA_A only), of the TAIL_ROWS rows after them, which
    reuse each loaded weight tile (zeros without a tail). Unused arguments of
    the other load mode are placeholders."""
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_gt = tl.zeros([TAIL_ROWS, BLOCK_N], dtype=tl.float32)
    acc_ut = tl.zeros([TAIL_ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        xt = _act_tile(x_ptr, x_ptrs, row0, k0, offs_k, HIDDEN, BLOCK_K, TMA_A)
        wg = _weight_tile(w13, g_ptrs, w_row, k0, offs_k, HIDDEN, BLOCK_K, TMA_W)
        wu = _weight_tile(w13, u_ptrs, w_row + INTER, k0, offs_k, HIDDEN, BLOCK_K, TMA_W)
        if UPCAST:
            xt = xt.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        else:
            xt = xt.to(wg.dtype)  # the reference's matmuls run in the weights' dtype
        acc_g = tl.dot(xt, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(xt, wu, acc_u, input_precision=DOT_PRECISION)
        if WITH_TAIL:
            xtt = xt_desc.load([row0 + BLOCK_M, k0])
            if UPCAST:
                xtt = xtt.to(tl.float32)
            else:
                xtt = xtt.to(wg.dtype)
            acc_gt = tl.dot(xtt, wg, acc_gt, input_precision=DOT_PRECISION)
            acc_ut = tl.dot(xtt, wu, acc_ut, input_precision=DOT_PRECISION)
        if not TMA_A:
            x_ptrs += BLOCK_K
        if not TMA_W:
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    return acc_g, acc_u, acc_gt, acc_ut


@device_fn
def _store_swiglu(acc_g, acc_u, act_ptr, rows, row_ok, offs_n, stride_am, INTER: tl.constexpr,
                  LIMIT: tl.constexpr):  # fmt: skip
    """act[rows, offs_n] = silu(gate) * up, gate and up first rounded to the
    weights' dtype (like the reference's bf16 F.linear); with a LIMIT
    (DeepSeek-V4's swiglu_limit, not None; 0 too) gate <= LIMIT and
    -LIMIT <= up <= LIMIT."""
    gate = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
    if LIMIT is not None:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    act = gate / (1.0 + tl.exp(-gate)) * up
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n < INTER)[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["group_m"])
def _gate_up_kernel(
    x_ptr, xt_desc, w13, act_ptr, order_ptr, counts_ptr,
    stride_xt, stride_we, stride_wn, stride_am, group_m,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL_M: tl.constexpr,
    UPCAST: tl.constexpr, TMA_A: tl.constexpr, TMA_W: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr = None,
):  # fmt: skip
    """Grid (max M-blocks * cdiv(I, BLOCK_N),). act[row, n] = silu(x_t . gate_n) *
    (x_t . up_n) for the sorted rows of one expert's M-block; row r holds pair
    order[r], token order[r] // K. act rows are in sorted order. w13's last
    dim is contiguous (checked on the host).

    TMA_W: w13 is a tensor descriptor over w13 viewed as [E*2I, D], block
    [BLOCK_N, BLOCK_K] (else a pointer). TMA_A: x_ptr is a descriptor over the
    sorted copy xs [M, D] (_gather_kernel), block [BLOCK_M, BLOCK_K]; the
    block's rows past its expert's segment read the next expert's rows (or
    zeros past M) and are dropped at the store; the strides are then unused.
    TAIL_M > 0 (TMA_A only): xt_desc is a second descriptor over xs, block
    [TAIL_M, BLOCK_K], for the tail rows ("Tails" in the module docstring)."""
    pid_m, pid_n = _program_tile(tl.cdiv(INTER, BLOCK_N), group_m)
    expert, row0, first_in_seg, count = _block_rows(
        pid_m, counts_ptr, NUM_EXPERTS, E_POW2, BLOCK_M, TAIL_M)  # fmt: skip
    if expert >= NUM_EXPERTS:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = first_in_seg + tl.arange(0, BLOCK_M) < count
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr  # placeholders where a descriptor loads instead
    g_ptrs = w13
    u_ptrs = w13
    w_row = 0
    if not TMA_A:
        # Padded rows read pair 0 (token 0): valid memory, never stored.
        pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
        token = pair // TOP_K
        x_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    # w13[e] is [2I, D]: gate rows [0, I), up rows [I, 2I). The tile is used
    # transposed ([BLOCK_K, BLOCK_N]) so x [BLOCK_M, BLOCK_K] @ w needs no trans.
    if TMA_W:
        # N tails read past the gate half (or the expert): dropped at the store.
        w_row = expert * (2 * INTER) + pid_n * BLOCK_N
    else:
        if INTER % BLOCK_N == 0:
            offs_wn = offs_n
        else:
            offs_wn = offs_n % INTER  # a wrapped tail: in bounds, dropped at the store
        g_ptrs = (w13 + expert.to(tl.int64) * stride_we
                  + offs_wn.to(tl.int64)[None, :] * stride_wn + offs_k[:, None])  # fmt: skip
        u_ptrs = g_ptrs + INTER * stride_wn
    TAIL_ROWS: tl.constexpr = TAIL_M if TAIL_M > 0 else 16  # a shape for the unused zeros
    if TAIL_M > 0:
        # Two copies of the loop, so that neither branches per K step.
        if _has_tail(first_in_seg, count, BLOCK_M, TAIL_M):
            acc_g, acc_u, acc_gt, acc_ut = _gate_up_mma(
                x_ptr, xt_desc, w13, x_ptrs, g_ptrs, u_ptrs, row0, w_row, offs_k, INTER, HIDDEN,
                BLOCK_M, BLOCK_N, BLOCK_K, TAIL_ROWS, True, UPCAST, TMA_A, TMA_W,
                DOT_PRECISION)  # fmt: skip
            t_rows = row0 + BLOCK_M + tl.arange(0, TAIL_ROWS)
            t_ok = first_in_seg + BLOCK_M + tl.arange(0, TAIL_ROWS) < count
            _store_swiglu(acc_gt, acc_ut, act_ptr, t_rows, t_ok, offs_n, stride_am, INTER,
                          SWIGLU_LIMIT)  # fmt: skip
        else:
            acc_g, acc_u, acc_gt, acc_ut = _gate_up_mma(
                x_ptr, xt_desc, w13, x_ptrs, g_ptrs, u_ptrs, row0, w_row, offs_k, INTER, HIDDEN,
                BLOCK_M, BLOCK_N, BLOCK_K, TAIL_ROWS, False, UPCAST, TMA_A, TMA_W,
                DOT_PRECISION)  # fmt: skip
    else:
        acc_g, acc_u, acc_gt, acc_ut = _gate_up_mma(
            x_ptr, xt_desc, w13, x_ptrs, g_ptrs, u_ptrs, row0, w_row, offs_k, INTER, HIDDEN,
            BLOCK_M, BLOCK_N, BLOCK_K, TAIL_ROWS, False, UPCAST, TMA_A, TMA_W,
            DOT_PRECISION)  # fmt: skip
    _store_swiglu(acc_g, acc_u, act_ptr, rows, row_ok, offs_n, stride_am, INTER, SWIGLU_LIMIT)


@device_fn
def _down_mma(act, at_desc, w2, a_ptrs, w_ptrs, row0, w_row, offs_k, INTER: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              TAIL_ROWS: tl.constexpr, WITH_TAIL: tl.constexpr, UPCAST: tl.constexpr,
              TMA_A: tl.constexpr, TMA_W: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """down's K loop: the fp32 accumulators of the main rows and, WITH_TAIL
    (TMA_A only), of the TAIL_ROWS rows after them (zeros without a tail)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([TAIL_ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        a = _act_tile(act, a_ptrs, row0, k0, offs_k, INTER, BLOCK_K, TMA_A)
        w = _weight_tile(w2, w_ptrs, w_row, k0, offs_k, INTER, BLOCK_K, TMA_W)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if WITH_TAIL:
            at = at_desc.load([row0 + BLOCK_M, k0])
            if UPCAST:
                at = at.to(tl.float32)
            acc_t = tl.dot(at, w, acc_t, input_precision=DOT_PRECISION)
        if not TMA_A:
            a_ptrs += BLOCK_K
        if not TMA_W:
            w_ptrs += BLOCK_K
    return acc, acc_t


@device_fn
def _store_rows(acc, y_ptr, order_ptr, rows, row_ok, offs_n, stride_ym, HIDDEN: tl.constexpr):
    """y[order[rows], offs_n] = acc rounded to y's dtype (the pairs' unsorted rows)."""
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n < HIDDEN)[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["group_m"])
def _down_kernel(
    act, at_desc, w2, y_ptr, order_ptr, counts_ptr,
    stride_am, stride_we, stride_wn, stride_ym, group_m,
    INTER: tl.constexpr, HIDDEN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL_M: tl.constexpr,
    UPCAST: tl.constexpr, TMA_A: tl.constexpr, TMA_W: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (max M-blocks * cdiv(D, BLOCK_N),). y[pair, n] = act_row . w2[e, n],
    rounded to y's dtype and written at the pair's *unsorted* index t*K + k so
    the per-token sum reads K consecutive rows (deterministic; no atomics).

    TMA_A: act is a tensor descriptor over act [M, I], block [BLOCK_M,
    BLOCK_K] (rows past the segment: the next expert's rows or zeros past M,
    dropped at the store); TMA_W: w2 is one over w2 viewed as [E*D, I], block
    [BLOCK_N, BLOCK_K]. Otherwise pointers. TAIL_M > 0 (TMA_A only): at_desc
    is a second descriptor over act, block [TAIL_M, BLOCK_K], for the tail rows."""
    pid_m, pid_n = _program_tile(tl.cdiv(HIDDEN, BLOCK_N), group_m)
    expert, row0, first_in_seg, count = _block_rows(
        pid_m, counts_ptr, NUM_EXPERTS, E_POW2, BLOCK_M, TAIL_M)  # fmt: skip
    if expert >= NUM_EXPERTS:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = first_in_seg + tl.arange(0, BLOCK_M) < count
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act  # placeholders where a descriptor loads instead
    w_ptrs = w2
    w_row = 0
    if not TMA_A:
        # Padded rows read sorted row 0 (the last expert's would run past M).
        a_rows = tl.where(row_ok, rows, 0)
        a_ptrs = act + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    if TMA_W:
        w_row = expert * HIDDEN + pid_n * BLOCK_N  # N tails: the next expert's rows, dropped
    else:
        if HIDDEN % BLOCK_N == 0:
            offs_wn = offs_n
        else:
            offs_wn = offs_n % HIDDEN
        w_ptrs = (w2 + expert.to(tl.int64) * stride_we
                  + offs_wn.to(tl.int64)[None, :] * stride_wn + offs_k[:, None])  # fmt: skip
    TAIL_ROWS: tl.constexpr = TAIL_M if TAIL_M > 0 else 16  # a shape for the unused zeros
    if TAIL_M > 0:
        if _has_tail(first_in_seg, count, BLOCK_M, TAIL_M):
            acc, acc_t = _down_mma(act, at_desc, w2, a_ptrs, w_ptrs, row0, w_row, offs_k, INTER,
                                   BLOCK_M, BLOCK_N, BLOCK_K, TAIL_ROWS, True, UPCAST, TMA_A,
                                   TMA_W, DOT_PRECISION)  # fmt: skip
            t_rows = row0 + BLOCK_M + tl.arange(0, TAIL_ROWS)
            t_ok = first_in_seg + BLOCK_M + tl.arange(0, TAIL_ROWS) < count
            _store_rows(acc_t, y_ptr, order_ptr, t_rows, t_ok, offs_n, stride_ym, HIDDEN)
        else:
            acc, acc_t = _down_mma(act, at_desc, w2, a_ptrs, w_ptrs, row0, w_row, offs_k, INTER,
                                   BLOCK_M, BLOCK_N, BLOCK_K, TAIL_ROWS, False, UPCAST, TMA_A,
                                   TMA_W, DOT_PRECISION)  # fmt: skip
    else:
        acc, acc_t = _down_mma(act, at_desc, w2, a_ptrs, w_ptrs, row0, w_row, offs_k, INTER,
                               BLOCK_M, BLOCK_N, BLOCK_K, TAIL_ROWS, False, UPCAST, TMA_A,
                               TMA_W, DOT_PRECISION)  # fmt: skip
    _store_rows(acc, y_ptr, order_ptr, rows, row_ok, offs_n, stride_ym, HIDDEN)
