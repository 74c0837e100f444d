"""POST /tokenize and /detokenize (vLLM's extras): the served model's tokenizer
over HTTP, so a client can count or inspect tokens exactly as the engine
will see them without loading the tokenizer itself.

/tokenize takes `prompt` (encoded as /v1/completions encodes it;
`add_special_tokens`, default true) or `messages` (rendered by the chat
template as /v1/chat/completions renders them; `add_generation_prompt`,
default true) and answers {"tokens", "count", "max_model_len"}.
/detokenize takes `tokens` and answers {"prompt"}. Bad input is a 400 naming
the field, as everywhere else.

Also owns the tokenizer steps generate.py shares: `require_tokenizer` (a
400 when the model has none), `template_messages` and `render_chat`
(messages -> token ids, so chat completions and /tokenize render a
conversation the same way) and
`encode_prompts` (completions' text prompts -> token ids). Tokenizing,
templating and decoding run in worker threads (the Rust tokenizer is safe to
call from any thread), never on the event loop; before any of it, text that
cannot fit in max_model_len tokens is refused by its length alone
(`check_prompt_chars`), so an absurd prompt costs nothing to reject.

Must never: submit anything to the engine; only the EngineClient's tokenizer
and model info are read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from tinyengine.serve.checks import check_model, off_loop, read_body, ready_engine
from tinyengine.serve.engine_client import EngineClient, PromptType
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
    body = await read_body(request)
    req = await off_loop(len(body), lambda: parse_body(body, TokenizeRequest))
    check_model(engine, req.model)
    tokenizer = require_tokenizer(engine, "this model has no tokenizer files", "model")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        # No length bound here: counting a too-long prompt is what /tokenize is for.
        prompt, special = req.prompt, req.add_special_tokens
        tokens = await off_loop(len(prompt), lambda: tokenizer.encode(prompt, special))
    else:
        messages = template_messages(req.messages or [])
        tokens = await render_chat(tokenizer, messages, req.add_generation_prompt)
    max_model_len = engine.model_info.max_model_len
    return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    engine = ready_engine(request)
    body = await read_body(request)
    req = await off_loop(len(body), lambda: parse_body(body, DetokenizeRequest))
    check_model(engine, req.model)
    vocab = engine.model_info.vocab_size
    assert vocab is not None  # known once READY, which ready_engine checked
    outside = [t for t in req.tokens if not 0 <= t < vocab]
    if outside:
        raise bad_request(
            f"token ids {outside[:5]} are outside the vocabulary [0, {vocab})", "tokens"
        )
    tokenizer = require_tokenizer(engine, "this model has no tokenizer files", "model")
    return {"prompt": await off_loop(len(req.tokens), lambda: tokenizer.decode(req.tokens))}


def require_tokenizer(engine: EngineClient, message: str, param: str) -> Tokenizer:
    """The model's tokenizer, or a 400 (`message`, naming `param`) when its
    folder has none: such a model serves token ids only."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise bad_request(message, param)
    return tokenizer


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template; a list of content parts becomes one
    string (text parts only: tinyengine serves text models)."""
    out = []
    for i, message in enumerate(messages):
        m = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for part in message.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"messages[{i}].content: only text parts are supported, "
                        f"got {part.get('type')!r}",
                        "messages",
                    )
                texts.append(part["text"])
            m["content"] = "".join(texts)
        out.append(m)
    return out


async def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """`messages` through the chat template, as token ids. The template is the
    model's own, but what it computes comes from the request (messages,
    tools, template variables): whatever fails in it (a role it does not
    know and raises on, a variable of the wrong type, ...) is a 400 on
    "messages"."""
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
    except Exception as e:  # noqa: BLE001 - any failure here is the request's input
        raise bad_request(f"the chat template failed: {type(e).__name__}: {e}", "messages") from e


# The floor of the characters-per-token bound. Real vocabularies go higher
# (DeepSeek-V3's longest tokens are 128 dots or spaces, SmolLM2's 81 symbols),
# and the bound follows them; the floor keeps a small vocabulary's bound loose.
MIN_CHARS_PER_TOKEN = 32


def max_chars_per_token(tokenizer: Tokenizer) -> int:
    """The bound's factor: the vocabulary's longest entry
    (Tokenizer.max_token_chars), at least MIN_CHARS_PER_TOKEN. A text with more
    than max_model_len times this many characters cannot encode to
    max_model_len tokens (unless a normalizer deletes text, which no model
    tinyengine serves has)."""
    return max(MIN_CHARS_PER_TOKEN, tokenizer.max_token_chars)


def check_prompt_chars(
    engine: EngineClient, tokenizer: Tokenizer, num_chars: int, param: str
) -> None:
    """A 400 (naming `param`) for text too long to fit max_model_len tokens
    whatever it says: decided by its length, before any tokenizing."""
    max_model_len = engine.model_info.max_model_len
    if max_model_len is None:
        return
    per_token = max_chars_per_token(tokenizer)  # computed on the engine thread at startup
    if num_chars > max_model_len * per_token:
        raise bad_request(
            f"the prompt has {num_chars} characters, more than max_model_len "
            f"({max_model_len} tokens) can hold: no token of this model stands for more "
            f"than {per_token} characters",
            param,
        )


async def encode_prompts(
    engine: EngineClient, prompts: list[PromptType], param: str = "prompt"
) -> list[PromptType]:
    """Text prompts as {"prompt": text, "prompt_token_ids": ids} (what the
    engine's tokenizer makes of them, made here off the event loop and the
    engine thread); token-id prompts as they are. Text too long for
    max_model_len is a 400 first. Without a tokenizer the prompts go as they
    are, and the engine refuses text."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not any(isinstance(p, str) for p in prompts):
        return prompts
    for prompt in prompts:
        if isinstance(prompt, str):
            check_prompt_chars(engine, tokenizer, len(prompt), param)
    num_chars = sum(len(p) for p in prompts if isinstance(p, str))

    def encode() -> list[PromptType]:
        return [
            {"prompt": p, "prompt_token_ids": tokenizer.encode(p)} if isinstance(p, str) else p
            for p in prompts
        ]

    return await off_loop(num_chars, encode)
