"""`uvicorn server:app` with TINYENGINE_TENSOR_PARALLEL_SIZE=2 on CPU: the
official openai client gets the one-process engine's greedy text, the
server's worker process ends with a normal shutdown, and a server killed
outright leaves no worker behind either (workers watch their parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests.server.conftest import ServerProcess
from tinyengine import LLM, SamplingParams

ENV = {
    "TINYENGINE_TENSOR_PARALLEL_SIZE": "2",
    "TINYENGINE_MAX_MODEL_LEN": "256",
    "TINYENGINE_MAX_NUM_SEQS": "4",
    "TINYENGINE_PRINT_STARTUP_REPORT": "false",
    "TINYENGINE_DEVICE": "cpu",  # CPU processes, also on a machine with one GPU
}
PROMPT = "The capital of France is"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_two_rank_server_serves_the_openai_client(tiny_text_model: str):
    import openai

    llm = LLM(tiny_text_model, max_model_len=256, max_num_seqs=4, print_startup_report=False,
              device="cpu")  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    (want,) = llm.generate(PROMPT, greedy, use_tqdm=False)
    del llm
    server = ServerProcess({"TINYENGINE_MODEL": tiny_text_model, **ENV})
    try:
        server.wait_for_health(200)
        workers = _children(server.proc.pid)
        assert len(workers) == 1, server.logs()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.outputs[0].text
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        server.stop()
    assert _gone(workers[0]), "the worker outlived the server's shutdown"


def test_a_killed_server_leaves_no_worker(tiny_text_model: str):
    server = ServerProcess({"TINYENGINE_MODEL": tiny_text_model, **ENV})
    try:
        server.wait_for_health(200)
        workers = _children(server.proc.pid)
        assert len(workers) == 1
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        assert _gone(workers[0], timeout=10), "the worker outlived its killed server"
    finally:
        server.stop()
