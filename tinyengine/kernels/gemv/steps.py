"""The skinny GEMM's device functions (gemv/kernel.py's kernel): one K step
of either inner loop (`k_step`), the RMSNorm prologue's normalized row
(`rms_normed_row`) and, for the DOT loop, its rows' rstd (`rms_rstd_rows`)
and normalized K chunks (`rms_normed_chunk`), and the FMA tile's products
against each of a few rows (`fma_rows`).

Must never launch anything: these are inlined into gemv/kernel.py's kernel.
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
def _with_residual(x, r):
    """x + residual, rounded to x's dtype: the norm kernel's new residual."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@device_fn
def _normed(x, rstd, nw):
    """x * rstd rounded to x's dtype, then times the norm weight nw (fp32)
    and rounded again: HF rounds before the weight, as the norm kernel does."""
    normed = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
    return (normed * nw).to(x.dtype)


@device_fn
def rms_normed_row(
    x_ptrs, res_ptr, res_out_ptr, nw, offs_k, k_ok, K, eps, pid, HAS_RESIDUAL: tl.constexpr
):  # fmt: skip
    """RMSNorm of the row x [1, BLOCK_K] (+ residual) times the norm weight
    nw (fp32), rounded step for step as norm/triton.py's kernel rounds it;
    program 0 stores the sum x + residual (the new residual)."""
    x = tl.load(x_ptrs, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        x = _with_residual(x, tl.load(res_ptr + offs_k[None, :], mask=k_ok, other=0.0))
        if pid == 0:
            tl.store(res_out_ptr + offs_k[None, :], x, mask=k_ok)
    xf = x.to(tl.float32)
    return _normed(x, 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1, keep_dims=True) / K + eps), nw)


@device_fn
def rms_rstd_rows(
    x_ptr, res_ptr, offs_m, offs_k, M, K, eps, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The DOT loop's RMSNorm prologue, first pass: 1 / rms [BLOCK_M, 1] of
    each row of x (+ residual, rounded to x's dtype as rms_normed_row rounds
    it) over all of K, summed a BLOCK_K chunk at a time. No stores: a store
    here would keep the compiler from issuing later steps' loads early."""
    m_ok = offs_m[:, None] < M
    sum_sq = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    # Unrolled, so the loads of several steps are in flight together: this
    # pass sits between the PDL wait and the first product.
    for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=4):
        ks = k0 + offs_k[None, :]
        ok = m_ok & (ks < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            x = _with_residual(x, tl.load(res_ptr + offs_m[:, None] * K + ks, mask=ok, other=0.0))
        xf = x.to(tl.float32)
        sum_sq += tl.sum(xf * xf, axis=1, keep_dims=True)
    return 1.0 / tl.sqrt(sum_sq / K + eps)


@device_fn
def rms_normed_chunk(
    x_ptr, res_ptr, res_out_ptr, nw, offs_m, ks, ok, rstd, K, stride_xm, pid,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The DOT loop's RMSNorm prologue, per K step: rows x [BLOCK_M, BLOCK_K]
    at columns ks (+ residual, which program 0 stores: the new residual,
    contiguous [M, K]) scaled by their rstd and the chunk's norm weight nw
    (fp32), rounded step for step as rms_normed_row rounds a whole row."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * K + ks[None, :], mask=ok, other=0.0)
        x = _with_residual(x, r)
        if pid == 0:
            tl.store(res_out_ptr + offs_m[:, None] * K + ks[None, :], x, mask=ok)
    return _normed(x, rstd, nw)


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
