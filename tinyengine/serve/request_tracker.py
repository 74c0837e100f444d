"""RequestTracker: the bridge's books, kept on the engine thread.

Owns which engine request belongs to which `RequestStream` (and at which
index of it), each request's timing and token counts for the server's
metrics, and the outbox: the events (accepted, outputs, failures) gathered
during one loop iteration and handed to the event loop in one
`call_soon_threadsafe` call.

Must never: call the engine (async_engine.py alone does; the tracker tells
it which requests to abort), be touched from the event loop (it is the engine
thread's, like the engine), or deliver an event anywhere but on the event
loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tinyengine.outputs import RequestOutput
from tinyengine.serve.engine_client import ACCEPTED, Failure, RequestStream
from tinyengine.serve.metrics import ServerMetrics


@dataclass
class _Live:
    """Engine-thread bookkeeping for one engine request."""

    stream: RequestStream
    index: int
    arrival: float
    first_token: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


class RequestTracker:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._live: dict[str, _Live] = {}
        self._outbox: list[tuple[RequestStream, Any]] = []

    def request_ids(self) -> list[str]:
        """The engine requests whose streams still wait for outputs."""
        return list(self._live)

    def stream_of(self, request_id: str) -> RequestStream | None:
        live = self._live.get(request_id)
        return live.stream if live is not None else None

    def track(
        self,
        request_id: str,
        stream: RequestStream,
        index: int,
        arrival: float,
        num_prompt_tokens: int,
    ) -> None:
        self._live[request_id] = _Live(stream, index, arrival, None, num_prompt_tokens)

    def untrack(self, request_id: str) -> None:
        """Forget a request the engine took back before anyone saw it (no metrics)."""
        del self._live[request_id]

    def accepted(self, stream: RequestStream) -> None:
        self._outbox.append((stream, ACCEPTED))

    def rejected(self, stream: RequestStream, error: Exception) -> None:
        self._outbox.append((stream, Failure(error)))

    def output(self, output: RequestOutput, now: float) -> None:
        """One step's output for one request: onto its stream; timed; and, when
        it is the last, the request is finished."""
        live = self._live.get(output.request_id)
        if live is None:
            return
        if live.first_token is None:
            live.first_token = now
            self.metrics.record_first_token(now - live.arrival)
        live.num_output_tokens += len(output.outputs[0].token_ids)  # a DELTA output
        self._outbox.append((live.stream, (live.index, output)))
        if output.finished:
            del self._live[output.request_id]
            self._record_finish(live, output.outputs[0].finish_reason or "stop", now)

    def finish(self, request_id: str, status: str, now: float) -> bool:
        """Stop tracking a request that ends without a final output (status
        "abort" or "error"); False when it was not tracked (it finished, or
        failed, first)."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        self._record_finish(live, status, now)
        return True

    def fail(self, stream: RequestStream, error: Exception, now: float) -> list[str]:
        """Fail every request of `stream` that is still tracked; returns their
        ids, for the engine to abort."""
        failed = [rid for rid in stream.request_ids if self.finish(rid, "error", now)]
        self._outbox.append((stream, Failure(error)))
        return failed

    def streams(self) -> set[RequestStream]:
        return {live.stream for live in self._live.values()}

    def flush(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Hand this iteration's events to the event loop in one call."""
        if not self._outbox or loop is None:
            return
        batch, self._outbox = self._outbox, []
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _record_finish(self, live: _Live, status: str, now: float) -> None:
        decode = now - live.first_token if live.first_token is not None else None
        self.metrics.record_finished(
            status, live.num_prompt_tokens, live.num_output_tokens, now - live.arrival, decode
        )


def _deliver(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, event in batch:
        stream.put(event)
