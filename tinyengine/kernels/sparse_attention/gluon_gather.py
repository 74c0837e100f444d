"""The gather side of DeepSeek-V4's Gluon sparse-attention split kernel
(kernels/sparse_attention/gluon.py): the producer warpgroup, and the three
dependent stages from a tile's key numbers to the element offsets of its
rows, each a separate function so their loads can be issued tiles ahead of
their first use.

A key list is [window | entries] as in kernels/sparse_attention/split.py:
key j < n_win is the raw row of position first + j, through the token
block table; key j >= n_win is entry w (j - n_win, or a CSA row's pick
j - n_win, -1 = none), through the entry table (the second half of the
same table row, table_offset columns on). A dead key (past the split's end,
or a pick of none) loads nothing and gets offset 0.
"""

from __future__ import annotations

from tinyengine.kernels.gluon_support import HAVE_GLUON
from tinyengine.kernels.sparse_attention.split import TOPK_ENTRIES

if HAVE_GLUON:
    from tinyengine.kernels.gluon_support import (
        async_copy,
        cp_async_load,
        cta_barrier,
        gl,
        gluon,
        mbarrier,
    )

    _TOPK_ENTRIES = gl.constexpr(TOPK_ENTRIES)

    @gluon.jit
    def _tile_picks(topk_row, j, end, n_win, MODE: gl.constexpr):
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
        """What keys j with entry numbers w are: (live: inside the split and
        a window row or an entry that is not a pick of none; is a window
        row; position of a window row; last position of an entry; block
        table column of either)."""
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
        Only issued here; _row_offsets is the first use, so the load's latency
        passes under whatever runs between the two."""
        live, _, _, _, col = _keys(j, w, end, n_win, first, table_offset, RATIO, BLOCK_SIZE)
        return gl.load(table_row + col, mask=live, other=0)

    @gluon.jit
    def _row_offsets(
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
    def produce(
        q_ptr, row, head_block, stride_qt, stride_qh, kv_ptr, entry_offset, topk_row, table_row,
        table_offset, start, end, n_win, first, stride_kb, stride_ks, stride_eb, stride_er,
        num_tiles, q_smem, q_full, kv_ring, live_ring, full, empty,
        D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, RATIO: gl.constexpr, MODE: gl.constexpr,
    ):  # fmt: skip
        """The producer: the query, then each tile's row offsets and, once
        both warpgroups have released its slot, its gather and which of its
        keys are live (live_ring, 1 byte a key). A slot's `full` barrier
        takes each thread's copies when they land (cp.async arrivals) and
        one arrival once every thread has stored its part of the mask."""
        num_stages: gl.constexpr = kv_ring.type.shape[0]
        # 16-byte vectors, a warp on 2 rows x 128 columns.
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
        cp_async_load(q_smem, q_ptr + row * stride_qt + heads[:, None] * stride_qh + cols[None, :])
        async_copy.mbarrier_arrive(q_full, increment_count=False)
        # A tile's row offsets take two dependent loads (its picks, then
        # their block ids): the picks are loaded four tiles ahead and the
        # block ids two, so each load has two tiles' gathers to land in.
        keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        j = start + keys
        w0 = _tile_picks(topk_row, j, end, n_win, MODE)
        w1 = _tile_picks(topk_row, j + BLOCK_N, end, n_win, MODE)
        w2 = _tile_picks(topk_row, j + 2 * BLOCK_N, end, n_win, MODE)
        w3 = _tile_picks(topk_row, j + 3 * BLOCK_N, end, n_win, MODE)
        b0 = _block_ids(table_row, table_offset, j, w0, end, n_win, first, RATIO, BLOCK_SIZE)
        b1 = _block_ids(table_row, table_offset, j + BLOCK_N, w1, end, n_win, first, RATIO,
                       BLOCK_SIZE)  # fmt: skip
        for t in range(num_tiles):
            slot = t % num_stages
            j = start + t * BLOCK_N + keys
            w4 = _tile_picks(topk_row, j + 4 * BLOCK_N, end, n_win, MODE)
            b2 = _block_ids(table_row, table_offset, j + 2 * BLOCK_N, w2, end, n_win, first,
                           RATIO, BLOCK_SIZE)  # fmt: skip
            offs, live = _row_offsets(
                b0, table_offset, entry_offset, j, w0, end, n_win, first,
                stride_kb, stride_ks, stride_eb, stride_er, RATIO, BLOCK_SIZE,
            )  # fmt: skip
            mbarrier.wait(empty.index(slot), ((t // num_stages) & 1) ^ 1)
            cp_async_load(
                kv_ring.index(slot), kv_ptr + offs[:, None] + cols[None, :], mask=live[:, None]
            )
            live_ring.index(slot).store(live.to(gl.int8))
            cta_barrier()
            mbarrier.arrive(full.index(slot), count=1)
            async_copy.mbarrier_arrive(full.index(slot), increment_count=False)
            w0, w1, w2, w3 = w1, w2, w3, w4
            b0, b1 = b1, b2
