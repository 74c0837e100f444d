"""Latency benchmark: `python -m tinyengine.bench latency`.

For a batch of B prompts of P random token ids, each generating O tokens
(`ignore_eos`), it measures, over `--num-iters` iterations after
`--num-iters-warmup` (fresh random prompts every time, so the prefix cache
never hits):

  prefill     the wall time of `LLM.generate(B prompts, max_tokens=1)`
  decode      the wall time of every decode-only step of a B x O run, driving
              `llm.engine` directly (add_request B times with FINAL_ONLY
              outputs, then `engine.step()` until done). A step counts once
              every request has its first token and none has finished, i.e.
              it is exactly B decode rows.
              `step()` returns only once the sampled tokens are on the host,
              so a step's wall time is honest. Mean / p50 / p99 in ms, and
              decode tokens/s = B / mean step time.

and prints the decode roofline (roofline.py): the bytes one decode step must
read (weights touched at batch B + the KV cache at the mean decode context
P + O/2) over the read bandwidth measured in the same run on the same device
(membw.py; `--bandwidth-gbps` overrides it), the roofline step time and the
achieved fraction = roofline step time / measured mean step time.

`--skip-prefill` measures decode at long contexts without paying for the
prefill of B x P tokens first: every prompt position but the last is counted
as computed without running it (the blocks are allocated through the block
manager as a chunked prefill would, and the cache is filled with random
numbers, so reads and top-k selections do real work on values like real
ones); prefill is then not timed. Decode steps read exactly what they would
after a real prefill, so their times and the roofline stand; the tokens are
meaningless.

`--batch-sizes 1,8,32` measures each batch size with one engine (which needs
`--max-num-seqs` >= the largest); `--plot PATH.png` draws decode tokens/s
against batch size with the roofline curve (plot.py; default batch sizes
1,8,32,64,128,256). `--compare hf` measures HF transformers' prefill and
per-token decode latency on the same prompts shape first (hf_compare.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from typing import Any

from tinyengine.bench import common
from tinyengine.bench.common import BenchError, percentile
from tinyengine.bench.prompts import TokenPool
from tinyengine.bench.routing import distinct_experts, record_routing
from tinyengine.bench.skip_prefill import assume_prefilled

PLOT_BATCH_SIZES = [1, 8, 32, 64, 128, 256]


def decode_run(
    engine: Any,
    prompts: list[list[int]],
    output_len: int,
    temperature: float,
    skip_prefill: bool = False,
):
    """One B x O run through engine.step(); returns (decode-only step seconds,
    total seconds). Fails if any request did not get exactly O tokens.
    `skip_prefill`: see the module docstring (assume_prefilled).

    Requests ask for FINAL_ONLY outputs, as `LLM.generate` (and vLLM's latency
    benchmark) do: a step's time is the engine's work for B decode rows, not
    the building of B cumulative output objects and their incremental text,
    which is a streaming server's cost (measured by `bench serve`). Which
    requests have their first token is read from the engine's request state."""
    from tinyengine.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=output_len,
        ignore_eos=True,
        temperature=temperature,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    if skip_prefill:
        assume_prefilled(engine, ids)
    finished: set[str] = set()
    steps: list[float] = []
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        is_decode = not finished and all(
            engine.states[i].request.num_output_tokens >= 1 for i in ids
        )
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if is_decode:
            steps.append(elapsed)
        for out in outputs:
            if out.finished:
                finished.add(out.request_id)
                if len(out.outputs[0].token_ids) != output_len:
                    raise BenchError(
                        f"request {out.request_id} finished with "
                        f"{len(out.outputs[0].token_ids)} tokens, asked {output_len}"
                    )
    total = time.perf_counter() - begin
    if finished != set(ids):
        raise BenchError(f"{len(ids - finished)} requests never finished")
    return steps, total


def measure_engine(llm: Any, pool: TokenPool, rng: Any, batch: int, args) -> dict[str, Any]:
    """Prefill and decode figures at one batch size."""
    from tinyengine.sampling_params import SamplingParams

    device = llm.engine.runner.device.type
    first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=args.temperature)
    prefill: list[float] = []
    steps: list[float] = []
    e2e: list[float] = []
    for i in range(args.num_iters_warmup + args.num_iters):
        elapsed = float("nan")
        if not args.skip_prefill:
            prompts = [{"prompt_token_ids": pool.sample(rng, args.input_len)} for _ in range(batch)]
            common.sync(device)
            start = time.perf_counter()
            llm.generate(prompts, first, use_tqdm=False)
            elapsed = time.perf_counter() - start
        run_steps, total = decode_run(
            llm.engine,
            [pool.sample(rng, args.input_len) for _ in range(batch)],
            args.output_len,
            args.temperature,
            args.skip_prefill,
        )
        if i >= args.num_iters_warmup:
            prefill.append(elapsed)
            steps += run_steps
            e2e.append(total)
    if not steps:
        raise BenchError("no decode-only step was measured; raise --output-len")
    step_s = common.mean(steps)
    return {
        "batch_size": batch,
        "prefill_ms": None if args.skip_prefill else common.mean(prefill) * 1000,
        "e2e_ms": common.mean(e2e) * 1000,
        "num_decode_steps": len(steps),
        "decode_step_ms": {
            "mean": step_s * 1000,
            "p50": percentile(steps, 50) * 1000,
            "p99": percentile(steps, 99) * 1000,
        },
        "decode_tokens_per_s": batch / step_s,
    }


def check_limits(engine: common.Resolved, batch_sizes: list[int], args) -> None:
    """Before anything loads: every batch fits one step, every sequence max_model_len."""
    if max(batch_sizes) > engine.max_num_seqs:
        raise BenchError(
            f"batch size {max(batch_sizes)} > max_num_seqs={engine.max_num_seqs}; "
            f"pass --max-num-seqs {max(batch_sizes)}"
        )
    if args.input_len + args.output_len > engine.max_model_len:
        raise BenchError(
            f"--input-len + --output-len = {args.input_len + args.output_len} > "
            f"max_model_len={engine.max_model_len}; raise --max-model-len"
        )


def check_kv_capacity(llm: Any, batch_sizes: list[int], args) -> None:
    """The largest batch fits the KV cache at once (no preemption mid-run)."""
    need_len, bs = args.input_len + args.output_len, llm.engine.config.block_size
    need = max(batch_sizes) * -(-need_len // bs)
    have = llm.engine.scheduler.block_manager.num_blocks
    if need > have:
        raise BenchError(
            f"batch {max(batch_sizes)} x {need_len} tokens needs {need} KV blocks but the "
            f"engine has {have}; raise --gpu-memory-utilization or --num-kv-blocks"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser, __doc__)
    parser.add_argument("--batch-size", type=common.positive_int, default=1)
    parser.add_argument("--input-len", type=common.positive_int, default=128)
    parser.add_argument("--output-len", type=common.positive_int, default=128)
    parser.add_argument("--num-iters", type=common.positive_int, default=5)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument(
        "--skip-prefill",
        action="store_true",
        help="decode at --input-len context without running the prefill (see above)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=common.parse_int_list,
        default=None,
        metavar="B,B,...",
        help="measure each batch size (overrides --batch-size)",
    )
    parser.add_argument("--plot", default=None, metavar="PATH.png", help="decode tok/s vs batch")
    parser.add_argument(
        "--bandwidth-gib", type=float, default=None, help="read-bandwidth buffer size"
    )
    parser.add_argument(
        "--bandwidth-gbps", type=float, default=None, help="use this read bandwidth (GB/s)"
    )


def run(args: argparse.Namespace) -> int:
    return common.run_guarded(_run, args)


def _run(args: argparse.Namespace) -> int:
    import numpy as np

    from tinyengine.bench import roofline
    from tinyengine.bench.membw import read_bandwidth

    if args.output_len < 2:
        raise BenchError("--output-len must be >= 2 (decode steps follow the first token)")
    batch_sizes = args.batch_sizes or (PLOT_BATCH_SIZES if args.plot else [args.batch_size])
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        common.warn(
            "matplotlib is missing: --plot will fail after measuring (use --json and draw "
            "it elsewhere: python -m tinyengine.bench.plot RESULT.json OUT.png)"
        )
    folder = common.resolve_model_folder(args.model)
    kwargs = common.engine_kwargs(args)
    engine = common.resolve_engine(folder, kwargs)
    check_limits(engine, batch_sizes, args)
    pool = TokenPool(folder, engine.vocab_size)
    device, dtype = engine.device, engine.dtype
    result: dict[str, Any] = {
        "benchmark": "latency",
        "model": args.model,
        "folder": folder,
        "engine_options": kwargs,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
        "temperature": args.temperature,
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
    }

    hf_by_batch: dict[int, dict[str, Any]] = {}
    if args.compare == "hf":  # first: it must be gone before the engine sizes its KV cache
        from tinyengine.bench.hf_compare import HFRunner, hf_latency

        rng = np.random.default_rng(args.seed + 1)
        with HFRunner(folder, dtype, device, args.hf_cache_implementation) as hf:
            for b in batch_sizes:
                hf_by_batch[b] = hf_latency(
                    hf, lambda b=b: [pool.sample(rng, args.input_len) for _ in range(b)], b,
                    args.output_len, args.num_iters, args.num_iters_warmup, args.temperature,
                )  # fmt: skip

    bandwidth = read_bandwidth(device, args.bandwidth_gib, args.bandwidth_gbps)
    result["bandwidth"] = bandwidth

    from tinyengine.llm import LLM

    llm = LLM(folder, **kwargs)
    check_kv_capacity(llm, batch_sizes, args)
    runner = llm.engine.runner
    inventory = roofline.inventory_from_model(runner.model, llm.engine.hf_config)
    kv_per_token = roofline.kv_bytes_per_token(runner)
    kv_read = roofline.kv_read_fn(runner)
    context = roofline.mean_decode_context(args.input_len, args.output_len)
    result["weights"] = {
        "total_bytes": inventory.total_bytes,
        "dense_bytes": inventory.dense_bytes,
        "routed_expert_bytes": sum(x.nbytes for x in inventory.expert_layers),
        "moe_layers": len(inventory.expert_layers),
    }
    result["kv_bytes_per_token"] = kv_per_token
    result["mean_decode_context"] = context

    rng = np.random.default_rng(args.seed)
    # MoE: the experts a batch touches, measured on this model's own routing
    # (routing.py); the uniform expectation is kept beside it in the output.
    routed = []
    if inventory.expert_layers:
        # The probe's prompts only need to route like real ones: a long
        # context without its prefill (--skip-prefill) is probed shorter.
        probe_len = min(args.input_len, 512) if args.skip_prefill else args.input_len
        probe = [pool.sample(rng, probe_len) for _ in range(max(batch_sizes))]
        routed = record_routing(llm, probe)
        result["expert_routing"] = "measured"

    def experts(b: int) -> list[float] | None:
        return [distinct_experts(ids, b) for ids in routed] if routed else None

    def line(b: int) -> roofline.DecodeRoofline:
        bytes_per_s = bandwidth["bytes_per_s"]
        return roofline.decode_roofline(
            inventory, kv_per_token, b, context, bytes_per_s, experts(b), kv_read
        )

    result["runs"] = []
    for b in batch_sizes:
        run = measure_engine(llm, pool, rng, b, args)
        roof = line(b)
        run["roofline"] = roof.as_dict()
        if routed:
            uniform = [
                roofline.expected_distinct_experts(x.num_experts, x.top_k, b)
                for x in inventory.expert_layers
            ]
            run["experts_touched"] = {"measured": experts(b), "uniform": uniform}
        run["roofline_fraction"] = roof.step_s * 1000 / run["decode_step_ms"]["mean"]
        if b in hf_by_batch:
            from tinyengine.bench.hf_compare import ratio

            run["hf"] = hf = hf_by_batch[b]
            run["speedup_vs_hf"] = ratio(run["decode_tokens_per_s"], hf["decode_tokens_per_s"])
        result["runs"].append(run)
    lo, hi = min(batch_sizes), max(batch_sizes)
    grid = sorted({round(lo * (hi / lo) ** (i / 63)) for i in range(64)} | set(batch_sizes))
    result["roofline_curve"] = [[b, line(b).tokens_per_s] for b in grid]

    print(format_result(result))
    common.write_json(args.json, result)
    if args.plot:
        from tinyengine.bench.plot import plot_decode

        plot_decode(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _expert_rows(run: dict[str, Any]) -> list[tuple[str, Any]]:
    """MoE: distinct experts per step (summed over MoE layers), measured and
    as uniform routing would have it."""
    touched = run.get("experts_touched")
    if not touched:
        return []
    measured, uniform = sum(touched["measured"]), sum(touched["uniform"])
    return [("Roofline: experts touched (uniform):", f"{measured:.1f} ({uniform:.1f})")]


def format_result(result: dict[str, Any]) -> str:
    gib, bw = 2**30, result["bandwidth"]
    head = [
        ("Model:", result["model"]),
        ("Device / dtype:", f"{result['device']} / {result['dtype']}"),
        ("Prompt / output tokens:", f"{result['input_len']} / {result['output_len']}"),
        ("Read bandwidth (GB/s):", f"{bw['bytes_per_s'] / 1e9:.1f} ({bw['method']})"),
        ("Weights (GiB):", result["weights"]["total_bytes"] / gib),
        ("KV cache per token (KiB):", result["kv_bytes_per_token"] / 1024),
        ("Mean decode context (tokens):", result["mean_decode_context"]),
    ]
    parts = [common.format_rows("Latency", head)]
    for run in result["runs"]:
        roof, step = run["roofline"], run["decode_step_ms"]
        rows: list[tuple[str, Any]] = [
            ("Prefill (ms):", run["prefill_ms"] if run["prefill_ms"] is not None else "skipped"),
            ("End-to-end B x O run (ms):", run["e2e_ms"]),
            ("Decode steps measured:", run["num_decode_steps"]),
            ("Decode step mean (ms):", step["mean"]),
            ("Decode step p50 (ms):", step["p50"]),
            ("Decode step p99 (ms):", step["p99"]),
            ("Decode tokens/s:", run["decode_tokens_per_s"]),
            ("Roofline: weights read (MiB):", roof["weight_bytes"] / 2**20),
            *_expert_rows(run),
            ("Roofline: KV read (MiB):", roof["kv_bytes"] / 2**20),
            ("Roofline step (ms):", roof["step_s"] * 1000),
            ("Roofline tokens/s:", roof["tokens_per_s"]),
            ("Achieved fraction of roofline:", run["roofline_fraction"]),
        ]
        if "hf" in run:
            rows += [
                ("HF prefill (ms):", run["hf"]["prefill_ms"]),
                ("HF decode per token (ms):", run["hf"]["decode_step_ms"]),
                ("HF decode tokens/s:", run["hf"]["decode_tokens_per_s"]),
                ("tinyengine / HF (decode tok/s):", run["speedup_vs_hf"]),
            ]
        parts.append(common.format_rows(f"Batch {run['batch_size']}", rows))
    return "\n".join(parts) + "\n" + "=" * 56
