"""Failure isolation, with a fault injected test-only: the app runs in this
process (uvicorn in a thread) so the test can patch the engine's runner to
raise on a "poisoned" prompt. A failing step fails the requests it ran with a
500 error body; a request the engine rejects gets 400; either way the engine
loop keeps running, other requests keep streaming, and no KV block leaks.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn

from tests.server.conftest import free_port
from tinyengine.serve import ServerSettings, create_app

POISON = 13  # a prompt containing this token id makes the runner raise


@pytest.fixture(scope="module")
def inproc(tiny_token_model: str):
    settings = ServerSettings(
        model=tiny_token_model,
        engine_kwargs=dict(max_num_seqs=4, max_model_len=256, print_startup_report=False),
    )
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.config.port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    engine = app.state.engine
    assert engine.ready, engine.health()

    # Test-only: reach past the bridge's interface to the LLMEngine it owns.
    runner = engine._engine.runner
    real_launch = runner.launch

    def faulty_launch(plan):  # runs on the engine thread
        if any(POISON in s.request.prompt_token_ids for s in plan.scheduled):
            raise RuntimeError("injected fault")
        return real_launch(plan)

    runner.launch = faulty_launch
    yield url, engine
    runner.launch = real_launch
    server.should_exit = True
    thread.join(timeout=30)


def counts(engine) -> dict:
    stats = engine.stats()
    return {
        "used": stats["num_total_blocks"] - stats["num_free_blocks"],
        "running": stats["num_running"],
        "waiting": stats["num_waiting"],
    }


def test_failing_step_gives_500_and_engine_keeps_running(inproc):
    url, engine = inproc
    errors_before = engine.metrics.requests["error"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, POISON, 2], "max_tokens": 4})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "internal_server_error" and "injected fault" in error["message"]

    # Streaming: the stream is open (200) when the step fails; the error
    # arrives as an event, then [DONE].
    body = {"prompt": [POISON, 5], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as s:
        assert s.status_code == 200
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert "injected fault" in json.loads(lines[-2][6:])["error"]["message"]

    r = httpx.post(
        url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert engine.metrics.requests["error"] == errors_before + 2
    assert counts(engine) == {"used": 0, "running": 0, "waiting": 0}


def test_rejected_request_does_not_disturb_a_running_one(inproc):
    url, engine = inproc
    # logprobs: a model without a tokenizer streams no text, but a chunk per
    # token when logprobs are asked for.
    body = {
        "prompt": [1, 2, 3, 4],
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        next(lines)  # the long request is running
        # Out-of-vocabulary ids: add_request raises ValueError -> 400.
        bad = httpx.post(url + "/v1/completions", json={"prompt": [10**6], "max_tokens": 2})
        assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
        rest = [line for line in lines if line.startswith("data: {")]
    usage = json.loads(rest[-1][6:])["usage"]
    assert usage["completion_tokens"] == 60
    assert counts(engine) == {"used": 0, "running": 0, "waiting": 0}
