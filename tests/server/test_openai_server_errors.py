"""The OpenAI-compatible server when things go wrong (SmolLM2-135M-Instruct
through a real `uvicorn server:app`, see test_openai_server.py): clients that
go away (the request aborted, its KV blocks freed), bad input answered with an
OpenAI-format error, the body size limit, and the API key."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest

from tests.server.openai_helpers import (
    API_KEY,
    AUTH,
    MAX_REQUEST_BYTES,
    PROMPT,
    QUESTION,
    metrics,
)

# --- a client that goes away ---


def wait_until_idle(client: httpx.Client, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(client)
        idle = (
            m["tinyengine_num_requests_running"] == 0
            and m["tinyengine_num_requests_waiting"] == 0
            and m["tinyengine_kv_blocks_used"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_disconnect_aborts_and_frees_blocks(server, client):
    before = metrics(client)['tinyengine_requests_total{status="abort"}']
    long_run = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    with client.stream("POST", "/v1/completions", json={**long_run, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)  # some tokens arrive; then the client hangs up
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(server.url + "/v1/completions", json=long_run, headers=AUTH, timeout=1.0)

    m = wait_until_idle(client)
    assert m["tinyengine_num_requests_running"] == 0
    assert m["tinyengine_num_requests_waiting"] == 0
    assert m["tinyengine_kv_blocks_used"] == 0
    assert m['tinyengine_requests_total{status="abort"}'] == before + 2


# --- bad input ---

BAD_REQUESTS = [
    # (endpoint, body (dict, or raw bytes), status, param, words in the message)
    ("completions", b'{"prompt": "hi", ', 400, None, "not valid JSON"),
    ("completions", b'["a list"]', 400, None, "JSON object"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("completions", {"prompt": 3.5}, 400, "prompt", "prompt"),
    ("completions", {}, 400, "prompt", "required"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("completions", {"prompt": "hi " * 600}, 400, "prompt", "max_model_len"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "greater than"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", "greater"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n", "greater than"),
    ("completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens", "maximum context"),
    ("completions", {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of", "best_of == n"),
    ("completions", {"prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of", "best_of=1 must"),
    ("completions", {"prompt": "hi", "seed": 2**64 + 5}, 400, "seed", "2^63"),
    ("completions", {"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed", "2^63"),
    ("completions", {"prompt": "hi", "top_k": -7}, 400, "top_k", "top_k"),
    ("completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "less than"),
    ("completions", {"prompt": [10**9]}, 400, "prompt", "vocabulary"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    ("completions", {"prompt": "hi", "logit_bias": {"3": 200}}, 400, "logit_bias", "[-100"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias", "vocab"),
    ("completions", {"prompt": "hi", "guided_choice": ["a"]}, 400, "guided_choice", "not supp"),
    ("completions", {"prompt": "hi", "allowed_token_ids": [5]}, 400, "allowed_token_ids", "not"),
    (
        "chat/completions",
        {"messages": QUESTION, "structured_outputs": {"choice": ["a"]}},
        400,
        "structured_outputs",
        "not supported",
    ),  # fmt: skip
    ("chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    ("chat/completions", {"messages": "hello"}, 400, "messages", "array"),
    ("chat/completions", {"messages": QUESTION, "n": 500}, 400, "n", "max_n=128"),
    ("chat/completions", {"messages": QUESTION, "max_tokens": 600}, 400, "max_tokens", "too large"),
    ("chat/completions", {"messages": QUESTION, "temperature": -1}, 400, "temperature", ">"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi " * 600}]},
        400,
        "messages",  # the chat's own name for the prompt
        "max_model_len",
    ),
    (
        "chat/completions",
        {"messages": QUESTION, "max_completion_tokens": 600},
        400,
        "max_completion_tokens",  # the field the request used
        "too large",
    ),
    # ~1100 nested arrays: json's parser recurses past Python's limit; a 400, not a 500.
    ("completions", b'{"prompt": ' + b"[" * 1100 + b"]" * 1100 + b"}", 400, None, "deeply"),
    ("chat/completions", {"messages": QUESTION, "model": "nope"}, 404, "model", "nope"),
]


@pytest.mark.parametrize("endpoint,body,status,param,words", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error(client, endpoint, body, status, param, words):
    if isinstance(body, bytes):
        r = client.post(
            f"/v1/{endpoint}", content=body, headers={"content-type": "application/json"}
        )
    else:
        r = client.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words.replace(">", "greater").lower() in error["message"].lower()


def test_client_gone_mid_body_is_not_a_server_error(server, client):
    # The client sends half of its Content-Length and hangs up: nothing was
    # queued, so the server must not log it as an unhandled 500.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n".encode()
            + b'{"prompt": "half a body'
        )
    time.sleep(0.5)
    logs = server.logs()
    assert "unhandled error" not in logs and "ClientDisconnect" not in logs, logs[-2000:]
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_body_limit_and_server_keeps_serving(client):
    big = {"prompt": "x" * (MAX_REQUEST_BYTES + 10)}
    r = client.post("/v1/completions", json=big)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    r = client.post("/v1/completions", content=chunked())
    assert r.status_code == 413
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_api_key(server):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert anon.get("/health").status_code == 200  # /health needs no key
        for method, path in (
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
        ):
            r = anon.request(method, path, json={"prompt": "hi"})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
            r = anon.request(
                method, path, json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"}
            )
            assert r.status_code == 401
        assert anon.get("/v1/models", headers=AUTH).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
