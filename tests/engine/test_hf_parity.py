"""Whole-engine parity with Hugging Face transformers, fp32 on CPU.

For tiny random Llama (GQA), Qwen2 (tied embeddings) and Qwen3 models, a batch
of prompts of varied lengths (some sharing long prefixes) must produce HF's
greedy tokens exactly, with per-step log-probabilities within 1e-4, under every
engine configuration that changes *how* the work is done (block size, chunked
prefill, preemption, prefix caching, piecewise graph replays) but not *what*
is computed.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.hf_models import (
    PIECEWISE_CONFIG,
    assert_greedy_matches,
    hf_greedy,
    make_tiny_hf_model,
)
from tinyengine import LLM, SamplingParams

MAX_NEW = 10
TOL = 1e-4


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 2, 7, 16, 17, 33, 60)]
    prompts += [shared + [rng.randrange(3, 500) for _ in range(k)] for k in (1, 9, 20)]
    prompts.append(shared[:32])  # exactly two full blocks of the shared prefix
    return prompts


PROMPTS = _prompts()


def _reference(arch: str, folder) -> tuple[str, list, list]:
    path = make_tiny_hf_model(arch, folder)
    tokens, logits = hf_greedy(path, PROMPTS, MAX_NEW)
    logprobs = [[torch.log_softmax(step.float(), dim=-1) for step in seq] for seq in logits]
    return str(path), tokens, logprobs


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_and_reference(request, tmp_path_factory):
    return _reference(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llama_and_reference(tmp_path_factory):
    return _reference("llama", tmp_path_factory.mktemp("llama-triton"))


CONFIGS = {
    "default": {},
    "block16": {"block_size": 16},
    "block32": {"block_size": 32},
    "chunked": {"max_num_batched_tokens": 16},  # long prompts in chunks, mixed with decodes
    "preempt": {"num_kv_blocks": 12, "block_size": 8},  # too few blocks for the whole batch
    "no_prefix_cache": {"enable_prefix_caching": False},
    # Each step waits for its own tokens (the default overlaps them with the next step).
    "sync": {"async_scheduling": False},
    "preempt_sync": {"num_kv_blocks": 12, "block_size": 8, "async_scheduling": False},
    "piecewise": PIECEWISE_CONFIG,  # graph chains with attention run between them
}


def _run(path: str, prompts: list[list[int]] = PROMPTS, **config) -> tuple[LLM, list]:
    config.setdefault("max_model_len", 256)
    llm = LLM(path, **config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(model_and_reference, name):
    path, tokens, logprobs = model_and_reference
    llm, outs = _run(path, **CONFIGS[name])
    assert_greedy_matches(outs, tokens, logprobs)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
    if name.startswith("preempt"):
        assert stats["num_preemptions"] > 0
    if name == "chunked":
        assert stats["num_steps"] > MAX_NEW + 4  # 60-token prompt alone needs 4 chunks
    if name == "piecewise":
        assert llm.engine.runner.piecewise.backend.num_replays > 0
    if name == "default":
        # Every prompt fits the first step (CPU budget: 512 tokens), so the
        # shared-prefix prompts after the first hit the blocks it fills in
        # that very step: two 16-token blocks each, one for the 32-token one
        # (whose last token must still run).
        assert [o.num_cached_tokens for o in outs[-4:]] == [0, 32, 32, 16]
        assert stats["prefix_cache_hit_tokens"] == 80


def test_prefix_cache_hits_give_same_tokens(model_and_reference):
    path, tokens, logprobs = model_and_reference
    llm, first = _run(path)
    assert_greedy_matches(first, tokens, logprobs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_greedy_matches(again, tokens, logprobs)


def test_prefix_hits_within_one_batch_with_small_budget(model_and_reference):
    """Shared-prefix prompts admitted in later steps hit the blocks that the
    first one computed earlier in the same generate call."""
    path, tokens, logprobs = model_and_reference
    llm, outs = _run(path, max_num_batched_tokens=48, max_num_seqs=2)
    assert_greedy_matches(outs, tokens, logprobs)
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


# The same parity under the Triton kernels (on CPU they run in the Triton
# interpreter, which is slow: a few configurations, not all). Engine limits
# just above what the prompts need (11 sequences, <= 70 tokens each) keep
# the interpreter's startup forwards (profile's worst prefill, a decode
# shape run per batch size at max_model_len) short; the tokens are the same.
TRITON_LIMITS = {"max_model_len": 80, "max_num_seqs": 12, "max_num_batched_tokens": 128}
TRITON_CONFIGS = {
    "default": {},
    "chunked_preempt": {"max_num_batched_tokens": 16, "num_kv_blocks": 12, "block_size": 8},
}


@pytest.mark.parametrize("name", list(TRITON_CONFIGS))
def test_greedy_matches_hf_with_triton_kernels(llama_and_reference, name):
    """The engine configurations under the Triton kernels, on llama."""
    path, tokens, logprobs = llama_and_reference
    llm, outs = _run(path, attention_backend="triton", **{**TRITON_LIMITS, **TRITON_CONFIGS[name]})
    assert_greedy_matches(outs, tokens, logprobs)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if name == "chunked_preempt":
        assert stats["num_preemptions"] > 0


def test_qwen3_matches_hf_with_triton_kernels(tmp_path):
    """Qwen3 under the Triton kernels: its per-head q/k RMSNorm runs inside the
    fused RoPE + cache-write kernel (tinyengine/kernels/rope/triton.py). Small
    engine limits keep the interpreter's startup short; the 32-token budget
    still chunks the longer prompts and mixes them with decode rows."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(20)]
    prompts = [[5, 6, 7], [rng.randrange(3, 500) for _ in range(27)], shared, shared + [9, 10]]
    path = make_tiny_hf_model("qwen3", tmp_path / "qwen3")
    tokens, logits = hf_greedy(path, prompts, 6)
    llm = LLM(str(path), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              attention_backend="triton", print_startup_report=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        assert completion.token_ids == tokens[i], i
        for step, entries in enumerate(completion.logprobs):
            ref = torch.log_softmax(logits[i][step].float(), dim=-1)
            for token_id, lp in entries.items():
                assert abs(lp.logprob - ref[token_id].item()) <= TOL, (i, step, token_id)
