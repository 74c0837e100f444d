"""Triton paged attention vs a naive dense reference (tests/kernels/attention_batch.py;
and vs tinyengine/kernels/attention/reference.py, the torch reference op, when it exists).

CPU runs go through the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which costs ~2 ms per program instance: shapes stay tiny
and tile sizes small so that several KV/Q tiles, block boundaries and splits
are still crossed. Unused cache slots and block-table padding point at NaN, so
any read outside a sequence's context shows up as NaN in the output.

The split-KV decode tests are in test_triton_attention_decode.py, the GPU
ones in test_triton_attention_gpu.py; the batch and the reference they share
in attention_batch.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyengine.kernels.attention.triton as ta
from tests.kernels.attention_batch import Batch, assert_close, check_against_torch_reference

# ----------------------------------------------------------------------------- prefill / mixed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_matches_reference(dtype: torch.dtype) -> None:
    # A whole prompt, a chunk after a cached prefix, a decode row, padding rows.
    b = Batch([19, 7, 1], [19, 30, 25], num_q_heads=4, num_kv_heads=2, head_dim_k=32,
              head_dim_v=32, block_size=8, dtype=dtype, pad_rows=3)  # fmt: skip
    out = b.empty_out()
    ta.prefill_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_query_len=19,
                         block_m=16, block_n=16)  # fmt: skip
    n = sum(b.q_lens)
    assert_close(out[:n], b.dense_reference()[:n], dtype)
    full = b.run()  # the public op: padding rows come back as zeros
    assert_close(full, b.dense_reference(), dtype)
    assert (full[n:] == 0).all()
    check_against_torch_reference(b, full)


@pytest.mark.parametrize(
    "head_dim_k,head_dim_v,group", [(64, 64, 1), (128, 128, 4), (192, 128, 1), (64, 32, 3)]
)
def test_prefill_head_dims(head_dim_k: int, head_dim_v: int, group: int) -> None:
    b = Batch([12, 5], [12, 21], num_q_heads=group, num_kv_heads=1, head_dim_k=head_dim_k,
              head_dim_v=head_dim_v, block_size=16, dtype=torch.float16)  # fmt: skip
    out = b.empty_out()
    ta.prefill_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_query_len=12,
                         block_m=16, block_n=16)  # fmt: skip
    assert_close(out, b.dense_reference(), torch.float16)


def test_wide_gqa_group() -> None:
    # MQA-like: 32 query heads on one KV head; a tile holds 4 tokens x 32 heads.
    b = Batch([5, 1], [9, 30], num_q_heads=32, num_kv_heads=1, head_dim_k=16, head_dim_v=16,
              block_size=8, dtype=torch.float16)  # fmt: skip
    assert_close(b.run(), b.dense_reference(), torch.float16)


def test_prefill_diagonal_at_tile_edges() -> None:
    # Cached prefixes of 14..17 tokens put a q tile's first row just before,
    # on and after a 16-key tile edge: the unmasked/masked loop split must
    # never let a row see its future.
    b = Batch([3, 3, 3, 3], [17, 18, 19, 20], num_q_heads=2, num_kv_heads=1, head_dim_k=32,
              head_dim_v=32, block_size=8, dtype=torch.float32)  # fmt: skip
    out = b.empty_out()
    ta.prefill_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_query_len=3,
                         block_m=16, block_n=16)  # fmt: skip
    assert_close(out, b.dense_reference(), torch.float32)


def test_prefill_default_config_whole_prompt() -> None:
    # The production tile config (BLOCK_M 256 = 128 tokens x 2 heads, BLOCK_N
    # 64) on one prompt long enough for two q tiles and unmasked KV tiles.
    b = Batch([200], [200], num_q_heads=2, num_kv_heads=1, head_dim_k=32, head_dim_v=32,
              block_size=16, dtype=torch.bfloat16)  # fmt: skip
    assert_close(b.run(), b.dense_reference(), torch.bfloat16)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_seqs=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    num_kv_heads=st.sampled_from([1, 2]),
    block_size=st.sampled_from([8, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_prefill_random_ragged(
    data: st.DataObject, num_seqs: int, group: int, num_kv_heads: int, block_size: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    q_lens = data.draw(st.lists(st.integers(0, 24), min_size=num_seqs, max_size=num_seqs))
    if max(q_lens) == 0:
        q_lens[0] = 1
    ctx = data.draw(st.lists(st.integers(0, 40), min_size=num_seqs, max_size=num_seqs))
    seq_lens = [max(q + c, 1) for q, c in zip(q_lens, ctx, strict=True)]
    pad_rows = data.draw(st.integers(0, 3))
    b = Batch(q_lens, seq_lens, num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
              head_dim_k=32, head_dim_v=32, block_size=block_size, dtype=dtype,
              pad_rows=pad_rows, seed=data.draw(st.integers(0, 1000)))  # fmt: skip
    block_m = data.draw(st.sampled_from([16, 32]))
    out = b.empty_out()
    ta.prefill_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:],
                         max_query_len=max(q_lens), block_m=block_m, block_n=16)  # fmt: skip
    n = sum(q_lens)
    if n:
        assert_close(out[:n], b.dense_reference()[:n], dtype)


# ----------------------------------------------------------------------------- host side


def test_op_set_shape() -> None:
    from tinyengine.kernels import triton_ops

    ops = triton_ops("cpu")
    assert ops.name == "triton"
    assert ops.paged_attention is ta.paged_attention
    assert ops.write_kv_cache is ta.write_kv_cache


def test_int32_offsets_only_when_the_strided_view_fits():
    """K and V share the rows of one allocation (tinyengine/worker/kv_cache.py), so a K view of
    N elements reaches offsets up to ~2N: the int32 address path must be
    chosen from the largest reachable offset, not from numel()."""
    from tinyengine.kernels.attention.triton import offsets_fit_32, wide_offsets

    def caches(num_blocks: int):
        storage = torch.empty(
            (2, num_blocks, 16, 8, 256), device="meta"
        )  # [L, blocks, bs, H, Dk+Dv]
        return storage[1, ..., :128], storage[1, ..., 128:]

    k, v = caches(2**31 // (16 * 8 * 256) + 1)  # the K view itself holds ~2^30 elements
    assert k.numel() < 2**31 and not offsets_fit_32(k, v)
    k, v = caches(2**30 // (16 * 8 * 256))
    assert offsets_fit_32(k, v)
    # Startup's dry run compiles the 64-bit variants before a large cache exists.
    with wide_offsets():
        assert not offsets_fit_32(k, v)
    assert offsets_fit_32(k, v)


def test_prefill_config_fp32_tiles_need_no_more_shared_memory_than_bf16():
    """fp32 (tests, references on the GPU) halves rows and keys, so its K/V
    ring and Q tile take at most the bf16 tiles' bytes (which fit an SM);
    a tile still holds at least one token's query heads."""
    for head_dim in (64, 80, 128, 256):
        for q_len in (1, 40, 1000):
            for group in (1, 4, 16):
                m2, n2, _, s2 = ta.prefill_config(head_dim, q_len, group, 2)
                m4, n4, _, s4 = ta.prefill_config(head_dim, q_len, group, 4)
                assert m4 >= group and s4 == s2
                assert (m4 + s4 * n4) * 4 <= (m2 + s2 * n2) * 2 or m4 == max(group, 16)
