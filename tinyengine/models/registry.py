"""Which class serves which Hugging Face architecture.

Owns the table from config.json's `architectures[0]` to a model class. Must
never build a model or read files; adding a family means adding a line here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tinyengine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tinyengine.models.deepseek_v4 import DeepseekV4ForCausalLM
from tinyengine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: dict[str, Any]) -> type[nn.Module]:
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(
            "config.json has no 'architectures' entry, so the model class is unknown; "
            f"add one of {supported_architectures()} (or pass it via hf_overrides)"
        )
    name = architectures[0]
    if name not in _MODELS:
        raise ValueError(
            f"architecture {name!r} is not supported; supported architectures are "
            f"{supported_architectures()}"
        )
    return _MODELS[name]
