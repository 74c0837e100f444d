"""The batch-invariant op set (EngineConfig.batch_invariant): the torch ops
whose result for one token could depend on what else is in the batch,
rewritten so that it cannot.

Why a token's result can move. A matmul library picks its algorithm (and
with it the order in which each output's products are summed) from the
shape of the call: a [1, K] x [K, N] product runs a GEMV, a [37, K] one a
blocked GEMM, and the two round differently. Attention sums over a context
whose grouping depends on how many keys the call holds: a prefill chunk's
token and the same token as a decode step see the same keys but not in the
same call. Each difference is a last-bit rounding; a few layers later it is
a different logprob, and sometimes a different token.

What this file does about it: every op a token's numbers go through is
called on blocks of a fixed shape, so each output element is reduced in
one order whatever the batch.

  - Row-wise ops (linear layers, norms): the rows are padded to a multiple
    of ROWS and run ROWS at a time; a row's result then comes from a
    [ROWS, K] call wherever the row sits and whatever its neighbours hold.
  - Attention (`paged_attention`): each sequence's query rows are run ROWS
    at a time against its context cut into KEYS-key blocks; the scores and
    the weighted values of a block are fixed-shape products, and the blocks
    are summed one after another in position order. Keys past a row's own
    position (the rest of its prefill chunk) weigh exactly 0 and values
    past the context are zeroed, so a chunk token adds exactly the terms,
    in exactly the order, that its decode step would (x + 0 and x * 1 are
    exact in floating point). The running max is order-free.
  - MLA (`mla_decode`, `head_matmul`): each row alone over its context's
    KEYS-key blocks, the per-head projections row-blocked; models/mla.py
    sends prefill tokens through this decode form too in this mode.
  - MoE (`fused_moe`): each expert's rows ROWS at a time, a token's experts
    summed in expert order. `row_blocks` (OpSet.per_token) runs the model's
    own per-token torch code, the routers' and V4's hyper-connection mixes,
    one row at a time (by_single_rows says why not ROWS).

The guarantee holds on one device and one build (library, thread count):
it is about the batch, not about machines. It costs the padding (a decode
step of one sequence runs ROWS rows) and Python loops over sequences and
row blocks: this is the torch op set, for the CPU and for checking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tinyengine.kernels.attention.reference import _gather_context
from tinyengine.kernels.gemv.reference import rms_norm_linear_of
from tinyengine.kernels.moe import reference as moe_reference

ROWS = 8  # rows per call of every row-wise op and per attention query block
GPU_ROWS = 64  # rows per call of OpSet.per_token in the GPU's invariant set
KEYS = 16  # keys per attention block


def by_row_blocks(fn: Callable[..., Any], *rows: torch.Tensor, **kwargs: Any) -> Any:
    """fn(*row_tensors, **kwargs) computed ROWS rows at a time: every tensor
    in `rows` shares its first dimension, is zero-padded to a multiple of
    ROWS and cut into blocks; fn's results (a tensor or a tuple of them, row
    for row) are joined and trimmed back."""
    return _blocks_of(ROWS, fn, rows, kwargs)


def by_single_rows(fn: Callable[..., Any], *rows: torch.Tensor, **kwargs: Any) -> Any:
    """fn one row at a time: the CPU set's OpSet.per_token, for model code
    that calls torch directly (hyper-connection mixes, routers). Their
    matmuls can have very few outputs (a V4 head's mixes: hc_mult), and for
    those MKL rounds a row by its index inside an [8, K] call (seen with 2
    and 3 outputs, K <= 128, on an AVX-512 machine), which a fixed block
    shape does not pin down; a [1, K] call has no index."""
    return _blocks_of(1, fn, rows, kwargs)


def by_gpu_row_blocks(fn: Callable[..., Any], *rows: torch.Tensor, **kwargs: Any) -> Any:
    """by_row_blocks with GPU_ROWS rows a block: a row's bits depend only on
    the block's fixed shape, so any fixed size keeps the promise, and on a
    GPU a 64-row call costs about what an 8-row one does."""
    return _blocks_of(GPU_ROWS, fn, rows, kwargs)


def _blocks_of(size: int, fn: Callable[..., Any], rows: tuple, kwargs: dict) -> Any:
    num = rows[0].shape[0]
    pad = -num % size
    if pad:
        rows = tuple(torch.cat([r, r.new_zeros((pad, *r.shape[1:]))]) for r in rows)
    outs = [fn(*(r[i : i + size] for r in rows), **kwargs) for i in range(0, num + pad, size)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:num] for parts in zip(*outs, strict=True))
    return torch.cat(outs)[:num]


def _flat_rows(fn: Callable[..., Any], *rows: torch.Tensor) -> Any:
    """by_row_blocks over tensors of one row per token, any leading shape
    (flattened to rows of their last dimension and back)."""
    shape = rows[0].shape[:-1]
    out = by_row_blocks(fn, *(r.reshape(-1, r.shape[-1]) for r in rows))
    if isinstance(out, tuple):
        return tuple(o.reshape(*shape, o.shape[-1]) for o in out)
    return out.reshape(*shape, out.shape[-1])


def invariant_linears(base: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`linear` and `linear_silu_mul` of the op set `base`, row-blocked."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
        return _flat_rows(lambda r: base.linear(r, weight, bias), x)

    def linear_silu_mul(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Any:
        return _flat_rows(lambda r: base.linear_silu_mul(r, weight, bias), x)

    return linear, linear_silu_mul


def invariant_rms_norm(base: Any) -> Callable[..., Any]:
    """`rms_norm` of the op set `base`, row-blocked (with its residual)."""

    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> Any:
        if residual is None:
            return _flat_rows(lambda r: base.rms_norm(r, weight, eps), x)
        return _flat_rows(lambda r, s: base.rms_norm(r, weight, eps, s), x, residual)

    return rms_norm


def _attend_block(
    q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """ROWS query rows q [ROWS, Hkv, G, D] at `positions` [ROWS] over one
    sequence's context keys/values [L, Hkv, D], L a multiple of KEYS (rows
    past the context zeroed) -> [ROWS, Hkv, G, Dv] fp32."""
    rows, hkv, group, _ = q.shape
    blocks = keys.shape[0] // KEYS
    # [blocks, Hkv, KEYS, D] and per block one fixed-shape product per KV head.
    kb = keys.view(blocks, KEYS, hkv, -1).permute(0, 2, 1, 3)
    vb = values.view(blocks, KEYS, hkv, -1).permute(0, 2, 1, 3)
    qb = q.permute(1, 0, 2, 3).reshape(1, hkv, rows * group, -1).expand(blocks, -1, -1, -1)
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [blocks, Hkv, ROWS*G, KEYS]
    k_pos = torch.arange(blocks * KEYS, device=q.device).view(blocks, 1, 1, KEYS)
    q_pos = positions.repeat_interleave(group).view(1, 1, rows * group, 1)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    top = scores.amax(dim=(0, 3), keepdim=True)  # order-free
    top = torch.where(top == float("-inf"), 0.0, top)
    weights = torch.exp(scores - top)
    partial = torch.matmul(weights, vb)  # [blocks, Hkv, ROWS*G, Dv], KEYS summed per block
    sums = weights.sum(dim=-1, keepdim=True)  # a fixed KEYS-long sum per block
    acc, total = partial[0], sums[0]
    for b in range(1, blocks):  # the blocks one after another, in position order
        acc, total = acc + partial[b], total + sums[b]
    out = acc / torch.where(total == 0, 1.0, total)
    return out.view(hkv, rows, group, -1).permute(1, 0, 2, 3)


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
    """attention/reference.py's paged_attention, batch-invariant (module
    docstring). Eager only: without host lengths (a graph-shaped decode step
    run eagerly by profile or warmup) it reads them from the device."""
    starts, lens = query_start_loc_cpu, seq_lens_cpu
    if starts is None or lens is None:
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        keys = _padded_context(k_cache, block_tables[i], seq_len)
        values = _padded_context(v_cache, block_tables[i], seq_len)
        qs = q[start:end].float().view(end - start, num_kv_heads, group, -1)
        positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        attended = by_row_blocks(
            _attend_block, qs, positions, keys=keys, values=values, scale=scale
        )
        out[start:end] = attended.reshape(end - start, q.shape[1], -1).to(q.dtype)
    return out


def _padded_context(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A sequence's first seq_len cached rows in fp32, zero-padded to whole
    KEYS blocks (zeros, not whatever the cache holds past the context: a
    weight of 0 times a NaN would still be NaN)."""
    padded = torch.zeros(-(-seq_len // KEYS) * KEYS, *cache.shape[2:], device=cache.device)
    padded[:seq_len] = _gather_context(cache, table_row, seq_len, None).float()
    return padded


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
    """mla/reference.py's mla_decode, batch-invariant: each row alone (one
    KV head shared by its H heads) over its own context's KEYS-key blocks,
    keys the latent cache rows, values their latent part."""
    latent_dim = q_latent.shape[2]
    q = torch.cat([q_latent, q_rope], dim=-1).float()
    out = torch.zeros_like(q_latent)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len <= 0:
            continue
        rows = _padded_context(latent_cache, block_tables[b], seq_len)  # [n, 1, L + R]
        position = torch.tensor([seq_len - 1], device=q.device)
        values = rows[..., :latent_dim].contiguous()
        attended = _attend_block(q[b, None, None], position, rows, values, scale)
        out[b] = attended[0, 0].to(out.dtype)
    return out


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """mla/reference.py's head_matmul, row-blocked."""
    return by_row_blocks(lambda r: torch.einsum("tha,hab->thb", r, w), x)


def _expert_mlp(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, swiglu_limit: float | None
) -> torch.Tensor:
    return by_row_blocks(lambda r: moe_reference._expert_mlp(r, w13, w2, swiglu_limit), x)


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
    """moe/reference.py's fused_moe, batch-invariant: each expert's rows
    run ROWS at a time, and a token's sum over its experts is formed in
    expert order whatever else was routed (as the reference does)."""
    moe_reference._check(x, w13, w2, topk_ids)
    return moe_reference.moe_by_expert(
        x, w13, w2, topk_weights, topk_ids, swiglu_limit, _expert_mlp
    )


def batch_invariant_ops(base: Any) -> Any:
    """The op set `base` with its batch-dependent ops replaced: the Triton
    set's by kernels/batch_invariant_triton.py's, the torch set's by this
    module's."""
    if base.name == "triton":
        from tinyengine.kernels.batch_invariant_triton import batch_invariant_triton_ops

        return batch_invariant_triton_ops(base)
    from tinyengine.kernels.batch_invariant_v4 import with_v4_ops  # it imports this module

    linear, linear_silu_mul = invariant_linears(base)
    norm = invariant_rms_norm(base)
    ops = dataclasses.replace(
        base,
        linear=linear,
        linear_silu_mul=linear_silu_mul,
        rms_norm=norm,
        rms_norm_linear=rms_norm_linear_of(norm, linear, linear_silu_mul),
        paged_attention=paged_attention,
        mla_decode=mla_decode,
        head_matmul=head_matmul,
        fused_moe=fused_moe,
        row_blocks=by_single_rows,
    )
    return with_v4_ops(ops)
