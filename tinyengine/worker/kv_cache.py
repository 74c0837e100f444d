"""KV cache tensors and their sizing.

Owns the allocation of the paged K/V tensors (one pair per attention layer,
carved from a single allocation) and the arithmetic of how many blocks fit a
memory budget. Knows nothing of requests: which block holds what is the
block manager's business.
"""

from __future__ import annotations

import torch


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V, every layer, one block."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed caches, per layer (k_cache, v_cache) each
    [num_blocks, block_size, num_kv_heads, head_dim]. Zeroed because a padded or
    masked-out read of a never-written slot must still be a finite number."""
    storage = torch.zeros(
        num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    return [(storage[i, 0], storage[i, 1]) for i in range(num_layers)]
