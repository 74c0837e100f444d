"""The batch-invariant op set on the GPU (EngineConfig.batch_invariant with
the Triton op set): the Triton set with its batch-dependent ops replaced by
kernels whose result for one token cannot depend on the rest of the batch.
kernels/batch_invariant.py says what the mode promises and why a normal
engine breaks it; this file is the GPU's way of keeping it.

The rule is the torch set's (every value a token depends on is reduced in
an order fixed by that token alone), kept without padding or host loops, so
steps stay CUDA-graph safe:

  - Linear layers (`linear`, `linear_silu_mul`): tensor-core Triton kernels
    only, one program per output over the whole K (no split-K): the skinny
    kernel's MMA path (kernels/gemv/, never its FMA path) for up to 16 rows,
    kernels/gemm/triton.py above. A row's bits do not depend on the tiles
    (kernels/gemm/triton.py says what was measured), so both can pick tiles
    per M. cuBLAS is never called.
  - Attention (`paged_attention`): every step, decode or prefill, through
    the prefill/mixed kernel, whose rows each walk their own context in
    64-key tiles from key 0 with one online-softmax update a tile; a decode
    row is a one-token sequence, a prefill token a row of its chunk, and
    tiles a row cannot see are exact no-ops (weight 0, running max
    unchanged). The tile keeps at least 64 rows: its softmax reductions then
    run in the same lanes whatever the tile holds (16-row tiles with 4 warps
    spread a row across warps and round differently). No split-KV: a split
    count that follows the batch would change the sum's grouping.
  - MLA (`mla_decode`): one split per row. The split kernel's tile is the
    model's alone (kernels/mla/tiles.py); only its split count follows the
    batch, and a split's keys come from cutting the row's context into that
    many parts. Every token takes this absorbed form (models/mla.py), a
    prefill token as the decode row it would be; the per-head projections
    (`head_matmul`) run on 8-row blocks as in the torch set.
  - The MoE (`fused_moe`, unchanged): its grouped GEMMs are tensor-core
    products without split-K (the tile class that follows the token count
    does not change a row's bits), and each token's K expert rows are summed
    in slot order by one program.
  - Norms, the RoPE prologue, the activation and the sampler's draw are
    already one program per row with tiles fixed by the model's widths.

  - DeepSeek-V4's ops: kernels/batch_invariant_v4_triton.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tinyengine.kernels.activation.triton import silu_and_mul_op
from tinyengine.kernels.attention.tiles import prefill_config
from tinyengine.kernels.attention.triton import paged_output, prefill_attention
from tinyengine.kernels.batch_invariant import by_gpu_row_blocks, head_matmul
from tinyengine.kernels.batch_invariant_v4_triton import with_v4_triton_ops
from tinyengine.kernels.gemm.triton import matmul
from tinyengine.kernels.gemv.reference import rms_norm_linear_of
from tinyengine.kernels.gemv.silu import skinny_linear_silu_mul
from tinyengine.kernels.gemv.tiles import GemvConfig, pick_config
from tinyengine.kernels.gemv.triton import _num_sms, skinny_linear
from tinyengine.kernels.mla.triton import launch_mla_decode

_MIN_TILE_ROWS = 64  # attention tile rows at least (module docstring)
# Rows on the skinny kernel's tensor-core path; more go to the GEMM. Either
# forms a row's sum as the same MMA chain (kernels/gemm/triton.py), so the
# bound moves speed, not bits.
_SKINNY_MAX_ROWS = 16
# One row on tensor cores: 64 weight rows a program, 128-wide K steps, six
# stages in flight. Within ~5% of the FMA kernel's default on every
# Llama-3-8B decode shape on an H200 (the 2..8-row config, tuned for the MMA
# at 8 rows, is 20-35% slower at one).
_ONE_ROW = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=6, use_dot=True)


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, K] with a contiguous last dimension."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _skinny_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """The skinny kernel's tensor-core config for m <= 16 rows (never FMA,
    M == 1's default)."""
    return _ONE_ROW if m == 1 else pick_config(m, n, k, _num_sms(device), tensor_cores=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on tensor cores whatever the row count (module docstring)."""
    x2 = _rows_2d(x)
    m, (n, k) = x2.shape[0], weight.shape
    if 0 < m <= _SKINNY_MAX_ROWS:
        out = skinny_linear(x2, weight, bias, config=_skinny_config(m, n, k, x.device))
    else:
        out = matmul(x2, weight, bias)
    return out.view(*x.shape[:-1], n)


def linear_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of `linear` for a gate_up weight [2I, K]: fused for one
    row (the skinny kernel rounds each half and applies the activation
    exactly as the activation kernel does), `linear` then the activation
    kernel otherwise: the same bits either way."""
    x2 = _rows_2d(x)
    n2, k = weight.shape
    if x2.shape[0] == 1:
        cfg = _skinny_config(1, n2, k, x.device)
        out = skinny_linear_silu_mul(x2, weight, bias, config=cfg)
    else:
        out = silu_and_mul_op(linear(x2, weight, bias))
    return out.view(*x.shape[:-1], n2 // 2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    query_start_loc_cpu: list[int] | None = None,
    seq_lens_cpu: list[int] | None = None,
    workspace: Any = None,
) -> torch.Tensor:
    """attention/triton.py's paged_attention through its prefill/mixed kernel
    for every step, tiles of at least 64 rows (module docstring)."""
    del max_seq_len, seq_lens_cpu, workspace
    out = paged_output(q, v_cache, query_start_loc_cpu)
    group = q.shape[1] // k_cache.shape[2]
    # The tile config of a query length whose tile holds >= _MIN_TILE_ROWS rows.
    tile_query_len = max(max_query_len, -(-_MIN_TILE_ROWS // group))
    block_m, block_n, warps, stages = prefill_config(
        q.shape[2], tile_query_len, group, q.element_size()
    )
    prefill_attention(
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale,
        max_query_len=max_query_len, block_m=block_m, block_n=block_n, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    workspace: Any = None,
) -> torch.Tensor:
    """mla/triton.py's mla_decode with one split per row (module docstring)."""
    return launch_mla_decode(
        q_latent, q_rope, latent_cache, block_tables, seq_lens, scale,
        max_seq_len=max_seq_len, workspace=workspace, num_splits=1,
    )  # fmt: skip


def batch_invariant_triton_ops(base: Any) -> Any:
    """The Triton op set `base` (on a GPU) with its batch-dependent ops replaced."""
    # The norm + linear pair unfused: the fused launch (one row) and the norm
    # kernel then a linear (more rows) may round a row's sum of squares apart.
    ops = dataclasses.replace(
        base, linear=linear, linear_silu_mul=linear_silu_mul, paged_attention=paged_attention,
        rms_norm_linear=rms_norm_linear_of(base.rms_norm, linear, linear_silu_mul),
        mla_decode=mla_decode, head_matmul=head_matmul, row_blocks=by_gpu_row_blocks,
    )  # fmt: skip
    return with_v4_triton_ops(ops)
