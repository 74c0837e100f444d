"""Triton lightning indexer (DeepSeek-V4 CSA layers): the op `indexer_topk`,
whose meaning (and layout) is kernels/indexer/reference.py's, the torch
reference; same signature, so models never know which runs.

Every query row goes through the kernels, decode rows and the tokens of
longer chunks (prefill, mixed batches) alike: a chunk's token at position p
picks exactly as a decode row of length p + 1 of its sequence would
(kernels/sparse_attention/rows.py, the row model), so no step loops over
sequences on the host; reference.choose_longer stays the definition of
those tokens' picks. Two steps per row (one query at p = seq_len - 1,
visible entries w < seq_len // ratio):

1. `_score_kernel` writes one int64 key per entry up to max_seq_len // ratio
   (the host's bound for every row of the step): the score packed with its
   entry id exactly as the reference's pack_scores does, -inf for entries the
   row cannot see. A program owns (row, a chunk of whole BLOCK_E-entry tiles).
   It loads the row's query heads [H, Di] and weights once, then per tile
   gathers the keys through the entry table (entry w lives in block
   table[(w + 1) * ratio - 1) // block_size], row ((w + 1) * ratio - 1) %
   block_size // ratio: rows of Di contiguous values, so each is one coalesced
   read; consecutive entries of a block are adjacent rows) and computes
   [BLOCK_E, H] = K Q^T on tensor cores, relu, the head weights, the sum over
   heads. Keys are the M side of the product so the head sum reduces inside
   a thread's fragment and a quad. Loads past the row's visible count are
   masked (nothing unreadable is touched), and tiles wholly past it are only
   filled with -inf keys.
2. kernels/indexer/select.py picks each row's top k of those keys (a tree
   of in-register radix selects, exact, ties to the lower id).

Why this shape. At V4-Flash's 64 heads and Di 128 in bf16 the product is
~64 FLOP per key byte, under the H200's ~200 FLOP/B ridge: the scoring is
bound by reading the keys, so the kernel reads each key once, for all heads,
and reloads only the small query per program. Chunks of several tiles per
program amortize that reload and let the loop pipeline its gathers
(num_stages; cp.async needs the cache strides divisible by 16, which Triton
learns from the launch); the chunk count per row comes from host ints only
(rows, entries, SM count) so the grid is fixed for a CUDA graph. On an H200
(benchmarks/bench_v4_indexer.py) the scoring reads keys at ~77% of the
measured read bandwidth at 64 rows of 64k context.

Graph safety: no host reads of device tensors; grid, chunking and buffer
sizes come from host ints (rows, max_seq_len); the key buffer comes from the
workspace arena when one is given. An eager step (never captured) runs
its attn.num_tokens rows in blocks whose keys fit a budget or the arena: a
prefill chunk's rows each take a key per entry of max_seq_len (8192 rows at
64k context: 1 GiB at once).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tinyengine.kernels.compressor.reference import entry_tables
from tinyengine.kernels.device_fn import device_fn
from tinyengine.kernels.indexer.reference import unpack_picks
from tinyengine.kernels.indexer.select import select_scratch, select_topk
from tinyengine.kernels.launch import dot_precision, interpreting, num_sms
from tinyengine.kernels.sparse_attention.rows import query_rows, rows_per_block, scratch

# Tiles, from benchmarks/bench_v4_indexer.py --sweep on an H200 (V4-Flash,
# B=1 and 64 at 64k context). Scoring: 64 entries, one warpgroup, two stages.
_BLOCK_E = 64  # entries per tile: the M of the K Q^T product
_NUM_WARPS = 4
_NUM_STAGES = 2
_MAX_TILES_PER_PROGRAM = 16  # caps the query reload saving, keeps enough programs
_PROGRAMS_PER_SM = 8  # aim: this many programs per SM, so the last wave is short
# An eager step's keys per row block at most (or what the arena holds, if
# more): 1024 rows at 64k context.
_KEYS_BUDGET = 128 << 20


@device_fn
def _pack_keys(score, entry):
    """int64 keys of fp32 scores and int32 entry ids: reference.pack_scores."""
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits)  # -0.0 ties with +0.0
    high = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    # 2^32 - 1 - id, written so that no constant is a uint32 literal.
    return (high.to(tl.int64) << 32) | (4294967296 - (entry.to(tl.int64) + 1))


@triton.jit(do_not_specialize=["num_entries", "chunk"])
def _score_kernel(
    q_ptr, w_ptr, key_ptr, table_ptr, seq_lens_ptr, seqs_ptr, out_ptr,
    scale, num_entries, chunk, num_heads,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_kr, stride_tb, stride_ot,
    RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_SEQS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (chunks, rows): out[row, e] for e in [chunk * c, chunk * (c + 1))
    clipped to num_entries; chunk is a multiple of BLOCK_E. Row `row` reads
    q, weights and out row `row` and block table row seqs[row] (HAS_SEQS)
    or `row`; it sees entries w < seq_lens[row] // RATIO (none at length <= 0)."""
    row = tl.program_id(1)
    start = tl.program_id(0) * chunk
    end = tl.minimum(start + chunk, num_entries)
    visible = tl.maximum(tl.load(seq_lens_ptr + row), 0) // RATIO
    seq = row.to(tl.int64)
    if HAS_SEQS:
        seq = tl.load(seqs_ptr + row).to(tl.int64)
    live_end = tl.minimum(end, visible)
    out_row = out_ptr + row.to(tl.int64) * stride_ot
    offs_e = tl.arange(0, BLOCK_E)
    if start < live_end:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_ok = offs_h < num_heads
        d_ok = offs_d < DIM
        q_rows = q_ptr + row.to(tl.int64) * stride_qt + offs_h * stride_qh
        q = tl.load(q_rows[:, None] + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_ptr + row.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        q_t = tl.trans(q)
        table_row = table_ptr + seq * stride_tb
        for e0 in range(start, live_end, BLOCK_E):
            entry = e0 + offs_e
            ok = entry < live_end
            last = (entry + 1) * RATIO - 1
            block = tl.load(table_row + last // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
            slot = key_ptr + block * stride_kb + ((last % BLOCK_SIZE) // RATIO) * stride_kr
            keys = tl.load(slot[:, None] + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                           other=0.0)  # fmt: skip
            if UPCAST:
                keys = keys.to(tl.float32)
            s = tl.dot(keys, q_t, input_precision=DOT_PRECISION)  # [BLOCK_E, BLOCK_H]
            score = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * scale
            score = tl.where(ok, score, float("-inf"))
            tl.store(out_row + entry, _pack_keys(score, entry), mask=entry < end)
    # The tiles the loop above did not reach hold no visible entry.
    first = start + tl.cdiv(tl.maximum(live_end - start, 0), BLOCK_E) * BLOCK_E
    hidden = tl.full([BLOCK_E], float("-inf"), tl.float32)
    for e0 in range(first, end, BLOCK_E):
        entry = e0 + offs_e
        tl.store(out_row + entry, _pack_keys(hidden, entry), mask=entry < end)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    attn: Any,
    *,
    ratio: int,
    topk: int,
    scale: float,
    block_size: int,
    workspace: Any = None,
) -> torch.Tensor:
    """Same contract as reference.indexer_topk: q [T, H, Di], weights [T, H]
    fp32, key_cache [num_blocks, rows, Di] -> int64 [T, topk], -1 where none."""
    rows = query_rows(attn)
    if rows.num_rows != q.shape[0]:
        raise ValueError(f"indexer: {rows.num_rows} query rows, q has {q.shape[0]}")
    num_entries = attn.max_seq_len // ratio
    if not num_entries or not rows.num_rows:  # no window complete in any row
        return torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    kwargs = dict(ratio=ratio, topk=topk, scale=scale, block_size=block_size,
                  num_entries=num_entries, workspace=workspace, eager=rows.eager)  # fmt: skip
    tables = entry_tables(attn)
    if not rows.eager:  # graph-shaped: one launch, whatever the rows
        return rows_topk(q, weights, key_cache, rows.seq_lens, tables, **kwargs)
    # An eager step's rows in blocks whose keys fit (the module docstring).
    row_bytes = sum(8 * shape[1] for shape, _ in _scratch_specs(1, num_entries, topk))
    step = rows_per_block(rows.num_rows, row_bytes, _KEYS_BUDGET, workspace)
    out = torch.empty(q.shape[0], topk, dtype=torch.long, device=q.device)
    for r0 in range(0, rows.num_rows, step):
        r1 = min(r0 + step, rows.num_rows)
        block = rows.block(r0, r1)
        rows_topk(q[r0:r1], weights[r0:r1], key_cache, block.seq_lens, tables, seqs=block.seqs,
                  out=out[r0:r1], **kwargs)  # fmt: skip
    return out


def rows_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    *,
    ratio: int,
    topk: int,
    scale: float,
    block_size: int,
    num_entries: int,
    seqs: torch.Tensor | None = None,
    workspace: Any = None,
    eager: bool = False,
    out: torch.Tensor | None = None,
    select: str = "radix",
    **overrides: int,
) -> torch.Tensor:
    """int64 [n, topk] picks of n query rows (row i: one query at
    seq_lens[i] - 1, entries through tables[seqs[i]], or tables[i] without
    seqs) among the first num_entries (>= 1) entries, into `out` when given.
    eager: the step is never captured (rows.scratch). select="torch":
    torch.topk on the keys instead of the radix-select kernel (benchmarks).
    `overrides` go to score_entries."""
    # One request: a later get would reuse the keys' bytes.
    specs = _scratch_specs(q.shape[0], num_entries, topk)
    keys, *select_buffers = scratch(workspace, specs, q.device, eager)
    score_entries(
        q, weights, key_cache, seq_lens, tables, ratio=ratio, scale=scale,
        block_size=block_size, num_entries=num_entries, seqs=seqs, out=keys, **overrides,
    )  # fmt: skip
    if select == "torch":
        k = min(topk, num_entries)
        picks = unpack_picks(torch.topk(keys, k, dim=1).values)
        picks = F.pad(picks, (0, topk - k), value=-1) if k < topk else picks
        return picks if out is None else out.copy_(picks)
    return select_topk(keys, topk, select_buffers, out=out)


def _scratch_specs(n: int, num_entries: int, topk: int) -> list:
    """(shape, dtype) of rows_topk's scratch: the keys, then the select's."""
    return [((n, num_entries), torch.int64), *select_scratch(n, num_entries, topk)]


def score_entries(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    *,
    ratio: int,
    scale: float,
    block_size: int,
    num_entries: int,
    seqs: torch.Tensor | None = None,
    workspace: Any = None,
    out: torch.Tensor | None = None,
    block_e: int | None = None,
    tiles_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """int64 [n, num_entries] packed keys (reference.pack_scores of the
    masked scores) of n query rows (row i's table row: seqs[i], or i without
    seqs), into `out` when given, else a view into
    `workspace` (valid until its next use) or a new tensor. block_e /
    tiles_per_program / num_warps / num_stages override the defaults (tests,
    benchmarks)."""
    n, num_heads, dim = q.shape
    if key_cache.shape[-1] != dim or weights.shape != (n, num_heads):
        raise ValueError(
            f"indexer: q {tuple(q.shape)}, weights {tuple(weights.shape)} and keys of width "
            f"{key_cache.shape[-1]} do not fit"
        )
    if q.stride(-1) != 1 or key_cache.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError("indexer: the last dim of q, weights and key_cache must be contiguous")
    if out is None and workspace is not None:
        (out,) = workspace.get(((n, num_entries), torch.int64))
    elif out is None:
        out = torch.empty(n, num_entries, dtype=torch.int64, device=q.device)
    if n == 0 or num_entries == 0:
        return out
    block_e = block_e or _BLOCK_E
    tiles = triton.cdiv(num_entries, block_e)
    if tiles_per_program is None:
        # As many tiles per program as keep _PROGRAMS_PER_SM programs per SM
        # busy (off the GPU, where programs run one by one, the most).
        programs = _PROGRAMS_PER_SM * num_sms(q.device, off_gpu=1)
        tiles_per_program = min(_MAX_TILES_PER_PROGRAM, triton.cdiv(n * tiles, programs))
    chunk = min(tiles, tiles_per_program) * block_e
    same = q.dtype == key_cache.dtype
    upcast = interpreting() or not same
    _score_kernel[(triton.cdiv(num_entries, chunk), n)](
        q, weights, key_cache, tables, seq_lens, seq_lens if seqs is None else seqs, out,
        scale, num_entries, chunk, num_heads,
        q.stride(0), q.stride(1), weights.stride(0), key_cache.stride(0), key_cache.stride(1),
        tables.stride(0), out.stride(0),
        RATIO=ratio, BLOCK_SIZE=block_size, DIM=dim,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_E=block_e, HAS_SEQS=seqs is not None,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision(key_cache.dtype if same else torch.float32),
        num_warps=num_warps or _NUM_WARPS, num_stages=num_stages or _NUM_STAGES,
    )  # fmt: skip
    return out
