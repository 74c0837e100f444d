"""POST /tokenize and /detokenize (vLLM's extras): the served model's tokenizer
over HTTP, so a client can count or inspect tokens exactly as the engine
will see them without loading the tokenizer itself.

/tokenize takes `prompt` (encoded as /v1/completions encodes it;
`add_special_tokens`, default true) or `messages` (rendered by the chat
template as /v1/chat/completions renders them; `add_generation_prompt`,
default true) and answers {"tokens", "count", "max_model_len"}.
/detokenize takes `tokens` and answers {"prompt"}. Bad input is a 400 naming
the field, as everywhere else.

Must never: touch the engine's scheduler; only its tokenizer is read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from tinyengine.serve.async_engine import AsyncLLMEngine
from tinyengine.serve.checks import check_model, read_body, ready_engine
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
    check_model(request, req.model)
    tokenizer = _tokenizer(engine)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
        try:
            tokens = await asyncio.to_thread(
                tokenizer.apply_chat_template, messages,
                add_generation_prompt=req.add_generation_prompt, tokenize=True,
            )  # fmt: skip
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), "messages") from e
    return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    engine = ready_engine(request)
    req = parse_body(await read_body(request), DetokenizeRequest)
    check_model(request, req.model)
    vocab = engine.engine.runner.vocab_size
    outside = [t for t in req.tokens if not 0 <= t < vocab]
    if outside:
        raise bad_request(
            f"token ids {outside[:5]} are outside the vocabulary [0, {vocab})", "tokens"
        )
    return {"prompt": _tokenizer(engine).decode(req.tokens)}


def _tokenizer(engine: AsyncLLMEngine) -> Tokenizer:
    tokenizer = engine.engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer files", "model")
    return tokenizer
