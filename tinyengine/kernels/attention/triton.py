"""Triton paged attention: the launchers of one kernel for prefill/mixed
batches and of a split-KV ("flash-decoding") kernel plus its reduce for
decode-only batches (the kernels: attention/kernels.py), and `paged_attention`,
which dispatches between them. The tile choices live in attention/tiles.py;
`prefill_attention` and `decode_attention` take tile overrides for tests and
sweeps, the op set's `paged_attention` never does.

Owns the GPU implementation of the two attention ops whose numerical definition
lives in attention/reference.py (the torch reference); the signatures are the
same, so a model never knows which backend runs. Layout and indexing are
written out in docs/kernels.md.

Must never (each one breaks CUDA-graph capture or replay):
  - read a device tensor on the host (.item(), .tolist(), boolean indexing);
  - size a grid or pick a kernel from tensor *contents* -- only from host ints
    (shapes, max_query_len, max_seq_len) that the caller passes;
  - allocate scratch outside the workspace arena when one is given (outputs
    are allocated with torch.empty; that is the caller's tensor, not scratch).

Numerics: every tile is upcast to fp32 for softmax bookkeeping; scores live in
the log2 domain (scale * log2(e) folded into one multiplier, so exp2 replaces
exp). On the GPU the two matmuls take the storage dtype (bf16/fp16 tensor
cores; fp32 tiles in 3xTF32, `dot_precision`) and accumulate in fp32. Under
TRITON_INTERPRET=1 the tiles are upcast to fp32 right after tl.load because
the interpreter computes bf16 math wrongly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import triton

import tinyengine.kernels.attention.gluon as prefill_gluon
from tinyengine.kernels.attention.cache_write import write_kv_cache_triton
from tinyengine.kernels.attention.kernels import (
    _decode_reduce_kernel,
    _decode_split_kernel,
    _prefill_kernel,
)
from tinyengine.kernels.attention.tiles import (
    DECODE_MAX_SPLITS,
    decode_config,
    decode_num_splits,
    prefill_config,
)
from tinyengine.kernels.gluon_support import GluonUnavailable
from tinyengine.kernels.launch import (
    LOG2E,
    dot_precision,
    interpreting,
    num_sms,
    pdl_kwargs,
)


def _num_sms(device: torch.device) -> int:
    # Off the GPU, 132 SMs (an H200's count): the interpreter then takes the GPU's split choices.
    return num_sms(device, off_gpu=132)


# ----------------------------------------------------------------------------- launchers


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Validate shapes (host metadata only) and return the GQA group size."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            "paged_attention: expected q [T, Hq, Dk] and caches [num_blocks, block_size, Hkv, D];"
            f" got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)},"
            f" v_cache {tuple(v_cache.shape)}"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: the head dim of q and of the caches must be contiguous")
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"paged_attention: {num_q_heads} query heads is not a multiple of "
            f"{num_kv_heads} KV heads (GQA needs Hq % Hkv == 0)"
        )
    return num_q_heads // num_kv_heads


def _max_offset(t: torch.Tensor) -> int:
    """The largest element offset from t's data pointer: not numel() - 1 for a
    strided view (K and V share rows of one allocation, so each spans ~2x)."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def offsets_fit_32(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether every element offset into the caches fits int32 (cheaper address
    math in the inner loop). Fixed once the KV cache is allocated, so warmup
    compiles the variant that serving uses; inside `wide_offsets()` never."""
    return not _wide_offsets and max(_max_offset(k_cache), _max_offset(v_cache)) < 2**31


_wide_offsets = False


@contextlib.contextmanager
def wide_offsets() -> Iterator[None]:
    """Within it the kernels take 64-bit cache offsets whatever the caches'
    size: startup's dry run (worker/precompile.py) compiles the variants of a
    KV cache too large for int32 offsets before that cache exists, against
    profile's one-block cache. Only for compile-only forwards: nothing else
    changes what a kernel computes, but it would run slower address math."""
    global _wide_offsets
    _wide_offsets = True
    try:
        yield
    finally:
        _wide_offsets = False


def _common_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[int, ...]:  # fmt: skip
    return (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
    )  # fmt: skip


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, *, max_query_len: int, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> None:  # fmt: skip
    """Causal paged attention for any varlen batch (decode rows, chunks after a
    cached prefix, whole prompts), written into `out` [T, Hq, Dv]."""
    group = _check_layout(q, k_cache, v_cache)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs == 0 or max_query_len == 0:
        return
    head_dim_k, head_dim_v = q.shape[2], v_cache.shape[3]
    overridden = any(x is not None for x in (block_m, block_n, num_warps, num_stages))
    indices = (block_tables, query_start_loc, seq_lens)
    if not overridden and prefill_gluon.supports(q, k_cache, v_cache, indices, max_query_len):
        try:  # Hopper, long prefills: the warp-specialized kernel (attention/gluon.py)
            prefill_gluon.launch(q, k_cache, v_cache, out, block_tables, query_start_loc,
                                 seq_lens, scale * LOG2E)  # fmt: skip
            return
        except GluonUnavailable:
            pass
    cfg_m, cfg_n, cfg_warps, cfg_stages = prefill_config(
        head_dim_k, max_query_len, group, q.element_size()
    )
    block_m, block_n = block_m or cfg_m, block_n or cfg_n  # overrides: tests and tuning only
    num_warps, num_stages = num_warps or cfg_warps, num_stages or cfg_stages
    if block_m < group:
        raise ValueError(f"prefill_attention: block_m={block_m} < GQA group {group}")
    block_q = block_m // group  # query tokens per tile
    # Sum over sequences of cdiv(q_len_i, block_q) <= T // block_q + num_seqs.
    num_tiles = q.shape[0] // block_q + num_seqs
    grid = (num_tiles * k_cache.shape[2],)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, num_seqs, *_common_args(q, k_cache, v_cache, out, block_tables),
        NUM_KV_HEADS=k_cache.shape[2], GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM_K=head_dim_k, HEAD_DIM_V=head_dim_v,
        BLOCK_DK=triton.next_power_of_2(head_dim_k), BLOCK_DV=_prefill_block_dv(head_dim_v),
        UPCAST=interpreting(), OFFS_32=offsets_fit_32(k_cache, v_cache),
        DOT_PRECISION=dot_precision(k_cache.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def _prefill_block_dv(head_dim_v: int) -> int:
    """The P @ V tile's width: at least 32. With 16 (value heads of <= 16,
    small test models), Triton 3.6's sm_90 code for that MMA reads shared
    memory out of bounds (compute-sanitizer: an illegal access in the
    `tl.dot(p, v, ...)` of _attend_tile); the extra columns are masked."""
    return max(32, triton.next_power_of_2(head_dim_v))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, *, max_seq_len: int, workspace: Any = None,
    num_splits: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> None:  # fmt: skip
    """Split-KV decode (every q_len <= 1) into `out`; scratch from `workspace`."""
    group = _check_layout(q, k_cache, v_cache)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs == 0:
        return
    num_q_heads, head_dim_k = q.shape[1], q.shape[2]
    num_kv_heads, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(q.device))
    cfg = decode_config(num_seqs, num_q_heads, num_kv_heads, head_dim_k)
    block_n, num_warps, num_stages = block_n or cfg[0], num_warps or cfg[1], num_stages or cfg[2]
    direct = num_splits == 1
    pdl = pdl_kwargs(q.device)
    if direct:  # no partials: the split kernel writes `out` itself
        part_out = part_lse = out
    elif workspace is not None:
        part_out, part_lse = workspace.get(
            ((num_seqs, num_q_heads, num_splits, head_dim_v), torch.float32),
            ((num_seqs, num_q_heads, num_splits), torch.float32),
        )
    else:
        part_out = torch.empty(num_seqs, num_q_heads, num_splits, head_dim_v, device=q.device)
        part_lse = torch.empty(num_seqs, num_q_heads, num_splits, device=q.device)
    common = _common_args(q, k_cache, v_cache, out, block_tables)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, num_splits, *common,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM_K=head_dim_k, HEAD_DIM_V=head_dim_v,
        BLOCK_DK=triton.next_power_of_2(head_dim_k), BLOCK_DV=triton.next_power_of_2(head_dim_v),
        DIRECT=direct, UPCAST=interpreting(), OFFS_32=offsets_fit_32(k_cache, v_cache),
        DOT_PRECISION=dot_precision(k_cache.dtype), EARLY_K=num_warps == 1,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )  # fmt: skip
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            out, part_out, part_lse, query_start_loc, seq_lens, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM_V=head_dim_v, BLOCK_DV=triton.next_power_of_2(head_dim_v),
            SPLIT_BLOCK_N=block_n,
            # Fixed, not next_power_of_2(num_splits): the split count varies with the
            # context length, and every distinct BLOCK_S would be a new compile.
            BLOCK_S=triton.next_power_of_2(max(num_splits, DECODE_MAX_SPLITS)), num_warps=4,
            **pdl,
        )  # fmt: skip


# ----------------------------------------------------------------------------- the op set


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
    """Same contract as attention/reference.py's paged_attention; out [T, Hq, Dv].

    Decode-only batches (max_query_len == 1) take the split-KV kernel, all
    others the prefill/mixed kernel. Rows past query_start_loc[-1] are zeros:
    with query_start_loc_cpu given only that tail is zeroed (before the
    kernels run, so a stale host list can never erase a real row); without it
    the whole output starts as zeros.
    """
    del seq_lens_cpu  # kernels read the device lengths; the host list is for the reference
    # A decode batch with one row per sequence (a decode graph's padding rows
    # are one-token sequences too) has every row written by the decode
    # kernels, so its output needs no zeroing: one fill kernel a layer less.
    every_row = max_query_len == 1 and q.shape[0] == query_start_loc.shape[0] - 1
    out = paged_output(q, v_cache, query_start_loc_cpu, every_row_written=every_row)
    if max_query_len == 1:
        decode_attention(
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale,
            max_seq_len=max_seq_len, workspace=workspace,
        )  # fmt: skip
    else:
        prefill_attention(
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale,
            max_query_len=max_query_len,
        )  # fmt: skip
    return out


def paged_output(
    q: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc_cpu: list[int] | None,
    *,
    every_row_written: bool = False,
) -> torch.Tensor:
    """paged_attention's output [T, Hq, Dv]: rows past query_start_loc[-1]
    zeroed (only that tail when the host list is given, before any kernel
    runs, so a stale list can never erase a real row), else all zeros; left
    uninitialized when the caller's kernels write every row
    (`every_row_written`: T one-token sequences, max_query_len 1)."""
    shape = (q.shape[0], q.shape[1], v_cache.shape[3])
    if every_row_written:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if not query_start_loc_cpu:
        return torch.zeros(shape, dtype=q.dtype, device=q.device)
    out = torch.empty(shape, dtype=q.dtype, device=q.device)
    if query_start_loc_cpu[-1] < q.shape[0]:
        out[query_start_loc_cpu[-1] :].zero_()
    return out


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as attention/reference.py's write_kv_cache (Triton scatter)."""
    write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
