"""DeepSeek-V2 and DeepSeek-V3: MLA attention over a paged latent cache
(models/mla.py) and DeepSeek MoE (models/moe.py), in a decoder stack whose
first `first_k_dense_replace` layers use a dense MLP.

Owns the reading of a DeepSeek config.json (with HF's per-architecture
defaults and quirks: HF writes `head_dim = qk_rope_head_dim`, which is not the
attention head size, and V3's `num_key_value_heads` means nothing for MLA) and
the routing of checkpoint names into this model's parameters: per-expert
tensors into the stacked expert weights (on an expert-parallel rank only its
own experts' tensors; the others are skipped unread), gate_proj/up_proj into
gate_up_proj. Parameter names otherwise mirror HF's, so the loader needs no
renaming.

V2 vs V3 differ only in routing and rope details:
  V2: softmax scores, topk_method "greedy" or "group_limited_greedy", no
      correction bias, rope pairs always interleaved.
  V3: sigmoid scores + e_score_correction_bias, group-limited top-k
      ("noaux_tc"), rope pairs interleaved when `rope_interleave` (default).
Multi-token-prediction layers (index >= num_hidden_layers in the checkpoint)
are never built; the loader skips their tensors.

Must never read files, allocate the KV cache, or choose a backend.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tinyengine.models.context import ForwardContext, KVCacheSpec
from tinyengine.models.layers import CausalLM, DecoderStack, PreNormDecoderLayer, RMSNorm, SwiGLUMLP
from tinyengine.models.mla import DeepseekRotaryEmbedding, MLAAttention, MLADims, mla_softmax_scale
from tinyengine.models.moe import DeepseekMoE, MoEConfig, expert_range
from tinyengine.models.parallel_layers import VocabParallelEmbedding
from tinyengine.models.rotary import get_rope_parameters

_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

# HF's defaults for keys a config.json may leave out (configuration_deepseek_v2/v3.py).
_V2_DEFAULTS: dict[str, Any] = dict(
    intermediate_size=11008, moe_intermediate_size=1407, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
    n_shared_experts=2, num_experts_per_tok=None, first_k_dense_replace=0, n_group=None,
    topk_group=None, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
    max_position_embeddings=2048,
)  # fmt: skip
_V3_DEFAULTS: dict[str, Any] = dict(
    intermediate_size=18432, moe_intermediate_size=2048, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, n_group=8,
    topk_group=4, topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=4096,
)  # fmt: skip

# model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class DeepseekArgs:
    """The config.json fields this family reads, checked once."""

    def __init__(self, hf_config: dict[str, Any], *, is_v3: bool) -> None:
        c = hf_config
        missing = [key for key in _REQUIRED_KEYS if c.get(key) is None]
        if missing:
            raise ValueError(
                f"config.json lacks {missing}, needed to build {c.get('architectures')}; "
                "add them to config.json or pass them via hf_overrides"
            )
        defaults = _V3_DEFAULTS if is_v3 else _V2_DEFAULTS

        def get(key: str) -> Any:
            # A key present with null (q_lora_rank: null) means None, not "default".
            return c[key] if key in c else defaults[key]

        self.hidden_size: int = c["hidden_size"]
        self.num_hidden_layers: int = c["num_hidden_layers"]
        self.vocab_size: int = c["vocab_size"]
        self.intermediate_size: int = get("intermediate_size")
        self.rms_norm_eps: float = c.get("rms_norm_eps", 1e-6)
        self.max_position_embeddings: int = get("max_position_embeddings")
        self.tie_word_embeddings = bool(c.get("tie_word_embeddings", False))
        self.mlp_bias = bool(c.get("mlp_bias", False)) and not is_v3  # V3's MLPs have none
        self.mla = MLADims(
            hidden_size=self.hidden_size,
            num_heads=c["num_attention_heads"],
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=bool(c.get("attention_bias", False)),
        )
        self.rope_parameters = get_rope_parameters(c)
        self.rope_interleaved = bool(c.get("rope_interleave", True)) if is_v3 else True
        self.first_k_dense_replace: int = get("first_k_dense_replace") or 0
        num_experts = get("n_routed_experts")
        self.moe: MoEConfig | None = None
        if num_experts:
            top_k = get("num_experts_per_tok")
            if top_k is None:
                raise ValueError("config.json sets n_routed_experts but not num_experts_per_tok")
            self.moe = MoEConfig(
                hidden_size=self.hidden_size,
                moe_intermediate_size=get("moe_intermediate_size"),
                num_experts=num_experts,
                top_k=top_k,
                n_shared_experts=get("n_shared_experts") or 0,
                # V3 always routes with sigmoid + bias, whatever topk_method says.
                topk_method="noaux_tc" if is_v3 else get("topk_method"),
                n_group=get("n_group"),
                topk_group=get("topk_group"),
                norm_topk_prob=bool(get("norm_topk_prob")),
                routed_scaling_factor=float(get("routed_scaling_factor")),
                mlp_bias=self.mlp_bias,
            )
            self.moe.validate()
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; DeepSeek uses 'silu'")

    def is_moe_layer(self, layer_idx: int) -> bool:
        # Every layer from first_k_dense_replace on, as HF transformers builds
        # it: HF ignores config.json's moe_layer_freq (DeepSeek's own remote
        # code skipped layers i % freq != 0; every released config has 1).
        return self.moe is not None and layer_idx >= self.first_k_dense_replace


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        args: DeepseekArgs,
        layer_idx: int,
        rotary_emb: DeepseekRotaryEmbedding,
        scale: float,
        tp_rank: int,
        tp_size: int,
        expert_parallel: bool,
    ) -> None:
        super().__init__()
        self.self_attn = MLAAttention(args.mla, layer_idx, rotary_emb, scale, tp_rank, tp_size)
        if args.is_moe_layer(layer_idx):
            assert args.moe is not None
            self.mlp: nn.Module = DeepseekMoE(
                args.moe, tp_rank, tp_size, expert_parallel=expert_parallel
            )
        else:
            self.mlp = SwiGLUMLP(
                args.hidden_size, args.intermediate_size, args.mlp_bias, tp_rank, tp_size
            )
        self.is_moe = isinstance(self.mlp, DeepseekMoE)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def run_mlp(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # The MoE takes the whole context (its scratch comes from the workspace).
        if self.is_moe:
            return self.mlp(hidden_states, ctx)
        return self.mlp(hidden_states, ctx.ops)


class DeepseekModel(DecoderStack):
    def __init__(
        self, args: DeepseekArgs, tp_rank: int, tp_size: int, expert_parallel: bool
    ) -> None:
        super().__init__()
        m = args.mla
        self.embed_tokens = VocabParallelEmbedding(
            args.vocab_size, args.hidden_size, tp_rank, tp_size
        )
        # One cos/sin cache shared by all layers.
        self.rotary_emb = DeepseekRotaryEmbedding(
            m.qk_rope_head_dim, args.max_position_embeddings, args.rope_parameters,
            interleaved=args.rope_interleaved,
        )  # fmt: skip
        scale = mla_softmax_scale(args.rope_parameters, m.qk_head_dim)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(args, i, self.rotary_emb, scale, tp_rank, tp_size, expert_parallel)
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class DeepseekV2ForCausalLM(CausalLM):
    # Checkpoint module name -> (fused module name, shard id); dense and
    # shared-expert MLPs. Routed experts go through route_checkpoint_name.
    packed_modules_mapping: dict[str, tuple[str, Any]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    _is_v3 = False
    # EngineConfig's block_size default on CUDA with the Triton backend: the
    # MLA decode kernels then load each 64-row tile as one TMA copy of a whole
    # page (kernels/mla/triton.py; at 128 heads about 2x faster than gathering
    # the rows of 16-token blocks, docs/benchmarks.md).
    cuda_block_size = 64
    # Every op with a batch-dependent result goes through the op set, and MLA
    # takes its absorbed (decode) form for every token in batch-invariant
    # mode (kernels/batch_invariant.py; on a GPU batch_invariant_triton.py).
    batch_invariant_ok = True
    batch_invariant_triton = True
    # load_model(expert_parallel=True): whole routed experts split over the
    # tensor-parallel ranks (models/moe.py's FusedExperts).
    supports_expert_parallel = True

    def __init__(
        self,
        hf_config: dict[str, Any],
        tp_rank: int = 0,
        tp_size: int = 1,
        *,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.args = args = DeepseekArgs(hf_config, is_v3=self._is_v3)
        # The routed experts an expert-parallel rank holds (None: all of them).
        self.local_experts: range | None = None
        if args.moe is not None and expert_parallel:
            self.local_experts = expert_range(args.moe.num_experts, tp_rank, tp_size)
        self.model = DeepseekModel(args, tp_rank, tp_size, expert_parallel)
        self._add_lm_head(tp_rank, tp_size)

    def skips_checkpoint_name(self, ckpt_name: str) -> bool:
        """Names the loader ignores: with n_shared_experts = 0, transformers
        still saves shared-expert MLPs of width 0 (no values), which this
        model, having no shared experts, has no parameters for; and, on an
        expert-parallel rank, the other ranks' experts (never read). An
        expert id past n_routed_experts is not skipped: its loader reports
        the mismatch."""
        moe = self.args.moe
        if moe is None:
            return False
        if moe.n_shared_experts == 0 and ".mlp.shared_experts." in ckpt_name:
            return True
        match = _EXPERT_RE.match(ckpt_name)
        if match is None or self.local_experts is None:
            return False
        expert = int(match.group(2))
        return expert < moe.num_experts and expert not in self.local_experts

    def route_checkpoint_name(self, ckpt_name: str) -> tuple[str, Any] | None:
        """Per-expert checkpoint names -> (stacked parameter, shard id); None
        for every other name (the loader's packed mapping handles those)."""
        match = _EXPERT_RE.match(ckpt_name)
        if match is None:
            return None
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        if proj == "down_proj":
            return f"{prefix}.w2_weight", expert
        return f"{prefix}.w13_weight", (expert, 0 if proj == "gate_proj" else 1)

    def kv_cache_spec(self) -> KVCacheSpec:
        """One latent row (kv_lora_rank + qk_rope_head_dim) per token and layer."""
        return KVCacheSpec(self.num_attention_layers, 1, self.args.mla.latent_width, 0)

    def warmup_token_counts(self, max_num_batched_tokens: int) -> list[int]:
        """Token counts whose kernel tile classes warmup must run: the first
        count of each fused-MoE size class (kernels/moe/tiles.py) over the
        model's MoE layers, ascending; [] without MoE layers."""
        counts = {
            n
            for m in self.modules()
            if isinstance(m, DeepseekMoE)
            for n in m.warmup_token_counts(max_num_batched_tokens)
        }
        return sorted(counts)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    _is_v3 = True
