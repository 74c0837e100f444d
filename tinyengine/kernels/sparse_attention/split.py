"""The Triton kernels of DeepSeek-V4 sparse attention, one query row at a
time (kernels/sparse_attention/triton.py launches them and says how they
work; kernels/sparse_attention/rows.py what a row is):
the split kernel `_sparse_split_kernel`, its per-tile step `_attend_tile`
and key gather `_key_rows`. kernels/split_reduce.py merges the splits'
partials together with the sink.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyengine.kernels.device_fn import device_fn

# Which keys a row has besides its window (the MODE constexpr): host ints
# for the launcher, constexpr copies for the kernels (which read no other globals).
WINDOW_ONLY, ALL_ENTRIES, TOPK_ENTRIES = 0, 1, 2
_WINDOW_ONLY = tl.constexpr(WINDOW_ONLY)
_ALL_ENTRIES = tl.constexpr(ALL_ENTRIES)
_TOPK_ENTRIES = tl.constexpr(TOPK_ENTRIES)


@device_fn
def _key_rows(
    kv_ptr, entry_offset, table_row, table_offset, picks_row, j, live, n_win, first,
    stride_kb, stride_ks, stride_eb, stride_er,
    MODE: tl.constexpr, RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """Row pointers [BLOCK_N] of keys j of a row's key list: its window's
    raw rows, then its entries (entry number j - n_win, or the compacted
    pick at picks_row[j - n_win]). A dead key's pointer is never
    dereferenced: not even its block id is loaded, so no table entry outside
    what the row may read is used.

    Entries are addressed from kv_ptr too (entry_offset: the entry cache's
    start minus the kv cache's, in elements; table_offset the same between
    the two block tables): a select between two pointers, or one whose
    offset comes from a scalar argument, hides the rows' 16-element
    alignment from Triton, which then loads element by element and does not
    pipeline the tile. ALIGNED: every offset is a multiple of 16 (the
    launcher checks), stated with multiple_of. Index math runs in int32 on
    non-negative values (dead keys: 0), only the offsets in int64."""
    is_win = j < n_win
    pos = tl.where(is_win, first + j, 0)
    if MODE == _WINDOW_ONLY:
        blk = tl.load(table_row + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        offs = blk * stride_kb + (pos % BLOCK_SIZE) * stride_ks
    else:
        ent = live & ~is_win
        if MODE == _TOPK_ENTRIES:
            w = tl.load(picks_row + (j - n_win), mask=ent, other=0)
        else:
            w = j - n_win
        last = tl.where(ent, (w + 1) * RATIO - 1, 0)
        # One block-id load serves both kinds of key.
        col = tl.where(is_win, pos // BLOCK_SIZE, table_offset + last // BLOCK_SIZE)
        blk = tl.load(table_row + col, mask=live, other=0).to(tl.int64)
        offs = tl.where(
            is_win,
            blk * stride_kb + (pos % BLOCK_SIZE) * stride_ks,
            entry_offset + blk * stride_eb + ((last % BLOCK_SIZE) // RATIO) * stride_er,
        )
    if ALIGNED:
        offs = tl.multiple_of(offs, 16)
    return kv_ptr + offs


@device_fn
def _attend_tile(
    q, kv, live, acc, m_i, l_i, qk_scale, LAZY_RESCALE: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a [BLOCK_N, D] tile of keys (= values)
    for all BLOCK_H heads: s = q @ kv^T * qk_scale (log2 units), dead keys
    -inf, acc += 2^(s - m) @ kv. The tile has >= 1 live key (a key list's
    live keys are a prefix), so every head's max is finite after it.
    LAZY_RESCALE: rebase the accumulator only when some head's max outgrew
    the running one by > RESCALE_THRESHOLD (the first tile always does);
    weights then reach 2^threshold, harmless in fp32 and bf16."""
    if UPCAST:
        kv = kv.to(tl.float32)
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(live[None, :], s, float("-inf"))
    m_tile = tl.max(s, 1)
    if LAZY_RESCALE:
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
    acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_splits", "topk"])
def _sparse_split_kernel(
    q_ptr, kv_ptr, entry_offset: tl.int64, tables_ptr, table_delta: tl.int64, seq_lens_ptr,
    seqs_ptr, topk_ptr, picks_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits, num_heads, topk,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_eb, stride_er, stride_bt, stride_ebt,
    stride_topk, stride_ot, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr, RATIO: tl.constexpr, MODE: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_SEQS: tl.constexpr, DIRECT: tl.constexpr, ALIGNED: tl.constexpr,
    LAZY_RESCALE: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(H, BLOCK_H), rows, num_splits). Row b (q, top-k and out
    row b; block table row seqs[b] with HAS_SEQS, else b: rows.py's row
    model) at p = seq_lens[b] - 1 has the key list [its window's raw rows
    max(0, p - WINDOW + 1) .. p | its entries] (MODE: every complete entry,
    or its `topk` picks; a row of length <= 0, padding, has none); split s
    takes whole tiles [s * chunk, (s + 1) * chunk) of it, chunk from the
    device length, so a grid sized from host ints fits any length.

    DIRECT (one split): normalise with the sink and write `out`. Otherwise
    write the split's normalised partial and its log2-sum-exp to
    part_out[b, h, s, :] / part_lse[b, h, s]; an empty split writes only
    lse = -inf."""
    head_block = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    row = b.to(tl.int64)
    seq = row
    if HAS_SEQS:
        seq = tl.load(seqs_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    n_win = tl.maximum(tl.minimum(seq_len, WINDOW), 0)
    first = seq_len - n_win
    program = (b * tl.num_programs(0) + head_block) * num_splits + split
    picks_row = picks_ptr + program.to(tl.int64) * BLOCK_K
    if MODE == _ALL_ENTRIES:
        total = n_win + tl.maximum(seq_len, 0) // RATIO
    elif MODE == _TOPK_ENTRIES:
        # Compact the row's picks (drop the -1s) into this program's scratch
        # row: its key list then has no dead key in the middle, so which keys
        # are live is arithmetic (j < end), also in the layout of the scores.
        # Masking by the picks themselves made Triton gather them a second
        # time in that layout, about 40% more instructions per tile.
        kk = tl.arange(0, BLOCK_K)
        # A padding row (length <= 0) sees no entry, whatever its picks hold.
        n_picks = tl.where(seq_len > 0, topk, 0)
        picks = tl.load(topk_ptr + row * stride_topk + kk, mask=kk < n_picks, other=-1)
        valid = picks >= 0
        at = tl.cumsum(valid.to(tl.int32), 0) - 1
        tl.store(picks_row + at, picks.to(tl.int32), mask=valid)
        tl.debug_barrier()  # the scratch row is read by other threads
        total = n_win + tl.sum(valid.to(tl.int32), 0)
    else:
        total = n_win
    chunk = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, total)

    head = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = head < num_heads
    part_idx = (b * num_heads + head).to(tl.int64) * num_splits + split
    if not DIRECT:
        if start >= end:
            tl.store(
                part_lse_ptr + part_idx, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_ok
            )
            return

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D  # D need not be a power of two: pad columns read 0
    q_ptrs = q_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    table_row = tables_ptr + seq * stride_bt
    table_offset = table_delta + seq * (stride_ebt - stride_bt)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        j = n + tl.arange(0, BLOCK_N)
        live = j < end
        ptrs = _key_rows(
            kv_ptr, entry_offset, table_row, table_offset, picks_row, j, live, n_win, first,
            stride_kb, stride_ks, stride_eb, stride_er, MODE, RATIO, BLOCK_SIZE, ALIGNED,
        )  # fmt: skip
        if BLOCK_D == D:  # row-uniform masks: full-width vector loads
            kv = tl.load(ptrs[:, None] + offs_d[None, :], mask=live[:, None], other=0.0)
        else:
            kv = tl.load(
                ptrs[:, None] + offs_d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0
            )
        acc, m_i, l_i = _attend_tile(
            q, kv, live, acc, m_i, l_i, qk_scale, LAZY_RESCALE, RESCALE_THRESHOLD, UPCAST,
            DOT_PRECISION,
        )  # fmt: skip

    o_mask = h_ok[:, None] & d_ok[None, :]
    if DIRECT:
        # The sink: one more logit, no value. m_f is finite unless both the
        # keys and the sink are -inf (then the output is 0).
        sink = tl.load(sinks_ptr + head, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
        keep = tl.exp2(m_i - m_f)
        denom = l_i * keep + tl.exp2(sink - m_f)
        out = acc * (keep / tl.where(denom == 0.0, 1.0, denom))[:, None]
        o_ptrs = out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        live = l_i > 0.0
        lse = tl.where(live, m_i + tl.log2(tl.where(live, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_idx, lse, mask=h_ok)
        out = acc / tl.where(live, l_i, 1.0)[:, None]
        tl.store(part_out_ptr + (part_idx * D)[:, None] + offs_d[None, :], out, mask=o_mask)
