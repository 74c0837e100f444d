"""Pure tensor ops, chosen by name: the attention op sets (torch reference or
Triton) that a model's attention layer calls through its ForwardContext.

Owns the mapping from a backend name to its op set. Must never import
`models/` or `tinyengine/`, and must not import triton at module import time
(the CPU path and the scheduling tests run without it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ATTENTION_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class AttentionOps:
    """One backend's attention ops; every backend has the same signatures as
    kernels/attention.py (the torch reference)."""

    name: str
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # The Llama-family prologue fused with the cache write (kernels/rope_cache.py).
    rope_write_kv: Callable[..., torch.Tensor]


def get_attention_ops(name: str) -> AttentionOps:
    if name == "torch":
        from tinyengine.kernels import attention, rope_cache

        return AttentionOps(
            "torch",
            attention.write_kv_cache,
            attention.paged_attention,
            rope_cache.rope_write_kv_torch,
        )
    if name == "triton":
        from tinyengine.kernels import triton_attention, triton_rope_cache

        return AttentionOps(
            "triton",
            triton_attention.write_kv_cache,
            triton_attention.paged_attention,
            triton_rope_cache.rope_write_kv_triton,
        )
    raise ValueError(
        f"unknown attention backend {name!r}; choose one of {list(ATTENTION_BACKENDS)}"
    )
