"""`python -m tinyengine serve`: its arguments and the uvicorn run behind them.

Owns the `serve` subcommand of the CLI (tinyengine/__main__.py adds it with
`add_serve_parser`): the server's flags, one flag per EngineConfig field, and
`run_server`, which layers the flags over the environment (as `uvicorn
server:app` reads it) and runs uvicorn. Here, and not in __main__.py, because
only tinyengine/serve/ imports the HTTP stack.

Must never: import uvicorn at module level (only running the server needs
it, not building the parser), or read a setting that settings.py does not
define.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tinyengine.serve.settings import ServerSettings, engine_option_types, parse_option


def add_serve_parser(sub: Any) -> None:
    """Add the `serve` subcommand to `sub` (an argparse subparsers object)."""
    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    # `serve MODEL` (vLLM's form) or `serve --model MODEL`.
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="same as --model")
    p.add_argument(
        "--model",
        help="a model folder or a preset name: deepseek-v4-tiny (default), deepseek-v3-tiny, "
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
    p.add_argument("--max-n", type=int, help="the largest n one request may ask for (default 128)")
    p.add_argument(
        "--max-request-sequences",
        type=int,
        help="the most sequences (prompts x n) one request may fan out to (default 4096)",
    )
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
    p.set_defaults(func=run_server)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Environment variables first (as `uvicorn server:app` reads them); flags win."""
    base = ServerSettings.from_env()
    engine_kwargs = dict(base.engine_kwargs)
    for name in engine_option_types():
        value = getattr(args, name)
        if value is not None:
            engine_kwargs[name] = value
    return dataclasses.replace(
        base,
        model=args.model or args.model_tag or base.model,
        engine_kwargs=engine_kwargs,
        served_model_name=args.served_model_name or base.served_model_name,
        api_key=args.api_key or base.api_key,
        max_request_bytes=args.max_request_bytes or base.max_request_bytes,
        max_n=args.max_n or base.max_n,
        max_request_sequences=args.max_request_sequences or base.max_request_sequences,
    )


def run_server(args: argparse.Namespace) -> None:
    """Serve until interrupted: the CLI twin of `uvicorn server:app`."""
    import uvicorn

    from tinyengine.serve.app import create_app

    settings = settings_from_args(args)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)
