"""The Llama family: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias) and
Qwen3ForCausalLM (per-head RMSNorm on q and k before RoPE), all with GQA and
optional tied embeddings.

Owns the architecture and the mapping from HF checkpoint names to this
model's fused parameters (`packed_modules_mapping`). Parameter names mirror
HF's (model.layers.N.self_attn...), so the loader needs no renaming beyond the
fusions. Must never read files, allocate the KV cache, or choose an attention
backend: the ForwardContext brings the cache and the ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tinyengine.models.context import ForwardContext, KVCacheSpec
from tinyengine.models.layers import (
    CausalLM,
    DecoderStack,
    PagedAttention,
    PreNormDecoderLayer,
    RMSNorm,
    SwiGLUMLP,
    norm_linear,
)
from tinyengine.models.parallel_layers import (
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tinyengine.models.rotary import RotaryEmbedding, get_rope_parameters

_REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


class LlamaArgs:
    """The config.json fields this family reads, with HF's defaults, checked once."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        *,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        qk_norm: bool = False,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        # `defaults`: the architecture's own values for keys config.json may
        # omit, where they differ from Llama's (transformers' config classes).
        c = {**(defaults or {}), **hf_config}
        missing = [key for key in _REQUIRED_KEYS if c.get(key) is None]
        if missing:
            raise ValueError(
                f"config.json lacks {missing}, needed to build {c.get('architectures')}; "
                "add them to config.json or pass them via hf_overrides"
            )
        self.hidden_size: int = c["hidden_size"]
        self.num_hidden_layers: int = c["num_hidden_layers"]
        self.num_heads: int = c["num_attention_heads"]
        self.num_kv_heads: int = c.get("num_key_value_heads") or self.num_heads  # null: MHA
        self.head_dim: int = c.get("head_dim") or self.hidden_size // self.num_heads
        self.intermediate_size: int = c["intermediate_size"]
        self.vocab_size: int = c["vocab_size"]
        self.rms_norm_eps: float = c.get("rms_norm_eps", 1e-6)
        self.max_position_embeddings: int = c.get("max_position_embeddings", 2048)
        self.tie_word_embeddings: bool = bool(c.get("tie_word_embeddings", False))
        attention_bias = bool(c.get("attention_bias", False))
        # Llama and Qwen3 put `attention_bias` on all four projections; Qwen2
        # hard-codes bias on q/k/v and none on o_proj (its class says so).
        self.qkv_bias: bool = attention_bias if qkv_bias is None else qkv_bias
        self.o_bias: bool = attention_bias if o_bias is None else o_bias
        self.mlp_bias: bool = bool(c.get("mlp_bias", False))
        self.qk_norm = qk_norm
        self.rope_parameters = get_rope_parameters(c)
        self._reject_unsupported(c)

    def _reject_unsupported(self, c: dict[str, Any]) -> None:
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; the Llama family uses 'silu'")
        if float(self.rope_parameters.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported for the Llama family")
        layer_types = c.get("layer_types")
        if not layer_types:  # an older config.json: derived as transformers does
            # (Qwen2: layers from max_window_layers on slide; 28 is its default)
            first = c.get("max_window_layers", 28) if c.get("use_sliding_window") else None
            layer_types = [
                "sliding_attention" if first is not None and i >= first else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        # use_sliding_window with max_window_layers >= the layer count slides
        # nowhere: such a model is plain full attention, as in HF.
        if "sliding_attention" in layer_types[: self.num_hidden_layers]:
            raise ValueError(
                "sliding-window attention is not supported; set use_sliding_window=false "
                "(and no 'sliding_attention' in layer_types) in config.json or hf_overrides"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        args: LlamaArgs,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads,
            bias=args.qkv_bias, tp_rank=tp_rank, tp_size=tp_size,
        )  # fmt: skip
        # This rank's heads (all of them at tp_size 1).
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.num_heads = self.q_size // args.head_dim
        self.num_kv_heads = self.kv_size // args.head_dim
        self.o_proj = RowParallelLinear(
            args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias,
            tp_rank=tp_rank, tp_size=tp_size,
        )  # fmt: skip
        if args.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(args.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(
            layer_idx, self.num_heads, args.head_dim, self.num_kv_heads, scale=args.head_dim**-0.5
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden_states, ctx.ops), ctx)

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The layer after its qkv projection: [T, q + 2 kv] -> [T, hidden]."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # Qwen3's per-head norms (before RoPE: order matters), RoPE, and the
        # K/V cache write are one op (ctx.ops.rope_write_kv).
        out = self.attn.forward_rope(
            q, k, v, positions, self.rotary_emb.cos_sin_cache, ctx, self.q_norm, self.k_norm
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size), ctx.ops)


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        args: LlamaArgs,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, layer_idx, rotary_emb, tp_rank, tp_size)
        self.mlp = SwiGLUMLP(
            args.hidden_size, args.intermediate_size, args.mlp_bias, tp_rank, tp_size
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """PreNormDecoderLayer's wiring with each norm and the column-parallel
        linear after it as one op (ops.rms_norm_linear: one launch at batch 1)."""
        ops = ctx.ops
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = norm_linear(ops, self.input_layernorm, hidden_states, residual,
                                    attn.qkv_proj)  # fmt: skip
        hidden_states = attn.attend(positions, qkv, ctx)
        act, residual = norm_linear(ops, self.post_attention_layernorm, hidden_states, residual,
                                    mlp.gate_up_proj, silu_mul=True)  # fmt: skip
        return mlp.down_proj(act, ops), residual


class LlamaModel(DecoderStack):
    def __init__(self, args: LlamaArgs, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            args.vocab_size, args.hidden_size, tp_rank, tp_size
        )
        # One cos/sin cache for all layers (it is max_position x head_dim; one
        # per layer would cost num_layers times that for identical data).
        self.rotary_emb = RotaryEmbedding(
            args.head_dim, args.max_position_embeddings, args.rope_parameters
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, i, self.rotary_emb, tp_rank, tp_size)
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    # Every op with a batch-dependent result goes through the op set, which
    # EngineConfig.batch_invariant swaps (kernels/batch_invariant.py), on a
    # GPU for the invariant Triton ops (kernels/batch_invariant_triton.py).
    batch_invariant_ok = True
    batch_invariant_triton = True
    # Checkpoint module name -> (fused module name, shard id in it).
    packed_modules_mapping: dict[str, tuple[str, Any]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Per-architecture switches (None: follow config.json's attention_bias).
    _qkv_bias: bool | None = None
    _o_bias: bool | None = None
    _qk_norm: bool = False
    _config_defaults: dict[str, Any] = {}

    def __init__(self, hf_config: dict[str, Any], tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        args = LlamaArgs(
            hf_config, qkv_bias=self._qkv_bias, o_bias=self._o_bias, qk_norm=self._qk_norm,
            defaults=self._config_defaults,
        )  # fmt: skip
        self.args = args
        self.model = LlamaModel(args, tp_rank, tp_size)
        self._add_lm_head(tp_rank, tp_size)

    def kv_cache_spec(self) -> KVCacheSpec:
        """This rank's cache: its KV heads of every layer."""
        a, attn = self.args, self.model.layers[0].self_attn
        return KVCacheSpec(self.num_attention_layers, attn.num_kv_heads, a.head_dim, a.head_dim)

    def warmup_token_counts(self, max_num_batched_tokens: int) -> list[int]:
        """Token counts whose kernel tile classes warmup must run: none (the
        dense layers' kernels pick tiles by query length, which warmup covers
        with its power-of-two prefills)."""
        return []


# Qwen2Config's and Qwen3Config's defaults that differ from LlamaConfig's
# (a missing num_key_value_heads is 32 there, an explicit null is MHA).
_QWEN_DEFAULTS = {"max_position_embeddings": 32768, "num_key_value_heads": 32}


class Qwen2ForCausalLM(LlamaForCausalLM):
    _qkv_bias = True
    _o_bias = False
    _config_defaults = _QWEN_DEFAULTS


class Qwen3ForCausalLM(LlamaForCausalLM):
    _qk_norm = True
    _config_defaults = {**_QWEN_DEFAULTS, "head_dim": 128}
