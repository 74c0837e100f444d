"""A step that raises does not poison the engine (LLMEngine.drop_failed_step):
with a fault injected once (in schedule, in the model's forward, while
waiting for the sampled tokens, or while processing them), `LLM.generate`
raises the original error, leaves no KV block held and no request behind,
and the next `generate` gives the same tokens as a fresh engine. Requests
that were only waiting when the step failed survive and finish normally.
Every engine drive here is bounded in steps, so a regression fails instead
of spinning forever."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.worker.sample_output import StepLaunch

# 6..42 tokens: max_num_batched_tokens=24 splits the longer prompts into
# chunks, so faults land in prefill chunks, mixed steps and decodes.
PROMPTS = [[5 + i, 17, 101 + 3 * i] * (2 + 4 * i) for i in range(4)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BASE = dict(max_model_len=128, max_num_batched_tokens=24, print_startup_report=False)
MAX_STEPS = 200  # a generate of PROMPTS takes ~12 steps


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def want(llama_path) -> list[list[int]]:
    """The greedy tokens of a fresh engine."""
    return _generate(LLM(llama_path, async_scheduling=False, **BASE))


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, llama_path) -> LLM:
    """One engine per mode, shared by the tests: each leaves it as it found it."""
    return LLM(llama_path, async_scheduling=request.param, **BASE)


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _fail_once(monkeypatch, target: Any, name: str, nth: int) -> None:
    """`target.name` raises InjectedFault on its nth call, and only then."""
    real: Callable = getattr(target, name)
    calls = 0

    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == nth:
            raise InjectedFault(f"injected fault in {name}, call {nth}")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)


def _bound_steps(monkeypatch, llm: LLM) -> None:
    """engine.step raises after MAX_STEPS calls: a poisoned engine spins."""
    engine = llm.engine
    real, calls = engine.step, 0

    def step():
        nonlocal calls
        calls += 1
        assert calls <= MAX_STEPS, "the engine does not finish: a failed step poisoned it"
        return real()

    monkeypatch.setattr(engine, "step", step)


def _assert_clean(llm: LLM, failed: bool = False) -> None:
    """No request, block or per-request state left; right after a failed step
    (`failed`) also no sampled ids a later step could read as its inputs."""
    engine, stats = llm.engine, llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not engine.has_unfinished_requests()
    assert engine._inflight is None and not engine.states
    runner = engine.runner
    if failed:
        assert runner.inflight.sampled is None and not runner.inflight.row_of
    assert not runner.block_table._slot_of
    assert not runner.request_sampling.generators and not runner.request_sampling.histories
    engine.scheduler.block_manager.check_invariants([])


# (what raises, on which call): schedule's 3rd call, the forward of the 3rd
# step, the 3rd wait for sampled tokens, and the 6th token processed (midway
# through a step's rows, after some were handled).
SITES = {
    "schedule": (lambda e: e.scheduler, "schedule", 3),
    "forward": (lambda e: e.runner.model, "forward", 3),
    "result": (lambda e: StepLaunch, "result", 3),
    "tokens": (lambda e: e, "_process_token", 6),
}


@pytest.mark.parametrize("site", list(SITES))
def test_failed_step_is_dropped_and_the_next_generate_works(llm, want, site, monkeypatch):
    _bound_steps(monkeypatch, llm)
    target, name, nth = SITES[site]
    _fail_once(monkeypatch, target(llm.engine), name, nth)
    with pytest.raises(InjectedFault, match="injected fault") as info:
        _generate(llm)
    assert any("dropped" in note for note in getattr(info.value, "__notes__", []))
    _assert_clean(llm, failed=True)
    assert _generate(llm) == want  # the fault fired once: this call runs clean
    _assert_clean(llm)


def test_waiting_requests_of_others_survive_a_failed_step(llama_path, want, monkeypatch):
    """Requests submitted with add_request, outside the failing generate: the
    two running in the failed step are dropped, the one still waiting (room
    for 2 sequences) survives and then gives a fresh engine's tokens."""
    for async_scheduling in (True, False):
        llm = LLM(llama_path, async_scheduling=async_scheduling, max_num_seqs=2, **BASE)
        engine = llm.engine
        _bound_steps(monkeypatch, llm)
        ids = [engine.add_request({"prompt_token_ids": p}, PARAMS, f"other-{i}")
               for i, p in enumerate(PROMPTS[:3])]  # fmt: skip
        _fail_once(monkeypatch, engine.runner.model, "forward", 2)
        with pytest.raises(InjectedFault):
            _generate(llm)
        assert sorted(engine.states) == [ids[2]]  # the generate's requests went too
        final = {}
        while engine.has_unfinished_requests():
            final.update((o.request_id, o) for o in engine.step() if o.finished)
        assert sorted(final) == [ids[2]]
        assert final[ids[2]].outputs[0].token_ids == want[2]
        _assert_clean(llm)
        assert _generate(llm) == want
        _assert_clean(llm)


def test_a_failed_step_leaves_no_prefix_hit_on_kv_it_never_wrote(llama_path, monkeypatch):
    """Blocks become prefix hits when the step that fills them is planned
    (BlockManager.cache_scheduled_blocks). When that step's forward raises,
    its K/V was never written: the dropped requests' blocks leave the index,
    and the same prompts afterwards compute them again."""
    shared = PROMPTS[3][:32]
    prompts = [shared + [7], shared + [9]]

    def generate(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    want_shared = generate(LLM(llama_path, async_scheduling=False, **BASE))
    for async_scheduling in (True, False):
        llm = LLM(llama_path, async_scheduling=async_scheduling, **BASE)
        _bound_steps(monkeypatch, llm)
        _fail_once(monkeypatch, llm.engine.runner.model, "forward", 1)
        with pytest.raises(InjectedFault):
            generate(llm)
        assert not llm.engine.scheduler.block_manager.cached
        assert generate(llm) == want_shared
        assert llm.stats()["prefix_cache_hit_tokens"] > 0  # the second prompt hit the first
        _assert_clean(llm)
