"""POST /tokenize and /detokenize (vLLM's extras): the served model's tokenizer
over HTTP, so a client can count or inspect tokens exactly as the engine
will see them without loading the tokenizer itself.

/tokenize takes `prompt` (encoded as /v1/completions encodes it;
`add_special_tokens`, default true) or `messages` (rendered by the chat
template as /v1/chat/completions renders them; `add_generation_prompt`,
default true) and answers {"tokens", "count", "max_model_len"}.
/detokenize takes `tokens` and answers {"prompt"}. Bad input is a 400 naming
the field, as everywhere else.

Also owns the two tokenizer steps generate.py shares: `require_tokenizer`
(a 400 when the model has none) and `render_chat` (messages -> token ids),
so chat completions and /tokenize render a conversation the same way.

Must never: submit anything to the engine; only the EngineClient's tokenizer
and model info are read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from tinyengine.serve.checks import check_model, read_body, ready_engine
from tinyengine.serve.engine_client import EngineClient
from tinyengine.serve.protocol import ChatMessage, Strict, bad_request, parse_body
from tinyengine.tokenizer import Tokenizer

router = APIRouter()


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    engine = ready_engine(request)
    req = parse_body(await read_body(request), TokenizeRequest)
    check_model(engine, req.model)
    tokenizer = require_tokenizer(engine, "this model has no tokenizer files", "model")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
        tokens = await render_chat(tokenizer, messages, req.add_generation_prompt)
    max_model_len = engine.model_info.max_model_len
    return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    engine = ready_engine(request)
    req = parse_body(await read_body(request), DetokenizeRequest)
    check_model(engine, req.model)
    vocab = engine.model_info.vocab_size
    assert vocab is not None  # known once READY, which ready_engine checked
    outside = [t for t in req.tokens if not 0 <= t < vocab]
    if outside:
        raise bad_request(
            f"token ids {outside[:5]} are outside the vocabulary [0, {vocab})", "tokens"
        )
    tokenizer = require_tokenizer(engine, "this model has no tokenizer files", "model")
    return {"prompt": tokenizer.decode(req.tokens)}


def require_tokenizer(engine: EngineClient, message: str, param: str) -> Tokenizer:
    """The model's tokenizer, or a 400 (`message`, naming `param`) when its
    folder has none: such a model serves token ids only."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise bad_request(message, param)
    return tokenizer


async def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """`messages` through the chat template, as token ids; a template that
    refuses them (a role it does not know, ...) or `template_kwargs` that
    clash with the other arguments are a 400 on "messages"."""
    try:
        # Off the event loop: a long conversation takes a while to render and encode.
        return await asyncio.to_thread(
            tokenizer.apply_chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **({"tools": tools} if tools else {}),
            **(template_kwargs or {}),
        )
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), "messages") from e
