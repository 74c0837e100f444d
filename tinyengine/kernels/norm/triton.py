"""RMSNorm, optionally fused with the residual add before it: the Triton
kernel, with the signature of norm/reference.py's `rms_norm_torch`.

Owns the GPU kernel; the numbers are the reference's, rounding step for
rounding step. The fused form is vLLM's fused_add_rms_norm made functional.
Must never allocate anything but its outputs (it runs inside captured CUDA
graphs), nor change its inputs in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyengine.kernels.gdc import gdc_launch_dependents, gdc_wait
from tinyengine.kernels.launch import pdl_kwargs
from tinyengine.kernels.norm.reference import rms_norm_torch


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (rows,): one row of `hidden` elements per program, held in
    registers. USE_PDL (kernels/launch.py): the norm weight is loaded before
    waiting for the previous kernel, everything else after."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # HF rounds before the weight
    tl.store(
        out_ptr + row * stride_out + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """A 2-D [rows, hidden] view (no copy for row-strided views)."""
    if t.stride(-1) != 1:
        raise ValueError(f"rms_norm: the last dim of {name} must be contiguous")
    return t.view(-1, t.shape[-1]) if t.dim() != 2 else t


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    x2 = _rows(x, "x")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        res2 = _rows(residual, "residual")
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out2 = res_out.view(-1, hidden)
    else:
        res2 = res_out2 = x2  # unused (HAS_RESIDUAL=False); any valid pointer
        res_out = None
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        # 8 elements (16 bytes of bf16) per thread: one vector load each.
        num_warps = max(1, min(16, block // 256))
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out2, res_out2,
            x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
            **pdl_kwargs(x.device),
        )  # fmt: skip
    return out if res_out is None else (out, res_out)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The Triton op set's norm: the kernel for contiguous operands (every
    decoder norm), the reference for a strided view the kernel cannot flatten
    (same numbers either way)."""
    if x.is_contiguous() and (residual is None or residual.is_contiguous()):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)
