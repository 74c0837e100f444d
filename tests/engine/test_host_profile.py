"""EngineConfig.profile_steps / LLMEngine.step_profile: one record per engine
step after startup, non-negative phase times that add up, a decode/prefill
split that sums to the whole, and outputs identical with profiling off."""

from __future__ import annotations

import math

import pytest

from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.config import EngineConfig

PROMPTS = [[5 + i, 17, 101 + 3 * i] * (2 + 3 * i) for i in range(5)]  # 6..42 tokens
KEYS = ("wall_s", "gpu_forward_s", "launch_s", "schedule_s", "prepare_s", "sample_s",
        "sample_wait_s", "output_s", "host_s")  # fmt: skip
# max_num_batched_tokens=24 splits the longer prompts into chunks (steps that
# sample nothing) and mixes them with decodes.
BASE = dict(max_model_len=128, max_num_batched_tokens=24, print_startup_report=False)
MODES = {
    "eager": {},
    "graphs": {"graph_backend": "recording", "cuda_graph_sizes": [1, 2, 4, 8]},
}


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama")))


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True)
    return [greedy, seeded, greedy, seeded, greedy]


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _check_summary(s: dict) -> None:
    assert all(s[k] >= 0 for k in KEYS), s
    host = s["schedule_s"] + s["prepare_s"] + s["sample_s"] + s["output_s"]
    assert math.isclose(s["host_s"], host, rel_tol=1e-9, abs_tol=1e-12)
    parts = host + s["launch_s"] + s["sample_wait_s"]
    assert parts <= s["wall_s"] * (1 + 1e-9) + 1e-9  # the phases lie inside the step
    if s["steps"]:
        assert s["host_fraction_of_gpu"] == pytest.approx(s["host_s"] / s["gpu_forward_s"])
        for k in KEYS:
            assert s["per_step"][k] == pytest.approx(s[k] / s["steps"])
        assert sum(s["batch_size_histogram"].values()) == s["steps"]
        sizes = s["batch_size_histogram"].items()
        assert s["mean_batch_size"] == pytest.approx(sum(b * n for b, n in sizes) / s["steps"])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_profile_counts_every_step_and_adds_up(llama_path, mode, monkeypatch):
    llm = LLM(llama_path, **BASE, **MODES[mode], profile_steps=True)
    engine = llm.engine
    assert llm.step_profile()["steps"] == 0  # warmup steps do not count
    # One record per step call that launched a forward pass (with async
    # scheduling the last call only collects the previous step's tokens).
    steps = []
    real_launch = engine.runner.launch
    monkeypatch.setattr(engine.runner, "launch", lambda plan: steps.append(1) or real_launch(plan))
    _generate(llm)
    profile = llm.step_profile()
    assert profile["steps"] == len(steps) > 0
    assert profile["forward_timing"] == "wall_clock"  # on CPU the forward's wall time
    _check_summary(profile)
    decode, prefill = profile["by_kind"]["decode"], profile["by_kind"]["prefill"]
    _check_summary(decode)
    _check_summary(prefill)
    assert decode["steps"] > 0 and prefill["steps"] > 0
    assert decode["steps"] + prefill["steps"] == profile["steps"]
    for k in KEYS:
        assert decode[k] + prefill[k] == pytest.approx(profile[k])
    hist = dict(decode["batch_size_histogram"])
    for size, n in prefill["batch_size_histogram"].items():
        hist[size] = hist.get(size, 0) + n
    assert hist == profile["batch_size_histogram"]
    assert decode["mean_tokens"] == decode["mean_batch_size"]  # one token per row
    # CPU: the forward runs inside the launch, so the wait is only the unpacking.
    assert 0 < profile["sample_wait_s"] < profile["gpu_forward_s"]
    if mode == "graphs":  # the decode steps went through graph replay
        assert engine.runner.graphs.backend.num_replays >= decode["steps"]

    # A batch-size filter keeps only the big steps; a reset forgets everything.
    big = llm.step_profile(min_batch_size=3)
    assert 0 < big["steps"] < profile["steps"]
    assert min(big["batch_size_histogram"]) >= 3
    llm.reset_step_profile()
    assert llm.step_profile()["steps"] == 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_profiling_leaves_outputs_identical(llama_path, mode):
    off = _generate(LLM(llama_path, **BASE, **MODES[mode]))
    on = _generate(LLM(llama_path, **BASE, **MODES[mode], profile_steps=True))
    assert on == off


def test_profiling_off_by_default(llama_path):
    llm = LLM(llama_path, **BASE)
    assert llm.engine.runner.profiler is None
    with pytest.raises(ValueError, match="profile_steps=True"):
        llm.step_profile()
    llm.reset_step_profile()  # harmless when off
    with pytest.raises(ValueError, match="profile_steps"):
        EngineConfig(model=llama_path, profile_steps="yes")


@pytest.mark.gpu
def test_gpu_forward_time_comes_from_cuda_events(llama_path):
    llm = LLM(llama_path, max_model_len=128, profile_steps=True, print_startup_report=False)
    _generate(llm)
    profile = llm.step_profile()
    assert profile["forward_timing"] == "cuda_events"
    _check_summary(profile)
    assert profile["gpu_forward_s"] > 0 and profile["host_fraction_of_gpu"] is not None
