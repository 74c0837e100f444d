"""Host-side TMA (Hopper's tensor memory accelerator) descriptors for the
Triton kernels: whether a tensor can be viewed as a 2-D descriptor, and the
descriptor itself. Shared by the fused MoE GEMMs (expert weights, sorted
activations) and MLA decode (whole pages of the latent cache).

A descriptor is built on the host from host ints and the tensor's address,
and a launch passes it by value: a CUDA graph records it with the launch, so
it stays valid as long as the tensor does not move (weights, the KV cache and
workspace buffers never do after startup). Under TRITON_INTERPRET=1 the
interpreter runs descriptor loads itself, so CPU tests cover these paths.
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def tma_ok(t: torch.Tensor, rows: int, row_stride: int) -> bool:
    """Whether a descriptor can view t as [rows, t.shape[-1]] with this row
    stride: TMA wants a 16-byte-aligned base and row stride (the last dim is
    contiguous, which callers check) and at most 2^31 rows."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and row_stride * size % 16 == 0 and 0 < rows < 2**31


def descriptor(t: torch.Tensor, rows: int, row_stride: int, block: list[int]) -> TensorDescriptor:
    """A descriptor over t viewed as 2-D [rows, t.shape[-1]] with row stride
    row_stride, loading [block] tiles; a tile reaching past the view's edge
    reads zeros there (so a block wider than the data pads with 0)."""
    return TensorDescriptor(t, [rows, t.shape[-1]], [row_stride, 1], block)
