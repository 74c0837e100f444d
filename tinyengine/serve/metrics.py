"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Owns the counters and histograms the async engine updates as requests finish,
and the rendering of those plus a snapshot of engine stats into the text that
GET /metrics returns. Written by hand (three tiny classes) rather than with
prometheus_client, so the server needs no extra dependency.

Must never touch the engine: callers hand in a stats snapshot that the engine
thread published, because LLMEngine is not thread-safe.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

PREFIX = "tinyengine_"

# Buckets in seconds, as vLLM's: CPU steps are slow, GPU steps fast; both fit.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0
)  # fmt: skip
TPOT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0
)  # fmt: skip

# Label values of tinyengine_requests_total{status=...}.
REQUEST_STATUSES = ("stop", "length", "abort", "error", "rejected")


class Histogram:
    """Cumulative-bucket histogram; observe() is called from the engine thread."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.count += 1
        self.sum += value


class ServerMetrics:
    """Everything /metrics reports that the engine's own stats do not: request
    outcomes, token totals and latency histograms. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(REQUEST_STATUSES, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def count_request(self, status: str) -> None:
        with self._lock:
            self.requests[status] = self.requests.get(status, 0) + 1

    def record_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def record_finished(
        self,
        status: str,
        prompt_tokens: int,
        output_tokens: int,
        e2e_seconds: float,
        decode_seconds: float | None,
    ) -> None:
        """One request is done. `decode_seconds` spans first to last token;
        time per output token is that over the tokens after the first."""
        with self._lock:
            self.requests[status] = self.requests.get(status, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += output_tokens
            self.e2e.observe(e2e_seconds)
            if decode_seconds is not None and output_tokens > 1:
                self.tpot.observe(decode_seconds / (output_tokens - 1))

    def render(
        self,
        stats: Mapping[str, Any] | None,
        stage_seconds: Mapping[str, float],
        ready: bool,
        model_name: str,
    ) -> str:
        """The full /metrics text. `stats` is LLMEngine.stats() (None before the
        engine exists); `stage_seconds` is the startup report's per-stage time."""
        out = _Writer()
        with self._lock:
            out.metric(
                "requests_total",
                "counter",
                "Finished requests by status.",
                [({"status": s}, n) for s, n in self.requests.items()],
            )
            out.metric(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests.",
                [({}, self.prompt_tokens)],
            )
            out.metric(
                "generation_tokens_total",
                "counter",
                "Generated tokens.",
                [({}, self.generation_tokens)],
            )
            out.histogram("time_to_first_token_seconds", "From arrival to first token.", self.ttft)
            out.histogram(
                "time_per_output_token_seconds", "Mean time between output tokens.", self.tpot
            )
            out.histogram("e2e_request_latency_seconds", "From arrival to finish.", self.e2e)
        s = stats or {}
        total = s.get("num_total_blocks", 0)
        used = total - s.get("num_free_blocks", 0)
        queried = s.get("prefix_cache_query_tokens", 0)
        hit_rate = s.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
        gauges = [
            ("num_requests_running", "Requests in the running batch.", s.get("num_running", 0)),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0)),
            ("kv_blocks_used", "KV cache blocks held by requests.", used),
            ("kv_blocks_total", "KV cache blocks in the cache.", total),
            ("kv_cache_usage_ratio", "Fraction of KV blocks in use.", used / total if total else 0),
            (
                "prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache / queried.",
                hit_rate,
            ),
            ("ready", "1 when the startup state machine is READY.", int(ready)),
            (
                "batch_invariant",
                "1 when batch-invariant mode is on (EngineConfig.batch_invariant).",
                int(bool(s.get("batch_invariant", False))),
            ),
        ]
        for name, help_text, value in gauges:
            out.metric(name, "gauge", help_text, [({}, value)])
        groups = s.get("cache_groups", {})
        for name, help_text, key in (
            ("kv_group_blocks_used", "Blocks held by requests, per cache group.", None),
            ("kv_group_blocks_total", "Blocks in the cache, per cache group.", "total_blocks"),
        ):
            samples = [
                ({"group": group}, g[key] if key else g["total_blocks"] - g["free_blocks"])
                for group, g in groups.items()
            ]
            out.metric(name, "gauge", help_text, samples)
        out.metric(
            "num_preemptions_total",
            "counter",
            "Requests preempted (recomputed later).",
            [({}, s.get("num_preemptions", 0))],
        )
        out.metric(
            "prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens found cached.",
            [({}, s.get("prefix_cache_hit_tokens", 0))],
        )
        out.metric(
            "prefix_cache_query_tokens_total",
            "counter",
            "Prompt tokens looked up.",
            [({}, queried)],
        )
        out.metric(
            "startup_stage_seconds",
            "gauge",
            "Seconds each startup stage took.",
            [({"stage": k}, v) for k, v in stage_seconds.items()],
        )
        out.metric("model_info", "gauge", "The served model.", [({"model": model_name}, 1)])
        return out.text()


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Sequence[tuple[Mapping[str, str], float]],
    ) -> None:
        full = PREFIX + name
        self.lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        for labels, value in samples:
            self.lines.append(f"{full}{_labels(labels)} {_number(value)}")

    def histogram(self, name: str, help_text: str, h: Histogram) -> None:
        full = PREFIX + name
        self.lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
        cumulative = 0
        for bound, n in zip(h.buckets, h.counts, strict=True):
            cumulative += n
            self.lines.append(f'{full}_bucket{{le="{_number(bound)}"}} {cumulative}')
        self.lines.append(f'{full}_bucket{{le="+Inf"}} {h.count}')
        self.lines.append(f"{full}_sum {_number(h.sum)}")
        self.lines.append(f"{full}_count {h.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
