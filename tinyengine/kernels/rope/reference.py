"""The torch reference of the Llama-family attention prologue: optional per-head
RMSNorm of q and k (Qwen3's q_norm / k_norm), RoPE in the neox (rotate-half)
layout, and the write of k and v into the paged cache, as one op:

    rope_write_kv_*(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                    slot_mapping, q_norm_weight=None, k_norm_weight=None,
                    eps=1e-6) -> rotated q [T, Hq, D]

Owns the rounding of that prologue, which is Hugging Face's in the activation
dtype: the norm as norm/reference.py defines it, then each product of the
rotation rounded to the dtype before the sum, with cos/sin rounded to the
dtype first (HF's `q * cos + rotate_half(q) * sin` in bf16). The Triton twin
in rope/triton.py does the same in one launch; on the GPU that
replaces ~20 small torch kernels a layer (two norms, the rotation pieces and
the cache write). Must never import triton at module import time (the torch
backend runs without compiling anything).

Layout: q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] may be strided views of a
fused qkv projection (head dim contiguous). cos_sin_cache [max_pos, R] holds
cos then sin for R/2 frequencies (models/rotary.py builds it); dims R.. of
each head pass through unrotated. Caches and slot_mapping as in
kernels/attention/reference.py (a negative slot writes nothing).
"""

from __future__ import annotations

import torch

from tinyengine.kernels.attention.reference import write_kv_cache
from tinyengine.kernels.norm.reference import rms_norm_torch


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [T, H, D] with cos/sin [T, 1, R/2] already in x's dtype.

    The rotated part's two halves are the (real, imag) pairs (neox layout,
    not interleaved lanes). Each product rounds to x's dtype before the sum,
    exactly as HF's bf16 expression does.
    """
    rot_dim = 2 * cos.shape[-1]
    rot, passthrough = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if passthrough.shape[-1] == 0:
        return rotated
    return torch.cat([rotated, passthrough], dim=-1)


def gather_cos_sin(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, R/2] for the given positions, rounded to `dtype`."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def rope_write_kv_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope_write_kv: give both q_norm_weight and k_norm_weight, or neither")
    if q_norm_weight is not None and k_norm_weight is not None:
        q = rms_norm_torch(q, q_norm_weight, eps)
        k = rms_norm_torch(k, k_norm_weight, eps)
    cos, sin = gather_cos_sin(cos_sin_cache, positions, q.dtype)
    q = rotate_neox(q, cos, sin)
    write_kv_cache(rotate_neox(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return q
