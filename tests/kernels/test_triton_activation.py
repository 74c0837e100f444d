"""Triton SiLU-and-mul vs the torch reference in tinyengine/kernels/activation/."""

from __future__ import annotations

import pytest
import torch

from tinyengine.kernels.activation.reference import silu_and_mul_torch
from tinyengine.kernels.activation.triton import silu_and_mul_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [64, 6000])  # 6000: two chunks of 4096, masked tail
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(2, 2, 2 * inter, generator=g) * 4).to(dtype).to(DEVICE)
    ref = silu_and_mul_torch(x)
    gate, up = x.float()[..., :inter], x.float()[..., inter:]
    tol = 2 * ULP[dtype]
    assert torch.allclose(ref.float(), gate * torch.sigmoid(gate) * up, rtol=tol, atol=tol)
    out = silu_and_mul_triton(x)
    assert out.shape == (2, 2, inter) and out.dtype == dtype
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_gpu_silu_and_mul_realistic() -> None:
    x = torch.randn(4096, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    out, ref = silu_and_mul_triton(x), silu_and_mul_torch(x)
    assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=2**-7)
