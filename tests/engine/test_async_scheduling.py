"""Asynchronous scheduling (EngineConfig.async_scheduling, the default): step
N+1 is scheduled and launched before step N's tokens reach the host. It must
change nothing a user can see: the same tokens, text, finish reasons and
logprobs as the synchronous engine for every way a request can end (length,
eos, stop token, stop string, min_tokens, abort), with seeded sampling,
chunked prefill, preemption and prefix hits; and no KV block may leak."""

from __future__ import annotations

import dataclasses

import pytest

from tinyengine import LLM, SamplingParams
from tinyengine.tools.make_proxy import ensure_preset

PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a land far away, there lived",
    "The capital of France is a city that",  # shares a prefix with the first
    "你好，世界",
]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return ensure_preset("deepseek-v3-tiny", str(tmp_path_factory.mktemp("cache")))


def _params() -> list[SamplingParams]:
    base = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, logprobs=2)
    return [
        dataclasses.replace(base, seed=1, ignore_eos=True),  # length
        dataclasses.replace(base, seed=2, stop=["e", "a"]),  # stop string, early
        dataclasses.replace(base, temperature=0.0, max_tokens=3),  # short: done while others run
        dataclasses.replace(base, seed=4, min_tokens=10, stop_token_ids=[5, 7, 11, 13]),
        dataclasses.replace(base, seed=5, stop_token_ids=list(range(200, 60000))),  # stops soon
        dataclasses.replace(base, seed=6, max_tokens=1),  # finishes at its first token
    ]


def _run(path: str, **config) -> tuple[LLM, list[tuple]]:
    llm = LLM(path, dtype="float32", max_model_len=96, print_startup_report=False, **config)
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    seen = []
    for out in outs:
        c = out.outputs[0]
        lps = [sorted((t, lp.logprob) for t, lp in step.items()) for step in c.logprobs]
        seen.append((c.text, c.token_ids, c.finish_reason, c.stop_reason, lps))
    return llm, seen


def _assert_same(got: list[tuple], want: list[tuple]) -> None:
    """Tokens, text and reasons exactly; logprobs to fp32 noise (a different
    batch mix changes the summation order of the matmuls)."""
    assert [g[:4] for g in got] == [w[:4] for w in want]
    for g, w in zip(got, want, strict=True):
        for step_g, step_w in zip(g[4], w[4], strict=True):
            assert [t for t, _ in step_g] == [t for t, _ in step_w]
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(step_g, step_w, strict=True))


CONFIGS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 8},
    "preempt": {"num_kv_blocks": 10, "block_size": 4, "max_num_batched_tokens": 16},
    "graphs": {"graph_backend": "recording", "cuda_graph_sizes": [1, 2, 4, 8]},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_async_matches_sync(path, name):
    sync_llm, sync = _run(path, async_scheduling=False, **CONFIGS[name])
    async_llm, got = _run(path, **CONFIGS[name])
    assert async_llm.engine.config.async_scheduling
    _assert_same(got, sync)
    reasons = {r[2] for r in got}
    assert reasons == {"length", "stop"}, reasons  # the mix really ends both ways
    for llm in (sync_llm, async_llm):
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]  # nothing leaked
        assert not llm.engine.has_unfinished_requests()
    if name == "preempt":
        assert async_llm.stats()["num_preemptions"] > 0


def test_abort_while_a_step_is_in_flight(path):
    llm = LLM(path, dtype="float32", max_model_len=96, print_startup_report=False)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(prompt, params, request_id=str(i))
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "1" or steps < 4, "an aborted request produced output"
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 4:  # request 1 is scheduled in the step now in flight
            assert engine._inflight is not None
            engine.abort_request("1")
    assert sorted(finished) == ["0", "2"]
    assert all(len(o.outputs[0].token_ids) == 20 for o in finished.values())
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_request_id_reused_while_the_aborted_one_is_in_flight(path):
    """An id freed by abort may be reused at once; the old request's token,
    still in flight, must not land in the new request."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = LLM(path, dtype="float32", max_model_len=96, print_startup_report=False)
    (want,) = alone.generate([PROMPTS[3]], params, use_tqdm=False)

    llm = LLM(path, dtype="float32", max_model_len=96, print_startup_report=False)
    engine = llm.engine
    engine.add_request(PROMPTS[0], params, request_id="x")
    engine.step()
    engine.step()  # "x" is decoding, a step of it in flight
    assert engine._inflight is not None
    engine.abort_request("x")
    engine.add_request(PROMPTS[3], params, request_id="x")
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "x"
            final = out if out.finished else final
    assert final is not None and final.outputs[0].token_ids == want.outputs[0].token_ids
