"""What `bench serve` measured, and how it is summed up and shown.

Owns the per-request record (`RequestResult`: latencies and token counts as
the client saw them), a run's figures (`BenchResult.summary()`: totals,
throughputs, mean and percentiles of TTFT / TPOT / E2E; `to_json()` for
--json) and the printed table (`format_table`, vLLM's benchmark_serving
layout). serve.py sends the requests and fills these in.

Must never: send anything or read a clock (the figures are a pure function of
the records, so a test can check them), or count a failed request in a
latency or a throughput.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tinyengine.bench.common import percentile

PERCENTILES = (50, 99)


@dataclasses.dataclass
class RequestResult:
    """What the client measured for one request (latencies in seconds)."""

    index: int
    prompt_len: int
    max_tokens: int
    success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0  # from the usage chunk
    output_tokens: int = 0  # from the usage chunk

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclasses.dataclass
class BenchResult:
    """The figures of one run; `summary()` is what the table and --json show."""

    config: dict[str, Any]
    duration_s: float
    requests: list[RequestResult]

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.success]

    def summary(self) -> dict[str, Any]:
        ok = self.ok
        duration = max(self.duration_s, 1e-9)
        input_tokens = sum(r.prompt_tokens for r in ok)
        output_tokens = sum(r.output_tokens for r in ok)
        out: dict[str, Any] = {
            "successful_requests": len(ok),
            "failed_requests": len(self.requests) - len(ok),
            "duration_s": self.duration_s,
            "total_input_tokens": input_tokens,
            "total_output_tokens": output_tokens,
            "request_throughput": len(ok) / duration,
            "input_throughput": input_tokens / duration,
            "output_throughput": output_tokens / duration,
        }
        series = {
            "ttft": [r.ttft_s * 1000 for r in ok],
            "tpot": [t * 1000 for r in ok if (t := r.tpot_s) is not None],
            "e2e": [r.e2e_s * 1000 for r in ok],
        }
        for name, values in series.items():
            out[f"mean_{name}_ms"] = sum(values) / len(values) if values else math.nan
            for p in PERCENTILES:
                out[f"p{p}_{name}_ms"] = percentile(values, p)
        return out

    def to_json(self) -> dict[str, Any]:
        summary = {
            k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in self.summary().items()
        }
        return {
            "config": self.config,
            **summary,
            "requests": [{**dataclasses.asdict(r), "tpot_s": r.tpot_s} for r in self.requests],
        }


def format_table(result: BenchResult) -> str:
    """The human-readable summary (vLLM's benchmark_serving layout)."""
    s = result.summary()
    rows: list[tuple[str, str]] = [
        ("Successful requests:", f"{s['successful_requests']}"),
        ("Failed requests:", f"{s['failed_requests']}"),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", f"{s['total_input_tokens']}"),
        ("Total output tokens:", f"{s['total_output_tokens']}"),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s):", f"{s['input_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
    ]
    sections = [
        ("Time to First Token", "ttft", "TTFT"),
        ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
        ("End-to-end Latency", "e2e", "E2E"),
    ]
    lines = [f"{' Serving Benchmark Result ':=^56}"]
    lines += [f"{k:<40}{v:>16}" for k, v in rows]
    for title, key, short in sections:
        lines.append(f"{' ' + title + ' ':-^56}")
        lines.append(f"{'Mean ' + short + ' (ms):':<40}{s[f'mean_{key}_ms']:>16.2f}")
        for p in PERCENTILES:
            lines.append(f"{f'P{p} {short} (ms):':<40}{s[f'p{p}_{key}_ms']:>16.2f}")
    lines.append("=" * 56)
    failed = [r for r in result.requests if not r.success]
    if failed:
        lines.append(f"first failure (request {failed[0].index}): {failed[0].error}")
    return "\n".join(lines)
