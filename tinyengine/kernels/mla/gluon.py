"""MLA decode's split kernel for Hopper in Gluon (Triton's lower-level
dialect, where the kernel chooses its own layouts and shared memory): the one
tile DeepSeek-V3 decode runs on Hopper (64 heads x 64 latent rows, L=512,
R=64, bf16/fp16, 64-token cache pages), written so both warpgroups share the
work instead of repeating it.

Why it exists. In the Triton kernel (kernels/mla/triton.py) the compiler lays
out the QK product, whose result feeds the PV product in the same iteration,
with all 8 warps along its 64 rows, so both warpgroups compute the same QK
product and softmax (~1.5x the MMA work). Here the layouts are explicit:

    S   [64 heads, 64 rows]  NVMMA v3, warps [4, 2]: the warpgroups split the
                             64 columns (32 each), each with all 64 heads;
    O   [64 heads, 512]      NVMMA v3, warps [4, 2]: each warpgroup owns 256
                             of the 512 output columns.

Both layouts split the rows the same way, so the softmax statistics (row
max, row sum, rescale factor) move between them without data movement, and
the weights P reach the PV product through shared memory: each warpgroup
writes its half of P, a fence and a CTA barrier make it visible to the
tensor cores, and each warpgroup multiplies all of P by its half of the tile.
Doing the QK product once makes it about 1.4x faster than the Triton kernel
at 128 heads (docs/benchmarks.md, MLA decode in Gluon).

One program = (64 heads, sequence, split), as in the Triton kernel, whose
reduce merges the splits. Per tile: a TMA copy of the page's latent and rope
rows into a two-slot ring (mbarrier-tracked; the copy of tile t + 1 is issued
before tile t is waited on), scores = q_lat @ c^T + q_rope @ r^T (wgmma from
shared memory), an eager online softmax in the log2 domain, acc += P @ c. A
split's last tile may end before its page does: its rows past the context
are zeroed in shared memory before the PV product (they may hold anything,
and 0 x NaN is NaN), and their scores are masked to -inf.

Shared memory at DeepSeek's widths: the query (72 KB), two ring slots (144
KB), P (8 KB): 224 of the 227 KB a block may use on sm_90, so this kernel has
exactly one tile shape; `supports` says when it applies, and everything else
runs the Triton kernel. No interpreter runs Gluon: CPU tests cover the Triton
kernel, and GPU tests compare this one with the reference and with it.
"""

from __future__ import annotations

import torch
import triton

from tinyengine.kernels.gluon_support import (
    HAVE_GLUON,
    is_hopper,
    launch_or_give_up,
)

if HAVE_GLUON:
    from tinyengine.kernels.gluon_split import (
        softmax_pv,
        split_range,
        write_empty_split,
        write_partial,
    )
    from tinyengine.kernels.gluon_support import (
        TensorDescriptor,
        cta_barrier,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma_load,
        warpgroup_mma,
    )

BLOCK_H = 64  # heads per program: the M of one wgmma
BLOCK_N = 64  # latent rows per tile = one page of a 64-token cache block
LATENT, ROPE = 512, 64  # the widths whose shared-memory budget was sized
NUM_STAGES = 2  # ring slots: two [64, 576] tiles + the query fill the SM


def supports(
    q_latent: torch.Tensor, latent_cache: torch.Tensor, block_h: int, block_n: int, paged: bool
) -> bool:
    """Whether this kernel can run the call: Gluon present, a Hopper GPU
    (not the interpreter), 16-bit floats, DeepSeek's widths, whole 64-head
    blocks and whole pages through TMA (`paged`: kernels/mla/triton.py's pages_by_tma)."""
    if not HAVE_GLUON or _compile_failed or q_latent.device.type != "cuda":
        return False
    num_heads, latent_dim = q_latent.shape[1], q_latent.shape[2]
    return (
        is_hopper(q_latent.device.index)
        and latent_cache.dtype in (torch.bfloat16, torch.float16)
        and q_latent.dtype == latent_cache.dtype
        and (latent_dim, latent_cache.shape[3] - latent_dim) == (LATENT, ROPE)
        and (block_h, block_n) == (BLOCK_H, BLOCK_N)
        and num_heads % BLOCK_H == 0
        and paged
    )


if HAVE_GLUON:

    @gluon.jit
    def _issue_tile(lat_desc, rope_desc, bt_row, n, bar, lat_buf, rope_buf, pred,
                    BLOCK_SIZE: gl.constexpr):  # fmt: skip
        """TMA copies of context rows n .. n + BLOCK_N (one page) into a ring
        slot, completing on `bar`; nothing at all when `pred` is False."""
        row = gl.load(bt_row + n // BLOCK_SIZE, mask=pred, other=0) * BLOCK_SIZE + n % BLOCK_SIZE
        mbarrier.expect(bar, lat_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=pred)
        tma_load(lat_desc, [row, 0], bar, lat_buf, pred=pred)
        tma_load(rope_desc, [row, 0], bar, rope_buf, pred=pred)

    @gluon.jit(do_not_specialize=["num_splits"])  # one compile for any split count
    def _mla_split_gluon(
        q_lat_ptr, q_rope_ptr, lat_desc, rope_desc, block_tables_ptr, seq_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr,
        qk_scale, num_splits, num_heads,
        stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_bt, stride_ob, stride_oh,
        LATENT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """Grid (H / BLOCK_H, B, num_splits), 8 warps; the same outputs as
        kernels/mla/split.py's _mla_split_kernel (DIRECT: `out`; else the partials and
        log2-sum-exps the reduce merges; an empty split writes lse = -inf)."""
        dtype: gl.constexpr = q_lat_ptr.dtype.element_ty
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, LATENT // 2, 16]
        )
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LATENT], dtype)
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)

        head_block = gl.program_id(0)
        seq = gl.program_id(1)
        split = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + seq)
        start, end = split_range(seq_len, num_splits, split, BLOCK_N)
        heads_o = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        part_idx = (seq * num_heads + heads_o).to(gl.int64) * num_splits + split
        if not DIRECT:
            if start >= end:
                write_empty_split(part_lse_ptr, part_idx)
                return

        # The query's loads go out first and the first tile's copy is issued
        # before they are used: the block-table read, the copy and the query
        # read overlap instead of following each other (at batch 1 a program
        # walks two tiles, so this latency is much of its time).
        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows_layout))
        offs_l = gl.arange(0, LATENT, layout=gl.SliceLayout(0, rows_layout))
        offs_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, rows_layout))
        q = gl.load(q_lat_ptr + seq.to(gl.int64) * stride_qlb + heads[:, None] * stride_qlh
                    + offs_l[None, :])  # fmt: skip
        qr = gl.load(q_rope_ptr + seq.to(gl.int64) * stride_qrb + heads[:, None] * stride_qrh
                     + offs_r[None, :])  # fmt: skip
        lat_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, LATENT], lat_desc.layout)
        rope_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, ROPE], rope_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()

        bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
        num_tiles = gl.cdiv(end - start, BLOCK_N)
        for i in gl.static_range(NUM_STAGES - 1):
            _issue_tile(
                lat_desc, rope_desc, bt_row, start + i * BLOCK_N, bars.index(i),
                lat_ring.index(i), rope_ring.index(i), i < num_tiles, BLOCK_SIZE,
            )  # fmt: skip
        # The query block into shared memory: the A operand of the QK wgmma
        # (the loop's first CTA barrier orders these stores before it).
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LATENT], q_sl, q)
        qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], qr_sl, qr)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)
        fence_async_shared()

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_H, LATENT], gl.float32, o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        for t in range(num_tiles):
            # Every warp is done with tile t - 1 (its ring slot, p_smem), so
            # the slot takes tile t + NUM_STAGES - 1 now.
            cta_barrier()
            ahead = t + NUM_STAGES - 1
            ring = ahead % NUM_STAGES
            _issue_tile(
                lat_desc, rope_desc, bt_row, start + ahead * BLOCK_N, bars.index(ring),
                lat_ring.index(ring), rope_ring.index(ring), ahead < num_tiles, BLOCK_SIZE,
            )  # fmt: skip
            slot = t % NUM_STAGES
            mbarrier.wait(bars.index(slot), (t // NUM_STAGES) & 1)
            lat = lat_ring.index(slot)
            n0 = start + t * BLOCK_N
            if n0 + BLOCK_N > end:  # the partial last tile: zero its dead rows
                live = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows_layout))) < end
                tile = lat.load(rows_layout)
                lat.store(gl.where(live[:, None], tile, gl.zeros_like(tile)))
                fence_async_shared()
                cta_barrier()
            s = warpgroup_mma(q_smem, lat.permute((1, 0)), s_zero, use_acc=False)
            s = warpgroup_mma(qr_smem, rope_ring.index(slot).permute((1, 0)), s)
            s = gl.where((n0 + cols < end)[None, :], s * qk_scale, float("-inf"))
            acc, m_i, l_i = softmax_pv(s, m_i, l_i, acc, p_smem, lat)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(i))

        if DIRECT:
            # l_i == 0 only for an empty context (seq_len 0, a padding row): output 0.
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
            cols_o = gl.arange(0, LATENT, layout=gl.SliceLayout(0, o_layout))
            o_rows = out_ptr + seq.to(gl.int64) * stride_ob + heads_o[:, None] * stride_oh
            gl.store(o_rows + cols_o[None, :], out.to(out_ptr.dtype.element_ty))
        else:
            write_partial(acc, m_i, l_i, part_out_ptr, part_lse_ptr, part_idx, 0, LATENT, True)


_compile_failed: list[str] = []  # the first compile error, once one happened


def launch_split(
    q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, qk_scale: float, num_splits: int,
    out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
) -> None:  # fmt: skip
    """The split kernel over a cache `supports` accepted; qk_scale is in
    log2 units (scale * log2(e)). Descriptors: the cache viewed as [rows, L]
    and [rows, R], 128-byte swizzled tiles of one page."""
    num_seqs, num_heads, _ = q_latent.shape
    block_size = latent_cache.shape[1]
    rows, row_stride = latent_cache.shape[0] * block_size, latent_cache.stride(1)
    bits = latent_cache.element_size() * 8
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)
    lat_desc = TensorDescriptor(
        latent_cache[..., :LATENT], [rows, LATENT], [row_stride, 1], [BLOCK_N, LATENT], layout
    )
    rope_desc = TensorDescriptor(
        latent_cache[..., LATENT:], [rows, ROPE], [row_stride, 1], [BLOCK_N, ROPE], layout
    )
    grid = (triton.cdiv(num_heads, BLOCK_H), num_seqs, num_splits)
    args = (
        q_latent, q_rope, lat_desc, rope_desc, block_tables, seq_lens, out, part_out, part_lse,
        qk_scale, num_splits, num_heads, q_latent.stride(0), q_latent.stride(1),
        q_rope.stride(0), q_rope.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
    )  # fmt: skip
    consts = dict(
        LATENT=LATENT, ROPE=ROPE, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_SIZE=block_size,
        DIRECT=num_splits == 1, NUM_STAGES=NUM_STAGES,
    )  # fmt: skip
    launch_or_give_up(
        lambda: _mla_split_gluon[grid](*args, **consts, num_warps=8), "MLA decode", _compile_failed
    )
