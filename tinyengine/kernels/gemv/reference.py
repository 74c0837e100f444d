"""The torch references of the GEMV folder, with the signatures of the Triton
launchers beside them:

  * `linear` / `linear_silu_mul`: what the torch op set runs for every linear
    layer and for a gated MLP's gate_up projection plus activation (F.linear,
    then Hugging Face's SiLU-and-mul rounding), any row count.
  * `rms_norm_linear`: a pre-norm layer's norm and the linear after it
    (optionally the gate_up projection plus activation), as the composition
    `rms_norm_linear_of` builds from any op set's norm and linears; the
    Triton set fuses it at one row (gemv/norm_linear.py).
  * `skinny_linear_torch` / `skinny_linear_silu_mul_torch`: the kernels'
    numerics (fp32 math, rounded once), the oracles their tests compare with.

Must never import triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tinyengine.kernels.activation.reference import silu_and_mul, silu_and_mul_torch
from tinyengine.kernels.norm.reference import rms_norm_torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of F.linear(x, weight, bias) for a gate_up weight [2I, K]."""
    return silu_and_mul(F.linear(x, weight, bias))


def rms_norm_linear_of(
    rms_norm: Callable[..., Any],
    linear: Callable[..., torch.Tensor],
    linear_silu_mul: Callable[..., torch.Tensor],
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The op `rms_norm_linear` as the given norm, then the given linear."""

    def rms_norm_linear(
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        silu_mul: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(rms_norm(x [+ residual])), the new residual: x + residual,
        or x itself without one); silu_mul: linear_silu_mul instead."""
        if residual is None:
            h, new_residual = rms_norm(x, norm_weight, eps), x
        else:
            h, new_residual = rms_norm(x, norm_weight, eps, residual)
        return (linear_silu_mul if silu_mul else linear)(h, weight, bias), new_residual

    return rms_norm_linear


rms_norm_linear = rms_norm_linear_of(rms_norm_torch, linear, linear_silu_mul)


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
