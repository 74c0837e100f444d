"""The Triton kernels of paged attention (kernels/attention/triton.py
launches them; docs/kernels.md walks through them): `_prefill_kernel` for
prefill/mixed batches, and for decode-only batches the split-KV
`_decode_split_kernel` with `_decode_reduce_kernel`, which merges the splits.
Both walk the context through `_attend_tile`, one online-softmax step over a
tile of cache rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyengine.kernels.device_fn import device_fn
from tinyengine.kernels.gdc import gdc_launch_dependents, gdc_wait


@device_fn
def _kv_tile_ptrs(
    n_start, bt_row, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, live,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, OFFS_32: tl.constexpr,
):  # fmt: skip
    """Pointers of the K^T tile [BLOCK_DK, BLOCK_N] (column j is key
    n_start + j, rows are head dims) and the V tile [BLOCK_N, BLOCK_DV].
    Paged: key position p lives in physical block bt_row[p // BLOCK_SIZE] at
    offset p % BLOCK_SIZE. MASKED: block-table entries where `live` is false
    are not read (past the sequence end they may be garbage)."""
    pos = n_start + tl.arange(0, BLOCK_N)
    if MASKED:
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=live, other=0)
    else:
        blk = tl.load(bt_row + pos // BLOCK_SIZE)
    if not OFFS_32:  # caches past 2^31 elements need 64-bit offsets
        blk = blk.to(tl.int64)
    off = pos % BLOCK_SIZE
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ptrs = k_base + blk[None, :] * stride_kb + off[None, :] * stride_ks + offs_dk[:, None]
    v_ptrs = v_base + blk[:, None] * stride_vb + off[:, None] * stride_vs + offs_dv[None, :]
    return k_ptrs, v_ptrs


@device_fn
def _online_softmax_step(
    acc, l_i, m_i, q, k, v, pos, q_pos, qk_scale,
    MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc, l_i, m_i after keys `pos` (K^T tile k, V tile v): raw scores, the
    causal mask `key_pos <= q_pos` per row when MASKED, then the running max,
    sum and output rescaled."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    # [M, BLOCK_N] raw scores; times qk_scale they are log2 units
    s = tl.dot(q, k, input_precision=DOT_PRECISION)
    if MASKED:
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    # Every row has already seen key 0 (or sees it in this tile), so m_new is
    # finite and no row computes exp2(-inf - -inf). qk_scale > 0, so scaling
    # the row max equals the max of the scaled row, and the scale rides in the
    # exponent's FMA instead of a separate multiply over the whole tile.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # Rescale first, then let the MMA accumulate into acc in place.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@device_fn
def _attend_tile(
    acc, l_i, m_i, q,
    n_start, q_pos, seq_len,
    bt_row, k_base, v_base,
    stride_kb, stride_ks, stride_vb, stride_vs,
    qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_K: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, UPCAST: tl.constexpr, OFFS_32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys [n_start, n_start + BLOCK_N): load
    the tile, then _online_softmax_step. MASKED=False is the fast path for
    tiles every row may fully see (no causal mask, all positions < seq_len);
    MASKED=True masks positions past seq_len (their block-table entries may be
    garbage) and applies the causal mask `key_pos <= q_pos` per row.
    """
    pos = n_start + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_seq = pos < seq_len
    k_ptrs, v_ptrs = _kv_tile_ptrs(
        n_start, bt_row, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs,
        in_seq, MASKED, BLOCK_N, BLOCK_SIZE, BLOCK_DK, BLOCK_DV, OFFS_32,
    )  # fmt: skip
    if MASKED or HEAD_DIM_K != BLOCK_DK:
        k = tl.load(k_ptrs, mask=in_seq[None, :] & (offs_dk[:, None] < HEAD_DIM_K), other=0.0)
    else:
        k = tl.load(k_ptrs)
    if MASKED or HEAD_DIM_V != BLOCK_DV:
        # Masked V rows matter: 0 * NaN from an uninitialized slot is NaN.
        v = tl.load(v_ptrs, mask=in_seq[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    else:
        v = tl.load(v_ptrs)
    return _online_softmax_step(
        acc, l_i, m_i, q, k, v, pos, q_pos, qk_scale, MASKED, UPCAST, DOT_PRECISION
    )


@device_fn
def _split_chunk(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Context rows per split of the split-KV decode: whole BLOCK_N tiles,
    from the *device* seq_len (the split kernel's ranges and the reduce's
    count of live splits both follow from it)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N), 1) * BLOCK_N


@device_fn
def _find_seq(tile_id, query_start_loc, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning q-tile `tile_id`: the largest i with
    query_start_loc[i] // BLOCK_Q + i <= tile_id (binary search, device-side)."""
    lo = tile_id * 0
    hi = lo + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        go_right = first_tile <= tile_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit(do_not_specialize=["num_seqs"])  # one compile for any batch size
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM_K: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, OFFS_32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (num_tiles * num_kv_heads,). A program owns BLOCK_Q query tokens of
    one sequence times the GROUP query heads sharing one KV head: tile row r is
    token r // GROUP, head kv_head * GROUP + r % GROUP (GQA packed into M)."""
    # KV head varies fastest and tile ids run backwards: the GPU starts programs
    # in id order, so the heaviest tiles (a prompt's last, which see the most
    # keys) of every head start first and the light ones fill the tail.
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    tile_id = tl.num_programs(0) // NUM_KV_HEADS - 1 - tl.program_id(0) // NUM_KV_HEADS
    seq = _find_seq(tile_id, query_start_loc_ptr, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return  # spare program: the grid is an upper bound on the tile count
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens already cached before this step's rows

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP  # token index within this sequence's q rows
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (tok < q_len)
    # Absolute position of each row; dead rows borrow the last live one so
    # they see >= 1 key and stay NaN-free (they are never stored).
    q_pos = ctx_len + tl.minimum(tok, q_len - 1)

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_dk[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_dk[None, :] < HEAD_DIM_K), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # Keys [0, n_full) are visible to every row of the tile (the earliest row
    # sits at ctx_len + q_tile * BLOCK_Q): no mask in that loop.
    first_pos = ctx_len + q_tile * BLOCK_Q
    n_full = (first_pos + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)  # last row's pos + 1
    for n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n, q_pos, seq_len, bt_row, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM_K, HEAD_DIM_V, BLOCK_DK, BLOCK_DV, False, UPCAST, OFFS_32,
            DOT_PRECISION,
        )  # fmt: skip
    for n in range(n_full, kv_end, BLOCK_N):  # the diagonal band: causal mask
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n, q_pos, seq_len, bt_row, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM_K, HEAD_DIM_V, BLOCK_DK, BLOCK_DV, True, UPCAST, OFFS_32,
            DOT_PRECISION,
        )  # fmt: skip

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
    o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["num_splits"])  # one compile for any split count
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM_K: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, DIRECT: tl.constexpr, UPCAST: tl.constexpr,
    OFFS_32: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
    EARLY_K: tl.constexpr = True,
):  # fmt: skip
    """Grid (num_seqs, num_kv_heads, num_splits). One program: the GROUP query
    heads of one KV head (rows of a [BLOCK_G, D] tile, so each K/V tile is
    loaded once per group) over one contiguous chunk of the context.

    DIRECT (num_splits == 1): write the normalized output straight to `out`.
    Otherwise write the chunk's normalized partial output and its log2-sum-exp
    to part_out[seq, head, split, :] / part_lse[seq, head, split]; the reduce
    kernel combines them. A split past the sequence's end writes lse = -inf.

    USE_PDL (kernels/launch.py): every program waits for the kernel before
    it, early returns included. That kernel (the RoPE + cache write) writes
    the query and the newest K/V row (position seq_len - 1) read here, so
    those are read only after the wait. What it does not write is read
    before it, while that kernel still runs: the host-staged indices
    (query_start_loc, seq_lens, the block table) and the split's first tile
    of K/V rows from earlier steps; the newest row, when it falls in that
    tile, is loaded after the wait into the rows the early load left zero.
    Behind the wait that leaves the query and one masked row, not a chain
    of index, block-table and cache loads. EARLY_K=False (the launcher's
    choice for tiles of more than one warp, which no preset's group size
    reaches) reads only the indices before the wait: the early tile was
    measured on the 1-warp tile only (ptxas, sm_90a: 0 spills there, 4
    bytes on the 4-warp tile).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    has_rows = tl.load(query_start_loc_ptr + seq + 1) > q_row  # q_len 0: nothing to write
    seq_len = tl.load(seq_lens_ptr + seq)
    # Split boundaries come from the *device* seq_len, so one captured grid
    # (sized from max_seq_len) spreads any actual length over all splits.
    chunk = _split_chunk(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    if EARLY_K:  # the first tile: rows before the newest are from earlier steps
        pos0 = start + tl.arange(0, BLOCK_N)
        tile_end = tl.where(has_rows, end, 0)  # no rows: nothing read, the table may be stale
        in_tile = pos0 < tile_end
        old = pos0 < tl.minimum(tile_end, seq_len - 1)
        k_mask = offs_dk[:, None] < HEAD_DIM_K
        v_mask = offs_dv[None, :] < HEAD_DIM_V
        k0_ptrs, v0_ptrs = _kv_tile_ptrs(
            start, bt_row, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, in_tile,
            True, BLOCK_N, BLOCK_SIZE, BLOCK_DK, BLOCK_DV, OFFS_32,
        )  # fmt: skip
        k0 = tl.load(k0_ptrs, mask=old[None, :] & k_mask, other=0.0)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if not has_rows:
        return  # the reduce skips this sequence too

    g = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    # part_* are contiguous [num_seqs, Hq, num_splits, (Dv)]; Hq = Hkv * GROUP.
    part_idx = (seq * tl.num_programs(1) * GROUP + head) * num_splits + split
    if not DIRECT:
        if start >= end:
            tl.store(
                part_lse_ptr + part_idx, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g_ok
            )
            return

    q_ptrs = q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_dk[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None] & (offs_dk[None, :] < HEAD_DIM_K), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    # The causal mask `pos <= q_pos` with q_pos = end - 1 keeps the masked
    # tail tile inside this split.
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (end - 1)
    n_begin = start
    if EARLY_K:  # the first tile: the newest row into the zeros left for it, V, the step
        newest = in_tile & (pos0 == seq_len - 1)
        k0 += tl.load(k0_ptrs, mask=newest[None, :] & k_mask, other=0.0)
        v0 = tl.load(v0_ptrs, mask=in_tile[:, None] & v_mask, other=0.0)
        if start < end:  # an empty context (DIRECT, a padding sequence) has no tile
            acc, l_i, m_i = _online_softmax_step(
                acc, l_i, m_i, q, k0, v0, pos0, q_pos, qk_scale, True, UPCAST, DOT_PRECISION
            )
        n_begin = start + BLOCK_N
    n_full = start + (end - start) // BLOCK_N * BLOCK_N
    for n in range(n_begin, n_full, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n, q_pos, seq_len, bt_row, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM_K, HEAD_DIM_V, BLOCK_DK, BLOCK_DV, False, UPCAST, OFFS_32,
            DOT_PRECISION,
        )  # fmt: skip
    for n in range(tl.maximum(n_full, n_begin), end, BLOCK_N):  # one partial tile at most
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, n, q_pos, seq_len, bt_row, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM_K, HEAD_DIM_V, BLOCK_DK, BLOCK_DV, True, UPCAST, OFFS_32,
            DOT_PRECISION,
        )  # fmt: skip

    # l_i == 0 only for an empty context (a padding sequence): output zeros.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    dv_ok = offs_dv[None, :] < HEAD_DIM_V
    if DIRECT:
        o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head[:, None] * stride_oh
        tl.store(
            o_ptrs + offs_dv[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & dv_ok
        )
    else:
        tl.store(part_lse_ptr + part_idx, m_i + tl.log2(l_i), mask=g_ok)
        p_ptrs = part_out_ptr + (part_idx.to(tl.int64) * HEAD_DIM_V)[:, None] + offs_dv[None, :]
        tl.store(p_ptrs, out, mask=g_ok[:, None] & dv_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, seq_lens_ptr,
    num_splits, stride_ot, stride_oh,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT_BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (num_seqs, Hq): out = sum_s w_s * part_s / sum_s w_s with
    w_s = 2^(lse_s - max lse) over the splits with rows; the others get weight
    0 and their partial is never loaded. Which splits have rows follows from
    seq_len and the split kernel's rule (_split_chunk with SPLIT_BLOCK_N, its
    BLOCK_N), read before the PDL wait, so the partials load together with
    the lse values instead of after them."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    has_rows = tl.load(query_start_loc_ptr + seq + 1) > q_row
    seq_len = tl.load(seq_lens_ptr + seq)
    num_live = tl.cdiv(seq_len, _split_chunk(seq_len, num_splits, SPLIT_BLOCK_N))
    if USE_PDL:  # kernels/launch.py
        gdc_wait()
        gdc_launch_dependents()
    if not has_rows:
        return
    s = tl.arange(0, BLOCK_S)
    live = s < num_live  # the splits with rows, [0, num_live)
    base = (seq * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=live, other=float("-inf"))
    offs_dv = tl.arange(0, BLOCK_DV)
    p_ptrs = part_out_ptr + (base + s).to(tl.int64)[:, None] * HEAD_DIM_V + offs_dv[None, :]
    part = tl.load(p_ptrs, mask=live[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
    w = tl.where(live, tl.exp2(lse - m), 0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom == 0.0, 1.0, denom)
    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_dv
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)
