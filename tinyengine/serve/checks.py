"""What every endpoint that runs the model checks first: the engine is READY
(else 503), the body is within the size limit (else 413, counted while
reading, so a chunked body without Content-Length is limited too), and the
request names the served model (else 404 model_not_found).

Must never: reach past the EngineClient interface (engine_client.py).
"""

from __future__ import annotations

from fastapi import Request

from tinyengine.serve.engine_client import EngineClient
from tinyengine.serve.protocol import APIError


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
