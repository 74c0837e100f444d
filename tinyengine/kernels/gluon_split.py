"""Pieces of the Gluon split-KV decode kernels (kernels/mla/gluon.py,
kernels/sparse_attention/gluon.py): where a split's whole tiles start and
end, what an empty split writes, and a split's normalised partial, written
by each warpgroup for the output columns it holds; and, shared with the
prefill kernel (kernels/attention/gluon.py), the zeroing of a landed page's
rows past the context.
"""

from __future__ import annotations

from tinyengine.kernels.gluon_support import HAVE_GLUON

if HAVE_GLUON:
    from tinyengine.kernels.gluon_support import (
        cta_barrier,
        fence_async_shared,
        gl,
        gluon,
    )

    @gluon.jit
    def zero_dead_rows(tile, n0, end):
        """Rows n0 + i >= end of a tile landed in shared memory set to 0, a
        quarter of the columns at a time (the whole tile would take as many
        registers again as a thread holds). Such rows may hold anything (a
        slot never written), and 0 x NaN is NaN in a P @ V product. Fenced
        for the wgmmas that read the tile next; every warp of the calling
        partition has stored its share on return."""
        ROWS: gl.constexpr = tile.type.shape[0]
        COLS: gl.constexpr = tile.type.shape[1] // 4
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (COLS // 8), COLS // 8],
                                                [gl.num_warps(), 1], [1, 0])  # fmt: skip
        live = (n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))) < end
        for c in gl.static_range(4):
            part = tile.slice(c * COLS, COLS, dim=1)
            vals = part.load(layout)
            part.store(gl.where(live[:, None], vals, gl.zeros_like(vals)))
        fence_async_shared()
        cta_barrier()

    @gluon.jit
    def split_range(total, num_splits, split, BLOCK_N: gl.constexpr):
        """[start, end) of split `split` of a key list of `total`: whole
        BLOCK_N tiles, the boundaries of the Triton kernels."""
        chunk = gl.cdiv(gl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
        start = split * chunk
        return start, gl.minimum(start + chunk, total)

    @gluon.jit
    def write_empty_split(part_lse_ptr, part_idx):
        """A split with no key: lse = -inf, so the reduce weighs it 0 and never
        loads its partial."""
        gl.store(part_lse_ptr + part_idx, gl.full(part_idx.shape, float("-inf"), gl.float32,
                                                  part_idx.type.layout))  # fmt: skip

    @gluon.jit
    def write_partial(
        acc, m_i, l_i, part_out_ptr, part_lse_ptr, part_idx, col0, ROW: gl.constexpr,
        WRITE_LSE: gl.constexpr,
    ):  # fmt: skip
        """A split's normalised partial, acc's columns as part_out[part_idx,
        col0 : col0 + acc's width] (partial rows of ROW), and, if WRITE_LSE,
        its log2-sum-exp at part_lse[part_idx] (-inf when it saw no live
        key). A kernel whose warpgroups each hold some of the output columns
        calls it from each, one of them writing the lse."""
        o_layout: gl.constexpr = acc.type.layout
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        alive = l_o > 0.0
        if WRITE_LSE:
            lse = gl.where(alive, m_o + gl.log2(gl.where(alive, l_o, 1.0)), float("-inf"))
            gl.store(part_lse_ptr + part_idx, lse)
        cols = col0 + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, o_layout))
        out = acc / gl.where(alive, l_o, 1.0)[:, None]
        gl.store(part_out_ptr + (part_idx * ROW)[:, None] + cols[None, :], out)
