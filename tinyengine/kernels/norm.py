"""RMSNorm, optionally fused with the residual add before it: a torch reference
and a Triton kernel with the same signature.

Owns the numerical definition of the norm (Hugging Face's: normalize in fp32,
round to the input dtype, then multiply by the weight and round again) and its
GPU kernel. Must never allocate anything but its outputs (it runs inside
captured CUDA graphs), nor change its inputs in place.

    rms_norm_*(x, weight, eps)                 -> normed
    rms_norm_*(x, weight, eps, residual=r)     -> (normed, x + r)

The fused form is vLLM's fused_add_rms_norm made functional: the sum x + r is
rounded to the input dtype (as the model's own `residual + hidden` would be),
returned as the next residual, and normalized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed.to(x.dtype).float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (rows,): one row of `hidden` elements per program, held in registers."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
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
        )  # fmt: skip
    return out if res_out is None else (out, res_out)
