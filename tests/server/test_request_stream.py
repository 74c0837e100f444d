"""RequestStream (serve/engine_client.py) on a real event loop: events in
order, a reader that fell behind reads each prompt's unread DELTA outputs
joined into one, a failure still delivers what came before it, and an abort
wakes a waiting reader."""

from __future__ import annotations

import asyncio

import pytest

from tinyengine.outputs import CompletionOutput, RequestOutput
from tinyengine.serve.engine_client import (
    ACCEPTED,
    Failure,
    RequestFailedError,
    RequestRejectedError,
    RequestStream,
)


def _output(request_id: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    text = "".join(chr(97 + t % 26) for t in tokens)
    done = "length" if finished else None
    completion = CompletionOutput(0, text, list(tokens), done)
    return RequestOutput(request_id, None, [1, 2], [completion], finished)


def _collect(stream: RequestStream) -> list[tuple[int, list[int]]]:
    async def read() -> list[tuple[int, list[int]]]:
        await stream.accepted()
        return [(i, out.outputs[0].token_ids) async for i, out in stream.outputs()]

    return asyncio.run(read())


def test_a_reader_behind_gets_each_prompts_unread_deltas_joined():
    aborted: list[list[str]] = []
    stream = RequestStream(["a-0", "a-1"], aborted.append)
    stream.put(ACCEPTED)
    for n in range(3):  # three steps queued before the reader runs
        stream.put((0, _output("a-0", [n])))
        stream.put((1, _output("a-1", [10 + n], finished=n == 2)))
    stream.put((0, _output("a-0", [3], finished=True)))
    assert _collect(stream) == [(0, [0, 1, 2, 3]), (1, [10, 11, 12])]
    assert stream.done and aborted == []


def test_joined_deltas_keep_text_logprobs_and_the_last_state():
    first, later = _output("g", [1, 2]), _output("g", [3], finished=True)
    first.outputs[0].logprobs, later.outputs[0].logprobs = [{1: 1}, {2: 2}], [{3: 3}]
    first.prompt_logprobs = [None, {5: 5}]
    first.add(later)
    c = first.outputs[0]
    assert (c.text, c.token_ids, c.logprobs) == ("bcd", [1, 2, 3], [{1: 1}, {2: 2}, {3: 3}])
    assert first.finished and c.finish_reason == "length"
    assert first.prompt_logprobs == [None, {5: 5}]


def test_a_reader_that_keeps_up_sees_every_output():
    stream = RequestStream(["b"], lambda ids: None)

    async def run() -> list[list[int]]:
        seen: list[list[int]] = []

        async def engine() -> None:
            stream.put(ACCEPTED)
            for n in range(4):
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                stream.put((0, _output("b", [n], finished=n == 3)))

        task = asyncio.ensure_future(engine())
        await stream.accepted()
        async for _, out in stream.outputs():
            seen.append(out.outputs[0].token_ids)
        await task
        return seen

    assert asyncio.run(run()) == [[0], [1], [2], [3]]


def test_a_failure_comes_after_the_outputs_before_it():
    stream = RequestStream(["c"], lambda ids: None)
    stream.put(ACCEPTED)
    stream.put((0, _output("c", [5])))
    stream.put(Failure(RequestFailedError("boom")))
    seen: list[list[int]] = []

    async def read() -> None:
        await stream.accepted()
        async for _, out in stream.outputs():
            seen.append(out.outputs[0].token_ids)

    with pytest.raises(RequestFailedError, match="boom"):
        asyncio.run(read())
    assert seen == [[5]] and stream.done


def test_a_rejection_raises_from_accepted():
    stream = RequestStream(["d"], lambda ids: None)
    stream.put(Failure(RequestRejectedError("max_tokens is too large", "max_tokens")))
    with pytest.raises(RequestRejectedError, match="max_tokens"):
        _collect(stream)


def test_abort_wakes_a_waiting_reader_and_aborts_once():
    aborted: list[list[str]] = []
    stream = RequestStream(["e-0", "e-1"], aborted.append)

    async def run() -> list[int]:
        stream.put(ACCEPTED)
        await stream.accepted()
        seen: list[int] = []

        async def read() -> None:
            async for i, _ in stream.outputs():
                seen.append(i)

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        stream.put((1, _output("e-1", [1])))
        await asyncio.sleep(0)
        stream.abort()
        stream.abort()
        await asyncio.wait_for(reader, 1.0)
        return seen

    assert asyncio.run(run()) == [1]
    assert aborted == [["e-0", "e-1"]]


def test_a_reader_that_stopped_reading_holds_one_output_per_prompt():
    """A client that does not read its socket stops its handler reading the
    stream; the outputs the engine keeps putting join the one unread output
    instead of piling up one object per step."""
    import gc
    import weakref

    stream = RequestStream(["f"], lambda ids: None)
    stream.put(ACCEPTED)
    stream.put((0, _output("f", [0])))
    second = _output("f", [1])
    stream.put((0, second))
    gone = weakref.ref(second)
    del second
    for n in range(2, 199):
        stream.put((0, _output("f", [n])))
    gc.collect()
    assert gone() is None
    stream.put((0, _output("f", [199], finished=True)))
    assert _collect(stream) == [(0, list(range(200)))]
