"""Cold-start benchmark: `python -m tinyengine.bench startup`.

Builds the engine once (`LLM(model, ...)`, which runs the startup state
machine to READY: load, profile, size KV, warmup, capture, lock) and prints
the machine's own report (`StartupReport.table()`: seconds, memory and
workspace per stage, KV blocks, captured graph sizes), then the wall time of
the whole `LLM(...)` call (the stages plus config, tokenizer and runner
setup), the KV cache size and its capacity: resident context tokens and the
bytes each costs. `--json` writes `StartupReport.as_dict()` plus
those totals.

`--compare hf` first times HF transformers from nothing to a model on the
device that has run one small generate (hf_compare.HFRunner), and prints the
ratio of the two wall times. Either way the model folder is built (presets)
before any clock starts, and the first engine in a process pays torch's and
Triton's import and CUDA context costs, as a real cold start does.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tinyengine.bench import common
from tinyengine.worker.kv_cache import sliding_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser, __doc__)


def run(args: argparse.Namespace) -> int:
    return common.run_guarded(_run, args)


def _run(args: argparse.Namespace) -> int:
    folder = common.resolve_model_folder(args.model)
    kwargs = common.engine_kwargs(args)
    result: dict[str, Any] = {
        "benchmark": "startup",
        "model": args.model,
        "folder": folder,
        "engine_options": kwargs,
    }
    if args.compare == "hf":
        from tinyengine.bench.hf_compare import hf_startup

        engine = common.resolve_engine(folder, kwargs)
        result["hf"] = hf_startup(folder, engine.dtype, engine.device)

    from tinyengine.llm import LLM

    start = time.perf_counter()
    llm = LLM(folder, **kwargs)
    common.sync(llm.engine.runner.device.type)
    wall = time.perf_counter() - start
    report = llm.startup_report()
    runner = llm.engine.runner
    spec = runner.model.kv_cache_spec()
    sliding = sliding_bytes(spec, runner.num_sliding_blocks, runner.block_size, runner.dtype)
    result.update(
        device=runner.device.type,
        dtype=str(runner.dtype).replace("torch.", ""),
        wall_s=wall,
        stages_s=sum(s.seconds for s in report.stages),
        triton_kernels=sum(s.kernels for s in report.stages),
        triton_compile_s=sum(s.compile_seconds for s in report.stages),
        kv_cache_bytes=report.num_kv_blocks * runner.kv_bytes_per_block() + sliding,
        # Capacity: the tokens of context the cache can keep resident, and
        # what each costs (the full-history group's bytes; a sliding group,
        # DeepSeek-V4's, is a fixed size on top, per running request).
        resident_tokens=report.num_kv_blocks * runner.block_size,
        bytes_per_resident_token=runner.kv_bytes_per_block() / runner.block_size,
        sliding_blocks=runner.num_sliding_blocks,
        sliding_bytes=sliding,
        report=report.as_dict(),
    )
    if "hf" in result:
        from tinyengine.bench.hf_compare import ratio

        result["time_ratio_vs_hf"] = ratio(wall, result["hf"]["load_s"])

    print(f"{' Startup report ':=^56}")
    print(report.table())
    rows: list[tuple[str, Any]] = [
        ("Model:", result["model"]),
        ("Device / dtype:", f"{result['device']} / {result['dtype']}"),
        ("Stages total (s):", result["stages_s"]),
        ("LLM(...) wall time (s):", wall),
        ("KV blocks:", report.num_kv_blocks),
        ("KV cache (GiB):", result["kv_cache_bytes"] / 2**30),
        ("Resident context tokens:", result["resident_tokens"]),
        ("KV bytes per resident token:", result["bytes_per_resident_token"]),
        ("Graphs captured:", len(report.captured_sizes)),
        ("Triton kernel variants:", result["triton_kernels"]),
        ("Triton compiling, cache misses (s):", result["triton_compile_s"]),
    ]
    if sliding:
        rows += [
            ("Sliding-group blocks:", runner.num_sliding_blocks),
            ("Sliding group (GiB):", sliding / 2**30),
        ]
    if "hf" in result:
        rows += [
            ("HF from_pretrained + first generate (s):", result["hf"]["load_s"]),
            ("tinyengine / HF (startup time):", result["time_ratio_vs_hf"]),
        ]
    print(common.format_rows("Startup", rows) + "\n" + "=" * 56)
    # Variants first met after profile: shape classes its forwards (and the
    # dry run, worker/precompile.py) did not reach, compiled one at a time.
    for stage in report.stages:
        if stage.name not in ("load", "profile"):
            for variant in stage.kernel_variants:
                print(f"{stage.name} met a new variant: {variant}")
    common.write_json(args.json, result)
    return 0
