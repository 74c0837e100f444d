"""Whole-engine parity for DeepSeek-V3 and DeepSeek-V2-Lite-style tiny models,
fp32 on CPU: greedy tokens identical to HF `generate` and per-step
log-probabilities within 1e-4, under every engine configuration that changes
how the work is done (chunked prefill, preemption, prefix-cache hits, decode
"graphs") -- with both MLA paths (absorbed decode, expanded prefill, and the
two inside one mixed batch) shown to have run."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tests.hf_deepseek import hf_greedy, make_tiny_deepseek
from tests.hf_models import PIECEWISE_CONFIG, assert_greedy_matches
from tinyengine import LLM, SamplingParams
from tinyengine.models.mla import MLAAttention

MAX_NEW = 8


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 2, 7, 17, 33, 60)]
    prompts += [shared + [rng.randrange(3, 500) for _ in range(k)] for k in (1, 9, 20)]
    prompts.append(shared[:32])  # exactly two full blocks of the shared prefix
    return prompts


PROMPTS = _prompts()


@pytest.fixture(scope="module", params=["v3", "v2-lite"])
def model_and_reference(request, tmp_path_factory):
    path = make_tiny_deepseek(request.param, tmp_path_factory.mktemp(request.param))
    tokens, logits = hf_greedy(path, PROMPTS, MAX_NEW)
    logprobs = [[torch.log_softmax(step, dim=-1) for step in seq] for seq in logits]
    return str(path), tokens, logprobs


@pytest.fixture
def mla_paths(monkeypatch) -> Counter:
    """Counts which MLA paths ran: 'absorbed' and 'expanded' calls, and
    'mixed' steps that had decode rows and prefill rows together."""
    seen: Counter = Counter()
    absorbed, expanded, mixed = MLAAttention._absorbed, MLAAttention._expanded, MLAAttention._mixed

    def spy_absorbed(self, *args, **kwargs):
        seen["absorbed"] += 1
        return absorbed(self, *args, **kwargs)

    def spy_expanded(self, *args, **kwargs):
        seen["expanded"] += 1
        return expanded(self, *args, **kwargs)

    def spy_mixed(self, q_nope, q_pe, cache, ctx):
        starts = ctx.attn.query_start_loc_cpu
        q_lens = {b - a for a, b in zip(starts, starts[1:], strict=False)}
        if 1 in q_lens and any(q > 1 for q in q_lens):
            seen["mixed"] += 1
        return mixed(self, q_nope, q_pe, cache, ctx)

    monkeypatch.setattr(MLAAttention, "_absorbed", spy_absorbed)
    monkeypatch.setattr(MLAAttention, "_expanded", spy_expanded)
    monkeypatch.setattr(MLAAttention, "_mixed", spy_mixed)
    return seen


def _run(path: str, prompts: list[list[int]] = PROMPTS, **config) -> tuple[LLM, list]:
    config.setdefault("attention_backend", "torch")
    config.setdefault("max_model_len", 256)
    llm = LLM(path, print_startup_report=False, **config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


CONFIGS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 16},  # long prompts in chunks, mixed with decodes
    "preempt": {"num_kv_blocks": 12, "block_size": 8},  # too few blocks for the whole batch
    "block4_no_prefix_cache": {"block_size": 4, "enable_prefix_caching": False},
    "piecewise": PIECEWISE_CONFIG,  # graph chains with attention run between them
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(model_and_reference, mla_paths, name):
    path, tokens, logprobs = model_and_reference
    llm, outs = _run(path, **CONFIGS[name])
    assert_greedy_matches(outs, tokens, logprobs)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
    assert mla_paths["absorbed"] > 0 and mla_paths["expanded"] > 0
    if name == "chunked":
        assert mla_paths["mixed"] > 0, "no step mixed decode rows with prefill chunks"
    if name == "preempt":
        assert stats["num_preemptions"] > 0
    if name == "piecewise":
        assert llm.engine.runner.piecewise.backend.num_replays > 0


def test_prefix_cache_hits_give_same_tokens(model_and_reference):
    path, tokens, logprobs = model_and_reference
    llm, first = _run(path)
    assert_greedy_matches(first, tokens, logprobs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_greedy_matches(again, tokens, logprobs)


def test_decode_graphs_use_no_host_lengths(model_and_reference):
    """The recording graph backend replays decode steps through the graph
    context (no host lengths, max_seq_len = max_model_len): same tokens."""
    path, tokens, logprobs = model_and_reference
    llm, outs = _run(path, PROMPTS[:6], graph_backend="recording", max_num_seqs=4,
                     cuda_graph_sizes=[1, 2, 4], max_model_len=128)  # fmt: skip
    assert_greedy_matches(outs, tokens[:6], logprobs[:6])
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.backend.num_replays > 0


def test_triton_attention_backend(model_and_reference):
    """The Triton op set (under the interpreter on CPU: small shapes only)
    serves the latent cache write, the expanded prefill, MLA decode
    (tinyengine/kernels/mla/triton.py) and the fused MoE
    (tinyengine/kernels/moe/triton.py)."""
    path, tokens, logprobs = model_and_reference
    _, outs = _run(
        path, PROMPTS[2:4], attention_backend="triton", max_num_seqs=2, max_model_len=32,
        max_num_batched_tokens=32,
    )  # fmt: skip
    assert_greedy_matches(outs, tokens[2:4], logprobs[2:4])


@pytest.mark.gpu
@pytest.mark.slow
def test_v3_proxy_at_real_widths_graphs_equal_eager():
    """deepseek-v3-proxy (4 layers at V3's widths, ~30 GB, built once into the
    cache: minutes) starts through the whole state machine with graphs
    captured and the workspace locked, and greedy tokens with graphs equal
    those of an eager run."""
    import gc

    from tinyengine.tools.make_proxy import ensure_preset

    folder = ensure_preset("deepseek-v3-proxy")
    prompts = [[0, 100 + i, 2000 + 7 * i, 30 + i] * (3 + i) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        llm = LLM(folder, max_model_len=1024, max_num_seqs=16, enforce_eager=eager)
        if not eager:
            report = llm.engine.startup.report
            assert report.captured_sizes and llm.engine.runner.workspace.locked
            assert report.workspace_growth_after_kv_sizing == 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in outs]
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]
