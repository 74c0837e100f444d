"""Rotary position embedding: a host-side cos/sin cache builder, a torch
reference and a Triton kernel with the same signature.

Owns how a rotation is applied to q and k given a precomputed cache. The
frequencies themselves (plain, llama3-scaled, yarn) are the model's business:
it passes `inv_freq` (and yarn's `mscale`) to build_cos_sin_cache once at load.
Must never compute frequencies per step, allocate anything but its outputs, or
modify q/k in place.

Cache layout (vLLM's): cos_sin_cache[pos] = [cos(pos * f_0..f_{R/2-1}),
sin(pos * f_0..f_{R/2-1})], fp32, shape [max_position, R] where R = rotary_dim.
Only the first R dims of each head rotate; dims R.. pass through unchanged.

Two pairings of the rotated dims, for i in [0, R/2):
    neox        (Llama, Qwen):          (x[i], x[i + R/2])
    interleaved (GPT-J, DeepSeek V3):   (x[2i], x[2i + 1])
each pair (a, b) -> (a cos_i - b sin_i, b cos_i + a sin_i), in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyengine.kernels.device_fn import device_fn


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, mscale: float = 1.0
) -> torch.Tensor:
    """[max_position, 2 * len(inv_freq)] fp32: cos then sin, each times mscale."""
    t = torch.arange(max_position, dtype=torch.float64, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.to(torch.float64))
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * mscale).float()


def _rotate_torch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    xf = x.float()
    xr, passthrough = xf[..., :rot], xf[..., rot:]
    if is_neox:
        a, b = xr[..., : rot // 2], xr[..., rot // 2 :]
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    ra, rb = a * c - b * s, b * c + a * s
    rotated = torch.cat([ra, rb], -1) if is_neox else torch.stack([ra, rb], -1).flatten(-2)
    return torch.cat([rotated, passthrough], -1).to(x.dtype)


def apply_rotary_torch(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, Hq, D], k [T, Hk, D] or None, positions [T] -> rotated (q, k)."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    q_out = _rotate_torch(q, cos, sin, is_neox)
    return q_out, (None if k is None else _rotate_torch(k, cos, sin, is_neox))


@device_fn
def _rotate_heads(
    src, dst, stride_sh, stride_dh, cos, sin,
    num_heads, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_PASS: tl.constexpr, IS_NEOX: tl.constexpr,
):  # fmt: skip
    """Rotate the [num_heads, HEAD_DIM] heads of one token from src into dst."""
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, ROT_HALF)[None, :]
    h_ok = h < num_heads
    if IS_NEOX:
        a = tl.load(src + h * stride_sh + i, mask=h_ok).to(tl.float32)
        b = tl.load(src + h * stride_sh + ROT_HALF + i, mask=h_ok).to(tl.float32)
    else:
        # Load the rotated span contiguously [H, 2*ROT_HALF] and split the
        # (even, odd) pairs in registers: full-width vector loads.
        j = tl.arange(0, 2 * ROT_HALF)[None, :]
        x = tl.load(src + h * stride_sh + j, mask=h_ok).to(tl.float32)
        a, b = tl.split(tl.reshape(x, [BLOCK_H, ROT_HALF, 2]))
    ra = a * cos - b * sin
    rb = b * cos + a * sin
    out_ty = dst.dtype.element_ty
    if IS_NEOX:
        tl.store(dst + h * stride_dh + i, ra.to(out_ty), mask=h_ok)
        tl.store(dst + h * stride_dh + ROT_HALF + i, rb.to(out_ty), mask=h_ok)
    else:
        j = tl.arange(0, 2 * ROT_HALF)[None, :]
        y = tl.reshape(tl.join(ra, rb), [BLOCK_H, 2 * ROT_HALF])
        tl.store(dst + h * stride_dh + j, y.to(out_ty), mask=h_ok)
    if BLOCK_PASS > 0:  # dims past rotary_dim are copied unchanged
        p = 2 * ROT_HALF + tl.arange(0, BLOCK_PASS)[None, :]
        p_ok = h_ok & (p < HEAD_DIM)
        tl.store(dst + h * stride_dh + p, tl.load(src + h * stride_sh + p, mask=p_ok), mask=p_ok)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    num_q_heads, num_k_heads,
    HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_PASS: tl.constexpr, IS_NEOX: tl.constexpr, HAS_K: tl.constexpr,
):  # fmt: skip
    """Grid (T,): one token's q heads and k heads share one cos/sin row."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, ROT_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + i)
    sin = tl.load(cache_ptr + pos * stride_cache + ROT_HALF + i)
    _rotate_heads(
        q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, cos, sin,
        num_q_heads, HEAD_DIM, ROT_HALF, BLOCK_HQ, BLOCK_PASS, IS_NEOX,
    )  # fmt: skip
    if HAS_K:
        _rotate_heads(
            k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, stride_kh, stride_koh, cos, sin,
            num_k_heads, HEAD_DIM, ROT_HALF, BLOCK_HK, BLOCK_PASS, IS_NEOX,
        )  # fmt: skip


def apply_rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as apply_rotary_torch. q/k may be strided views (a slice
    of a fused projection, DeepSeek's q_pe) as long as the head dim is
    contiguous; rotary_dim = cos_sin_cache.shape[1] must be a power of two."""
    num_tokens, num_q_heads, head_dim = q.shape
    rot = cos_sin_cache.shape[1]
    if rot & (rot - 1) or rot < 2 or rot > head_dim:
        raise ValueError(
            f"apply_rotary: rotary_dim {rot} must be a power of two <= head_dim {head_dim}"
        )
    if k is not None and k.shape[2] != head_dim:
        raise ValueError(f"apply_rotary: q and k head dims differ ({head_dim} vs {k.shape[2]})")
    if q.stride(-1) != 1 or (k is not None and k.stride(-1) != 1) or cos_sin_cache.stride(-1) != 1:
        raise ValueError("apply_rotary: the last dim of q, k and the cache must be contiguous")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_src = q if k is None else k
    k_out = q_out if k is None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens > 0:
        num_k_heads = k_src.shape[1]
        block_hq = triton.next_power_of_2(num_q_heads)
        _rotary_kernel[(num_tokens,)](
            q, k_src, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k_src.stride(0), k_src.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos_sin_cache.stride(0), num_q_heads, num_k_heads,
            HEAD_DIM=head_dim, ROT_HALF=rot // 2, BLOCK_HQ=block_hq,
            BLOCK_HK=triton.next_power_of_2(num_k_heads),
            BLOCK_PASS=triton.next_power_of_2(head_dim - rot) if head_dim > rot else 0,
            IS_NEOX=is_neox, HAS_K=k is not None,
            num_warps=max(1, min(8, block_hq * head_dim // 512)),
        )  # fmt: skip
    return q_out, (None if k is None else k_out)
