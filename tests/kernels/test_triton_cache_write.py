"""Triton KV-cache write vs a naive per-row scatter (and vs
kernels.attention.write_kv_cache when it exists): padding slots skipped,
strided k/v views, Dk != Dv, dtype conversion into the cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyengine.kernels.attention.cache_write import write_kv_cache_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def naive_write(k, v, k_cache, v_cache, slot_mapping) -> None:  # noqa: ANN001
    bs = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // bs, slot % bs] = k[t].to(k_cache.dtype)
            v_cache[slot // bs, slot % bs] = v[t].to(v_cache.dtype)


def make_case(num_tokens: int, num_heads: int, dk: int, dv: int, block_size: int,
              num_blocks: int, dtype: torch.dtype, cache_dtype: torch.dtype, pad: int,
              seed: int):  # noqa: ANN202  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    # k and v as strided slices of one fused projection output, like a model's qkv split.
    fused = torch.randn(num_tokens, num_heads * (dk + dv) + 8, generator=g).to(dtype)
    k = fused[:, : num_heads * dk].view(num_tokens, num_heads, dk)
    v = fused[:, num_heads * dk : num_heads * (dk + dv)].view(num_tokens, num_heads, dv)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[:pad]] = -1  # padding rows
    k_cache = torch.randn(num_blocks, block_size, num_heads, dk, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_heads, dv, generator=g).to(cache_dtype)
    dev = DEVICE
    return k.to(dev), v.to(dev), k_cache.to(dev), v_cache.to(dev), slots.to(dev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_matches_naive(dtype: torch.dtype) -> None:
    k, v, kc, vc, slots = make_case(12, 2, 32, 16, 8, 4, dtype, dtype, pad=3, seed=0)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    naive_write(k, v, kc_ref, vc_ref, slots)
    write_kv_cache_triton(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # a copy is exact
    from tinyengine.kernels.attention.reference import write_kv_cache

    kc2, vc2 = kc_ref.clone(), vc_ref.clone()
    write_kv_cache(k, v, kc2, vc2, slots)
    assert torch.equal(kc2, kc_ref) and torch.equal(vc2, vc_ref)


def test_write_converts_to_cache_dtype() -> None:
    k, v, kc, vc, slots = make_case(6, 3, 16, 16, 16, 2, torch.float32, torch.bfloat16, 1, 1)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    naive_write(k, v, kc_ref, vc_ref, slots)
    write_kv_cache_triton(k, v, kc, vc, slots)
    # The interpreter truncates fp32 -> bf16 where torch rounds: 1 bf16 ulp.
    assert torch.allclose(kc.float(), kc_ref.float(), rtol=2**-7, atol=0)
    assert torch.allclose(vc.float(), vc_ref.float(), rtol=2**-7, atol=0)


@settings(max_examples=8, deadline=None)
@given(
    num_tokens=st.integers(1, 10),
    num_heads=st.sampled_from([1, 2, 3]),
    block_size=st.sampled_from([8, 16]),
    pad=st.integers(0, 3),
    seed=st.integers(0, 99),
)
def test_write_random(
    num_tokens: int, num_heads: int, block_size: int, pad: int, seed: int
) -> None:
    dtype = torch.float16
    k, v, kc, vc, slots = make_case(
        num_tokens, num_heads, 16, 32, block_size, 3, dtype, dtype, min(pad, num_tokens), seed
    )
    kc_ref, vc_ref = kc.clone(), vc.clone()
    naive_write(k, v, kc_ref, vc_ref, slots)
    write_kv_cache_triton(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.gpu
def test_gpu_write_realistic() -> None:
    k, v, kc, vc, slots = make_case(4096, 8, 128, 128, 16, 512, torch.bfloat16,
                                    torch.bfloat16, pad=100, seed=0)  # fmt: skip
    kc_ref, vc_ref = kc.clone(), vc.clone()
    naive_write(k, v, kc_ref, vc_ref, slots)
    write_kv_cache_triton(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
