"""The OpenAI-compatible server's other endpoints (SmolLM2-135M-Instruct
through a real `uvicorn server:app`, see test_openai_server.py): /tokenize
and /detokenize against the engine's tokenizer, /v1/models through the
official client, /health, /ping, /version and the Prometheus /metrics."""

from __future__ import annotations

import openai
import pytest

from tests.server.openai_helpers import ENGINE, PROMPT, QUESTION, metrics

# --- health, models, metrics ---


def test_tokenize_and_detokenize_match_the_engine(client, llm, model_name):
    """/tokenize gives the ids the engine computes for the same prompt or
    conversation (its usage.prompt_tokens); /detokenize inverts it."""
    tok = llm.get_tokenizer()
    r = client.post("/tokenize", json={"model": model_name, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == ENGINE["max_model_len"]
    chat = client.post("/tokenize", json={"messages": QUESTION}).json()
    usage = client.post("/v1/chat/completions",
                        json={"messages": QUESTION, "max_tokens": 1}).json()["usage"]  # fmt: skip
    assert chat["count"] == usage["prompt_tokens"]
    assert chat["tokens"] == tok.apply_chat_template(QUESTION, tokenize=True)
    r = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}
    for path, bad, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": QUESTION}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        r = client.post(path, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, bad, r.text)
    assert client.post("/tokenize", json={"prompt": "a", "model": "x"}).status_code == 404


def test_models_retrieve_through_the_official_client(oai, model_name):
    card = oai.models.retrieve(model_name)
    assert card.id == model_name and card.object == "model"
    assert [m.id for m in oai.models.list().data] == [model_name]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.models.retrieve("gpt-4")


def test_health_models_and_metrics(client, model_name):
    h = client.get("/health")
    assert h.status_code == 200
    assert h.json()["status"] == "ready"
    assert set(h.json()["stage_seconds"]) >= {"load", "profile", "size_kv", "warmup", "lock"}
    for method in ("GET", "POST"):  # vLLM's /ping: /health under another name
        ping = client.request(method, "/ping")
        assert ping.status_code == 200 and ping.json()["status"] == "ready"
    assert client.get("/version").json()["version"]
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == model_name
    # A prompt longer than one KV block, twice: the second hits the prefix cache.
    long_prompt = "Once upon a time, in a land far away, there lived a wise old owl. " * 3
    for _ in range(2):
        assert (
            client.post(
                "/v1/completions", json={"prompt": long_prompt, "max_tokens": 2}
            ).status_code
            == 200
        )
    m = metrics(client)
    for name in (
        'tinyengine_requests_total{status="length"}',
        'tinyengine_requests_total{status="rejected"}',
        "tinyengine_prompt_tokens_total",
        "tinyengine_generation_tokens_total",
        "tinyengine_time_to_first_token_seconds_count",
        "tinyengine_time_per_output_token_seconds_count",
        "tinyengine_num_requests_running",
        "tinyengine_num_requests_waiting",
        "tinyengine_kv_blocks_used",
        "tinyengine_kv_blocks_total",
        "tinyengine_prefix_cache_hit_rate",
        "tinyengine_num_preemptions_total",
        'tinyengine_startup_stage_seconds{stage="warmup"}',
    ):
        assert name in m, name
    assert m['tinyengine_requests_total{status="length"}'] >= 2
    assert m["tinyengine_generation_tokens_total"] >= 4
    assert m["tinyengine_kv_blocks_total"] > 0
    assert 0 < m["tinyengine_prefix_cache_hit_rate"] <= 1
    assert (
        m['tinyengine_time_to_first_token_seconds_bucket{le="+Inf"}']
        == m["tinyengine_time_to_first_token_seconds_count"]
    )
