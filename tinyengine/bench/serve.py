"""Online serving benchmark: `python -m tinyengine.bench serve`.

Sends N streaming `/v1/completions` requests to a running OpenAI-compatible
server (tinyengine's `uvicorn server:app`, or vLLM / SGLang), with arrival
times drawn from a Poisson process at `--request-rate` requests per second
(`inf`: all at once). Each prompt is a list of random token ids, its length
uniform in `--input-len-range`; each `max_tokens` is uniform in
`--output-len-range`, sent with `ignore_eos: true` and temperature 0 so every
request generates exactly `max_tokens` tokens.

Per request it measures, on the client:

    TTFT   time from sending the request to the first streamed chunk with a choice
    E2E    time from sending the request to the end of the stream
    TPOT   (E2E - TTFT) / (output_tokens - 1)   (requests with >= 2 output tokens)

and reads the prompt and output token counts from the stream's final usage
chunk (`stream_options.include_usage`). It prints a table of the totals,
throughputs and mean / p50 / p99 of each latency, and `--json` writes the same
figures plus the per-request values (both made in serve_results.py).

The prompts, lengths and arrival gaps depend only on `--seed`, so two runs
with the same options send the same work. The vocabulary for the random ids
comes from `--vocab-size`, else from a `vocab_size` on the /v1/models card,
else from the served model's `config.json` when the server's model folder (or
its preset's build in the tinyengine cache) is readable from this machine,
else a conservative default of 256 ids.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tinyengine.bench.common import parse_range
from tinyengine.bench.serve_results import BenchResult, RequestResult, format_table

DEFAULT_VOCAB_SIZE = 256  # used only when nothing tells us the real vocabulary


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request of the workload: what is sent and when (seconds after start)."""

    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"--request-rate must be > 0 (or inf), got {text!r}")
    return rate


def make_workload(
    num_requests: int,
    request_rate: float,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """The requests and their arrival times. Prompts and lengths use one
    generator and arrival gaps another, so the same seed sends the same prompts
    at any rate."""
    content = random.Random(seed)
    arrivals = random.Random(seed + 1)
    t = 0.0
    out = []
    for i in range(num_requests):
        prompt_len = content.randint(*input_len_range)
        prompt = [content.randrange(vocab_size) for _ in range(prompt_len)]
        max_tokens = content.randint(*output_len_range)
        out.append(BenchRequest(i, prompt, max_tokens, t))
        if math.isfinite(request_rate):
            t += arrivals.expovariate(request_rate)  # Poisson process: exponential gaps
    return out


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _vocab_from_card(card: dict[str, Any]) -> int | None:
    if isinstance(card.get("vocab_size"), int):
        return card["vocab_size"]
    root = card.get("root")
    if not isinstance(root, str) or not root:
        return None
    cache = Path(os.environ.get("TINYENGINE_CACHE", "~/.cache/tinyengine")).expanduser()
    for folder in (Path(root), cache / root):
        config = folder / "config.json"
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            continue
        vocab = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
        if isinstance(vocab, int) and vocab > 0:
            return vocab
    return None


async def fetch_model_card(
    client: httpx.AsyncClient, base_url: str, api_key: str | None
) -> dict[str, Any]:
    """The first model /v1/models lists (the server must be ready)."""
    r = await client.get(base_url + "/v1/models", headers=_headers(api_key))
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return data[0]


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    request: BenchRequest,
    api_key: str | None,
) -> RequestResult:
    """Send one streaming completion and time it."""
    result = RequestResult(request.index, len(request.prompt_token_ids), request.max_tokens)
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST", base_url + "/v1/completions", json=body, headers=_headers(api_key)
        ) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {text[:300]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error']}"
                    return result
                if chunk.get("choices") and result.ttft_s == 0.0:
                    result.ttft_s = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
        result.e2e_s = time.perf_counter() - start
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if usage is None:
        result.error = "the stream ended without a usage chunk"
        return result
    if result.ttft_s == 0.0:
        result.error = "the stream carried no token"
        return result
    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
    result.output_tokens = int(usage.get("completion_tokens", 0))
    result.success = True
    return result


async def benchmark(
    base_url: str = "http://127.0.0.1:8000",
    *,
    model: str | None = None,
    num_requests: int = 64,
    request_rate: float = math.inf,
    input_len_range: tuple[int, int] = (32, 256),
    output_len_range: tuple[int, int] = (16, 64),
    seed: int = 0,
    vocab_size: int | None = None,
    api_key: str | None = None,
    timeout_s: float = 600.0,
) -> BenchResult:
    """Run the benchmark against the server at `base_url` and return its figures."""
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        if model is None or vocab_size is None:
            card = await fetch_model_card(client, base_url, api_key)
            model = model or card["id"]
            if vocab_size is None:
                vocab_size = _vocab_from_card(card)
                if vocab_size is None:
                    vocab_size = DEFAULT_VOCAB_SIZE
                    print(
                        f"warning: vocabulary size unknown; prompts use token ids "
                        f"< {vocab_size} (pass --vocab-size)",
                        file=sys.stderr,
                    )
        workload = make_workload(
            num_requests, request_rate, input_len_range, output_len_range, vocab_size, seed
        )
        config = {
            "base_url": base_url,
            "model": model,
            "num_requests": num_requests,
            "request_rate": request_rate if math.isfinite(request_rate) else "inf",
            "input_len_range": list(input_len_range),
            "output_len_range": list(output_len_range),
            "seed": seed,
            "vocab_size": vocab_size,
        }

        start = time.perf_counter()

        async def timed(request: BenchRequest) -> RequestResult:
            delay = start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await send_request(client, base_url, model, request, api_key)

        results = await asyncio.gather(*(timed(r) for r in workload))
        duration = time.perf_counter() - start
    return BenchResult(config, duration, list(results))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="the server's root URL (default %(default)s)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the model name to send (default: the first one /v1/models lists)",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--request-rate",
        type=parse_rate,
        default=math.inf,
        help="requests per second, Poisson arrivals; inf sends all at once (default inf)",
    )
    parser.add_argument(
        "--input-len-range",
        type=parse_range,
        default=(32, 256),
        metavar="A:B",
        help="prompt length in tokens, uniform (default 32:256)",
    )
    parser.add_argument(
        "--output-len-range",
        type=parse_range,
        default=(16, 64),
        metavar="A:B",
        help="max_tokens, uniform (default 16:64)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="random prompt ids are < this (default: from the server's model)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TINYENGINE_API_KEY"),
        help="Bearer key (default: $TINYENGINE_API_KEY)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="per-request timeout in seconds (default %(default)s)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the figures and per-request values here",
    )


def run(args: argparse.Namespace) -> int:
    """Run from parsed arguments; print the table; 0 if every request succeeded."""
    if args.num_requests < 1:
        print("--num-requests must be >= 1", file=sys.stderr)
        return 2
    result = asyncio.run(
        benchmark(
            args.base_url,
            model=args.model,
            num_requests=args.num_requests,
            request_rate=args.request_rate,
            input_len_range=args.input_len_range,
            output_len_range=args.output_len_range,
            seed=args.seed,
            vocab_size=args.vocab_size,
            api_key=args.api_key,
            timeout_s=args.timeout,
        )
    )
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return 0 if all(r.success for r in result.requests) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tinyengine.bench.serve ...` (same as `... bench serve ...`)."""
    parser = argparse.ArgumentParser(prog="python -m tinyengine.bench serve")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
