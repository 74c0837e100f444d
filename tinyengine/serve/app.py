"""The FastAPI application: wiring, auth, errors, and the small endpoints.

Owns `create_app(settings)`: the AsyncLLMEngine's lifetime (started when the
server starts, so /health answers at once while the model loads), the API-key
check, the OpenAI-style error bodies for every failure (including FastAPI's
and Starlette's own 404/405), and GET (and HEAD) /health, /v1/models(/{id}) and /metrics.
The generation endpoints live in generate.py, /tokenize and /detokenize in
tokenize.py.

Must never: reach past the EngineClient interface (engine_client.py; only the
lifespan calls the bridge's start/stop), or let an error escape as an HTML or
`{"detail": ...}` body.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import secrets
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tinyengine.serve.async_engine import AsyncLLMEngine
from tinyengine.serve.checks import check_model, engine_client
from tinyengine.serve.generate import router as generate_router
from tinyengine.serve.protocol import APIError
from tinyengine.serve.settings import ServerSettings
from tinyengine.serve.tokenize import router as tokenize_router

logger = logging.getLogger("tinyengine.server")


def create_app(settings: ServerSettings, engine: AsyncLLMEngine | None = None) -> FastAPI:
    """The server for `settings`. Pass `engine` to serve a prebuilt (not yet
    started) AsyncLLMEngine, e.g. in tests; its model info is what the server
    reports."""
    engine = engine or AsyncLLMEngine(
        settings.model, settings.engine_kwargs, served_model_name=settings.model_name
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        _stop_serving_on_exit_signals(engine)
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tinyengine", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnected)
    app.add_exception_handler(Exception, _unexpected_error)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that want no body
    async def health() -> JSONResponse:
        h = engine.health()
        return JSONResponse(h.as_dict(), status_code=200 if h.ready else 503)

    # vLLM's liveness aliases (load balancers probe them): /ping is /health.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _package_version()}

    protected = APIRouter(dependencies=[Depends(require_api_key)])

    def model_card() -> dict[str, Any]:
        info = engine.model_info
        return {
            "id": info.name,
            "object": "model",
            "created": 0,
            "owned_by": "tinyengine",
            "root": info.root,
            "max_model_len": info.max_model_len,  # None while the engine starts
        }

    @protected.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @protected.get("/v1/models/{model:path}")  # OpenAI's models.retrieve; ids may hold "/"
    async def retrieve_model(model: str) -> dict[str, Any]:
        check_model(engine, model)
        return model_card()

    @protected.get("/metrics")
    async def metrics() -> PlainTextResponse:
        h = engine.health()
        name = engine.model_info.name
        text = engine.metrics.render(engine.stats(), h.stage_seconds, h.ready, name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    app.include_router(protected)
    app.include_router(generate_router, dependencies=[Depends(require_api_key)])
    app.include_router(tokenize_router, dependencies=[Depends(require_api_key)])
    return app


def _stop_serving_on_exit_signals(engine: AsyncLLMEngine) -> None:
    """On SIGINT/SIGTERM uvicorn stops accepting and then waits for every open
    connection to finish: one long generation would hold a SIGTERM for minutes.
    Chained onto the handlers uvicorn installed (this runs at startup, after
    it did), the first signal also stops the engine, failing the in-flight
    requests with "the server is shutting down", so the connections close
    and the process exits in seconds (vLLM's server does not drain either).
    Only from the main thread, where signal handlers can be set."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue  # SIG_DFL / SIG_IGN: not a server's graceful handler; leave it

        def on_signal(signum: int, frame: Any, previous: Any = previous) -> None:
            engine.stop_serving()
            previous(signum, frame)

        signal.signal(sig, on_signal)


def _package_version() -> str:
    try:
        return importlib.metadata.version("tinyengine")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


async def require_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken must not tell how much of a guess was right.
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        token.strip().encode(), key.encode()
    ):
        raise APIError(
            401,
            "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
            "authentication_error",
            code="invalid_api_key",
        )


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    if exc.status < 500:
        engine_client(request).metrics.count_request("rejected")
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    error = APIError(exc.status_code, str(exc.detail), "invalid_request_error")
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    err = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    error = APIError(
        400, f"{'.'.join(loc)}: {err.get('msg', 'invalid request')}", param=loc[0] if loc else None
    )
    return JSONResponse(error.body(), status_code=400)


async def _client_disconnected(request: Request, exc: Exception) -> JSONResponse:
    # The client went away while still sending its body: nothing was queued,
    # and nobody will read this (499, nginx's "client closed request").
    logger.info("client disconnected while sending %s %s", request.method, request.url.path)
    return JSONResponse(APIError(499, "client closed the request").body(), status_code=499)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    error = APIError(
        500, f"internal server error: {type(exc).__name__}: {exc}", "internal_server_error"
    )
    return JSONResponse(error.body(), status_code=500)
