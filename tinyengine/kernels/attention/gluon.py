"""Paged causal prefill attention for Hopper in Gluon, warp-specialized in
the manner of FlashAttention-3: a producer warp copies the query tile once,
then each 128-key tile of K and of V page by page (TMA) into two-slot rings;
two consumer warpgroups, each owning 64 of the tile's 128 query rows, run
the QK^T and PV wgmmas and the online softmax. The same outputs as
kernels/attention/kernels.py's `_prefill_kernel` (up to the online
softmax's order of tiles); kernels/attention/triton.py picks this kernel
for long prefills where `supports` says yes.

The consumer's loop, per key tile j (FlashAttention-3's intra-warpgroup
overlap): issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, both
async; wait for S_j alone; the softmax of S_j (mask on the diagonal tiles,
row max, exp2, row sum) while the PV product is still on the tensor cores;
then wait for it, rescale O and convert P_j to 16 bits for the next
iteration. K and V have rings of their own: a K slot is free once its QK
product is done, a V slot once its PV product is, so the producer runs
further ahead on K.

Ping-pong between the two consumers (the `turn` barriers): a warpgroup
issues its products of an iteration only after the other has issued its
own of the iteration before, so the two alternate, one's softmax under the
other's MMAs, instead of drifting into step and leaving the tensor cores
idle while both run exp2.

Pages: a 128-key tile is 128 / block_size pages, each one TMA box from a
descriptor over the cache viewed as 2-D [blocks * block_size, columns]
(`_rows_ok`: head h at column h * stride, so the engine's cache, which
keeps a head's K and V side by side, is read in place). Rows past the
sequence's end may hold anything (a slot not yet written, a page the block
table does not name: the producer then copies block 0), and 0 x NaN is NaN
in the PV product, so on a tile that reaches past the end the first
consumer zeroes those V rows in shared memory once they land and signals
`zeroed` before either consumer applies P (their scores are masked to
-inf, which `where` makes exact whatever K holds).

Grid (query heads, q tiles), q tiles numbered as in kernels.py (whose
binary search, `_find_seq`, finds a tile's sequence here too) and run
heaviest first (a prompt's last tiles see the most keys); the GPU starts
programs head fastest, so the heads sharing a KV head read its tiles at
about the same time (L2 hits). Query rows past their sequence are the
next sequence's rows or TMA's zero fill: their position is clamped to the
last live row's (finite scores) and they are never stored.

Shared memory: Q 32 KB, two slots each of K and V tiles (32 KB each): 160
KB. No interpreter runs Gluon: GPU tests compare it with the reference.
"""

from __future__ import annotations

import functools

import torch
import triton

from tinyengine.kernels.gluon_support import HAVE_GLUON, is_hopper, launch_or_give_up

if HAVE_GLUON:
    from tinyengine.kernels.attention.kernels import _find_seq
    from tinyengine.kernels.gluon_split import zero_dead_rows
    from tinyengine.kernels.gluon_support import (
        TensorDescriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma_load,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

BLOCK_M = 128  # query rows a program: 64 a consumer warpgroup (one wgmma M)
BLOCK_N = 128  # keys a tile
HEAD_DIM = 128
NUM_STAGES = 2
MIN_QUERY_LEN = 128  # shorter prefills (mixed decode batches, short chunks) stay on Triton
CONSUMER_REGS = 240  # the second consumer's; the first gets the rest
PRODUCER_REGS = 32
MAXNREG = 168  # 12 warps at launch (65536 / 384, a multiple of 8)

_compile_failed: list[str] = []


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             indices: tuple[torch.Tensor, ...], max_query_len: int) -> bool:  # fmt: skip
    """Whether this kernel can run the call: Gluon on a Hopper GPU, 16-bit
    floats, 128-wide heads, prefills of at least MIN_QUERY_LEN tokens, pages
    that divide a 128-key tile, tensors a 2-D descriptor can address
    (`_rows_ok`; K and V alike), and int32
    `indices` (block table, query starts, sequence lengths; the engine's):
    the TMA coordinates built from them are 32-bit."""
    if not HAVE_GLUON or _compile_failed or q.device.type != "cuda":
        return False
    block_size = k_cache.shape[1]
    return (
        is_hopper(q.device.index)
        and q.dtype in (torch.bfloat16, torch.float16)
        and k_cache.dtype == v_cache.dtype == q.dtype
        and q.shape[2] == k_cache.shape[3] == v_cache.shape[3] == HEAD_DIM
        and max_query_len >= MIN_QUERY_LEN
        and 8 <= block_size <= BLOCK_N
        and BLOCK_N % block_size == 0
        and all(_rows_ok(t) for t in (q, k_cache, v_cache))
        and k_cache.stride() == v_cache.stride()
        and all(t.dtype == torch.int32 for t in indices)
    )


def _rows_ok(t: torch.Tensor) -> bool:
    """t [..., rows, heads, D] viewable as a 2-D [rows, columns] whose head
    h starts at column h * t.stride(-2): each head's D contiguous, heads
    evenly strided (the engine's cache keeps a head's K and V side by side,
    so K's heads are 2 D apart), rows evenly strided (a cache's blocks
    abut), all 16-byte aligned as TMA needs."""
    # One stride() and one shape read: called per layer per prefill step,
    # where each tensor method call costs host time.
    shape, stride = t.shape, t.stride()
    heads, d, row_stride, head_stride = shape[-2], shape[-1], stride[-3], stride[-2]
    within_row = (
        stride[-1] == 1 and d <= head_stride and (heads - 1) * head_stride + d <= row_stride
    )
    abut = len(shape) == 3 or stride[0] == shape[1] * row_stride
    size = t.element_size()
    aligned = (row_stride * size) % 16 == 0 and (head_stride * size) % 16 == 0
    return within_row and abut and aligned and t.data_ptr() % 16 == 0


if HAVE_GLUON:
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
    _BLOCK_N = gl.constexpr(BLOCK_N)

    @gluon.jit
    def _tile_of_program(query_start_loc, seq_lens, num_seqs, BLOCK: gl.constexpr):
        """(live, first query row, query rows, first row's position, keys
        the tile reads, sequence length, sequence) of this program's q tile."""
        tile_id = gl.num_programs(1) - 1 - gl.program_id(1)
        seq = _find_seq(tile_id, query_start_loc, num_seqs, BLOCK)
        q_start = gl.load(query_start_loc + seq)
        q_len = gl.load(query_start_loc + seq + 1) - q_start
        q_tile = tile_id - (q_start // BLOCK + seq)
        seq_len = gl.load(seq_lens + seq)
        first_pos = seq_len - q_len + q_tile * BLOCK
        kv_end = gl.minimum(first_pos + BLOCK, seq_len)
        live = q_tile * BLOCK < q_len
        row0 = q_start + q_tile * BLOCK
        return live, row0, q_len - q_tile * BLOCK, first_pos, kv_end, seq_len, seq

    @gluon.jit
    def _copy_tile(
        desc, ring, full, empty, bt_row, j, live_pages, kv_col, BLOCK_SIZE: gl.constexpr
    ):
        """Key tile j's pages (block 0 for pages past the sequence's) into
        its ring slot, once both consumers have freed it."""
        N: gl.constexpr = ring.type.shape[1]
        stages: gl.constexpr = ring.type.shape[0]
        PAGES: gl.constexpr = N // BLOCK_SIZE
        s = j % stages
        mbarrier.wait(empty.index(s), ((j // stages) & 1) ^ 1)
        mbarrier.expect(full.index(s), PAGES * desc.block_type.nbytes)
        for p in gl.static_range(PAGES):
            page = j * PAGES + p
            blk = gl.load(bt_row + page, mask=page < live_pages, other=0)
            dst = ring.index(s).slice(p * BLOCK_SIZE, BLOCK_SIZE, dim=0)
            tma_load(desc, [blk * BLOCK_SIZE, kv_col], full.index(s), dst)

    @gluon.jit
    def _produce(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_full, k_full, v_full,
                 k_empty, v_empty, bt_row, row0, q_col, kv_col, kv_end, seq_len,
                 BLOCK_SIZE: gl.constexpr):  # fmt: skip
        """The producer warp: the query tile, then each key tile's K, then
        its V, each into its own ring: a K slot frees as soon as its QK
        product is done, a V slot only after its PV product, so K runs
        further ahead."""
        mbarrier.expect(q_full, q_desc.block_type.nbytes)
        tma_load(q_desc, [row0, q_col], q_full, q_smem)
        live_pages = gl.cdiv(seq_len, BLOCK_SIZE)
        for j in range(gl.cdiv(kv_end, k_ring.type.shape[1])):
            _copy_tile(k_desc, k_ring, k_full, k_empty, bt_row, j, live_pages, kv_col, BLOCK_SIZE)
            _copy_tile(v_desc, v_ring, v_full, v_empty, bt_row, j, live_pages, kv_col, BLOCK_SIZE)

    @gluon.jit
    def _take_turn(turn, window, WG: gl.constexpr):
        """Wait until the other warpgroup has issued its products of the
        window before this one: warpgroup 0 issues window w after warpgroup
        1's window w - 1, warpgroup 1 after warpgroup 0's window w."""
        if WG == 0:
            if window > 0:
                mbarrier.wait(turn.index(0), (window - 1) & 1)
        else:
            mbarrier.wait(turn.index(1), window & 1)

    @gluon.jit
    def _pass_turn(turn, WG: gl.constexpr):
        mbarrier.arrive(turn.index(1 - WG), count=1)

    @gluon.jit
    def _softmax_step(s, m_i, l_i, n0, n_full, j, q_pos, cols, qk_scale):
        """Mask (diagonal tiles), then the online softmax in log2 units:
        (p, alpha, m, l)."""
        if j >= n_full:
            s = gl.where((n0 + cols)[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _zero_if_past(v, v_bar, v_phase, zeroed, n0, seq_len, WG: gl.constexpr):
        """V rows past the sequence: zeroed once, by warpgroup 0, after they land."""
        N: gl.constexpr = v.type.shape[0]
        if n0 + N > seq_len:
            mbarrier.wait(v_bar, v_phase)
            if WG == 0:
                zero_dead_rows(v, n0, seq_len)
                mbarrier.arrive(zeroed, count=1)
            else:
                mbarrier.wait(zeroed, 0)

    @gluon.jit
    def _attend(q_smem, k_ring, v_ring, q_full, k_full, v_full, k_empty, v_empty, zeroed, turn,
                out_ptr, stride_ot, stride_oh, row0, q_rows, first_pos, kv_end, seq_len, head,
                qk_scale, WG: gl.constexpr):  # fmt: skip
        """Consumer warpgroup WG: query rows [64 WG, 64 WG + 64) of the tile
        over every key tile, then their normalized output. Tile j's QK
        product is issued together with tile j-1's PV product, and the
        softmax of tile j runs while that PV product is on the tensor cores
        (FlashAttention-3's intra-warpgroup overlap)."""
        HALF: gl.constexpr = q_smem.type.shape[0] // 2
        D: gl.constexpr = q_smem.type.shape[1]
        N: gl.constexpr = k_ring.type.shape[1]
        stages: gl.constexpr = k_ring.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_smem.dtype
        q = q_smem.slice(WG * HALF, HALF, dim=0)
        rows = WG * HALF + gl.arange(0, HALF, layout=row_s)
        # Rows past the sequence take the last live row's position.
        q_pos = first_pos + gl.minimum(rows, q_rows - 1)
        cols = gl.arange(0, N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([HALF, N], gl.float32, s_layout)
        n_tiles = gl.cdiv(kv_end, N)
        n_full = (first_pos + 1) // N  # tiles every row of the program sees whole
        mbarrier.wait(q_full, 0)
        # Tile 0: its QK product alone.
        mbarrier.wait(k_full.index(0), 0)
        _take_turn(turn, 0, WG)
        s = warpgroup_mma(q, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)  # fmt: skip
        _pass_turn(turn, WG)
        s = warpgroup_mma_wait(0, deps=[s])
        mbarrier.arrive(k_empty.index(0), count=1)
        m_i = gl.full([HALF], float("-inf"), gl.float32, row_s)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, gl.zeros([HALF], gl.float32, row_s), 0,
                                           n_full, 0, q_pos, cols, qk_scale)  # fmt: skip
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        _zero_if_past(v_ring.index(0), v_full.index(0), 0, zeroed, 0, seq_len, WG)
        acc = gl.zeros([HALF, D], gl.float32, o_layout)
        for j in range(1, n_tiles):
            s_idx = j % stages
            prev = (j - 1) % stages
            mbarrier.wait(k_full.index(s_idx), (j // stages) & 1)
            _take_turn(turn, j, WG)
            s = warpgroup_mma(q, k_ring.index(s_idx).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)  # fmt: skip
            mbarrier.wait(v_full.index(prev), ((j - 1) // stages) & 1)
            acc = warpgroup_mma(p_op, v_ring.index(prev), acc, is_async=True)
            _pass_turn(turn, WG)
            s = warpgroup_mma_wait(1, deps=[s])  # this tile's QK; the PV may still run
            mbarrier.arrive(k_empty.index(s_idx), count=1)
            n0 = j * N
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, n0, n_full, j, q_pos, cols, qk_scale)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            _zero_if_past(v_ring.index(s_idx), v_full.index(s_idx), (j // stages) & 1, zeroed,
                          n0, seq_len, WG)  # fmt: skip
        # The last tile's PV product.
        last = (n_tiles - 1) % stages
        mbarrier.wait(v_full.index(last), ((n_tiles - 1) // stages) & 1)
        _take_turn(turn, n_tiles, WG)
        acc = warpgroup_mma(p_op, v_ring.index(last), acc, is_async=True)
        _pass_turn(turn, WG)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(v_empty.index(last), count=1)
        out = acc / gl.convert_layout(l_i, row_o)[:, None]
        o_rows = WG * HALF + gl.arange(0, HALF, layout=row_o)
        o_cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        ptrs = (out_ptr + (row0 + o_rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh
                + o_cols[None, :])  # fmt: skip
        gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=(o_rows < q_rows)[:, None])

    @gluon.jit
    def _attend_second(q_smem, k_ring, v_ring, q_full, k_full, v_full, k_empty, v_empty, zeroed,
                       turn, out_ptr, stride_ot, stride_oh, row0, q_rows, first_pos, kv_end,
                       seq_len, head, qk_scale):  # fmt: skip
        _attend(q_smem, k_ring, v_ring, q_full, k_full, v_full, k_empty, v_empty, zeroed, turn,
                out_ptr, stride_ot, stride_oh, row0, q_rows, first_pos, kv_end, seq_len, head,
                qk_scale, 1)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_seqs"])
    def _prefill_gluon(
        q_desc, k_desc, v_desc, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        qk_scale, num_seqs, stride_ot, stride_oh, stride_bt, stride_qh, stride_kvh,
        GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """Grid (Hq, q tiles upper bound); 4 warps (the first consumer), a
        second 4-warp consumer and the producer warp."""
        BLOCK: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        N: gl.constexpr = _BLOCK_N
        head = gl.program_id(0)
        kv_head = head // GROUP
        live, row0, q_rows, first_pos, kv_end, seq_len, seq = _tile_of_program(
            query_start_loc_ptr, seq_lens_ptr, num_seqs, BLOCK)  # fmt: skip
        if not live:
            return  # a spare program: the grid is an upper bound on the tile count
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK, D], q_desc.layout)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, D], dtype)
        k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, N, D], kv_layout)
        v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, N, D], kv_layout)
        bar_l: gl.constexpr = mbarrier.MBarrierLayout()
        q_full = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        zeroed = gl.allocate_shared_memory(gl.int64, [1], bar_l)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        k_full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l)
        v_full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l)
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l)
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l)
        mbarrier.init(q_full, count=1)
        mbarrier.init(zeroed, count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_full.index(i), count=1)  # the expect-tx arrival
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one per consumer
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()
        bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
        gl.warp_specialize(
            [
                (_attend, (
                    q_smem, k_ring, v_ring, q_full, k_full, v_full, k_empty, v_empty, zeroed,
                    turn, out_ptr, stride_ot, stride_oh, row0, q_rows, first_pos, kv_end,
                    seq_len, head, qk_scale, 0,
                )),
                (_attend_second, (
                    q_smem, k_ring, v_ring, q_full, k_full, v_full, k_empty, v_empty, zeroed,
                    turn, out_ptr, stride_ot, stride_oh, row0, q_rows, first_pos, kv_end,
                    seq_len, head, qk_scale,
                )),
                (_produce, (
                    q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_full, k_full, v_full,
                    k_empty, v_empty, bt_row, row0, head * stride_qh, kv_head * stride_kvh,
                    kv_end, seq_len, BLOCK_SIZE,
                )),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )  # fmt: skip


@functools.cache
def _layout(smem: tuple[int, int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The 128-byte swizzled layout of a [smem] tile, made once: building it
    costs more host time than the descriptor it goes into, and a prefill
    step builds three descriptors a layer (its attention runs outside CUDA
    graphs). The descriptors themselves are not kept: each holds its tensor,
    and one kept for a KV cache would keep that cache alive."""
    return gl.NVMMASharedLayout.get_default_for(
        list(smem), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    )


def _desc(t: torch.Tensor, rows: int, block: list[int], smem: list[int]) -> TensorDescriptor:
    """t [..., rows, heads, D] as the 2-D [rows, columns] `_rows_ok`
    describes, [block] tiles landing in shared memory of shape `smem`'s
    layout; a tile past the last row reads zeros."""
    cols = (t.shape[-2] - 1) * t.stride(-2) + t.shape[-1]
    layout = _layout(tuple(smem), t.dtype)
    return TensorDescriptor(t, [rows, cols], [t.stride(-3), 1], block, layout)


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
           qk_scale: float) -> None:  # fmt: skip
    """The kernel over a call `supports` accepted; qk_scale in log2 units.
    Raises GluonUnavailable if it does not compile."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = query_start_loc.shape[0] - 1
    q_desc = _desc(q, num_tokens, [BLOCK_M, head_dim], [BLOCK_M, head_dim])
    rows = k_cache.shape[0] * block_size
    k_desc = _desc(k_cache, rows, [block_size, head_dim], [BLOCK_N, head_dim])
    v_desc = _desc(v_cache, rows, [block_size, head_dim], [BLOCK_N, head_dim])
    # Sum over sequences of cdiv(q_len_i, BLOCK_M) <= T // BLOCK_M + num_seqs.
    grid = (num_heads, triton.cdiv(num_tokens, BLOCK_M) + num_seqs)
    args = (q_desc, k_desc, v_desc, out, block_tables, query_start_loc, seq_lens, qk_scale,
            num_seqs, out.stride(0), out.stride(1), block_tables.stride(0), q.stride(1),
            k_cache.stride(2))  # fmt: skip
    consts = dict(GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, NUM_STAGES=NUM_STAGES)
    launch_or_give_up(
        lambda: _prefill_gluon[grid](*args, **consts, num_warps=4, maxnreg=MAXNREG),
        "prefill attention",
        _compile_failed,
    )
