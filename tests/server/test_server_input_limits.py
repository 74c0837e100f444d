"""Inputs a server must refuse cheaply and clearly, as a client sees them:
a prompt too long for max_model_len refused by its length before any
tokenizing (and /health answering meanwhile), stop_token_ids outside the
vocabulary, unknown chat roles, NaN and infinite floats, lone surrogate
escapes; HEAD /health.

One real `uvicorn server:app` (the tiny text model: SmolLM2's tokenizer,
max_model_len 512, the default 4 MiB body limit) serves the module.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import httpx
import pytest

from tests.server.conftest import ServerProcess, start_server
from tinyengine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tinyengine.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from tinyengine.serve.protocol import parse_request as parse
from tinyengine.serve.tokenize import MIN_CHARS_PER_TOKEN, max_chars_per_token
from tinyengine.tokenizer import Tokenizer

MAX_MODEL_LEN = 512
USER = {"role": "user", "content": "hi"}


def _error(body: bytes, cls: type = CompletionRequest) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body, cls)
    assert e.value.status == 400
    return e.value


# --- no server ---


@pytest.mark.parametrize(
    "field,value",
    [("temperature", "NaN"), ("top_p", "Infinity"), ("min_p", "NaN"),
     ("presence_penalty", "-Infinity"), ("frequency_penalty", "NaN"),
     ("repetition_penalty", "Infinity")],
)  # fmt: skip
def test_non_finite_floats_are_refused_naming_the_field(field, value):
    e = _error(f'{{"prompt": "a", "{field}": {value}}}'.encode())
    assert e.param == field and "must be a finite number" in e.message
    e = _error(f'{{"messages": [{json.dumps(USER)}], "{field}": {value}}}'.encode(),
               ChatCompletionRequest)  # fmt: skip
    assert e.param == field and "must be a finite number" in e.message


def test_non_finite_logit_bias_value_is_refused():
    e = _error(b'{"prompt": "a", "logit_bias": {"5": NaN}}')
    assert e.param == "logit_bias" and "must be a finite number" in e.message


def test_unknown_chat_role_is_refused_naming_it():
    for role in ("system", "user", "assistant", "tool", "developer"):
        parse(json.dumps({"messages": [{"role": role, "content": "x"}]}).encode(),
              ChatCompletionRequest)  # fmt: skip
    e = _error(b'{"messages": [{"role": "wizard", "content": "x"}]}', ChatCompletionRequest)
    assert e.param == "messages" and "'wizard'" in e.message and "developer" in e.message


def test_lone_surrogate_is_not_valid_unicode():
    e = _error(b'{"prompt": "a\\ud800b"}')
    assert e.param == "prompt" and "not valid Unicode" in e.message
    e = _error(b'{"messages": [{"role": "user", "content": "\\udfff"}]}', ChatCompletionRequest)
    assert e.param == "messages" and "not valid Unicode" in e.message
    # A surrogate pair is a character (U+1F600), not an error.
    assert parse(b'{"prompt": "a\\ud83d\\ude00"}', CompletionRequest).prompt == "a\U0001f600"


def test_json_the_parser_reads_but_cannot_use_is_a_400():
    # Nesting deeper than a recursive walk can follow (json.loads takes it;
    # the lone-surrogate scan once recursed over it), and an integer of over
    # 4300 digits, which json.loads refuses with a plain ValueError.
    for depth in (400, 950, 5000):
        body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        assert "too deeply" in _error(body).message
    e = _error(b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}")
    assert "not valid JSON" in e.message and "4300" in e.message


def test_an_error_without_a_field_names_the_body():
    # UTF-16: Python's json reads it, pydantic's strict UTF-8 parser does not.
    e = _error('{"prompt": "a"}'.encode("utf-16"))
    assert e.message.startswith("the request body: "), e.message
    # A UTF-8 byte-order mark before the JSON is ignored (RFC 8259 allows it).
    assert parse(b'\xef\xbb\xbf{"prompt": "a"}', CompletionRequest).prompt == "a"


def test_reserved_chat_template_kwargs_are_refused_naming_them():
    for key in ("chat_template", "add_generation_prompt", "tokenize", "messages"):
        body = {"messages": [USER], "chat_template_kwargs": {key: "{{ 1/0 }}"}}
        e = _error(json.dumps(body).encode(), ChatCompletionRequest)
        assert e.param == "chat_template_kwargs" and f"chat_template_kwargs.{key}" in e.message
    ok = {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}}
    parse(json.dumps(ok).encode(), ChatCompletionRequest)


def test_stop_strings_are_bounded():
    def refused(body: dict) -> APIError:
        with pytest.raises(APIError) as e:
            parse(json.dumps(body).encode(), CompletionRequest).sampling_params()
        assert e.value.status == 400 and e.value.param == "stop"
        return e.value

    many = {"prompt": "a", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}
    assert str(MAX_STOP_STRINGS) in refused(many).message
    long = {"prompt": "a", "stop": ["x" * (MAX_STOP_CHARS + 1)]}
    assert str(MAX_STOP_CHARS) in refused(long).message
    fine = {"prompt": "a", "stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}
    assert len(parse(json.dumps(fine).encode(), CompletionRequest).sampling_params().stop) == (
        MAX_STOP_STRINGS
    )


def test_chars_per_token_bound_follows_the_vocabulary(smollm2_path: str):
    """The bound is the vocabulary's longest entry (SmolLM2: a newline and 80
    spaces, 81 symbols), never below the floor: a prompt of such tokens is
    legitimate, and a fixed factor of 32 would refuse it."""
    tokenizer = Tokenizer.from_pretrained(smollm2_path)
    per_token = max_chars_per_token(tokenizer)
    assert per_token >= MIN_CHARS_PER_TOKEN
    assert len(tokenizer.encode("\n" + " " * 80, add_special_tokens=False)) == 1
    assert per_token >= 81


# --- a real server ---


@pytest.fixture(scope="module")
def server(tiny_text_model: str) -> Iterator[ServerProcess]:
    yield from start_server({
        "TINYENGINE_MODEL": tiny_text_model, "TINYENGINE_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "TINYENGINE_ENFORCE_EAGER": "1", "TINYENGINE_PRINT_STARTUP_REPORT": "false",
    })  # fmt: skip


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _send_all(url: str, bodies: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    """POST each body in turn (in a process of its own: see below)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        answers = [client.post(path, json=body) for path, body in bodies]
    return [(r.status_code, r.json()) for r in answers]


def test_health_answers_while_huge_prompts_are_rejected(server: ServerProcess):
    """A ~4 MB prompt (under the 4 MiB body limit) is refused by its length,
    naming max_model_len, while /health keeps answering within 100 ms. The
    huge requests come from another process: built and sent from a thread
    of this one, their JSON encoding would hold this process's GIL and the
    probe would time the client, not the server."""
    text = ("hello world, this is text. " * 150_000)[:4_000_000]
    bodies = [("/v1/completions", {"prompt": text, "max_tokens": 4}, "prompt"),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
               "messages")] * 3  # fmt: skip
    context = multiprocessing.get_context("spawn")
    slowest = 0.0
    with (
        ProcessPoolExecutor(1, mp_context=context) as pool,
        httpx.Client(base_url=server.url, timeout=30) as probe,
    ):
        sent = pool.submit(_send_all, server.url, [(path, body) for path, body, _ in bodies])
        while not sent.done():
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.005)
        answers = sent.result()
    assert slowest < 0.1, f"/health took {slowest * 1000:.0f} ms while a huge prompt was refused"
    for (status, answer), (_, _, param) in zip(answers, bodies, strict=True):
        assert status == 400, answer
        error = answer["error"]
        assert (
            error["param"] == param
            and f"max_model_len ({MAX_MODEL_LEN} tokens)" in error["message"]
        )


def test_long_token_prompts_under_the_bound_are_served(server: ServerProcess):
    """More characters than max_model_len * 32, but few tokens: served."""
    text = ("\n" + " " * 80) * 300 + "end"
    assert len(text) > MAX_MODEL_LEN * 32
    count = _post(server, "/tokenize", {"prompt": text}).json()["count"]
    assert count < MAX_MODEL_LEN - 1
    r = _post(server, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == count


def test_stop_token_ids_outside_the_vocabulary(server: ServerProcess):
    for path, body in [("/v1/completions", {"prompt": "a"}),
                       ("/v1/chat/completions", {"messages": [USER]})]:  # fmt: skip
        r = _post(server, path, {**body, "max_tokens": 1, "stop_token_ids": [3, 49152]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "stop_token_ids" and "49152" in error["message"]
        ok = _post(server, path, {**body, "max_tokens": 1, "stop_token_ids": [49151]})
        assert ok.status_code == 200, ok.text


def test_validation_over_http(server: ServerProcess):
    cases = [
        (b'{"prompt": "a", "temperature": NaN}', "/v1/completions", "temperature",
         "must be a finite number"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "/v1/chat/completions",
         "messages", "'wizard'"),
        (b'{"prompt": "\\ud800"}', "/v1/completions", "prompt", "not valid Unicode"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "/tokenize", "messages",
         "'wizard'"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
         b'{"url": "x"}}]}]}', "/tokenize", "messages", "only text parts"),
    ]  # fmt: skip
    for body, path, param, words in cases:
        r = httpx.post(server.url + path, content=body, timeout=30,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)


def test_top_p_below_float32_is_served(server: ServerProcess):
    """1e-46 is a valid top_p (> 0) that is 0 in float32: the request gets
    its most likely token, and a request running beside it is unharmed."""
    for path, body in (("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/chat/completions", {"messages": [USER]})):  # fmt: skip
        r = _post(server, path, {**body, "max_tokens": 2, "top_p": 1e-46})
        assert r.status_code == 200, r.text
        greedy = _post(server, path, {**body, "max_tokens": 2, "temperature": 0})
        choice, want = r.json()["choices"][0], greedy.json()["choices"][0]
        assert choice.get("text", choice.get("message")) == want.get("text", want.get("message"))


def test_head_health(server: ServerProcess):
    r = httpx.head(server.url + "/health")
    assert r.status_code == 200 and r.content == b""


def test_head_health_503_while_starting(tiny_text_model: str):
    """HEAD /health follows GET: 503 until READY, then 200."""
    server = ServerProcess({"TINYENGINE_MODEL": tiny_text_model,
                            "TINYENGINE_ENFORCE_EAGER": "1"})  # fmt: skip
    try:
        statuses: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and 200 not in statuses:
            try:
                statuses.append(httpx.head(server.url + "/health", timeout=5).status_code)
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.02)
        assert statuses and statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
    finally:
        server.stop()
