"""Tensor-core GEMM: y = x W^T (+ b) for x [M, K], W [N, K], any M.

The batch-invariant op set (kernels/batch_invariant_triton.py) sends every
linear layer with more than 16 rows here (16 or fewer go to the skinny
kernel's tensor-core path, kernels/gemv/), instead of cuBLAS, whose
algorithm, and with it the order each output's K products are summed in,
follows the call's shape: the same row rounds differently at M = 1, 7 and
256.

Why a row's bits here do not depend on M. One program sums an output's
whole K (no split-K), and tl.dot adds the products as a chain of k16 MMA
steps in K order into an fp32 accumulator. The tile shape does not enter
that chain: on an H200 a row's result is bitwise the same for BLOCK_M 8 to
256, BLOCK_N 64 to 256, BLOCK_K 32 to 128, 4 or 8 warps, and either operand
as the MMA's A side (the skinny kernel's swapped product included); only a
non-MMA inner product (the skinny kernel's FMA path) or cuBLAS differ. So
the tiles below are picked per M for speed, and the epilogue adds the bias
in fp32 and rounds once, as the skinny kernel does; tests/kernels/
test_gemm.py checks rows alone against rows in batches on the GPU.

Two kernels, the same chain. Up to 64 rows `_matmul_kernel` loads tiles
through pointers, one program per output tile: with few rows the work is
streaming the weight, and many small programs do that best. From 65 rows
`_matmul_tma_kernel` is persistent (one program per SM walks the output
tiles in the same grouped order) and loads its tiles through TMA
descriptors, which Triton pipelines across the K loop; its MMA chain per
output is the pointer kernel's, so the switch changes no bit.

Graph safety: the grid and the tiles come from host ints (M, N, K); nothing
is allocated but the output and the TMA descriptors (host objects).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyengine.kernels.gemv.triton import check_operands
from tinyengine.kernels.launch import dot_precision, interpreting, num_sms
from tinyengine.kernels.tma import descriptor, tma_ok

_GROUP_M = 8  # row tiles that share weight tiles in L2 (programs run grouped)


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),): one output tile per
    program, in groups of GROUP_M row tiles per column of weight tiles. Rows
    past M and N are wrapped for the loads (only the store is masked)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter computes bf16 dots wrongly; fp32 is exact
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))  # fmt: skip


# M is not specialized on (its divisibility by 16 would be): a prefill chunk
# of any length then reuses the variant warmup compiled.
@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    x_desc, w_desc, b_ptr, out_ptr, M, N, K, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Persistent: NUM_PROGRAMS programs (one per SM) walk the
    output tiles in the same grouped order as _matmul_kernel, loading x and
    W tiles through TMA descriptors (a tile past K reads zeros, which add
    nothing). Each tile's K loop is the same chain of MMA steps in K order,
    so a row's bits are those of _matmul_kernel and of the skinny kernel."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            x = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w.T, acc, input_precision=DOT_PRECISION)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))  # fmt: skip


def tiles(m: int, elem_bytes: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows, the
    fastest of a sweep on Llama-3-8B's linears on an H200 (docs/
    benchmarks.md): small tiles while M is small (enough programs to stream
    the weight), 128 x 128 up to 512 rows, then 128 x 256 with 8 warps (the
    persistent TMA kernel is then within 1-5% of cuBLAS at 1,024 and 4,096
    rows; 128 x 128 tiles were 30% slower there); fp32 (tests) halves the
    tiles to stay in shared memory."""
    if m <= 64:
        cfg = (64, 64, 128, 4, 4)
    elif m <= 512:
        cfg = (128, 128, 64, 4, 4)
    else:
        cfg = (128, 256, 64, 8, 3)
    if elem_bytes > 2:
        cfg = (min(cfg[0], 64), min(cfg[1], 64), 32, 4, 2)
    return cfg


TMA_MIN_ROWS = 65  # below, the pointer kernel's small tiles stream the weight as well


def use_tma(x: torch.Tensor, weight: torch.Tensor, m: int) -> bool:
    """The persistent TMA kernel for large M where descriptors can view the
    operands (Hopper and later; the interpreter runs descriptor loads too)."""
    if m < TMA_MIN_ROWS or not (
        tma_ok(x, m, x.stride(0)) and tma_ok(weight, weight.shape[0], weight.stride(0))
    ):
        return False
    return interpreting() or torch.cuda.get_device_capability(x.device)[0] >= 9


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    check_operands("matmul", "x [M, K], weight [N, K]", x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps, stages = tiles(m, x.element_size())
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if use_tma(x, weight, m):
        # One program per SM whatever the tile count: NUM_PROGRAMS is a
        # compile-time constant, so a count that followed the tiles would
        # compile a variant per tile count (programs past the last tile exit).
        programs = num_sms(x.device, off_gpu=4)
        _matmul_tma_kernel[(programs,)](
            descriptor(x, m, x.stride(0), [block_m, block_k]),
            descriptor(weight, n, weight.stride(0), [block_n, block_k]),
            bias if bias is not None else weight, out, m, n, k, out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            GROUP_M=_GROUP_M, NUM_PROGRAMS=programs, UPCAST=interpreting(),
            DOT_PRECISION=dot_precision(x.dtype), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out
    _matmul_kernel[(num_tiles,)](
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=_GROUP_M, EVEN_K=k % block_k == 0, UPCAST=interpreting(),
        DOT_PRECISION=dot_precision(x.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
