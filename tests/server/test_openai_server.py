"""The OpenAI-compatible server against real weights (SmolLM2-135M-Instruct),
through a real `uvicorn server:app` process, with httpx and the official
`openai` client.

The reference for every text is the offline API in this process
(`LLM.generate` / `LLM.chat` with the same engine options): the server must
give exactly what the engine gives.

Text parity here (completions, chat, n > 1, echo, penalties, stop strings);
logprobs in test_openai_server_logprobs.py, client disconnects, bad input and
auth in test_openai_server_errors.py, tokenize / models / health / metrics in
test_openai_server_endpoints.py. The server and the reference engine are
fixtures of conftest.py, shared by those files (one server for all of them).
"""

from __future__ import annotations

import pytest

from tests.server.openai_helpers import PROMPT, QUESTION, greedy, read_sse
from tinyengine import SamplingParams

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
