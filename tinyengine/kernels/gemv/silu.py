"""Fused gate_up GEMV + SiLU-and-mul for small-batch decode: a gated MLP's
gate_up projection and its activation in one launch of gemv/triton.py's
skinny kernel, with the signature pair

    skinny_linear_silu_mul_*(x [M, K], weight [2I, K], bias [2I] | None, out=None)
        -> silu(y[:, :I]) * y[:, I:]   [M, I],   y = x W^T + b

The skinny kernel with its constexpr FUSE_SILU_MUL: each program's BLOCK_N
weight rows interleave BLOCK_N / 2 gate rows j with their up rows I + j, the
K loop is the plain one, and the epilogue rounds y to the dtype (as the plain
store does) and then computes silu(gate) * up in fp32, rounded once, exactly
as activation/triton.py's kernel does. The config is the plain launch's for
the [2I, K] weight, so every row's fp32 sum is computed as the plain launch
computes it and the result is meant to equal skinny_linear followed by
silu_and_mul_triton bit for bit, with one launch and no [M, 2I] intermediate
(the plain launch's split over K, if it has one, is not taken: the
activation needs each whole sum).

`linear_silu_mul(x, gate_up_weight, bias)` is the Triton op set's
linear_silu_mul (the reference: gemv/reference.py): the fused kernel when
`skinny_linear_ok` holds for x (up to MAX_M rows), else `linear`
then the activation.
`skinny_linear_silu_mul(config=...)` takes a tile override for tests and
sweeps; `linear_silu_mul` never does.
"""

from __future__ import annotations

import torch

import tinyengine.kernels.gemv.triton as gemv
from tinyengine.kernels.activation.triton import silu_and_mul_op
from tinyengine.kernels.gemv.tiles import GemvConfig, pick_config
from tinyengine.kernels.gemv.triton import _launch, _num_sms, check_operands


def skinny_linear_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """silu(gate) * up of y = x W^T + b in one launch, for x [M <= MAX_M, K]
    and a gate_up weight [2I, K] (rows :I gate, I: up), bias [2I] | None ->
    [M, I].

    The config is the plain launch's for this weight (pick_config(M, 2I, K),
    never split over K: the activation needs the whole sum):
    its BLOCK_N counts weight rows per program, here BLOCK_N // 2 gate rows and
    their BLOCK_N // 2 up rows, so the tile, the K loop and hence every row's
    fp32 sum are the plain kernel's, and the result is meant to equal
    skinny_linear followed by silu_and_mul_triton bit for bit. Graph-safe like
    skinny_linear: host ints only, nothing allocated but `out`."""
    name = "skinny_linear_silu_mul"
    check_operands(name, "x [M, K], weight [2I, K]", x, weight, bias)
    m, k = x.shape
    n2 = weight.shape[0]
    if not 1 <= m <= gemv.MAX_M:
        raise ValueError(f"{name}: M must be in 1..{gemv.MAX_M}, got {m}")
    if n2 % 2:
        raise ValueError(f"{name}: gate_up weight needs an even row count, got {n2}")
    inter = n2 // 2
    if out is None:
        out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    elif out.shape != (m, inter) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(
            f"skinny_linear_silu_mul: out must be {x.dtype} [{m}, {inter}] with a contiguous "
            "last dim"
        )
    if inter == 0:
        return out

    cfg = config if config is not None else pick_config(m, n2, k, _num_sms(x.device))
    if not cfg.use_dot and (cfg.block_n < 2 or cfg.block_n & (cfg.block_n - 1)):
        raise ValueError(
            f"skinny_linear_silu_mul: BLOCK_N must be a power of two >= 2, got {cfg.block_n}"
        )
    _launch(x, weight, bias, out, inter, cfg, fuse_silu_mul=True)
    return out


def linear_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of F.linear(x, weight, bias) for a gate_up weight
    [2I, K]: one fused launch where the skinny kernel applies (x of up to
    MAX_M rows), otherwise `linear` then the op set's activation."""
    if (
        x.dim() == 2
        and weight.shape[0] % 2 == 0
        and gemv.skinny_linear_ok(x, weight, bias)  # (a module attribute: tests patch it)
    ):
        return skinny_linear_silu_mul(x, weight, bias)
    return silu_and_mul_op(gemv.linear(x, weight, bias))
