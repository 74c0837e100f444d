"""DeepSeek-V4's Triton kernels on the row model
(tinyengine/kernels/sparse_attention/rows.py): every query token of a step
(decode rows, chunks after a cached prefix, whole prompts, padding rows) is
a row of its own, of length p + 1, reading its sequence's table row.

Here: the per-row metadata itself, padding rows that see nothing whatever
their top-k rows hold, the launcher's own choices on prefill-only steps,
scratch against a locked arena (an eager step never grows it: its scratch
is allocated instead, the indexer's row blocks are cut to what it holds),
the indexer's row blocks and ties inside chunks, and on the GPU long chunks
at V4-Flash's shapes. The mixed-batch cases of each op are in
test_triton_sparse_attention.py and test_triton_indexer.py, whose batches
(poisoned caches, integer indexer inputs) these reuse.
"""

from __future__ import annotations

import pytest
import torch

import tinyengine.kernels.indexer.reference as iref
import tinyengine.kernels.indexer.triton as itri
from tests.kernels.test_triton_indexer import MIXED, dense_scores, make_batch
from tests.kernels.test_triton_sparse_attention import DEVICE, FLASH, V4Batch, decode_seqs
from tinyengine.kernels.sparse_attention.rows import query_rows, rows_per_block
from tinyengine.kernels.workspace import ALIGNMENT, Workspace, WorkspaceLockedError

# ----------------------------------------------------------------------------- sparse attention


def test_query_rows() -> None:
    # Sequence i's token j sits at seq_len_i - q_len_i + j: its row's length
    # is that + 1 and its sequence i; padding rows have length 0.
    b = V4Batch([(19, 1), (50, 4), (3, 3)], pad_rows=2)
    rows = query_rows(b.attn)
    assert rows.num_rows == 10 and rows.eager
    assert rows.seq_lens.tolist() == [19, 47, 48, 49, 50, 1, 2, 3, 0, 0]
    assert rows.seqs.tolist()[:8] == [0, 1, 1, 1, 1, 2, 2, 2]
    assert rows.block(2, 5).seq_lens.tolist() == [48, 49, 50]
    # One row per sequence: attn's own tensors, no copy, no indirection.
    for graph in (False, True):
        d = V4Batch(decode_seqs([5, 9]), graph=graph)
        rows = query_rows(d.attn)
        assert rows.seqs is None and rows.seq_lens is d.attn.seq_lens and rows.eager != graph


@pytest.mark.parametrize("csa", [False, True])
def test_prefill_rows_with_the_launchers_choices(csa: bool) -> None:
    # Prompts alone (no decode row, no padding), then one long chunk after a
    # cached prefix, with the launcher's own tiles and splits.
    for seqs in ([(37, 37), (9, 9)], [(70, 41)]):
        b = V4Batch(seqs, heads=20, block_size=8, window=12, ratio=4 if csa else 8,
                    topk=20 if csa else None, csa=csa, seed=len(seqs))  # fmt: skip
        b.check(b.run())


@pytest.mark.parametrize("splits", [1, 3])
def test_padding_rows_see_nothing(splits: int) -> None:
    # Padding rows of an eager step are 0 whatever their top-k rows hold
    # (here the complete entries of the last sequence, the table row a
    # padding row is given): a row of length 0 has no key.
    b = V4Batch([(30, 5), (17, 1)], block_size=8, window=8, ratio=4, topk=6, csa=True,
                pad_rows=2, seed=9)  # fmt: skip
    b.topk[b.pad_rows, :4] = torch.arange(4, device=b.topk.device)
    b.check(b.run(num_splits=splits, block_h=16, block_n=16))


def test_locked_workspace_sparse_attention() -> None:
    # A locked arena too small for a step's scratch: an eager step (never
    # captured) allocates its own and leaves the arena as it is; a
    # graph-shaped step raises, as a shape not warmed up before capture.
    eager = V4Batch([(40, 12), (17, 1)], heads=5, block_size=8, window=8, ratio=8, seed=4)
    graph = V4Batch(decode_seqs([6, 27, 40]), heads=5, block_size=8, window=8, ratio=8, seed=4,
                    graph=True)  # fmt: skip
    ws = Workspace(DEVICE)
    ws.lock()
    eager.check(eager.run(workspace=ws, num_splits=3, block_h=16, block_n=16))
    assert ws.size == 0
    with pytest.raises(WorkspaceLockedError):
        graph.run(workspace=ws, num_splits=3, block_h=16, block_n=16)


# ----------------------------------------------------------------------------- indexer


def test_score_entries_of_chunk_rows_match_dense_scores():
    # A chunk's tokens are rows of their own: lengths p + 1, the table row
    # of their sequence through `seqs`, q and out rows in step order.
    seqs = [(90, 2), (37, 12), (150, 1)]
    b = make_batch(seqs, block_size=8, seed=8)
    rows = query_rows(b.attn)
    lens = [s - n + j + 1 for s, n in seqs for j in range(n)]
    owners = [i for i, (_, n) in enumerate(seqs) for _ in range(n)]
    assert rows.seq_lens.tolist() == lens and rows.seqs.tolist() == owners
    keys = itri.score_entries(
        b.q, b.weights, b.cache, rows.seq_lens, b.table, seqs=rows.seqs, ratio=4, scale=0.25,
        block_size=8, num_entries=150 // 4, block_e=16, tiles_per_program=2,
    )  # fmt: skip
    dense = dense_scores(b, list(range(len(lens))), lens, 150 // 4, seqs=owners)
    assert torch.equal(keys.cpu(), iref.pack_scores(dense))


@pytest.mark.parametrize("budget_rows", [1, 7, 64])
def test_row_blocks(monkeypatch, budget_rows):
    """An eager step's rows in blocks whose keys fit the budget (here a few
    rows' worth): the picks are the same whatever the blocks."""
    b = make_batch(MIXED, topk=10, block_size=8, pad_rows=2, seed=6)
    expected = b.run(iref.indexer_topk)
    row_bytes = 8 * (150 // 4 + 16)
    monkeypatch.setattr(itri, "_KEYS_BUDGET", budget_rows * row_bytes + 4 * ALIGNMENT)
    launches = []
    real = itri.score_entries

    def counted(q, *args, **kwargs):
        launches.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(itri, "score_entries", counted)
    assert torch.equal(b.run(), expected)
    assert max(launches) == min(budget_rows, b.attn.num_tokens)
    assert sum(launches) == b.attn.num_tokens == 69


def test_locked_workspace_holds_the_row_blocks():
    """A locked arena (captured graphs hold its address) is never grown: an
    eager step's row blocks are cut to what it holds."""
    b = make_batch(MIXED, topk=10, block_size=8, seed=7)
    ws = Workspace(DEVICE)
    row_bytes = 8 * (150 // 4 + 16)
    ws.get(((20 * row_bytes + 4 * ALIGNMENT,), torch.uint8))  # 1 MiB: ~2400 rows
    ws.lock()
    size = ws.size

    def fit(nbytes: int) -> int:  # whole multiples of 16 rows, with alignment slack
        return (nbytes - 4 * ALIGNMENT) // row_bytes // 16 * 16

    assert rows_per_block(10**6, row_bytes, 0, ws) == fit(size)
    assert rows_per_block(10**6, row_bytes, 2 * size, ws) == fit(size)
    assert torch.equal(b.run(workspace=ws), b.run(iref.indexer_topk))
    assert ws.size == size and ws.stats.num_growths == 1
    ws.unlock()  # unlocked: the budget or the arena, whichever holds more
    assert rows_per_block(10**6, row_bytes, 2 * size, ws) == fit(2 * size)
    assert rows_per_block(10**6, row_bytes, 0, ws) == fit(size)
    assert rows_per_block(5, row_bytes, 0, ws) == 5
    assert rows_per_block(10**6, row_bytes, 7 * row_bytes + 4 * ALIGNMENT, None) == 7


def test_ties_in_chunks_go_to_the_lower_entry_id():
    """The same for the tokens of longer chunks: the token at p picks the
    first min(16, (p + 1) // 4) ids."""
    seqs = [(150, 1), (30, 12), (9, 9), (77, 5)]
    positions = [s - n + j for s, n in seqs for j in range(n)]
    expected = [[w if w < (p + 1) // 4 else -1 for w in range(16)] for p in positions]
    for case in (dict(zero_q=True), dict(same_keys=True)):
        b = make_batch(seqs, topk=16, **case)
        out = b.run()
        assert out.tolist() == expected, case
        assert torch.equal(out, b.run(iref.indexer_topk))


# ----------------------------------------------------------------------------- GPU: V4-Flash


@pytest.mark.gpu
@pytest.mark.parametrize("csa", [False, True])
def test_gpu_prefill_chunks(csa: bool) -> None:
    # Long chunks (one after a 4500-token cached prefix, a whole 2048-token
    # prompt) next to decode rows: thousands of rows in one launch.
    seqs = [(6000, 1500), (300, 1), (2048, 2048), (129, 1)]
    b = V4Batch(seqs, ratio=4 if csa else 128, topk=512 if csa else None, csa=csa, **FLASH,
                seed=6)  # fmt: skip
    b.check(b.run(workspace=Workspace(DEVICE)))


@pytest.mark.gpu
def test_v4_flash_prefill_chunks_exact_on_integers(monkeypatch):
    """A chunk after a long cached prefix, a whole prompt and decode rows, at
    once and in row blocks (a budget cut to about 300 rows: 288, a multiple of 16)."""
    seqs = [(20000, 1200), (4096, 1), (3000, 3000), (65536, 1)]
    b = make_batch(seqs, heads=64, dim=128, block_size=64, topk=512, dtype=torch.bfloat16,
                   seed=5)  # fmt: skip
    expected = b.run(iref.indexer_topk)
    assert torch.equal(b.run(workspace=Workspace(DEVICE)), expected)
    row_bytes = 8 * (65536 // 4 + 512)
    monkeypatch.setattr(itri, "_KEYS_BUDGET", 300 * row_bytes + 4 * ALIGNMENT)
    assert torch.equal(b.run(), expected)
