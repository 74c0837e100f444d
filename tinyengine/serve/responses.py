"""The OpenAI wire format, outbound: response and stream-chunk bodies, usage,
logprobs, and server-sent-event framing.

Owns the exact shapes OpenAI clients parse (id, object, created, model,
choices[index, text | message | delta, logprobs, finish_reason], usage).
Plain dicts, built by small functions: no engine access, no I/O.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from tinyengine.outputs import Logprob, RequestOutput

# JSON has no -inf; a token the model rules out entirely gets this, as in vLLM.
MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def usage(outputs: Sequence[RequestOutput], n: int = 1) -> dict[str, int]:
    """Token counts of a response whose choices are n per prompt (in prompt
    order, each whole): each prompt counts once, as OpenAI and vLLM count it."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])
    return usage_of(prompt, sum(len(o.outputs[0].token_ids) for o in outputs))


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# --- logprobs ---


def _token_text(token_id: int, entry: dict[int, Logprob]) -> str:
    lp = entry.get(token_id)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{token_id}"  # vLLM's spelling when there is no tokenizer


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The top n of the distribution. The engine also reports the sampled
    token, which may rank below n; it is not part of the chat format's top
    list (OpenAI's chat API returns exactly n)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= n), key=lambda x: x[1].rank)


def _value(lp: Logprob | None) -> float | None:
    return None if lp is None else max(lp.logprob, MIN_LOGPROB)


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob]],
    num_top: int,
    text_offset: int,
) -> dict[str, Any]:
    """The legacy completions format: parallel lists per token. `text_offset`
    is where the first of these tokens starts in the choice's text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = _token_text(token_id, entry)
        tokens.append(text)
        token_logprobs.append(_value(entry.get(token_id)))
        # OpenAI's legacy format (and vLLM's) always lists the chosen token
        # too: up to num_top + 1 entries, in rank order.
        ranked = [(t, lp) for t, lp in entry.items() if lp.rank <= num_top or t == token_id]
        ranked.sort(key=lambda x: x[1].rank)
        top_logprobs.append({_token_text(t, entry): _value(lp) for t, lp in ranked})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def prompt_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    num_top: int,
    first_text: str,
) -> dict[str, Any]:
    """The echoed prompt's part of the completions format: the first token
    has no logprob (null, as in vLLM and OpenAI), so its text comes from the
    caller; every later one is the model's, given the tokens before it."""
    head = {"tokens": [first_text], "token_logprobs": [None], "top_logprobs": [None],
            "text_offset": [0]}  # fmt: skip
    rest = completion_logprobs(token_ids[1:], list(entries[1:]), num_top, len(first_text))
    return {key: head[key] + rest[key] for key in head}


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], num_top: int
) -> dict[str, Any]:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, entry: dict[int, Logprob]) -> dict[str, Any]:
        text = _token_text(token_id, entry)
        return {
            "token": text,
            "logprob": _value(entry.get(token_id)),
            "bytes": list(text.encode("utf-8")),
        }

    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        top = [item(t, entry) for t, _ in _top(entry, num_top)]
        content.append({**item(token_id, entry), "top_logprobs": top})
    return {"content": content}


# --- whole responses and stream chunks ---


def completion_response(
    request_id: str,
    model: str,
    finals: Sequence[RequestOutput],
    num_logprobs: int | None,
    n: int = 1,
    echo: Sequence[str] | None = None,
    echo_first_texts: Sequence[str] | None = None,
) -> dict[str, Any]:
    """`finals`: n choices per prompt, in order; `echo`: per prompt, the text
    to put before each of its choices' text; with logprobs, `echo_first_texts`
    per prompt the text of its first token (whose logprob is null)."""
    choices = []
    for index, out in enumerate(finals):
        c = out.outputs[0]
        logprobs = None
        if num_logprobs is not None and c.logprobs is not None:
            first = None if echo_first_texts is None else echo_first_texts[index // n]
            logprobs = with_echo(out, num_logprobs, first)
        choices.append(
            {
                "index": index,
                "text": c.text if echo is None else echo[index // n] + c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": request_id,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage(finals, n),
    }


def with_echo(out: RequestOutput, num_top: int, first_text: str | None) -> dict[str, Any]:
    """A completion choice's logprobs: the echoed prompt's (when first_text is
    given and the output has prompt logprobs), then the generated tokens'."""
    c = out.outputs[0]
    if first_text is None or out.prompt_logprobs is None:
        return completion_logprobs(c.token_ids, c.logprobs or [], num_top, 0)
    head = prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, num_top, first_text)
    end = head["text_offset"][-1] + len(head["tokens"][-1])
    tail = completion_logprobs(c.token_ids, c.logprobs or [], num_top, end)
    return {key: head[key] + tail[key] for key in head}


def chat_response(
    request_id: str,
    model: str,
    finals: Sequence[RequestOutput],
    num_logprobs: int | None,
    n: int = 1,
) -> dict[str, Any]:
    choices = []
    for index, out in enumerate(finals):
        c = out.outputs[0]
        logprobs = None
        if num_logprobs is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, num_logprobs)
        choices.append(
            {
                "index": index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage(finals, n),
    }


def chunk(
    request_id: str,
    model: str,
    created: int,
    chat: bool,
    choices: list[dict[str, Any]],
    usage_: dict[str, int] | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk. with_usage (stream_options.include_usage): every
    chunk has a "usage" field, null until the last, usage-only one (OpenAI's
    and vLLM's format); otherwise only a chunk given usage_ has one."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None or with_usage:
        body["usage"] = usage_
    return body


def chunk_choice(
    chat: bool,
    index: int,
    text: str | None,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    role: str | None = None,
) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {}
        if role is not None:
            delta["role"] = role
        if text is not None:
            delta["content"] = text
        body: dict[str, Any] = {"index": index, "delta": delta}
    else:
        body = {"index": index, "text": text or ""}
    body["logprobs"] = logprobs
    body["finish_reason"] = finish_reason
    return body
