"""The sampler's draw inside the decode graph (ModelRunner.decode_step,
Sampler.stage_graph_draw).

A decode graph runs the whole step: model, LM head over every row, and the
op set's draw over inverse temperatures and seeds the sampler stages before
the replay. These tests pin what that may and may not change:
  * the tokens and logprobs equal those of the same engine whose sampler runs
    eagerly on the graph's logits (stage_graph_draw refused), step for step,
    greedy, unseeded and seeded rows mixed in one padded batch;
  * the graph's draw serves exactly the fast-path batches: a batch with a
    filter, a penalty or a banned token (min_tokens) takes the eager sampler.

On a CPU the op sets have no draw op (the torch sampler is the CPU's), so the
CPU tests give the torch op set the draw's torch reference
(kernels/sampling/reference.py, the kernel's bit-exact definition) and record
graphs; the GPU test runs real CUDA graphs with the Triton draw.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.kernels.sampling.reference import gumbel_argmax_torch
from tinyengine.worker.sampler import Sampler

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"), num_hidden_layers=2))


PROMPTS = [[5 + (7 * i + 3 * j) % 400 for j in range(6 + 3 * i)] for i in range(5)]
MIXED = [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.6, seed=5, max_tokens=10, ignore_eos=True),
]


def _with_draw(monkeypatch) -> None:
    """The CPU's op sets, given the draw's torch reference as their draw op."""
    import tinyengine.worker.runner as runner_module

    choose = runner_module.choose_ops

    def choose_with_draw(*args, **kwargs):
        return dataclasses.replace(choose(*args, **kwargs), sample_draw=gumbel_argmax_torch)

    monkeypatch.setattr(runner_module, "choose_ops", choose_with_draw)


def _count_draws(llm: LLM) -> dict[str, int]:
    """Per-step counts: steps the graph's draw served, steps the eager sampler did."""
    sampler = llm.engine.runner.sampler
    counts = {"graph": 0, "eager": 0}
    finish, sample = sampler.finish, sampler.sample

    def counted_finish(*args, **kwargs):
        counts["graph"] += 1
        return finish(*args, **kwargs)

    def counted_sample(*args, **kwargs):
        counts["eager"] += 1
        return sample(*args, **kwargs)

    sampler.finish, sampler.sample = counted_finish, counted_sample
    return counts


def _run(path: str, params, *, graph_draw: bool, monkeypatch, **config):
    llm = LLM(path, max_model_len=128, max_num_seqs=8, print_startup_report=False, **config)
    if not graph_draw:  # the same engine, its sampler eager on the graph's logits
        monkeypatch.setattr(llm.engine.runner.sampler, "stage_graph_draw", lambda *a: False)
    counts = _count_draws(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[: len(params)]], params)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [
        [{t: lp.logprob for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])]
        for o in outs
    ]
    return tokens, logprobs, counts


def test_graph_draw_equals_eager_sampler_on_graph_logits(qwen3_path, monkeypatch):
    _with_draw(monkeypatch)
    common = dict(graph_backend="recording", attention_backend="torch", seed=3)
    tokens, logprobs, counts = _run(qwen3_path, MIXED, graph_draw=True, monkeypatch=monkeypatch,
                                    **common)  # fmt: skip
    eager_tokens, eager_logprobs, eager_counts = _run(
        qwen3_path, MIXED, graph_draw=False, monkeypatch=monkeypatch, **common
    )
    assert tokens == eager_tokens
    assert logprobs == eager_logprobs
    # 9 decode steps after the prefill, five rows padded to the 8-row graph.
    assert counts["graph"] == 9 and eager_counts["graph"] == 0
    assert all(len(t) == p.max_tokens for t, p in zip(tokens, MIXED, strict=True))


@pytest.mark.parametrize(
    "odd_one",
    [
        SamplingParams(temperature=0.9, top_k=5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=10, max_tokens=10, stop_token_ids=[7]),
    ],
    ids=["top_k", "top_p", "penalty", "min_tokens"],
)
def test_graph_draw_leaves_other_batches_to_the_eager_sampler(qwen3_path, monkeypatch, odd_one):
    """One row with a filter, a penalty or banned tokens sends its batch's
    steps to the eager sampler; the tokens are the eager sampler's."""
    _with_draw(monkeypatch)
    params = [*MIXED[:3], odd_one]
    common = dict(graph_backend="recording", attention_backend="torch", seed=3)
    tokens, _, counts = _run(qwen3_path, params, graph_draw=True, monkeypatch=monkeypatch,
                             **common)  # fmt: skip
    eager_tokens, _, _ = _run(qwen3_path, params, graph_draw=False, monkeypatch=monkeypatch,
                              **common)  # fmt: skip
    assert counts["graph"] == 0 and counts["eager"] == 10
    assert tokens == eager_tokens


def test_stage_graph_draw_writes_rows_and_padding():
    """The staged inputs: 1/temperature per sampled row, 0 for greedy and
    padding rows; seeds as the eager fast path draws them (one seeded row's
    from its own generator, unseeded rows' from the sampler's)."""
    sampler = Sampler("cpu", seed=7, draw=gumbel_argmax_torch)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=2),
              SamplingParams(temperature=2.0)]  # fmt: skip
    inv_t = torch.full((6,), 9.0)
    seeds = torch.full((6,), -1, dtype=torch.int64)
    generators = [None, sampler.new_generator(2), None]
    assert sampler.stage_graph_draw(params, generators, [[], [], []], 50, inv_t, seeds)
    assert inv_t.tolist() == [0.0, 2.0, 0.5, 0.0, 0.0, 0.0]
    twin = Sampler("cpu", seed=7, draw=gumbel_argmax_torch)
    expected = twin.seeds([None, twin.new_generator(2), None], [True, False, False])
    assert seeds[1:3].tolist() == expected[1:3].tolist()
    assert seeds[3:].tolist() == [-1, -1, -1]  # past the batch: never written
    assert not sampler.stage_graph_draw(params, generators, [[], [4], []], 50, inv_t, seeds)
    top_k = [SamplingParams(temperature=1.0, top_k=3)]
    assert not sampler.stage_graph_draw(top_k, [None], [[]], 50, inv_t, seeds)
    assert not Sampler("cpu").stage_graph_draw(params, generators, [[]] * 3, 50, inv_t, seeds)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu)")
def test_gpu_graph_draw_equals_eager_sampler_on_graph_logits(qwen3_path, monkeypatch):
    """Real CUDA graphs, the Triton draw captured in them."""
    common = dict(attention_backend="triton", seed=3)
    tokens, logprobs, counts = _run(qwen3_path, MIXED, graph_draw=True, monkeypatch=monkeypatch,
                                    **common)  # fmt: skip
    eager_tokens, eager_logprobs, _ = _run(
        qwen3_path, MIXED, graph_draw=False, monkeypatch=monkeypatch, **common
    )
    assert counts["graph"] == 9
    assert tokens == eager_tokens
    assert logprobs == eager_logprobs
