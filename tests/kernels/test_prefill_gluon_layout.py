"""Which tensors the Gluon prefill's TMA descriptors can address
(kernels/attention/gluon.py `_rows_ok`), checked on the CPU: the engine's
own cache layout (a head's K and V side by side in one allocation) and a
query sliced out of a fused QKV projection must pass, or on a Hopper GPU the
engine would silently keep the slower Triton prefill; tensors a 2-D
[rows, columns] view cannot describe must fail."""

from __future__ import annotations

import torch

from tinyengine.kernels.attention.gluon import _rows_ok
from tinyengine.models.context import KVCacheSpec
from tinyengine.worker.kv_cache import allocate_kv_cache


def test_the_engine_cache_layout_is_addressable() -> None:
    caches = allocate_kv_cache(KVCacheSpec(2, 4, 128, 128), 6, 16, torch.bfloat16, "cpu")
    for k_cache, v_cache in caches:
        assert k_cache.stride(2) == 256  # K and V of a head side by side
        assert _rows_ok(k_cache) and _rows_ok(v_cache)
        assert k_cache.stride() == v_cache.stride()


def test_a_query_sliced_from_fused_qkv_is_addressable() -> None:
    qkv = torch.zeros(300, (32 + 2 * 8) * 128, dtype=torch.bfloat16)
    q = qkv[:, : 32 * 128].view(300, 32, 128)
    assert _rows_ok(q)
    assert _rows_ok(torch.zeros(300, 32, 128, dtype=torch.bfloat16))


def test_layouts_a_2d_view_cannot_describe_are_refused() -> None:
    base = torch.zeros(8, 16, 4, 128, dtype=torch.bfloat16)
    assert _rows_ok(base)
    assert not _rows_ok(base.transpose(1, 2))  # heads outside rows
    assert not _rows_ok(base[..., ::2])  # a head's elements strided
    assert not _rows_ok(base[:, :8])  # blocks that do not abut
    unaligned = torch.zeros(8, 16, 4, 100, dtype=torch.bfloat16)[..., :98]
    assert not _rows_ok(unaligned)  # heads 200 B apart, not a multiple of 16
    offset = torch.zeros(8 * 16 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(8, 16, 4, 128)
    assert not _rows_ok(offset)  # base not 16-byte aligned
