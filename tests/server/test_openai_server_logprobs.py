"""The OpenAI-compatible server's logprobs (SmolLM2-135M-Instruct through a
real `uvicorn server:app`, see test_openai_server.py): the legacy completions
format (tokens, offsets, top_logprobs with the chosen token) streamed or not,
and chat's OpenAI format, against the offline engine's values."""

from __future__ import annotations

import pytest

from tests.server.openai_helpers import PROMPT, QUESTION, greedy, read_sse

# --- logprobs ---


def test_completion_logprobs(client, llm):
    ref = llm.generate([PROMPT], greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    r = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]) == r.json()["choices"][0]["text"]
    assert lp["text_offset"][0] == 0
    for i, (token_id, entry) in enumerate(zip(ref.token_ids, ref.logprobs, strict=True)):
        assert lp["token_logprobs"][i] == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert 1 <= len(lp["top_logprobs"][i]) <= 3  # greedy: the chosen token is in the top
        # Greedy: the sampled token is the most likely one.
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(lp["token_logprobs"][i])


def test_completion_top_logprobs_always_list_the_chosen_token(client):
    # OpenAI's legacy format: "the API will always return the logprob of the
    # sampled token, so there may be up to logprobs+1 elements". A hot
    # temperature samples tokens outside the top 1; logprobs=0 lists only it.
    for n_top in (0, 1):
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 2.0, "seed": 5,
                "logprobs": n_top, "echo": True}  # fmt: skip
        lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                     strict=True):  # fmt: skip
            if value is None:  # the echoed prompt's first token
                assert top is None
                continue
            assert top[token] == pytest.approx(value)
            assert len(top) <= n_top + 1
        if n_top == 0:
            assert all(len(top) == 1 for top in lp["top_logprobs"][1:])


def test_null_for_optional_booleans_means_false(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "echo": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    body = {"messages": QUESTION, "max_tokens": 2, "logprobs": None}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_streamed_completion_logprobs_line_up(client):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = read_sse(r)[:-1]
    tokens, offsets, text = [], [], ""
    for event in events:
        choice = event["choices"][0]
        text += choice["text"]
        tokens += choice["logprobs"]["tokens"]
        offsets += choice["logprobs"]["text_offset"]
    assert len(tokens) == 6 and "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(6)]


def test_chat_logprobs_openai_format(oai, model_name):
    out = oai.chat.completions.create(
        model=model_name,
        messages=QUESTION,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.bytes == list(item.token.encode())
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
