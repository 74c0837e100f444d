"""DeepSeek-V4's ops in the batch-invariant Triton set
(tinyengine/kernels/batch_invariant_v4_triton.py): a query row's bits (==,
not close) are the same in any step, a chunk's token or a decode row, alone
or beside other sequences. Each step's rows are compared with the same rows
run one at a time as one-row decode steps (kernels/batch_invariant_v4.py's
decode_rows). Where the Triton set's own form can differ (sparse attention's
split count, the compressor's chunk path), the test shows it does, so the
comparison can fail. CPU runs go through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

import tinyengine.kernels.compressor.triton as compressor
import tinyengine.kernels.indexer.triton as indexer
import tinyengine.kernels.sparse_attention.triton as sparse
from tests.kernels.test_triton_compressor import make_case
from tests.kernels.test_triton_indexer import make_batch
from tests.kernels.test_triton_sparse_attention import V4Batch
from tinyengine.kernels import batch_invariant_v4_triton as biv4
from tinyengine.kernels.batch_invariant_v4 import decode_rows
from tinyengine.kernels.compressor.reference import entry_tables, write_rows

# A chunk after a cached prefix, decode rows, a whole prompt, longer chunks.
STEP = [(70, 1), (61, 30), (23, 1), (40, 40), (97, 1), (88, 5)]


@pytest.mark.parametrize(("ratio", "csa"), [(4, True), (8, False), (0, False)])
def test_sparse_attention_rows_are_the_same_alone(ratio, csa):
    # A 40-row window: most rows have two or more 32-key tiles (fp32), so the
    # Triton set's launch splits them.
    b = V4Batch(STEP, heads=8, block_size=8, window=40, ratio=ratio, topk=24 if csa else None,
                csa=csa, seed=ratio)  # fmt: skip
    kw = b.kwargs()
    picks = kw.pop("topk_indices")
    step = biv4.sparse_attention(b.q, b.kv_cache, b.attn, topk_indices=picks, **kw)
    b.check(step)
    alone = torch.zeros_like(step)
    for r, one in decode_rows(b.attn):
        row_picks = None if picks is None else picks[r : r + 1]
        alone[r : r + 1] = biv4.sparse_attention(b.q[r : r + 1], b.kv_cache, one,
                                                 topk_indices=row_picks, **kw)  # fmt: skip
    assert torch.equal(step, alone)
    split = sparse.sparse_attention(b.q, b.kv_cache, b.attn, topk_indices=picks, **kw)
    assert not torch.equal(split, step), "the Triton set's split count changed no bit"


def test_compressor_closes_a_chunks_windows_as_decode_rows_do():
    case = make_case([(24, 24), (13, 1), (40, 9), (16, 1)], seed=5)
    state, entries = case.run(biv4.write_and_compress, fused=True)
    want_state, want = case.state.clone(), case.entries.clone()
    write_rows(want_state, torch.cat([case.kv, case.gate], dim=-1), case.attn.slot_mapping)
    closed = 0
    for _, one in decode_rows(case.attn):
        closed += int(one.max_seq_len % case.kwargs["ratio"] == 0)
        compressor.compress_decode(want_state, want, one.seq_lens, one.block_tables,
                                   entry_tables(one), **case.kwargs)  # fmt: skip
    assert closed == 6 + 3 + 1  # windows closed by the two chunks and a decode row
    torch.testing.assert_close(state, want_state, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(entries, want)
    # The Triton set closes a chunk's windows with the torch reference's loop.
    assert not torch.equal(case.run(compressor.write_and_compress, fused=True)[1], want)


def test_indexer_picks_are_the_same_alone():
    b = make_batch(STEP, heads=8, dim=32, topk=6, integer=False, seed=2)
    step = b.run()  # the Triton set's indexer, which the invariant set keeps
    alone = torch.full_like(step, -1)
    for r, one in decode_rows(b.attn):
        alone[r : r + 1] = indexer.indexer_topk(b.q[r : r + 1], b.weights[r : r + 1], b.cache,
                                                one, **b.kwargs)  # fmt: skip
    assert (step >= 0).any()
    assert torch.equal(step, alone)
