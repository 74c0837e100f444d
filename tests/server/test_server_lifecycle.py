"""Server startup as a client sees it: /health answers 503 with the startup
stage while the engine starts and 200 once READY; a model that fails to load
gives 503 with the reason; `python -m tinyengine serve` is the CLI twin of
`uvicorn server:app`.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import REPO, STARTUP_TIMEOUT_S, ServerProcess, free_port

STARTING_STATES = {"preparing", "created", "loaded", "profiled", "kv_ready", "warm", "captured"}
STAGES = {"prepare_model", "load", "profile", "size_kv", "warmup", "capture", "lock"}


def test_cli_serve_health_503_until_ready(tiny_token_model: str, tmp_path: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinyengine",
            "serve",
            "--model",
            tiny_token_model,
            "--port",
            str(port),
            "--api-key",
            "k3y",
            "--max-num-seqs",
            "2",
            "--max-model-len",
            "128",
            "--enforce-eager",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        seen: list[tuple[int, dict]] = []
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, Path(log.name).read_text()
            try:
                r = httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            # While starting, generation is refused with 503 and the reason.
            r2 = httpx.post(
                url + "/v1/completions",
                json={"prompt": [1, 2]},
                headers={"Authorization": "Bearer k3y"},
            )
            if r2.status_code == 503:
                assert "starting" in r2.json()["error"]["message"]
            time.sleep(0.02)
        codes = [code for code, _ in seen]
        assert codes[-1] == 200, Path(log.name).read_text()
        assert codes[0] == 503, "the engine was READY before the server answered at all"
        for code, body in seen[:-1]:
            assert code == 503 and body["status"] == "starting"
            # A poll between two stages (state "captured" before "lock"
            # starts, say) sees no stage running.
            assert body["state"] in STARTING_STATES
            assert body["stage"] in STAGES or body["stage"] is None
        ready = seen[-1][1]
        assert ready["status"] == "ready" and "warmup" in ready["stage_seconds"]

        # --api-key protects everything but /health.
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200
        assert r.json()["data"][0]["id"] == Path(tiny_token_model).name
        r = httpx.post(
            url + "/v1/completions",
            headers={"Authorization": "Bearer k3y"},
            json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


@pytest.fixture
def broken_model(tiny_token_model: str, tmp_path: Path) -> str:
    """A folder whose config is fine but whose weights are not a safetensors file."""
    folder = tmp_path / "broken"
    shutil.copytree(tiny_token_model, folder)
    (folder / "model.safetensors").write_bytes(b"this is not a safetensors file")
    return str(folder)


def test_model_that_fails_to_load_gives_503_with_reason(broken_model: str):
    server = ServerProcess({"TINYENGINE_MODEL": broken_model})
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            r = server.health()
            if r is not None and r.json()["status"] == "failed":
                break
            assert r is None or r.status_code == 503
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.05)
        assert r.status_code == 503
        body = r.json()
        assert body["state"] == "failed" and body["error"].startswith("load:")
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2]})
        assert r.status_code == 503
        assert "failed to start" in r.json()["error"]["message"]
        assert json.loads(r.text)["error"]["type"] == "service_unavailable"
    finally:
        server.stop()


def test_sigterm_ends_inflight_generations_and_exits(tiny_text_model: str):
    """uvicorn alone waits for every open connection on SIGTERM, so a long
    generation would keep the server alive for minutes. The first signal must
    fail the in-flight requests ("the server is shutting down") and the process
    must exit within seconds."""
    server = ServerProcess({"TINYENGINE_MODEL": tiny_text_model, "TINYENGINE_ENFORCE_EAGER": "1"})
    try:
        server.wait_for_health(200)
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        lines: list[str] = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            while sum(line.startswith("data: {") for line in lines) < 2:
                lines.append(next(it))
            server.proc.terminate()  # SIGTERM
            t0 = time.monotonic()
            lines.extend(it)  # the stream ends early, with an error event
        # uvicorn re-raises the signal once shut down: exit status -SIGTERM.
        assert server.proc.wait(timeout=20) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 20
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert any("shutting down" in json.dumps(e) for e in events), lines[-5:]
        finished = [c for e in events for c in e.get("choices", ()) if c.get("finish_reason")]
        assert not any(c["finish_reason"] == "length" for c in finished)  # not run to the end
    finally:
        server.stop()
