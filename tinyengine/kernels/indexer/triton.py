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
2. `_select_kernel`, one program per row, picks the top k of those keys:
   a radix select on the 32-bit score field (8 bits a pass from the top,
   tl.histogram over the keys still in the running; it stops as soon as the
   group at the k-th place is needed whole), then one scan that compacts the
   keys above that group and the group's first `need` in id order, and a
   bitonic sort of the k picks. Packed keys are distinct and order by (score
   descending, id ascending), so the picks are the reference's stable choice,
   ties to the lower id, exactly what torch.topk on the keys gives (which
   costs more: ~100 us for one 16k-entry row on an H200, where this takes
   ~50). Ids come out as reference.unpack_picks makes them (-1 for -inf).

Why this shape. At V4-Flash's 64 heads and Di 128 in bf16 the product is
~64 FLOP per key byte, under the H200's ~200 FLOP/B ridge: the scoring is
bound by reading the keys, so the kernel reads each key once, for all heads,
and reloads only the small query per program. Chunks of several tiles per
program amortize that reload and let the loop pipeline its gathers
(num_stages; cp.async needs the cache strides divisible by 16, which Triton
learns from the launch); the chunk count per row comes from host ints only
(rows, entries, SM count) so the grid is fixed for a CUDA graph. On an H200
(benchmarks/bench_v4_indexer.py) the scoring reads keys at ~76% of the
measured read bandwidth at 64 rows of 64k context. The select is latency
bound: one program scans its row up to 5 times, ~50 us at 16k entries
whatever the batch: two thirds of the scoring's time at 64 rows of 64k
context, most of the op at one row.

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
from tinyengine.kernels.indexer.reference import NEG_INF_HI, unpack_picks
from tinyengine.kernels.launch import dot_precision, interpreting, num_sms
from tinyengine.kernels.sparse_attention.rows import query_rows, rows_per_block, scratch

_NEG_INF_HI = tl.constexpr(NEG_INF_HI)

# Tiles, from benchmarks/bench_v4_indexer.py --sweep on an H200 (V4-Flash,
# B=1 and 64 at 64k context). Scoring: 64 entries, one warpgroup, two stages.
_BLOCK_E = 64  # entries per tile: the M of the K Q^T product
_NUM_WARPS = 4
_NUM_STAGES = 2
_MAX_TILES_PER_PROGRAM = 16  # caps the query reload saving, keeps enough programs
_PROGRAMS_PER_SM = 8  # aim: this many programs per SM, so the last wave is short
# Select: 4096 keys a step (fewer steps of a latency-bound scan), 8 warps.
_SELECT_BLOCK = 4096
_SELECT_WARPS = 8
_DIGIT = 8  # bits of the score resolved per radix pass
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


@device_fn
def _score_order(key):
    """The score field of packed keys as an int64 in [0, 2^32), same order
    (the signed high half + 2^31, written so that no constant is a uint32)."""
    return ((key >> 32) + 2147483647) + 1


@triton.jit(do_not_specialize=["num_entries", "k"])
def _select_kernel(
    keys_ptr, chosen_ptr, out_ptr, num_entries, k, stride_kt, stride_ct, stride_ot,
    TOPK: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr, DIGIT: tl.constexpr,
):  # fmt: skip
    """Grid (rows,): out[row, :TOPK] <- ids of the k largest of the row's
    num_entries keys, largest first, -1 for -inf scores and past k.

    Radix select on the 32-bit score field u, DIGIT bits a pass from the top:
    a histogram of the next digit over the keys whose higher digits match
    the prefix found so far, then the bin where the count from the top
    reaches `need`. It stops once every key of the prefix's group is needed
    or all 32 bits are resolved (the group is then one score). Keys above the
    group are in; of the group the `need` lowest ids, i.e. the first met in
    id order (the packed order of equal scores). They are compacted into
    chosen[row] and sorted (bitonic, in registers)."""
    row = tl.program_id(0)
    row_keys = keys_ptr + row.to(tl.int64) * stride_kt
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << DIGIT)
    zero = row * 0
    prefix = zero.to(tl.int64)
    shift = zero.to(tl.int64) + 32
    need = zero + k
    group = zero + num_entries
    while (shift > 0) & (need < group):
        shift -= DIGIT
        hist = tl.zeros([1 << DIGIT], tl.int32)
        for e0 in range(0, num_entries, BLOCK):
            e = e0 + offs
            u = _score_order(tl.load(row_keys + e, mask=e < num_entries, other=0))
            digit = ((u >> shift) & ((1 << DIGIT) - 1)).to(tl.int32)
            inside = (e < num_entries) & ((u >> (shift + DIGIT)) == prefix)
            hist += tl.histogram(digit, 1 << DIGIT, mask=inside)
        above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # keys in higher bins
        hit = (above < need) & (above + hist >= need)  # exactly one bin
        b = tl.max(tl.where(hit, bins, -1), 0)
        need -= tl.sum(tl.where(bins == b, above, 0), 0)
        group = tl.sum(tl.where(bins == b, hist, 0), 0)
        prefix = (prefix << DIGIT) + b
    taken = zero
    ties = zero
    chosen_row = chosen_ptr + row.to(tl.int64) * stride_ct
    for e0 in range(0, num_entries, BLOCK):
        e = e0 + offs
        valid = e < num_entries
        key = tl.load(row_keys + e, mask=valid, other=0)
        level = _score_order(key) >> shift
        tie = (valid & (level == prefix)).to(tl.int32)
        rank = ties + tl.cumsum(tie, 0) - tie  # among the group, in id order
        sel = (valid & ((level > prefix) | ((tie > 0) & (rank < need)))).to(tl.int32)
        tl.store(chosen_row + taken + tl.cumsum(sel, 0) - sel, key, mask=sel > 0)
        taken += tl.sum(sel, 0)
        ties += tl.sum(tie, 0)
    tl.debug_barrier()  # the compacted keys, stored by all threads, are read back
    kk = tl.arange(0, K_POW2)
    best = tl.sort(tl.load(chosen_row + kk, mask=kk < k, other=-9223372036854775808),
                   descending=True)  # fmt: skip
    low = best - ((best >> 32) << 32)
    ids = 4294967296 - (low + 1)
    ids = tl.where(((best >> 32) == _NEG_INF_HI) | (kk >= k), -1, ids)
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + kk, ids, mask=kk < TOPK)


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
    row_bytes = 8 * (num_entries + triton.next_power_of_2(topk))
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
    specs = (((q.shape[0], num_entries), torch.int64),
             ((q.shape[0], triton.next_power_of_2(topk)), torch.int64))  # fmt: skip
    # One request: a later get would reuse the keys' bytes.
    keys, chosen = scratch(workspace, specs, q.device, eager)
    score_entries(
        q, weights, key_cache, seq_lens, tables, ratio=ratio, scale=scale,
        block_size=block_size, num_entries=num_entries, seqs=seqs, out=keys, **overrides,
    )  # fmt: skip
    if select == "torch":
        k = min(topk, num_entries)
        picks = unpack_picks(torch.topk(keys, k, dim=1).values)
        picks = F.pad(picks, (0, topk - k), value=-1) if k < topk else picks
        return picks if out is None else out.copy_(picks)
    return select_topk(keys, topk, chosen, out=out)


def select_topk(
    keys: torch.Tensor,
    topk: int,
    chosen: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """int64 [n, topk] entry ids of the min(topk, E) largest packed keys
    [n, E >= 1] per row, largest first, -1 for -inf scores and past E: what
    unpack_picks(torch.topk(keys, ...).values) gives; into `out` (rows of
    contiguous ids) when given. chosen: int64 scratch
    [n, >= next_power_of_2(topk)]."""
    n, num_entries = keys.shape
    if out is None:
        out = torch.empty(n, topk, dtype=torch.int64, device=keys.device)
    elif out.shape != (n, topk) or out.stride(1) != 1:
        raise ValueError(f"indexer: out {tuple(out.shape)} must be [{n}, {topk}], rows contiguous")
    if n:
        _select_kernel[(n,)](
            keys, chosen, out, num_entries, min(topk, num_entries),
            keys.stride(0), chosen.stride(0), out.stride(0),
            TOPK=topk, K_POW2=triton.next_power_of_2(topk), BLOCK=block or _SELECT_BLOCK,
            DIGIT=_DIGIT, num_warps=num_warps or _SELECT_WARPS,
        )  # fmt: skip
    return out


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
