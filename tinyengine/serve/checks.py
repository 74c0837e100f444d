"""What every endpoint that runs the model checks first: the engine is READY
(else 503), the body is within the size limit (else 413, counted while
reading, so a chunked body without Content-Length is limited too), and the
request names the served model (else 404 model_not_found), and it fans out
to no more sequences than the server allows (else 400 naming the cap). Also `off_loop`:
how a handler runs work that grows with the body (parsing, tokenizing) so a
large request does not stall every other client's.

Must never: reach past the EngineClient interface (engine_client.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from tinyengine.serve.engine_client import EngineClient
from tinyengine.serve.protocol import APIError, bad_request


def engine_client(request: Request) -> EngineClient:
    """The app's engine, as the handlers may see it."""
    engine: EngineClient = request.app.state.engine
    return engine


def ready_engine(request: Request) -> EngineClient:
    engine = engine_client(request)
    if not engine.ready:
        raise APIError(503, engine.not_ready_message(), "service_unavailable")
    return engine


def check_model(engine: EngineClient, model: str | None) -> str:
    served = engine.model_info.name
    if model is not None and model != served:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return served


async def read_body(request: Request) -> bytes:
    limit: int = request.app.state.settings.max_request_bytes
    too_large = APIError(
        413,
        f"the request body is larger than {limit} bytes (the server's "
        "TINYENGINE_MAX_REQUEST_BYTES)",
        "invalid_request_error",
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for part in request.stream():  # counts chunked bodies, which have no length
        body += part
        if len(body) > limit:
            raise too_large
    return bytes(body)


def check_fan_out(request: Request, num_prompts: int, n: int) -> None:
    """One request may not take the engine: `n` and prompts x n are capped
    (ServerSettings.max_n, .max_request_sequences). Checked before anything
    is built per sequence."""
    settings = request.app.state.settings
    if n > settings.max_n:
        raise bad_request(
            f"n={n} is more than this server allows per prompt: max_n={settings.max_n} "
            "(the server's TINYENGINE_MAX_N)",
            "n",
        )
    if num_prompts * n > settings.max_request_sequences:
        raise bad_request(
            f"this request fans out to {num_prompts * n} sequences ({num_prompts} prompts x "
            f"n={n}); this server allows at most max_request_sequences="
            f"{settings.max_request_sequences} per request (TINYENGINE_MAX_REQUEST_SEQUENCES); "
            "split it into several requests",
            "n" if n > 1 else "prompt",
        )


T = TypeVar("T")

# Bodies above this are parsed in a worker thread: a 4 MiB body takes tens of
# milliseconds of json and pydantic work (more for a long token-id list), and
# on the event loop that would be every other client's wait, /health's included.
OFF_LOOP_BYTES = 64 * 1024


async def off_loop(size: int, fn: Callable[[], T]) -> T:
    """`fn()`, in a worker thread when `size` (bytes or characters of input)
    is large enough for it to stall the event loop."""
    if size <= OFF_LOOP_BYTES:
        return fn()
    return await asyncio.to_thread(fn)
