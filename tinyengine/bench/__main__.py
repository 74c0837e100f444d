"""`python -m tinyengine.bench <subcommand> [options]`: dispatch to one benchmark.

    python -m tinyengine.bench serve --base-url http://127.0.0.1:8000
        --num-requests 64 --request-rate 4 --input-len-range 32:256
        --output-len-range 16:64 --seed 0 [--json out.json]
    python -m tinyengine.bench throughput --model qwen3-0.6b-shape
        --num-prompts 256 --input-len-range 100:1024 --output-len-range 100:1024
        [--profile-host] [--compare hf] [--json out.json]
    python -m tinyengine.bench latency --model llama3-8b-shape
        --batch-size 1 --input-len 128 --output-len 128 [--compare hf]
        [--batch-sizes 1,8,32,64,128,256 --plot decode.png]
    python -m tinyengine.bench startup --model deepseek-v3-proxy [--json out.json]

Each subcommand lives in its own module (imported only when chosen) that
provides `add_arguments(parser)` and `run(args) -> int`; `<subcommand> -h`
lists its options. The offline ones (throughput, latency, startup) share the
engine options and --model / --seed / --json / --compare of common.py.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help). Modules are imported lazily so that a
# client-only benchmark never imports torch, and vice versa.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "tinyengine.bench.serve",
        "online serving benchmark against a running OpenAI-compatible server",
    ),
    "throughput": (
        "tinyengine.bench.throughput",
        "offline throughput: N random-length requests through LLM.generate",
    ),
    "latency": (
        "tinyengine.bench.latency",
        "prefill time, per-token decode latency and the decode memory roofline",
    ),
    "startup": (
        "tinyengine.bench.startup",
        "the startup state machine's report: seconds per stage, graphs, KV blocks",
    ),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tinyengine.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        # Only the chosen subcommand's module is imported to add its options.
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    module, _ = SUBCOMMANDS[args.subcommand]
    return int(importlib.import_module(module).run(args))


if __name__ == "__main__":
    sys.exit(main())
