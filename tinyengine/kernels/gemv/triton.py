"""Skinny GEMM (GEMV for M == 1): y = x W^T + b for a handful of rows, the
decode-time shape of every linear layer. A torch reference and a Triton kernel
with the same signature (the reference: gemv/reference.py):

    skinny_linear*(x [M, K], weight [N, K], bias [N] | None, out=None) -> [M, N]

At a few rows a linear layer is a weight stream: 2*N*K bytes of weight against
~2*M*N*K FLOPs. cuBLAS picks tensor-core GEMM tiles meant for large M and reads
the weight at ~60% of HBM bandwidth; this kernel gives each program BLOCK_N
weight rows, walks K in BLOCK_K-wide coalesced chunks (the x chunk is loaded
once per step for all M rows, M padded to a constexpr power of two), and
accumulates in fp32. Two inner loops, picked per config:

  - FMA   (M == 1): a [BLOCK_N, BLOCK_K] fp32 accumulator of products,
          reduced across K once at the end (no per-step shuffles); with
          num_stages >= 2 the weight loads are cp.async-pipelined through
          shared memory, with 1 they are plain 16-byte register loads.
          More rows (FMA_ROWS) only with a one-step tile (K <= BLOCK_K): the
          weight slice is loaded once and each row's products are reduced in
          turn, every row's sum the one-row kernel's (the dispatcher sends
          2 rows here, gemv/tiles.py says why not more).
  - DOT   (any M <= MAX_M = 64): tl.dot(W tile [BLOCK_N, BLOCK_K], x^T
          [BLOCK_K, BLOCK_M]) ("swap AB": the weight is the MMA's A operand,
          x padded to BLOCK_M = 16, 32 or 64 rows, the MMA's N),
          the loads software-pipelined over num_stages. When the output has
          too few tiles to cover the SMs (a small model's o_proj, down_proj)
          the config splits K (HAS_SPLIT, gemv/split_k.py): fp32 partials in
          the workspace's arena, summed in slice order by the tile's last
          program, found by an atomic ticket.
          Under TRITON_INTERPRET=1 the tiles are upcast to fp32 before the dot
          (the interpreter computes bf16 dots wrongly).

The kernel itself is gemv/kernel.py's (its device functions gemv/steps.py's).

CUDA-graph safe: no host syncs, nothing allocated but the output (the
split's scratch is the workspace's, sized at warmup like every op's), the grid
and the config come from host ints only (shapes and the SM count), and a model
needs few compiled variants (one per config x dtype; N and K are runtime
args), all compiled during the engine's warmup of each decode batch size.

`linear(x, weight, bias, workspace=None)` is the Triton op set's linear (its
reference is F.linear; the op set binds the runner's workspace): the kernel
when `skinny_linear_ok` holds (up to MAX_M rows), F.linear otherwise. The
kernel also has a fused gate_up + SiLU-and-mul epilogue (constexpr
FUSE_SILU_MUL), launched by gemv/silu.py. Tiles: gemv/tiles.py;
`skinny_linear(config=...)` takes an override for benchmarks/bench_gemv.py's
sweep, `linear` never does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from tinyengine.kernels.gemv.kernel import _skinny_gemm_kernel
from tinyengine.kernels.gemv.split_k import split_k_plan
from tinyengine.kernels.gemv.tiles import GemvConfig, pick_config
from tinyengine.kernels.launch import interpreting, num_sms, pdl_kwargs
from tinyengine.kernels.workspace import Workspace

# The most rows the kernel takes, and the dispatcher sends (the rest go to
# F.linear): on a 0.6B model's linears the DOT loop beat cuBLAS per matrix at
# 16 rows and on the sum of a layer's four at 64, and the decode step at
# 12-64 rows was 2-12% faster with it (the fused gate_up + SiLU launch
# included); at 256 rows cuBLAS won every matrix (docs/benchmarks.md).
MAX_M = 64


@dataclass(frozen=True)
class NormPrologue:
    """The RMSNorm a skinny launch applies to its one-row x first
    (gemv/norm_linear.py): the norm weight and eps, and with a residual,
    where program 0 stores x + residual."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: tests only
_DISPATCH_DTYPES = (torch.bfloat16, torch.float16)


def _num_sms(device: torch.device) -> int:
    return num_sms(device, off_gpu=1)  # the interpreter: any grid is fine


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Everything but the device and the switch: shapes, dtypes, layouts."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and x.shape[1] == weight.shape[1]
        and x.shape[1] > 0
        and x.dtype in _DISPATCH_DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and x.stride(1) == 1
        and x.device == weight.device
        and not (x.requires_grad and torch.is_grad_enabled())
        and (
            bias is None
            or (bias.dtype == x.dtype and bias.dim() == 1 and bias.is_contiguous()
                and bias.shape[0] == weight.shape[0] and bias.device == x.device)
        )
    )  # fmt: skip


# For more than one row the dispatcher sends only weights up to this many
# bytes: the DOT loop beat cuBLAS at 2-8 rows on a 0.6B model's 4-13 MB
# matrices (cuBLAS's large-M tiles leave them few programs), while on
# Llama-3-8B's 33-235 MB ones cuBLAS won (docs/benchmarks.md); one row
# always takes the kernel.
DISPATCH_MAX_BYTES_MULTI_ROW = 16 << 20


def skinny_linear_ok(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """Use the Triton kernel? On CUDA, 2-D x with up to MAX_M rows (more
    than one: a weight of at most DISPATCH_MAX_BYTES_MULTI_ROW), bf16/fp16,
    contiguous weight of the same dtype; otherwise the caller uses F.linear."""
    return (
        x.is_cuda
        and weight.is_cuda
        and _eligible(x, weight, bias)
        and (
            x.shape[0] == 1
            or weight.numel() * weight.element_size() <= DISPATCH_MAX_BYTES_MULTI_ROW
        )
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    workspace: Workspace | None = None,
) -> torch.Tensor:  # fmt: skip
    """F.linear, through the skinny kernel where it applies (split over K
    when a workspace holds the partials: the op set binds the runner's)."""
    if skinny_linear_ok(x, weight, bias):
        return skinny_linear(x, weight, bias, workspace=workspace)
    return F.linear(x, weight, bias)


def check_operands(
    name: str, shapes: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """What every launch of the skinny kernel needs of x [M, K], weight [N, K]
    and bias [N]: 2-D operands with equal K, one supported dtype for all three,
    contiguous last dims (`shapes` names the expected shapes in the message)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: need {shapes}; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"{name}: dtypes {x.dtype}, {weight.dtype} unsupported")
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"{name}: bias dtype {bias.dtype} != {x.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name}: x and weight need a contiguous last dim")
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"{name}: bias must be contiguous [{n}]")


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """y = x W^T + b for x [M <= MAX_M, K]; `config` overrides the tuned
    choice (benchmarks sweep through it). The config's split over K runs
    only with a `workspace` (its arena holds the fp32 partials, its tickets
    count the slices); without one, or past a locked arena's size, one
    program per tile takes all of K."""
    check_operands("skinny_linear", "x [M, K], weight [N, K]", x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"skinny_linear: M must be in 1..{MAX_M}, got {m}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"skinny_linear: out must be [{m}, {n}] with a contiguous last dim")
    if n == 0:
        return out

    cfg = config if config is not None else pick_config(m, n, k, _num_sms(x.device))
    _launch(x, weight, bias, out, n, cfg, fuse_silu_mul=False, workspace=workspace)
    return out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    n: int,
    cfg: GemvConfig,
    fuse_silu_mul: bool,
    norm: NormPrologue | None = None,
    workspace: Workspace | None = None,
) -> None:
    """One _skinny_gemm_kernel launch over n output columns (checked args).
    `norm`: x is RMSNorm's input (the NORM prologue: the DOT loop, or the
    FMA config in one K step); such a launch is never split over K."""
    m, k = x.shape
    use_dot = cfg.use_dot
    block_m = max(16 if use_dot else 1, triton.next_power_of_2(m))  # tl.dot's smallest N: 16
    block_k = max(16, min(cfg.block_k, triton.next_power_of_2(k)))
    block_n = max(16, cfg.block_n) if use_dot else cfg.block_n
    cols = block_n // 2 if fuse_silu_mul else block_n  # output columns per program
    tiles = triton.cdiv(n, cols)
    if not use_dot and m > 1 and block_k < k:
        raise ValueError("skinny GEMM: the FMA config serves more than one row in one K step only")
    if norm is not None and not use_dot and block_k < k:
        raise ValueError("skinny GEMM: the RMSNorm prologue on the FMA config needs one K step")
    has_split = use_dot and not fuse_silu_mul and norm is None  # plain DOT: one compile
    split_k = cfg.split_k if has_split else 1
    split, k_split, parts, tickets = split_k_plan(
        workspace, split_k, k, block_k, block_m, block_n, tiles, out
    )
    nw, res, res_out = (norm.weight, norm.residual, norm.residual_out) if norm else (x, None, None)
    _skinny_gemm_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, out,
        nw, res if res is not None else x, res_out if res_out is not None else x,
        parts, tickets, m, n, k, norm.eps if norm else 0.0, k_split, split,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_N=n % cols == 0, EVEN_K=k % block_k == 0,
        USE_DOT=use_dot, REDUCE_EACH_STEP=cfg.reduce_each_step and not use_dot,
        LOOP_STAGES=cfg.num_stages, UPCAST=interpreting(),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interpreting() else "tf32",
        FUSE_SILU_MUL=fuse_silu_mul, NORM=norm is not None, NORM_RESIDUAL=res is not None,
        HAS_SPLIT=has_split, FMA_ROWS=not use_dot and m > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x.device),
    )  # fmt: skip
