"""Triton RMSNorm (plain and fused with the residual add) vs the torch
reference in tinyengine/kernels/norm/, and that reference vs Hugging Face's formula."""

from __future__ import annotations

import pytest
import torch

from tinyengine.kernels.norm.reference import rms_norm_torch
from tinyengine.kernels.norm.triton import rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 -> bf16/fp16 casts truncate under the interpreter (torch rounds): a
# stored element may differ by one ulp of its dtype.
ULP = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=2 * ULP[dtype], atol=2 * ULP[dtype])


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, verbatim in spirit."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a non-power-of-two row, masked tail
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(2, 3, hidden, generator=g) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    ref = rms_norm_torch(x, w, 1e-6)
    assert torch.equal(ref, hf_rms_norm(x, w, 1e-6))
    out = rms_norm_triton(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 128, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(5, 128, generator=g).to(dtype).to(DEVICE)
    w = torch.rand(128, generator=g).to(dtype).to(DEVICE)
    x0, res0 = x.clone(), res.clone()
    out_ref, res_ref = rms_norm_torch(x, w, 1e-5, residual=res)
    assert torch.equal(res_ref, (x.float() + res.float()).to(dtype))
    out, new_res = rms_norm_triton(x, w, 1e-5, residual=res)
    assert close(new_res, res_ref, dtype) and close(out, out_ref, dtype)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


def test_row_strided_input() -> None:
    # DeepSeek normalizes the first 512 of 576 columns (compressed_kv): a row-strided view.
    full = torch.randn(4, 80, device=DEVICE)
    x = full[:, :64]
    w = torch.rand(64, device=DEVICE)
    assert close(rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), torch.float32)


@pytest.mark.gpu
def test_gpu_rms_norm_realistic() -> None:
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    out, res = rms_norm_triton(x, w, 1e-6, residual=r)
    out_ref, res_ref = rms_norm_torch(x, w, 1e-6, residual=r)
    assert torch.equal(res, res_ref)
    assert close(out, out_ref, torch.bfloat16)
