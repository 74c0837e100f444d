"""Where a decode step's GPU time goes: torch.profiler over a few decode steps
of a batch (eager, so every kernel is visible), top kernels by CUDA time.

    python benchmarks/profile_decode.py --model qwen3-0.6b-shape --batch-size 256

Prints figures; not a test.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from tinyengine import LLM, SamplingParams  # noqa: E402
from tinyengine.models_presets import resolve_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b-shape")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    llm = LLM(resolve_model(args.model), enforce_eager=True, max_model_len=4096,
              print_startup_report=False)  # fmt: skip
    engine, rng = llm.engine, random.Random(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=64, ignore_eos=True)
    for i in range(args.batch_size):
        ids = [rng.randrange(100, 20000) for _ in range(args.input_len)]
        engine.add_request({"prompt_token_ids": ids}, params, request_id=str(i))
    for _ in range(8):  # through the prefill (8192 tokens a step), into steady decode
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=18, max_name_column_width=60
    )
    print(f"# {args.model} batch {args.batch_size}, {args.steps} decode steps, eager")
    print(table)


if __name__ == "__main__":
    main()
