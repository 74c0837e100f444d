"""The merge of split-KV partials, the second kernel of a split decode
(Flash-Decoding), shared by MLA decode (kernels/mla) and DeepSeek-V4 sparse
attention (kernels/sparse_attention).

Each split of a (row, head) wrote its partial output, already normalized by
its own softmax sum, and that sum's log2 with the running max folded in
(lse_s, -inf for a split that saw no key). The merged output is

    out = sum_s w_s * part_s / (sum_s w_s + w_sink),  w_s = 2^(lse_s - M),

with M the largest lse (and the sink's logit, when the attention has sinks:
a per-head logit that joins every softmax's denominator and no numerator,
w_sink = 2^(sink - M)). One program per (row, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Splits summed per step: a [16, 512] fp32 tile per program. Each step is a
# round trip to memory the program waits for, so at batch 1 (128 programs,
# 32 splits) the step count, not the bytes, is the merge's time
# (docs/benchmarks.md has 4, 8, 16 and 32 a step measured).
_CHUNK_S = 16


@triton.jit(do_not_specialize=["num_splits"])
def _split_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, num_splits, stride_ot, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Grid (rows, H), the module docstring's merge. The max comes from one
    [BLOCK_S] load; the [D]-wide partials are then summed CHUNK_S splits at
    a time (a [BLOCK_S, 512] fp32 tile would not fit in registers). A dead
    split (lse = -inf) weighs 0 and its partial, never written (whatever
    the workspace held), is never loaded. (Loading every partial with its
    lse and zeroing the dead ones afterwards, so that the partial loads do
    not wait on the lse loads, measured slower: docs/benchmarks.md.)"""
    b = tl.program_id(0)
    head = tl.program_id(1)
    base = (b * tl.num_programs(1) + head).to(tl.int64) * num_splits
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + base + s, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # no key and no sink: weights 0, output 0
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    denom = tl.zeros([CHUNK_S], dtype=tl.float32)
    for i in range(0, num_splits, CHUNK_S):
        si = i + tl.arange(0, CHUNK_S)
        lse_i = tl.load(part_lse_ptr + base + si, mask=si < num_splits, other=float("-inf"))
        live = lse_i > float("-inf")
        w = tl.where(live, tl.exp2(lse_i - m), 0.0)
        denom += w
        part = tl.load(
            part_out_ptr + (base + si)[:, None] * D + offs_d[None, :],
            mask=live[:, None] & d_ok[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.sum(w[:, None] * part, 0)
    total = tl.sum(denom, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m)
    out = acc / tl.where(total == 0.0, 1.0, total)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def merge_splits(
    out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, num_splits: int,
    max_splits: int, sinks: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write out[r, h] (rows x heads x D, last dim contiguous) from the
    partials part_out [rows, heads, num_splits, D] and part_lse [rows,
    heads, num_splits] (contiguous). max_splits: the most splits the caller
    ever launches, so that every split count shares one compile."""
    rows, heads, _, dim = part_out.shape
    _split_reduce_kernel[(rows, heads)](
        out, part_out, part_lse, sinks if sinks is not None else part_lse, num_splits,
        out.stride(0), out.stride(1),
        D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_S=triton.next_power_of_2(max(num_splits, max_splits)), CHUNK_S=_CHUNK_S,
        HAS_SINKS=sinks is not None, num_warps=4,
    )  # fmt: skip
