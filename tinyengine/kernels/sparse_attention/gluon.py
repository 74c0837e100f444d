"""DeepSeek-V4 sparse attention's split kernel for Hopper in Gluon: the one
tile V4 runs on an H200 (64 heads x 64 keys, D = 512, bf16/fp16), with the
key rows gathered by cp.async into a two-slot ring that is filled a whole
tile ahead, and the MMA work shared by the two warpgroups instead of
repeated. Same grid, same outputs and same reduce as kernels/sparse_attention/split.py's
_sparse_split_kernel; kernels/sparse_attention/triton.py chooses between them.

Why it exists. The Triton kernel is latency bound (kernels/sparse_attention/triton.py,
"Where it stands"): Triton issues tile t + 1's gather only after tile t's
block-id loads, and waits for it at the start of t + 1, so the loads hardly
overlap the MMAs, and both warpgroups compute the same QK product. Here:

  - the gather of tile t + 1 is issued before tile t's QK product, from row
    offsets computed during tile t - 1: a key's top-k pick is loaded at the
    start of one iteration and its block id after that iteration's QK
    product, so neither dependent load stalls a warp in front of an MMA;
  - the layouts are those of kernels/mla/gluon.py: S [64 heads, 64 keys]
    with the warpgroups splitting the keys (32 each), O [64 heads, 512]
    with each warpgroup owning 256 columns, and P through shared memory.

Dead keys. A key list is [window | entries] as in split.py, but a CSA
row's picks are used where they are (no compaction into scratch): a pick of
-1 is a dead key, masked to -inf in the scores. Its ring row is zero-filled
by the masked cp.async (0 x anything finite is 0), and neither its pick's
block id nor its row is ever loaded. A tile, or a whole split, may then
hold only dead keys; the running max stays -inf there and is used as 0.

Where it stands (H200, Triton 3.6, benchmarks/bench_v4_attention.py,
CSA rows of 640 keys): B=64 in 37.5 us, 143 TFLOP/s, 21% of the measured
bf16 MMA peak (the Triton split kernel: 60 us); B=256 in 103 us, 30%.
Fitting split and tile counts gives ~5 us a program outside the loop (the
query, the first gather, the partial's write, the reduce) and ~4 us a
tile, about twice what the tile's MMAs (1.6 us at the measured peak) and
the QK product's shared-memory reads (each warpgroup reads the whole query
per tile) account for; deeper rings of smaller tiles were slower, so the
gathers are not what it waits on. Left to do, as FlashMLA does it:
asynchronous wgmma chains so one tile's softmax overlaps the next tile's
MMAs, and producer warps for the gathers (warp specialization).

Shared memory: the query (64 KB), two ring slots (128 KB), P (8 KB). No
interpreter runs Gluon: CPU tests cover the Triton kernel, GPU tests compare
this one with the reference.
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
    from tinyengine.kernels.gluon_split import (
        softmax_pv,
        split_range,
        write_empty_split,
        write_partial,
    )
    from tinyengine.kernels.gluon_support import (
        async_copy,
        cp_async_load,
        cta_barrier,
        fence_async_shared,
        gl,
        gluon,
        warpgroup_mma,
    )

BLOCK_H = 64  # heads per program: the M of one wgmma
BLOCK_N = 64  # keys per tile
HEAD_DIM = 512  # the width whose shared-memory budget was sized (V4's head_dim)
# Ring slots: two [64, 512] tiles next to the query. Three or four slots of
# 32-key tiles (more bytes in flight) measured 3-8% slower: the loop is not
# waiting on its gathers (docs/benchmarks.md, V4 kernels).
NUM_STAGES = 2


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

    @gluon.jit
    def _picks(topk_row, j, end, n_win, MODE: gl.constexpr):
        """Stage one of a tile's row offsets: the entry numbers of keys j
        (a CSA row's picks, loaded; otherwise j - n_win; 0 for window keys
        and keys past `end`, and -1 for a pick of none)."""
        ent = (j < end) & (j >= n_win)
        if MODE == _TOPK_ENTRIES:
            w = gl.load(topk_row + (j - n_win), mask=ent, other=0).to(gl.int32)
        else:
            w = gl.where(ent, j - n_win, 0)
        return w

    @gluon.jit
    def _keys(j, w, end, n_win, first, table_offset, RATIO: gl.constexpr,
              BLOCK_SIZE: gl.constexpr):  # fmt: skip
        """What keys j with entry numbers w are: (live, is a window row,
        position of a window row, last position of an entry, block table
        column of either)."""
        is_win = j < n_win
        live = (j < end) & (is_win | (w >= 0))
        pos = gl.where(is_win, first + j, 0)
        last = gl.where(live & ~is_win, (w + 1) * RATIO - 1, 0)
        col = gl.where(is_win, pos // BLOCK_SIZE, table_offset + last // BLOCK_SIZE)
        return live, is_win, pos, last, col

    @gluon.jit
    def _block_ids(table_row, table_offset, j, w, end, n_win, first, RATIO: gl.constexpr,
                   BLOCK_SIZE: gl.constexpr):  # fmt: skip
        """Stage two: the block ids of keys j (a dead key's is not loaded).
        Only issued here; _offsets is the first use, so the load's latency
        passes under whatever runs between the two."""
        live, _, _, _, col = _keys(j, w, end, n_win, first, table_offset, RATIO, BLOCK_SIZE)
        return gl.load(table_row + col, mask=live, other=0)

    @gluon.jit
    def _offsets(
        blk, table_offset, entry_offset, j, w, end, n_win, first,
        stride_kb, stride_ks, stride_eb, stride_er, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ):  # fmt: skip
        """Stage three: (element offsets from the kv cache's start, live) of
        keys j; a dead key's offset is 0. Entries are addressed from the kv
        cache too (entry_offset: the entry cache's start minus the kv
        cache's), so one pointer tensor gathers both kinds of key."""
        live, is_win, pos, last, _ = _keys(j, w, end, n_win, first, table_offset, RATIO,
                                           BLOCK_SIZE)  # fmt: skip
        blk = blk.to(gl.int64)
        offs = gl.where(
            is_win,
            blk * stride_kb + (pos % BLOCK_SIZE) * stride_ks,
            entry_offset + blk * stride_eb + ((last % BLOCK_SIZE) // RATIO) * stride_er,
        )
        return gl.multiple_of(gl.where(live, offs, 0), 16), live

    @gluon.jit
    def _tile_offsets(
        topk_row, table_row, table_offset, entry_offset, j, end, n_win, first,
        stride_kb, stride_ks, stride_eb, stride_er,
        MODE: gl.constexpr, RATIO: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ):  # fmt: skip
        """All three stages at once (the prologue, where nothing runs between)."""
        w = _picks(topk_row, j, end, n_win, MODE)
        blk = _block_ids(table_row, table_offset, j, w, end, n_win, first, RATIO, BLOCK_SIZE)
        return _offsets(
            blk, table_offset, entry_offset, j, w, end, n_win, first,
            stride_kb, stride_ks, stride_eb, stride_er, RATIO, BLOCK_SIZE,
        )  # fmt: skip

    @gluon.jit
    def _issue(kv_ptr, offs, live, slot, cols):
        """cp.async of one tile's key rows into a ring slot (dead rows: zeros)."""
        cp_async_load(slot, kv_ptr + offs[:, None] + cols[None, :], mask=live[:, None])
        async_copy.commit_group()

    @gluon.jit(do_not_specialize=["num_splits", "topk"])
    def _sparse_split_gluon(
        q_ptr, kv_ptr, entry_offset, tables_ptr, table_delta, seq_lens_ptr, seqs_ptr, topk_ptr,
        picks_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        qk_scale, num_splits, num_heads, topk,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_eb, stride_er, stride_bt, stride_ebt,
        stride_topk, stride_ot, stride_oh,
        D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        WINDOW: gl.constexpr, RATIO: gl.constexpr, MODE: gl.constexpr, HAS_SEQS: gl.constexpr,
        DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """Grid (H / BLOCK_H, rows, num_splits), 8 warps; the arguments
        (picks_ptr unused: no compaction) and contract of split.py's
        _sparse_split_kernel (DIRECT: `out` with the sink; else
        the normalised partials and log2-sum-exps the reduce merges; a split
        with no live key writes lse = -inf)."""
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16]
        )
        # 16-byte vectors, a warp on 2 rows x 128 columns: 16 copies a thread a tile.
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        key_layout: gl.constexpr = gl.SliceLayout(1, rows_layout)
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], dtype)
        kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)

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
        start, end = split_range(total, num_splits, split, BLOCK_N)
        heads_o = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        part_idx = (b * num_heads + heads_o).to(gl.int64) * num_splits + split
        if not DIRECT:
            if start >= end:
                write_empty_split(part_lse_ptr, part_idx)
                return

        table_row = tables_ptr + seq * stride_bt
        table_offset = table_delta + seq * (stride_ebt - stride_bt)
        topk_row = topk_ptr + row * stride_topk
        kv_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], kv_sl)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, rows_layout))
        keys = gl.arange(0, BLOCK_N, layout=key_layout)
        keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        num_tiles = gl.cdiv(end - start, BLOCK_N)
        # The first NUM_STAGES - 1 tiles' gathers (the query loads while
        # they fly), then the next tile's row offsets.
        j = start + keys
        for i in gl.static_range(NUM_STAGES - 1):
            offs, live = _tile_offsets(
                topk_row, table_row, table_offset, entry_offset, j, end, n_win, first,
                stride_kb, stride_ks, stride_eb, stride_er, MODE, RATIO, BLOCK_SIZE,
            )  # fmt: skip
            _issue(kv_ptr, offs, live, kv_ring.index(i), cols)
            j = j + BLOCK_N
        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows_layout))
        q = gl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + cols[None, :])
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D], q_sl, q)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)
        offs_next, live_next = _tile_offsets(
            topk_row, table_row, table_offset, entry_offset, j, end, n_win, first,
            stride_kb, stride_ks, stride_eb, stride_er, MODE, RATIO, BLOCK_SIZE,
        )  # fmt: skip

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_H, D], gl.float32, o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        for t in range(num_tiles):
            # Every warp is done with tile t - 1 (its ring slot and P): the
            # slot takes tile t + NUM_STAGES - 1 now (all-dead past the last
            # tile: a zero fill, never read).
            cta_barrier()
            ahead = t + NUM_STAGES - 1
            _issue(kv_ptr, offs_next, live_next, kv_ring.index(ahead % NUM_STAGES), cols)
            # Which of tile t's keys are live, in the scores' layout.
            j_s = start + t * BLOCK_N + keys_s
            w_s = _picks(topk_row, j_s, end, n_win, MODE)
            # The row offsets of the tile after it in three stages, each
            # load's first use an MMA later: its picks now, its block ids
            # after the QK product, its offsets after the PV product.
            j = j + BLOCK_N
            w = _picks(topk_row, j, end, n_win, MODE)
            async_copy.wait_group(NUM_STAGES - 1)  # this thread's copies of tile t
            fence_async_shared()  # visible to the tensor cores
            cta_barrier()  # and every thread's copies landed
            kv = kv_ring.index(t % NUM_STAGES)
            s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False)
            blk = _block_ids(table_row, table_offset, j, w, end, n_win, first, RATIO, BLOCK_SIZE)
            live_s = (j_s < end) & ((j_s < n_win) | (w_s >= 0))
            s = gl.where(live_s[None, :], s * qk_scale, float("-inf"))
            acc, m_i, l_i = softmax_pv(s, m_i, l_i, acc, p_smem, kv)
            offs_next, live_next = _offsets(
                blk, table_offset, entry_offset, j, w, end, n_win, first,
                stride_kb, stride_ks, stride_eb, stride_er, RATIO, BLOCK_SIZE,
            )  # fmt: skip
        async_copy.wait_group(0)  # no copy outlives the program

        if DIRECT:
            # The sink: one more logit, no value (split.py's DIRECT branch).
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
            sink = gl.load(sinks_ptr + heads_o).to(gl.float32) * 1.4426950408889634
            m_f = gl.maximum(m_o, sink)
            m_f = gl.where(m_f == float("-inf"), 0.0, m_f)
            keep = gl.exp2(m_o - m_f)
            denom = l_o * keep + gl.exp2(sink - m_f)
            out = acc * (keep / gl.where(denom == 0.0, 1.0, denom))[:, None]
            cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
            o_rows = out_ptr + row * stride_ot + heads_o[:, None] * stride_oh
            gl.store(o_rows + cols_o[None, :], out.to(out_ptr.dtype.element_ty))
        else:
            write_partial(acc, m_i, l_i, part_out_ptr, part_lse_ptr, part_idx, D)


_compile_failed: list[str] = []  # the first compile error, once one happened


def launch_split(grid: tuple[int, int, int], args: tuple, common: dict[str, Any]) -> None:
    """The split kernel over a call `supports` accepted, with the Triton
    kernel's positional arguments and its constexprs shared by both
    (kernels/sparse_attention/triton.py builds them)."""
    launch_or_give_up(
        lambda: _sparse_split_gluon[grid](*args, **common, NUM_STAGES=NUM_STAGES, num_warps=8),
        "sparse-attention",
        _compile_failed,
    )
