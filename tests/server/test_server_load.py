"""The server under load: many concurrent requests through one real uvicorn
process, batched by the scheduler. The model is the embedded default, the
deepseek-v3-tiny proxy (MLA, MoE, the real DeepSeek tokenizer), so a step
costs little and hundreds of requests fit in a CI run; the KV cache is kept
small so that preemption happens too.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.server.conftest import get_metrics, start_server
from tinyengine import LLM, SamplingParams

ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=96)


@pytest.fixture(scope="module")
def proxy_model() -> str:
    from tinyengine.tools.make_proxy import ensure_preset

    return ensure_preset("deepseek-v3-tiny")


@pytest.fixture(scope="module")
def server(proxy_model: str):
    env = {f"TINYENGINE_{k.upper()}": str(v) for k, v in ENGINE.items()}
    env.update(
        TINYENGINE_MODEL=proxy_model,
        TINYENGINE_SERVED_MODEL_NAME="tiny",
        TINYENGINE_PRINT_STARTUP_REPORT="0",
    )
    yield from start_server(env)


def wait_until_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = get_metrics(url)
        if (
            m["tinyengine_num_requests_running"]
            == m["tinyengine_num_requests_waiting"]
            == m["tinyengine_kv_blocks_used"]
            == 0
        ) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


async def stream_text(c: httpx.AsyncClient, body: dict, cancel_after: int | None = None) -> dict:
    """Stream one completion; return its text, finish reason and usage. With
    `cancel_after`, hang up after that many events."""
    out: dict = {"text": "", "finish_reason": None, "usage": None, "cancelled": False}
    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                out["usage"] = event["usage"]
            for choice in event["choices"]:
                out["text"] += choice["text"]
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
            n += 1
            if cancel_after is not None and n >= cancel_after:
                out["cancelled"] = True
                return out  # leaving the block closes the connection
    return out


def test_concurrent_streams_each_get_their_own_text(server, proxy_model):
    prompts = [f"Request number {i} says:" + " la" * i for i in range(16)]
    llm = LLM(proxy_model, **ENGINE, print_startup_report=False)
    refs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(stream_text(c, {**body, "prompt": p}) for p in prompts))

    results = asyncio.run(run())
    assert [r["text"] for r in results] == [o.outputs[0].text for o in refs]
    assert all(r["finish_reason"] == "length" for r in results)


def test_200_concurrent_requests_with_cancellations(server):
    """Mixed prompt and output lengths, streaming and not, 20% cancelled
    mid-stream: every other request completes with exactly its token count,
    and afterwards every KV block is free and /metrics agrees."""
    rng = random.Random(0)
    before = get_metrics(server.url)
    jobs = []
    for i in range(200):
        body = {
            "prompt": " ".join(
                rng.choice(["cat", "dog", "sun", "sea", "tree"]) for _ in range(rng.randint(1, 24))
            ),
            "max_tokens": rng.randint(1, 20),
            "temperature": 0.8 if i % 10 == 1 else 0.0,
            "seed": i,
            "ignore_eos": True,
        }
        kind = "cancel" if i % 5 == 0 else ("stream" if i % 2 else "plain")
        if kind == "cancel":
            body["max_tokens"] = 40  # long enough never to finish before the hang-up
        if kind == "stream":
            body["stream_options"] = {"include_usage": True}
        jobs.append((kind, body))

    async def one(c: httpx.AsyncClient, kind: str, body: dict) -> dict:
        if kind == "plain":
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return {"usage": r.json()["usage"], "finish_reason": choice["finish_reason"]}
        return await stream_text(c, body, cancel_after=2 if kind == "cancel" else None)

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as c:
            return await asyncio.gather(*(one(c, kind, body) for kind, body in jobs))

    results = asyncio.run(run())
    for (kind, body), result in zip(jobs, results, strict=True):
        if kind == "cancel":
            assert result["cancelled"]
            continue
        assert result["finish_reason"] == "length", (kind, body, result)
        assert result["usage"]["completion_tokens"] == body["max_tokens"], (kind, body, result)

    after = wait_until_idle(server.url)
    assert after["tinyengine_kv_blocks_used"] == 0
    assert after["tinyengine_num_requests_running"] == 0
    assert after["tinyengine_num_requests_waiting"] == 0
    delta = {k: after[k] - before.get(k, 0) for k in after}
    num_cancelled = sum(kind == "cancel" for kind, _ in jobs)
    assert delta['tinyengine_requests_total{status="abort"}'] == num_cancelled
    assert delta['tinyengine_requests_total{status="length"}'] == len(jobs) - num_cancelled
    assert delta['tinyengine_requests_total{status="error"}'] == 0
    assert delta["tinyengine_time_to_first_token_seconds_count"] == len(jobs)
