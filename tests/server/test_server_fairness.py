"""The README's run command and fair admission, through one real `uvicorn
server:app` with nothing configured: the embedded default model
(deepseek-v4-tiny) and every default setting, as a new user starts it.

- The server answers /health 200 within a generous bound of the process
  start, once the model is built (docs/startup.md has the real figure).
- One request cannot take the engine: n and prompts x n are capped by the
  server's settings with a 400 naming the cap; and while a request that fans
  out to 4,000 sequences runs, a one-prompt request streamed through the
  official openai client gets its first token within a few seconds, and both
  finish with the right outputs.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess, get_metrics
from tinyengine.models_presets import DEFAULT_MODEL as MODEL
from tinyengine.serve.settings import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_SEQUENCES

# Generous against a busy 2-core machine; ~2-3 s when idle (docs/startup.md).
READY_BOUND_S = 60.0
# "Within a few seconds": one engine step on this model takes tens of
# milliseconds; without fair admission the wait is the whole 4,000-sequence
# request (~10 s idle, longer on a busy machine).
FIRST_TOKEN_BOUND_S = 5.0
NUM_PROMPTS, N = 32, 125  # 4,000 sequences


@pytest.fixture(scope="module")
def readme_server():
    from tinyengine.models_presets import DEFAULT_MODEL, resolve_model

    resolve_model(DEFAULT_MODEL)  # "once built": the build is not startup
    env = {k: v for k, v in os.environ.items() if k == "TINYENGINE_CACHE"}
    server = ServerProcess(env)
    try:
        server.wait_for_health(200)
        server.ready_after = time.monotonic() - server.started_at
        yield server
    finally:
        server.stop()


def test_readme_server_is_ready_within_its_bound(readme_server):
    print(f"README server READY {readme_server.ready_after:.1f} s after the process started")
    assert readme_server.ready_after < READY_BOUND_S, readme_server.logs()
    body = readme_server.health().json()
    assert body["status"] == "ready"


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=600)


def test_fan_out_caps_answer_400_naming_the_cap(readme_server):
    import openai

    url = readme_server.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=f"max_n={DEFAULT_MAX_N}") as caught:
        client.chat.completions.create(
            model=MODEL, n=DEFAULT_MAX_N + 1, max_tokens=1,
            messages=[{"role": "user", "content": "hi"}],
        )  # fmt: skip
    assert caught.value.body["param"] == "n"

    prompts = [f"p{i}" for i in range(DEFAULT_MAX_REQUEST_SEQUENCES // DEFAULT_MAX_N + 1)]
    r = completion(url, prompt=prompts, n=DEFAULT_MAX_N, max_tokens=1)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert f"max_request_sequences={DEFAULT_MAX_REQUEST_SEQUENCES}" in err["message"]
    assert f"{len(prompts) * DEFAULT_MAX_N} sequences" in err["message"]

    # Many prompts without n count too.
    prompts = [[7, i % 100 + 10] for i in range(DEFAULT_MAX_REQUEST_SEQUENCES + 1)]
    r = completion(url, prompt=prompts, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    # The server kept serving.
    assert completion(url, prompt="hi", max_tokens=2).status_code == 200


def first_token_seconds(url: str, body: dict) -> tuple[float, str]:
    """Stream `body` through the official openai client; the seconds until
    the first text arrives, and the whole text."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    start = time.monotonic()
    first, text = None, ""
    for chunk in client.completions.create(model=MODEL, stream=True, **body):
        piece = chunk.choices[0].text if chunk.choices else ""
        if piece and first is None:
            first = time.monotonic() - start
        text += piece
    assert first is not None, "no text streamed"
    return first, text


def test_small_request_gets_its_first_token_while_a_4000_sequence_request_runs(readme_server):
    url = readme_server.url
    prompts = [f"Tell me about the number {i}" for i in range(NUM_PROMPTS)]
    big_body = dict(prompt=prompts, n=N, max_tokens=4, temperature=0)
    small_body = dict(prompt="A short question about cats", max_tokens=8, temperature=0)

    big: dict[str, httpx.Response] = {}
    started = time.monotonic()
    worker = threading.Thread(target=lambda: big.update(r=completion(url, **big_body)))
    worker.start()
    # Wait until the big request is in the engine and most of it still waits.
    deadline = time.monotonic() + 60
    while get_metrics(url)["tinyengine_num_requests_waiting"] < NUM_PROMPTS * N / 2:
        assert time.monotonic() < deadline and worker.is_alive(), "the big request never queued"
        time.sleep(0.02)
    ttft, small_text = first_token_seconds(url, small_body)
    still_waiting = get_metrics(url)["tinyengine_num_requests_waiting"]
    worker.join()
    big_seconds = time.monotonic() - started
    print(
        f"small request: first token {ttft:.2f} s while a {NUM_PROMPTS * N}-sequence request "
        f"ran ({still_waiting:.0f} of its sequences still waiting after the small one finished; "
        f"the big request took {big_seconds:.1f} s)"
    )
    assert ttft < FIRST_TOKEN_BOUND_S
    assert still_waiting > 0, "the big request finished first: the test measured nothing"

    r = big["r"]
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == NUM_PROMPTS * N
    assert sorted(c["index"] for c in choices) == list(range(NUM_PROMPTS * N))
    assert all(c["finish_reason"] == "length" for c in choices)
    # Greedy: every child of a prompt equals that prompt run once (n=1), and
    # the small request equals itself run alone on an idle engine.
    alone = completion(url, prompt=prompts, max_tokens=4, temperature=0).json()["choices"]
    by_index = {c["index"]: c["text"] for c in choices}
    for p in range(NUM_PROMPTS):
        texts = {by_index[p * N + k] for k in range(N)}
        assert texts == {alone[p]["text"]}, (p, texts)
    _, small_alone = first_token_seconds(url, small_body)
    assert small_text == small_alone
    # The default model (DeepSeek-V4) has two cache groups; both are idle again.
    m = get_metrics(url)
    for group in ("full", "sliding"):
        assert m[f'tinyengine_kv_group_blocks_total{{group="{group}"}}'] > 0
        assert m[f'tinyengine_kv_group_blocks_used{{group="{group}"}}'] == 0
