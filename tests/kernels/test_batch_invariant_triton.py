"""The batch-invariant Triton ops (tinyengine/kernels/batch_invariant_triton.py)
on the GPU: a row's bits (==, not close) do not depend on how many rows share
the call, across the skinny/GEMM switch at 8 rows, for the plain and the
SiLU-fused linear; attention gives a token the same bits in a whole prompt,
in any chunk of it after a cached prefix, as a decode row, and beside other
sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.attention_batch import Batch
from tinyengine.kernels import batch_invariant_triton as bi

pytestmark = pytest.mark.gpu

ROWS = (1, 2, 7, 8, 9, 33, 64, 65, 300)


def _weights(n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, k, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).cuda()
    b = torch.randn(n, generator=g).to(torch.bfloat16).cuda() if bias else None
    return x, w, b


@pytest.mark.parametrize(("n", "k", "bias"), [(1024, 4096, False), (200, 1000, True)])
def test_linear_rows_are_the_same_in_any_call(n, k, bias):
    x, w, b = _weights(n, k, bias)
    full = bi.linear(x, w, b)
    torch.testing.assert_close(full.float(), F.linear(x, w, b).float(), rtol=2**-6, atol=2**-6)
    for m in ROWS:
        assert torch.equal(bi.linear(x[:m], w, b), full[:m]), m
        assert torch.equal(bi.linear(x[m - 1 : m + 4], w, b), full[m - 1 : m + 4]), m
    assert torch.equal(bi.linear(x.view(3, 100, k), w, b).view(300, n), full)


def test_linear_silu_mul_rows_are_the_same_in_any_call():
    x, w, b = _weights(2 * 704, 512, bias=False, seed=1)
    full = bi.linear_silu_mul(x, w, b)
    gate, up = F.linear(x, w).float().chunk(2, dim=-1)
    torch.testing.assert_close(full.float(), F.silu(gate) * up, rtol=2**-5, atol=2**-5)
    for m in ROWS:  # M == 1 runs the fused skinny launch, the rest linear then the activation
        assert torch.equal(bi.linear_silu_mul(x[m - 1 : m], w, b), full[m - 1 : m]), m
        assert torch.equal(bi.linear_silu_mul(x[:m], w, b), full[:m]), m


def _attend(q, tables, q_lens, seq_lens, cache) -> torch.Tensor:
    starts = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
    return bi.paged_attention(
        q, cache.k_cache, cache.v_cache, tables, starts,
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), cache.scale,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )  # fmt: skip


@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 128), (14, 2, 64), (8, 8, 64)])
def test_attention_gives_a_token_the_same_bits_in_any_step(hq, hkv, d):
    # A 300-token prompt (sequence 1) beside three others, in one paged cache.
    batch = Batch([5, 300, 1, 40], [70, 300, 9, 200], num_q_heads=hq, num_kv_heads=hkv,
                  head_dim_k=d, head_dim_v=d, block_size=16, dtype=torch.bfloat16,
                  device="cuda", seed=3)  # fmt: skip
    q, tables = batch.q, batch.block_tables
    together = _attend(q, tables, batch.q_lens, batch.seq_lens, batch)
    prompt = q[5:305]
    whole = _attend(prompt, tables[1:2], [300], [300], batch)
    assert torch.equal(together[5:305], whole)
    # Its last 263 tokens as a chunk after a cached prefix of 37.
    assert torch.equal(_attend(prompt[37:], tables[1:2], [263], [300], batch), whole[37:])
    # Its last token as a decode row, alone and beside the others.
    assert torch.equal(_attend(prompt[-1:], tables[1:2], [1], [300], batch), whole[-1:])
    beside = torch.cat([q[:5], prompt[-1:], q[305:]])
    got = _attend(beside, tables, [5, 1, 1, 40], batch.seq_lens, batch)
    assert torch.equal(got[5:6], whole[-1:])
