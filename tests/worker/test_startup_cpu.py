"""Startup on CPU with the torch op set (a "light" startup, worker/warmup.py):
it does only the work that protects something there, and stays fast.

- Warmup runs no would-be-captured decode size (nothing compiles; profile
  already sized the arena for them) and sends one small workload through the
  real scheduler and runner: one prefill step and one decode step.
- Profile skips the worst-case prefill (its activation peak is unused on CPU)
  but still runs the arena's worst request, so a step at max_model_len context
  after READY grows nothing, and a larger request still raises
  WorkspaceLockedError.
- The Triton op set on CPU (the interpreter) keeps the full startup.
- SmolLM2-135M with real weights reaches READY within a generous bound,
  read from the startup report.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from tests.hf_deepseek import make_tiny_deepseek
from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.kernels.workspace import WorkspaceLockedError
from tinyengine.worker.runner import ModelRunner

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              print_startup_report=False)  # fmt: skip
# Generous: ~2 s on an idle 2-core machine, ~14 s with a neighbour busy on one
# of the two cores (docs/startup.md).
READY_BOUND_S = 60.0


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=2))


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory) -> str:
    return str(make_tiny_deepseek("v3", tmp_path_factory.mktemp("deepseek")))


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts (workspace stage, what) of the runner's startup-relevant calls:
    'decode_shape' (run_decode_shape), 'launch' (a real scheduled step),
    'forward:<tokens>x<rows>' (dummy_forward)."""
    seen: Counter = Counter()
    decode_shape, launch, dummy = (
        ModelRunner.run_decode_shape, ModelRunner.launch, ModelRunner.dummy_forward,
    )  # fmt: skip

    def spy_decode_shape(self, size):
        seen[(self.workspace.stage, "decode_shape")] += 1
        return decode_shape(self, size)

    def spy_launch(self, plan):
        seen[(self.workspace.stage, "launch")] += 1
        return launch(self, plan)

    def spy_dummy(self, q_lens, seq_lens=None):
        seen[(self.workspace.stage, f"forward:{sum(q_lens)}x{len(q_lens)}")] += 1
        return dummy(self, q_lens, seq_lens)

    monkeypatch.setattr(ModelRunner, "run_decode_shape", spy_decode_shape)
    monkeypatch.setattr(ModelRunner, "launch", spy_launch)
    monkeypatch.setattr(ModelRunner, "dummy_forward", spy_dummy)
    return seen


def _in(seen: Counter, stage: str) -> dict[str, int]:
    return {what: n for (where, what), n in seen.items() if where == stage}


@pytest.mark.parametrize("backend", ["auto", "recording"])
def test_cpu_warmup_runs_no_capture_size(llama_path, calls, backend):
    llm = LLM(llama_path, **ENGINE, graph_backend=backend)
    report = llm.startup_report()
    assert report.state == "ready"
    runner = llm.engine.runner
    assert runner.device.type == "cpu" and runner.ops.name == "torch"
    sizes = [1, 2, 4] if backend == "recording" else []
    assert report.captured_sizes == sizes

    warmup = _in(calls, "warmup")
    assert "decode_shape" not in warmup, warmup  # no would-be-captured size runs
    assert warmup == {"launch": 2}, warmup  # one prefill step, one decode step

    # Profile: the arena's worst eager request (max_num_seqs decode rows, one
    # at max_model_len), not the max_num_batched_tokens prefill, plus each
    # size capture will record (the arena must hold them before the lock).
    profile = _in(calls, "profile")
    assert profile.pop(f"forward:{ENGINE['max_num_seqs']}x{ENGINE['max_num_seqs']}") == 1
    assert profile == ({"decode_shape": len(sizes)} if sizes else {}), profile
    # Capture itself grew nothing.
    assert report.workspace_growth_after_kv_sizing == 0
    assert {g.stage for g in runner.workspace.stats.growths} == {"profile"}


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_light_profile_still_sizes_the_arena(llama_path, deepseek_path, model):
    """After a light startup the arena holds every eager step up to
    max_model_len context (the reference attention's one gathered context,
    MLA's rows x longest context), and growth after the lock still raises."""
    path = llama_path if model == "llama" else deepseek_path
    llm = LLM(path, **ENGINE)
    ws = llm.engine.runner.workspace
    assert ws.locked
    size, growths = ws.size, ws.stats.num_growths
    longest = ENGINE["max_model_len"] - 2
    prompts = [list(range(3, 3 + longest)), [5, 6, 7], [8] * 30, [9] * 70]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 4
    assert ws.size == size and ws.stats.num_growths == growths
    with pytest.raises(WorkspaceLockedError, match="workspace is locked"):
        ws.get(((size + 1,), torch.uint8))


def test_triton_on_cpu_keeps_the_full_startup(llama_path, calls):
    """The interpreter's Triton kernels compile per shape class: profile still
    runs the largest prefill and every capture size (once: warmup, which
    would compile nothing new, does not repeat them)."""
    llm = LLM(llama_path, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16,
              attention_backend="triton", graph_backend="recording", cuda_graph_sizes=[1, 2],
              print_startup_report=False)  # fmt: skip
    assert llm.startup_report().state == "ready"
    assert _in(calls, "profile")["decode_shape"] == 2
    assert "decode_shape" not in _in(calls, "warmup")
    assert _in(calls, "profile").get("forward:16x1") == 1


@pytest.mark.parametrize("eager", [False, True])
def test_triton_profile_runs_each_decode_size_a_step_can_have(llama_path, monkeypatch, eager):
    """A decode batch that a graph fits is padded to that graph's size, so
    profile runs the captured sizes and every size above the largest (each
    eager batch runs at its own size); with nothing captured, every size.
    Afterwards an eager batch above the largest graph grows nothing."""
    sizes: list[int] = []
    run_decode_shape = ModelRunner.run_decode_shape

    def spy(self, size):
        if self.workspace.stage == "profile":
            sizes.append(size)
        return run_decode_shape(self, size)

    monkeypatch.setattr(ModelRunner, "run_decode_shape", spy)
    llm = LLM(llama_path, max_model_len=32, max_num_seqs=5, max_num_batched_tokens=16,
              attention_backend="triton", graph_backend="recording", cuda_graph_sizes=[1, 3],
              enforce_eager=eager, print_startup_report=False)  # fmt: skip
    assert llm.startup_report().captured_sizes == ([] if eager else [1, 3])
    assert sorted(sizes) == ([1, 2, 3, 4, 5] if eager else [1, 3, 4, 5])
    ws = llm.engine.runner.workspace
    size = ws.size
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [3 + i] * 20} for i in range(5)], params,
                        use_tqdm=False)  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 5
    assert ws.size == size


def test_warmup_runs_every_piecewise_shape_before_any_capture(llama_path, monkeypatch):
    """A full startup (Triton ops on CPU): profile runs the largest piecewise
    step, warmup every one, and only then does capture record any graph."""
    from tinyengine.worker import stages, warmup
    from tinyengine.worker.piecewise_graphs import PiecewiseGraphs

    events: list[str] = []
    run_shape, capture = warmup.run_piecewise_shape, PiecewiseGraphs.capture

    def spy_run(where):
        def run(runner, size, **kwargs):
            events.append(f"{where}:{size}")
            return run_shape(runner, size, **kwargs)

        return run

    def spy_capture(self, size, ctx, step):
        events.append(f"capture:{size}")
        return capture(self, size, ctx, step)

    monkeypatch.setattr(stages, "run_piecewise_shape", spy_run("profile"))
    monkeypatch.setattr(warmup, "run_piecewise_shape", spy_run("warmup"))
    monkeypatch.setattr(PiecewiseGraphs, "capture", spy_capture)
    llm = LLM(llama_path, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16,
              attention_backend="triton", graph_backend="recording", cuda_graph_sizes=[1, 2],
              cudagraph_mode="full_and_piecewise", piecewise_graph_sizes=[8, 16],
              print_startup_report=False)  # fmt: skip
    assert events == ["profile:16", "warmup:8", "warmup:16", "capture:16", "capture:8"]
    report = llm.startup_report()
    assert report.piecewise_sizes == [8, 16] and report.workspace_growth_after_kv_sizing == 0


@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only"])
def test_warmup_leaves_a_prefill_length_to_its_piecewise_shape(llama_path, calls, mode):
    """Warmup's one-sequence prefill per power-of-two length (2, 4, 8, 16
    here) skips the lengths a piecewise shape runs as the same forward; with
    no piecewise graphs it runs them all."""
    from tinyengine.worker import warmup

    pieces: list[int] = []
    run_shape = warmup.run_piecewise_shape

    def spy(runner, size, **kwargs):
        pieces.append(size)
        return run_shape(runner, size, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warmup, "run_piecewise_shape", spy)
        LLM(llama_path, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16,
            attention_backend="triton", graph_backend="recording", cuda_graph_sizes=[1, 2],
            cudagraph_mode=mode, piecewise_graph_sizes=[8, 16],
            print_startup_report=False)  # fmt: skip
    prefills = {what for what in _in(calls, "warmup") if what.endswith("x1")}
    if mode == "full_and_piecewise":
        assert pieces == [8, 16]
        assert prefills == {"forward:2x1", "forward:4x1"}
    else:
        assert pieces == []
        assert prefills == {"forward:2x1", "forward:4x1", "forward:8x1", "forward:16x1"}


def test_smollm2_ready_within_bound_on_cpu(smollm2_path, caplog):
    """`LLM(smollm2)` with its defaults (max_model_len 8192, 16 sequences,
    a 512-token step budget) on CPU: READY within READY_BOUND_S, and every
    stage announced as it began and ended."""
    caplog.set_level(logging.INFO, logger="tinyengine.startup")
    llm = LLM(smollm2_path, print_startup_report=False)
    report = llm.startup_report()
    assert report.state == "ready"
    seconds = {s.name: round(s.seconds, 2) for s in report.stages}
    assert sum(seconds.values()) <= READY_BOUND_S, seconds
    messages = [r.getMessage() for r in caplog.records if r.name == "tinyengine.startup"]
    assert len(messages) == 12 and "READY after" in messages[-1], messages
