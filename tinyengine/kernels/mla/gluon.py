"""MLA decode's split kernel for Hopper in Gluon, warp-specialized with
FlashMLA's division of the work: a producer warpgroup copies the query and
each 64-row page of the latent cache (TMA) into a two-slot ring; the first
consumer warpgroup computes every tile's whole score tile (QK^T over the 512
latent and 64 rope columns, N = 64) and its softmax, publishes the weights P
and the rescale factors, and applies P to its half of the 512 output
columns; the second consumer applies P to the other half.

Why one warpgroup scores. Split between two warpgroups, a tile's scores
are two N = 32 wgmmas with both operands in shared memory, which ask it for
~1.5x the bytes a cycle it delivers, and the warpgroups meet at a barrier
for every row max and sum. Scored by one, the tile is one N = 64 product
(the bytes a cycle shared memory gives), the softmax's row reductions stay
inside the warpgroup, and while the second warpgroup runs tile t's PV
product the first is already scoring tile t + 1 (docs/kernels.md,
docs/benchmarks.md).

Per tile t (slot t % 2): the first consumer waits for the page, scores it,
updates its running (max, sum), waits until the second consumer has read
P(t - 1), writes P(t) and alpha(t) = 2^(m_prev - m_new) to shared memory and
signals `ready`; each consumer then rescales its output half by alpha(t) and
adds P(t) @ C(t)[:, half]; the slot is free (`empty`, count 2) once both
have. At the end the first publishes (max, sum) through `done` for the
second's half of the partial.

A split's last page may end before its rows do: the first consumer zeroes
the rows past the context in shared memory before scoring it (they may hold
anything, and 0 x NaN is NaN); their scores are masked to -inf.

Shared memory: the query (64 + 8 KB), two ring slots of 64 latent and rope
rows (72 KB each), P (8 KB), alpha / max / sum (768 bytes): 225 of the
227 KB. No interpreter runs Gluon: GPU tests compare it with the reference.
"""

from __future__ import annotations

import torch
import triton

from tinyengine.kernels.gluon_support import HAVE_GLUON, is_hopper, launch_or_give_up

if HAVE_GLUON:
    from tinyengine.kernels.gluon_split import (
        split_range,
        write_empty_split,
        write_partial,
        zero_dead_rows,
    )
    from tinyengine.kernels.gluon_support import (
        TensorDescriptor,
        async_copy,
        cp_async_load,
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
LATENT, ROPE = 512, 64
NUM_STAGES = 2
PRODUCER_REGS = 96
CONSUMER_REGS = 168  # the second consumer's (its output half only); the first gets the rest
MAXNREG = 168  # 12 warps at launch: 65536 / 384, rounded down to a multiple of 8


def supports(
    q_latent: torch.Tensor, latent_cache: torch.Tensor, block_h: int, block_n: int, paged: bool
) -> bool:
    """Whether this kernel can run the call: Gluon present, a Hopper GPU
    (not the interpreter), 16-bit floats, DeepSeek's widths, whole 64-head
    blocks and whole pages through TMA (`paged`: kernels/mla/triton.py's
    pages_by_tma)."""
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
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.jit
    def _produce(
        q_lat_ptr, q_rope_ptr, seq, head_block, stride_qlb, stride_qlh, stride_qrb, stride_qrh,
        lat_desc, rope_desc, bt_row, start, num_tiles, q_smem, qr_smem, q_full, lat_ring,
        rope_ring, full, empty,
        LATENT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
    ):  # fmt: skip
        """The query (cp.async, arriving on q_full), then each tile's page
        lookup and, once both consumers have released its slot, its TMA
        copies (arriving on the slot's `full` with their byte count)."""
        num_stages: gl.constexpr = lat_ring.type.shape[0]
        l_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        r_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, l_layout))
        cols = gl.arange(0, LATENT, layout=gl.SliceLayout(0, l_layout))
        cp_async_load(q_smem, q_lat_ptr + seq * stride_qlb + heads[:, None] * stride_qlh
                      + cols[None, :])  # fmt: skip
        heads_r = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, r_layout))
        cols_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, r_layout))
        cp_async_load(qr_smem, q_rope_ptr + seq * stride_qrb + heads_r[:, None] * stride_qrh
                      + cols_r[None, :])  # fmt: skip
        async_copy.mbarrier_arrive(q_full, increment_count=False)
        for t in range(num_tiles):
            slot = t % num_stages
            n = start + t * BLOCK_N
            row = gl.load(bt_row + n // BLOCK_SIZE) * BLOCK_SIZE + n % BLOCK_SIZE
            mbarrier.wait(empty.index(slot), ((t // num_stages) & 1) ^ 1)
            mbarrier.expect(
                full.index(slot), lat_desc.block_type.nbytes + rope_desc.block_type.nbytes
            )
            tma_load(lat_desc, [row, 0], full.index(slot), lat_ring.index(slot))
            tma_load(rope_desc, [row, 0], full.index(slot), rope_ring.index(slot))

    @gluon.jit
    def _score(
        q_smem, qr_smem, q_full, lat_ring, rope_ring, full, empty, p_smem, alpha_smem, m_smem,
        l_smem, ready, pfree, done, qk_scale, start, end, num_tiles, seq, head_block, num_heads,
        out_ptr, part_out_ptr, part_lse_ptr, num_splits, split, stride_ob, stride_oh,
        LATENT: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """The first consumer: every tile's scores and softmax, P and alpha
        published, output columns [0, L/2)."""
        HALF: gl.constexpr = LATENT // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
        )
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        num_stages: gl.constexpr = lat_ring.type.shape[0]
        acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
        mbarrier.wait(q_full, 0)
        fence_async_shared()  # the query came through cp.async; the wgmmas read it
        for t in range(num_tiles):
            slot = t % num_stages
            mbarrier.wait(full.index(slot), (t // num_stages) & 1)
            lat = lat_ring.index(slot)
            n0 = start + t * BLOCK_N
            if n0 + BLOCK_N > end:  # the split's partial last page
                zero_dead_rows(lat, n0, end)
            s = warpgroup_mma(q_smem, lat.permute((1, 0)), s_zero, use_acc=False)
            s = warpgroup_mma(qr_smem, rope_ring.index(slot).permute((1, 0)), s)
            s = gl.where((n0 + cols < end)[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            # P and alpha are free once the second consumer has read tile t - 1's.
            mbarrier.wait(pfree, (t - 1) & 1, pred=t > 0)
            p_smem.store(p.to(p_smem.dtype))
            alpha_smem.store(alpha)
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(ready, count=1)
            acc = acc * alpha_smem.load(row_o)[:, None]
            acc = warpgroup_mma(p_smem, lat.slice(0, HALF, dim=1), acc)
            cta_barrier()  # every warp's share of the product has read the slot
            mbarrier.arrive(empty.index(slot), count=1)
        # The final (max, sum) go through shared memory for both consumers,
        # which read them in the output's layout: a convert_layout would want
        # scratch the full shared memory does not have.
        m_smem.store(m_i)
        l_smem.store(l_i)
        cta_barrier()
        mbarrier.arrive(done, count=1)
        _write_half(acc, m_smem.load(row_o), l_smem.load(row_o), seq, head_block, num_heads,
                    out_ptr, part_out_ptr, part_lse_ptr, num_splits, split, stride_ob, stride_oh,
                    0, LATENT, BLOCK_H, DIRECT)  # fmt: skip

    @gluon.jit
    def _apply_half(
        lat_ring, full, empty, p_smem, alpha_smem, m_smem, l_smem, ready, pfree, done,
        num_tiles, seq, head_block, num_heads, out_ptr, part_out_ptr, part_lse_ptr, num_splits,
        split, stride_ob, stride_oh,
        LATENT: gl.constexpr, BLOCK_H: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """The second consumer: every tile's P applied to output columns
        [L/2, L)."""
        HALF: gl.constexpr = LATENT // 2
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
        )
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        num_stages: gl.constexpr = lat_ring.type.shape[0]
        acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
        for t in range(num_tiles):
            slot = t % num_stages
            # `ready` implies the page landed; the wait on `full` is what makes
            # the TMA's writes visible to this warpgroup's wgmma.
            mbarrier.wait(full.index(slot), (t // num_stages) & 1)
            mbarrier.wait(ready, t & 1)
            fence_async_shared()
            acc = acc * alpha_smem.load(row_o)[:, None]
            acc = warpgroup_mma(p_smem, lat_ring.index(slot).slice(HALF, HALF, dim=1), acc)
            cta_barrier()  # every warp's share of the product has read P and the slot
            mbarrier.arrive(pfree, count=1)
            mbarrier.arrive(empty.index(slot), count=1)
        mbarrier.wait(done, 0)
        _write_half(acc, m_smem.load(row_o), l_smem.load(row_o), seq, head_block, num_heads,
                    out_ptr, part_out_ptr, part_lse_ptr, num_splits, split, stride_ob, stride_oh,
                    1, LATENT, BLOCK_H, DIRECT)  # fmt: skip

    @gluon.jit
    def _write_half(
        acc, m_o, l_o, seq, head_block, num_heads, out_ptr, part_out_ptr, part_lse_ptr,
        num_splits, split, stride_ob, stride_oh,
        W: gl.constexpr, LATENT: gl.constexpr, BLOCK_H: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """Output half W of the program: `out` (DIRECT) or the split's
        partial, the first half also writing its log2-sum-exp."""
        HALF: gl.constexpr = LATENT // 2
        o_layout: gl.constexpr = acc.type.layout
        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        if DIRECT:
            # l == 0 only for an empty context (seq_len 0, a padding row): output 0.
            out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
            cols_o = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
            o_rows = out_ptr + seq * stride_ob + heads[:, None] * stride_oh
            gl.store(o_rows + cols_o[None, :], out.to(out_ptr.dtype.element_ty))
        else:
            part_idx = (seq * num_heads + heads).to(gl.int64) * num_splits + split
            write_partial(acc, m_o, l_o, part_out_ptr, part_lse_ptr, part_idx, W * HALF, LATENT,
                          W == 0)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_splits"])  # one compile for any split count
    def _mla_split_gluon(
        q_lat_ptr, q_rope_ptr, lat_desc, rope_desc, block_tables_ptr, seq_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr,
        qk_scale, num_splits, num_heads,
        stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_bt, stride_ob, stride_oh,
        LATENT: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr,
        NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """Grid (H / BLOCK_H, B, num_splits); 4 warps here (the first
        consumer) and two 4-warp workers (the second consumer, the
        producer). The outputs of kernels/mla/split.py's _mla_split_kernel
        (DIRECT: `out`; else the partials and log2-sum-exps the reduce
        merges; an empty split writes lse = -inf)."""
        dtype: gl.constexpr = q_lat_ptr.dtype.element_ty
        head_block = gl.program_id(0)
        seq = gl.program_id(1).to(gl.int64)
        split = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + seq)
        start, end = split_range(seq_len, num_splits, split, BLOCK_N)
        if not DIRECT:
            if start >= end:
                lse_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
                heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=lse_layout)
                write_empty_split(part_lse_ptr, (seq * num_heads + heads) * num_splits + split)
                return
        num_tiles = gl.cdiv(end - start, BLOCK_N)
        bt_row = block_tables_ptr + seq * stride_bt

        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LATENT], dtype)
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
        stat_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        bar_l: gl.constexpr = mbarrier.MBarrierLayout()
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LATENT], q_sl)
        qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], qr_sl)
        lat_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, LATENT], lat_desc.layout)
        rope_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, ROPE], rope_desc.layout)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)
        alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], stat_sl)
        m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], stat_sl)
        l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], stat_sl)
        q_full = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l)
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l)
        ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        pfree = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        done = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        mbarrier.init(q_full, count=128)  # the producer's threads (cp.async arrivals)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(full.index(i), count=1)  # the expect-tx arrival; TMA adds the bytes
            mbarrier.init(empty.index(i), count=2)  # one per output half
        mbarrier.init(ready, count=1)
        mbarrier.init(pfree, count=1)
        mbarrier.init(done, count=1)
        fence_async_shared()

        gl.warp_specialize(
            [
                (_score, (
                    q_smem, qr_smem, q_full, lat_ring, rope_ring, full, empty, p_smem,
                    alpha_smem, m_smem, l_smem, ready, pfree, done, qk_scale, start, end,
                    num_tiles, seq, head_block, num_heads, out_ptr, part_out_ptr, part_lse_ptr,
                    num_splits, split, stride_ob, stride_oh, LATENT, BLOCK_H, BLOCK_N, DIRECT,
                )),
                (_apply_half, (
                    lat_ring, full, empty, p_smem, alpha_smem, m_smem, l_smem, ready, pfree,
                    done, num_tiles, seq, head_block, num_heads, out_ptr, part_out_ptr,
                    part_lse_ptr, num_splits, split, stride_ob, stride_oh, LATENT, BLOCK_H,
                    DIRECT,
                )),
                (_produce, (
                    q_lat_ptr, q_rope_ptr, seq, head_block, stride_qlb, stride_qlh, stride_qrb,
                    stride_qrh, lat_desc, rope_desc, bt_row, start, num_tiles, q_smem, qr_smem,
                    q_full, lat_ring, rope_ring, full, empty,
                    LATENT, ROPE, BLOCK_H, BLOCK_N, BLOCK_SIZE,
                )),
            ],
            [4, 4],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )  # fmt: skip


_compile_failed: list[str] = []  # the first compile error, once one happened


def launch_split(
    q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, qk_scale: float, num_splits: int,
    out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
) -> None:  # fmt: skip
    """The split kernel over a call `supports` accepted; qk_scale is in
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
        LATENT=LATENT, ROPE=ROPE, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        BLOCK_SIZE=block_size, DIRECT=num_splits == 1, NUM_STAGES=NUM_STAGES,
    )  # fmt: skip
    launch_or_give_up(
        lambda: _mla_split_gluon[grid](*args, **consts, num_warps=4, maxnreg=MAXNREG),
        "MLA decode",
        _compile_failed,
    )
