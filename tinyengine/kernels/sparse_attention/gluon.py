"""DeepSeek-V4 sparse attention's split kernel for Hopper in Gluon, for V4's
own tile (64 heads, D = 512, bf16/fp16), warp-specialized: a producer
warpgroup gathers the query and the key rows, two consumer warpgroups take
alternate 32-key tiles (each one's QK^T product and softmax) and each
applies every tile to its own half of the output columns. Same grid,
outputs and reduce as kernels/sparse_attention/split.py's
_sparse_split_kernel; kernels/sparse_attention/triton.py chooses between
them.

Why. With every warp on every tile (as in the Triton kernel), a step is
one chain that all eight warps walk together: the tile's block-id loads
and gathers, QK^T, a softmax whose row max crosses warpgroups, PV. The
tensor cores idle during the softmax and the warps idle during the
products and loads. Here:

  - the producer (4 warps, 96 registers) loads each tile's picks four
    tiles ahead and their block ids two ahead (kernels/sparse_attention/
    gluon_gather.py), then gathers the tile with cp.async into a four-slot
    ring once both consumers have released the slot, and writes which of
    the tile's keys are live next to it (so the consumers load no picks);
    each thread's copies arrive on the slot's `full` mbarrier when they
    land. 96 registers, not 64: with 64 ptxas spilled the prefetched picks
    and block ids inside the loop, and a spill store must wait for the
    load it spills, which undoes the prefetch (3% at B=64, 4% at B=256);
  - the consumers are out of phase: while one runs its tile's softmax the
    other's products occupy the tensor cores.

The online softmax stays one sequence over the tiles in order. The owner
of tile t needs the running (max, sum) after tile t - 1, which the other
warpgroup publishes in shared memory with tile t - 1's weights P; then it
publishes its own. Each warpgroup's output half takes the tiles in order,
t - 1 (the other's P) then t (its own), each as

    O = O * 2^(m_prev - m) + P @ V[:, half]

Barriers (mbarriers, phases counted per use): `full`/`empty` per ring slot
(a slot has landed once the producer's copies and its mask are in; it is
free once both halves' PV read it), `ready` per warpgroup (its
tile's P and running stats published), `pfree` per warpgroup (the other
warpgroup's PV has read its P), `q_full` (the query landed).

Dead keys. A CSA row's picks are used where they are (no compaction into
scratch): a pick of -1 is a dead key, masked to -inf in the scores (the
producer's live mask); its ring row is zero-filled by the masked cp.async
and neither its block id nor its row is loaded. A tile, or a whole split,
may hold only dead keys; the running max stays -inf there and is used as 0.

Where it stands (H100, Triton 3.6, benchmarks/bench_v4_attention.py, CSA
rows of 640 keys): B=64 in 37.1 us, 21% of the measured bf16 MMA peak;
B=256 in 92.4 us, 33% (docs/benchmarks.md, V4 kernels). The op is bound by
memory, not the tensor cores: 64 heads make 128 FLOP per cache byte, under
the H100's and the H200's ridge. Profiled at B=64, the consumers wait
for their tile's rows about half the time; the split kernel moves its
bytes at about half the rate a plain gather kernel reaches, and the fp32
partials (written here, read back by the reduce) add a third to the bytes.

Shared memory: the query (64 KB), four 32-key ring slots (128 KB) and
their live masks, two P tiles (8 KB), the running stats (1 KB). No
interpreter runs Gluon: CPU tests cover the Triton kernel, GPU tests
compare this one with the reference.
"""

from __future__ import annotations

from typing import Any

import torch

from tinyengine.kernels.gluon_support import (
    HAVE_GLUON,
    is_hopper,
    launch_or_give_up,
)
from tinyengine.kernels.sparse_attention.split import ALL_ENTRIES, TOPK_ENTRIES

if HAVE_GLUON:
    import triton.language as tl  # the kernel's 64-bit argument annotations

    from tinyengine.kernels.gluon_split import split_range, write_empty_split, write_partial
    from tinyengine.kernels.gluon_support import (
        cta_barrier,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        warpgroup_mma,
    )
    from tinyengine.kernels.sparse_attention.gluon_gather import produce

BLOCK_H = 64  # heads per program: the M of one wgmma
BLOCK_N = 64  # the launcher's tile (block_n): each split is whole spans of it
TILE_N = 32  # keys per tile: each warpgroup's own QK^T product
HEAD_DIM = 512  # the width whose shared-memory budget was sized (V4's head_dim)
NUM_STAGES = 4  # ring slots: tiles t and t + 1 in use, t + 2 and t + 3 landing
PRODUCER_REGS = 96
CONSUMER_REGS = 200  # the second warpgroup's; the first gets what is left (208)
MAXNREG = 168  # 12 warps at launch: 65536 / 384, rounded down to a multiple of 8


def supports(
    q: torch.Tensor, kv_cache: torch.Tensor, entry_cache: torch.Tensor, block_h: int,
    block_n: int, aligned: bool,
) -> bool:  # fmt: skip
    """Whether this kernel can run the call: Gluon present, a Hopper GPU
    (not the interpreter), 16-bit floats, V4's head_dim, whole 64-head
    blocks of 64-key tiles, every row offset a multiple of 16 elements
    (`aligned`, as the launcher computes it for the Triton kernel)."""
    if not HAVE_GLUON or _compile_failed or q.device.type != "cuda":
        return False
    return (
        is_hopper(q.device.index)
        and kv_cache.dtype in (torch.bfloat16, torch.float16)
        and q.dtype == kv_cache.dtype == entry_cache.dtype
        and q.shape[2] == HEAD_DIM
        and (block_h, block_n) == (BLOCK_H, BLOCK_N)
        and q.shape[1] % BLOCK_H == 0
        and aligned
    )


if HAVE_GLUON:
    _ALL_ENTRIES = gl.constexpr(ALL_ENTRIES)
    _TOPK_ENTRIES = gl.constexpr(TOPK_ENTRIES)
    _SPLIT_SPAN = gl.constexpr(BLOCK_N)
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
    _FIRST = gl.constexpr(0)
    _SECOND = gl.constexpr(1)

    @gluon.jit
    def _apply(acc, m_acc, m_new, p_buf, kv_ring, t, full, empty, W: gl.constexpr):
        """O = O * 2^(m_acc - m_new') + P_t @ V_t[:, half W] (m_new' = m_new,
        or 0 while every key so far is dead), then release tile t's slot."""
        num_stages: gl.constexpr = kv_ring.type.shape[0]
        half: gl.constexpr = acc.type.shape[1]
        slot = t % num_stages
        mbarrier.wait(full.index(slot), (t // num_stages) & 1)  # landed (for this warpgroup too)
        fence_async_shared()
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.convert_layout(gl.exp2(m_acc - m_use), gl.SliceLayout(1, acc.type.layout))
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_buf, kv_ring.index(slot).slice(W * half, half, dim=1), acc)
        cta_barrier()  # every warp's share of the product has read the slot and P
        mbarrier.arrive(empty.index(slot), count=1)
        return acc

    @gluon.jit
    def _consume(
        q_smem, q_full, kv_ring, live_ring, full, empty, p_bufs, stats_m, stats_l, ready, pfree,
        qk_scale, num_tiles, row, head_block, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        part_base, num_splits, split, stride_ot, stride_oh,
        W: gl.constexpr, D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        DIRECT: gl.constexpr,
    ):  # fmt: skip
        """Warpgroup W: tiles W, W + 2, ... (QK^T, softmax, publish), every
        tile's PV on output columns [W * D/2, (W + 1) * D/2), then its half
        of the split's partial (or of `out`)."""
        HALF: gl.constexpr = D // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
        )
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        other: gl.constexpr = 1 - W
        m_mine, l_mine = stats_m.slice(W * BLOCK_H, BLOCK_H), stats_l.slice(W * BLOCK_H, BLOCK_H)
        m_theirs = stats_m.slice(other * BLOCK_H, BLOCK_H)
        l_theirs = stats_l.slice(other * BLOCK_H, BLOCK_H)
        acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        m_acc = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)  # acc's reference max
        m_i = m_acc  # the running max and sum after the last tile this warpgroup knows
        l_i = gl.zeros([BLOCK_H], gl.float32, row_l)
        mbarrier.wait(q_full, 0)
        fence_async_shared()
        for t in range(W, num_tiles, 2):
            slot = t % kv_ring.type.shape[0]
            mbarrier.wait(full.index(slot), (t // kv_ring.type.shape[0]) & 1)
            fence_async_shared()
            s = warpgroup_mma(q_smem, kv_ring.index(slot).permute((1, 0)), s_zero, use_acc=False)
            live = live_ring.index(slot).load(gl.SliceLayout(0, s_layout)) != 0
            s = gl.where(live[None, :], s * qk_scale, float("-inf"))
            # The running stats after tile t - 1 (the other warpgroup's).
            mbarrier.wait(ready.index(other), ((t - 1) // 2) & 1, pred=t > 0)
            m_prev = gl.where(t > 0, m_theirs.load(row_l), float("-inf"))
            l_prev = gl.where(t > 0, l_theirs.load(row_l), 0.0)
            m_new = gl.maximum(m_prev, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_use[:, None])
            l_new = l_prev * gl.exp2(m_prev - m_use) + gl.sum(p, 1)
            # This warpgroup's P buffer is free once the other's PV read it.
            mbarrier.wait(pfree.index(W), ((t // 2) - 1) & 1, pred=t >= 2)
            p_buf = p_bufs.index(W)
            p_buf.store(p.to(p_buf.dtype))
            m_mine.store(m_new)
            l_mine.store(l_new)
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(ready.index(W), count=1)
            if t > 0:  # the other warpgroup's tile t - 1 first
                acc = _apply(acc, m_acc, m_prev, p_bufs.index(other), kv_ring, t - 1, full, empty,
                             W)  # fmt: skip
                mbarrier.arrive(pfree.index(other), count=1)
                m_acc = m_prev
            acc = _apply(acc, m_acc, m_new, p_buf, kv_ring, t, full, empty, W)
            m_acc, m_i, l_i = m_new, m_new, l_new
        last = num_tiles - 1
        if (last % 2) != W:  # the other warpgroup's last tile
            mbarrier.wait(ready.index(other), (last // 2) & 1)
            m_i = m_theirs.load(row_l)
            l_i = l_theirs.load(row_l)
            acc = _apply(acc, m_acc, m_i, p_bufs.index(other), kv_ring, last, full, empty, W)
            mbarrier.arrive(pfree.index(other), count=1)

        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        if DIRECT:
            # The sink: one more logit, no value (split.py's DIRECT branch).
            cols = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
            sink = gl.load(sinks_ptr + heads).to(gl.float32) * 1.4426950408889634
            m_f = gl.maximum(m_o, sink)
            m_f = gl.where(m_f == float("-inf"), 0.0, m_f)
            keep = gl.exp2(m_o - m_f)
            denom = l_o * keep + gl.exp2(sink - m_f)
            out = acc * (keep / gl.where(denom == 0.0, 1.0, denom))[:, None]
            o_rows = out_ptr + row * stride_ot + heads[:, None] * stride_oh
            gl.store(o_rows + cols[None, :], out.to(out_ptr.dtype.element_ty))
        else:
            part_idx = (part_base + heads).to(gl.int64) * num_splits + split
            write_partial(acc, m_i, l_i, part_out_ptr, part_lse_ptr, part_idx, W * HALF, D, W == 0)

    @gluon.jit(do_not_specialize=["num_splits", "topk"])
    def _sparse_split_gluon(
        q_ptr, kv_ptr, entry_offset: tl.int64, tables_ptr, table_delta: tl.int64, seq_lens_ptr,
        seqs_ptr, topk_ptr, picks_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        qk_scale, num_splits, num_heads, topk,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_eb, stride_er, stride_bt, stride_ebt,
        stride_topk, stride_ot, stride_oh,
        D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        WINDOW: gl.constexpr, RATIO: gl.constexpr, MODE: gl.constexpr, HAS_SEQS: gl.constexpr,
        DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """Grid (H / BLOCK_H, rows, num_splits); 4 warps here (the first
        consumer warpgroup) and two 4-warp workers (the second, the
        producer). gluon.py's _sparse_split_gluon's arguments and contract;
        BLOCK_N is this kernel's 32-key tile."""
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        head_block = gl.program_id(0)
        b = gl.program_id(1)
        split = gl.program_id(2)
        row = b.to(gl.int64)
        seq = row
        if HAS_SEQS:
            seq = gl.load(seqs_ptr + b).to(gl.int64)
        seq_len = gl.load(seq_lens_ptr + b)
        n_win = gl.maximum(gl.minimum(seq_len, WINDOW), 0)
        first = seq_len - n_win
        if MODE == _ALL_ENTRIES:
            total = n_win + gl.maximum(seq_len, 0) // RATIO
        elif MODE == _TOPK_ENTRIES:
            total = n_win + gl.where(seq_len > 0, topk, 0)
        else:
            total = n_win
        # The Triton kernel's split boundaries (whole 64-key spans), walked
        # as 32-key tiles.
        start, end = split_range(total, num_splits, split, _SPLIT_SPAN)
        part_base = b * num_heads
        if not DIRECT:
            if start >= end:
                lse_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
                heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=lse_layout)
                idx = (part_base + heads).to(gl.int64) * num_splits + split
                write_empty_split(part_lse_ptr, idx)
                return
        # A direct program with no key still runs one all-dead tile.
        num_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 1)
        table_row = tables_ptr + seq * stride_bt
        table_offset = table_delta + seq * (stride_ebt - stride_bt)
        topk_row = topk_ptr + row * stride_topk

        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], dtype)
        kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
        stat_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        bar_l: gl.constexpr = mbarrier.MBarrierLayout()
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D], q_sl)
        kv_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], kv_sl)
        live_ring = gl.allocate_shared_memory(gl.int8, [NUM_STAGES, BLOCK_N], stat_sl)
        p_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N], p_sl)
        stats_m = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], stat_sl)
        stats_l = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], stat_sl)
        q_full = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l)
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        pfree = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        mbarrier.init(q_full, count=128)  # the producer's threads (cp.async arrivals)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(full.index(i), count=129)  # 128 cp.async arrivals, 1 for the mask
            mbarrier.init(empty.index(i), count=2)  # one per output half
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(pfree.index(i), count=1)

        gl.warp_specialize(
            [
                (_consume, (
                    q_smem, q_full, kv_ring, live_ring, full, empty, p_bufs, stats_m, stats_l,
                    ready, pfree, qk_scale, num_tiles, row, head_block, sinks_ptr, out_ptr,
                    part_out_ptr, part_lse_ptr, part_base, num_splits, split, stride_ot,
                    stride_oh, _FIRST, D, BLOCK_H, BLOCK_N, DIRECT,
                )),
                (_consume, (
                    q_smem, q_full, kv_ring, live_ring, full, empty, p_bufs, stats_m, stats_l,
                    ready, pfree, qk_scale, num_tiles, row, head_block, sinks_ptr, out_ptr,
                    part_out_ptr, part_lse_ptr, part_base, num_splits, split, stride_ot,
                    stride_oh, _SECOND, D, BLOCK_H, BLOCK_N, DIRECT,
                )),
                (produce, (
                    q_ptr, row, head_block, stride_qt, stride_qh, kv_ptr, entry_offset, topk_row,
                    table_row, table_offset, start, end, n_win, first, stride_kb, stride_ks,
                    stride_eb, stride_er, num_tiles, q_smem, q_full, kv_ring, live_ring, full,
                    empty,
                    D, BLOCK_H, BLOCK_N, BLOCK_SIZE, RATIO, MODE,
                )),
            ],
            [4, 4],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )  # fmt: skip


def launch_split(grid: tuple[int, int, int], args: tuple, common: dict[str, Any]) -> None:
    """The split kernel over a call `supports` accepted, with the Triton
    kernel's positional arguments and its constexprs shared by both
    (kernels/sparse_attention/triton.py builds them); BLOCK_N becomes this
    kernel's 32-key tile (the splits stay whole 64-key spans)."""
    common = dict(common, BLOCK_N=TILE_N)
    launch_or_give_up(
        lambda: _sparse_split_gluon[grid](
            *args, **common, NUM_STAGES=NUM_STAGES, num_warps=4, maxnreg=MAXNREG
        ),
        "sparse-attention",
        _compile_failed,
    )


_compile_failed: list[str] = []
