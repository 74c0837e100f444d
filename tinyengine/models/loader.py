"""Reading a Hugging Face checkpoint folder: config.json (+ user overrides) and
safetensors weights into a model built by the registry.

Owns file discovery (single file, sharded with an index, or several files),
the routing of checkpoint names into fused parameters through the model's
`packed_modules_mapping` and each parameter's `weight_loader`, and layer
truncation for proxy models (a reduced num_hidden_layers never reads the
dropped layers' bytes). Must never unpickle anything: pickle checkpoints can
run arbitrary code, so `*.bin` / `*.pt` folders are refused.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tinyengine.models.dummy_weights import DUMMY_MARKER, init_dummy_weights
from tinyengine.models.parallel_layers import default_weight_loader
from tinyengine.models.pinned_reader import (
    StagingBuffers,
    TensorEntry,
    read_header,
    read_to_device,
)
from tinyengine.models.registry import get_model_class
from tinyengine.models.tied_head import keeps_tie

_INDEX_FILE = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# HF once saved RoPE's inverse frequencies as buffers; we compute our own.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_NAMES_SHOWN = 10
# Each file's tensors go out in this many times `threads` pieces, so a
# thread that drew small tensors picks up more work.
_PIECES_PER_THREAD = 4


def load_hf_config(model_path: str, hf_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json as a dict, with `hf_overrides` merged on top (shallow update).

    Overrides are applied before anything is built, so e.g.
    {"num_hidden_layers": 2} yields a 2-layer model that only reads 2 layers.
    """
    folder = Path(model_path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        where = "is not a folder" if not folder.is_dir() else "has no config.json"
        raise ValueError(
            f"model path {str(model_path)!r} {where}; point `model` at a Hugging Face "
            "checkpoint folder holding config.json and *.safetensors weights"
        )
    with config_file.open() as f:
        hf_config: dict[str, Any] = json.load(f)
    if hf_overrides:
        if not isinstance(hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict, got {type(hf_overrides).__name__}")
        hf_config.update(hf_overrides)
    layers = hf_config.get("num_hidden_layers")
    if layers is not None and (type(layers) is not int or layers < 1):
        src = "hf_overrides" if "num_hidden_layers" in (hf_overrides or {}) else "config.json"
        raise ValueError(f"num_hidden_layers must be an integer >= 1, got {layers!r} (from {src})")
    return hf_config


def load_model(
    model_path: str,
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    device: str | torch.device,
    load_format: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_parallel: bool = False,
    threads: int = 1,
    on_built: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Build the model named by hf_config["architectures"][0] directly on
    `device` in `dtype` and fill every parameter: from the checkpoint
    ("safetensors"), or seeded random values ("dummy", models/dummy_weights.py).
    "auto" is safetensors, or dummy for a folder marked as having no weights
    by design (a dummy-weight preset). tp_rank / tp_size: this rank's shard
    of a tensor-parallel model (its layers keep their slices of each tensor).
    expert_parallel (vLLM's enable_expert_parallel): the MoE layers' routed
    experts split whole over those tp_size ranks instead of each expert's
    features; only classes with `supports_expert_parallel` take it.
    threads: how many threads read the checkpoint (load_weights; the
    engine passes EngineConfig.load_threads). on_built: called with the
    built model before any of its weights are set (the startup starts its
    kernel compiles there, worker/stages.py)."""
    folder = Path(model_path)
    model_cls = get_model_class(hf_config)
    if expert_parallel and not getattr(model_cls, "supports_expert_parallel", False):
        raise ValueError(
            f"expert_parallel=True: {model_cls.__name__} does not support expert "
            "parallelism (it has no mixture-of-experts layers, or they cannot be split by "
            "expert yet; DeepSeek-V2/V3 can); load it with expert_parallel=False"
        )
    # Passed only when asked for: classes without expert parallelism keep the
    # (hf_config, tp_rank, tp_size) constructor.
    ep = {"expert_parallel": True} if expert_parallel else {}
    if load_format == "auto":
        load_format = "dummy" if (folder / DUMMY_MARKER).is_file() else "safetensors"
    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"load_format={load_format!r}: choose auto, safetensors or dummy")
    # Find the weights before building: a pickle-only folder fails fast.
    weight_map = checkpoint_weight_map(folder) if load_format == "safetensors" else {}
    if hf_config.get("tie_word_embeddings") and not keeps_tie(folder, weight_map):
        hf_config = {**hf_config, "tie_word_embeddings": False}  # the stored head is used
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, tp_rank, tp_size, **ep)
    if on_built is not None:
        on_built(model.eval())
    if load_format == "dummy":
        init_dummy_weights(model, float(hf_config.get("initializer_range") or 0.02))
    else:
        try:
            load_weights(
                model, folder, weight_map, num_hidden_layers=hf_config["num_hidden_layers"],
                threads=threads,
            )  # fmt: skip
        except ValueError as e:
            if quant := hf_config.get("quantization_config"):  # e.g. FP8 scales: name the cause
                method = quant.get("quant_method") if isinstance(quant, dict) else quant
                raise ValueError(f"quantized checkpoints (quantization_config, quant_method "
                                 f"{method!r}) are not supported, only bf16/fp16/fp32 weights: "
                                 f"{e}") from e  # fmt: skip
            raise
    return model.eval()


def checkpoint_weight_map(folder: Path) -> dict[str, str]:
    """Checkpoint tensor name -> file name (relative to `folder`)."""
    index_file = folder / _INDEX_FILE
    if index_file.is_file():
        with index_file.open() as f:
            return dict(json.load(f)["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for pattern in _PICKLE_PATTERNS for p in folder.glob(pattern))
        if pickles:
            raise ValueError(
                f"{folder} holds only pickle checkpoints ({_shorten(pickles)}); pickle "
                "checkpoints are refused because loading them can run arbitrary code. "
                "Convert them to safetensors (e.g. transformers' "
                "from_pretrained(...).save_pretrained(out_dir)) and point `model` at the result"
            )
        raise ValueError(
            f"no *.safetensors weights found in {folder}; for seeded random weights "
            "(speed and memory runs) pass load_format='dummy'"
        )
    # Without an index only the headers name the tensors; safe_open reads just
    # the header, so tensors of dropped layers are still never read.
    weight_map: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                weight_map.setdefault(name, file.name)
    return weight_map


def load_weights(
    model: nn.Module,
    folder: Path,
    weight_map: dict[str, str],
    *,
    num_hidden_layers: int,
    threads: int,
) -> None:
    """Copy checkpoint tensors into `model`'s parameters, checking that every
    parameter (every shard of a fused one) is filled exactly by the checkpoint.

    The copies run on `threads` threads. Reading is page-cache copies and
    host-to-device copies, both outside the GIL, and one thread reaches a
    fraction of either's bandwidth. On a GPU, whole tensors go through
    pinned staging buffers (models/pinned_reader.py) and each thread copies
    on its own stream, so that the reads and copies overlap."""
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    # A model may route some names itself (e.g. per-expert tensors into stacked
    # expert weights); it returns None for the names it leaves to `packed`.
    route_own = getattr(model, "route_checkpoint_name", None)
    # ... and may ignore some (tensors that hold nothing for it).
    skip_own = getattr(model, "skips_checkpoint_name", None)
    tied = bool(getattr(model, "tie_word_embeddings", False))
    params = dict(model.named_parameters())  # a tied weight appears once

    # Route every wanted name first, so that naming errors surface before any
    # tensor data is read.
    plan: dict[str, list[tuple[str, str, Any]]] = {}  # file -> [(ckpt, param, shard)]
    unexpected: list[str] = []
    for ckpt_name, file in weight_map.items():
        if _skipped(ckpt_name, num_hidden_layers, tied):
            continue
        if skip_own is not None and skip_own(ckpt_name):
            continue
        routed = route_own(ckpt_name) if route_own is not None else None
        param_name, shard_id = routed if routed is not None else _route(ckpt_name, packed)
        if param_name not in params:
            unexpected.append(ckpt_name)
            continue
        plan.setdefault(file, []).append((ckpt_name, param_name, shard_id))
    if unexpected:
        raise ValueError(
            f"the checkpoint has {len(unexpected)} tensor(s) this "
            f"{type(model).__name__} has no parameter for: {_shorten(sorted(unexpected))}; "
            "check that config.json's architectures/sizes match the weights"
        )

    needed = {(name, shard) for name, param in params.items() for shard in _shards_of(param)}
    planned = {(param, shard) for entries in plan.values() for _, param, shard in entries}
    missing = sorted(_checkpoint_name(p, s, packed) for p, s in needed - planned)
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} tensor(s) the model needs: "
            f"{_shorten(missing)}; is the checkpoint complete (all shards present) and "
            "does config.json match it?"
        )

    absent = sorted(file for file in plan if not (folder / file).is_file())
    if absent:
        raise ValueError(
            f"{folder} lacks weight file(s) {_shorten(absent)} that {_INDEX_FILE} lists; "
            "the download is incomplete, fetch the missing shards"
        )

    pieces = [
        (file, piece)
        for file, entries in sorted(plan.items())
        for piece in _split(entries, threads * _PIECES_PER_THREAD)
    ]
    device = next((p.device for p in params.values() if p.is_cuda), None)
    headers = {file: read_header(folder / file) for file in plan} if device is not None else {}

    def work(file: str, piece: list[Any], staging: StagingBuffers | None) -> None:
        _load_piece(folder / file, piece, params, headers.get(file, {}), staging)

    _run_on_threads(work, pieces, threads, device)


def _load_piece(
    path: Path,
    entries: list[tuple[str, str, Any]],
    params: dict[str, nn.Parameter],
    header: dict[str, TensorEntry],
    staging: StagingBuffers | None,
) -> None:
    """Copy one piece of one file's tensors into their parameters; through
    `staging` where given (a CUDA load) for the tensors `header` maps."""
    # Only files holding a kept tensor are opened at all.
    fd = os.open(path, os.O_RDONLY) if staging is not None else -1
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for ckpt_name, param_name, shard_id in entries:
                param = params[param_name]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                # A tensor-parallel rank's parameter takes the lazy slice and
                # reads only its part; the others take the whole tensor.
                if getattr(param, "reads_part", False):
                    loaded = handle.get_slice(ckpt_name)
                elif staging is not None and ckpt_name in header:
                    loaded = read_to_device(fd, header[ckpt_name], param.device, staging)
                else:
                    loaded = handle.get_tensor(ckpt_name)
                try:
                    weight_loader(param, loaded, shard_id)
                except ValueError as err:
                    raise ValueError(f"cannot load {ckpt_name!r} from {path.name}: {err}") from None
    finally:
        if fd >= 0:
            os.close(fd)


def _run_on_threads(
    work: Any,
    pieces: list[tuple[str, list[tuple[str, str, Any]]]],
    threads: int,
    device: torch.device | None,
) -> None:
    """work(file, entries, staging) for every piece on `threads` threads,
    copying to the CUDA `device` through a thread's staging buffers (None:
    the parameters are on the CPU, and staging is None); the first error is
    raised once the pieces already running have stopped."""
    # Inference mode and the current CUDA device are per thread: each worker
    # takes the caller's mode, or in-place copies into parameters made under
    # inference mode are refused.
    inference = torch.is_inference_mode_enabled()
    failed = threading.Event()  # once set, pieces not started yet are dropped
    # One set of staging buffers per running piece, handed back once its
    # copies are done.
    staging: queue.SimpleQueue[StagingBuffers] = queue.SimpleQueue()
    if device is not None:
        for _ in range(min(threads, len(pieces))):
            staging.put(StagingBuffers(device))

    def run(piece: tuple[str, list[tuple[str, str, Any]]]) -> None:
        if failed.is_set():
            return
        try:
            with torch.inference_mode(inference):
                if device is None:
                    work(*piece, None)
                    return
                torch.cuda.set_device(device)
                # A stream per piece: the copies of different threads overlap
                # instead of queueing on the default stream.
                stream = torch.cuda.Stream(device)
                buffers = staging.get()
                try:
                    with torch.cuda.stream(stream):
                        work(*piece, buffers)
                finally:
                    stream.synchronize()
                    staging.put(buffers)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(threads, thread_name_prefix="load-weights") as pool:
        futures = [pool.submit(run, piece) for piece in pieces]
    if device is not None:
        # Temporaries of a copy (the device-side tensors, a dtype cast) were
        # cached for their side stream, where only that stream can reuse
        # them; the pinned staging buffers go back to the host.
        while not staging.empty():
            staging.get()
        torch.cuda.empty_cache()
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()
    for future in futures:  # all have finished: the pool's exit waits for them
        future.result()


def _split(entries: list[Any], pieces: int) -> list[list[Any]]:
    """`entries` in at most `pieces` runs of consecutive items, in order."""
    size = -(-len(entries) // pieces)
    return [entries[i : i + size] for i in range(0, len(entries), size)]


def _skipped(ckpt_name: str, num_hidden_layers: int, tied: bool) -> bool:
    if ckpt_name.endswith(_IGNORED_SUFFIXES):
        return True
    if tied and ckpt_name == "lm_head.weight":
        return True  # the embedding is the head; a saved copy equals it (models/tied_head.py)
    match = _LAYER_RE.search(ckpt_name)
    return match is not None and int(match.group(1)) >= num_hidden_layers


def _route(ckpt_name: str, packed: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """'...self_attn.k_proj.weight' -> ('...self_attn.qkv_proj.weight', 'k')."""
    parts = ckpt_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in packed:
            fused, shard_id = packed[part]
            parts[i] = fused
            return ".".join(parts), shard_id
    return ckpt_name, None


def _checkpoint_name(param_name: str, shard_id: Any, packed: dict[str, tuple[str, Any]]) -> str:
    """Inverse of _route, for error messages that name what the checkpoint lacks."""
    if shard_id is None:
        return param_name
    for original, (fused, shard) in packed.items():
        if shard == shard_id and f".{fused}." in f".{param_name}":
            return param_name.replace(f"{fused}.", f"{original}.")
    return f"{param_name} (shard {shard_id!r})"


def _shards_of(param: nn.Parameter) -> list[Any]:
    offsets = getattr(param, "shard_offsets", None)
    return list(offsets) if offsets else [None]


def _shorten(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    hidden = len(names) - _MAX_NAMES_SHOWN
    return f"{shown}, ... and {hidden} more" if hidden > 0 else shown


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    if not dtype.is_floating_point:
        raise ValueError(f"model dtype must be a floating point type, got {dtype}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
