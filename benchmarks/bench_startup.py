"""Startup and decode-latency benchmark (prints figures; not a test).

    python benchmarks/bench_startup.py [--layers 8 --hidden 1024]

Builds a small dense Llama-shaped checkpoint with random weights (bf16), then:
  1. the startup state machine's report: seconds per stage, graphs captured;
  2. decode step latency at batch 1, 8, 64 with CUDA graphs and eagerly, and
     the ratio. A decode step here is one LLMEngine.step() over B running
     requests (host work included), timed after their prefill.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


def make_checkpoint(path: str, layers: int, hidden: int, heads: int, kv_heads: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=32000,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def decode_latency(llm, batch: int, prompt_len: int = 128, steps: int = 32) -> float:
    from tinyengine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 30000 + 1 for j in range(prompt_len)]
        engine.add_request({"prompt_token_ids": prompt}, params)
    requests = engine.scheduler.requests.values()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        engine.step()  # prefill (possibly chunked)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    return statistics.median(times[4:]) * 1e3


def main() -> None:
    from tinyengine import LLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    path = make_checkpoint(tempfile.mkdtemp(), args.layers, args.hidden, 16, 4)
    print(f"# model: Llama-shaped, {args.layers} layers, hidden {args.hidden}, bf16, random")
    print(f"# GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    llms = {}
    for eager in (False, True):
        start = time.perf_counter()
        llm = LLM(path, max_model_len=2048, max_num_seqs=64, enforce_eager=eager,
                  attention_backend=args.backend, print_startup_report=False)  # fmt: skip
        total = time.perf_counter() - start
        report = llm.startup_report()
        print(f"\n## startup ({'eager' if eager else 'graphs'}): {total:.2f} s total")
        print(report.table())
        llms[eager] = llm
        del llm
    print("\n## decode step latency (ms, median of 28 steps, one LLMEngine.step incl. host work)")
    print(f"{'batch':>5} {'graphs':>8} {'eager':>8} {'eager/graphs':>12}")
    for batch in (1, 8, 64):
        graphs = decode_latency(llms[False], batch)
        eager = decode_latency(llms[True], batch)
        print(f"{batch:>5} {graphs:>8.3f} {eager:>8.3f} {eager / graphs:>12.2f}")


if __name__ == "__main__":
    main()
