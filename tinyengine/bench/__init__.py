"""Benchmark clients, run as `python -m tinyengine.bench <subcommand>`.

serve       an online serving benchmark against a running OpenAI-compatible
            server (tinyengine's `uvicorn server:app`, or any vLLM-compatible
            one): Poisson arrivals, streamed completions, TTFT / TPOT / E2E.

`throughput`, `latency` and `startup` (offline engine benchmarks) are to come;
each subcommand is a module here with `add_arguments(parser)` and
`run(args) -> int`, registered in `__main__.SUBCOMMANDS`.
"""
