"""RMSNorm fused into the linear layer after it, for decode batches of up
to NORM_MAX_M rows (now 2): the Triton op set's `rms_norm_linear`, with the
signature of gemv/reference.py's

    rms_norm_linear(x [M, K], norm_weight [K], eps, residual [M, K] | None,
                    weight [N, K], bias [N] | None, *, silu_mul=False)
        -> (linear(rms_norm(x + residual)), x + residual)

(silu_mul: the linear is a gate_up projection followed by SiLU-and-mul, as
`linear_silu_mul`). A pre-norm decoder layer runs norm -> linear twice, and
at a few rows the norm is a launch of its own that reads a few KB and sits
on the step's critical path. Here the skinny GEMM (gemv/kernel.py, its NORM
prologue) does it: every program reads the rows, forms x + residual,
normalizes them with the norm kernel's rounding steps, and multiplies;
program 0 stores the new residual. On the FMA tile (1-2 rows, gemv/tiles.py's
FMA_MAX_M) one K step holds the rows (K <= ONE_STEP_MAX_K), and it fuses
with 4 or more weight rows a program (K <= 2048; below that the row's bytes
rival the weight's). On the DOT loop (more rows, when NORM_MAX_M allows
them) each program sums the rows' squares over K first, then normalizes each
chunk as it loads it; it fuses when the linear is not split over K (a split
launch's slices would each need the whole rows). Everything else runs the
Triton norm and then the linear, the same numbers up to the order of one
fp32 sum of squares.

Graph-safe like the skinny kernel: host ints only, nothing allocated but
the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import tinyengine.kernels.gemv.silu as gemv_silu
import tinyengine.kernels.gemv.triton as gemv
from tinyengine.kernels.gemv.reference import rms_norm_linear_of
from tinyengine.kernels.gemv.tiles import FMA_MAX_M, GemvConfig, pick_config
from tinyengine.kernels.norm.triton import rms_norm

MIN_FUSED_BLOCK_N = 4
# The most rows the dispatcher fuses. Past FMA_MAX_M that is the DOT loop's
# prologue, whose programs each read the rows twice (their sums of squares,
# then each K step) from L2 to save the norm's launch: a trade the decode
# step must show faster before this bound rises past FMA_MAX_M
# (docs/benchmarks.md). `skinny_rms_norm_linear` serves any rows up to
# MAX_M when called directly (tests, sweeps).
NORM_MAX_M = FMA_MAX_M


def _fusable(x: torch.Tensor, norm_weight: torch.Tensor, residual: torch.Tensor | None,
             weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> bool:  # fmt: skip
    if x.dim() != 2 or not 1 <= x.shape[0] <= NORM_MAX_M or not x.is_contiguous():
        return False
    if not gemv.skinny_linear_ok(x, weight, bias):
        return False
    k = x.shape[1]
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        return False
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):  # fmt: skip
        return False
    if silu_mul and weight.shape[0] % 2:
        return False
    cfg = pick_config(x.shape[0], weight.shape[0], k, gemv._num_sms(x.device))
    if cfg.use_dot:  # a fused launch is never split over K: only tiles that are not
        return silu_mul or cfg.split_k == 1
    # Each program reads the row (and the residual) whole: 2K elements beside
    # its BLOCK_N x K of weight. At BLOCK_N < 4 that is half of its bytes or
    # more (from L2, but on the step's critical path), so those stay unfused.
    return cfg.block_k >= k and cfg.block_n >= MIN_FUSED_BLOCK_N


def rms_norm_linear_with(linear: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """The op with `linear` where the fused launch does not apply (the Triton
    norm, then that linear: the op set's, which may hold a workspace)."""
    unfused = rms_norm_linear_of(rms_norm, linear, gemv_silu.linear_silu_mul)

    def rms_norm_linear(
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        silu_mul: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(rms_norm(x [+ residual])), the new residual: x + residual,
        or x itself without one): one skinny launch where it applies, else
        the norm kernel and then the linear."""
        if not _fusable(x, norm_weight, residual, weight, bias, silu_mul):
            return unfused(x, norm_weight, eps, residual, weight, bias, silu_mul=silu_mul)
        return skinny_rms_norm_linear(x, norm_weight, eps, residual, weight, bias,
                                      silu_mul=silu_mul)  # fmt: skip

    return rms_norm_linear


def skinny_rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused launch (rms_norm_linear's contract) for rows x whose K fits
    one step of the FMA tile pick_config gives (or `config`, for tests and
    sweeps); raises otherwise."""
    gemv.check_operands("skinny_rms_norm_linear", "x [M, K], weight [N, K]", x, weight, bias)
    m, k = x.shape
    n_rows = weight.shape[0]
    cfg = config if config is not None else pick_config(m, n_rows, k, gemv._num_sms(x.device))
    if not cfg.use_dot and cfg.block_k < k:
        raise ValueError(
            f"skinny_rms_norm_linear: the FMA tile needs K <= one step; got x "
            f"{tuple(x.shape)} and the tile {cfg}"
        )
    if m > gemv.MAX_M:
        raise ValueError(f"skinny_rms_norm_linear: M must be in 1..{gemv.MAX_M}, got {m}")
    if silu_mul and n_rows % 2:
        raise ValueError(f"skinny_rms_norm_linear: gate_up needs an even row count, got {n_rows}")
    n = n_rows // 2 if silu_mul else n_rows
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    norm = gemv.NormPrologue(norm_weight, eps, residual, residual_out)
    if n > 0:
        gemv._launch(x, weight, bias, out, n, cfg, fuse_silu_mul=silu_mul, norm=norm)
    return out, residual_out if residual_out is not None else x


rms_norm_linear = rms_norm_linear_with(gemv.linear)  # without a workspace: no split over K
