"""Triton DeepSeek-V4 sparse attention: the launcher `sparse_attention`,
its tile and split choice, and how its kernels
(kernels/sparse_attention/split.py) work.

Owns the GPU implementation of `sparse_attention`, whose numerical
definition lives in kernels/sparse_attention/reference.py; the signature is
the same. Every query row goes through the kernels, decode rows and the
tokens of longer chunks (prefill, mixed batches) alike, in one launch: a
chunk's token at position p sees exactly what a decode row of length p + 1
of its sequence sees (kernels/sparse_attention/rows.py, the row model), so
one kernel serves both and no step loops over sequences on the host. The
reference's per-sequence path (reference.attend_longer) stays the
definition of what those tokens compute.

Must never, on a graph-shaped decode step (each one breaks CUDA-graph
capture or replay): read a device tensor on the host; size a grid or pick a
kernel from tensor contents (only host ints: rows, H, D, window, top-k
width, attn.max_seq_len, the SM count); allocate scratch outside the
workspace arena when one is given. An eager step (host lengths; never
captured) sizes its grid from attn.num_tokens and builds its per-row
lengths and sequences on the device; its scratch leaves a locked arena it
would outgrow (rows.scratch says why).

What a row attends. At p = seq_len - 1 (seq_len: the decode row's, or a
chunk token's p + 1): the raw rows of positions max(0, p - window + 1) .. p,
each through its sequence's token block table
(kv_cache[table[pos // bs], pos % bs]), then compressed entries through the
entry table (entry w in block table[last // bs], row (last % bs) // ratio,
last = (w + 1) * ratio - 1): every complete one, w < (p + 1) // ratio (HCA),
or the indexer's picks, topk_indices[row] with -1 = none (CSA). Keys =
values: one row of D per key, shared by all H heads (MQA with group = H).
Nothing else is read: a position before the window, whose table entry may
point at the sliding group's null block, never has its block id loaded.

The kernel. That key list is one index space [window rows | entries]; one
program owns (row, BLOCK_H heads, split s) and walks whole BLOCK_N
tiles of its split's share, gathering each key's row through its own
pointer (window rows and entries in one loop, so one shared-memory ring
serves both: a second pipelined loop would claim another ring, and two
rings of [64, 512] bf16 tiles do not fit next to the query). A CSA row's
picks are first compacted (the -1s dropped) into the program's scratch, so
the live keys are always a prefix and masking is arithmetic. Per tile

    s   [BLOCK_H, BLOCK_N] = q [BLOCK_H, D] @ kv^T   (fp32, log2 units)
    acc [BLOCK_H, D]      += 2^(s - m) @ kv          (online softmax)

Why it is shaped this way (V4-Flash: H=64, D=512, one KV head). Every key
row feeds all 64 heads: 4 * 64 FLOP per cache byte at bf16, about the
H200's ridge, so the tile must feed the tensor cores as in MLA decode
(kernels/mla/triton.py): 64 heads per program (a Hopper warpgroup MMA's M),
an fp32 [64, 512] accumulator over 8 warps, 64-key tiles in 2 stages
(64 KB each) next to the 64 KB query. A row has few keys (window + top-k =
640 for CSA), so the rows are split: up to three quarters of the SMs' program
slots, never more splits than tiles, and no more than pay for the partials
they add (`num_splits_for`; B=1: a split per tile; B=48: 2; B=64: 1). Each
split writes a normalised fp32 [BLOCK_H, D] partial and its log2-sum-exp;
the reduce kernel (kernels/split_reduce.py) merges them with the sink, the
one logit without a value:

    out = sum_j 2^(s_j - M) v_j / (2^(sink - M) + sum_j 2^(s_j - M))

With one split the split kernel applies the sink and writes `out` itself.

Prefill. A chunk is many rows, so the split count falls to one (V4-Flash:
from 67 rows on). Each token gathers its own window, though its neighbours
share most of it: a chunk reads q_len x (window + k) key rows, as that many
decode rows do. A kernel that gave one program several queries of a
sequence would read each window row once; the row model keeps one kernel
for both instead, and the chunk's cost is linear in q_len.

Where it stands (H200, Triton 3.6, B=64, 640 keys a row: about 60 us, 90
TFLOP/s, 13% of a measured 677 TFLOP/s bf16 MMA peak; 4-7x the torch
reference). The loop is latency bound, not MMA or HBM bound: Triton issues
tile t + 1's gather (cp.async) only at the end of iteration t, after that
tile's block-id loads, and waits for it at the start of t + 1, so loads
hardly overlap the MMAs; one 196 KB, 255-register program per SM leaves no
other program to hide them, and the QK product runs on both warpgroups (as
in MLA decode). Smaller tiles (32 heads or 32 keys, 3 stages, two programs
per SM) measured no better. So on Hopper, for V4's own tile (64 heads,
D = 512, 16-bit), the split kernel is the warp-specialized Gluon one of
kernels/sparse_attention/gluon.py (1.6x faster at B=64), with the same
grid, splits and reduce; this kernel runs everything else (other widths,
fp32, the interpreter) and is the one the CPU tests check.

Numerics: softmax in fp32 (log2 domain, scale * log2(e) folded into one
multiplier); dots take the storage dtype (bf16 tensor cores; fp32 tiles in
3xTF32, launch.dot_precision) and accumulate in fp32. Under TRITON_INTERPRET=1
tiles are upcast to fp32 after loading (the interpreter's bf16 math is wrong).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton

import tinyengine.kernels.sparse_attention.gluon as sparse_gluon
from tinyengine.kernels.compressor.reference import check_ratio
from tinyengine.kernels.compressor.reference import entry_tables as entry_tables_of
from tinyengine.kernels.gluon_support import GluonUnavailable
from tinyengine.kernels.launch import LOG2E, dot_precision, interpreting, num_sms
from tinyengine.kernels.sparse_attention.rows import QueryRows, query_rows, scratch
from tinyengine.kernels.sparse_attention.split import (
    ALL_ENTRIES,
    TOPK_ENTRIES,
    WINDOW_ONLY,
    _sparse_split_kernel,
)
from tinyengine.kernels.split_reduce import merge_splits

MAX_SPLITS = 64
# A running max may lag the true one by this much (log2 units) before the
# accumulator is rebased (LAZY_RESCALE): weights then reach 2^8.
RESCALE_THRESHOLD = 8.0


class SparseConfig(NamedTuple):
    block_h: int  # heads per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    num_splits: int  # runtime argument: any value shares one compiled kernel
    lazy_rescale: bool  # rebase the accumulator only when a max grew past the threshold


def sparse_config(
    rows: int, num_heads: int, head_dim: int, max_keys: int, sms: int, elem_bytes: int,
    every_entry: bool = False,
) -> SparseConfig:  # fmt: skip
    """Tiles and splits from host ints only (a graph captured for a batch
    size stays valid for any context up to the one max_keys was taken at).
    every_entry: an HCA layer's key list (every complete entry), which
    rescales lazily; CSA and window-only lists rescale eagerly (H200, B=64,
    640 keys: HCA 100 vs 81 TFLOP/s lazy vs eager, CSA 80 vs 89;
    benchmarks/bench_v4_attention.py --sweep)."""
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    block_n = 64
    if elem_bytes > 2:
        # fp32: half the heads and keys keep the query and two tile stages
        # in shared memory at the bf16 tile's size.
        block_h, block_n = min(block_h, 32), 32
    warps = _warps_for(block_h, head_dim)
    splits = num_splits_for(rows, num_heads, block_h, max_keys, block_n, sms, warps, elem_bytes)
    return SparseConfig(block_h, block_n, warps, 2, splits, lazy_rescale=every_entry)


def _warps_for(block_h: int, head_dim: int) -> int:
    """4 warps, 8 once the fp32 accumulator passes [32, 512] (128 registers a thread)."""
    return 8 if block_h * max(16, triton.next_power_of_2(head_dim)) > 32 * 512 else 4


def num_splits_for(
    rows: int, num_heads: int, block_h: int, max_keys: int, block_n: int, sms: int,
    num_warps: int = 8, elem_bytes: int = 2,
) -> int:  # fmt: skip
    """Splits per (row, head block): as many as fill three quarters of the
    program slots, never more than the row's tiles, and then no more than
    pay for their partials.

    An SM holds one 8-warp program (its [64, 512] tiles take most of the
    shared memory and all registers) or two 4-warp ones. A program reads
    its rows at a rate set by latency (~1/slots of the GPU's bandwidth), so
    s splits take (1 - 1/s) of the row's key bytes off the longest path,
    while their fp32 partials, 8 * rows * heads * s bytes a column written
    and read back by the reduce, move at the whole GPU's rate: a split is
    kept only while keys * (1 - 1/s) * elem_bytes * slots >= 8 * rows *
    heads * s. Measured on an H100 (benchmarks/bench_v4_attention.py
    --splits, V4-Flash's 64 heads, 160 and 640 keys, 8-128 rows): this
    choice is within 0.6 us of the fastest split count everywhere; filling
    every slot loses up to 5.5 us (HCA, 64 rows: 21.2 against 15.7 with
    one split), and beyond three quarters of the slots the partials'
    traffic outweighs the extra programs (CSA, 32 rows, 4 splits: 25.4 us,
    3 splits 23.9)."""
    slots = sms * (2 if num_warps <= 4 else 1)
    programs = rows * triton.cdiv(num_heads, block_h)
    tiles = max(1, triton.cdiv(max_keys, block_n))
    splits = max(1, min(3 * slots // (4 * max(1, programs)), tiles, MAX_SPLITS))
    while splits > 1 and max_keys * (splits - 1) * elem_bytes * slots < (
        8 * rows * num_heads * splits * splits
    ):
        splits -= 1
    return splits


def sparse_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: Any,
    *,
    window: int,
    sinks: torch.Tensor,
    scale: float,
    entry_cache: torch.Tensor | None = None,
    ratio: int = 0,
    topk_indices: torch.Tensor | None = None,
    workspace: Any = None,
) -> torch.Tensor:
    """Same contract as reference.sparse_attention: q [T, H, D] -> out
    [T, H, D] in q.dtype (rows of padding stay 0)."""
    return launch_sparse_attention(
        q, kv_cache, attn, window=window, sinks=sinks, scale=scale, entry_cache=entry_cache,
        ratio=ratio, topk_indices=topk_indices, workspace=workspace,
    )  # fmt: skip


def launch_sparse_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: Any,
    *,
    window: int,
    sinks: torch.Tensor,
    scale: float,
    entry_cache: torch.Tensor | None = None,
    ratio: int = 0,
    topk_indices: torch.Tensor | None = None,
    workspace: Any = None,
    **tiles: Any,
) -> torch.Tensor:
    """sparse_attention with overrides of sparse_config's choices in
    `tiles` (num_splits, block_h, block_n, num_warps, num_stages,
    lazy_rescale; tests and benchmarks): host values, so an overridden call
    is exactly as graph-safe as the default one."""
    rows = query_rows(attn)
    if rows.num_rows != q.shape[0]:
        raise ValueError(f"sparse_attention: {rows.num_rows} query rows, q has {q.shape[0]}")
    out = torch.empty_like(q)  # every row is written: padding rows (length 0) get 0
    if rows.num_rows:
        _attend_rows(
            out, q, kv_cache, attn, rows, window, sinks, scale, entry_cache, ratio, topk_indices,
            workspace, tiles,
        )  # fmt: skip
    return out


def _attend_rows(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, attn: Any, rows: QueryRows,
    window: int, sinks: torch.Tensor, scale: float, entry_cache: torch.Tensor | None,
    ratio: int, topk: torch.Tensor | None, workspace: Any, tiles: dict[str, Any],
) -> None:  # fmt: skip
    """The split kernel (and the reduce) over every row of `rows`."""
    num_rows, (_, num_heads, head_dim) = rows.num_rows, q.shape
    max_seq_len = attn.max_seq_len
    block_size = kv_cache.shape[1]
    tables = entry_tables = attn.block_tables
    if entry_cache is None:
        mode, max_keys, entry_cache = WINDOW_ONLY, window, kv_cache  # never read as entries
    else:
        check_ratio(ratio, block_size)
        if entry_cache.dtype != kv_cache.dtype or entry_cache.shape[-1] != head_dim:
            raise ValueError(
                f"sparse_attention: entry_cache {entry_cache.dtype} {tuple(entry_cache.shape)} "
                f"must match kv_cache {kv_cache.dtype} rows of {head_dim}"
            )
        entry_tables = entry_tables_of(attn)
        if topk is None:
            mode, max_keys = ALL_ENTRIES, window + max_seq_len // ratio
        else:
            mode, max_keys = TOPK_ENTRIES, window + topk.shape[1]
    if kv_cache.shape[-1] != head_dim or q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("sparse_attention: q and the caches need contiguous rows of D")
    if entry_cache.stride(-1) != 1 or tables.stride(1) != 1 or entry_tables.stride(1) != 1:
        raise ValueError("sparse_attention: entry rows and block table rows must be contiguous")
    if topk is not None and topk.stride(1) != 1:
        raise ValueError("sparse_attention: top-k rows must be contiguous")
    # Off the GPU, 132 SMs (an H200's): the interpreter takes the GPU's choices.
    sms = num_sms(q.device, off_gpu=132)
    elem = kv_cache.element_size()
    cfg = sparse_config(num_rows, num_heads, head_dim, max_keys, sms, elem, mode == ALL_ENTRIES)
    block_h = tiles.get("block_h") or cfg.block_h
    block_n = tiles.get("block_n") or cfg.block_n
    num_warps = tiles.get("num_warps") or (
        cfg.num_warps if block_h == cfg.block_h else _warps_for(block_h, head_dim)
    )
    num_splits = tiles.get("num_splits") or (
        cfg.num_splits
        if (block_h, block_n, num_warps) == cfg[:3]
        else num_splits_for(num_rows, num_heads, block_h, max_keys, block_n, sms, num_warps, elem)
    )
    lazy = tiles.get("lazy_rescale")
    lazy = cfg.lazy_rescale if lazy is None else lazy
    if num_splits > MAX_SPLITS:
        raise ValueError(f"sparse_attention: at most {MAX_SPLITS} splits, not {num_splits}")
    direct = num_splits == 1
    # Scratch: each program's compacted top-k picks (CSA), and the splits'
    # partials and log2-sum-exps (none with one split: the split kernel
    # then writes `out` itself).
    head_blocks = triton.cdiv(num_heads, block_h)
    block_k = triton.next_power_of_2(topk.shape[1]) if topk is not None else 1
    specs = [((num_rows * head_blocks * num_splits, block_k), torch.int32)]
    if not direct:
        specs += [
            ((num_rows, num_heads, num_splits, head_dim), torch.float32),
            ((num_rows, num_heads, num_splits), torch.float32),
        ]
    bufs = scratch(workspace, specs, q.device, rows.eager)
    picks, (part_out, part_lse) = bufs[0], (bufs[1:] if not direct else (out, out))
    has_seqs = rows.seqs is not None
    seqs = rows.seqs if has_seqs else rows.seq_lens  # placeholder when unused
    topk_t = topk if topk is not None else rows.seq_lens  # placeholder when unused
    # Entries and their table are addressed from the kv cache and the token
    # table (split.py's _key_rows says why): host ints from the tensors'
    # addresses, fixed for a captured graph as the tensors are. The kernels
    # declare both int64: a difference of two addresses fits int32 or not
    # by where the allocator put the caches, and Triton would otherwise
    # compile a variant for each, one of them first met in serving (the
    # startup's dry run sees profile's one-block caches only).
    entry_offset = (entry_cache.data_ptr() - kv_cache.data_ptr()) // elem
    table_delta = (entry_tables.data_ptr() - tables.data_ptr()) // tables.element_size()
    strides = (kv_cache.stride(0), kv_cache.stride(1), entry_cache.stride(0), entry_cache.stride(1))
    aligned = (entry_cache.data_ptr() - kv_cache.data_ptr()) % (16 * elem) == 0 and all(
        st % 16 == 0 for st in strides
    )
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (head_blocks, num_rows, num_splits)
    args = (
        q, kv_cache, entry_offset, tables, table_delta, rows.seq_lens, seqs, topk_t, picks,
        sinks, out, part_out, part_lse, scale * LOG2E, num_splits, num_heads,
        0 if topk is None else topk.shape[1],
        q.stride(0), q.stride(1), *strides, tables.stride(0), entry_tables.stride(0),
        0 if topk is None else topk.stride(0), out.stride(0), out.stride(1),
    )  # fmt: skip
    common = dict(
        D=head_dim, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_SIZE=block_size, WINDOW=window,
        RATIO=max(ratio, 1), MODE=mode, HAS_SEQS=has_seqs, DIRECT=direct,
    )  # fmt: skip
    use_gluon = tiles.get("gluon") is not False and sparse_gluon.supports(
        q, kv_cache, entry_cache, block_h, block_n, aligned
    )
    if use_gluon:
        try:
            sparse_gluon.launch_split(grid, args, common)
        except GluonUnavailable:
            use_gluon = False
    if not use_gluon:
        _sparse_split_kernel[grid](
            *args, **common, BLOCK_D=block_d, BLOCK_K=block_k, ALIGNED=aligned,
            LAZY_RESCALE=lazy, RESCALE_THRESHOLD=RESCALE_THRESHOLD, UPCAST=interpreting(),
            DOT_PRECISION=dot_precision(kv_cache.dtype), num_warps=num_warps,
            num_stages=tiles.get("num_stages") or cfg.num_stages,
        )  # fmt: skip
    if not direct:
        merge_splits(out, part_out, part_lse, num_splits, MAX_SPLITS, sinks)
