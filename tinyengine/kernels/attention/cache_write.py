"""Triton KV-cache write: scatter this step's keys and values into their paged
cache slots through `slot_mapping`.

Owns the Triton twin of kernels.attention.write_kv_cache (same signature, same
semantics: slot = block_id * block_size + offset, a negative slot is a padding
row and is skipped). Must never read slot_mapping on the host or allocate: it
runs inside captured CUDA graphs, once per layer per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM_K: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Grid (T,): token t copies k[t] [Hkv, Dk] and v[t] [Hkv, Dv] into
    cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return  # padding row: must never touch a live block
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    dk = tl.arange(0, BLOCK_DK)[None, :]
    dv = tl.arange(0, BLOCK_DV)[None, :]
    k_mask = (h < NUM_HEADS) & (dk < HEAD_DIM_K)
    v_mask = (h < NUM_HEADS) & (dv < HEAD_DIM_V)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + dk, mask=k_mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dv, mask=v_mask)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + dk
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + dv
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k [T, Hkv, Dk] / v [T, Hkv, Dv] into the caches, in place.

    k and v may be strided views (e.g. slices of a fused qkv projection) as
    long as the head dim is contiguous; so may the caches.
    """
    num_tokens, num_heads, head_dim_k = k.shape
    head_dim_v = v.shape[2]
    if num_tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"write_kv_cache: the last dim of {name} must be contiguous")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"write_kv_cache: slot_mapping has {slot_mapping.shape[0]} entries for "
            f"{num_tokens} rows of k/v"
        )
    block_h = triton.next_power_of_2(num_heads)
    block_dk = triton.next_power_of_2(head_dim_k)
    block_dv = triton.next_power_of_2(head_dim_v)
    # ~8 elements (16 bytes of bf16) per thread per tensor: one vector access each.
    num_warps = max(1, min(8, block_h * max(block_dk, block_dv) // 256))
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM_K=head_dim_k, HEAD_DIM_V=head_dim_v,
        BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        BLOCK_SIZE=k_cache.shape[1], num_warps=num_warps,
    )  # fmt: skip
