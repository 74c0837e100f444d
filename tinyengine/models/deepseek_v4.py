"""DeepSeek-V4: hybrid sliding-window / compressed attention
(models/deepseek_v4_attention.py), manifold-constrained hyper-connections
(mHC) in place of the residual, and MoE with hash routing in the first layers.

The residual is `hc_mult` streams [T, hc, hidden]. Before attention and before
the MoE, weights computed from the RMS-normalised flattened streams collapse
them into the block's input (`pre`), expand the block's output back (`post`)
and mix the streams (`comb`, made doubly stochastic by Sinkhorn iterations);
`hc_head` collapses them before the final norm. Routing: `hash_moe` layers
take their experts from a fixed token-id table (tid2eid), `moe` layers the
top-k of sqrt(softplus(logits)) + a correction bias; both weight the chosen
experts by their sqrt-softplus scores, normalised and scaled. Experts and the
shared expert clamp SwiGLU's inputs at `swiglu_limit`
(models/deepseek_v4_moe.py).

Tensor parallelism: attention splits its query heads and output groups
(deepseek_v4_attention.py), the MoE each expert's intermediate features
(deepseek_v4_moe.py), the embedding and the LM head the vocabulary; the
mHC parameters, the norms and the router stay whole on every rank.

Owns the reading of a V4 config.json (HF's field names and defaults, and the
legacy spellings HF folds in) and the mapping of checkpoint names, HF's or
DeepSeek's release names (transformers' conversion table), to parameters.
Multi-token-prediction weights (`mtp.*`) are ignored, as HF does. The V4
ops (kernels/compressor, indexer, sparse_attention, mhc; a torch reference
and a Triton kernel each) take graph-shaped decode steps with device ops
only, so decode is captured in CUDA graphs like every other model's.

Must never read files, allocate the cache, or choose a backend.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tinyengine.kernels.moe.tiles import moe_token_classes
from tinyengine.models.context import ForwardContext, HybridCacheSpec
from tinyengine.models.deepseek_v4_attention import (
    CSA,
    HCA,
    LAYER_TYPES,
    SLIDING,
    V4Attention,
    V4AttentionDims,
    V4Rotary,
)
from tinyengine.models.deepseek_v4_moe import V4MoE
from tinyengine.models.hyper_connections import HyperConnection, HyperHead
from tinyengine.models.layers import CausalLM, RMSNorm
from tinyengine.models.moe import MoEConfig, expert_range
from tinyengine.models.parallel_layers import VocabParallelEmbedding

_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_DEFAULTS: dict[str, Any] = dict(
    moe_intermediate_size=2048, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6,
    n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0,
    compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
    index_head_dim=128, index_topk=512, rms_norm_eps=1e-6,
)  # fmt: skip
_COMPRESS_RATES = {CSA: 4, HCA: 128}
_LEGACY_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
_NUM_HASH_LAYERS = 3


class DeepseekV4Args:
    """The config.json fields V4 reads, checked once (HF's __post_init__ rules)."""

    def __init__(self, c: dict[str, Any]) -> None:
        missing = [key for key in _REQUIRED_KEYS if c.get(key) is None]
        if missing:
            raise ValueError(f"config.json lacks {missing}, needed to build DeepseekV4ForCausalLM")

        def get(key: str) -> Any:
            return c[key] if c.get(key) is not None else _DEFAULTS[key]

        n = c["num_hidden_layers"]
        self.num_hidden_layers, self.vocab_size = n, c["vocab_size"]
        self.hidden_size = c["hidden_size"]
        self.rms_norm_eps = float(get("rms_norm_eps"))
        self.max_position_embeddings = int(get("max_position_embeddings"))
        self.tie_word_embeddings = bool(c.get("tie_word_embeddings", False))
        rates = dict(c.get("compress_rates") or _COMPRESS_RATES)
        rates.setdefault(CSA, c.get("compress_rate_csa", _COMPRESS_RATES[CSA]))
        rates.setdefault(HCA, c.get("compress_rate_hca", _COMPRESS_RATES[HCA]))
        self.compress_rates = rates
        layer_types = c.get("layer_types")
        if layer_types is None and c.get("compress_ratios") is not None:
            layer_types = [_LEGACY_RATIO_TYPES[r] for r in c["compress_ratios"]]
        if layer_types is None:  # HF's default: two HCA layers, then CSA / HCA alternating
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        self.layer_types = list(layer_types)[:n]
        hash_layers = c.get("num_hash_layers", _NUM_HASH_LAYERS)
        mlp_types = c.get("mlp_layer_types") or (["hash_moe"] * hash_layers + ["moe"] * n)
        self.mlp_layer_types = list(mlp_types)[:n]
        for name, values, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, ("hash_moe", "moe")),
        ):
            if len(values) != n or any(v not in allowed for v in values):
                raise ValueError(
                    f"config.json {name} must list one of {list(allowed)} per layer "
                    f"({n} layers), got {values!r}"
                )
        head_dim = int(get("head_dim"))
        factor = c.get("partial_rotary_factor")
        if factor is None:
            rope = c.get("qk_rope_head_dim")
            factor = rope / head_dim if rope is not None else 64 / 512
        self.attention = V4AttentionDims(
            hidden_size=self.hidden_size, num_heads=c["num_attention_heads"], head_dim=head_dim,
            rope_dim=int(head_dim * factor), q_lora_rank=int(get("q_lora_rank")),
            o_groups=int(get("o_groups")), o_lora_rank=int(get("o_lora_rank")),
            sliding_window=int(get("sliding_window")), index_n_heads=int(get("index_n_heads")),
            index_head_dim=int(get("index_head_dim")), index_topk=int(get("index_topk")),
            rms_norm_eps=self.rms_norm_eps,
        )  # fmt: skip
        self.rope_main, self.rope_compress = _rope_parameters(c, get)
        self.hc_mult, self.hc_iters = int(get("hc_mult")), int(get("hc_sinkhorn_iters"))
        self.hc_eps = float(get("hc_eps"))
        if get("scoring_func") != "sqrtsoftplus":
            raise ValueError(
                f"scoring_func={get('scoring_func')!r}: V4 here routes with sqrtsoftplus"
            )
        self.moe = MoEConfig(
            hidden_size=self.hidden_size, moe_intermediate_size=int(get("moe_intermediate_size")),
            num_experts=int(get("n_routed_experts")), top_k=int(get("num_experts_per_tok")),
            n_shared_experts=int(get("n_shared_experts")), topk_method="greedy", n_group=None,
            topk_group=None, norm_topk_prob=True,
            routed_scaling_factor=float(get("routed_scaling_factor")), mlp_bias=False,
        )  # fmt: skip
        self.swiglu_limit = float(get("swiglu_limit"))


def _rope_parameters(c: dict[str, Any], get: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main, compress) rope parameters, as HF builds them: nested in
    config.json already, or main = default RoPE at rope_theta and compress =
    the flat (YaRN) parameters at compress_rope_theta, attention factor 1."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": get("rope_theta")}
        compress = {**flat, "rope_theta": get("compress_rope_theta")}
        compress["rope_type"] = compress.get("rope_type") or compress.get("type") or "default"
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    for p in (main, compress):
        p["rope_type"] = p.get("rope_type") or p.get("type") or "default"
        p["rope_theta"] = float(p["rope_theta"])
    return main, compress


# ----------------------------------------------------------------------------- the model


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(
        self, args: DeepseekV4Args, layer_idx: int, rotaries: dict[str, V4Rotary],
        tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        layer_type = args.layer_types[layer_idx]
        rotary = rotaries["main" if layer_type == SLIDING else "compress"]
        ratio = args.compress_rates.get(layer_type, 0)
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.self_attn = V4Attention(args.attention, layer_idx, layer_type, ratio, rotary, **tp)
        self.mlp = V4MoE(args, args.mlp_layer_types[layer_idx] == "hash_moe", **tp,
                         expert_parallel=expert_parallel)  # fmt: skip
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn_hc = HyperConnection(args)
        self.ffn_hc = HyperConnection(args)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        post, comb, x = self.attn_hc(streams, ctx.ops)
        out = self.self_attn(positions, self.input_layernorm(x, ctx.ops), ctx)
        streams = ctx.ops.mhc_post(streams, post, comb, out)
        post, comb, x = self.ffn_hc(streams, ctx.ops)
        out = self.mlp(self.post_attention_layernorm(x, ctx.ops), input_ids, ctx)
        return ctx.ops.mhc_post(streams, post, comb, out)


class DeepseekV4Model(nn.Module):
    def __init__(
        self, args: DeepseekV4Args, tp_rank: int = 0, tp_size: int = 1,
        expert_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.hc_mult = args.hc_mult
        self.embed_tokens = VocabParallelEmbedding(
            args.vocab_size, args.hidden_size, tp_rank, tp_size
        )
        rope_dim, positions = args.attention.rope_dim, args.max_position_embeddings
        # Not in any checkpoint; two tables shared by the layers of each rope type.
        self.rotaries = nn.ModuleDict({
            "main": V4Rotary(rope_dim, args.rope_main, positions),
            "compress": V4Rotary(rope_dim, args.rope_compress, positions),
        })  # fmt: skip
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(args, i, dict(self.rotaries), tp_rank, tp_size, expert_parallel)
            for i in range(args.num_hidden_layers)
        )
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in ctx.decoder_layers(self.layers):
            streams = layer(positions, streams, input_ids, ctx)
        return self.norm(self.hc_head(streams, ctx.ops), ctx.ops)


# Checkpoint names: DeepSeek's release spelling -> HF's (transformers'
# conversion_mapping.py, "deepseek_v4"), applied in order to a layer's suffix.
_LAYER_RENAMES = [
    (r"^attn\.", "self_attn."), (r"^ffn\.", "mlp."),
    (r"^self_attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
    (r"^self_attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
    (r"^self_attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"^attn_norm\.", "input_layernorm."), (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_attn_(fn|base|scale)$", r"attn_hc.\1"), (r"^hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"), (r"\.norm\.weight$", ".kv_norm.weight"),
    (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]  # fmt: skip
_TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale",
}  # fmt: skip
_LAYER_NAME_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_SHARD = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


def checkpoint_to_param(name: str) -> tuple[str, Any]:
    """A checkpoint tensor name (HF's or DeepSeek's) -> (parameter, shard id)."""
    match = _LAYER_NAME_RE.match(name)
    if match is None:
        return _TOP_RENAMES.get(name.removeprefix("model."), name), None
    layer, rest = match.groups()
    for pattern, replacement in _LAYER_RENAMES:
        rest = re.sub(pattern, replacement, rest)
    expert = _EXPERT_RE.match(rest)
    prefix = f"model.layers.{layer}.mlp.experts"
    if expert is not None:
        index, proj = int(expert.group(1)), expert.group(2)
        if proj in _EXPERT_SHARD:
            return f"{prefix}.w13_weight", (index, _EXPERT_SHARD[proj])
        return f"{prefix}.w2_weight", index
    return f"model.layers.{layer}.{rest}", None


class DeepseekV4ForCausalLM(CausalLM):
    # Every op with a batch-dependent result goes through the op set, per-token
    # torch code through OpSet.per_token (kernels/batch_invariant.py); on a
    # GPU the invariant Triton set (kernels/batch_invariant_v4_triton.py).
    batch_invariant_ok = True
    batch_invariant_triton = True
    packed_modules_mapping: dict[str, tuple[str, Any]] = {}

    # load_model(expert_parallel=True): whole routed experts split over the
    # tensor-parallel ranks (models/moe.py's FusedExperts).
    supports_expert_parallel = True

    def __init__(
        self, hf_config: dict[str, Any], tp_rank: int = 0, tp_size: int = 1, *,
        expert_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.args = args = DeepseekV4Args(hf_config)
        # The routed experts an expert-parallel rank holds (None: all of them).
        self.local_experts = (
            expert_range(args.moe.num_experts, tp_rank, tp_size) if expert_parallel else None
        )
        self.model = DeepseekV4Model(args, tp_rank, tp_size, expert_parallel)
        self._add_lm_head(tp_rank, tp_size)

    def skips_checkpoint_name(self, ckpt_name: str) -> bool:
        """MTP weights (HF ignores them too), and on an expert-parallel rank
        the other ranks' experts (never read)."""
        if ckpt_name.removeprefix("model.").startswith("mtp."):
            return True
        if self.local_experts is None:
            return False
        param, shard_id = checkpoint_to_param(ckpt_name)
        if not param.endswith(("mlp.experts.w13_weight", "mlp.experts.w2_weight")):
            return False
        expert = shard_id[0] if isinstance(shard_id, tuple) else shard_id
        return expert < self.args.moe.num_experts and expert not in self.local_experts

    def route_checkpoint_name(self, ckpt_name: str) -> tuple[str, Any]:
        return checkpoint_to_param(ckpt_name)

    def kv_cache_spec(self) -> HybridCacheSpec:
        """Two cache groups: the per-token rows (raw KV, compressor state)
        slide, the compressed entries and index keys keep the whole history."""
        attns = [layer.self_attn for layer in self.model.layers]
        return HybridCacheSpec(
            tuple(a.cache_tensors() for a in attns), keep=max(a.tokens_kept() for a in attns)
        )

    def decode_cache_read_bytes(self, context: float, itemsize: int) -> float:
        """The cache bytes one sequence's decode step must read at `context`
        tokens (the benchmarks' roofline): every layer's window of raw KV; CSA
        the indexer's top-k entries and every index key it scores; HCA every
        entry; and the fp32 compressor state of a window (2m rows with
        overlap, m without), amortised over the m tokens that complete it."""
        d = self.args.attention
        total = 0.0
        for layer in self.model.layers:
            attn = layer.self_attn
            total += min(d.sliding_window, context) * d.head_dim * itemsize
            if attn.layer_type == SLIDING:
                continue
            entries = context // attn.ratio
            if attn.layer_type == CSA:
                total += min(d.index_topk, entries) * d.head_dim * itemsize
                total += entries * d.index_head_dim * itemsize
                # 2m rows of [kv | gate] at 2 x dim, fp32, per m tokens.
                total += 2 * (4 * d.head_dim + 4 * d.index_head_dim) * 4
            else:
                total += entries * d.head_dim * itemsize
                total += 2 * d.head_dim * 4  # m rows of [kv | gate] per m tokens
        return total

    def warmup_token_counts(self, max_num_batched_tokens: int) -> list[int]:
        """Token counts whose kernel tile classes warmup must run: the first
        count of each fused-MoE size class (kernels/moe/tiles.py), as for
        DeepSeek-V3 (every V4 layer has the same routing shape)."""
        moe = self.args.moe
        return moe_token_classes(max_num_batched_tokens, moe.top_k, moe.num_experts)
