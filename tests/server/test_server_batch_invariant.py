"""Batch-invariant mode through the server (`TINYENGINE_BATCH_INVARIANT=1`,
docs/batch_invariance.md), as a client sees it with the official openai
client: a prompt's completion tokens and logprobs are the same sent alone
and sent while other requests share its batches, and /metrics says the mode
is on. A real uvicorn process serving a tiny random Llama on the CPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from tests.server.conftest import get_metrics, start_server

PROMPT = "The quick brown fox jumps over the lazy dog while the river runs on"
OTHERS = [f"Request {i}: tell me about {'many ' * (5 * i)}things" for i in range(6)]


def _complete(client: openai.OpenAI, prompt: str, max_tokens: int = 12) -> tuple:
    out = client.completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    return choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs


def test_completions_do_not_depend_on_the_batch(tiny_text_model: str):
    env = {
        "TINYENGINE_MODEL": tiny_text_model,
        "TINYENGINE_SERVED_MODEL_NAME": "m",
        "TINYENGINE_BATCH_INVARIANT": "1",
        # Small chunks, so the prompt's prefill also lands in mixed steps.
        "TINYENGINE_MAX_NUM_BATCHED_TOKENS": "24",
        "TINYENGINE_PRINT_STARTUP_REPORT": "false",
    }
    for server in start_server(env):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert get_metrics(server.url)["tinyengine_batch_invariant"] == 1
        alone = _complete(client, PROMPT)
        with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
            others = [pool.submit(_complete, client, p, 24) for p in OTHERS]
            together = pool.submit(_complete, client, PROMPT)
            assert together.result() == alone
            assert all(f.result()[0] for f in others)
        assert get_metrics(server.url)["tinyengine_num_requests_running"] == 0
