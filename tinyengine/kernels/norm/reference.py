"""RMSNorm, optionally fused with the residual add before it: the torch
reference (the Triton kernel with the same signature is norm/triton.py).

Owns the numerical definition of the norm, Hugging Face's: normalize in fp32,
round to the input dtype, then multiply by the weight and round again. With a
residual, the sum x + r is rounded to the input dtype (as the model's own
`residual + hidden` would be), returned as the next residual, and normalized:

    rms_norm_torch(x, weight, eps)                 -> normed
    rms_norm_torch(x, weight, eps, residual=r)     -> (normed, x + r)

Must never import triton (the torch op set runs without it) nor change its
inputs in place.
"""

from __future__ import annotations

import torch


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed.to(x.dtype).float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)
