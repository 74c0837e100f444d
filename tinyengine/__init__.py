"""tinyengine: a minimal, readable LLM inference engine.

The public API mirrors vLLM's offline interface:
    from tinyengine import LLM, SamplingParams
    llm = LLM("path/to/hf_model_folder")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

Exports resolve lazily, so importing the torch-free scheduling layer
(`tinyengine.scheduling`) does not pull in torch through this package.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "tinyengine.llm",
    "LLMEngine": "tinyengine.engine",
    "EngineConfig": "tinyengine.config",
    "SamplingParams": "tinyengine.sampling_params",
    "RequestOutput": "tinyengine.outputs",
    "CompletionOutput": "tinyengine.outputs",
    "Logprob": "tinyengine.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tinyengine' has no attribute {name!r}")
