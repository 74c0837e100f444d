"""POST /v1/completions and /v1/chat/completions.

Owns one HTTP request's path: read the body (with the size limit), validate
it, turn it into engine prompts and SamplingParams, submit it to the async
engine, then either gather the final outputs into one response or stream
deltas as server-sent events. While it waits, it watches the connection: a
client that goes away has its request aborted, which frees its KV blocks.

The engine sends DELTA outputs (what is new since a choice's last output),
so a stream sends each as it comes; the engine itself holds back text that a
later token could still turn into a stop string (request_state.py).

Must never: reach past the EngineClient interface (engine_client.py), or
leave a request in the engine once its response is over, however it ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tinyengine.outputs import RequestOutput
from tinyengine.sampling_params import SamplingParams
from tinyengine.serve import responses as R
from tinyengine.serve.checks import (
    check_fan_out,
    check_model,
    off_loop,
    read_body,
    ready_engine,
)
from tinyengine.serve.engine_client import (
    EngineClient,
    EngineNotReadyError,
    PromptType,
    RequestAbortedError,
    RequestFailedError,
    RequestRejectedError,
    RequestStream,
)
from tinyengine.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_request,
)
from tinyengine.serve.tokenize import (
    check_prompt_chars,
    encode_prompts,
    render_chat,
    require_tokenizer,
    template_messages,
)

router = APIRouter()


@dataclass
class _Job:
    """What the response builders need to know about one HTTP request."""

    request_id: str
    model: str
    chat: bool
    params: SamplingParams
    num_logprobs: int | None  # None: no logprobs asked for
    include_usage: bool
    echo: list[str] | None = None  # completions' echo: the prompt text, per prompt
    # The request's own names for the engine's fields, for errors' "param"
    # (chat: the prompt is "messages"; the limit may be max_completion_tokens).
    param_names: dict[str, str] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.params.n


@router.post("/v1/completions", response_model=None)
async def create_completion(request: Request) -> JSONResponse | StreamingResponse:
    engine = ready_engine(request)
    body = await read_body(request)
    req = await off_loop(len(body), lambda: parse_request(body, CompletionRequest))
    model = check_model(engine, req.model)
    params = req.sampling_params()
    _check_stop_token_ids(engine, params)
    prompts = await off_loop(len(body), req.prompts)
    check_fan_out(request, len(prompts), params.n)
    job = _Job(R.new_id("cmpl"), model, False, params, req.logprobs, req.include_usage_in_stream)
    if req.echo:
        job.echo = await off_loop(len(body), lambda: [_prompt_text(engine, p) for p in prompts])
    prompts = await encode_prompts(engine, prompts)
    return await _generate(request, engine, prompts, job, bool(req.stream))


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(request: Request) -> JSONResponse | StreamingResponse:
    engine = ready_engine(request)
    body = await read_body(request)
    req = await off_loop(len(body), lambda: parse_request(body, ChatCompletionRequest))
    model = check_model(engine, req.model)
    params = req.sampling_params()
    _check_stop_token_ids(engine, params)
    check_fan_out(request, 1, params.n)
    tokenizer = require_tokenizer(
        engine,
        "this model has no tokenizer, so chat is unavailable; use /v1/completions with token ids",
        "messages",
    )
    # The template only adds text: messages too long for max_model_len stay so.
    num_chars = sum(m.text_length() for m in req.messages)
    check_prompt_chars(engine, tokenizer, num_chars, "messages")
    token_ids = await render_chat(
        tokenizer,
        template_messages(req.messages),
        req.add_generation_prompt,
        req.tools,
        req.chat_template_kwargs,
    )
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    job = _Job(R.new_id("chatcmpl"), model, True, params, num_logprobs, req.include_usage_in_stream)
    job.param_names["prompt"] = "messages"
    if req.max_completion_tokens is not None:
        job.param_names["max_tokens"] = "max_completion_tokens"
    prompts: list[PromptType] = [{"prompt_token_ids": token_ids}]
    return await _generate(request, engine, prompts, job, bool(req.stream))


def _check_stop_token_ids(engine: EngineClient, params: SamplingParams) -> None:
    vocab = engine.model_info.vocab_size
    assert vocab is not None  # known once READY, which ready_engine checked
    outside = [t for t in params.stop_token_ids or () if not 0 <= t < vocab]
    if outside:
        raise bad_request(
            f"stop_token_ids {outside[:5]} are outside the vocabulary [0, {vocab})",
            "stop_token_ids",
        )


def _prompt_text(engine: EngineClient, prompt: PromptType) -> str:
    """A prompt as text, for echo: the string itself, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    tokenizer = require_tokenizer(
        engine, "echo of token-id prompts needs a tokenizer; this model has none", "echo"
    )
    try:
        return tokenizer.decode(prompt["prompt_token_ids"])
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise bad_request(f"prompt: cannot decode the token ids: {e}", "prompt") from e


def _first_token_text(engine: EngineClient, output: RequestOutput) -> str:
    """The text of a prompt's first token (echo with logprobs lists it, with a
    null logprob)."""
    tokenizer = engine.tokenizer
    first = output.prompt_token_ids[0]
    return tokenizer.decode([first]) if tokenizer is not None else f"token_id:{first}"


# --- running it ---


async def _generate(
    request: Request,
    engine: EngineClient,
    prompts: list[PromptType],
    job: _Job,
    stream: bool,
) -> JSONResponse | StreamingResponse:
    # n completions per prompt are n engine requests (choice k = prompt k // n);
    # the prefix cache shares the prompt's KV blocks among them.
    children = job.params.fan_out()
    choices = [p for p in prompts for _ in children]
    try:
        rs = engine.submit(choices, children * len(prompts), job.request_id)
    except EngineNotReadyError as e:
        raise APIError(503, str(e), "service_unavailable") from e
    watcher = asyncio.create_task(_abort_on_disconnect(request, rs))
    try:
        await rs.accepted()
    except RequestRejectedError as e:
        watcher.cancel()
        raise bad_request(str(e), job.param_names.get(e.param or "", e.param)) from e
    except RequestAbortedError:
        return _client_gone()
    except BaseException:
        watcher.cancel()
        rs.abort()
        raise
    if stream:
        return StreamingResponse(
            _stream(rs, watcher, job, len(choices), engine),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        # The stream's outputs are deltas: each choice's first one, extended
        # in place by the rest, ends as the whole of it.
        finals: dict[int, RequestOutput] = {}
        async for index, output in rs.outputs():
            if index in finals:
                finals[index].add(output)
            else:
                finals[index] = output
    except RequestFailedError as e:
        raise APIError(500, str(e), "internal_server_error") from e
    finally:
        watcher.cancel()
        rs.abort()  # a no-op when everything finished
    if len(finals) < len(choices) or not all(o.finished for o in finals.values()):  # aborted
        return _client_gone()
    ordered = [finals[i] for i in range(len(choices))]
    if job.chat:
        body = R.chat_response(job.request_id, job.model, ordered, job.num_logprobs, job.n)
    else:
        first_texts = None
        if job.echo is not None and job.num_logprobs is not None:
            first_texts = [_first_token_text(engine, o) for o in ordered[:: job.n]]
        body = R.completion_response(
            job.request_id, job.model, ordered, job.num_logprobs, job.n, job.echo, first_texts
        )
    return JSONResponse(body)


def _client_gone() -> JSONResponse:
    # 499 (nginx's "client closed request"): nobody reads it, but logs show why.
    return JSONResponse(APIError(499, "client closed the request").body(), status_code=499)


async def _abort_on_disconnect(request: Request, rs: RequestStream) -> None:
    """Abort the request as soon as the client disconnects. The body is read by
    now, so the next ASGI message can only be the disconnect (uvicorn also
    sends one once the response is complete; by then the stream is done and
    abort() does nothing)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            rs.abort()
            return


async def _stream(
    rs: RequestStream,
    watcher: asyncio.Task[None],
    job: _Job,
    num_choices: int,
    engine: EngineClient,
) -> AsyncIterator[str]:
    created = R.now()
    chat = job.chat
    num_tokens = [0] * num_choices  # completion tokens so far, per choice (usage)
    token_text_end = [0] * num_choices  # where the next token's text starts (logprobs)
    finished: dict[int, RequestOutput] = {}

    def emit(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        return R.sse(
            R.chunk(job.request_id, job.model, created, chat, choices, usage, job.include_usage)
        )

    try:
        if chat:  # OpenAI opens each choice with the assistant role
            yield emit([R.chunk_choice(True, i, "", role="assistant") for i in range(num_choices)])
        echoed = [job.echo is None] * num_choices
        async for index, output in rs.outputs():
            c = output.outputs[0]
            if not echoed[index]:  # the prompt first, as vLLM streams echo
                echoed[index] = True
                assert job.echo is not None
                head = None
                if job.num_logprobs is not None and output.prompt_logprobs is not None:
                    head = R.prompt_logprobs(
                        output.prompt_token_ids, output.prompt_logprobs, job.num_logprobs,
                        _first_token_text(engine, output),
                    )  # fmt: skip
                    token_text_end[index] = head["text_offset"][-1] + len(head["tokens"][-1])
                yield emit([R.chunk_choice(False, index, job.echo[index // job.n], head)])
            # A delta: the engine held back any text a stop string may still cut.
            delta = c.text
            num_tokens[index] += len(c.token_ids)
            logprobs = None
            if job.num_logprobs is not None and c.logprobs is not None:
                logprobs = (
                    R.chat_logprobs(c.token_ids, c.logprobs, job.num_logprobs)
                    if chat
                    else R.completion_logprobs(
                        c.token_ids, c.logprobs, job.num_logprobs, token_text_end[index]
                    )
                )
                if not chat and logprobs["tokens"]:
                    token_text_end[index] = logprobs["text_offset"][-1] + len(
                        logprobs["tokens"][-1]
                    )
            if not (delta or c.finished or logprobs):
                continue
            # The closing chat chunk carries an empty delta ({}), as OpenAI's does.
            content = None if chat and c.finished and not delta else delta
            yield emit([R.chunk_choice(chat, index, content, logprobs, c.finish_reason)])
            if c.finished:
                finished[index] = output
        if job.include_usage and len(finished) == num_choices:
            prompts = [len(finished[i].prompt_token_ids) for i in range(0, num_choices, job.n)]
            yield emit([], R.usage_of(sum(prompts), sum(num_tokens)))
        yield R.SSE_DONE
    except RequestFailedError as e:
        # Headers went out long ago: the error travels as an event, as in vLLM.
        yield R.sse(APIError(500, str(e), "internal_server_error").body())
        yield R.SSE_DONE
    finally:
        watcher.cancel()
        rs.abort()  # client gone (or anything else): free the request's blocks
