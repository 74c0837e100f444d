"""The serving benchmark client against a real `uvicorn server:app` (the default
deepseek-v3-tiny preset on CPU): every request succeeds, the usage counts add
up to what was asked, and the table names every metric."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess, start_server
from tinyengine.bench.__main__ import main as bench_main
from tinyengine.bench.common import parse_range, percentile
from tinyengine.bench.serve import make_workload

NUM_REQUESTS = 12
METRIC_NAMES = (
    "Successful requests",
    "Failed requests",
    "Benchmark duration (s)",
    "Request throughput (req/s)",
    "Input token throughput (tok/s)",
    "Output token throughput (tok/s)",
    "Mean TTFT (ms)",
    "P50 TTFT (ms)",
    "P99 TTFT (ms)",
    "Mean TPOT (ms)",
    "P50 TPOT (ms)",
    "P99 TPOT (ms)",
    "Mean E2E (ms)",
    "P50 E2E (ms)",
    "P99 E2E (ms)",
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from start_server(
        {
            "TINYENGINE_MODEL": "deepseek-v3-tiny",
            "TINYENGINE_MAX_NUM_SEQS": "8",
            "TINYENGINE_MAX_MODEL_LEN": "512",
        }
    )


def test_bench_serve_end_to_end(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    rc = bench_main(
        [
            "serve",
            "--base-url", server.url,
            "--num-requests", str(NUM_REQUESTS),
            "--request-rate", "8",
            "--input-len-range", "8:64",
            "--output-len-range", "4:16",
            "--seed", "0",
            "--json", str(out),
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0, printed
    for name in METRIC_NAMES:
        assert name in printed, name

    data = json.loads(out.read_text())
    reqs = data["requests"]
    assert len(reqs) == NUM_REQUESTS
    assert data["successful_requests"] == NUM_REQUESTS
    assert data["failed_requests"] == 0
    assert all(r["success"] for r in reqs), [r["error"] for r in reqs]
    # ignore_eos: every request generates exactly its max_tokens.
    assert data["total_output_tokens"] == sum(r["max_tokens"] for r in reqs)
    assert [r["output_tokens"] for r in reqs] == [r["max_tokens"] for r in reqs]
    assert [r["prompt_tokens"] for r in reqs] == [r["prompt_len"] for r in reqs]
    assert all(8 <= r["prompt_len"] <= 64 and 4 <= r["max_tokens"] <= 16 for r in reqs)
    for r in reqs:
        assert 0 < r["ttft_s"] <= r["e2e_s"], r
    # The vocabulary came from the served model's config (deepseek-v3-tiny's).
    assert data["config"]["vocab_size"] > 1000
    assert data["config"]["model"] == "deepseek-v3-tiny"
    assert data["duration_s"] > 0 and data["mean_tpot_ms"] > 0


def test_workload_is_seeded_and_poisson() -> None:
    a = make_workload(200, 4.0, (8, 64), (4, 16), 1000, seed=3)
    b = make_workload(200, math.inf, (8, 64), (4, 16), 1000, seed=3)
    # Same prompts at any rate; all at once when the rate is inf.
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(r.arrival_s == 0.0 for r in b)
    gaps = [y.arrival_s - x.arrival_s for x, y in zip(a, a[1:], strict=False)]
    assert all(g >= 0 for g in gaps)
    assert 0.15 < sum(gaps) / len(gaps) < 0.35  # mean gap ~ 1 / rate
    assert parse_range("3:7") == (3, 7) and parse_range("5") == (5, 5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
