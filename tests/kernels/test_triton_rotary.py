"""Triton rotary embedding vs the torch reference in tinyengine/kernels/rope/rotary.py, both
layouts, partial rotary, strided views; and the reference vs the textbook
complex-number rotation."""

from __future__ import annotations

import pytest
import torch

from tinyengine.kernels.rope.rotary import (
    apply_rotary_torch,
    apply_rotary_triton,
    build_cos_sin_cache,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def inv_freq(rot: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)


def complex_rotation(x: torch.Tensor, pos: torch.Tensor, rot: int, is_neox: bool) -> torch.Tensor:
    """Rotate pairs as complex numbers times e^{i pos f}: an independent formula."""
    xd = x.double()
    f = torch.outer(pos.double(), inv_freq(rot))[:, None, :]  # [T, 1, rot/2]
    if is_neox:
        z = torch.complex(xd[..., : rot // 2], xd[..., rot // 2 : rot])
    else:
        z = torch.complex(xd[..., 0:rot:2], xd[..., 1:rot:2])
    z = z * torch.polar(torch.ones_like(f), f)
    r = (
        torch.cat([z.real, z.imag], -1)
        if is_neox
        else torch.stack([z.real, z.imag], -1).flatten(-2)
    )
    return torch.cat([r, xd[..., rot:]], -1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rot", [(64, 64), (48, 32)])  # 48/32: partial rotary
def test_rotary(is_neox: bool, dtype: torch.dtype, head_dim: int, rot: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    T = 5
    q = torch.randn(T, 4, head_dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(T, 2, head_dim, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor([0, 3, 100, 7, 2047], device=DEVICE)
    cache = build_cos_sin_cache(inv_freq(rot).to(DEVICE), 2048)
    q_ref, k_ref = apply_rotary_torch(q, k, pos, cache, is_neox)
    assert torch.allclose(q_ref.double(), complex_rotation(q, pos, rot, is_neox).to(dtype).double(),
                          rtol=2 * ULP[dtype], atol=2 * ULP[dtype])  # fmt: skip
    q_out, k_out = apply_rotary_triton(q, k, pos, cache, is_neox)
    tol = 2 * ULP[dtype]
    assert torch.allclose(q_out.float(), q_ref.float(), rtol=tol, atol=tol)
    assert torch.allclose(k_out.float(), k_ref.float(), rtol=tol, atol=tol)
    assert torch.equal(q_out[..., rot:], q[..., rot:])  # pass-through dims untouched


def test_rotary_strided_views_and_no_k() -> None:
    # DeepSeek's q_pe: the last 16 dims of [T, H, 48] heads; k_pe a [T, 1, 16] slice.
    q_full = torch.randn(3, 2, 48, device=DEVICE)
    kv = torch.randn(3, 40, device=DEVICE)
    q_pe, k_pe = q_full[..., 32:], kv[:, 24:].view(3, 1, 16)
    pos = torch.tensor([5, 6, 7], device=DEVICE)
    cache = build_cos_sin_cache(inv_freq(16).to(DEVICE), 16, mscale=1.3)
    q_ref, k_ref = apply_rotary_torch(q_pe, k_pe, pos, cache, False)
    q_out, k_out = apply_rotary_triton(q_pe, k_pe, pos, cache, False)
    assert torch.allclose(q_out, q_ref, atol=1e-5) and torch.allclose(k_out, k_ref, atol=1e-5)
    q_only, none = apply_rotary_triton(q_pe, None, pos, cache, False)
    assert none is None and torch.allclose(q_only, q_ref, atol=1e-5)


@pytest.mark.gpu
def test_gpu_rotary_realistic() -> None:
    q = torch.randn(4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (4096,), device="cuda")
    cache = build_cos_sin_cache(inv_freq(128).cuda(), 8192)
    for is_neox in (True, False):
        ref = apply_rotary_torch(q, k, pos, cache, is_neox)
        out = apply_rotary_triton(q, k, pos, cache, is_neox)
        for a, b in zip(out, ref, strict=True):
            assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=2**-7)
