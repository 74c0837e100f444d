"""AsyncLLMEngine: the bridge between asyncio HTTP handlers and the LLMEngine.

It implements `EngineClient` (engine_client.py), all that handlers may use,
and is the one holder of an LLMEngine: this file alone knows the engine's API
(`StartupMachine.for_config`, `LLMEngine(config, startup)`, the machine's
`state/report/running`, `add_request`, `step`, ...).

One background thread owns the LLMEngine: it builds it, runs the startup state
machine, then loops: apply the commands that arrived (add, abort), run one
step, hand the outputs back. Handlers never call the engine; they post
commands to a thread-safe queue and read their outputs from a `RequestStream`,
an asyncio queue that the engine thread fills through
`loop.call_soon_threadsafe`. Every request is a stream, so many concurrent
HTTP requests simply become one batch in the scheduler.

    handler --submit()--> command queue --(between steps)--> engine.add_request
    engine.step() --outputs--> call_soon_threadsafe --> RequestStream --> handler

Owns: the engine thread and failure isolation: a step that raises fails the
requests it was running (they get an error, their KV blocks are freed) and
the loop goes on. The books it keeps on that thread (which engine request
belongs to which stream, per-request timing for metrics, the outbox) are a
RequestTracker's (request_tracker.py).

Must never: let any thread but its own touch the LLMEngine (it is not
thread-safe), block the event loop, or leave a request in the engine after its
stream has been aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tinyengine import models_presets
from tinyengine.sampling_params import RequestOutputKind, SamplingParams
from tinyengine.serve.engine_client import (
    EngineNotReadyError,
    Health,
    ModelInfo,
    PromptType,
    RequestFailedError,
    RequestRejectedError,
    RequestStream,
)
from tinyengine.serve.metrics import ServerMetrics
from tinyengine.serve.request_tracker import RequestTracker
from tinyengine.tokenizer import Tokenizer

logger = logging.getLogger("tinyengine.server")


# --- what travels from the event loop to the engine thread ---


@dataclass
class _Add:
    stream: RequestStream
    prompts: list[PromptType]
    params: list[SamplingParams]  # one per prompt
    arrival: float
    group: str  # the HTTP request's id: its prompts x n share one fair-share group


@dataclass
class _Abort:
    request_ids: list[str]


_SHUTDOWN = object()


class AsyncLLMEngine:
    """Owns the engine thread and implements EngineClient. `start()` returns
    at once; /health watches `health()` while the model is built, loaded,
    profiled and warmed up.

    Lifecycle (app.py's, not the handlers'): start(), stop_serving(), shutdown().
    """

    def __init__(
        self,
        model: str | None,
        engine_kwargs: dict[str, Any] | None = None,
        served_model_name: str | None = None,
        resolve_model: Callable[[str | None], str] | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self._model_spec = model
        self._engine_kwargs = dict(engine_kwargs or {})
        self._resolve_model = resolve_model or models_presets.resolve_model
        self.metrics = metrics or ServerMetrics()
        # What handlers read about the model; the limits are filled in (by the
        # engine thread, before `ready`) once the engine exists.
        name = served_model_name or models_presets.served_model_name(model)
        self._model_info = ModelInfo(name, model)
        self._tokenizer: Tokenizer | None = None
        # Built on the engine thread. Any: naming their types would import torch here.
        self._startup: Any = None  # the StartupMachine, from before the engine exists
        self._engine: Any = None  # the LLMEngine, once its startup reached READY
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tracker = RequestTracker(self.metrics)  # the engine thread's
        self._stats: dict[str, Any] | None = None  # published by the engine thread
        self._error: str | None = None
        self._prepare_seconds: float | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False  # stop_serving() was called: refuse new requests

    # --- model info (event loop side) ---

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

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
        machine = self._startup
        if machine is None:
            state, stage = ("failed", None) if self._error else ("preparing", "prepare_model")
            return Health(False, state, stage, self._error, seconds)
        for record in list(machine.report.stages):
            seconds[record.name] = record.seconds
        state = machine.state.value
        if self._error or state == "failed":
            # The machine's error names the stage that failed ("load: ...").
            return Health(False, "failed", None, machine.report.error or self._error, seconds)
        if self.ready:
            return Health(True, "ready", None, None, seconds)
        if not machine.report.stages and machine.running is None:
            # The LLMEngine constructor's work before the first stage (reading
            # the tokenizer) is still preparing the model.
            return Health(False, "preparing", "prepare_model", None, seconds)
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
        # A stream carries DELTA outputs (engine_client.RequestStream): each
        # step's costs the engine what is new, not a copy of everything so far.
        per_prompt = [dataclasses.replace(p, output_kind=RequestOutputKind.DELTA)
                      for p in per_prompt]  # fmt: skip
        if self._error is not None and self.ready:
            raise EngineNotReadyError(f"the engine can serve no more: {self._error}")
        if self._closing:
            raise EngineNotReadyError("the server is shutting down")
        if not self.ready:
            raise EngineNotReadyError(self.not_ready_message())
        one = len(prompts) == 1
        ids = [request_id] if one else [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(ids, self.abort)
        self._post(_Add(stream, list(prompts), per_prompt, time.monotonic(), request_id))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self._post(_Abort(list(request_ids)))

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
        engine = self._engine
        self._stats = engine.stats()
        # Published before `ready`: a handler that sees ready also sees these.
        self._model_info = dataclasses.replace(
            self._model_info,
            max_model_len=engine.max_model_len,
            vocab_size=engine.runner.vocab_size,
        )
        self._tokenizer = engine.tokenizer
        if self._tokenizer is not None:
            self._tokenizer.max_token_chars  # noqa: B018  (read the vocabulary here, not on the loop)
        self._ready.set()
        logger.info("engine ready")
        reason = "the server is shutting down"
        while True:
            if not self._apply_commands(block=not engine.has_unfinished_requests()):
                break
            if engine.has_unfinished_requests() and not self._step():
                reason = f"the engine died: {self._error}"
                break
            self._stats = engine.stats()
            self._tracker.flush(self._loop)
        self._closing = True
        self._fail_all(RequestFailedError(reason))
        self._tracker.flush(self._loop)
        engine.shutdown()

    def _start_engine(self) -> bool:
        from tinyengine.config import EngineConfig
        from tinyengine.engine import LLMEngine
        from tinyengine.worker.startup import StartupMachine, show_progress

        show_progress()  # one line per startup stage on stderr, beside uvicorn's own

        start = time.perf_counter()
        try:
            path = self._resolve_model(self._model_spec)
            config = EngineConfig.from_kwargs(path, **self._engine_kwargs)
            # The machine exists before the engine, so health() can read its
            # state while the LLMEngine constructor runs it to READY.
            self._startup = StartupMachine.for_config(config)
            self._prepare_seconds = time.perf_counter() - start
            self._engine = LLMEngine(config, self._startup)
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
        engine, stream = self._engine, add.stream
        added: list[str] = []
        try:
            for index, (prompt, params, request_id) in enumerate(
                zip(add.prompts, add.params, stream.request_ids, strict=True)
            ):
                # The server's rule (OpenAI's, vLLM's): a max_tokens that does
                # not fit beside the prompt is an error, not silently cut.
                engine.add_request(
                    prompt, params, request_id, strict_max_tokens=True, group=add.group
                )
                added.append(request_id)
                num_prompt = len(engine.states[request_id].request.prompt_token_ids)
                self._tracker.track(request_id, stream, index, add.arrival, num_prompt)
        except Exception as exc:
            for request_id in added:
                engine.abort_request(request_id)
                self._tracker.untrack(request_id)
            error = (
                RequestRejectedError(str(exc), getattr(exc, "param", None))
                if isinstance(exc, ValueError)
                else exc
            )
            if not isinstance(exc, ValueError):
                logger.exception("add_request failed")
            self._tracker.rejected(stream, error)
            return
        self._tracker.accepted(stream)

    def _abort(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        for request_id in request_ids:
            # Not tracked: finished (or failed) before the abort arrived.
            if self._tracker.finish(request_id, "abort", now):
                self._engine.abort_request(request_id)

    def _step(self) -> bool:
        """One engine step; False when the engine can serve no more (a
        tensor-parallel rank died: EngineDeadError)."""
        try:
            outputs = self._engine.step()
        except Exception as exc:
            if type(exc).__name__ == "EngineDeadError":  # named: importing it imports torch
                logger.error("the engine died: %s", exc)
                self._error = f"{type(exc).__name__}: {exc}"
                return False
            logger.exception("engine step failed; failing the requests it was running")
            self._fail_step(exc)
            return True
        now = time.monotonic()
        for output in outputs:
            self._tracker.output(output, now)
        return True

    def _fail_step(self, exc: Exception) -> None:
        """Fail what the broken step ran. The engine has already dropped those
        requests (`LLMEngine.drop_failed_step`: blocks freed, state cleared),
        always including the one that broke the step, so one poisonous request
        cannot fail every later step. They are the tracked requests the
        scheduler no longer holds (with any that finished inside the failed
        step, whose outputs are lost); waiting requests are untouched."""
        scheduler = self._engine.scheduler
        victims = {rid for rid in self._tracker.request_ids() if rid not in scheduler.requests}
        error = RequestFailedError(f"the engine failed while running this request: {exc!r}")
        streams = {s for rid in victims if (s := self._tracker.stream_of(rid)) is not None}
        for stream in streams:
            self._fail_stream(stream, error)
        for request_id in victims:  # requests without a stream (none expected)
            self._engine.abort_request(request_id)

    def _fail_stream(self, stream: RequestStream, error: Exception) -> None:
        for request_id in self._tracker.fail(stream, error, time.monotonic()):
            self._engine.abort_request(request_id)

    def _fail_all(self, error: Exception) -> None:
        for stream in self._tracker.streams():
            self._fail_stream(stream, error)
