"""tinyengine: a minimal, readable LLM inference engine.

The public API mirrors vLLM's offline interface:
    from tinyengine import LLM, SamplingParams
    llm = LLM("path/to/hf_model_folder")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

Exports resolve lazily, so importing the torch-free scheduling layer
(`tinyengine.scheduling`) does not pull in torch through this package.
"""

import importlib.metadata
import importlib.util
import warnings
from importlib import import_module
from pathlib import Path
from typing import Any


def _check_kernels_package() -> None:
    """Our kernels/ package shares its import name with Hugging Face's
    `kernels` distribution (a hard dependency of transformers >= 5.25, which
    is why the extras pin transformers < 5.25). With both installed, one
    process imports only one of them: say which breaks, and how to fix it,
    instead of a bare "cannot import name" later."""
    try:
        hf_version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    fix = ("pip uninstall kernels && pip install 'transformers<5.25' (tinyengine's own "
           "kernels/ package has the same import name)")  # fmt: skip
    spec = importlib.util.find_spec("kernels")
    ours = Path(__file__).resolve().parent.parent / "kernels"
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent != ours:
        raise ImportError(f"`import kernels` finds Hugging Face's kernels {hf_version}, not "
                          f"tinyengine's kernels/ package ({ours}); to fix: {fix}")  # fmt: skip
    warnings.warn(f"Hugging Face's kernels {hf_version} is installed; transformers will fail "
                  f"to import it (tinyengine's kernels/ shadows it); to fix: {fix}",
                  stacklevel=2)  # fmt: skip


_check_kernels_package()

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
