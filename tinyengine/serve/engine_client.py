"""EngineClient: everything an HTTP handler may ask of the engine, and nothing more.

The handlers (app.py, generate.py, tokenize.py, checks.py) see the engine only
through this interface; `AsyncLLMEngine` (async_engine.py) implements it and is
the one object that holds an LLMEngine. It has four parts:

    model info   model_info (served name, root, max_model_len, vocab_size), tokenizer
    requests     submit(prompts, params, request_id) -> RequestStream; abort(request_ids)
    state        ready, health(), not_ready_message(), stats()
    metrics      the ServerMetrics the bridge updates as requests finish

Owns that interface, what travels back to a handler (a `RequestStream` of
outputs, `Health`, `ModelInfo`) and the errors a handler turns into HTTP
statuses. Must never: import the engine, or grow a member that hands out an
engine object (a handler holding one could call it from the event loop, but
LLMEngine is not thread-safe and belongs to the bridge's thread).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tinyengine.outputs import RequestOutput
from tinyengine.sampling_params import SamplingParams
from tinyengine.serve.metrics import ServerMetrics
from tinyengine.tokenizer import Tokenizer

PromptType = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]}


class EngineNotReadyError(RuntimeError):
    """The engine is still starting (or failed to start); the server answers 503."""


class RequestRejectedError(ValueError):
    """add_request refused the request (bad input); the server answers 400,
    naming `param` when the engine said which field was at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    """The engine failed while running the request; the server answers 500."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (its client went away) before the engine took it."""


@dataclass(frozen=True)
class ModelInfo:
    """The served model, as /v1/models, /tokenize and /detokenize describe it."""

    name: str  # what clients send as `model` and /v1/models lists
    root: str | None  # the model folder or preset name the server was started with
    # The engine's limits: known once it is READY, None before.
    max_model_len: int | None = None
    vocab_size: int | None = None


@dataclass
class Health:
    ready: bool
    state: str  # "preparing", a startup Stage value ("loaded", ...), "ready" or "failed"
    stage: str | None  # the startup stage running now ("profile", ...), if any
    error: str | None
    stage_seconds: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        status = "ready" if self.ready else "failed" if self.state == "failed" else "starting"
        body: dict[str, Any] = {"status": status}
        body.update(state=self.state, stage=self.stage, stage_seconds=self.stage_seconds)
        if self.error:
            body["error"] = self.error
        return body


# --- what the bridge puts on a stream (besides (prompt index, output) pairs) ---

ACCEPTED = object()  # every prompt of the stream is in the engine
_ABORTED = object()  # the handler gave up (client gone); readers stop


@dataclass
class Failure:
    error: Exception


class RequestStream:
    """The outputs of one HTTP request: one engine request per prompt, each
    output tagged with its prompt's index. Used only on the event loop: the
    bridge `put`s events, the handler reads them.

    Outputs are DELTA outputs (each carries what is new since its prompt's
    last one: AsyncLLMEngine.submit asks for RequestOutputKind.DELTA), and
    the unread ones of a prompt are joined into one (RequestOutput.add): a
    reader that fell behind sends the tokens it missed in one chunk and
    catches up, and one that stopped reading (a client that does not read
    its socket) holds one output per prompt, not one per step. A dict, a
    deque of the other events and one future stand in for an asyncio.Queue:
    `put` runs once per prompt per engine step, on the loop the HTTP
    handlers share with the engine thread's GIL."""

    def __init__(self, request_ids: list[str], abort: Callable[[list[str]], None]) -> None:
        self.request_ids = request_ids
        self._abort = abort
        self._unread: dict[int, RequestOutput] = {}  # unread, by prompt index
        self._events: deque[Any] = deque()  # ACCEPTED, a Failure, _ABORTED
        self._wakeup: asyncio.Future[None] | None = None  # set while the reader waits
        self._unfinished = set(range(len(request_ids)))
        self.done = False

    def put(self, event: Any) -> None:
        """The bridge's side: ACCEPTED, a Failure, or (prompt index, output)."""
        if isinstance(event, tuple):
            index, output = event
            unread = self._unread.get(index)
            if unread is None:
                self._unread[index] = output
            else:
                unread.add(output)
        else:
            if isinstance(event, Failure):
                self.done = True  # the engine already removed every sub-request
            self._events.append(event)
        waiter, self._wakeup = self._wakeup, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        while not (self._unread or self._events):
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup

    async def accepted(self) -> None:
        """Wait until the engine took the request; raise what it said otherwise."""
        while not self._events:
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup
        event = self._events.popleft()
        if isinstance(event, Failure):
            raise event.error
        if event is _ABORTED:
            raise RequestAbortedError("request aborted before it was accepted")
        assert event is ACCEPTED

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, DELTA RequestOutput) until every prompt finished, a
        prompt's unread outputs joined into one. Raises RequestFailedError if
        the engine failed the request (after yielding what came before the
        failure); ends early (no error) if the request was aborted."""
        while self._unfinished:
            await self._wait()
            unread, self._unread = self._unread, {}
            for index, output in unread.items():
                if output.finished:
                    self._unfinished.discard(index)
                yield index, output
            if self._events:
                event = self._events.popleft()
                if isinstance(event, Failure):
                    raise event.error
                if event is _ABORTED:
                    return
        self.done = True

    def abort(self) -> None:
        """Stop every unfinished sub-request and free its KV blocks. Idempotent."""
        if self.done:
            return
        self.done = True
        self._abort(list(self.request_ids))
        self.put(_ABORTED)  # wakes a reader waiting for events


class EngineClient(Protocol):
    """What handlers may use. Every member is called on the event loop and
    returns at once: none of them waits for the engine thread."""

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The served model's tokenizer once READY; None before, or when the
        model folder has no tokenizer files."""
        ...

    @property
    def metrics(self) -> ServerMetrics: ...

    @property
    def ready(self) -> bool:
        """True once the startup state machine is READY (and from then on)."""
        ...

    def health(self) -> Health: ...

    def not_ready_message(self) -> str:
        """Why a request cannot run now: still starting (which stage), or failed."""
        ...

    def stats(self) -> dict[str, Any] | None:
        """The engine's stats as of its last step; None before it exists."""
        ...

    def submit(
        self,
        prompts: Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams],
        request_id: str,
    ) -> RequestStream:
        """Queue one engine request per prompt (`params`: one for all, or one
        per prompt); await `stream.accepted()`, then read `stream.outputs()`.
        Raises EngineNotReadyError before READY or once shutting down."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Remove these engine requests (freeing their KV blocks) before the
        next step; ids already finished are skipped. `RequestStream.abort`
        calls it."""
        ...
