"""The torch references of the GEMV folder, with the signatures of the Triton
launchers beside them:

  * `linear` / `linear_silu_mul`: what the torch op set runs for every linear
    layer and for a gated MLP's gate_up projection plus activation (F.linear,
    then Hugging Face's SiLU-and-mul rounding), any row count.
  * `skinny_linear_torch` / `skinny_linear_silu_mul_torch`: the kernels'
    numerics (fp32 math, rounded once), the oracles their tests compare with.

Must never import triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyengine.kernels.activation.reference import silu_and_mul, silu_and_mul_torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of F.linear(x, weight, bias) for a gate_up weight [2I, K]."""
    return silu_and_mul(F.linear(x, weight, bias))


def skinny_linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: fp32 math, rounded once to x.dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def skinny_linear_silu_mul_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: the gate_up projection in fp32 rounded once to x.dtype
    (skinny_linear_torch), then silu(gate) * up in fp32 rounded once
    (silu_and_mul_torch, the reference of the Triton activation that the
    unfused CUDA path runs). weight [2I, K], gate rows first -> [M, I]."""
    y = silu_and_mul_torch(skinny_linear_torch(x, weight, bias))
    if out is None:
        return y
    out.copy_(y)
    return out
