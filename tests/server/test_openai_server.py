"""The OpenAI-compatible server against real weights (SmolLM2-135M-Instruct),
through a real `uvicorn server:app` process, with httpx and the official
`openai` client.

The reference for every text is the offline API in this process
(`LLM.generate` / `LLM.chat` with the same engine options): the server must
give exactly what the engine gives.
"""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import start_server
from tinyengine import LLM, SamplingParams

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ENGINE = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256)
MAX_REQUEST_BYTES = 64 * 1024
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_path: str):
    env = {f"TINYENGINE_{k.upper()}": str(v) for k, v in ENGINE.items()}
    env.update(
        TINYENGINE_MODEL=smollm2_path,
        TINYENGINE_API_KEY=API_KEY,
        TINYENGINE_MAX_REQUEST_BYTES=str(MAX_REQUEST_BYTES),
        TINYENGINE_PRINT_STARTUP_REPORT="false",
    )
    yield from start_server(env)


@pytest.fixture(scope="module")
def model_name(smollm2_path: str) -> str:
    return smollm2_path.rstrip("/").split("/")[-1]


@pytest.fixture(scope="module")
def llm(smollm2_path: str) -> LLM:
    return LLM(smollm2_path, **ENGINE, print_startup_report=False)


@pytest.fixture
def client(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def read_sse(response: httpx.Response) -> list[Any]:
    """The decoded `data:` payloads of a stream; "[DONE]" stays a string."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metrics(client: httpx.Client) -> dict[str, float]:
    """/metrics as {"name{labels}": value}, checking the text format line by line."""
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    typed: set[str] = set()
    sample = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            continue
        m = sample.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        family = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in typed or family in typed, f"{m.group(1)} has no # TYPE"
        values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values


# --- text parity with the offline engine ---


def test_completion_matches_llm_generate(client, llm, model_name):
    ref = llm.generate([PROMPT], greedy(16), use_tqdm=False)[0]
    r = client.post(
        "/v1/completions",
        json={"model": model_name, "prompt": PROMPT, "max_tokens": 16, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == model_name
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0
    assert choice["text"] == ref.outputs[0].text
    assert choice["finish_reason"] == ref.outputs[0].finish_reason
    assert body["usage"] == {
        "prompt_tokens": len(ref.prompt_token_ids),
        "completion_tokens": len(ref.outputs[0].token_ids),
        "total_tokens": len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids),
    }


def test_completion_stream_matches_and_reports_usage(client, llm):
    ref = llm.generate([PROMPT], greedy(16), use_tqdm=False)[0]
    body = {
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = read_sse(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)
    assert usage_chunk["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    # include_usage: every other chunk carries "usage": null (OpenAI's format)
    assert all("usage" in c and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.outputs[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == ref.outputs[0].finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_token_id_prompts_and_several_prompts(client, llm):
    tok = llm.get_tokenizer()
    prompts = [PROMPT, "Name three primary colors:"]
    refs = llm.generate(prompts, greedy(6), use_tqdm=False)
    r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 6, "temperature": 0})
    assert [c["text"] for c in r.json()["choices"]] == [o.outputs[0].text for o in refs]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    ids = tok.encode(PROMPT)
    for prompt in (ids, [ids]):
        r = client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == refs[0].outputs[0].text


def test_seeded_sampling_matches(client, llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12)
    ref = llm.generate([PROMPT], params, use_tqdm=False)[0]
    r = client.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "temperature": 0.9,
            "top_p": 0.95,
            "top_k": 50,
            "seed": 1234,
            "max_tokens": 12,
        },
    )
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text


def test_n_choices_per_prompt_match_llm_generate(client, oai, llm, model_name):
    """n > 1: choice k is prompt k // n's completion k % n, which samples as
    an n=1 request with seed + k % n; LLM.generate(n=2) gives the same texts
    (one RequestOutput per prompt, with n completions); each prompt's tokens
    count once in usage, as OpenAI counts them."""
    prompts = [PROMPT, "Name three primary colors:"]
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8)
    refs = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.index for c in r.outputs] for r in refs] == [[0, 1], [0, 1]]
    want = [c.text for r in refs for c in r.outputs]
    single = llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=8, max_tokens=8),
                          use_tqdm=False)[0]  # fmt: skip
    assert want[1] == single.outputs[0].text  # completion 1 = the n=1 request with seed + 1
    assert want[0] != want[1]  # seeds 7 and 8 differ (not one sample copied n times)

    body = {"prompt": prompts, "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 8}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == want
    prompt_tokens = sum(len(ref.prompt_token_ids) for ref in refs)
    completion_tokens = sum(len(c.token_ids) for ref in refs for c in ref.outputs)
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["usage"]["completion_tokens"] == completion_tokens

    # Chat through the official client, streamed: deltas regroup by index.
    ref = llm.chat(QUESTION, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6),
                   use_tqdm=False)[0]  # fmt: skip
    stream = oai.chat.completions.create(
        model=model_name, messages=QUESTION, n=3, temperature=1.0, seed=3, max_tokens=6,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        usage = chunk.usage or usage
    assert texts == {i: c.text for i, c in enumerate(ref.outputs)}
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)


def test_echo_puts_the_prompt_before_the_text(client, llm):
    ref = llm.generate([PROMPT], greedy(5), use_tqdm=False)[0].outputs[0].text
    ids = llm.get_tokenizer().encode(PROMPT)
    for prompt, shown in ((PROMPT, PROMPT), (ids, llm.get_tokenizer().decode(ids))):
        body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == shown + ref
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = read_sse(r)
    assert events[0]["choices"][0]["text"] == shown  # the prompt comes first
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == shown + ref


def test_penalties_match_llm_generate(oai, llm, model_name):
    """OpenAI's presence/frequency penalties and vLLM's repetition_penalty
    (extra_body) reach the sampler: the texts are the offline engine's, and
    they differ from the unpenalized answer."""
    kw = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3)
    ref = llm.generate([PROMPT], greedy(24, **kw), use_tqdm=False)[0].outputs[0].text
    plain = llm.generate([PROMPT], greedy(24), use_tqdm=False)[0].outputs[0].text
    assert ref != plain
    r = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
        presence_penalty=0.8, frequency_penalty=0.6, extra_body={"repetition_penalty": 1.3},
    )  # fmt: skip
    assert r.choices[0].text == ref

    # OpenAI's logit_bias: keys are token ids as strings.
    forced = llm.get_tokenizer().encode(" Paris")[0]
    r = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0,
                               logit_bias={str(forced): 100})  # fmt: skip
    want = llm.generate([PROMPT], greedy(3, logit_bias={forced: 100.0}), use_tqdm=False)[0]
    assert want.outputs[0].token_ids == [forced] * 3
    assert r.choices[0].text == want.outputs[0].text


def test_echo_with_logprobs_scores_the_prompt(client, oai, llm, model_name):
    """echo + logprobs (lm-eval-harness's loglikelihood request): the prompt's
    tokens come first, the first with null logprobs, then the generated
    ones; values are LLM.generate's prompt_logprobs / logprobs. A stream
    sends the same entries, the prompt's with the echoed text."""
    tok = llm.get_tokenizer()
    params = greedy(3, logprobs=2, prompt_logprobs=2)
    ref = llm.generate([PROMPT], params, use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    r = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0,
                               echo=True, logprobs=2)  # fmt: skip
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT + ref.outputs[0].text
    assert len(lp.tokens) == len(ids) + 3
    assert lp.tokens[0] == tok.decode([ids[0]]) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    want = [ref.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    want += [e[t].logprob for t, e in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs,
                                          strict=True)]  # fmt: skip
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    # The top 2, plus the chosen token where it ranks lower (OpenAI's rule).
    for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True):
        assert token in top and 2 <= len(top) <= 3
    assert lp.text_offset == sorted(lp.text_offset)

    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2,
            "stream": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as s:
        events = [e for e in read_sse(s) if e != "[DONE]"]
    assert events[0]["choices"][0]["text"] == PROMPT
    streamed = [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp.token_logprobs
    assert "".join(e["choices"][0]["text"] for e in events) == r.choices[0].text


def test_chat_matches_llm_chat(client, oai, llm, model_name):
    ref = llm.chat(QUESTION, greedy(16), use_tqdm=False)[0]
    r = client.post(
        "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 16, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ref.outputs[0].text}
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)

    # The official client, streaming, with max_completion_tokens.
    stream = oai.chat.completions.create(
        model=model_name,
        messages=QUESTION,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [ref.outputs[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_openai_client_completions_and_models(oai, llm, model_name):
    ref = llm.generate([PROMPT], greedy(10), use_tqdm=False)[0]
    out = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0)
    assert out.choices[0].text == ref.outputs[0].text
    assert out.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids)
    assert [m.id for m in oai.models.list().data] == [model_name]


# --- stop strings ---


def test_stop_string_ends_stream_at_the_right_place(client, llm):
    full = llm.generate([PROMPT], greedy(20), use_tqdm=False)[0].outputs[0].text
    # A stop string from the middle of the greedy text, likely spanning tokens.
    k = len(full) // 2
    stop = full[k : k + 5]
    expected = full[: full.find(stop)]
    ref = llm.generate([PROMPT], greedy(20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert ref.text == expected and ref.finish_reason == "stop"

    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop": stop, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = read_sse(r)
    assert events[-1] == "[DONE]"
    streamed = ""
    for event in events[:-1]:
        streamed += event["choices"][0]["text"]
        # Never a character that the stop string later cut away.
        assert expected.startswith(streamed), (streamed, expected)
    assert streamed == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"

    r = client.post(
        "/v1/chat/completions",
        json={"messages": QUESTION, "max_tokens": 12, "temperature": 0, "stop": ["France"]},
    )
    chat = r.json()["choices"][0]
    assert chat["finish_reason"] == "stop" and "France" not in chat["message"]["content"]


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
    ("chat/completions", {"messages": QUESTION, "n": 500}, 400, "n", "less than"),
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
