"""Building blocks shared by the model families: RMSNorm, SiLU-and-mul and
the SwiGLU MLP, the
paged attention layer that talks to the KV cache through the ForwardContext,
the decoder wiring, and `CausalLM`, the LM head and entry points every
*ForCausalLM shares. The linear layers, the embedding and their weight
loaders (and how they shard across tensor-parallel ranks) are
parallel_layers.py's.

Must never read files (that is models/loader.py) nor pick an implementation:
every computing layer takes the op set (`ctx.ops`) and calls its ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tinyengine.distributed.tp import shard
from tinyengine.kernels.opset import OpSet
from tinyengine.models.context import ForwardContext
from tinyengine.models.parallel_layers import (
    LinearBase,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)


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


def norm_linear(
    ops: OpSet,
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    linear: LinearBase,
    *,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """linear(norm(x [+ residual])) and the new residual (x itself without
    one) as one op; silu_mul: the linear is a gate_up projection and
    SiLU-and-mul follows. For linears that do not reduce across ranks
    (replicated or column-parallel): the op gets the weight, not the module."""
    if isinstance(linear, RowParallelLinear):
        raise TypeError("norm_linear: a row-parallel linear all-reduces; call it as a module")
    return ops.rms_norm_linear(
        x, norm.weight, norm.eps, residual, linear.weight, linear.bias, silu_mul=silu_mul
    )


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [..., 2 * I] gate_up activation."""

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        return ops.silu_and_mul(x)

    def of_linear(self, gate_up: LinearBase, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        """self(gate_up(x)) as one op: the Triton set runs a one-row x
        (batch-1 decode) as one GEMV launch with the activation in its epilogue."""
        return ops.linear_silu_mul(x, gate_up.weight, gate_up.bias)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into gate_up_proj."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, tp_rank: int, tp_size: int,
        what: str = "intermediate_size",
    ) -> None:  # fmt: skip
        super().__init__()
        # Each rank holds an equal slice of the features; `what` names the
        # config field in the error when tensor_parallel_size does not divide it.
        shard(intermediate_size, tp_rank, tp_size, what)
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, **tp
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, **tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        return self.down_proj(self.act_fn.of_linear(self.gate_up_proj, x, ops), ops)


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
        for layer in ctx.decoder_layers(self.layers):
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
        return ctx.splitting_op(self._attend, q)

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
        return ctx.splitting_op(self._attend, q)

    def _kv_cache(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_idx >= len(ctx.kv_caches):
            raise RuntimeError(
                f"attention layer {self.layer_idx} has no KV cache: ctx.kv_caches holds "
                f"{len(ctx.kv_caches)} layers (allocate one (k, v) pair per attention layer)"
            )
        return ctx.kv_caches[self.layer_idx]

    def _attend(self, ctx: ForwardContext, q: torch.Tensor) -> torch.Tensor:
        """The splitting op (ForwardContext.splitting_op): the cache write
        before it reads only slot_mapping, a per-token device buffer."""
        k_cache, v_cache = self._kv_cache(ctx)
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
    _layer_kinds: tuple[int, ...] | None = None  # layer_kinds(), once computed

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

    def layer_kinds(self) -> tuple[int, ...]:
        """One decoder layer of each kind, by index: the first two (the first
        starts the residual stream, the second adds to it), then the first of
        every other build (module types, parameter and buffer names, shapes
        and dtypes: a MoE layer beside dense ones, a V4 layer type or routing
        kind). Layers of one kind run the same kernels at the same shapes and
        ask the workspace for the same scratch, so startup's shape runs
        (ForwardContext.running_only) run only these."""
        if self._layer_kinds is None:
            layers = self.model.layers
            kinds: dict[tuple, int] = {}
            for i, layer in enumerate(layers):
                kinds.setdefault(_build_of(layer), i)
            self._layer_kinds = tuple(sorted({*range(min(2, len(layers))), *kinds.values()}))
        return self._layer_kinds

    def compute_logits(self, hidden_states: torch.Tensor, ops: OpSet) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab_size] in the model's dtype. The runner
        passes only the rows it samples from, so the vocab matmul is not done for
        every token. No fp32 copy here: at batch 256 and a 152k vocabulary it
        costs more than the sampling kernel; the sampler widens the values it
        needs (the fused kernel in registers)."""
        return self.lm_head(hidden_states, ops)


def _build_of(layer: nn.Module) -> tuple:
    """What a decoder layer is built of: its modules' types, and its
    parameters' and buffers' names, shapes and dtypes."""
    modules = tuple((name, type(m).__name__) for name, m in layer.named_modules())
    tensors = tuple(
        (name, tuple(t.shape), t.dtype)
        for name, t in (*layer.named_parameters(), *layer.named_buffers())
    )
    return modules, tensors
