"""Triton split-KV decode attention (tinyengine/kernels/attention/triton.py:
decode_attention, decode_num_splits) vs the naive dense reference of
attention_batch.py, on CPU through the Triton interpreter (see
test_triton_attention.py for why the shapes stay tiny)."""

from __future__ import annotations

import pytest
import torch

import tinyengine.kernels.attention.triton as ta
from tests.kernels.attention_batch import Batch, assert_close, check_against_torch_reference
from tinyengine.kernels.workspace import Workspace

# ----------------------------------------------------------------------------- split-KV decode


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_splits_match_reference(num_splits: int, dtype: torch.dtype) -> None:
    # Lengths straddle block and tile edges; 8 splits is more than the short
    # sequences need, so some programs find their split past the end.
    seq_lens = [1, 17, 70]
    b = Batch([1, 1, 1], seq_lens, num_q_heads=8, num_kv_heads=2, head_dim_k=32, head_dim_v=32,
              block_size=8, dtype=dtype, pad_rows=1)  # fmt: skip
    ws = Workspace("cpu")
    out = b.empty_out()
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=70,
                        workspace=ws, num_splits=num_splits, block_n=16)  # fmt: skip
    assert_close(out[:3], b.dense_reference()[:3], dtype)
    if num_splits > 1:
        assert ws.size >= 3 * 8 * num_splits * 32 * 4  # partials came from the arena


def test_decode_without_workspace_and_public_op() -> None:
    b = Batch([1, 1], [33, 64], num_q_heads=4, num_kv_heads=1, head_dim_k=64, head_dim_v=64,
              block_size=16, dtype=torch.float16, pad_rows=2)  # fmt: skip
    out = b.empty_out()
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=64,
                        num_splits=4, block_n=16)  # fmt: skip
    assert_close(out[:2], b.dense_reference()[:2], torch.float16)
    full = b.run(workspace=Workspace("cpu"))  # heuristic S, padding rows zeroed
    assert_close(full, b.dense_reference(), torch.float16)
    check_against_torch_reference(b, full)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_writes_every_row_of_one_token_sequences(num_splits: int) -> None:
    # paged_attention leaves its output uninitialized for a batch of T
    # one-token sequences (a decode graph pads with one-token sequences of
    # length 1): the kernels must write every row, padding rows included.
    b = Batch([1, 1, 1, 1], [9, 30, 1, 1], num_q_heads=4, num_kv_heads=2, head_dim_k=32,
              head_dim_v=32, block_size=8, dtype=torch.float32)  # fmt: skip
    out = torch.full_like(b.empty_out(), float("nan"))
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=30,
                        num_splits=num_splits, block_n=16)  # fmt: skip
    assert not out.isnan().any()
    assert_close(out, b.dense_reference(), torch.float32)
    assert ta.paged_output(b.q, b.v_cache, None, every_row_written=False).eq(0).all()


def test_decode_dk_differs_from_dv() -> None:
    b = Batch([1, 1], [40, 9], num_q_heads=2, num_kv_heads=2, head_dim_k=192, head_dim_v=128,
              block_size=8, dtype=torch.float16)  # fmt: skip
    out = b.empty_out()
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=40,
                        num_splits=3, block_n=16)  # fmt: skip
    assert_close(out, b.dense_reference(), torch.float16)


def test_decode_empty_and_zero_length_sequences() -> None:
    # A padded graph batch may carry sequences with q_len 0 or seq_len 0.
    b = Batch([1, 0, 1], [12, 5, 20], num_q_heads=2, num_kv_heads=1, head_dim_k=32,
              head_dim_v=32, block_size=8, dtype=torch.float32)  # fmt: skip
    for s in (1, 4):
        out = b.empty_out()
        ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=20,
                            num_splits=s, block_n=16)  # fmt: skip
        assert_close(out, b.dense_reference(), torch.float32)
    b.seq_lens_t[0] = 0  # an empty context attends to nothing: zeros, never NaN
    out = b.empty_out()
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=20,
                        num_splits=2, block_n=16)  # fmt: skip
    assert (out[0] == 0).all()


def test_decode_num_splits_heuristic() -> None:
    # Big batches fill the GPU alone; small ones split, bounded by the length.
    assert ta.decode_num_splits(64, 8, 4096, 132) == 1
    assert ta.decode_num_splits(256, 8, 32768, 132) == 1
    s = ta.decode_num_splits(1, 8, 4096, 132)
    assert 1 < s <= 4096 // 32
    assert ta.decode_num_splits(1, 8, 20, 132) == 1  # no split shorter than 32 tokens
    assert ta.decode_num_splits(1, 8, 512, 132) == 16
    assert ta.decode_num_splits(4, 8, 1 << 20, 132) <= 64


@pytest.mark.parametrize("num_warps", [1, 2])  # 1: the first tile's K before the wait
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_reads_the_newest_row_only_after_the_pdl_wait(
    num_splits: int, num_warps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under PDL the split kernel starts while the RoPE + cache write kernel
    # still writes the query's K/V row (position seq_len - 1); the split
    # kernel reads its first tile of older rows before its wait. Simulated
    # here: the queries and the newest rows are NaN until gdc_wait, which
    # writes them (the kernel before "finishes" there). A read of them before
    # the wait shows up as NaN in the output.
    import tinyengine.kernels.attention.kernels as kernels

    b = Batch([1, 1, 1], [1, 9, 40], num_q_heads=4, num_kv_heads=2, head_dim_k=32,
              head_dim_v=32, block_size=8, dtype=torch.float32)  # fmt: skip
    newest = []
    for i, s in enumerate(b.seq_lens):
        blk, off = int(b.block_tables[i, (s - 1) // 8]), (s - 1) % 8
        newest.append((blk, off, b.k_cache[blk, off].clone(), b.v_cache[blk, off].clone()))
        b.k_cache[blk, off] = float("nan")
        b.v_cache[blk, off] = float("nan")
    q = b.q.clone()
    b.q.fill_(float("nan"))
    waits = []

    def wait() -> None:  # the kernel before completes: its rows are written
        waits.append(1)
        b.q.copy_(q)
        for blk, off, k, v in newest:
            b.k_cache[blk, off] = k
            b.v_cache[blk, off] = v

    monkeypatch.setattr(kernels, "gdc_wait", wait)
    monkeypatch.setattr(kernels, "gdc_launch_dependents", lambda: None)
    monkeypatch.setattr(ta, "pdl_kwargs", lambda device: {"USE_PDL": True})
    out = b.empty_out()
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=40,
                        num_splits=num_splits, block_n=16, num_warps=num_warps)  # fmt: skip
    assert waits, "the kernel never waited"
    assert_close(out, b.dense_reference(), torch.float32)
