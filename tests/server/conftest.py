"""Helpers for the server tests: real `uvicorn server:app` processes on free
loopback ports, configured through environment variables exactly as a user
would, and the model folders they serve.

Each test module starts at most one or two server processes (module-scoped
fixtures) and shares them across its tests, to keep the suite quick on two
CPU cores. The exception is the SmolLM2 server of the test_openai_server*.py
files (one suite split by topic): one session-scoped server and one offline
reference engine serve all of them, as they did when the suite was one file.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.openai_helpers import API_KEY, AUTH, ENGINE, MAX_REQUEST_BYTES
from tinyengine import LLM

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def free_port() -> int:
    # Bind to port 0 and let the OS pick; a tiny race with other processes is
    # acceptable in tests.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `python -m uvicorn server:app` child process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="tinyengine-server-", suffix=".log", delete=False
        )
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("TINYENGINE_")}
        full_env.update(env)
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env["PYTHONUNBUFFERED"] = "1"
        # One torch thread: tiny batches gain little from two, and on a busy
        # two-core CI machine a multi-threaded process stalls on every op.
        full_env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [
            sys.executable,
            "-m",
            "uvicorn",
            "server:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def health(self, timeout: float = 2.0) -> httpx.Response | None:
        try:
            return httpx.get(self.url + "/health", timeout=timeout)
        except httpx.TransportError:
            return None

    def wait_for_health(self, status: int, timeout: float = STARTUP_TIMEOUT_S) -> httpx.Response:
        """Poll /health until it answers `status`; fail with the server's log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            r = self.health()
            if r is not None and r.status_code == status:
                return r
            time.sleep(0.05)
        pytest.fail(f"/health never answered {status} within {timeout}s:\n{self.logs()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def get_metrics(url: str) -> dict[str, float]:
    """The server's /metrics as {name (with labels): value}."""
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def start_server(env: dict[str, str]) -> Iterator[ServerProcess]:
    """Start a server, wait until READY, yield it, stop it."""
    server = ServerProcess(env)
    try:
        server.wait_for_health(200)
        yield server
    finally:
        server.stop()


def make_tiny_text_model(path: Path, tokenizer_dir: str) -> Path:
    """A tiny random llama (hidden 64) with SmolLM2's vocabulary size and a copy
    of its tokenizer files: a model with real text in and out that costs
    almost nothing per step, for load tests."""
    from tests.hf_models import make_tiny_hf_model

    make_tiny_hf_model(
        "llama", path, vocab_size=49152, max_position_embeddings=512, num_hidden_layers=2
    )
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy(src, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    return str(make_tiny_text_model(tmp_path_factory.mktemp("tiny-text"), smollm2_path))


@pytest.fixture(scope="session")
def tiny_token_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random llama without a tokenizer (prompts as token ids)."""
    from tests.hf_models import make_tiny_hf_model

    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-ids")))


# --- the SmolLM2 OpenAI server of test_openai_server*.py ---
# (test_server_load.py defines its own module-scoped `server`, which wins there.)


@pytest.fixture(scope="session")
def server(smollm2_path: str):
    env = {f"TINYENGINE_{k.upper()}": str(v) for k, v in ENGINE.items()}
    env.update(
        TINYENGINE_MODEL=smollm2_path,
        TINYENGINE_API_KEY=API_KEY,
        TINYENGINE_MAX_REQUEST_BYTES=str(MAX_REQUEST_BYTES),
        TINYENGINE_PRINT_STARTUP_REPORT="false",
    )
    yield from start_server(env)


@pytest.fixture(scope="session")
def model_name(smollm2_path: str) -> str:
    return smollm2_path.rstrip("/").split("/")[-1]


@pytest.fixture(scope="session")
def llm(smollm2_path: str) -> LLM:
    return LLM(smollm2_path, **ENGINE, print_startup_report=False)


@pytest.fixture
def client(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture
def oai(server) -> Any:
    """A real OpenAI client on the server (imported here: the harness in this
    file is also used by tests/bench, which need no openai)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
