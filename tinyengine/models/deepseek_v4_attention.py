"""DeepSeek-V4 attention: its two rotaries, the KV compressor, the lightning
indexer, and the attention block over a sliding window plus compressed
entries.

Per layer type (config.json `layer_types`):
  sliding_attention             the last `sliding_window` raw KV rows
  compressed_sparse_attention   (CSA) + compressed entries, one per 4 tokens from
                                overlapping windows, of which the indexer keeps
                                the top `index_topk` per query
  heavily_compressed_attention  (HCA) + every compressed entry, one per 128 tokens
The KV is one head shared by all query heads, K = V; the rope slice is the
last qk_rope_head_dim channels, rotated in interleaved pairs; the output's
rope slice is rotated back (so each value contributes by relative position);
a learned sink per head joins every softmax. The output projection is
grouped: a block-diagonal o_a_proj over `o_groups` head groups, then o_b_proj.

Owns the module structure (parameter names mirror Hugging Face's
DeepseekV4Attention, so HF-named checkpoints load as they are), how it
shards across tensor-parallel ranks (V4Attention: query heads and output
groups split, the KV head, compressor and indexer whole), and what each
layer keeps in its paged cache (`cache_tensors`, the same on every rank).
The arithmetic over pages is the op set's (kernels/compressor, indexer,
sparse_attention). Modules HF keeps in fp32 (compressor and indexer
projections and position biases, the sinks) are fp32 here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tinyengine.distributed.tp import shard
from tinyengine.kernels.compressor.reference import rope_tail
from tinyengine.kernels.opset import OpSet
from tinyengine.models.context import ForwardContext, PagedTensor
from tinyengine.models.layers import RMSNorm
from tinyengine.models.parallel_layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
    mark_reads_part,
    sliced_weight_loader,
)
from tinyengine.models.rotary import RopeCache, rope_frequencies

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)


@dataclass(frozen=True)
class V4AttentionDims:
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float


def fp32_param(*shape: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


class Fp32Linear(nn.Module):
    """A bias-free projection HF keeps in fp32: fp32 weight, fp32 result."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = fp32_param(output_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight.t()


class V4Rotary(RopeCache):
    """cos/sin of one of V4's two rope types ("main": default RoPE for sliding
    layers; "compress": YaRN for CSA/HCA layers, their compressors and the
    indexer), applied to the last rope_dim channels in interleaved pairs."""

    def __init__(self, rope_dim: int, params: dict[str, Any], max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_frequencies(rope_dim, params, max_positions)
        self._init_cache(inv_freq, attention_factor, max_positions, torch.float32)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return cos, sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False):
        """x [T, D] or [T, H, D]: the rope slice rotated by `positions` (back, if inverse)."""
        cos, sin = self.cos_sin(positions)
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        return rope_tail(x, cos, -sin if inverse else sin)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's DeepseekV4UnweightedRMSNorm: x * rsqrt(mean(x^2) + eps), the
    factor computed in fp32 and cast to x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4Compressor(nn.Module):
    """One compressed entry per `ratio` tokens (kernels/compressor). With
    `overlap` (CSA and the indexer) each token projects to 2 * dim: the halves
    feed this window's entry and the next one's."""

    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap, self.eps = dim, ratio, overlap, eps
        self.kv_proj = Fp32Linear(hidden_size, width)
        self.gate_proj = Fp32Linear(hidden_size, width)
        self.position_bias = fp32_param(ratio, width)
        self.kv_norm = RMSNorm(dim, eps)

    def cache_tensors(self, prefix: str) -> tuple[PagedTensor, ...]:
        width = 2 * self.dim if self.overlap else self.dim
        return (
            PagedTensor(f"{prefix}state", 2 * width, dtype=torch.float32),
            PagedTensor(f"{prefix}entries", self.dim, tokens_per_row=self.ratio),
        )

    def update(self, x: torch.Tensor, cache: dict, prefix: str, ctx: ForwardContext,
               rotary: V4Rotary) -> None:  # fmt: skip
        """Page this step's per-token state [kv_proj(x) | gate_proj(x)], then
        write the entries it completes (one op: a decode step is one launch)."""
        kv, gate = ctx.ops.per_token(lambda r: (self.kv_proj(r), self.gate_proj(r)), x)
        ctx.ops.write_and_compress(
            cache[f"{prefix}state"], cache[f"{prefix}entries"], kv, gate, ctx.attn,
            ratio=self.ratio, overlap=self.overlap,
            position_bias=self.position_bias, norm_weight=self.kv_norm.weight, eps=self.eps,
            cos_sin=rotary.cos_sin_cache,
        )  # fmt: skip


class V4IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.weights_proj = Fp32Linear(hidden_size, num_heads)


class V4Indexer(V4Compressor):
    """The lightning indexer (CSA): its own compressor at index_head_dim, and
    queries from the q-LoRA residual scored against its compressed keys."""

    def __init__(self, d: V4AttentionDims, ratio: int) -> None:
        super().__init__(d.hidden_size, d.index_head_dim, ratio, True, d.rms_norm_eps)
        self.num_heads, self.topk = d.index_n_heads, d.index_topk
        self.q_b_proj = ReplicatedLinear(d.q_lora_rank, d.index_n_heads * d.index_head_dim, False)
        self.scorer = V4IndexerScorer(d.hidden_size, d.index_n_heads)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
               cache: dict, ctx: ForwardContext, rotary: V4Rotary) -> torch.Tensor:  # fmt: skip
        """[T, index_topk] entry ids per query (-1: none)."""
        self.update(x, cache, "index_", ctx, rotary)

        def queries(r: torch.Tensor, res: torch.Tensor, pos: torch.Tensor) -> tuple:
            q = self.q_b_proj(res, ctx.ops).view(r.shape[0], self.num_heads, self.dim)
            return rotary.rotate(q, pos), self.scorer.weights_proj(r) * self.num_heads**-0.5

        q, weights = ctx.ops.per_token(queries, x, q_residual, positions)
        return ctx.ops.indexer_topk(
            q, weights, cache["index_entries"], ctx.attn, ratio=self.ratio, topk=self.topk,
            scale=self.dim**-0.5, block_size=cache["kv"].shape[1], workspace=ctx.workspace,
        )  # fmt: skip


class V4Attention(nn.Module):
    """Under tensor parallelism a rank keeps an equal share of the query
    heads and of the output groups (the heads of its groups: group g holds
    heads [g * H / G, (g + 1) * H / G)): its rows of q_b_proj and o_a_proj,
    its heads' sinks, its groups' input columns of o_b_proj, whose partial
    products are all-reduced. The one KV head, the compressor and the
    indexer stay whole on every rank, so every rank pages the same cache."""

    def __init__(self, d: V4AttentionDims, layer_idx: int, layer_type: str, ratio: int,
                 rotary: V4Rotary, tp_rank: int = 0, tp_size: int = 1) -> None:  # fmt: skip
        super().__init__()
        first_head, heads = shard(d.num_heads, tp_rank, tp_size, "num_attention_heads")
        _, groups = shard(d.o_groups, tp_rank, tp_size, "o_groups")
        # This rank's heads and groups: everything after the projections sees only them.
        self.d = dataclasses.replace(d, num_heads=heads, o_groups=groups)
        self.layer_idx, self.layer_type, self.ratio = layer_idx, layer_type, ratio
        self.rotary = rotary  # shared with the other layers of its rope type
        h, hd, tp = d.num_heads, d.head_dim, {"tp_rank": tp_rank, "tp_size": tp_size}
        self.q_a_proj = ReplicatedLinear(d.hidden_size, d.q_lora_rank, False)
        self.q_a_norm = RMSNorm(d.q_lora_rank, d.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(d.q_lora_rank, h * hd, False, **tp)
        self.kv_proj = ReplicatedLinear(d.hidden_size, hd, False)
        self.kv_norm = RMSNorm(hd, d.rms_norm_eps)
        # Block-diagonal: group g maps its heads' h * hd / G channels to
        # o_lora_rank (output rows [g * o_lora_rank, (g + 1) * o_lora_rank)).
        o_in = h * hd // d.o_groups
        self.o_a_proj = ColumnParallelLinear(o_in, d.o_groups * d.o_lora_rank, False, **tp)
        self.o_b_proj = RowParallelLinear(d.o_groups * d.o_lora_rank, d.hidden_size, False, **tp)
        self.sinks = fp32_param(heads)
        self.sinks.weight_loader = sliced_weight_loader(0, first_head, h)  # type: ignore[attr-defined]
        mark_reads_part(self.sinks, tp_size > 1)
        self.compressor: V4Compressor | None = None
        if layer_type != SLIDING:
            self.compressor = V4Compressor(
                d.hidden_size, hd, ratio, overlap=layer_type == CSA, eps=d.rms_norm_eps
            )
            if layer_type == CSA:
                self.compressor.indexer = V4Indexer(d, ratio)  # d: the whole model's dims

    def tokens_kept(self) -> int:
        """How far back before the next token to compute this layer's
        per-token rows are read: the window's raw rows (window - 1 earlier
        positions), and the compressor state of the windows the next chunk
        completes (2m - 1 with overlap, m - 1 without)."""
        kept = self.d.sliding_window - 1
        if self.compressor is not None:
            kept = max(kept, (2 if self.compressor.overlap else 1) * self.ratio - 1)
        return kept

    def cache_tensors(self) -> tuple[PagedTensor, ...]:
        tensors = (PagedTensor("kv", self.d.head_dim),)
        if self.compressor is not None:
            tensors += self.compressor.cache_tensors("")
            if self.layer_type == CSA:
                tensors += self.compressor.indexer.cache_tensors("index_")
        return tensors

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        ops = ctx.ops
        q_residual, q, kv = ops.per_token(lambda r, p: self._prologue(r, p, ops), x, positions)
        ops.write_rows(ctx.kv_caches[self.layer_idx]["kv"], kv, ctx.attn.slot_mapping)
        out = ctx.splitting_op(self._attention, x, q_residual, q, positions)
        return ops.per_token(lambda o, p: self._epilogue(o, p, ops), out, positions)

    def _attention(self, ctx: ForwardContext, x: torch.Tensor, q_residual: torch.Tensor,
                   q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The splitting op (ForwardContext.splitting_op): the compressors
        and the indexer read the step's lengths as much as attention does,
        so they run inside it, projections included."""
        d, cache = self.d, ctx.kv_caches[self.layer_idx]
        topk = None
        if self.compressor is not None:
            self.compressor.update(x, cache, "", ctx, self.rotary)
            if self.layer_type == CSA:
                topk = self.compressor.indexer.select(
                    x, q_residual, positions, cache, ctx, self.rotary
                )
        return ctx.ops.sparse_attention(
            q, cache["kv"], ctx.attn, window=d.sliding_window, sinks=self.sinks,
            scale=d.head_dim**-0.5, entry_cache=cache.get("entries"), ratio=self.ratio,
            topk_indices=topk, workspace=ctx.workspace,
        )  # fmt: skip

    def _prologue(self, x: torch.Tensor, positions: torch.Tensor, ops: OpSet) -> tuple:
        """Per token: (the q-LoRA residual, the roped queries, the roped kv row)."""
        d = self.d
        q_residual = self.q_a_norm(self.q_a_proj(x, ops), ops)
        q = self.q_b_proj(q_residual, ops).view(x.shape[0], d.num_heads, d.head_dim)
        q = self.rotary.rotate(unweighted_rms_norm(q, d.rms_norm_eps), positions)
        kv = self.rotary.rotate(self.kv_norm(self.kv_proj(x, ops), ops), positions)
        return q_residual, q, kv

    def _epilogue(self, out: torch.Tensor, positions: torch.Tensor, ops: OpSet) -> torch.Tensor:
        """Per token: the output rotated back, then the grouped output projection."""
        d = self.d
        out = self.rotary.rotate(out, positions, inverse=True)
        grouped = out.view(out.shape[0], d.o_groups, -1)
        weight = self.o_a_proj.weight.view(d.o_groups, d.o_lora_rank, -1)
        out = torch.einsum("tgi,goi->tgo", grouped, weight).flatten(1)
        return self.o_b_proj(out, ops)
