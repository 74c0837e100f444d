"""Triton fused mixture-of-experts: tokens grouped by expert on the device, one
grouped-GEMM launch for gate/up with SiLU-and-mul fused, one for down, and a
per-token reduction over the token's K expert rows that applies the routing
weights.

Owns the GPU implementation of `fused_moe`, whose numerical definition (and
layout) lives in kernels/moe/reference.py, the torch reference; the signature is the
same, so models/moe.py never knows which backend runs. The choice of tiles
per size class (`moe_config`, `moe_token_classes` for the engine's warmup)
lives in kernels/moe/tiles.py.

Must never (each one breaks CUDA-graph capture or replay):
  - read a device tensor on the host: no per-expert counts on the host, no
    .item()/.tolist(); grids are sized for the worst case from host ints
    (T, K, E, block sizes) and programs past the real work exit early;
  - allocate scratch outside the workspace arena when one is given: every
    intermediate (sort results, counts, activations, the sorted copy of x
    for TMA) is a workspace view whose size depends only on T, K, E, I, D
    and the (host-chosen) tiles;
  - pick a tile from anything but host ints, or have more than a few size
    classes: each class is a compiled variant, and every variant must be
    compiled by the engine's warmup, before graph capture.
  - It does not check that topk_ids < E (that would need a host read); ids
    out of range are the router's bug and read out of bounds.

Grouping (the device-side equivalent of vLLM's moe_align_block_size). The
M = T*K (token, slot) pairs are "pairs" p = t*K + k with expert topk_ids[t, k].
    order      = stable argsort of the expert ids  (pairs grouped by expert)
    counts[e]  = pairs routed to e                 (a histogram kernel)
The two grouped-GEMM kernels (which M-block belongs to which expert, tails,
program order, pointer or TMA loads) are in kernels/moe/gemm.py; this file
holds the grouping, the gather, the reduction and the launchers.

Numerics: dots take the weights' dtype on the GPU (bf16 tensor cores; fp32 in
3xTF32, launch.dot_precision) with fp32 accumulation; the SwiGLU
activation is stored in the weights' dtype (as the reference's bf16 matmul
chain rounds it); the down projection is rounded to the weights' dtype (the
reference's F.linear output) and stored so, and the reduction multiplies it by
the fp32 routing weight and sums the K rows in fp32. Under TRITON_INTERPRET=1
tiles are upcast to fp32 right after tl.load (the interpreter's bf16 math is
wrong).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from tinyengine.kernels.launch import dot_precision, interpreting
from tinyengine.kernels.moe.gemm import _down_kernel, _gate_up_kernel
from tinyengine.kernels.moe.tiles import (  # noqa: F401  (re-exported: tests and the sweep use them here)
    CLASS_CONFIGS,
    CLASS_ROWS,
    GEMMS,
    TMA_AW,
    TMA_MODES,
    TMA_OFF,
    TMA_W,
    _resolve,
    max_m_blocks,
    moe_config,
    moe_size_class,
    moe_token_classes,
)
from tinyengine.kernels.tma import descriptor, tma_ok

# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, stride_ids, NUM_EXPERTS: tl.constexpr,
                  E_POW2: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Grid (cdiv(M, BLOCK),). counts[e] += pairs of this chunk routed to e;
    counts starts zeroed. Integer atomics: the result is deterministic."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs * stride_ids, mask=ok, other=0).to(tl.int32)
    hist = tl.histogram(ids, E_POW2, mask=ok)
    e = tl.arange(0, E_POW2)
    tl.atomic_add(counts_ptr + e, hist, mask=e < NUM_EXPERTS)


@triton.jit(do_not_specialize=["num_pairs"])
def _gather_kernel(x_ptr, order_ptr, xs_ptr, num_pairs, stride_xt, stride_xs,
                   TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_D: tl.constexpr):  # fmt: skip
    """Grid (cdiv(M, BLOCK_R), cdiv(D, BLOCK_D)). xs[r] = x[order[r] // K] cast
    to xs's dtype: the activations in sorted-row order, so that gate_up's A
    tiles are contiguous row blocks (TMA-loadable)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_pairs
    token = tl.load(order_ptr + rows, mask=row_ok, other=0) // TOP_K
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (cols < HIDDEN)[None, :]
    v = tl.load(x_ptr + token.to(tl.int64)[:, None] * stride_xt + cols[None, :], mask=ok)
    tl.store(xs_ptr + rows.to(tl.int64)[:, None] * stride_xs + cols[None, :],
             v.to(xs_ptr.dtype.element_ty), mask=ok)  # fmt: skip


@triton.jit
def _sum_topk_kernel(
    y_ptr, topk_weights_ptr, out_ptr, stride_ym, stride_tw_t, stride_tw_k, stride_ot,
    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (T, cdiv(D, BLOCK_D)). out[t] = sum_k w[t, k] * y[t*K + k] in fp32,
    cast once. topk_weights [T, K] may be a strided view."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < HIDDEN
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(TOP_K):
        weight = tl.load(topk_weights_ptr + t * stride_tw_t + k * stride_tw_k).to(tl.float32)
        y = tl.load(y_ptr + (t * TOP_K + k).to(tl.int64) * stride_ym + offs, mask=ok, other=0.0)
        acc += y.to(tl.float32) * weight
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- launcher

_COUNT_BLOCK = 1024  # pairs per histogram program


@dataclass
class _Scratch:
    """fused_moe's intermediates (workspace views when a workspace is given)."""

    keys: torch.Tensor  # [M] the expert ids narrowed to _key_dtype(E): the sort's input
    sorted_ids: torch.Tensor  # [M] sort's values output (unused)
    order: torch.Tensor  # [M] int64: pair index of each sorted row
    counts: torch.Tensor  # [E] int32: pairs per expert
    act: torch.Tensor  # [M, I] weights' dtype: SwiGLU activations, sorted rows
    y: torch.Tensor  # [M, D] weights' dtype: down projections, unsorted pair rows
    xs: torch.Tensor | None = None  # [M, D] weights' dtype: x in sorted-row order (TMA_AW)


def _scratch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
             workspace: Any, sorted_x: bool = False) -> _Scratch:  # fmt: skip
    """sorted_x: also the xs buffer (gate_up with tma=TMA_AW)."""
    num_experts, two_i, hidden = w13.shape
    num_pairs = topk_ids.numel()
    key_dtype = _key_dtype(num_experts)
    specs = [
        ((num_pairs,), key_dtype),
        ((num_pairs,), key_dtype),
        ((num_pairs,), torch.int64),
        ((num_experts,), torch.int32),
        ((num_pairs, two_i // 2), w13.dtype),
        ((num_pairs, hidden), w2.dtype),
    ]
    if sorted_x:
        specs.append(((num_pairs, hidden), w13.dtype))
    if workspace is not None:
        bufs = workspace.get(*specs)
    else:
        bufs = [torch.empty(tuple(shape), dtype=dtype, device=x.device) for shape, dtype in specs]
    return _Scratch(*bufs)


Launch = tuple[Any, tuple[int, ...], tuple, dict[str, Any]]  # kernel, grid, args, kwargs


def _run(launches: list[Launch]) -> None:
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)


def _w_desc_ok(w: torch.Tensor) -> bool:
    """w [E, N, K] viewable as [E*N, K] (rows of consecutive experts abut)."""
    rows = w.shape[0] * w.shape[1]
    return w.stride(0) == w.shape[1] * w.stride(1) and tma_ok(w, rows, w.stride(1))


def _key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds every expert id: the radix sort
    makes one pass per key byte, so int16 keys (E < 32768, every DeepSeek)
    take a quarter of the passes of the router's int64 ids (the grouping's
    time halves at T=4096 x top-8; docs/benchmarks.md)."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def _group(topk_ids: torch.Tensor, s: _Scratch) -> None:
    """order and counts, on the device, in place into the scratch views."""
    flat_ids = topk_ids.reshape(-1)
    s.keys.copy_(flat_ids)
    # Stable: an expert's rows stay in token order (like the reference's sort).
    # (Nothing numeric depends on it -- each row of the GEMMs is computed on
    # its own and written back at its pair's index -- but it keeps every
    # intermediate reproducible run to run.)
    torch.sort(s.keys, stable=True, out=(s.sorted_ids, s.order))
    s.counts.zero_()
    num_experts = s.counts.shape[0]
    _count_kernel[(triton.cdiv(flat_ids.numel(), _COUNT_BLOCK),)](
        flat_ids, s.counts, flat_ids.numel(), flat_ids.stride(0),
        NUM_EXPERTS=num_experts, E_POW2=triton.next_power_of_2(num_experts), BLOCK=_COUNT_BLOCK,
    )  # fmt: skip


def _grid(num_pairs: int, num_experts: int, n: int, c: dict[str, int]) -> tuple[tuple, int]:
    """The 1-D grid (worst-case M-blocks x N-blocks) and the group_m to pass."""
    m_blocks = max_m_blocks(num_pairs, num_experts, c["block_m"])
    group_m = c["group_m"] if 0 < c["group_m"] < m_blocks else m_blocks
    return (m_blocks * triton.cdiv(n, c["block_n"]),), group_m


def _gate_up_launch(x: torch.Tensor, w13: torch.Tensor, s: _Scratch, top_k: int,
                    c: dict[str, int],
                    swiglu_limit: float | None = None) -> list[Launch]:  # fmt: skip
    """gate_up's launches: the gather into s.xs first where c["tma"] is
    TMA_AW (s must then have xs), then the GEMM. A TMA mode that a tensor's
    alignment or layout rules out falls back to pointer loads for it."""
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    num_pairs = s.order.shape[0]
    grid, group_m = _grid(num_pairs, num_experts, inter, c)
    launches = []
    tma_w = c["tma"] >= TMA_W and _w_desc_ok(w13)
    tma_a = c["tma"] >= TMA_AW and s.xs is not None and tma_ok(s.xs, num_pairs, s.xs.stride(0))
    if c["tma"] >= TMA_AW and s.xs is None:
        raise ValueError("fused_moe: tma=TMA_AW for gate_up needs _scratch(..., sorted_x=True)")
    w_arg = w13
    if tma_w:
        w_arg = descriptor(w13, num_experts * two_i, w13.stride(1), [c["block_n"], c["block_k"]])
    tail = c["tail_m"] if tma_a else 0  # tails load by TMA only
    xt_arg = x
    if tma_a:
        block_d = min(1024, triton.next_power_of_2(hidden))
        launches.append((_gather_kernel, (triton.cdiv(num_pairs, 8), triton.cdiv(hidden, block_d)),
                         (x, s.order, s.xs, num_pairs, x.stride(0), s.xs.stride(0)),
                         dict(TOP_K=top_k, HIDDEN=hidden, BLOCK_R=8, BLOCK_D=block_d,
                              num_warps=4)))  # fmt: skip
        x_arg = descriptor(s.xs, num_pairs, s.xs.stride(0), [c["block_m"], c["block_k"]])
        if tail:
            xt_arg = descriptor(s.xs, num_pairs, s.xs.stride(0), [tail, c["block_k"]])
    else:
        x_arg = x
    args = (x_arg, xt_arg, w_arg, s.act, s.order, s.counts,
            x.stride(0), w13.stride(0), w13.stride(1), s.act.stride(0), group_m)  # fmt: skip
    kwargs = dict(
        INTER=inter, HIDDEN=hidden, TOP_K=top_k, NUM_EXPERTS=num_experts,
        E_POW2=triton.next_power_of_2(num_experts), BLOCK_M=c["block_m"],
        BLOCK_N=c["block_n"], BLOCK_K=c["block_k"], TAIL_M=tail, UPCAST=interpreting(),
        TMA_A=tma_a, TMA_W=tma_w, num_warps=c["num_warps"], num_stages=c["num_stages"],
        DOT_PRECISION=dot_precision(w13.dtype),
        SWIGLU_LIMIT=None if swiglu_limit is None else float(swiglu_limit),  # 0 clamps too
    )  # fmt: skip
    launches.append((_gate_up_kernel, grid, args, kwargs))
    return launches


def _down_launch(w2: torch.Tensor, s: _Scratch, c: dict[str, int]) -> list[Launch]:
    num_experts, hidden, inter = w2.shape
    num_pairs = s.order.shape[0]
    grid, group_m = _grid(num_pairs, num_experts, hidden, c)
    tma_w = c["tma"] >= TMA_W and _w_desc_ok(w2)
    tma_a = c["tma"] >= TMA_AW and tma_ok(s.act, num_pairs, s.act.stride(0))
    w_arg, a_arg, at_arg = w2, s.act, s.act
    tail = c["tail_m"] if tma_a else 0  # tails load by TMA only
    if tma_w:
        w_arg = descriptor(w2, num_experts * hidden, w2.stride(1), [c["block_n"], c["block_k"]])
    if tma_a:
        a_arg = descriptor(s.act, num_pairs, s.act.stride(0), [c["block_m"], c["block_k"]])
        if tail:
            at_arg = descriptor(s.act, num_pairs, s.act.stride(0), [tail, c["block_k"]])
    args = (a_arg, at_arg, w_arg, s.y, s.order, s.counts,
            s.act.stride(0), w2.stride(0), w2.stride(1), s.y.stride(0), group_m)  # fmt: skip
    kwargs = dict(
        INTER=inter, HIDDEN=hidden, NUM_EXPERTS=num_experts,
        E_POW2=triton.next_power_of_2(num_experts), BLOCK_M=c["block_m"],
        BLOCK_N=c["block_n"], BLOCK_K=c["block_k"], TAIL_M=tail, UPCAST=interpreting(),
        TMA_A=tma_a, TMA_W=tma_w, num_warps=c["num_warps"], num_stages=c["num_stages"],
        DOT_PRECISION=dot_precision(w2.dtype),
    )  # fmt: skip
    return [(_down_kernel, grid, args, kwargs)]


def _sum_topk(y: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> None:
    num_tokens, hidden = out.shape
    block_d = min(1024, triton.next_power_of_2(hidden))
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        y, topk_weights, out, y.stride(0), topk_weights.stride(0), topk_weights.stride(1),
        out.stride(0), TOP_K=topk_weights.shape[1], HIDDEN=hidden, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip


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
    """Same contract as moe/reference.py's fused_moe; out [T, D] in x.dtype,
    with moe_config's tiles."""
    return launch_fused_moe(
        x, w13, w2, topk_weights, topk_ids, workspace=workspace, swiglu_limit=swiglu_limit
    )


def launch_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    workspace: Any = None,
    config: dict[str, Any] | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """fused_moe with tile overrides (tests and benchmarks/sweep_moe.py):

    config overrides moe_config's tiles (tests and tuning): {"gate_up": {...},
    "down": {...}}, either GEMM and any of its fields."""
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
    cfg = _resolve(
        moe_config(num_tokens, top_k, num_experts, hidden, inter, w13.element_size()), config
    )
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    s = _scratch(x, w13, w2, topk_ids, workspace,
                 sorted_x=cfg["gate_up"]["tma"] >= TMA_AW)  # fmt: skip
    _group(topk_ids, s)
    _run(_gate_up_launch(x, w13, s, top_k, cfg["gate_up"], swiglu_limit))
    _run(_down_launch(w2, s, cfg["down"]))
    _sum_topk(s.y, topk_weights, out)
    return out
