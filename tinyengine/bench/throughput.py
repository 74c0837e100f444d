"""Offline throughput benchmark: `python -m tinyengine.bench throughput`.

The workload small engines publish (vLLM's benchmark_throughput, nano-vllm's
bench.py): `--num-prompts` sequences (default 256) whose prompt lengths and
output lengths are uniform in `--input-len-range` / `--output-len-range`
(default 100:1024 each), prompts of random token ids (see TokenPool:
below the vocabulary, no special tokens), every one generating exactly its
`max_tokens` (`ignore_eos=True`), all submitted at once through
`LLM.generate(..., use_tqdm=False)`. Temperature defaults to 1.0 (plain
sampling, as vLLM's benchmark); `--temperature 0` is greedy.

Prints elapsed seconds, requests/s, output tokens/s and total (prompt +
output) tokens/s, after checking that every request produced exactly the
tokens it asked for (a mismatch fails the run). The engine is built before
the clock starts; its startup seconds are reported separately.

`--profile-host` builds the engine with `profile_steps=True` and prints its
per-step host/GPU split (`LLMEngine.step_profile()`); `--compare hf` runs the
same prompts through HF transformers first (hf_compare.py says how) and
prints the ratio. The workload depends only on `--seed`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from tinyengine.bench import common
from tinyengine.bench.common import BenchError
from tinyengine.bench.prompts import TokenPool


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(
    pool: TokenPool,
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    seed: int,
) -> Workload:
    import numpy as np

    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len_range[0], input_len_range[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, size=num_prompts)
    prompts = [pool.sample(rng, int(n)) for n in in_lens]
    return Workload(prompts, [int(n) for n in out_lens])


def run_engine(llm: Any, workload: Workload, temperature: float) -> dict[str, Any]:
    """Generate the workload once; check the counts; return the figures.
    No per-request seeds: the engine's --seed makes the run repeatable, and
    per-request generators would make the sampler work row by row."""
    from tinyengine.sampling_params import SamplingParams

    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature)
        for n in workload.max_tokens
    ]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    reset = getattr(llm.engine, "reset_step_profile", None)
    if reset is not None:  # profile the benchmark's steps only, not startup's
        reset()
    device = llm.engine.runner.device.type
    common.sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    common.sync(device)
    elapsed = time.perf_counter() - start

    got = [len(o.outputs[0].token_ids) for o in outputs]
    pairs = enumerate(zip(got, workload.max_tokens, strict=True))
    wrong = [(i, g, w) for i, (g, w) in pairs if g != w]
    if wrong:
        shown = ", ".join(f"request {i}: {g} tokens, asked {w}" for i, g, w in wrong[:5])
        raise BenchError(f"{len(wrong)} of {len(got)} outputs have the wrong length ({shown})")
    total = workload.prompt_tokens + workload.output_tokens
    return {
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": sum(got),
        "output_lens": got,  # per request, checked equal to max_tokens
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": sum(got) / elapsed,
        "total_tokens_per_s": total / elapsed,
    }


def step_profile(llm: Any, min_batch_size: int | None) -> dict[str, Any] | None:
    """The engine's step profile (over steps of at least `min_batch_size`
    rows), or None, with a message, when this checkout's engine has none."""
    fn = getattr(llm.engine, "step_profile", None)
    if fn is None:
        common.warn("this engine has no step_profile(); --profile-host printed nothing")
        return None
    return fn(min_batch_size) if min_batch_size else fn()


def decode_roofline(llm: Any, decode: dict[str, Any]) -> dict[str, Any]:
    """The profiled decode steps against their roofline (roofline.py): the
    weights touched at their mean batch plus the KV of their mean context,
    over the read bandwidth measured now on the same device."""
    from tinyengine.bench import roofline
    from tinyengine.bench.membw import read_bandwidth

    runner = llm.engine.runner
    batch = decode["mean_batch_size"]
    roof = roofline.decode_roofline(
        roofline.inventory_from_model(runner.model, llm.engine.hf_config),
        roofline.kv_bytes_per_token(runner),
        round(batch),
        decode["mean_context_tokens"] / batch,
        read_bandwidth(runner.device.type, None, None)["bytes_per_s"],
        kv_read=roofline.kv_read_fn(runner),
    )
    per_step = decode["per_step"]
    return {
        **roof.as_dict(),
        "wall_over_roofline": per_step["wall_s"] / roof.step_s,
        "gpu_forward_over_roofline": per_step["gpu_forward_s"] / roof.step_s,
    }


def format_profile(profile: dict[str, Any]) -> list[str]:
    """The step profile as one table: per-step milliseconds of each phase
    (rows) for all steps and for each kind of step (columns)."""
    columns = [("all", profile), *profile.get("by_kind", {}).items()]
    phases = list(profile.get("per_step", {}))
    lines = [f"{'(ms per step)':<20}" + "".join(f"{name:>12}" for name, _ in columns)]
    for phase in phases:
        cells = [c.get("per_step", {}).get(phase) for _, c in columns]
        lines.append(f"{phase.removesuffix('_s'):<20}" + "".join(_ms(v) for v in cells))
    for key in (
        "steps",
        "mean_batch_size",
        "mean_tokens",
        "mean_context_tokens",
        "host_fraction_of_gpu",
        "exposed_fraction_of_gpu",
    ):
        cells = [c.get(key) for _, c in columns]
        lines.append(f"{key:<20}" + "".join(f"{common.format_value(v):>12}" for v in cells))
    if "forward_timing" in profile:
        lines.append(f"gpu_forward timed by {profile['forward_timing']}")
    return lines


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:>12.3f}" if isinstance(seconds, (int, float)) else f"{'-':>12}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser, __doc__)
    parser.add_argument("--num-prompts", type=common.positive_int, default=256)
    parser.add_argument(
        "--input-len-range", type=common.parse_range, default=(100, 1024), metavar="A:B"
    )
    parser.add_argument(
        "--output-len-range", type=common.parse_range, default=(100, 1024), metavar="A:B"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument(
        "--profile-host", action="store_true", help="print the engine's per-step host profile"
    )
    parser.add_argument(
        "--profile-min-batch-size",
        type=common.positive_int,
        default=None,
        metavar="N",
        help="--profile-host: only steps of at least N sequences (e.g. 256)",
    )
    parser.add_argument(
        "--hf-batch-size",
        type=common.positive_int,
        default=None,
        help="--compare hf: prompts per HF generate call (default: all at once)",
    )


def run(args: argparse.Namespace) -> int:
    return common.run_guarded(_run, args)


def _run(args: argparse.Namespace) -> int:
    folder = common.resolve_model_folder(args.model)
    extra: dict[str, Any] = {}
    if args.profile_host:
        if common.engine_supports("profile_steps"):
            extra["profile_steps"] = True
        else:
            common.warn("this checkout's EngineConfig has no profile_steps; no host profile")
    kwargs = common.engine_kwargs(args, **extra)
    engine = common.resolve_engine(folder, kwargs)
    longest = args.input_len_range[1] + args.output_len_range[1]
    if longest > engine.max_model_len:
        raise BenchError(
            f"a request may need {longest} tokens but max_model_len is "
            f"{engine.max_model_len}; shorten the ranges or raise --max-model-len"
        )
    pool = TokenPool(folder, engine.vocab_size)
    workload = make_workload(
        pool, args.num_prompts, args.input_len_range, args.output_len_range, args.seed
    )
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "model": args.model,
        "folder": folder,
        "engine_options": kwargs,
        "num_prompts": args.num_prompts,
        "input_len_range": list(args.input_len_range),
        "output_len_range": list(args.output_len_range),
        "temperature": args.temperature,
        "seed": args.seed,
        "prompt_lens": [len(p) for p in workload.prompts],
        "max_tokens": workload.max_tokens,
    }

    if args.compare == "hf":  # first: it must be gone before the engine sizes its KV cache
        from tinyengine.bench.hf_compare import HFRunner, hf_throughput

        with HFRunner(folder, engine.dtype, engine.device, args.hf_cache_implementation) as hf:
            result["hf"] = hf_throughput(
                hf, workload.prompts, workload.max_tokens, args.temperature,
                args.hf_batch_size, args.seed,
            )  # fmt: skip

    from tinyengine.llm import LLM

    start = time.perf_counter()
    llm = LLM(folder, **kwargs)
    result["startup_s"] = time.perf_counter() - start
    runner = llm.engine.runner
    result["device"], result["dtype"] = runner.device.type, str(runner.dtype)
    result["engine"] = run_engine(llm, workload, args.temperature)
    if args.profile_host and "profile_steps" in extra:
        result["step_profile"] = profile = step_profile(llm, args.profile_min_batch_size)
        if profile and profile["by_kind"]["decode"]["steps"]:
            result["decode_roofline"] = decode_roofline(llm, profile["by_kind"]["decode"])
    if "hf" in result:
        from tinyengine.bench.hf_compare import ratio

        result["speedup_vs_hf"] = ratio(
            result["engine"]["output_tokens_per_s"], result["hf"]["output_tokens_per_s"]
        )

    print(format_result(result))
    common.write_json(args.json, result)
    return 0


def format_result(result: dict[str, Any]) -> str:
    e = result["engine"]
    rows: list[tuple[str, Any]] = [
        ("Model:", result["model"]),
        ("Device / dtype:", f"{result['device']} / {result['dtype'].replace('torch.', '')}"),
        ("Requests:", e["num_requests"]),
        ("Prompt tokens:", e["prompt_tokens"]),
        ("Output tokens:", e["output_tokens"]),
        ("Engine startup (s):", result["startup_s"]),
        ("Elapsed (s):", e["elapsed_s"]),
        ("Requests/s:", e["requests_per_s"]),
        ("Output tokens/s:", e["output_tokens_per_s"]),
        ("Total tokens/s:", e["total_tokens_per_s"]),
    ]
    text = common.format_rows("Offline Throughput", rows)
    if "hf" in result:
        h = result["hf"]
        text += "\n" + common.format_rows(
            "HF transformers generate",
            [
                ("Batch size / cache:", f"{h['batch_size']} / {h['cache_implementation']}"),
                ("Elapsed (s):", h["elapsed_s"]),
                ("Output tokens/s (requested only):", h["output_tokens_per_s"]),
                ("Total tokens/s:", h["total_tokens_per_s"]),
                ("Wasted output tokens:", h["wasted_output_tokens"]),
                ("tinyengine / HF (output tok/s):", result["speedup_vs_hf"]),
            ],
        )
    profile = result.get("step_profile")
    if profile:
        text += "\n" + f"{' Engine step profile ':=^56}\n" + "\n".join(format_profile(profile))
    roof = result.get("decode_roofline")
    if roof:
        text += "\n" + common.format_rows(
            "Decode steps vs roofline",
            [
                ("Read bandwidth (GB/s):", roof["bandwidth"] / 1e9),
                ("Mean batch / context (tokens):", f"{roof['batch']} / {roof['mean_context']:.1f}"),
                ("Weights + KV read (MiB):", roof["total_bytes"] / 2**20),
                ("Roofline step (ms):", roof["step_s"] * 1000),
                ("Wall step / roofline:", roof["wall_over_roofline"]),
                ("GPU forward / roofline:", roof["gpu_forward_over_roofline"]),
            ],
        )
    return text + "\n" + "=" * 56
