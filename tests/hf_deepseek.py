"""Tiny random DeepSeek-V2/V3 models built with Hugging Face transformers, and
HF reference outputs for them, for tests.

Owns the tiny DeepSeek variants the suite covers (each exercises a different
routing / attention path) and how they are saved (`save_pretrained`, which
writes per-expert checkpoint names). Plain functions, no fixtures. Must never
be imported by the engine: transformers is a test-only dependency.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# YaRN with mscale != mscale_all_dim, so both the cos/sin attention factor and
# the softmax-scale correction differ from 1. factor * original == max_position
# keeps HF from warning. rope_dim 8 puts the four frequencies in all three
# YaRN bands (kept, blended, interpolated).
YARN_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.9,
    "mscale_all_dim": 0.7,
}

_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # HF's V3 default (128) would break its eager attention
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,  # != qk_nope_head_dim: K and V head sizes differ
    first_k_dense_replace=1,  # layer 0 dense, layers 1.. MoE
    n_shared_experts=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Larger than HF's 0.02 so logits are far from uniform and argmax is stable.
    initializer_range=0.08,
    rope_parameters=YARN_ROPE,
)

# name -> (arch, overrides on top of _COMMON)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # q_lora, 8 experts in 4 groups (2 eligible), top-3, sigmoid + bias, yarn.
    "v3": ("v3", dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                      topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # rope_interleave=False: the neox pairing.
    "v3-neox": ("v3", dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                           topk_group=1, rope_interleave=False)),
    # V2-Lite style: no q_lora, softmax greedy routing, no groups.
    "v2-lite": ("v2", dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                           topk_method="greedy", routed_scaling_factor=1.0)),
    # V2 with q_lora, group_limited_greedy, and every optional bias.
    "v2-group": ("v2", dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                            topk_method="group_limited_greedy", n_group=4, topk_group=2,
                            routed_scaling_factor=1.5, attention_bias=True, mlp_bias=True)),
}  # fmt: skip


def make_config(variant: str, **overrides: Any) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config

    arch, extra = VARIANTS[variant]
    kwargs = {**_COMMON, **extra, **overrides}
    return (DeepseekV3Config if arch == "v3" else DeepseekV2Config)(**kwargs)


def make_tiny_deepseek(
    variant: str,
    path: str | Path,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Build a tiny random float32 DeepSeek model and save it to `path`.

    Norm weights, biases and the V3 correction bias are perturbed away from
    HF's 1/0 init so that a wrong norm, a dropped bias or an ignored correction
    bias changes the output."""
    from transformers import AutoModelForCausalLM

    config = make_config(variant, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path


def load_hf(path: str | Path, **config_overrides: Any) -> Any:
    """The saved model back in HF, fp32, eager attention and experts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch.float32,
        attn_implementation="eager",
        use_kernels=False,
        experts_implementation="eager",
        **config_overrides,
    )
    return model.eval()


@torch.no_grad()
def hf_logits(path: str | Path, token_ids: list[int], **config_overrides: Any) -> torch.Tensor:
    """HF's fp32 logits [len(token_ids), vocab] for one sequence."""
    return load_hf(path, **config_overrides)(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(
    path: str | Path, prompts: list[list[int]], max_new_tokens: int, **config_overrides: Any
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """HF greedy generation, one prompt at a time, EOS disabled (see
    tests/hf_models.hf_greedy). Returns (tokens, per-step fp32 logits)."""
    model = load_hf(path, **config_overrides)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    tokens: list[list[int]] = []
    logits: list[list[torch.Tensor]] = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        logits.append([step[0].float() for step in out.logits])
    return tokens, logits
