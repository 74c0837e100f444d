"""What the benchmark subcommands share: argument parsing helpers, the engine
options as command-line flags, statistics, and printing / JSON output.

Owns the mapping from flags to `LLM(model, **kwargs)` options (only flags the
user set are passed, so EngineConfig's own defaults apply otherwise) and
their resolution before anything loads (`resolve_engine`). Must never import
torch, transformers or the engine at module level: the `serve` client
imports it and runs without them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# --- parsing -------------------------------------------------------------------------


def parse_range(text: str) -> tuple[int, int]:
    """'a:b' -> (a, b) with 1 <= a <= b; a single 'n' means n:n."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a range 'a:b', got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"range {text!r} needs 1 <= a <= b")
    return lo, hi


def parse_int_list(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32] (positive ints)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ints like '1,8,32', got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# --- statistics ------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation (numpy's default); nan if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


# --- the engine's options as flags ------------------------------------------------------

# flag dest -> EngineConfig field (flags left at None are not passed to LLM).
_ENGINE_FLAGS = (
    "dtype", "device", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
    "num_kv_blocks", "block_size", "gpu_memory_utilization", "attention_backend",
    "cuda_graph_sizes", "graph_backend", "cudagraph_mode", "piecewise_graph_sizes",
    "enforce_eager", "enable_prefix_caching", "seed",
    "batch_invariant", "tensor_parallel_size", "enable_expert_parallel", "load_threads",
)  # fmt: skip


class BenchError(RuntimeError):
    """A benchmark cannot run or its result is wrong; the message says why."""


def run_guarded(body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a subcommand body; a BenchError prints one line and returns 1."""
    try:
        return body(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def add_common_arguments(parser: argparse.ArgumentParser, doc: str | None) -> None:
    """--model, the engine options, --seed, --json and --compare."""
    parser.description = doc
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--model",
        default="deepseek-v3-tiny",
        help="a model folder or a preset name (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and engine seed")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write figures here")
    parser.add_argument(
        "--compare",
        choices=["hf"],
        default=None,
        help="also run the workload with HF transformers and print the ratio",
    )
    parser.add_argument(
        "--hf-cache-implementation",
        default=None,
        metavar="NAME",
        help="--compare hf: HF's cache_implementation, e.g. static (default: dynamic)",
    )
    g = parser.add_argument_group("engine options (default: EngineConfig's)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-num-seqs", type=positive_int)
    g.add_argument("--max-num-batched-tokens", type=positive_int)
    g.add_argument("--max-model-len", type=positive_int)
    g.add_argument("--num-kv-blocks", type=positive_int, help="skip KV sizing")
    g.add_argument("--block-size", type=positive_int)
    g.add_argument("--gpu-memory-utilization", type=float)
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"])
    g.add_argument("--cuda-graph-sizes", type=parse_int_list, metavar="N,N,...")
    g.add_argument("--graph-backend", choices=["auto", "cuda", "recording", "none"])
    g.add_argument(
        "--cudagraph-mode",
        choices=["full_decode_only", "full_and_piecewise"],
        help="full_and_piecewise: prefill/mixed steps replay piecewise graphs too",
    )
    g.add_argument("--piecewise-graph-sizes", type=parse_int_list, metavar="N,N,...")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        default=None,
        help="batch-invariant mode (docs/batch_invariance.md)",
    )
    g.add_argument("--tensor-parallel-size", type=positive_int, help="ranks (one GPU each)")
    g.add_argument("--load-threads", type=positive_int, help="threads reading the checkpoint")
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        default=None,
        help="MoE: whole experts per rank instead of a slice of each",
    )


def engine_kwargs(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """LLM(...) options from the flags the user set, plus `extra`."""
    kwargs = {name: getattr(args, name) for name in _ENGINE_FLAGS}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs["print_startup_report"] = False  # the bench prints what it needs
    kwargs.update(extra)
    return kwargs


def resolve_model_folder(spec: str) -> str:
    """The model folder for a folder path or a preset name (built once)."""
    from tinyengine.models_presets import PresetError, resolve_model

    try:
        return resolve_model(spec)
    except PresetError as e:
        raise BenchError(str(e)) from e


@dataclass(frozen=True)
class Resolved:
    """What the engine will pick for these options, known before building it."""

    device: str
    dtype: Any  # torch.dtype
    max_num_seqs: int
    max_model_len: int
    vocab_size: int


def resolve_engine(folder: str, kwargs: dict[str, Any]) -> Resolved:
    """EngineConfig's own resolution of device, dtype and limits, so HF runs
    in exactly the engine's dtype and bad sizes fail before anything loads."""
    from tinyengine.config import EngineConfig
    from tinyengine.models.loader import load_hf_config

    try:
        config = EngineConfig.from_kwargs(folder, **kwargs)
        hf_config = load_hf_config(folder, config.hf_overrides)
        device = config.resolved_device()
        config.resolve_limits(device)
        return Resolved(
            device=device,
            dtype=config.resolved_dtype(hf_config, device),
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.resolve_max_model_len(hf_config),
            vocab_size=int(hf_config["vocab_size"]),
        )
    except ValueError as e:  # a bad option: say so without a traceback
        raise BenchError(str(e)) from e


def engine_supports(option: str) -> bool:
    """Whether this checkout's EngineConfig has the field `option`."""
    import dataclasses

    from tinyengine.config import EngineConfig

    return option in {f.name for f in dataclasses.fields(EngineConfig)}


def free_accelerator_memory() -> None:
    """Release what deleted models left in torch's caching allocator, so the
    next model (engine or HF) sees the whole device."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    """Wait for queued device work, so a host clock reads a finished interval."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# --- output ----------------------------------------------------------------------------


def format_rows(title: str, rows: Sequence[tuple[str, Any]], width: int = 56) -> str:
    """A titled two-column table (the layout of the serve benchmark)."""
    lines = [f"{' ' + title + ' ':=^{width}}"]
    for key, value in rows:
        lines.append(f"{key:<{width - 16}}{format_value(value):>16}")
    return "\n".join(lines)


def format_value(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        text = json.dumps(_jsonable(data), indent=2, default=str)
        Path(path).write_text(text + "\n")
        print(f"wrote {path}")


def _jsonable(value: Any) -> Any:
    """NaN / inf -> None (strict JSON), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
