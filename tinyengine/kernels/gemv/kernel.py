"""The skinny GEMM's Triton kernel, `_skinny_gemm_kernel` (its launchers,
dispatch and the design of its two inner loops: gemv/triton.py; its device
functions: gemv/steps.py; the split over K: gemv/split_k.py).

Must never allocate or pick a config: gemv/triton.py's `_launch` passes
everything in.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyengine.kernels.gdc import gdc_launch_dependents, gdc_wait
from tinyengine.kernels.gemv.split_k import sum_slices
from tinyengine.kernels.gemv.steps import (
    fma_rows,
    k_step,
    rms_normed_chunk,
    rms_normed_row,
    rms_rstd_rows,
)


@triton.jit(do_not_specialize=["K_SPLIT", "SPLIT_K"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, nw_ptr, res_ptr, res_out_ptr, part_ptr, ticket_ptr,
    M, N, K, eps, K_SPLIT, SPLIT_K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, REDUCE_EACH_STEP: tl.constexpr,
    LOOP_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    FUSE_SILU_MUL: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    NORM: tl.constexpr = False, NORM_RESIDUAL: tl.constexpr = False,
    HAS_SPLIT: tl.constexpr = False, FMA_ROWS: tl.constexpr = False,
):  # fmt: skip
    """Grid (cdiv(N, BLOCK_N),): program p computes out[:, p*BLOCK_N : +BLOCK_N]
    over the whole K. Rows past N are wrapped (not masked) so weight loads stay
    unmasked along N; only the store is masked.

    FUSE_SILU_MUL: the weight is a gate_up matrix [2N, K] (N = I) and the
    output [M, N] is silu(gate) * up. Grid (cdiv(N, BLOCK_N // 2),): the tile's
    BLOCK_N weight rows interleave gate row j (tile row 2i) and up row N + j
    (tile row 2i + 1) for the program's BLOCK_N // 2 output columns j, so the
    K loop is the plain one, unchanged. Each half is rounded to the output
    dtype (after the bias, as the plain store does) before the activation,
    which is computed and rounded exactly as kernels/activation/ does.

    USE_PDL (a programmatic dependent launch, kernels/launch.py): the program
    may start while the kernel before it still runs. It loads its first K
    step of the weight (never written by a step's kernels) at once, then waits
    for the previous kernel with gdc_wait before it touches x or stores, and
    lets the next kernel start. With a one-step tile (K <= BLOCK_K) the whole
    weight slice is in flight before the wait.

    FMA_ROWS (FMA, 2 <= M <= BLOCK_M, one K step): the weight slice is
    loaded once and multiplied by each row in turn, each row's sum formed
    exactly as the one-row kernel forms it; accumulator [BLOCK_M, BLOCK_N].

    NORM (FMA in one K step, K <= BLOCK_K, or the DOT loop): x is RMSNorm's
    input, not the linear's. Every program normalizes the rows itself (norm
    weight nw, eps; NORM_RESIDUAL: x + residual first, which program 0 stores
    to res_out, contiguous [M, K] like the residual), rounding as
    norm/triton.py's kernel does, and multiplies them: the norm kernel and
    its launch are gone from the step. The DOT loop first sums each row's
    squares over all of K (x is a few KB, read from L2 by every program),
    then normalizes each K step's chunk as it loads it.

    HAS_SPLIT (every plain DOT launch, so split and unsplit are one
    compile): grid (tiles, SPLIT_K); program (p, s) sums K slice
    [s * K_SPLIT, (s + 1) * K_SPLIT) of tile p, and with SPLIT_K > 1 the
    tile's last program adds the slices (gemv/split_k.py) and runs the
    epilogue."""
    pid = tl.program_id(0)
    if HAS_SPLIT:
        # A slice starts at a multiple of BLOCK_K (split_k_plan): stated, so
        # the weight loads stay 16-byte vectors (K_SPLIT is not specialized).
        k_lo = tl.multiple_of(tl.program_id(1) * K_SPLIT, BLOCK_K)
        k_len = tl.minimum(K_SPLIT, K - k_lo)
    else:
        k_lo = 0
        k_len = K
    if FUSE_SILU_MUL:
        offs_r = tl.arange(0, BLOCK_N)
        cols = pid * (BLOCK_N // 2) + offs_r // 2
        if EVEN_N:
            rows = cols
        else:
            rows = cols % N
        rows = rows + (offs_r % 2) * N  # odd tile rows: the up half
        offs_n = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # output columns
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        if EVEN_N:
            rows = offs_n
        else:
            rows = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    m_mask = offs_m[:, None] < M

    # FMA (M == 1, BLOCK_M == 1): elementwise products into a [BLOCK_N,
    # BLOCK_K] accumulator, one cross-thread reduction at the very end (or,
    # REDUCE_EACH_STEP, a [BLOCK_N] accumulator: fewer registers, a reduction
    # per step). DOT: a [BLOCK_N, BLOCK_M] MMA accumulator.
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif FMA_ROWS:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif REDUCE_EACH_STEP:
        acc = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_first = 0
    if USE_PDL or NORM or FMA_ROWS:  # the first step peeled: weight loads before the wait
        k_ok = offs_k[None, :] < k_len
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=k_ok, other=0.0, eviction_policy="evict_first")
        nw = 0.0  # the norm weight (fp32), with NORM only
        rstd = 1.0  # the rows' 1 / rms, with NORM on the DOT loop only
        if NORM:
            nw = tl.load(nw_ptr + offs_k[None, :], mask=k_ok, other=0.0).to(tl.float32)
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()
        if FMA_ROWS:
            acc = fma_rows(
                acc, w, x_ptr, res_ptr, res_out_ptr, nw, offs_k, k_ok, M, K, eps, stride_xm, pid,
                BLOCK_M, NORM, NORM_RESIDUAL,
            )  # fmt: skip
        elif NORM and USE_DOT:  # rows over several K steps: their rstd first
            rstd = rms_rstd_rows(
                x_ptr, res_ptr, offs_m, offs_k, M, K, eps, stride_xm, BLOCK_M, BLOCK_K,
                NORM_RESIDUAL,
            )  # fmt: skip
            xk = rms_normed_chunk(
                x_ptr, res_ptr, res_out_ptr, nw, offs_m, offs_k, m_mask & k_ok, rstd, K,
                stride_xm, pid, NORM_RESIDUAL,
            )  # fmt: skip
        elif NORM:
            xk = rms_normed_row(
                x_ptrs, res_ptr, res_out_ptr, nw, offs_k, k_ok, K, eps, pid, NORM_RESIDUAL
            )
        elif EVEN_K:  # every slice is whole K steps: no mask along K
            xk = tl.load(x_ptrs, mask=m_mask, other=0.0)
        else:
            xk = tl.load(x_ptrs, mask=m_mask & k_ok, other=0.0)
        if not FMA_ROWS:
            acc = k_step(acc, w, xk, USE_DOT, REDUCE_EACH_STEP, DOT_PRECISION, UPCAST)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_first = BLOCK_K
    # Software-pipelined over LOOP_STAGES (FMA: cp.async into shared memory
    # only when asked explicitly; LOOP_STAGES == 1 keeps plain register loads).
    if not FMA_ROWS:
        for k0 in tl.range(k_first, k_len, BLOCK_K, num_stages=LOOP_STAGES):
            k_mask = (k0 + offs_k)[None, :] < k_len
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=k_mask, other=0.0, eviction_policy="evict_first")
            if NORM and USE_DOT:  # the prologue per step (FMA: one step, none left)
                ks = k0 + offs_k  # a norm launch is never split: k_len is K
                nw = tl.load(nw_ptr + ks[None, :], mask=k_mask, other=0.0).to(tl.float32)
                xk = rms_normed_chunk(
                    x_ptr, res_ptr, res_out_ptr, nw, offs_m, ks, m_mask & k_mask, rstd, K,
                    stride_xm, pid, NORM_RESIDUAL,
                )  # fmt: skip
            elif EVEN_K:
                xk = tl.load(x_ptrs, mask=m_mask, other=0.0)
            else:
                xk = tl.load(x_ptrs, mask=m_mask & k_mask, other=0.0)
            acc = k_step(acc, w, xk, USE_DOT, REDUCE_EACH_STEP, DOT_PRECISION, UPCAST)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    if USE_DOT:
        res = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    elif FMA_ROWS:
        res = acc
    else:
        res = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    if HAS_SPLIT:
        if SPLIT_K > 1:
            res, last = sum_slices(res, part_ptr, ticket_ptr, pid, SPLIT_K, BLOCK_M, BLOCK_N)
            if not last:
                return

    if HAS_BIAS:
        if FUSE_SILU_MUL:
            b = tl.load(b_ptr + rows)  # rows are wrapped: always in bounds
        else:
            b = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
        res += b.to(tl.float32)[None, :]
    if FUSE_SILU_MUL:
        # gate_up output rounded as the plain kernel stores it, then
        # silu(gate) * up in fp32 as _silu_and_mul_kernel computes it.
        res = res.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(res, (BLOCK_M, BLOCK_N // 2, 2)))
        res = gate / (1.0 + tl.exp(-gate)) * up  # [BLOCK_M, BLOCK_N // 2]
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=m_mask & (offs_n[None, :] < N))
