"""The Triton kernels of MLA decode (kernels/mla/triton.py launches them and
says how they work): the split-KV kernel `_mla_split_kernel`, its per-tile
steps (`_attend_tile`, and `_attend_gathered_tile` for tiles gathered row by
row through pointers). kernels/split_reduce.py merges the splits' partials
(also those of the Gluon split kernel, kernels/mla/gluon.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyengine.kernels.device_fn import device_fn

# A running max may lag the true one by up to this much (log2 units) before the
# accumulator is rescaled: softmax weights then reach 2^8, harmless in fp32 and
# in bf16 (whose relative precision does not depend on magnitude).
RESCALE_THRESHOLD = 8.0


@device_fn
def _load_rows(row_ptrs, row_ok, offs, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """[rows, BLOCK] tile of `WIDTH` columns from row_ptrs; masked rows and
    pad columns read 0. The column mask only exists where the tile is wider
    than the data, so a power-of-two width gets row-uniform masks (full-width
    vector loads)."""
    if BLOCK == WIDTH:
        return tl.load(row_ptrs[:, None] + offs[None, :], mask=row_ok[:, None], other=0.0)
    else:
        return tl.load(
            row_ptrs[:, None] + offs[None, :], mask=row_ok[:, None] & (offs < WIDTH)[None, :],
            other=0.0,
        )  # fmt: skip


@device_fn
def _attend_tile(
    q_lat, q_rope, lat, rope, pos_ok, acc, m_i, l_i, qk_scale,
    MASKED: tl.constexpr, LAZY_RESCALE: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a [BLOCK_N] tile for all BLOCK_H heads:
    scores = (q_lat @ lat^T + q_rope @ rope^T) * qk_scale (log2 units), then
    acc += 2^(scores - m) @ lat. MASKED: rows where pos_ok is False get weight
    0 (a tile past the context's end); the tile has >= 1 live row."""
    if UPCAST:
        lat = lat.to(tl.float32)
        rope = rope.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
    s = tl.dot(q_rope, tl.trans(rope), s, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:  # rows past `end` may hold another sequence's data
        s = tl.where(pos_ok[None, :], s, float("-inf"))
    m_tile = tl.max(s, 1)
    if LAZY_RESCALE:
        # Rebase (all rows at once) only when some row's max outgrew the
        # running one by > RESCALE_THRESHOLD; the first tile always does
        # (m_i = -inf). Otherwise weights are taken against the stale max.
        if tl.max(m_tile - m_i, 0) > RESCALE_THRESHOLD:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
    else:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    l_i += tl.sum(p, 1)
    acc = tl.dot(p.to(lat.dtype), lat, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@device_fn
def _attend_gathered_tile(
    cache_ptr, bt_row, n, end, stride_cb, stride_cs, q_lat, q_rope, acc, m_i, l_i, qk_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """_attend_tile over rows n .. n + BLOCK_N of a sequence gathered through
    pointers ([BLOCK_N, BLOCK_L] latent, [BLOCK_N, BLOCK_R] rope). The tile may
    straddle cache blocks, so each row looks up its own block id; rows at or
    past `end` read 0 (their block id is not loaded either) and weigh 0."""
    pos = n + tl.arange(0, BLOCK_N)
    pos_ok = pos < end
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    row = cache_ptr + blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
    lat = _load_rows(row, pos_ok, tl.arange(0, BLOCK_L), LATENT, BLOCK_L)
    rope = _load_rows(row + LATENT, pos_ok, tl.arange(0, BLOCK_R), ROPE, BLOCK_R)
    return _attend_tile(
        q_lat, q_rope, lat, rope, pos_ok, acc, m_i, l_i, qk_scale,
        True, LAZY_RESCALE, RESCALE_THRESHOLD, UPCAST, DOT_PRECISION,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])  # one compile for any split count
def _mla_split_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, lat_desc, rope_desc, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits, num_heads,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_cb, stride_cs, stride_bt,
    stride_ob, stride_oh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DIRECT: tl.constexpr, PAGED_TMA: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(H, BLOCK_H), B, num_splits): the head blocks of one
    sequence are adjacent program ids, so they run together and the second
    one finds the latent tiles in L2.

    PAGED_TMA (BLOCK_SIZE a multiple of BLOCK_N): every whole tile lies in one
    cache block, so it is one TMA copy per operand through lat_desc /
    rope_desc (descriptors over the cache viewed as [rows, L] and [rows, R]);
    a split's last, partial tile goes through pointers, masked. Otherwise
    every tile goes through pointers (lat_desc / rope_desc are unused).

    DIRECT (num_splits == 1): write the normalized output straight to `out`.
    Otherwise write the chunk's normalized partial output and its log2-sum-exp
    to part_out[b, h, s, :] / part_lse[b, h, s] (contiguous [B, H, S, (L)]);
    a split past the sequence's end writes lse = -inf and nothing else.
    """
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Split boundaries come from the *device* seq_len (rounded to whole tiles),
    # so one grid sized from max_seq_len spreads any actual length over the
    # splits; trailing splits of a short sequence are empty.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    head = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = head < num_heads
    part_idx = (seq * num_heads + head).to(tl.int64) * num_splits + split
    if not DIRECT:
        if start >= end:
            tl.store(
                part_lse_ptr + part_idx, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_ok
            )
            return

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < LATENT  # L need not be a power of two: pad columns read 0
    r_ok = offs_r < ROPE
    ql_ptrs = q_lat_ptr + seq.to(tl.int64) * stride_qlb + head[:, None] * stride_qlh
    q_lat = tl.load(ql_ptrs + offs_l[None, :], mask=h_ok[:, None] & l_ok[None, :], other=0.0)
    qr_ptrs = q_rope_ptr + seq.to(tl.int64) * stride_qrb + head[:, None] * stride_qrh
    q_rope = tl.load(qr_ptrs + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    if PAGED_TMA:
        whole_end = start + (end - start) // BLOCK_N * BLOCK_N
        for n in range(start, whole_end, BLOCK_N):
            row = tl.load(bt_row + n // BLOCK_SIZE) * BLOCK_SIZE + n % BLOCK_SIZE
            lat = lat_desc.load([row, 0])
            rope = rope_desc.load([row, 0])
            acc, m_i, l_i = _attend_tile(
                q_lat, q_rope, lat, rope, None, acc, m_i, l_i, qk_scale,
                False, LAZY_RESCALE, RESCALE_THRESHOLD, UPCAST, DOT_PRECISION,
            )  # fmt: skip
        # An `if`, not a loop: a second pipelined loop would claim its own
        # shared-memory ring, which the TMA loop's ring leaves no room for.
        if whole_end < end:
            acc, m_i, l_i = _attend_gathered_tile(
                cache_ptr, bt_row, whole_end, end, stride_cb, stride_cs, q_lat, q_rope,
                acc, m_i, l_i, qk_scale, LATENT, ROPE, BLOCK_L, BLOCK_R, BLOCK_N, BLOCK_SIZE,
                LAZY_RESCALE, RESCALE_THRESHOLD, UPCAST, DOT_PRECISION,
            )  # fmt: skip
    else:
        for n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_gathered_tile(
                cache_ptr, bt_row, n, end, stride_cb, stride_cs, q_lat, q_rope,
                acc, m_i, l_i, qk_scale, LATENT, ROPE, BLOCK_L, BLOCK_R, BLOCK_N, BLOCK_SIZE,
                LAZY_RESCALE, RESCALE_THRESHOLD, UPCAST, DOT_PRECISION,
            )  # fmt: skip

    # l_i == 0 only for an empty context (seq_len 0, a padding row): output 0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_mask = h_ok[:, None] & l_ok[None, :]
    if DIRECT:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh
        tl.store(o_ptrs + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(part_lse_ptr + part_idx, m_i + tl.log2(l_i), mask=h_ok)
        p_ptrs = part_out_ptr + (part_idx * LATENT)[:, None] + offs_l[None, :]
        tl.store(p_ptrs, out, mask=o_mask)
