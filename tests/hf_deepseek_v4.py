"""Tiny random DeepSeek-V4 models built with Hugging Face transformers, for
tests: every layer type (sliding, CSA, HCA), hash and learned routing,
hc_mult 2, windows and compression ratios small enough that a few dozen
tokens cross many of their boundaries. Plain functions; test-only (the
engine never imports transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_V4: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, head_dim=32, q_lora_rank=24, num_experts_per_tok=2,
    n_routed_experts=8, n_shared_experts=1,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    # The spellings every transformers with V4 reads (5.25 folds them into
    # compress_rates / mlp_layer_types).
    compress_rate_csa=4, compress_rate_hca=8, num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=5,
    sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
    index_topk=3, max_position_embeddings=512, partial_rotary_factor=0.25,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32, "beta_slow": 1},
    # Larger than HF's 0.02 so logits are far from uniform and argmax is stable.
    initializer_range=0.08,
)  # fmt: skip


def make_tiny_v4(path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Build and save a tiny random fp32 V4 model. What HF initialises to
    constants (norm weights, sinks, position biases, the correction bias, the
    hash table, the mHC biases and scales) is randomised, so that ignoring
    any of them changes the output."""
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    config = DeepseekV4Config(**{**TINY_V4, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                param.copy_(0.5 * torch.randn_like(param))
            elif name.endswith(("scale", "hc_scale")):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
            elif name.endswith("tid2eid"):
                experts = config.n_routed_experts
                table = torch.stack([torch.randperm(experts)[: config.num_experts_per_tok]
                                     for _ in range(config.vocab_size)])  # fmt: skip
                buf.copy_(table)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path
