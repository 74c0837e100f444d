"""Benchmarks, run as `python -m tinyengine.bench <subcommand>`.

serve       an online serving benchmark against a running OpenAI-compatible
            server (tinyengine's `uvicorn server:app`, or any vLLM-compatible
            one): Poisson arrivals, streamed completions, TTFT / TPOT / E2E.
throughput  offline: N random-length requests through `LLM.generate`.
latency     prefill time, per-token decode latency, the decode memory roofline.
startup     the startup state machine's report.

Each subcommand is a module here with `add_arguments(parser)` and
`run(args) -> int`, registered in `__main__.SUBCOMMANDS`. Shared pieces:
common.py (flags, prompts, output), hf_compare.py (`--compare hf`),
roofline.py and membw.py (the decode roofline), plot.py (`--plot`).
"""
