"""DeepSeek-V4's ops in the batch-invariant op set (kernels/batch_invariant.py
says what the mode promises and how): sparse attention, the indexer's
top-k, the compressor and the hyper-connection ops.

The V4 references already have a path whose shapes depend on one row only:
their decode path, which takes a one-token sequence at its length with its
block table rows and gathers a fixed number of keys (the window, the
top-k picks, the entries its length makes visible). So each query row of a
step, a decode row or a token of a prefill chunk alike, goes through that
path alone: a token at position p is the decode row of length p + 1 of its
sequence (kernels/sparse_attention/rows.py, the row model), with the
step's max_seq_len replaced by its own length, so that no shape depends on
what else the step holds. The hyper-connection ops are per token: rows 8 at
a time, as the other row-wise ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from tinyengine.kernels.batch_invariant import by_row_blocks
from tinyengine.kernels.compressor import reference as compressor
from tinyengine.kernels.indexer import reference as indexer
from tinyengine.kernels.mhc import reference as mhc
from tinyengine.kernels.sparse_attention import reference as sparse
from tinyengine.kernels.sparse_attention.rows import query_rows


def decode_rows(attn: Any) -> Iterator[tuple[int, Any]]:
    """(row, the metadata of that row alone as a decode row) for every query
    row of the step that is not padding."""
    rows = query_rows(attn)
    lens = rows.seq_lens.tolist()
    seqs = range(rows.num_rows) if rows.seqs is None else rows.seqs.tolist()
    entries = attn.entry_block_tables
    device = attn.seq_lens.device
    for r, (seq_len, seq) in enumerate(zip(lens, seqs, strict=True)):
        if seq_len <= 0:
            continue
        yield r, dataclasses.replace(
            attn, num_tokens=1, num_seqs=1, max_query_len=1, max_seq_len=seq_len,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_tables=attn.block_tables[seq : seq + 1],
            slot_mapping=attn.slot_mapping[r : r + 1],
            query_start_loc_cpu=None, seq_lens_cpu=None,
            entry_block_tables=None if entries is None else entries[seq : seq + 1],
        )  # fmt: skip


def sparse_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, attn: Any, *, window: int, sinks: torch.Tensor,
    scale: float, entry_cache: torch.Tensor | None = None, ratio: int = 0,
    topk_indices: torch.Tensor | None = None, workspace: Any = None,
) -> torch.Tensor:  # fmt: skip
    """reference.sparse_attention, each row alone through its decode path."""
    out = torch.zeros_like(q)
    for r, one in decode_rows(attn):
        picks = None if topk_indices is None else topk_indices[r : r + 1]
        out[r : r + 1] = sparse.sparse_attention(
            q[r : r + 1], kv_cache, one, window=window, sinks=sinks, scale=scale,
            entry_cache=entry_cache, ratio=ratio, topk_indices=picks,
        )  # fmt: skip
    return out


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, attn: Any, *, ratio: int,
    topk: int, scale: float, block_size: int, workspace: Any = None,
) -> torch.Tensor:  # fmt: skip
    """reference.indexer_topk, each row alone through its decode path."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    for r, one in decode_rows(attn):
        out[r : r + 1] = indexer.indexer_topk(
            q[r : r + 1], weights[r : r + 1], key_cache, one, ratio=ratio, topk=topk,
            scale=scale, block_size=block_size,
        )  # fmt: skip
    return out


def write_and_compress(
    state_cache: torch.Tensor, entry_cache: torch.Tensor, kv: torch.Tensor,
    gate: torch.Tensor, attn: Any, **kw: Any,
) -> None:  # fmt: skip
    """reference.write_and_compress: the step's state rows first, then the
    window each row's token completes (its length a multiple of the ratio)
    alone through the decode path."""
    compressor.write_rows(state_cache, torch.cat([kv, gate], dim=-1), attn.slot_mapping)
    for _, one in decode_rows(attn):
        if one.max_seq_len % kw["ratio"] == 0:
            compressor.compress_windows(state_cache, entry_cache, one, **kw)


def mhc_pre(streams: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor,
            scale: torch.Tensor, **kw: Any) -> Any:  # fmt: skip
    return by_row_blocks(lambda s, m: mhc.mhc_pre(s, m, base, scale, **kw), streams, mixes)


def mhc_head(streams: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor,
             scale: torch.Tensor, **kw: Any) -> Any:  # fmt: skip
    return by_row_blocks(lambda s, m: mhc.mhc_head(s, m, base, scale, **kw), streams, mixes)


def mhc_post(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return by_row_blocks(mhc.mhc_post, streams, post, comb, out)


def with_v4_ops(ops: Any) -> Any:
    """The batch-invariant set `ops` with DeepSeek-V4's ops made invariant too."""
    return dataclasses.replace(
        ops, sparse_attention=sparse_attention, indexer_topk=indexer_topk,
        write_and_compress=write_and_compress, mhc_pre=mhc_pre, mhc_head=mhc_head,
        mhc_post=mhc_post,
    )  # fmt: skip
