"""The torch reference attention ops against a naive dense causal attention,
on ragged batches: decode rows, prefills after a cached prefix, chunks that
cross block boundaries, GQA, Dv != Dk, padding rows.

The paged cache is filled the way a model does it: the cached prefix by an
earlier write, this step's rows by write_kv_cache in the same batched call,
with blocks handed out in scrambled order so a wrong gather cannot pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyengine.kernels import choose_ops
from tinyengine.kernels.attention.reference import paged_attention, write_kv_cache


@dataclass
class Seq:
    seq_len: int  # context length after this step
    q_len: int  # new tokens this step (the last q_len of the context)


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Naive float64 attention for ONE sequence: q [L, Hq, Dk] are the last L
    positions of a context whose full keys/values are k [S, Hkv, Dk], v [S, Hkv, Dv]."""
    q_len, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty(q_len, num_q_heads, v.shape[-1], dtype=torch.float64)
    for h in range(num_q_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for j in range(q_len):
            visible = seq_len - q_len + j + 1  # keys 0..position of query j
            scores = (kh[:visible] @ q[j, h].double()) * scale
            out[j, h] = torch.softmax(scores, dim=0) @ vh[:visible]
    return out


def run_case(
    seqs: list[Seq],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    head_dim_v: int,
    num_padding: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Returns (paged output, dense reference, number of real rows)."""
    gen = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * group
    blocks_per_seq = [-(-s.seq_len // block_size) for s in seqs]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks must stay untouched
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, cursor = [], 0
    for n in blocks_per_seq:
        tables.append(order[cursor : cursor + n])
        cursor += n
    max_blocks = max(blocks_per_seq)
    block_tables = torch.tensor(
        [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
    )

    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim_v, dtype=dtype)

    def slots(i: int, positions: range) -> list[int]:
        return [tables[i][p // block_size] * block_size + p % block_size for p in positions]

    full_k, full_v, new_q = [], [], []
    step_slots: list[int] = []
    for i, s in enumerate(seqs):
        k = torch.randn(s.seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(s.seq_len, num_kv_heads, head_dim_v, generator=gen).to(dtype)
        full_k.append(k)
        full_v.append(v)
        new_q.append(torch.randn(s.q_len, num_q_heads, head_dim, generator=gen).to(dtype))
        cached = s.seq_len - s.q_len
        # The prefix was written by earlier steps.
        prefix_slots = torch.tensor(slots(i, range(cached)), dtype=torch.int64)
        write_kv_cache(k[:cached], v[:cached], k_cache, v_cache, prefix_slots)
        step_slots += slots(i, range(cached, s.seq_len))

    # This step: all sequences' new rows in one varlen batch, plus padding rows
    # whose slot is -1 and whose k/v are garbage that must never land anywhere.
    pad_k = torch.full((num_padding, num_kv_heads, head_dim), 1e4, dtype=dtype)
    pad_v = torch.full((num_padding, num_kv_heads, head_dim_v), 1e4, dtype=dtype)
    step_k = torch.cat(
        [k[s.seq_len - s.q_len :] for k, s in zip(full_k, seqs, strict=True)] + [pad_k]
    )
    step_v = torch.cat(
        [v[s.seq_len - s.q_len :] for v, s in zip(full_v, seqs, strict=True)] + [pad_v]
    )
    slot_mapping = torch.tensor(step_slots + [-1] * num_padding, dtype=torch.int64)
    write_kv_cache(step_k, step_v, k_cache, v_cache, slot_mapping)

    q = torch.cat(new_q + [torch.randn(num_padding, num_q_heads, head_dim).to(dtype)])
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.q_len)
    scale = head_dim**-0.5
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([s.seq_len for s in seqs], dtype=torch.int32),
        scale,
        max_query_len=max(s.q_len for s in seqs),
        max_seq_len=max(s.seq_len for s in seqs),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[s.seq_len for s in seqs],
    )
    ref = torch.cat(
        [
            dense_causal_attention(q_i, k, v, scale)
            for q_i, k, v in zip(new_q, full_k, full_v, strict=True)
        ]
    )
    # Spare blocks never referenced by any table stay zero (no stray writes).
    spare = order[cursor:]
    assert k_cache[spare].abs().sum() == 0 and v_cache[spare].abs().sum() == 0
    assert (k_cache.abs() < 1e3).all() and (v_cache.abs() < 1e3).all(), "padding row written"
    return out, ref, starts[-1]


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_decode_and_prefill(block_size: int) -> None:
    seqs = [
        Seq(seq_len=1, q_len=1),  # first token of a sequence
        Seq(seq_len=37, q_len=1),  # decode mid-block
        Seq(seq_len=2 * block_size, q_len=1),  # decode filling a block exactly
        Seq(seq_len=40, q_len=40),  # whole prompt, crosses block boundaries
        Seq(seq_len=block_size + 9, q_len=9),  # chunk after a cached full block
        Seq(seq_len=50, q_len=13),  # chunk starting mid-block
    ]
    out, ref, rows = run_case(
        seqs, block_size=block_size, num_kv_heads=2, group=2, head_dim=16, head_dim_v=16,
        num_padding=3,
    )  # fmt: skip
    assert out.shape == (rows + 3, 4, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out[:rows].double(), ref, atol=1e-5, rtol=1e-5)
    assert (out[rows:] == 0).all(), "padding rows must produce zeros"


def test_gqa_with_value_dim_different_from_key_dim() -> None:
    seqs = [Seq(23, 23), Seq(40, 1), Seq(33, 5)]
    out, ref, rows = run_case(
        seqs, block_size=16, num_kv_heads=2, group=4, head_dim=16, head_dim_v=24
    )
    assert out.shape == (rows, 8, 24)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_storage_computes_in_fp32() -> None:
    out, ref, rows = run_case(
        [Seq(30, 30), Seq(17, 1)], block_size=16, num_kv_heads=1, group=2, head_dim=16,
        head_dim_v=16, dtype=torch.bfloat16,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    # Inputs are exactly representable in bf16; the only error is the final rounding.
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)


def test_dense_decode_path_matches_varlen_path() -> None:
    """Without *_cpu lists (a decode inside a CUDA graph) the op takes the
    dense, device-only path; it must agree with the exact varlen path, with or
    without a workspace arena."""
    from tinyengine.kernels.workspace import Workspace

    torch.manual_seed(0)
    q = torch.randn(3, 4, 8)
    k_cache = torch.randn(6, 16, 2, 8)
    v_cache = torch.randn(6, 16, 2, 8)
    tables = torch.tensor([[3, 1, 0], [0, 2, 0], [5, 4, 1]], dtype=torch.int32)
    args = (
        q, k_cache, v_cache, tables, torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        torch.tensor([20, 9, 33], dtype=torch.int32), 0.3,
    )  # fmt: skip
    exact = paged_attention(
        *args, max_query_len=1, max_seq_len=33, query_start_loc_cpu=[0, 1, 2, 3],
        seq_lens_cpu=[20, 9, 33],
    )  # fmt: skip
    dense = paged_attention(*args, max_query_len=1, max_seq_len=48)
    torch.testing.assert_close(dense, exact, atol=1e-5, rtol=1e-5)
    workspace = Workspace("cpu")
    arena = paged_attention(*args, max_query_len=1, max_seq_len=48, workspace=workspace)
    torch.testing.assert_close(arena, exact, atol=1e-5, rtol=1e-5)
    assert workspace.stats.largest_request_bytes >= 2 * 3 * 3 * 16 * 2 * 8 * 4
    with pytest.raises(ValueError, match="only\\s+decode batches|decode batches"):
        paged_attention(*args[:4], torch.tensor([0, 2, 3]), *args[5:], max_query_len=2,
                        max_seq_len=48)  # fmt: skip


def test_write_kv_cache_skips_negative_slots() -> None:
    k_cache = torch.zeros(3, 4, 1, 2)
    v_cache = torch.zeros(3, 4, 1, 2)
    k = torch.arange(1, 9, dtype=torch.float32).view(4, 1, 2)
    write_kv_cache(k, -k, k_cache, v_cache, torch.tensor([9, -1, 0, -7]))
    assert torch.equal(k_cache[2, 1, 0], k[0, 0]) and torch.equal(v_cache[2, 1, 0], -k[0, 0])
    assert torch.equal(k_cache[0, 0, 0], k[2, 0])
    assert k_cache.abs().sum() == k[0].abs().sum() + k[2].abs().sum()


def test_choose_ops_attention() -> None:
    ops = choose_ops("torch", "cpu")
    assert ops.paged_attention is paged_attention and ops.write_kv_cache is write_kv_cache
    import tinyengine.kernels.attention.triton as triton_attention

    triton_ops = choose_ops("triton", "cpu")
    assert triton_ops.paged_attention is triton_attention.paged_attention
    assert triton_ops.write_kv_cache is triton_attention.write_kv_cache
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_ops("flash", "cpu")


@st.composite
def ragged_batches(draw: st.DrawFn) -> tuple[list[Seq], dict]:
    block_size = draw(st.sampled_from([16, 32]))
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        seq_len = draw(st.integers(1, 3 * block_size + 3))
        kind = draw(st.sampled_from(["decode", "prefill", "chunk"]))
        q_len = {"decode": 1, "prefill": seq_len}.get(kind) or draw(st.integers(1, seq_len))
        seqs.append(Seq(seq_len, q_len))
    params = dict(
        block_size=block_size,
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([8, 16])),
        head_dim_v=draw(st.sampled_from([8, 16, 24])),
        num_padding=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)),
    )
    return seqs, params


@settings(max_examples=40, deadline=None)
@given(ragged_batches())
def test_random_ragged_batches_match_dense(case: tuple[list[Seq], dict]) -> None:
    seqs, params = case
    out, ref, rows = run_case(seqs, **params)
    torch.testing.assert_close(out[:rows].double(), ref, atol=1e-5, rtol=1e-5)
    assert (out[rows:] == 0).all()
