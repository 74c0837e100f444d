"""Shared by the OpenAI-server tests (test_openai_server*.py): the server's
configuration (API key, engine options, body limit), the prompts they send,
and helpers that read its answers (SSE streams, the Prometheus /metrics text).
The fixtures that start the server and the offline reference engine are in
conftest.py."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from tinyengine import SamplingParams

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ENGINE = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256)
MAX_REQUEST_BYTES = 64 * 1024
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def read_sse(response: httpx.Response) -> list[Any]:
    """The decoded `data:` payloads of a stream; "[DONE]" stays a string."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metrics(client: httpx.Client) -> dict[str, float]:
    """/metrics as {"name{labels}": value}, checking the text format line by line."""
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    typed: set[str] = set()
    sample = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            continue
        m = sample.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        family = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in typed or family in typed, f"{m.group(1)} has no # TYPE"
        values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values
