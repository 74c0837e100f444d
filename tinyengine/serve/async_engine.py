"""AsyncLLMEngine: the bridge between asyncio HTTP handlers and the LLMEngine.

One background thread owns the LLMEngine: it builds it, runs the startup state
machine, then loops: apply the commands that arrived (add, abort), run one
step, hand the outputs back. Handlers never call the engine; they post
commands to a thread-safe queue and read their outputs from a `RequestStream`,
an asyncio queue that the engine thread fills through
`loop.call_soon_threadsafe`. Every request is a stream, so many concurrent
HTTP requests simply become one batch in the scheduler.

    handler --submit()--> command queue --(between steps)--> engine.add_request
    engine.step() --outputs--> call_soon_threadsafe --> RequestStream --> handler

Owns: the engine thread, request bookkeeping (which engine request belongs to
which stream), per-request timing for metrics, and failure isolation: a step
that raises fails the requests it was running (they get an error, their KV
blocks are freed) and the loop goes on.

Must never: let any thread but its own touch the LLMEngine (it is not
thread-safe), block the event loop, or leave a request in the engine after its
stream has been aborted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tinyengine.outputs import RequestOutput
from tinyengine.sampling_params import SamplingParams
from tinyengine.serve.metrics import ServerMetrics

logger = logging.getLogger("tinyengine.server")

PromptType = str | dict[str, Any]


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


# --- what travels between the two threads ---


@dataclass
class _Add:
    stream: RequestStream
    prompts: list[PromptType]
    params: list[SamplingParams]  # one per prompt
    arrival: float


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Failure:
    error: Exception


_ACCEPTED = object()  # every prompt of the stream is in the engine
_ABORTED = object()  # the handler gave up (client gone); readers stop
_SHUTDOWN = object()


@dataclass
class _Live:
    """Engine-thread bookkeeping for one engine request."""

    stream: RequestStream
    index: int
    arrival: float
    first_token: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


class RequestStream:
    """The outputs of one HTTP request: one engine request per prompt, each
    output tagged with its prompt's index. Used only on the event loop."""

    def __init__(self, engine: AsyncLLMEngine, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._engine = engine
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self.done = False

    def _put(self, event: Any) -> None:
        if isinstance(event, _Failure):
            self.done = True  # the engine already removed every sub-request
        self._queue.put_nowait(event)

    async def accepted(self) -> None:
        """Wait until the engine took the request; raise what it said otherwise."""
        event = await self._queue.get()
        if isinstance(event, _Failure):
            raise event.error
        if event is _ABORTED:
            raise RequestAbortedError("request aborted before it was accepted")
        assert event is _ACCEPTED

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative RequestOutput) until every prompt finished.
        Raises RequestFailedError if the engine failed the request; ends early
        (no error) if the request was aborted."""
        while self._unfinished:
            event = await self._queue.get()
            if isinstance(event, _Failure):
                raise event.error
            if event is _ABORTED:
                return
            index, output = event
            if output.finished:
                self._unfinished.discard(index)
            yield index, output
        self.done = True

    def abort(self) -> None:
        """Stop every unfinished sub-request and free its KV blocks. Idempotent."""
        if self.done:
            return
        self.done = True
        self._engine._post(_Abort(list(self.request_ids)))
        self._queue.put_nowait(_ABORTED)  # wakes a reader blocked on get()


class AsyncLLMEngine:
    """Owns the engine thread. `start()` returns at once; /health watches
    `health()` while the model is built, loaded, profiled and warmed up."""

    def __init__(
        self,
        model: str | None,
        engine_kwargs: dict[str, Any] | None = None,
        resolve_model: Callable[[str | None], str] | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.model_spec = model
        self.engine_kwargs = dict(engine_kwargs or {})
        if resolve_model is None:
            from tinyengine.models_presets import resolve_model
        self._resolve_model = resolve_model
        self.metrics = metrics or ServerMetrics()
        self.engine: Any = None  # LLMEngine once built (Any: avoids importing torch here)
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._outbox: list[tuple[RequestStream, Any]] = []
        self._stats: dict[str, Any] | None = None  # published by the engine thread
        self._error: str | None = None
        self._prepare_seconds: float | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False  # stop_serving() was called: refuse new requests

    # --- lifecycle (event loop side) ---

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tinyengine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stop_serving()
        if self._thread is not None:
            self._thread.join(timeout)

    def stop_serving(self) -> None:
        """Refuse new requests and fail the in-flight ones ("the server is
        shutting down"), so their connections close now instead of when their
        generations end. Safe from a signal handler: it sets a flag and posts
        one command (SimpleQueue.put is reentrant)."""
        self._closing = True
        self._post(_SHUTDOWN)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def health(self) -> Health:
        seconds: dict[str, float] = {}
        if self._prepare_seconds is not None:
            seconds["prepare_model"] = self._prepare_seconds
        engine = self.engine
        if engine is None:
            state, stage = ("failed", None) if self._error else ("preparing", "prepare_model")
            return Health(False, state, stage, self._error, seconds)
        machine = engine.startup
        for record in list(machine.report.stages):
            seconds[record.name] = record.seconds
        state = machine.state.value
        if self._error or state == "failed":
            # The machine's error names the stage that failed ("load: ...").
            return Health(False, "failed", None, machine.report.error or self._error, seconds)
        if self.ready:
            return Health(True, "ready", None, None, seconds)
        return Health(False, state, machine.running, None, seconds)

    def stats(self) -> dict[str, Any] | None:
        """The engine stats as of the end of the last loop iteration."""
        return self._stats

    # --- requests (event loop side) ---

    def submit(
        self,
        prompts: Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams],
        request_id: str,
    ) -> RequestStream:
        """Queue one engine request per prompt (`params`: one for all, or one
        per prompt); outputs arrive on the stream. Validation happens in the
        engine thread: await `stream.accepted()`."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        if self._closing:
            raise EngineNotReadyError("the server is shutting down")
        if not self.ready:
            raise EngineNotReadyError(self.not_ready_message())
        if len(prompts) == 1:
            ids = [request_id]
        else:
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, ids)
        self._post(_Add(stream, list(prompts), per_prompt, time.monotonic()))
        return stream

    def not_ready_message(self) -> str:
        h = self.health()
        if h.state == "failed":
            return f"the engine failed to start: {h.error}"
        return f"the engine is starting (state {h.state}, running {h.stage}); retry shortly"

    def _post(self, command: Any) -> None:
        self._commands.put(command)

    # --- the engine thread ---

    def _run(self) -> None:
        if not self._start_engine():
            return
        engine = self.engine
        self._stats = engine.stats()
        self._ready.set()
        logger.info("engine ready")
        while True:
            if not self._apply_commands(block=not engine.has_unfinished_requests()):
                break
            if engine.has_unfinished_requests():
                self._step()
            self._stats = engine.stats()
            self._flush()
        self._fail_all(RequestFailedError("the server is shutting down"))
        self._flush()

    def _start_engine(self) -> bool:
        from tinyengine.config import EngineConfig
        from tinyengine.engine import LLMEngine

        start = time.perf_counter()
        try:
            path = self._resolve_model(self.model_spec)
            config = EngineConfig.from_kwargs(path, **self.engine_kwargs)
            self.engine = LLMEngine(config, start=False)
            self._prepare_seconds = time.perf_counter() - start
            self.engine.start()
        except Exception as exc:
            if self._prepare_seconds is None:
                self._prepare_seconds = time.perf_counter() - start
            self._error = f"{type(exc).__name__}: {exc}"
            logger.exception("engine startup failed")
            return False
        return True

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; False once shutdown was asked for."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _SHUTDOWN:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_ids)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, add: _Add) -> None:
        """All prompts of a stream go in, or none do."""
        engine, stream = self.engine, add.stream
        added: list[str] = []
        try:
            for index, (prompt, params, request_id) in enumerate(
                zip(add.prompts, add.params, stream.request_ids, strict=True)
            ):
                # The server's rule (OpenAI's, vLLM's): a max_tokens that does
                # not fit beside the prompt is an error, not silently cut.
                engine.add_request(prompt, params, request_id, strict_max_tokens=True)
                added.append(request_id)
                num_prompt = len(engine.states[request_id].request.prompt_token_ids)
                self._live[request_id] = _Live(stream, index, add.arrival, None, num_prompt)
        except Exception as exc:
            for request_id in added:
                engine.abort_request(request_id)
                del self._live[request_id]
            error = (
                RequestRejectedError(str(exc), getattr(exc, "param", None))
                if isinstance(exc, ValueError)
                else exc
            )
            if not isinstance(exc, ValueError):
                logger.exception("add_request failed")
            self._outbox.append((stream, _Failure(error)))
            return
        self._outbox.append((stream, _ACCEPTED))

    def _abort(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        for request_id in request_ids:
            live = self._live.pop(request_id, None)
            if live is None:
                continue  # finished (or failed) before the abort arrived
            self.engine.abort_request(request_id)
            self._record_finish(live, "abort", now)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it was running")
            self._fail_step(exc)
            return
        now = time.monotonic()
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            if live.first_token is None:
                live.first_token = now
                self.metrics.record_first_token(now - live.arrival)
            live.num_output_tokens = len(output.outputs[0].token_ids)
            self._outbox.append((live.stream, (live.index, output)))
            if output.finished:
                del self._live[output.request_id]
                self._record_finish(live, output.outputs[0].finish_reason or "stop", now)

    def _fail_step(self, exc: Exception) -> None:
        """Fail what the broken step ran. The scheduler put every request it
        scheduled into `running`; failing them (and not retrying) keeps one
        poisonous request from failing every later step. Waiting requests are
        untouched, unless nothing was running (then the fault is elsewhere and
        everything is failed so the loop cannot spin on it)."""
        scheduler = self.engine.scheduler
        victims = {r.request_id for r in scheduler.running} or set(scheduler.requests)
        # A step that broke after finishing some requests leaves live entries
        # the scheduler no longer knows: they would wait forever.
        victims |= {rid for rid in self._live if rid not in scheduler.requests}
        error = RequestFailedError(f"the engine failed while running this request: {exc!r}")
        streams = {self._live[rid].stream for rid in victims if rid in self._live}
        for stream in streams:
            self._fail_stream(stream, error)
        for request_id in victims:  # requests without a stream (none expected)
            self.engine.abort_request(request_id)

    def _fail_stream(self, stream: RequestStream, error: Exception) -> None:
        now = time.monotonic()
        for request_id in stream.request_ids:
            live = self._live.pop(request_id, None)
            if live is not None:
                self.engine.abort_request(request_id)
                self._record_finish(live, "error", now)
        self._outbox.append((stream, _Failure(error)))

    def _fail_all(self, error: Exception) -> None:
        for stream in {live.stream for live in self._live.values()}:
            self._fail_stream(stream, error)

    def _record_finish(self, live: _Live, status: str, now: float) -> None:
        decode = now - live.first_token if live.first_token is not None else None
        self.metrics.record_finished(
            status, live.num_prompt_tokens, live.num_output_tokens, now - live.arrival, decode
        )

    def _flush(self) -> None:
        """Hand this iteration's events to the event loop in one call."""
        if not self._outbox or self._loop is None:
            return
        batch, self._outbox = self._outbox, []
        try:
            self._loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass


def _deliver(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, event in batch:
        stream._put(event)
