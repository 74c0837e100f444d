"""Whole-engine parity for a tiny DeepSeek-V4 (every layer type, hash and
learned routing, hc_mult 2), fp32 on CPU: greedy tokens identical to HF
`generate` and per-step log-probabilities within 1e-4, with prompts and
generations that cross many sliding-window (8) and compression (4 and 8)
boundaries, under every engine configuration that changes how the work is
done: chunks that end anywhere, preemption by recompute, prefix-cache hits,
no prefix cache, other block sizes, asynchronous scheduling, the Triton op
set. Every run ends with every block free."""

from __future__ import annotations

import random

import pytest
import torch

from tests.hf_deepseek import hf_greedy
from tests.hf_deepseek_v4 import make_tiny_v4
from tests.hf_models import PIECEWISE_CONFIG, assert_greedy_matches
from tinyengine import LLM, SamplingParams

MAX_NEW = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 3, 7, 17, 33, 61)]
    prompts += [shared + [rng.randrange(3, 500) for _ in range(k)] for k in (1, 9, 22)]
    prompts.append(shared[:32])  # exactly two full 16-token blocks of the shared prefix
    return prompts


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    path = make_tiny_v4(tmp_path_factory.mktemp("v4"))
    tokens, logits = hf_greedy(path, PROMPTS, MAX_NEW)
    logprobs = [[torch.log_softmax(step, dim=-1) for step in seq] for seq in logits]
    return str(path), tokens, logprobs


def _run(path: str, max_tokens: int = MAX_NEW, **config) -> tuple[LLM, list]:
    config.setdefault("max_model_len", 128)
    llm = LLM(path, print_startup_report=False, **config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, outs


def _assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
    assert stats["num_running"] == stats["num_waiting"] == 0
    groups = stats["cache_groups"]
    assert set(groups) == {"full", "sliding"}
    for name, group in groups.items():
        assert group["free_blocks"] == group["total_blocks"], f"{name} blocks leaked"


TRITON_NEW = 8
CONFIGS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 7},  # chunk ends at every offset mod 4 and 8
    "preempt": {"num_kv_blocks": 14, "block_size": 8, "max_model_len": 80},
    "block4_no_prefix_cache": {"block_size": 4, "enable_prefix_caching": False},
    "block32": {"block_size": 32},  # above both ratios: several entries per block
    "async": {"async_scheduling": True, "max_num_seqs": 3},
    # The Triton op set (the interpreter on CPU): V4's sparse attention,
    # indexer, compressor and mHC kernels; profile also runs every
    # graph-shaped decode size. A 64-token budget keeps the interpreter's
    # worst-case prefills (profile, warmup) short and chunks the prompts.
    # Its runs are the slowest of all (a few seconds an interpreted step), so
    # it generates TRITON_NEW tokens, the first of HF's MAX_NEW: any 8
    # consecutive positions still close a window of both ratios in decode.
    "triton": {"attention_backend": "triton", "max_num_seqs": 4, "max_num_batched_tokens": 64},
    "piecewise": PIECEWISE_CONFIG,  # graph chains with attention run between them
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(model_and_reference, name):
    path, tokens, logprobs = model_and_reference
    new = TRITON_NEW if name == "triton" else MAX_NEW
    llm, outs = _run(path, max_tokens=new, **CONFIGS[name])
    assert_greedy_matches(outs, [t[:new] for t in tokens], logprobs)
    _assert_idle(llm)
    if name == "preempt":
        assert llm.stats()["num_preemptions"] > 0
    if name == "piecewise":
        assert llm.engine.runner.piecewise.backend.num_replays > 0


def test_prefix_cache_hits_restore_every_kind_of_state(model_and_reference):
    """A second round hits the first round's blocks: the raw window, the
    compressor's per-token state, compressed entries and indexer keys of the
    cached prefix are what recomputing them would give."""
    path, tokens, logprobs = model_and_reference
    llm, first = _run(path, block_size=8)
    assert_greedy_matches(first, tokens, logprobs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) >= 200
    assert_greedy_matches(again, tokens, logprobs)
    _assert_idle(llm)


def test_decode_graphs_run_the_device_only_paths(model_and_reference):
    """The recording graph backend replays decode steps through the graph
    context (no host lengths, every entry max_model_len allows gathered at a
    fixed size, completed windows' entries written, the others to the spare
    rows): same tokens and log-probabilities as HF."""
    path, tokens, logprobs = model_and_reference
    llm, outs = _run(path, graph_backend="recording", max_num_seqs=4, cuda_graph_sizes=[1, 2, 4])
    assert_greedy_matches(outs, tokens, logprobs)
    assert llm.startup_report().captured_sizes == [1, 2, 4]
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.backend.num_replays > 20
    _assert_idle(llm)


def test_the_sliding_group_holds_only_the_window(model_and_reference):
    """Raw KV and compressor state are a sliding cache group: while one long
    request runs, its sliding blocks stay within the kept span (window - 1 =
    7 positions: at most 2 blocks of 4 between steps, a few more while a
    chunk is written) as the full-history group grows with the context."""
    path, tokens, logprobs = model_and_reference
    llm = LLM(path, print_startup_report=False, max_model_len=160, block_size=4,
              max_num_batched_tokens=32)  # fmt: skip
    assert llm.engine.runner.keep == 7
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompt = PROMPTS[5]  # 61 tokens: two chunks, then decode
    engine.add_request({"prompt_token_ids": prompt}, params, request_id="long")
    sliding_used, full_used, out = [], [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        groups = engine.stats()["cache_groups"]
        sliding_used.append(groups["sliding"]["total_blocks"] - groups["sliding"]["free_blocks"])
        full_used.append(groups["full"]["total_blocks"] - groups["full"]["free_blocks"])
    assert out.outputs[0].token_ids == tokens[5]
    assert max(full_used[:-1]) == -(-(len(prompt) + MAX_NEW - 1) // 4)  # the whole history
    assert max(sliding_used[2:-1]) <= 3  # decode: the kept span's blocks and the next
    assert max(sliding_used) <= 3 + 32 // 4  # a chunk's blocks before it is released
    _assert_idle(llm)


def test_warmup_names_the_moe_size_classes(model_and_reference):
    # V4's MoE picks its fused-MoE tiles by token count as V3's does, so the
    # model names one count per size class for the GPU warmup to run.
    from tinyengine.kernels.moe.tiles import moe_token_classes

    llm = LLM(model_and_reference[0], max_model_len=128, print_startup_report=False)
    model = llm.engine.runner.model
    moe = model.args.moe
    counts = model.warmup_token_counts(4096)
    assert counts == moe_token_classes(4096, moe.top_k, moe.num_experts)
    assert len(counts) > 1 and counts[0] == 1 and counts[-1] <= 4096


def _greedy_matches_hf_alone(path, prompts) -> LLM:
    tokens, logits = hf_greedy(path, prompts, MAX_NEW)
    logprobs = [[torch.log_softmax(step, dim=-1) for step in seq] for seq in logits]
    llm = LLM(str(path), print_startup_report=False, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_matches(outs, tokens, logprobs)
    _assert_idle(llm)
    return llm


def test_sliding_layers_only_start_with_default_sizing(tmp_path):
    """Every layer sliding: the full-history group holds no bytes a block, so
    KV sizing gives it the blocks every sequence could use (it divided by
    zero before) and the tokens are HF's."""
    layers = ["sliding_attention"] * 2
    path = make_tiny_v4(tmp_path, num_hidden_layers=2, layer_types=layers)
    llm = _greedy_matches_hf_alone(path, PROMPTS[:4])
    assert llm.stats()["num_total_blocks"] >= llm.engine.runner.max_blocks_per_seq


def test_one_shared_expert_whatever_n_shared_experts_says(tmp_path):
    """transformers' V4 builds one shared expert of moe_intermediate_size
    whatever n_shared_experts is; its checkpoints load and match."""
    path = make_tiny_v4(tmp_path, n_shared_experts=2)
    _greedy_matches_hf_alone(path, PROMPTS[:3])
