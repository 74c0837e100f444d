"""Torch reference for the fused mixture-of-experts op: every token through its
top-k experts' SwiGLU MLPs, weighted and summed. kernels/moe/triton.py
implements the same signature on the GPU; this file defines the numbers.

    out[t] = sum_k topk_weights[t, k] * down_e( silu(gate_e(x_t)) * up_e(x_t) ),
             e = topk_ids[t, k]

With `swiglu_limit` L (DeepSeek-V4), gate is clamped to <= L and up to
[-L, L] before the activation.

Layout:
    x             [T, D]
    w13           [E, 2I, D]   rows [gate (I rows); up (I rows)] of each expert
    w2            [E, D, I]
    topk_weights  [T, K] float32
    topk_ids      [T, K] int64, each in [0, E)

Which experts a token uses (the router: softmax or sigmoid scores, grouped
top-k, scaling) is the model's business (models/moe.py); this op only applies
the choice. Pure tensor code: never imports `models/` or `tinyengine/`.

Two paths. Eager: tokens sorted by expert, one pair of matmuls per expert that
received any token (reads the per-expert counts on the host). Inside a CUDA
graph capture nothing may be read on the host, so a dense path runs every
expert on every token and masks by the routing weights: correct and
graph-safe, but E times the work, which is why the Triton kernel serves CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> None:
    num_experts, two_i, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_i % 2:
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)} does not match w13 {tuple(w13.shape)} "
            "(expected x [T, D], w13 [E, 2I, D])"
        )
    if tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"fused_moe: w2 {tuple(w2.shape)} should be [E, D, I] = "
            f"{(num_experts, hidden, two_i // 2)}"
        )
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: {topk_ids.shape[0]} routing rows for {x.shape[0]} tokens")


def _expert_mlp(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, swiglu_limit: float | None = None
) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
    return F.linear(F.silu(gate) * up, w2)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    workspace: Any = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """out [T, D] in x.dtype. Expert matmuls run in the weights' dtype; the
    weighted sum over a token's experts accumulates in fp32."""
    del workspace  # the reference allocates its (eager-sized) temporaries itself
    _check(x, w13, w2, topk_ids)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _fused_moe_dense(x, w13, w2, topk_weights, topk_ids, swiglu_limit)
    return moe_by_expert(x, w13, w2, topk_weights, topk_ids, swiglu_limit, _expert_mlp)


def moe_by_expert(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None,
    expert_mlp: Any,
) -> torch.Tensor:
    """fused_moe's eager path with the per-expert MLP `expert_mlp(x_rows,
    w13_e, w2_e, swiglu_limit)` (the batch-invariant set passes a
    row-blocked one): each expert over its tokens, then each token's
    weighted sum, formed in expert order."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    flat_ids = topk_ids.reshape(-1)
    # A stable sort keeps each expert's tokens in token order, so the sum for
    # a token is formed in expert order whatever K-slot chose the expert.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # host sync: eager only
    if len(counts) > w13.shape[0]:
        raise ValueError(f"fused_moe: topk_ids holds ids >= the {w13.shape[0]} experts")
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        y = expert_mlp(x[rows], w13[expert], w2[expert], swiglu_limit)
        out.index_add_(0, rows, y.float() * weight_of[start : start + count, None])
        start += count
    return out.to(x.dtype)


def _fused_moe_dense(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Every expert on every token; a token's weight for expert e is the sum
    of its top-k weights whose id is e (zero when e was not chosen)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        weight = (topk_weights.float() * (topk_ids == expert)).sum(dim=-1, keepdim=True)
        out += _expert_mlp(x, w13[expert], w2[expert], swiglu_limit).float() * weight
    return out.to(x.dtype)
