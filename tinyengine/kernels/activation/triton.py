"""SiLU-and-mul, the gated MLP activation: the Triton kernel, with the
signature of activation/reference.py's functions.

    silu_and_mul_*(x [..., 2 * I]) -> silu(x[..., :I]) * x[..., I:]   [..., I]

x is the fused gate_up projection output (gate first, then up). Math in fp32,
rounded once to x.dtype. Must never allocate anything but its output (it runs
inside captured CUDA graphs) or modify x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyengine.kernels.activation.reference import silu_and_mul


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (rows,): one row per program, walked in BLOCK-wide vector chunks so
    any intermediate size works without a giant register tile."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * stride_out
    for start in range(0, inter, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < inter
        gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + inter + offs, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(o_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(
            f"silu_and_mul: last dim must be even and contiguous; got shape {tuple(x.shape)}"
        )
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    x2 = x.view(-1, x.shape[-1]) if x.dim() != 2 else x
    out2 = out.view(-1, inter)
    if x2.shape[0] > 0:
        block = min(4096, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0],)](
            x2, out2, x2.stride(0), out2.stride(0), inter,
            BLOCK=block, num_warps=max(1, min(8, block // 512)),
        )  # fmt: skip
    return out


def silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    """The Triton op set's activation: the kernel for a contiguous x on the GPU
    (every MLP's gate_up output there), the reference op otherwise (a strided
    view; a CPU tensor, which only the GEMV's fallback in tests passes)."""
    if x.is_cuda and x.is_contiguous():
        return silu_and_mul_triton(x)
    return silu_and_mul(x)
