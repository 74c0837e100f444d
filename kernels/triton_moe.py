"""Triton fused mixture-of-experts: tokens grouped by expert on the device, one
grouped-GEMM launch for gate/up with SiLU-and-mul fused, one for down (the
routing weight applied in its epilogue), and a per-token reduction over the
token's K expert rows.

Owns the GPU implementation of `fused_moe`, whose numerical definition (and
layout) lives in kernels/moe.py, the torch reference; the signature is the
same, so models/moe.py never knows which backend runs.

Must never (each one breaks CUDA-graph capture or replay):
  - read a device tensor on the host: no per-expert counts on the host, no
    .item()/.tolist(); grids are sized for the worst case from host ints
    (T, K, E, block sizes) and programs past the real work exit early;
  - allocate scratch outside the workspace arena when one is given: every
    intermediate (sort results, counts, offsets, activations) is a workspace
    view whose size depends only on T, K, E, I, D and the block sizes.
  - It does not check that topk_ids < E (that would need a host read); ids
    out of range are the router's bug and read out of bounds.

Grouping (the device-side equivalent of vLLM's moe_align_block_size). The
M = T*K (token, slot) pairs are "pairs" p = t*K + k with expert topk_ids[t, k].
    order      = stable argsort of the expert ids  (pairs grouped by expert)
    counts[e]  = pairs routed to e;  seg_end = cumsum(counts)
    nblk[e]    = cdiv(counts[e], BLOCK_M);  blk_end = cumsum(nblk)
M-block b belongs to the expert e with blk_end[e-1] <= b < blk_end[e] (found by
binary search in the kernel) and covers sorted rows
seg_end[e] - counts[e] + (b - blk_end[e] + nblk[e]) * BLOCK_M + [0, BLOCK_M),
masked to the expert's segment: each expert's rows are padded to whole blocks
without materializing the padding. The grid's M dimension is the worst case
sum_e cdiv(c_e, BLOCK_M) <= (M + min(E, M) * (BLOCK_M - 1)) // BLOCK_M; blocks
past blk_end[E-1] exit.

Numerics: dots take the weights' dtype on the GPU (bf16 tensor cores) with fp32
accumulation; the SwiGLU activation is stored in the weights' dtype (as the
reference's bf16 matmul chain rounds it); the down projection times the routing
weight stays fp32 until the per-token sum. Under TRITON_INTERPRET=1 tiles are
upcast to fp32 right after tl.load (the interpreter's bf16 math is wrong).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.triton_attention import _interpreting

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _find_expert(b, blk_end_ptr, NUM_EXPERTS: tl.constexpr):
    """Smallest e with blk_end[e] > b (NUM_EXPERTS when b is past all blocks):
    a binary search over the inclusive cumsum of per-expert block counts."""
    lo = b * 0  # a tensor from the start: loop-carried values keep one type
    hi = lo + NUM_EXPERTS
    while lo < hi:
        mid = (lo + hi) // 2
        go_right = tl.load(blk_end_ptr + mid) <= b
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _block_rows(b, counts_ptr, seg_end_ptr, blk_end_ptr, NUM_EXPERTS: tl.constexpr,
                BLOCK_M: tl.constexpr):  # fmt: skip
    """(expert, sorted-row indices [BLOCK_M], row mask) of M-block b; see the
    module docstring. expert == NUM_EXPERTS means "no work"."""
    expert = _find_expert(b, blk_end_ptr, NUM_EXPERTS)
    e = tl.minimum(expert, NUM_EXPERTS - 1)  # keep the loads in bounds; caller exits
    count = tl.load(counts_ptr + e)
    first_blk = tl.load(blk_end_ptr + e) - tl.cdiv(count, BLOCK_M)
    in_seg = (b - first_blk) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(seg_end_ptr + e) - count + in_seg
    return expert, rows, in_seg < count


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, order_ptr, counts_ptr, seg_end_ptr, blk_end_ptr,
    stride_xt, stride_we, stride_wn, stride_wk, stride_am,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid (max M-blocks, cdiv(I, BLOCK_N)). act[row, n] = silu(x_t . gate_n) *
    (x_t . up_n) for the sorted rows of one expert's M-block; row r holds pair
    order[r], token order[r] // K. act rows are in sorted order."""
    expert, rows, row_ok = _block_rows(
        tl.program_id(0), counts_ptr, seg_end_ptr, blk_end_ptr, NUM_EXPERTS, BLOCK_M
    )
    if expert >= NUM_EXPERTS:
        return
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token.to(tl.int64)[:, None] * stride_xt
    # w13[e] is [2I, D]: gate rows [0, I), up rows [I, 2I). The tile is read
    # transposed ([BLOCK_K, BLOCK_N]) so x [BLOCK_M, BLOCK_K] @ w needs no trans.
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    g_cols = w_base + offs_n[None, :].to(tl.int64) * stride_wn
    u_cols = w_base + (offs_n[None, :] + INTER).to(tl.int64) * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < HIDDEN
        xt = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(g_cols + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        wu = tl.load(u_cols + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        else:
            xt = xt.to(wg.dtype)  # the reference's matmuls run in the weights' dtype
        acc_g = tl.dot(xt, wg, acc_g)
        acc_u = tl.dot(xt, wu, acc_u)
    # Round gate/up to the weights' dtype first, like the reference's bf16 F.linear.
    gate = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, y_ptr, topk_weights_ptr, order_ptr, counts_ptr, seg_end_ptr, blk_end_ptr,
    stride_am, stride_we, stride_wn, stride_wk, stride_ym, stride_tw_t, stride_tw_k,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid (max M-blocks, cdiv(D, BLOCK_N)). y[pair, n] = w_pair * (act_row . w2[e, n])
    in fp32, written at the pair's *unsorted* index t*K + k so the per-token sum
    reads K consecutive rows (deterministic; no atomics)."""
    expert, rows, row_ok = _block_rows(
        tl.program_id(0), counts_ptr, seg_end_ptr, blk_end_ptr, NUM_EXPERTS, BLOCK_M
    )
    if expert >= NUM_EXPERTS:
        return
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + rows.to(tl.int64)[:, None] * stride_am
    w_cols = w2_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < INTER
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
    # Round to the weights' dtype like the reference's F.linear output, then
    # scale by the fp32 routing weight.
    acc = acc.to(w2_ptr.dtype.element_ty).to(tl.float32)
    # topk_weights [T, K] may be a strided view: index it by (t, k) = divmod(pair, K).
    w_ptrs = topk_weights_ptr + (pair // TOP_K) * stride_tw_t + (pair % TOP_K) * stride_tw_k
    weight = tl.load(w_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc * weight[:, None], mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_topk_kernel(
    y_ptr, out_ptr, stride_ym, stride_ot,
    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (T, cdiv(D, BLOCK_D)). out[t] = sum_k y[t*K + k] in fp32, cast once."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < HIDDEN
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + k).to(tl.int64) * stride_ym + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- launcher


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M from host ints: ~the mean rows per expert, 16 (tl.dot's minimum)
    to 64. Decode batches (few rows per expert) waste less padding at 16."""
    return max(16, min(64, triton.next_power_of_2(max(1, num_pairs // num_experts))))


def max_m_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e cdiv(count_e, block_m) over any routing: at most
    min(E, M) experts are non-empty and each wastes < block_m rows."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    workspace: Any = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Same contract as kernels.moe.fused_moe; out [T, D] in x.dtype.

    block_m / block_n / block_k override the tile sizes (tests and tuning)."""
    num_experts, two_i, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_i % 2:
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)} does not match w13 {tuple(w13.shape)} "
            "(expected x [T, D], w13 [E, 2I, D])"
        )
    inter = two_i // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"fused_moe: w2 {tuple(w2.shape)} should be [E, D, I] = "
                         f"{(num_experts, hidden, inter)}")  # fmt: skip
    if topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_moe: {tuple(topk_ids.shape)} routing ids / {tuple(topk_weights.shape)} "
            f"weights for {x.shape[0]} tokens"
        )
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe: the last dim of x, w13 and w2 must be contiguous")
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    block_m = block_m or moe_block_m(num_pairs, num_experts)
    dev = x.device
    specs = (
        ((num_pairs,), topk_ids.dtype),  # sorted expert ids (unused, sort's values output)
        ((num_pairs,), torch.int64),  # order: pair index of each sorted row
        ((num_pairs,), torch.int64),  # ones, for the scatter-add histogram
        ((num_experts,), torch.int64),  # counts
        ((num_experts,), torch.int64),  # seg_end
        ((num_experts,), torch.int64),  # nblk
        ((num_experts,), torch.int64),  # blk_end
        ((num_pairs, inter), w13.dtype),  # act, sorted rows
        ((num_pairs, hidden), torch.float32),  # y, weighted down-proj, unsorted pair rows
    )
    if workspace is not None:
        bufs = workspace.get(*specs)
    else:
        bufs = [torch.empty(tuple(shape), dtype=dtype, device=dev) for shape, dtype in specs]
    sorted_ids, order, ones, counts, seg_end, nblk, blk_end, act, y = bufs

    # Grouping, all on the device and in place into the views above.
    flat_ids = topk_ids.reshape(-1)
    # Stable: an expert's rows stay in token order (like the reference's sort).
    torch.sort(flat_ids, stable=True, out=(sorted_ids, order))
    ones.fill_(1)
    counts.zero_().scatter_add_(0, flat_ids.to(torch.int64), ones)
    torch.cumsum(counts, 0, out=seg_end)
    torch.add(counts, block_m - 1, out=nblk)
    nblk.div_(block_m, rounding_mode="floor")
    torch.cumsum(nblk, 0, out=blk_end)

    m_blocks = max_m_blocks(num_pairs, num_experts, block_m)
    upcast = _interpreting()
    _gate_up_kernel[(m_blocks, triton.cdiv(inter, block_n))](
        x, w13, act, order, counts, seg_end, blk_end,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        INTER=inter, HIDDEN=hidden, TOP_K=top_k, NUM_EXPERTS=num_experts,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _down_kernel[(m_blocks, triton.cdiv(hidden, block_n))](
        act, w2, y, topk_weights, order, counts, seg_end, blk_end,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
        topk_weights.stride(0), topk_weights.stride(1),
        INTER=inter, HIDDEN=hidden, TOP_K=top_k, NUM_EXPERTS=num_experts,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    block_d = min(1024, triton.next_power_of_2(hidden))
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        y, out, y.stride(0), out.stride(0), TOP_K=top_k, HIDDEN=hidden, BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip
    return out
