"""KV cache tensors and their sizing.

Owns the allocation of the paged K/V tensors (one pair per attention layer,
carved from a single allocation, or a hybrid cache's named tensors in their
cache groups) and the arithmetic of how many blocks fit a memory budget.
Knows nothing of requests: which block holds what is the block manager's
business.
"""

from __future__ import annotations

from typing import Any

import torch

from tinyengine.models.context import HybridCacheSpec, KVCacheSpec
from tinyengine.scheduling.block_manager import SlidingGroup


def bytes_per_block(
    spec: KVCacheSpec | HybridCacheSpec, block_size: int, dtype: torch.dtype
) -> int:
    """Everything one block holds, every layer."""
    if isinstance(spec, HybridCacheSpec):
        return spec.bytes_per_block(block_size, dtype)
    return block_size * spec.elements_per_token() * dtype.itemsize


def sliding_keep(spec: KVCacheSpec | HybridCacheSpec) -> int | None:
    """The sliding group's kept span in tokens, None when the cache has
    one group."""
    return spec.keep if isinstance(spec, HybridCacheSpec) else None


def sliding_blocks_wanted(keep: int | None, block_size: int, config: Any) -> int:
    """The sliding group's size: twice what the running requests can hold
    at once (SlidingGroup.blocks_needed), so the blocks they release stay
    findable by prefix hits for a while; 0 without a sliding group."""
    if keep is None:
        return 0
    needed = SlidingGroup.blocks_needed(
        keep, block_size, config.max_num_seqs, config.max_num_batched_tokens
    )
    return 2 * needed


def sliding_bytes(
    spec: KVCacheSpec | HybridCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype
) -> int:
    """What the sliding group's `num_blocks` blocks and its reserved one take."""
    if sliding_keep(spec) is None:
        return 0
    return (num_blocks + 1) * spec.bytes_per_block(block_size, dtype, sliding=True)


def useful_blocks(num_blocks: int, max_num_seqs: int, max_blocks_per_seq: int) -> int:
    """No more blocks than every sequence at full length can use."""
    return min(num_blocks, max_num_seqs * max_blocks_per_seq)


def allocate_cache(
    spec: KVCacheSpec | HybridCacheSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_sliding_blocks: int = 0,
) -> list[Any]:
    """Per layer, what the model's forward reads in ctx.kv_caches:
    `num_blocks` blocks of the full-history group, `num_sliding_blocks` of
    the sliding one (when the spec has it)."""
    if isinstance(spec, HybridCacheSpec):
        return allocate_hybrid_cache(
            spec, num_blocks, block_size, dtype, device, num_sliding_blocks
        )
    return allocate_kv_cache(spec, num_blocks, block_size, dtype, device)


def allocate_hybrid_cache(
    spec: HybridCacheSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_sliding_blocks: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """Zeroed, per layer {name: [blocks of its group, rows_per_block, width]}."""
    return [
        {
            t.name: torch.zeros(
                num_sliding_blocks if spec.is_sliding(t) else num_blocks,
                t.rows_per_block(block_size),
                t.width,
                dtype=t.dtype or dtype,
                device=device,
            )  # fmt: skip
            for t in layer
        }
        for layer in spec.layers
    ]


def zero_cache(caches: list[Any]) -> None:
    for layer in caches:
        tensors = layer.values() if isinstance(layer, dict) else layer
        for tensor in tensors:
            tensor.zero_()


def allocate_kv_cache(
    spec: KVCacheSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed caches, per layer (k_cache, v_cache) of shapes
    [num_blocks, block_size, num_kv_heads, head_dim_k | head_dim_v], carved from
    one allocation; a latent cache gives the same tensor twice. Zeroed because
    a masked-out read of a never-written slot must still be a finite number."""
    layer_shape = (num_blocks, block_size, spec.num_kv_heads)
    width = spec.head_dim_k + spec.head_dim_v
    storage = torch.zeros(spec.num_layers, *layer_shape, width, dtype=dtype, device=device)
    caches = []
    for i in range(spec.num_layers):
        k_cache = storage[i, ..., : spec.head_dim_k]
        v_cache = k_cache if spec.is_latent else storage[i, ..., spec.head_dim_k :]
        caches.append((k_cache, v_cache))
    return caches
