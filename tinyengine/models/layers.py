"""Building blocks shared by the model families: linear layers whose parameters
know how to load themselves, embeddings, RMSNorm, SiLU-and-mul, the paged
attention layer that talks to the KV cache through the ForwardContext, the
decoder wiring, and `CausalLM`, the LM head and entry points every
*ForCausalLM shares.

Owns the parameter layouts (e.g. q, k and v stacked in one `qkv_proj` weight)
and each parameter's `weight_loader(param, loaded_tensor, shard_id)`, the only
place that knows where a checkpoint tensor lands inside a fused parameter.
Must never read files (that is models/loader.py) nor pick an implementation:
every computing layer takes the op set (`ctx.ops`) and calls its ops.

Tensor parallelism: every layer takes `tp_rank, tp_size`. The parallel
linears and the vocab-parallel embedding / LM head hold only their rank's
slice: their weight loaders narrow each whole checkpoint tensor to it, a
row-parallel product and the embedding all-reduce their partial results, and
the LM head all-gathers the vocab slices of the logits (the collectives are
distributed/tp.py's group). A model family supports tensor_parallel_size > 1
once its own modules use these (the Llama family does); the others refuse it
(check_tp).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyengine.distributed.tp import shard, tp_group
from tinyengine.kernels.opset import OpSet
from tinyengine.models.context import ForwardContext


def check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size != 1 or tp_rank != 0:
        raise NotImplementedError(
            f"tensor parallelism is not implemented yet (got tp_rank={tp_rank}, "
            f"tp_size={tp_size}); run with tp_size=1"
        )


def _new_param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: the loader overwrites every parameter, and
    # skipping a random init keeps building a large model cheap. Built on the
    # current default device/dtype (the loader sets them).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole checkpoint tensor into a parameter of the same shape."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not packed, yet got shard {shard_id!r}")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
            f"{tuple(param.shape)} (does config.json match the weights?)"
        )
    param.data.copy_(loaded)  # copy_ also casts dtype and moves device


def checkpoint_shape(loaded: Any) -> tuple[int, ...]:
    """The shape of a checkpoint tensor: a torch.Tensor, or a safetensors
    slice not read yet (what models/loader.py hands a slicing loader)."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_part(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """[start, start + length) along `dim` of a checkpoint tensor: narrowed
    from a tensor, or read from a safetensors slice (only those bytes)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def sliced_weight_loader(dim: int, start: int, full: int) -> Any:
    """A loader for this rank's slice of a whole checkpoint tensor: `full`
    along `dim` in the checkpoint, [start, start + param's size) kept; it
    reads only that part of a safetensors file (`reads_slices`)."""

    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not packed, yet got shard {shard_id!r}")
        want = list(param.shape)
        want[dim] = full
        if list(checkpoint_shape(loaded)) != want:
            raise ValueError(
                f"shape mismatch: checkpoint has {checkpoint_shape(loaded)}, model expects "
                f"{tuple(want)} (does config.json match the weights?)"
            )
        param.data.copy_(read_part(loaded, dim, start, param.shape[dim]))

    load.reads_slices = True  # type: ignore[attr-defined]
    return load


@dataclass(frozen=True)
class PackedShard:
    """Where one checkpoint tensor of a fused parameter goes: rows [start,
    start + size) of the parameter take rows [src_start, src_start + size)
    of the checkpoint tensor, which has `full` rows (size < full: this
    rank's slice)."""

    start: int
    size: int
    src_start: int
    full: int


def packed_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any) -> None:
    """Copy one checkpoint tensor (e.g. k_proj), or this rank's rows of it,
    into its rows of a fused parameter (e.g. qkv_proj), using the offsets the
    layer recorded; from a safetensors slice it reads only those rows."""
    offsets: dict[Any, PackedShard] = param.shard_offsets  # type: ignore[attr-defined]
    if shard_id not in offsets:
        raise ValueError(f"unknown shard {shard_id!r}; this parameter packs {list(offsets)}")
    where = offsets[shard_id]
    shape = checkpoint_shape(loaded)
    if shape[0] != where.full or shape[1:] != tuple(param.shape[1:]):
        raise ValueError(
            f"shape mismatch for shard {shard_id!r}: checkpoint has {shape}, "
            f"model expects ({where.full}, *{tuple(param.shape[1:])})"
        )
    param.data.narrow(0, where.start, where.size).copy_(
        read_part(loaded, 0, where.src_start, where.size)
    )


packed_weight_loader.reads_slices = True  # type: ignore[attr-defined]


class LinearBase(nn.Module):
    """y = x W^T + b with W [output_size, input_size], this rank's sizes;
    parameters carry a weight_loader. Parallel variants differ only in how
    they shard (their loaders) and whether they reduce (RowParallelLinear)."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _new_param(output_size, input_size)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = _new_param(output_size)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)

    def _pack(self, shards: dict[Any, tuple[int, int, int]]) -> None:
        """Declare that the output rows are several checkpoint tensors stacked:
        shard id -> (rows here, first row kept, rows in the checkpoint)."""
        offsets: dict[Any, PackedShard] = {}
        start = 0
        for shard_id, (size, src_start, full) in shards.items():
            offsets[shard_id] = PackedShard(start, size, src_start, full)
            start += size
        assert start == self.output_size, "packed shards must cover the output exactly"
        for param in (self.weight, self.bias):
            if param is not None:
                param.shard_offsets = offsets  # type: ignore[attr-defined]
                param.weight_loader = packed_weight_loader  # type: ignore[attr-defined]


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(input_size, output_size, bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r * O / tp,
    (r + 1) * O / tp) of W (and of b); its output is that slice, no
    communication."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        start, size = shard(output_size, tp_rank, tp_size, "output features")
        super().__init__(input_size, size, bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = sliced_weight_loader(0, start, output_size)  # type: ignore[attr-defined]


class RowParallelLinear(LinearBase):
    """Input features split across ranks: rank r holds columns [r * I / tp,
    (r + 1) * I / tp) of W and takes that slice of x (a column-parallel
    layer's output); the partial products are all-reduced. The bias is added
    once, by rank 0, before the sum."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        start, size = shard(input_size, tp_rank, tp_size, "input features")
        super().__init__(size, output_size, bias)
        self.weight.weight_loader = sliced_weight_loader(1, start, input_size)  # type: ignore[attr-defined]
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        if self.tp_size == 1:
            return ops.linear(x, self.weight, self.bias)
        partial = ops.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return tp_group().all_reduce(partial)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of the same input fused into one
    matmul (gate_proj and up_proj -> gate_up_proj); shard ids 0, 1, ...
    Each is split across ranks on its own, so rank r holds [gate_r | up_r]."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        shards = {}
        for i, full in enumerate(output_sizes):
            start, size = shard(full, tp_rank, tp_size, f"projection {i}'s output features")
            shards[i] = (size, start, full)
        super().__init__(input_size, sum(size for size, _, _ in shards.values()), bias)
        self.output_sizes = [size for size, _, _ in shards.values()]
        self._pack(shards)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: an equal share, or one (replicated) when there
    are fewer KV heads than ranks (tp_size must then be a multiple)."""
    if num_kv_heads >= tp_size:
        return shard(num_kv_heads, 0, tp_size, "num_key_value_heads")[1]
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide or be a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )
    return 1


def first_kv_head(num_kv_heads: int, tp_rank: int, tp_size: int) -> int:
    """The first KV head rank tp_rank holds (kv_heads_per_rank of them)."""
    if num_kv_heads >= tp_size:
        return tp_rank * kv_heads_per_rank(num_kv_heads, tp_size)
    return tp_rank // (tp_size // num_kv_heads)


class QKVParallelLinear(LinearBase):
    """q, k and v projections fused into one matmul; shard ids "q", "k", "v".
    Output rows: [q (Hq*D) | k (Hkv*D) | v (Hkv*D)] of this rank's heads: an
    equal share of the query heads, and of the KV heads (or the one KV head
    its query heads use, when there are fewer KV heads than ranks)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        q_start, q_heads = shard(num_heads, tp_rank, tp_size, "num_attention_heads")
        kv_heads = kv_heads_per_rank(num_kv_heads, tp_size)
        kv_start = first_kv_head(num_kv_heads, tp_rank, tp_size)
        self.q_size = q_heads * head_dim
        self.kv_size = kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        kv = (self.kv_size, kv_start * head_dim, num_kv_heads * head_dim)
        self._pack({"q": (self.q_size, q_start * head_dim, num_heads * head_dim), "k": kv,
                    "v": kv})  # fmt: skip


class VocabParallelEmbedding(nn.Module):
    """Token embeddings, the vocabulary split across ranks: rank r holds rows
    [r * V_r, (r + 1) * V_r) with V_r = ceil(V / tp) (the last slice padded
    with zero rows). A rank embeds the ids in its slice, zeros for the rest,
    and the all-reduce adds the ranks' rows."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_size = tp_size
        per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * per_rank
        self.weight = _new_param(per_rank, embedding_dim)
        if tp_size == 1:
            self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        else:
            self.weight.weight_loader = self._load_slice  # type: ignore[attr-defined]

    def _load_slice(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        shape = checkpoint_shape(loaded)
        if shard_id is not None or shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(
                f"shape mismatch: checkpoint has {shape}, model expects "
                f"{(self.num_embeddings, param.shape[1])} (does config.json match the weights?)"
            )
        rows = max(0, min(param.shape[0], self.num_embeddings - self.vocab_start))
        param.data.zero_()
        param.data[:rows].copy_(read_part(loaded, 0, self.vocab_start, rows))

    _load_slice.reads_slices = True  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return tp_group().all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocab; may share its weight with the
    input embedding (tie_word_embeddings). Each rank computes its vocab
    slice's logits; the all-gather joins them (padding rows dropped)."""

    def forward(self, hidden_states: torch.Tensor, ops: OpSet) -> torch.Tensor:
        logits = ops.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        return tp_group().all_gather(logits, dim=-1)[..., : self.num_embeddings]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 and rounded the way HF does.

    With `residual`, first adds it (the "fused add" of vLLM) and returns
    (normed, new_residual): the decoder then never materialises the residual
    sum twice.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(
        self, x: torch.Tensor, ops: OpSet, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, residual)


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [..., 2 * I] gate_up activation."""

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        return ops.silu_and_mul(x)

    def of_linear(self, gate_up: LinearBase, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        """self(gate_up(x)) as one op: the Triton set runs a one-row x
        (batch-1 decode) as one GEMV launch with the activation in its epilogue."""
        return ops.linear_silu_mul(x, gate_up.weight, gate_up.bias)


class PreNormDecoderLayer(nn.Module):
    """A decoder layer's residual wiring, shared by the model families:
    norm -> self_attn -> norm -> mlp. A subclass builds `self_attn`, `mlp`,
    `input_layernorm` and `post_attention_layernorm`.

    The residual stream is carried separately and added inside the next norm
    (fused add): layer i returns (mlp_out, residual_before_mlp), and the
    model's final norm forms the last sum.
    """

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states, ctx.ops)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, ctx.ops, residual)
        hidden_states = self.self_attn(positions, hidden_states, ctx)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, ctx.ops, residual)
        return self.run_mlp(hidden_states, ctx), residual

    def run_mlp(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.mlp(hidden_states, ctx.ops)


class DecoderStack(nn.Module):
    """A model's body: embeddings -> decoder layers -> final norm, the residual
    of the last layer added inside that norm. A subclass builds
    `embed_tokens`, `layers` and `norm`."""

    embed_tokens: VocabParallelEmbedding
    layers: nn.ModuleList
    norm: RMSNorm

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, ctx)
        hidden_states, _ = self.norm(hidden_states, ctx.ops, residual)
        return hidden_states


class PagedAttention(nn.Module):
    """Writes this layer's new K/V into the paged cache, then attends over it.

    forward: q [T, Hq, D], k/v [T, Hkv, D] already have RoPE applied.
    forward_rope: q/k before RoPE (the Llama family), rotated on the way into
    the cache. Both return [T, Hq, Dv]. The op set (torch reference or Triton)
    and the cache come from the ForwardContext, so the same module serves every
    backend.
    """

    def __init__(
        self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads: int, scale: float
    ) -> None:
        """num_heads / num_kv_heads: this rank's (QKVParallelLinear's output)."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads={num_heads} must be a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        k_cache, v_cache = self._kv_cache(ctx)
        ctx.ops.write_kv_cache(k, v, k_cache, v_cache, ctx.attn.slot_mapping)
        return self._attend(q, k_cache, v_cache, ctx)

    def forward_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        ctx: ForwardContext,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """forward() for q/k straight out of the projection: the per-head norms
        (if given), RoPE and the cache write are one op (one kernel on the
        Triton backend), then attention. q, k, v may be views of a fused qkv."""
        k_cache, v_cache = self._kv_cache(ctx)
        q = ctx.ops.rope_write_kv(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, ctx.attn.slot_mapping,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            1e-6 if q_norm is None else q_norm.eps,
        )  # fmt: skip
        return self._attend(q, k_cache, v_cache, ctx)

    def _kv_cache(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_idx >= len(ctx.kv_caches):
            raise RuntimeError(
                f"attention layer {self.layer_idx} has no KV cache: ctx.kv_caches holds "
                f"{len(ctx.kv_caches)} layers (allocate one (k, v) pair per attention layer)"
            )
        return ctx.kv_caches[self.layer_idx]

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        attn = ctx.attn
        return ctx.ops.paged_attention(
            q,
            k_cache,
            v_cache,
            attn.block_tables,
            attn.query_start_loc,
            attn.seq_lens,
            self.scale,
            max_query_len=attn.max_query_len,
            max_seq_len=attn.max_seq_len,
            query_start_loc_cpu=attn.query_start_loc_cpu or None,
            seq_lens_cpu=attn.seq_lens_cpu or None,
            workspace=ctx.workspace,
        )


class CausalLM(nn.Module):
    """What every *ForCausalLM shares. A subclass builds `self.args` (with
    vocab_size, hidden_size, num_hidden_layers, tie_word_embeddings) and
    `self.model` (with embed_tokens, called as model(input_ids, positions,
    ctx)), then calls `_add_lm_head`."""

    args: Any
    model: nn.Module

    def _add_lm_head(self, tp_rank: int, tp_size: int) -> None:
        a = self.args
        self.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, tp_rank, tp_size)
        if a.tie_word_embeddings:
            # One Parameter under two names; named_parameters() reports it once
            # (as model.embed_tokens.weight), which is what the loader fills.
            self.lm_head.weight = self.model.embed_tokens.weight
        # Read by the worker (KV allocation, activation estimates) and the tests.
        self.num_attention_layers = a.num_hidden_layers
        self.hidden_size = a.hidden_size
        self.vocab_size = a.vocab_size

    @property
    def tie_word_embeddings(self) -> bool:
        return self.args.tie_word_embeddings

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden_states: torch.Tensor, ops: OpSet) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab_size] in the model's dtype. The runner
        passes only the rows it samples from, so the vocab matmul is not done for
        every token. No fp32 copy here: at batch 256 and a 152k vocabulary it
        costs more than the sampling kernel; the sampler widens the values it
        needs (the fused kernel in registers)."""
        return self.lm_head(hidden_states, ops)
