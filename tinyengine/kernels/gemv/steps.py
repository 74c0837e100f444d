"""The skinny GEMM's device functions (gemv/triton.py's kernel): one K step
of either inner loop (`k_step`), the RMSNorm prologue's normalized row
(`rms_normed_row`), and the FMA tile's products against each of a few rows
(`fma_rows`).

Must never launch anything: these are inlined into _skinny_gemm_kernel.
"""

from __future__ import annotations

import triton.language as tl

from tinyengine.kernels.device_fn import device_fn


@device_fn
def k_step(
    acc, w, xk,
    USE_DOT: tl.constexpr, REDUCE_EACH_STEP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """One K step: a weight tile [BLOCK_N, BLOCK_K] times an x chunk
    [BLOCK_M, BLOCK_K] into the accumulator (DOT: the MMA with x^T as its B
    operand; FMA, BLOCK_M == 1: fp32 products)."""
    # Both branches end in one return: Triton compiles the code after a
    # constexpr-if's early return for the taken branch too.
    if USE_DOT:
        if UPCAST:  # the interpreter computes bf16 dots wrongly; fp32 is exact
            w = w.to(tl.float32)
            xk = xk.to(tl.float32)
        acc = tl.dot(w, tl.trans(xk), acc, input_precision=DOT_PRECISION)
    elif REDUCE_EACH_STEP:
        acc += tl.sum(w.to(tl.float32) * xk.to(tl.float32), axis=1, keep_dims=True)
    else:
        acc += w.to(tl.float32) * xk.to(tl.float32)
    return acc


@device_fn
def rms_normed_row(
    x_ptrs, res_ptr, res_out_ptr, nw, offs_k, k_ok, K, eps, pid, HAS_RESIDUAL: tl.constexpr
):  # fmt: skip
    """RMSNorm of the row x [1, BLOCK_K] (+ residual) times the norm weight
    nw (fp32), rounded step for step as norm/triton.py's kernel rounds it;
    program 0 stores the sum x + residual (the new residual)."""
    x = tl.load(x_ptrs, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_k[None, :], mask=k_ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if pid == 0:
            tl.store(res_out_ptr + offs_k[None, :], x, mask=k_ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1, keep_dims=True) / K + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # HF rounds before the weight
    return (normed * nw).to(x.dtype)


@device_fn
def fma_rows(
    acc, w, x_ptr, res_ptr, res_out_ptr, nw, offs_k, k_ok, M, K, eps, stride_xm, pid,
    BLOCK_M: tl.constexpr, NORM: tl.constexpr, NORM_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] of the one-step weight tile w [BLOCK_N,
    BLOCK_K] (K columns valid where k_ok) times each row of x (normalized
    first with NORM, norm weight nw): row m's sum is the one-row kernel's,
    sum(w * x_m) over the tile, whatever M is."""
    wf = w.to(tl.float32)
    rows = tl.arange(0, BLOCK_M)[:, None]
    for m in tl.static_range(BLOCK_M):
        row_ok = k_ok & (tl.zeros_like(offs_k)[None, :] + m < M)
        row_ptrs = x_ptr + m * stride_xm + offs_k[None, :]
        if NORM:
            xm = rms_normed_row(
                row_ptrs, res_ptr + m * K, res_out_ptr + m * K, nw, offs_k, row_ok, K, eps,
                pid, NORM_RESIDUAL,
            )  # fmt: skip
        else:
            xm = tl.load(row_ptrs, mask=row_ok, other=0.0)
        acc = tl.where(rows == m, tl.sum(wf * xm.to(tl.float32), axis=1)[None, :], acc)
    return acc
