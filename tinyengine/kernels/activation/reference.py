"""SiLU-and-mul, the gated MLP activation, in torch: two references with the
signature of the Triton kernel (activation/triton.py).

    silu_and_mul*(x [..., 2 * I]) -> silu(x[..., :I]) * x[..., I:]   [..., I]

x is the fused gate_up projection output (gate first, then up).
  * `silu_and_mul`: Hugging Face's rounding (silu rounded to x.dtype, then the
    product rounded again): what the torch op set runs, so its tokens match
    HF's in bf16 too.
  * `silu_and_mul_torch`: the kernel's rounding (fp32 math, rounded once): the
    oracle the Triton kernel is tested against. In fp32 the two are equal.

Why its own folder, not with norm or GEMV: it is one op with its own kernel
that the model calls after any linear; the GEMV's fused epilogue (gemv/silu.py)
reuses its numbers rather than owning them.
Must never import triton or modify x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
